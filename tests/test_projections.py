"""The projection suite on the memory backend and a real redis-server, and a property test."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Iterator

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eventstore import (
    OUTCOMES,
    Event,
    EventStore,
    MemoryEventStore,
    MemoryServer,
    MessageAppended,
    NewEvent,
    RedisEventStore,
    StateUpdated,
    TranscriptAppended,
    TranscriptReplaced,
    ViewConflictError,
    open_store,
)
from eventstore._connect import StoreSettings
from projections import Block
from projections.testing import (
    BLOCKS,
    ProjectionConformance,
    Snapshot,
    make_projector,
    message,
    opened,
    settled,
    snapshot,
)
from tests.test_security import with_query


class TestMemoryProjections(ProjectionConformance):
    server = MemoryServer()

    async def make_store(self, namespace: str) -> EventStore:
        return MemoryEventStore(namespace=namespace, server=self.server)

    async def delete_view(self, store: EventStore, thread_id: str, view: str) -> None:
        assert isinstance(store, MemoryEventStore)
        del store.server.namespaces[store.namespace].threads[thread_id].views[view]


class TestRedisProjections(ProjectionConformance):
    @pytest.fixture(autouse=True)
    def _redis(self, redis_url: str) -> None:
        self.url = redis_url

    async def make_store(self, namespace: str) -> EventStore:
        return await open_store(StoreSettings.from_url(self.url, namespace=namespace))

    async def delete_view(self, store: EventStore, thread_id: str, view: str) -> None:
        assert isinstance(store, RedisEventStore)
        assert await store.client.delete(store.keys.view(thread_id, view)) == 1


class TestResp3Projections(TestRedisProjections):
    """The same on a RESP3 connection (``?protocol=3``)."""

    @pytest.fixture(autouse=True)
    def _redis(self, redis_url: str) -> None:
        self.url = with_query(redis_url, protocol="3")


class TestSentinelProjections(TestRedisProjections):
    """The same through Redis Sentinel (``redis+sentinel://``)."""

    @pytest.fixture(autouse=True)
    def _redis(self, sentinel_url: str) -> None:
        self.url = sentinel_url


# -- property: views == fold(log) == rebuild, and time travel == the live reads back then ------

StoreFactory = Callable[[str], Awaitable[EventStore]]


@pytest.fixture(scope="module", params=["memory", "redis"])
def open_backend(request: pytest.FixtureRequest) -> Iterator[StoreFactory]:
    if request.param == "memory":
        server = MemoryServer()

        async def memory(namespace: str) -> EventStore:
            return MemoryEventStore(namespace=namespace, server=server)

        yield memory
    else:
        url: str = request.getfixturevalue("redis_url")

        async def redis(namespace: str) -> EventStore:
            return await open_store(StoreSettings.from_url(url, namespace=namespace))

        yield redis


# JSON values: what a state block may hold (no NaN or infinities, string keys).
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
texts = st.text(alphabet="abc xyz", min_size=1, max_size=6)


@st.composite
def scripts(draw: st.DrawFn) -> list[list[Event]]:
    """Batches of events: messages, turns (root or child, every outcome, some settled twice,
    without an open or never), state updates (some guarded by a version) and transcript
    appends and replaces."""
    pool = [f"turn-{i}" for i in range(draw(st.integers(1, 6)))]
    parents: dict[str, str | None] = {}
    batches: list[list[Event]] = []
    for _ in range(draw(st.integers(1, 8))):
        batch: list[Event] = []
        written: set[str] = set()
        for _ in range(draw(st.integers(1, 4))):
            kind = draw(
                st.sampled_from(["message", "open", "settle", "state", "append", "replace"])
            )
            if kind == "message":
                role = draw(st.sampled_from(["user", "assistant", "system"]))
                batch.append(MessageAppended(message=message(draw(texts), role)))
            elif kind == "open":
                turn = draw(st.sampled_from(pool))
                others = [p for p in pool if p != turn]
                parent = draw(st.none() | st.sampled_from(others)) if others else None
                parents[turn] = parent
                request = draw(st.none() | texts)
                batch.append(opened(turn, request=request, parent=parent))
            elif kind == "settle":
                turn = draw(st.sampled_from(pool))
                outcome = draw(st.sampled_from(OUTCOMES))
                answer = draw(st.none() | texts)
                batch.append(settled(turn, outcome, answer, parent=parents.get(turn)))
            elif kind == "state":
                block = draw(st.sampled_from(BLOCKS))
                # Only a block's first update in a batch is guarded: see `_guards_hold`.
                guard = None if block in written else draw(st.sampled_from([None, None, 0, 1]))
                written.add(block)
                value = draw(json_values)
                batch.append(StateUpdated(block=block, value=value, expected_version=guard))
            else:
                messages = [message(t) for t in draw(st.lists(texts, max_size=3))]
                cls = TranscriptAppended if kind == "append" else TranscriptReplaced
                batch.append(cls(messages=messages))
        batches.append(batch)
    return batches


def _guards_hold(batch: list[Event], state: dict[str, Block]) -> bool:
    # A guard is checked against the block's version before the append; the scripts guard
    # only a block's first update in a batch, where that is also the version in sequence.
    return all(
        e.expected_version == (state[e.block].version if e.block in state else 0)
        for e in batch
        if isinstance(e, StateUpdated) and e.expected_version is not None
    )


async def _run_script(open_store_for: StoreFactory, batches: list[list[Event]]) -> None:
    store = await open_store_for("h" + uuid.uuid4().hex[:12])
    # The same events, one append per event, in another namespace: its live reads after each
    # event are what time travel must answer for every seq, inside a batch or not.
    one_at_a_time = await open_store_for("h" + uuid.uuid4().hex[:12])
    try:
        projector, reference = make_projector(store), make_projector(one_at_a_time)
        live: dict[int, Snapshot] = {0: await snapshot(projector, "t")}
        per_event = [live[0]]
        times: list[int] = []
        for batch in batches:
            version = await store.version("t")
            before = live[version]
            if not _guards_hold(batch, before.state):
                with pytest.raises(ViewConflictError):
                    await projector.append("t", batch)
                assert await store.version("t") == version
                assert await snapshot(projector, "t") == before
                continue
            # The same event ids in both stores: turn records carry the id of their event.
            news = [NewEvent(payload=e) for e in batch]
            result = await projector.append("t", news)
            live[result.last_seq] = await snapshot(projector, "t")
            (last,) = [e async for e in store.read("t", start=result.last_seq)]
            times.append(last.time_ms)
            for event in news:
                await reference.append("t", [event])
                per_event.append(await snapshot(reference, "t"))
        final = live[max(live)]
        assert final == per_event[-1]

        # Materialized views == fold(log) == views after a rebuild.
        report = await projector.check("t")
        assert report.ok, report.differences
        await projector.rebuild("t")
        assert await snapshot(projector, "t") == final
        assert (await projector.check("t")).ok

        # Time travel by seq, at every seq, equals the live reads right after that event.
        for seq, expected in enumerate(per_event):
            assert await snapshot(projector, "t", as_of=seq) == expected, f"as_of={seq}"
        # ... and by time: a time names the last append made at or before it.
        for ms in times:
            at = await store.seq_at("t", ms)
            when = (await anext(store.read("t", start=at, stop=at))).time
            assert await snapshot(projector, "t", as_of=when) == live[at], f"as_of={when}"
    finally:
        await store.close()
        await one_at_a_time.close()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batches=scripts())
def test_views_equal_fold_and_time_travel_equals_live(
    open_backend: StoreFactory, batches: list[list[Event]]
) -> None:
    anyio.run(_run_script, open_backend, batches)
