"""ThreadStore, SessionStore, JSONL and access control, on the memory backend and real Redis."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

import adapters._jsonl
import eventstore as es
from adapters import (
    AccessDenied,
    Auditor,
    CallbackPolicy,
    ImportProgress,
    JsonlImportError,
    NoTranscriptError,
    Principal,
    SessionStore,
    SessionUpdate,
    StateUpdate,
    TenantPolicy,
    ThreadStore,
    TurnConflictError,
    TurnNotFoundError,
    export_jsonl,
    import_jsonl,
    parse_jsonl,
    session_update,
)
from adapters._threads import RECORDS_READ_AHEAD
from eventstore.testing import read_all
from projections import (
    Projector,
    ReaderView,
    SeqBeyondVersionError,
    StateProjection,
    UnknownBlockError,
)

pytestmark = pytest.mark.anyio


def user(text: str) -> es.Message:
    return es.Message(role="user", content=text)


def assistant(text: str) -> es.Message:
    return es.Message(role="assistant", content=text)


PLANNER = ReaderView("planner", {"plan": None, "profile": ("name",)})


async def test_scripted_conversation(store: es.EventStore) -> None:
    threads = ThreadStore(store, state=StateProjection([PLANNER], blocks=["scratch"]))
    sessions = SessionStore(store)
    t = "conv"

    # Turn 1: a root turn that completes, with a child turn that completes too.
    t1 = await threads.open_turn(
        t, request_message=user("plan my trip"), grant=es.Grant(max_steps=8)
    )
    assert [m.message.text for m in await threads.list_messages(t)] == ["plan my trip"]
    child = await threads.open_turn(t, parent_turn_id=t1, request_message=user("sub-question"))
    await threads.settle_turn(
        t, child, outcome="completed", assistant_message=assistant("sub-answer")
    )
    await threads.update_state(t, "plan", {"steps": ["fly"]}, turn_id=t1)
    await threads.update_state(
        t, "profile", {"name": "Ada", "email": "ada@example.com"}, turn_id=t1
    )
    s1 = await threads.settle_turn(
        t,
        t1,
        outcome="completed",
        assistant_message=assistant("here is the plan"),
        usage=es.Usage(input_tokens=100, output_tokens=20),
        steps=3,
        model_tier="large",
        fallbacks=[es.Fallback(from_tier="large", to_tier="small", reason="rate limit")],
        state_updates=[StateUpdate("plan", {"steps": ["fly", "hotel"]}, expected_version=1)],
    )
    assert s1.record.outcome == "completed" and not s1.duplicate

    # Turn 2: fails after recording a state update: the update stays, no assistant message.
    t2 = await threads.open_turn(t, request_message=user("book it"))
    await threads.update_state(t, "scratch", {"draft": 1}, turn_id=t2)
    await threads.settle_turn(
        t,
        t2,
        outcome="failed",
        error=es.TurnError(kind="tool_error", message="booking API down"),
        assistant_message=assistant("partial answer that must not show"),
    )
    # Turn 3: refused at admission.
    t3 = await threads.open_turn(t, request_message=user("do something forbidden"))
    await threads.settle_turn(t, t3, outcome="refused", error=es.TurnError(kind="policy"))

    messages = [m.message.text for m in await threads.list_messages(t, limit=10)]
    assert messages == [
        "plan my trip",
        "here is the plan",
        "book it",
        "do something forbidden",
    ]
    assert [m.message.text for m in await threads.list_messages(t)] == messages[-6:]
    assert await threads.list_messages(t, limit=0) == []
    assert [m.message.text for m in await threads.list_messages(t, limit=2)] == messages[-2:]

    state = await threads.state(t, "planner")
    assert state["plan"].value == {"steps": ["fly", "hotel"]}
    assert state["plan"].version == 2
    assert state["profile"].value == {"name": "Ada"}  # the view hides the email
    assert "scratch" not in state
    everything = await threads.state(t)
    assert everything["scratch"].value == {"draft": 1}  # failure is not rollback

    page = await threads.records(t)
    assert [r.turn_id for r in page.records] == [t3, t2, t1, child]
    by_turn = {r.turn_id: r for r in page.records}
    assert by_turn[t2].outcome == "failed" and by_turn[t2].error is not None
    assert by_turn[t3].outcome == "refused"
    assert by_turn[t1].usage.total_tokens == 120 and by_turn[t1].steps == 3
    assert by_turn[t1].fallbacks[0].to_tier == "small"
    assert by_turn[t1].grant == es.Grant(max_steps=8)
    assert by_turn[child].parent_turn_id == t1
    tree = await threads.turn_tree(t)
    assert [n.record.turn_id for n in tree] == [t1, t2, t3]
    assert [c.record.turn_id for c in tree[0].children] == [child]

    # A compaction through the session store on the same log.
    session = "conv-session"
    await sessions.append(session, [user("a"), assistant("b"), user("c")])
    loaded = await sessions.load(session)
    await sessions.replace(session, [assistant("summary of a, b"), user("c")])
    assert [m.text for m in (await sessions.load(session)).messages] == ["summary of a, b", "c"]
    logged = [e.type for e in await read_all(store, session)]
    assert logged == ["transcript.appended", "transcript.replaced"]
    assert loaded.version == 1

    report = await Projector(store, state=StateProjection([PLANNER], blocks=["scratch"])).check(t)
    assert report.ok and report.anomalies == []


def test_reader_view_fields_must_be_a_tuple_of_names() -> None:
    with pytest.raises(es.InvalidInputError, match="tuple of field names"):
        ReaderView("planner", {"profile": ("name")})  # type: ignore[dict-item]  # the missing comma
    with pytest.raises(es.InvalidInputError, match="tuple of field names"):
        ReaderView("planner", {"profile": (1, 2)})  # type: ignore[dict-item]
    assert ReaderView("planner", {"profile": ["name"]}).blocks  # type: ignore[dict-item]


def test_a_state_schema_is_checked_as_it_is_declared() -> None:
    """A lone string of block names would declare its letters; a second reader view of one
    name would silently replace the first (a confined reader would see what the later one
    shows); neither is taken, and malformed views are refused with a typed error."""
    with pytest.raises(es.InvalidInputError, match="blocks"):
        StateProjection(blocks="plan")
    with pytest.raises(es.InvalidInputError, match="blocks"):
        StateProjection(blocks=["plan", 7])  # type: ignore[list-item]
    with pytest.raises(es.InvalidInputError, match="defined twice"):
        StateProjection([ReaderView("planner", {"plan": None}), ReaderView("planner", {"x": None})])
    for not_a_name in (["planner"], {"planner": None}, 5):
        with pytest.raises(es.InvalidInputError, match="named by a str"):
            StateProjection([PLANNER]).reader_view(not_a_name)  # type: ignore[arg-type]
    for views in (["planner"], ReaderView("planner", {"plan": None})):
        with pytest.raises(es.InvalidInputError, match="ReaderView"):
            StateProjection(views)  # type: ignore[arg-type]
    for blocks in (["plan"], None, "plan"):
        with pytest.raises(es.InvalidInputError, match="mapping"):
            ReaderView("planner", blocks)  # type: ignore[arg-type]
    assert StateProjection(blocks=("plan",)).known_blocks == frozenset({"plan"})


async def test_settling_is_idempotent_and_scoped_to_the_thread(store: es.EventStore) -> None:
    threads = ThreadStore(store)
    turn = await threads.open_turn("a", request_message=user("hi"))
    first = await threads.settle_turn(
        "a", turn, outcome="completed", assistant_message=assistant("yo")
    )
    again = await threads.settle_turn("a", turn, outcome="failed")
    assert again.duplicate and again.record == first.record
    assert again.record.outcome == "completed"
    with pytest.raises(TurnNotFoundError):
        await threads.settle_turn("b", turn, outcome="completed")
    with pytest.raises(TurnNotFoundError):
        await threads.settle_turn("a", es.new_ulid(), outcome="completed")
    with pytest.raises(TurnNotFoundError):
        await threads.open_turn("b", parent_turn_id=turn)
    settled = [e for e in await read_all(store, "a") if e.type == "turn.settled"]
    assert len(settled) == 1
    assert await store.version("b") == 0


async def test_a_settlement_racing_a_deletion_never_writes_into_another_life(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread deleted while a turn is settled: after the open record was read, the
    settlement is refused (it would start a new life holding only a stray settlement, which
    usage counts and check flags); after the settlement landed, its own record is answered
    (it was a bare AssertionError)."""
    threads = ThreadStore(store)
    read_record, append = Projector.record_in_life, Projector.append

    async def deleted_after_the_read(self: Projector, thread_id: str, turn_id: str):  # type: ignore[no-untyped-def]
        found = await read_record(self, thread_id, turn_id)
        await threads.delete_thread(thread_id)
        return found

    turn = await threads.open_turn("b", request_message=user("hi"))
    monkeypatch.setattr(Projector, "record_in_life", deleted_after_the_read)
    with pytest.raises(TurnNotFoundError, match="before it was deleted"):
        await threads.settle_turn("b", turn, outcome="completed", assistant_message=assistant("x"))
    assert await store.version("b") == 0  # nothing written: no new life
    assert "b" not in [t.thread_id for t in await store.threads()]
    # A child turn, its parent read before the deletion: refused the same way.
    parent = await threads.open_turn("c")
    with pytest.raises(TurnNotFoundError, match="before it was deleted"):
        await threads.open_turn("c", parent_turn_id=parent)
    assert await store.version("c") == 0
    # A message or a state update tagged with a turn read before the deletion, the thread
    # written again meanwhile (a session reset reusing the id): refused, not written into
    # the new life under a turn it never had.

    async def written_again_after_the_read(self: Projector, thread_id: str, turn_id: str):  # type: ignore[no-untyped-def]
        found = await read_record(self, thread_id, turn_id)
        await threads.delete_thread(thread_id)
        await threads.append_message(thread_id, user("new life"))
        return found

    writes: list[Callable[[str], Awaitable[es.AppendResult]]] = [
        lambda t: threads.update_state("d", "plan", {"secret": 1}, turn_id=t),
        lambda t: threads.append_message("d", assistant("stray"), turn_id=t),
    ]
    for write in writes:
        monkeypatch.setattr(Projector, "record_in_life", read_record)
        old_turn = await threads.open_turn("d", request_message=user("old life"))
        monkeypatch.setattr(Projector, "record_in_life", written_again_after_the_read)
        with pytest.raises(TurnNotFoundError, match="before it was deleted"):
            await write(old_turn)
        assert [m.message.text for m in await threads.list_messages("d")] == ["new life"]
        assert await threads.state("d") == {}
        monkeypatch.setattr(Projector, "record_in_life", read_record)
        await threads.delete_thread("d")
    monkeypatch.setattr(Projector, "record_in_life", read_record)

    async def deleted_after_the_append(self: Projector, thread_id: str, *args: Any, **kw: Any):  # type: ignore[no-untyped-def]
        result = await append(self, thread_id, *args, **kw)
        await threads.delete_thread(thread_id)
        return result

    turn = await threads.open_turn("a", request_message=user("hi"))
    monkeypatch.setattr(Projector, "append", deleted_after_the_append)
    settled = await threads.settle_turn(
        "a", turn, outcome="completed", steps=2, assistant_message=assistant("x")
    )
    assert (settled.record.turn_id, settled.record.outcome, settled.record.steps) == (
        turn,
        "completed",
        2,
    )
    assert (settled.record.status, settled.record.seq, settled.duplicate) == ("settled", 2, False)
    assert settled.last_seq == 2 and await store.version("a") == 0


async def test_messages_json_cannot_hold_are_refused_before_anything_is_written(
    store: es.EventStore,
) -> None:
    """A message built in Python can hold what JSON cannot (a message read from JSON cannot):
    it was stored, then export, show and replay failed on it (exit 3) for good."""
    threads, sessions = ThreadStore(store), SessionStore(store)
    call = {"type": "tool-call", "toolCallId": "c1", "toolName": "f"}
    bad: list[tuple[dict[str, Any], str]] = [
        (
            {"role": "assistant", "content": [{**call, "input": {True: 1}}]},
            "content[0].input is keyed by True",
        ),
        (
            {"role": "user", "content": "x", "providerOptions": {(1, 2): 3}},
            "providerOptions is keyed by (1, 2)",
        ),
        (
            {"role": "assistant", "content": [{**call, "input": {"x": math.nan}}]},
            "content[0].input['x'] is nan",
        ),
        (
            {"role": "user", "content": "x", "meta": {"b": b"raw"}},
            "extra['meta']['b'] is of type bytes",
        ),
    ]
    for message, problem in bad:
        with pytest.raises(es.MessageFormatError, match=re.escape(problem)):
            await threads.append_message("t", message)
        with pytest.raises(es.MessageFormatError, match=re.escape(problem)):
            await threads.open_turn("t", request_message=message)
        with pytest.raises(es.MessageFormatError, match=re.escape(problem)):
            await sessions.append("s", [user("fine"), message])
    assert await store.version("t") == 0 and await store.version("s") == 0
    # Tuples are lists to JSON, and come back as lists.
    ok = {"role": "assistant", "content": [{**call, "input": {"xs": (1, 2)}}]}
    await threads.append_message("t", ok)
    (stored,) = await threads.list_messages("t")
    assert stored.message.to_json()["content"][0]["input"] == {"xs": [1, 2]}


