"""`ThreadlogCheckpointSaver`: LangGraph checkpoints and pending writes as events in threadlog.

Install with ``pip install threadlog[langgraph]``; the core never imports this module.

One LangGraph thread is one threadlog thread (``lg:<thread id>``), every checkpoint namespace
included, so a thread's keys share one Redis Cluster slot and every call touches one thread.
The log holds what happened:

* `BlobsPut` -- the channel values of the versions a checkpoint introduces (``new_versions``),
  each stored once. A ``list`` value (a message history) is stored as a run of elements that
  extends the channel's earlier version: only the elements that were not there before are new,
  so a history that grows by one message per step grows the store by one message per step;
* `CheckpointPut` -- the checkpoint itself (without channel values) and its metadata;
* `WritesPut` -- a task's pending writes;
* `CheckpointsRemoved` -- ``prune`` and ``delete_for_runs``: the views drop the checkpoints,
  the log keeps them for audit. ``delete_thread`` deletes the thread for good.

Hash views (``lg.*``) answer reads. A checkpoint record names everything its tuple is built
from (its channel versions, and the element runs of its list values), so a read takes two
round trips: the record, then its blobs, elements and writes. The saver remembers which fields
a record needed (after writing or reading it) and reads them in the same atomic step as the
record: when the record is unchanged that is the whole read, one round trip; when not, only
what is missing is read next. Only the choice of fields is remembered, never a value.
`LangGraphProjection` folds the log into the same views, so `projections.Projector` can check
and rebuild them and read any past state.

The sync methods run the async ones on a private event loop thread. A Redis client belongs to
the loop that opened it, so the sync API needs a store the saver can open itself:
`ThreadlogCheckpointSaver.from_url` (or ``connect=``). A `MemoryEventStore` works anywhere.
The loop thread is a daemon thread, stopped by ``close()``, or when the saver is collected or
the interpreter exits; a store the saver opened on a caller's loop is closed by ``aclose()`` or
when ``asyncio.run`` shuts that loop down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import random
import threading
import weakref
from collections import OrderedDict
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Mapping,
    Sequence,
)
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar, cast

import anyio
import msgspec
from anyio.from_thread import BlockingPortal
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    PendingWrite,
    get_checkpoint_id,
    get_checkpoint_metadata,
)
from langgraph.checkpoint.serde.base import CipherProtocol, SerializerProtocol
from langgraph.checkpoint.serde.encrypted import EncryptedSerializer

from eventstore import (
    NO_THREAD,
    AppendResult,
    ConcurrencyError,
    Event,
    EventRegistry,
    EventStore,
    EventTooLargeError,
    ExpectedVersion,
    HashDelete,
    HashGet,
    HashGetAll,
    HashLoad,
    HashSet,
    IncarnationConflictError,
    InvalidInputError,
    InvalidThreadIdError,
    MemoryEventStore,
    NewEvent,
    OperationalError,
    RecordedEvent,
    ThreadInfo,
    ThreadReplacedError,
    ViewConflictError,
    ViewEntry,
    ViewOp,
    ViewRead,
    connect,
)
from eventstore._errors import DECODE_ERRORS
from eventstore._ids import prefixed_thread_id
from projections import CheckReport, Projection, Projector

from ._framework_events import (
    BlobRef,
    BlobsPut,
    CheckpointPut,
    CheckpointRef,
    CheckpointsRemoved,
    Elements,
    InlineBlob,
    ListBlob,
    Record,
    StoredWrite,
    Typed,
    Version,
    WritesPut,
    register_langgraph_events,
)

__all__ = [
    "DEFAULT_THREAD_PREFIX",
    "VIEWS",
    "BlobsPut",
    "CheckpointPut",
    "CheckpointValueTooLargeError",
    "CheckpointsRemoved",
    "LangGraphProjection",
    "ThreadlogCheckpointSaver",
    "WritesPut",
    "checkpoint_thread_id",
    "register_langgraph_events",
]

DEFAULT_THREAD_PREFIX = "lg:"

# Views (hash views of the thread). Field names are built by the ``_*_field`` helpers below.
RECORDS = "lg.checkpoints"  # <ns><checkpoint id> -> Record
HEADS = "lg.heads"  # <ns> -> Record of the namespace's highest checkpoint id (its latest)
WRITES = "lg.writes"  # <ns><checkpoint id> -> [StoredWrite, ...]: the first chunk of its writes
# A checkpoint's writes past its first chunk (a wide step: hundreds of tasks), and how many such
# chunks it has. See `_merge_chunks`.
WRITES_N = "lg.writes.n"  # <ns><checkpoint id> -> number of chunks after the first
WRITES_MORE = "lg.writes.more"  # _p(<ns><checkpoint id>) + <chunk number, from 1> -> [...]
BLOBS = "lg.blobs"  # <ns><channel><version> -> (type, data)
RANGES = "lg.ranges"  # <ns><channel><version> -> [(start, count), ...] into the lineage
ELEMS = "lg.elements"  # <lineage>:<block> -> [(type, data), ...] (see BLOCK)
LISTS = "lg.lineages"  # <lineage> -> number of elements (guards concurrent extension)
VIEWS = (RECORDS, HEADS, WRITES, BLOBS, RANGES, ELEMS, LISTS, WRITES_N, WRITES_MORE)

ATTEMPTS = 16
# The jittered pause after a put_writes refused by another process's write to the same step.
CONFLICT_BACKOFF_MIN = 0.001
CONFLICT_BACKOFF_MAX = 0.05
READ_CHUNK = 1000  # fields per HashGet: the read script unpacks them onto the Lua stack
COPY_CHUNK = 256
LIST_PAGE = 256  # threads of the index per read when list() goes through every thread
UNDO_TIMEOUT_S = 30.0  # how long an interrupted copy_thread may take to delete what it wrote
CACHE_SIZE = 1024
# A lineage's elements are kept in blocks: element i is entry i % BLOCK of field
# ``<lineage>:<i // BLOCK>``, so reading a 60-message history reads 8 fields, not 60 (each
# field read costs the client about as much as deserializing a small message). Extending a
# lineage rewrites its last block, so a block stops growing at BLOCK_BYTES: the rewrite
# stays bounded (measured: blocks of 16 cost the server more per put than they save per read).
# A block closed early leaves unused indices, which split the value's runs, and every later
# checkpoint repeats its runs: so BLOCK_BYTES is set where elements of up to 4 KiB never close
# a block early (at 8 KiB, 1 KiB messages did, and per-step growth rose with the history).
BLOCK = 8
BLOCK_BYTES = 32768
# A checkpoint's pending writes are kept in chunks of about this many bytes: each put_writes
# rewrites the chunks it changes (the last one, mostly), not every write of the step, so a
# step of n tasks writes O(n) bytes, not O(n^2). A chunk is full once it holds this much: small
# enough that the rewrites stay a few times the writes' own size, large enough that an
# ordinary step's writes are one chunk (one field, read with the checkpoint).
WRITES_CHUNK_BYTES = 16384

V = TypeVar("V")

_enc = msgspec.msgpack.Encoder()


# -- events -----------------------------------------------------------------------------------


class CheckpointValueTooLargeError(EventTooLargeError):
    """Raised when one channel value, list element or pending write, or a checkpoint's metadata
    (``kind`` ``"metadata"``, ``channel`` empty), serializes to more than one event of the store
    holds (its ``max_event_bytes``, 1 MiB by default). Nothing of the checkpoint or the task's
    writes is stored: in a graph run, the step that produced the value fails, and a resumed
    run runs it again."""

    def __init__(
        self, thread_id: str, size: int, limit: int, index: int, channel: str, kind: str
    ) -> None:
        super().__init__(thread_id, size, limit, index)
        self.channel = channel
        self.kind = kind
        if kind == "metadata":
            # LangGraph copies every str of the run's configurable and metadata into it.
            what = (
                "the checkpoint's metadata (which holds every string of the run's config: "
                "configurable and metadata; keep large documents out of the config)"
            )
        else:
            what = f"a {kind} of channel {channel!r}"
        self.args = (
            f"thread {thread_id!r}: {what} makes an event of {size} bytes; the store's "
            f"max_event_bytes is {limit} (raise it with "
            "ThreadlogCheckpointSaver.from_url(..., max_event_bytes=N) or "
            "eventstore.connect(..., max_event_bytes=N))",
        )

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.thread_id, self.size, self.limit, self.index, self.channel, self.kind)
        return (type(self), args)


def _too_large(exc: EventTooLargeError, events: Sequence[Event]) -> EventTooLargeError:
    """``exc`` naming the channel of the largest value of the event it refused.

    The saver packs a value larger than half the limit into an event of its own, so that value
    is what made the event too large."""
    if not 0 <= exc.index < len(events):
        return exc
    sizes: list[tuple[int, str, str]] = []
    event = events[exc.index]
    if isinstance(event, BlobsPut):
        sizes += [(len(b.data), b.channel, "value") for b in event.values]
        sizes += [
            (len(item[1]), el.channel, "list element") for el in event.elements for item in el.items
        ]
    elif isinstance(event, WritesPut):
        sizes += [(len(w.data), w.channel, "pending write") for w in event.writes]
    elif isinstance(event, CheckpointPut):  # channel values are in events of their own
        sizes.append((len(event.record.metadata[1]), "", "metadata"))
    if not sizes:
        return exc
    _, channel, kind = max(sizes)
    return CheckpointValueTooLargeError(
        exc.thread_id, exc.size, exc.limit, exc.index, channel, kind
    )


# -- ids and field names ----------------------------------------------------------------------

_ESCAPED = frozenset("%{}\x7f") | frozenset(chr(c) for c in range(0x20))


def _escape(text: str) -> str:
    if not any(ch in _ESCAPED for ch in text):
        return text
    return "".join(f"%{ord(ch):02X}" if ch in _ESCAPED else ch for ch in text)


def _unescape(text: str) -> str:
    if "%" not in text:
        return text
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "%":
            out.append(chr(int(text[i + 1 : i + 3], 16)))
            i += 3
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def checkpoint_thread_id(thread_id: object, *, prefix: str = DEFAULT_THREAD_PREFIX) -> str:
    """The threadlog thread of a LangGraph ``thread_id`` (all its checkpoint namespaces).

    Braces, control characters and ``%`` are percent-encoded, so any LangGraph thread id maps
    to a distinct, valid thread id; the empty id is a thread like any other (``lg:``), as in
    LangGraph's own savers. Other types are taken as ``str(thread_id)``. Raises
    `InvalidThreadIdError` for None (a missing id: ``str(None)`` would share the thread
    ``"None"``), for an id too long, and for an empty id under an empty prefix.
    """
    if thread_id is None:
        raise InvalidThreadIdError("LangGraph thread_id must not be None")
    text = thread_id if isinstance(thread_id, str) else str(thread_id)
    return prefixed_thread_id(prefix, _escape(text), "LangGraph thread_id")


def _p(text: str) -> str:
    """Length-prefixed, so fields built from several free-text parts never collide."""
    return f"{len(text)}:{text}"


def _ck_field(ns: str, checkpoint_id: str) -> str:
    return _p(ns) + checkpoint_id


def _vkey(version: Version) -> str:
    if isinstance(version, str):
        return "s" + version
    if isinstance(version, int):
        return f"i{version}"
    return f"f{version!r}"


def _blob_field(ns: str, channel: str, version: Version) -> str:
    return _p(ns) + _p(channel) + _vkey(version)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _lineage(ns: str, channel: str) -> str:
    # A pure function of its arguments, asked for several times per put and read.
    return hashlib.blake2b((_p(ns) + _p(channel)).encode(), digest_size=6).hexdigest()


def _block_field(lineage: str, block: int) -> str:
    return f"{lineage}:{block}"


def _as_typed(pair: tuple[str, Any]) -> Typed:
    # A serde may hand back a bytearray or a memoryview; fingerprints need the bytes a read
    # decodes.
    typ, data = pair
    return (typ, data) if type(data) is bytes else (typ, bytes(data))


def _fingerprint(item: Typed) -> int:
    # Only compared within this process (the lineage cache), to find the prefix a new list
    # value shares with the stored one. Python's hash of str and bytes is SipHash with a
    # per-process random key: 64 bits, and no crafted collisions; about 15x cheaper than
    # blake2b, so a put does not pay a cryptographic hash for every element of the history.
    return hash(item)


# An element sealed by an encrypting serde: its plain typed pair -> the stored one.
_Seal = Callable[[Typed], Typed]


def _encryption(serde: SerializerProtocol) -> tuple[SerializerProtocol, CipherProtocol] | None:
    """The inner serde and cipher of LangGraph's `EncryptedSerializer` (None for another).

    Its ciphertexts take a fresh nonce each time (AES-EAX), so the same element never
    encrypts to the same bytes twice: list elements are matched by their plain serialization
    instead, and only the new ones are encrypted. Asked of ``self.serde`` at each call, as
    LangGraph's ``with_allowlist`` copies replace it."""
    if isinstance(serde, EncryptedSerializer):
        return serde.serde, serde.cipher
    return None


