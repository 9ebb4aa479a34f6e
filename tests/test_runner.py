"""The async projection runner over the change feed, on the memory backend and real Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import AsyncIterator, Sequence

import anyio
import anyio.lowlevel
import pytest

import eventstore as es
import projections._runner
from eventstore._feed import parse_stream_id
from eventstore.servers import redis_server
from projections import (
    AsyncProjection,
    ForgottenProjection,
    GroupLag,
    Increment,
    MessagesProjection,
    ProjectionRunner,
    UsageProjection,
    UsageRow,
    drop_feed_group,
    feed_group_lag,
    forget_projection,
    partitions_for,
)

pytestmark = [pytest.mark.anyio, pytest.mark.partitions(4)]


async def settle(store: es.EventStore, thread: str, tier: str, tokens: int) -> None:
    turn = es.new_ulid()
    await store.append(
        thread,
        [
            es.TurnOpened(turn_id=turn),
            es.TurnSettled(
                turn_id=turn,
                outcome="completed",
                model_tier=tier,
                usage=es.Usage(input_tokens=tokens, output_tokens=tokens // 2),
            ),
        ],
    )


async def fill(store: es.EventStore, turns: int) -> dict[str, tuple[int, int, int]]:
    expected: dict[str, tuple[int, int, int]] = {}
    for i in range(turns):
        tier = ("small", "large", "medium")[i % 3]
        await settle(store, f"thread-{i % 7}", tier, 10 * (i + 1))
        t, a, b = expected.get(tier, (0, 0, 0))
        expected[tier] = (t + 1, a + 10 * (i + 1), b + 5 * (i + 1))
    await store.append(
        "chatter", [es.MessageAppended(message=es.Message(role="user", content="x"))]
    )
    return expected


def totals(rows: list[UsageRow]) -> dict[str, tuple[int, int, int]]:
    out: dict[str, tuple[int, int, int]] = {}
    for r in rows:
        t, a, b = out.get(r.model_tier, (0, 0, 0))
        out[r.model_tier] = (t + r.turns, a + r.input_tokens, b + r.output_tokens)
    return out


async def test_usage_projection_counts_every_turn_once(store: es.EventStore) -> None:
    expected = await fill(store, 30)
    usage = UsageProjection()
    runner = ProjectionRunner(store, usage, consumer="c1", batch_size=4)
    assert await runner.run_once() == 31
    assert await runner.run_once() == 0
    rows = await usage.report(store)
    assert totals(rows) == expected
    assert all(len(r.day) == 10 for r in rows)
    # New appends are picked up incrementally.
    await settle(store, "thread-late", "small", 1000)
    assert await runner.run_once() == 1
    t, a, b = expected["small"]
    assert totals(await usage.report(store))["small"] == (t + 1, a + 1000, b + 500)


@pytest.mark.parametrize("bad", ["", None, "tab\there"])
async def test_a_runner_with_an_unusable_consumer_name_is_refused_at_once(
    store: es.EventStore, bad: object
) -> None:
    with pytest.raises(es.InvalidInputError, match="consumer name"):
        ProjectionRunner(store, UsageProjection(), consumer=bad)  # type: ignore[arg-type]
    assert await store.feed_groups(0) == []  # no group was registered


async def test_a_runner_given_a_store_not_awaited_is_refused_at_once(redis_url: str) -> None:
    pending = es.connect(redis_url, namespace="r" + uuid.uuid4().hex[:12])
    try:
        with pytest.raises(
            es.InvalidInputError,
            match=r"^ProjectionRunner needs an EventStore \(from eventstore.connect\), not "
            r"coroutine: await it",
        ):
            ProjectionRunner(pending, UsageProjection(), consumer="c")  # type: ignore[arg-type]
        with pytest.raises(es.InvalidInputError, match=r"^UsageProjection.report needs .*await"):
            await UsageProjection().report(pending)  # type: ignore[arg-type]
    finally:
        async with await pending:
            pass


@pytest.mark.parametrize("damage", [b"garbage", b"\xff\xfe"], ids=["no-id", "not-ascii"])
async def test_a_damaged_checkpoint_is_named_as_damage(redis_url: str, damage: bytes) -> None:
    """A checkpoint changed from outside threadlog was taken for the caller's bad input
    (`InvalidInputError: not a stream id`) or raised a bare `UnicodeDecodeError`, from the
    runner and from `feed_group_lag` alike. It is `CorruptKeyError`, naming the key and the
    projection; the runner's other partitions go on."""
    store = await es.connect(redis_url, namespace="r" + uuid.uuid4().hex[:12], partitions=2)
    assert isinstance(store, es.RedisEventStore)
    try:
        threads = {es.partition_of(t, 2): t for t in (f"t{i}" for i in range(20))}
        for thread in threads.values():
            await settle(store, thread, "small", 1)
        runner = ProjectionRunner(store, UsageProjection(), consumer="c")
        assert await runner.run_once() == 2
        key = store.keys.checkpoints(0)
        await store.client.hset(key, "usage", damage)
        for read in (store.checkpoint_of(0, "usage"), store.checkpoints(0)):
            with pytest.raises(es.CorruptKeyError, match="'usage'") as info:
                await read
            assert info.value.key == key
        # Asked to, the listing goes on past it, and says what is wrong where.
        damaged: dict[str, es.CorruptKeyError] = {}
        assert await store.checkpoints(0, damaged=damaged) == {}
        assert list(damaged) == ["usage"] and damaged["usage"].key == key
        rows = {r.partition: r for r in await feed_group_lag(store) if r.name == "usage"}
        assert rows[0].damaged is not None and "no feed id" in rows[0].damaged
        assert rows[0].position == rows[0].last_delivered  # the group's own, for want of it
        assert rows[1].damaged is None and rows[1].registered
        await settle(store, threads[1], "small", 1)
        with pytest.raises(es.CorruptKeyError):
            await runner.run_once()
        assert list(runner.failed) == [0]  # partition 1 was worked all the same
        assert await store.checkpoint_of(1, "usage") != "0-0"
        assert (await UsageProjection().report(store))[0].turns == 3
    finally:
        await store.close()


async def test_a_thread_deleted_and_created_again_is_counted_in_each_life_once(
    store: es.EventStore,
) -> None:
    """A change is read in its own life of the thread: the new life's events, at the same seqs,
    are not counted again for the old change (they come with their own)."""
    await settle(store, "x", "old-tier", 100)
    await store.delete_thread("x")
    await settle(store, "x", "new-tier", 7)
    usage = UsageProjection()
    assert await ProjectionRunner(store, usage, consumer="c1").run_once() == 3
    # The old life's events are gone from the log: nothing of it is left to count, and the new
    # life's turn counts once.
    assert totals(await usage.report(store)) == {"new-tier": (1, 7, 3)}


async def test_read_change_reads_a_change_in_its_own_life(store: es.EventStore) -> None:
    await settle(store, "y", "a", 10)
    (first,) = [
        e
        for p in range(store.partitions)
        for e in await store.read_feed(p, count=100)
        if e.thread_id == "y"
    ]
    events = await store.read_change(first)
    assert [e.seq for e in events] == [1, 2]
    assert [e.type for e in events] == ["turn.opened", "turn.settled"]
    await store.delete_thread("y")
    await settle(store, "y", "b", 20)
    assert await store.read_change(first) == []


class Exploding(UsageProjection):
    """Dies on the n-th change it sees, the way a consumer dies mid-batch."""

    def __init__(self, after: int) -> None:
        self.left = after

    def increments(
        self, entry: es.FeedEntry, events: Sequence[es.RecordedEvent]
    ) -> list[Increment]:
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("consumer died")
        return super().increments(entry, events)


class GroupLoser(ProjectionRunner):
    """Applies its batches but dies before moving the group past the second one."""

    batches = 0

    async def _hold_feed(self, partition: int, checkpoint: str) -> None:
        if checkpoint != "0-0":
            self.batches += 1
            if self.batches == 2:
                raise RuntimeError("died before moving the group")
        await super()._hold_feed(partition, checkpoint)


async def test_a_runner_dying_mid_batch_is_followed_exactly(store: es.EventStore) -> None:
    expected = await fill(store, 40)
    with pytest.raises(RuntimeError, match="consumer died"):
        await ProjectionRunner(
            store, Exploding(after=9), consumer="doomed", batch_size=5
        ).run_once()
    with pytest.raises(RuntimeError, match="died before moving the group"):
        await GroupLoser(store, UsageProjection(), consumer="doomed2", batch_size=5).run_once()
    survivor = ProjectionRunner(store, UsageProjection(), consumer="survivor", batch_size=5)
    await survivor.run_once()
    assert totals(await UsageProjection().report(store)) == expected
    for p in range(store.partitions):
        (group,) = await store.feed_groups(p)
        assert group.pending == 0
        assert group.last_delivered == await store.checkpoint_of(p, "usage")


