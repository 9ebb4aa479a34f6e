"""Async projections over the partitioned change feed, and the runner that keeps them exact.

An async projection turns a batch of changes into increments on its own partition-level hashes.
The runner reads each partition's feed in order from the projection's checkpoint and, per
batch, applies the increments and moves the checkpoint past the batch in ONE atomic
compare-and-set. A runner whose compare-and-set fails (another runner of the projection moved
the checkpoint first) reads again from the new checkpoint, and one killed mid-batch wrote
nothing, so its successor starts where it did: nothing is counted twice, nothing skipped, with
any number of runners on the same partitions. `partitions_for` spreads the partitions over
runners so they do not race for the same batches (a race costs work, never exactness).

The projection's consumer group on each feed partition only holds back trimming: the runner
moves it to the checkpoint after each batch, so `trim_feed` removes only applied changes.
"""

from __future__ import annotations

import abc
import inspect
import logging
import math
import time
from collections.abc import Sequence
from datetime import UTC, datetime

import anyio
import msgspec

from eventstore import (
    ConflictError,
    CorruptKeyError,
    EventStore,
    FeedEntry,
    FeedGroupNotFoundError,
    FeedInfo,
    FeedResetError,
    FeedTrimmedError,
    InvalidInputError,
    OperationalError,
    RawRange,
    RecordedEvent,
    StoreClosedError,
    ThreadReplacedError,
    TurnSettled,
    validate_consumer,
    validate_group,
)
from eventstore._codec import decode_rows
from eventstore._contract import require_store
from eventstore._errors import UNREACHABLE
from eventstore._feed import (
    EXPORT_GROUP_PREFIX,
    format_stream_id,
    parse_stream_id,
    validate_group_to_drop,
    validate_hash_names,
    validate_increments,
    validate_projection_name,
)
from eventstore._ids import validate_count

log = logging.getLogger("threadlog.runner")

BACKFILL_ATTEMPTS = 5
BACKFILL_BATCH = 512
"""Threads a backfill asks its versions, and reads its first events, in one round trip."""
BACKFILL_FIRST_PAGE = 128
"""Events of each thread in that read (at most 64k events in hand); a longer thread's rest
is read on its own."""
FEED_PAGE = 1024
TURN_BATCHES = 8
"""The batches `ProjectionRunner.run` applies in one partition before it turns to the next."""
MIN_POLL_INTERVAL = 0.001
"""The shortest ``poll_interval`` a runner takes, in seconds: below it an idle runner reads its
feeds in a loop as fast as the round trips allow, burning a core on both sides for nothing."""
# `run` waits out a store it cannot reach (`UNREACHABLE`): backoffs from the first to the
# last, doubling.
OUTAGE_FIRST_BACKOFF = 0.1
OUTAGE_LAST_BACKOFF = 5.0
DEFAULT_MAX_OUTAGE = 300.0

Increment = tuple[str, str, int]
"""``(hash name, field, amount)`` on one of the projection's partition-level hashes."""


class AsyncProjection(abc.ABC):
    """A read model updated from the change feed, after the append (eventually consistent)."""

    name: str
    """The consumer group name and the namespace of its hashes."""

    @abc.abstractmethod
    def increments(self, entry: FeedEntry, events: Sequence[RecordedEvent]) -> list[Increment]:
        """What one change adds: a pure function of the change and its events.

        Each amount is an int within +-(2**63 - 1), and a hash's fields stay in that range
        (Redis keeps them as 64-bit ints): anything else, or an exception raised here, stops
        the runner at this change, named in the error; it is never skipped."""


def partitions_for(partitions: int, runner_index: int, runners: int) -> list[int]:
    """The partitions runner ``runner_index`` of ``runners`` owns (a disjoint cover).

    Raises:
        InvalidInputError: ``partitions`` or ``runners`` not an int >= 1, ``runner_index`` not
            an int in ``0..runners-1``.
    """
    validate_count(partitions, "partitions", minimum=1)
    validate_count(runners, "runners", minimum=1)
    validate_count(runner_index, "runner_index")
    if not runner_index < runners:
        raise InvalidInputError("runner_index must be in 0..runners-1")
    return [p for p in range(partitions) if p % runners == runner_index]


class GroupLag(msgspec.Struct, frozen=True, kw_only=True):
    """How far behind one consumer group of one partition's feed is (`feed_group_lag`)."""

    name: str
    partition: int
    position: str
    """Where its reader has got to: for an async projection, its checkpoint once it has one
    (the runner reads on from it; the group only follows it, and sits at 0-0 when dropped
    and registered again), else the group's last delivered entry."""
    unread: int
    """Entries the feed holds after ``position``: what the reader has still to read, which
    trimming keeps for it."""
    oldest_unread: str | None
    """The first of them (None: it has read all the feed holds)."""
    last_delivered: str
    """The group's own position (`GroupInfo`)."""
    pending: int
    """Entries delivered to the group's consumers and not acknowledged."""
    oldest_pending: str | None
    """The oldest of them (None: none)."""
    lost_changes: bool
    """The feed was trimmed (by age, or by hand) past ``position``, or past entries delivered
    to the group and not acknowledged: changes its reader had not read, or not finished, are
    gone from the feed."""
    damaged: str | None = None
    """What is wrong with the checkpoint stored under this name, changed from outside
    threadlog into something that is no feed id (None: nothing). ``position`` is then the
    group's last delivered entry (for a group no longer registered, 0-0); the projection's
    runner stops on this partition until the checkpoint is put right."""
    registered: bool = True
    """Whether the group is registered on the partition's feed. False for an async projection
    whose checkpoint is there without a group because the feed was deleted or replaced,
    taking the group with it (``feed_reset``): a group dropped on purpose is not listed."""
    feed_reset: bool = False
    """For an async projection: the feed holds neither the entry at its checkpoint nor a trim
    record reaching it, so it was deleted or replaced since, and whatever it held after the
    checkpoint went without a trace. Its runner stops there with `FeedResetError`; the
    remedy is the projection under a new name with ``backfill=True``."""