def _sealer(cipher: CipherProtocol) -> _Seal:
    def seal(item: Typed) -> Typed:
        # What EncryptedSerializer.dumps_typed stores, from the plain pair already made.
        name, ciphertext = cipher.encrypt(item[1])
        return f"{item[0]}+{name}", bytes(ciphertext)

    return seal


def _unseal(cipher: CipherProtocol, item: Typed) -> Typed:
    # As EncryptedSerializer.loads_typed reads: a type without "+" was stored unencrypted.
    typ, data = item
    if "+" not in typ:
        return item
    plain, name = typ.split("+", 1)
    return plain, bytes(cipher.decrypt(name, data))


_record_dec = msgspec.msgpack.Decoder(Record)
_writes_dec = msgspec.msgpack.Decoder(list[StoredWrite])
_typed_dec = msgspec.msgpack.Decoder(Typed)
_block_dec = msgspec.msgpack.Decoder(list[Typed])
_ranges_dec = msgspec.msgpack.Decoder(list[tuple[int, int]])


def _decode(decoder: msgspec.msgpack.Decoder[V], entry: ViewEntry, what: str) -> V:
    try:
        return decoder.decode(entry.value)
    except DECODE_ERRORS as exc:
        raise OperationalError(
            f"{what} (written at seq {entry.seq}) does not decode ({exc}); run rebuild"
        ) from None


# -- view ops: one function for appends, copies and the fold ----------------------------------


class _Views:
    """An in-process model of the saver's hash views, with the store's stamping rules."""

    def __init__(self, heads: Mapping[str, str | None] | None = None) -> None:
        self.hashes: dict[str, dict[str, ViewEntry]] = {v: {} for v in VIEWS}
        # The head checkpoint ids of namespaces whose lg.heads entry this model does not hold
        # (the saver knows them without having read the record).
        self.known_heads = dict(heads or {})

    def get(self, view: str, field: str) -> ViewEntry | None:
        return self.hashes[view].get(field)

    def head_id(self, ns: str) -> str | None:
        """The checkpoint id of the namespace's head (its highest checkpoint id)."""
        entry = self.hashes[HEADS].get(ns)
        if entry is None:
            return self.known_heads.get(ns)
        return _decode(_record_dec, entry, "lg.heads").checkpoint_id

    def apply(self, op: ViewOp, seq: int) -> None:
        if isinstance(op, HashSet):
            h = self.hashes[op.view]
            old = h.get(op.field)
            h[op.field] = ViewEntry(seq, op.value, (old.version if old else 0) + 1)
        elif isinstance(op, HashDelete):
            self.hashes[op.view].pop(op.field, None)
        else:  # pragma: no cover - the saver emits hash ops only
            raise InvalidInputError(f"unexpected view op {op!r}")


def merge_writes(current: list[StoredWrite], new: Sequence[StoredWrite]) -> list[StoredWrite]:
    """``current`` with ``new`` set: a write replaces the one with the same task and index."""
    out = list(current)
    at = {(w.task_id, w.idx): i for i, w in enumerate(out)}
    for w in new:
        i = at.get((w.task_id, w.idx))
        if i is None:
            at[(w.task_id, w.idx)] = len(out)
            out.append(w)
        else:
            out[i] = w
    return out


def _write_bytes(w: StoredWrite) -> int:
    return len(w.data) + len(w.type) + len(w.channel) + len(w.task_id) + len(w.task_path) + 16


def _more_field(field: str, chunk: int) -> str:
    return _p(field) + str(chunk)


def _stored_chunks(views: _Views, field: str) -> list[list[StoredWrite]]:
    """A checkpoint's writes as ``views`` holds them, chunk by chunk."""
    entry = views.get(WRITES, field)
    chunks = [_decode(_writes_dec, entry, "lg.writes") if entry else []]
    count = views.get(WRITES_N, field)
    for j in range(1, int(count.value) + 1 if count else 1):
        e = views.get(WRITES_MORE, _more_field(field, j))
        chunks.append(_decode(_writes_dec, e, "lg.writes.more") if e else [])
    return chunks


def _merge_chunks(
    chunks: list[list[StoredWrite]], new: Sequence[StoredWrite], field: str, index: int
) -> list[HashSet]:
    """Merge ``new`` into ``chunks`` (in place, as `merge_writes` merges) and return the ops
    that store the chunks it changed. The fold and the saver both call it, so the chunking is
    a function of the log alone.

    A write replaces the one with its task and index wherever it is; any other goes at the end
    of the last chunk, or starts a new chunk when the last one is full. While a checkpoint has
    one chunk, that is all: the ``lg.writes`` field, as before chunks. With more, every merge
    also sets the chunk count (``lg.writes.n``), which is what concurrent writers guard.
    """
    before = len(chunks)
    at = {(w.task_id, w.idx): (j, i) for j, c in enumerate(chunks) for i, w in enumerate(c)}
    size = sum(map(_write_bytes, chunks[-1]))
    dirty: set[int] = set()
    for w in new:
        pos = at.get((w.task_id, w.idx))
        if pos is not None:
            chunks[pos[0]][pos[1]] = w
            dirty.add(pos[0])
            continue
        if chunks[-1] and size >= WRITES_CHUNK_BYTES:
            chunks.append([])
            size = 0
        at[(w.task_id, w.idx)] = (len(chunks) - 1, len(chunks[-1]))
        chunks[-1].append(w)
        size += _write_bytes(w)
        dirty.add(len(chunks) - 1)
    if before == 1 and len(chunks) > 1:
        dirty.add(0)  # the first chunk carries the guard until the count exists
    ops = [
        HashSet(WRITES, field, _enc.encode(chunks[0]), index)
        if j == 0
        else HashSet(WRITES_MORE, _more_field(field, j), _enc.encode(chunks[j]), index)
        for j in sorted(dirty)
    ]
    if len(chunks) > 1:
        ops.append(HashSet(WRITES_N, field, b"%d" % (len(chunks) - 1), index))
    return ops


def _event_ops(payload: Event, index: int, views: _Views | None) -> list[ViewOp]:
    """The view ops of one event; `WritesPut` merges into the writes ``views`` holds."""
    ops: list[ViewOp] = []
    if isinstance(payload, BlobsPut):
        ns = payload.ns
        for b in payload.values:
            value = _enc.encode((b.type, b.data))
            ops.append(HashSet(BLOBS, _blob_field(ns, b.channel, b.version), value, index))
        for lb in payload.lists:
            value = _enc.encode(lb.ranges)
            ops.append(HashSet(RANGES, _blob_field(ns, lb.channel, lb.version), value, index))
        blocks: dict[str, list[Typed]] = {}
        for el in payload.elements:
            lin = _lineage(ns, el.channel)
            for i, item in enumerate(el.items):
                block, at = divmod(el.start + i, BLOCK)
                field = _block_field(lin, block)
                stored = blocks.get(field)
                if stored is None:
                    stored = blocks[field] = _block_before(views, field, at)
                if len(stored) != at:
                    raise OperationalError(
                        f"lg.elements {field} holds {len(stored)} elements where element "
                        f"{el.start + i} goes at {at}; run rebuild"
                    )
                stored.append(item)
            ops.append(HashSet(LISTS, lin, b"%d" % (el.start + len(el.items)), index))
        for field, stored in blocks.items():
            ops.append(HashSet(ELEMS, field, _enc.encode(stored), index))
    elif isinstance(payload, CheckpointPut):
        rec = payload.record
        value = _enc.encode(rec)
        ops.append(HashSet(RECORDS, _ck_field(rec.ns, rec.checkpoint_id), value, index))
        # A namespace's head is its checkpoint with the highest id, as LangGraph's own savers
        # answer "the latest checkpoint": a checkpoint written after one with a higher id (a
        # clock-skewed writer, an explicit put) does not replace it.
        if views is None:
            raise InvalidInputError(
                "langgraph.checkpoint_put compares with the namespace's head: append it "
                "through ThreadlogCheckpointSaver"
            )
        head_id = views.head_id(rec.ns)
        if head_id is None or rec.checkpoint_id >= head_id:
            ops.append(HashSet(HEADS, rec.ns, value, index))
    elif isinstance(payload, WritesPut):
        field = _ck_field(payload.ns, payload.checkpoint_id)
        if views is None:
            raise InvalidInputError(
                "langgraph.writes_put merges into the stored writes: append it through "
                "ThreadlogCheckpointSaver"
            )
        ops += _merge_chunks(_stored_chunks(views, field), payload.writes, field, index)
    elif isinstance(payload, CheckpointsRemoved):
        if views is None:
            raise InvalidInputError(
                "langgraph.checkpoints_removed drops chunks the views count: append it "
                "through ThreadlogCheckpointSaver"
            )
        for ref in payload.checkpoints:
            field = _ck_field(ref.ns, ref.checkpoint_id)
            ops.append(HashDelete(RECORDS, field))
            ops.append(HashDelete(WRITES, field))
            # Chunks past the first: their count is in the views (the saver reads it with the
            # records it removes).
            count = views.get(WRITES_N, field)
            if count is not None:
                ops.append(HashDelete(WRITES_N, field))
                for j in range(1, int(count.value) + 1):
                    ops.append(HashDelete(WRITES_MORE, _more_field(field, j)))
        for ns, head in payload.heads.items():
            if head is None:
                ops.append(HashDelete(HEADS, ns))
            else:
                ops.append(HashSet(HEADS, ns, _enc.encode(head), index))
        for br in payload.unreferenced:
            field = _blob_field(br.ns, br.channel, br.version)
            ops.append(HashDelete(BLOBS, field))
            ops.append(HashDelete(RANGES, field))
    return ops


