"""ThreadlogCheckpointSaver: LangGraph's conformance suite, real graphs, and storage growth."""

from __future__ import annotations

import asyncio
import gc
import operator
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, TypedDict, cast

import anyio
import msgspec
import pytest
import redis
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, RemoveMessage
from langchain_core.runnables import RunnableConfig
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.base import BaseCheckpointSaver, copy_checkpoint, empty_checkpoint
from langgraph.checkpoint.base.id import uuid6
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import ALL_CAPABILITIES
from langgraph.checkpoint.conformance.report import ProgressCallbacks
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.graph.state import CompiledStateGraph
from langgraph.types import Command, Send, StateSnapshot, interrupt

import adapters.langgraph as lg
import eventstore as es
from adapters._framework_events import Record
from adapters.langgraph import (
    VIEWS,
    BlobsPut,
    CheckpointPut,
    CheckpointsRemoved,
    ThreadlogCheckpointSaver,
    WritesPut,
    checkpoint_thread_id,
)
from projections import Projector

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).absolute().parent.parent


BACKENDS = ["memory", "redis", "cluster"]


async def open_store(kind: str, request: pytest.FixtureRequest) -> es.EventStore:
    namespace = "lg" + uuid.uuid4().hex[:12]
    if kind == "memory":
        return es.MemoryEventStore(namespace=namespace)
    try:
        url = request.getfixturevalue("cluster_url" if kind == "cluster" else "redis_url")
    except pytest.FixtureLookupError:
        pytest.skip(f"no {kind} fixture")
    return await es.connect(url, namespace=namespace)


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[es.EventStore]:
    opened = await open_store(request.param, request)
    try:
        yield opened
    finally:
        await opened.close()


def config(thread_id: str, **extra: Any) -> RunnableConfig:
    return {"configurable": {"thread_id": thread_id, **extra}}


def ask(text: str) -> Any:
    """A graph input: one human message (typed Any: LangGraph takes partial states)."""
    return {"messages": [HumanMessage(text)]}


# -- the official conformance suite -----------------------------------------------------------


@pytest.mark.parametrize("kind", BACKENDS)
async def test_conformance_suite(kind: str, request: pytest.FixtureRequest) -> None:
    async def factory() -> AsyncIterator[BaseCheckpointSaver[str]]:
        store = await open_store(kind, request)
        try:
            yield ThreadlogCheckpointSaver(store)
        finally:
            await store.close()

    registered = checkpointer_test(name=f"ThreadlogCheckpointSaver[{kind}]")(factory)
    report = await validate(registered, progress=ProgressCallbacks.verbose())
    report.print_report()
    detected = {name for name, r in report.results.items() if r.detected}
    assert detected == {c.value for c in ALL_CAPABILITIES}
    failures = [f for r in report.results.values() for f in r.failures]
    assert report.passed_all(), failures
    assert report.conformance_level() == "FULL"
    assert sum(r.tests_passed for r in report.results.values()) == 81


# -- a graph with messages, fan-out, a subgraph, edits and removals ---------------------------


class SubState(TypedDict):
    notes: Annotated[list[str], operator.add]


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    notes: Annotated[list[str], operator.add]
    count: int


def chat(state: State) -> dict[str, Any]:
    n = state.get("count", 0) + 1
    messages: list[AnyMessage] = [AIMessage(f"reply {n}", id=f"ai-{n}")]
    if n == 3:
        messages.append(AIMessage("edited first reply", id="ai-1"))  # replaces by id
    if n == 4:
        messages.append(RemoveMessage(id="ai-2"))  # type: ignore[arg-type]
    return {"messages": messages, "count": n}


def fan_out(state: State) -> Any:
    if state["count"] >= 4:
        return END
    return [Send("worker", {"item": i}) for i in range(3)]


def worker(arg: Any) -> dict[str, Any]:
    return {"notes": [f"worked {arg['item']}"]}


def sub_step(state: SubState) -> dict[str, Any]:
    return {"notes": ["sub ran"]}


def busy_graph() -> StateGraph[State]:
    sub = StateGraph(SubState)
    sub.add_node("sub_step", sub_step)
    sub.add_edge(START, "sub_step")
    builder = StateGraph(State)
    builder.add_node("chat", chat)
    builder.add_node("worker", cast(Any, worker))  # a Send target: takes its own input
    builder.add_node("sub", sub.compile())
    builder.add_edge(START, "chat")
    builder.add_conditional_edges("chat", fan_out, ["worker", END])
    builder.add_edge("worker", "sub")
    builder.add_edge("sub", "chat")
    return builder


def summary(states: list[StateSnapshot]) -> list[tuple[Any, ...]]:
    """What two runs on different savers must agree on (ids and timestamps differ)."""
    return [
        (
            s.values,
            s.next,
            (s.metadata or {}).get("step"),
            (s.metadata or {}).get("source"),
            [(t.name, t.error, t.interrupts) for t in s.tasks],
            s.parent_config is None,
        )
        for s in states
    ]


async def test_graph_matches_in_memory_saver(store: es.EventStore) -> None:
    reference = busy_graph().compile(checkpointer=InMemorySaver())
    saver = ThreadlogCheckpointSaver(store)
    graph = busy_graph().compile(checkpointer=saver)
    start: Any = {"messages": [HumanMessage("hi", id="h")]}

    expected = await reference.ainvoke(start, config("t"))
    got = await graph.ainvoke(start, config("t"))
    assert got == expected
    assert [m.content for m in got["messages"]] == [
        "hi",
        "edited first reply",
        "reply 3",
        "reply 4",
    ]
    history = [s async for s in graph.aget_state_history(config("t"))]
    reference_history = [s async for s in reference.aget_state_history(config("t"))]
    assert summary(history) == summary(reference_history)
    assert len(history) == 12
    # Subgraph checkpoints live in their own namespaces of the same thread.
    namespaces = {
        t.config["configurable"]["checkpoint_ns"]
        async for t in saver.alist({"configurable": {"thread_id": "t"}})
    }
    assert "" in namespaces and any(ns.startswith("sub:") for ns in namespaces)
    report = await saver.acheck("t")
    assert report.ok, report.differences


# -- restart in another process, then time travel ---------------------------------------------


