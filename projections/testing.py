"""The conformance suite of `Projector` over any `EventStore` backend, shipped for outside backends.

Subclass `ProjectionConformance` in a test module and implement `make_store`; every inherited
test then runs the projections against that backend::

    class TestMyBackendProjections(ProjectionConformance):
        async def make_store(self, namespace):
            return MyEventStore(namespace=namespace)

`delete_view` damages a view behind the projector's back; the default goes through the store
contract (`EventStore.load_views`), and a backend may override it to damage its raw storage.

Requires pytest and the anyio pytest plugin.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import Any, ClassVar

import anyio
import msgspec
import pytest

from eventstore import (
    EventStore,
    EventValidationError,
    Grant,
    HashGetAll,
    HashLoad,
    InvalidInputError,
    ListLoad,
    ListRange,
    Message,
    MessageAppended,
    NewEvent,
    OperationalError,
    Outcome,
    RecordedEvent,
    StateUpdated,
    TranscriptAppended,
    TranscriptReplaced,
    TurnError,
    TurnOpened,
    TurnSettled,
    Usage,
    ViewClear,
    ViewConflictError,
    ViewEntry,
    new_ulid,
)

from ._base import UnknownBlockError, UnknownReaderViewError
from ._messages import StoredMessage
from ._projector import (
    AsOf,
    CheckReport,
    Context,
    Projector,
    RebuildBusyError,
    RebuildError,
    SeqBeyondVersionError,
)
from ._records import Anomaly, TurnNode, TurnRecord
from ._state import Block, ReaderView, StateProjection
from ._transcript import TranscriptMessage

__all__ = [
    "BLOCKS",
    "PLANNER",
    "ProjectionConformance",
    "Snapshot",
    "make_projector",
    "message",
    "opened",
    "settled",
    "snapshot",
    "ulids",
]

PLANNER = ReaderView("planner", {"plan": None, "profile": ("name",)})
"""The reader view the suite reads through: the whole plan, only the profile's name."""

BLOCKS = ("plan", "profile", "notes")
"""The declared state blocks; any other block name is refused."""

NOT_COMPLETED: tuple[Outcome, ...] = ("failed", "cut", "stopped", "truncated", "refused")


def ulids(n: int) -> list[str]:
    """``n`` fresh ULIDs in ascending order (the order turn lists sort by)."""
    return sorted(new_ulid() for _ in range(n))


def make_projector(store: EventStore) -> Projector:
    """A projector with every projection, the `PLANNER` reader view and the `BLOCKS` schema."""
    return Projector(store, state=StateProjection([PLANNER], blocks=BLOCKS))


def message(text: str, role: str = "user") -> Message:
    """A model message with ``text``."""
    return Message(role=role, content=text)  # type: ignore[arg-type]


def opened(turn_id: str, request: str | None = None, parent: str | None = None) -> TurnOpened:
    """A turn admitted, with a user request when ``request`` is given."""
    return TurnOpened(
        turn_id=turn_id,
        parent_turn_id=parent,
        grant=Grant(max_steps=8),
        request=message(request) if request is not None else None,
    )


def settled(
    turn_id: str, outcome: Outcome, answer: str | None = None, parent: str | None = None
) -> TurnSettled:
    """A turn settled with ``outcome``, carrying an assistant message when ``answer`` is given."""
    return TurnSettled(
        turn_id=turn_id,
        outcome=outcome,
        parent_turn_id=parent,
        grant=Grant(max_steps=8),
        steps=3,
        model_tier="small",
        usage=Usage(input_tokens=100, output_tokens=20),
        error=None if outcome == "completed" else TurnError(kind=outcome, message="it did not"),
        assistant_message=message(answer, "assistant") if answer is not None else None,
    )


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Every read a projector answers for a thread, taken at one moment (or as of one point)."""

    messages: list[StoredMessage]
    window: list[StoredMessage]
    state: dict[str, Block]
    planner: dict[str, Block]
    records: list[TurnRecord]
    latest_records: list[TurnRecord]
    turns: list[TurnRecord]
    tree: list[TurnNode]
    transcript: list[TranscriptMessage]


async def snapshot(projector: Projector, thread_id: str, as_of: AsOf | None = None) -> Snapshot:
    """Read everything through the projector's public reads (live, or ``as_of`` a past point)."""
    return Snapshot(
        messages=await projector.last(thread_id, 1_000_000, as_of=as_of),
        window=await projector.last(thread_id, as_of=as_of),
        state=await projector.state(thread_id, as_of=as_of),
        planner=await projector.state(thread_id, PLANNER.name, as_of=as_of),
        records=await projector.records(thread_id, as_of=as_of),
        latest_records=await projector.records(thread_id, last=2, as_of=as_of),
        turns=await projector.turns(thread_id, as_of=as_of),
        tree=await projector.turn_tree(thread_id, as_of=as_of),
        transcript=await projector.transcript(thread_id, as_of=as_of),
    )


async def _events(store: EventStore, thread_id: str) -> list[RecordedEvent]:
    return [e async for e in store.read(thread_id)]


def _texts(messages: Sequence[StoredMessage | TranscriptMessage]) -> list[str]:
    return [m.message.text for m in messages]


