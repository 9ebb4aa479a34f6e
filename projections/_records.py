"""`RecordsProjection`: one turn record per turn, in settle order, by id, and as a tree.

A turn shows as ``open`` from `TurnOpened` until its `TurnSettled`; one that never settles stays
open, which is how audits see a crashed turn. Every settlement is recorded, whatever its
outcome. A settlement for a turn that was never opened is recorded too, and `anomalies`
flags it (so does `check`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec
from ulid import ULID

from eventstore import (
    Event,
    EventMeta,
    Fallback,
    Grant,
    HashGetAll,
    HashGetListed,
    HashLoad,
    HashSet,
    ListLoad,
    ListPush,
    ListRange,
    NewEvent,
    Outcome,
    RecordedEvent,
    Timing,
    TurnError,
    TurnOpened,
    TurnSettled,
    Usage,
    ViewEntry,
    ViewOp,
    ViewRead,
    ViewResult,
    event_id_text,
)

from ._base import Projection, decode_as, encoder


class _RecordFields(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a turn record says beyond its identity (shared by the stored value and the record)."""

    status: Literal["open", "settled"]
    # The id of the event that wrote the record: its ULID time orders records across threads
    # identically in the views and in a fold (the server time is not known when ops are built).
    event_id: str = ""
    parent_turn_id: str | None = None
    grant: Grant | None = None
    outcome: Outcome | None = None
    steps: int = 0
    model_tier: str | None = None
    fallbacks: list[Fallback] = msgspec.field(default_factory=list)
    usage: Usage = msgspec.field(default_factory=Usage)
    timing: Timing = msgspec.field(default_factory=Timing)
    error: TurnError | None = None


class _RecordValue(_RecordFields, frozen=True, kw_only=True, omit_defaults=True):
    """The stored form in the ``turns`` view (thread, turn and seq come from the key/stamp)."""


class TurnRecord(_RecordFields, frozen=True, kw_only=True):
    """A turn as the records show it: open, or settled with its outcome and accounting."""

    thread_id: str
    turn_id: str
    seq: int

    @property
    def recorded_ms(self) -> int:
        """When the record was written (ms since the epoch, from the event's ULID)."""
        try:
            return ULID.from_str(self.event_id).milliseconds
        except ValueError:
            return 0

    @property
    def is_open(self) -> bool:
        """True while the turn has not settled (a crashed turn stays open)."""
        return self.status == "open"


class TurnNode(msgspec.Struct, frozen=True, kw_only=True):
    """A turn with its child turns, in turn id order: the order they were opened for turn ids
    that sort by creation time (ULIDs), and not for others (random UUIDs, counters as text,
    where "turn-10" sorts before "turn-9")."""

    record: TurnRecord
    children: list[TurnNode]


class Anomaly(msgspec.Struct, frozen=True, kw_only=True):
    """Something the log allows but an auditor should see."""

    kind: Literal["settled_without_open", "settled_twice", "opened_twice"]
    seq: int
    turn_id: str


@dataclass
class RecordsState:
    """The folded records: per-turn view entries (the encoded record with its hash version and
    seq) and the settle order.

    Records are kept encoded, as the ``turns`` view stores them, and decoded when read: a fold
    of a long log then holds one untracked object per turn instead of a few objects the
    garbage collector traverses over and over while the fold grows.
    """

    turns: dict[str, ViewEntry] = field(default_factory=dict)
    settled: list[ViewEntry] = field(default_factory=list)
    opened: set[str] = field(default_factory=set)
    closed: set[str] = field(default_factory=set)  # turns whose latest record is a settlement
    anomalies: list[Anomaly] = field(default_factory=list)
    # Open records a fold of payload rows has not encoded yet (turn -> seq, version, parent,
    # grant, event id bytes); ``turns`` holds `_OPEN` for them. A turn's settlement normally
    # replaces its open record, which is then never encoded (nor its id turned into text).
    pending: dict[str, tuple[int, int, str | None, Grant | None, bytes]] = field(
        default_factory=dict
    )

    def entries(self) -> dict[str, ViewEntry]:
        """``turns``, with every record encoded (call this, not ``turns``, after a fold)."""
        if self.pending:
            turns = self.turns
            for turn, (seq, version, parent, grant, event_id) in self.pending.items():
                value = _RecordValue(
                    status="open",
                    event_id=event_id_text(event_id),
                    parent_turn_id=parent,
                    grant=grant,
                )
                turns[turn] = ViewEntry(seq, encoder.encode(value), version)
            self.pending.clear()
        return self.turns


