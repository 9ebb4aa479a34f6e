"""The scripted agent conversation `threadlog demo` records: threadlog's main job in one thread.

A travel assistant runs four root turns. It spawns child turns (flight, hotel and payment
searches), records state blocks (a profile, the plan, the booking), fails one turn when the
payment provider times out (the state update made before the failure stays recorded), keeps an
AI-SDK-style model transcript through `SessionStore` and compacts it once. The model is
scripted, so token counts and latencies are illustrative; everything else is written exactly as
a runtime would write it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from eventstore import EventStore, Fallback, Grant, Timing, TurnError, Usage
from projections import ReaderView, StateProjection

from ._sessions import SessionStore, session_update
from ._threads import StateUpdate, ThreadStore

PLANNER_VIEW = "planner"
"""The reader view the demo shows: the planner model sees the plan, not the traveller's contact
details or what the booking cost."""

_Json = dict[str, Any]


def demo_state() -> StateProjection:
    """The demo's state schema: three blocks, and the planner's reader view over them."""
    planner = ReaderView(
        PLANNER_VIEW,
        {
            "plan": None,
            "profile": ("name", "home_airport"),
            "booking": ("flight_ref", "hotel_ref"),
        },
    )
    return StateProjection([planner])


class DemoSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What `record_demo` wrote."""

    thread_id: str
    root_turns: int
    child_turns: int
    failed_turns: int
    state_updates: int
    compactions: int
    version: int
    failing_seq: int
    """A seq inside the failed turn: its child has failed, the turn has not settled yet."""


SCRIPT_SPAN_MS = 46_710
"""The scripted latencies of `record_demo`'s root turns, added up (a test holds it to them)."""