class ProjectionConformance:
    """Projection behaviour every backend shares. Subclasses implement `make_store`."""

    pytestmark: ClassVar[Any] = pytest.mark.anyio

    async def make_store(self, namespace: str) -> EventStore:
        """Open a store of this backend on ``namespace``."""
        raise NotImplementedError

    async def delete_view(self, store: EventStore, thread_id: str, view: str) -> None:
        """Remove one materialized view of the thread, leaving its log alone."""
        version = await store.version(thread_id)
        await store.load_views(thread_id, [ViewClear(view)], expected_version=version)

    @pytest.fixture
    async def store(self) -> AsyncIterator[EventStore]:
        store = await self.make_store("p" + uuid.uuid4().hex[:12])
        try:
            yield store
        finally:
            await store.close()

    @pytest.fixture
    def projector(self, store: EventStore) -> Projector:
        return make_projector(store)

    # -- messages: the runtime's rules, case by case --------------------------------------------

    async def test_root_request_joins_at_admission(self, projector: Projector) -> None:
        (turn,) = ulids(1)
        await projector.append("t", [opened(turn, request="hello")])
        # Read-your-writes: the window shows the request as soon as the append returns.
        (stored,) = await projector.last("t")
        assert (stored.seq, stored.turn_id) == (1, turn)
        assert stored.message == message("hello")

    async def test_completed_root_adds_its_assistant_message(self, projector: Projector) -> None:
        (turn,) = ulids(1)
        await projector.append("t", [opened(turn, request="hello")])
        await projector.append("t", [settled(turn, "completed", answer="hi there")])
        window = await projector.last("t")
        assert [(m.seq, m.message.role, m.message.text) for m in window] == [
            (1, "user", "hello"),
            (2, "assistant", "hi there"),
        ]
        assert window[1].turn_id == turn

    @pytest.mark.parametrize("outcome", NOT_COMPLETED)
    async def test_non_completed_root_adds_no_assistant_message(
        self, store: EventStore, projector: Projector, outcome: Outcome
    ) -> None:
        (turn,) = ulids(1)
        await projector.append("t", [opened(turn, request="hello")])
        await projector.append("t", [settled(turn, outcome, answer="half an answer")])
        assert _texts(await projector.last("t")) == ["hello"]
        # The log keeps the assistant message for audit.
        payload = (await _events(store, "t"))[-1].payload
        assert isinstance(payload, TurnSettled)
        assert payload.outcome == outcome
        assert payload.assistant_message == message("half an answer", "assistant")
        assert (await projector.check("t")).ok

    async def test_child_turns_add_no_messages(self, projector: Projector) -> None:
        root, child = ulids(2)
        await projector.append("t", [opened(root, request="plan a trip")])
        await projector.append("t", [opened(child, request="find flights", parent=root)])
        await projector.append("t", [settled(child, "completed", answer="3 flights", parent=root)])
        assert _texts(await projector.last("t")) == ["plan a trip"]
        await projector.append("t", [settled(root, "completed", answer="here is the plan")])
        assert _texts(await projector.last("t")) == ["plan a trip", "here is the plan"]

    async def test_stored_messages_always_join(self, projector: Projector) -> None:
        (child,) = ulids(1)
        await projector.append(
            "t",
            [
                MessageAppended(message=message("be brief", "system")),
                MessageAppended(message=message("a note", "assistant"), turn_id=child),
            ],
        )
        await projector.append("t", [NewEvent(payload=MessageAppended(message=message("hi")))])
        window = await projector.last("t")
        assert _texts(window) == ["be brief", "a note", "hi"]
        assert [m.turn_id for m in window] == [None, child, None]

    async def test_history_window(self, projector: Projector) -> None:
        await projector.append("t", [MessageAppended(message=message(str(i))) for i in range(10)])
        assert _texts(await projector.last("t")) == ["4", "5", "6", "7", "8", "9"]
        assert _texts(await projector.last("t", 2)) == ["8", "9"]
        assert await projector.last("t", 0) == []
        assert _texts(await projector.last("t", 50)) == [str(i) for i in range(10)]
        assert await projector.last("empty") == []
        assert await projector.last("t", 0, as_of=5) == []
        assert _texts(await projector.last("t", 50, as_of=3)) == ["0", "1", "2"]
        for bad in (-1, True, 1.5, "6"):
            with pytest.raises(InvalidInputError):
                await projector.last("t", bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidInputError):
                await projector.last("t", bad, as_of=3)  # type: ignore[arg-type]

    async def test_retried_append_does_not_repeat_messages(self, projector: Projector) -> None:
        events = [NewEvent(payload=MessageAppended(message=message("once")))]
        first = await projector.append("t", events)
        again = await projector.append("t", events)
        assert again == first and again.duplicate
        assert _texts(await projector.last("t")) == ["once"]

    # -- state blocks and reader views ------------------------------------------------------------

    async def test_blocks_carry_version_and_seq(self, projector: Projector) -> None:
        await projector.append("t", [StateUpdated(block="plan", value=["a"])])
        await projector.append(
            "t",
            [
                MessageAppended(message=message("x")),
                StateUpdated(block="plan", value=["a", "b"]),
                StateUpdated(block="notes", value="n"),
            ],
        )
        state = await projector.state("t")
        assert state == {
            "notes": Block(name="notes", value="n", version=1, seq=4),
            "plan": Block(name="plan", value=["a", "b"], version=2, seq=3),
        }

    async def test_reader_view_selects_blocks_and_fields(self, projector: Projector) -> None:
        profile = {"name": "Ada", "email": "ada@example.com"}
        await projector.append(
            "t",
            [
                StateUpdated(block="plan", value={"steps": [1, 2]}),
                StateUpdated(block="profile", value=profile),
                StateUpdated(block="notes", value="private"),
            ],
        )
        planner = await projector.state("t", "planner")
        assert planner == {
            "plan": Block(name="plan", value={"steps": [1, 2]}, version=1, seq=1),
            "profile": Block(name="profile", value={"name": "Ada"}, version=1, seq=2),
        }
        assert (await projector.state("t"))["profile"].value == profile
        assert await projector.state("t", "planner", as_of=3) == planner
        assert await projector.state("t", "planner", as_of=1) == {"plan": planner["plan"]}

    async def test_unknown_reader_view_is_refused(self, projector: Projector) -> None:
        await projector.append("t", [StateUpdated(block="plan", value=1)])
        with pytest.raises(UnknownReaderViewError):
            await projector.state("t", "nobody")
        with pytest.raises(UnknownReaderViewError):
            await projector.state("t", "nobody", as_of=1)
        with pytest.raises(UnknownReaderViewError):
            await projector.context("t", view="nobody")

    async def test_undeclared_block_is_refused_and_nothing_written(
        self, store: EventStore, projector: Projector
    ) -> None:
        await projector.append("t", [StateUpdated(block="plan", value=1)])
        for block in ("secrets", ""):
            with pytest.raises(UnknownBlockError):
                await projector.append(
                    "t",
                    [
                        MessageAppended(message=message("x")),
                        StateUpdated(block=block, value=2),
                    ],
                )
        assert await store.version("t") == 1
        assert await projector.last("t") == []
        assert list(await projector.state("t")) == ["plan"]

    async def test_guarded_update_conflict_writes_nothing(
        self, store: EventStore, projector: Projector
    ) -> None:
        await projector.append("t", [StateUpdated(block="plan", value="v1", expected_version=0)])
        before = await snapshot(projector, "t")
        with pytest.raises(ViewConflictError) as info:
            await projector.append(
                "t",
                [
                    MessageAppended(message=message("x")),
                    StateUpdated(block="plan", value="v2", expected_version=0),
                ],
            )
        assert (info.value.view, info.value.field) == ("state", "plan")
        assert (info.value.expected, info.value.actual) == (0, 1)
        assert await store.version("t") == 1
        assert await snapshot(projector, "t") == before
        await projector.append("t", [StateUpdated(block="plan", value="v2", expected_version=1)])
        assert (await projector.state("t"))["plan"] == Block(
            name="plan", value="v2", version=2, seq=2
        )

    async def test_failure_is_not_rollback(self, store: EventStore, projector: Projector) -> None:
        (turn,) = ulids(1)
        await projector.append("t", [opened(turn, request="do it")])
        await projector.append(
            "t", [NewEvent(payload=StateUpdated(block="plan", value="half", turn_id=turn))]
        )
        await projector.append("t", [settled(turn, "failed", answer="oops")])
        assert (await projector.state("t"))["plan"].value == "half"
        (record,) = await projector.records("t")
        assert (record.turn_id, record.outcome) == (turn, "failed")
        assert record.error == TurnError(kind="failed", message="it did not")
        assert _texts(await projector.last("t")) == ["do it"]
        assert (await projector.check("t")).ok

    # -- turn records -----------------------------------------------------------------------------

    async def test_one_record_per_settled_turn_in_settle_order(self, projector: Projector) -> None:
        a, b, c, d = ulids(4)
        await projector.append("t", [opened(a, request="a"), opened(b, request="b")])
        await projector.append("t", [opened(c, parent=a), opened(d)])
        await projector.append("t", [settled(b, "refused")])
        await projector.append("t", [settled(c, "truncated", parent=a), settled(a, "completed")])
        records = await projector.records("t")
        assert [(r.turn_id, r.outcome) for r in records] == [
            (b, "refused"),
            (c, "truncated"),
            (a, "completed"),
        ]
        assert [r.seq for r in records] == [5, 6, 7]
        assert all(r.thread_id == "t" and r.status == "settled" for r in records)
        assert records[1].parent_turn_id == a
        assert (records[0].steps, records[0].model_tier, records[0].grant) == (
            3,
            "small",
            Grant(max_steps=8),
        )
        assert records[0].usage.total_tokens == 120

    async def test_record_by_turn_id(self, projector: Projector) -> None:
        a, b = ulids(2)
        await projector.append("t", [opened(a), opened(b)])
        await projector.append("t", [settled(a, "stopped")])
        record = await projector.record("t", a)
        assert record is not None
        assert (record.turn_id, record.outcome, record.status, record.seq) == (
            a,
            "stopped",
            "settled",
            3,
        )
        record = await projector.record("t", b)
        assert record is not None and record.is_open and record.outcome is None
        assert await projector.record("t", "never") is None
        assert await projector.record("empty", a) is None

    async def test_unsettled_turn_shows_open(self, projector: Projector) -> None:
        done, crashed = ulids(2)
        await projector.append("t", [opened(done), opened(crashed, request="hi")])
        await projector.append("t", [settled(done, "completed")])
        turns = await projector.turns("t")
        assert [(r.turn_id, r.status) for r in turns] == [(done, "settled"), (crashed, "open")]
        assert turns[1].is_open and turns[1].seq == 2
        assert [r.turn_id for r in await projector.records("t")] == [done]

    async def test_turn_tree(self, projector: Projector) -> None:
        root, kid1, kid2, grandkid, other = ulids(5)
        await projector.append("t", [opened(root, request="r")])
        await projector.append("t", [opened(kid1, parent=root), opened(kid2, parent=root)])
        await projector.append("t", [opened(grandkid, parent=kid1)])
        await projector.append("t", [settled(grandkid, "completed", parent=kid1)])
        await projector.append("t", [opened(other, request="o")])

        def shape(nodes: list[TurnNode]) -> list[Any]:
            return [(n.record.turn_id, shape(n.children)) for n in nodes]

        tree = await projector.turn_tree("t")
        assert shape(tree) == [
            (root, [(kid1, [(grandkid, [])]), (kid2, [])]),
            (other, []),
        ]
        assert tree[0].children[0].children[0].record.status == "settled"
        assert shape(await projector.turn_tree("t", as_of=3)) == [
            (root, [(kid1, []), (kid2, [])]),
        ]

    async def test_settlement_without_open_is_recorded_and_flagged(
        self, store: EventStore, projector: Projector
    ) -> None:
        (ghost,) = ulids(1)
        await projector.append("t", [MessageAppended(message=message("x"))])
        await projector.append("t", [settled(ghost, "failed")])
        (record,) = await projector.records("t")
        assert (record.turn_id, record.outcome, record.seq) == (ghost, "failed", 2)
        assert await projector.record("t", ghost) == record
        report = await projector.check("t")
        assert report.ok and report.differences == []
        assert report.anomalies == [Anomaly(kind="settled_without_open", seq=2, turn_id=ghost)]
        assert await store.version("t") == 2

    async def test_latest_records(self, projector: Projector) -> None:
        turns = ulids(5)
        for turn in turns:
            await projector.append("t", [opened(turn), settled(turn, "completed")])
        assert [r.turn_id for r in await projector.records("t", last=2)] == turns[3:]
        assert [r.turn_id for r in await projector.records("t", last=9)] == turns
        assert await projector.records("t", last=0) == []
        assert [r.turn_id for r in await projector.records("t", last=2, as_of=6)] == turns[1:3]
        for bad in (-1, True):
            with pytest.raises(InvalidInputError):
                await projector.records("t", last=bad)

    async def test_anomalous_turns_read_the_same_live_and_folded(
        self, projector: Projector
    ) -> None:
        # Ids that do not sort in the order the turns were opened, one turn settled twice and
        # one opened twice: the log allows all of it, and every read agrees with the fold.
        await projector.append("t", [opened("b"), opened("a"), opened("c", parent="a")])
        await projector.append("t", [settled("a", "completed"), settled("b", "failed")])
        await projector.append("t", [settled("a", "stopped"), opened("c", parent="b")])
        assert [r.turn_id for r in await projector.turns("t")] == ["a", "b", "c"]
        assert [r.turn_id for r in await projector.records("t")] == ["a", "b"]
        assert [r.turn_id for r in await projector.records("t", last=1)] == ["a"]
        assert [r.turn_id for r in await projector.records("t", last=2)] == ["b", "a"]
        assert [r.outcome for r in await projector.records("t")] == ["stopped", "failed"]
        assert await snapshot(projector, "t", as_of=7) == await snapshot(projector, "t")
        report = await projector.check("t")
        assert report.ok
        assert [(a.kind, a.turn_id, a.seq) for a in report.anomalies] == [
            ("settled_twice", "a", 6),
            ("opened_twice", "c", 7),
        ]

    # -- transcript ---------------------------------------------------------------------------

    async def test_transcript_replace_keeps_the_log(
        self, store: EventStore, projector: Projector
    ) -> None:
        a, b, c = message("a"), message("b", "assistant"), message("c")
        summary = message("summary of a, b, c", "system")
        await projector.append("t", [TranscriptAppended(messages=[a, b])])
        await projector.append("t", [TranscriptAppended(messages=[c])])
        await projector.append("t", [TranscriptReplaced(messages=[summary])])
        assert await projector.transcript("t") == [TranscriptMessage(seq=3, message=summary)]
        logged = [
            m
            for e in await _events(store, "t")
            if isinstance(e.payload, TranscriptAppended)
            for m in e.payload.messages
        ]
        assert logged == [a, b, c]
        assert await projector.transcript("t", as_of=2) == [
            TranscriptMessage(seq=1, message=a),
            TranscriptMessage(seq=1, message=b),
            TranscriptMessage(seq=2, message=c),
        ]
        assert _texts(await projector.transcript("t", as_of=1)) == ["a", "b"]
        await projector.append("t", [TranscriptReplaced(messages=[])])
        assert await projector.transcript("t") == []
        await projector.append("t", [TranscriptAppended(messages=[c])])
        assert await projector.transcript("t") == [TranscriptMessage(seq=5, message=c)]
        assert (await projector.check("t")).ok

    # -- time travel ----------------------------------------------------------------------------

    async def _conversation(
        self, store: EventStore, projector: Projector, thread_id: str
    ) -> list[tuple[int, datetime, Snapshot]]:
        """A scripted conversation; after each append: its last seq, its time, the live reads."""
        root, child, next_root = ulids(3)
        script: list[list[Any]] = [
            [MessageAppended(message=message("be brief", "system"))],
            [opened(root, request="plan a trip"), StateUpdated(block="plan", value=["ask"])],
            [opened(child, request="find flights", parent=root)],
            [
                StateUpdated(block="profile", value={"name": "Ada", "city": "Paris"}),
                TranscriptAppended(messages=[message("plan a trip")]),
            ],
            [settled(child, "completed", answer="3 flights", parent=root)],
            [StateUpdated(block="plan", value=["ask", "book"]), settled(root, "completed", "ok")],
            [TranscriptAppended(messages=[message("ok", "assistant"), message("and hotels?")])],
            [opened(next_root, request="and hotels?")],
            [TranscriptReplaced(messages=[message("summary", "system")])],
            [StateUpdated(block="notes", value="n"), settled(next_root, "cut", answer="hot")],
            [MessageAppended(message=message("bye"))],
        ]
        out = []
        for batch in script:
            result = await projector.append(thread_id, batch)
            (event,) = [e async for e in store.read(thread_id, start=result.last_seq)]
            out.append((result.last_seq, event.time, await snapshot(projector, thread_id)))
            # Distinct milliseconds per append, so that each append's time names it alone.
            await anyio.sleep(0.003)
        return out

    async def test_time_travel_equals_live_reads_at_that_point(
        self, store: EventStore, projector: Projector
    ) -> None:
        points = await self._conversation(store, projector, "t")
        for seq, when, live in points:
            assert await snapshot(projector, "t", as_of=seq) == live, f"as_of={seq}"
            assert await store.seq_at("t", int(when.timestamp() * 1000)) == seq
            assert await snapshot(projector, "t", as_of=when) == live, f"as_of={when}"
        empty = await snapshot(projector, "t", as_of=0)
        assert empty == await snapshot(projector, "missing")
        assert empty.messages == [] and empty.state == {} and empty.turns == []
        first_time = points[0][1]
        before = datetime.fromtimestamp(first_time.timestamp() - 1, tz=first_time.tzinfo)
        assert await snapshot(projector, "t", as_of=before) == empty
        # A seq the thread has not reached is no past point, on every backend (a time after
        # the last event is: it means "now").
        last_seq, last_time, last_live = points[-1]
        for beyond in (last_seq + 1, 10_000):
            with pytest.raises(SeqBeyondVersionError) as info:
                await snapshot(projector, "t", as_of=beyond)
            assert (info.value.seq, info.value.version) == (beyond, last_seq)
            assert f"ends at seq {last_seq}" in str(info.value)
        with pytest.raises(SeqBeyondVersionError):
            await projector.seq_of("missing", 1)
        for bad_thread in ("", 5):
            with pytest.raises(InvalidInputError):
                await projector.seq_of(bad_thread, 0)  # type: ignore[arg-type]
        assert await projector.seq_of("t", last_seq) == last_seq
        later = datetime.fromtimestamp(last_time.timestamp() + 3600, tz=last_time.tzinfo)
        assert await snapshot(projector, "t", as_of=later) == last_live
        with pytest.raises(InvalidInputError):
            await projector.last("t", as_of=-1)
        # Asking for no records (or no messages) still asks about that point.
        for read in (
            lambda at: projector.records("t", last=0, as_of=at),
            lambda at: projector.last("t", 0, as_of=at),
            lambda at: projector.context("t", n=0, as_of=at),
        ):
            await read(last_seq)
            with pytest.raises(SeqBeyondVersionError):
                await read(last_seq + 1)
            for bad in (-1, True, 1.5, "3"):
                with pytest.raises(InvalidInputError):
                    await read(bad)

    async def test_context_and_record_as_of_a_past_point_are_what_was_read_then(
        self, store: EventStore, projector: Projector
    ) -> None:
        # What an agent assembled its prompt from (`context`) and one turn's record, as they
        # were at each past point: the reads an audit of a decision needs most.
        points = await self._conversation(store, projector, "t")
        life = await store.incarnation("t")
        assert life is not None
        for seq, when, live in points:
            for at in (seq, when):
                past = await projector.context("t", view=PLANNER.name, records=2, as_of=at)
                assert past == Context(
                    thread_id="t",
                    version=seq,
                    messages=live.window,
                    state=live.planner,
                    records=live.latest_records,
                    incarnation=life,  # the life the fold read: a write planned from it names it
                ), f"as_of={at}"
                for turn in live.turns:
                    assert await projector.record("t", turn.turn_id, as_of=at) == turn
            bare = await projector.context("t", n=0, as_of=seq)
            assert (bare.messages, bare.records, bare.state) == ([], [], live.state)
        assert await projector.context("t", as_of=points[-1][0]) == await projector.context("t")
        assert await projector.record("t", points[-1][2].turns[0].turn_id, as_of=0) is None
        assert (await projector.context("t", as_of=0)).version == 0
        with pytest.raises(SeqBeyondVersionError):
            await projector.context("t", as_of=points[-1][0] + 1)
        with pytest.raises(UnknownReaderViewError):
            await projector.context("t", view="nobody", as_of=1)
        with pytest.raises(InvalidInputError):
            await projector.context("t", n=-1, as_of=1)

    async def test_time_travel_never_mixes_two_lives_of_a_thread(
        self, store: EventStore, projector: Projector
    ) -> None:
        # The point is found in one round trip (a time search, a version) and the log folded
        # in the next ones: a thread deleted and written again in between must not be folded
        # up to a seq of its old life, as if the new life's events were the past asked about.
        for n in range(3):
            await projector.append("t", [MessageAppended(message=message(f"old{n}"))])
            await anyio.sleep(0.003)
        (third,) = [e async for e in store.read("t", start=3)]
        await anyio.sleep(0.003)

        def recreate_after(name: str, new: int) -> None:
            real = getattr(store, name)

            async def answer_then_recreate(*args: Any) -> Any:
                setattr(store, name, real)  # once
                answer = await real(*args)
                await projector.delete_thread("t")
                news = [MessageAppended(message=message(f"new{n}")) for n in range(new)]
                await projector.append("t", news)
                return answer

            setattr(store, name, answer_then_recreate)

        # By time: at that moment, the thread's current life had recorded nothing yet.
        recreate_after("seq_at", 4)
        assert await projector.last("t", 50, as_of=third.time) == []
        assert await projector.seq_of("t", third.time) == 0
        # By seq: the life it is in now ends before seq 3 (its old life reached it).
        await projector.delete_thread("t")
        for n in range(3):
            await projector.append("t", [MessageAppended(message=message(f"old{n}"))])
        recreate_after("version", 2)
        with pytest.raises(SeqBeyondVersionError) as info:
            await projector.transcript("t", as_of=3)
        assert (info.value.seq, info.value.version) == (3, 2)
        assert _texts(await projector.last("t", 50, as_of=2)) == ["new0", "new1"]

    # -- rebuild and check ----------------------------------------------------------------------

    async def test_check_finds_deleted_views_and_rebuild_restores_them(
        self, store: EventStore, projector: Projector
    ) -> None:
        points = await self._conversation(store, projector, "t")
        live = points[-1][2]
        assert (await projector.check("t")).ok
        views = [v for p in projector.projections for v in p.views]
        assert sorted(views) == ["messages", "settled", "state", "transcript", "turns"]
        for view in views:
            await self.delete_view(store, "t", view)
            report = await projector.check("t")
            assert not report.ok, view
            assert {d.view for d in report.differences} == {view}
            assert await projector.rebuild("t") == points[-1][0]
            assert (await projector.check("t")).ok
            assert await snapshot(projector, "t") == live
        for view in views:
            await self.delete_view(store, "t", view)
        assert len((await projector.check("t")).differences) >= len(views)
        await projector.rebuild("t")
        assert await snapshot(projector, "t") == live

    async def test_check_finds_altered_views(self, store: EventStore, projector: Projector) -> None:
        points = await self._conversation(store, projector, "t")
        version = points[-1][0]
        snap = await store.read_views("t", [ListRange("messages"), HashGetAll("state")])
        messages, state = snap.results
        assert isinstance(messages, list) and isinstance(state, dict)
        plan = state["plan"]
        await store.load_views(
            "t",
            [
                ListLoad("messages", tuple(messages[:-1])),
                HashLoad("state", {**state, "plan": msgspec.structs.replace(plan, version=9)}),
            ],
            expected_version=version,
        )
        report = await projector.check("t")
        assert {(d.view, d.key) for d in report.differences} == {
            ("messages", f"[{len(messages) - 1}]"),
            ("messages", "length"),
            ("state", "plan"),
        }
        await projector.rebuild("t")
        assert (await projector.check("t")).ok
        assert await snapshot(projector, "t") == points[-1][2]

    async def test_undecodable_view_values_are_reported_and_rebuilt(
        self, store: EventStore, projector: Projector
    ) -> None:
        points = await self._conversation(store, projector, "t")
        version, live = points[-1][0], points[-1][2]
        damaged = ViewEntry(1, b"\xc1 not msgpack")
        await store.load_views(
            "t",
            [
                ListLoad("messages", (damaged,)),
                ListLoad("transcript", (damaged,)),
                HashLoad("state", {"plan": damaged}),
                HashLoad("turns", {"x": damaged}),
            ],
            expected_version=version,
        )
        for read in (projector.last, projector.transcript, projector.state, projector.turns):
            with pytest.raises(OperationalError, match="rebuild"):
                await read("t")
        report = await projector.check("t")
        assert {d.view for d in report.differences} == {"messages", "transcript", "state", "turns"}
        await projector.rebuild("t")
        assert (await projector.check("t")).ok
        assert await snapshot(projector, "t") == live

    async def test_views_of_the_wrong_kind_read_empty_and_are_rebuilt(
        self, store: EventStore, projector: Projector
    ) -> None:
        points = await self._conversation(store, projector, "t")
        version, live = points[-1][0], points[-1][2]
        entry = ViewEntry(1, b"x")
        # A list where a hash belongs and the reverse: reads see an empty view, never a
        # server type error, and appends replace the stray key.
        await store.load_views(
            "t",
            [ListLoad("state", (entry,)), HashLoad("messages", {"f": entry})],
            expected_version=version,
        )
        assert await projector.state("t") == {}
        assert await projector.last("t") == []
        assert {d.view for d in (await projector.check("t")).differences} == {"state", "messages"}
        await projector.rebuild("t")
        assert (await projector.check("t")).ok
        assert await snapshot(projector, "t") == live

    async def test_check_and_rebuild_an_empty_thread(self, projector: Projector) -> None:
        report = await projector.check("missing")
        assert report.ok and report.version == 0 and report.anomalies == []
        assert await projector.rebuild("missing") == 0

    async def test_check_all_and_rebuild_all_report_progress(
        self, store: EventStore, projector: Projector
    ) -> None:
        threads = ["one", "two", "three"]
        for t in threads:
            await projector.append(t, [opened(new_ulid(), request=t)])
            await projector.append(t, [StateUpdated(block="plan", value=t)])
        await self.delete_view(store, "one", "messages")
        await self.delete_view(store, "three", "state")
        calls: list[tuple[int, int]] = []
        reports = await projector.check_all(
            progress=lambda done, total: calls.append((done, total))
        )
        assert calls == [(1, 3), (2, 3), (3, 3)]
        assert {t: r.ok for t, r in reports.items()} == {"one": False, "two": True, "three": False}
        calls.clear()
        versions = await projector.rebuild_all(
            progress=lambda done, total: calls.append((done, total))
        )
        assert calls == [(1, 3), (2, 3), (3, 3)]
        assert versions == dict.fromkeys(threads, 2)
        assert all(r.ok for r in (await projector.check_all()).values())
        assert _texts(await projector.last("one")) == ["one"]
        assert (await projector.state("three"))["plan"].value == "three"

    async def test_rebuild_all_and_check_all_work_on_several_threads_at_once(
        self, store: EventStore, projector: Projector
    ) -> None:
        """Up to ``concurrency`` threads at a time (no more), results in the listing's order,
        progress counted one thread at a time."""
        threads = [f"t{i:02d}" for i in range(10)]
        for t in threads:
            await projector.append(t, [StateUpdated(block="plan", value=t)])
            await self.delete_view(store, t, "state")
        listed = [info.thread_id for info in await store.threads()]
        real_load, real_check = store.load_views, projector.check
        in_flight: list[str] = []
        peaks: list[int] = []

        async def slowly(job: Any, thread_id: str, *args: Any, **kwargs: Any) -> Any:
            in_flight.append(thread_id)
            peaks.append(len(in_flight))
            try:
                await anyio.sleep(0.02)  # long enough for every worker to start one
                return await job(thread_id, *args, **kwargs)
            finally:
                in_flight.remove(thread_id)

        async def load_views(thread_id: str, *args: Any, **kwargs: Any) -> None:
            await slowly(real_load, thread_id, *args, **kwargs)

        async def check(thread_id: str) -> CheckReport:
            result: CheckReport = await slowly(real_check, thread_id)
            return result

        store.load_views = load_views  # type: ignore[method-assign]
        projector.check = check  # type: ignore[method-assign]
        try:
            calls: list[tuple[int, int]] = []
            for concurrency in (1, 4):
                peaks.clear()
                calls.clear()
                reports = await projector.check_all(
                    concurrency=concurrency,
                    progress=lambda done, total: calls.append((done, total)),
                )
                assert max(peaks) == concurrency, peaks
                assert list(reports) == listed and not any(r.ok for r in reports.values())
                assert calls == [(n, 10) for n in range(1, 11)]
            peaks.clear()
            versions = await projector.rebuild_all(concurrency=4)
            assert max(peaks) == 4 and versions == dict.fromkeys(listed, 1)
            peaks.clear()
            assert await projector.rebuild_all(threads=["t01", "t01", "t02"]) == {
                "t01": 1,
                "t02": 1,
            }
            assert len(peaks) == 2  # a thread named twice is rebuilt once
        finally:
            del store.load_views, projector.check
        assert all(r.ok for r in (await projector.check_all(concurrency=3)).values())
        for bad in (0, -1, True, 2.0, "4"):
            with pytest.raises(InvalidInputError, match="concurrency"):
                await projector.rebuild_all(concurrency=bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidInputError, match="concurrency"):
                await projector.check_all(concurrency=bad)  # type: ignore[arg-type]

    async def test_a_thread_that_keeps_changing_does_not_stop_rebuild_all(
        self, store: EventStore, projector: Projector
    ) -> None:
        """A writer lands between the fold and the swap on every attempt: that thread is named
        as not rebuilt (its views as they were), and every other thread is rebuilt."""
        for t in ("busy", "quiet"):
            await projector.append(t, [StateUpdated(block="plan", value=t)])
        await self.delete_view(store, "quiet", "state")
        await self.delete_view(store, "busy", "state")

        real_load = store.load_views

        async def load_views(thread_id: str, *args: Any, **kwargs: Any) -> None:
            if thread_id == "busy":  # another writer, just after the fold
                await store.append("busy", [StateUpdated(block="notes", value=1)])
            await real_load(thread_id, *args, **kwargs)

        store.load_views = load_views  # type: ignore[method-assign]
        try:
            with pytest.raises(RebuildBusyError) as one:
                await projector.rebuild("busy")
            assert one.value.thread_id == "busy" and "kept changing" in str(one.value)
            with pytest.raises(RebuildError) as caught:
                await projector.rebuild_all()
        finally:
            del store.load_views
        assert set(caught.value.rebuilt) == {"quiet"}
        assert set(caught.value.failed) == {"busy"}
        assert isinstance(caught.value.failed["busy"], RebuildBusyError)
        assert "rebuild again later" in str(caught.value)
        assert (await projector.check("quiet")).ok
        assert not (await projector.check("busy")).ok  # left as it was: its state view is gone
        assert await projector.rebuild("busy") == await store.version("busy")

    async def test_a_thread_replaced_between_the_fold_and_the_write_never_gets_old_views(
        self, store: EventStore, projector: Projector
    ) -> None:
        """Deleted and written again up to the same version after the fold: the version alone
        would let the old life's views in. The write is refused, and the rebuild folds again."""
        await projector.append("t", [MessageAppended(message=message("old"))])
        real_load = store.load_views
        seen: list[list[str]] = []

        async def load_views(thread_id: str, *args: Any, **kwargs: Any) -> None:
            if not seen:  # once, just after the first fold
                await projector.delete_thread("t")
                await projector.append("t", [MessageAppended(message=message("new"))])
            try:
                await real_load(thread_id, *args, **kwargs)
            finally:
                seen.append(_texts(await projector.last("t")))

        store.load_views = load_views  # type: ignore[method-assign]
        try:
            assert await projector.rebuild("t") == 1
        finally:
            del store.load_views
        assert seen == [["new"], ["new"]]  # the first write was refused: never "old"
        assert (await projector.check("t")).ok

    # -- bad input ------------------------------------------------------------------------------

    @pytest.mark.parametrize(
        "bad",
        [
            StateUpdated(block=123, value=1),  # type: ignore[arg-type]
            StateUpdated(block="plan", value=object()),
            StateUpdated(block="plan", value=2**70),
            MessageAppended(message=Message(role="robot", content="x")),  # type: ignore[arg-type]
            TurnOpened(turn_id=5),  # type: ignore[arg-type]
            TurnSettled(turn_id=5, outcome="completed"),  # type: ignore[arg-type]
            TurnSettled(turn_id="x", outcome="won"),  # type: ignore[arg-type]
            TranscriptAppended(messages=["not a message"]),  # type: ignore[list-item]
        ],
        ids=lambda e: type(e).__name__,
    )
    async def test_invalid_payload_is_refused_and_nothing_written(
        self, store: EventStore, projector: Projector, bad: Any
    ) -> None:
        await projector.append("t", [MessageAppended(message=message("ok"))])
        before = await snapshot(projector, "t")
        with pytest.raises(EventValidationError):
            await projector.append("t", [MessageAppended(message=message("x")), bad])
        assert await store.version("t") == 1
        assert await snapshot(projector, "t") == before
        with pytest.raises(EventValidationError):
            await projector.append("fresh", [bad])
        assert [t.thread_id for t in await store.threads()] == ["t"]

    @pytest.mark.parametrize(
        "events", [[], "text", [object()], MessageAppended(message=message("x"))]
    )
    async def test_malformed_event_lists_are_refused(
        self, store: EventStore, projector: Projector, events: Any
    ) -> None:
        with pytest.raises(InvalidInputError):
            await projector.append("t", events)
        assert await store.version("t") == 0

    async def test_context_reads_every_part_at_once(
        self, store: EventStore, projector: Projector
    ) -> None:
        await self._conversation(store, projector, "t")
        context = await projector.context("t", n=6, view="planner", records=3)
        assert context.thread_id == "t"
        assert context.version == await store.version("t")
        assert context.messages == await projector.last("t", 6)
        assert context.state == await projector.state("t", "planner")
        assert context.records == await projector.records("t", last=3)
        assert len(context.records) == 3 and len(context.messages) == 5
        assert set(context.state) == {"plan", "profile"}
        assert context.state["profile"].value == {"name": "Ada"}
        bare = await projector.context("t", n=0)
        assert (bare.messages, bare.records) == ([], [])
        assert bare.state == await projector.state("t")
        with pytest.raises(InvalidInputError):
            await projector.context("t", n=-1)
        with pytest.raises(InvalidInputError):
            await projector.context("t", records=-1)
