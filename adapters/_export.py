"""Incremental export of the event log to NDJSON and Parquet, driven by the change feed.

Each run writes the changes since the previous run into new part files of an output
directory. A part is committed by one atomic rename, and its positions sidecar (the feed id
reached in every partition) is renamed into place before it; a run's starting positions are
those of the newest committed part. So a crash at any moment leaves either the whole part or
none of it — never duplicates, never holes — and the next run picks up where the last
committed part ends. The exporter also advances a consumer group per partition after each
commit, so feed trimming never removes changes it has not exported.

Rows are flat: namespace, thread, seq, id, type, time, turn, parent turn, outcome, model tier,
token usage, and the payload as JSON. Deleted threads arrive as ``thread.deleted`` tombstones.

A run is three stages joined by one-slot queues, so each overlaps the others: reading (feed
entries, then the log ranges they name — on standalone Redis as one pipeline of raw
``XRANGE`` replies per chunk), decoding (column by column, no per-row objects), and writing
(in a worker thread: pyarrow encodes and compresses without holding the GIL). Memory stays
bounded whatever the log's size: a chunk holds at most `CHUNK_EVENTS` events (or one append,
when an append is larger), and at most two chunks wait between the stages.
"""

from __future__ import annotations

import gc
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from itertools import repeat
from operator import itemgetter
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.to_thread
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from redis import exceptions as rex
from redis.asyncio.client import Pipeline, Redis

from eventstore import (
    CorruptEventError,
    EventStore,
    FeedEntry,
    InvalidInputError,
    RedisEventStore,
    translate_redis_error,
    validate_view_name,
)
from eventstore._codec import seq_of_entry_id

Format = Literal["ndjson", "parquet"]
COLUMNS = (
    "namespace",
    "thread",
    "seq",
    "id",
    "type",
    "time_ms",
    "turn",
    "parent_turn",
    "outcome",
    "model_tier",
    "input_tokens",
    "output_tokens",
    "payload",
)
CHUNK_EVENTS = 8192
"""Events decoded and written at a time: what bounds an export's memory."""
PAGE = 4096
"""Log entries per ``XRANGE``."""

_PART_RE = re.compile(r"^part-(\d{8})\.(ndjson|parquet)$")
_json = msgspec.json.Encoder()
_any_msgpack = msgspec.msgpack.Decoder()
_entry_values = itemgetter(b"i", b"s", b"d", b"m")
_FIELD_NAMES = (b"i", b"v", b"s", b"d", b"m", b"h")  # the order the append script writes
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_ULID_PAIRS = [a + b for a in _CROCKFORD for b in _CROCKFORD]  # 10 bits -> two characters
_ULID_TRIPLES = [a + b for a in _ULID_PAIRS for b in _CROCKFORD]  # 15 bits -> three
_DICTIONARY_COLUMNS = ["namespace", "thread", "type", "outcome", "model_tier"]


class ExportResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one export run wrote."""

    files: list[str]
    events: int
    tombstones: int
    positions: dict[int, str]


def _ulid_text(raw: bytes) -> str:
    """``str(ULID.from_bytes(raw))`` without building a ULID: 26 Crockford digits of 128 bits.

    Two digits, then eight groups of three (the 130 bits of 26 digits, two of them leading
    zeros): nine lookups where python-ulid takes a loop of 26.
    """
    n = int.from_bytes(raw, "big")
    p = _ULID_TRIPLES
    return (
        _ULID_PAIRS[n >> 120] + p[(n >> 105) & 32767] + p[(n >> 90) & 32767]
        + p[(n >> 75) & 32767] + p[(n >> 60) & 32767] + p[(n >> 45) & 32767]
        + p[(n >> 30) & 32767] + p[(n >> 15) & 32767] + p[n & 32767]
    )  # fmt: skip


class _Rows:
    """Export rows column by column (the namespace column is implied)."""

    __slots__ = (
        "id",
        "input_tokens",
        "model_tier",
        "outcome",
        "output_tokens",
        "parent_turn",
        "payload",
        "seq",
        "thread",
        "time_ms",
        "tombstones",
        "turn",
        "type",
    )

    def __init__(self) -> None:
        self.thread: list[str] = []
        self.seq: list[int] = []
        self.id: list[str] = []
        self.type: list[Any] = []
        self.time_ms: list[int] = []
        self.turn: list[Any] = []
        self.parent_turn: list[Any] = []
        self.outcome: list[Any] = []
        self.model_tier: list[Any] = []
        self.input_tokens: list[Any] = []
        self.output_tokens: list[Any] = []
        self.payload: list[bytes] = []  # JSON
        self.tombstones = 0

    def __len__(self) -> int:
        return len(self.seq)

    def columns(self, namespace: str) -> list[list[Any]]:
        """Every column, in `COLUMNS` order."""
        return [
            [namespace] * len(self.seq), self.thread, self.seq, self.id, self.type, self.time_ms,
            self.turn, self.parent_turn, self.outcome, self.model_tier, self.input_tokens,
            self.output_tokens, self.payload,
        ]  # fmt: skip

    def add_events(
        self,
        thread: str,
        seqs: Sequence[int],
        ids: Sequence[bytes],
        times: Sequence[int],
        payloads: Sequence[dict[str, Any]],
        metas: Sequence[Any],
        since_ms: int | None,
    ) -> None:
        """Add decoded events of one thread (``payloads`` must all be maps)."""
        if since_ms is not None:
            keep = [i for i, t in enumerate(times) if t >= since_ms]
            if len(keep) < len(times):
                seqs, ids, times = (
                    [seqs[i] for i in keep],
                    [ids[i] for i in keep],
                    [times[i] for i in keep],
                )
                payloads, metas = [payloads[i] for i in keep], [metas[i] for i in keep]
        self.thread += repeat(thread, len(seqs))
        self.seq += seqs
        self.id += map(_ulid_text, ids)
        self.time_ms += times
        self.payload += map(_json.encode, payloads)
        types, turns, parents = self.type, self.turn, self.parent_turn
        outcomes, tiers, inputs, outputs = (
            self.outcome, self.model_tier, self.input_tokens, self.output_tokens
        )  # fmt: skip
        for payload, meta in zip(payloads, metas, strict=True):
            get = payload.get
            types.append(get("type"))
            turn = get("turn_id")
            if not turn and meta.__class__ is dict:
                turn = meta.get("t")
            turns.append(turn or None)
            parents.append(get("parent_turn_id"))
            outcomes.append(get("outcome"))
            tiers.append(get("model_tier"))
            usage = get("usage")
            if usage.__class__ is dict and usage:
                inputs.append(usage.get("input_tokens"))
                outputs.append(usage.get("output_tokens"))
            else:
                inputs.append(None)
                outputs.append(None)

    def add_tombstone(self, entry: FeedEntry) -> None:
        self.tombstones += 1
        self.thread.append(entry.thread_id)
        self.seq.append(entry.last_seq)
        self.id.append(entry.id)
        self.type.append("thread.deleted")
        self.time_ms.append(entry.time_ms)
        for column in (
            self.turn, self.parent_turn, self.outcome, self.model_tier, self.input_tokens,
            self.output_tokens,
        ):  # fmt: skip
            column.append(None)
        payload = json.dumps({"type": "thread.deleted", "version": entry.last_seq})
        self.payload.append(payload.encode("utf-8"))


def _decode_page(rows: _Rows, thread: str, lo: int, entries: list[Any], since: int | None) -> None:
    """Decode the log entries of one ``XRANGE`` from seq ``lo`` into ``rows``.

    Entries come as redis-py parses them (``(id, {field: value})``) or as raw RESP arrays
    (``[id, [field, value, ...]]``). The fast path checks and decodes whole columns at once;
    anything unusual (a hole, a foreign entry id, a damaged field) takes the careful path,
    which names the thread and seq of the first damage.
    """
    n = len(entries)
    if not n:
        return
    try:
        ids_, *fields = zip(*entries, strict=True)
        if ids_ != tuple(map(b"%d-0".__mod__, range(lo, lo + n))):
            raise ValueError("not consecutive")
        first = fields[0][0]
        if first.__class__ is dict:
            ids, times, datas, metas = zip(*map(_entry_values, fields[0]), strict=True)
        else:
            flat = list(zip(*fields[0], strict=True))
            names = flat[0::2]
            if any(c.count(name) != n for c, name in zip(names, _FIELD_NAMES, strict=True)):
                raise ValueError("unusual layout")
            ids, times, datas, metas = flat[1], flat[5], flat[7], flat[9]
        if set(map(len, ids)) != {16}:
            raise ValueError("id length")
        time_ms = list(map(int, times))
        payloads = list(map(_any_msgpack.decode, datas))
        if any(p.__class__ is not dict for p in payloads):
            raise ValueError("payload is not a map")
        decoded_metas = [_any_msgpack.decode(m) if m else None for m in metas]
    except (ValueError, TypeError, KeyError, IndexError, msgspec.DecodeError):
        _decode_carefully(rows, thread, entries, since)
        return
    rows.add_events(thread, range(lo, lo + n), ids, time_ms, payloads, decoded_metas, since)


def _decode_carefully(rows: _Rows, thread: str, entries: list[Any], since: int | None) -> None:
    for entry_id, raw in entries:
        seq = seq_of_entry_id(thread, entry_id)
        if isinstance(raw, list):
            raw = dict(zip(raw[0::2], raw[1::2], strict=False))
        try:
            payload = _any_msgpack.decode(raw[b"d"])
            meta = _any_msgpack.decode(raw[b"m"]) if raw[b"m"] else None
            event_id = raw[b"i"]
            if len(event_id) != 16:
                raise ValueError("the event id is not 16 bytes")
            time_ms = int(raw[b"s"])
        except KeyError as exc:
            raise CorruptEventError(
                thread, seq, f"cannot export: no field {exc.args[0]!r}"
            ) from None
        except (ValueError, TypeError, msgspec.DecodeError) as exc:
            raise CorruptEventError(thread, seq, f"cannot export: {exc}") from None
        if not isinstance(payload, dict):
            raise CorruptEventError(thread, seq, "cannot export: payload is not a map")
        rows.add_events(thread, [seq], [event_id], [time_ms], [payload], [meta], since)


class _Chunk:
    """A run of feed entries of one partition and the log entries they name."""

    __slots__ = ("entries", "last_id", "pages", "partition")

    def __init__(self, partition: int, entries: list[FeedEntry]) -> None:
        self.partition = partition
        self.entries = entries
        self.last_id = entries[-1].id
        self.pages: list[tuple[str, int, list[Any]]] = []  # thread, first seq, entries


class _Decoded:
    __slots__ = ("last_id", "partition", "rows")

    def __init__(self, chunk: _Chunk, rows: _Rows) -> None:
        self.partition = chunk.partition
        self.last_id = chunk.last_id
        self.rows = rows


def _chunks(entries: list[FeedEntry], budget: int) -> Iterable[list[FeedEntry]]:
    """Split feed entries into runs of at most ``budget`` events (an entry is never split).

    A tombstone is a run of its own, so a thread's rows never move across its deletion (its
    ranges before and after one are never merged into one read).
    """
    run: list[FeedEntry] = []
    size = 0
    for e in entries:
        events = 0 if e.deleted else e.last_seq - e.first_seq + 1
        if run and (e.deleted or size + events > budget):
            yield run
            run, size = [], 0
        if e.deleted:
            yield [e]
            continue
        run.append(e)
        size += events
    if run:
        yield run


def _pages(entries: list[FeedEntry]) -> list[tuple[str, int, int]]:
    """The log ranges (thread, first seq, last seq) the entries name, merged, in pages."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for e in entries:
        spans.setdefault(e.thread_id, []).append((e.first_seq, e.last_seq))
    out: list[tuple[str, int, int]] = []
    for thread, ranges in spans.items():
        ranges.sort()
        merged = [list(ranges[0])]
        for lo, hi in ranges[1:]:
            if lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        for lo, hi in merged:
            out += [(thread, s, min(hi, s + PAGE - 1)) for s in range(lo, hi + 1, PAGE)]
    return out


