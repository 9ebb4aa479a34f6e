"""Rebuilds of threads too large for one command: chunked view loads, and the bulk read path.

The Redis backend loads views above its chunk limits in bounded chunks to staging keys and
swaps them in with one small script. These tests set the limits tiny so that an ordinary thread
spans many chunks, on standalone Redis and on Redis Cluster, and check what a chunked load
must guarantee: the same views as a one-shot load, nothing loaded when the thread moves on
meanwhile, and no staging key left behind, whatever happens half way.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import anyio
import pytest
from hypothesis import given
from redis.asyncio.cluster import RedisCluster

import eventstore as es
from eventstore import (
    ConcurrencyError,
    HashLoad,
    ListLoad,
    MessageAppended,
    OperationalError,
    RedisEventStore,
    ViewClear,
    ViewEntry,
    ViewOp,
)
from eventstore._codec import decode_entry, decode_payload_rows, decode_rows, payload_row
from eventstore._keys import STAGING_TTL_S
from eventstore.servers import RedisServer
from projections import Block, Projector, RecordsProjection, StateProjection
from projections._projector import for_each_thread
from projections._records import RecordsState
from projections.testing import make_projector, message, opened, settled, snapshot, ulids

from .test_fuzz import FAST, entry_fields_strategy, entry_ids
from .test_security import acl_server, add_tenant, admin, tenant_url

__all__ = ["acl_server"]  # a fixture, shared with the tenant tests

pytestmark = pytest.mark.anyio

CHUNK_VALUES = 8
CHUNK_BYTES = 600

Hook = Callable[[int, str], Awaitable[None]]


class HookedStore(RedisEventStore):
    """A real Redis store that runs ``hook(chunk number, staging key)`` after each chunk lands.

    Not a test double: every command still goes to the real server; the hook only decides
    what else happens between two chunks (a concurrent append, a failure, a lost key).
    """

    hook: Hook | None = None
    chunks = 0

    async def _staged(self, stage: str) -> None:
        self.chunks += 1
        if self.hook is not None:
            await self.hook(self.chunks, stage)


@pytest.fixture(params=["redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[HookedStore]:
    url: str = request.getfixturevalue("redis_url" if request.param == "redis" else "cluster_url")
    opened_store = await es.connect(url, namespace="r" + uuid.uuid4().hex[:12])
    assert isinstance(opened_store, RedisEventStore)
    # The connected store's client and layout, with the hook and tiny chunk limits.
    hooked = HookedStore(
        opened_store.client,
        namespace=opened_store.namespace,
        partitions=opened_store.partitions,
        load_chunk_values=CHUNK_VALUES,
        load_chunk_bytes=CHUNK_BYTES,
    )
    try:
        yield hooked
    finally:
        await hooked.close()


async def staging_keys(store: RedisEventStore) -> list[bytes]:
    pattern = f"tl:{{{store.namespace}:*}}:load:*"
    found: list[bytes] = []
    async for key in store.client.scan_iter(match=pattern, count=1000):
        found.append(key)
    return found


async def write_turns(projector: Projector, thread: str, turns: int) -> None:
    for i, turn in enumerate(ulids(turns)):
        answer = f"answer {i} " + "x" * 40
        await projector.append(
            thread,
            [
                opened(turn, request=f"question {i} " + "y" * 40),
                es.StateUpdated(block=("plan", "profile", "notes")[i % 3], value={"i": i}),
                settled(turn, "completed" if i % 5 else "failed", answer),
                es.TranscriptAppended(messages=[message(f"t{i}")]),
            ],
        )


async def test_a_rebuild_spanning_many_chunks_restores_every_view(store: HookedStore) -> None:
    projector = make_projector(store)
    await write_turns(projector, "t", 40)
    before = await snapshot(projector, "t")
    # Damage every view: the rebuild must bring back all of it.
    for view in ("messages", "state", "turns", "settled", "transcript"):
        await store.client.delete(store.keys.view("t", view))
    assert not (await projector.check("t")).ok

    index = store.keys.index(store.keys.partition("t"))
    assert await store.client.zrem(index, "t") == 1  # and the index lost it
    assert await projector.rebuild("t") == 160
    assert await store.indexed("t")  # the swap lists it again
    # messages 72 + settled 40 + transcript 40 values, turns 40 and state 3 fields, at most
    # 8 values (4 fields) and ~600 bytes a chunk: dozens of chunks.
    assert store.chunks >= 30
    assert await snapshot(projector, "t") == before
    assert (await projector.check("t")).ok
    assert await staging_keys(store) == []
    # The swapped-in views carry no TTL from their staging keys.
    for view in ("messages", "state", "turns", "settled", "transcript"):
        assert await store.client.ttl(store.keys.view("t", view)) == -1


async def test_chunked_and_one_shot_loads_give_the_same_views(store: HookedStore) -> None:
    projector = make_projector(store)
    await write_turns(projector, "t", 12)
    reads = [r for p in projector.projections for r in p.full_reads()]
    await projector.rebuild("t")
    chunked = await store.read_views("t", reads)
    assert store.chunks > 0
    store.load_chunk_values, store.load_chunk_bytes = 10**9, 10**12
    store.chunks = 0
    await projector.rebuild("t")
    assert store.chunks == 0
    assert await store.read_views("t", reads) == chunked


async def test_a_load_only_empties_and_clears_what_it_should(store: HookedStore) -> None:
    await store.append("t", [MessageAppended(message=message("a"))])
    entries = tuple(ViewEntry(1, b"v%d" % i) for i in range(30))
    # Field names as any text (chunks are packed by hand on standalone Redis: encoded right).
    fields = {f"f{i}-é✓": ViewEntry(1, b"x\r\n" * 20, 2) for i in range(20)}
    # Standalone Redis gets chunks packed by the store, the cluster client its pipelines.
    assert store._packs_chunks is not isinstance(store.client, RedisCluster)
    await store.load_views(
        "t",
        [ListLoad("a", entries), HashLoad("h", fields), ListLoad("gone", ()), ViewClear("c")],
        expected_version=1,
    )
    got = await store.read_views("t", [es.ListRange("a"), es.HashGetAll("h")])
    assert got.results == [list(entries), fields]
    # A later load of the same views replaces them whole (a ViewClear empties one).
    await store.load_views("t", [ListLoad("a", entries[:3]), ViewClear("h")], expected_version=1)
    got = await store.read_views("t", [es.ListRange("a"), es.HashGetAll("h")])
    assert got.results == [list(entries[:3]), {}]
    assert await staging_keys(store) == []


async def test_an_append_during_a_chunked_load_loads_nothing_and_leaves_no_staging_keys(
    store: HookedStore,
) -> None:
    projector = make_projector(store)
    await write_turns(projector, "t", 10)
    folded = await projector.fold("t")
    old_views = await store.read_views("t", [es.ListRange("messages")])
    ops = [op for p in projector.projections for op in p.materialize(folded.states[p.name])]
    ops[0] = ListLoad("messages", ())  # what a wrong load would leave: an empty window

    async def append_meanwhile(chunk: int, stage: str) -> None:
        if chunk == 3:
            # Mid-load, the key has its TTL (a crash now leaves it for a bounded time).
            assert 0 < await store.client.ttl(stage) <= STAGING_TTL_S
            await projector.append("t", [MessageAppended(message=message("late"))])

    store.hook = append_meanwhile
    with pytest.raises(ConcurrencyError) as info:
        await store.load_views("t", ops, expected_version=folded.version)
    assert (info.value.expected, info.value.actual) == (40, 41)
    # The next chunk saw the new version and stopped the load. Chunks the store packs itself
    # go one ahead of their replies: the chunk already in flight when the append landed (its
    # version read before it) still lands, the one after stops the load.
    assert store.chunks == (4 if store._packs_chunks else 3)
    assert await staging_keys(store) == []
    (after,) = (await store.read_views("t", [es.ListRange("messages")])).results
    assert isinstance(after, list)
    assert after[:-1] == old_views.results[0]
    assert after[-1].seq == 41


async def after_the_last_chunk(
    store: HookedStore, ops: Sequence[ViewOp], version: int, then: Callable[[], Awaitable[Any]]
) -> int:
    """Load ``ops`` into thread "t" once, to count its chunks, and hook ``then`` to run after
    the last chunk of the next load of them (before its swap). Returns the number of chunks."""
    store.hook, store.chunks = None, 0
    await store.load_views("t", ops, expected_version=version)
    total, store.chunks = store.chunks, 0

    async def last(chunk: int, stage: str) -> None:
        if chunk == total:
            await then()

    store.hook = last
    return total


async def test_the_swap_refuses_a_thread_that_moved_after_the_last_chunk(
    store: HookedStore,
) -> None:
    projector = make_projector(store)
    await write_turns(projector, "t", 6)
    folded = await projector.fold("t")
    ops = [op for p in projector.projections for op in p.materialize(folded.states[p.name])]
    late = [MessageAppended(message=message("late"))]
    total = await after_the_last_chunk(
        store, ops, folded.version, lambda: projector.append("t", late)
    )
    with pytest.raises(ConcurrencyError):
        await store.load_views("t", ops, expected_version=folded.version)
    assert store.chunks == total  # every chunk went; the swap script said no
    assert await staging_keys(store) == []
    assert (await projector.check("t")).ok


async def test_the_swap_refuses_a_thread_replaced_up_to_the_same_version_after_the_last_chunk(
    store: HookedStore,
) -> None:
    """Deleted and written again to the version the contents were folded at (ABA): each
    chunk's version read passes, and only the life tells the swap the contents are stale."""
    projector = make_projector(store)
    await write_turns(projector, "t", 10)
    folded = await projector.fold("t")
    life = await store.incarnation("t")
    ops = [op for p in projector.projections for op in p.materialize(folded.states[p.name])]

    new_views = None

    async def replace() -> None:
        nonlocal new_views
        await store.delete_thread("t")
        await write_turns(projector, "t", 10)
        new_views = await snapshot(projector, "t")

    total = await after_the_last_chunk(store, ops, folded.version, replace)
    with pytest.raises(es.IncarnationConflictError) as info:
        await store.load_views("t", ops, expected_version=folded.version, expected_incarnation=life)
    assert info.value.expected_incarnation == life
    assert info.value.actual_incarnation == await store.incarnation("t") != life
    assert store.chunks == total  # every chunk went; the swap script said no
    assert await staging_keys(store) == []
    assert new_views is not None and await snapshot(projector, "t") == new_views


