"""`MemoryEventStore`: the same semantics as the Redis backend, in process, for embedding and tests.

Stored bytes are identical to the Redis backend's (entry fields, view stamps, chain links), so
verification, decoding and damage reports behave the same on both.
"""

from __future__ import annotations

import bisect
import heapq
import re
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import anyio.lowlevel

from ._codec import (
    DEFAULT_MAX_EVENT_BYTES,
    LEDGER_DIGEST_BYTES,
    UNKEYED_FINGERPRINT,
    caller_key_field,
    chain_link,
    check_secret,
    damaged_time,
    decode_entry,
    encode_events,
    entry_fields,
    expected_incarnation_arg,
    expected_version_arg,
    idempotency_key_for,
    idempotency_key_text,
    key_fingerprint,
    log_without_meta,
    missing_entry,
    namespace_chain_key,
    request_digest,
    version_satisfies,
)
from ._contract import (
    ANY,
    AppendResult,
    ChainHead,
    EventStore,
    ExpectedVersion,
    ThreadInfo,
    threads_cursor,
)
from ._errors import (
    ChainKeyMismatchError,
    ConcurrencyError,
    CorruptKeyError,
    FeedGroupNotFoundError,
    FeedTrimmedError,
    IdempotencyKeyReusedError,
    IncarnationConflictError,
    InvalidInputError,
    StoreClosedError,
    ThreadReplacedError,
    ViewConflictError,
)
from ._events import Event, EventRegistry, NewEvent, RecordedEvent
from ._events import registry as default_registry
from ._feed import (
    INCREMENT_MAX,
    CheckpointedState,
    FeedEntry,
    FeedInfo,
    GroupInfo,
    entry_from_fields,
    format_stream_id,
    parse_stream_id,
    parse_stream_ids,
    safe_trim_point,
    validate_block_ms,
    validate_consumer,
    validate_feed_count,
    validate_group,
    validate_group_to_drop,
    validate_hash_names,
    validate_increments,
)
from ._ids import (
    new_ulid,
    validate_count,
    validate_expected_deletion,
    validate_int,
    validate_limit,
    validate_namespace,
    validate_partition,
    validate_seq_range,
    validate_thread_id,
    validate_view_name,
)
from ._keys import DEFAULT_PARTITIONS, partition_of
from ._views import (
    HashDelete,
    HashGet,
    HashGetAll,
    HashLoad,
    HashSet,
    ListLoad,
    ListPop,
    ListPush,
    ListRange,
    ListReset,
    ViewClear,
    ViewEntry,
    ViewOp,
    ViewRead,
    ViewResult,
    ViewSnapshot,
    check_ops,
    check_reads,
    decode_view_result,
    stamp_hash_value,
    stamp_list_value,
)

READ_BATCH = 512
_DIGITS = re.compile(rb"[0-9]{1,20}")


_MAX_ID_PART = 2**64 - 1


@dataclass
class _Thread:
    # Mirrors a Redis stream: entry ids (ms, seq parts) in order, with their fields. The
    # version lives apart from the entries, as in the Redis meta hash, so that damage written
    # straight into the log behaves the same on both backends.
    ids: list[tuple[int, int]] = field(default_factory=list)
    entries: list[dict[bytes, bytes]] = field(default_factory=list)
    times: list[int] = field(default_factory=list)
    version: int = 0
    head: str = ""
    created_ms: int = 0
    incarnation: int = 0
    # The chain key fingerprint it was created with (meta "f"); None as in a thread from
    # before fingerprints were recorded, which adopts its next writer's.
    fingerprint: str | None = None
    ledger: dict[bytes, tuple[int, int, str]] = field(default_factory=dict)
    views: dict[str, list[bytes] | dict[str, bytes]] = field(default_factory=dict)

    def span(self, lo: int, hi: int | None) -> range:
        """Indexes of entries with ids in ``lo-0 .. hi-max`` (all after ``lo`` when hi is None)."""
        first = bisect.bisect_left(self.ids, (lo, 0))
        last = len(self.ids) if hi is None else bisect.bisect_right(self.ids, (hi, _MAX_ID_PART))
        return range(first, max(first, last))

    def raw_xadd(self, entry_id: tuple[int, int], fields: dict[bytes, bytes]) -> None:
        """Insert an entry as XADD with an explicit id would (ids must increase)."""
        if self.ids and entry_id <= self.ids[-1]:
            raise ValueError("entry id is not greater than the stream's top item")
        self.ids.append(entry_id)
        self.entries.append(fields)


