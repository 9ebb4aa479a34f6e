"""Incremental export of the event log to NDJSON and Parquet, driven by the change feed.

Each run writes the changes since the previous run into new part files of an output
directory. A part is committed by one atomic rename, and its positions sidecar (the feed id
reached in each partition the part's run covers) is renamed into place before it; a run's
starting positions are those of the newest committed part that names each partition. So a
crash at any moment leaves either the whole part or none of it — never duplicates, never
holes — and the next run picks up where the last committed part ends. The exporter also
advances a consumer group per partition after each commit, so feed trimming never removes
changes it has not exported.

Rows are flat: namespace, thread, incarnation, seq, id, type, time, turn, parent turn, outcome,
model tier, token usage, and the payload as JSON. Deleted threads arrive as ``thread.deleted``
tombstones. A feed entry names its thread's incarnation, and its seqs are read only while the
thread is still in that incarnation (one atomic check and read): a thread deleted and created
again before the export catches up would otherwise have its new events read for the old
entries.

A run is three stages joined by one-slot queues, so each overlaps the others: reading (feed
entries, then the log ranges they name, with `EventStore.read_raw_ranges`, a piece of at most
`PAGE` events, and about `READ_BYTES` of payload, per round trip), decoding (each piece as it
arrives, column by column, no per-row objects, into the rows of its chunk), and writing a chunk
at a time (in a worker thread: pyarrow encodes and compresses without holding the GIL). Memory
stays bounded whatever the log's size and its events' size: a chunk holds at most
`CHUNK_EVENTS` events (or one append, when an append is larger), its rows go to the writer in
batches of about `ROWS_BYTES` of payload at most (its position only with the last), and at
most two batches wait between the stages.

With ``workers=N`` the partitions are shared out among N processes: the calling process and
N - 1 worker processes it spawns, each opening its own connection from the store's settings
and running the same three stages over the partitions it claims (one at a time, from the
parent, so a slow start or a large partition does not leave the others idle). Each process
writes its own part files, numbered so that no two collide and each process's numbers rise
(the parent's first free number plus the worker's index, stepping by N); a part's sidecar
names only the partitions its process exported, and a run's starting positions merge every
committed sidecar in part order, partition by partition. A partition is exported by exactly
one process in a run, so the merge gives each partition the position of its newest part.

Positions are feed ids, which mean nothing outside their feed, so a directory records its
source (`SOURCE_FILE`: namespace, the data set's `EventStore.namespace_id`, export name) and
refuses any other (`ExportSourceError`), and each run checks its positions against the feeds.
Runs are fenced by two ``flock`` locks in the directory: one run at a time, and a new run
waits (bounded) until every worker of an earlier, killed run is gone before it reads the
positions, so an orphaned worker can never commit a part a new run then exports again.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import functools
import gc
import hashlib
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from itertools import repeat
from multiprocessing.connection import Connection, wait
from operator import itemgetter
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
import anyio.to_thread
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from eventstore import (
    CorruptEventError,
    EventStore,
    EventStoreError,
    FeedEntry,
    FeedTrimmedError,
    InvalidInputError,
    OperationalError,
    RawRange,
    RedisEventStore,
    StoreSettings,
    open_store,
    redact,
    validate_view_name,
)
from eventstore._codec import MAX_EVENT_TIME_MS, seq_of_entry_id
from eventstore._errors import DECODE_ERRORS
from eventstore._feed import parse_stream_id
from eventstore._ids import validate_count

from ._files import temp_beside

Format = Literal["ndjson", "parquet"]
Compression = Literal["snappy", "zstd", "lz4", "none"]
COMPRESSIONS: tuple[Compression, ...] = ("snappy", "zstd", "lz4", "none")
# Snappy, as pyarrow and Spark write by default: on 1,000,000 events (bench.export, recorded
# run of 2026-11-30 16:12 UTC) it exported 212k events/s into 176 MB, zstd 202k into 107 MB.
DEFAULT_COMPRESSION: Compression = "snappy"
COLUMNS: tuple[str, ...] = (
    "namespace",
    "thread",
    "incarnation",
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
"""The columns of an export, in order. (thread, incarnation, seq) names an event: a thread
deleted and written again starts a new incarnation, and its seqs start at 1 again."""
LEGACY_COLUMNS = tuple(c for c in COLUMNS if c != "incarnation")
"""The columns of a directory whose first run was before the incarnation column (its
`SOURCE_FILE` records no ``columns``): its later runs keep them, so that its parts stay one
table."""
CHUNK_EVENTS = 8192
"""Events decoded and written at a time: what bounds an export's memory."""
GC_EVERY_CHUNKS = 64
"""With the collector paused (``pause_gc``, worker processes): chunks between two collections."""
PARALLEL_CHUNK_EVENTS = 4096
"""The same in each process of a parallel export: about 40 MB less per process (~145 MB
against ~185 MB peak, of which ~80 MB is the interpreter with pyarrow loaded), for row groups
of 4,096 rows instead of 8,192."""
PAGE = 1024
"""Log entries per ``XRANGE``, and about the most a read hands to the decoder at once."""
READ_BYTES = 4 << 20
"""About the most payload bytes one read asks for: with large events (a tool result of
hundreds of kB) a read takes fewer than `PAGE`, sized by the events decoded before it."""
FIRST_READ = 64
"""Events of a process's first reads, before it knows how large its events are."""
ROWS_BYTES = 8 << 20
"""Payload bytes of decoded rows that go to the writer at once, before their chunk ends (a
chunk of `CHUNK_EVENTS` large events would otherwise be held whole, up to gigabytes)."""

_PART_RE = re.compile(r"^part-(\d{8})\.(ndjson|parquet)$")
_json = msgspec.json.Encoder()
_any_msgpack = msgspec.msgpack.Decoder()
_entry_values = itemgetter(b"i", b"s", b"d", b"m")
_FIELD_NAMES = (b"i", b"v", b"s", b"d", b"m", b"h")  # the order the append script writes
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_ULID_PAIRS = [a + b for a in _CROCKFORD for b in _CROCKFORD]  # 10 bits -> two characters
_ULID_TRIPLES = [a + b for a in _ULID_PAIRS for b in _CROCKFORD]  # 15 bits -> three
_NO_USAGE: dict[str, Any] = {}  # read only
_DICTIONARY_COLUMNS = ["namespace", "thread", "type", "outcome", "model_tier"]
# Min/max statistics only where a reader can prune with them: on ids and payload JSON they cost
# the writer and tell a query nothing.
_NO_STATISTICS = ("id", "payload")
AUTO_WORKERS_MAX = 3
"""The most processes ``workers="auto"`` uses: each peaks at ~140 to 170 MB (bench.export), so
three stay under the 500 MB an export may use."""
PARALLEL_MIN_EVENTS = 200_000
"""Events a ``workers="auto"`` run must find waiting before it starts workers: a worker's
start-up (~0.5 s of CPU, mostly imports) repays itself only over some 50,000 events of its own,
and a small incremental run is faster in one process."""
_RUN_LOCK = ".export.lock"
"""Held (exclusively) by the process running an export into the directory."""
_WORKERS_LOCK = ".workers.lock"
"""Held (shared) by every worker process of a run; a new run waits until none holds it."""
LEGACY_NAME = "export"
"""The export name directories got before each had its own (`directory_export_name`)."""
SOURCE_FILE = "_source.json"
"""The directory's source: namespace, data set id (`EventStore.namespace_id`), export name.

This and the parts' positions sidecars start with ``_`` so that readers of a directory of parts
skip them, as they skip names starting with ``.`` (pyarrow, and pandas and Spark over it):
``pandas.read_parquet(directory)`` reads the parts alone."""
LEGACY_SOURCE_FILE = "source.json"
"""`SOURCE_FILE` as directories written before 2026-12 name it; a run renames it."""
_SIDECAR_SUFFIX = ".positions.json"
T = TypeVar("T")
RUN_RECORD_FILE = "_positions.json"
"""Where the last run that committed a part ended: its last part's number and every
partition's position. Parts' sidecars above that number (a run killed after some commits) are
merged on top. The record is what lets parts be removed once loaded: a parallel run's
sidecars each name only their own process's partitions, and the newest parts' positions go
with them."""
FENCE_TIMEOUT = 30.0
"""Seconds a run waits for the workers of an earlier, killed run to be gone."""


class ExportResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one export run wrote."""

    files: list[str]
    events: int
    tombstones: int
    positions: dict[int, str]
    workers: int = 1
    """Processes that took part (this one included)."""
    busy_partitions: int | None = None
    """Partitions that had changes waiting, when the run counted them (to share them out)."""


class ExportBusyError(OperationalError):
    """Raised when another export run is writing into the same directory."""


class ExportSourceError(InvalidInputError):
    """Raised when an export directory holds another source's export than the run's: another
    namespace, another data set (another server, or this one flushed or restored from an older
    copy), or another export name; or when the feeds contradict its positions. Nothing is
    written: a run into it would export a wrong set of events (nothing, or a hole)."""


def _other_partitions(n: int) -> str:
    return f"{n} other partition" if n == 1 else f"{n} other partitions"


def _fmt_ms(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


class ExportWorkerError(OperationalError):
    """Raised when an export worker process dies, stops reporting, or fails with an error that
    cannot be sent back as itself; the worker's committed parts stand, and a rerun resumes."""


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
        "incarnation",
        "input_tokens",
        "model_tier",
        "outcome",
        "output_tokens",
        "parent_turn",
        "payload",
        "payload_ends",
        "seq",
        "text_ids",
        "thread",
        "time_ms",
        "tombstones",
        "turn",
        "type",
    )

    def __init__(self) -> None:
        self.thread: list[str] = []
        self.incarnation: list[int | None] = []
        self.seq: list[int] = []
        # Raw 16-byte event ids, printed as ULIDs by the writer (for Parquet, column-wise and
        # mostly without the GIL); once a chunk holds a deletion (no id: null), ULID text.
        self.id: list[Any] = []
        self.text_ids = False
        self.type: list[Any] = []
        self.time_ms: list[int] = []
        self.turn: list[Any] = []
        self.parent_turn: list[Any] = []
        self.outcome: list[Any] = []
        self.model_tier: list[Any] = []
        self.input_tokens: list[Any] = []
        self.output_tokens: list[Any] = []
        # The payloads' JSON back to back, and where each ends: encoded into one buffer (no
        # bytes object per event), which becomes the Parquet column's data as it is.
        self.payload = bytearray()
        self.payload_ends: list[int] = []
        self.tombstones = 0

    def __len__(self) -> int:
        return len(self.seq)

    def columns(self, namespace: str) -> list[Any]:
        """Every column, in `COLUMNS` order (ids as raw bytes unless `text_ids`; the payload
        column is left to `payload_texts` or `payload_array`)."""
        return [
            [namespace] * len(self.seq), self.thread, self.incarnation, self.seq, self.id,
            self.type, self.time_ms, self.turn, self.parent_turn, self.outcome, self.model_tier,
            self.input_tokens, self.output_tokens, None,
        ]  # fmt: skip

    def payload_texts(self) -> list[str]:
        """The payload column as one str per row."""
        data, ends = memoryview(self.payload), self.payload_ends
        starts = [0, *ends][: len(ends)]
        return [str(data[a:b], "utf-8") for a, b in zip(starts, ends, strict=True)]

    def payload_array(self) -> Any:
        """The payload column as a pyarrow string array, on the JSON buffer as it is."""
        import pyarrow as pa

        if len(self.payload) >= 2**31:  # beyond 32-bit offsets: pyarrow splits it as before
            return pa.array(self.payload_texts(), type=pa.string())
        offsets = array.array("i", [0])
        offsets += array.array("i", self.payload_ends)
        # msgspec writes valid UTF-8 (it decoded and validated every string it encodes).
        return pa.StringArray.from_buffers(
            len(self.payload_ends), pa.py_buffer(offsets), pa.py_buffer(self.payload)
        )

    def add_events(
        self,
        thread: str,
        incarnation: int | None,
        seqs: Sequence[int],
        ids: Sequence[bytes],
        times: Sequence[int],
        payloads: Sequence[dict[str, Any]],
        metas: Sequence[Any],
        since_ms: int | None,
    ) -> None:
        """Add decoded events of one life of a thread (``payloads`` must all be maps)."""
        if since_ms is not None:
            keep = [i for i, t in enumerate(times) if t >= since_ms]
            if len(keep) < len(times):
                seqs, ids, times = (
                    [seqs[i] for i in keep],
                    [ids[i] for i in keep],
                    [times[i] for i in keep],
                )
                payloads, metas = [payloads[i] for i in keep], [metas[i] for i in keep]
        # The payloads first, before any column grows: one JSON cannot hold (a non-string
        # key, written by an application's own event) stops the export naming it.
        # ``encode_into`` appends to the buffer and returns None: ``or`` records the end.
        data, encode_into = self.payload, _json.encode_into
        start = len(data)
        try:
            ends = [encode_into(p, data, -1) or len(data) for p in payloads]
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
            del data[start:]
            for seq, payload in zip(seqs, payloads, strict=True):
                try:
                    _json.encode(payload)
                except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
                    raise CorruptEventError(
                        thread, seq, f"cannot export: its payload holds what JSON cannot: {exc}"
                    ) from None
            raise
        self.payload_ends += ends
        self.thread += repeat(thread, len(seqs))
        self.incarnation += repeat(incarnation, len(seqs))
        self.seq += seqs
        self.id += map(_ulid_text, ids) if self.text_ids else ids
        self.time_ms += times
        # Each derived column is one ``map`` of ``dict.get`` over the payloads: the loop runs
        # in C, where a Python loop over events with seven lookups cost ~0.7 us an event.
        # An application's own event may use these field names for values of other types (an
        # outcome that is a map, a tier that is a number): those stay in the payload only, as
        # a column holds one type (Parquet refuses another, and would stop every run here).
        get = dict.get
        types = _texts(list(map(get, payloads, repeat("type"))))
        self.type += types
        turns = list(map(get, payloads, repeat("turn_id")))
        if not all(t.__class__ is str and t for t in turns):
            # Events that name their turn only in the metadata, or not as text.
            for i, turn in enumerate(turns):
                if turn.__class__ is not str or not turn:
                    meta = metas[i]
                    turn = meta.get("t") if meta.__class__ is dict else None
                    turns[i] = turn if turn.__class__ is str and turn else None
        self.turn += turns
        self.parent_turn += _texts(list(map(get, payloads, repeat("parent_turn_id"))))
        self.outcome += _texts(list(map(get, payloads, repeat("outcome"))))
        self.model_tier += _texts(list(map(get, payloads, repeat("model_tier"))))
        usages: list[Any] = list(map(get, payloads, repeat("usage")))
        if any(usages) or _SETTLED in types:
            usages = [u if u.__class__ is dict else _NO_USAGE for u in usages]
            # A turn record's `Usage` is stored without the counts left at their default, 0
            # (omit_defaults): the record says 0 tokens, which null would turn into unknown.
            zeros = [0 if t == _SETTLED else None for t in types]
            self.input_tokens += _counts(list(map(get, usages, repeat("input_tokens"), zeros)))
            self.output_tokens += _counts(list(map(get, usages, repeat("output_tokens"), zeros)))
        else:
            self.input_tokens += repeat(None, len(usages))
            self.output_tokens += repeat(None, len(usages))

    def add_tombstone(self, entry: FeedEntry) -> None:
        if not self.text_ids:
            self.id = list(map(_ulid_text, self.id))
            self.text_ids = True
        self.tombstones += 1
        self.thread.append(entry.thread_id)
        self.incarnation.append(entry.incarnation)  # the life it ended
        self.seq.append(entry.last_seq)
        # A deletion is recorded on the change feed, not as an event of the log: it has no
        # event id, and its feed entry id (a stream position, not a ULID) would read as one.
        self.id.append(None)
        self.type.append("thread.deleted")
        self.time_ms.append(entry.time_ms)
        for column in (
            self.turn, self.parent_turn, self.outcome, self.model_tier, self.input_tokens,
            self.output_tokens,
        ):  # fmt: skip
            column.append(None)
        # The same encoder as every event's payload: compact JSON, "type" first.
        payload = {"type": "thread.deleted", "version": entry.last_seq}
        _json.encode_into(payload, self.payload, -1)
        self.payload_ends.append(len(self.payload))


_SETTLED = "turn.settled"
_TEXT_TYPES = {str, type(None)}
_COUNT_TYPES = {int, type(None)}
_INT64 = range(-(2**63), 2**63)


def _texts(values: list[Any]) -> list[Any]:
    """A text column's values: each str as it is, anything else null."""
    if set(map(type, values)) <= _TEXT_TYPES:  # the rule, checked in C
        return values
    return [v if v.__class__ is str else None for v in values]


def _counts(values: list[Any]) -> list[Any]:
    """A whole-number column's values: each int that fits 64 bits, anything else null (a bool,
    a fraction, text, a number beyond what the column holds)."""
    if set(map(type, values)) <= _COUNT_TYPES:
        numbers = [v for v in values if v is not None]
        if not numbers or (min(numbers) in _INT64 and max(numbers) in _INT64):
            return values
    return [v if v.__class__ is int and v in _INT64 else None for v in values]


@functools.lru_cache(maxsize=64)
def _entry_ids(lo: int, n: int) -> tuple[bytes, ...]:
    """The entry ids of ``n`` events from seq ``lo``. Pages of long threads start at the same
    seqs (1, 1 + PAGE, ...), so most are formatted once per run (~0.09 us an id otherwise)."""
    return tuple(map(b"%d-0".__mod__, range(lo, lo + n)))


def _decode_page(rows: _Rows, page: _ReadPage, since: int | None) -> None:
    """Decode the log entries of one ``XRANGE`` (of seqs ``lo..hi`` of the thread's
    incarnation ``life``) into ``rows``.

    Entries come as redis-py parses them (``(id, {field: value})``) or as raw RESP arrays
    (``[id, [field, value, ...]]``). The fast path checks and decodes whole columns at once;
    anything unusual (a hole, a foreign entry id, a damaged field) takes the careful path,
    which names the thread and seq of the first damage.
    """
    thread, lo, hi, life, entries = page
    n = len(entries)
    if not n:
        return  # the thread left the page's life: its deletion is on the feed (`_require_deletion`)
    try:
        ids_, *fields = zip(*entries, strict=True)
        if n != hi - lo + 1 or ids_ != _entry_ids(lo, n):
            raise ValueError("not every seq of the range")
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
        if min(time_ms) < 0 or max(time_ms) > MAX_EVENT_TIME_MS:
            raise ValueError("a time out of range")
        payloads = list(map(_any_msgpack.decode, datas))
        if set(map(type, payloads)) != {dict}:
            raise ValueError("payload is not a map")
        if set(map(type, map(dict.get, payloads, repeat("type")))) != {str}:
            raise ValueError("a payload names no type")
        if all(metas):
            decoded_metas = list(map(_any_msgpack.decode, metas))
        else:
            decoded_metas = [_any_msgpack.decode(m) if m else None for m in metas]
    except (ValueError, TypeError, KeyError, IndexError, msgspec.DecodeError):
        _decode_carefully(rows, page, since)
        return
    rows.add_events(thread, life, range(lo, lo + n), ids, time_ms, payloads, decoded_metas, since)


def _decode_carefully(rows: _Rows, page: _ReadPage, since: int | None) -> None:
    thread, lo, hi, life, entries = page
    expected = lo
    for entry_id, raw in entries:
        seq = seq_of_entry_id(thread, entry_id)
        if seq != expected:
            # The feed says the thread's life holds every seq of the range: a hole is damage,
            # and leaving it out would export a silently incomplete log.
            raise CorruptEventError(
                thread, expected, "cannot export: missing from the log (run 'verify')"
            )
        expected = seq + 1
        if isinstance(raw, list):
            raw = dict(zip(raw[0::2], raw[1::2], strict=False))
        try:
            payload = _any_msgpack.decode(raw[b"d"])
            meta = _any_msgpack.decode(raw[b"m"]) if raw[b"m"] else None
            event_id = raw[b"i"]
            if len(event_id) != 16:
                raise ValueError("the event id is not 16 bytes")
            time_ms = int(raw[b"s"])
            if not 0 <= time_ms <= MAX_EVENT_TIME_MS:
                raise ValueError(f"time {time_ms} ms is out of range (0 to 9999-12-31)")
        except KeyError as exc:
            raise CorruptEventError(
                thread, seq, f"cannot export: no field {exc.args[0]!r}"
            ) from None
        except (ValueError, TypeError, msgspec.DecodeError) as exc:
            raise CorruptEventError(thread, seq, f"cannot export: {exc}") from None
        if not isinstance(payload, dict):
            raise CorruptEventError(thread, seq, "cannot export: payload is not a map")
        if not isinstance(payload.get("type"), str):
            # Every payload threadlog writes names its type ("type", the union's tag): one
            # without is damage, as every read path calls it, not a row of type null.
            raise CorruptEventError(thread, seq, "cannot export: its payload names no event type")
        rows.add_events(thread, life, [seq], [event_id], [time_ms], [payload], [meta], since)
    if expected <= hi:
        raise CorruptEventError(
            thread, expected, "cannot export: missing from the log (run 'verify')"
        )


class _Chunk:
    """A run of feed entries of one partition (what one commit of positions covers)."""

    __slots__ = ("entries", "last_id", "partition")

    def __init__(self, partition: int, entries: list[FeedEntry]) -> None:
        self.partition = partition
        self.entries = entries
        self.last_id = entries[-1].id


class _Piece:
    """The log entries of one read (at most about `PAGE` events) of a chunk; ``last`` ends it.

    Reads hand their entries to the decoder a piece at a time, not a chunk at a time: decoded
    while hiredis's objects are still in the CPU's caches, a piece costs ~0.8 us an event less
    than the same entries decoded after a whole chunk's (~10 MB of objects) were read.
    """

    __slots__ = ("chunk", "last", "pages")

    def __init__(self, chunk: _Chunk, pages: list[_ReadPage], last: bool):
        self.chunk = chunk
        self.pages = pages  # thread, first seq, last seq, incarnation, entries
        self.last = last


class _Decoded:
    """Decoded rows of a chunk; ``final`` when they end it (its position is then reached)."""

    __slots__ = ("final", "last_id", "partition", "rows")

    def __init__(self, chunk: _Chunk, rows: _Rows, final: bool = True) -> None:
        self.partition = chunk.partition
        self.last_id = chunk.last_id
        self.rows = rows
        self.final = final


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


