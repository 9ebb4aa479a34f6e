"""The `EventStore` contract every backend implements, and the values it exchanges."""

from __future__ import annotations

import abc
import enum
import inspect
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Any, Self

from ._errors import (
    CorruptEventError,
    CorruptKeyError,
    InvalidInputError,
    ThreadReplacedError,
    WrongKeyTypeError,
)
from ._events import Event, EventRegistry, NewEvent, PayloadRow, RecordedEvent
from ._feed import CheckpointedState, FeedEntry, FeedInfo, GroupInfo, validate_feed_count
from ._gc import paused_collector
from ._ids import validate_int, validate_thread_id
from ._views import ViewEntry, ViewOp, ViewRead, ViewSnapshot


class StreamState(enum.Enum):
    """Symbolic expected versions."""

    ANY = "any"
    """Append whatever the thread's version."""
    NO_THREAD = "no_thread"
    """Append only if the thread has no events yet."""
    EXISTS = "exists"
    """Append only if the thread has at least one event."""

    def __repr__(self) -> str:
        return self.name


ANY = StreamState.ANY
NO_THREAD = StreamState.NO_THREAD
EXISTS = StreamState.EXISTS

ExpectedVersion = StreamState | int
"""`ANY`, `NO_THREAD`, `EXISTS`, or the exact current version (the seq of the last event)."""


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Where an append landed: the seqs of its first and last events.

    ``duplicate`` is True when the idempotency key matched an earlier append, whose result this
    is; nothing was written by the retry.

    ``incarnation`` is the life the thread is in right after the append (`EventStore.incarnation`;
    for a duplicate, the life it is in now), to pass as the next append's
    ``expected_incarnation``: a writer that created the thread learns its life without another
    round trip. None where the backend records none (`EventStore.recorded_append` on a thread
    deleted since).
    """

    thread_id: str
    first_seq: int
    last_seq: int
    duplicate: bool = field(default=False, compare=False)
    incarnation: int | None = field(default=None, compare=False)

    @property
    def version(self) -> int:
        """The thread's version right after this append (pass it as the next expected version)."""
        return self.last_seq


@dataclass(frozen=True, slots=True)
class ChainHead:
    """What a thread's meta hash records of its log, read together (`EventStore.chain_head`):
    `Auditor.verify` holds the log to each. A time is None when none is recorded (or it is
    not a number)."""

    version: int
    head: str
    """The chain link of its last event ("": none recorded)."""
    last_ms: int | None = None
    """When its last append was recorded: the time of its last event."""
    created_ms: int | None = None
    """When its current life began: the time of its first event."""


# Stored damage one field of a meta snapshot may hold: raised when that field is asked for,
# as its own read would raise it, without keeping the other fields from being read.
_STORED_DAMAGE = (CorruptEventError, WrongKeyTypeError)


@dataclass(frozen=True, slots=True)
class MetaSnapshot:
    """A thread's meta hash and thread-index entry, read at one moment
    (`EventStore.meta_snapshot`). Each method answers what the `EventStore` read of the same
    name answers, and raises the `CorruptEventError` or `WrongKeyTypeError` that read would
    raise: damage in one field does not hide the others."""

    thread_id: str
    parts: Mapping[str, object]
    """Each read's name -> its answer, or the stored damage it raised."""

    def _part(self, name: str) -> Any:
        value = self.parts[name]
        if isinstance(value, BaseException):
            raise value
        return value

    def incarnation(self) -> int | None:
        """As `EventStore.incarnation`."""
        value: int | None = self._part("incarnation")
        return value

    def version(self) -> int:
        """As `EventStore.version`."""
        value: int = self._part("version")
        return value

    def chain_key_fingerprint(self) -> str | None:
        """As `EventStore.chain_key_fingerprint`."""
        value: str | None = self._part("chain_key_fingerprint")
        return value

    def chain_head(self) -> ChainHead | None:
        """As `EventStore.chain_head`."""
        value: ChainHead | None = self._part("chain_head")
        return value

    def indexed(self) -> bool:
        """As `EventStore.indexed`."""
        value: bool = self._part("indexed")
        return value


@dataclass(frozen=True, slots=True)
class RawRange:
    """A seq range of one thread for `EventStore.read_raw_ranges` (``stop`` included).

    With ``incarnation`` (a `FeedEntry.incarnation`) the range is read only while the thread
    is still in that life, as `EventStore.read_raw` reads it.
    """

    thread_id: str
    start: int = 1
    stop: int | None = None
    incarnation: int | None = None