async def test_graceful_shutdown_and_trimming(store: es.EventStore) -> None:
    expected = await fill(store, 12)
    stop = anyio.Event()
    runner = ProjectionRunner(store, UsageProjection(), consumer="c", poll_interval=0.01)
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            await runner.run(stop)

        tg.start_soon(run)
        with anyio.fail_after(10):
            while totals(await UsageProjection().report(store)) != expected:
                await anyio.sleep(0.01)
        stop.set()
    # Everything was acknowledged, so the feed can be trimmed to nothing.
    trimmed = sum([await store.trim_feed(p) for p in range(store.partitions)])
    assert trimmed == 13
    assert partitions_for(8, 1, 3) == [1, 4, 7]


class Slow(UsageProjection):
    def increments(
        self, entry: es.FeedEntry, events: Sequence[es.RecordedEvent]
    ) -> list[Increment]:
        import time

        time.sleep(0.02)
        return super().increments(entry, events)


KILLED_RUNNER = textwrap.dedent(
    """
    import sys, anyio, eventstore as es
    from projections import ProjectionRunner, UsageProjection
    from tests.test_runner import Slow

    async def main():
        store = await es.connect(sys.argv[1], namespace=sys.argv[2])
        print("ready", flush=True)
        await ProjectionRunner(store, Slow(), consumer="victim", batch_size=3).run_once()

    anyio.run(main)
    """
)


async def behind(store: es.EventStore) -> bool:
    """Whether the usage projection has changes left to apply in some partition."""
    for p in range(store.partitions):
        checkpoint = await store.checkpoint_of(p, "usage")
        if await store.read_feed(p, after=checkpoint, count=1):
            return True
    return False


async def test_runner_process_killed_with_sigkill(redis_url: str) -> None:
    namespace = "r" + uuid.uuid4().hex[:12]
    store = await es.connect(redis_url, namespace=namespace, partitions=4)
    try:
        expected = await fill(store, 60)
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED_RUNNER, redis_url, namespace],
            stdout=subprocess.PIPE,
            cwd=os.path.dirname(os.path.dirname(__file__)),
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == b"ready"
            # Kill it mid-batch: once it has applied something and has more to apply (each
            # batch takes ~60 ms of slow increments; the check takes well under 1 ms).
            with anyio.fail_after(30):
                while True:
                    if await behind(store) and any(
                        [await store.checkpoint_of(p, "usage") != "0-0" for p in range(4)]
                    ):
                        break
                    await anyio.sleep(0.005)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL
        assert await behind(store)  # it died with changes left to apply
        survivor = ProjectionRunner(store, UsageProjection(), consumer="survivor")
        await survivor.run_once()
        assert totals(await UsageProjection().report(store)) == expected
    finally:
        await store.close()


async def test_a_feed_trimmed_past_the_checkpoint_stops_the_runner(store: es.EventStore) -> None:
    expected = await fill(store, 6)
    runner = ProjectionRunner(store, UsageProjection(), consumer="c")
    await runner.run_once()
    assert totals(await UsageProjection().report(store)) == expected
    # Trimming that waits for the group leaves the runner exact ...
    assert sum([await store.trim_feed(p) for p in range(store.partitions)]) > 0
    await fill(store, 2)
    await anyio.sleep(0.01)
    # ... but by age it takes changes the projection had not applied yet.
    assert sum([await store.trim_feed(p, max_age_ms=0) for p in range(store.partitions)]) > 0
    with pytest.raises(es.FeedTrimmedError, match="trimmed past projection 'usage'"):
        await runner.run_once()
    assert totals(await UsageProjection().report(store)) == expected  # nothing half-counted
    # A projection started after trimming is told too, and may choose to go on.
    late = ProjectionRunner(store, UsageProjection(), consumer="c", accept_trimmed_feed=True)
    assert await late.run_once() == 0
    await settle(store, "thread-after", "small", 1000)  # counted from the feed it still holds
    assert await late.run_once() == 1
    small = totals(await UsageProjection().report(store))["small"]
    assert small == (expected["small"][0] + 1, expected["small"][1] + 1000, small[2])


@pytest.mark.parametrize("damaged", ["9_999_999_999_999-0", " 99999999999999-0"])
async def test_a_checkpoint_that_is_not_a_stream_id_stops_the_runner(
    redis_url: str, damaged: str
) -> None:
    """A stored checkpoint is read as the store reads stream ids: Python's ``int`` would take
    ``9_999...`` (or a leading space) for a position past every change, and the runner would
    ack the changes after it uncounted."""
    async with await es.connect(redis_url, namespace="c" + uuid.uuid4().hex[:12]) as store:
        assert isinstance(store, es.RedisEventStore)
        expected = await fill(store, 3)
        usage = UsageProjection()
        runner = ProjectionRunner(store, usage, consumer="c")
        await runner.run_once()
        p = es.partition_of("thread-0", store.partitions)
        checkpoint = await store.checkpoint_of(p, usage.name)
        await store.client.hset(store.keys.checkpoints(p), usage.name, damaged)
        await settle(store, "thread-0", "small", 1000)
        with pytest.raises(es.CorruptKeyError, match="no feed id"):
            await runner.run_once()
        assert totals(await usage.report(store)) == expected
        # Nothing was passed over: with the checkpoint repaired, the change is counted.
        await store.client.hset(store.keys.checkpoints(p), usage.name, checkpoint)
        assert await runner.run_once() == 1
        t, a, b = expected["small"]
        assert totals(await usage.report(store))["small"] == (t + 1, a + 1000, b + 500)


# -- runners sharing partitions, trimmed feeds, bad input ---------------------------------------


class Turns:
    """Store calls of several runners taken in turn, by a repeated pattern of their names: a
    runner waits for its turn before each call (a runner that finished gives up its turns)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.calls = 0
        self.done: set[str] = set()

    def store(self, store: es.EventStore, who: str) -> es.EventStore:
        turns = self

        class Taken:
            def __getattr__(self, attr: str) -> object:
                value = getattr(store, attr)
                if attr.startswith("_") or not callable(value):
                    return value

                async def call(*args: object, **kwargs: object) -> object:
                    while True:
                        holder = turns.pattern[turns.calls % len(turns.pattern)]
                        if holder == who or holder in turns.done:
                            break
                        await anyio.lowlevel.checkpoint()
                    turns.calls += 1
                    return await value(*args, **kwargs)

                return call

        return Taken()  # type: ignore[return-value]

    async def run(self, runner: ProjectionRunner, who: str) -> int:
        try:
            return await runner.run_once()
        finally:
            self.done.add(who)


@pytest.mark.parametrize("pattern", ["ab", "abb", "aab", "abbb", "aaab"])
async def test_two_runners_on_the_same_partitions_count_every_change_once(
    store: es.EventStore, pattern: str
) -> None:
    """Two runners over every partition (the default, and a rolling deploy) whose store calls
    interleave by ``pattern``: whichever reads or applies first, every change counts once."""
    expected = await fill(store, 40)
    turns = Turns(pattern)
    runners = {
        who: ProjectionRunner(
            turns.store(store, who), UsageProjection(), consumer=who, batch_size=3
        )
        for who in "ab"
    }
    applied: dict[str, int] = {}
    async with anyio.create_task_group() as tg:
        for who, runner in runners.items():

            async def run(who: str = who, runner: ProjectionRunner = runner) -> None:
                applied[who] = await turns.run(runner, who)

            tg.start_soon(run)
    assert totals(await UsageProjection().report(store)) == expected
    assert applied["a"] + applied["b"] == 41  # each change applied by one of them, once
    for p in range(store.partitions):
        (group,) = await store.feed_groups(p)
        assert group.pending == 0
        assert group.last_delivered == await store.checkpoint_of(p, "usage")


async def test_a_runner_finds_what_an_earlier_consumer_left_pending(store: es.EventStore) -> None:
    """A consumer of the group (a runner of an older release, killed) holds delivered entries
    nobody acknowledged: a runner under another name counts them at once, in order."""
    for _ in range(5):
        await settle(store, "t", "small", 1)
    p = es.partition_of("t", store.partitions)
    await store.create_feed_group(p, "usage")
    assert len(await store.read_feed_group(p, "usage", "host-1:100", count=2)) == 2
    runner = ProjectionRunner(store, UsageProjection(), consumer="host-1:200", partitions=[p])
    assert await runner.run_once() == 5
    assert totals(await UsageProjection().report(store)) == {"small": (5, 5, 0)}
    (group,) = await store.feed_groups(p)
    assert (group.pending, group.last_delivered) == (0, await store.checkpoint_of(p, "usage"))
    # So trimming removes every change, all applied.
    assert await store.trim_feed(p) == 5


async def test_accepting_a_trimmed_feed_stands_for_later_runs(store: es.EventStore) -> None:
    """``accept_trimmed_feed`` moves the checkpoint past what was trimmed: a later run without
    it goes on (no new change needed), and the group no longer reads as having lost changes."""
    for i in range(8):
        await settle(store, f"t{i}", "small", 1)
    await anyio.sleep(0.01)
    assert sum([await store.trim_feed(p, max_age_ms=0) for p in range(store.partitions)]) == 8
    accepting = ProjectionRunner(store, UsageProjection(), consumer="c", accept_trimmed_feed=True)
    assert await accepting.run_once() == 0
    for p in range(store.partitions):
        info = await store.feed_info(p)
        assert await store.checkpoint_of(p, "usage") == info.trimmed_to
        (group,) = await store.feed_groups(p)
        # What `threadlog feed` flags: a group positioned before what was trimmed.
        assert parse_stream_id(group.last_delivered) >= parse_stream_id(info.trimmed_to)
    plain = ProjectionRunner(store, UsageProjection(), consumer="c")
    assert await plain.run_once() == 0
    await settle(store, "t0", "small", 1000)
    assert await plain.run_once() == 1
    assert totals(await UsageProjection().report(store)) == {"small": (1, 1000, 500)}


class Late(UsageProjection):
    name = "late"


async def test_a_runner_refused_for_a_trimmed_feed_leaves_no_group(store: es.EventStore) -> None:
    """A projection that first runs on a trimmed feed is refused before it registers a group:
    one left at the feed's start would hold trimming back for ever."""
    for _ in range(5):
        await settle(store, "t", "small", 1)
    p = es.partition_of("t", store.partitions)
    usage = ProjectionRunner(store, UsageProjection(), consumer="c", partitions=[p])
    await usage.run_once()
    assert await store.trim_feed(p) == 5
    with pytest.raises(es.FeedTrimmedError, match="projection 'late'"):
        await ProjectionRunner(store, Late(), consumer="c", partitions=[p]).run_once()
    assert [g.name for g in await store.feed_groups(p)] == ["usage"]
    for _ in range(5):
        await settle(store, "t", "small", 1)
    await usage.run_once()
    assert await store.trim_feed(p) == 5  # what usage applied, nothing held back
    # A projection that registered on an empty partition and applied nothing there when the
    # feed was trimmed past it by age: refused, and its group goes with it.
    q = (p + 1) % store.partitions
    late = ProjectionRunner(store, Late(), consumer="c", partitions=[q])
    assert await late.run_once() == 0
    assert [g.name for g in await store.feed_groups(q)] == ["late"]
    thread = next(f"u{i}" for i in range(100) if es.partition_of(f"u{i}", store.partitions) == q)
    await settle(store, thread, "small", 1)
    await anyio.sleep(0.01)
    assert await store.trim_feed(q, max_age_ms=0) == 1
    with pytest.raises(es.FeedTrimmedError, match="projection 'late'"):
        await late.run_once()
    assert await store.feed_groups(q) == []


