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
Memory stays bounded: feed entries and events are read and written in batches.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.to_thread
import msgspec

from eventstore import EventStore, FeedEntry, InvalidInputError, validate_view_name
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
_PART_RE = re.compile(r"^part-(\d{8})\.(ndjson|parquet)$")
_json = msgspec.json.Encoder()
_any_msgpack = msgspec.msgpack.Decoder()


class ExportResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one export run wrote."""

    files: list[str]
    events: int
    tombstones: int
    positions: dict[int, str]


def _ulid_to_str(raw: bytes) -> str:
    from ulid import ULID

    return str(ULID.from_bytes(raw))


def _row(
    namespace: str, thread: str, entry_id: bytes, fields: dict[bytes, bytes]
) -> dict[str, Any]:
    seq = seq_of_entry_id(thread, entry_id)
    try:
        payload = _any_msgpack.decode(fields[b"d"])
        meta = _any_msgpack.decode(fields[b"m"]) if fields[b"m"] else {}
        event_id = _ulid_to_str(fields[b"i"])
        time_ms = int(fields[b"s"])
    except (KeyError, ValueError, msgspec.DecodeError) as exc:
        from eventstore import CorruptEventError

        raise CorruptEventError(thread, seq, f"cannot export: {exc}") from None
    if not isinstance(payload, dict):
        from eventstore import CorruptEventError

        raise CorruptEventError(thread, seq, "cannot export: payload is not a map")
    usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else {}
    return {
        "namespace": namespace,
        "thread": thread,
        "seq": seq,
        "id": event_id,
        "type": payload.get("type"),
        "time_ms": time_ms,
        "turn": payload.get("turn_id") or (meta.get("t") if isinstance(meta, dict) else None),
        "parent_turn": payload.get("parent_turn_id"),
        "outcome": payload.get("outcome"),
        "model_tier": payload.get("model_tier"),
        "input_tokens": usage.get("input_tokens") if usage else None,
        "output_tokens": usage.get("output_tokens") if usage else None,
        "payload": _json.encode(payload).decode("utf-8"),
    }


def _tombstone(namespace: str, entry: FeedEntry) -> dict[str, Any]:
    return {
        "namespace": namespace,
        "thread": entry.thread_id,
        "seq": entry.last_seq,
        "id": entry.id,
        "type": "thread.deleted",
        "time_ms": entry.time_ms,
        "turn": None,
        "parent_turn": None,
        "outcome": None,
        "model_tier": None,
        "input_tokens": None,
        "output_tokens": None,
        "payload": json.dumps({"type": "thread.deleted", "version": entry.last_seq}),
    }


class _PartWriter:
    """Writes one part file under a temporary name; `commit` renames it into place."""

    def __init__(self, directory: Path, number: int, fmt: Format) -> None:
        self.final = directory / f"part-{number:08d}.{fmt}"
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{self.final.name}.", suffix=".tmp")
        os.close(fd)
        self.tmp = Path(tmp)
        self.fmt = fmt
        self.rows = 0
        self._ndjson = open(self.tmp, "wb") if fmt == "ndjson" else None  # noqa: SIM115
        self._parquet: Any = None

    def write(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        self.rows += len(rows)
        if self._ndjson is not None:
            self._ndjson.write(b"".join(_json.encode(r) + b"\n" for r in rows))
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist(rows, schema=_parquet_schema())
        if self._parquet is None:
            self._parquet = pq.ParquetWriter(self.tmp, table.schema, compression="zstd")
        self._parquet.write_table(table)

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
        import pyarrow.parquet as pq

        self._parquet = pq.ParquetWriter(self.tmp, _parquet_schema(), compression="zstd")
        self._parquet.write_table(pa.Table.from_pylist([], schema=_parquet_schema()))

    def abort(self) -> None:
        if self._ndjson is not None:
            self._ndjson.close()
        if self._parquet is not None:
            self._parquet.close()
        self.tmp.unlink(missing_ok=True)


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

    ``rows_per_part`` bounds a part file; ``batch`` bounds memory (feed entries per read).
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
        files: list[str] = []
        events = tombstones = 0
        writer: _PartWriter | None = None
        try:
            for p in range(self.store.partitions):
                after = positions.get(p, "0-0")
                while True:
                    entries = await self.store.read_feed(p, after=after, count=self.batch)
                    if not entries:
                        break
                    rows = await self._rows(entries, since_ms)
                    if writer is None:
                        number += 1
                        writer = _PartWriter(self.directory, number, self.fmt)
                    await anyio.to_thread.run_sync(writer.write, rows)
                    events += sum(1 for r in rows if r["type"] != "thread.deleted")
                    tombstones += sum(1 for r in rows if r["type"] == "thread.deleted")
                    after = entries[-1].id
                    positions[p] = after
                    if progress is not None:
                        progress(events + tombstones)
                    if writer.rows >= self.rows_per_part:
                        files.append(str(await self._commit(writer, positions)))
                        writer = None
            if writer is not None:
                files.append(str(await self._commit(writer, positions)))
                writer = None
        finally:
            if writer is not None:
                writer.abort()
        return ExportResult(files=files, events=events, tombstones=tombstones, positions=positions)

    async def _commit(self, writer: _PartWriter, positions: dict[int, str]) -> Path:
        snapshot = dict(positions)
        path = await anyio.to_thread.run_sync(writer.commit, snapshot)
        for p, position in snapshot.items():
            await self.store.advance_feed_group(p, self.group, position)
        return path

    async def _rows(self, entries: list[FeedEntry], since_ms: int | None) -> list[dict[str, Any]]:
        ns = self.store.namespace
        # Merge each thread's consecutive ranges so a batch costs one read per thread.
        ranges: dict[str, list[int]] = {}
        for e in entries:
            if e.deleted:
                continue
            span = ranges.get(e.thread_id)
            if span is None:
                ranges[e.thread_id] = [e.first_seq, e.last_seq]
            else:
                span[0] = min(span[0], e.first_seq)
                span[1] = max(span[1], e.last_seq)
        fetched: dict[str, dict[int, dict[str, Any]]] = {}
        for thread, (lo, hi) in ranges.items():
            rows: dict[int, dict[str, Any]] = {}
            start = lo
            while start <= hi:
                raw = await self.store.read_raw(thread, start=start, stop=hi, count=4096)
                if not raw:
                    break
                for entry_id, fields in raw:
                    row = _row(ns, thread, entry_id, fields)
                    rows[row["seq"]] = row
                start = (rows and max(rows) + 1) or hi + 1
            fetched[thread] = rows
        out: list[dict[str, Any]] = []
        for e in entries:
            if e.deleted:
                if since_ms is None or e.time_ms >= since_ms:
                    out.append(_tombstone(ns, e))
                continue
            thread_rows = fetched.get(e.thread_id, {})
            for seq in range(e.first_seq, e.last_seq + 1):
                found = thread_rows.get(seq)
                # A thread deleted since leaves nothing to read; its tombstone follows.
                if found is not None and (since_ms is None or found["time_ms"] >= since_ms):
                    out.append(found)
        return out


def read_parquet_dir(directory: str | os.PathLike[str]) -> Iterable[dict[str, Any]]:
    """Every committed row of a Parquet export directory (for tests and small checks)."""
    import pyarrow.parquet as pq

    for path in sorted(Path(directory).glob("part-*.parquet")):
        yield from pq.read_table(path).to_pylist()