async def test_a_retried_settlement_answers_the_first_ones_seqs(store: es.EventStore) -> None:
    threads = ThreadStore(store)
    turn = await threads.open_turn("t")
    updates: list[StateUpdate | dict[str, Any]] = [StateUpdate("b", 1), {"block": "c", "value": 2}]
    first = await threads.settle_turn("t", turn, outcome="completed", state_updates=updates)
    assert (first.first_seq, first.last_seq, first.duplicate) == (2, 4, False)
    again = await threads.settle_turn("t", turn, outcome="completed", state_updates=updates)
    other = await threads.settle_turn("t", turn, outcome="failed")  # other details: first wins
    for retry in (again, other):
        assert (retry.first_seq, retry.last_seq, retry.duplicate) == (2, 4, True)
        assert retry.record == first.record
    assert await store.version("t") == 4


async def test_a_settlement_key_taken_by_another_append_is_a_conflict(
    store: es.EventStore,
) -> None:
    threads = ThreadStore(store)
    turn = await threads.open_turn("t", request_message=user("q"))
    for reserved in (f"settle:{turn}", f"open:{turn}", "settle:", "open:x"):
        with pytest.raises(es.InvalidInputError, match="ThreadStore's own"):
            await threads.append_message("t", user("r"), turn_id=turn, idempotency_key=reserved)
        with pytest.raises(es.InvalidInputError, match="ThreadStore's own"):
            await threads.update_state("t", "b", 1, turn_id=turn, idempotency_key=reserved)
    # Below ThreadStore nothing reserves the key: the settlement must not pass for a duplicate.
    await threads.projector.append(
        "t",
        [es.NewEvent(payload=es.MessageAppended(message=user("r")), turn_id=turn)],
        idempotency_key=f"settle:{turn}",
    )
    with pytest.raises(TurnConflictError, match=f"settle:{turn}"):
        await threads.settle_turn(
            "t", turn, outcome="completed", assistant_message=assistant("answer")
        )
    record = await threads.turn("t", turn)
    assert record is not None and record.is_open
    assert [m.message.text for m in await threads.list_messages("t")] == ["q", "r"]


async def test_turn_arguments_are_checked_and_take_their_json_forms(
    store: es.EventStore,
) -> None:
    threads = ThreadStore(store)
    turn = await threads.open_turn("t")
    for bad_id in (None, 1.5, b"x", ""):
        with pytest.raises(es.InvalidInputError, match="turn_id"):
            await threads.turn("t", bad_id)  # type: ignore[arg-type]
        with pytest.raises(es.InvalidInputError, match="turn_id"):
            await threads.settle_turn("t", bad_id, outcome="completed")  # type: ignore[arg-type]
    with pytest.raises(es.InvalidInputError, match="parent_turn_id"):
        await threads.open_turn("t", parent_turn_id=5)  # type: ignore[arg-type]
    with pytest.raises(es.InvalidInputError, match="records cursor"):
        await threads.records("t", after=123)  # type: ignore[arg-type]
    bad_settlements: list[dict[str, Any]] = [
        {"usage": {"input_tokens": "many"}},
        {"usage": 7},
        {"usage": es.Usage(cost_usd=float("inf"))},
        {"usage": {"cost_usd": float("nan")}},
        {"timing": {"started_ms": -1}},
        {"timing": es.Timing(started_ms=20, settled_ms=10)},
        {"fallbacks": [{"to_tier": "big"}]},
        {"fallbacks": "big"},
        {"state_updates": [{"value": 1}]},
        {"state_updates": [3]},
        {"error": {"message": "no kind"}},
    ]
    for bad in bad_settlements:
        with pytest.raises(es.InvalidInputError):
            await threads.settle_turn("t", turn, outcome="failed", **bad)
            pytest.fail(f"settled with {bad}")
    for bad_grant in (
        {"max_steps": -5},
        es.Grant(max_tokens=-1),
        es.Grant(max_cost_usd=float("nan")),
        {"deadline_ms": 1.5},
    ):
        with pytest.raises(es.InvalidInputError, match="grant"):
            await threads.open_turn("t", grant=bad_grant)
    assert await store.version("t") == 1
    # The JSON forms of the structs are taken, as messages are.
    child = await threads.open_turn("t", parent_turn_id=turn, grant={"max_steps": 3})
    done = await threads.settle_turn(
        "t",
        child,
        outcome="failed",
        usage={"input_tokens": 5, "output_tokens": 2},
        timing={"started_ms": 10, "settled_ms": 20},
        fallbacks=[{"from_tier": "small", "to_tier": "big"}],
        error={"kind": "timeout", "retryable": True},
        state_updates=[{"block": "plan", "value": {"step": 2}}],
    )
    record = done.record
    assert record.grant == es.Grant(max_steps=3)
    assert (record.usage.input_tokens, record.timing.duration_ms) == (5, 10)
    assert record.fallbacks == [es.Fallback(from_tier="small", to_tier="big")]
    assert record.error == es.TurnError(kind="timeout", retryable=True)
    assert (await threads.state("t"))["plan"].value == {"step": 2}


async def test_turn_ids_are_injectable(store: es.EventStore) -> None:
    ids = iter(["turn-1", "turn-2"])
    threads = ThreadStore(store, new_turn_id=lambda: next(ids))
    assert await threads.open_turn("t") == "turn-1"
    assert await threads.open_turn("t") == "turn-2"
    assert await threads.open_turn("t", turn_id="mine") == "mine"
    assert await threads.open_turn("t", turn_id="mine") == "mine"  # the same again: idempotent
    with pytest.raises(TurnConflictError):
        await threads.open_turn("t", turn_id="mine", request_message=user("other"))
    with pytest.raises(es.InvalidInputError, match="non-empty"):
        await threads.open_turn("t", turn_id="")
    assert await store.version("t") == 3


async def test_a_minted_turn_id_must_be_a_new_valid_turn_id(store: es.EventStore) -> None:
    """An injected generator that repeats an id (a counter after a restart) is refused, not
    taken as a re-open that drops the new turn's request; one that mints no valid turn id
    (empty, control characters, not a str) writes nothing."""
    ids = iter(["turn-1", "turn-1", "turn-1", "", "bad\x00", 7])
    threads = ThreadStore(store, new_turn_id=lambda: next(ids))  # type: ignore[arg-type,return-value]
    assert await threads.open_turn("t", request_message=user("hi")) == "turn-1"
    for request in ("hi", "another question"):
        with pytest.raises(TurnConflictError, match=r"new_turn_id\(\) returned 'turn-1'"):
            await threads.open_turn("t", request_message=user(request))
    for _ in range(3):
        with pytest.raises(es.InvalidInputError, match=r"new_turn_id\(\)"):
            await threads.open_turn("t")
    assert await store.version("t") == 1
    assert [r.turn_id for r in await threads.projector.turns("t")] == ["turn-1"]


async def test_a_turn_whose_appends_were_sent_twice_opens_and_settles_once(
    store: es.EventStore,
) -> None:
    """A lost reply re-sent by the connection is answered from the ledger (duplicate) with
    the very event sent: that open is this turn's, not a repeated id."""
    threads = ThreadStore(store)
    append = threads.projector.append

    async def sent_twice(*args: Any, **kwargs: Any) -> es.AppendResult:
        await append(*args, **kwargs)
        return await append(*args, **kwargs)

    threads.projector.append = sent_twice  # type: ignore[method-assign]
    turn = await threads.open_turn("t", request_message=user("hi"))
    assert await store.version("t") == 1
    assert (await threads.turn("t", turn)) is not None
    # So does a settlement: this call wrote it, whatever the ledger answered the repeat.
    settled = await threads.settle_turn("t", turn, outcome="completed", steps=1)
    assert (settled.first_seq, settled.last_seq, settled.duplicate) == (2, 2, False)
    again = await threads.settle_turn("t", turn, outcome="completed", steps=1)
    assert again.duplicate and again.record == settled.record
    assert await store.version("t") == 2


async def test_a_window_larger_than_any_list_is_the_whole_history(store: es.EventStore) -> None:
    threads = ThreadStore(store)
    for text in ("a", "b", "c"):
        await threads.append_message("t", user(text))
    for limit in (3, 10**6, 10**20):
        assert [m.message.text for m in await threads.list_messages("t", limit)] == ["a", "b", "c"]
    assert await threads.list_messages("t", 0) == []


async def test_negative_counts_are_refused_and_write_nothing(store: es.EventStore) -> None:
    threads = ThreadStore(store)
    turn = await threads.open_turn("t")
    for bad in (
        {"steps": -1},
        {"usage": es.Usage(input_tokens=-1)},
        {"usage": es.Usage(output_tokens=3, cached_tokens=-2)},
        {"usage": es.Usage(cost_usd=-0.5)},
    ):
        with pytest.raises(es.InvalidInputError, match=">= 0"):
            await threads.settle_turn("t", turn, outcome="completed", **bad)
    assert await store.version("t") == 1


async def test_state_version_conflict_writes_nothing(store: es.EventStore) -> None:
    threads = ThreadStore(store)
    await threads.update_state("t", "plan", 1, turn_id=None, expected_block_version=0)
    with pytest.raises(es.ViewConflictError) as info:
        await threads.update_state("t", "plan", 2, turn_id=None, expected_block_version=0)
    assert info.value.actual == 1
    assert (await threads.state("t"))["plan"].value == 1
    assert await store.version("t") == 1


async def test_a_state_update_planned_in_a_gone_life_writes_nothing(store: es.EventStore) -> None:
    """The block read at version 1, then the thread deleted and written again up to block
    version 1: the block version alone let the stale update land in the new life."""
    threads = ThreadStore(store)
    await threads.update_state("t", "plan", "old", turn_id=None)
    read = await threads.context("t", limit=0)
    assert read.state["plan"].version == 1
    assert read.incarnation is not None and read.incarnation == await store.incarnation("t")
    await threads.delete_thread("t")
    await threads.update_state("t", "plan", "new", turn_id=None)
    with pytest.raises(es.IncarnationConflictError) as info:
        await threads.update_state(
            "t",
            "plan",
            "from the old plan",
            turn_id=None,
            expected_block_version=1,
            expected_incarnation=read.incarnation,
        )
    assert info.value.actual_incarnation == await store.incarnation("t")
    assert (await threads.state("t"))["plan"].value == "new"
    assert await store.version("t") == 1
    # In its own life, the same update lands.
    now = await threads.context("t", limit=0)
    await threads.update_state(
        "t",
        "plan",
        "next",
        turn_id=None,
        expected_block_version=1,
        expected_incarnation=now.incarnation,
    )
    assert (await threads.state("t"))["plan"].value == "next"
    with pytest.raises(es.InvalidInputError, match="expected_incarnation"):
        await threads.update_state("t", "plan", 1, turn_id="x", expected_incarnation=0)
    assert (await threads.context("never")).incarnation is None


async def test_events_tagged_with_a_turn_never_opened_are_refused(store: es.EventStore) -> None:
    threads = ThreadStore(store)
    turn = await threads.open_turn("t", request_message={"role": "user", "content": "hi"})
    await threads.update_state("t", "plan", 1, turn_id=turn)
    await threads.append_message("t", {"role": "assistant", "content": "ok"}, turn_id=turn)
    other = await threads.open_turn("elsewhere")
    for bad in ("not-a-turn", other):  # unknown, or a turn of another thread
        with pytest.raises(TurnNotFoundError, match=bad):
            await threads.update_state("t", "plan", 2, turn_id=bad)
        with pytest.raises(TurnNotFoundError, match=bad):
            await threads.append_message("t", {"role": "user", "content": "x"}, turn_id=bad)
    with pytest.raises(es.InvalidInputError, match="turn_id"):
        await threads.update_state("t", "plan", 2, turn_id="")
    assert await store.version("t") == 3
    assert (await threads.state("t"))["plan"].value == 1


async def test_counts_are_named_as_the_caller_named_them(store: es.EventStore) -> None:
    threads = ThreadStore(store)
    await threads.append_message("t", {"role": "user", "content": "x"})
    with pytest.raises(es.InvalidInputError, match=r"^limit must be an int >= 0, not -1$"):
        await threads.list_messages("t", -1)
    with pytest.raises(es.InvalidInputError, match=r"^limit must be"):
        await threads.context("t", limit=-1)
    with pytest.raises(es.InvalidInputError, match=r"^records must be"):
        await threads.context("t", records=-2)
    with pytest.raises(es.InvalidInputError, match=r"^expected_block_version must be"):
        await threads.update_state("t", "plan", 1, turn_id=None, expected_block_version=-1)
    with pytest.raises(es.ConcurrencyError, match=r"expected version NO_THREAD \(no events yet\)"):
        await store.append(
            "t",
            [es.MessageAppended(message=es.Message(role="user", content="y"))],
            expected_version=es.NO_THREAD,
        )
    assert await store.version("t") == 1