async def test_a_dropped_group_of_a_running_projection_is_registered_again(
    store: es.EventStore,
) -> None:
    """`threadlog drop-group` while the projection runs: the runner registers it again where
    it moves the checkpoint next (or trimming would pass the projection), and counts on."""
    expected = await fill(store, 6)
    runner = ProjectionRunner(store, UsageProjection(), consumer="c")
    await runner.run_once()
    for p in range(store.partitions):
        await store.delete_feed_group(p, "usage")
    await settle(store, "thread-0", "small", 1000)
    assert await runner.run_once() == 1
    t, a, b = expected["small"]
    assert totals(await UsageProjection().report(store))["small"] == (t + 1, a + 1000, b + 500)
    p = es.partition_of("thread-0", store.partitions)
    (group,) = await store.feed_groups(p)
    assert group.last_delivered == await store.checkpoint_of(p, "usage")


@pytest.mark.parametrize(
    "bad",
    [
        {"partitions": ["0"]},
        {"partitions": [True]},
        {"partitions": [4]},
        {"partitions": [-1]},
        {"partitions": [0, 0]},
        {"partitions": "01"},
        {"partitions": 2},
        {"batch_size": True},
        {"batch_size": 2.5},
        {"batch_size": 0},
        {"poll_interval": -1},
        {"poll_interval": float("nan")},
        {"poll_interval": "1"},
        {"poll_interval": 0},
        {"poll_interval": 0.0},
        {"poll_interval": 1e-9},
        {"poll_interval": float("inf")},
        {"accept_trimmed_feed": "yes"},
        {"backfill": 1},
        {"max_outage": -1},
        {"max_outage": float("inf")},
        {"max_outage": True},
        {"max_outage": "60"},
    ],
)
async def test_a_runner_with_bad_settings_is_refused_at_once(
    store: es.EventStore, bad: dict[str, object]
) -> None:
    await settle(store, "t", "small", 1)
    with pytest.raises(es.InvalidInputError):
        ProjectionRunner(store, UsageProjection(), consumer="c", **bad)  # type: ignore[arg-type]
    assert [await store.feed_groups(p) for p in range(store.partitions)] == [[]] * 4


@pytest.mark.parametrize("stop", [None, "stop", threading.Event()], ids=repr)
async def test_run_refuses_a_stop_that_is_no_awaitable_event(
    store: es.EventStore, stop: object
) -> None:
    """A `threading.Event` would block the event loop in its ``wait()`` (for ever, as nothing
    else of the loop can set it); None raised a bare AttributeError. Both are refused, before
    anything is read or registered."""
    await settle(store, "t", "small", 1)
    runner = ProjectionRunner(store, UsageProjection(), consumer="c")
    with anyio.fail_after(5), pytest.raises(es.InvalidInputError, match="stop must be"):
        await runner.run(stop)  # type: ignore[arg-type]
    assert [await store.feed_groups(p) for p in range(store.partitions)] == [[]] * 4


class Nameless(AsyncProjection):
    def increments(
        self, entry: es.FeedEntry, events: Sequence[es.RecordedEvent]
    ) -> list[Increment]:
        return []


@pytest.mark.parametrize(
    "bad", [UsageProjection, MessagesProjection(), object(), None, Nameless()], ids=repr
)
async def test_a_runner_given_no_async_projection_is_refused_at_once(
    store: es.EventStore, bad: object
) -> None:
    """A class instead of an instance, a view projection, or one without a name: refused when
    the runner is made. Before, it failed at the first change (blamed on the change), after
    registering the projection's consumer group, which then held trimming back."""
    await settle(store, "t", "small", 1)
    with pytest.raises(es.InvalidInputError, match=r"projection|view name"):
        runner = ProjectionRunner(store, bad, consumer="c")  # type: ignore[arg-type]
        await runner.run_once()
    assert [await store.feed_groups(p) for p in range(store.partitions)] == [[]] * 4


@pytest.mark.parametrize(
    "args",
    [
        (4, 0.5, 2),
        (4, True, 2),
        (4, 0, True),
        (4, 0, 0),
        (4, 2, 2),
        (4, -1, 2),
        (0, 0, 1),
        ("4", 0, 1),
    ],
)
def test_partitions_for_refuses_what_is_not_a_runner_of_runners(args: tuple[object, ...]) -> None:
    with pytest.raises(es.InvalidInputError):
        partitions_for(*args)  # type: ignore[arg-type]


def test_partitions_for_covers_the_partitions_once() -> None:
    for runners in (1, 2, 3, 5, 8):
        owned = [partitions_for(8, i, runners) for i in range(runners)]
        assert sorted(p for part in owned for p in part) == list(range(8))


# -- backfill: a projection added later counts from the logs -------------------------------------


async def test_a_projection_added_after_trimming_backfills_from_the_logs(
    store: es.EventStore,
) -> None:
    expected = await fill(store, 12)
    await settle(store, "reborn", "old-tier", 100)
    await store.delete_thread("reborn")  # its first life is gone from the log: not counted
    await settle(store, "reborn", "small", 1)
    t, a, b = expected["small"]
    expected["small"] = (t + 1, a + 1, b + 0)
    await anyio.sleep(0.01)
    trimmed = sum([await store.trim_feed(p, max_age_ms=0) for p in range(store.partitions)])
    assert trimmed > 0  # every change so far left the feed
    with pytest.raises(es.FeedTrimmedError):
        await ProjectionRunner(store, UsageProjection(), consumer="c").run_once()
    runner = ProjectionRunner(store, UsageProjection(), consumer="c", backfill=True)
    assert await runner.run_once() == 0  # nothing left in the feed: all from the logs
    assert totals(await UsageProjection().report(store)) == expected
    # From there on it follows the feed, counting each change once.
    await settle(store, "thread-late", "large", 1000)
    assert await runner.run_once() == 1
    t, a, b = expected["large"]
    assert totals(await UsageProjection().report(store))["large"] == (t + 1, a + 1000, b + 500)
    # Backfilling again does nothing: the projection has a checkpoint.
    assert await runner.backfill() == 0
    assert await ProjectionRunner(store, UsageProjection(), consumer="d").backfill() == 0
    assert totals(await UsageProjection().report(store))["large"] == (t + 1, a + 1000, b + 500)