_OPEN = ViewEntry(0, b"")
"""The place of a pending open record in `RecordsState.turns` (keeps the turns' order)."""
_TURN_EVENTS = (TurnOpened, TurnSettled)  # a tuple: `A | B` would build a union on every call


_value_decoder = msgspec.msgpack.Decoder(_RecordValue)


def _value_of(payload: object, event_id: str) -> _RecordValue | None:
    if isinstance(payload, TurnOpened):
        return _RecordValue(
            status="open",
            event_id=event_id,
            parent_turn_id=payload.parent_turn_id,
            grant=payload.grant,
        )
    if isinstance(payload, TurnSettled):
        return _settled_value(payload, event_id)
    return None


def _settled_value(payload: TurnSettled, event_id: str) -> _RecordValue:
    return _RecordValue(
        status="settled",
        event_id=event_id,
        parent_turn_id=payload.parent_turn_id,
        grant=payload.grant,
        outcome=payload.outcome,
        steps=payload.steps,
        model_tier=payload.model_tier,
        fallbacks=payload.fallbacks,
        usage=payload.usage,
        timing=payload.timing,
        error=payload.error,
    )


def _version_after(state: RecordsState, turn: str) -> int:
    """The hash version the turn's next record gets (its current one, pending or not, + 1)."""
    prior = state.turns.get(turn)
    if prior is None:
        return 1
    if prior is _OPEN:
        return state.pending.pop(turn)[1] + 1
    return prior.version + 1


def _open(state: RecordsState, seq: int, payload: TurnOpened, event_id: bytes | str) -> None:
    """Fold a `TurnOpened`: its record left pending (see `RecordsState.pending`) when the id
    comes as bytes (a payload row), encoded at once when it comes as text."""
    turn = payload.turn_id
    version = _version_after(state, turn)
    if isinstance(event_id, str):
        value = _value_of(payload, event_id)
        assert value is not None
        state.turns[turn] = ViewEntry(seq, encoder.encode(value), version)
    else:
        state.turns[turn] = _OPEN
        state.pending[turn] = (seq, version, payload.parent_turn_id, payload.grant, event_id)
    if turn in state.opened:
        state.anomalies.append(Anomaly(kind="opened_twice", seq=seq, turn_id=turn))
    state.opened.add(turn)
    state.closed.discard(turn)


def _settle(state: RecordsState, seq: int, payload: TurnSettled, event_id: str) -> None:
    """Fold a `TurnSettled`: its record encoded (it replaces the open one)."""
    turn = payload.turn_id
    version = _version_after(state, turn)
    state.turns[turn] = ViewEntry(seq, encoder.encode(_settled_value(payload, event_id)), version)
    if turn not in state.opened:
        state.anomalies.append(Anomaly(kind="settled_without_open", seq=seq, turn_id=turn))
    if turn in state.closed:
        state.anomalies.append(Anomaly(kind="settled_twice", seq=seq, turn_id=turn))
    state.closed.add(turn)
    state.settled.append(ViewEntry(seq, turn.encode("utf-8")))


def _record(thread_id: str, turn_id: str, seq: int, v: _RecordValue) -> TurnRecord:
    return TurnRecord(thread_id=thread_id, turn_id=turn_id, seq=seq, **msgspec.structs.asdict(v))