async def test_the_swap_refuses_a_version_only_lua_would_read_as_a_number(
    store: HookedStore,
) -> None:
    """A version damaged to ``4e1`` after the last chunk (each chunk's own read of it takes
    digits only): the swap reports the damage as every reader does, and loads nothing."""
    projector = make_projector(store)
    await write_turns(projector, "t", 10)
    folded = await projector.fold("t")
    assert folded.version == 40
    ops = [op for p in projector.projections for op in p.materialize(folded.states[p.name])]
    meta = store.keys.meta("t")
    total = await after_the_last_chunk(store, ops, 40, lambda: store.client.hset(meta, "v", "4e1"))
    await store.client.delete(store.keys.view("t", "messages"))  # a load would bring it back
    with pytest.raises(es.CorruptEventError, match="field 'v'"):
        await store.load_views("t", ops, expected_version=40)
    assert store.chunks == total  # every chunk went; the swap script said no
    assert await staging_keys(store) == []
    assert not await store.client.exists(store.keys.view("t", "messages"))


async def test_rebuild_retries_past_appends_made_during_its_chunked_load(
    store: HookedStore,
) -> None:
    projector = make_projector(store)
    await write_turns(projector, "t", 20)
    appended = 0

    async def append_twice(chunk: int, stage: str) -> None:
        nonlocal appended
        if chunk % 5 == 2 and appended < 2:
            appended += 1
            await projector.append("t", [MessageAppended(message=message(f"late {appended}"))])

    store.hook = append_twice
    await store.client.delete(store.keys.view("t", "messages"))
    assert await projector.rebuild("t") == 82
    assert appended == 2
    report = await projector.check("t")
    assert report.ok and report.version == 82
    assert [m.message.text for m in await projector.last("t", 2)] == ["late 1", "late 2"]
    assert await staging_keys(store) == []