async def test_a_backfill_counts_what_the_feed_holds_once_with_its_runner(
    store: es.EventStore,
) -> None:
    """Untrimmed feed: the backfill counts from the logs up to the feed's end, and the
    runner skips those changes in the feed (its checkpoint is past them)."""
    expected = await fill(store, 9)
    runner = ProjectionRunner(store, UsageProjection(), consumer="c", backfill=True)
    read = await runner.backfill()
    assert read == 9 * 2 + 1  # every event, once
    assert await runner.run_once() == 0
    assert totals(await UsageProjection().report(store)) == expected


async def test_a_backfill_asks_the_thread_versions_a_batch_at_a_time(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The versions of a partition's threads are asked `BACKFILL_BATCH` at a time (one round
    trip each on Redis), not one thread at a time, and their events read a batch of first
    pages at a time; a thread longer than a page is read on from there: all counted once."""
    expected = await fill(store, 12)
    for i in range(5):
        await settle(store, "long", "large", i + 1)
    t, a, b = expected["large"]
    expected["large"] = (t + 5, a + 15, b + 6)
    monkeypatch.setattr(projections._runner, "BACKFILL_BATCH", 2)
    monkeypatch.setattr(projections._runner, "BACKFILL_FIRST_PAGE", 3)
    asked: list[int] = []
    real_versions = store.versions

    async def versions(thread_ids: Sequence[str]) -> list[int]:
        asked.append(len(thread_ids))
        return await real_versions(thread_ids)

    monkeypatch.setattr(store, "versions", versions)
    runner = ProjectionRunner(store, UsageProjection(), consumer="c", backfill=True)
    assert await runner.backfill() == 12 * 2 + 1 + 5 * 2
    threads = len(await store.threads())
    assert sum(asked) == threads and max(asked) == 2
    assert totals(await UsageProjection().report(store)) == expected


async def test_a_long_thread_deleted_while_a_backfill_reads_it_starts_the_backfill_over(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread of several read batches deleted (and written again) while the backfill reads
    it: the read refuses to go on in the new life (`ThreadReplacedError`), and the backfill
    starts over, as for a deletion it finds in the feed, rather than fail."""
    note = es.MessageAppended(message=es.Message(role="user", content="x"))
    for _ in range(5):
        await store.append("long", [note] * 500)
    await settle(store, "long", "small", 1)
    real_read_batches = store.read_batches
    replaced = False

    async def read_batches(
        thread_id: str, *, start: int = 1, stop: int | None = None
    ) -> AsyncIterator[list[es.RecordedEvent]]:
        nonlocal replaced
        async for batch in real_read_batches(thread_id, start=start, stop=stop):
            yield batch
            if thread_id == "long" and not replaced:
                replaced = True
                await store.delete_thread("long")
                await settle(store, "long", "medium", 7)

    monkeypatch.setattr(store, "read_batches", read_batches)
    runner = ProjectionRunner(store, UsageProjection(), consumer="c", backfill=True)
    assert await runner.backfill() == 2
    assert replaced
    assert totals(await UsageProjection().report(store)) == {"medium": (1, 7, 3)}


async def test_a_backfill_ends_while_writers_keep_pace_with_its_reads(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each page of the feed the backfill reads, writers add as many changes: it reads up to
    the feed's end as it was when it started reading, not for as long as they write, and
    every change is counted once (the later ones by the runner, from the feed)."""
    expected = await fill(store, 6)
    monkeypatch.setattr(projections._runner, "FEED_PAGE", 2)
    real_read_feed = store.read_feed
    written = 0

    async def read_feed_while_writing(
        partition: int, *, after: str = "0-0", count: int = 512
    ) -> list[es.FeedEntry]:
        nonlocal written
        page = await real_read_feed(partition, after=after, count=count)
        if written < 400:
            for _ in range(2):  # a page's worth, in the partition being read
                await settle(store, thread_in(store, partition, f"w{written}-"), "small", 1)
                written += 1
        return page

    monkeypatch.setattr(store, "read_feed", read_feed_while_writing)
    runner = ProjectionRunner(store, UsageProjection(), consumer="c", backfill=True)
    with anyio.fail_after(60):
        await runner.run_once()
    monkeypatch.undo()
    assert written < 400, "the backfill read for as long as the writers wrote"
    await runner.run_once()
    t, a, b = expected["small"]
    expected["small"] = (t + written, a + written, b)
    assert totals(await UsageProjection().report(store)) == expected


async def test_writes_landing_during_a_backfill_are_counted_once(store: es.EventStore) -> None:
    """Appends and a deletion (with the thread created again) land after the backfill read
    the feed's end and the thread versions: the appends are counted once (by the runner,
    from the feed), and the deletion makes the backfill start over, so the events it read of
    the thread's next life are not counted twice."""
    expected = await fill(store, 6)  # thread-0 .. thread-5, one turn each
    landed = False

    class Busy(ProjectionRunner):
        async def _feed_after(self, partition: int, position: str, end: str) -> list[es.FeedEntry]:
            nonlocal landed
            tail = await super()._feed_after(partition, position, end)
            if not landed and partition == es.partition_of("thread-1", store.partitions):
                landed = True
                await settle(store, "thread-1", "small", 5)  # a thread being read
                await store.delete_thread("thread-1")
                await settle(store, "thread-1", "medium", 7)  # its next life
                await settle(store, "thread-1", "medium", 9)
            return tail

    runner = Busy(store, UsageProjection(), consumer="c", backfill=True)
    await runner.run_once()
    assert landed
    # thread-1's first life ("large", tokens 20) was deleted before anything counted it, as a
    # runner reading the feed late would find it gone; its next life counts once.
    t, a, b = expected["large"]
    expected["large"] = (t - 1, a - 20, b - 10)
    t, a, b = expected["medium"]
    expected["medium"] = (t + 2, a + 16, b + 3 + 4)
    assert totals(await UsageProjection().report(store)) == expected
    assert await runner.run_once() == 0
    assert totals(await UsageProjection().report(store)) == expected


# -- a runner lagging behind another runner of its projection ------------------------------------


async def test_a_runner_whose_peer_applied_and_trimmed_meanwhile_reads_on(
    store: es.EventStore,
) -> None:
    """Runner b read the checkpoint; meanwhile runner a applied every change and the feed was
    trimmed to what a applied. Nothing was lost: b reads on from the checkpoint as it stands
    (not FeedTrimmedError for its stale position), and the group stays registered."""
    expected = await fill(store, 8)
    a = ProjectionRunner(store, UsageProjection(), consumer="a")
    await a.run_once()
    await settle(store, "thread-0", "small", 1000)
    p = es.partition_of("thread-0", store.partitions)
    raced = False

    class Lagging(ProjectionRunner):
        async def _past_trimmed(self, partition: int, checkpoint: str, *, held: bool) -> bool:
            nonlocal raced
            if not raced:
                raced = True
                assert await a.run_once() == 1
                assert await store.trim_feed(partition) > 0
            return await super()._past_trimmed(partition, checkpoint, held=held)

    b = Lagging(store, UsageProjection(), consumer="b", partitions=[p])
    assert await b.run_once() == 0
    assert raced
    t, x, y = expected["small"]
    assert totals(await UsageProjection().report(store))["small"] == (t + 1, x + 1000, y + 500)
    (group,) = await store.feed_groups(p)
    assert group.last_delivered == await store.checkpoint_of(p, "usage")


class Poisoned(UsageProjection):
    """Raises for every change of one thread (a projection bug, an event it cannot take)."""

    def increments(
        self, entry: es.FeedEntry, events: Sequence[es.RecordedEvent]
    ) -> list[Increment]:
        if entry.thread_id == "poison":
            raise ValueError("cannot take this one")
        return super().increments(entry, events)


async def test_a_change_the_projection_raises_for_stops_the_runner_there(
    store: es.EventStore,
) -> None:
    """Never skipped: the runner applies the batch's changes before it, then raises the
    projection's error with a note naming the change, and a restart stops there again."""
    p = es.partition_of("poison", store.partitions)
    other = next(f"t{i}" for i in range(100) if es.partition_of(f"t{i}", store.partitions) == p)
    for _ in range(3):
        await settle(store, other, "small", 1)
    await settle(store, "poison", "small", 100)
    await settle(store, other, "small", 1)
    feed = await store.read_feed(p, count=10)
    runner = ProjectionRunner(store, Poisoned(), consumer="c", partitions=[p], batch_size=10)
    for _ in range(2):
        with pytest.raises(ValueError, match="cannot take this one") as caught:
            await runner.run_once()
        assert any(
            f"change {feed[3].id} of partition {p} (thread 'poison', events #1..2)" in note
            for note in caught.value.__notes__
        )
        assert await store.checkpoint_of(p, "usage") == feed[2].id
        assert totals(await UsageProjection().report(store)) == {"small": (3, 3, 0)}
    (group,) = await store.feed_groups(p)
    assert group.last_delivered == feed[2].id  # trimming keeps the change it stopped at