async def test_a_lone_surrogate_is_refused_as_invalid_input(store: es.EventStore) -> None:
    """Python strings may hold unpaired surrogates, which have no UTF-8 form: refused as
    `EventValidationError` (an `EventStoreError`), not a bare UnicodeEncodeError."""
    bad = {"role": "user", "content": "bad \ud800 surrogate"}
    threads, sessions = ThreadStore(store), SessionStore(store)
    attempts = [
        sessions.append("s", [bad]),
        threads.append_message("t", bad),
        threads.open_turn("t", request_message=bad),
        threads.update_state("t", "plan", {"note": "\udfff"}, turn_id=None),
        store.append(
            "raw", [es.MessageAppended(message=es.Message(role="user", content="\ud800"))]
        ),
    ]
    for attempt in attempts:
        with pytest.raises(es.EventValidationError, match="surrogates not allowed"):
            await attempt
    assert [await store.version(t) for t in ("s", "t", "raw")] == [0, 0, 0]


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (float("nan"), "is nan (JSON has no NaN or infinity)"),
        ({"budget": [1.0, float("-inf")]}, "at ['budget'][1] is -inf"),
        (b"raw", "is of type bytes, not a JSON type"),
        ({"tags": {"a", "b"}}, "at ['tags'] is of type set"),
        ({1: "one"}, "is keyed by 1, of type int (JSON keys are strings)"),
        (datetime(2026, 1, 1, tzinfo=UTC), "is of type datetime"),
    ],
)
async def test_a_state_value_json_cannot_hold_is_refused(
    store: es.EventStore, value: object, said: str
) -> None:
    """State is read and exported as JSON: a value that would come back as something else
    is refused before anything is written, wherever it is written from."""
    threads = ThreadStore(store)
    turn = await threads.open_turn("t")
    with pytest.raises(
        es.EventValidationError, match=re.escape(f"state block 'plan': the value {said}")
    ):
        await threads.update_state("t", "plan", value, turn_id=turn)
    with pytest.raises(es.EventValidationError, match=re.escape(said)):
        await threads.settle_turn(
            "t", turn, outcome="completed", state_updates=[StateUpdate("plan", value)]
        )
    assert await store.version("t") == 1
    assert await threads.state("t") == {}
    await threads.update_state("t", "plan", {"fine": (1, 2.5, None, True)}, turn_id=turn)
    assert (await threads.state("t"))["plan"].value == {"fine": [1, 2.5, None, True]}


async def test_bad_state_updates_are_refused_before_the_turn_is_looked_up(
    store: es.EventStore,
) -> None:
    """Bad input is named as such, not answered "turn not found" (or with a settlement) by the
    record read that comes first: an undeclared block, a value JSON cannot hold, a message
    that is no message, for a turn that was never opened and for one that was."""
    threads = ThreadStore(store, state=StateProjection([PLANNER], blocks=["scratch"]))
    opened = await threads.open_turn("t")
    settled = await threads.open_turn("t")
    await threads.settle_turn("t", settled, outcome="completed")
    version = await store.version("t")
    for turn in ("never-opened", opened, settled):
        with pytest.raises(UnknownBlockError, match="'notes' is not declared"):
            await threads.update_state("t", "notes", 1, turn_id=turn)
        with pytest.raises(es.EventValidationError, match="is nan"):
            await threads.update_state("t", "plan", math.nan, turn_id=turn)
        with pytest.raises(UnknownBlockError, match="'notes' is not declared"):
            await threads.settle_turn(
                "t", turn, outcome="failed", state_updates=[StateUpdate("notes", 1)]
            )
        with pytest.raises(es.EventValidationError, match="is nan"):
            await threads.settle_turn(
                "t", turn, outcome="failed", state_updates=[StateUpdate("plan", math.nan)]
            )
        with pytest.raises(es.InvalidInputError, match="role"):
            await threads.settle_turn(
                "t", turn, outcome="completed", assistant_message={"content": "no role"}
            )
    assert await store.version("t") == version
    # Good input for the turn never opened still finds it missing.
    with pytest.raises(TurnNotFoundError):
        await threads.update_state("t", "plan", 1, turn_id="never-opened")
    with pytest.raises(TurnNotFoundError):
        await threads.settle_turn("t", "never-opened", outcome="failed")
    # And a settlement of the open turn keeps its parent and grant from the record.
    child = await threads.open_turn("t", parent_turn_id=opened, grant={"max_steps": 2})
    record = (await threads.settle_turn("t", child, outcome="completed")).record
    assert (record.parent_turn_id, record.grant) == (opened, es.Grant(max_steps=2))


async def test_turn_ids_and_message_lists_are_checked_with_plain_words(
    store: es.EventStore,
) -> None:
    threads, sessions = ThreadStore(store), SessionStore(store)
    with pytest.raises(es.InvalidInputError, match=r"^turn_id is 600 characters long, the limit"):
        await threads.open_turn("t", turn_id="x" * 600)
    with pytest.raises(es.InvalidInputError, match=r"holds a control character '\\n'"):
        await threads.open_turn("t", turn_id="turn\n1")
    with pytest.raises(es.InvalidInputError, match=r"^parent_turn_id .* control character"):
        await threads.open_turn("t", parent_turn_id="p\x00")
    one = {"role": "user", "content": "hi"}
    with pytest.raises(
        es.InvalidInputError, match=r"^messages must be a list of messages, not dict \(one message"
    ):
        await sessions.append("s", one)  # type: ignore[arg-type]
    with pytest.raises(
        es.InvalidInputError, match=r"^messages must be a list of messages, not str"
    ):
        await sessions.replace("s", "hi")  # type: ignore[arg-type]
    with pytest.raises(es.InvalidInputError, match=r"^result must be a list of messages"):
        session_update([one], one)  # type: ignore[arg-type]
    assert await store.version("t") == 0 and await store.version("s") == 0
    assert await threads.open_turn("t", turn_id="x" * 256) == "x" * 256


async def test_saving_what_is_not_a_session_update_is_refused_with_plain_words(
    store: es.EventStore,
) -> None:
    """`save` takes what `session_update` returns; the messages themselves, or the loaded
    `Transcript`, are refused as invalid input (not an AttributeError) and write nothing."""
    sessions = SessionStore(store)
    await sessions.append("s", [{"role": "user", "content": "a"}])
    loaded = await sessions.load("s")
    for wrong, named in [
        ([{"role": "user", "content": "b"}], "list"),
        (loaded, "Transcript"),
        ({"mode": "append", "messages": []}, "dict"),
        (None, "NoneType"),
    ]:
        with pytest.raises(
            es.InvalidInputError,
            match=rf"^update must be a SessionUpdate \(session_update\(before, result\)\), "
            rf"not {named}",
        ):
            await sessions.save("s", wrong)  # type: ignore[arg-type]
    assert await store.version("s") == 1
    assert await sessions.save("s", session_update(loaded, [*loaded.messages, user("b")])) == 2


async def test_a_store_not_awaited_is_refused_when_the_adapter_is_made(redis_url: str) -> None:
    """``SessionStore(es.connect(url))`` (no await) is refused at once, saying to await it,
    not with an AttributeError of the coroutine at the first call; so is any non-store."""
    pending = es.connect(redis_url, namespace="a" + uuid.uuid4().hex[:12])
    try:
        for make in (SessionStore, Auditor):
            with pytest.raises(
                es.InvalidInputError,
                match=rf"^{make.__name__} needs an EventStore \(from eventstore.connect\), not "
                r"coroutine: await it",
            ):
                make(pending)  # type: ignore[arg-type]
            with pytest.raises(es.InvalidInputError, match=r"needs an EventStore .*, not str$"):
                make(redis_url)  # type: ignore[arg-type]
    finally:
        async with await pending:
            pass


async def test_jsonl_files_take_the_event_store_itself_and_refuse_other_things(
    store: es.EventStore, tmp_path: Path
) -> None:
    """``import_jsonl(store, ...)`` with the store `connect` returned (not a SessionStore)
    works as with ``SessionStore(store)``; anything else is refused with plain words, not an
    AttributeError from inside."""
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_bytes(b'{"role":"user","content":"hi"}\n')
    report = await import_jsonl(store, path, "s")
    assert (report.imported, report.version) == (1, 1)
    assert await export_jsonl(store, "s", out) == 1
    assert out.read_bytes() == path.read_bytes()
    threads = ThreadStore(store)
    with pytest.raises(
        es.InvalidInputError,
        match=r"^import_jsonl needs a SessionStore or an EventStore, not ThreadStore",
    ):
        await import_jsonl(threads, path, "s2")  # type: ignore[arg-type]
    with pytest.raises(
        es.InvalidInputError, match=r"^export_jsonl needs a SessionStore or an EventStore"
    ):
        await export_jsonl(threads, "s", out)  # type: ignore[arg-type]
    assert await store.version("s2") == 0


async def test_a_message_missing_its_role_or_content_is_told_so(store: es.EventStore) -> None:
    threads = ThreadStore(store)
    cases: list[tuple[dict[str, object], str]] = [
        (
            {"role": "user"},
            r"^a message needs content \(a string or a list of parts\); it has none",
        ),
        ({"content": "hi"}, r"^a message needs a role \(one of system, user, assistant, tool\)"),
        (
            {"role": "user", "content": 5},
            r"^message content must be a string or a list of parts, not int",
        ),
        ({"role": "bot", "content": "hi"}, r"^message role must be one of .*, not 'bot'"),
    ]
    for message, said in cases:
        with pytest.raises(es.MessageFormatError, match=said):
            await threads.append_message("t", message)
    assert await store.version("t") == 0


async def test_two_instances_interleave_on_one_thread(redis_url: str) -> None:
    namespace = "a" + uuid.uuid4().hex[:12]
    a_store = await es.connect(redis_url, namespace=namespace)
    b_store = await es.connect(redis_url, namespace=namespace)
    try:
        instances = [ThreadStore(a_store), ThreadStore(b_store)]
        turn_ids: list[str] = []

        async def run(i: int, store: ThreadStore) -> None:
            for n in range(25):
                turn = await store.open_turn("shared", request_message=user(f"{i}-{n}"))
                turn_ids.append(turn)
                await store.settle_turn(
                    "shared", turn, outcome="completed", assistant_message=assistant(f"{i}-{n}!")
                )

        async with anyio.create_task_group() as tg:
            for i, inst in enumerate(instances):
                tg.start_soon(run, i, inst)
        assert len(set(turn_ids)) == 50
        history = await instances[0].list_messages("shared", limit=1000)
        texts = [m.message.text for m in history]
        assert len(texts) == 100
        for i in range(2):
            asked = [t for t in texts if t.startswith(f"{i}-") and not t.endswith("!")]
            assert asked == [f"{i}-{n}" for n in range(25)]
            for n in range(25):
                assert texts.index(f"{i}-{n}") < texts.index(f"{i}-{n}!")
        seqs = [m.seq for m in history]
        assert seqs == sorted(seqs)
    finally:
        await a_store.close()
        await b_store.close()


async def test_settle_retried_after_a_timeout_writes_once(redis_url: str) -> None:
    namespace = "a" + uuid.uuid4().hex[:12]
    store = await es.connect(redis_url, namespace=namespace)
    admin = await es.connect(redis_url, namespace=namespace)
    assert isinstance(admin, es.RedisEventStore)
    try:
        threads = ThreadStore(store)
        turn = await threads.open_turn("t", request_message=user("q"))
        # Hold every write on the server so the settle is cut off while in flight.
        await admin.client.execute_command("CLIENT", "PAUSE", "300", "WRITE")
        with anyio.move_on_after(0.1) as scope:
            await threads.settle_turn(
                "t", turn, outcome="completed", assistant_message=assistant("a")
            )
        assert scope.cancelled_caught
        await anyio.sleep(0.4)
        retry = await threads.settle_turn(
            "t", turn, outcome="completed", assistant_message=assistant("a")
        )
        assert retry.record.outcome == "completed"
        events = await read_all(store, "t")
        assert [e.type for e in events].count("turn.settled") == 1
        texts = [m.message.text for m in await threads.list_messages("t")]
        assert texts == ["q", "a"]
    finally:
        await store.close()
        await admin.close()


async def test_saving_nothing_still_checks_an_explicit_expected_version(
    store: es.EventStore,
) -> None:
    sessions = SessionStore(store)
    await sessions.append("s", [{"role": "user", "content": "a"}])
    await sessions.append("s", [{"role": "user", "content": "b"}])
    nothing = SessionUpdate(mode="append", messages=[])
    assert await sessions.save("s", nothing) == 2
    assert await sessions.save("s", nothing, expected_version=2) == 2
    assert await sessions.save("s", nothing, expected_version=es.EXISTS) == 2
    with pytest.raises(es.ConcurrencyError) as stale:
        await sessions.save("s", nothing, expected_version=1)
    assert (stale.value.expected, stale.value.actual) == (1, 2)
    with pytest.raises(es.ConcurrencyError):
        await sessions.save("s", nothing, expected_version=es.NO_THREAD)
    with pytest.raises(es.InvalidInputError, match="expected_version"):
        await sessions.save("s", nothing, expected_version=-1)
    assert await store.version("s") == 2


async def test_an_update_is_saved_only_to_the_session_it_was_computed_from(
    store: es.EventStore,
) -> None:
    """Two sessions at the same version: an update computed from one's transcript and saved
    to the other would append its tail there, after messages it was never compared with."""
    sessions = SessionStore(store)
    await sessions.append("s1", [user("a1"), assistant("b1")])
    await sessions.append("s2", [user("a2"), assistant("b2")])
    loaded = await sessions.load("s1")
    update = session_update(loaded, [*loaded.messages, user("c1")])
    assert update.session_id == "s1"
    with pytest.raises(es.InvalidInputError, match="session 's1'"):
        await sessions.save("s2", update)
    assert [m.text for m in (await sessions.load("s2")).messages] == ["a2", "b2"]
    await sessions.save("s1", update)
    assert [m.text for m in (await sessions.load("s1")).messages] == ["a1", "b1", "c1"]
    assert session_update([user("x")], [user("x"), user("y")]).session_id is None