class Review(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    approved: bool


def draft(state: Review) -> dict[str, Any]:
    return {"messages": [AIMessage(f"draft {len(state['messages'])}")]}


def review(state: Review) -> dict[str, Any]:
    answer = interrupt("approve the draft?")
    return {"approved": answer == "yes", "messages": [HumanMessage(f"review: {answer}")]}


def publish(state: Review) -> dict[str, Any]:
    return {"messages": [AIMessage("published" if state["approved"] else "discarded")]}


def review_graph() -> StateGraph[Review]:
    builder = StateGraph(Review)
    builder.add_node("draft", draft)
    builder.add_node("review", review)
    builder.add_node("publish", publish)
    builder.add_edge(START, "draft")
    builder.add_edge("draft", "review")
    builder.add_edge("review", "publish")
    builder.add_edge("publish", END)
    return builder


FIRST_PROCESS = textwrap.dedent(
    """
    import sys
    from langchain_core.messages import HumanMessage
    from adapters.langgraph import ThreadlogCheckpointSaver
    from tests.test_langgraph import ask, review_graph

    url, namespace, thread = sys.argv[1:4]
    with ThreadlogCheckpointSaver.from_url(url, namespace=namespace) as saver:
        graph = review_graph().compile(checkpointer=saver)
        config = {"configurable": {"thread_id": thread}}
        graph.invoke(ask("write a post"), config)
        print(graph.get_state(config).next, flush=True)
    """
)


def resume_and_travel(graph: CompiledStateGraph[Any], thread: str) -> None:
    """Runs after the restart: resume the interrupted run, then fork from before the review."""
    cfg = config(thread)
    paused = graph.get_state(cfg)
    assert paused.next == ("review",)
    assert [i.value for t in paused.tasks for i in t.interrupts] == ["approve the draft?"]

    done = graph.invoke(Command(resume="yes"), cfg)
    assert [m.content for m in done["messages"]] == [
        "write a post",
        "draft 1",
        "review: yes",
        "published",
    ]
    history = list(graph.get_state_history(cfg))
    assert [s.next for s in history] == [(), ("publish",), ("review",), ("draft",), ("__start__",)]
    before_draft = history[3]
    published_id = history[0].config["configurable"]["checkpoint_id"]

    # Time travel: run again from the checkpoint before the draft; this forks the thread, and
    # the review on the new branch can be answered differently.
    graph.invoke(None, before_draft.config)
    assert graph.get_state(cfg).next == ("review",)
    forked = graph.invoke(Command(resume="no"), cfg)
    assert [m.content for m in forked["messages"]] == [
        "write a post",
        "draft 1",
        "review: no",
        "discarded",
    ]
    fork_history = list(graph.get_state_history(cfg))
    assert len(fork_history) == 9  # both branches
    assert graph.get_state(cfg).values["approved"] is False  # the fork is the latest
    old = graph.get_state(config(thread, checkpoint_id=published_id))
    assert old.values["messages"][-1].content == "published"  # the first branch is intact
    assert old.values["approved"] is True
    # The fork's first checkpoint descends from the one we travelled to.
    parents = {
        s.parent_config["configurable"]["checkpoint_id"] for s in fork_history if s.parent_config
    }
    assert before_draft.config["configurable"]["checkpoint_id"] in parents


async def test_restart_in_another_process_and_time_travel(redis_url: str, namespace: str) -> None:
    thread = "review-" + uuid.uuid4().hex[:8]
    result = await anyio.run_process(
        [sys.executable, "-c", FIRST_PROCESS, redis_url, namespace, thread], cwd=ROOT
    )
    assert result.stdout.decode().strip() == "('review',)"

    saver = ThreadlogCheckpointSaver.from_url(redis_url, namespace=namespace)
    try:
        graph = review_graph().compile(checkpointer=saver)
        await anyio.to_thread.run_sync(resume_and_travel, graph, thread)
        report = await anyio.to_thread.run_sync(saver.check, thread)
        assert report.ok, report.differences
    finally:
        await anyio.to_thread.run_sync(saver.close)


def test_restart_of_the_saver_on_the_memory_backend() -> None:
    server = es.MemoryServer()
    thread = "review-mem"

    def fresh() -> ThreadlogCheckpointSaver:
        return ThreadlogCheckpointSaver(es.MemoryEventStore(namespace="m", server=server))

    with fresh() as first:
        graph = review_graph().compile(checkpointer=first)
        graph.invoke(ask("write a post"), config(thread))
    with fresh() as second:
        resume_and_travel(review_graph().compile(checkpointer=second), thread)
        assert second.check(thread).ok


# -- the sync bridge --------------------------------------------------------------------------


async def test_sync_api_from_inside_a_running_loop(redis_url: str, namespace: str) -> None:
    with ThreadlogCheckpointSaver.from_url(redis_url, namespace=namespace) as saver:
        graph = review_graph().compile(checkpointer=saver)
        # A sync call made on a thread whose event loop is running (this test's): the saver
        # runs it on its own loop thread, so nothing deadlocks.
        graph.invoke(ask("hello"), config("sync"))
        assert graph.get_state(config("sync")).next == ("review",)
        # The async API of the same saver opens its own store on this loop.
        state = await graph.aget_state(config("sync"))
        assert [m.content for m in state.values["messages"]] == ["hello", "draft 1"]
        await saver.aclose()


async def test_sync_api_needs_a_store_of_its_own(redis_url: str, namespace: str) -> None:
    store = await es.connect(redis_url, namespace=namespace)
    try:
        saver = ThreadlogCheckpointSaver(store)
        assert await saver.aget_tuple(config("x")) is None
        with pytest.raises(es.InvalidInputError, match="from_url"):
            await anyio.to_thread.run_sync(saver.get_tuple, config("x"))
        saver.close()
    finally:
        await store.close()


# -- the log ----------------------------------------------------------------------------------


async def test_events_thread_ids_and_audit(store: es.EventStore) -> None:
    saver = ThreadlogCheckpointSaver(store)
    graph = review_graph().compile(checkpointer=saver)
    odd = "team{a}/\x01%"
    await graph.ainvoke(ask("post"), config(odd))
    await graph.ainvoke(Command(resume="yes"), config(odd))
    tid = checkpoint_thread_id(odd)
    assert tid == "lg:team%7Ba%7D/%01%25"
    assert [s.thread_id for s in await store.threads()] == [tid]
    kinds = [type(e.payload) async for e in store.read(tid)]
    assert {BlobsPut, CheckpointPut, WritesPut} <= set(kinds)
    listed = [t async for t in saver.alist(None)]  # every thread: the id comes back decoded
    assert {t.config["configurable"]["thread_id"] for t in listed} == {odd}

    await saver.aprune([odd])
    remaining = [t async for t in saver.alist(config(odd))]
    assert len(remaining) == 1
    assert CheckpointsRemoved in [type(e.payload) async for e in store.read(tid)]
    # The log still holds every checkpoint: fold it as of the version before the prune.
    state = await graph.aget_state(config(odd))
    assert state.values["messages"][-1].content == "published"
    report = await saver.acheck(odd)
    assert report.ok, report.differences
    await saver.adelete_thread(odd)
    assert await store.version(tid) == 0
    for view in VIEWS:
        snap = await store.read_views(tid, [es.HashGetAll(view)])
        assert snap.results == [{}]
    with pytest.raises(es.InvalidThreadIdError):
        await saver.aget_tuple(config(cast(Any, None)))
    # An id too long once prefixed and escaped is said in LangGraph's terms.
    for too_long in ("x" * 254, "%" * 90):
        with pytest.raises(es.InvalidThreadIdError, match="LangGraph thread_id is too long"):
            await saver.aget_tuple(config(too_long))
    with pytest.raises(es.InvalidInputError):
        await saver.aget_tuple({"configurable": {}})
    # A checkpoint id or namespace that is no str: named, not a TypeError from inside.
    for bad in ({"checkpoint_id": 1}, {"checkpoint_ns": 3}, {"checkpoint_id": b"x"}):
        conf: Any = {"configurable": {"thread_id": odd, **bad}}
        key = next(iter(bad))
        with pytest.raises(es.InvalidInputError, match=f"configurable.{key}"):
            await saver.aget_tuple(conf)
        with pytest.raises(es.InvalidInputError, match=f"configurable.{key}"):
            [c async for c in saver.alist(conf)]
        with pytest.raises(es.InvalidInputError, match=f"configurable.{key}"):
            [c async for c in saver.alist(None, before=conf)]
    with pytest.raises(es.InvalidInputError, match=r"configurable\.checkpoint_id"):
        await saver.aput_writes(
            {"configurable": {"thread_id": odd, "checkpoint_id": 5}}, [("a", 1)], "task"
        )


async def test_list_of_every_thread_reads_the_thread_index_a_page_at_a_time(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``alist(None)`` listed every thread of the namespace before its first checkpoint: a
    ``limit=1`` on a namespace of millions read them all. It now pages the thread index."""
    monkeypatch.setattr(lg, "LIST_PAGE", 3)
    saver = ThreadlogCheckpointSaver(store)
    graph = todo_graph().compile(checkpointer=saver)
    names = [f"t{i}" for i in range(8)]
    for i, name in enumerate(names):
        await graph.ainvoke({"todo": [name], "n": i}, config(name))
        await anyio.sleep(0.002)  # one activity time each: the index order is the write order
    await store.append("not-langgraph", [es.StateUpdated(block="x", value=1)])
    real_threads = store.threads
    pages: list[int | None] = []

    async def threads(**kwargs: Any) -> list[es.ThreadInfo]:
        pages.append(kwargs.get("limit"))
        return await real_threads(**kwargs)

    monkeypatch.setattr(store, "threads", threads)
    first = [t async for t in saver.alist(None, limit=1)]
    assert [t.config["configurable"]["thread_id"] for t in first] == ["t7"]  # newest activity
    assert pages == [3]  # one page of the index, not the namespace
    pages.clear()
    every = {t.config["configurable"]["thread_id"] async for t in saver.alist(None)}
    assert every == set(names)  # the other thread of the namespace is skipped
    assert pages == [3, 3, 3, 3]  # 9 threads: three full pages of 3, then an empty one


# -- lists, size limits, stale caches ---------------------------------------------------------


class CountingStore(es.MemoryEventStore):
    """A memory store that counts the view conflicts it raises."""

    conflicts = 0

    async def append(self, *args: Any, **kwargs: Any) -> es.AppendResult:
        try:
            return await super().append(*args, **kwargs)
        except es.ViewConflictError:
            CountingStore.conflicts += 1
            raise


async def test_a_long_new_list_is_split_into_events() -> None:
    store = es.MemoryEventStore(namespace="small", max_event_bytes=4096)
    saver = ThreadlogCheckpointSaver(store)
    history = [HumanMessage(f"old message {i}: " + "x" * 100, id=f"h{i}") for i in range(120)]
    checkpoint = empty_checkpoint()
    version = saver.get_next_version(None, None)
    checkpoint["channel_values"] = {"messages": history}
    checkpoint["channel_versions"] = {"messages": version}
    metadata: Any = {"source": "input", "step": -1}
    stored = await saver.aput(
        config("long", checkpoint_ns=""), checkpoint, metadata, {"messages": version}
    )
    events = [e async for e in store.read(saver.thread_id_of("long"))]
    runs = [el for e in events if isinstance(e.payload, BlobsPut) for el in e.payload.elements]
    assert len(runs) > 1 and sum(len(r.items) for r in runs) == 120
    tup = await saver.aget_tuple(stored)
    assert tup is not None and tup.checkpoint["channel_values"]["messages"] == history
    assert (await saver.acheck("long")).ok
    # A value too large for one event is refused whole, before anything is written.
    checkpoint = empty_checkpoint()
    checkpoint["channel_values"] = {"doc": "y" * 10_000}
    checkpoint["channel_versions"] = {"doc": version}
    with pytest.raises(es.EventTooLargeError):
        await saver.aput(config("big", checkpoint_ns=""), checkpoint, metadata, {"doc": version})
    assert await store.version(saver.thread_id_of("big")) == 0


def _extended_by_a(saver: Any, seen: Any) -> tuple[Any, str]:
    """A checkpoint saver ``a`` writes from what it saw (``seen``, maybe stale): the same
    checkpoint with one more message of its own, under a new id; and the messages version."""
    checkpoint = copy_checkpoint(seen.checkpoint)
    version = saver.get_next_version(str(checkpoint["channel_versions"]["messages"]), None)
    mine = [*seen.checkpoint["channel_values"]["messages"], AIMessage("a's own", id="own")]
    checkpoint["id"] = str(uuid6(clock_seq=-1))
    checkpoint["channel_values"] = {**checkpoint["channel_values"], "messages": mine}
    checkpoint["channel_versions"] = {**checkpoint["channel_versions"], "messages": version}
    return checkpoint, version


async def test_two_savers_extend_the_same_thread() -> None:
    store = CountingStore(namespace="two")
    a, b = ThreadlogCheckpointSaver(store), ThreadlogCheckpointSaver(store)
    graph_a = growing_graph().compile(checkpointer=a)
    graph_b = growing_graph().compile(checkpointer=b)
    cfg = config("shared")
    cfg["recursion_limit"] = 100
    more_of: Any = lambda n: {"target": n}  # noqa: E731 - a partial state input
    await graph_a.ainvoke({"messages": [], "target": 10}, cfg)
    seen = await a.aget_tuple(config("shared"))  # a knows the history at 10 messages
    assert seen is not None
    await graph_b.ainvoke(more_of(15), cfg)  # b starts cold, loads the parent, extends to 15
    # a now writes a checkpoint from what it saw: its plan for the message list is stale.
    CountingStore.conflicts = 0
    checkpoint, version = _extended_by_a(a, seen)
    metadata: Any = {"source": "update", "step": 11}
    stored = await a.aput(seen.config, checkpoint, metadata, {"messages": version})
    assert CountingStore.conflicts == 1  # refused once, reloaded, written
    got = await b.aget_tuple(stored)
    assert (
        got is not None
        and got.checkpoint["channel_values"]["messages"] == checkpoint["channel_values"]["messages"]
    )
    history = growing_graph().compile(checkpointer=a).aget_state_history(config("shared"))
    lengths = sorted({len(s.values.get("messages", [])) async for s in history})
    assert lengths == list(range(0, 16))  # b's line (to 15) and a's branch (11) both readable
    assert (await a.acheck("shared")).ok

    # Pending writes: b's cached writes of a checkpoint go stale when a adds some.
    tup = await a.aget_tuple(config("shared"))
    assert tup is not None
    await b.aput_writes(tup.config, [("x", 1)], "task-b")
    await a.aput_writes(tup.config, [("x", 2)], "task-a")
    CountingStore.conflicts = 0
    await b.aput_writes(tup.config, [("x", 3), ("y", 4)], "task-c")
    assert CountingStore.conflicts == 1
    tup = await a.aget_tuple(tup.config)
    assert tup is not None and tup.pending_writes is not None
    assert sorted((t, c, v) for t, c, v in tup.pending_writes) == [
        ("task-a", "x", 2),
        ("task-b", "x", 1),
        ("task-c", "x", 3),
        ("task-c", "y", 4),
    ]
    assert (await b.acheck("shared")).ok


async def test_a_saver_caching_a_deleted_life_never_writes_into_the_new_one(
    store: es.EventStore,
) -> None:
    """The ABA of a recreated thread: saver a reads it; b deletes it and writes it again to
    the same point, so its versions, lineage lengths and head field versions are a's again.
    a's put from its cache (guards planned from the old life) must not land there: refused,
    reloaded, written after b's line, which stays whole; the views stay the fold of the log."""
    a, b = ThreadlogCheckpointSaver(store), ThreadlogCheckpointSaver(store)
    cfg = config("reborn")
    cfg["recursion_limit"] = 100
    tid = a.thread_id_of("reborn")
    await growing_graph().compile(checkpointer=a).ainvoke({"messages": [], "target": 5}, cfg)
    seen = await a.aget_tuple(config("reborn"))
    assert seen is not None
    old_life, old_version = await store.incarnation(tid), await store.version(tid)
    await b.adelete_thread("reborn")
    await growing_graph().compile(checkpointer=b).ainvoke({"messages": [], "target": 5}, cfg)
    theirs = await b.aget_tuple(config("reborn"))
    assert theirs is not None
    assert await store.incarnation(tid) != old_life and await store.version(tid) == old_version
    b_messages = theirs.checkpoint["channel_values"]["messages"]
    assert b_messages != seen.checkpoint["channel_values"]["messages"]  # other message ids
    # a writes a checkpoint from what it saw (its cache: the old life's lineages and head).
    checkpoint, version = _extended_by_a(a, seen)
    metadata: Any = {"source": "update", "step": 6}
    stored = await a.aput(seen.config, checkpoint, metadata, {"messages": version})
    # Pending writes from a's cache of the old life's checkpoint go the same way.
    await a.aput_writes(seen.config, [("x", 1)], "task-a")
    assert (await a.acheck("reborn")).ok
    again = await b.aget_tuple(theirs.config)
    assert again is not None and again.checkpoint["channel_values"]["messages"] == b_messages
    got = await b.aget_tuple(stored)
    assert (
        got is not None
        and got.checkpoint["channel_values"]["messages"] == checkpoint["channel_values"]["messages"]
    )


class ReadCounter:
    """Counts a store's ``read_views`` calls (its round trips for view reads)."""

    def __init__(self, store: es.EventStore) -> None:
        self.calls = 0
        inner = store.read_views

        async def counted(thread_id: str, reads: Any) -> es.ViewSnapshot:
            self.calls += 1
            return await inner(thread_id, reads)

        store.read_views = counted  # type: ignore[method-assign]

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls


async def test_reads_take_one_round_trip_and_hints_never_serve_stale_data(
    store: es.EventStore,
) -> None:
    a, b = ThreadlogCheckpointSaver(store), ThreadlogCheckpointSaver(store)
    cfg = config("hinted")
    cfg["recursion_limit"] = 100
    more_of: Any = lambda n: {"target": n}  # noqa: E731 - a partial state input
    await growing_graph().compile(checkpointer=a).ainvoke({"messages": [], "target": 5}, cfg)
    counter = ReadCounter(store)

    async def latest(saver: ThreadlogCheckpointSaver) -> list[Any]:
        tup = await saver.aget_tuple(config("hinted"))
        assert tup is not None
        return cast(list[Any], tup.checkpoint["channel_values"]["messages"])

    # After its own put, a saver reads the latest checkpoint in one round trip.
    assert len(await latest(a)) == 5 and counter.take() == 1
    # A saver that has not seen the thread reads the record, then what it refers to.
    assert await latest(b) == await latest(a)
    assert counter.take() == 3  # b: 2, a: 1
    assert len(await latest(b)) == 5 and counter.take() == 1
    # Another saver moved the thread on: b's hint names the old head's fields. b must return
    # the new head (read in a second round trip), never what its hint remembers.
    await growing_graph().compile(checkpointer=a).ainvoke(more_of(8), cfg)
    counter.take()
    fresh = await latest(b)
    assert counter.take() == 2
    assert len(fresh) == 8 and fresh == await latest(a)
    # By checkpoint id: the record and its writes, then its values; then one round trip.
    tup = await b.aget_tuple(config("hinted"))
    assert tup is not None
    counter.take()
    by_id = await b.aget_tuple(tup.config)
    assert by_id is not None and counter.take() == 2
    assert by_id.checkpoint == tup.checkpoint
    assert await b.aget_tuple(tup.config) == by_id and counter.take() == 1
    # Records that do not hold their list runs (as written before they did) are read through
    # lg.ranges: one round trip more, the same values.
    c = ThreadlogCheckpointSaver(store)
    c._runs = lambda *args: {}  # type: ignore[method-assign]
    await growing_graph().compile(checkpointer=c).ainvoke(more_of(10), cfg)
    counter.take()
    cold = ThreadlogCheckpointSaver(store)
    old_style = await latest(cold)
    assert counter.take() == 3
    assert len(old_style) == 10 and old_style[:8] == fresh
    assert await latest(cold) == old_style and counter.take() == 1
    assert (await a.acheck("hinted")).ok


async def test_elements_are_stored_in_blocks(store: es.EventStore) -> None:
    saver = ThreadlogCheckpointSaver(store)
    tid = saver.thread_id_of("blocks")

    async def put(parent: RunnableConfig, messages: list[Any], versions: dict[str, Any]) -> Any:
        checkpoint = empty_checkpoint()
        checkpoint["id"] = str(uuid6(clock_seq=len(messages)))
        version = saver.get_next_version(versions.get("messages"), None)
        versions = {**versions, "messages": version}
        checkpoint["channel_values"] = {"messages": messages}
        checkpoint["channel_versions"] = versions
        metadata: Any = {"source": "loop", "step": len(messages)}
        stored = await saver.aput(parent, checkpoint, metadata, {"messages": version})
        return stored, versions

    async def values(cfg: RunnableConfig) -> list[Any]:
        tup = await ThreadlogCheckpointSaver(store).aget_tuple(cfg)  # a cold reader
        assert tup is not None
        return cast(list[Any], tup.checkpoint["channel_values"]["messages"])

    async def blocks() -> list[list[int]]:
        """The data sizes of the elements each block of lg.elements holds."""
        snap = await store.read_views(tid, [es.HashGetAll("lg.elements")])
        found = snap.results[0]
        assert isinstance(found, dict)
        return [[len(x[1]) for x in msgspec.msgpack.decode(e.value)] for e in found.values()]

    assert (lg.BLOCK, lg.BLOCK_BYTES) == (8, 32768)  # the figures below follow from these
    # One message per step: 40 elements in five blocks.
    messages: list[Any] = []
    versions: dict[str, Any] = {}
    cfg = config("blocks", checkpoint_ns="")
    saved: dict[int, tuple[RunnableConfig, dict[str, Any]]] = {}
    for i in range(40):
        messages = [*messages, HumanMessage(f"message {i}", id=f"m{i}")]
        cfg, versions = await put(cfg, messages, versions)
        saved[len(messages)] = (cfg, versions)
    assert sorted(len(b) for b in await blocks()) == [8] * 5
    assert await values(cfg) == messages
    # Large elements: a block stops growing at BLOCK_BYTES.
    for i in range(5):
        messages = [*messages, HumanMessage("x" * 30000, id=f"big{i}")]
        cfg, versions = await put(cfg, messages, versions)
    assert await values(cfg) == messages
    sizes = await blocks()
    assert sorted(len(b) for b in sizes) == [1] * 5 + [8] * 5  # one 30000-byte element each
    assert max(sum(b) for b in sizes) < 32768
    # A branch from step 20: the lineage's last block holds the other branch's elements, so
    # the branch's new element starts the next block (index 80), not index 73.
    branch_cfg, branch_versions = saved[20]
    branch = [*messages[:20], HumanMessage("another way", id="b")]
    branch_cfg, _ = await put(branch_cfg, branch, branch_versions)
    assert sorted(len(b) for b in await blocks()) == [1] * 6 + [8] * 5
    assert await values(branch_cfg) == branch
    assert await values(cfg) == messages
    assert (await saver.acheck("blocks")).ok
    # The fold makes the same blocks: rebuild, then read again.
    await Projector(store, [saver.projection]).rebuild(tid)
    assert await values(cfg) == messages and await values(branch_cfg) == branch


async def test_prune_then_continue(store: es.EventStore) -> None:
    saver = ThreadlogCheckpointSaver(store)
    graph = growing_graph().compile(checkpointer=saver)
    cfg = config("p")
    cfg["recursion_limit"] = 100
    more_of: Any = lambda n: {"target": n}  # noqa: E731
    await graph.ainvoke({"messages": [], "target": 10}, cfg)
    before = await store.version(saver.thread_id_of("p"))
    count = len([t async for t in saver.alist(config("p"))])
    await saver.aprune(["p"])
    assert len([t async for t in saver.alist(config("p"))]) == 1
    final = await graph.ainvoke(more_of(15), cfg)
    assert [m.content.split(":")[0] for m in final["messages"]] == [
        f"message {i}" for i in range(15)
    ]
    assert (await saver.acheck("p")).ok
    # The log kept the pruned checkpoints: the fold before the prune still has all of them.
    folded = await Projector(store, [saver.projection]).fold(saver.thread_id_of("p"), as_of=before)
    assert len(folded.states["langgraph"].hashes["lg.checkpoints"]) == count > 10


def _add_all(state: Any, writes: Any) -> Any:
    out: Any = list(state)
    for w in writes:
        out = add_messages(out, w)
    return out


class DeltaState(TypedDict):
    messages: Annotated[list[AnyMessage], DeltaChannel(_add_all, snapshot_frequency=5)]
    target: int


def delta_speak(state: DeltaState) -> dict[str, Any]:
    n = len(state["messages"])
    return {"messages": [AIMessage(f"m{n}", id=f"m{n}")]}


def delta_more(state: DeltaState) -> str:
    return "speak" if len(state["messages"]) < state["target"] else END


def delta_graph() -> StateGraph[DeltaState]:
    builder = StateGraph(DeltaState)
    builder.add_node("speak", delta_speak)
    builder.add_edge(START, "speak")
    builder.add_conditional_edges("speak", delta_more, ["speak", END])
    return builder


async def test_delta_channels_match_in_memory_saver(store: es.EventStore) -> None:
    builder = delta_graph()
    cfg = config("delta")
    cfg["recursion_limit"] = 100
    start: Any = {"messages": [], "target": 12}
    results = []
    for saver in (InMemorySaver(), ThreadlogCheckpointSaver(store)):
        graph = builder.compile(checkpointer=saver)
        await graph.ainvoke(start, cfg)
        results.append(summary([s async for s in graph.aget_state_history(config("delta"))]))
    assert results[0] == results[1]


async def test_prune_keeps_what_delta_channels_are_rebuilt_from(store: es.EventStore) -> None:
    """A delta channel's value at the latest checkpoint is rebuilt from its ancestors' writes
    back to its last snapshot: ``keep_latest`` keeps those (only those), and the graph goes
    on from the same messages (it started again from none when they were dropped)."""
    builder = delta_graph()
    saver = ThreadlogCheckpointSaver(store)
    graph = builder.compile(checkpointer=saver)
    cfg = config("delta-prune")
    cfg["recursion_limit"] = 100
    start: Any = {"messages": [], "target": 7}
    await graph.ainvoke(start, cfg)
    before = [m.content for m in (await graph.aget_state(cfg)).values["messages"]]
    assert before == [f"m{i}" for i in range(7)]
    history = [s async for s in graph.aget_state_history(cfg)]
    counters = [(s.metadata or {}).get("counters_since_delta_snapshot", {}) for s in history]
    # The latest checkpoint back to the nearest whose counters do not name the channel.
    needed = next(i for i, c in enumerate(counters) if i and "messages" not in c) + 1
    assert 1 < needed < len(history)  # some ancestors are needed, and some are not
    await saver.aprune(["delta-prune"])
    kept = [s.config["configurable"]["checkpoint_id"] async for s in graph.aget_state_history(cfg)]
    assert kept == [s.config["configurable"]["checkpoint_id"] for s in history[:needed]]
    assert [m.content for m in (await graph.aget_state(cfg)).values["messages"]] == before
    final = await graph.ainvoke(cast(Any, {"target": 9}), cfg)
    assert [m.content for m in final["messages"]] == [f"m{i}" for i in range(9)]
    assert (await saver.acheck("delta-prune")).ok
    # A graph without delta channels keeps the latest checkpoint only (test_prune_then_continue);
    # "delete" drops every one, delta channels or not.
    await saver.aprune(["delta-prune"], strategy="delete")
    assert [s async for s in saver.alist(cfg)] == []


# -- storage growth ---------------------------------------------------------------------------


class Growing(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    target: int


def speak(state: Growing) -> dict[str, Any]:
    n = len(state["messages"])
    return {"messages": [AIMessage(f"message {n}: " + "lorem ipsum dolor sit amet " * 4)]}


def more(state: Growing) -> str:
    return "speak" if len(state["messages"]) < state["target"] else END


def growing_graph() -> StateGraph[Growing]:
    builder = StateGraph(Growing)
    builder.add_node("speak", speak)
    builder.add_edge(START, "speak")
    builder.add_conditional_edges("speak", more, ["speak", END])
    return builder


async def stored_bytes(store: es.EventStore, tid: str) -> dict[str, int]:
    """Bytes of the thread's log entries and views, and Redis's own count when it has one."""
    log = 0
    start = 1
    while True:
        rows = await store.read_raw(tid, start=start, count=512)
        if not rows:
            break
        log += sum(len(k) + len(v) for _, fields in rows for k, v in fields.items())
        start = int(rows[-1][0].split(b"-")[0]) + 1
    snap = await store.read_views(tid, [es.HashGetAll(v) for v in VIEWS])
    views = sum(
        len(f) + len(e.value) + 12
        for r in snap.results
        if isinstance(r, dict)
        for f, e in r.items()
    )
    out = {"log": log, "views": views, "total": log + views}
    if isinstance(store, es.RedisEventStore):
        keys = list(store.keys.thread_keys(tid)[:3]) + [store.keys.view(tid, v) for v in VIEWS]
        out["redis"] = sum([int(await store.client.memory_usage(k, samples=0) or 0) for k in keys])
    return out


async def grow(
    store: es.EventStore, saver: ThreadlogCheckpointSaver, thread: str, steps: int
) -> dict[str, int]:
    graph = growing_graph().compile(checkpointer=saver)
    cfg = config(thread)
    cfg["recursion_limit"] = steps + 10
    final = await graph.ainvoke({"messages": [], "target": steps}, cfg)
    assert len(final["messages"]) == steps
    state = await graph.aget_state(cfg)
    assert state.values["messages"] == final["messages"]
    assert state.metadata is not None and state.metadata["step"] == steps
    return await stored_bytes(store, saver.thread_id_of(thread))


async def test_storage_grows_linearly(
    store: es.EventStore, capsys: pytest.CaptureFixture[str]
) -> None:
    saver = ThreadlogCheckpointSaver(store)
    half = await grow(store, saver, "grow-100", 100)
    full = await grow(store, saver, "grow-200", 200)
    whole = ThreadlogCheckpointSaver(store, dedupe_lists=False)
    half_whole = await grow(store, whole, "whole-100", 100)
    full_whole = await grow(store, whole, "whole-200", 200)
    ratio = full["total"] / half["total"]
    ratio_whole = full_whole["total"] / half_whole["total"]
    with capsys.disabled():
        client = type(store.client).__name__ if isinstance(store, es.RedisEventStore) else ""
        print(f"\nstorage growth on {type(store).__name__} {client}:")
        for name, figures in [
            ("lists deduplicated, 100 steps", half),
            ("lists deduplicated, 200 steps", full),
            ("lists stored whole, 100 steps", half_whole),
            ("lists stored whole, 200 steps", full_whole),
        ]:
            print(f"  {name}: {figures}")
        print(f"  ratio 200/100 steps: {ratio:.2f} deduplicated, {ratio_whole:.2f} whole")
        print(f"  bytes per step (steps 101-200): {(full['total'] - half['total']) / 100:.0f}")
    # Linear growth doubles the bytes when the steps double; quadratic growth quadruples them.
    assert ratio < 2.4
    assert ratio_whole > 3.0  # the measure does tell the two apart
    # Each step adds about as much as the one before it, whatever the history's length.
    first, second = half["total"] / 100, (full["total"] - half["total"]) / 100
    assert 0.8 < second / first < 1.25


# -- regressions ------------------------------------------------------------------------------


class Todo(TypedDict):
    todo: list[str]  # a plain list channel: each update replaces it
    n: int


def todo_graph() -> StateGraph[Todo]:
    builder = StateGraph(Todo)
    builder.add_node("noop", lambda state: {})
    builder.add_edge(START, "noop")
    builder.add_edge("noop", END)
    return builder


async def test_an_emptied_list_grows_again_under_cold_savers(store: es.EventStore) -> None:
    # Each update by a saver that knows nothing yet (a new process per step, a fork), as
    # InMemorySaver does it. The list becomes [] and is extended again: a cold read of the
    # empty value used to cache its lineage as empty, and every later put conflicted.
    updates: list[Any] = [{"todo": ["a", "b"]}, {"todo": []}, {"n": 1}, {"todo": ["c"]}]
    memory = todo_graph().compile(checkpointer=InMemorySaver())
    cfg = config("todo")
    past: list[RunnableConfig] = []
    for update in updates:
        expected = await memory.aupdate_state(cfg, update)
        graph = todo_graph().compile(checkpointer=ThreadlogCheckpointSaver(store))
        past.append(await graph.aupdate_state(cfg, update))
        assert (await graph.aget_state(cfg)).values == (await memory.aget_state(cfg)).values
        assert expected is not None
    # A fork from the checkpoint where the list was empty, then cold savers again.
    graph = todo_graph().compile(checkpointer=ThreadlogCheckpointSaver(store))
    await graph.aupdate_state(past[2], {"n": 2})
    for update in [{"todo": ["d"]}, {"todo": ["d", "e"]}]:
        graph = todo_graph().compile(checkpointer=ThreadlogCheckpointSaver(store))
        await graph.aupdate_state(cfg, cast(Any, update))
        assert (await graph.aget_state(cfg)).values == {**cast(Any, update), "n": 2}
    assert (await ThreadlogCheckpointSaver(store).acheck("todo")).ok


async def test_the_latest_checkpoint_is_the_one_with_the_highest_id(store: es.EventStore) -> None:
    ids = sorted(str(uuid6(clock_seq=i)) for i in range(4))

    def checkpoint(i: int) -> Any:
        c = empty_checkpoint()
        c["id"] = ids[i]
        c["channel_versions"] = {"x": f"{i + 1}"}
        c["channel_values"] = {"x": i}
        return c

    base = config("h", checkpoint_ns="")
    a, b = ThreadlogCheckpointSaver(store), ThreadlogCheckpointSaver(store)
    memory = InMemorySaver()
    # Written out of id order: by one saver, then by a second that knew an older head.
    order: list[tuple[BaseCheckpointSaver[Any], int]] = [(a, 2), (a, 0), (b, 1), (a, 3)]
    await b.aget_tuple(base)  # b knows there is no head yet
    for saver, i in order:
        for s in (saver, memory):
            await s.aput(base, checkpoint(i), cast(Any, {"step": i}), {"x": f"{i + 1}"})
        latest = [await s.aget_tuple(base) for s in (memory, a, b, ThreadlogCheckpointSaver(store))]
        assert {t.config["configurable"]["checkpoint_id"] for t in latest if t} == {
            max(ids[j] for _, j in order[: order.index((saver, i)) + 1])
        }
    steps = [t.metadata["step"] async for t in a.alist(base)]
    assert steps == [t.metadata["step"] for t in memory.list(base)] == [3, 2, 1, 0]
    assert (await a.acheck("h")).ok
    # Removing the head leaves the next highest id as the head, in the views and the fold.
    await a.aprune(["h"], strategy="keep_latest")
    tup = await ThreadlogCheckpointSaver(store).aget_tuple(base)
    assert tup is not None and tup.checkpoint["id"] == ids[3]
    assert (await a.acheck("h")).ok


UNCLOSED = textwrap.dedent(
    """
    import sys
    from adapters.langgraph import ThreadlogCheckpointSaver
    from tests.test_langgraph import ask, review_graph

    url, namespace = sys.argv[1:3]
    saver = ThreadlogCheckpointSaver.from_url(url, namespace=namespace)
    graph = review_graph().compile(checkpointer=saver)
    graph.invoke(ask("write a post"), {"configurable": {"thread_id": "t"}})
    if sys.argv[3:] == ["collect"]:
        import gc, threading

        del graph, saver
        gc.collect()
        assert not [t for t in threading.enumerate() if t.name == "threadlog-langgraph-saver"]
    print("exiting", flush=True)
    if sys.argv[3:] == ["raise"]:
        raise RuntimeError("an error the application did not catch")
    """
)


@pytest.mark.parametrize("how", ["return", "raise", "collect"])
async def test_an_unclosed_sync_saver_lets_the_interpreter_exit(
    redis_url: str, namespace: str, how: str
) -> None:
    # The saver's loop thread used to be a non-daemon thread, joined at exit: forever.
    with anyio.fail_after(60):
        result = await anyio.run_process(
            [sys.executable, "-X", "dev", "-c", UNCLOSED, redis_url, namespace, how],
            cwd=ROOT,
            check=False,
        )
    assert result.stdout.decode().strip() == "exiting"
    assert result.returncode == (1 if how == "raise" else 0), result.stderr
    assert b"nclosed" not in result.stderr, result.stderr  # the store it opened was closed


def test_a_collected_sync_saver_stops_its_loop_thread(redis_url: str, namespace: str) -> None:
    def threads() -> int:
        return sum(t.name == "threadlog-langgraph-saver" for t in threading.enumerate())

    before = threads()
    saver = ThreadlogCheckpointSaver.from_url(redis_url, namespace=namespace)
    assert saver.get_tuple(config("x")) is None
    assert threads() == before + 1
    del saver
    gc.collect()
    assert threads() == before
    # close() still works, and the saver can be used again after it.
    with ThreadlogCheckpointSaver.from_url(redis_url, namespace=namespace) as saver:
        assert saver.get_tuple(config("x")) is None
        saver.close()
        assert saver.get_tuple(config("x")) is None
    assert threads() == before


def test_each_asyncio_run_closes_the_store_it_opened(redis_url: str, namespace: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    saver = ThreadlogCheckpointSaver.from_url(redis_url, namespace=namespace)
    graph = review_graph().compile(checkpointer=saver)
    try:
        before = len(admin.client_list())
        for i in range(10):
            asyncio.run(graph.ainvoke(ask(f"post {i}"), config(f"run-{i}")))
        gc.collect()
        assert len(admin.client_list()) == before  # one client per run used to stay open
        assert len(saver._opened) == 0

        async def explicit() -> None:
            await graph.ainvoke(ask("post"), config("explicit"))
            await saver.aclose()

        asyncio.run(explicit())
        assert len(admin.client_list()) == before
    finally:
        saver.close()
        admin.close()


class Big(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def big_graph(size: int) -> StateGraph[Big]:
    def tool(state: Big) -> dict[str, Any]:
        n = len(state["messages"])
        return {"messages": [AIMessage("z" * size, id=f"big-{n}")]}

    builder = StateGraph(Big)
    builder.add_node("tool", tool)
    builder.add_edge(START, "tool")
    builder.add_edge("tool", END)
    return builder


async def test_a_value_over_the_event_limit_is_refused_with_a_clear_error(
    store: es.EventStore,
) -> None:
    saver = ThreadlogCheckpointSaver(store)
    limit = store.max_event_bytes
    big = "y" * (limit + 1000)
    base = config("big", checkpoint_ns="")
    checkpoint = empty_checkpoint()
    for values in ({"doc": big}, {"log": ["small", big]}):
        checkpoint["channel_values"] = values
        versions = dict.fromkeys(values, "1")
        with pytest.raises(lg.CheckpointValueTooLargeError, match="max_event_bytes") as caught:
            await saver.aput(base, checkpoint, cast(Any, {}), cast(Any, versions))
        assert caught.value.channel in values and caught.value.limit == limit
        assert isinstance(caught.value, es.EventTooLargeError)
    assert await store.version(saver.thread_id_of("big")) == 0  # nothing written
    checkpoint["channel_values"] = {}
    # Metadata over the limit (LangGraph copies the config's strings into it): said so.
    with pytest.raises(lg.CheckpointValueTooLargeError, match=r"metadata.*config") as caught:
        await saver.aput(base, checkpoint, cast(Any, {"note": big}), {})
    assert (caught.value.kind, caught.value.channel) == ("metadata", "")
    assert await store.version(saver.thread_id_of("big")) == 0
    stored = await saver.aput(base, checkpoint, cast(Any, {}), {})
    with pytest.raises(lg.CheckpointValueTooLargeError, match="'out'"):
        await saver.aput_writes(stored, [("small", 1), ("out", big)], "task")
    assert await store.version(saver.thread_id_of("big")) == 1
    # Writes each under the limit but over it together are stored in several events.
    half = "w" * (limit // 2)
    await saver.aput_writes(stored, [("a", half), ("b", half), ("c", 3)], "task")
    tup = await ThreadlogCheckpointSaver(store).aget_tuple(stored)
    assert tup is not None and tup.pending_writes == [
        ("task", "a", half),
        ("task", "b", half),
        ("task", "c", 3),
    ]
    assert (await saver.acheck("big")).ok
    # In a graph: the step fails with the error, and nothing of it is stored.
    graph = big_graph(limit + 1000).compile(checkpointer=saver)
    with pytest.raises(lg.CheckpointValueTooLargeError, match="'messages'"):
        await graph.ainvoke(ask("hi"), config("g"))
    assert (await graph.aget_state(config("g"))).next == ("tool",)


async def test_the_event_limit_can_be_raised(redis_url: str, namespace: str) -> None:
    def run(saver: BaseCheckpointSaver[Any]) -> list[int]:
        graph = big_graph(3_000_000).compile(checkpointer=saver)
        graph.invoke(ask("hi"), config("big"))
        return [len(str(m.content)) for m in graph.get_state(config("big")).values["messages"]]

    with ThreadlogCheckpointSaver.from_url(
        redis_url, namespace=namespace, max_event_bytes=4 * 1024 * 1024
    ) as saver:
        assert await anyio.to_thread.run_sync(run, saver) == run(InMemorySaver())
        assert (await anyio.to_thread.run_sync(saver.check, "big")).ok


async def test_kilobyte_messages_keep_one_run_and_a_constant_step(store: es.EventStore) -> None:
    # Blocks used to close early past 8 KiB (about seven 1 KiB messages): each left unused
    # indices, which split the history into one run per block, and every later checkpoint
    # repeated all its runs, so the bytes per step rose with the history.
    def long_speak(state: Growing) -> dict[str, Any]:
        n = len(state["messages"])
        return {"messages": [AIMessage(f"message {n}: " + "lorem ipsum " * 250)]}  # 3 KB

    builder = StateGraph(Growing)
    builder.add_node("speak", long_speak)
    builder.add_edge(START, "speak")
    builder.add_conditional_edges("speak", more, ["speak", END])
    saver = ThreadlogCheckpointSaver(store)
    graph = builder.compile(checkpointer=saver)
    tid = saver.thread_id_of("long")
    totals = []
    for target in (40, 80, 120):
        cfg = config("long")
        cfg["recursion_limit"] = 200
        await graph.ainvoke({"messages": [], "target": target}, cfg)
        totals.append((await stored_bytes(store, tid))["total"])
    snap = await store.read_views(tid, [es.HashGet(lg.HEADS, ("",))])
    head = snap.results[0]
    assert isinstance(head, dict)
    record = msgspec.msgpack.decode(head[""].value, type=Record)
    assert record.lists["messages"] == [(0, 120)]
    first, second = totals[1] - totals[0], totals[2] - totals[1]
    assert abs(second - first) / first < 0.01  # 40 steps cost the same later as earlier


async def test_the_empty_thread_id_is_a_thread_as_in_memory_saver(store: es.EventStore) -> None:
    saver = ThreadlogCheckpointSaver(store)
    results = []
    for checkpointer in (InMemorySaver(), saver):
        graph = review_graph().compile(checkpointer=checkpointer)
        await graph.ainvoke(ask("post"), config(""))
        await graph.ainvoke(Command(resume="yes"), config(""))
        state = await graph.aget_state(config(""))
        history = [s async for s in graph.aget_state_history(config(""))]
        contents = [m.content for m in state.values["messages"]]
        results.append((contents, state.values["approved"], state.next, len(history)))
    assert results[0] == results[1]
    assert saver.thread_id_of("") == "lg:"
    assert {t.config["configurable"]["thread_id"] async for t in saver.alist(None)} == {""}
    assert (await saver.acheck("")).ok
    await saver.acopy_thread("", "copy")
    assert (await saver.aget_tuple(config("copy"))) is not None
    await saver.adelete_thread("")
    assert await saver.aget_tuple(config("")) is None
    # None is a missing id, not a thread (str(None) would share the thread "None").
    with pytest.raises(es.InvalidThreadIdError, match="None"):
        await saver.aput(config(cast(Any, None)), empty_checkpoint(), cast(Any, {}), {})


class Outer(TypedDict):
    notes: Annotated[list[str], operator.add]


def nested_graph(checkpointer: BaseCheckpointSaver[Any]) -> CompiledStateGraph[Any]:
    inner = StateGraph(Outer)
    inner.add_node("a", lambda s: {"notes": ["inner a"]})
    inner.add_node("b", lambda s: {"notes": ["inner b"]})
    inner.add_edge(START, "a")
    inner.add_edge("a", "b")
    inner.add_edge("b", END)
    outer = StateGraph(Outer)
    outer.add_node("first", lambda s: {"notes": ["first"]})
    outer.add_node("sub", inner.compile(checkpointer=True))
    outer.add_edge(START, "first")
    outer.add_edge("first", "sub")
    outer.add_edge("sub", END)
    return outer.compile(checkpointer=checkpointer)


async def test_list_across_namespaces_in_in_memory_saver_order(store: es.EventStore) -> None:
    orders = []
    for saver in (InMemorySaver(), ThreadlogCheckpointSaver(store)):
        graph = nested_graph(saver)
        for i in range(2):
            await graph.ainvoke({"notes": [f"run {i}"]}, config("n"))
        listed = [t async for t in saver.alist(config("n"))]
        namespaces = [t.config["configurable"]["checkpoint_ns"].split(":")[0] for t in listed]
        steps = [(ns, t.metadata["step"]) for ns, t in zip(namespaces, listed, strict=True)]
        limited = [t.metadata["step"] async for t in saver.alist(config("n"), limit=7)]
        orders.append((steps, limited))
    assert orders[0] == orders[1]
    assert orders[1][0][0][0] == ""  # the root namespace first, as it was written first


def test_a_copy_made_by_with_allowlist_shares_the_sync_bridge(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With LANGGRAPH_STRICT_MSGPACK set, LangGraph compiles a graph with
    # `checkpointer.with_allowlist(...)`: a shallow copy of the saver. Closing the saver the
    # user holds must close what the graph's copy runs on, and the graph must still work after.
    from langgraph._internal import _serde
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    monkeypatch.setattr(_serde, "STRICT_MSGPACK_ENABLED", True)
    strict = JsonPlusSerializer(allowed_msgpack_modules=None)  # what the variable makes

    def threads() -> int:
        return sum(t.name == "threadlog-langgraph-saver" for t in threading.enumerate())

    before = threads()
    saver = ThreadlogCheckpointSaver.from_url(redis_url, namespace=namespace, serde=strict)
    try:
        assert saver.get_tuple(config("x")) is None  # the saver's loop is running
        graph = review_graph().compile(checkpointer=saver)
        assert graph.checkpointer is not saver  # the copy
        graph.invoke(ask("one"), config("a"))
        saver.close()
        assert threads() == before
        # It used to raise "This portal is not running": the copy kept the stopped loop.
        graph.invoke(ask("two"), config("b"))
        assert graph.get_state(config("b")).next == ("review",)
        saver.close()
        assert threads() == before
        # And the other way round: a copy made before the saver's loop started.
        fresh = ThreadlogCheckpointSaver.from_url(redis_url, namespace=namespace, serde=strict)
        other = review_graph().compile(checkpointer=fresh)
        other.invoke(ask("three"), config("c"))
        assert threads() == before + 1
        fresh.close()  # used to leave the copy's loop thread and its connection running
        assert threads() == before
    finally:
        saver.close()


class StallingStore(es.MemoryEventStore):
    """The append to ``stall_thread`` after ``after`` of them have landed hangs after landing
    (or, with ``fail``, raises without landing): a copy interrupted half way."""

    stall_thread = ""
    after = 1
    fail = False

    async def append(self, thread_id: str, *args: Any, **kwargs: Any) -> es.AppendResult:
        if thread_id == self.stall_thread:
            if self.after <= 0:
                self.stall_thread = ""  # once
                if self.fail:
                    raise es.StoreConnectionError("connection lost")
                # Lands, then hangs: the caller cannot tell it landed.
                await super().append(thread_id, *args, **kwargs)
                await anyio.sleep_forever()
            self.after -= 1
        return await super().append(thread_id, *args, **kwargs)


@pytest.mark.parametrize("how", ["cancelled", "failed"])
async def test_an_interrupted_copy_leaves_no_partial_target(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    monkeypatch.setattr(lg, "COPY_CHUNK", 4)
    store = StallingStore(namespace="copy")
    saver = ThreadlogCheckpointSaver(store)
    graph = todo_graph().compile(checkpointer=saver)
    for i in range(6):
        await graph.ainvoke({"todo": [f"task {i}"], "n": i}, config("src"))
    expected = (await graph.aget_state(config("src"))).values
    store.stall_thread = saver.thread_id_of("dst")
    store.after, store.fail = 2, how == "failed"
    # The copy used to leave the chunks written so far: a target whose latest checkpoint was
    # an old state of the source, and a second copy refused ("not empty").
    if how == "cancelled":
        with anyio.move_on_after(0.5) as scope:
            await saver.acopy_thread("src", "dst")
        assert scope.cancelled_caught
    else:
        with pytest.raises(es.StoreConnectionError):
            await saver.acopy_thread("src", "dst")
    assert await saver.aget_tuple(config("dst")) is None
    assert [e async for e in store.read(saver.thread_id_of("dst"))] == []
    await saver.acopy_thread("src", "dst")
    assert (await graph.aget_state(config("dst"))).values == expected


async def test_a_copy_whose_target_is_replaced_half_way_leaves_the_new_target_alone(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between two chunks of a copy, the target deleted and written again up to the copy's
    version by someone else: the next chunk used to land on that other thread (its expected
    version matched), and the undo of a failed copy would have deleted it."""
    monkeypatch.setattr(lg, "COPY_CHUNK", 4)
    saver = ThreadlogCheckpointSaver(store)
    graph = todo_graph().compile(checkpointer=saver)
    for i in range(6):
        await graph.ainvoke({"todo": [f"task {i}"], "n": i}, config("src"))
    dst = saver.thread_id_of("dst")
    real_append = store.append
    foreign: list[es.RecordedEvent] = []

    async def append(thread_id: str, events: Any, **kwargs: Any) -> es.AppendResult:
        if thread_id == dst and isinstance(kwargs.get("expected_version"), int) and not foreign:
            # The copy's first chunk landed: another writer replaces the target, up to the
            # same version, with events of its own.
            version = kwargs["expected_version"]
            await store.delete_thread(dst, views=list(lg.VIEWS))
            filler = [es.StateUpdated(block="other", value=i) for i in range(version)]
            await real_append(dst, [es.NewEvent(payload=e) for e in filler])
            foreign.extend([e async for e in store.read(dst)])
        return await real_append(thread_id, events, **kwargs)

    monkeypatch.setattr(store, "append", append)
    with pytest.raises(es.IncarnationConflictError):
        await saver.acopy_thread("src", "dst")
    assert foreign and [e async for e in store.read(dst)] == foreign  # untouched, not undone


def test_sync_list_is_read_as_it_is_consumed(monkeypatch: pytest.MonkeyPatch) -> None:
    # As InMemorySaver's list, a generator: `next(saver.list(cfg))` used to build every
    # checkpoint of the thread, each with all its channel values, first. (LangGraph's own
    # get_state_history reads the whole list before it yields: it is not lazy either way.)
    resolved: list[int] = []
    resolve = ThreadlogCheckpointSaver._resolve

    async def counting(self: ThreadlogCheckpointSaver, *args: Any, **kwargs: Any) -> Any:
        resolved.append(len(args[3]))
        return await resolve(self, *args, **kwargs)

    monkeypatch.setattr(ThreadlogCheckpointSaver, "_resolve", counting)
    with ThreadlogCheckpointSaver(es.MemoryEventStore(namespace="lazy")) as saver:
        graph = todo_graph().compile(checkpointer=saver)
        for i in range(40):
            graph.invoke({"todo": [f"task {i}"], "n": i}, config("t"))
        resolved.clear()
        listed = saver.list(config("t"))
        assert next(listed).checkpoint["channel_values"] == {"todo": ["task 39"], "n": 39}
        assert sum(resolved) <= 32  # one page
        assert len([next(listed) for _ in range(39)]) == 39
        listed.close()  # closes the async generator on the saver's loop
        assert len(list(saver.list(config("t")))) == 120
        assert [t.metadata["step"] for t in saver.list(config("t"), limit=2)] == [118, 117]
        assert list(saver.list(config("nothing"))) == []


class NonceCipher:
    """A cipher with a fresh random nonce per encryption, as LangGraph's AES-EAX one: the same
    value encrypts to other bytes every time. (A keystream from the nonce; a test stand-in,
    not encryption.)"""

    def encrypt(self, plaintext: bytes) -> tuple[str, bytes]:
        nonce = uuid.uuid4().bytes
        return "test", nonce + bytes(b ^ nonce[i % 16] for i, b in enumerate(plaintext))

    def decrypt(self, ciphername: str, ciphertext: bytes) -> bytes:
        assert ciphername == "test"
        nonce, body = ciphertext[:16], ciphertext[16:]
        return bytes(b ^ nonce[i % 16] for i, b in enumerate(body))


async def test_storage_grows_linearly_with_an_encrypting_serde(store: es.EventStore) -> None:
    # List elements are matched with the stored ones by their bytes; encrypted with a fresh
    # nonce, no element ever matched, and every step stored the whole history again.
    from langgraph.checkpoint.serde.encrypted import EncryptedSerializer

    serde = EncryptedSerializer(NonceCipher())
    saver = ThreadlogCheckpointSaver(store, serde=serde)
    half = await grow(store, saver, "enc-50", 50)
    full = await grow(store, saver, "enc-100", 100)
    assert full["total"] / half["total"] < 2.4  # it was 3.8: quadratic
    # Everything stored is encrypted (nothing of the plain text is in the log), reads decrypt,
    # cold savers (new processes) extend the history, and the views are the log's fold.
    thread = saver.thread_id_of("enc-100")
    raw = [fields async for fields in raw_entries(store, thread)]
    assert raw and not any(b"lorem ipsum" in v for fields in raw for v in fields.values())
    graph = growing_graph().compile(checkpointer=ThreadlogCheckpointSaver(store, serde=serde))
    cfg = config("enc-100")
    before = (await graph.aget_state(cfg)).values["messages"]
    await graph.aupdate_state(cfg, {"messages": [AIMessage("one more", id="x")]})
    after = (await graph.aget_state(cfg)).values["messages"]
    assert after == [*before, AIMessage("one more", id="x")]
    history = [s async for s in growing_graph().compile(checkpointer=saver).aget_state_history(cfg)]
    assert [len(s.values.get("messages", [])) for s in history[:3]] == [101, 100, 99]
    assert (await saver.acheck("enc-100")).ok


async def raw_entries(store: es.EventStore, thread: str) -> AsyncIterator[dict[bytes, bytes]]:
    start = 1
    while rows := await store.read_raw(thread, start=start, count=512):
        for _, fields in rows:
            yield fields
        start = int(rows[-1][0].split(b"-")[0]) + 1


class Split(TypedDict):
    log: Annotated[list[str], operator.add]


def crashing_graph(checkpointer: BaseCheckpointSaver[Any], runs: dict[str, int]) -> Any:
    """``a``, then ``b`` and ``c`` in one step (``c`` fails while ``runs["fail"]``, once ``b``
    has finished and its writes have had time to be stored), then ``d``."""
    b_done = threading.Event()

    def node(name: str) -> Any:
        def run(state: Split) -> dict[str, Any]:
            runs[name] = runs.get(name, 0) + 1
            if name == "c" and runs.get("fail"):
                # b and c run at once, each in a thread: failing before b's writes are stored
                # would test the scheduler (which Python 3.12 orders differently from 3.11),
                # not the saver. A write takes a millisecond; 0.3 s is ample.
                assert b_done.wait(10), "b did not finish"
                time.sleep(0.3)
                raise RuntimeError("the process died in the middle of the step")
            if name == "b":
                b_done.set()
            return {"log": [name]}

        return run

    builder = StateGraph(Split)
    for name in "abcd":
        builder.add_node(name, node(name))
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("a", "c")
    builder.add_edge(["b", "c"], "d")
    builder.add_edge("d", END)
    return builder.compile(checkpointer=checkpointer)


async def test_a_step_that_fails_half_way_keeps_the_writes_of_its_finished_tasks(
    store: es.EventStore,
) -> None:
    outcomes = []
    for saver in (InMemorySaver(), ThreadlogCheckpointSaver(store)):
        runs = {"fail": 1}
        graph = crashing_graph(saver, runs)
        with pytest.raises(RuntimeError, match="died"):
            await graph.ainvoke({"log": []}, config("crash"))
        # A new process resumes: b's writes were stored as pending writes of the step's
        # checkpoint, so only c runs again.
        fresh = (
            ThreadlogCheckpointSaver(store)
            if isinstance(saver, ThreadlogCheckpointSaver)
            else saver
        )
        graph = crashing_graph(fresh, runs)
        state = await graph.aget_state(config("crash"))
        failed = [(t.name, t.error is not None) for t in state.tasks]
        del runs["fail"]
        done = await graph.ainvoke(None, config("crash"))
        outcomes.append((state.next, failed, done, dict(runs)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[1][3] == {"a": 1, "b": 1, "c": 2, "d": 1}


class Fan(TypedDict):
    notes: Annotated[list[str], operator.add]


def fan_graph(checkpointer: BaseCheckpointSaver[Any], width: int, runs: dict[int, int]) -> Any:
    """``width`` tasks in one step (the Send API), each writing ~1 KB; the last one fails
    while ``runs[-1]`` is set."""

    def fan(state: Fan) -> Any:
        return [Send("work", {"i": i}) for i in range(width)]

    def work(arg: Any) -> dict[str, Any]:
        i = arg["i"]
        runs[i] = runs.get(i, 0) + 1
        if i == width - 1 and runs.get(-1):
            raise RuntimeError("the last task failed")
        return {"notes": [f"{i:04}:" + "x" * 1000]}

    builder = StateGraph(Fan)
    builder.add_node("work", cast(Any, work))
    builder.add_conditional_edges(START, fan, ["work"])
    builder.add_edge("work", END)
    return builder.compile(checkpointer=checkpointer)


async def test_a_wide_step_writes_each_pending_write_about_once(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A step's pending writes were kept in one view field, rewritten whole by every task's
    # put_writes: a step of n tasks wrote O(n^2) bytes (800 tasks of 1 KB: 357 MB sent to
    # Redis and 5.3 s, against 0.4 s for InMemorySaver).
    width = 300
    written = 0
    append = store.append

    async def counting(*args: Any, **kwargs: Any) -> es.AppendResult:
        nonlocal written
        written += sum(
            len(op.value)
            for op in kwargs.get("view_ops", ())
            if isinstance(op, es.HashSet) and op.view.startswith("lg.writes")
        )
        return await append(*args, **kwargs)

    monkeypatch.setattr(store, "append", counting)
    outcomes = []
    savers: list[BaseCheckpointSaver[Any]] = [InMemorySaver(), ThreadlogCheckpointSaver(store)]
    for saver in savers:
        runs = {-1: 1}
        graph = fan_graph(saver, width, runs)
        with pytest.raises(RuntimeError, match="last task"):
            await graph.ainvoke({"notes": []}, config("wide"))
        # Resumed by a new saver: every finished task's write is read back, only the failed
        # task runs again.
        if isinstance(saver, ThreadlogCheckpointSaver):
            saver = ThreadlogCheckpointSaver(store)
        graph = fan_graph(saver, width, runs)
        state = await graph.aget_state(config("wide"))
        del runs[-1]
        done = await graph.ainvoke(None, config("wide"))
        outcomes.append((len(state.tasks), done, dict(runs)))
    assert outcomes[0] == outcomes[1]
    assert outcomes[1][2] == {**dict.fromkeys(range(width - 1), 1), width - 1: 2}
    # Each write is stored about 8 times over (a chunk is rewritten as it fills), whatever the
    # width; it was ~50 MB here: each write ~170 times, the step's width over two.
    assert written < 12 * width * 1000, written
    assert (await ThreadlogCheckpointSaver(store).acheck("wide")).ok
    # The views of a removal depend on the chunks stored: only the saver can make them.
    removal = CheckpointsRemoved(reason="test", checkpoints=[], heads={}, unreferenced=[])
    with pytest.raises(es.InvalidInputError, match="through ThreadlogCheckpointSaver"):
        lg.LangGraphProjection().ops([es.NewEvent(payload=removal)])
    await ThreadlogCheckpointSaver(store).aprune(["wide"], strategy="delete")
    assert (await ThreadlogCheckpointSaver(store).acheck("wide")).ok
    thread = checkpoint_thread_id("wide")
    left = await store.read_views(thread, [es.HashGetAll(v) for v in VIEWS[:3] + VIEWS[-2:]])
    assert left.results == [{}, {}, {}, {}, {}]  # records, heads, writes and their chunks


async def test_two_processes_write_one_steps_tasks_at_once(redis_url: str, namespace: str) -> None:
    # Workers of two processes storing the writes of one step's tasks (a distributed fan-out):
    # each refused write was retried at once, the two collided again in lockstep, and a
    # writer ran out of attempts (ViewConflictError).
    stores = [await es.connect(redis_url, namespace=namespace) for _ in range(2)]
    try:
        savers = [ThreadlogCheckpointSaver(s) for s in stores]
        cfg = await savers[0].aput(config("both", checkpoint_ns=""), empty_checkpoint(), {}, {})

        async def work(i: int) -> None:
            await savers[i % 2].aput_writes(cfg, [("notes", f"{i}:" + "x" * 900)], f"task-{i}")

        async with anyio.create_task_group() as tg:
            for i in range(240):
                tg.start_soon(work, i)
        stored = await ThreadlogCheckpointSaver(stores[0]).aget_tuple(cfg)
        assert stored is not None and stored.pending_writes is not None
        assert sorted(int(v.split(":")[0]) for _, _, v in stored.pending_writes) == list(range(240))
        assert (await savers[1].acheck("both")).ok
    finally:
        for s in stores:
            await s.close()