async def feed_group_lag(store: EventStore) -> list[GroupLag]:
    """Every consumer group on the namespace's feeds, one row per group and partition, by
    name then partition: where its reader has got to and how much it has left to read.

    A group nobody reads any more (an export name given up, a projection renamed or retired)
    holds feed trimming back for ever: its ``unread`` keeps growing while its ``position``
    stays; `drop_feed_group` removes it (what `threadlog feed` and `threadlog drop-group` do).
    ``unread`` is counted from the feed: the whole feed's length when the reader is behind its
    first entry (a stale group usually is, as trimming stops at it), else read page by page,
    so a listing costs a few round trips a group and partition plus one a 1,024 entries of a
    backlog that is not the whole feed.

    An async projection whose partition's feed was deleted (or replaced) has a checkpoint
    there but no group any more (the groups went with the feed): it is listed too, with
    ``registered`` False and ``feed_reset`` True, as its runner stops there. A projection
    whose group was dropped on purpose (`drop_feed_group`, with its feed intact) is not.
    A checkpoint changed from outside threadlog into something that is no feed id does not
    stop the listing: its row says so (``damaged``), its group or not.

    Raises:
        InvalidInputError: ``store`` not an `EventStore`.
    """
    store = require_store(store, "feed_group_lag")
    rows: list[GroupLag] = []
    for partition in range(store.partitions):
        broken: dict[str, CorruptKeyError] = {}
        checkpoints = await store.checkpoints(partition, damaged=broken)
        groups = await store.feed_groups(partition)
        names = {g.name for g in groups}
        # A group that may be a projection's is judged by its checkpoint, when it has one.
        positions = {
            g.name: checkpoints.get(g.name, "0-0")
            for g in groups
            if _projection_name(g.name) and checkpoints.get(g.name, "0-0") != "0-0"
        }
        lost_groups = {n: c for n, c in checkpoints.items() if n not in names and c != "0-0"}
        damage = {name: exc.detail for name, exc in broken.items()}
        missing = [
            (name, checkpoint)
            for name, checkpoint in (positions | lost_groups).items()
            if not await _holds(store, partition, checkpoint)
        ]
        # Read after the entries were looked for: an entry trimmed meanwhile is in its record.
        info = await store.feed_info(partition)
        trimmed_to = parse_stream_id(info.trimmed_to)
        reset = {name for name, at in missing if trimmed_to < parse_stream_id(at)}
        for group in groups:
            position = positions.get(group.name, group.last_delivered)
            unread, oldest = await _unread(store, info, position)
            rows.append(
                GroupLag(
                    name=group.name,
                    partition=partition,
                    position=position,
                    unread=unread,
                    oldest_unread=oldest,
                    last_delivered=group.last_delivered,
                    pending=group.pending,
                    oldest_pending=group.oldest_pending,
                    lost_changes=trimmed_to > parse_stream_id(position)
                    or (
                        group.oldest_pending is not None
                        and trimmed_to >= parse_stream_id(group.oldest_pending)
                    ),
                    damaged=damage.get(group.name),
                    feed_reset=group.name in reset,
                )
            )
        for name, detail in damage.items():
            if name not in names:  # else listed above, with its group
                rows.append(await _groupless(store, info, name, "0-0", damaged=detail))
        for name, checkpoint in lost_groups.items():
            if name in reset:  # else its group was dropped from an intact feed: retired
                rows.append(await _groupless(store, info, name, checkpoint, feed_reset=True))
    return sorted(rows, key=lambda r: (r.name, r.partition))


async def _groupless(
    store: EventStore,
    info: FeedInfo,
    name: str,
    position: str,
    *,
    damaged: str | None = None,
    feed_reset: bool = False,
) -> GroupLag:
    """The row of a projection with a checkpoint on ``info``'s partition and no group there."""
    unread, oldest = await _unread(store, info, position)
    return GroupLag(
        name=name,
        partition=info.partition,
        position=position,
        unread=unread,
        oldest_unread=oldest,
        last_delivered="0-0",
        pending=0,
        oldest_pending=None,
        lost_changes=False,
        damaged=damaged,
        registered=False,
        feed_reset=feed_reset,
    )


async def _holds(store: EventStore, partition: int, position: str) -> bool:
    """Whether the partition's feed holds the entry at ``position``."""
    page = await store.read_feed(partition, after=_just_before(position), count=1)
    return bool(page) and parse_stream_id(page[0].id) == parse_stream_id(position)


def _just_before(position: str) -> str:
    """The stream id right before ``position`` (a read after it starts at ``position``)."""
    ms, n = parse_stream_id(position)
    return format_stream_id((ms, n - 1) if n else (ms - 1, 2**64 - 1))


