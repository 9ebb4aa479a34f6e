"""Async projections over the partitioned change feed, and the runner that keeps them exact.

An async projection turns a batch of changes into increments on its own partition-level hashes.
The runner reads each partition's feed through a consumer group and, per batch, applies the
increments and moves the projection's checkpoint in ONE atomic compare-and-set, then
acknowledges the entries. A batch delivered twice (its consumer died before acking and another
reclaimed it) finds the checkpoint moved and only acks: nothing is counted twice, nothing lost.

Order matters for that argument, so each partition is worked by one runner at a time: give
every runner a disjoint set of partitions (`partitions_for`). A runner first re-reads what was
delivered to it, then takes over entries other consumers left idle (XAUTOCLAIM), and reads new
entries only when no other consumer holds older ones.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from datetime import UTC, datetime

import anyio
import msgspec

from eventstore import (
    ConflictError,
    EventStore,
    FeedEntry,
    FeedTrimmedError,
    InvalidInputError,
    RecordedEvent,
    TurnSettled,
    validate_consumer,
    validate_view_name,
)
from eventstore._feed import parse_stream_id

log = logging.getLogger("threadlog.runner")

BACKFILL_ATTEMPTS = 5
FEED_PAGE = 1024

Increment = tuple[str, str, int]
"""``(hash name, field, amount)`` on one of the projection's partition-level hashes."""


class AsyncProjection(abc.ABC):
    """A read model updated from the change feed, after the append (eventually consistent)."""

    name: str
    """The consumer group name and the namespace of its hashes."""

    @abc.abstractmethod
    def increments(self, entry: FeedEntry, events: Sequence[RecordedEvent]) -> list[Increment]:
        """What one change adds: a pure function of the change and its events."""


def partitions_for(partitions: int, runner_index: int, runners: int) -> list[int]:
    """The partitions runner ``runner_index`` of ``runners`` owns (a disjoint cover)."""
    if not 0 <= runner_index < runners:
        raise InvalidInputError("runner_index must be in 0..runners-1")
    return [p for p in range(partitions) if p % runners == runner_index]