@pytest.mark.parametrize("mode", ["append", "replace"])
async def test_a_save_retried_with_its_idempotency_key_writes_once(
    store: es.EventStore, mode: str
) -> None:
    """A save whose outcome is unknown (a timeout) retried with the same key: the first
    save's version, not a conflict with the writer's own write, and one write."""
    sessions = SessionStore(store)
    await sessions.append("s", [user("q1"), assistant("a1")])
    loaded = await sessions.load("s")
    result = [*loaded.messages, user("q2")] if mode == "append" else [user("summary")]
    update = session_update(loaded, result)
    assert update.mode == mode
    first = await sessions.save("s", update, idempotency_key="turn-2")
    other = SessionStore(store)  # the retry of a process that never heard the answer
    assert await other.save("s", update, idempotency_key="turn-2") == first
    assert await store.version("s") == first
    assert [m.text for m in (await sessions.load("s")).messages] == [m.text for m in result]
    with pytest.raises(es.InvalidInputError):
        await sessions.save("s", update, idempotency_key="")


async def test_session_update_and_stale_writers(store: es.EventStore) -> None:
    before = [user("a"), assistant("b")]
    extended = session_update(before, [*before, user("c")])
    assert extended.mode == "append" and [m.text for m in extended.messages] == ["c"]
    compacted = session_update(before, [assistant("summary")])
    assert compacted.mode == "replace"
    assert session_update(before, before).messages == []
    nothing = session_update(before, before)
    await SessionStore(store).append("s-none", before)
    assert await SessionStore(store).save("s-none", nothing) == 1  # never loaded: still 1
    # An imported line keeps its original text as ``source``; a runtime hands the messages back
    # in their JSON form, without it. Still the same messages: an append, not a replace.
    imported = [es.Message.from_json_bytes(b'{"role": "user",  "content": "a"}'), before[1]]
    assert imported[0].source is not None
    handed_back = [m.to_json() for m in imported] + [{"role": "user", "content": "c"}]
    again = session_update(imported, handed_back)
    assert again.mode == "append" and [m.text for m in again.messages] == ["c"]
    changed = [{"role": "user", "content": "A"}, handed_back[1]]
    assert session_update(imported, changed).mode == "replace"
    with pytest.raises(es.InvalidInputError, match="not str"):
        session_update(["a"], [])  # type: ignore[list-item]

    writer_a, writer_b = SessionStore(store), SessionStore(store)
    await writer_a.append("s", before)
    await writer_b.load("s")
    await writer_a.load("s")
    await writer_a.save("s", extended)
    with pytest.raises(es.ConcurrencyError):
        await writer_b.replace("s", [assistant("stale summary")])
    assert [m.text for m in (await writer_a.load("s")).messages] == ["a", "b", "c"]
    loaded = await writer_b.load("s")
    await writer_b.save("s", session_update(loaded.messages, [assistant("fresh summary")]))
    assert [m.text for m in (await writer_a.load("s")).messages] == ["fresh summary"]


@pytest.mark.parametrize(
    ("stored", "handed_back"),
    [
        ({"flag": 1, "n": 0}, {"flag": True, "n": False}),  # Python: 1 == True, 0 == False
        ({"score": 0.0}, {"score": -0.0}),  # Python: 0.0 == -0.0
        ({"score": 2}, {"score": 2.0}),  # Python: 2 == 2.0
    ],
    ids=["int-bool", "zero-sign", "int-float"],
)
async def test_a_message_changed_only_in_its_json_types_is_replaced_not_kept(
    store: es.EventStore, stored: dict[str, Any], handed_back: dict[str, Any]
) -> None:
    """Values Python calls equal but JSON does not: the message read as unchanged, the update
    appended after it, and the stored transcript kept the old values for good."""
    sessions = SessionStore(store)
    await sessions.append("s", [{"role": "user", "content": "hi", **stored}])
    loaded = await sessions.load("s")
    changed = {"role": "user", "content": "hi", **handed_back}
    update = session_update(loaded, [changed, {"role": "assistant", "content": "yo"}])
    assert update.mode == "replace", update
    await sessions.save("s", update)
    stored_first = (await sessions.load("s")).messages[0]
    assert stored_first.to_json() == changed
    # In a part's input too.
    call = {"type": "tool-call", "toolCallId": "c1", "toolName": "f", "input": {"x": 1, "y": 2}}
    await sessions.append("p", [{"role": "assistant", "content": [call]}])
    loaded = await sessions.load("p")
    floated = {"role": "assistant", "content": [{**call, "input": {"x": 1.0, "y": 2}}]}
    assert session_update(loaded, [floated]).mode == "replace"
    # The same JSON, its keys in another order: unchanged, so an append of the new tail only.
    reordered = {"content": [{**call, "input": {"y": 2, "x": 1}}], "role": "assistant"}
    same = session_update(loaded, [reordered, {"role": "user", "content": "next"}])
    assert same.mode == "append" and [m.text for m in same.messages] == ["next"]


async def test_a_writer_is_stale_after_its_retry_was_answered_from_the_ledger(
    store: es.EventStore,
) -> None:
    a, b = SessionStore(store), SessionStore(store)
    await a.load("s")
    await b.load("s")
    await a.append("s", [user("a1")], idempotency_key="k1")
    assert await a.append("s", [user("a1")], idempotency_key="k1") == 1  # the retry: a duplicate
    await b.load("s")
    await b.append("s", [user("b1")])
    with pytest.raises(es.ConcurrencyError):  # a never saw b1
        await a.replace("s", [assistant("summary of a1")])
    assert [m.text for m in (await b.load("s")).messages] == ["a1", "b1"]


async def test_requests_sharing_one_session_store_are_writers_of_their_own(
    store: es.EventStore,
) -> None:
    """A server with one SessionStore and a task per request: what one request loaded is
    its own expected version, whatever the other requests wrote meanwhile."""
    sessions = SessionStore(store)
    await sessions.append("s", [user("hello")])
    loaded = anyio.Event()
    a_wrote = anyio.Event()
    outcome: dict[str, object] = {}

    async def request_a() -> None:
        await sessions.load("s")
        await loaded.wait()
        await sessions.append("s", [user("A's message")])
        a_wrote.set()

    async def request_b() -> None:
        before = await sessions.load("s")
        loaded.set()
        await a_wrote.wait()
        try:
            await sessions.save("s", session_update(before.messages, [assistant("summary")]))
            outcome["b"] = "saved"
        except es.ConcurrencyError as exc:
            outcome["b"] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(request_a)
        tg.start_soon(request_b)
    assert isinstance(outcome["b"], es.ConcurrencyError)
    assert [m.text for m in (await sessions.load("s")).messages] == ["hello", "A's message"]


async def test_a_task_started_after_a_load_does_not_see_its_parents_later_writes(
    store: es.EventStore,
) -> None:
    """A child task inherits the version its parent had loaded when the child started; the
    parent's writes after that must not become the child's: its write is stale."""
    sessions = SessionStore(store)
    await sessions.append("s", [user("u1")])
    await sessions.load("s")  # this task remembers version 1
    go = anyio.Event()
    outcome: dict[str, object] = {}

    async def summarizer() -> None:
        await go.wait()
        try:
            outcome["child"] = await sessions.replace("s", [assistant("summary of u1")])
        except es.ConcurrencyError as exc:
            outcome["child"] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(summarizer)  # the child's context: this task's, version 1
        assert await sessions.append("s", [user("u2")]) == 2
        go.set()
    child = outcome["child"]
    assert isinstance(child, es.ConcurrencyError), child
    assert (child.expected, child.actual) == (1, 2)
    assert [m.text for m in (await sessions.load("s")).messages] == ["u1", "u2"]