async def test_a_partition_that_fails_stops_alone_and_its_error_is_still_raised(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poison change stops its partition there; `run` goes on with the others (changes
    made after the failure too), lists the error in `failed` and raises it once stopped, and
    `run_once` raises it after working the others; before, the first partition's error
    stopped them all. Every partition stopped: raised at once. The store answering with an
    error (not an outage) still stops every partition at once."""
    p = es.partition_of("poison", store.partitions)
    q = (p + 1) % store.partitions
    other = thread_in(store, q, "q")
    await settle(store, "poison", "small", 100)
    await settle(store, other, "small", 1)
    (poison,) = await store.read_feed(p)
    runner = ProjectionRunner(
        store, Poisoned(), consumer="c", partitions=[p, q], poll_interval=0.01
    )
    stop = anyio.Event()
    outcome: dict[str, object] = {}

    async def run() -> None:
        try:
            outcome["applied"] = await runner.run(stop)
        except ValueError as exc:
            outcome["error"] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        with anyio.fail_after(10):
            while not runner.failed:
                await anyio.sleep(0.01)
            await settle(store, other, "small", 2)  # after the failure: applied all the same
            while totals(await UsageProjection().report(store)) != {"small": (2, 3, 1)}:
                await anyio.sleep(0.01)
        assert outcome == {}  # still running
        stop.set()
    error = outcome["error"]
    assert isinstance(error, ValueError) and runner.failed == {p: error}
    notes = " ".join(error.__notes__)
    assert f"change {poison.id} of partition {p} (thread 'poison'" in notes
    assert f"partition {p} (ValueError)" in notes
    assert await store.checkpoint_of(p, "usage") == "0-0"  # stays at the change
    assert [g.last_delivered for g in await store.feed_groups(p)] == ["0-0"]

    await settle(store, other, "small", 4)
    with pytest.raises(ValueError, match="cannot take this one"):
        await runner.run_once()
    assert totals(await UsageProjection().report(store)) == {"small": (3, 7, 3)}
    alone = ProjectionRunner(store, Poisoned(), consumer="c", partitions=[p])
    with anyio.fail_after(5), pytest.raises(ValueError, match="cannot take this one"):
        await alone.run(anyio.Event())

    async def denied(entry: es.FeedEntry) -> list[es.RecordedEvent]:
        raise es.OperationalError("redis denied the command (ACL)")

    monkeypatch.setattr(store, "read_change", denied)
    renamed = ProjectionRunner(store, Renamed(), consumer="c", partitions=[p, q])
    with anyio.fail_after(5), pytest.raises(es.OperationalError, match="denied"):
        await renamed.run(anyio.Event())
    assert await store.checkpoint_of(q, "usage-v2") == "0-0"  # never reached


class Overflowing(UsageProjection):
    """Counts each change in "changes", and adds ``amount`` to a "big" field."""

    def __init__(self, amount: object) -> None:
        self.amount = amount

    def increments(
        self, entry: es.FeedEntry, events: Sequence[es.RecordedEvent]
    ) -> list[Increment]:
        return [("turns", "changes", 1), ("turns", "big", self.amount)]  # type: ignore[list-item]


@pytest.mark.parametrize("amount", [2**63, -(2**63), 2.5, True, "1"])
async def test_an_increment_that_is_no_64_bit_int_writes_nothing(
    store: es.EventStore, amount: object
) -> None:
    """Refused before anything is written (Redis would have applied the increments before it
    and not the checkpoint, so each retry counted them again; a float was truncated)."""
    await settle(store, "t", "small", 1)
    p = es.partition_of("t", store.partitions)
    runner = ProjectionRunner(store, Overflowing(amount), consumer="c", partitions=[p])
    (change,) = await store.read_feed(p)
    for _ in range(2):
        with pytest.raises(es.InvalidInputError, match="increment") as caught:
            await runner.run_once()
        # The change it came from is named: the runner stops there.
        assert any(f"change {change.id} of partition {p}" in n for n in caught.value.__notes__)
        assert await store.read_aux(p, "usage", "turns") == {}
        assert await store.checkpoint_of(p, "usage") == "0-0"


async def test_an_increment_that_would_overflow_its_field_writes_nothing(
    store: es.EventStore,
) -> None:
    """HINCRBY refuses to overflow a 64-bit field after the script wrote the batch's earlier
    increments: the batch is refused whole, the checkpoint stays, a retry counts nothing twice."""
    await settle(store, "t", "small", 1)
    p = es.partition_of("t", store.partitions)
    await ProjectionRunner(store, Overflowing(2**63 - 1), consumer="c", partitions=[p]).run_once()
    assert await store.read_aux(p, "usage", "turns") == {"changes": 1, "big": 2**63 - 1}
    checkpoint = await store.checkpoint_of(p, "usage")
    await settle(store, "t", "small", 1)
    runner = ProjectionRunner(store, Overflowing(1), consumer="c", partitions=[p])
    for _ in range(2):
        with pytest.raises(es.InvalidInputError, match="overflow"):
            await runner.run_once()
        assert await store.read_aux(p, "usage", "turns") == {"changes": 1, "big": 2**63 - 1}
        assert await store.checkpoint_of(p, "usage") == checkpoint


async def test_a_projection_field_holding_no_integer_refuses_the_batch_whole(
    redis_url: str,
) -> None:
    """A field changed from outside threadlog to hold no integer: HINCRBY refuses it after the
    batch's earlier increments; they are undone (a field the batch created goes again)."""
    async with await es.connect(redis_url, namespace="c" + uuid.uuid4().hex[:12]) as store:
        assert isinstance(store, es.RedisEventStore)
        await settle(store, "t", "small", 1)
        p = es.partition_of("t", store.partitions)
        key = store.keys.aux(p, "usage", "turns")
        await store.client.hset(key, "big", "not a number")
        runner = ProjectionRunner(store, Overflowing(5), consumer="c", partitions=[p])
        with pytest.raises(es.CorruptKeyError, match="'big'"):
            await runner.run_once()
        assert await store.client.hgetall(key) == {b"big": b"not a number"}
        assert await store.checkpoint_of(p, "usage") == "0-0"
        await store.client.hset(key, "big", "7")
        assert await runner.run_once() == 1
        assert await store.read_aux(p, "usage", "turns") == {"changes": 1, "big": 12}


async def test_every_loss_an_accepting_runner_goes_on_past_is_logged(
    store: es.EventStore, caplog: pytest.LogCaptureFixture
) -> None:
    """``accept_trimmed_feed``: the feed trimmed by age past a running projection a second
    time loses other changes, and that is said too (not only the first time)."""
    p = es.partition_of("t", store.partitions)
    runner = ProjectionRunner(
        store, UsageProjection(), consumer="c", partitions=[p], accept_trimmed_feed=True
    )
    for round_ in range(2):
        await settle(store, "t", "small", 1)
        await anyio.sleep(0.01)
        assert await store.trim_feed(p, max_age_ms=0) >= 1
        caplog.clear()
        with caplog.at_level("WARNING", logger="threadlog.runner"):
            assert await runner.run_once() == 0
        trimmed_to = (await store.feed_info(p)).trimmed_to
        assert [r for r in caplog.records if trimmed_to in r.getMessage()], round_
    assert totals(await UsageProjection().report(store)) == {}


# -- a feed or group lost from under the runner, busy loops -------------------------------------


async def delete_feed(store: es.EventStore, partition: int) -> None:
    """What ``DEL`` of the feed key does (an operator's cleanup, a bad migration): the feed,
    its groups and its trim record go; the next append starts a new one."""
    if isinstance(store, es.RedisEventStore):
        assert await store.client.delete(store.keys.feed(partition)) == 1
    else:
        assert isinstance(store, es.MemoryEventStore)
        del store._ns.feeds[partition]


def thread_in(store: es.EventStore, partition: int, prefix: str) -> str:
    return next(
        f"{prefix}{i}"
        for i in range(1000)
        if es.partition_of(f"{prefix}{i}", store.partitions) == partition
    )


async def test_a_feed_deleted_under_the_runner_stops_it_rather_than_skip_its_changes(
    store: es.EventStore,
) -> None:
    """The changes the feed held past the checkpoint went with it, leaving no trim record: a
    runner reading on from its checkpoint would count the new feed's changes and never the
    lost ones. It stops with `FeedResetError` naming the projection, each time, and leaves
    no group on the new feed."""
    p = es.partition_of("thread-0", store.partitions)
    runner = ProjectionRunner(store, UsageProjection(), consumer="c", partitions=[p])
    await settle(store, "thread-0", "small", 1)
    assert await runner.run_once() == 1
    checkpoint = await store.checkpoint_of(p, "usage")
    await settle(store, "thread-0", "small", 10)  # never applied: lost with the feed
    await delete_feed(store, p)
    for fresh in (False, True):
        # Both the runner that saw the group, and one started afterwards.
        who = ProjectionRunner(store, UsageProjection(), consumer="c", partitions=[p])
        with pytest.raises(es.FeedResetError, match="projection 'usage'") as caught:
            await (who if fresh else runner).run_once()
        assert (caught.value.partition, caught.value.position) == (p, checkpoint)
    if isinstance(store, es.RedisEventStore):
        # A new feed whose ids start below the checkpoint (a server clock set back, a feed
        # restored from elsewhere): its first entry is no older change, and not the one there.
        ms = parse_stream_id(checkpoint)[0]
        fields = {"t": "elsewhere", "f": 1, "l": 1}
        await store.client.xadd(store.keys.feed(p), fields, id=f"{ms - 5}-0")
        with pytest.raises(es.FeedResetError, match=f"partition {p}"):
            await runner.run_once()
        await delete_feed(store, p)
    await anyio.sleep(0.01)  # a new feed whose first id is the checkpoint's cannot be told
    await settle(store, thread_in(store, p, "new"), "small", 100)  # a new feed, ids past it
    with pytest.raises(es.FeedResetError, match=f"partition {p}"):
        await runner.run_once()
    assert totals(await UsageProjection().report(store)) == {"small": (1, 1, 0)}
    assert await store.checkpoint_of(p, "usage") == checkpoint
    assert await store.feed_groups(p) == []


async def test_a_feed_trimmed_to_nothing_is_not_taken_for_a_deleted_one(
    store: es.EventStore,
) -> None:
    """The reset check asks only the trim record: a feed trimmed (by the group or by age) to
    no entry at all still records that the checkpoint's change was trimmed."""
    p = es.partition_of("t", store.partitions)
    runner = ProjectionRunner(store, UsageProjection(), consumer="c", partitions=[p])
    await settle(store, "t", "small", 1)
    assert await runner.run_once() == 1
    assert await store.trim_feed(p) == 1
    assert (await store.feed_info(p)).length == 0
    assert await runner.run_once() == 0
    await settle(store, "t", "small", 2)
    assert await runner.run_once() == 1
    assert totals(await UsageProjection().report(store)) == {"small": (2, 3, 1)}


async def test_a_group_dropped_while_the_runner_idles_is_registered_again_at_once(
    store: es.EventStore, caplog: pytest.LogCaptureFixture
) -> None:
    """`XGROUP DESTROY` (`threadlog drop-group`) of a running projection's group while its feed
    is idle: the runner's next idle pass registers it again at the checkpoint and says so,
    so trimming after another reader (an export's group) cannot pass the changes that come
    next before the projection applied them."""
    p = es.partition_of("t", store.partitions)
    runner = ProjectionRunner(store, UsageProjection(), consumer="c", partitions=[p])
    await settle(store, "t", "small", 1)
    assert await runner.run_once() == 1
    checkpoint = await store.checkpoint_of(p, "usage")
    assert await store.delete_feed_group(p, "usage")
    with caplog.at_level("WARNING", logger="threadlog.runner"):
        assert await runner.run_once() == 0  # idle: nothing new
    assert [(g.name, g.last_delivered) for g in await store.feed_groups(p)] == [
        ("usage", checkpoint)
    ]
    assert any("'usage'" in r.getMessage() and "again" in r.getMessage() for r in caplog.records)
    # Another reader that is ahead: trimming after it stops at the projection's group.
    await settle(store, "t", "small", 2)
    await store.create_feed_group(p, "export-x", start=(await store.feed_info(p)).last_id)
    await store.trim_feed(p)
    assert await runner.run_once() == 1
    assert totals(await UsageProjection().report(store)) == {"small": (2, 3, 1)}


async def test_a_runner_idling_with_the_shortest_poll_interval_does_not_spin(
    store: es.EventStore,
) -> None:
    """An idle runner reads its feed once per ``poll_interval``, not in a loop: with the
    shortest interval it takes (1 ms), some hundreds of passes a second, not thousands."""
    passes = 0

    class Counting(ProjectionRunner):
        async def _read(self, partition: int, checkpoint: str) -> tuple[bool, list[es.FeedEntry]]:
            nonlocal passes
            passes += 1
            return await super()._read(partition, checkpoint)

    runner = Counting(store, UsageProjection(), consumer="c", partitions=[0], poll_interval=0.001)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run, stop)
        await anyio.sleep(0.3)
        stop.set()
    assert 0 < passes <= 300