class _PartWriter:
    """Writes one part file under a temporary name; `commit` renames it into place."""

    def __init__(self, directory: Path, number: int, fmt: Format, namespace: str) -> None:
        self.final = directory / f"part-{number:08d}.{fmt}"
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{self.final.name}.", suffix=".tmp")
        os.close(fd)
        self.tmp = Path(tmp)
        self.fmt = fmt
        self.namespace = namespace
        self.rows = 0
        self._ndjson = open(self.tmp, "wb") if fmt == "ndjson" else None  # noqa: SIM115
        self._parquet: Any = None

    def write(self, rows: _Rows) -> None:
        if not len(rows):
            return
        self.rows += len(rows)
        columns = rows.columns(self.namespace)
        if self._ndjson is not None:
            columns[-1] = [p.decode("utf-8") for p in columns[-1]]
            self._ndjson.write(_json.encode_lines(list(map(_NdjsonRow, *columns))))
            return
        import pyarrow as pa

        schema = _parquet_schema()
        arrays = [pa.array(c, type=f.type) for c, f in zip(columns, schema, strict=True)]
        batch = pa.RecordBatch.from_arrays(arrays, schema=schema)
        if self._parquet is None:
            self._parquet = _parquet_writer(self.tmp, schema)
        self._parquet.write_batch(batch)

    def commit(self, positions: dict[int, str]) -> Path:
        if self._ndjson is not None:
            self._ndjson.flush()
            os.fsync(self._ndjson.fileno())
            self._ndjson.close()
        elif self._parquet is None:
            self.write_empty()
        if self._parquet is not None:
            self._parquet.close()
        sidecar = self.final.with_suffix(".positions.json")
        _atomic_write(sidecar, json.dumps({str(k): v for k, v in positions.items()}).encode())
        with open(self.tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.final)
        _fsync_dir(self.final.parent)
        return self.final

    def write_empty(self) -> None:
        import pyarrow as pa

        self._parquet = _parquet_writer(self.tmp, _parquet_schema())
        self._parquet.write_table(pa.Table.from_pylist([], schema=_parquet_schema()))

    def abort(self) -> None:
        if self._ndjson is not None:
            self._ndjson.close()
        if self._parquet is not None:
            self._parquet.close()
        self.tmp.unlink(missing_ok=True)