def _block_before(views: _Views | None, field: str, at: int) -> list[Typed]:
    """The elements a block holds before one is added at ``at`` (a new block: none)."""
    if at == 0:
        return []
    if views is None:
        raise InvalidInputError(
            "langgraph.blobs_put continues a block of lg.elements: append it through "
            "ThreadlogCheckpointSaver"
        )
    entry = views.get(ELEMS, field)
    return _decode(_block_dec, entry, "lg.elements") if entry else []  # a fresh list


class LangGraphProjection(Projection[_Views]):
    """The saver's views as a fold of the log (for check, rebuild and time travel)."""

    name = "langgraph"
    views = VIEWS

    def initial(self) -> _Views:
        return _Views()

    def apply(self, state: _Views, event: RecordedEvent) -> _Views:
        for op in _event_ops(event.payload, 0, state):
            state.apply(op, event.seq)
        return state

    def ops(self, events: Sequence[NewEvent]) -> list[ViewOp]:
        """Ops of self-contained events; `WritesPut`, `CheckpointPut` (which may become the
        namespace's head), a `BlobsPut` that continues a block of elements and
        `CheckpointsRemoved` (which drops every chunk of the checkpoints' writes) need what
        the views hold (the saver has it).

        Raises:
            InvalidInputError: for a `WritesPut`, a `CheckpointPut`, a `BlobsPut` continuing
                a block, or a `CheckpointsRemoved`.
        """
        out: list[ViewOp] = []
        for index, new in enumerate(events):
            out += _event_ops(new.payload, index, None)
        return out

    def materialize(self, state: _Views) -> list[ViewOp]:
        return [HashLoad(view, dict(state.hashes[view])) for view in VIEWS]

    def full_reads(self) -> list[ViewRead]:
        return [HashGetAll(view) for view in VIEWS]


# -- caches -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Lineage:
    """What the saver knows of a channel's lineage: its length and field version, and the
    elements of the version it last wrote or read (to find the prefix a new version shares)."""

    length: int
    field_version: int
    version: Version | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    fingerprints: tuple[int, ...] = ()  # `_fingerprint` of each element, in list order
    # The lineage's last block as stored, when known (kept for encrypting serdes only):
    # (block index, its elements). See `_plan_lists`.
    last_block: tuple[int, tuple[Typed, ...]] | None = None


@dataclass(frozen=True, slots=True)
class _KnownWrites:
    """A checkpoint's pending writes as this saver last wrote or read them, chunk by chunk,
    with the versions of the first chunk's field and of the chunk count (0: absent)."""

    first_version: int
    count_version: int
    chunks: list[list[StoredWrite]]


class _Cache:
    """A small LRU map, shared by the caller's loop and the saver's private loop thread."""

    def __init__(self) -> None:
        self._data: OrderedDict[tuple[str, ...], Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, ...]) -> Any:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: tuple[str, ...], value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > CACHE_SIZE:
                self._data.popitem(last=False)

    def pop(self, key: tuple[str, ...]) -> None:
        with self._lock:
            self._data.pop(key, None)

    def forget_thread(self, tid: str) -> None:
        with self._lock:
            for key in [k for k in self._data if k[0] == tid]:
                del self._data[key]