async def test_a_failure_half_way_deletes_the_staging_keys(store: HookedStore) -> None:
    projector = make_projector(store)
    await write_turns(projector, "t", 10)
    before = await snapshot(projector, "t")

    async def fail(chunk: int, stage: str) -> None:
        if chunk == 5:
            assert await staging_keys(store) != []
            raise RuntimeError("the process dies half way")

    store.hook = fail
    await store.client.delete(store.keys.view("t", "settled"))
    with pytest.raises(RuntimeError):
        await projector.rebuild("t")
    assert await staging_keys(store) == []
    assert not (await projector.check("t")).ok  # nothing was swapped in
    store.hook = None
    await projector.rebuild("t")
    assert await snapshot(projector, "t") == before


async def test_a_staging_key_lost_half_way_is_an_error_not_a_short_view(
    store: HookedStore,
) -> None:
    projector = make_projector(store)
    await write_turns(projector, "t", 10)
    before = await snapshot(projector, "t")

    async def expire_first(chunk: int, stage: str) -> None:
        if chunk == 2:
            # What a TTL running out on a stalled load does to the first staging key.
            (first,) = [k for k in await staging_keys(store) if b":load:" in k and b":0:" in k]
            assert await store.client.delete(first) == 1

    store.hook = expire_first
    with pytest.raises(OperationalError, match="vanished"):
        await projector.rebuild("t")
    assert await staging_keys(store) == []
    assert await snapshot(projector, "t") == before