class _NdjsonRow(msgspec.Struct, frozen=True):
    """One NDJSON line: every column, in `COLUMNS` order, nulls included."""

    namespace: str
    thread: str
    seq: int
    id: str
    type: Any
    time_ms: int
    turn: Any
    parent_turn: Any
    outcome: Any
    model_tier: Any
    input_tokens: Any
    output_tokens: Any
    payload: str


def _parquet_writer(path: Path, schema: Any) -> Any:
    import pyarrow.parquet as pq

    # Dictionary encoding only where values repeat: on ids and payloads it is built, found
    # useless and dropped, page after page.
    return pq.ParquetWriter(path, schema, compression="zstd", use_dictionary=_DICTIONARY_COLUMNS)


def _parquet_schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            ("namespace", pa.string()),
            ("thread", pa.string()),
            ("seq", pa.int64()),
            ("id", pa.string()),
            ("type", pa.string()),
            ("time_ms", pa.int64()),
            ("turn", pa.string()),
            ("parent_turn", pa.string()),
            ("outcome", pa.string()),
            ("model_tier", pa.string()),
            ("input_tokens", pa.int64()),
            ("output_tokens", pa.int64()),
            ("payload", pa.string()),
        ]
    )


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def committed_positions(directory: Path) -> tuple[int, dict[int, str]]:
    """The newest committed part number and its positions (0 and {} for a fresh directory).

    Also removes what a crashed run left: temporary files and sidecars without their part.
    """
    newest = 0
    positions: dict[int, str] = {}
    for path in sorted(directory.iterdir()):
        name = path.name
        if name.startswith(".part-") and name.endswith(".tmp"):
            path.unlink(missing_ok=True)
            continue
        if name.endswith(".positions.json"):
            part = name[: -len(".positions.json")]
            if not any((directory / f"{part}.{ext}").exists() for ext in ("ndjson", "parquet")):
                path.unlink(missing_ok=True)
            continue
        match = _PART_RE.match(name)
        if match and int(match.group(1)) > newest:
            sidecar = directory / f"part-{match.group(1)}.positions.json"
            raw = json.loads(sidecar.read_text())
            newest = int(match.group(1))
            positions = {int(k): v for k, v in raw.items()}
    return newest, positions