class ProjectionRunner:
    """Feeds an `AsyncProjection` from the change feed of some (default: all) partitions.

    When the feed was trimmed past the projection's checkpoint (by age, or before the
    projection first ran), its changes up to there are gone from the feed: the runner raises
    `FeedTrimmedError` rather than count without them, unless ``accept_trimmed_feed`` says
    to go on from what the feed still holds (logged once per partition).

    A projection added to a running system starts from the logs instead with
    ``backfill=True``: before it reads a partition's feed for the first time (no checkpoint
    yet), `backfill` counts every event the feed has recorded so far from the threads' logs,
    trimmed or not, and sets the checkpoint there.
    """

    def __init__(
        self,
        store: EventStore,
        projection: AsyncProjection,
        *,
        consumer: str,
        partitions: Sequence[int] | None = None,
        batch_size: int = 256,
        claim_idle_ms: int = 30_000,
        poll_interval: float = 0.2,
        accept_trimmed_feed: bool = False,
        backfill: bool = False,
    ) -> None:
        validate_view_name(projection.name)
        validate_consumer(consumer)
        if batch_size < 1:
            raise InvalidInputError("batch_size must be >= 1")
        self.store = store
        self.projection = projection
        self.consumer = consumer
        self.partitions = list(range(store.partitions)) if partitions is None else list(partitions)
        self.batch_size = batch_size
        self.claim_idle_ms = claim_idle_ms
        self.poll_interval = poll_interval
        self.accept_trimmed_feed = accept_trimmed_feed
        self.backfills = backfill
        self._backfilled: set[int] = set()
        self._registered: set[int] = set()
        self._warned: set[int] = set()

    async def _register(self, partition: int) -> None:
        if partition not in self._registered:
            await self.store.create_feed_group(partition, self.projection.name, start="0-0")
            self._registered.add(partition)

    async def run_once(self) -> int:
        """Work every owned partition until nothing is left; returns the entries processed."""
        done = 0
        for partition in self.partitions:
            done += await self._drain(partition)
        return done

    async def run(self, stop: anyio.Event) -> int:
        """Work until ``stop`` is set; the batch in hand is finished (applied and acked) first."""
        done = 0
        while not stop.is_set():
            processed = 0
            for partition in self.partitions:
                if stop.is_set():
                    break
                processed += await self._drain(partition, stop=stop)
            done += processed
            if not processed:
                with anyio.move_on_after(self.poll_interval):
                    await stop.wait()
        return done

    async def _check_not_trimmed(self, partition: int) -> None:
        """Refuse to go on past changes that left the feed before they were applied.

        Trimming waits for every group, so this happens only when the feed was trimmed by age
        (or by hand) past the projection's checkpoint, or before the projection first ran:
        its totals would silently lack those changes.
        """
        name = self.projection.name
        trimmed_to = (await self.store.feed_info(partition)).trimmed_to
        checkpoint = await self.store.checkpoint_of(partition, name)
        if parse_stream_id(trimmed_to) <= parse_stream_id(checkpoint):
            return
        if not self.accept_trimmed_feed:
            raise FeedTrimmedError(partition, f"projection {name!r}", checkpoint, trimmed_to)
        if partition not in self._warned:
            self._warned.add(partition)
            log.warning(
                "projection %s goes on without the changes trimmed from partition %d's feed "
                "(up to %s; its checkpoint is %s): accept_trimmed_feed=True",
                name, partition, trimmed_to, checkpoint,
            )  # fmt: skip

    async def _drain(self, partition: int, *, stop: anyio.Event | None = None) -> int:
        if self.backfills and partition not in self._backfilled:
            await self.backfill_partition(partition)
        await self._register(partition)
        await self._check_not_trimmed(partition)
        group = self.projection.name
        done = 0
        # 1. what was delivered to this consumer before (it restarted) and 2. what crashed
        # consumers left idle: both older than anything new, so they go first.
        for source in ("mine", "claim", "new"):
            while stop is None or not stop.is_set():
                if source == "mine":
                    batch = await self.store.read_feed_group(
                        partition, group, self.consumer, count=self.batch_size, pending=True
                    )
                elif source == "claim":
                    batch = await self.store.claim_feed(
                        partition,
                        group,
                        self.consumer,
                        min_idle_ms=self.claim_idle_ms,
                        count=self.batch_size,
                    )
                else:
                    if any(
                        g.pending
                        for g in await self.store.feed_groups(partition)
                        if g.name == group
                    ):
                        break  # another consumer still holds older entries: wait for them
                    batch = await self.store.read_feed_group(
                        partition, group, self.consumer, count=self.batch_size
                    )
                if not batch:
                    break
                done += await self._process(partition, batch)
        return done

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
        `ConflictError`).

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
        threads = [t.thread_id for t in await store.threads() if t.partition == partition]
        versions = {t: await store.version(t) for t in threads}
        # Read after the versions: every change behind them that came after ``position`` is
        # in this tail, and each thread's first one there marks where its counted part ends.
        tail = await self._feed_after(partition, position)
        upto = dict(versions)
        for entry in tail:
            if entry.thread_id in upto:
                end = 0 if entry.deleted else entry.first_seq - 1
                upto[entry.thread_id] = min(upto[entry.thread_id], end)
        events = 0
        totals: dict[tuple[str, str], int] = {}
        for thread_id, stop in upto.items():
            if stop <= 0:
                continue
            async for batch in store.read_batches(thread_id, stop=stop):
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
        seen = {e.id for e in tail}
        for entry in await self._feed_after(partition, position):
            if entry.deleted and entry.id not in seen and upto.get(entry.thread_id, 0) > 0:
                return None  # its events may have been read from its next life
        return events, totals

    async def _feed_after(self, partition: int, position: str) -> list[FeedEntry]:
        out: list[FeedEntry] = []
        after = position
        while True:
            page = await self.store.read_feed(partition, after=after, count=FEED_PAGE)
            out += page
            if len(page) < FEED_PAGE:
                return out
            after = page[-1].id

    async def _process(self, partition: int, batch: list[FeedEntry]) -> int:
        name = self.projection.name
        batch = sorted(batch, key=lambda e: parse_stream_id(e.id))
        while True:
            checkpoint = await self.store.checkpoint_of(partition, name)
            after = parse_stream_id(checkpoint)
            fresh = [e for e in batch if parse_stream_id(e.id) > after]
            if not fresh:
                break
            incr: list[Increment] = []
            for entry in fresh:
                # In the change's own life of the thread: a thread deleted (and created again)
                # since has other events at these seqs, which are counted by their own changes.
                events = await self.store.read_change(entry)
                incr += self.projection.increments(entry, events)
            applied = await self.store.apply_checkpointed(
                partition, name, expected=checkpoint, checkpoint=fresh[-1].id, incr=incr
            )
            if applied:
                break
            log.info("checkpoint of %s moved in partition %d; refiltering", name, partition)
        await self.store.ack_feed(partition, name, [e.id for e in batch])
        return len(batch)


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
        """The usage table, summed over every partition, by day then tier."""
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
