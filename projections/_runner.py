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