_Page = tuple[str, int, int, int | None]
"""A log range to read: thread, first seq, last seq, and the thread's incarnation (or None)."""
_ReadPage = tuple[str, int, int, int | None, list[Any]]
"""A `_Page` and its entries."""


def _pages(entries: list[FeedEntry]) -> list[_Page]:
    """The log ranges the entries name, merged per thread and incarnation, in pages.

    (A run never holds two incarnations of a thread: the tombstone between them ends a run.)
    """
    spans: dict[tuple[str, int | None], list[tuple[int, int]]] = {}
    for e in entries:
        spans.setdefault((e.thread_id, e.incarnation), []).append((e.first_seq, e.last_seq))
    out: list[_Page] = []
    for (thread, life), ranges in spans.items():
        ranges.sort()
        merged = [list(ranges[0])]
        for lo, hi in ranges[1:]:
            if lo <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        for lo, hi in merged:
            out += [(thread, s, min(hi, s + PAGE - 1), life) for s in range(lo, hi + 1, PAGE)]
    return out


def _next_read(todo: list[_Page], budget: int) -> list[_Page]:
    """Take the pages of the next read, of at most ``budget`` events, from ``todo`` (pages
    in reverse order: taken from its end, in O(1) each). A page larger than the budget is
    split; otherwise pages are kept whole."""
    read: list[_Page] = []
    size = 0
    while todo:
        thread, lo, hi, life = todo[-1]
        events = hi - lo + 1
        if read and size + events > budget:
            break
        if events > budget:  # a first page larger than the budget: its front part only
            todo[-1] = (thread, lo + budget, hi, life)
            read.append((thread, lo, lo + budget - 1, life))
            break
        read.append(todo.pop())
        size += events
    return read


class _PartWriter:
    """Writes one part file under a temporary name; `commit` renames it into place."""

    def __init__(
        self,
        directory: Path,
        number: int,
        fmt: Format,
        namespace: str,
        compression: Compression = DEFAULT_COMPRESSION,
        columns: tuple[str, ...] = COLUMNS,
    ) -> None:
        self.final = directory / f"part-{number:08d}.{fmt}"
        self.compression = compression
        self.columns = columns
        # Where each of its columns is among `COLUMNS` (None: all of them, in order).
        self._picks = None if columns == COLUMNS else [COLUMNS.index(c) for c in columns]
        self._id = columns.index("id")
        fd, tmp = temp_beside(self.final)
        os.close(fd)
        self.tmp = Path(tmp)
        self.fmt = fmt
        self.namespace = namespace
        self.rows = 0
        self._ndjson = open(self.tmp, "wb") if fmt == "ndjson" else None  # noqa: SIM115
        self._parquet: Any = None
        self._sink: Any = None  # the file the Parquet writer writes, when it is ours to close

    def write(self, rows: _Rows) -> None:
        if not len(rows):
            return
        self.rows += len(rows)
        columns = rows.columns(self.namespace)
        if self._picks is not None:  # a directory older than some column: its own ones
            columns = [columns[i] for i in self._picks]
        i = self._id
        if self._ndjson is not None:
            if not rows.text_ids:
                columns[i] = list(map(_ulid_text, columns[i]))
            columns[-1] = rows.payload_texts()
            row = _ndjson_row(self.columns)
            self._ndjson.write(_json.encode_lines(list(map(row, *columns))))
            return
        import pyarrow as pa

        schema = _parquet_schema(self.columns)
        if not rows.text_ids:
            columns[i] = _ulid_array(columns[i])
        columns[-1] = rows.payload_array()
        arrays = [
            c if isinstance(c, pa.Array) else pa.array(c, type=f.type)
            for c, f in zip(columns, schema, strict=True)
        ]
        batch = pa.RecordBatch.from_arrays(arrays, schema=schema)
        if self._parquet is None:
            self._parquet = self._parquet_writer(schema)
        self._parquet.write_batch(batch)

    def _parquet_writer(self, schema: Any) -> Any:
        try:
            str(self.tmp).encode("utf-8")
            sink: Any = self.tmp
        except UnicodeEncodeError:
            # A name that is not UTF-8 (Linux names are bytes): pyarrow takes a path for text
            # (a URI) and cannot say it; a file it is handed needs no name.
            sink = self._sink = open(self.tmp, "wb")  # noqa: SIM115
        return _parquet_writer(sink, schema, self.compression, self.columns)

    def _close_parquet(self) -> None:
        if self._parquet is not None:
            self._parquet.close()
        if self._sink is not None:
            self._sink.close()

    def commit(self, positions: dict[int, str]) -> Path:
        if self._ndjson is not None:
            self._ndjson.flush()
            os.fsync(self._ndjson.fileno())
            self._ndjson.close()
        elif self._parquet is None:
            self.write_empty()
        self._close_parquet()
        sidecar = sidecar_path(self.final)
        _atomic_write(sidecar, json.dumps({str(k): v for k, v in positions.items()}).encode())
        with open(self.tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(self.tmp, self.final)
        _fsync_dir(self.final.parent)
        return self.final

    def write_empty(self) -> None:
        import pyarrow as pa

        schema = _parquet_schema(self.columns)
        self._parquet = self._parquet_writer(schema)
        self._parquet.write_table(pa.Table.from_pylist([], schema=schema))

    def abort(self) -> None:
        if self._ndjson is not None:
            self._ndjson.close()
        self._close_parquet()
        self.tmp.unlink(missing_ok=True)


# Each column's type in an NDJSON line. ``id`` is null on a ``thread.deleted`` row (a deletion
# is no event); ``incarnation`` on an event of a life from before lives were recorded.
_NDJSON_TYPES: dict[str, Any] = {
    "namespace": str,
    "thread": str,
    "incarnation": int | None,
    "seq": int,
    "id": str | None,
    "type": Any,
    "time_ms": int,
    "turn": Any,
    "parent_turn": Any,
    "outcome": Any,
    "model_tier": Any,
    "input_tokens": Any,
    "output_tokens": Any,
    "payload": str,
}


@functools.cache
def _ndjson_row(columns: tuple[str, ...]) -> type[msgspec.Struct]:
    """One NDJSON line: every column, in order, nulls included (a struct encodes as fast as
    msgspec encodes anything)."""
    fields = [(c, _NDJSON_TYPES[c]) for c in columns]
    return msgspec.defstruct("_NdjsonRow", fields, frozen=True)


def _parquet_writer(
    path: Any, schema: Any, compression: Compression, columns: tuple[str, ...]
) -> Any:
    import pyarrow.parquet as pq

    # Dictionary encoding only where values repeat: on ids and payloads it is built, found
    # useless and dropped, page after page.
    return pq.ParquetWriter(
        path,
        schema,
        compression=compression,
        use_dictionary=_DICTIONARY_COLUMNS,
        write_statistics=[c for c in columns if c not in _NO_STATISTICS],
    )


_CROCKFORD_BYTES = _CROCKFORD.encode("ascii")


def _ulid_array(ids: Sequence[bytes]) -> Any:
    """A pyarrow string array of the ULID text of raw 16-byte ids.

    With numpy (which pyarrow brings along), the 26 base-32 digits are cut out of the 128-bit
    numbers for the whole column at once: ~0.15 us an id against ~0.7 for `_ulid_text`, and
    numpy drops the GIL while it works. Without numpy, `_ulid_text` it is.
    """
    import pyarrow as pa

    try:
        import numpy as np
    except ModuleNotFoundError:  # pragma: no cover - pyarrow >= 16 does not require numpy
        return pa.array(list(map(_ulid_text, ids)), type=pa.string())
    n = len(ids)
    halves = np.frombuffer(b"".join(ids), dtype=">u8").reshape(n, 2)
    hi, lo = halves[:, 0], halves[:, 1]
    alphabet = np.frombuffer(_CROCKFORD_BYTES, dtype=np.uint8)
    text = np.empty((n, 26), dtype=np.uint8)
    for digit in range(26):
        shift = 125 - 5 * digit  # the digit's lowest bit, counted from the right of 128
        if shift >= 64:
            bits = hi >> np.uint64(shift - 64)
        elif shift > 59:  # the digit straddles the two halves
            bits = (hi << np.uint64(64 - shift)) | (lo >> np.uint64(shift))
        else:
            bits = lo >> np.uint64(shift)
        text[:, digit] = alphabet[(bits & np.uint64(31)).astype(np.intp)]
    offsets = np.arange(0, 26 * n + 1, 26, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(text))


def _parquet_schema(columns: tuple[str, ...] = COLUMNS) -> Any:
    import pyarrow as pa

    every = pa.schema(
        [
            ("namespace", pa.string()),
            ("thread", pa.string()),
            ("incarnation", pa.int64()),
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
    return pa.schema([every.field(c) for c in columns])


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = temp_beside(path)
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


class _Source(msgspec.Struct, frozen=True, kw_only=True):
    """Whose events an export directory holds (`SOURCE_FILE`)."""

    namespace: str
    store: str
    """The data set's id: `EventStore.namespace_id`."""
    name: str
    """The export name (its feed consumer group is ``export-<name>``)."""
    url: str | None = None
    """Where it was last exported from, password removed: for messages only (one data set can
    be reached by several URLs)."""
    since_ms: int | None = None
    """The time the directory started at (``since``): no event before it is exported into it."""
    columns: tuple[str, ...] = LEGACY_COLUMNS
    """The columns of its parts: those of its first run (absent: `LEGACY_COLUMNS`)."""

    def describe(self) -> str:
        where = f" at {self.url}" if self.url else ""
        return f"namespace {self.namespace!r} of data set {self.store}{where}"


def _read_source(directory: Path) -> _Source | None:
    for name in (SOURCE_FILE, LEGACY_SOURCE_FILE):  # the legacy one until a run renames it
        path = directory / name
        try:
            data = path.read_bytes()
            break
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise InvalidInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    else:
        return None
    try:
        source = msgspec.json.decode(data, type=_Source)
    except DECODE_ERRORS as exc:
        raise ExportSourceError(
            f"{path} does not say whose export {directory} holds ({exc}); restore it, or "
            f"export to a new directory"
        ) from None
    if source.columns not in (COLUMNS, LEGACY_COLUMNS):
        raise ExportSourceError(
            f"{path} records columns this threadlog does not write ({', '.join(source.columns)}; "
            f"it writes {', '.join(COLUMNS)}): a newer threadlog's directory, or an edited "
            f"record; export to a new directory"
        )
    return source


def _write_source(directory: Path, source: _Source) -> None:
    _atomic_write(directory / SOURCE_FILE, msgspec.json.format(msgspec.json.encode(source)))
    _fsync_dir(directory)


def _remove_made(directory: Path, made: list[Path]) -> None:
    """Remove the directories a run made (``made``, outermost first) when it commits nothing,
    so that a refused or empty run leaves no trace. Called with the run lock held: a run
    that starts meanwhile fails to take it (or, once its file is gone, makes its own and the
    directory is not empty any more, so it stays)."""
    if not made:
        return
    for name in (_WORKERS_LOCK, _RUN_LOCK):
        with contextlib.suppress(OSError):
            (directory / name).unlink()
    for path in reversed(made):
        try:
            path.rmdir()
        except OSError:  # something else is in it: it stays, with whatever is there
            return


def _remove_source(directory: Path) -> None:
    removed = False
    for name in (SOURCE_FILE, LEGACY_SOURCE_FILE):
        path = directory / name
        if path.exists():
            path.unlink()
            removed = True
    if removed:
        _fsync_dir(directory)


def sidecar_path(part: Path) -> Path:
    """Where the positions of ``part`` (``part-N.parquet``) are: ``_part-N.positions.json``."""
    return part.with_name(f"_{part.stem}{_SIDECAR_SUFFIX}")


def _rename_legacy_records(directory: Path) -> None:
    """Give the records of a directory written before 2026-12 (``source.json``,
    ``part-N.positions.json``) the names that readers of the parts skip (`SOURCE_FILE`).

    Called with the run lock held. Sidecars first, then the source: a crash between two renames
    leaves names `committed_positions` and `_read_source` read either way, and the next run
    finishes the job."""
    renamed = False
    for path in sorted(directory.iterdir()):
        name = path.name
        if name.startswith("part-") and name.endswith(_SIDECAR_SUFFIX):
            os.replace(path, directory / f"_{name}")
            renamed = True
    legacy = directory / LEGACY_SOURCE_FILE
    if legacy.exists() and not (directory / SOURCE_FILE).exists():
        os.replace(legacy, directory / SOURCE_FILE)
        renamed = True
    if renamed:
        _fsync_dir(directory)


def directory_export_name(directory: str | os.PathLike[str]) -> str:
    """The export name a new directory gets when none is given: its base name (cut to what a
    name may hold) and a digest of its absolute path.

    So two directories never share a feed consumer group by default (two sharing one refuse
    each other: trimming follows the group), and a directory removed and exported into again
    at the same path takes over its predecessor's group instead of leaving it to hold back
    feed trimming. The name is recorded in the directory's `SOURCE_FILE`, so a directory that
    is moved keeps its own.
    """
    path = os.path.abspath(directory)
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(path))[:32] or "root"
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:12]
    return f"{base}-{digest}"


def _check_source(directory: Path, recorded: _Source, asked: _Source) -> None:
    """Raise `ExportSourceError` unless ``asked`` is the source the directory holds."""
    if recorded.namespace != asked.namespace:
        raise ExportSourceError(
            f"{directory} holds an export of {recorded.describe()}; asked to export "
            f"{asked.describe()}: one directory holds one namespace's export; export "
            f"{asked.namespace!r} to another directory"
        )
    if recorded.store != asked.store:
        raise ExportSourceError(
            f"{directory} holds an export of {recorded.describe()}, but the store now holds "
            f"{asked.describe()}: another server, or the data was flushed or replaced since "
            f"(its feed positions no longer apply); export to a new directory"
        )
    if recorded.name != asked.name:
        raise ExportSourceError(
            f"{directory} was exported under the name {recorded.name!r}, not {asked.name!r}: "
            f"the name keeps the directory's feed consumer group; use --name {recorded.name}"
        )


def _newest_part_says(directory: Path) -> tuple[str, tuple[str, ...]] | None:
    """The namespace and the columns of the newest part with a row (an older directory's
    source record, lost or never written)."""
    for path in sorted(directory.glob("part-*"), reverse=True):
        try:
            if path.suffix == ".ndjson":
                with open(path, "rb") as f:
                    line = f.readline()
                if line.strip():
                    row = json.loads(line)
                    return str(row["namespace"]), tuple(row)
            elif path.suffix == ".parquet":
                import pyarrow.parquet as pq

                with open(path, "rb") as f:  # a file, not a name pyarrow may not take
                    part = pq.ParquetFile(f)
                    if part.metadata.num_rows:
                        first = part.read_row_group(0, columns=["namespace"])[0][0].as_py()
                        return str(first), tuple(part.schema_arrow.names)
        except Exception:  # a part that does not say (damaged, edited): an older one may
            continue
    return None


def _before(position: str) -> str | None:
    """The stream id just below ``position`` (None below ``0-0``)."""
    ms, n = parse_stream_id(position)
    if n:
        return f"{ms}-{n - 1}"
    return f"{ms - 1}-{2**64 - 1}" if ms else None


async def _on_feed(store: EventStore, partition: int, position: str) -> bool:
    """Whether the partition's feed holds an entry at ``position``."""
    before = _before(position)
    if before is None:
        return True
    found = await store.read_feed(partition, after=before, count=1)
    return bool(found) and found[0].id == position


def committed_positions(directory: Path) -> tuple[int, dict[int, str]]:
    """The newest committed part number, and the position of every partition: the one the
    newest committed part that names the partition recorded (0 and {} for a fresh directory).

    Also removes what a crashed run left: temporary files, and sidecars without their part
    numbered above every committed part. One numbered below stays: its part was removed or
    moved by hand (compressed, say), and is the directory's record if it is put back; one
    left by a crash is harmless, as positions are read only for parts, and a part of its
    number writes its own sidecar first.
    """
    record = _read_run_record(directory)
    if record is not None and not (directory / SOURCE_FILE).exists():
        # The source record removed (the README's way to start a directory over), the run
        # record left: it speaks for an export that is no more, and goes too.
        (directory / RUN_RECORD_FILE).unlink(missing_ok=True)
        record = None
    parts: list[tuple[int, Path]] = []
    orphans: list[tuple[int, Path]] = []
    for path in sorted(directory.iterdir()):
        name = path.name
        if name.startswith(".part-") and name.endswith(".tmp"):
            path.unlink(missing_ok=True)
            continue
        if name.endswith(_SIDECAR_SUFFIX):
            part = name[: -len(_SIDECAR_SUFFIX)].removeprefix("_")
            if not any((directory / f"{part}.{ext}").exists() for ext in ("ndjson", "parquet")):
                digits = part.removeprefix("part-")
                orphans.append((int(digits) if digits.isdigit() else 0, path))
            continue
        match = _PART_RE.match(name)
        if match:
            sidecar = sidecar_path(path)
            if not sidecar.exists():  # a directory written before 2026-12, not yet renamed
                legacy = directory / f"{path.stem}{_SIDECAR_SUFFIX}"
                sidecar = legacy if legacy.exists() else sidecar
            parts.append((int(match.group(1)), sidecar))
    recorded_part, positions = record if record is not None else (0, {})
    newest = max([recorded_part, *(number for number, _ in parts)])
    for orphan, path in orphans:
        if (parts or record is not None) and orphan > newest:
            path.unlink(missing_ok=True)
    # A single-process run's sidecars name every partition; a parallel run's name only the
    # partitions of the process that wrote them. Merging in part order serves both: within a
    # run a partition belongs to one process, whose part numbers rise, and every run's parts
    # are numbered above every earlier run's. The run record holds the merge up to its part.
    for number, sidecar in sorted(parts):
        if number > recorded_part:
            positions.update(_read_sidecar(sidecar))
    return newest, positions


def _write_run_record(directory: Path, part: int, positions: dict[int, str]) -> None:
    """Record where a run that committed parts up to ``part`` ended (`RUN_RECORD_FILE`)."""
    record = {"part": part, "positions": {str(p): pos for p, pos in sorted(positions.items())}}
    _atomic_write(directory / RUN_RECORD_FILE, json.dumps(record, indent=1).encode())
    _fsync_dir(directory)


def _read_run_record(directory: Path) -> tuple[int, dict[int, str]] | None:
    """The run record's part number and positions; None without one (a directory from before
    it, or whose runs committed nothing); `ExportSourceError` naming it when damaged."""
    return _read_record(directory / RUN_RECORD_FILE, _run_record_of)


def _run_record_of(raw: Any) -> tuple[int, dict[int, str]]:
    if not isinstance(raw, dict) or set(raw) != {"part", "positions"}:
        raise ValueError("not a run record")
    part = raw["part"]
    if isinstance(part, bool) or not isinstance(part, int) or part < 1:
        raise ValueError(f"part {part!r}")
    return part, _positions_of(raw["positions"])


def _read_sidecar(sidecar: Path) -> dict[int, str]:
    """A committed part's positions; `ExportSourceError` naming the file when it is missing or
    damaged (a directory copied without its sidecars, an edit): a run cannot know where the
    directory stands, and guessing would export a hole or duplicates."""
    found = _read_record(sidecar, _positions_of)
    if found is None:
        part = sidecar.name[: -len(_SIDECAR_SUFFIX)].removeprefix("_")
        raise ExportSourceError(
            f"{sidecar.parent} has {part} without its positions ({sidecar.name}): the "
            f"directory does not say how far it was exported; restore the file, or export "
            f"to a new directory"
        )
    return found


def _positions_of(raw: Any) -> dict[int, str]:
    """Feed positions by partition, as a record holds them (``{"0": "<stream id>"}``)."""
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    out = {int(k): v for k, v in raw.items()}
    for k, v in out.items():
        if k < 0:
            raise ValueError(f"partition {k}")
        parse_stream_id(v)
    return out


def _read_record(path: Path, parse: Callable[[Any], T]) -> T | None:
    """A directory record (JSON) as ``parse`` makes it, None when there is none; damaged
    (``parse`` raised ValueError or InvalidInputError), `ExportSourceError` naming it."""
    try:
        return parse(json.loads(path.read_bytes()))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InvalidInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, InvalidInputError) as exc:
        raise ExportSourceError(
            f"{path} is damaged ({exc}): the directory does not say how far it was exported; "
            f"restore the file, or export to a new directory"
        ) from None