class Exporter:
    """Exports a namespace's events to ``directory``, incrementally.

    ``rows_per_part`` bounds a part file; ``batch`` is the feed entries read per call.
    """

    def __init__(
        self,
        store: EventStore,
        directory: str | os.PathLike[str],
        *,
        fmt: Format = "parquet",
        name: str = "export",
        batch: int = 2048,
        rows_per_part: int = 1_000_000,
    ) -> None:
        if fmt not in ("ndjson", "parquet"):
            raise InvalidInputError(f"unknown export format {fmt!r} (ndjson or parquet)")
        validate_view_name(name)
        self.store = store
        self.directory = Path(directory)
        self.fmt: Format = fmt
        self.group = f"export-{name}"
        self.batch = batch
        self.rows_per_part = rows_per_part
        # Standalone Redis: the log pages of a chunk go as one pipeline, and their replies
        # stay raw RESP arrays (an empty callback table: no per-entry dict is built).
        client = getattr(store, "client", None) if isinstance(store, RedisEventStore) else None
        self._raw_client: Redis | None = client if isinstance(client, Redis) else None

    async def run(
        self,
        *,
        since: datetime | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> ExportResult:
        """Export every change after the committed positions; returns what was written.

        ``since`` skips events recorded before that time (a first export of recent data).
        """
        await anyio.to_thread.run_sync(lambda: self.directory.mkdir(parents=True, exist_ok=True))
        number, positions = await anyio.to_thread.run_sync(committed_positions, self.directory)
        for p in range(self.store.partitions):
            await self.store.create_feed_group(p, self.group, start=positions.get(p, "0-0"))
        since_ms = int(since.timestamp() * 1000) if since is not None else None
        result = _RunState(number, positions)
        read_send, read_receive = anyio.create_memory_object_stream[_Chunk](1)
        rows_send, rows_receive = anyio.create_memory_object_stream[_Decoded](1)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read, dict(positions), read_send)
                tg.start_soon(self._decode, since_ms, read_receive, rows_send)
                tg.start_soon(self._write, result, rows_receive, progress)
        except BaseExceptionGroup as group:
            # The stage that failed first says what went wrong; the others were cancelled.
            raise _first_error(group) from None
        return ExportResult(
            files=result.files,
            events=result.events,
            tombstones=result.tombstones,
            positions=result.positions,
        )

    # -- the three stages -----------------------------------------------------------------------

    async def _read(self, positions: dict[int, str], send: MemoryObjectSendStream[_Chunk]) -> None:
        async with send:
            for p in range(self.store.partitions):
                after = positions.get(p, "0-0")
                while True:
                    entries = await self.store.read_feed(p, after=after, count=self.batch)
                    if not entries:
                        break
                    for run in _chunks(entries, CHUNK_EVENTS):
                        chunk = _Chunk(p, run)
                        if not run[0].deleted:
                            chunk.pages = await self._read_log(_pages(run))
                        await send.send(chunk)
                    after = entries[-1].id

    async def _read_log(
        self, pages: list[tuple[str, int, int]]
    ) -> list[tuple[str, int, list[Any]]]:
        client = self._raw_client
        if client is None:
            return [
                (thread, lo, await self.store.read_raw(thread, start=lo, stop=hi, count=PAGE + 1))
                for thread, lo, hi in pages
            ]
        assert isinstance(self.store, RedisEventStore)
        log = self.store.keys.log
        # Every range is a set of dense ``<seq>-0`` ids, so a page holds at most PAGE entries;
        # COUNT one more keeps a damaged log (foreign entries) from growing a reply unbounded.
        pipe = Pipeline(client.connection_pool, {}, False, None)
        for thread, lo, hi in pages:
            pipe.execute_command(
                "XRANGE", log(thread), b"%d-0" % lo, b"%d-0" % hi, "COUNT", PAGE + 1
            )
        try:
            replies = await pipe.execute()
        except (rex.RedisError, OSError) as exc:
            raise translate_redis_error(exc) from exc
        return [(thread, lo, reply) for (thread, lo, _), reply in zip(pages, replies, strict=True)]

    async def _decode(
        self,
        since_ms: int | None,
        receive: MemoryObjectReceiveStream[_Chunk],
        send: MemoryObjectSendStream[_Decoded],
    ) -> None:
        async with receive, send:
            async for chunk in receive:
                rows = _Rows()
                if not chunk.pages:
                    for e in chunk.entries:
                        if e.deleted and (since_ms is None or e.time_ms >= since_ms):
                            rows.add_tombstone(e)
                # Decoding builds a few objects per field of every event and no cycles; the
                # collector's passes over them cost a quarter of the decode, for nothing.
                paused = gc.isenabled()
                gc.disable()
                try:
                    for thread, lo, entries in chunk.pages:
                        # A thread deleted since leaves nothing to read; its tombstone follows.
                        _decode_page(rows, thread, lo, entries, since_ms)
                finally:
                    if paused:
                        gc.enable()
                chunk.pages = []
                await send.send(_Decoded(chunk, rows))

    async def _write(
        self,
        state: _RunState,
        receive: MemoryObjectReceiveStream[_Decoded],
        progress: Callable[[int], None] | None,
    ) -> None:
        writer: _PartWriter | None = None
        try:
            async with receive:
                async for item in receive:
                    if writer is None:
                        state.number += 1
                        writer = _PartWriter(
                            self.directory, state.number, self.fmt, self.store.namespace
                        )
                    await anyio.to_thread.run_sync(writer.write, item.rows)
                    state.tombstones += item.rows.tombstones
                    state.events += len(item.rows) - item.rows.tombstones
                    state.positions[item.partition] = item.last_id
                    if progress is not None:
                        progress(state.events + state.tombstones)
                    if writer.rows >= self.rows_per_part:
                        state.files.append(str(await self._commit(writer, state.positions)))
                        writer = None
            if writer is not None:
                state.files.append(str(await self._commit(writer, state.positions)))
                writer = None
        finally:
            if writer is not None:
                writer.abort()

    async def _commit(self, writer: _PartWriter, positions: dict[int, str]) -> Path:
        snapshot = dict(positions)
        path = await anyio.to_thread.run_sync(writer.commit, snapshot)
        for p, position in snapshot.items():
            await self.store.advance_feed_group(p, self.group, position)
        return path


class _RunState:
    """What a run has written so far (owned by the writing stage)."""

    __slots__ = ("events", "files", "number", "positions", "tombstones")

    def __init__(self, number: int, positions: dict[int, str]) -> None:
        self.number = number
        self.positions = positions
        self.files: list[str] = []
        self.events = 0
        self.tombstones = 0


def _first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def read_parquet_dir(directory: str | os.PathLike[str]) -> Iterable[dict[str, Any]]:
    """Every committed row of a Parquet export directory (for tests and small checks)."""
    import pyarrow.parquet as pq

    for path in sorted(Path(directory).glob("part-*.parquet")):
        yield from pq.read_table(path).to_pylist()