async def test_a_partition_whose_feed_never_runs_dry_does_not_starve_the_others(
    store: es.EventStore,
) -> None:
    """`run` takes the partitions in turns of a few batches: one whose feed keeps filling as
    fast as the runner reads it (a busy tenant) no longer keeps the others waiting for ever."""
    hot = es.partition_of("hot", store.partitions)
    cold_thread = thread_in(store, (hot + 1) % store.partitions, "cold")
    cold = es.partition_of(cold_thread, store.partitions)
    await settle(store, cold_thread, "cold", 1)

    class Flooded(ProjectionRunner):
        async def _read(self, partition: int, checkpoint: str) -> tuple[bool, list[es.FeedEntry]]:
            if partition == hot:  # a new change in the hot partition before every read
                await settle(self.store, "hot", "hot", 1)
            return await super()._read(partition, checkpoint)

    runner = Flooded(store, UsageProjection(), consumer="c", partitions=[hot, cold], batch_size=1)
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run, stop)
        with anyio.fail_after(10):
            while await store.checkpoint_of(cold, "usage") == "0-0":
                await anyio.sleep(0.01)
        stop.set()
    assert totals(await UsageProjection().report(store))["cold"] == (1, 1, 0)


async def test_a_trim_never_passes_a_group_registered_while_it_trims(
    store: es.EventStore,
) -> None:
    """`trim_feed` takes the groups as they stand when it trims, in the same atomic step: a
    group registered meanwhile (a runner registering its dropped group again, a new
    projection) keeps what it needs. Taken from an earlier look at the groups, the trim
    removed it, and the runner then stopped with `FeedTrimmedError`."""
    p = es.partition_of("t", store.partitions)
    runner = ProjectionRunner(store, UsageProjection(), consumer="c", partitions=[p])
    await settle(store, "t", "small", 1)
    assert await runner.run_once() == 1
    checkpoint = await store.checkpoint_of(p, "usage")
    assert await store.delete_feed_group(p, "usage")
    await settle(store, "t", "small", 2)  # not applied yet
    await store.create_feed_group(p, "export-x", start=(await store.feed_info(p)).last_id)
    # What a trim that looked at the groups a moment ago saw; the runner's idle pass then
    # registered the group again, before the trim removed anything.
    looked = store.feed_groups
    stale = await looked(p)
    assert await store.create_feed_group(p, "usage", start=checkpoint)

    async def earlier(partition: int) -> list[es.GroupInfo]:
        return stale

    store.feed_groups = earlier  # type: ignore[method-assign]
    try:
        await store.trim_feed(p)
    finally:
        store.feed_groups = looked  # type: ignore[method-assign]
    assert await runner.run_once() == 1
    assert totals(await UsageProjection().report(store)) == {"small": (2, 3, 1)}


async def test_a_group_dropped_while_the_store_lists_or_moves_it_is_no_store_failure(
    store: es.EventStore,
) -> None:
    """`drop-group` landing between the commands of `feed_groups` (the group listed, then its
    pending entries asked) or of `advance_feed_group` (the group moved, then its pending
    entries acknowledged): the listing leaves the group out, the move says the group is not
    there (`FeedGroupNotFoundError`, which the runner answers by registering it again), not
    an `OperationalError` as for a failing server."""
    if not isinstance(store, es.RedisEventStore):
        pytest.skip("one step on the memory backend: nothing lands in between")
    p = es.partition_of("t", store.partitions)
    runner = ProjectionRunner(store, UsageProjection(), consumer="c", partitions=[p])
    await settle(store, "t", "small", 1)
    assert await runner.run_once() == 1
    await store.create_feed_group(p, "other")
    client = store.client
    asked = client.xpending

    async def dropped_first(key: str, group: str | bytes) -> object:
        # feed_groups asks by the name's own bytes (a name need not be UTF-8).
        name = group.decode() if isinstance(group, bytes) else group
        await store.delete_feed_group(p, name)
        return await asked(key, group)

    client.xpending = dropped_first
    try:
        assert await store.feed_groups(p) == []
    finally:
        del client.xpending
    await store.create_feed_group(p, "usage", start=await store.checkpoint_of(p, "usage"))
    ranged = client.xpending_range

    async def dropped_before_range(key: str, group: str, *args: object) -> object:
        await store.delete_feed_group(p, group)
        return await ranged(key, group, *args)

    client.xpending_range = dropped_before_range
    try:
        with pytest.raises(es.FeedGroupNotFoundError, match="'usage'"):
            await store.advance_feed_group(p, "usage", await store.checkpoint_of(p, "usage"))
    finally:
        del client.xpending_range