async def test_a_tenant_confined_user_can_run_a_chunked_rebuild(acl_server: RedisServer) -> None:
    """The commands a chunked load sends and its swap script calls are all in ACL_COMMANDS."""
    namespace = "r" + uuid.uuid4().hex[:12]
    url = tenant_url(acl_server, *add_tenant(acl_server, namespace))
    async with await es.connect(url, namespace=namespace) as tenant:
        assert isinstance(tenant, RedisEventStore)
        tenant.load_chunk_values, tenant.load_chunk_bytes = CHUNK_VALUES, CHUNK_BYTES
        projector = make_projector(tenant)
        await write_turns(projector, "t", 8)
        before = await snapshot(projector, "t")
        await tenant.client.delete(tenant.keys.view("t", "turns"))
        assert await projector.rebuild("t") == 32
        assert await snapshot(projector, "t") == before
    with admin(acl_server) as c:  # SCAN is not the tenant's to run
        assert c.keys(f"tl:{{{namespace}:*}}:load:*") == []
        assert c.exists(tenant.keys.view("t", "turns")) == 1


class StateWithNotes(StateProjection):
    """Also keeps the text of the last stored message as block "notes": an ``apply`` that
    reacts to more than the parent's ``handles`` names."""

    def apply(self, state: dict[str, Block], event: es.RecordedEvent) -> dict[str, Block]:
        state = super().apply(state, event)
        if isinstance(event.payload, MessageAppended):
            prior = state.get("notes")
            text = event.payload.message.text
            version = (prior.version if prior else 0) + 1
            state["notes"] = Block(name="notes", value=text, version=version, seq=event.seq)
        return state


async def test_a_subclass_overriding_apply_gets_every_event_in_a_fold() -> None:
    store = es.MemoryEventStore(namespace="n" + uuid.uuid4().hex[:12])
    projector = Projector(store, state=StateWithNotes())
    await projector.append("t", [MessageAppended(message=message("hello"))])
    await projector.append("t", [es.StateUpdated(block="plan", value=1)])
    folded = await projector.fold("t")
    state = folded.states["state"]
    assert state["notes"].value == "hello" and state["notes"].seq == 1
    assert state["plan"].value == 1
    # The built-in projections keep their declared types.
    assert projector._targets(MessageAppended) == [
        (projector.messages, "messages"),
        (projector.state_projection, "state"),
    ]
    assert projector._targets(es.StateUpdated) == [(projector.state_projection, "state")]