class _Recorder:
    """A tiny scripted runtime: opens and settles turns and keeps the session transcript."""

    def __init__(self, store: EventStore, thread_id: str) -> None:
        self.thread_id = thread_id
        self.threads = ThreadStore(store, state=demo_state())
        self.sessions = SessionStore(store)
        # The script's turns take SCRIPT_SPAN_MS in all: starting that long ago, the scripted
        # conversation settles by now, never after the events that record it.
        self.clock_ms = int(time.time() * 1000) - SCRIPT_SPAN_MS
        self.opened: dict[str, int] = {}
        self.roots = self.children = self.failed = self.updates = self.compactions = 0

    def timing(self, latency_ms: int, turn: str | None = None) -> Timing:
        """A scripted latency; a root turn's timing spans its child turns too."""
        started = self.clock_ms if turn is None else self.opened[turn]
        self.clock_ms += latency_ms
        return Timing(started_ms=started, settled_ms=self.clock_ms)

    async def root(self, text: str, *, max_steps: int = 8) -> str:
        self.roots += 1
        turn = await self.threads.open_turn(
            self.thread_id,
            request_message={"role": "user", "content": text},
            grant=Grant(max_steps=max_steps, max_tokens=40_000),
        )
        self.opened[turn] = self.clock_ms
        return turn

    async def child(
        self,
        parent: str,
        task: str,
        *,
        steps: int,
        tokens: tuple[int, int],
        latency_ms: int,
        error: TurnError | None = None,
    ) -> str:
        """A child turn: its request stays in the log only; it adds no conversation message."""
        self.children += 1
        turn = await self.threads.open_turn(
            self.thread_id,
            parent_turn_id=parent,
            request_message={"role": "user", "content": task},
            grant=Grant(max_steps=3),
        )
        if error is not None:
            self.failed += 1
        await self.threads.settle_turn(
            self.thread_id,
            turn,
            outcome="failed" if error is not None else "completed",
            steps=steps,
            model_tier="small",
            usage=Usage(input_tokens=tokens[0], output_tokens=tokens[1]),
            timing=self.timing(latency_ms),
            error=error,
        )
        return turn

    async def state(self, turn: str, block: str, value: _Json) -> None:
        self.updates += 1
        await self.threads.update_state(self.thread_id, block, value, turn_id=turn)

    async def transcript(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """Save the runtime's model transcript: an append when it grew, a replace otherwise."""
        before = await self.sessions.load(self.thread_id)
        update = session_update(before.messages, [*before.messages, *messages])
        await self.sessions.save(self.thread_id, update)

    async def compact(self, summary: str, keep: int) -> None:
        before = await self.sessions.load(self.thread_id)
        kept = before.messages[-keep:]
        result: list[Any] = [{"role": "system", "content": summary}, *kept]
        update = session_update(before.messages, result)
        assert update.mode == "replace"
        self.compactions += 1
        await self.sessions.save(self.thread_id, update)


def _tool_call(call_id: str, tool: str, args: _Json) -> _Json:
    return {
        "role": "assistant",
        "content": [
            {"type": "tool-call", "toolCallId": call_id, "toolName": tool, "input": args},
        ],
    }


def _tool_result(call_id: str, tool: str, output: Any, *, error: bool = False) -> _Json:
    part: _Json = {"type": "tool-result", "toolCallId": call_id, "toolName": tool}
    part["output"] = output
    if error:
        part["isError"] = True
    return {"role": "tool", "content": [part]}


async def record_demo(store: EventStore, thread_id: str) -> DemoSummary:
    """Record the demo conversation into ``thread_id`` (which must be new)."""
    r = _Recorder(store, thread_id)

    # Turn 1: a request that fans out into two child turns, and completes.
    ask1 = (
        "I need to be in Lisbon for a conference on the 14th. Find me a flight from Berlin "
        "under EUR 250 and a hotel near the venue."
    )
    t1 = await r.root(ask1)
    await r.state(
        t1,
        "profile",
        {
            "name": "Ada",
            "home_airport": "BER",
            "email": "ada@example.com",
            "loyalty_no": "TP-4471-0092",
        },
    )
    await r.child(
        t1, "search flights BER->LIS on the 13th, max EUR 250", steps=2, tokens=(1840, 212),
        latency_ms=2310,
    )  # fmt: skip
    await r.child(
        t1, "search hotels within 1 km of the FIL venue, 13th-15th", steps=2, tokens=(1620, 240),
        latency_ms=2750,
    )  # fmt: skip
    answer1 = (
        "TP 537 leaves BER at 09:40 on the 13th for EUR 189, and Casa do Largo is 600 m from "
        "the venue at EUR 142 a night. Shall I book both?"
    )
    plan = {
        "trip": "BER -> LIS, 13th-15th",
        "flight": "TP 537, 13th 09:40, EUR 189",
        "hotel": "Casa do Largo, 2 nights, EUR 284",
        "status": "proposed",
    }
    await r.threads.settle_turn(
        thread_id,
        t1,
        outcome="completed",
        steps=4,
        model_tier="large",
        usage=Usage(input_tokens=5210, output_tokens=388, cached_tokens=1024),
        timing=r.timing(2420, t1),
        assistant_message={"role": "assistant", "content": answer1},
        state_updates=[StateUpdate("plan", plan)],
    )
    r.updates += 1
    await r.transcript(
        [
            {"role": "user", "content": ask1},
            _tool_call("call_1", "search_flights", {"from": "BER", "to": "LIS", "max_eur": 250}),
            _tool_result("call_1", "search_flights", [{"flight": "TP 537", "eur": 189}]),
            _tool_call("call_2", "search_hotels", {"near": "FIL Lisboa", "nights": 2}),
            _tool_result("call_2", "search_hotels", [{"hotel": "Casa do Largo", "eur": 142}]),
            {"role": "assistant", "content": answer1},
        ]
    )

    # Turn 2: the booking fails in its payment child turn. The "booking" status recorded
    # before the failure stays recorded: failure is not rollback.
    ask2 = "Yes, book both please."
    t2 = await r.root(ask2)
    await r.state(t2, "plan", {**plan, "status": "booking"})
    timeout = TurnError(
        kind="tool_timeout", message="payment provider did not answer within 30 s", retryable=True
    )
    await r.child(
        t2, "charge EUR 473 to the card on file", steps=1, tokens=(610, 48), latency_ms=30_120,
        error=timeout,
    )  # fmt: skip
    r.failed += 1
    failing_seq = await store.version(thread_id)
    await r.threads.settle_turn(
        thread_id,
        t2,
        outcome="failed",
        steps=3,
        model_tier="small",
        fallbacks=[Fallback(from_tier="large", to_tier="small", reason="rate limited (429)")],
        usage=Usage(input_tokens=3980, output_tokens=121),
        timing=r.timing(2950, t2),
        error=TurnError(
            kind="child_failed", message="booking aborted: the payment step failed", retryable=True
        ),
    )
    await r.transcript(
        [
            {"role": "user", "content": ask2},
            _tool_call("call_3", "charge_card", {"amount_eur": 473}),
            _tool_result("call_3", "charge_card", "timeout after 30 s", error=True),
        ]
    )

    # Turn 3: the retry goes through; then the runtime compacts the transcript.
    ask3 = "The payment timed out? Please try again."
    t3 = await r.root(ask3)
    await r.child(
        t3, "charge EUR 473 to the card on file", steps=1, tokens=(640, 52), latency_ms=1870
    )
    answer3 = (
        "Done: flight TP 537 is booked (ref LX7Q2M) and Casa do Largo holds your room "
        "(ref CDL-88213). Total EUR 473."
    )
    await r.threads.settle_turn(
        thread_id,
        t3,
        outcome="completed",
        steps=2,
        model_tier="large",
        usage=Usage(input_tokens=4410, output_tokens=97, cached_tokens=2048),
        timing=r.timing(2150, t3),
        assistant_message={"role": "assistant", "content": answer3},
        state_updates=[
            StateUpdate("plan", {**plan, "status": "booked"}),
            StateUpdate(
                "booking", {"flight_ref": "LX7Q2M", "hotel_ref": "CDL-88213", "total_eur": 473}
            ),
        ],
    )
    r.updates += 2
    await r.transcript(
        [
            {"role": "user", "content": ask3},
            _tool_call("call_4", "charge_card", {"amount_eur": 473}),
            _tool_result("call_4", "charge_card", {"status": "paid", "ref": "PAY-5521"}),
            {"role": "assistant", "content": answer3},
        ]
    )
    await r.compact(
        "Summary so far: Ada (BER) travels to Lisbon on the 13th for a conference on the 14th. "
        "Booked TP 537 (LX7Q2M) and Casa do Largo (CDL-88213), EUR 473 in total; the first "
        "payment attempt timed out.",
        keep=2,
    )

    # Turn 4: a plain question, answered from the compacted transcript.
    ask4 = "What will the weather be like that week?"
    t4 = await r.root(ask4)
    await r.child(t4, "weather forecast for Lisbon, 13th-15th", steps=1, tokens=(420, 85),
                  latency_ms=980)  # fmt: skip
    answer4 = "Sunny, 24-27 C by day and about 17 C at night. A light jacket will do."
    await r.threads.settle_turn(
        thread_id,
        t4,
        outcome="completed",
        steps=2,
        model_tier="small",
        usage=Usage(input_tokens=1310, output_tokens=64),
        timing=r.timing(1160, t4),
        assistant_message={"role": "assistant", "content": answer4},
    )
    await r.transcript(
        [{"role": "user", "content": ask4}, {"role": "assistant", "content": answer4}]
    )

    return DemoSummary(
        thread_id=thread_id,
        root_turns=r.roots,
        child_turns=r.children,
        failed_turns=r.failed,
        state_updates=r.updates,
        compactions=r.compactions,
        version=await store.version(thread_id),
        failing_seq=failing_seq,
    )