async def test_a_worker_task_remembers_the_sessions_it_served_last(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One task serving session after session (a queue worker): it remembered every session
    it ever served, and each write copied all of them (4.5 ms an append after 20,000). It
    now keeps the ones it served last, still checks those, and forgets the oldest."""
    import adapters._sessions as sessions_module

    # Small buckets: the bound is reached after a few dozen sessions, not a thousand.
    monkeypatch.setattr(sessions_module, "REMEMBER_PER_BUCKET", 2)
    bound = sessions_module.REMEMBER_BUCKETS * 2
    sessions = SessionStore(store)
    await sessions.append("first", [user("a")])
    await sessions.load("first")
    served = [f"s{i}" for i in range(20 * bound)]
    for session_id in served:
        await sessions.append(session_id, [user("hi")])
    assert len(sessions._versions.get()) <= bound
    last = served[-1]
    await sessions.load(last)
    await SessionStore(store).append(last, [user("another writer")])
    with pytest.raises(es.ConcurrencyError):  # served last: remembered, so checked
        await sessions.append(last, [user("stale")])
    # Served before 640 others: forgotten, so written as by a task that never loaded it.
    await SessionStore(store).append("first", [user("another writer")])
    assert await sessions.append("first", [user("unchecked")]) == 3
    assert [m.text for m in (await sessions.load(last)).messages] == ["hi", "another writer"]


async def test_an_update_of_a_loaded_transcript_carries_its_version(
    store: es.EventStore,
) -> None:
    sessions = SessionStore(store)
    await sessions.append("s", [user("a")])
    loaded = await sessions.load("s")
    update = session_update(loaded, [*loaded.messages, user("b")])
    assert (update.mode, update.expected_version) == ("append", 1)
    assert session_update(loaded.messages, [user("x")]).expected_version is None
    await SessionStore(store).append("s", [user("elsewhere")])
    # The same store, this very task: still refused, by the version the update carries.
    sessions.forget("s")
    with pytest.raises(es.ConcurrencyError) as info:
        await sessions.save("s", update)
    assert (info.value.expected, info.value.actual) == (1, 2)
    fresh = await sessions.load("s")
    assert await sessions.save("s", session_update(fresh, [*fresh.messages, user("b")])) == 3


async def test_a_stale_save_after_the_session_was_deleted_and_written_again_is_refused(
    store: es.EventStore,
) -> None:
    """The ABA of a session: A loads it at version 2; it is deleted (an idle sweep) and B
    starts it again, up to version 2. Versions restart at 1, so only the life the transcript
    was loaded in tells A's update (its remembered version too) from one made for B's."""
    a, b = SessionStore(store), SessionStore(store)
    await a.append("s", [user("a1")])
    await a.append("s", [assistant("a2")])
    loaded = await a.load("s")
    assert loaded.version == 2 and loaded.incarnation == await store.incarnation("s")
    update = session_update(loaded, [*loaded.messages, user("stale")])
    assert update.expected_incarnation == loaded.incarnation
    await b.delete("s")
    await b.append("s", [user("b1")])
    await b.append("s", [assistant("b2")])
    with pytest.raises(es.IncarnationConflictError) as by_update:
        await a.save("s", update)
    assert isinstance(by_update.value, es.ConcurrencyError)
    assert by_update.value.actual_incarnation == await store.incarnation("s")
    with pytest.raises(es.IncarnationConflictError):  # the version this task remembers
        await a.append("s", [user("stale")])
    with pytest.raises(es.IncarnationConflictError):
        await a.replace("s", [assistant("stale summary")])
    with pytest.raises(es.IncarnationConflictError):  # nothing to write, still checked
        await a.save("s", session_update(loaded, loaded.messages))
    assert [m.text for m in (await b.load("s")).messages] == ["b1", "b2"]
    assert await store.version("s") == 2
    # Loaded again, in the session's new life: A's write lands, and later ones follow it.
    fresh = await a.load("s")
    assert await a.save("s", session_update(fresh, [*fresh.messages, user("a3")])) == 3
    assert await a.append("s", [assistant("a4")]) == 4
    assert [m.text for m in (await b.load("s")).messages] == ["b1", "b2", "a3", "a4"]


async def test_a_session_started_by_this_writer_is_remembered_in_its_life(
    store: es.EventStore,
) -> None:
    """A writer that creates a session learns its life from the append itself: deleted and
    written again by another writer to the same version, its next write is refused."""
    a, b = SessionStore(store), SessionStore(store)
    assert (await a.load("s")).incarnation is None  # no session yet: no life to check
    assert await a.append("s", [user("a1")]) == 1
    await b.delete("s")
    await b.append("s", [user("b1")])
    with pytest.raises(es.IncarnationConflictError):
        await a.append("s", [user("a2")])
    assert [m.text for m in (await b.load("s")).messages] == ["b1"]


async def test_a_transcript_bigger_than_one_event_is_written_whole(store: es.EventStore) -> None:
    """A compacted transcript over the event size limit (1 MiB) goes as several events of one
    atomic append; only a single message over the limit is refused, writing nothing."""
    sessions = SessionStore(store)
    big = [user(f"{i}" + "x" * 300_000) for i in range(4)]
    version = await sessions.append("bs-1", big)
    assert [m.text[0] for m in (await sessions.load("bs-1")).messages] == ["0", "1", "2", "3"]
    await sessions.load("bs-1")
    assert version == 2  # two events, one append
    replaced = await sessions.replace("bs-1", [assistant("summary"), *big])
    assert replaced == version + 2
    loaded = (await sessions.load("bs-1")).messages
    assert [m.text[:2] for m in loaded] == ["su", "0x", "1x", "2x", "3x"]
    assert (await Projector(store).check("bs-1")).ok
    with pytest.raises(es.EventTooLargeError):
        await sessions.append("bs-1", [user("y" * 1_100_000)])
    assert await store.version("bs-1") == replaced


ALL_PARTS = {
    "role": "assistant",
    "content": [
        {"type": "text", "text": "héllo ✓ 𝄞", "providerOptions": {"x": {"cache": True}}},
        {"type": "reasoning", "text": "thinking"},
        {"type": "tool-call", "toolCallId": "c1", "toolName": "search", "input": {"q": "x"}},
        {"type": "tool-result", "toolCallId": "c1", "toolName": "search", "output": [1, 2.5]},
        {"type": "file", "mediaType": "application/pdf", "url": "https://example.com/a.pdf"},
        {"type": "image", "image": "aGVsbG8=", "mediaType": "image/png"},
        {"type": "source", "sourceType": "url", "id": "s1", "url": "https://example.com"},
        {"type": "text", "text": "x", "unknownField": {"nested": [1, None]}},
    ],
    "providerOptions": {"anthropic": {"cacheControl": {"type": "ephemeral"}}},
    "futureField": 7,
}


def jsonl_lines() -> list[bytes]:
    big = "x" * 1_000_000
    return [
        json.dumps({"role": "system", "content": "be brief"}, separators=(",", ":")).encode(),
        json.dumps(ALL_PARTS, separators=(",", ":"), ensure_ascii=False).encode(),
        # Not canonical: spaces, escaped unicode, key order; must still come back byte for byte.
        b'{"content": "caf\\u00e9", "role": "user", "id": "m-1"}',
        json.dumps(
            {
                "role": "tool",
                "content": [
                    {
                        "type": "tool-result",
                        "toolCallId": "c1",
                        "toolName": "search",
                        "output": {"ok": True},
                    }
                ],
            }
        ).encode(),
        json.dumps({"role": "user", "content": big}, separators=(",", ":")).encode(),
    ]


async def test_jsonl_round_trip_is_byte_faithful(store: es.EventStore, tmp_path: Path) -> None:
    sessions = SessionStore(store)
    source = tmp_path / "session.jsonl"
    lines = jsonl_lines()
    source.write_bytes(b"\n".join(lines) + b"\n")
    report = await import_jsonl(sessions, source, "s")
    assert (report.imported, report.skipped, report.duplicate) == (5, [], False)
    again = await import_jsonl(sessions, source, "s")
    assert again.duplicate
    assert len((await sessions.load("s")).messages) == 5
    out = tmp_path / "out.jsonl"
    assert await export_jsonl(sessions, "s", out) == 5
    assert out.read_bytes() == source.read_bytes()
    # Written as any file the user writes: 0666 less the umask (mkstemp alone gives 0600).
    mask = os.umask(0o022)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask
    with pytest.raises(es.InvalidInputError, match="is a directory"):
        await export_jsonl(sessions, "s", tmp_path)
    loaded = (await sessions.load("s")).messages
    assert isinstance(loaded[1].content, list)
    assert isinstance(loaded[1].content[2], es.ToolCallPart)
    assert isinstance(loaded[1].content[6], es.OtherPart)


async def test_jsonl_lines_too_large_to_store_are_not_called_malformed(tmp_path: Path) -> None:
    store = es.MemoryEventStore(max_event_bytes=4096)
    sessions = SessionStore(store)
    text = "x" * 2500
    pretty = json.dumps({"role": "user", "content": text}, indent=2).encode()  # 2.5 KB compact
    path = tmp_path / "big.jsonl"
    path.write_bytes(
        b'{"role":"user","content":"ok"}\n'
        + json.dumps({"role": "user", "content": "y" * 5000}, separators=(",", ":")).encode()
        + b"\n"
        + pretty.replace(b"\n", b"")  # one line, with spaces: kept as written besides parsed
        + b"\n"
    )
    with pytest.raises(JsonlImportError) as info:
        await import_jsonl(sessions, path, "s")
    error = str(info.value)
    assert "malformed" not in error
    assert [(e.line, e.too_large) for e in info.value.errors] == [(2, True), (3, True)]
    limit = 4096 - 512  # the event's envelope keeps a margin
    assert "2 line(s) too large to store: line 2: the message stores as 5," in error
    assert f"over the limit of {limit:,} bytes" in error
    # The pretty line stores twice (its text and the parsed message); compact, it would fit.
    third = info.value.errors[1].reason
    assert "not compact JSON" in third and "about 2," in third, third
    assert "not compact JSON" not in info.value.errors[0].reason
    assert await store.version("s") == 0
    # Malformed and too large lines are told apart in one message.
    path.write_bytes(b"nope\n" + path.read_bytes())
    with pytest.raises(
        JsonlImportError, match=r"1 malformed line\(s\): line 1: .*; 2 line\(s\) too"
    ):
        await import_jsonl(sessions, path, "s")
    report = await import_jsonl(sessions, path, "s", skip_bad=True)
    assert report.imported == 1 and [e.line for e in report.skipped] == [1, 3, 4]


async def test_jsonl_malformed_lines(store: es.EventStore, tmp_path: Path) -> None:
    sessions = SessionStore(store)
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b'{"role":"user","content":"ok"}\n'
        b"not json\n"
        b'{"role":"robot","content":"x"}\n'
        b"\n"
        b"[1,2]\n"
        b'{"role":"user","content":"also ok"}\n'
        b'{"role":"user","content":"trunc'
    )
    with pytest.raises(JsonlImportError) as info:
        await import_jsonl(sessions, path, "s")
    assert [e.line for e in info.value.errors] == [2, 3, 4, 5, 7]
    assert "line 2" in str(info.value)
    assert await store.version("s") == 0
    report = await import_jsonl(sessions, path, "s", skip_bad=True)
    assert report.imported == 2 and [e.line for e in report.skipped] == [2, 3, 4, 5, 7]
    assert [m.text for m in (await sessions.load("s")).messages] == ["ok", "also ok"]
    with pytest.raises(es.InvalidInputError):
        await import_jsonl(sessions, tmp_path / "missing.jsonl", "s")
    # A byte order mark opens the file, not the first message; CRLF ends lines as LF does.
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(
        b'\xef\xbb\xbf{"role":"user","content":"first"}\r\n{"role":"user","content":"b"}'
    )
    assert (await import_jsonl(sessions, bom, "s-bom")).imported == 2
    assert [m.text for m in (await sessions.load("s-bom")).messages] == ["first", "b"]


async def test_jsonl_copies_that_differ_only_in_what_an_import_drops_import_once(
    store: es.EventStore, tmp_path: Path
) -> None:
    sessions = SessionStore(store)
    lines = [b'{"role":"user","content":"a"}', b'{"role":"assistant","content":"b \\u00e9"}']
    clean = b"".join(line + b"\n" for line in lines)
    variants = [
        clean,
        clean + b"\n\n",  # re-saved by an editor
        b"\xef\xbb\xbf" + b"".join(line + b"\r\n" for line in lines),  # BOM and CRLF
    ]
    reports = []
    for i, data in enumerate(variants):
        path = tmp_path / f"copy{i}.jsonl"
        path.write_bytes(data)
        reports.append(await import_jsonl(sessions, path, "s"))
    assert [(r.imported, r.duplicate, r.version) for r in reports] == [
        (2, False, 1),
        (2, True, 1),
        (2, True, 1),
    ]
    assert len((await sessions.load("s")).messages) == 2
    # A clean file's key is the hash of its bytes, as before: files imported by earlier
    # releases are still recognised.
    messages, _ = parse_jsonl(clean, max_message_bytes=1 << 20)
    assert b"".join(m.to_json_bytes() + b"\n" for m in messages) == clean


async def test_jsonl_blank_lines_at_the_end_and_files_with_no_message(
    store: es.EventStore, tmp_path: Path
) -> None:
    sessions = SessionStore(store)
    path = tmp_path / "s.jsonl"
    # Blank lines after the last message are no lines of the file (a hand-edited file's).
    path.write_bytes(b'{"role":"user","content":"a"}\r\n{"role":"user","content":"b"}\n\n \r\n')
    report = await import_jsonl(sessions, path, "s")
    assert (report.lines, report.imported, report.skipped) == (2, 2, [])
    out = tmp_path / "out.jsonl"
    assert await export_jsonl(sessions, "s", out) == 2
    # Each message byte for byte; line ends LF, one final newline.
    assert out.read_bytes() == b'{"role":"user","content":"a"}\n{"role":"user","content":"b"}\n'
    # A file with no message writes nothing and says so: an import never reports success
    # for a session that export would then not find.
    for data, skip_bad in ((b"", False), (b"\n\n", False), (b"nope\n", True)):
        path.write_bytes(data)
        with pytest.raises(JsonlImportError, match="no message to import") as info:
            await import_jsonl(sessions, path, "empty", skip_bad=skip_bad)
        assert info.value.empty
    assert await store.version("empty") == 0


async def test_export_jsonl_needs_a_session_transcript(
    store: es.EventStore, tmp_path: Path
) -> None:
    sessions = SessionStore(store)
    out = tmp_path / "out.jsonl"
    with pytest.raises(NoTranscriptError, match="nothing was ever written"):
        await export_jsonl(sessions, "never", out)
    threads = ThreadStore(store)
    turn = await threads.open_turn("chat", request_message={"role": "user", "content": "hi"})
    await threads.settle_turn(
        "chat", turn, outcome="completed", assistant_message={"role": "assistant", "content": "yo"}
    )
    with pytest.raises(NoTranscriptError, match="has no session transcript"):
        await export_jsonl(sessions, "chat", out)
    assert not out.exists()
    # A transcript compacted to nothing is a transcript: an empty file.
    await sessions.append("s", [es.Message(role="user", content="x")])
    await sessions.replace("s", [])
    assert await export_jsonl(sessions, "s", out) == 0
    assert out.read_bytes() == b""


async def test_access_policy_denies_and_writes_nothing(store: es.EventStore) -> None:
    policy = TenantPolicy()
    threads = ThreadStore(store, policy=policy)
    sessions = SessionStore(store, policy=policy)
    insider = Principal(id="alice", tenant=store.namespace)
    outsider = Principal(id="mallory", tenant="other-tenant")
    await threads.append_message("t", user("secret"), principal=insider)
    calls: list[Any] = [
        threads.list_messages("t", principal=outsider),
        threads.append_message("t", user("x"), principal=outsider),
        threads.state("t", principal=outsider),
        threads.update_state("t", "b", 1, turn_id=None, principal=outsider),
        threads.open_turn("t", principal=outsider),
        threads.records("t", principal=outsider),
        threads.records(principal=outsider),
        sessions.load("t", principal=outsider),
        sessions.append("t", [user("x")], principal=outsider),
        threads.list_messages("t"),  # no principal at all
    ]
    for call in calls:
        with pytest.raises(AccessDenied):
            await call
    assert await store.version("t") == 1
    assert [m.message.text for m in await threads.list_messages("t", principal=insider)] == [
        "secret"
    ]
    # A per-thread policy: the session id alone proves nothing.
    owners = {"t": "alice"}
    by_owner = ThreadStore(
        store,
        policy=CallbackPolicy(
            lambda p, action, ns, thread: p is not None and owners.get(thread or "") == p.id
        ),
    )
    with pytest.raises(AccessDenied):
        await by_owner.list_messages("t", principal=Principal(id="bob"))
    assert len(await by_owner.list_messages("t", principal=Principal(id="alice"))) == 1
    # A callback that forgets to return (None) denies: the policy fails closed.
    forgetful = ThreadStore(store, policy=CallbackPolicy(lambda p, action, ns, thread: None))  # type: ignore[arg-type,return-value]
    with pytest.raises(AccessDenied):
        await forgetful.append_message("t", user("x"), principal=Principal(id="alice"))
    assert await store.version("t") == 1


async def test_settling_answers_with_stored_records_so_it_needs_read_access_too(
    store: es.EventStore,
) -> None:
    """A principal allowed to write but not to read a thread (an ingestion service) must not
    read another's settlement through settle_turn's answer."""
    threads = ThreadStore(store)
    turn = await threads.open_turn("t", grant={"max_cost_usd": 2.5})
    await threads.settle_turn(
        "t", turn, outcome="failed", error={"kind": "secret-failure", "message": "db password"}
    )
    open_turn = await threads.open_turn("t")
    write_only = ThreadStore(
        store, policy=CallbackPolicy(lambda p, action, ns, thread: action == "write")
    )
    for settling in (turn, open_turn):
        with pytest.raises(AccessDenied, match="may not read"):
            await write_only.settle_turn("t", settling, outcome="completed")
    assert await store.version("t") == 3
    record = await threads.turn("t", open_turn)
    assert record is not None and record.is_open


class RuleTable(dict[str, str]):
    """A policy as a table of thread -> owner: empty, it allows nobody anything."""

    async def allows(
        self, principal: Principal | None, action: str, namespace: str, thread_id: str | None
    ) -> bool:
        return principal is not None and self.get(thread_id or "") == principal.id


async def test_principal_roles_are_names_not_text(store: es.EventStore) -> None:
    """Roles given as one string were searched as text: with ``admin_role="admin"`` a
    principal of another tenant whose roles read "not-an-admin" reached this tenant."""
    await ThreadStore(store).append_message("t", user("secret"))
    threads = ThreadStore(store, policy=TenantPolicy(admin_role="admin"))
    with pytest.raises(es.InvalidInputError, match="roles"):
        Principal(id="mallory", tenant="other", roles="not-an-admin")  # type: ignore[arg-type]
    for bad in (
        lambda: Principal(id="m", roles=["admin", 1]),  # type: ignore[arg-type]
        lambda: Principal(id=5),  # type: ignore[arg-type]
        lambda: Principal(id="m", tenant=["t"]),  # type: ignore[arg-type]
        lambda: TenantPolicy(admin_role=["admin"]),  # type: ignore[arg-type]
    ):
        with pytest.raises(es.InvalidInputError):
            bad()
    listed = Principal(id="ops", tenant="other", roles=["admin"])  # type: ignore[arg-type]
    assert listed.roles == frozenset({"admin"})
    assert len(await threads.list_messages("t", principal=listed)) == 1
    with pytest.raises(AccessDenied):
        await threads.list_messages(
            "t", principal=Principal(id="m", tenant="other", roles=frozenset({"not-an-admin"}))
        )


@pytest.mark.frameworks
async def test_the_idle_sweep_refuses_a_ttl_that_is_none(store: es.EventStore) -> None:
    from adapters.openai_agents import sweep_idle_sessions

    with pytest.raises(es.InvalidInputError, match="ttl"):
        await sweep_idle_sessions(store, None)  # type: ignore[arg-type]


@pytest.mark.frameworks
async def test_a_policy_that_is_falsy_still_decides(store: es.EventStore) -> None:
    """An empty rule table is falsy: taken for "no policy" (``policy or AllowAll()``), it let
    every call through where it should deny them all."""
    from adapters.openai_agents import ThreadlogSession

    rules = RuleTable()
    assert not rules
    alice = Principal(id="alice")
    threads = ThreadStore(store, policy=rules)
    sessions = SessionStore(store, policy=rules)
    agents = ThreadlogSession("t", store, policy=rules, principal=alice)
    for call in (
        threads.append_message("t", user("x"), principal=alice),
        threads.list_messages("t", principal=alice),
        sessions.append("t", [user("x")], principal=alice),
        agents.add_items([{"role": "user", "content": "x"}]),
    ):
        with pytest.raises(AccessDenied):
            await call
    assert await store.version("t") == 0
    rules["t"] = "alice"
    await threads.append_message("t", user("x"), principal=alice)
    assert await store.version("t") == 1


@pytest.mark.frameworks
async def test_stores_refuse_what_is_no_store_policy_or_schema(store: es.EventStore) -> None:
    """Misconfiguration is refused when the store is built, with a typed error, instead of an
    AttributeError on every later call."""
    from adapters.openai_agents import ThreadlogSession

    bad: list[Any] = [
        lambda: ThreadStore("redis://localhost"),  # type: ignore[arg-type]
        lambda: ThreadStore(store, policy="tenant"),  # type: ignore[arg-type]
        lambda: ThreadStore(store, state=[PLANNER]),  # type: ignore[arg-type]
        lambda: ThreadStore(store, new_turn_id="ulid"),  # type: ignore[arg-type]
        lambda: SessionStore(store, policy=TenantPolicy),  # type: ignore[arg-type]  # the class
        lambda: ThreadlogSession("s", "redis://localhost"),  # type: ignore[arg-type]
        lambda: ThreadlogSession("s", store, policy=object()),  # type: ignore[arg-type]
        lambda: CallbackPolicy(True),  # type: ignore[arg-type]
        lambda: CallbackPolicy(lambda p, a, ns, t: True, reader_view="planner"),  # type: ignore[arg-type]
    ]
    for build in bad:
        with pytest.raises(es.InvalidInputError):
            build()


@pytest.mark.frameworks
def test_a_store_not_awaited_is_refused_saying_so() -> None:
    from adapters.openai_agents import ThreadlogSession

    pending = es.connect("memory://")
    try:
        for build in (lambda: ThreadStore(pending), lambda: ThreadlogSession("s", pending)):  # type: ignore[arg-type]
            with pytest.raises(es.InvalidInputError, match="await it"):
                build()
    finally:
        pending.close()  # never awaited, on purpose: closed without a warning


@pytest.mark.parametrize(
    ("argument", "value", "unknown"),
    [
        ("usage", {"input": 12, "output_tokens": 3}, "'input'"),
        ("timing", {"start_ms": 5}, "'start_ms'"),
        ("error", {"kind": "x", "msg": "y"}, "'msg'"),
        ("fallbacks", [{"from": "big", "tier": "small"}], "'tier'"),
    ],
)
async def test_a_misspelt_field_of_a_settlement_is_refused_not_dropped(
    store: es.EventStore, argument: str, value: Any, unknown: str
) -> None:
    """{"input": 12} for input_tokens used to be dropped, and the record said 0 tokens."""
    threads = ThreadStore(store)
    turn = await threads.open_turn("t", request_message={"role": "user", "content": "q"})
    version = await store.version("t")
    with pytest.raises(es.InvalidInputError, match=unknown) as caught:
        await threads.settle_turn("t", turn, outcome="completed", **{argument: value})
    assert argument in str(caught.value)
    assert await store.version("t") == version  # nothing written: the turn is still open
    record = await threads.projector.record("t", turn)
    assert record is not None and record.is_open


async def test_an_unknown_outcome_is_refused_naming_the_outcomes(store: es.EventStore) -> None:
    threads = ThreadStore(store)
    turn = await threads.open_turn("t")
    version = await store.version("t")
    with pytest.raises(es.InvalidInputError, match="outcome must be one of completed, failed"):
        await threads.settle_turn("t", turn, outcome="done")  # type: ignore[arg-type]
    assert await store.version("t") == version


async def test_a_principal_of_another_type_is_refused_and_writes_nothing(
    store: es.EventStore,
) -> None:
    """A name or a dict passed as the principal: every policy would fail on it with an
    AttributeError (and the default one let it through); it is bad input, refused first."""
    owner = CallbackPolicy(lambda p, action, ns, thread: p is not None and p.id == "alice")
    for policy in (None, TenantPolicy(), TenantPolicy(admin_role="admin"), owner):
        threads = ThreadStore(store, policy=policy)
        sessions = SessionStore(store, policy=policy)
        bad_principals: list[Any] = ["alice", {"id": "alice", "tenant": store.namespace}]
        for bad in bad_principals:
            calls: list[Any] = [
                threads.append_message("t", user("x"), principal=bad),
                threads.list_messages("t", principal=bad),
                threads.open_turn("t", principal=bad),
                threads.update_state("t", "b", 1, turn_id=None, principal=bad),
                threads.state("t", principal=bad),
                threads.context("t", principal=bad),
                threads.records(principal=bad),
                threads.delete_thread("t", principal=bad),
                sessions.append("t", [user("x")], principal=bad),
                sessions.load("t", principal=bad),
            ]
            for call in calls:
                with pytest.raises(es.InvalidInputError, match="principal must be a Principal"):
                    await call
    assert await store.version("t") == 0


async def test_a_policy_can_confine_a_principal_to_a_reader_view(store: es.EventStore) -> None:
    """Reader views as a boundary: a principal the policy names a view for reads state
    through that view only; every other principal reads as before."""
    views = {"planner-agent": "planner"}
    confined = ThreadStore(
        store,
        state=StateProjection([ReaderView("planner", {"plan": None, "profile": ("name",)})]),
        policy=CallbackPolicy(
            lambda p, action, ns, thread: True,
            reader_view=lambda p, ns, thread: views.get(p.id) if p is not None else None,
        ),
    )
    await confined.update_state("t", "plan", {"step": 1}, turn_id=None)
    await confined.update_state("t", "profile", {"name": "Ada", "email": "a@x"}, turn_id=None)
    agent, operator = Principal(id="planner-agent"), Principal(id="operator")
    for call, asked in [
        (confined.state("t", principal=agent), "every block"),
        (confined.state("t", "other", principal=agent), "reader view 'other'"),
        (confined.context("t", principal=agent), "every block"),
    ]:
        with pytest.raises(AccessDenied) as denied:
            await call
        assert str(denied.value) == (
            "planner-agent may not read thread 't': its state only through reader view "
            f"'planner', not {asked}"
        )
        assert denied.value.reason is not None
    seen = await confined.state("t", "planner", principal=agent)
    assert seen["profile"].value == {"name": "Ada"}
    ctx = await confined.context("t", view="planner", principal=agent)
    assert set(ctx.state) == {"plan", "profile"} and ctx.state["profile"].value == {"name": "Ada"}
    everything = await confined.state("t", principal=operator)
    assert everything["profile"].value == {"name": "Ada", "email": "a@x"}
    # An async callback works the same way.

    async def confine(p: Principal | None, ns: str, thread: str) -> str | None:
        return "planner"

    strict = ThreadStore(
        store,
        state=StateProjection([ReaderView("planner", {"plan": None})]),
        policy=CallbackPolicy(lambda p, action, ns, thread: True, reader_view=confine),
    )
    with pytest.raises(AccessDenied):
        await strict.state("t")
    assert set(await strict.state("t", "planner")) == {"plan"}


async def test_records_across_threads_newest_first_paginated(store: es.EventStore) -> None:
    threads = ThreadStore(store)
    settled: list[str] = []
    for i in range(7):
        thread = f"t{i % 3}"
        turn = await threads.open_turn(thread)
        await threads.settle_turn(thread, turn, outcome="completed")
        settled.append(turn)
        await anyio.sleep(0.002)
    seen: list[str] = []
    cursor = None
    while True:
        page = await threads.records(limit=3, after=cursor)
        seen += [r.turn_id for r in page.records]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == list(reversed(settled))
    one = await threads.records("t0", limit=2)
    assert [r.turn_id for r in one.records] == [settled[6], settled[3]]
    assert one.next_cursor is not None
    rest = await threads.records("t0", limit=2, after=one.next_cursor)
    assert [r.turn_id for r in rest.records] == [settled[0]] and rest.next_cursor is None


async def test_records_pages_across_more_threads_than_one_read_batch(
    store: es.EventStore,
) -> None:
    """More threads than are read at once, settled in an order unrelated to their names: every
    record comes once, newest first, whatever the page size."""
    threads = ThreadStore(store)
    n_threads = RECORDS_READ_AHEAD + 9
    settled: list[str] = []
    for i in range(2 * n_threads):
        thread = f"t{(i * 7) % n_threads}"
        turn = await threads.open_turn(thread)
        await threads.settle_turn(thread, turn, outcome="completed")
        settled.append(turn)
        await anyio.sleep(0.002)  # record times are ms: one turn per ms keeps the order exact
    for size in (1, 5, 40, 200):
        seen: list[str] = []
        cursor = None
        while True:
            page = await threads.records(limit=size, after=cursor)
            seen += [r.turn_id for r in page.records]
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert seen == list(reversed(settled)), size


async def test_a_records_page_across_threads_lists_the_index_a_batch_at_a_time(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page near the front does not list every thread of the namespace first: with many
    idle threads behind a busy one, the index is read one batch of threads at a time and the
    read stops once older threads cannot change the page."""
    threads = ThreadStore(store)
    for i in range(3 * RECORDS_READ_AHEAD):
        await store.append(f"idle{i}", [es.NewEvent(payload=es.MessageAppended(message=user("x")))])
    await anyio.sleep(0.002)
    turns = []
    for _ in range(3):
        turn = await threads.open_turn("busy")
        await threads.settle_turn("busy", turn, outcome="completed")
        turns.append(turn)
    listed: list[int] = []
    real = store.threads

    async def counting(**kwargs: Any) -> list[es.ThreadInfo]:
        found = await real(**kwargs)
        listed.append(len(found))
        return found

    monkeypatch.setattr(store, "threads", counting)
    page = await threads.records(limit=2)
    assert [r.turn_id for r in page.records] == turns[:0:-1]
    assert listed and max(listed) <= RECORDS_READ_AHEAD
    # The idle threads hold no records, so nothing ends the read early: it pages to the end.
    whole = await threads.records(limit=10)
    assert [r.turn_id for r in whole.records] == turns[::-1]
    assert max(listed) <= RECORDS_READ_AHEAD and sum(listed) >= 3 * RECORDS_READ_AHEAD


async def test_deleting_a_thread_and_a_session(store: es.EventStore) -> None:
    threads = ThreadStore(store)
    sessions = SessionStore(store)
    turn = await threads.open_turn("t", request_message=user("hi"))
    await threads.settle_turn("t", turn, outcome="completed", assistant_message=assistant("yo"))
    await sessions.append("s", [user("a")])
    assert await threads.delete_thread("t") == 2
    assert await threads.list_messages("t") == []
    assert (await threads.records("t")).records == []
    assert await threads.turn("t", turn) is None
    assert await sessions.delete("s") == 1
    assert (await sessions.load("s")).messages == []
    await sessions.append("s", [user("fresh start")])
    assert [m.text for m in (await sessions.load("s")).messages] == ["fresh start"]


async def test_jsonl_export_writes_only_regular_files_and_keeps_their_mode(
    store: es.EventStore, tmp_path: Path
) -> None:
    sessions = SessionStore(store)
    await sessions.append("s", [user("hi")])
    kept = tmp_path / "kept.jsonl"
    kept.write_bytes(b"old\n")
    kept.chmod(0o600)
    assert await export_jsonl(sessions, "s", kept) == 1
    assert kept.stat().st_mode & 0o777 == 0o600 and kept.read_bytes().startswith(b"{")
    target = tmp_path / "target"
    target.write_bytes(b"untouched")
    link, fifo = tmp_path / "link", tmp_path / "fifo"
    link.symlink_to(target)
    os.mkfifo(fifo)
    for path in (link, fifo):
        with pytest.raises(es.InvalidInputError, match="not a regular file"):
            await export_jsonl(sessions, "s", path)
    assert link.is_symlink() and target.read_bytes() == b"untouched"
    assert fifo.is_fifo()


@pytest.mark.parametrize("levels", [200, 5000])
async def test_jsonl_nested_too_deeply_is_a_malformed_line(
    store: es.EventStore, tmp_path: Path, levels: int
) -> None:
    """Too deep for the log, whether or not this Python's decoder parses it (200 levels
    parse everywhere; 5,000 fail on 3.11 and parse on 3.13)."""
    deep = tmp_path / "deep.jsonl"
    nested = "[" * levels + "]" * levels
    deep.write_text(
        '{"role":"user","content":"x","n":'
        + nested
        + "}\n"
        + json.dumps({"role": "user", "content": "fine"})
        + "\n"
    )
    with pytest.raises(JsonlImportError) as info:
        await import_jsonl(SessionStore(store), deep, "s")
    assert "line 1" in str(info.value) and "nested too deeply" in str(info.value)
    report = await import_jsonl(SessionStore(store), deep, "s", skip_bad=True)
    assert report.imported == 1 and [e.line for e in report.skipped] == [1]


async def test_values_nested_too_deeply_are_refused_typed_through_the_store(
    store: es.EventStore,
) -> None:
    """A message or state value nested past what the log stores is refused with
    EventValidationError before any view op is computed, on every Python (3.11 raised a bare
    RecursionError here, 3.13 stored what 3.11 cannot read), and nothing is written."""
    threads = ThreadStore(store)
    sessions = SessionStore(store)
    deep: Any = []
    for _ in range(2_000):
        deep = [deep]
    with pytest.raises(es.EventValidationError, match="levels deep"):
        await threads.update_state("t", "plan", deep, turn_id=None)
    with pytest.raises(es.EventValidationError, match="levels deep"):
        await threads.append_message("t", {"role": "user", "content": "x", "n": deep})
    with pytest.raises(es.EventValidationError, match="levels deep"):
        await sessions.append("s", [{"role": "user", "content": [{"type": "x", "n": deep}]}])
    assert await store.version("t") == 0 and await store.version("s") == 0


async def test_the_demo_conversation_settles_no_later_than_it_is_recorded(
    store: es.EventStore,
) -> None:
    from adapters._demo import SCRIPT_SPAN_MS, record_demo

    thread = f"demo-{uuid.uuid4().hex[:8]}"
    await record_demo(store, thread)
    events = await read_all(store, thread)
    settled = [(e.time_ms, e.payload) for e in events if isinstance(e.payload, es.TurnSettled)]
    for time_ms, turn in settled:
        assert turn.timing.settled_ms <= time_ms, turn
    roots = [turn for _, turn in settled if turn.parent_turn_id is None]
    first = min(turn.timing.started_ms for turn in roots)
    last = max(turn.timing.settled_ms for turn in roots)
    assert last - first == SCRIPT_SPAN_MS


# -- messages: every field back, and exports that say what load() says -------------------------

# Fields given at their default value (null, false): the struct alone would drop them.
AT_DEFAULTS: list[dict[str, Any]] = [
    {"role": "user", "content": "x", "id": None, "providerOptions": None},
    {
        "role": "tool",
        "content": [
            {
                "type": "tool-result",
                "toolCallId": "c1",
                "toolName": "lookup",
                "output": None,
                "isError": False,
            },
            {"type": "tool-result", "toolCallId": "c2", "toolName": "lookup", "isError": False},
        ],
    },
    {
        "role": "assistant",
        "content": [
            {"type": "tool-call", "toolCallId": "c", "toolName": "t", "input": None},
            {"type": "text", "text": "t", "providerOptions": None},
            {"type": "image", "image": "u", "mediaType": None},
            {"type": "file", "mediaType": "m", "data": None, "url": None, "filename": None},
        ],
    },
]


async def test_message_fields_given_at_their_default_value_survive(
    store: es.EventStore, tmp_path: Path
) -> None:
    sessions, threads = SessionStore(store), ThreadStore(store)
    await sessions.append("s", AT_DEFAULTS)
    for message in AT_DEFAULTS:
        await threads.append_message("t", message)
    loaded = (await sessions.load("s")).messages
    listed = [m.message for m in await threads.list_messages("t")]
    # Key for key, in order: these dicts list the modelled fields in threadlog's order.
    want = [json.dumps(m) for m in AT_DEFAULTS]
    assert [json.dumps(m.to_json()) for m in loaded] == want
    assert [json.dumps(m.to_json()) for m in listed] == want
    out = tmp_path / "out.jsonl"
    await export_jsonl(sessions, "s", out)
    assert out.read_bytes() == b"".join(msgspec.json.encode(m) + b"\n" for m in AT_DEFAULTS)
    # The attributes are what they always were (an explicit null is None, false is False).
    content = loaded[1].content
    assert isinstance(content, list) and isinstance(content[0], es.ToolResultPart)
    assert content[0].output is None and content[0].is_error is False
    assert loaded[0].id is None and loaded[0].provider_options is None
    # An attribute set to another value wins over the explicit default kept beside it.
    flagged = msgspec.structs.replace(content[0], is_error=True, output="boom")
    assert es.Message(role="tool", content=[flagged]).to_json()["content"][0] == {
        **AT_DEFAULTS[1]["content"][0],
        "output": "boom",
        "isError": True,
    }
    named = msgspec.structs.replace(loaded[0], id="m-1")
    assert named.to_json() == {**AT_DEFAULTS[0], "id": "m-1"}


def test_messages_without_explicit_defaults_store_as_they_always_did() -> None:
    """The stored form of a message is unchanged: events written before decode the same."""
    message = es.Message.from_json(
        {
            "role": "tool",
            "id": "m1",
            "content": [
                {
                    "type": "tool-result",
                    "toolCallId": "c1",
                    "toolName": "t",
                    "output": {"ok": True},
                },
                {"type": "tool-call", "toolCallId": "c2", "toolName": "t"},
                {"type": "file", "mediaType": "text/plain", "url": "https://example.com/a.txt"},
            ],
            "x": 1,
        }
    )
    # Encoded by the release before explicit defaults were kept.
    before = (
        b"\x84\xa4role\xa4tool\xa7content\x93\x84\xa4type\xabtool-result\xaatoolCallId\xa2c1"
        b"\xa8toolName\xa1t\xa6output\x81\xa2ok\xc3\x83\xa4type\xa9tool-call\xaatoolCallId"
        b"\xa2c2\xa8toolName\xa1t\x83\xa4type\xa4file\xa9mediaType\xaatext/plain\xa3url"
        b"\xb9https://example.com/a.txt\xa2id\xa2m1\xa5extra\x81\xa1x\x01"
    )
    assert msgspec.msgpack.encode(message) == before
    assert msgspec.msgpack.decode(before, type=es.Message) == message


async def test_jsonl_export_writes_what_load_returns_after_a_redaction(
    store: es.EventStore, tmp_path: Path
) -> None:
    sessions = SessionStore(store)
    source = tmp_path / "s.jsonl"
    # Spaced lines keep their text as ``source``, for a byte-faithful export.
    kept = b'{ "role": "user", "content": "nothing secret" }'
    source.write_bytes(
        b'{ "role": "user", "content": "my SSN is 078-05-1120" }\n'
        + kept
        + b'\n{"role": "user", "content": "n", "n": 1}\n'
    )
    await import_jsonl(sessions, source, "s")
    transcript = await sessions.load("s")
    secret, untouched, counted = transcript.messages
    redacted = [
        msgspec.structs.replace(secret, content="[redacted]"),
        untouched,
        # Equal in Python (1 == True), not as JSON: the source no longer says it.
        msgspec.structs.replace(counted, extra={"n": True}),
    ]
    await sessions.replace("s", redacted, expected_version=transcript.version, reason="redact")
    loaded = (await sessions.load("s")).messages
    out = tmp_path / "out.jsonl"
    await export_jsonl(sessions, "s", out)
    exported = out.read_bytes()
    assert b"078-05-1120" not in exported
    assert exported.splitlines() == [
        b'{"role":"user","content":"[redacted]"}',
        kept,  # unchanged: still byte for byte
        b'{"role":"user","content":"n","n":true}',
    ]
    assert [json.loads(line) for line in exported.splitlines()] == [m.to_json() for m in loaded]
    # Nor is the original text kept with the redacted message: the replace stored it without
    # its source (only the import's own event, in the log, still holds it).
    assert loaded[0].source is None and loaded[2].source is None
    assert loaded[1].source == kept.decode()
    replaced = await Projector(store).transcript("s")
    assert all("078-05-1120" not in (m.message.source or "") for m in replaced)


async def test_pretty_printed_json_exports_as_one_line(
    store: es.EventStore, tmp_path: Path
) -> None:
    sessions = SessionStore(store)
    pretty = json.dumps({"role": "user", "content": "hello"}, indent=2)
    message = es.Message.from_json_bytes(pretty)
    assert message.source is None  # a JSONL line cannot hold it
    assert message.to_json_bytes() == b'{"role":"user","content":"hello"}'
    # As stored by a release that kept multi-line text: exported canonical all the same.
    older = msgspec.structs.replace(message, source=pretty)
    crlf = msgspec.structs.replace(message, source='{"role":"user",\r"content":"hello"}')
    await sessions.append("s", [message, older, crlf, {"role": "assistant", "content": "hi"}])
    out = tmp_path / "out.jsonl"
    assert await export_jsonl(sessions, "s", out) == 4
    exported = out.read_bytes()
    assert exported.count(b"\n") == 4 and b"\r" not in exported
    # The library reads its own export back.
    report = await import_jsonl(sessions, out, "again")
    assert report.imported == 4 and report.skipped == []
    assert [m.to_json() for m in (await sessions.load("again")).messages] == [
        m.to_json() for m in (await sessions.load("s")).messages
    ]


async def limited_store(backend: str, redis_url: str, max_event_bytes: int) -> es.EventStore:
    """A store on a fresh namespace whose events hold at most ``max_event_bytes``."""
    namespace = "lim" + uuid.uuid4().hex[:12]
    if backend == "memory":
        return es.MemoryEventStore(namespace=namespace, max_event_bytes=max_event_bytes)
    return await es.connect(redis_url, namespace=namespace, max_event_bytes=max_event_bytes)


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_jsonl_import_splits_events_by_the_stores_own_limit(
    backend: str, redis_url: str, tmp_path: Path
) -> None:
    async with await limited_store(backend, redis_url, 100_000) as store:
        sessions = SessionStore(store)
        path = tmp_path / "s.jsonl"
        lines = [
            msgspec.json.encode({"role": "user", "content": f"{i}" + "z" * 30_000})
            for i in range(10)
        ]
        path.write_bytes(b"".join(line + b"\n" for line in lines))
        report = await import_jsonl(sessions, path, "s")
        assert (report.imported, report.written, report.duplicate) == (10, 10, False)
        assert [m.to_json_bytes() for m in (await sessions.load("s")).messages] == lines
        # Several events, each under the limit (the store refuses any over it).
        assert report.version == await store.version("s") > 1


class Stop(Exception):
    """Raised by `stop_after_one`."""


def stop_after_one(progress: ImportProgress) -> None:
    """An import's progress callback that stops it once its first append is written."""
    if progress.appends == 1:
        raise Stop


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_an_import_run_again_after_a_stop_says_what_it_wrote(
    backend: str, redis_url: str, tmp_path: Path
) -> None:
    # A small event limit: one message per event, so 100 messages take two appends of 64.
    async with await limited_store(backend, redis_url, 8192) as store:
        sessions = SessionStore(store)
        path = tmp_path / "s.jsonl"
        path.write_bytes(
            b"".join(
                msgspec.json.encode({"role": "user", "content": f"{i} " + "y" * 3000}) + b"\n"
                for i in range(100)
            )
        )
        with pytest.raises(Stop):
            await import_jsonl(sessions, path, "s", progress=stop_after_one)
        assert await store.version("s") == 64
        rest = await import_jsonl(sessions, path, "s")
        assert (rest.imported, rest.written, rest.duplicate, rest.version) == (100, 36, False, 100)
        again = await import_jsonl(sessions, path, "s")
        assert (again.imported, again.written, again.duplicate) == (100, 0, True)


async def test_jsonl_lines_that_are_not_unicode_say_so(
    store: es.EventStore, tmp_path: Path
) -> None:
    path = tmp_path / "s.jsonl"
    path.write_bytes(
        b'{"role":"user","content":"fine"}\n'
        b'{"role":"user","content":"\\ud800"}\n'  # a lone high surrogate, ending the string
        b'{"role":"user","content":"a\\udc00b"}\n'  # a lone low surrogate
        b'{"role":"user","content":"\\ud83d\\u0041"}\n'  # a high one not followed by a low
        b'{"role":"user","content":"\xff"}\n'  # not UTF-8
        b'{"role":"user","content":"\\\\ud800 \\ud83d\\ude00"}\n'  # an escaped backslash: fine
        b'{"role":"user","content":"trunc\n'
        b'{"role":"user","content":"x","n":1e400}\n'  # valid JSON, beyond a float
    )
    with pytest.raises(JsonlImportError) as info:
        await import_jsonl(SessionStore(store), path, "s")
    reasons = {e.line: e.reason for e in info.value.errors}
    assert sorted(reasons) == [2, 3, 4, 5, 7, 8]
    assert reasons[8].startswith("a number too large to store (beyond a 64-bit float)")
    assert reasons[2].startswith("unpaired UTF-16 surrogate escape \\ud800 at byte 26")
    assert reasons[3].startswith("unpaired UTF-16 surrogate escape \\udc00 at byte 27")
    assert reasons[4].startswith("unpaired UTF-16 surrogate escape \\ud83d at byte 26")
    assert reasons[5] == "not valid UTF-8: invalid start byte at byte 26"
    assert reasons[7] == "not valid JSON: Input data was truncated"
    assert "line 2: unpaired UTF-16 surrogate" in str(info.value)
    report = await import_jsonl(SessionStore(store), path, "s", skip_bad=True)
    loaded = (await SessionStore(store).load("s")).messages
    assert report.imported == 2 and [m.text for m in loaded] == ["fine", "\\ud800 😀"]


def numbered_lines(first: int, last: int) -> bytes:
    """JSONL lines of messages ``first`` .. ``last - 1``, each ~3 KB (one per event of an
    8 KiB store, `limited_store`)."""
    return b"".join(
        msgspec.json.encode({"role": "user", "content": f"{i} " + "y" * 3000}) + b"\n"
        for i in range(first, last)
    )


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_an_import_of_a_file_grown_since_writes_only_its_new_lines(
    backend: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runtimes append to their session files: importing one again once it has grown writes
    the lines added since, never the earlier ones a second time, whether the earlier import
    ended on an append of the layout or inside one, and however often it grew."""
    monkeypatch.setattr(adapters._jsonl, "EVENTS_PER_APPEND", 4)  # appends end at 4, 8, 12...
    async with await limited_store(backend, redis_url, 8192) as store:
        sessions = SessionStore(store)
        path = tmp_path / "s.jsonl"
        reports = []
        for size in (3, 4, 10, 10, 11, 17):  # inside an append, on an end, across ends
            path.write_bytes(numbered_lines(0, size))
            reports.append(await import_jsonl(sessions, path, "s"))
        assert [(r.imported, r.written, r.duplicate) for r in reports] == [
            (3, 3, False),
            (4, 1, False),
            (10, 6, False),
            (10, 0, True),
            (11, 1, False),
            (17, 6, False),
        ]
        assert reports[-1].version == await store.version("s")
        loaded = [m.to_json_bytes() + b"\n" for m in (await sessions.load("s")).messages]
        assert b"".join(loaded) == numbered_lines(0, 17)  # each line once, in order
        # The same file imported whole into another session writes the same events' worth.
        whole = await import_jsonl(sessions, path, "t")
        assert (whole.written, whole.duplicate) == (17, False)
        assert (await sessions.load("t")).messages == (await sessions.load("s")).messages
        # A file that is no longer an extension (an earlier line edited) is another file:
        # appended whole, as any other file is (its first line matches, which is not enough).
        path.write_bytes(numbered_lines(0, 3))
        assert (await import_jsonl(sessions, path, "u")).written == 3
        edited = numbered_lines(0, 1) + b'{"role":"user","content":"edited"}\n'
        path.write_bytes(edited + numbered_lines(2, 5))
        other = await import_jsonl(sessions, path, "u")
        assert other.written == 5
        loaded = [m.to_json_bytes() + b"\n" for m in (await sessions.load("u")).messages]
        assert b"".join(loaded) == numbered_lines(0, 3) + edited + numbered_lines(2, 5)
        # Grown again, that file writes its new line only.
        path.write_bytes(path.read_bytes() + numbered_lines(99, 100))
        assert (await import_jsonl(sessions, path, "u")).written == 1


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_an_import_stopped_after_a_grown_files_first_append_resumes_exactly(
    backend: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adapters._jsonl, "EVENTS_PER_APPEND", 4)
    async with await limited_store(backend, redis_url, 8192) as store:
        sessions = SessionStore(store)
        path = tmp_path / "s.jsonl"
        path.write_bytes(numbered_lines(0, 6))
        assert (await import_jsonl(sessions, path, "s")).written == 6
        path.write_bytes(numbered_lines(0, 15))
        with pytest.raises(Stop):  # the first append writes 6..7 (it ends where 0..7 does)
            await import_jsonl(sessions, path, "s", progress=stop_after_one)
        assert await store.version("s") == 8
        rest = await import_jsonl(sessions, path, "s")
        assert (rest.written, rest.duplicate, rest.version) == (7, False, 15)
        loaded = [m.to_json_bytes() + b"\n" for m in (await sessions.load("s")).messages]
        assert b"".join(loaded) == numbered_lines(0, 15)


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_imports_of_a_file_at_two_sizes_at_once_write_each_line_once(
    backend: str, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two imports of one session file, one of it before it grew and one after, running at
    once: each plans from the ledger it read, and the shorter one's last append ends between
    the longer one's appends, under another key. Every append expects the version its plan
    was made at, so whichever comes second plans again and writes each line once. The same
    file imported twice at once writes it once (the second finds its appends duplicates)."""
    monkeypatch.setattr(adapters._jsonl, "EVENTS_PER_APPEND", 4)
    async with await limited_store(backend, redis_url, 8192) as store:
        sessions = SessionStore(store)
        short, long = tmp_path / "short.jsonl", tmp_path / "long.jsonl"
        short.write_bytes(numbered_lines(0, 10))
        long.write_bytes(numbered_lines(0, 17))
        original = adapters._jsonl._ImportLayout.imported_before
        racing: list[Path] = []

        async def imported_before(
            layout: adapters._jsonl._ImportLayout, store: es.EventStore, session_id: str
        ) -> int:
            done = await original(layout, store, session_id)
            if racing:  # the other import runs whole between this one's plan and its append
                await import_jsonl(sessions, racing.pop(), session_id)
            return done

        monkeypatch.setattr(adapters._jsonl._ImportLayout, "imported_before", imported_before)
        # "a": the short file written whole between the long one's plan and its first append;
        # "b": the other way round (the short file's last two lines were in the long file's
        # third append, keyed for its 12 lines: found as the messages after its second).
        written = {}
        for first, second, session in ((long, short, "a"), (short, long, "b")):
            racing.append(second)
            report = await import_jsonl(sessions, first, session)
            assert not racing
            loaded = [m.to_json_bytes() + b"\n" for m in (await sessions.load(session)).messages]
            assert b"".join(loaded) == numbered_lines(0, 17), session  # each line once
            assert report.version == await store.version(session)
            written[session] = report.written
        assert written == {"a": 7, "b": 0}
        # An older copy imported after the grown one (no race) writes nothing either.
        monkeypatch.setattr(adapters._jsonl._ImportLayout, "imported_before", original)
        older = await import_jsonl(sessions, short, "b")
        assert (older.written, older.duplicate, older.version) == (0, True, 17)
        monkeypatch.setattr(adapters._jsonl._ImportLayout, "imported_before", imported_before)
        racing.append(long)
        again = await import_jsonl(sessions, long, "c")
        assert (again.written, again.duplicate, again.version) == (0, True, 17)
        loaded = [m.to_json_bytes() + b"\n" for m in (await sessions.load("c")).messages]
        assert b"".join(loaded) == numbered_lines(0, 17)


async def test_an_import_into_a_session_that_keeps_moving_gives_up_having_written_nothing(
    store: es.EventStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adapters._jsonl, "IMPORT_ATTEMPTS", 3)
    sessions = SessionStore(store)
    path = tmp_path / "s.jsonl"
    path.write_bytes(b'{"role":"user","content":"imported"}\n')
    original = adapters._jsonl._ImportLayout.imported_before

    async def imported_before(
        layout: adapters._jsonl._ImportLayout, store: es.EventStore, session_id: str
    ) -> int:
        done = await original(layout, store, session_id)
        await sessions.append(session_id, [user("live")])
        return done

    monkeypatch.setattr(adapters._jsonl._ImportLayout, "imported_before", imported_before)
    with pytest.raises(es.ConcurrencyError):
        await import_jsonl(sessions, path, "s")
    assert [m.text for m in (await sessions.load("s")).messages] == ["live"] * 3


async def test_an_import_written_under_the_whole_file_keys_is_still_recognised(
    store: es.EventStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before an append's key named the messages up to its last, it named the whole file's
    digest and the append's index: a file imported that way (all of it, or its first appends
    before a stop) is not written again."""
    monkeypatch.setattr(adapters._jsonl, "EVENTS_PER_APPEND", 1)
    monkeypatch.setattr(adapters._jsonl, "EVENT_BUDGET_BYTES", 16)  # one message an event
    sessions = SessionStore(store)
    path = tmp_path / "s.jsonl"
    path.write_bytes(b"".join(b'{"role":"user","content":"m%d"}\n' % i for i in range(5)))
    messages, _ = parse_jsonl(path.read_bytes(), max_message_bytes=1 << 20)
    layout = adapters._jsonl._ImportLayout(messages, 16)
    assert layout.ends == [1, 2, 3, 4, 5]
    whole = hashlib.sha256(b"".join(m.to_json_bytes() + b"\n" for m in messages))
    for i in range(3):  # an import by an earlier release, stopped after three appends
        key = f"jsonl:{whole.hexdigest()[:32]}:{i}"
        await sessions.append_batches("s", [messages[i : i + 1]], idempotency_key=key)
    report = await import_jsonl(sessions, path, "s")
    assert (report.written, report.version) == (2, 5)
    assert [m.text for m in (await sessions.load("s")).messages] == [f"m{i}" for i in range(5)]


async def test_past_reads_through_the_thread_store_keep_its_access_policy(
    store: es.EventStore,
) -> None:
    """Reads as of a past point were only on `ThreadStore.projector`, which has no policy: a
    principal confined to a reader view read every block as it was. Through the ThreadStore
    they keep the boundary, and answer what the projector does."""
    views = {"planner-agent": "planner"}
    threads = ThreadStore(
        store,
        state=StateProjection([ReaderView("planner", {"plan": None, "profile": ("name",)})]),
        policy=CallbackPolicy(
            lambda p, action, ns, thread: p is None or p.id != "stranger",
            reader_view=lambda p, ns, thread: views.get(p.id) if p is not None else None,
        ),
    )
    turn = await threads.open_turn("t", request_message={"role": "user", "content": "hi"})
    await threads.update_state("t", "profile", {"name": "Ada", "email": "a@x"}, turn_id=turn)
    point = await store.version("t")
    await threads.update_state("t", "profile", {"name": "Bo", "email": "b@x"}, turn_id=turn)
    await threads.settle_turn(
        "t", turn, outcome="completed", assistant_message={"role": "assistant", "content": "yo"}
    )
    agent, stranger = Principal(id="planner-agent"), Principal(id="stranger")
    with pytest.raises(AccessDenied, match="only through reader view 'planner'"):
        await threads.state("t", as_of=point, principal=agent)
    with pytest.raises(AccessDenied, match="only through reader view 'planner'"):
        await threads.context("t", as_of=point, principal=agent)
    then = await threads.state("t", "planner", as_of=point, principal=agent)
    assert then["profile"].value == {"name": "Ada"}
    assert (await threads.state("t", "planner", principal=agent))["profile"].value == {"name": "Bo"}
    projector = threads.projector
    assert [m.message.text for m in await threads.list_messages("t", as_of=point)] == ["hi"]
    assert await threads.list_messages("t", as_of=point) == await projector.last("t", as_of=point)
    assert await threads.turn("t", turn, as_of=point) == await projector.record(
        "t", turn, as_of=point
    )
    was = await threads.turn("t", turn, as_of=point)
    assert was is not None and was.outcome is None  # open then
    assert await threads.turn_tree("t", as_of=point) == await projector.turn_tree("t", as_of=point)
    assert (await threads.records("t", as_of=point)).records == []  # none settled then
    assert len((await threads.records("t")).records) == 1
    ctx = await threads.context("t", view="planner", records=1, as_of=point, principal=agent)
    assert [m.message.text for m in ctx.messages] == ["hi"] and ctx.records == []
    for read in (
        threads.list_messages("t", as_of=point, principal=stranger),
        threads.turn("t", turn, as_of=point, principal=stranger),
        threads.turn_tree("t", as_of=point, principal=stranger),
        threads.records("t", as_of=point, principal=stranger),
    ):
        with pytest.raises(AccessDenied):
            await read
    with pytest.raises(es.InvalidInputError, match="give a thread_id"):
        await threads.records(as_of=point)
    # A point past the end is refused whatever the count: limit=0 gave an empty page.
    past = await store.version("t") + 5
    for limit in (0, 5):
        with pytest.raises(SeqBeyondVersionError):
            await threads.records("t", limit=limit, as_of=past)
    assert (await threads.records("t", limit=0, as_of=point)).records == []