# -- stale groups: listing them with their lag, dropping them -----------------------------------


class Renamed(UsageProjection):
    name = "usage-v2"


async def test_a_renamed_projections_old_group_is_listed_with_its_lag_and_dropped(
    store: es.EventStore,
) -> None:
    """A projection started under a new name leaves its old group on the feeds, where it holds
    trimming back for ever. `feed_group_lag` lists every group of the namespace with how far
    behind it is, and `drop_feed_group` removes the stale one: trimming goes on."""
    expected = await fill(store, 6)
    await ProjectionRunner(store, UsageProjection(), consumer="c").run_once()
    renamed = ProjectionRunner(store, Renamed(), consumer="c", backfill=True)
    await renamed.run_once()
    await settle(store, "thread-0", "small", 1000)
    await settle(store, "thread-1", "large", 1000)
    assert await renamed.run_once() == 2
    assert totals(await Renamed().report(store))["small"][0] == expected["small"][0] + 1
    # The old group holds the two new changes back.
    await anyio.sleep(0.01)
    assert sum([await store.trim_feed(p) for p in range(store.partitions)]) == 7
    assert sum([(await store.feed_info(p)).length for p in range(store.partitions)]) == 2

    lag = await feed_group_lag(store)
    assert all(isinstance(row, GroupLag) for row in lag)
    assert [(r.name, r.partition) for r in lag] == sorted((r.name, r.partition) for r in lag)
    old = {r.partition: r for r in lag if r.name == "usage"}
    new = {r.partition: r for r in lag if r.name == "usage-v2"}
    assert set(old) == set(new) == set(range(store.partitions))
    assert sum(r.unread for r in old.values()) == 2
    assert all(r.unread == 0 and r.oldest_unread is None for r in new.values())
    for p, row in old.items():
        feed = await store.read_feed(p)
        assert row.oldest_unread == (feed[0].id if feed else None)
        assert row.position == await store.checkpoint_of(p, "usage")
        assert (row.pending, row.lost_changes) == (0, False)

    assert await drop_feed_group(store, "usage") == list(range(store.partitions))
    assert await drop_feed_group(store, "usage") == []
    assert {r.name for r in await feed_group_lag(store)} == {"usage-v2"}
    assert sum([await store.trim_feed(p) for p in range(store.partitions)]) == 2
    # Any name a group may have is looked for (another tool may have made it); none is no name.
    assert await drop_feed_group(store, "no such group") == []
    for nothing in ("", None, b"usage"):
        with pytest.raises(es.InvalidInputError):
            await drop_feed_group(store, nothing)  # type: ignore[arg-type]