def _projection_name(group: str) -> bool:
    """Whether ``group`` may be an async projection's (which has a checkpoint under that name):
    an export's group is ``export-<name>``, and a group registered from outside threadlog may
    have a name no projection can."""
    if group.startswith(EXPORT_GROUP_PREFIX):
        return False
    try:
        validate_group(group)
    except InvalidInputError:
        return False
    return True


async def _unread(store: EventStore, info: FeedInfo, position: str) -> tuple[int, str | None]:
    """How many entries the feed holds after ``position``, and the first of them."""
    if info.first_id is None:
        return 0, None
    if parse_stream_id(position) < parse_stream_id(info.first_id):
        return info.length, info.first_id  # behind every entry it holds: no need to read them
    count, first, after = 0, None, position
    while True:
        page = await store.read_feed(info.partition, after=after, count=FEED_PAGE)
        if not page:
            return count, first
        first = first or page[0].id
        count += len(page)
        after = page[-1].id


async def drop_feed_group(store: EventStore, name: str) -> list[int]:
    """Remove consumer group ``name`` from every partition's feed (its position and pending
    entries), so trimming stops waiting for it; returns the partitions it was on (empty: it
    was on none). For a group nobody reads any more: `feed_group_lag` shows them.

    A `ProjectionRunner` still running under that name registers its group again (it needs
    it), so stop it first; a projection's checkpoint and figures stay (an export directory's
    positions stay in its files, and its next run registers its group again).

    Raises:
        InvalidInputError: ``store`` not an `EventStore`, ``name`` not a non-empty str (a
            name threadlog would not give a group is fine: another tool may have).
    """
    store = require_store(store, "drop_feed_group")
    validate_group_to_drop(name)
    return [p for p in range(store.partitions) if await store.delete_feed_group(p, name)]


class ForgottenProjection(msgspec.Struct, frozen=True, kw_only=True):
    """What `forget_projection` removed of an async projection, by partition."""

    name: str
    groups: list[int]
    """The partitions whose feed held its consumer group."""
    checkpoints: dict[int, str]
    """Partition -> the checkpoint it had there."""
    hashes: dict[int, list[str]]
    """Partition -> the names of its hashes (its figures) that were there, sorted."""

    @property
    def found(self) -> bool:
        """Whether anything of it was there."""
        return bool(self.groups or self.checkpoints or self.hashes)


async def forget_projection(
    store: EventStore, name: str, *, hashes: Sequence[str] = ()
) -> ForgottenProjection:
    """Remove every trace of async projection ``name`` from the namespace: on each partition
    its consumer group (`drop_feed_group`), then, atomically, its checkpoint and its figures
    (every hash it wrote: `EventStore.delete_checkpointed`). For a projection retired or
    renamed for good: `drop_feed_group` alone frees the feed but keeps the checkpoint, which
    `feed_group_lag` then lists as a reader whose feed was reset when a feed is deleted, and
    the figures, which nothing reads any more.

    Stop its runners first: one still running registers its group again and counts from the
    start of the feed. Started again later under the same name, a projection counts from
    scratch (``backfill=True`` counts what the logs hold). Interrupted half way (a lost
    connection), it leaves each partition either done or untouched but for its group: call
    it again. ``hashes`` names hashes to delete beyond those recorded, for figures written by
    a release from before hash names were recorded (2026-12-02).

    Raises:
        InvalidInputError: ``store`` not an `EventStore`, ``name`` not a projection name
            (1-64 of A-Z a-z 0-9 _ . -), a bad hash name.
    """
    store = require_store(store, "forget_projection")
    validate_projection_name(name)
    hash_names = validate_hash_names(hashes)
    groups: list[int] = []
    checkpoints: dict[int, str] = {}
    figures: dict[int, list[str]] = {}
    for partition in range(store.partitions):
        # The group first: a feed held back for it is freed even if what follows fails.
        if await store.delete_feed_group(partition, name):
            groups.append(partition)
        state = await store.delete_checkpointed(partition, name, hashes=hash_names)
        if state.checkpoint is not None:
            checkpoints[partition] = state.checkpoint
        if state.hashes:
            figures[partition] = state.hashes
    return ForgottenProjection(name=name, groups=groups, checkpoints=checkpoints, hashes=figures)