def _truncate(ranges: Sequence[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, count in ranges:
        if n <= 0:
            break
        take = min(count, n)
        out.append((start, take))
        n -= take
    return out


def _extend(ranges: list[tuple[int, int]], start: int, count: int) -> list[tuple[int, int]]:
    if count <= 0:
        return ranges
    if ranges and ranges[-1][0] + ranges[-1][1] == start:
        ranges[-1] = (ranges[-1][0], ranges[-1][1] + count)
    else:
        ranges.append((start, count))
    return ranges


def _positions(ranges: Sequence[tuple[int, int]], lo: int, hi: int) -> range | None:
    """The list positions of lineage indexes ``lo..hi-1``, if one run of ``ranges`` has them."""
    pos = 0
    for start, count in ranges:
        if start <= lo and hi <= start + count:
            return range(pos + lo - start, pos + hi - start)
        pos += count
    return None


def _item_bytes(item: Typed) -> int:
    return len(item[0]) + len(item[1]) + 8


def _chunks(fields: Sequence[str]) -> list[tuple[str, ...]]:
    return [tuple(fields[i : i + READ_CHUNK]) for i in range(0, len(fields), READ_CHUNK)]


Needs = Mapping[str, Iterable[str]]
_Needs = dict[str, tuple[str, ...]]  # view -> fields
_NONE: dict[str, ViewEntry] = {}


class _Fetch:
    """The view fields one call has read so far: those it asked for, and those it found.

    With ``note`` (a read whose results the saver caches), the life the first read found is
    passed to it, and a later read that finds another life (the thread was deleted, perhaps
    written again, in between) raises `ThreadReplacedError`: what was read would mix lives.
    """

    def __init__(self, note: Callable[[int | None], None] | None = None) -> None:
        self.asked: dict[str, set[str]] = {}
        self.found: dict[str, dict[str, ViewEntry]] = {}
        self.note = note
        self.reads = 0
        self.life: int | None = None

    def view(self, view: str) -> dict[str, ViewEntry]:
        return self.found.get(view, _NONE)

    def entry(self, view: str, field: str) -> ViewEntry | None:
        return self.found.get(view, _NONE).get(field)

    async def read(self, store: EventStore, tid: str, needs: Needs) -> None:
        """Read the fields of ``needs`` not asked for yet, in one atomic step."""
        reads: list[HashGet] = []
        for view, fields in needs.items():
            asked = self.asked.setdefault(view, set())
            todo = [f for f in fields if f not in asked]
            if todo:
                asked.update(todo)
                reads += [HashGet(view, c) for c in _chunks(todo)]
        if not reads:
            return
        snap = await store.read_views(tid, reads)
        if self.note is not None:
            if not self.reads:
                self.life = snap.incarnation
                self.note(snap.incarnation)
            elif snap.incarnation != self.life:
                raise ThreadReplacedError(tid)
        self.reads += 1
        for r, result in zip(reads, snap.results, strict=True):
            assert isinstance(result, dict)
            self.found.setdefault(r.view, {}).update(result)


# One channel of a record: (channel, version, blob field, lineage, runs or None).
_Slot = tuple[str, Version, str, str, Sequence[tuple[int, int]] | None]


def _layout(rec: Record, versions: Mapping[str, Version]) -> list[_Slot]:
    ns = rec.ns
    return [
        (ch, v, _blob_field(ns, ch, v), _lineage(ns, ch), rec.lists.get(ch))
        for ch, v in versions.items()
    ]


def _needs_of(rec: Record, versions: Mapping[str, Version]) -> _Needs:
    """What a warm read of ``rec`` reads (as `ThreadlogCheckpointSaver._resolve` does)."""
    needs: dict[str, list[str]] = {BLOBS: [], RANGES: [], ELEMS: [], LISTS: []}
    for _, _, blob, lin, runs in _layout(rec, versions):
        if runs is None:
            needs[BLOBS].append(blob)
            needs[RANGES].append(blob)
        else:
            needs[ELEMS] += _run_blocks(lin, runs)
            needs[LISTS].append(lin)
    out = {view: tuple(fields) for view, fields in needs.items() if fields}
    out[WRITES] = out[WRITES_N] = (_ck_field(rec.ns, rec.checkpoint_id),)
    return out


def _run_blocks(lineage: str, runs: Sequence[tuple[int, int]]) -> list[str]:
    """The `_block_field` names of the blocks holding the elements ``runs`` covers."""
    blocks: dict[int, None] = {}
    for start, count in runs:
        if count > 0:
            blocks.update(dict.fromkeys(range(start // BLOCK, (start + count - 1) // BLOCK + 1)))
    return [_block_field(lineage, b) for b in blocks]


def _configurable(config: RunnableConfig | None, *, thread: bool = True) -> dict[str, Any]:
    """A config's ``configurable``, with its thread id (unless ``thread`` is False: a
    ``before`` config names only a checkpoint) and a checkpoint id and namespace that are
    text when given: anything else is `InvalidInputError` naming it, not a TypeError from
    inside the saver."""
    conf = (config or {}).get("configurable")
    if not isinstance(conf, Mapping) or (thread and "thread_id" not in conf):
        raise InvalidInputError("config must have configurable.thread_id")
    for key in ("checkpoint_id", "checkpoint_ns"):
        value = conf.get(key)
        if value is not None and not isinstance(value, str):
            raise InvalidInputError(
                f"configurable.{key} must be a str, not {type(value).__name__} ({value!r:.40})"
            )
    return dict(conf)


Opener = Callable[[], Awaitable[EventStore]]

PORTAL_STOP_TIMEOUT_S = 5.0


@dataclass(slots=True)
class _Opened:
    """A store the saver opened on one event loop, and the async generator that closes it."""

    store: EventStore
    closer: AsyncGenerator[None, None]


async def _close_with_loop(
    store: EventStore,
    opened: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Opened],
    loop: asyncio.AbstractEventLoop,
) -> AsyncGenerator[None, None]:
    # An async generator started on a loop is closed by the loop's shutdown_asyncgens, which
    # asyncio.run (and anyio.run) call before closing the loop: so a store opened on a loop
    # is closed with it, even if nobody calls aclose (each asyncio.run used to leave one
    # client and its connections behind, since the store keeps its loop alive).
    try:
        yield
    finally:
        if (entry := opened.get(loop)) is not None and entry.store is store:
            del opened[loop]
        await store.close()


def _start_portal() -> tuple[BlockingPortal, threading.Thread]:
    """A blocking portal on a new event loop, in a daemon thread: a saver nobody closed does
    not keep the interpreter from exiting (a non-daemon thread is joined at exit, forever)."""
    ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()

    async def serve() -> None:
        async with BlockingPortal() as portal:
            ready.set_result(portal)
            await portal.sleep_until_stopped()

    def run() -> None:
        try:
            anyio.run(serve, backend="asyncio")
        except BaseException as exc:  # handed to the thread that waits
            if not ready.done():
                ready.set_exception(exc)

    thread = threading.Thread(target=run, name="threadlog-langgraph-saver", daemon=True)
    thread.start()
    return ready.result(), thread


def _stop_portal(portal: BlockingPortal, thread: threading.Thread, keep: list[Any]) -> None:
    """Stop a portal's loop; the stores opened on it close as the loop shuts down. Bounded,
    as it also runs at interpreter exit (`weakref.finalize`) for savers nobody closed.

    ``keep`` holds the closers of the stores opened on the loop until then: the saver, which
    holds them too, may be gone already."""
    if not thread.is_alive():
        keep.clear()
        return
    if threading.current_thread() is thread:
        # Collected on its own loop (the last reference dropped by a call it was running): it
        # cannot wait for itself, so another thread does.
        threading.Thread(target=_stop_portal, args=(portal, thread, keep), daemon=True).start()
        return
    # Its future is cancelled with the portal's tasks, or it is late: the join tells.
    with contextlib.suppress(BaseException):
        portal.start_task_soon(portal.stop, True).result(PORTAL_STOP_TIMEOUT_S)
    thread.join(PORTAL_STOP_TIMEOUT_S)
    keep.clear()


class _Bridge:
    """The sync API's private loop thread. One object, held by the saver and by every shallow
    copy of it: LangGraph compiles a graph with ``checkpointer.with_allowlist(...)`` (a
    ``copy.copy``) when ``LANGGRAPH_STRICT_MSGPACK`` is set, and the user closes the saver they
    hold. With the loop in the saver's own attributes, that close left the graph's copy with a
    stopped loop ("This portal is not running"), or with a loop and a connection of its own
    that nothing closed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._portal: BlockingPortal | None = None
        self._stop: weakref.finalize[Any, Any] | None = None
        self.keep: list[Any] = []  # the closers of the stores opened on the loop
        self.loop: asyncio.AbstractEventLoop | None = None

    def portal(self) -> BlockingPortal:
        with self.lock:
            if self._portal is None:
                portal, thread = _start_portal()
                self.loop = portal.call(asyncio.get_running_loop)
                # Stops the loop when the last saver holding the bridge is collected or the
                # interpreter exits unclosed.
                self.keep = []
                self._stop = weakref.finalize(self, _stop_portal, portal, thread, self.keep)
                self._portal = portal
            return self._portal

    def detach(self) -> tuple[BlockingPortal | None, weakref.finalize[Any, Any] | None]:
        """The running portal and its stopper, forgotten: the next sync call starts another."""
        with self.lock:
            portal, stop = self._portal, self._stop
            self._portal = self._stop = self.loop = None
            return portal, stop


# -- the saver --------------------------------------------------------------------------------


class ThreadlogCheckpointSaver(
    BaseCheckpointSaver[str],
    AbstractContextManager["ThreadlogCheckpointSaver"],
    AbstractAsyncContextManager["ThreadlogCheckpointSaver"],
):
    """A LangGraph checkpointer on a threadlog `EventStore` (plain Redis, Redis Cluster, memory).

    ``store`` serves the async methods. The sync methods need a store opened on the saver's
    private loop: pass ``connect`` (a coroutine function opening one) or build the saver with
    `from_url`; a `MemoryEventStore` is used as is. ``dedupe_lists=False`` stores every list
    value whole, as other savers do.

    Raises `InvalidThreadIdError` for a thread id that cannot be stored, `InvalidInputError`
    for a config without ``configurable.thread_id``, and the store's errors otherwise.
    """

    def __init__(
        self,
        store: EventStore | None = None,
        *,
        connect: Opener | None = None,
        serde: SerializerProtocol | None = None,
        thread_prefix: str = DEFAULT_THREAD_PREFIX,
        dedupe_lists: bool = True,
    ) -> None:
        super().__init__(serde=serde)
        if store is None and connect is None:
            raise InvalidInputError("pass a store, or connect= to open one")
        self._store = store
        self._connect = connect
        self.thread_prefix = thread_prefix
        self.dedupe_lists = dedupe_lists
        self.projection = LangGraphProjection()
        if store is not None:
            register_langgraph_events(store.registry)
        self._opened: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Opened] = (
            weakref.WeakKeyDictionary()
        )
        self._locks: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[str, asyncio.Lock]
        ] = weakref.WeakKeyDictionary()
        self._lineages = _Cache()  # (thread, ns, channel) -> _Lineage
        self._writes = _Cache()  # (thread, checkpoint field) -> _KnownWrites
        self._hints = _Cache()  # (thread, view, record field) -> _Needs: what to read with it
        self._heads = _Cache()  # (thread, ns) -> (head checkpoint id or None, field version)
        # (thread,) -> the life the thread's cached state above was read (or written) in; 0:
        # read when there was no thread. Every write made from that state names the life,
        # so a thread deleted and written again since (versions, and the guards' field
        # versions, restart at 1) refuses it, whatever versions it has reached again.
        self._lives = _Cache()
        self._bridge = _Bridge()

    @classmethod
    def from_url(
        cls,
        url: str | None = None,
        *,
        namespace: str | None = None,
        registry: EventRegistry | None = None,
        serde: SerializerProtocol | None = None,
        thread_prefix: str = DEFAULT_THREAD_PREFIX,
        dedupe_lists: bool = True,
        max_event_bytes: int | None = None,
    ) -> ThreadlogCheckpointSaver:
        """A saver that opens its own stores (see `eventstore.connect`), one per event loop.

        ``max_event_bytes`` (default 1 MiB) bounds one channel value, list element or pending
        write (`CheckpointValueTooLargeError` beyond it).

        Close it with ``close()`` (sync) or ``await aclose()`` on the loop it ran on, or use it
        as a context manager. Unclosed, its stores close with their loops (``asyncio.run``
        shuts them down; the private loop stops when the saver is collected or at exit).
        """

        async def opener() -> EventStore:
            return await connect(
                url, namespace=namespace, registry=registry, max_event_bytes=max_event_bytes
            )

        return cls(
            connect=opener, serde=serde, thread_prefix=thread_prefix, dedupe_lists=dedupe_lists
        )

    # -- stores, loops and the sync bridge -----------------------------------------------------

    async def _get_store(self) -> EventStore:
        loop = asyncio.get_running_loop()
        on_portal = loop is self._bridge.loop
        if self._store is not None and not (on_portal and self._connect is not None):
            if on_portal and not isinstance(self._store, MemoryEventStore):
                raise InvalidInputError(
                    "the sync API needs a store of its own loop: build the saver with "
                    "ThreadlogCheckpointSaver.from_url(...) or pass connect="
                )
            return self._store
        entry = self._opened.get(loop)
        if entry is None:
            assert self._connect is not None
            opened = await self._connect()
            entry = self._opened.get(loop)
            if entry is not None:  # another task of this loop opened one meanwhile
                await opened.close()
                return entry.store
            closer = _close_with_loop(opened, self._opened, loop)
            await anext(closer)  # registers it with the loop
            entry = self._opened[loop] = _Opened(opened, closer)
            if on_portal:
                self._bridge.keep.append(closer)
            register_langgraph_events(opened.registry)
        return entry.store

    def _lock(self, thread: str) -> asyncio.Lock:
        # Serializes this process's writes to one thread, so its own concurrent put_writes
        # (LangGraph runs a step's tasks at once) do not trip each other's view guards.
        locks = self._locks.setdefault(asyncio.get_running_loop(), {})
        lock = locks.get(thread)
        if lock is None:
            if len(locks) > CACHE_SIZE:
                for key in [k for k, v in locks.items() if not v.locked()]:
                    del locks[key]
            lock = locks[thread] = asyncio.Lock()
        return lock

    def _run(self, fn: Callable[..., Awaitable[V]], *args: Any, **kwargs: Any) -> V:
        portal = self._bridge.portal()
        return portal.call(functools.partial(fn, *args, **kwargs))

    async def aclose(self) -> None:
        """Close the store this saver opened on the running loop (a given store stays open).

        A store opened on a loop is also closed when ``asyncio.run`` shuts that loop down. A
        later call on that loop opens one again: closing frees, it does not retire the saver.
        """
        loop = asyncio.get_running_loop()
        entry = self._opened.pop(loop, None)
        self._locks.pop(loop, None)
        if entry is not None:
            await entry.closer.aclose()

    def close(self) -> None:
        """Close the saver's private loop and the store it opened there.

        A sync saver nobody closed is closed when it is collected or the interpreter exits.
        Closing frees what the saver holds; it does not retire it: a later call opens a loop
        and a store again (as a `with` block reused would need).
        """
        portal, stop = self._bridge.detach()
        if portal is not None and stop is not None:
            try:
                portal.call(self.aclose)
            finally:
                stop()

    def __enter__(self) -> ThreadlogCheckpointSaver:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> ThreadlogCheckpointSaver:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
        self.close()

    def thread_id_of(self, thread_id: object) -> str:
        """The threadlog thread of a LangGraph thread id."""
        return checkpoint_thread_id(thread_id, prefix=self.thread_prefix)

    # -- versions -----------------------------------------------------------------------------

    def get_next_version(self, current: str | None, channel: None) -> str:
        """``<counter>.<random>``: increasing, and distinct on two branches of a fork.

        Shorter than InMemorySaver's (16 digits and 48 random bits): versions are repeated in
        every checkpoint and blob, so their length is paid at every step.
        """
        if current is None:
            n = 0
        elif isinstance(current, int):
            n = current
        else:
            n = int(str(current).split(".")[0])
        return f"{n + 1:016}.{random.getrandbits(48):012x}"

    # -- reads --------------------------------------------------------------------------------

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        conf = _configurable(config)
        ns = conf.get("checkpoint_ns") or ""
        checkpoint_id = get_checkpoint_id(config)
        tid = self.thread_id_of(conf["thread_id"])
        store = await self._get_store()
        return await self._get(store, tid, conf["thread_id"], ns, checkpoint_id, warm=True)

    async def _get(
        self,
        store: EventStore,
        tid: str,
        thread_id: Any,
        ns: str,
        checkpoint_id: str | None,
        *,
        warm: bool,
    ) -> CheckpointTuple | None:
        # A namespace's latest checkpoint is its lg.heads entry; any other is in lg.checkpoints.
        view, field = (RECORDS, _ck_field(ns, checkpoint_id)) if checkpoint_id else (HEADS, ns)
        first: dict[str, Iterable[str]] = {view: (field,)}
        if checkpoint_id:
            first[WRITES] = first[WRITES_N] = (field,)
        hint: _Needs | Callable[[], _Needs] | None = self._hints.get((tid, view, field))
        if callable(hint):  # left by a put: worked out on first use, puts outnumber reads
            hint = hint()
        if hint is not None:
            # The fields this record needed last time, read in the same atomic step as the
            # record: if it is unchanged, that is the whole read (one round trip); if not, its
            # successor shares most of them, and only the rest is read. A hint only chooses
            # what to read: every value used comes from the store, in this call.
            first = {**hint, **first}
        fetch = _Fetch(functools.partial(self._note_life, tid))
        await fetch.read(store, tid, first)
        entry = fetch.entry(view, field)
        if entry is None:
            self._hints.pop((tid, view, field))
            if view == HEADS:
                self._heads.put((tid, ns), (None, 0))
            return None
        rec = _decode(_record_dec, entry, view)
        if view == HEADS:
            self._heads.put((tid, ns), (rec.checkpoint_id, entry.version))
        tuples, needs = await self._resolve(store, tid, thread_id, [rec], fetch, warm=warm)
        if warm:
            self._hints.put((tid, view, field), needs)
        return tuples[0]

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        store = await self._get_store()
        targets: AsyncIterator[tuple[str, Any, str | None, str | None]]
        if config is None:
            targets = self._every_thread(store)
        else:
            conf = _configurable(config)
            targets = _one_target(
                (
                    self.thread_id_of(conf["thread_id"]),
                    conf["thread_id"],
                    conf.get("checkpoint_ns"),
                    get_checkpoint_id(config),
                )
            )
        if before:
            _configurable(before, thread=False)  # its ids checked, as the config's are
        before_id = get_checkpoint_id(before) if before else None
        remaining = limit
        async for tid, thread_id, ns, checkpoint_id in targets:
            if remaining is not None and remaining <= 0:
                return
            snap = await store.read_views(tid, [HashGetAll(RECORDS)])
            entries = snap.results[0]
            assert isinstance(entries, dict)
            pairs = [(_decode(_record_dec, e, "lg.checkpoints"), e.seq) for e in entries.values()]
            # As InMemorySaver lists: namespace by namespace, in the order they were first
            # written, and each namespace's checkpoints from the highest id down.
            first: dict[str, int] = {}
            for r, seq in pairs:
                first[r.ns] = min(seq, first.get(r.ns, seq))
            records = [
                r
                for r, _ in pairs
                if (ns is None or r.ns == ns)
                and (not checkpoint_id or r.checkpoint_id == checkpoint_id)
                and (before_id is None or r.checkpoint_id < before_id)
            ]
            records.sort(key=lambda r: r.checkpoint_id, reverse=True)
            records.sort(key=lambda r: (first[r.ns], r.ns))
            if filter:
                records = [r for r in records if self._matches(r, filter)]
            if remaining is not None:
                records = records[:remaining]
                remaining -= len(records)
            for i in range(0, len(records), 32):
                page = records[i : i + 32]
                tuples, _ = await self._resolve(store, tid, thread_id, page, _Fetch(), warm=False)
                for tup in tuples:
                    yield tup

    async def _every_thread(
        self, store: EventStore
    ) -> AsyncIterator[tuple[str, Any, str | None, str | None]]:
        """Every LangGraph thread of the namespace, most recent activity first, a page of the
        thread index at a time: a ``list(None, limit=1)`` reads one page, not every thread of
        a namespace that may hold millions (a thread written meanwhile moves to the front and
        is not listed again, as `EventStore.threads` pages)."""
        after: ThreadInfo | None = None
        while True:
            page = await store.threads(limit=LIST_PAGE, after=after)
            for info in page:
                tid = info.thread_id
                if tid.startswith(self.thread_prefix):
                    yield tid, _unescape(tid[len(self.thread_prefix) :]), None, None
            if len(page) < LIST_PAGE:
                return
            after = page[-1]

    def _body(self, rec: Record) -> Checkpoint:
        return cast(Checkpoint, self.serde.loads_typed(rec.checkpoint))

    def _matches(self, rec: Record, filter: Mapping[str, Any]) -> bool:
        metadata = self.serde.loads_typed(rec.metadata)
        return all(metadata.get(k) == v for k, v in filter.items())

    async def _resolve(
        self,
        store: EventStore,
        tid: str,
        thread_id: Any,
        records: Sequence[Record],
        fetch: _Fetch,
        *,
        warm: bool,
    ) -> tuple[list[CheckpointTuple], _Needs]:
        """The tuples of ``records``, and the view fields they were built from.

        Reads what ``fetch`` does not hold yet: one round trip when every list value's runs are
        in its record, a second for the elements of list values found through ``lg.ranges``.
        """
        single = warm and len(records) == 1
        bodies = [self._body(r) for r in records]
        layouts = [
            _layout(r, body["channel_versions"]) for r, body in zip(records, bodies, strict=True)
        ]
        needs: dict[str, set[str]] = {
            view: set() for view in (BLOBS, RANGES, ELEMS, LISTS, WRITES, WRITES_N)
        }
        for r, layout in zip(records, layouts, strict=True):
            needs[WRITES].add(_ck_field(r.ns, r.checkpoint_id))
            needs[WRITES_N].add(_ck_field(r.ns, r.checkpoint_id))
            for _, _, blob, lin, runs in layout:
                if runs is None:
                    needs[BLOBS].add(blob)
                    needs[RANGES].add(blob)
                else:
                    needs[ELEMS].update(_run_blocks(lin, runs))
                    if single:
                        needs[LISTS].add(lin)
        await fetch.read(store, tid, needs)

        # List values whose runs are not in their record (written before records held them).
        found_ranges = fetch.view(RANGES)
        more: dict[str, set[str]] = {ELEMS: set(), LISTS: set(), WRITES_MORE: set()}
        # The writes of wide steps, past their first chunk.
        for ck, chunks_n in fetch.view(WRITES_N).items():
            more[WRITES_MORE].update(_more_field(ck, j) for j in range(1, int(chunks_n.value) + 1))
        for layout in layouts:
            for j, (ch, v, blob, lin, runs) in enumerate(layout):
                e = found_ranges.get(blob) if runs is None else None
                if e is not None:
                    runs = _decode(_ranges_dec, e, "lg.ranges")
                    layout[j] = (ch, v, blob, lin, runs)
                    more[ELEMS].update(_run_blocks(lin, runs))
                    if single:
                        more[LISTS].add(lin)
        if more[ELEMS] or more[LISTS] or more[WRITES_MORE]:
            # An empty list value has no elements, but a warm read still needs its lineage's
            # length: caching length 0 would make every later extension conflict.
            await fetch.read(store, tid, more)
            needs[ELEMS] |= more[ELEMS]
            needs[LISTS] |= more[LISTS]
            needs[WRITES_MORE] = more[WRITES_MORE]

        blobs, elems, lins, writes = (fetch.view(v) for v in (BLOBS, ELEMS, LISTS, WRITES))
        loads = self.serde.loads_typed
        encryption = _encryption(self.serde)
        blocks_read: dict[str, list[Typed]] = {}
        out: list[CheckpointTuple] = []
        for r, body, layout in zip(records, bodies, layouts, strict=True):
            values: dict[str, Any] = {}
            for ch, v, blob, lin, runs in layout:
                if runs is not None:
                    items: list[Typed] = []
                    for start, count in runs:
                        for i in range(start, start + count):
                            block, at = divmod(i, BLOCK)
                            field = _block_field(lin, block)
                            held = blocks_read.get(field)
                            if held is None:
                                e = elems.get(field)
                                held = _decode(_block_dec, e, "lg.elements") if e else []
                                blocks_read[field] = held
                            if at >= len(held):
                                raise OperationalError(
                                    f"thread {tid!r}: element {i} of channel {ch!r} is missing; "
                                    "run rebuild"
                                )
                            items.append(held[at])
                    last_block: tuple[int, tuple[Typed, ...]] | None = None
                    if encryption is None:
                        values[ch] = [loads(item) for item in items]
                    else:
                        inner, cipher = encryption
                        items = [_unseal(cipher, item) for item in items]
                        values[ch] = [inner.loads_typed(item) for item in items]
                    lin_entry = lins.get(lin) if single else None
                    length = int(lin_entry.value) if lin_entry else 0
                    if encryption is not None and length:
                        # The stored last block, if this value reached it (a put continuing
                        # it must rewrite it with the very bytes stored).
                        last = (length - 1) // BLOCK
                        held = blocks_read.get(_block_field(lin, last))
                        if held is not None and len(held) == length - last * BLOCK:
                            last_block = (last, tuple(held))
                    if single:
                        self._lineages.put(
                            (tid, r.ns, ch),
                            _Lineage(
                                length=length,
                                field_version=lin_entry.version if lin_entry else 0,
                                version=v,
                                ranges=tuple(runs),
                                fingerprints=tuple(map(_fingerprint, items)),
                                last_block=last_block,
                            ),
                        )
                elif blob in blobs:
                    typ, data = _decode(_typed_dec, blobs[blob], "lg.blobs")
                    if typ != "empty":
                        values[ch] = loads((typ, data))
            checkpoint = cast(Checkpoint, {**body, "channel_values": values})
            ck = _ck_field(r.ns, r.checkpoint_id)
            n_entry = fetch.entry(WRITES_N, ck)
            if n_entry is None:  # one chunk: an ordinary step
                chunks = [_decode(_writes_dec, writes[ck], "lg.writes") if ck in writes else []]
                stored = chunks[0]
            else:
                fetched = _Views()
                for view in (WRITES, WRITES_N, WRITES_MORE):
                    fetched.hashes[view] = fetch.view(view)
                chunks = _stored_chunks(fetched, ck)
                stored = [w for c in chunks for w in c]
            if single and (ck in writes or n_entry is not None):
                first = writes.get(ck)
                self._writes.put(
                    (tid, ck),
                    _KnownWrites(
                        first.version if first else 0, n_entry.version if n_entry else 0, chunks
                    ),
                )
            # LangGraph's writes_sort_key: the order a super-step applies its tasks' writes.
            ordered = sorted(stored, key=lambda w: (w.task_path, w.task_id, w.idx))
            pending: list[PendingWrite] = [
                (w.task_id, w.channel, loads((w.type, w.data))) for w in ordered
            ]
            conf = {"thread_id": thread_id, "checkpoint_ns": r.ns}
            out.append(
                CheckpointTuple(
                    config={"configurable": {**conf, "checkpoint_id": r.checkpoint_id}},
                    checkpoint=checkpoint,
                    metadata=cast(CheckpointMetadata, loads(r.metadata)),
                    parent_config=(
                        {"configurable": {**conf, "checkpoint_id": r.parent_id}}
                        if r.parent_id
                        else None
                    ),
                    pending_writes=pending,
                )
            )
        return out, {view: tuple(fields) for view, fields in needs.items() if fields}

    # -- writes -------------------------------------------------------------------------------

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        conf = _configurable(config)
        ns = conf.get("checkpoint_ns") or ""
        parent_id = conf.get("checkpoint_id")
        tid = self.thread_id_of(conf["thread_id"])
        body = {k: v for k, v in checkpoint.items() if k != "channel_values"}
        values = checkpoint.get("channel_values", {})
        meta = get_checkpoint_metadata(config, metadata)
        run_id = meta.get("run_id")
        stored_body = self.serde.dumps_typed(body)
        stored_meta = self.serde.dumps_typed(meta)
        inline: list[InlineBlob] = []
        as_lists: dict[str, tuple[Version, list[Typed], _Seal | None]] = {}
        encryption = _encryption(self.serde)
        for ch, ver in new_versions.items():
            if ch not in values:
                inline.append(InlineBlob(ch, ver, "empty", b""))
            elif self.dedupe_lists and type(values[ch]) is list:
                if encryption is None:
                    dumps = self.serde.dumps_typed
                    as_lists[ch] = (ver, [_as_typed(dumps(x)) for x in values[ch]], None)
                else:
                    # Plain pairs to match with the stored elements; only new ones are sealed.
                    dumps = encryption[0].dumps_typed
                    seal = _sealer(encryption[1])
                    as_lists[ch] = (ver, [_as_typed(dumps(x)) for x in values[ch]], seal)
            else:
                inline.append(InlineBlob(ch, ver, *self.serde.dumps_typed(values[ch])))

        store = await self._get_store()
        budget = max(store.max_event_bytes // 2, 1024)
        async with self._lock(tid):
            self._drop_if_lifeless(tid)
            cold = [ch for ch in as_lists if self._lineages.get((tid, ns, ch)) is None]
            if cold and parent_id:
                # A cold cache (a new process): load the parent, as LangGraph itself did before
                # running, so that the new versions can share its elements.
                await self._get(store, tid, conf["thread_id"], ns, parent_id, warm=True)
            conflict: ViewConflictError | IncarnationConflictError | None = None
            for _ in range(ATTEMPTS):
                missing = [ch for ch in as_lists if self._lineages.get((tid, ns, ch)) is None]
                head: tuple[str | None, int] | None = self._heads.get((tid, ns))
                if missing or head is None:
                    await self._load(store, tid, ns, missing, head=head is None)
                    head = self._heads.get((tid, ns)) or (None, 0)
                is_head = head[0] is None or checkpoint["id"] >= head[0]
                plan = self._plan_lists(tid, ns, as_lists, budget)
                record = Record(
                    ns=ns,
                    checkpoint_id=checkpoint["id"],
                    parent_id=parent_id,
                    checkpoint=stored_body,
                    metadata=stored_meta,
                    run_id=run_id if isinstance(run_id, str) else None,
                    lists=self._runs(tid, ns, checkpoint["channel_versions"], new_versions, plan),
                )
                events = self._pack(ns, inline, plan, budget)
                events.append(CheckpointPut(record=record))
                ops = self._guarded_ops(events, ns, plan, head)
                try:
                    await self._write(store, tid, events, ops)
                except EventTooLargeError as exc:
                    raise _too_large(exc, events) from None
                except (ViewConflictError, IncarnationConflictError) as exc:
                    # Another writer extended a lineage or moved the head: forget what we knew
                    # and reload the parent's elements (so the new version still shares them),
                    # then the lineages' lengths and the head as they are now. The thread
                    # deleted (and written again) since: nothing known of it holds any more.
                    conflict = exc
                    if isinstance(exc, IncarnationConflictError):
                        self._forget(tid)
                    for ch in as_lists:
                        self._lineages.pop((tid, ns, ch))
                    self._heads.pop((tid, ns))
                    if parent_id:
                        await self._get(store, tid, conf["thread_id"], ns, parent_id, warm=True)
                    await self._load(store, tid, ns, list(as_lists), head=True)
                    continue
                for ch, p in plan.items():
                    self._lineages.put((tid, ns, ch), p.after)
                self._writes.put((tid, _ck_field(ns, checkpoint["id"])), _KnownWrites(0, 0, [[]]))
                if is_head:
                    self._heads.put((tid, ns), (checkpoint["id"], head[1] + 1))
                    # The next read of the namespace's latest checkpoint is most likely this.
                    self._hints.put(
                        (tid, HEADS, ns),
                        functools.partial(_needs_of, record, dict(checkpoint["channel_versions"])),
                    )
                break
            else:
                assert conflict is not None
                raise conflict
        return {
            "configurable": {
                "thread_id": conf["thread_id"],
                "checkpoint_ns": ns,
                "checkpoint_id": checkpoint["id"],
            }
        }

    def _runs(
        self,
        tid: str,
        ns: str,
        versions: ChannelVersions,
        new_versions: ChannelVersions,
        plan: dict[str, _ListPlan],
    ) -> dict[str, list[tuple[int, int]]]:
        """The runs of the checkpoint's list values this saver knows: those it writes now, and
        those of unchanged channels whose version it wrote or read last."""
        runs = {ch: p.ranges for ch, p in plan.items()}
        for ch, v in versions.items():
            if ch in new_versions:
                continue
            known: _Lineage | None = self._lineages.get((tid, ns, ch))
            if known is not None and type(known.version) is type(v) and known.version == v:
                runs[ch] = list(known.ranges)
        return runs

    async def _load(
        self, store: EventStore, tid: str, ns: str, channels: list[str], *, head: bool
    ) -> None:
        """Read the lineages' lengths (keeping the elements known of them) and the head."""
        fields = tuple(_lineage(ns, ch) for ch in channels)
        reads: list[ViewRead] = [HashGet(LISTS, fields)] if fields else []
        if head:
            reads.append(HashGet(HEADS, (ns,)))
        if not reads:
            return
        snap = await store.read_views(tid, reads)
        self._note_life(tid, snap.incarnation)
        if fields:
            found = snap.results[0]
            assert isinstance(found, dict)
            for ch, lin in zip(channels, fields, strict=True):
                e = found.get(lin)
                length, version = (int(e.value), e.version) if e else (0, 0)
                known: _Lineage | None = self._lineages.get((tid, ns, ch))
                self._lineages.put(
                    (tid, ns, ch),
                    dataclasses.replace(
                        known,
                        length=length,
                        field_version=version,
                        last_block=known.last_block if known.length == length else None,
                    )
                    if known is not None
                    else _Lineage(length=length, field_version=version),
                )
        if head:
            found = snap.results[-1]
            assert isinstance(found, dict)
            e = found.get(ns)
            rec = _decode(_record_dec, e, "lg.heads") if e else None
            self._heads.put((tid, ns), (rec.checkpoint_id, e.version) if rec and e else (None, 0))

    def _plan_lists(
        self,
        tid: str,
        ns: str,
        as_lists: dict[str, tuple[Version, list[Typed], _Seal | None]],
        budget: int,
    ) -> dict[str, _ListPlan]:
        plan: dict[str, _ListPlan] = {}
        for ch, (ver, items, seal) in as_lists.items():
            known: _Lineage = self._lineages.get((tid, ns, ch)) or _Lineage(0, 0)
            prints = tuple(map(_fingerprint, items))
            shared = 0
            for a, b in zip(known.fingerprints, prints, strict=False):
                if a != b:
                    break
                shared += 1
            ranges = _truncate(known.ranges, shared)
            # New elements go on at the lineage's end. Its last block is rewritten whole, so
            # this saver must hold the elements already in it: it does when they are in the
            # shared prefix. Otherwise (another branch wrote them, or nothing is known), and
            # when the block is full enough, the new elements start the next block and the
            # indices left between are never used.
            at = known.length
            block, offset = divmod(at, BLOCK)
            tail: tuple[int, list[Typed]] | None = None
            filled = 0
            if offset and shared < len(items):
                where = _positions(ranges, block * BLOCK, at)
                stored = known.last_block
                if where is None:
                    at = (block + 1) * BLOCK
                elif seal is None:
                    tail = (block, [items[p] for p in where])
                    filled = sum(_item_bytes(items[p]) for p in where)
                elif stored is not None and stored[0] == block and len(stored[1]) == offset:
                    # Encrypted: the list's own pairs are plain, the block holds ciphertexts.
                    tail = (block, list(stored[1]))
                    filled = sum(map(_item_bytes, stored[1]))
                else:
                    at = (block + 1) * BLOCK
            # New elements in runs that fit in an event each; every run sets the lineage's
            # length once, so the field version moves by the number of runs.
            runs: list[tuple[int, list[Typed]]] = []
            size = 0
            for item in items[shared:]:
                if seal is not None:
                    item = seal(item)
                n = _item_bytes(item)
                if at % BLOCK == 0:
                    filled = 0
                elif filled + n > BLOCK_BYTES:
                    at, filled = (at // BLOCK + 1) * BLOCK, 0
                if runs and runs[-1][0] + len(runs[-1][1]) == at and size + n <= budget:
                    runs[-1][1].append(item)
                else:
                    runs.append((at, [item]))
                    size = 0
                size += n
                filled += n
                at += 1
            for start, run in runs:
                _extend(ranges, start, len(run))
            last_block = known.last_block
            if seal is not None and runs:
                last = (at - 1) // BLOCK
                held = list(tail[1]) if tail is not None and tail[0] == last else []
                for start, run in runs:
                    held += [x for i, x in enumerate(run, start) if i // BLOCK == last]
                last_block = (last, tuple(held))
            after = _Lineage(
                length=at if runs else known.length,
                field_version=known.field_version + len(runs),
                version=ver,
                ranges=tuple(ranges),
                fingerprints=prints,
                last_block=last_block if seal is not None else None,
            )
            plan[ch] = _ListPlan(ver, ranges, runs, known, after, tail)
        return plan

    @staticmethod
    def _pack(
        ns: str, inline: list[InlineBlob], plan: dict[str, _ListPlan], budget: int
    ) -> list[Event]:
        # Values go into as few events as the size limit allows (a value larger than the
        # store's max_event_bytes is refused by the store).
        events: list[Event] = []
        values: list[InlineBlob] = []
        lists: list[ListBlob] = []
        elements: list[Elements] = []
        size = 0

        def add(n: int) -> None:
            nonlocal size
            if size and size + n > budget:
                flush()
            size += n

        def flush() -> None:
            nonlocal values, lists, elements, size
            if values or lists or elements:
                events.append(BlobsPut(ns=ns, values=values, lists=lists, elements=elements))
            values, lists, elements, size = [], [], [], 0

        for b in inline:
            add(len(b.data) + len(b.channel) + 64)
            values.append(b)
        for ch, p in plan.items():
            for start, run in p.runs:
                add(sum(_item_bytes(x) for x in run) + len(ch))
                elements.append(Elements(ch, start, run))
            add(len(ch) + 64 + 16 * len(p.ranges))
            lists.append(ListBlob(ch, p.version, p.ranges))
        flush()
        return events

    @staticmethod
    def _guarded_ops(
        events: list[Event],
        ns: str,
        plan: dict[str, _ListPlan],
        head: tuple[str | None, int],
    ) -> list[ViewOp]:
        # The first length update of each lineage carries the version this saver planned from:
        # if another writer extended the lineage meanwhile, the append is refused whole. So
        # does the head, if the checkpoint becomes it (its id is not below the known head's).
        guards = {_lineage(ns, ch): p.before.field_version for ch, p in plan.items()}
        # The blocks the new elements continue, as the store holds them; each event's ops are
        # applied before the next event's are made, as the fold does.
        views = _Views({ns: head[0]} if head[0] is not None else None)
        for ch, p in plan.items():
            if p.tail is not None:
                field = _block_field(_lineage(ns, ch), p.tail[0])
                views.hashes[ELEMS][field] = ViewEntry(0, _enc.encode(p.tail[1]), 0)
        ops: list[ViewOp] = []
        for index, event in enumerate(events):
            event_ops = _event_ops(event, index, views)
            for op in event_ops:
                views.apply(op, 0)
                if isinstance(op, HashSet) and op.view == LISTS and op.field in guards:
                    expected = guards.pop(op.field)
                    op = HashSet(op.view, op.field, op.value, op.event, expected_version=expected)
                elif isinstance(op, HashSet) and op.view == HEADS and op.field == ns:
                    op = HashSet(op.view, op.field, op.value, op.event, expected_version=head[1])
                ops.append(op)
        return ops

    @staticmethod
    async def _append(
        store: EventStore,
        tid: str,
        events: Sequence[Event],
        ops: Sequence[ViewOp],
        *,
        expected_version: ExpectedVersion | None = None,
        expected_incarnation: int | None = None,
    ) -> AppendResult:
        news = [NewEvent(payload=e) for e in events]
        if expected_version is None:
            return await store.append(
                tid, news, view_ops=ops, expected_incarnation=expected_incarnation
            )
        return await store.append(
            tid,
            news,
            view_ops=ops,
            expected_version=expected_version,
            expected_incarnation=expected_incarnation,
        )

    async def _write(
        self, store: EventStore, tid: str, events: Sequence[Event], ops: Sequence[ViewOp]
    ) -> None:
        """Append what was planned from the cached state, in the life that state is of
        (`IncarnationConflictError` once the thread is in another), and note the life it
        landed in (a thread this write created)."""
        life = self._lives.get((tid,))
        result = await self._append(store, tid, events, ops, expected_incarnation=life or None)
        self._note_life(tid, result.incarnation, written=True)

    def _drop_if_lifeless(self, tid: str) -> None:
        """Forget the thread's cached state if its life is not known (the caches evict on
        their own): a write planned from it could not name the life it is of."""
        if self._lives.get((tid,)) is None:
            self._forget(tid)

    def _note_life(self, tid: str, life: int | None, *, written: bool = False) -> None:
        """Record the life the thread's cached state is of, as a read (or, ``written``, an
        append made from that state) found it. Another life than the one recorded: the
        state cached is of a thread that is gone, and is forgotten. A write from state read
        when there was no thread created it (its guards held): that state is of the new life.
        """
        now = life or 0
        known: int | None = self._lives.get((tid,))
        if known is not None and known != now and not (written and known == 0):
            self._forget(tid)
        self._lives.put((tid,), now)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        conf = _configurable(config)
        ns = conf.get("checkpoint_ns") or ""
        checkpoint_id = conf.get("checkpoint_id")
        if not checkpoint_id:
            raise InvalidInputError("put_writes needs configurable.checkpoint_id")
        tid = self.thread_id_of(conf["thread_id"])
        field = _ck_field(ns, checkpoint_id)
        incoming: list[StoredWrite] = []
        for idx, (channel, value) in enumerate(writes):
            typ, data = self.serde.dumps_typed(value)
            slot = WRITES_IDX_MAP.get(channel, idx)
            incoming.append(StoredWrite(task_id, slot, channel, typ, data, task_path))
        store = await self._get_store()
        budget = max(store.max_event_bytes // 2, 1024)
        async with self._lock(tid):
            conflict: ViewConflictError | IncarnationConflictError | None = None
            attempt = 0
            for _ in range(ATTEMPTS):
                self._drop_if_lifeless(tid)
                known: _KnownWrites | None = self._writes.get((tid, field))
                if known is None:
                    known = await self._read_writes(store, tid, field)
                have = {(w.task_id, w.idx) for c in known.chunks for w in c}
                # As LangGraph's own savers do: a regular write already stored is kept, special
                # writes (errors, interrupts; negative slots) are replaced.
                new = [w for w in incoming if w.idx < 0 or (w.task_id, w.idx) not in have]
                if not new:
                    return
                # Writes that are large together go in several events (each merged in turn, as
                # the fold does); the first carries the guard: the chunk count once there is
                # one, else the first chunk (the only one).
                events: list[Event] = []
                ops: list[ViewOp] = []
                chunks = [list(c) for c in known.chunks]
                guard = (WRITES_N, known.count_version) if len(chunks) > 1 else None
                guard = guard or (WRITES, known.first_version)
                for part in _split_writes(new, budget):
                    events.append(WritesPut(ns=ns, checkpoint_id=checkpoint_id, writes=part))
                    for op in _merge_chunks(chunks, part, field, len(events) - 1):
                        if guard is not None and op.view == guard[0]:
                            op = msgspec.structs.replace(op, expected_version=guard[1])
                            guard = None
                        ops.append(op)
                try:
                    await self._write(store, tid, events, ops)
                except EventTooLargeError as exc:
                    raise _too_large(exc, events) from None
                except (ViewConflictError, IncarnationConflictError) as exc:
                    # Another process wrote them meanwhile (or the thread was deleted, and
                    # perhaps written again, since: nothing cached of it holds any more).
                    conflict = exc
                    if isinstance(exc, IncarnationConflictError):
                        self._forget(tid)
                    self._writes.pop((tid, field))
                    # Full jitter: processes writing one step's tasks at once otherwise collide
                    # again in lockstep, and a writer ran out of attempts.
                    attempt += 1
                    pause = min(CONFLICT_BACKOFF_MAX, CONFLICT_BACKOFF_MIN * 2**attempt)
                    await anyio.sleep(random.uniform(0, pause))
                    continue
                bumps = {WRITES: 0, WRITES_N: 0}
                for done in ops:
                    if isinstance(done, HashSet) and done.view in bumps:
                        bumps[done.view] += 1
                self._writes.put(
                    (tid, field),
                    _KnownWrites(
                        known.first_version + bumps[WRITES],
                        known.count_version + bumps[WRITES_N],
                        chunks,
                    ),
                )
                return
            assert conflict is not None
            raise conflict

    async def _read_writes(self, store: EventStore, tid: str, field: str) -> _KnownWrites:
        """A checkpoint's stored writes, chunk by chunk, with the versions its guards need."""
        snap = await store.read_views(tid, [HashGet(WRITES, (field,)), HashGet(WRITES_N, (field,))])
        self._note_life(tid, snap.incarnation)
        first, count = snap.results
        assert isinstance(first, dict) and isinstance(count, dict)
        views = _Views()
        views.hashes[WRITES].update(first)
        views.hashes[WRITES_N].update(count)
        if field in count:
            # The chunks past the first, read after their count: if a writer added to them in
            # between, it moved the count's version too, and the guard refuses this put.
            fields = tuple(_more_field(field, j) for j in range(1, int(count[field].value) + 1))
            more = await store.read_views(tid, [HashGet(WRITES_MORE, fields)])
            if more.incarnation != snap.incarnation:
                raise ThreadReplacedError(tid)  # the chunks would be of another life
            found = more.results[0]
            assert isinstance(found, dict)
            views.hashes[WRITES_MORE].update(found)
        return _KnownWrites(
            first[field].version if field in first else 0,
            count[field].version if field in count else 0,
            _stored_chunks(views, field),
        )

    # -- thread maintenance -------------------------------------------------------------------

    def _forget(self, tid: str) -> None:
        self._lineages.forget_thread(tid)
        self._heads.forget_thread(tid)
        self._writes.forget_thread(tid)
        self._hints.forget_thread(tid)
        self._lives.forget_thread(tid)

    async def adelete_thread(self, thread_id: str) -> None:
        tid = self.thread_id_of(thread_id)
        store = await self._get_store()
        async with self._lock(tid):
            await store.delete_thread(tid, views=list(VIEWS))
            self._forget(tid)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every event of the source thread to the (new) target thread.

        The copy is appended in chunks; each event's ``causation_id`` names its original.
        A copy that fails or is cancelled half way deletes what it wrote (unless the target
        was written by someone else meanwhile), so the target never holds an old state of the
        source as its latest, and the copy can be made again. Only a process that dies half
        way leaves part of a copy behind.

        Raises:
            InvalidInputError: the target thread already has checkpoints.
        """
        src = self.thread_id_of(source_thread_id)
        dst = self.thread_id_of(target_thread_id)
        store = await self._get_store()
        views = _Views()
        expected: ExpectedVersion = NO_THREAD
        # The target's life, from the first chunk on: each later chunk lands only in it (a
        # target deleted and written again up to the copy's version must not get the rest).
        life: int | None = None
        batch: list[RecordedEvent] = []
        # The chunk being appended: sent again (the same events, so the same idempotency key)
        # to learn whether it landed when its append was interrupted.
        sending: _Chunk | None = None

        async def flush() -> None:
            nonlocal expected, life, batch, sending
            if not batch:
                return
            ops: list[ViewOp] = []
            for index, e in enumerate(batch):
                event_ops = _event_ops(e.payload, index, views)
                for op in event_ops:
                    views.apply(op, 0)
                ops += event_ops
            news = [
                NewEvent(
                    payload=e.payload,
                    turn_id=e.turn_id,
                    correlation_id=e.correlation_id,
                    causation_id=e.id,
                )
                for e in batch
            ]
            sending = (news, ops, expected, life)
            try:
                result = await store.append(
                    dst, news, view_ops=ops, expected_version=expected, expected_incarnation=life
                )
            except ConcurrencyError:
                sending = None  # refused whole: nothing of it landed
                if expected is NO_THREAD:
                    raise InvalidInputError(
                        f"copy_thread: target thread {target_thread_id!r} is not empty"
                    ) from None
                raise
            sending = None
            expected, life = result.last_seq, result.incarnation
            batch = []

        async with self._lock(dst):
            try:
                async for event in store.read(src):
                    batch.append(event)
                    if len(batch) >= COPY_CHUNK:
                        await flush()
                await flush()
            except BaseException:
                # A partial copy is a thread whose latest checkpoint is an old one of the
                # source: a graph resumed on it would go on from there, silently.
                with anyio.CancelScope(shield=True), anyio.move_on_after(UNDO_TIMEOUT_S):
                    await _undo_copy(store, dst, expected, life, sending)
                raise
            finally:
                self._forget(dst)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Drop checkpoints from the views: ``keep_latest`` keeps each namespace's latest (its
        highest checkpoint id), ``delete`` drops them all. The log keeps them
        (`CheckpointsRemoved`); delete the thread to reclaim its storage.

        `DeltaChannel`-aware: a delta channel's value is rebuilt from the writes of the kept
        checkpoint's ancestors back to its last snapshot, so ``keep_latest`` also keeps those
        ancestors (with their writes): for each channel the latest checkpoint's metadata
        counts as written since its snapshot (``counters_since_delta_snapshot``), every
        ancestor back to the nearest one whose counters no longer name it (the snapshot, or
        the checkpoint before the channel's first write). Other ancestors are dropped: a kept
        checkpoint's ``parent_config`` may name a parent that is gone (as with savers that
        delete rows), and reading that config answers None.
        """
        if strategy not in ("keep_latest", "delete"):
            raise InvalidInputError(f"unknown prune strategy {strategy!r}")
        store = await self._get_store()

        def select(records: list[tuple[Record, ViewEntry]]) -> set[tuple[str, str]]:
            if strategy == "delete":
                return {(r.ns, r.checkpoint_id) for r, _ in records}
            latest: dict[str, Record] = {}
            for r, _ in records:
                if r.checkpoint_id > getattr(latest.get(r.ns), "checkpoint_id", ""):
                    latest[r.ns] = r
            by_id = {(r.ns, r.checkpoint_id): r for r, _ in records}
            kept = {(r.ns, r.checkpoint_id) for r in latest.values()}
            for head in latest.values():
                kept |= self._delta_ancestors(head, by_id)
            return {(r.ns, r.checkpoint_id) for r, _ in records} - kept

        for thread_id in thread_ids:
            await self._remove(store, self.thread_id_of(thread_id), select, f"prune:{strategy}")

    def _delta_counters(self, rec: Record) -> Mapping[str, Any]:
        metadata = self.serde.loads_typed(rec.metadata)
        counters = metadata.get("counters_since_delta_snapshot") if metadata else None
        return counters if isinstance(counters, Mapping) else {}

    def _delta_ancestors(
        self, head: Record, by_id: Mapping[tuple[str, str], Record]
    ) -> set[tuple[str, str]]:
        """The ancestors ``head``'s delta channels are rebuilt from (see `aprune`)."""
        pending = set(self._delta_counters(head))
        keep: set[tuple[str, str]] = set()
        rec = head
        while pending and rec.parent_id is not None:
            parent = by_id.get((rec.ns, rec.parent_id))
            if parent is None:
                break  # gone already: the rebuild stops there whatever is kept
            keep.add((parent.ns, parent.checkpoint_id))
            pending &= set(self._delta_counters(parent))
            rec = parent
        return keep

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Drop the checkpoints of these runs from every thread of the namespace (a scan).

        The log keeps them (`CheckpointsRemoved`).
        """
        wanted = set(run_ids)
        if not wanted:
            return
        store = await self._get_store()

        def select(records: list[tuple[Record, ViewEntry]]) -> set[tuple[str, str]]:
            return {(r.ns, r.checkpoint_id) for r, _ in records if r.run_id in wanted}

        for info in await store.threads():
            if info.thread_id.startswith(self.thread_prefix):
                await self._remove(store, info.thread_id, select, "delete_for_runs")

    async def _remove(
        self,
        store: EventStore,
        tid: str,
        select: Callable[[list[tuple[Record, ViewEntry]]], set[tuple[str, str]]],
        reason: str,
    ) -> int:
        async with self._lock(tid):
            conflict: ConcurrencyError | None = None
            for _ in range(ATTEMPTS):
                snap = await store.read_views(tid, [HashGetAll(RECORDS), HashGetAll(WRITES_N)])
                entries, counts = snap.results
                assert isinstance(entries, dict) and isinstance(counts, dict)
                records = [(_decode(_record_dec, e, "lg.checkpoints"), e) for e in entries.values()]
                doomed = select(records)
                if not doomed:
                    return 0
                versions = {
                    (r.ns, r.checkpoint_id): self._body(r)["channel_versions"] for r, _ in records
                }
                event = _removal(records, versions, doomed, reason)
                held = _Views()  # the chunk counts, so the removal drops every chunk
                held.hashes[WRITES_N] = counts
                ops = _event_ops(event, 0, held)
                try:
                    await self._append(
                        store,
                        tid,
                        [event],
                        ops,
                        expected_version=snap.version,
                        expected_incarnation=snap.incarnation,
                    )
                except ConcurrencyError as exc:  # the thread moved on (or was replaced): again
                    conflict = exc
                    continue
                self._forget(tid)
                return len(doomed)
            assert conflict is not None
            raise conflict

    # -- audit --------------------------------------------------------------------------------

    async def acheck(self, thread_id: str) -> CheckReport:
        """Compare the thread's views with the fold of its log."""
        store = await self._get_store()
        return await Projector(store, [self.projection]).check(self.thread_id_of(thread_id))

    # -- the sync API: the async methods on the saver's private loop ---------------------------

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return self._run(self.aget_tuple, config)

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Generator[CheckpointTuple, None, None]:
        """`alist` on the saver's loop, read as it is consumed (a page of checkpoints at a
        time), as InMemorySaver's: taking the first of a long history builds one page, not
        every checkpoint with all its channel values."""
        portal = self._bridge.portal()
        listing = portal.call(self._open_listing, config, filter, before, limit)
        try:
            while True:
                try:
                    tup = portal.call(anext, listing)
                except StopAsyncIteration:
                    return
                yield tup
        finally:
            # Closed on its own loop; a generator collected there cannot wait for itself (the
            # loop's own async generator hooks finalize it then).
            with contextlib.suppress(RuntimeError):
                portal.call(listing.aclose)

    async def _open_listing(
        self,
        config: RunnableConfig | None,
        filter: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> AsyncGenerator[CheckpointTuple, None]:
        # Created on the saver's loop, so that loop's hooks finalize it if it is never closed.
        return cast(
            AsyncGenerator[CheckpointTuple, None],
            self.alist(config, filter=filter, before=before, limit=limit),
        )

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return self._run(self.aput, config, checkpoint, metadata, new_versions)

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        self._run(self.aput_writes, config, writes, task_id, task_path)

    def delete_thread(self, thread_id: str) -> None:
        self._run(self.adelete_thread, thread_id)

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self._run(self.acopy_thread, source_thread_id, target_thread_id)

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        self._run(self.aprune, thread_ids, strategy=strategy)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        self._run(self.adelete_for_runs, run_ids)

    def check(self, thread_id: str) -> CheckReport:
        """Sync `acheck`."""
        return self._run(self.acheck, thread_id)


_Chunk = tuple[list[NewEvent], list[ViewOp], ExpectedVersion, int | None]
"""A chunk of a copy: its events, view ops, expected version and the target's life (or None)."""


async def _one_target(
    target: tuple[str, Any, str | None, str | None],
) -> AsyncIterator[tuple[str, Any, str | None, str | None]]:
    yield target


async def _undo_copy(
    store: EventStore, dst: str, written: ExpectedVersion, life: int | None, sending: _Chunk | None
) -> None:
    """Delete what an interrupted copy wrote to ``dst``: its chunks up to version ``written``,
    and the chunk it was sending if that one landed. A target written by anyone else since is
    kept (the delete expects the copy's own version and life)."""
    version = written if isinstance(written, int) else 0
    if sending is not None:
        news, ops, expected, life = sending
        # The same events: answered from the idempotency ledger if they landed. If they had
        # not, they land now, and are deleted with the rest.
        with contextlib.suppress(Exception):
            landed = await store.append(
                dst, news, view_ops=ops, expected_version=expected, expected_incarnation=life
            )
            version, life = landed.last_seq, landed.incarnation
    if version:
        # Only the copy's own life at its own version: a target deleted and written again
        # meanwhile (perhaps up to the same version) is someone else's thread.
        with contextlib.suppress(ConcurrencyError):
            await store.delete_thread(
                dst, views=list(VIEWS), expected_version=version, expected_incarnation=life
            )


def _split_writes(writes: list[StoredWrite], budget: int) -> list[list[StoredWrite]]:
    parts: list[list[StoredWrite]] = []
    size = 0
    for w in writes:
        n = len(w.data) + len(w.type) + len(w.channel) + len(w.task_id) + len(w.task_path) + 16
        if parts and size + n <= budget:
            parts[-1].append(w)
            size += n
        else:
            parts.append([w])
            size = n
    return parts


@dataclass(frozen=True, slots=True)
class _ListPlan:
    version: Version
    ranges: list[tuple[int, int]]
    runs: list[tuple[int, list[Typed]]]  # (start index, new elements)
    before: _Lineage
    after: _Lineage
    tail: tuple[int, list[Typed]] | None = None  # the last block, as it is stored


def _removal(
    records: list[tuple[Record, ViewEntry]],
    versions: Mapping[tuple[str, str], ChannelVersions],
    doomed: set[tuple[str, str]],
    reason: str,
) -> CheckpointsRemoved:
    """The event that removes ``doomed`` checkpoints, with its new heads and dead blobs."""
    remaining = [(r, e) for r, e in records if (r.ns, r.checkpoint_id) not in doomed]
    removed = [r for r, _ in records if (r.ns, r.checkpoint_id) in doomed]
    # A namespace's head is its checkpoint with the highest id.
    heads: dict[str, Record | None] = {}
    for ns in {r.ns for r in removed}:
        current = max((r for r, _ in records if r.ns == ns), key=lambda r: r.checkpoint_id)
        if (ns, current.checkpoint_id) in doomed:
            left = [r for r, _ in remaining if r.ns == ns]
            heads[ns] = max(left, key=lambda r: r.checkpoint_id) if left else None
    kept = {
        (r.ns, ch, _vkey(v))
        for r, _ in remaining
        for ch, v in versions[(r.ns, r.checkpoint_id)].items()
    }
    dead: dict[tuple[str, str, str], BlobRef] = {}
    for r in removed:
        for ch, v in versions[(r.ns, r.checkpoint_id)].items():
            key = (r.ns, ch, _vkey(v))
            if key not in kept:
                dead[key] = BlobRef(r.ns, ch, v)
    return CheckpointsRemoved(
        reason=reason,
        checkpoints=[
            CheckpointRef(r.ns, r.checkpoint_id)
            for r in sorted(removed, key=lambda r: (r.ns, r.checkpoint_id))
        ],
        heads=heads,
        unreferenced=[dead[k] for k in sorted(dead)],
    )