@dataclass
class _Group:
    last_delivered: tuple[int, int]
    # entry id -> (consumer, delivery time in ms)
    pending: dict[tuple[int, int], tuple[str, float]] = field(default_factory=dict)


@dataclass
class _Feed:
    """A partition's feed stream with consumer groups, as Redis keeps them."""

    ids: list[tuple[int, int]] = field(default_factory=list)
    entries: dict[tuple[int, int], dict[bytes, bytes]] = field(default_factory=dict)
    last_id: tuple[int, int] = (0, 0)
    groups: dict[str, _Group] = field(default_factory=dict)
    trimmed_to: tuple[int, int] = (0, 0)  # Redis's max-deleted-entry-id

    def add(self, fields: dict[bytes, bytes]) -> None:
        ms = int(time.time() * 1000)
        new = (ms, 0) if ms > self.last_id[0] else (self.last_id[0], self.last_id[1] + 1)
        self.ids.append(new)
        self.entries[new] = fields
        self.last_id = new

    def after(self, after: tuple[int, int], count: int) -> list[tuple[int, int]]:
        start = bisect.bisect_right(self.ids, after)
        return self.ids[start : start + count]


def _group_infos(feed: _Feed, *, held_only: bool = False) -> list[GroupInfo]:
    """The groups as `feed_groups` lists them; ``held_only``: each one's oldest pending entry
    among those the feed still holds (what trimming must keep)."""
    infos = []
    for name, g in feed.groups.items():
        pending = [i for i in g.pending if i in feed.entries] if held_only else list(g.pending)
        infos.append(
            GroupInfo(
                name=name,
                last_delivered=format_stream_id(g.last_delivered),
                pending=len(g.pending),
                oldest_pending=format_stream_id(min(pending)) if pending else None,
            )
        )
    return infos


def _lost_pending(
    partition: int, group: str, feed: _Feed, lost: list[tuple[int, int]]
) -> FeedTrimmedError:
    ids = [format_stream_id(i) for i in lost]
    trimmed_to = format_stream_id(feed.trimmed_to)
    return FeedTrimmedError(partition, f"group {group!r}", ids[0], trimmed_to, ids)


@dataclass
class _Namespace:
    partitions: int
    threads: dict[str, _Thread] = field(default_factory=dict)
    feeds: dict[int, _Feed] = field(default_factory=dict)
    checkpoints: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)
    aux: dict[tuple[int, str, str], dict[str, int]] = field(default_factory=dict)
    index: dict[str, int] = field(default_factory=dict)
    id: str = field(default_factory=new_ulid)  # `namespace_id`


def _holds_data(ns: _Namespace) -> bool:
    # Every store opens its namespace here (readers too), so what was written is the sign.
    return bool(ns.threads) or any(feed.last_id != (0, 0) for feed in ns.feeds.values())


class MemoryServer:
    """The shared state behind `MemoryEventStore`s: stores on one server see each other's writes."""

    _named: ClassVar[dict[str, MemoryServer]] = {}
    _named_lock = threading.Lock()

    def __init__(self) -> None:
        self.namespaces: dict[str, _Namespace] = {}

    @classmethod
    def named(cls, name: str) -> MemoryServer:
        """The process-wide server called ``name`` (``memory://name`` URLs share it)."""
        with cls._named_lock:
            server = cls._named.get(name)
            if server is None:
                server = cls._named[name] = cls()
            return server

    def namespace(self, name: str, partitions: int) -> _Namespace:
        ns = self.namespaces.get(name)
        if ns is None:
            ns = self.namespaces[name] = _Namespace(partitions)
        return ns


def _check_life(
    thread_id: str,
    thread: _Thread | None,
    version: int,
    expected_version: object,
    expected_incarnation: int | None,
) -> None:
    """As the scripts: only the life tells a thread from a later one at the same version (a
    thread without a version has no life, whatever it still holds)."""
    if expected_incarnation is not None and (
        not version or thread is None or thread.incarnation != expected_incarnation
    ):
        raise IncarnationConflictError(
            thread_id,
            expected_version,
            version,
            expected_incarnation,
            thread.incarnation if thread is not None and version else None,
        )


_incarnation_lock = threading.Lock()
_last_incarnation = 0