class RecordsProjection(Projection[RecordsState]):
    """Turn records: hash ``turns`` (turn id -> record) and list ``settled`` (settle order)."""

    name = "records"
    views = ("turns", "settled")
    handles = (TurnOpened, TurnSettled)

    def initial(self) -> RecordsState:
        return RecordsState()

    def apply(self, state: RecordsState, event: RecordedEvent) -> RecordsState:
        payload = event.payload
        if isinstance(payload, _TURN_EVENTS):
            state.entries()  # an earlier fold of payload rows may have left some pending
            if isinstance(payload, TurnSettled):
                _settle(state, event.seq, payload, event.id)
            else:
                # The id as text: encoded at once, ``turns`` stays complete for callers that
                # read it directly.
                _open(state, event.seq, payload, event.id)
        return state

    @staticmethod
    def record_of(thread_id: str, seq: int, event: NewEvent) -> TurnRecord | None:
        """The record a `TurnOpened` or `TurnSettled` appended at ``seq`` makes (None for any
        other event): what a read would answer just after that append."""
        payload = event.payload
        value = _value_of(payload, event.id)
        if value is None:
            return None
        assert isinstance(payload, TurnOpened | TurnSettled)
        return _record(thread_id, payload.turn_id, seq, value)

    def apply_payload(
        self, state: RecordsState, seq: int, payload: Event, event_id: bytes, meta: EventMeta
    ) -> RecordsState:
        if isinstance(payload, TurnSettled):
            _settle(state, seq, payload, event_id_text(event_id))
        elif isinstance(payload, TurnOpened):
            _open(state, seq, payload, event_id)
        return state

    def ops(self, events: Sequence[NewEvent]) -> list[ViewOp]:
        out: list[ViewOp] = []
        for index, new in enumerate(events):
            payload = new.payload
            value = _value_of(payload, new.id)
            if value is None:
                continue
            assert isinstance(payload, TurnOpened | TurnSettled)
            out.append(HashSet("turns", payload.turn_id, encoder.encode(value), index))
            if isinstance(payload, TurnSettled):
                out.append(ListPush("settled", (payload.turn_id.encode("utf-8"),), index))
        return out

    def materialize(self, state: RecordsState) -> list[ViewOp]:
        return [
            HashLoad("turns", dict(state.entries())),
            ListLoad("settled", tuple(state.settled)),
        ]

    def full_reads(self) -> list[ViewRead]:
        return [HashGetAll("turns"), ListRange("settled", 0, -1)]

    # -- reads ---------------------------------------------------------------------------------

    @staticmethod
    def settled_read(last: int | None = None) -> ViewRead:
        """Settled records in settle order (only the latest ``last`` when given)."""
        if last is not None:
            return HashGetListed("turns", "settled", -last, -1)
        return HashGetListed("turns", "settled", 0, -1)

    @staticmethod
    def parse(thread_id: str, result: ViewResult) -> list[TurnRecord]:
        """Decode a hash result of the turns view into records (in the result's order)."""
        assert isinstance(result, dict)
        return [
            _record(
                thread_id,
                turn,
                e.seq,
                decode_as(_RecordValue, e.value, f"turns view (turn {turn!r})"),
            )
            for turn, e in result.items()
        ]

    @staticmethod
    def all_records(thread_id: str, state: RecordsState) -> list[TurnRecord]:
        """Every turn of a folded state (open and settled), by turn id.

        The order is the one a read of the ``turns`` hash can give (a hash has none of its
        own); for ULID turn ids it is the order the turns were created in.
        """
        return [
            _record(thread_id, t, e.seq, _value_decoder.decode(e.value))
            for t, e in sorted(state.entries().items())
        ]

    @staticmethod
    def settled_records(
        thread_id: str, state: RecordsState, last: int | None = None
    ) -> list[TurnRecord]:
        """Settled records of a folded state, in settle order (each turn once).

        Like `settled_read`, this takes the latest ``last`` settlements first and then lists
        each turn once, at its first place among them: a turn settled twice (an anomaly) then
        shows the same way in a fold as in the materialized view.
        """
        entries = state.settled if last is None else state.settled[-last:] if last else []
        turns = state.entries()
        seen: dict[str, TurnRecord] = {}
        for entry in entries:
            turn = entry.value.decode("utf-8")
            if turn not in seen:
                e = turns[turn]
                seen[turn] = _record(thread_id, turn, e.seq, _value_decoder.decode(e.value))
        return list(seen.values())

    @staticmethod
    def tree(records: Sequence[TurnRecord]) -> list[TurnNode]:
        """Root turns with their descendants; a child whose parent is unknown becomes a root."""
        ordered = sorted(records, key=lambda r: r.turn_id)
        by_id = {r.turn_id: r for r in ordered}
        children: dict[str, list[TurnRecord]] = {}
        roots: list[TurnRecord] = []
        for r in ordered:
            parent = r.parent_turn_id
            if parent is not None and parent in by_id and parent != r.turn_id:
                children.setdefault(parent, []).append(r)
            else:
                roots.append(r)

        placed: set[str] = set()

        def node(r: TurnRecord) -> TurnNode:
            placed.add(r.turn_id)
            kids = [c for c in children.get(r.turn_id, []) if c.turn_id not in placed]
            return TurnNode(record=r, children=[node(c) for c in kids])

        out = [node(r) for r in roots]
        # Turns caught in a parent cycle (only a damaged or forged log has one) are never
        # reached from a root; show them as roots rather than lose them.
        for r in ordered:
            if r.turn_id not in placed:
                out.append(node(r))
        return out
