"""ThreadlogSession against the OpenAI Agents SDK: real Runner runs with a scripted model.

The same conversation runs once on a `ThreadlogSession` and once on the SDK's own
`SQLiteSession`; both must hand the SDK the same history and end with the same items.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from agents import (
    Agent,
    ModelResponse,
    ModelSettings,
    RunConfig,
    Runner,
    RunResult,
    SQLiteSession,
    Usage,
    function_tool,
)
from agents.agent_output import AgentOutputSchemaBase
from agents.handoffs import Handoff
from agents.items import TResponseInputItem, TResponseStreamEvent
from agents.memory import Session, SessionSettings
from agents.models.interface import Model, ModelTracing
from agents.retry import ModelRetrySettings, RetryDecision, RetryPolicyContext
from agents.run_internal.session_persistence import rewind_session_items
from agents.tool import Tool
from anyio.streams.buffered import BufferedByteReceiveStream
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
)
from openai.types.responses.response_prompt_param import ResponsePromptParam

import eventstore as es
from adapters import AccessDenied, CallbackPolicy, Principal, TenantPolicy
from adapters.openai_agents import (
    ITEMS_VIEW,
    ItemPopped,
    ItemsAdded,
    SessionCleared,
    ThreadlogSession,
    encode_item,
    item_digest,
    session_thread_id,
    sweep_idle_sessions,
)
from projections import Projector
from tests._sdk_items import call, say

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).absolute().parent.parent


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[es.EventStore]:
    namespace = "oa" + uuid.uuid4().hex[:12]
    if request.param == "memory":
        opened: es.EventStore = es.MemoryEventStore(namespace=namespace)
    else:
        fixture = "cluster_url" if request.param == "cluster" else "redis_url"
        try:
            url = request.getfixturevalue(fixture)
        except pytest.FixtureLookupError:
            pytest.skip(f"no {fixture} fixture")
        opened = await es.connect(url, namespace=namespace)
    try:
        yield opened
    finally:
        await opened.close()


# -- a scripted model -------------------------------------------------------------------------


class TransientModelError(Exception):
    """Raised by the scripted model where the script says the provider failed."""


Step = list[ResponseOutputMessage | ResponseFunctionToolCall] | Exception


def script() -> list[Step]:
    """What the model answers, call after call (the same for every session under test)."""
    return [
        # turn 1: a tool call, then the answer
        [call("get_weather", {"city": "Paris"}, 1)],
        [say("It is sunny in Paris.", 2)],
        # turn 2: the provider fails once (the runner retries), then two tool calls
        TransientModelError("503 upstream overloaded"),
        [call("get_weather", {"city": "Rome"}, 3), call("get_weather", {"city": "Oslo"}, 4)],
        [say("Rome is sunny, Oslo is snowing.", 5)],
        # turn 3 (to be corrected): answered, then popped with the user's question
        [say("Berlin? Let me guess: rain.", 6)],
        # turn 3 again, corrected
        [call("get_weather", {"city": "Madrid"}, 7)],
        [say("Madrid is sunny.", 8)],
        # turn 4, after clear_session
        [say("Fresh start: hello!", 9)],
    ]


class ScriptedModel(Model):
    """Plays a fixed script; records the input of every call."""

    def __init__(self, steps: list[Step]) -> None:
        self.steps = list(steps)
        self.inputs: list[Any] = []

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> ModelResponse:
        self.inputs.append(json.loads(json.dumps(input)))
        step = self.steps.pop(0)
        if isinstance(step, Exception):
            raise step
        return ModelResponse(output=list(step), usage=Usage(), response_id=None)

    def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None,
        conversation_id: str | None,
        prompt: ResponsePromptParam | None,
    ) -> AsyncIterator[TResponseStreamEvent]:
        raise NotImplementedError("the scripted model does not stream")


WEATHER = {"Paris": "sunny", "Rome": "sunny", "Oslo": "snowing", "Madrid": "sunny"}


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return WEATHER.get(city, "unknown")


def retry_transient(ctx: RetryPolicyContext) -> RetryDecision:
    return RetryDecision(retry=isinstance(ctx.error, TransientModelError), delay=0.0)


def make_agent(model: ScriptedModel) -> Agent[None]:
    return Agent(
        name="forecaster",
        instructions="Answer weather questions with the tool.",
        model=model,
        tools=[get_weather],
        model_settings=ModelSettings(
            retry=ModelRetrySettings(max_retries=2, policy=retry_transient)
        ),
    )


def user(text: str) -> TResponseInputItem:
    return cast(TResponseInputItem, {"role": "user", "content": text})


NO_TRACING = RunConfig(tracing_disabled=True)


async def ask(agent: Agent[None], text: str, session: Session) -> RunResult:
    return await Runner.run(agent, text, session=session, run_config=NO_TRACING)


async def conversation(session: Session) -> dict[str, Any]:
    """One scripted conversation; returns what was observed along the way."""
    model = ScriptedModel(script())
    agent = make_agent(model)
    seen: dict[str, Any] = {"snapshots": [], "popped": [], "finals": []}

    async def snapshot() -> None:
        seen["snapshots"].append(await session.get_items())

    result = await ask(agent, "What's the weather in Paris?", session)
    seen["finals"].append(result.final_output)
    await snapshot()

    result = await ask(agent, "And in Rome and Oslo?", session)
    seen["finals"].append(result.final_output)
    await snapshot()

    # The SDK's retry rewind: the runner persisted this turn's input, then the model call must
    # be replayed, so it removes the input again with pop_item (after checking the tail).
    pending = [user("What about Lisbon?")]
    await session.add_items(pending)
    await rewind_session_items(session, pending)
    await snapshot()

    result = await ask(agent, "What about Berlin?", session)
    seen["finals"].append(result.final_output)
    await snapshot()
    # The user corrects the question: drop the answer and the question, ask again.
    seen["popped"].append(await session.pop_item())
    seen["popped"].append(await session.pop_item())
    await snapshot()
    result = await ask(agent, "What about Madrid?", session)
    seen["finals"].append(result.final_output)
    await snapshot()

    seen["limited"] = [
        await session.get_items(limit=3),
        await session.get_items(limit=0),
        await session.get_items(limit=-1),
        await session.get_items(limit=1000),
    ]
    seen["before_clear"] = await session.get_items()
    await session.clear_session()
    await snapshot()
    assert await session.pop_item() is None

    result = await ask(agent, "Hello again", session)
    seen["finals"].append(result.final_output)
    await snapshot()
    seen["model_inputs"] = model.inputs
    assert not model.steps, "the script was not played to the end"
    return seen


async def test_runner_matches_sqlite_session(store: es.EventStore) -> None:
    reference = SQLiteSession("conv-1")
    try:
        expected = await conversation(reference)
    finally:
        reference.close()
    session = ThreadlogSession("conv-1", store)
    got = await conversation(session)

    assert got["finals"] == expected["finals"]
    assert got["model_inputs"] == expected["model_inputs"]  # the SDK saw the same history
    assert got["snapshots"] == expected["snapshots"]
    assert got["limited"] == expected["limited"]
    assert got["popped"] == expected["popped"]
    # Sanity: the run had tool calls, tool outputs, a rewind, pops and a clear.
    kinds = {item.get("type") for item in expected["before_clear"]}
    assert {"function_call", "function_call_output", "message"} <= kinds
    assert len(expected["snapshots"][-2]) == 0  # cleared
    assert expected["snapshots"][1] == expected["snapshots"][2]  # the rewind removed its input

    # The log still holds every item ever added, popped and cleared ones included.
    events = [e async for e in store.read(session.thread_id)]
    added = [item for e in events if isinstance(e.payload, ItemsAdded) for item in e.payload.items]
    pops = [e.payload for e in events if isinstance(e.payload, ItemPopped)]
    assert len(pops) == 3  # the rewind's one and the correction's two
    assert sum(isinstance(e.payload, SessionCleared) for e in events) == 1
    assert user("What about Lisbon?") in added
    for item in got["popped"]:
        assert item in added
        assert item_digest(encode_item(item)) in {p.digest for p in pops}
    cleared = got["before_clear"]
    assert all(item in added for item in cleared)
    by_seq = {e.seq: e.payload for e in events}
    for pop in pops:
        origin = by_seq[pop.added_seq]
        assert isinstance(origin, ItemsAdded)
        assert pop.digest in {item_digest(encode_item(i)) for i in origin.items}

    report = await Projector(store, [session.projection]).check(session.thread_id)
    assert report.ok, report.differences


async def test_items_round_trip_losslessly(store: es.EventStore) -> None:
    session = ThreadlogSession("lossless", store)
    items: list[Any] = [
        {"role": "user", "content": "unicode: \u00e9\u4e2d\U0001f600", "n": 1, "f": 1.0},
        {"type": "function_call_output", "call_id": "c", "output": {"nested": [1, None, True]}},
        {"type": "x", "big": 2**62, "neg": -(2**62), "tiny": 1e-300, "empty": {}, "list": []},
    ]
    await session.add_items(items)
    assert await session.get_items() == items
    assert [type(v) for v in (await session.get_items())[0].values()] == [str, str, int, float]
    with pytest.raises(es.InvalidInputError):
        await session.add_items({"role": "user"})  # type: ignore[arg-type]
    with pytest.raises(es.InvalidInputError):
        await session.add_items("not a list")  # type: ignore[arg-type]
    with pytest.raises(es.InvalidInputError):
        await session.add_items([cast(TResponseInputItem, {"content": object()})])
    for not_an_item in (None, "plain string", 5, ["a", "list"]):
        with pytest.raises(es.InvalidInputError, match=r"items\[1\] must be an input item"):
            await session.add_items([items[0], cast(TResponseInputItem, not_an_item)])
    assert await session.get_items() == items  # the refused adds wrote nothing


async def test_items_are_stored_as_a_json_store_keeps_them(store: es.EventStore) -> None:
    """What `SQLiteSession` (json.dumps) refuses is refused here, and what JSON turns into
    something else comes back as JSON gives it back."""
    session = ThreadlogSession("json", store)
    refused: list[Any] = [
        {"role": "user", "content": {1, 2}},
        {"role": "user", "raw": b"\x00"},
        {"role": "user", "score": float("inf")},
        {"role": "user", "score": float("nan")},
    ]
    for item in refused:
        with pytest.raises(es.InvalidInputError, match=r"items\[0\] is not a JSON object"):
            await session.add_items([item])
    await session.add_items([cast(TResponseInputItem, {"role": "user", "t": (1, 2), 7: "k"})])
    assert await session.get_items() == [{"role": "user", "t": [1, 2], "7": "k"}]
    # JSON keeps these, the log cannot: refused naming the item, before anything is written
    # (SQLiteSession stores them; a tool output of os.listdir can hold a lone surrogate).
    unstorable: list[tuple[Any, str]] = [
        ({"type": "function_call_output", "output": ["caf\udce9.txt"]}, "not valid Unicode"),
        ({"role": "user", "n": 2**70}, "an int beyond 64 bits"),
    ]
    for item, problem in unstorable:
        for write in (session.add_items, session._atomic_replace_items):
            with pytest.raises(
                es.InvalidInputError, match=rf"items\[1\] cannot be stored: .*{problem}"
            ):
                await write([user("fine"), item])
    assert await session.get_items() == [{"role": "user", "t": [1, 2], "7": "k"}]


async def test_limits_are_ints_and_any_int_works(store: es.EventStore) -> None:
    session = ThreadlogSession("limits", store)
    await session.add_items([user(str(i)) for i in range(3)])
    for huge in (2**64, 10**30):
        assert len(await session.get_items(limit=huge)) == 3
    assert len(await session.get_items(limit=-(2**64))) == 3  # negative: everything
    for bad in ("2", 1.5, True):
        with pytest.raises(es.InvalidInputError, match="limit"):
            await session.get_items(limit=bad)  # type: ignore[arg-type]
    for bad_ttl in ("5", True, [1]):
        with pytest.raises(es.InvalidInputError, match="ttl"):
            ThreadlogSession("s", store, ttl=bad_ttl)  # type: ignore[arg-type]


async def test_a_batch_bigger_than_one_event_is_added_whole(store: es.EventStore) -> None:
    """A turn's items over the event size limit (1 MiB) together: several events of one
    atomic append, as SessionStore writes a long transcript; one item over it is refused."""
    session = ThreadlogSession("big", store)
    items = [user(f"{i}" + "y" * 100_000) for i in range(20)]
    await session.add_items(items)
    assert await session.get_items() == items
    assert await store.version(session.thread_id) > 1  # several events, one append
    assert (await Projector(store, [session.projection]).check(session.thread_id)).ok
    with pytest.raises(es.EventTooLargeError):
        await session.add_items([user("z" * 1_100_000)])
    assert await session.get_items() == items


async def test_session_settings_limit_and_ids(store: es.EventStore) -> None:
    session = ThreadlogSession("a{b}\n%c", store, session_settings=SessionSettings(limit=2))
    assert session.thread_id == "agents:a%7Bb%7D%0A%25c"
    assert session_thread_id("a%7Bb") != session_thread_id("a{b")
    with pytest.raises(es.InvalidThreadIdError, match=r"session id is too long.*'agents:'"):
        ThreadlogSession("y" * 250, store)
    await session.add_items([user(str(i)) for i in range(5)])
    assert [i["content"] for i in await session.get_items()] == ["3", "4"]  # type: ignore[typeddict-item]
    assert len(await session.get_items(limit=4)) == 4
    # The empty id is a session like any other, as in SQLiteSession; None is no id.
    empty = ThreadlogSession("", store)
    assert empty.thread_id == "agents:"
    await empty.add_items([user("e")])
    assert await empty.get_items() == [user("e")]
    assert await ThreadlogSession("a", store).get_items() == []
    with pytest.raises(es.InvalidThreadIdError):
        ThreadlogSession(None, store)  # type: ignore[arg-type]
    with pytest.raises(es.InvalidThreadIdError):
        ThreadlogSession("", store, thread_prefix="")
    with pytest.raises(es.InvalidThreadIdError):
        ThreadlogSession("x" * 300, store)
    with pytest.raises(es.InvalidInputError):
        ThreadlogSession("s", store, ttl=0)


async def test_concurrent_adds_and_pops(store: es.EventStore) -> None:
    writers = [ThreadlogSession("busy", store) for _ in range(4)]
    await writers[0].add_items([user(f"seed-{i}") for i in range(40)])
    popped: list[Any] = []

    async def add(w: int) -> None:
        for b in range(10):
            await writers[w].add_items([user(f"w{w}-b{b}-{k}") for k in range(3)])

    async def pop(w: int) -> None:
        for _ in range(10):
            popped.append(await writers[w].pop_item())

    async with anyio.create_task_group() as tg:
        tg.start_soon(add, 0)
        tg.start_soon(add, 1)
        tg.start_soon(pop, 2)
        tg.start_soon(pop, 3)

    remaining = await writers[0].get_items()
    events = [e async for e in store.read(writers[0].thread_id)]
    added = [item for e in events if isinstance(e.payload, ItemsAdded) for item in e.payload.items]
    assert len(added) == 40 + 2 * 10 * 3
    got = [p for p in popped if p is not None]
    assert len(got) == 20 and len(remaining) == len(added) - 20
    # Nothing lost, nothing popped twice: remaining + popped is exactly what was added.
    keys = sorted(json.dumps(i, sort_keys=True) for i in remaining + got)
    assert keys == sorted(json.dumps(i, sort_keys=True) for i in added)
    report = await Projector(store, [writers[0].projection]).check(writers[0].thread_id)
    assert report.ok, report.differences


BATCHES = 150
WRITER = f"BATCHES = {BATCHES}\n" + textwrap.dedent(
    """
    import sys, anyio
    import eventstore as es
    from adapters.openai_agents import ThreadlogSession

    url, namespace, name = sys.argv[1], sys.argv[2], sys.argv[3]

    async def main():
        store = await es.connect(url, namespace=namespace)
        session = ThreadlogSession("shared", store)
        await session.get_items()  # connected and warm
        print("ready", flush=True)
        sys.stdin.readline()  # both start together
        for b in range(BATCHES):
            await session.add_items(
                [{"role": "user", "content": f"{name}-{b}-{k}"} for k in range(5)]
            )
        await store.close()

    anyio.run(main)
    """
)


async def test_two_processes_add_concurrently(redis_url: str, namespace: str) -> None:
    procs = [
        await anyio.open_process(
            [sys.executable, "-c", WRITER, redis_url, namespace, name], cwd=ROOT
        )
        for name in ("p1", "p2")
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            ready = BufferedByteReceiveStream(p.stdout)
            assert await ready.receive_until(b"\n", 100) == b"ready"
        for p in procs:  # both are connected and warm: let them go at once
            assert p.stdin is not None
            await p.stdin.send(b"go\n")
        for p in procs:
            assert await p.wait() == 0
    finally:
        for p in procs:
            await p.aclose()
    store = await es.connect(redis_url, namespace=namespace)
    try:
        items = await ThreadlogSession("shared", store).get_items()
    finally:
        await store.close()
    contents = [cast(dict[str, str], i)["content"] for i in items]
    assert len(contents) == 2 * BATCHES * 5
    # Every batch is contiguous and in order, and each process's batches keep their order.
    batches = [contents[i : i + 5] for i in range(0, len(contents), 5)]
    for batch in batches:
        name, b, _ = batch[0].split("-")
        assert batch == [f"{name}-{b}-{k}" for k in range(5)]
    for name in ("p1", "p2"):
        order = [int(batch[0].split("-")[1]) for batch in batches if batch[0].startswith(name)]
        assert order == list(range(BATCHES))
    interleaved = [batch[0].split("-")[0] for batch in batches]
    assert interleaved != sorted(interleaved), "the processes did not overlap; test is vacuous"


async def test_a_cancelled_add_or_clear_still_writes_as_the_sdk_sessions_do(
    store: es.EventStore,
) -> None:
    """The SDK's own sessions finish a write their caller cancelled, then raise the
    cancellation; so does this one: the caller knows the items were added."""
    session = ThreadlogSession("cancelled", store)
    outcomes: list[str] = []
    for n in range(30):
        task = asyncio.ensure_future(session.add_items([user(f"m{n}")]))
        for _ in range(1 + n % 3):
            await asyncio.sleep(0)  # the call began; cut in at different points of it
        task.cancel()
        try:
            await task
            outcomes.append("done")
        except asyncio.CancelledError:
            outcomes.append("cancelled")
    assert "cancelled" in outcomes  # else the test cut in nowhere
    assert contents(await session.get_items()) == [f"m{n}" for n in range(30)]
    task = asyncio.ensure_future(session.clear_session())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await session.get_items() == []


async def test_a_pop_cancelled_once_its_write_was_sent_finishes_it(
    redis_url: str, namespace: str
) -> None:
    """A pop whose write reached Redis cannot be called back: the server runs it whenever it
    gets to it. Cancelled then, the pop finishes its write before raising the cancellation
    (as the SDK's SQLiteSession finishes a pop), so the session does not change under the
    caller after the call has ended."""
    store = await es.connect(redis_url, namespace=namespace)
    admin = await es.connect(redis_url, namespace=namespace)
    assert isinstance(admin, es.RedisEventStore)
    try:
        session = ThreadlogSession("cancelled-pop", store)
        await session.add_items([user("a"), user("b")])
        sent = anyio.Event()
        append = session.projector.append

        async def paused_append(*args: Any, **kwargs: Any) -> es.AppendResult:
            # Redis holds writes (scripts included) for 400 ms: the pop's write is sent and
            # waits there, where a cancellation finds it.
            await admin.client.execute_command("CLIENT", "PAUSE", "400", "WRITE")
            sent.set()
            return await append(*args, **kwargs)

        session.projector.append = paused_append  # type: ignore[method-assign]

        async def cancel_once_sent(scope: anyio.CancelScope) -> None:
            await sent.wait()
            await anyio.sleep(0.1)
            scope.cancel()

        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as scope:
                tg.start_soon(cancel_once_sent, scope)
                await session.pop_item()
                pytest.fail("the pop was not cancelled")
        assert scope.cancelled_caught
        when_cancelled = contents(await ThreadlogSession("cancelled-pop", store).get_items())
        await anyio.sleep(0.6)  # the pause is over: a write still pending has landed
        assert contents(await session.get_items()) == when_cancelled == ["a"]
        events = [e async for e in store.read(session.thread_id)]
        assert sum(isinstance(e.payload, ItemPopped) for e in events) == 1
    finally:
        await admin.client.execute_command("CLIENT", "UNPAUSE")
        await admin.close()
        await store.close()


async def test_a_tail_item_that_does_not_decode_is_not_popped(
    redis_url: str, namespace: str
) -> None:
    """A damaged item raises a typed error and stays where it is (run rebuild), instead of
    being removed by the pop that then failed to return it."""
    from eventstore._views import stamp_list_value

    store = await es.connect(redis_url, namespace=namespace)
    assert isinstance(store, es.RedisEventStore)
    try:
        session = ThreadlogSession("damaged", store)
        await session.add_items([user("a"), user("b")])
        key = store.keys.view(session.thread_id, ITEMS_VIEW)
        await store.client.lset(key, -1, stamp_list_value(1, b"\xc1"))  # not msgpack
        with pytest.raises(es.OperationalError, match="does not decode"):
            await session.pop_item()
        assert await store.version(session.thread_id) == 1
        assert await store.client.llen(key) == 2
    finally:
        await store.close()


async def test_an_access_policy_confines_a_session(store: es.EventStore) -> None:
    """Sessions are confined as ThreadStore and SessionStore are: each call asks the policy
    first, and a denied one reads and writes nothing."""
    owners = {"agents:alice-chat": "alice"}

    def decide(p: Principal | None, action: str, ns: str, thread: str | None) -> bool:
        if p is None or owners.get(thread or "") != p.id:
            return False
        return action == "read" or "writer" in p.roles

    policy = CallbackPolicy(decide)
    alice = Principal(id="alice", roles=frozenset({"writer"}))
    owner = ThreadlogSession("alice-chat", store, policy=policy, principal=alice)
    await owner.add_items([user("a"), user("b")])
    reader = ThreadlogSession("alice-chat", store, policy=policy, principal=Principal(id="alice"))
    assert contents(await reader.get_items()) == ["a", "b"]
    outsiders = [
        ThreadlogSession("alice-chat", store, policy=policy, principal=Principal(id="mallory")),
        ThreadlogSession("alice-chat", store, policy=policy),  # no principal at all
        ThreadlogSession("alice-chat", store, policy=TenantPolicy(), principal=alice),
    ]
    for session in [*outsiders, reader]:
        calls: list[Awaitable[Any]] = [
            session.add_items([user("x")]),
            session.pop_item(),  # it removes an item: a reader may not
            session.clear_session(),
            session.delete(),
        ]
        if session is not reader:
            calls.append(session.get_items())
        for denied in calls:
            with pytest.raises(AccessDenied):
                await denied
    assert await store.version(owner.thread_id) == 1
    assert contents(await owner.get_items()) == ["a", "b"]
    assert await owner.pop_item() == user("b")
    with pytest.raises(es.InvalidInputError, match="principal must be a Principal"):
        await ThreadlogSession("alice-chat", store, principal="alice").get_items()  # type: ignore[arg-type]
    with pytest.raises(es.InvalidThreadIdError, match="prefix"):
        ThreadlogSession("alice-chat", store, thread_prefix=5)  # type: ignore[arg-type]


async def test_a_pop_never_lands_in_a_life_of_the_session_it_did_not_read(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pop_item reads the tail, then appends its removal expecting the version it read. If
    the session is deleted and written again to that version in between, the removal must
    not land in the new life (it names an item that life never held): refused, the new tail
    read, and that one popped."""
    session = ThreadlogSession("reborn", store)
    other = ThreadlogSession("reborn", store)
    await session.add_items([user("a"), user("b")])
    read = store.read_views
    armed = [True]

    async def read_then_replace(thread_id: str, reads: Any) -> es.ViewSnapshot:
        snap = await read(thread_id, reads)
        if armed[0]:
            armed[0] = False
            await other.delete()
            await other.add_items([user("c"), user("d")])
            assert await store.version(thread_id) == snap.version  # the same version again
        return snap

    monkeypatch.setattr(store, "read_views", read_then_replace)
    assert await session.pop_item() == user("d")
    assert contents(await other.get_items()) == ["c"]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Shift the session module's clock: append milliseconds to ``clock[0]``."""
    import adapters.openai_agents as module

    offset = [0]
    real = module._now_ms
    monkeypatch.setattr(module, "_now_ms", lambda: real() + offset[0])
    return offset


async def test_ttl_deletes_an_idle_session_when_touched(
    store: es.EventStore, clock: list[int]
) -> None:
    session = ThreadlogSession("ephemeral", store, ttl=1.0)
    await session.add_items([user("hi")])
    await anyio.sleep(0.6)
    await session.add_items([user("still here")])
    await anyio.sleep(0.6)
    # 1.2 s after the first write but 0.6 s after the last: a write keeps the session alive.
    assert len(await ThreadlogSession("ephemeral", store, ttl=1.0).get_items()) == 2
    clock[0] = 5_000
    other = ThreadlogSession("ephemeral", store, ttl=1.0)
    assert await other.get_items() == []  # idle for 5 s: deleted when touched
    assert await store.version(other.thread_id) == 0
    assert await session.pop_item() is None
    await session.add_items([user("new life")])
    assert [i["content"] for i in await session.get_items()] == ["new life"]  # type: ignore[typeddict-item]
    # Without a ttl nothing expires.
    clock[0] = 10**9
    assert len(await ThreadlogSession("ephemeral", store).get_items()) == 1


async def test_sweep_idle_sessions(store: es.EventStore) -> None:
    old = ThreadlogSession("old", store)
    await old.add_items([user("x")])
    await store.append("not-a-session", [es.TranscriptAppended(messages=[])])
    cutoff_ms = int(time.time() * 1000) + 5
    await anyio.sleep(0.02)
    fresh = ThreadlogSession("fresh", store)
    await fresh.add_items([user("y")])
    deleted = await sweep_idle_sessions(store, 60, now_ms=cutoff_ms + 60_000)
    assert deleted == [old.thread_id]
    assert await old.get_items() == []
    assert len(await fresh.get_items()) == 1
    assert await store.version("not-a-session") == 1
    assert await sweep_idle_sessions(store, 60) == []
    # Bad arguments are refused before anything is listed or deleted (a TypeError before).
    bad: list[dict[str, Any]] = [{"now_ms": "5"}, {"now_ms": 1.5}, {"thread_prefix": 5}]
    for kwargs in bad:
        with pytest.raises(es.InvalidInputError):
            await sweep_idle_sessions(store, 60, **kwargs)
    assert len(await fresh.get_items()) == 1


async def test_a_session_written_after_it_was_found_idle_is_kept(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The idle check and the delete are two steps: a write landing between them used to be
    deleted with the session."""
    session = ThreadlogSession("busy", store)
    await session.add_items([user("x")])
    real_read = store.read
    written: list[int] = []

    async def read_then_write(thread_id: str, **kwargs: Any) -> Any:
        events = [event async for event in real_read(thread_id, **kwargs)]
        if kwargs.get("backwards") and not written:  # the idle check, read: now a write
            written.append(1)
            await ThreadlogSession("busy", store).add_items([user("y")])
        for event in events:
            yield event

    monkeypatch.setattr(store, "read", read_then_write)
    far = int(time.time() * 1000) + 3_600_000
    assert await sweep_idle_sessions(store, 60, now_ms=far) == []
    assert written == [1]
    monkeypatch.undo()
    assert [cast(Any, i)["content"] for i in await session.get_items()] == ["x", "y"]

    # The same through the session's own ttl: a write between its check and its delete.
    expiring = ThreadlogSession("busy", store, ttl=0.001)
    await anyio.sleep(0.01)
    written.clear()
    monkeypatch.setattr(store, "read", read_then_write)
    items = await expiring.get_items()
    monkeypatch.undo()
    assert written == [1]
    assert [cast(Any, i)["content"] for i in items] == ["x", "y", "y"]


async def test_a_session_started_again_after_it_was_found_idle_is_kept(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the idle check and the delete, the session deleted and started again with as
    many items: the same version, another life. The version alone let the fresh session be
    deleted as the idle one."""
    session = ThreadlogSession("again", store)
    await session.add_items([user("old")])
    real_read = store.read
    restarted: list[int] = []

    async def read_then_restart(thread_id: str, **kwargs: Any) -> Any:
        events = [event async for event in real_read(thread_id, **kwargs)]
        if kwargs.get("backwards") and not restarted:  # the idle check, read
            restarted.append(1)
            fresh = ThreadlogSession("again", store)
            await fresh.delete()
            await fresh.add_items([user("new")])
        for event in events:
            yield event

    monkeypatch.setattr(store, "read", read_then_restart)
    far = int(time.time() * 1000) + 3_600_000
    assert await sweep_idle_sessions(store, 60, now_ms=far) == []
    monkeypatch.undo()
    assert restarted == [1]
    assert await store.version(session.thread_id) == 1
    assert [cast(Any, i)["content"] for i in await session.get_items()] == ["new"]


async def test_private_registry_and_views(redis_url: str, namespace: str) -> None:
    registry = es.EventRegistry()
    store = await es.connect(redis_url, namespace=namespace, registry=registry)
    try:
        session = ThreadlogSession("private", store)
        await session.add_items([user("a"), user("b")])
        assert await session.pop_item() == user("b")
        assert "agents.items_added" in registry
        snap = await store.read_views(session.thread_id, [es.ListRange(ITEMS_VIEW)])
        assert [e.seq for e in cast(list[es.ViewEntry], snap.results[0])] == [1]
        assert await session.delete() == 2
        assert await store.version(session.thread_id) == 0
    finally:
        await store.close()


# -- pops under contention --------------------------------------------------------------------


def contents(items: list[Any]) -> list[str]:
    return [cast(dict[str, str], i)["content"] for i in items]


async def gather(*calls: Awaitable[Any]) -> list[Any]:
    """Run ``calls`` concurrently; their results in order (the first failure cancels the rest)."""
    results: list[Any] = [None] * len(calls)

    async def run(i: int, call: Awaitable[Any]) -> None:
        results[i] = await call

    async with anyio.create_task_group() as tg:
        for i, call in enumerate(calls):
            tg.start_soon(run, i, call)
    return results


async def test_concurrent_pops_each_pop_a_distinct_item(store: es.EventStore) -> None:
    session = ThreadlogSession("contended", store)
    added = [user(f"item-{i}") for i in range(200)]
    await session.add_items(added)
    # Half the pops through one object, half through an object per pop (as per request).
    pops = [session.pop_item() for _ in range(100)]
    pops += [ThreadlogSession("contended", store).pop_item() for _ in range(100)]
    popped = await gather(*pops)
    assert sorted(contents(popped)) == sorted(contents(added))
    assert await session.get_items() == []
    assert await session.pop_item() is None
    events = [e async for e in store.read(session.thread_id)]
    assert sum(isinstance(e.payload, ItemPopped) for e in events) == 200
    report = await Projector(store, [session.projection]).check(session.thread_id)
    assert report.ok, report.differences


async def test_pops_racing_adds_never_fail(store: es.EventStore) -> None:
    session = ThreadlogSession("racing", store)
    seeds = [user(f"seed-{i}") for i in range(100)]
    await session.add_items(seeds)
    extra = [user(f"extra-{i}") for i in range(100)]
    adds = [ThreadlogSession("racing", store).add_items([item]) for item in extra]
    pops = [session.pop_item() for _ in range(100)]
    results = await gather(*(c for pair in zip(adds, pops, strict=True) for c in pair))
    popped = [r for r in results if r is not None]
    assert len(popped) == 100  # never empty: each pop found an item
    remaining = await session.get_items()
    # Every item is either still there or was popped exactly once.
    assert sorted(contents(popped + remaining)) == sorted(contents(seeds + extra))
    report = await Projector(store, [session.projection]).check(session.thread_id)
    assert report.ok, report.differences


async def test_pops_from_two_connections(redis_url: str, namespace: str) -> None:
    # Two stores are two clients: their pops contend through the server alone, as two
    # processes' pops would.
    stores = [await es.connect(redis_url, namespace=namespace) for _ in range(2)]
    try:
        sessions = [ThreadlogSession("shared", s) for s in stores]
        added = [user(f"item-{i}") for i in range(120)]
        await sessions[0].add_items(added)
        pops = [s.pop_item() for _ in range(60) for s in sessions]
        adds = [sessions[i % 2].add_items([user(f"late-{i}")]) for i in range(20)]
        results = await gather(*pops, *adds)
        popped = [r for r in results[:120] if r is not None]
        assert len(popped) == 120
        remaining = await sessions[1].get_items()
        late = [user(f"late-{i}") for i in range(20)]
        assert sorted(contents(popped + remaining)) == sorted(contents(added + late))
    finally:
        for s in stores:
            await s.close()


# -- session settings -------------------------------------------------------------------------


async def test_session_settings_as_the_sdk_accepts_them(
    store: es.EventStore, tmp_path: Path
) -> None:
    items = [user(str(i)) for i in range(3)]
    for given in ({"limit": 1}, SessionSettings(limit=1), {"limit": None}, {}, None):
        ours = ThreadlogSession(f"s{uuid.uuid4().hex}", store, session_settings=given)
        sdk = SQLiteSession("s", tmp_path / f"{uuid.uuid4().hex}.db", session_settings=given)
        try:
            # None stays None (the protocol's default); SQLiteSession makes it SessionSettings().
            assert (ours.session_settings or SessionSettings()) == sdk.session_settings
            await ours.add_items(items)
            await sdk.add_items(items)
            assert await ours.get_items() == await sdk.get_items()
        finally:
            sdk.close()
    session = ThreadlogSession("typed", store, session_settings={"limit": 2})
    assert isinstance(session.session_settings, SessionSettings)
    # What the runner does with a run's own settings.
    assert session.session_settings.resolve({"limit": 5}).limit == 5
    for bad in ({"limit": 1, "bogus": 2}, {"limit": "many"}, {1: 2}, "limit=1", 1, [("limit", 1)]):
        with pytest.raises(es.InvalidInputError, match="session_settings"):
            ThreadlogSession("bad", store, session_settings=bad)  # type: ignore[arg-type]


class CompactingResponses:
    """The `responses.compact` endpoint of an OpenAI client: the history becomes one summary.
    (The model is the only thing not run for real; the session and the SDK's compaction code
    are.)"""

    def __init__(self) -> None:
        self.calls = 0

    async def compact(self, **kwargs: Any) -> Any:
        self.calls += 1
        summary = {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": f"summary of {len(kwargs['input'])}"}],
        }
        return type("Compacted", (), {"output": [summary], "usage": None})()


class CompactingClient:
    def __init__(self) -> None:
        self.responses = CompactingResponses()


async def test_compaction_replaces_the_history_in_one_step(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The SDK's compaction session replaces the stored history with the compacted one. Without
    # an atomic replacement on the session, it clears, then adds: a process that dies in
    # between (or any reader in between) finds the session empty, and the history is gone
    # for the next run. The SDK's own RedisSession and SQLite stores replace in one step.
    from agents.memory import OpenAIResponsesCompactionArgs, OpenAIResponsesCompactionSession

    inner = ThreadlogSession("compacted", store)
    history = [user(f"m{i}") for i in range(12)]
    await inner.add_items(history)
    client = CompactingClient()
    session = OpenAIResponsesCompactionSession(
        "compacted", inner, client=cast(Any, client), compaction_mode="input"
    )
    appends = 0
    append = store.append
    stalled, release = anyio.Event(), anyio.Event()

    async def stalls_on_the_second_write(*args: Any, **kwargs: Any) -> es.AppendResult:
        nonlocal appends
        appends += 1
        if appends == 2:  # were the process to die here, what would stay?
            stalled.set()
            await release.wait()
        return await append(*args, **kwargs)

    monkeypatch.setattr(store, "append", stalls_on_the_second_write)
    compacted = [
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "summary of 12"}],
        }
    ]
    async with anyio.create_task_group() as tg:
        forced: OpenAIResponsesCompactionArgs = {"force": True}
        tg.start_soon(session.run_compaction, forced)
        with anyio.move_on_after(1):
            await stalled.wait()
        # What another process reads now, and what stays if this one dies now.
        seen = await ThreadlogSession("compacted", store).get_items()
        release.set()
    assert seen in (history, compacted), seen  # it used to be [] (cleared, not added yet)
    assert appends == 1
    assert client.responses.calls == 1
    monkeypatch.setattr(store, "append", append)
    assert await ThreadlogSession("compacted", store).get_items() == compacted
    # The log keeps what the compaction replaced, and the views are its fold.
    thread = session_thread_id("compacted")
    payloads = [e.payload async for e in store.read(thread)]
    assert [type(p).__name__ for p in payloads] == ["ItemsAdded", "SessionCleared", "ItemsAdded"]
    assert (await Projector(store, [inner.projection]).check(thread)).ok
    # An empty compacted history clears the session; a subclass (which may transform what
    # add_items stores) is left to the SDK's clear and add.
    assert await inner._atomic_replace_items([]) is True
    assert await inner.get_items() == []

    class Transforming(ThreadlogSession):
        pass

    assert await Transforming("compacted", store)._atomic_replace_items(history) is False
    assert await inner.get_items() == []