class ProjectionRunner:
    """Feeds an `AsyncProjection` from the change feed of some (default: all) partitions.

    Any number of runners may work the same partitions (a second process, a rolling deploy):
    each reads from the projection's checkpoint and moves it with a compare-and-set, so the
    totals are exact either way; disjoint partitions (`partitions_for`) only save the work of
    batches read twice. A runner killed at any point wrote all of a batch or none of it.

    When the feed was trimmed past the projection's checkpoint (by age, or before the
    projection first ran), its changes up to there are gone from the feed: the runner raises
    `FeedTrimmedError` rather than count without them, unless ``accept_trimmed_feed`` says
    to go on from what the feed still holds: then the checkpoint is moved past what was
    trimmed (logged, each time), which stands for every later run.

    A projection added to a running system starts from the logs instead with
    ``backfill=True``: before it reads a partition's feed for the first time (no checkpoint
    yet), `backfill` counts every event the feed has recorded so far from the threads' logs,
    trimmed or not, and sets the checkpoint there.

    ``consumer`` names the runner in its log lines (``"host-1:4242"``); runners need not have
    distinct names, as nothing is delivered to a name.

    ``poll_interval`` is how long `run` waits, in seconds, after a pass that found nothing new
    before it reads the feeds again (a pass that applied something reads on at once). It is
    at least `MIN_POLL_INTERVAL` (1 ms): 0 would read idle feeds in a busy loop. Each idle
    pass also makes sure the projection's consumer group is still registered (one
    ``XGROUP CREATE`` a partition), and registers it again at the checkpoint, logged, when it
    was dropped from outside.

    A partition's feed deleted (or replaced) under the projection took the changes it held
    after the checkpoint with it, leaving no trim record: the runner stops there with
    `FeedResetError` rather than read on from a new feed past them.

    A partition that fails (a change the projection raises for, a feed trimmed or reset under
    its checkpoint) stops alone; the runner works its other partitions and raises the error
    afterwards (see `run`), listing it in `failed` meanwhile.

    `run` waits out a store it cannot reach (a restart, a failover: `StoreConnectionError` or
    `StoreTimeoutError` once the client's own retries are spent), logging a warning each
    time, backing off from 0.1 s to 5 s, and reads on from the checkpoint when the store
    answers again (a batch is applied whole or not at all, so nothing counts twice). After
    ``max_outage`` seconds without an answer it raises the last error (None: it waits for
    ever; 0: it raises at once, as `run_once` always does).

    Raises:
        InvalidInputError: ``store`` not an `EventStore` (a ``connect()`` not awaited),
            ``projection`` not an `AsyncProjection` instance (a class, a view projection), a
            bad projection name or consumer name, ``partitions`` not distinct
            ints of the store's partitions, ``batch_size`` not an int >= 1, ``poll_interval``
            not a finite number >= `MIN_POLL_INTERVAL`, ``accept_trimmed_feed`` or
            ``backfill`` not a bool, ``max_outage`` neither None nor a finite number >= 0.
            Nothing is registered.
    """

    def __init__(
        self,
        store: EventStore,
        projection: AsyncProjection,
        *,
        consumer: str,
        partitions: Sequence[int] | None = None,
        batch_size: int = 256,
        poll_interval: float = 0.2,
        accept_trimmed_feed: bool = False,
        backfill: bool = False,
        max_outage: float | None = DEFAULT_MAX_OUTAGE,
    ) -> None:
        store = require_store(store, "ProjectionRunner")
        if not isinstance(projection, AsyncProjection):
            # Else a class, or a view projection, failed only at the first change, blamed on
            # it, with the projection's consumer groups registered by then.
            raise InvalidInputError(
                f"projection must be an instance of an AsyncProjection subclass, not {projection!r}"
            )
        validate_projection_name(getattr(projection, "name", None))
        validate_consumer(consumer)
        validate_count(batch_size, "batch_size", minimum=1)
        if (
            isinstance(poll_interval, bool)
            or not isinstance(poll_interval, int | float)
            or not MIN_POLL_INTERVAL <= poll_interval < math.inf
        ):
            raise InvalidInputError(
                f"poll_interval must be a finite number of seconds >= {MIN_POLL_INTERVAL} (0 "
                f"would read an idle feed in a busy loop), not {poll_interval!r}"
            )
        if max_outage is not None and (
            isinstance(max_outage, bool)
            or not isinstance(max_outage, int | float)
            or not 0 <= max_outage < math.inf
        ):
            raise InvalidInputError(
                f"max_outage must be None or a finite number of seconds >= 0, not {max_outage!r}"
            )
        for flag, value in (("accept_trimmed_feed", accept_trimmed_feed), ("backfill", backfill)):
            if not isinstance(value, bool):
                raise InvalidInputError(f"{flag} must be a bool, not {value!r}")
        self.store = store
        self.projection = projection
        self.consumer = consumer
        self.partitions = self._owned(store, partitions)
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.accept_trimmed_feed = accept_trimmed_feed
        self.backfills = backfill
        self.max_outage = max_outage
        self._backfilled: set[int] = set()
        self._group_at: dict[int, str] = {}
        """Where this runner last put the projection's group, per partition."""
        self._created: set[int] = set()
        """Partitions where this runner registered the group and has applied nothing since."""
        self._failed: dict[int, Exception] = {}

    @staticmethod
    def _owned(store: EventStore, partitions: Sequence[int] | None) -> list[int]:
        if partitions is None:
            return list(range(store.partitions))
        if isinstance(partitions, str | bytes) or not isinstance(partitions, Sequence):
            raise InvalidInputError(f"partitions must be a sequence of ints, not {partitions!r}")
        owned = list(partitions)
        for p in owned:
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < store.partitions:
                raise InvalidInputError(
                    f"partitions must be ints in 0..{store.partitions - 1}, not {p!r}"
                )
        if len(set(owned)) != len(owned):
            raise InvalidInputError(f"partitions must be distinct, not {owned!r}")
        return owned

    @property
    def failed(self) -> dict[int, Exception]:
        """The partitions the current (or last) `run` or `run_once` stopped working, each with
        its error: for a health check while `run` goes on with the others."""
        return dict(self._failed)

    async def run_once(self) -> int:
        """Work every owned partition until its feed holds nothing after the projection's
        checkpoint; returns the entries this runner applied (other runners of the projection
        may have applied some of them meanwhile).

        A partition that fails stops alone, as in `run`: the others are worked to their end,
        then its error is raised."""
        done = 0
        failed: dict[int, Exception] = {}
        self._failed = failed
        for partition in self.partitions:
            done += await self._work(partition, failed)
        if failed:
            raise self._failure(failed)
        return done

    async def run(self, stop: anyio.Event) -> int:
        """Work until ``stop`` is set; the batch in hand is finished (applied) first.

        The partitions are taken in turns of at most `TURN_BATCHES` batches each, so one whose
        feed fills as fast as it is read does not keep the others waiting.

        A partition that fails stops alone: a change the projection raises for (or whose
        events do not decode), its feed trimmed or reset under the checkpoint, a damaged
        checkpoint or figure. Partitions are independent (a checkpoint and a group each), so
        the others go on, and their groups let trimming go on; the failed one stays at the
        change (its checkpoint right before it, its group holding the rest of its feed) and is
        not tried again in this run, as waiting cures none of these. The error is logged when
        it happens, `failed` lists it, and `run` raises it once ``stop`` is set, or at once when
        every owned partition has stopped (the first one's error, with a note naming them
        all): a run that left changes unapplied never returns as if it had not. A store that
        answers with an error (an ACL denial, a read-only replica, a closed store: an
        `OperationalError` other than an outage) is the store's, not a partition's: it stops
        every partition at once, raised as is.

        Raises:
            InvalidInputError: ``stop`` not an event awaited with ``wait()`` (anyio's, or
                asyncio's): a `threading.Event` would block the event loop in its wait.
        """
        if not callable(getattr(stop, "is_set", None)) or not inspect.iscoroutinefunction(
            getattr(stop, "wait", None)
        ):
            raise InvalidInputError(f"stop must be an anyio.Event, not {stop!r}")
        done = 0
        failed: dict[int, Exception] = {}
        self._failed = failed
        outage_since: float | None = None
        backoff = OUTAGE_FIRST_BACKOFF
        while not stop.is_set():
            processed = 0
            try:
                for partition in self.partitions:
                    if stop.is_set():
                        break
                    if partition not in failed:
                        processed += await self._work(
                            partition, failed, stop=stop, turn=TURN_BATCHES
                        )
            except UNREACHABLE as exc:
                done += processed
                now = time.monotonic()
                outage_since = now if outage_since is None else outage_since
                waited = now - outage_since
                if self.max_outage is not None and waited >= self.max_outage:
                    exc.add_note(
                        f"projection {self.projection.name!r}: the store did not answer for "
                        f"{waited:.1f} s (max_outage {self.max_outage:g} s)"
                    )
                    raise
                log.warning(
                    "runner %s: the store does not answer (%r), %.1f s so far; "
                    "reading on from the checkpoint in %.1f s",
                    self.consumer, exc, waited, backoff,
                )  # fmt: skip
                with anyio.move_on_after(backoff):
                    await stop.wait()
                backoff = min(backoff * 2, OUTAGE_LAST_BACKOFF)
                continue
            if outage_since is not None:
                log.warning(
                    "runner %s: the store answers again after %.1f s",
                    self.consumer, time.monotonic() - outage_since,
                )  # fmt: skip
                outage_since, backoff = None, OUTAGE_FIRST_BACKOFF
            done += processed
            if failed and len(failed) == len(self.partitions):
                break  # nothing left to work
            if not processed:
                with anyio.move_on_after(self.poll_interval):
                    await stop.wait()
        if failed:
            raise self._failure(failed)
        return done

    async def _work(
        self,
        partition: int,
        failed: dict[int, Exception],
        *,
        stop: anyio.Event | None = None,
        turn: int | None = None,
    ) -> int:
        """`_drain` the partition; an error of its own (not the store's) sets it aside in
        ``failed``, logged, and the caller goes on with the others."""
        try:
            return await self._drain(partition, stop=stop, turn=turn)
        except OperationalError:
            raise  # the store's (an outage is waited out by `run`): every partition's
        except Exception as exc:
            failed[partition] = exc
            log.error(
                "runner %s: projection %s stops working partition %d in this run (%r); "
                "its other partitions go on",
                self.consumer, self.projection.name, partition, exc,
            )  # fmt: skip
            return 0

    def _failure(self, failed: dict[int, Exception]) -> Exception:
        """The error to raise for the partitions a run stopped working: the first one's."""
        first = next(iter(failed.values()))
        where = ", ".join(f"{p} ({type(e).__name__})" for p, e in failed.items())
        first.add_note(
            f"projection {self.projection.name!r} stopped working partition"
            f"{'s' if len(failed) > 1 else ''} {where} in this run; every other partition "
            "it owns was worked (`ProjectionRunner.failed` has each error)"
        )
        return first

    async def _drain(
        self, partition: int, *, stop: anyio.Event | None = None, turn: int | None = None
    ) -> int:
        """Apply the partition's feed from the checkpoint on, batch by batch, until it is read
        to its end (or ``stop`` is set, or ``turn`` batches were applied); returns the entries
        applied."""
        if self.backfills and partition not in self._backfilled:
            await self.backfill_partition(partition)
        name = self.projection.name
        done = 0
        checkpoint = await self.store.checkpoint_of(partition, name)
        while stop is None or not stop.is_set():
            held, batch = await self._read(partition, checkpoint)
            # Asked after the read: nothing after the checkpoint had left the feed by then, so
            # the batch is the feed's next entries, none passed over.
            if await self._past_trimmed(partition, checkpoint, held=held):
                checkpoint = await self.store.checkpoint_of(partition, name)
                continue
            group_in_place = self._group_at.get(partition) == checkpoint
            await self._hold_feed(partition, checkpoint)
            if not batch:
                if group_in_place:  # else _hold_feed just registered or moved it
                    await self._check_group(partition, checkpoint)
                break
            incr: list[Increment] = []
            for i, entry in enumerate(batch):
                try:
                    # In the change's own life of the thread: a thread deleted (and created
                    # again) since has other events at these seqs, counted by their own changes.
                    events = await self.store.read_change(entry)
                    incr += validate_increments(self.projection.increments(entry, events))
                except (*UNREACHABLE, StoreClosedError):
                    # The store's, not the change's: `run` waits out one it cannot reach and
                    # reads it again; a store closed under the runner ends it.
                    raise
                except Exception as exc:
                    await self._stop_at(partition, checkpoint, batch[:i], incr, entry, exc)
                    raise
            if await self.store.apply_checkpointed(
                partition, name, expected=checkpoint, checkpoint=batch[-1].id, incr=incr
            ):
                done += len(batch)
                checkpoint = batch[-1].id
                self._created.discard(partition)
                if turn is not None:
                    turn -= 1
                    if not turn:
                        break  # the others' turn: `run` comes back, as it applied something
            else:
                log.info(
                    "runner %s: checkpoint of %s moved in partition %d; reading on from it",
                    self.consumer, name, partition,
                )  # fmt: skip
                checkpoint = await self.store.checkpoint_of(partition, name)
        if partition in self._group_at:
            await self._hold_feed(partition, checkpoint)
        return done

    async def _read(self, partition: int, checkpoint: str) -> tuple[bool, list[FeedEntry]]:
        """The feed's next batch after the checkpoint, and whether the feed still holds the
        checkpoint's own entry: read with it (from the id just before), in the same round
        trip, so that `_past_trimmed` can tell a feed that lost it without a trim record."""
        if checkpoint == "0-0":
            return True, await self.store.read_feed(partition, count=self.batch_size)
        at = parse_stream_id(checkpoint)
        before = _just_before(checkpoint)
        page = await self.store.read_feed(partition, after=before, count=self.batch_size + 1)
        held = bool(page) and parse_stream_id(page[0].id) == at
        return held, page[1:] if held else page[: self.batch_size]

    async def _stop_at(
        self,
        partition: int,
        checkpoint: str,
        before: Sequence[FeedEntry],
        incr: list[Increment],
        entry: FeedEntry,
        exc: Exception,
    ) -> None:
        """A change the runner cannot apply (the projection raised for it, or its events do not
        decode): the runner stops there, never skipping it. The changes of the batch before it
        are applied (so the checkpoint, and `threadlog feed`, point at it), and ``exc`` is
        given a note naming it; the runner raises it."""
        name = self.projection.name
        if before:
            try:
                applied = await self.store.apply_checkpointed(
                    partition, name, expected=checkpoint, checkpoint=before[-1].id, incr=incr
                )
                if applied:
                    self._created.discard(partition)
                    await self._hold_feed(partition, before[-1].id)
            except Exception:  # the change's own error is the one to raise
                log.exception("runner %s: applying the changes before it failed", self.consumer)
        what = "deletion" if entry.deleted else f"events #{entry.first_seq}..{entry.last_seq}"
        note = (
            f"projection {name!r} stopped at change {entry.id} of partition {partition} "
            f"(thread {entry.thread_id!r}, {what}): it is not applied, and no later one is"
        )
        exc.add_note(note)
        log.error("runner %s: %s: %r", self.consumer, note, exc)

    async def _check_group(self, partition: int, checkpoint: str) -> None:
        """On an idle pass, register again the group this runner put at the checkpoint if it
        was dropped meanwhile. Without it a group dropped while the feed is idle stayed gone
        until the next batch, and a trim after another reader (an export) could pass the
        changes coming next before the projection applied them."""
        if await self.store.create_feed_group(partition, self.projection.name, start=checkpoint):
            self._dropped(partition, checkpoint)

    async def _hold_feed(self, partition: int, checkpoint: str) -> None:
        """Register the projection's group at the checkpoint, or move it there, so trimming
        removes only changes the projection applied. Racing runners may leave it behind the
        checkpoint for a while (never ahead): that holds trimming back, and the runner that
        left it there moves it on its next pass."""
        group = self.projection.name
        if self._group_at.get(partition) == checkpoint:
            return
        if partition not in self._group_at:
            created = await self.store.create_feed_group(partition, group, start=checkpoint)
            self._group_at[partition] = checkpoint
            if created:
                self._created.add(partition)
                return
        # An existing group may sit elsewhere (left by an earlier run); this also forgets the
        # entries the consumer-group runner of older releases left pending below the checkpoint.
        try:
            await self.store.advance_feed_group(partition, group, checkpoint)
        except FeedGroupNotFoundError:
            # Dropped meanwhile (`threadlog drop-group`, a refused runner): while the projection
            # runs it needs one, or trimming would pass it. A change trimmed in between is
            # caught by the next read's check.
            if await self.store.create_feed_group(partition, group, start=checkpoint):
                self._dropped(partition, checkpoint)
        self._group_at[partition] = checkpoint

    def _dropped(self, partition: int, checkpoint: str) -> None:
        log.warning(
            "runner %s: consumer group %r of partition %d's feed was dropped while projection "
            "%s runs; registered it again at its checkpoint %s",
            self.consumer, self.projection.name, partition, self.projection.name, checkpoint,
        )  # fmt: skip

    async def _past_trimmed(self, partition: int, checkpoint: str, *, held: bool) -> bool:
        """Refuse to go on past changes that left the feed before they were applied; True when
        ``accept_trimmed_feed`` moved the checkpoint past them instead (or another runner
        moved it meanwhile): read on from the checkpoint as it stands.

        The projection's group holds trimming back to its checkpoint, so this happens only when
        the feed was trimmed by age (or by hand) past the checkpoint, or before the projection
        first ran: its totals would silently lack those changes. A runner refused before it
        applied anything leaves no group behind (it would hold trimming back for ever).

        ``held`` says whether the read found the checkpoint's own entry in the feed. Every
        checkpoint is an id the feed gave (a batch's last entry, a trim point, the feed's end
        for a backfill), and trimming or deleting an entry records it in ``trimmed_to``, so
        a feed holding neither was deleted (or replaced) since, taking the changes after the
        checkpoint with it, without a record: `FeedResetError`, as ``accept_trimmed_feed``
        cannot move a checkpoint back to where the new feed starts. (A new feed whose first
        entry got the checkpoint's very id, in the same millisecond, cannot be told apart.)
        """
        name = self.projection.name
        trimmed_to = (await self.store.feed_info(partition)).trimmed_to
        if parse_stream_id(trimmed_to) <= parse_stream_id(checkpoint):
            if held or parse_stream_id(trimmed_to) == parse_stream_id(checkpoint):
                return False
            if await self.store.checkpoint_of(partition, name) != checkpoint:
                return True  # moved by another runner meanwhile: judged again from there
            raise FeedResetError(partition, f"projection {name!r}", checkpoint)
        if await self.store.checkpoint_of(partition, name) != checkpoint:
            # Another runner of the projection applied past ``checkpoint`` meanwhile (and the
            # feed was trimmed to what it applied): nothing was lost, read on from its
            # checkpoint (checked there in turn).
            return True
        if not self.accept_trimmed_feed:
            if partition in self._created:
                await self.store.delete_feed_group(partition, name)
                self._created.discard(partition)
                del self._group_at[partition]
            raise FeedTrimmedError(partition, f"projection {name!r}", checkpoint, trimmed_to)
        # A compare-and-set like any batch: the acceptance stands for every later run, and a
        # runner that applied changes meanwhile keeps them.
        if await self.store.apply_checkpointed(
            partition, name, expected=checkpoint, checkpoint=trimmed_to
        ):
            self._created.discard(partition)
            # Each time: a later trim past the projection loses other changes.
            log.warning(
                "runner %s: projection %s goes on without the changes trimmed from "
                "partition %d's feed (up to %s; its checkpoint was %s): "
                "accept_trimmed_feed=True",
                self.consumer, name, partition, trimmed_to, checkpoint,
            )  # fmt: skip
        return True

    # -- backfill ------------------------------------------------------------------------------

    async def backfill(self) -> int:
        """`backfill_partition` every owned partition; returns the events read."""
        return sum([await self.backfill_partition(p) for p in self.partitions])

    async def backfill_partition(self, partition: int) -> int:
        """Count, from the threads' logs, every change the partition's feed recorded so far,
        and move the projection's checkpoint there; returns the events read (0: nothing to
        do, as the projection has a checkpoint already: it counted from the feed).

        For a projection that never ran: what it would have counted had it followed the feed
        from the start, read from the logs, so it works on a trimmed feed too. Increments are
        summed (they are ``HINCRBY`` amounts) and applied with the checkpoint in one atomic
        step: a backfill that dies half way wrote nothing and may be run again, and a runner
        of the same projection elsewhere either finds the checkpoint moved (and skips what
        the backfill counted) or moved it first (and the backfill writes nothing). The
        projection sees the events of each thread in read batches, each as one change whose
        ``id`` is the feed position the backfill counts up to. A thread deleted before that
        position is not counted (a runner reading the feed late would find its events gone);
        a deletion landing while the backfill reads makes it start again (a few times, then
        `ConflictError`). Versions and first events are read `BACKFILL_BATCH` threads at a
        time (a round trip each on Redis), not a thread at a time.

        Raises:
            ConflictError: threads kept being deleted while it read.
        """
        name = self.projection.name
        for _ in range(BACKFILL_ATTEMPTS):
            if await self.store.checkpoint_of(partition, name) != "0-0":
                self._backfilled.add(partition)
                return 0
            position = (await self.store.feed_info(partition)).last_id
            if position == "0-0":  # nothing recorded yet: the feed has it all
                self._backfilled.add(partition)
                return 0
            counted = await self._count_up_to(partition, position)
            if counted is None:
                continue  # a thread was deleted while its events were read
            events, totals = counted
            await self.store.create_feed_group(partition, name, start=position)
            incr = [(h, f, amount) for (h, f), amount in totals.items() if amount]
            applied = await self.store.apply_checkpointed(
                partition, name, expected="0-0", checkpoint=position, incr=incr
            )
            self._backfilled.add(partition)
            if applied:
                log.info(
                    "projection %s backfilled partition %d from the logs: %d events up to %s",
                    name, partition, events, position,
                )  # fmt: skip
                return events
            return 0  # a runner got there first: its checkpoint stands
        raise ConflictError(
            f"projection {name!r}: threads of partition {partition} kept being deleted while "
            f"it was backfilled ({BACKFILL_ATTEMPTS} attempts); run it again"
        )

    async def _count_up_to(
        self, partition: int, position: str
    ) -> tuple[int, dict[tuple[str, str], int]] | None:
        """Every event of the partition's threads that a change up to ``position`` recorded,
        through the projection, summed (None: a thread was deleted meanwhile)."""
        store = self.store
        threads = [t.thread_id for t in await store.threads(partition=partition)]
        versions: dict[str, int] = {}
        for i in range(0, len(threads), BACKFILL_BATCH):
            chunk = threads[i : i + BACKFILL_BATCH]
            versions.update(zip(chunk, await store.versions(chunk), strict=True))
        # Read after the versions: every change behind them that came after ``position`` is
        # in this tail, and each thread's first one there marks where its counted part ends.
        # Changes made after the versions were read lie past every version: the tail stops at
        # the feed's end as it is now, so writers that keep pace cannot keep it reading.
        tail_end = (await store.feed_info(partition)).last_id
        tail = await self._feed_after(partition, position, tail_end)
        upto = dict(versions)
        for entry in tail:
            if entry.thread_id in upto:
                end = 0 if entry.deleted else entry.first_seq - 1
                upto[entry.thread_id] = min(upto[entry.thread_id], end)
        events = 0
        totals: dict[tuple[str, str], int] = {}

        def count(thread_id: str, batch: list[RecordedEvent]) -> None:
            nonlocal events
            change = FeedEntry(
                id=position,
                partition=partition,
                thread_id=thread_id,
                first_seq=batch[0].seq,
                last_seq=batch[-1].seq,
            )
            for hash_name, field, amount in self.projection.increments(change, batch):
                key = (hash_name, field)
                totals[key] = totals.get(key, 0) + amount
            events += len(batch)

        counted = [(t, stop) for t, stop in upto.items() if stop > 0]
        for i in range(0, len(counted), BACKFILL_BATCH):
            part = counted[i : i + BACKFILL_BATCH]
            # The first page of every thread of the part in one round trip (standalone Redis;
            # `read_raw_ranges` reads a range at a time on a cluster, as before).
            firsts = await store.read_raw_ranges(
                [RawRange(thread_id=t, stop=stop) for t, stop in part], count=BACKFILL_FIRST_PAGE
            )
            for (thread_id, stop), rows in zip(part, firsts, strict=True):
                batch = decode_rows(thread_id, rows, store.registry) if rows else []
                if (
                    not batch
                    or batch[-1].seq != len(batch)
                    or len(batch) < min(stop, BACKFILL_FIRST_PAGE)
                ):
                    batch = []  # not seqs 1..n as expected: read as before, which says why
                else:
                    count(thread_id, batch)
                start = len(batch) + 1
                if start <= stop:
                    try:
                        async for more in store.read_batches(thread_id, start=start, stop=stop):
                            count(thread_id, more)
                    except ThreadReplacedError:
                        return None  # deleted between two of its batches: as below
        seen = {e.id for e in tail}
        # A deletion that landed while the events were read; one landing after cannot change
        # what was read, so this read too stops at the feed's end as it is now.
        read_end = (await store.feed_info(partition)).last_id
        for entry in await self._feed_after(partition, position, read_end):
            if entry.deleted and entry.id not in seen and upto.get(entry.thread_id, 0) > 0:
                return None  # its events may have been read from its next life
        return events, totals

    async def _feed_after(self, partition: int, position: str, end: str) -> list[FeedEntry]:
        """The feed's entries after ``position`` up to ``end`` (both feed ids)."""
        out: list[FeedEntry] = []
        after, last = position, parse_stream_id(end)
        while parse_stream_id(after) < last:
            page = await self.store.read_feed(partition, after=after, count=FEED_PAGE)
            out += [e for e in page if parse_stream_id(e.id) <= last]
            if len(page) < FEED_PAGE or parse_stream_id(page[-1].id) >= last:
                return out
            after = page[-1].id
        return out