async def test_group_lag_counts_a_backlog_longer_than_a_page_and_flags_lost_changes(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lag is counted over the whole backlog, and a group whose position the feed was
    trimmed past (by age) is flagged, as `threadlog feed` flags it."""
    p = es.partition_of("t", store.partitions)
    await store.create_feed_group(p, "reader")
    await store.create_feed_group(p, "ahead")
    for _ in range(3):
        await store.append("t", [es.MessageAppended(message=es.Message(role="user", content="x"))])
    feed = await store.read_feed(p)
    await store.advance_feed_group(p, "ahead", feed[0].id)
    monkeypatch.setattr(projections._runner, "FEED_PAGE", 2)
    rows = {r.name: r for r in await feed_group_lag(store)}
    assert (rows["reader"].unread, rows["reader"].oldest_unread) == (3, feed[0].id)
    assert (rows["ahead"].unread, rows["ahead"].oldest_unread) == (2, feed[1].id)
    assert rows["ahead"].position == feed[0].id
    await anyio.sleep(0.01)
    assert await store.trim_feed(p, max_age_ms=0) == 3
    rows = {r.name: r for r in await feed_group_lag(store)}
    assert rows["reader"].lost_changes and rows["ahead"].lost_changes
    assert rows["reader"].unread == 0


async def test_group_lag_flags_pending_entries_trimmed_before_their_ack(
    store: es.EventStore,
) -> None:
    """A consumer read entries and crashed before acknowledging them; an age limit trimmed
    them. The group's position is past them, yet changes were lost: flagged, as `threadlog
    feed` flags a position trimmed past."""
    p = es.partition_of("t", store.partitions)
    await store.create_feed_group(p, "consumers")
    for _ in range(2):
        await store.append("t", [es.MessageAppended(message=es.Message(role="user", content="x"))])
    delivered = await store.read_feed_group(p, "consumers", "c1")
    (row,) = [r for r in await feed_group_lag(store) if r.name == "consumers"]
    assert (row.pending, row.lost_changes) == (2, False)
    await anyio.sleep(0.01)
    assert await store.trim_feed(p, max_age_ms=0) == 2
    (row,) = [r for r in await feed_group_lag(store) if r.name == "consumers"]
    assert (row.pending, row.unread, row.lost_changes) == (2, 0, True)
    await store.ack_feed(p, "consumers", [e.id for e in delivered])
    (row,) = [r for r in await feed_group_lag(store) if r.name == "consumers"]
    assert (row.pending, row.lost_changes) == (0, False)


async def test_a_projection_whose_feed_was_deleted_is_listed_without_a_group(
    store: es.EventStore,
) -> None:
    """The feed deleted under a projection took its group along, while its checkpoint stays
    and its runner stops with `FeedResetError`: `feed_group_lag` lists it (no group, feed
    reset) rather than leave it out. A group dropped on purpose from an intact feed is not."""
    p = es.partition_of("t", store.partitions)
    q = (p + 1) % store.partitions
    await settle(store, "t", "small", 1)
    await settle(store, thread_in(store, q, "q"), "small", 1)
    for projection in (UsageProjection(), Renamed()):
        await ProjectionRunner(store, projection, consumer="c", partitions=[p, q]).run_once()
    checkpoint = await store.checkpoint_of(p, "usage")
    assert await store.checkpoints(p) == {"usage": checkpoint, "usage-v2": checkpoint}
    assert await drop_feed_group(store, "usage-v2") == sorted([p, q])  # retired on purpose
    await delete_feed(store, p)
    await anyio.sleep(0.01)
    for _ in range(2):  # an empty feed, then a new one past the checkpoint
        rows = {(r.name, r.partition): r for r in await feed_group_lag(store)}
        # The retired one is listed where the feed was deleted: a checkpoint alone cannot
        # tell a retired projection from a running one, and its figures lack changes too.
        assert set(rows) == {("usage", p), ("usage", q), ("usage-v2", p)}
        assert (rows["usage-v2", p].registered, rows["usage-v2", p].feed_reset) == (False, True)
        lost = rows["usage", p]
        assert (lost.registered, lost.feed_reset, lost.position) == (False, True, checkpoint)
        assert (lost.last_delivered, lost.pending, lost.lost_changes) == ("0-0", 0, False)
        assert lost.unread == (await store.feed_info(p)).length
        assert (rows["usage", q].registered, rows["usage", q].feed_reset) == (True, False)
        await settle(store, thread_in(store, p, "new"), "small", 5)
    with pytest.raises(es.FeedResetError):
        await ProjectionRunner(store, UsageProjection(), consumer="c", partitions=[p]).run_once()
    # A group registered again on the new feed (by hand, or an older release's runner): the
    # row is the group's, still said to be on a reset feed.
    await store.create_feed_group(p, "usage")
    (row,) = [r for r in await feed_group_lag(store) if (r.name, r.partition) == ("usage", p)]
    assert (row.registered, row.feed_reset, row.position) == (True, True, checkpoint)
    # Trimmed past the checkpoint is not a reset: the feed records it (lost changes instead).
    await delete_feed(store, p)
    await settle(store, thread_in(store, p, "new"), "small", 5)
    await store.create_feed_group(p, "usage", start=checkpoint)
    await anyio.sleep(0.01)
    assert await store.trim_feed(p, max_age_ms=0) == 1
    (row,) = [r for r in await feed_group_lag(store) if (r.name, r.partition) == ("usage", p)]
    assert (row.registered, row.feed_reset, row.lost_changes) == (True, False, True)


async def test_a_forgotten_projection_leaves_no_group_checkpoint_or_figures(
    store: es.EventStore,
) -> None:
    """`forget_projection` removes a retired projection whole: its groups (trimming goes on),
    its checkpoints (a feed deleted later does not list it as a reader that lost its feed)
    and its figures; another projection keeps all of its own, and the name counts from
    scratch if it is used again."""
    expected = await fill(store, 9)
    await ProjectionRunner(store, UsageProjection(), consumer="c").run_once()
    await ProjectionRunner(store, Renamed(), consumer="c").run_once()
    with_changes = sorted({es.partition_of(f"thread-{i}", store.partitions) for i in range(7)})
    with_changes = sorted({*with_changes, es.partition_of("chatter", store.partitions)})
    before = {p: await store.checkpoint_of(p, "usage") for p in with_changes}

    forgotten = await forget_projection(store, "usage")
    assert isinstance(forgotten, ForgottenProjection) and forgotten.found
    assert forgotten.name == "usage"
    assert forgotten.groups == list(range(store.partitions))  # registered on every partition
    assert forgotten.checkpoints == before
    metrics = ["input_tokens", "output_tokens", "turns"]
    counted = sorted({es.partition_of(f"thread-{i}", store.partitions) for i in range(7)})
    assert forgotten.hashes == dict.fromkeys(counted, metrics)
    assert await UsageProjection().report(store) == []
    assert totals(await Renamed().report(store)) == expected  # the other one: untouched
    for p in range(store.partitions):
        assert "usage" not in await store.checkpoints(p)
        assert "usage" not in {g.name for g in await store.feed_groups(p)}
    assert {r.name for r in await feed_group_lag(store)} == {"usage-v2"}
    # Nothing left: found is False, and no error.
    again = await forget_projection(store, "usage")
    assert not again.found and (again.groups, again.checkpoints, again.hashes) == ([], {}, {})
    # The name used again counts from scratch (backfill: what the logs hold).
    await ProjectionRunner(store, UsageProjection(), consumer="c", backfill=True).run_once()
    assert totals(await UsageProjection().report(store)) == expected
    assert (await forget_projection(store, "usage")).hashes == forgotten.hashes
    # A feed deleted afterwards: the forgotten projection is not listed as having lost it
    # (a checkpoint alone would be: `feed_group_lag` cannot tell it from a running one).
    await delete_feed(store, with_changes[0])
    assert {r.name for r in await feed_group_lag(store)} == {"usage-v2"}
    await ProjectionRunner(store, UsageProjection(), consumer="c").run_once()
    kept = await UsageProjection().report(store)
    checkpoints = {p: await store.checkpoint_of(p, "usage") for p in range(store.partitions)}
    assert kept and set(checkpoints.values()) != {"0-0"}
    for bad in ("", "bad name", None):
        with pytest.raises(es.InvalidInputError):
            await forget_projection(store, bad)  # type: ignore[arg-type]
    with pytest.raises(es.InvalidInputError):
        await forget_projection(store, "usage", hashes="turns")
    assert await UsageProjection().report(store) == kept  # the refused calls: untouched
    assert {p: await store.checkpoint_of(p, "usage") for p in checkpoints} == checkpoints


def test_threadlog_feed_shows_a_renamed_projections_group_and_drop_group_removes_it(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same from the command line (`adapters.cli.main`): `threadlog feed` gives each
    group's unread entries, and `threadlog drop-group` removes the stale one."""
    from adapters.cli import main

    namespace = "r" + uuid.uuid4().hex[:12]
    where = ["--url", redis_url, "--namespace", namespace]

    async def setup() -> None:
        async with await es.connect(redis_url, namespace=namespace, partitions=4) as store:
            await fill(store, 3)
            await ProjectionRunner(store, UsageProjection(), consumer="c").run_once()
            await ProjectionRunner(store, Renamed(), consumer="c", backfill=True).run_once()
            await settle(store, "thread-0", "small", 5)
            await ProjectionRunner(store, Renamed(), consumer="c").run_once()

    anyio.run(setup)

    def unread() -> dict[str, int]:
        capsys.readouterr()
        assert main(["feed", "--json", *where]) == 0
        out: dict[str, int] = {}
        for g in json.loads(capsys.readouterr().out)["groups"]:
            out[g["name"]] = out.get(g["name"], 0) + g["unread"]
        return out

    assert unread() == {"usage": 1, "usage-v2": 0}
    assert main(["feed", *where]) == 0
    table = capsys.readouterr().out
    assert "unread" in table
    assert main(["drop-group", "usage", *where]) == 0
    assert "Dropped consumer group 'usage' from 4 partitions" in capsys.readouterr().out
    assert unread() == {"usage-v2": 0}


def test_threadlog_feed_flags_a_projection_whose_feed_was_deleted(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`threadlog feed` lists the projection that lost its group with its feed, and says so."""
    from adapters.cli import main

    namespace = "r" + uuid.uuid4().hex[:12]
    where = ["--url", redis_url, "--namespace", namespace]

    async def setup() -> None:
        async with await es.connect(redis_url, namespace=namespace, partitions=4) as store:
            await settle(store, "t", "small", 1)
            await ProjectionRunner(store, UsageProjection(), consumer="c").run_once()
            await delete_feed(store, es.partition_of("t", 4))

    anyio.run(setup)
    capsys.readouterr()
    assert main(["feed", "--json", *where]) == 0
    groups = json.loads(capsys.readouterr().out)["groups"]
    reset = [(g["partition"], g["registered"]) for g in groups if g["feed_reset"]]
    assert reset == [(es.partition_of("t", 4), False)]
    assert main(["feed", *where]) == 0
    assert "feed reset under it" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_run_waits_out_a_store_restart_and_counts_every_change_once() -> None:
    """A server stopped for longer than the client's retries (a restart, a failover) and
    started again: `run` waits it out and reads on from its checkpoint; with max_outage=0 the
    same outage stops it with the store's error, as before."""
    with redis_server(extra_args=["--appendonly", "yes", "--appendfsync", "always"]) as server:
        store = await es.connect(server.url, namespace="outage", partitions=4)
        try:
            usage = UsageProjection()
            runner = ProjectionRunner(store, usage, consumer="c", poll_interval=0.01)
            expected = await fill(store, 12)
            stop = anyio.Event()
            outcome: dict[str, object] = {}

            async def run() -> None:
                outcome["applied"] = await runner.run(stop)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                with anyio.fail_after(30):
                    while totals(await usage.report(store)) != expected:
                        await anyio.sleep(0.01)
                await anyio.to_thread.run_sync(server.stop)
                await anyio.sleep(1.5)  # the client's own retries give up within ~0.7 s
                await anyio.to_thread.run_sync(server.start)
                for i in range(6):
                    await settle(store, f"after-{i}", "small", 1)
                t, a, b = expected["small"]
                expected["small"] = (t + 6, a + 6, b + 0)
                with anyio.fail_after(30):
                    while totals(await usage.report(store)) != expected:
                        await anyio.sleep(0.01)
                stop.set()
            assert outcome["applied"] == 13 + 6
            strict = ProjectionRunner(store, usage, consumer="c", max_outage=0)
            await anyio.to_thread.run_sync(server.stop)
            with pytest.raises(es.StoreConnectionError):
                await strict.run(anyio.Event())
            await anyio.to_thread.run_sync(server.start)
        finally:
            await store.close()


class NamedLikeAnExport(UsageProjection):
    name = "export-nightly"


async def test_a_projection_may_not_take_an_exports_group_name(store: es.EventStore) -> None:
    """``export-<name>`` is an export's consumer group: a projection under such a name would
    move the export's position (and the export its), and forgetting it would drop the
    export's group. Refused before anything is registered or removed."""
    await settle(store, "t", "small", 1)
    for p in range(store.partitions):
        assert await store.create_feed_group(p, "export-nightly", start="0-0")
    with pytest.raises(es.InvalidInputError, match="'export-nightly' starts with 'export-'"):
        ProjectionRunner(store, NamedLikeAnExport(), consumer="c")
    with pytest.raises(es.InvalidInputError, match="drop-group"):
        await forget_projection(store, "export-nightly")
    for p in range(store.partitions):
        assert [g.name for g in await store.feed_groups(p)] == ["export-nightly"]
    # The export's own way to go: drop its group.
    assert await drop_feed_group(store, "export-nightly") == list(range(store.partitions))


async def test_a_store_closed_under_a_running_projection_is_not_a_bad_change(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The store closed while the runner reads changes: the run ends with `StoreClosedError`,
    and the change being read is not reported as one the projection cannot apply (the
    runner's ERROR "stopped at change ...", whose text is wrong for a call that may have run)."""
    namespace = "r" + uuid.uuid4().hex[:12]
    async with await es.connect(redis_url, namespace=namespace) as filling:
        await fill(filling, 300)
    delays = [0.001 * i for i in range(1, 30)]
    closed_under = 0
    for delay in delays:
        store = await es.connect(redis_url, namespace=namespace)
        runner = ProjectionRunner(store, UsageProjection(), consumer="c", batch_size=4)
        caplog.clear()
        with caplog.at_level("WARNING", logger="threadlog.runner"):
            closed_under += await run_closed_under(runner, store, delay)
        reported = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert not reported, (delay, reported)
    assert closed_under, "the store never closed under a run: the case is not made"


async def run_closed_under(runner: ProjectionRunner, store: es.EventStore, delay: float) -> int:
    """1 if ``runner.run_once()`` ended with `StoreClosedError`, the store closed after
    ``delay`` seconds, else 0 (it ended first)."""
    ended: list[int] = []

    async def run() -> None:
        try:
            await runner.run_once()
            ended.append(0)
        except es.StoreClosedError:
            ended.append(1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.sleep(delay)
        await store.close()
    return ended[0]