class AskedState(StateProjection):
    """Records the events of each append its ``ops`` is asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[list[str]] = []

    def ops(self, events: Sequence[es.NewEvent]) -> list[es.ViewOp]:
        self.asked.append([type(e.payload).__name__ for e in events])
        return super().ops(events)


class AskedStateWithNotes(AskedState, StateWithNotes):
    """The same, with an ``apply`` that reacts to more than the declared ``handles``."""


@pytest.mark.parametrize("fold_all", [False, True])
async def test_an_append_asks_the_ops_of_the_projections_that_fold_its_events(
    fold_all: bool,
) -> None:
    store = es.MemoryEventStore(namespace="n" + uuid.uuid4().hex[:12])
    state = AskedStateWithNotes() if fold_all else AskedState()
    projector = Projector(store, state=state)
    await projector.append("t", [MessageAppended(message=message("hello"))])
    await projector.append("t", [es.StateUpdated(block="plan", value=1)])
    await projector.append(
        "t", [MessageAppended(message=message("again")), es.StateUpdated(block="plan", value=2)]
    )
    both = ["MessageAppended", "StateUpdated"]
    if fold_all:  # an apply below the declared handles: every event is its business
        assert state.asked == [["MessageAppended"], ["StateUpdated"], both]
    else:
        assert state.asked == [["StateUpdated"], both]
        assert (await projector.check("t")).ok
    assert (await projector.state("t"))["plan"].value == 2


# -- the bulk read path decodes exactly as decode_entry does -------------------------------------


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except es.CorruptEventError as exc:
        return ("error", exc.thread_id, exc.seq, str(exc))


@FAST
@given(entry_id=entry_ids, fields=entry_fields_strategy)
def test_decode_rows_agrees_with_decode_entry(entry_id: bytes, fields: dict[bytes, bytes]) -> None:
    one = _outcome(lambda: decode_entry("fuzz", entry_id, fields, es.registry))
    flat = [x for kv in fields.items() for x in kv]
    as_dict = _outcome(lambda: decode_rows("fuzz", [(entry_id, fields)], es.registry))
    as_list = _outcome(lambda: decode_rows("fuzz", [(entry_id, flat)], es.registry))
    expected = one if isinstance(one, tuple) else [one]
    assert as_dict == expected
    assert as_list == expected
    rows = _outcome(lambda: decode_payload_rows("fuzz", [(entry_id, flat)], es.registry))
    assert rows == (one if isinstance(one, tuple) else [payload_row(one)])


class StateViaPayloads(StateProjection):
    """Overrides the payload fold only: folds keep the fast path (and call this one)."""

    calls = 0

    def apply_payload(
        self,
        state: dict[str, Block],
        seq: int,
        payload: es.Event,
        event_id: bytes,
        meta: es.EventMeta,
    ) -> dict[str, Block]:
        StateViaPayloads.calls += 1
        return super().apply_payload(state, seq, payload, event_id, meta)


async def test_folds_skip_recorded_events_only_when_every_projection_folds_payloads() -> None:
    store = es.MemoryEventStore(namespace="n" + uuid.uuid4().hex[:12])
    fast = Projector(store, state=StateViaPayloads())
    slow = Projector(store, state=StateWithNotes())
    assert fast._folds_payloads and not slow._folds_payloads
    await fast.append("t", [es.StateUpdated(block="plan", value=1)])
    await fast.append("t", [MessageAppended(message=message("hello"))])
    StateViaPayloads.calls = 0
    assert (await fast.fold("t")).states["state"]["plan"].value == 1
    assert StateViaPayloads.calls == 1
    assert (await slow.fold("t")).states["state"]["notes"].value == "hello"


class RecordsViaEvents(RecordsProjection):
    """Overrides ``apply`` (unchanged): folds take the RecordedEvent path for every projection."""

    def apply(self, state: RecordsState, event: es.RecordedEvent) -> RecordsState:
        return super().apply(state, event)


async def test_payload_and_event_folds_agree_on_odd_turn_histories() -> None:
    """Open records left pending (payload rows) and encoded at once (events) come out the same,
    anomalies and hash versions included, and a pending record resolves where it is read."""
    store = es.MemoryEventStore(namespace="n" + uuid.uuid4().hex[:12])
    fast = make_projector(store)
    slow = Projector(
        store,
        [fast.messages, fast.state_projection, RecordsViaEvents(), fast.transcript_projection],
    )
    assert fast._folds_payloads and not slow._folds_payloads
    a, b, c, d = ulids(4)
    history: list[es.Event] = [
        opened(a, "q"),
        opened(a, "q again"),  # opened twice, still open
        settled(b, "completed", "no open"),  # settled without open
        opened(c, parent=a),
        settled(c, "failed", parent=a),
        settled(c, "completed", parent=a),  # settled twice
        opened(c),  # re-opened after settling
        opened(d, "never settled"),
    ]
    for n in range(1, len(history) + 1):
        await fast.delete_thread("t")
        for payload in history[:n]:
            await fast.append("t", [payload])
        f, s = await fast.fold("t"), await slow.fold("t")
        assert fast._materialize(f) == slow._materialize(s)
        assert f.states["records"].anomalies == s.states["records"].anomalies
        assert await fast.turns("t", as_of=n) == await slow.turns("t", as_of=n)
        assert await fast.records("t", as_of=n) == await slow.records("t", as_of=n)
        assert (await fast.check("t")).ok
    kinds = [x.kind for x in (await fast.fold("t")).states["records"].anomalies]
    assert kinds == ["opened_twice", "settled_without_open", "settled_twice", "opened_twice"]


async def test_a_thread_whose_job_fails_stops_new_ones_and_lets_running_ones_end() -> None:
    """`for_each_thread` (the namespace-wide rebuild, check and verify): an error from one
    thread's job is raised as itself, not in an exception group; the jobs running then end
    (none cut off between its writes) and no other thread is started."""
    started: list[str] = []
    ended: list[str] = []

    async def job(thread_id: str) -> str:
        started.append(thread_id)
        if thread_id == "b":
            raise OperationalError("lost the server")
        await anyio.sleep(0.02)
        ended.append(thread_id)
        return thread_id

    with pytest.raises(OperationalError, match="lost the server"):
        await for_each_thread(list("abcdef"), job, progress=None, concurrency=2)
    assert started == ["a", "b"] and ended == ["a"]
    started.clear()
    ended.clear()
    done = await for_each_thread(list("acdef"), job, progress=None, concurrency=3)
    assert list(done) == list("acdef") and sorted(ended) == list("acdef")
    assert await for_each_thread([], job, progress=None, concurrency=3) == {}