class Exporter:
    """Exports a namespace's events to ``directory``, incrementally.

    ``rows_per_part`` bounds a part file; ``batch`` is the feed entries read per call.

    ``workers`` shares the partitions out among that many processes: this one and
    ``workers - 1`` it spawns (at most one per partition). The spawned workers open their own
    connections from ``settings``, which must describe this store (its URL; a ``memory://``
    store cannot be shared between processes). The default, 1, exports in this process and
    starts none: a library call should not start processes unasked. ``"auto"`` (the
    ``threadlog`` command's default) picks one process per CPU, at most `AUTO_WORKERS_MAX` and
    one per partition, for a run that finds at least `PARALLEL_MIN_EVENTS` events waiting, and
    this process alone otherwise (or without ``settings``, or for an in-memory store). A worker
    that goes ``worker_timeout`` seconds without reporting (a chunk written, a partition
    claimed) is declared hung and stopped.

    ``pause_gc`` is for a process that does nothing else while it exports (the ``threadlog``
    command, a batch job): the cyclic garbage collector is paused for the run and run once
    every `GC_EVERY_CHUNKS` chunks instead. The reads build two lists per event that live until
    the chunk is decoded, and the collector's passes over them cost ~1 us/event (reference
    counting still frees everything as before). Worker processes always run this way; an
    application that embeds the exporter keeps its collector unless it asks.

    ``name`` (the feed consumer group ``export-<name>``) defaults to the directory's own: the
    one its `SOURCE_FILE` records, else `directory_export_name` for a new directory (`LEGACY_NAME`
    for one from before source records), so two directories never share a group unasked.
    ``compression`` is Parquet's codec (default `DEFAULT_COMPRESSION`); NDJSON parts are plain.

    A directory holds one source's export (`SOURCE_FILE`: namespace, data set id, ``name``);
    ``workers=N`` is a maximum: a run starts no more processes than there are partitions
    with changes waiting.

    Raises `InvalidInputError` for a bad format, view name, worker count or settings;
    `run` raises `ExportSourceError` for a directory of another source (or positions the
    store contradicts), `InvalidInputError` for ``since`` on a directory that has positions,
    `ExportBusyError` while another run writes into the same directory, a
    worker's own error as itself (`CorruptEventError`, `StoreConnectionError`, ...), and
    `ExportWorkerError` when a worker dies or hangs.
    """

    def __init__(
        self,
        store: EventStore,
        directory: str | os.PathLike[str],
        *,
        fmt: Format = "parquet",
        name: str | None = None,
        batch: int = 2048,
        rows_per_part: int = 1_000_000,
        workers: int | Literal["auto"] = 1,
        settings: StoreSettings | None = None,
        worker_timeout: float = 300.0,
        pause_gc: bool = False,
        compression: Compression | None = None,
    ) -> None:
        if fmt not in ("ndjson", "parquet"):
            raise InvalidInputError(f"unknown export format {fmt!r} (ndjson or parquet)")
        if compression is not None and fmt != "parquet":
            # NDJSON parts are written plain (a reader globs part-*.ndjson); a codec asked
            # for them would silently do nothing.
            raise InvalidInputError(
                f"compression {compression!r} applies to Parquet parts only; NDJSON parts are "
                "written uncompressed (drop the compression, or export --format parquet)"
            )
        if compression is not None and compression not in COMPRESSIONS:
            raise InvalidInputError(
                f"unknown Parquet compression {compression!r} ({', '.join(COMPRESSIONS)})"
            )
        if not os.fspath(directory).strip():
            # Path("") is the working directory: an empty --out would export into it.
            raise InvalidInputError("the export directory is empty; give a directory name")
        self.compression: Compression = compression or DEFAULT_COMPRESSION
        if name is not None:
            try:
                validate_view_name(name)
                validate_view_name(f"export-{name}")  # the group's name must fit too
            except InvalidInputError:
                # Said as the export name it is, not as a view name (or as the group's name,
                # which the caller did not give).
                text = str(name)
                shown = text if len(text) <= 64 else f"{text[:61]}..."
                raise InvalidInputError(
                    f"export name {shown!r} must be 1-{64 - len('export-')} characters of "
                    "A-Z a-z 0-9 _ . - (its feed consumer group is export-<name>)"
                ) from None
        self.adaptive = workers == "auto"
        if workers == "auto":
            shareable = isinstance(store, RedisEventStore) and settings is not None
            if not shareable or settings is None or settings.scheme == "memory":
                workers = 1
            else:
                workers = min(os.cpu_count() or 1, AUTO_WORKERS_MAX)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InvalidInputError(
                f"workers must be a whole number >= 1 or 'auto', not {workers!r}"
            )
        validate_count(batch, "batch", minimum=1)
        validate_count(rows_per_part, "rows_per_part", minimum=1)
        if not worker_timeout > 0:
            raise InvalidInputError(f"worker_timeout must be > 0 seconds, not {worker_timeout!r}")
        count = min(workers, store.partitions)
        if count > 1:
            if settings is None:
                raise InvalidInputError(
                    "an export with workers > 1 needs the store's settings: each worker "
                    "process opens its own connection"
                )
            if settings.scheme == "memory" or not isinstance(store, RedisEventStore):
                raise InvalidInputError(
                    "an in-memory store cannot be shared with worker processes; use workers=1"
                )
            if settings.namespace != store.namespace:
                raise InvalidInputError(
                    f"the settings name namespace {settings.namespace!r}, "
                    f"the store {store.namespace!r}"
                )
            # Workers check the partition count they open against this store's.
            settings = replace(settings, partitions=store.partitions)
        self.store = store
        self.directory = Path(directory)
        self.fmt: Format = fmt
        self.given_name = name
        self.name = name or LEGACY_NAME
        """The export name; with none given, settled by `run` (the directory's own)."""
        self.group = f"export-{self.name}"
        self.columns: tuple[str, ...] = COLUMNS  # settled by a run (`_claim_directory`)
        self.batch = batch
        self.rows_per_part = rows_per_part
        self.workers = count
        """The most processes a run uses (``"auto"``: for a large enough backlog)."""
        self.settings = settings
        self.worker_timeout = float(worker_timeout)
        self.pause_gc = pause_gc

    async def run(
        self,
        *,
        since: datetime | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> ExportResult:
        """Export every change after the committed positions, up to the newest change on the
        feeds when the run starts (changes appended meanwhile are the next run's); returns
        what was written.

        ``since`` starts a new directory at that time: events recorded before it are never
        exported into it (later runs continue from where this one ended). It is refused on a
        directory that has positions, where it would skip events for good; a run with it that
        finds nothing since the time commits nothing, leaving the directory new.
        ``progress`` gets the running count of rows written.
        """
        if since is not None and not isinstance(since, datetime):
            raise InvalidInputError(f"since must be a datetime, not {since!r}")
        since_ms = int(since.timestamp() * 1000) if since is not None else None
        paused = self.pause_gc and gc.isenabled()
        if paused:
            gc.disable()
        try:
            for _ in range(_PREPARE_ATTEMPTS):
                made = await anyio.to_thread.run_sync(self._prepare_directory)
                try:
                    return await self._run(since_ms, progress, made)
                except _DirectoryRemoved:
                    # Another run made the directory, had nothing to commit and removed it
                    # between this run's finding it and taking its lock: made again.
                    continue
            raise ExportBusyError(
                f"other export runs into {self.directory} kept removing it (each made it and "
                "had nothing to commit); run again"
            )
        finally:
            if paused:
                gc.enable()

    def _prepare_directory(self) -> list[Path]:
        """The output directory, made if missing; refused, with a clear error, when it is a
        file or already holds the other format's parts (a glob over one format would then
        silently miss rows). Returns the directories it made, outermost first."""
        if self.directory.exists() and not self.directory.is_dir():
            raise InvalidInputError(f"cannot export to {self.directory}: it is not a directory")
        made: list[Path] = []
        target = self.directory.absolute()
        # Made level by level, so that only what this run made is in ``made`` (another run
        # may make, or remove, the same directories meanwhile).
        for path in [*reversed(target.parents), target]:
            if path.is_dir():
                continue
            try:
                path.mkdir()
                made.append(path)
            except FileExistsError:
                if not path.is_dir():  # a file, or removed again at once: said as a file
                    raise InvalidInputError(
                        f"cannot export to {self.directory}: {path} is not a directory"
                    ) from None
            except OSError as exc:
                raise InvalidInputError(
                    f"cannot export to {self.directory}: {exc.strerror or exc}"
                ) from None
        other = "ndjson" if self.fmt == "parquet" else "parquet"
        if next(self.directory.glob(f"part-*.{other}"), None) is not None:
            raise InvalidInputError(
                f"{self.directory} holds {other} parts; export {self.fmt} to another directory "
                f"(each directory keeps one format, so its parts read as one table)"
            )
        return made

    async def _run(
        self, since_ms: int | None, progress: Callable[[int], None] | None, made: list[Path]
    ) -> ExportResult:
        with _run_lock(self.directory):
            await _fence_earlier_workers(self.directory)
            await anyio.to_thread.run_sync(_rename_legacy_records, self.directory)
            number, positions = await anyio.to_thread.run_sync(committed_positions, self.directory)
            if positions:
                return await self._run_from(number, positions, since_ms, progress, None)
            await self._check_parts_kept()
            # A new directory: a run refused, failed or with nothing to commit leaves it as it
            # found it, with no source recorded and the export's group as it was (none, or a
            # predecessor's at its position): a group left at 0-0 would hold every change of
            # the feed back from trimming for as long as nobody exports there again.
            undo = _Undo()
            try:
                result = await self._run_from(number, positions, since_ms, progress, undo)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    _, committed = await anyio.to_thread.run_sync(
                        committed_positions, self.directory
                    )
                    if not committed:
                        # Best effort: the error that stopped the run is the one to report.
                        with contextlib.suppress(EventStoreError, OSError):
                            await self._leave_new(undo)
                        _remove_made(self.directory, made)
                raise
            if not result.files:
                await self._leave_new(undo)
                _remove_made(self.directory, made)
            return result

    async def _check_parts_kept(self) -> None:
        """Refuse a directory that has no part but records this source, whose group has read
        changes: its parts were removed, moved or renamed (compressed: ``part-*.ndjson.gz``),
        and a run would export every change again. (A first run that stopped before its first
        commit leaves the record with the group where it started, which is no refusal.)"""
        recorded = await anyio.to_thread.run_sync(_read_source, self.directory)
        if recorded is None or recorded.namespace != self.store.namespace:
            return
        if self.given_name not in (None, recorded.name):
            return
        if recorded.store != await self.store.namespace_id():
            return
        group = f"export-{recorded.name}"
        for p in range(self.store.partitions):
            for info in await self.store.feed_groups(p):
                if info.name == group and parse_stream_id(info.last_delivered) > (0, 0):
                    raise ExportSourceError(
                        f"{self.directory} holds no part, but it recorded exporting "
                        f"{recorded.describe()} under the name {recorded.name!r}, whose feed "
                        f"group has read up to {info.last_delivered} in partition {p}: its "
                        f"parts were removed, moved or renamed, and a run would export every "
                        f"change again; put them back, export into a new directory, or "
                        f"remove {SOURCE_FILE} to export everything into it again"
                    )

    async def _leave_new(self, undo: _Undo) -> None:
        """Undo what a run into a new directory that committed nothing did."""
        for p in sorted(undo.made):
            await self.store.delete_feed_group(p, self.group)
        for p, position in sorted(undo.moved.items()):
            await self.store.advance_feed_group(p, self.group, position)
        await anyio.to_thread.run_sync(_remove_source, self.directory)

    async def _run_from(
        self,
        number: int,
        positions: dict[int, str],
        since_ms: int | None,
        progress: Callable[[int], None] | None,
        undo: _Undo | None,
    ) -> ExportResult:
        """The run on from the committed ``positions`` (the last part's ``number``); ``undo``
        (a new directory's run) is told where the export's group stood before it was touched."""
        if since_ms is not None and positions:
            raise InvalidInputError(
                f"since (--since) only starts a new export directory: {self.directory} "
                f"already continues from its committed positions, and events before the "
                f"time would be skipped for good; run without it, or export to a new "
                f"directory"
            )
        delivered, start_ms = await self._claim_directory(positions, since_ms)
        # A directory started at a time keeps it: a run that finishes an interrupted one reads
        # the partitions that run did not reach from their start, where the events before the
        # time are.
        since_ms = start_ms
        floors = await self._check_not_trimmed(positions, since_ms, delivered)
        # Where each partition is read from: its position, or the feed's trim record as the
        # check accepted it when that is later (entries up to it are gone either way). From
        # there every read checks the record again, so a trim landing after the check (by age,
        # while a new directory's groups are being made) stops the run instead of leaving a
        # hole at the directory's start.
        read_from = {
            p: max(positions.get(p, "0-0"), floor, key=parse_stream_id)
            for p, floor in floors.items()
        }
        for p in range(self.store.partitions):
            start = positions.get(p, "0-0")
            created = await self.store.create_feed_group(p, self.group, start=start)
            if created and undo is not None:
                undo.made.add(p)
            if not created and not positions:
                # A new directory takes over the group an abandoned one left (a directory
                # still in use was refused above): trimming waits for this one now.
                if undo is not None:
                    groups = await self.store.feed_groups(p)
                    undo.moved.update((p, g.last_delivered) for g in groups if g.name == self.group)
                await self.store.advance_feed_group(p, self.group, start)
        # Where the run ends: each feed's newest entry now. A run that read on until a feed was
        # empty would never end while writers keep pace with it; what they append meanwhile
        # is the next run's.
        ends = {p: (await self.store.feed_info(p)).last_id for p in range(self.store.partitions)}
        workers = self.workers
        busy: int | None = None
        if workers > 1:
            # A process with no partition to claim would only start and stop.
            busy = await self._busy_partitions(positions)
            workers = min(workers, max(busy, 1))
        small = self.adaptive and workers > 1
        if small and not await self._backlog_reaches(positions, PARALLEL_MIN_EVENTS):
            workers = 1
        if workers > 1:
            result = await self._run_parallel(
                workers, number, positions, read_from, ends, since_ms, progress
            )
        else:
            state = _RunState(number + 1, 1, dict(positions))
            partitions = iter(range(self.store.partitions))

            async def claim() -> int | None:
                return next(partitions, None)

            pipeline = self._pipeline(
                self.store, 1, state, read_from, ends, since_ms, claim, progress
            )
            await pipeline.run()
            result = state.result()
        result = msgspec.structs.replace(result, busy_partitions=busy)
        empty = not result.events + result.tombstones
        if since_ms is not None and not positions and result.files and empty:
            result = await self._discard_empty_run(result)
        if result.files:
            # Every part of the run is committed: where it ended, recorded apart from them.
            last = max(int(_PART_RE.match(Path(f).name).group(1)) for f in result.files)  # type: ignore[union-attr]
            await anyio.to_thread.run_sync(
                _write_run_record, self.directory, last, dict(result.positions)
            )
        return result

    async def _claim_directory(
        self, positions: dict[int, str], since_ms: int | None
    ) -> tuple[dict[int, str], int | None]:
        """Check that the directory holds this run's source, recording it in a new (or older)
        directory (with ``since_ms``, the time a new one starts at), and settle the export
        name; raises `ExportSourceError` otherwise.

        Returns where the export's consumer group stands per partition that has it (read
        only for a directory with positions, else empty), for the run's later checks: read
        once a run, as each read is an XINFO GROUPS and an XPENDING per group; and the time the
        directory starts at (its recorded one, once it has positions). Settles the columns too
        (those its parts have, once it has positions: a new column is for new directories).
        """
        recorded = await anyio.to_thread.run_sync(_read_source, self.directory)
        # A source binds a directory once it has positions: before that there is nothing a
        # wrong source could skip or duplicate, and a record left by a run that exported
        # nothing (on memory://, a new data set every process) must not refuse a real one.
        bound = recorded if positions else None
        if self.given_name is not None:
            name = self.given_name
        elif bound is not None:
            name = bound.name
        elif positions:
            name = LEGACY_NAME  # a directory from before sources: the default of its time
        else:
            name = await anyio.to_thread.run_sync(directory_export_name, self.directory)
        self.name, self.group = name, f"export-{name}"
        # A directory keeps the columns of its first run, whatever columns came since: its
        # parts stay one table. One from before source records has those of its parts (older
        # than the incarnation column, unless its record was lost since).
        found = None
        if bound is not None:
            columns = bound.columns
        elif positions:
            found = await anyio.to_thread.run_sync(_newest_part_says, self.directory)
            columns = found[1] if found is not None and found[1] == COLUMNS else LEGACY_COLUMNS
        else:
            columns = COLUMNS
        asked = _Source(
            namespace=self.store.namespace,
            store=await self.store.namespace_id(),
            name=name,
            url=redact(self.settings.url) if self.settings is not None else None,
            # (An older directory with positions and no record started at no time.)
            since_ms=bound.since_ms if bound is not None else None if positions else since_ms,
            columns=columns,
        )
        if bound is not None:
            _check_source(self.directory, bound, asked)
        elif found is not None and found[0] != asked.namespace:
            # A directory from before sources were recorded: its rows name their namespace,
            # and the checks below on the feeds and the group stand in for the data set's id.
            raise ExportSourceError(
                f"{self.directory} holds an export of namespace {found[0]!r}, not of "
                f"{asked.namespace!r}: one directory holds one namespace's export; "
                f"export {asked.namespace!r} to another directory"
            )
        delivered: dict[int, str] = {}
        if positions:
            delivered = await self._group_positions()
            await self._check_positions(positions, delivered)
        if bound is None or (asked.url is not None and bound.url != asked.url):
            await anyio.to_thread.run_sync(_write_source, self.directory, asked)
        self.columns = asked.columns
        return delivered, asked.since_ms

    async def _group_positions(self) -> dict[int, str]:
        """The last entry delivered to the export's consumer group, per partition that has it."""
        found: dict[int, str] = {}
        for p in range(self.store.partitions):
            for group in await self.store.feed_groups(p):
                if group.name == self.group:
                    found[p] = group.last_delivered
        return found

    async def _check_not_trimmed(
        self, positions: dict[int, str], since_ms: int | None, delivered: dict[int, str]
    ) -> dict[int, str]:
        """Refuse to start where the feed no longer holds every change after the start
        (``delivered``: where the export's group stands, as `_claim_directory` read it).
        Returns each partition's trim record (max-deleted-entry-id) as it was checked.

        Trimming waits for the directory's group, so this is a trim by age (or by hand), a
        group dropped meanwhile, or a new directory on a feed trimmed before it: reading on
        from what the feed still holds would leave a hole, silently.
        """
        lacking: list[tuple[tuple[int, int], int, str]] = []  # trimmed to, partition, id
        floors: dict[int, str] = {}
        for p in range(self.store.partitions):
            info = await self.store.feed_info(p)
            floors[p] = info.trimmed_to
            trimmed = parse_stream_id(info.trimmed_to)
            if since_ms is not None and trimmed[0] < since_ms:
                # Every trimmed change is older than the directory's start: none it needs.
                # (A position is a change it exported, never older than the start; the group
                # of a partition it has had no change from may stand before the trim, as it
                # was made at the feed's start.)
                continue
            start = positions.get(p)
            if start is None and positions:
                # A partition the directory has had no change from: its group, made at the
                # directory's first run, has held trimming back there since.
                start = delivered.get(p)
            if start is None:  # a partition this directory has not read yet: from the start
                if trimmed > (0, 0):
                    lacking.append((trimmed, p, info.trimmed_to))
                continue
            if trimmed > parse_stream_id(start):
                raise ExportSourceError(
                    f"the change feed of partition {p} of namespace {self.store.namespace!r} "
                    f"was trimmed past {self.directory}'s position ({start}; entries up to "
                    f"{info.trimmed_to} removed, {_fmt_ms(trimmed[0])}): the changes in "
                    f"between are gone from the feed (every event is still in its thread's "
                    f"log), so the directory cannot continue without a hole; trim only what "
                    f"the export has read (threadlog trim-feed without --max-age), and start "
                    f"a new directory with --since"
                )
        if lacking:
            # The time to pass is the one after the latest trim of them all: each partition's
            # own, said first, was refused as it stood (a change of that millisecond may be
            # gone) and left the partitions trimmed later refused still.
            trimmed, p, trimmed_to = max(lacking)
            when = _fmt_ms(trimmed[0])
            others = len(lacking) - 1
            also = f", and {_other_partitions(others)} up to before then" if others else ""
            raise ExportSourceError(
                f"the change feed of partition {p} of namespace {self.store.namespace!r} "
                f"was trimmed up to {trimmed_to} ({when}){also}: an export into "
                f"{self.directory} would start after it and lack every change before "
                f"(every event is still in its thread's log); to export what follows, "
                + (
                    # --since starts a new directory only: on this one it is refused.
                    f"export into a new directory with --since {_fmt_ms(trimmed[0] + 1)} or later"
                    if positions
                    else f"pass --since {_fmt_ms(trimmed[0] + 1)} or later"
                )
            )
        return floors

    async def _check_positions(self, positions: dict[int, str], delivered: dict[int, str]) -> None:
        """Refuse positions the store contradicts: a position that is not on its partition's
        feed although the feed holds entries before it (the feed was reset, or is another
        one: those entries would never be exported), and a consumer group ahead of the
        directory (``delivered``: where it stands; another directory exports under the same
        name)."""
        store = self.store
        for p, position in sorted(positions.items()):
            if p >= store.partitions:
                raise ExportSourceError(
                    f"{self.directory} has a position in partition {p}, but namespace "
                    f"{store.namespace!r} has {store.partitions} partitions: it holds another "
                    f"store's export; export to another directory"
                )
            if await _on_feed(store, p, position):
                continue
            first = await store.read_feed(p, count=1)
            if first and parse_stream_id(first[0].id) < parse_stream_id(position):
                raise ExportSourceError(
                    f"{self.directory} is at {position} in partition {p}, which the feed of "
                    f"namespace {store.namespace!r} does not hold although it holds entries "
                    f"before it (from {first[0].id}): the store was flushed, restored or "
                    f"replaced since, or the directory holds another store's export; export "
                    f"to a new directory"
                )
        for p, last_delivered in sorted(delivered.items()):
            if parse_stream_id(last_delivered) > parse_stream_id(positions.get(p, "0-0")):
                raise ExportSourceError(
                    f"the feed consumer group {self.group!r} of namespace "
                    f"{store.namespace!r} is ahead of {self.directory} (partition {p}: "
                    f"{last_delivered}, the directory {positions.get(p, '0-0')}): "
                    f"another export directory uses the export name {self.name!r}, and "
                    f"this one cannot continue under it (feed trimming follows the group, "
                    f"so it may have removed changes this directory has not exported); "
                    f"export into a new directory, without --name (each new directory then "
                    f"gets a name of its own)"
                )

    async def _busy_partitions(self, positions: dict[int, str]) -> int:
        """How many partitions have changes waiting past ``positions``."""
        busy = 0
        for p in range(self.store.partitions):
            if await self.store.read_feed(p, after=positions.get(p, "0-0"), count=1):
                busy += 1
        return busy

    async def _discard_empty_run(self, result: ExportResult) -> ExportResult:
        """Undo a ``since`` run that found nothing since the time: its parts are empty, and
        keeping their positions would skip every earlier event for good although the directory
        holds nothing yet. The directory stays new (`_leave_new` puts the group back)."""

        def remove() -> None:
            for name in result.files:
                part = Path(name)
                part.unlink(missing_ok=True)
                sidecar_path(part).unlink(missing_ok=True)
            _fsync_dir(self.directory)

        await anyio.to_thread.run_sync(remove)
        return msgspec.structs.replace(result, files=[], positions={})

    async def _backlog_reaches(self, positions: dict[int, str], events: int) -> bool:
        """Whether at least ``events`` events wait past ``positions``.

        Counted from the feeds, stopping as soon as there are enough: at most the entries of
        ``events`` events are read twice (a log appended a turn at a time: ~100,000 entries,
        ~0.2 s), and a small backlog's entries once more, which is cheap beside its export.
        """
        total = 0
        for p in range(self.store.partitions):
            after = positions.get(p, "0-0")
            while entries := await self.store.read_feed(p, after=after, count=self.batch):
                total += sum(e.last_seq - e.first_seq + 1 for e in entries if not e.deleted)
                if total >= events:
                    return True
                after = entries[-1].id
        return False

    def _pipeline(
        self,
        store: EventStore,
        workers: int,
        state: _RunState,
        start: dict[int, str],
        end: dict[int, str],
        since_ms: int | None,
        claim: Callable[[], Awaitable[int | None]],
        progress: Callable[[int], None] | None,
        guard: Callable[[], None] | None = None,
    ) -> _Pipeline:
        return _Pipeline(
            store,
            self.directory,
            self.fmt,
            self.group,
            self.batch,
            self.rows_per_part,
            start=start,
            end=end,
            since_ms=since_ms,
            state=state,
            claim=claim,
            progress=progress,
            guard=guard,
            chunk_events=CHUNK_EVENTS if workers == 1 else PARALLEL_CHUNK_EVENTS,
            collect=self.pause_gc,
            compression=self.compression,
            columns=self.columns,
        )

    async def _run_parallel(
        self,
        workers: int,
        number: int,
        positions: dict[int, str],
        read_from: dict[int, str],
        ends: dict[int, str],
        since_ms: int | None,
        progress: Callable[[int], None] | None,
    ) -> ExportResult:
        assert self.settings is not None
        partitions = iter(range(self.store.partitions))
        counts = [0] * workers

        def report(worker: int, rows: int) -> None:
            counts[worker] = rows
            if progress is not None:
                progress(sum(counts))

        async def claim() -> int | None:
            return next(partitions, None)

        own = _RunState(number + 1, workers, {})
        children: list[_Child] = []
        try:
            for worker in range(1, workers):
                job = _WorkerJob(
                    worker=worker,
                    first_number=number + 1 + worker,
                    step=workers,
                    settings=self.settings,
                    directory=str(self.directory),
                    fmt=self.fmt,
                    group=self.group,
                    batch=self.batch,
                    rows_per_part=self.rows_per_part,
                    since_ms=since_ms,
                    start=read_from,
                    end=ends,
                    parent_pid=os.getpid(),
                    timeout=self.worker_timeout,
                    compression=self.compression,
                    columns=self.columns,
                )
                children.append(_Child.start(job))
            async with anyio.create_task_group() as tg:
                own_progress = (lambda rows: report(0, rows)) if progress is not None else None
                pipeline = self._pipeline(
                    self.store, workers, own, read_from, ends, since_ms, claim, own_progress
                )
                tg.start_soon(pipeline.run)
                tg.start_soon(_supervise, children, partitions, report, self.worker_timeout)
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        finally:
            with anyio.CancelScope(shield=True):
                await _reap(children)
        done = [own.result(), *(c.result for c in children if c.result is not None)]
        merged = dict(positions)
        for result in done:
            merged.update(result.positions)
        return ExportResult(
            files=sorted((f for r in done for f in r.files), key=lambda f: Path(f).name),
            events=sum(r.events for r in done),
            tombstones=sum(r.tombstones for r in done),
            positions=merged,
            workers=workers,
        )


class _Pipeline:
    """One process's share of a run: reads, decodes and writes the partitions it claims."""

    def __init__(
        self,
        store: EventStore,
        directory: Path,
        fmt: Format,
        group: str,
        batch: int,
        rows_per_part: int,
        *,
        start: dict[int, str],
        end: dict[int, str],
        since_ms: int | None,
        state: _RunState,
        claim: Callable[[], Awaitable[int | None]],
        progress: Callable[[int], None] | None,
        guard: Callable[[], None] | None,
        chunk_events: int,
        collect: bool,
        compression: Compression = DEFAULT_COMPRESSION,
        columns: tuple[str, ...] = COLUMNS,
    ) -> None:
        self.store = store
        self.columns = columns
        self.compression: Compression = compression
        self.chunk_events = chunk_events
        self.collect = collect
        self.directory = directory
        self.fmt: Format = fmt
        self.group = group
        self.batch = batch
        self.rows_per_part = rows_per_part
        self.start = start
        self.end = {p: parse_stream_id(last) for p, last in end.items()}
        """Per partition, the feed id the run ends at (none given: the feed's end)."""
        self.since_ms = since_ms
        self.state = state
        self.claim = claim
        self.progress = progress
        self.guard = guard
        # (thread, life): lives whose deletion was found on the feed
        self._deletions: set[tuple[str, int]] = set()
        # Payload bytes per event of the last piece decoded (None: none decoded yet).
        self._event_bytes: int | None = None

    def _read_budget(self) -> int:
        """Events the next read may ask for: `PAGE`, fewer for large events (`READ_BYTES`)."""
        if self._event_bytes is None:
            return FIRST_READ
        return max(1, min(PAGE, READ_BYTES // max(1, self._event_bytes)))

    async def run(self) -> None:
        read_send, read_receive = anyio.create_memory_object_stream[_Piece](1)
        rows_send, rows_receive = anyio.create_memory_object_stream[_Decoded](1)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read, read_send)
                tg.start_soon(self._decode, read_receive, rows_send)
                tg.start_soon(self._write, rows_receive)
        except BaseExceptionGroup as group:
            # The stage that failed first says what went wrong; the others were cancelled.
            raise _first_error(group) from None

    # -- the three stages -----------------------------------------------------------------------

    async def _read(self, send: MemoryObjectSendStream[_Piece]) -> None:
        async with send:
            while (p := await self.claim()) is not None:
                after = self.start.get(p, "0-0")
                end = self.end.get(p)
                # The start was checked against the trim record (`_check_not_trimmed`) and is
                # at or after it: a record moved past it since is a hole, from the first read.
                reader = f"export {self.directory}"
                while True:
                    try:
                        entries = await self.store.read_feed(
                            p, after=after, count=self.batch, reader=reader
                        )
                    except FeedTrimmedError as exc:
                        raise ExportSourceError(
                            f"the change feed of partition {p} was trimmed (by age, or by "
                            f"hand) while this export read it, past what it had read ({after}; "
                            f"entries up to {exc.trimmed_to} removed): the changes in between "
                            "are gone from the feed (every event is still in its thread's "
                            "log), so the directory cannot continue without a hole; trim only "
                            "what the export has read (threadlog trim-feed without "
                            "--max-age), and start a new directory with --since"
                        ) from None
                    reached = False
                    if end is not None and entries and parse_stream_id(entries[-1].id) > end:
                        entries = [e for e in entries if parse_stream_id(e.id) <= end]
                        reached = True
                    if not entries:
                        break
                    for run in _chunks(entries, self.chunk_events):
                        if self.guard is not None:
                            self.guard()
                        chunk = _Chunk(p, run)
                        # A tombstone's chunk, or (damaged feed entries) one naming no seqs,
                        # still goes through as one empty piece: its position is reached.
                        todo = [] if run[0].deleted else _pages(run)[::-1]
                        if not todo:
                            await send.send(_Piece(chunk, [], True))
                        while todo:
                            # Sized by the events the decoder has seen so far: bounded in
                            # bytes as well as in events.
                            pages = _next_read(todo, self._read_budget())
                            # The decoder works on the previous piece meanwhile (the stream
                            # holds one), so the server answers this read during that work.
                            read: list[_ReadPage] = []
                            for thread, lo, hi, life, page in await self._read_log(pages):
                                if not page and life is not None:
                                    await self._require_deletion(p, after, thread, life, lo)
                                read.append((thread, lo, hi, life, page))
                            await send.send(_Piece(chunk, read, not todo))
                    after = entries[-1].id
                    if reached:
                        break

    async def _read_log(
        self, pages: list[_Page]
    ) -> list[tuple[str, int, int, int | None, list[Any]]]:
        """The entries of each page: none when the thread is no longer in the page's
        incarnation (deleted, or deleted and created again: its seqs now name other events)."""
        # Every range is a set of dense ``<seq>-0`` ids, so a page holds at most PAGE entries;
        # COUNT one more keeps a damaged log (foreign entries) from growing a reply unbounded.
        ranges = [RawRange(thread, lo, hi, life) for thread, lo, hi, life in pages]
        found = await self.store.read_raw_ranges(ranges, count=PAGE + 1)
        return [
            (thread, lo, hi, life, entries)
            for (thread, lo, hi, life), entries in zip(pages, found, strict=True)
        ]

    async def _require_deletion(
        self, partition: int, after: str, thread: str, life: int, seq: int
    ) -> None:
        """A page that reads as nothing because its thread left the page's life is skipped
        only if the feed records that life's deletion (after the change that named the page;
        the store writes the tombstone with the deletion). Without one, the thread's meta no
        longer names the life its own changes name: damage, which is never exported as a
        deletion that did not happen."""
        if (thread, life) in self._deletions:
            return
        cursor = after
        while entries := await self.store.read_feed(partition, after=cursor, count=self.batch):
            for e in entries:
                if e.deleted and e.thread_id == thread and e.incarnation in (life, None):
                    self._deletions.add((thread, life))
                    return
            cursor = entries[-1].id
        raise CorruptEventError(
            thread, seq, f"cannot export: the change feed names this seq in the thread's life "
            f"{life}, its meta hash names another, and no deletion of that life was recorded: "
            "damaged (run 'verify')"
        )  # fmt: skip

    async def _decode(
        self,
        receive: MemoryObjectReceiveStream[_Piece],
        send: MemoryObjectSendStream[_Decoded],
    ) -> None:
        since_ms = self.since_ms
        rows = _Rows()
        async with receive, send:
            async for piece in receive:
                chunk = piece.chunk
                if chunk.entries[0].deleted:
                    for e in chunk.entries:
                        if e.deleted and (since_ms is None or e.time_ms >= since_ms):
                            rows.add_tombstone(e)
                # Decoding builds a few objects per field of every event and no cycles; the
                # collector's passes over them cost a quarter of the decode, for nothing.
                paused = gc.isenabled()
                gc.disable()
                size, count = len(rows.payload), len(rows)
                try:
                    for page in piece.pages:
                        _decode_page(rows, page, since_ms)
                    piece.pages = []  # freed here, while the collector is off
                finally:
                    if paused:
                        gc.enable()
                if len(rows) > count:
                    self._event_bytes = (len(rows.payload) - size) // (len(rows) - count)
                if piece.last:
                    await send.send(_Decoded(chunk, rows))
                    rows = _Rows()
                elif len(rows.payload) >= ROWS_BYTES:
                    # Large events: written before their chunk ends, its position not yet.
                    await send.send(_Decoded(chunk, rows, final=False))
                    rows = _Rows()

    async def _write(self, receive: MemoryObjectReceiveStream[_Decoded]) -> None:
        state, progress = self.state, self.progress
        writer: _PartWriter | None = None
        chunks = 0
        whole = True  # the rows written so far end a chunk
        try:
            async with receive:
                async for item in receive:
                    whole = item.final
                    if writer is None:
                        writer = _PartWriter(
                            self.directory,
                            state.next_number(),
                            self.fmt,
                            self.store.namespace,
                            self.compression,
                            self.columns,
                        )
                    await anyio.to_thread.run_sync(writer.write, item.rows)
                    state.tombstones += item.rows.tombstones
                    state.events += len(item.rows) - item.rows.tombstones
                    if not item.final:  # more rows of its chunk follow, and only then a commit
                        if progress is not None:
                            progress(state.events + state.tombstones)
                        continue
                    state.positions[item.partition] = item.last_id
                    chunks += 1
                    if self.collect and chunks % GC_EVERY_CHUNKS == 0:
                        gc.collect()  # the collector is paused: whatever cycles others made
                    if progress is not None:
                        progress(state.events + state.tombstones)
                    if writer.rows >= self.rows_per_part:
                        state.files.append(str(await self._commit(writer, state.positions)))
                        writer = None
            # The stream ends mid-chunk only when the decoder failed (the task group cancels
            # this stage too, but need not before it gets here): rows of a chunk whose position
            # the part cannot record are never committed, a rerun would export them again.
            if writer is not None and whole:
                state.files.append(str(await self._commit(writer, state.positions)))
                writer = None
        finally:
            if writer is not None:
                writer.abort()

    async def _commit(self, writer: _PartWriter, positions: dict[int, str]) -> Path:
        if self.guard is not None:
            self.guard()  # a worker whose run was called off must not commit
        snapshot = dict(positions)
        path = await anyio.to_thread.run_sync(writer.commit, snapshot)
        for p, position in snapshot.items():
            await self.store.advance_feed_group(p, self.group, position)
        return path


@dataclass
class _Undo:
    """What a run into a new directory changed that it puts back if it commits nothing: the
    partitions where it made the export's group, and where the group stood in those where it
    took over a group an earlier directory of the same name left."""

    made: set[int] = field(default_factory=set)
    moved: dict[int, str] = field(default_factory=dict)


class _RunState:
    """What one process of a run has written so far (owned by its writing stage)."""

    __slots__ = ("events", "files", "number", "positions", "step", "tombstones")

    def __init__(self, first_number: int, step: int, positions: dict[int, str]) -> None:
        self.number = first_number
        self.step = step
        self.positions = positions
        self.files: list[str] = []
        self.events = 0
        self.tombstones = 0

    def next_number(self) -> int:
        """The next part number of this process: rising, and never another process's."""
        number = self.number
        self.number += self.step
        return number

    def result(self) -> ExportResult:
        return ExportResult(
            files=self.files,
            events=self.events,
            tombstones=self.tombstones,
            positions=self.positions,
        )


def _first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


# -- fencing runs ----------------------------------------------------------------------------


class _DirectoryRemoved(Exception):
    """The export directory was removed, with its run lock, before this run held the lock:
    another run made it and removed it, having nothing to commit (`_remove_made`)."""


_PREPARE_ATTEMPTS = 3  # directories made and locked by a run before it gives up (see run)


@contextlib.contextmanager
def _run_lock(directory: Path) -> Iterator[None]:
    """Hold the directory's run lock; two runs at once would export the same changes twice.

    `_DirectoryRemoved` when the lock file is gone, or is not the one locked (unlinked by the
    run that held it, then made again by a third): the lock would fence nothing."""
    path = directory / _RUN_LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        raise _DirectoryRemoved from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ExportBusyError(f"another export run is writing into {directory}") from None
        try:
            current = os.stat(path)
        except FileNotFoundError:
            raise _DirectoryRemoved from None
        locked = os.fstat(fd)
        if (current.st_dev, current.st_ino) != (locked.st_dev, locked.st_ino):
            raise _DirectoryRemoved
        yield
    finally:
        os.close(fd)  # releases the lock


async def _fence_earlier_workers(directory: Path, patience: float = FENCE_TIMEOUT) -> None:
    """Wait until no worker of an earlier run holds the workers' lock.

    A run killed outright (SIGKILL, OOM) releases its run lock at once, but its workers may
    take a moment to follow it (on Linux the kernel kills them; elsewhere they notice at their
    next chunk). Reading positions before they are gone could miss a part one of them commits.
    """
    fd = os.open(directory / _WORKERS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + patience
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ExportWorkerError(
                        f"worker processes of an earlier export run into {directory} are "
                        f"still running after {patience:.0f} s"
                    ) from None
                await anyio.sleep(0.05)
    finally:
        os.close(fd)


# -- worker processes ------------------------------------------------------------------------

# A worker is a fresh interpreter started by this bootstrap, not a multiprocessing child: the
# "spawn" method re-imports the caller's ``__main__`` in every child (a script without an
# ``if __name__ == "__main__"`` guard would run again, or fail), and "fork" would copy a
# running event loop and pyarrow's threads. The bootstrap takes the parent's ``sys.path``
# first, so the worker imports this module from where the parent did.
_BOOTSTRAP = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "sys.path[:] = conn.recv()\n"
    f"from {__name__} import _worker_main\n"
    "_worker_main(conn)\n"
)


@dataclass(frozen=True)
class _WorkerJob:
    """What a worker process needs to export its share of a run (sent pickled at start)."""

    worker: int
    first_number: int
    step: int
    settings: StoreSettings
    directory: str
    fmt: Format
    group: str
    batch: int
    rows_per_part: int
    since_ms: int | None
    start: dict[int, str]
    parent_pid: int
    timeout: float
    compression: Compression = DEFAULT_COMPRESSION
    end: dict[int, str] | None = None
    columns: tuple[str, ...] = COLUMNS


class _Stopped(Exception):
    """A worker's run was called off (another process failed) or its parent is gone."""


class _Child:
    """The parent's handle on one worker process and the socket pair it talks over."""

    def __init__(self, job: _WorkerJob, process: subprocess.Popen[bytes], conn: Connection):
        self.job = job
        self.process = process
        self.conn = conn
        self.last_seen = time.monotonic()
        self.gone = False
        self.result: ExportResult | None = None

    @classmethod
    def start(cls, job: _WorkerJob) -> _Child:
        ours, theirs = socket.socketpair()
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the worker holds the only other end: its exit reads as EOF here
        conn = Connection(ours.detach())
        child = cls(job, process, conn)
        try:
            conn.send(sys.path)
            conn.send(job)
        except OSError:
            child.gone = True  # it died at once; `_supervise` reports how
        return child

    @property
    def name(self) -> str:
        return f"export worker {self.job.worker} (pid {self.process.pid})"

    def drain(self, partitions: Iterator[int], report: Callable[[int, int], None]) -> None:
        """Handle every message waiting; raises what the worker raised."""
        while self.result is None and not self.gone:
            try:
                if not self.conn.poll():
                    return
                message = self.conn.recv()
            except (EOFError, OSError):
                self.gone = True  # the worker exited or died; its exit status says which
                return
            except Exception as exc:  # an error that pickled but does not unpickle
                raise ExportWorkerError(f"{self.name} sent an unreadable message: {exc}") from exc
            self.last_seen = time.monotonic()
            kind = message[0]
            if kind == "claim":
                self.conn.send(next(partitions, None))
            elif kind == "progress":
                report(self.job.worker, message[1])
            elif kind == "done":
                self.result = message[1]
            elif kind == "error":
                error: BaseException = message[1]
                error.add_note(f"raised in {self.name}:\n{message[2]}")
                raise error

    def exit_status(self) -> str:
        try:
            code = self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return "closed its connection without a result"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
            return f"was killed by signal {-code}"
        return f"exited with code {code} before reporting a result"


async def _supervise(
    children: list[_Child],
    partitions: Iterator[int],
    report: Callable[[int, int], None],
    silence: float,
) -> None:
    """Answer the workers' claims and follow them until each has reported its result.

    Every wait is bounded: a worker that dies without a result, or goes ``silence`` seconds
    without a message, raises `ExportWorkerError` (and the run's cleanup stops the others).
    """
    while running := [c for c in children if c.result is None]:
        # In a thread, a fifth of a second at a time: the loop stays free for this process's
        # own share of the export, and a cancelled run is noticed promptly.
        await anyio.to_thread.run_sync(wait, [c.conn for c in running if not c.gone], 0.2)
        now = time.monotonic()
        for child in running:
            child.drain(partitions, report)
            if child.result is not None:
                continue
            if child.gone:
                status = await anyio.to_thread.run_sync(child.exit_status)
                raise ExportWorkerError(f"{child.name} {status}")
            if now - child.last_seen > silence:
                raise ExportWorkerError(f"{child.name} sent nothing for {silence:.0f} s")


async def _reap(children: list[_Child], grace: float = 10.0) -> None:
    """Stop the workers still running (SIGTERM: they abort their open part and exit), wait
    for them, bounded, and kill what is left."""
    for child in children:
        if child.result is None and child.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.terminate()
                os.kill(child.process.pid, signal.SIGCONT)  # a stopped worker must see it
    deadline = time.monotonic() + grace
    for child in children:
        try:
            await anyio.to_thread.run_sync(
                child.process.wait, max(0.01, deadline - time.monotonic())
            )
        except subprocess.TimeoutExpired:
            child.process.kill()
            await anyio.to_thread.run_sync(child.process.wait)  # SIGKILL cannot be refused
        child.conn.close()


def _worker_main(conn: Connection) -> None:
    """A worker process: export the partitions claimed from the parent, report, exit."""
    _die_with_parent()
    stopping: list[int] = []
    # The parent decides when a run stops: Ctrl-C reaches the whole process group, and a
    # worker quitting on its own would only be reported as a failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    # This process runs nothing but its share of the export (see `Exporter`'s ``pause_gc``).
    gc.disable()
    try:
        job: _WorkerJob = conn.recv()
        with open(Path(job.directory) / _WORKERS_LOCK, "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_SH)
            if os.getppid() != job.parent_pid:
                return  # the parent died before the lock was ours: a new run may own the dir
            result = anyio.run(_worker_run, job, conn, stopping)
        conn.send(("done", result))
    except BaseException as exc:  # every failure goes to the parent, typed
        _send_error(conn, exc)
    finally:
        conn.close()


async def _worker_run(job: _WorkerJob, conn: Connection, stopping: list[int]) -> ExportResult:
    store = await open_store(job.settings)
    try:
        state = _RunState(job.first_number, job.step, {})

        def guard() -> None:
            if stopping:
                raise _Stopped("the export run was called off")
            if os.getppid() != job.parent_pid:
                raise _Stopped("the exporting parent process is gone")

        async def claim() -> int | None:
            guard()
            conn.send(("claim",))
            deadline = time.monotonic() + job.timeout
            while not conn.poll():
                guard()
                if time.monotonic() > deadline:
                    raise ExportWorkerError(f"the parent did not answer for {job.timeout:.0f} s")
                await anyio.sleep(0.002)
            partition: int | None = conn.recv()
            return partition

        def progress(rows: int) -> None:
            conn.send(("progress", rows))

        pipeline = _Pipeline(
            store,
            Path(job.directory),
            job.fmt,
            job.group,
            job.batch,
            job.rows_per_part,
            start=job.start,
            end=job.end or {},
            since_ms=job.since_ms,
            state=state,
            claim=claim,
            progress=progress,
            guard=guard,
            chunk_events=PARALLEL_CHUNK_EVENTS,
            collect=True,
            compression=job.compression,
            columns=job.columns,
        )
        await pipeline.run()
        return state.result()
    finally:
        await store.close()


def _send_error(conn: Connection, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(exc)).rstrip()
    try:
        pickle.loads(pickle.dumps(exc))
        error: BaseException = exc
    except Exception:  # an error that cannot travel is described instead
        error = ExportWorkerError(f"{type(exc).__name__}: {exc}")
    with contextlib.suppress(OSError, ValueError):
        conn.send(("error", error, text))


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (elsewhere: the guard notices)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def read_parquet_dir(directory: str | os.PathLike[str]) -> Iterable[dict[str, Any]]:
    """Every committed row of a Parquet export directory (for tests and small checks)."""
    import pyarrow.parquet as pq

    for path in sorted(Path(directory).glob("part-*.parquet")):
        with open(path, "rb") as f:  # a file, not a name pyarrow may not take
            yield from pq.read_table(f).to_pylist()