class UsageRow(msgspec.Struct, frozen=True, kw_only=True):
    """Usage of one model tier on one UTC day, summed over a namespace."""

    day: str
    model_tier: str
    turns: int
    input_tokens: int
    output_tokens: int


class UsageProjection(AsyncProjection):
    """Tokens and turns per model tier per day (UTC), per namespace: the example projection."""

    name = "usage"
    _METRICS = ("turns", "input_tokens", "output_tokens")

    def increments(self, entry: FeedEntry, events: Sequence[RecordedEvent]) -> list[Increment]:
        out: list[Increment] = []
        for event in events:
            payload = event.payload
            if not isinstance(payload, TurnSettled):
                continue
            day = datetime.fromtimestamp(event.time_ms / 1000, tz=UTC).strftime("%Y-%m-%d")
            key = f"{day}|{payload.model_tier or 'unknown'}"
            out += [
                ("turns", key, 1),
                ("input_tokens", key, payload.usage.input_tokens),
                ("output_tokens", key, payload.usage.output_tokens),
            ]
        return out

    async def report(self, store: EventStore) -> list[UsageRow]:
        """The usage table, summed over every partition, by day then tier.

        Raises:
            InvalidInputError: ``store`` not an `EventStore` (a ``connect()`` not awaited).
        """
        store = require_store(store, "UsageProjection.report")
        totals: dict[str, dict[str, int]] = {}
        for partition in range(store.partitions):
            for metric in self._METRICS:
                for key, value in (await store.read_aux(partition, self.name, metric)).items():
                    row = totals.setdefault(key, dict.fromkeys(self._METRICS, 0))
                    row[metric] += value
        rows = []
        for key in sorted(totals):
            day, _, tier = key.partition("|")
            rows.append(UsageRow(day=day, model_tier=tier, **totals[key]))
        return rows