def _incarnation() -> int:
    """A new thread life's marker, as Redis makes it (creation time in us), never repeated here."""
    global _last_incarnation
    with _incarnation_lock:
        _last_incarnation = max(_last_incarnation + 1, time.time_ns() // 1000)
        return _last_incarnation


def _field_version(raw: bytes | None) -> int:
    if raw is None:
        return 0
    head = raw.split(b":", 1)[0]
    return int(head) if head.isdigit() else 0


class MemoryEventStore(EventStore):
    """The event log in process memory, with exactly the semantics of `RedisEventStore`."""

    def __init__(
        self,
        *,
        namespace: str = "default",
        partitions: int = DEFAULT_PARTITIONS,
        registry: EventRegistry | None = None,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        secret: bytes | None = None,
        server: MemoryServer | None = None,
    ) -> None:
        self.namespace = validate_namespace(namespace)
        self.server = server or MemoryServer()
        self._ns = self.server.namespace(self.namespace, partitions)
        # Like the Redis backend, the first store to touch a namespace fixes its partitions.
        self.partitions = self._ns.partitions
        self.registry = registry or default_registry
        self.max_event_bytes = max_event_bytes
        # The key the chain is linked with: derived for this namespace (`namespace_chain_key`).
        # An empty secret is refused, not taken as no key (`check_secret`).
        key = check_secret(secret)
        self._secret = None if key is None else namespace_chain_key(key, self.namespace)
        self._fingerprint = key_fingerprint(self._secret)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    def _thread(self, thread_id: str) -> _Thread | None:
        validate_thread_id(thread_id)
        self._check_open()
        return self._ns.threads.get(thread_id)

    # -- append ---------------------------------------------------------------------------------

    async def append(
        self,
        thread_id: str,
        events: Sequence[Event | NewEvent],
        *,
        expected_version: ExpectedVersion = ANY,
        idempotency_key: str | None = None,
        view_ops: Sequence[ViewOp] = (),
        expected_incarnation: int | None = None,
    ) -> AppendResult:
        encoded = encode_events(
            thread_id,
            events,
            self.registry,
            max_event_bytes=self.max_event_bytes,
            secret=self._secret,
        )
        expected_version_arg(expected_version)  # a malformed one is refused before the yield
        expected_incarnation_arg(expected_incarnation)
        ops = list(view_ops)
        check_ops(ops, len(encoded), in_append=True)
        for op in ops:
            validate_view_name(op.view)
            if isinstance(op, ListLoad | HashLoad):
                raise InvalidInputError(f"{type(op).__name__} is not valid inside an append")
        ikey = idempotency_key_for(idempotency_key, encoded[0].id_bytes)
        # As much of the digest as the Redis ledger keeps: both backends answer alike.
        rdigest = request_digest(encoded)[: 2 * LEDGER_DIGEST_BYTES]
        # A real server answers after a network hop; yielding here lets concurrent appenders
        # interleave as they would against Redis. Everything after it runs without a yield,
        # which is what makes the append atomic.
        await anyio.lowlevel.checkpoint()
        self._check_open()

        thread = self._ns.threads.get(thread_id) or _Thread()
        prior = thread.ledger.get(ikey)
        if prior is not None:
            if prior[2] != rdigest:
                raise IdempotencyKeyReusedError(
                    thread_id, idempotency_key_text(idempotency_key, encoded[0].id)
                )
            return AppendResult(
                thread_id, prior[0], prior[1], duplicate=True, incarnation=thread.incarnation
            )
        if thread.fingerprint is not None and thread.fingerprint != self._fingerprint:
            raise ChainKeyMismatchError(
                thread_id, thread.fingerprint != UNKEYED_FINGERPRINT, bool(self._secret)
            )
        version = thread.version
        if version == 0 and thread.entries:  # as the append script: a log without its meta
            raise log_without_meta(thread_id, "; nothing was appended")
        # As the script: only the life tells this thread from a later one at the same version.
        _check_life(thread_id, thread, version, expected_version, expected_incarnation)
        if not version_satisfies(expected_version, version):
            raise ConcurrencyError(thread_id, expected_version, version)
        # Guards see the ops before them in this append, as if its events came one by one (as
        # the script does): a field's version after the earlier sets, deletes and clears.
        after: dict[tuple[str, str], int] = {}
        cleared: set[str] = set()
        for op in ops:
            if isinstance(op, HashSet | HashDelete):
                known = after.get((op.view, op.field))
                if known is None:
                    view = None if op.view in cleared else thread.views.get(op.view)
                    cur = view.get(op.field) if isinstance(view, dict) else None
                    known = _field_version(cur)
                if op.expected_version is not None and known != op.expected_version:
                    raise ViewConflictError(
                        thread_id, op.view, op.field, op.expected_version, known
                    )
                after[(op.view, op.field)] = known + 1 if isinstance(op, HashSet) else 0
            elif isinstance(op, ViewClear | ListPush | ListReset):
                cleared.add(op.view)
                after = {vf: v for vf, v in after.items() if vf[0] != op.view}

        now = int(time.time() * 1000)
        last_time = thread.times[-1] if thread.times else 0
        now = max(now, last_time)
        prev = thread.head
        for i, e in enumerate(encoded):
            seq = version + 1 + i
            prev = chain_link(prev, seq, now, e.digest)
            thread.raw_xadd((seq, 0), entry_fields(e, now, prev))
            thread.times.append(now)
        first, last = version + 1, version + len(encoded)
        for op in ops:
            self._apply(thread, op, version)
        if version == 0:
            thread.created_ms = now
            thread.incarnation = _incarnation()
            self._ns.threads[thread_id] = thread
        thread.fingerprint = self._fingerprint
        thread.version = last
        thread.head = prev
        thread.ledger[ikey] = (first, last, rdigest)
        p = partition_of(thread_id, self.partitions)
        self._ns.feeds.setdefault(p, _Feed()).add(
            {
                b"t": thread_id.encode(),
                b"f": b"%d" % first,
                b"l": b"%d" % last,
                b"n": b"%d" % thread.incarnation,
            }
        )
        self._ns.index[thread_id] = now
        return AppendResult(thread_id, first, last, incarnation=thread.incarnation)

    @staticmethod
    def _apply(thread: _Thread, op: ViewOp, version: int) -> None:
        views = thread.views
        if isinstance(op, ListPush | ListReset):
            stamped = [stamp_list_value(version + 1 + op.event, v) for v in op.values]
            current = views.get(op.view)
            if isinstance(op, ListReset) or not isinstance(current, list):
                views[op.view] = stamped
            else:
                current.extend(stamped)
        elif isinstance(op, ListPop):
            current = views.get(op.view)
            if isinstance(current, list):
                del current[max(0, len(current) - op.count) :]
        elif isinstance(op, HashSet):
            current = views.get(op.view)
            if not isinstance(current, dict):
                current = views[op.view] = {}
            ver = _field_version(current.get(op.field)) + 1
            current[op.field] = stamp_hash_value(ver, version + 1 + op.event, op.value)
        elif isinstance(op, HashDelete):
            current = views.get(op.view)
            if isinstance(current, dict):
                current.pop(op.field, None)
        elif isinstance(op, ViewClear):
            views.pop(op.view, None)
        # Redis deletes a key whose list or hash becomes empty; mirror it.
        if not views.get(op.view):
            views.pop(op.view, None)

    # -- reads ----------------------------------------------------------------------------------

    async def version(self, thread_id: str) -> int:
        thread = self._thread(thread_id)
        return thread.version if thread else 0

    async def chain_key_fingerprint(self, thread_id: str) -> str | None:
        thread = self._thread(thread_id)
        return thread.fingerprint if thread else None

    async def incarnation(self, thread_id: str) -> int | None:
        thread = self._thread(thread_id)
        await anyio.lowlevel.checkpoint()
        # A thread's views left after it was deleted are no thread (version 0), as on Redis.
        return thread.incarnation if thread is not None and thread.version else None

    async def chain_head(self, thread_id: str) -> ChainHead | None:
        thread = self._thread(thread_id)
        await anyio.lowlevel.checkpoint()
        if thread is None or not thread.version:
            return None
        # No time recorded apart from the events' own, which nothing outside can edit: none.
        return ChainHead(thread.version, thread.head)

    async def recorded_append(self, thread_id: str, idempotency_key: str) -> AppendResult | None:
        ikey = caller_key_field(idempotency_key)
        thread = self._thread(thread_id)
        await anyio.lowlevel.checkpoint()
        prior = thread.ledger.get(ikey) if thread else None
        if prior is None or thread is None:
            return None
        return AppendResult(
            thread_id, prior[0], prior[1], duplicate=True, incarnation=thread.incarnation
        )

    async def read_raw(
        self,
        thread_id: str,
        *,
        start: int = 1,
        stop: int | None = None,
        count: int = READ_BATCH,
        incarnation: int | None = None,
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        validate_seq_range(start, stop)
        validate_feed_count(count)
        thread = self._thread(thread_id)
        if thread is None or (incarnation is not None and thread.incarnation != incarnation):
            return []
        span = thread.span(max(start, 1), stop)[:count]
        return [(_entry_id(thread.ids[i]), dict(thread.entries[i])) for i in span]

    async def read(
        self,
        thread_id: str,
        *,
        start: int = 1,
        stop: int | None = None,
        backwards: bool = False,
        limit: int | None = None,
    ) -> AsyncIterator[RecordedEvent]:
        validate_limit(limit)
        validate_seq_range(start, stop)
        thread = self._thread(thread_id)
        if thread is None:
            return
        span = thread.span(max(start, 1), stop)
        if backwards:
            span = span[::-1]
        if limit is not None:
            span = span[:limit]
        for n, i in enumerate(span):
            if n and n % READ_BATCH == 0:
                await anyio.lowlevel.checkpoint()
                if self._thread(thread_id) is not thread:
                    # As on Redis, where each page is read with the thread's life: a read
                    # does not go on in a life of the thread that is gone.
                    raise ThreadReplacedError(thread_id)
            yield decode_entry(
                thread_id, _entry_id(thread.ids[i]), thread.entries[i], self.registry
            )

    async def seq_at(self, thread_id: str, time_ms: int) -> int:
        validate_int(time_ms, "time_ms")
        thread = self._thread(thread_id)
        if thread is None:
            return 0
        # The search seq_at.lua makes, over the stored entries' times rather than the times
        # this backend appended: damage written into the log is found, as on Redis.
        lo, hi = 0, thread.version
        if hi == 0 and thread.ids:
            raise log_without_meta(thread_id)  # a log, and no version (a lost meta)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            i = bisect.bisect_left(thread.ids, (mid, 0))
            if i == len(thread.ids) or thread.ids[i] != (mid, 0):
                # Never answered from the entry after it, nor searched below it.
                raise missing_entry(thread_id, mid, thread.version)
            raw = thread.entries[i].get(b"s")
            if raw is None or _DIGITS.fullmatch(raw) is None:
                entry_id = b"%d-%d" % thread.ids[i]
                raise damaged_time(thread_id, entry_id, raw)
            if int(raw) <= time_ms:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- views ----------------------------------------------------------------------------------

    async def read_list(
        self, thread_id: str, view: str, start: int = 0, stop: int = -1
    ) -> list[ViewEntry]:
        validate_int(start, "start")
        validate_int(stop, "stop")
        snap = await self.read_views(thread_id, [ListRange(view, start, stop)])
        result = snap.results[0]
        assert isinstance(result, list)
        return result

    async def read_views(self, thread_id: str, reads: Sequence[ViewRead]) -> ViewSnapshot:
        reads = check_reads(reads)
        thread = self._thread(thread_id)
        await anyio.lowlevel.checkpoint()
        views = thread.views if thread else {}
        results: list[ViewResult] = []
        for r in reads:  # checked by `check_reads`
            view = views.get(r.view)
            raw: list[bytes]
            if isinstance(r, ListRange):
                raw = _lrange(view if isinstance(view, list) else [], r.start, r.stop)
            elif isinstance(r, HashGetAll):
                raw = _flat(view.items() if isinstance(view, dict) else ())
            elif isinstance(r, HashGet):
                h = view if isinstance(view, dict) else {}
                raw = _flat((f.encode(), h[f]) for f in r.fields if f in h)
            else:  # HashGetListed
                h = view if isinstance(view, dict) else {}
                lst = views.get(r.list_view)
                names = _lrange(lst if isinstance(lst, list) else [], r.start, r.stop)
                # Redis looks the raw bytes up; bytes that are not UTF-8 then match no field.
                fields = [n.split(b":", 1)[1].decode("utf-8", "surrogateescape") for n in names]
                raw = _flat((f.encode(), h[f]) for f in fields if f in h)
            results.append(decode_view_result(thread_id, r, raw))
        version = thread.version if thread else 0
        return ViewSnapshot(version, results, thread.incarnation if thread and version else None)

    async def load_views(
        self,
        thread_id: str,
        ops: Sequence[ViewOp],
        *,
        expected_version: int,
        expected_incarnation: int | None = None,
    ) -> None:
        expected_incarnation_arg(expected_incarnation)
        thread = self._thread(thread_id)
        await anyio.lowlevel.checkpoint()
        version = thread.version if thread else 0
        _check_life(thread_id, thread, version, expected_version, expected_incarnation)
        if version != expected_version:
            raise ConcurrencyError(thread_id, expected_version, version)
        for op in ops:
            validate_view_name(op.view)
            if not isinstance(op, ListLoad | HashLoad | ViewClear):
                raise InvalidInputError(f"{type(op).__name__} cannot be loaded outside an append")
        if thread is None:
            return  # views of a thread that has no events are empty by definition
        for op in ops:
            thread.views.pop(op.view, None)
            if version == 0:
                continue  # no events (e.g. deleted, views kept): a load can only empty a view
            if isinstance(op, ListLoad) and op.entries:
                thread.views[op.view] = [stamp_list_value(e.seq, e.value) for e in op.entries]
            elif isinstance(op, HashLoad) and op.entries:
                thread.views[op.view] = {
                    f: stamp_hash_value(e.version, e.seq, e.value) for f, e in op.entries.items()
                }
        if version > 0 and thread_id not in self._ns.index:
            # As on Redis: a load lists a thread with events that the index lost.
            self._ns.index[thread_id] = (
                thread.times[-1] if thread.times else int(time.time() * 1000)
            )

    async def threads(
        self,
        *,
        limit: int | None = None,
        before_ms: int | None = None,
        after: ThreadInfo | tuple[int, str] | None = None,
        partition: int | None = None,
    ) -> list[ThreadInfo]:
        self._check_open()
        validate_limit(limit)
        cursor = threads_cursor(before_ms, after)
        if partition is not None:
            validate_partition(partition, self.partitions)
        rows = (
            info
            for info in (
                ThreadInfo(t, ms, partition_of(t, self.partitions))
                for t, ms in self._ns.index.items()
                if cursor is None or (ms, t) < cursor
            )
            if partition is None or info.partition == partition
        )
        # Newest first, ties by thread id descending: the order ZREVRANGE gives on Redis.
        key = lambda t: (t.last_activity_ms, t.thread_id)  # noqa: E731
        if limit is not None:
            return heapq.nlargest(limit, rows, key=key)
        return sorted(rows, key=key, reverse=True)

    async def indexed(self, thread_id: str) -> bool:
        validate_thread_id(thread_id)
        self._check_open()
        await anyio.lowlevel.checkpoint()
        return thread_id in self._ns.index

    async def stored_threads(self) -> list[str]:
        self._check_open()
        await anyio.lowlevel.checkpoint()
        # A thread with entries or a version has a log or a meta hash in Redis terms; one left
        # with views only (deleted without naming them) has neither.
        return sorted(t for t, th in self._ns.threads.items() if th.ids or th.version)

    async def delete_thread(
        self,
        thread_id: str,
        *,
        views: Sequence[str] = (),
        expected_version: int | None = None,
        expected_incarnation: int | None = None,
    ) -> int:
        validate_thread_id(thread_id)
        for view in views:
            validate_view_name(view)
        validate_expected_deletion(expected_version)
        expected_incarnation_arg(expected_incarnation)
        await anyio.lowlevel.checkpoint()
        thread = self._thread(thread_id)  # as it is now, after the checkpoint
        actual = thread.version if thread is not None else 0
        _check_life(thread_id, thread, actual, expected_version, expected_incarnation)
        if expected_version is not None and actual != expected_version:
            raise ConcurrencyError(thread_id, expected_version, actual)
        if thread is None:
            return 0
        # Every view goes, named or not, as on Redis (where each view name is recorded for
        # its partition before it is first written).
        del self._ns.threads[thread_id]
        self._ns.index.pop(thread_id, None)
        p = partition_of(thread_id, self.partitions)
        self._ns.feeds.setdefault(p, _Feed()).add(
            {
                b"t": thread_id.encode(),
                b"f": b"0",
                b"l": b"%d" % thread.version,
                b"n": b"%d" % thread.incarnation,
                b"x": b"deleted",
            }
        )
        return thread.version

    # -- the change feed ------------------------------------------------------------------------

    def _feed(self, partition: int, *, create: bool = False) -> _Feed | None:
        self._check_open()
        validate_partition(partition, self.partitions)
        feed = self._ns.feeds.get(partition)
        if feed is None and create:
            feed = self._ns.feeds[partition] = _Feed()
        return feed

    def _group(self, partition: int, group: str) -> tuple[_Feed, _Group]:
        validate_group(group)
        feed = self._feed(partition)
        grp = feed.groups.get(group) if feed is not None else None
        if feed is None or grp is None:
            raise FeedGroupNotFoundError(partition, group)
        return feed, grp

    @staticmethod
    def _out(partition: int, feed: _Feed, ids: Sequence[tuple[int, int]]) -> list[FeedEntry]:
        return [
            # (It wrote these fields itself: nothing outside a process can edit them.)
            entry_from_fields(
                f"memory feed {partition}", partition, format_stream_id(i), feed.entries[i]
            )
            for i in ids
            if i in feed.entries
        ]

    async def read_feed(
        self,
        partition: int,
        *,
        after: str = "0-0",
        count: int = READ_BATCH,
        reader: str | None = None,
    ) -> list[FeedEntry]:
        after_id = parse_stream_id(after)
        validate_feed_count(count)
        feed = self._feed(partition)
        await anyio.lowlevel.checkpoint()
        if feed is None:
            return []
        if reader is not None and feed.trimmed_to > after_id:
            raise FeedTrimmedError(partition, reader, after, format_stream_id(feed.trimmed_to))
        return self._out(partition, feed, feed.after(after_id, count))

    async def create_feed_group(self, partition: int, group: str, *, start: str = "0-0") -> bool:
        validate_group(group)
        start_id = parse_stream_id(start)
        feed = self._feed(partition, create=True)
        assert feed is not None
        if group in feed.groups:
            return False
        feed.groups[group] = _Group(last_delivered=start_id)
        return True

    async def read_feed_group(
        self,
        partition: int,
        group: str,
        consumer: str,
        *,
        count: int = READ_BATCH,
        block_ms: int | None = None,
        pending: bool = False,
    ) -> list[FeedEntry]:
        validate_consumer(consumer)
        validate_feed_count(count)
        validate_block_ms(block_ms)
        feed, grp = self._group(partition, group)
        if pending:
            mine = sorted(i for i, (c, _) in grp.pending.items() if c == consumer)[:count]
            await anyio.lowlevel.checkpoint()
            lost = [i for i in mine if i not in feed.entries]  # trimmed before acknowledged
            if lost:
                raise _lost_pending(partition, group, feed, lost)
            return self._out(partition, feed, mine)
        deadline = time.monotonic() + (block_ms or 0) / 1000
        while True:
            ids = feed.after(grp.last_delivered, count)
            if ids or block_ms is None or time.monotonic() >= deadline:
                break
            await anyio.sleep(0.005)
        now = time.monotonic() * 1000
        for i in ids:
            grp.pending[i] = (consumer, now)
        if ids:
            grp.last_delivered = ids[-1]
        await anyio.lowlevel.checkpoint()
        return self._out(partition, feed, ids)

    async def claim_feed(
        self,
        partition: int,
        group: str,
        consumer: str,
        *,
        min_idle_ms: int,
        count: int = READ_BATCH,
    ) -> list[FeedEntry]:
        validate_consumer(consumer)
        validate_count(min_idle_ms, "min_idle_ms")
        validate_feed_count(count)
        feed, grp = self._group(partition, group)
        now = time.monotonic() * 1000
        claimed: list[tuple[int, int]] = []
        lost: list[tuple[int, int]] = []
        for i in sorted(grp.pending):
            if len(claimed) >= count:
                break
            _, since = grp.pending[i]
            if now - since >= min_idle_ms:
                if i not in feed.entries:  # trimmed while pending: XAUTOCLAIM drops it
                    del grp.pending[i]
                    lost.append(i)
                    continue
                grp.pending[i] = (consumer, now)
                claimed.append(i)
        await anyio.lowlevel.checkpoint()
        if lost:
            raise _lost_pending(partition, group, feed, lost)
        return self._out(partition, feed, claimed)

    async def ack_feed(self, partition: int, group: str, ids: Sequence[str]) -> int:
        parsed = parse_stream_ids(ids)
        _, grp = self._group(partition, group)
        done = 0
        for entry_id in parsed:
            if grp.pending.pop(entry_id, None) is not None:
                done += 1
        return done

    async def advance_feed_group(self, partition: int, group: str, to: str) -> None:
        target = parse_stream_id(to)
        _, grp = self._group(partition, group)
        grp.last_delivered = target
        for i in [i for i in grp.pending if i <= target]:
            del grp.pending[i]

    async def feed_groups(self, partition: int) -> list[GroupInfo]:
        feed = self._feed(partition)
        return [] if feed is None else _group_infos(feed)

    async def trim_feed(self, partition: int, *, max_age_ms: int | None = None) -> int:
        validate_limit(max_age_ms, "max_age_ms")
        feed = self._feed(partition)
        if feed is None:
            return 0
        # Read with no await before the trim, as Redis's script reads them: a group registered
        # meanwhile is waited for. A pending entry trimmed already is needed by nobody.
        point = safe_trim_point(_group_infos(feed, held_only=True))
        if max_age_ms is not None:
            aged = f"{max(int(time.time() * 1000) - max_age_ms, 0)}-0"
            point = aged if point is None else max(point, aged, key=parse_stream_id)
        if point is None:
            return 0
        cut = bisect.bisect_left(feed.ids, parse_stream_id(point))
        for i in feed.ids[:cut]:
            del feed.entries[i]
        if cut:
            feed.trimmed_to = max(feed.trimmed_to, feed.ids[cut - 1])
        del feed.ids[:cut]
        return cut

    async def feed_info(self, partition: int) -> FeedInfo:
        feed = self._feed(partition) or _Feed()
        return FeedInfo(
            partition=partition,
            length=len(feed.ids),
            first_id=format_stream_id(feed.ids[0]) if feed.ids else None,
            last_id=format_stream_id(feed.last_id),
            trimmed_to=format_stream_id(feed.trimmed_to),
        )

    async def delete_feed_group(self, partition: int, group: str) -> bool:
        validate_group_to_drop(group)
        feed = self._feed(partition)
        return feed is not None and feed.groups.pop(group, None) is not None

    async def apply_checkpointed(
        self,
        partition: int,
        name: str,
        *,
        expected: str,
        checkpoint: str,
        incr: Sequence[tuple[str, str, int]] = (),
    ) -> bool:
        self._feed(partition)
        validate_view_name(name)
        new = parse_stream_id(checkpoint)
        if new <= parse_stream_id(expected):
            raise InvalidInputError(f"checkpoint {checkpoint} must be above {expected}")
        increments = validate_increments(incr)
        await anyio.lowlevel.checkpoint()
        stored = self._ns.checkpoints.get((partition, name))
        if (format_stream_id(stored) if stored else "0-0") != expected:
            return False
        # All or nothing, as the Redis script: a field kept as a 64-bit int (as Redis keeps
        # it) that would overflow refuses the batch before anything is written.
        staged: dict[tuple[str, str], int] = {}
        for hash_name, field_name, amount in increments:
            held = self._ns.aux.get((partition, name, hash_name), {})
            value = staged.get((hash_name, field_name), held.get(field_name, 0)) + amount
            if not -INCREMENT_MAX - 1 <= value <= INCREMENT_MAX:
                raise InvalidInputError(
                    f"increment of field {field_name!r} of {hash_name!r} would overflow a "
                    "64-bit int: nothing written, the checkpoint stays"
                )
            staged[hash_name, field_name] = value
        for (hash_name, field_name), value in staged.items():
            self._ns.aux.setdefault((partition, name, hash_name), {})[field_name] = value
        self._ns.checkpoints[(partition, name)] = new
        return True

    async def delete_checkpointed(
        self, partition: int, name: str, *, hashes: Sequence[str] = ()
    ) -> CheckpointedState:
        self._feed(partition)
        validate_view_name(name)
        validate_hash_names(hashes)  # every hash written is known here: the names add none
        await anyio.lowlevel.checkpoint()
        stored = self._ns.checkpoints.pop((partition, name), None)
        mine = sorted(k for k in self._ns.aux if k[:2] == (partition, name))
        for key in mine:
            del self._ns.aux[key]
        return CheckpointedState(
            checkpoint=format_stream_id(stored) if stored else None,
            hashes=[hash_name for _, _, hash_name in mine],
        )

    async def read_aux(self, partition: int, name: str, hash_name: str) -> dict[str, int]:
        self._feed(partition)
        return dict(self._ns.aux.get((partition, name, hash_name), {}))

    async def checkpoint_of(self, partition: int, name: str) -> str:
        self._feed(partition)
        found = self._ns.checkpoints.get((partition, name))
        return format_stream_id(found) if found else "0-0"

    async def checkpoints(
        self, partition: int, *, damaged: dict[str, CorruptKeyError] | None = None
    ) -> dict[str, str]:
        # Stored parsed: nothing here can be damaged (``damaged`` stays as given).
        self._feed(partition)
        return {
            name: format_stream_id(at)
            for (p, name), at in self._ns.checkpoints.items()
            if p == partition
        }

    async def namespace_id(self) -> str:
        self._check_open()
        return self._ns.id

    async def namespace_exists(self) -> bool:
        self._check_open()
        return _holds_data(self._ns)

    async def known_namespaces(self) -> list[str] | None:
        self._check_open()
        return sorted(name for name, ns in self.server.namespaces.items() if _holds_data(ns))

    async def close(self) -> None:
        self._closed = True


def _entry_id(parts: tuple[int, int]) -> bytes:
    return b"%d-%d" % parts


def _lrange(values: list[bytes], start: int, stop: int) -> list[bytes]:
    """Redis LRANGE semantics (inclusive stop, negative indexes from the end)."""
    n = len(values)
    if start < 0:
        start = max(n + start, 0)
    if stop < 0:
        stop = n + stop
    if start > stop or start >= n:
        return []
    return values[start : min(stop, n - 1) + 1]


def _flat(pairs: object) -> list[bytes]:
    out: list[bytes] = []
    for f, v in pairs:  # type: ignore[attr-defined]
        out.append(f.encode() if isinstance(f, str) else f)
        out.append(v)
    return out