@dataclass(frozen=True, slots=True)
class ThreadInfo:
    """A thread as listed by the thread index."""

    thread_id: str
    last_activity_ms: int
    partition: int


class EventStore(abc.ABC):
    """An append-only log of events per thread, with views kept in step atomically.

    Implementations: `RedisEventStore`, `MemoryEventStore`. Both pass the conformance suite
    in `eventstore.testing`.
    """

    namespace: str
    registry: EventRegistry
    partitions: int
    max_event_bytes: int

    @abc.abstractmethod
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
        """Append ``events`` to the thread, all or nothing, applying ``view_ops`` in the same step.

        With ``expected_incarnation`` (an `incarnation` or `AppendResult.incarnation` the caller
        read), the append lands only while the thread is in that life: versions, seqs and view
        field versions restart at 1 when a thread is deleted and written again, so an expected
        version (or guarded view op) alone can match a later life by coincidence.

        The idempotency key defaults to one derived from the first event's id, so a retry with
        the same `NewEvent` objects is safe. A key that was already used returns the original
        result with ``duplicate=True`` and writes nothing.

        Raises:
            InvalidInputError: a bad thread id, empty or oversized events, an unregistered type,
                a payload that fails validation, a malformed view op, an
                ``expected_incarnation`` not None or an int >= 1. Nothing is sent.
            ConcurrencyError: the expected version does not hold. Nothing is written.
            IncarnationConflictError: (a `ConcurrencyError`) the thread is not in the life
                ``expected_incarnation`` names: deleted since, or deleted and written again.
                Checked after the idempotency key (a retry of an append that landed still
                returns its result). Nothing is written.
            ViewConflictError: a guarded view op found another version. Nothing is written.
            IdempotencyKeyReusedError: the key was used for different events. Nothing is written.
            ChainKeyMismatchError: the thread was created with another chain key, or one side
                has a key and the other none (checked after the idempotency key: a retry of an
                append that landed still returns its result). Nothing is written.
            OperationalError: the server failed; the append may have landed, retry with the
                same idempotency key.
        """

    @abc.abstractmethod
    def read(
        self,
        thread_id: str,
        *,
        start: int = 1,
        stop: int | None = None,
        backwards: bool = False,
        limit: int | None = None,
    ) -> AsyncIterator[RecordedEvent]:
        """Iterate the thread's events with ``start <= seq <= stop``, in batches.

        Backwards reads start at ``stop`` (default: the last event) and go down to ``start``.
        A missing thread yields nothing. ``start`` 0 reads from the first event; ``limit`` 0
        reads nothing.

        Raises:
            InvalidInputError: ``start`` or ``stop`` negative (seqs are not counted from the
                end; None is "the last"), ``limit`` not an int >= 0.
            CorruptEventError: a stored entry does not decode (names thread and seq).
            ThreadReplacedError: the thread was deleted (and perhaps written again) between
                two batches: a read stays in the life of the thread it began in.
        """

    async def read_batches(
        self, thread_id: str, *, start: int = 1, stop: int | None = None
    ) -> AsyncIterator[list[RecordedEvent]]:
        """The events `read` yields forwards, in lists (never empty), for folds of a whole log.

        A backend may read the next batch while the caller works on the current one.

        Raises:
            CorruptEventError: a stored entry does not decode (names thread and seq).
            ThreadReplacedError: as `read`.
        """
        batch: list[RecordedEvent] = []
        async for event in self.read(thread_id, start=start, stop=stop):
            batch.append(event)
            if len(batch) >= 512:
                yield batch
                batch = []
        if batch:
            yield batch

    async def fold_payloads(
        self,
        thread_id: str,
        fold: Callable[[list[PayloadRow]], None],
        *,
        start: int = 1,
        stop: int | None = None,
    ) -> None:
        """Call ``fold`` with the events `read_batches` yields, as lists of `PayloadRow`
        ``(seq, payload, event id as 16 raw bytes, meta)``.

        For folds that need no more of an event: a backend may skip building the
        `RecordedEvent` (and the id's text), and runs ``fold`` with the cyclic garbage
        collector paused (``fold`` cannot await; it must not keep the lists it is given).
        The same events, checks and errors as `read_batches`.

        Raises:
            CorruptEventError: a stored entry does not decode (names thread and seq).
            ThreadReplacedError: as `read`.
        """
        from ._codec import payload_row  # _codec imports this module

        async for batch in self.read_batches(thread_id, start=start, stop=stop):
            with paused_collector():
                fold([payload_row(e) for e in batch])
            del batch

    @abc.abstractmethod
    async def read_raw(
        self,
        thread_id: str,
        *,
        start: int = 1,
        stop: int | None = None,
        count: int = 512,
        incarnation: int | None = None,
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Stored entries as they are, undecoded: for verification, damage reports and export.

        With ``incarnation`` (a `FeedEntry.incarnation`), entries come only if the thread is
        still in that life: nothing when it was deleted and created again since, as one atomic
        read (a feed entry's seqs then name events that no longer exist).

        Raises:
            InvalidInputError: ``start`` or ``stop`` negative, ``count`` not an int >= 1.
        """

    async def read_change(self, entry: FeedEntry) -> list[RecordedEvent]:
        """The events of one change of the feed, decoded, read in the thread's life the change
        belongs to (its `FeedEntry.incarnation`), in one atomic step.

        Empty for a deletion, and when the thread was deleted since (perhaps created again
        under its id: its seqs then name other events, which are not this change's).

        Raises:
            CorruptEventError: a stored entry does not decode (names thread and seq).
        """
        from ._codec import decode_rows  # the codec imports this module: not at the top

        if entry.deleted:
            return []
        rows = await self.read_raw(
            entry.thread_id,
            start=entry.first_seq,
            stop=entry.last_seq,
            count=max(1, entry.last_seq - entry.first_seq + 1),
            incarnation=entry.incarnation,
        )
        return decode_rows(entry.thread_id, rows, self.registry)

    async def read_raw_ranges(
        self, ranges: Sequence[RawRange], *, count: int = 512
    ) -> list[list[tuple[bytes, Any]]]:
        """The stored entries of several ranges, undecoded: `read_raw` in bulk (export).

        Each range's entries (at most ``count``) come in its place, each as ``(entry_id,
        fields)``: ``fields`` is the ``{name: value}`` dict `read_raw` gives, or the flat
        ``[name, value, ...]`` list the Redis server sends, with no dict built per entry
        (`decode_rows` takes either). A range with an incarnation is checked and read in one
        atomic step, and comes empty when the thread is no longer in that life. The Redis
        backend reads all the ranges in one round trip.

        Raises:
            InvalidInputError: a range's ``start`` or ``stop`` negative, ``count`` not an
                int >= 1.
        """
        validate_feed_count(count)  # also when there are no ranges, as every backend does
        return [
            await self.read_raw(
                r.thread_id, start=r.start, stop=r.stop, count=count, incarnation=r.incarnation
            )
            for r in ranges
        ]

    @abc.abstractmethod
    async def version(self, thread_id: str) -> int:
        """The seq of the thread's last event; 0 when the thread has none."""

    async def versions(self, thread_ids: Sequence[str]) -> list[int]:
        """`version` of each of ``thread_ids``, in their order. The Redis backend asks for
        them all in one round trip (a pipeline: each is read on its own, not together).

        Raises:
            InvalidInputError: ``thread_ids`` a lone str or bytes, or a bad thread id in it.
                Nothing is sent.
            CorruptEventError: a thread's meta hash records a version that is not a number.
        """
        ids = thread_id_list(thread_ids)
        return [await self.version(t) for t in ids]

    @abc.abstractmethod
    async def seq_at(self, thread_id: str, time_ms: int) -> int:
        """The seq of the last event recorded at or before ``time_ms``; 0 if there is none
        (or no such thread).

        A binary search over seq: damage it meets is raised, never searched past (the answer
        would come from the wrong events).

        Raises:
            InvalidInputError: ``time_ms`` is not an int (epoch ms).
            CorruptEventError: an entry the search looks at is missing from the log though
                the thread's version holds it, or its time is not a number (names the seq);
                the log holds events but no meta hash records the thread's version; the
                version is not a number.
        """

    async def chain_key_fingerprint(self, thread_id: str) -> str | None:
        """The fingerprint of the chain key the thread was written with (``"-"``: written
        without one), or None when it records none: no such thread, a thread written before
        fingerprints were recorded (it adopts its next writer's), or a backend that keeps none.
        """
        return None

    async def incarnation(self, thread_id: str) -> int | None:
        """The life the thread is in: the `FeedEntry.incarnation` its changes carry, the same
        across its appends and another each time it is created (deleted and written again
        under its id); None when there is no such thread (or it records none: a thread
        written before lives were recorded, or a backend that keeps none).

        Lives never repeat, so a reader of several round trips that finds the same life before
        its first and after its last read what one life held (as `Auditor.verify` does).

        Raises:
            CorruptEventError: the thread's meta records a life that is not a number.
        """
        return None

    async def chain_head(self, thread_id: str) -> ChainHead | None:
        """What the thread's meta records of its log (`ChainHead`: its version, the chain link
        of its last event, the times of its last and first events), read together; None when
        it records none (no such thread, or a backend that keeps none)."""
        return None

    async def meta_snapshot(self, thread_id: str) -> MetaSnapshot:
        """The thread's `incarnation`, `version`, `chain_key_fingerprint`, `chain_head` and
        `indexed`, read at one moment (`MetaSnapshot`): what an audit reads before and after
        a log. The Redis backend reads them in one round trip (the meta hash's fields in one
        ``HMGET``, pipelined with the index's ``ZSCORE``) where the five reads take five; this
        default makes the five reads, one after the other.

        Stored damage (`CorruptEventError`, `WrongKeyTypeError`) is raised by the snapshot's
        method for the damaged field, not here; any other error (a lost server) is raised here.
        """
        validate_thread_id(thread_id)
        reads: dict[str, Callable[[str], Any]] = {
            "incarnation": self.incarnation,
            "version": self.version,
            "chain_key_fingerprint": self.chain_key_fingerprint,
            "chain_head": self.chain_head,
            "indexed": self.indexed,
        }
        parts: dict[str, object] = {}
        for name, read in reads.items():
            try:
                parts[name] = await read(thread_id)
            except _STORED_DAMAGE as exc:
                parts[name] = exc
        return MetaSnapshot(thread_id, parts)

    async def recorded_append(self, thread_id: str, idempotency_key: str) -> AppendResult | None:
        """What the append made with ``idempotency_key`` wrote (its first and last seq, marked
        ``duplicate``), or None: no append of the thread's current life used the key.

        Answers "did my append land?" without sending it again, and gives a retry's caller
        the original seqs. Raises `InvalidInputError` for a key `append` would refuse.
        (A backend that keeps no ledger it can answer from returns None.)
        """
        return None

    async def recorded_appends(
        self, thread_id: str, idempotency_keys: Sequence[str]
    ) -> dict[str, AppendResult]:
        """`recorded_append` for many keys at once: each key some append of the thread's
        current life used, with what it wrote; keys no append used are left out.

        For a caller that must find how far a series of keyed appends got (an import run
        again over a file that has grown). Raises `InvalidInputError` for a key `append`
        would refuse (before anything is read). The answers for different keys may be read
        at different moments: a thread deleted meanwhile can answer for its old life.
        """
        keys = key_list(idempotency_keys)
        found: dict[str, AppendResult] = {}
        for key in keys:
            result = await self.recorded_append(thread_id, key)
            if result is not None:
                found[key] = result
        return found

    async def read_between(
        self,
        thread_id: str,
        since: datetime | int | None = None,
        until: datetime | int | None = None,
        *,
        backwards: bool = False,
    ) -> AsyncIterator[RecordedEvent]:
        """Iterate the events recorded in ``since <= time <= until``.

        Each bound is an aware datetime, a naive one (read as local time, as
        `datetime.timestamp` reads it: pass ``tzinfo=UTC`` for a UTC time), or an int of epoch
        milliseconds; None is unbounded. Event times are the server's clock, in UTC
        (`RecordedEvent.time`).

        The seqs the bounds stand for and the events are read in one life of the thread: a
        thread deleted and written again in between is asked again.

        Raises:
            InvalidInputError: a bound of another type (a str, a float), or a datetime out of
                the range the platform can convert.
            ThreadReplacedError: the thread was deleted (and written again) while each of a
                few attempts read it, or, as `read` raises it, once events were yielded.
        """
        since_ms = _to_ms(since, "since")
        until_ms = _to_ms(until, "until")
        if since_ms is None and until_ms is None:
            async for event in self.read(thread_id, backwards=backwards):
                yield event
            return
        for _ in range(_LIFE_ATTEMPTS):
            # The bounds are searched in round trips of their own: the same life before the
            # searches and after the first events were read (lives never repeat) says the
            # events are of the life the bounds were found in.
            life = await self.incarnation(thread_id)
            start = 1 if since_ms is None else await self.seq_at(thread_id, since_ms - 1) + 1
            stop = None if until_ms is None else await self.seq_at(thread_id, until_ms)
            events: AsyncIterator[RecordedEvent] | None = None
            first: RecordedEvent | None = None
            if stop is None or stop >= start:
                events = self.read(thread_id, start=start, stop=stop, backwards=backwards)
                first = await anext(events, None)
            if await self.incarnation(thread_id) != life:
                if events is not None:
                    await _close(events)
                continue
            if events is None or first is None:
                return
            yield first
            async for event in events:
                yield event
            return
        raise ThreadReplacedError(thread_id)

    @abc.abstractmethod
    async def read_list(
        self, thread_id: str, view: str, start: int = 0, stop: int = -1
    ) -> list[ViewEntry]:
        """One list view's entries ``start..stop``, in one plain read (no version, no snapshot
        across views): the cheapest read there is, for windows such as the last N messages."""

    @abc.abstractmethod
    async def read_views(self, thread_id: str, reads: Sequence[ViewRead]) -> ViewSnapshot:
        """Answer several view reads in one atomic step, with the thread's version."""

    @abc.abstractmethod
    async def load_views(
        self,
        thread_id: str,
        ops: Sequence[ViewOp],
        *,
        expected_version: int,
        expected_incarnation: int | None = None,
    ) -> None:
        """Apply view ops outside an append (rebuilds), only if the thread is at that version
        and, with ``expected_incarnation`` (the `incarnation` the ops were folded in), still
        in that life: a thread deleted and written again up to the same version meanwhile
        must not get the old life's views.

        A thread with events that its partition's thread index does not list is listed again
        (by its last append time), in the same step: a rebuild repairs a lost listing.

        Raises:
            ConcurrencyError: the thread moved on; fold again and retry.
            IncarnationConflictError: (a `ConcurrencyError`) the thread is not in the life
                ``expected_incarnation`` names: deleted, or deleted and written again.
            InvalidInputError: ``expected_incarnation`` neither None nor an int >= 1.
        """

    @abc.abstractmethod
    async def threads(
        self,
        *,
        limit: int | None = None,
        before_ms: int | None = None,
        after: ThreadInfo | tuple[int, str] | None = None,
        partition: int | None = None,
    ) -> list[ThreadInfo]:
        """Threads of the namespace, most recent activity first: by last activity (ms)
        descending, then by thread id descending (code points, which is the UTF-8 byte order
        Redis keeps), on every backend and across partitions; with ``partition``, only the
        threads of that partition (one partition's index is read, not every one).

        ``before_ms`` lists only the threads last active before that time. ``after`` pages: pass
        the last `ThreadInfo` of a page (or its ``(last_activity_ms, thread_id)``) and the next
        page starts right after it, however many threads share its millisecond. Paging skips
        and repeats nothing among threads that stay idle meanwhile; a thread active since
        the first page moves to the front and is not listed by later pages.

        Raises:
            InvalidInputError: ``limit`` neither None nor an int >= 0, ``before_ms`` neither
                None nor an int, ``after`` neither None, a `ThreadInfo` nor an (int, thread id)
                pair, ``partition`` neither None nor one of the store's partitions.
            CorruptKeyError: the thread index holds a member that is no thread id or a score
                that is no time in ms (changed from outside threadlog; Redis).
        """

    @abc.abstractmethod
    async def indexed(self, thread_id: str) -> bool:
        """Whether the thread index lists the thread (`threads` lists exactly these)."""

    @abc.abstractmethod
    async def stored_threads(self) -> list[str]:
        """Every thread of the namespace that has a log or a meta hash, found from the stored
        keys themselves rather than the thread index (sorted by id).

        For audits: one edited index key (a thread removed from it) must not hide a thread
        from them. It walks the whole namespace (on Redis a ``SCAN`` of every primary), so it
        belongs on cold paths only, never on a request path.

        Raises:
            OperationalError: the Redis user may not ``SCAN``. `acl_rules` does not grant it:
                Redis does not confine ``SCAN`` to a user's key pattern.
        """

    @abc.abstractmethod
    async def delete_thread(
        self,
        thread_id: str,
        *,
        views: Sequence[str] = (),
        expected_version: int | None = None,
        expected_incarnation: int | None = None,
    ) -> int:
        """Delete the thread: its log, meta, idempotency ledger and every one of its views.

        ``views`` names views to delete besides those the store knows: on Redis each view
        name is recorded for its partition before it is first written (one ``SADD`` per store
        and name), and a deletion removes the thread's view under every recorded name; views
        written before names were recorded (2026-12-02) go only when named here. A view left
        behind would be read as the next life's, when the id is written again.

        The change feed records a tombstone (so exports and consumers learn of it) and the
        thread leaves the thread index. Returns the version the thread had (0: no thread).
        An append after deletion starts a new thread at seq 1.

        With ``expected_version``, only a thread at that version is deleted, in the same
        atomic step: a thread written since the caller looked at it is kept. With
        ``expected_incarnation`` (an `incarnation` or `AppendResult.incarnation`), only a
        thread still in that life: one deleted and written again since, perhaps up to the
        same version, is another thread under the same id, and is kept.

        Raises:
            ConcurrencyError: the thread is not at ``expected_version``; nothing is deleted.
            IncarnationConflictError: (a `ConcurrencyError`) the thread is not in the life
                ``expected_incarnation`` names; nothing is deleted.
            InvalidInputError: ``expected_version`` not None or an int >= 0, or
                ``expected_incarnation`` not None or an int >= 1.
        """

    # -- the change feed -----------------------------------------------------------------------

    @abc.abstractmethod
    async def read_feed(
        self, partition: int, *, after: str = "0-0", count: int = 512, reader: str | None = None
    ) -> list[FeedEntry]:
        """Up to ``count`` feed entries of a partition with ids above ``after``, oldest first.

        With ``reader`` (its name, for the error), a reader that has read up to ``after``
        learns in the same atomic step whether the feed was trimmed past it: entries after
        ``after`` removed (by age, or by hand) before this read would be skipped without a
        trace, so `FeedTrimmedError` is raised instead. Without it, the read is a plain range.

        Raises:
            InvalidInputError: a partition out of range, ``after`` not a stream id, ``count``
                not an int >= 1. Nothing is sent.
            FeedTrimmedError: with ``reader``, the feed was trimmed past ``after``.
        """

    @abc.abstractmethod
    async def create_feed_group(self, partition: int, group: str, *, start: str = "0-0") -> bool:
        """Register a consumer group on a partition's feed (False if it exists already).

        Entries after ``start`` will be delivered to it. Registered groups hold back trimming.

        Raises:
            InvalidInputError: a group name outside 1-64 characters of ``A-Za-z0-9_.-``,
                ``start`` not a stream id, a partition out of range.
        """

    @abc.abstractmethod
    async def read_feed_group(
        self,
        partition: int,
        group: str,
        consumer: str,
        *,
        count: int = 512,
        block_ms: int | None = None,
        pending: bool = False,
    ) -> list[FeedEntry]:
        """Deliver up to ``count`` new entries to ``consumer`` (or, with ``pending``, re-read the
        ones delivered to it and not yet acknowledged).

        ``block_ms`` None answers at once; a positive ``block_ms`` waits up to that many ms for
        a new entry when there is none. There is no "wait forever" (Redis's BLOCK 0): 0 is
        refused, as a consumer that waits forever cannot stop cleanly; wait in a loop.

        Raises:
            InvalidInputError: ``count`` not an int >= 1, ``block_ms`` neither None nor an
                int > 0, a bad group name or partition. Nothing is sent.
            FeedGroupNotFoundError: the group is not registered on the partition.
            FeedTrimmedError: with ``pending``, entries delivered to the consumer were trimmed
                before it acknowledged them (``lost`` names them; they stay pending, and
                this is raised again, until they are acknowledged).
        """

    @abc.abstractmethod
    async def claim_feed(
        self,
        partition: int,
        group: str,
        consumer: str,
        *,
        min_idle_ms: int,
        count: int = 512,
    ) -> list[FeedEntry]:
        """Take over entries pending longer than ``min_idle_ms`` (from crashed consumers).

        Raises:
            InvalidInputError: ``min_idle_ms`` not an int >= 0, ``count`` not an int >= 1, a
                bad group name or partition. Nothing is sent.
            FeedGroupNotFoundError: the group is not registered on the partition.
            FeedTrimmedError: some of those entries were trimmed before anyone acknowledged
                them (``lost`` names them). They are dropped from the group as this is
                raised (said once); the entries it did take over are the consumer's, and a
                pending read (`read_feed_group`) returns them.
        """

    @abc.abstractmethod
    async def ack_feed(self, partition: int, group: str, ids: Sequence[str]) -> int:
        """Acknowledge delivered entries; returns how many were pending.

        Raises:
            InvalidInputError: an id that is not a stream id (``<ms>-<n>``), a bad group name
                or partition. Nothing is sent.
            FeedGroupNotFoundError: the group is not registered on the partition.
        """

    @abc.abstractmethod
    async def advance_feed_group(self, partition: int, group: str, to: str) -> None:
        """Move a group's position to ``to`` and forget its pending entries up to there.

        For readers that track their own position (exports): they read with `read_feed` and
        advance their group only after their output is committed, holding back trimming.

        Raises:
            InvalidInputError: ``to`` not a stream id, a bad group name or partition.
            FeedGroupNotFoundError: the group is not registered on the partition.
        """

    @abc.abstractmethod
    async def feed_groups(self, partition: int) -> list[GroupInfo]:
        """The consumer groups registered on a partition's feed."""

    @abc.abstractmethod
    async def feed_info(self, partition: int) -> FeedInfo:
        """How much a partition's feed holds, and the newest id ever trimmed from it.

        Raises:
            InvalidInputError: a bad partition.
        """

    @abc.abstractmethod
    async def delete_feed_group(self, partition: int, group: str) -> bool:
        """Forget a consumer group of a partition's feed (its position and pending entries),
        so trimming no longer waits for it. False when it was not registered there. Any
        group can be dropped, whatever its name (`validate_group_to_drop`): one registered by
        another tool too.

        Raises:
            InvalidInputError: ``group`` not a non-empty str, or a bad partition.
        """

    @abc.abstractmethod
    async def trim_feed(self, partition: int, *, max_age_ms: int | None = None) -> int:
        """Drop feed entries every registered group has acknowledged, or older than
        ``max_age_ms`` (whichever reaches further). Returns the number of entries removed.

        Raises:
            InvalidInputError: ``max_age_ms`` neither None nor an int >= 0.
        """

    @abc.abstractmethod
    async def apply_checkpointed(
        self,
        partition: int,
        name: str,
        *,
        expected: str,
        checkpoint: str,
        incr: Sequence[tuple[str, str, int]] = (),
    ) -> bool:
        """Apply an async projection's writes and move its checkpoint, atomically.

        ``incr`` is ``(hash, field, amount)`` increments on the projection's own partition-level
        hashes. A compare-and-set: applied only if the stored checkpoint of ``name`` in this
        partition is still ``expected`` ("0-0" for none) and ``checkpoint`` is above it;
        otherwise returns False and writes nothing, which makes redelivered batches harmless.
        """

    @abc.abstractmethod
    async def delete_checkpointed(
        self, partition: int, name: str, *, hashes: Sequence[str] = ()
    ) -> CheckpointedState:
        """Delete async projection ``name``'s state in a partition, atomically: its checkpoint
        and every partition-level hash `apply_checkpointed` wrote for it (each one's name is
        recorded as it is written), plus any hash named in ``hashes`` (one written by a release
        before names were recorded). Returns what was there. The projection's consumer group
        stays (`delete_feed_group`); a runner still working it writes the state anew, from
        the start of the feed, so stop its runners first.

        Raises:
            InvalidInputError: a bad partition, ``name`` or hash name.
            OperationalError: (Redis) a runner kept adding hashes while they were deleted.
        """

    @abc.abstractmethod
    async def read_aux(self, partition: int, name: str, hash_name: str) -> dict[str, int]:
        """Read one of an async projection's partition-level hashes."""

    @abc.abstractmethod
    async def checkpoint_of(self, partition: int, name: str) -> str:
        """The stored checkpoint of async projection ``name`` in a partition ("0-0": none)."""

    @abc.abstractmethod
    async def checkpoints(
        self, partition: int, *, damaged: dict[str, CorruptKeyError] | None = None
    ) -> dict[str, str]:
        """Every async projection's stored checkpoint in a partition, by name (a projection
        with none is absent). A checkpoint outlives its projection's consumer group (a feed
        deleted takes the groups with it): this is how a reader that lost its group is found.

        A checkpoint changed from outside threadlog into something that is no feed id raises
        `CorruptKeyError`, or, given ``damaged``, is left out and put there by name instead
        (a listing of every reader can go on past one damaged entry; a reader must stop).

        Raises:
            InvalidInputError: a bad partition.
            CorruptKeyError: a damaged checkpoint, when no ``damaged`` was given.
        """

    @abc.abstractmethod
    async def namespace_id(self) -> str:
        """The id of this namespace's data set: a ULID made the first time any store asks and
        kept with the namespace's settings, the same for every client from then on.

        Another namespace, another server, or the same server after its data was flushed has
        another id: a consumer that keeps its positions outside the store (an export
        directory) records it to notice when it is pointed at other data.
        """

    @abc.abstractmethod
    async def namespace_exists(self) -> bool:
        """Whether this namespace was ever written: a store that may write has recorded its
        settings (Redis: the config hash), or it holds events or feed entries (memory).

        Reads nothing but that and writes nothing, so a reader (the ``threadlog`` command's
        read-only commands) can refuse a misspelt namespace without creating it.
        """

    async def known_namespaces(self) -> list[str] | None:
        """The namespaces this store's server holds, sorted, when that is cheap to find out;
        None when it is not (the default). For messages only (a misspelt namespace's hint)."""
        return None

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections; further calls raise `StoreClosedError`.

        Calls still in flight fail with `StoreClosedError` too (one already sent says it may
        have been applied); on Redis, `close` waits for them to end (at most 1 s) and then
        closes whatever connections they took meanwhile."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


def threads_cursor(before_ms: object, after: object) -> tuple[int, str] | None:
    """Where a `EventStore.threads` listing starts, as the ``(ms, thread id)`` key its threads
    must sort below (None: from the newest); ``before_ms`` is ``(before_ms, "")``, which every
    thread of that millisecond sorts above. Refuses malformed arguments (`InvalidInputError`)."""
    cursor: tuple[int, str] | None = None
    if before_ms is not None:
        validate_int(before_ms, "before_ms")
        assert isinstance(before_ms, int)
        cursor = (before_ms, "")
    if after is not None:
        if isinstance(after, ThreadInfo):
            pair: object = (after.last_activity_ms, after.thread_id)
        else:
            pair = after
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise InvalidInputError(
                f"after must be a ThreadInfo or a (last_activity_ms, thread_id) pair, not {after!r}"
            )
        ms, thread_id = pair
        validate_int(ms, "after's last_activity_ms")
        validate_thread_id(thread_id)
        if cursor is None or (ms, thread_id) < cursor:
            cursor = (ms, thread_id)
    return cursor


_LIFE_ATTEMPTS = 5
"""How often `EventStore.read_between` asks again when the thread was replaced meanwhile."""


async def _close(events: AsyncIterator[Any]) -> None:
    """End a read left early (an async generator's ``aclose``)."""
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


def _to_ms(value: datetime | int | None, name: str) -> int | None:
    """Epoch ms of a time given as a datetime or as epoch ms; a naive datetime is local time
    (as `datetime.timestamp` and the command line's ``--since`` read it)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if not isinstance(value, datetime):
        raise InvalidInputError(
            f"{name} must be a datetime or an int (epoch ms), not {type(value).__name__} {value!r}"
        )
    try:
        return int(value.timestamp() * 1000)
    except (OverflowError, OSError, ValueError) as exc:  # a time the platform cannot convert
        raise InvalidInputError(f"{name} {value!r} is out of the range of times: {exc}") from None


def thread_id_list(thread_ids: Sequence[str]) -> list[str]:
    """``thread_ids`` as a list of valid thread ids (a lone str would be taken for its
    characters)."""
    return _checked_list(thread_ids, "thread_ids", "thread ids", validate_thread_id)


def _checked_list(
    values: Sequence[str], name: str, what: str, check: Callable[[str], object]
) -> list[str]:
    """``values`` as a list, each passed by ``check``; a lone str or bytes is refused (Python
    would iterate its characters), as is anything that is no sequence."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise InvalidInputError(f"{name} must be a sequence of {what}, not {values!r}")
    out = list(values)
    for value in out:
        check(value)
    return out


def require_store(store: object, owner: str) -> EventStore:
    """``store``, unless it cannot be an event store: then `InvalidInputError` saying what it
    is. Most often that is the coroutine of a ``connect(...)`` that was not awaited, which
    would otherwise fail later, at first use, as an AttributeError of the coroutine. Checked
    by shape, not by class: a proxy of a store (instrumentation, a test's) is one."""
    if isinstance(store, EventStore):
        return store
    if inspect.isawaitable(store) or not all(
        hasattr(store, name) for name in ("namespace", "append", "read_views")
    ):
        hint = ""
        if inspect.isawaitable(store):
            hint = ": await it (store = await eventstore.connect(...))"
        raise InvalidInputError(
            f"{owner} needs an EventStore (from eventstore.connect), not "
            f"{type(store).__name__}{hint}"
        )
    return store  # type: ignore[return-value]


def key_list(keys: Sequence[str]) -> list[str]:
    """``keys`` as a list, each an idempotency key `append` would take."""
    from ._codec import caller_key_field  # (the codec imports this module)

    return _checked_list(keys, "idempotency_keys", "keys", caller_key_field)
