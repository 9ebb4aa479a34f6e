"""`ThreadStore`: the runtime-facing Store over the event log and its projections.

A runtime swaps its in-process store for this one and keeps its turn loop: messages, state
blocks, turn lifecycle and records, all durable, safe across instances (turn ids are ULIDs,
appends are atomic and idempotent) and auditable.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import msgspec

from eventstore import (
    OUTCOMES,
    AppendResult,
    ConflictError,
    EventStore,
    Fallback,
    Grant,
    IdempotencyKeyReusedError,
    IncarnationConflictError,
    InvalidInputError,
    Message,
    MessageAppended,
    NewEvent,
    Outcome,
    StateUpdated,
    ThreadInfo,
    Timing,
    TurnError,
    TurnOpened,
    TurnSettled,
    Usage,
    check_json_message,
    new_ulid,
    validate_count,
    validate_thread_id,
)
from eventstore._codec import expected_incarnation_arg
from eventstore._contract import require_store
from projections import (
    DEFAULT_WINDOW,
    AsOf,
    Block,
    Context,
    Projector,
    RecordsProjection,
    StateProjection,
    StoredMessage,
    TurnNode,
    TurnRecord,
)

from ._access import (
    AccessPolicy,
    Principal,
    authorize,
    authorize_view,
    check_policy,
)

CLOCK_SKEW_MS = 5 * 60 * 1000
RECORDS_READ_AHEAD = 32  # threads whose records are read at once by a cross-thread page


class TurnNotFoundError(InvalidInputError):
    """Raised when a turn id was not opened in the thread it is used with."""


class TurnConflictError(ConflictError):
    """Raised when a turn id is opened again with other details than it was first opened with."""


class StateUpdate(msgspec.Struct, frozen=True):
    """A state block update to record with a turn's settlement."""

    block: str
    value: Any
    expected_version: int | None = None


class Settlement(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of `settle_turn`: the record as stored and where the append landed.

    ``duplicate`` is True when the turn had already been settled by another call; ``record``
    is then the first settlement and nothing was written. (A call whose append the
    connection re-sent after a lost reply, answered from the ledger, wrote the settlement:
    not a duplicate.)
    """

    record: TurnRecord
    first_seq: int
    last_seq: int
    duplicate: bool = False


class RecordsPage(msgspec.Struct, frozen=True, kw_only=True):
    """Turn records, newest first, and the cursor for the next page (None: no more)."""

    records: list[TurnRecord]
    next_cursor: str | None


def as_message(message: Message | Mapping[str, Any]) -> Message:
    """Accept a `Message` or its JSON object form (a `Message` whose ``source`` no longer
    matches it loses the source: see `Message.with_current_source`); one holding what JSON
    cannot hold (a NaN, a non-string key, bytes...) is refused (`check_json_message`)."""
    if isinstance(message, Message):
        message = message.with_current_source()
    elif isinstance(message, Mapping):
        message = Message.from_json(dict(message))
    else:
        raise InvalidInputError(
            "a message is a Message or a mapping with 'role' and 'content', not "
            f"{type(message).__name__}: {message!r:.80}"
        )
    check_json_message(message)  # built in Python, it can hold what JSON cannot
    return message


def as_messages(messages: object, name: str = "messages") -> list[Message]:
    """Accept a list of messages (`Message` or JSON object form each)."""
    if isinstance(messages, Mapping | Message | str | bytes) or not isinstance(messages, Iterable):
        one = " (one message? pass it in a list)" if isinstance(messages, Mapping | Message) else ""
        raise InvalidInputError(
            f"{name} must be a list of messages, not {type(messages).__name__}{one}"
        )
    return [as_message(m) for m in messages]


def _check_counts(steps: int, usage: Usage | None) -> None:
    """Counts are never negative: analytics sums them (a -1 would hide a turn's tokens)."""
    counts = {"steps": steps}
    if usage is not None:
        counts |= {
            "usage.input_tokens": usage.input_tokens,
            "usage.output_tokens": usage.output_tokens,
            "usage.cached_tokens": usage.cached_tokens,
        }
    for name, value in counts.items():
        _check_whole(value, name)
    if usage is not None:
        _check_amount(usage.cost_usd, "usage.cost_usd")


def _check_whole(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(f"{name} must be a whole number >= 0, not {value!r}")


def _check_amount(value: float | None, name: str) -> None:
    """A money amount: None or a finite number >= 0 (NaN and infinity sum to nonsense)."""
    if value is not None and not (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and value >= 0
    ):
        raise InvalidInputError(f"{name} must be a finite number >= 0, not {value!r}")


def _check_grant(grant: Grant | None) -> None:
    """A budget is counts and an amount >= 0: a negative one admits nothing, and audits read it."""
    if grant is None:
        return
    for name in ("max_steps", "max_tokens", "deadline_ms"):
        value = getattr(grant, name)
        if value is not None:
            _check_whole(value, f"grant.{name}")
    _check_amount(grant.max_cost_usd, "grant.max_cost_usd")


def _check_timing(timing: Timing | None) -> None:
    """Epoch milliseconds (0: not recorded); a turn does not settle before it starts."""
    if timing is None:
        return
    _check_whole(timing.started_ms, "timing.started_ms")
    _check_whole(timing.settled_ms, "timing.settled_ms")
    if timing.started_ms and timing.settled_ms and timing.settled_ms < timing.started_ms:
        raise InvalidInputError(
            f"timing.settled_ms ({timing.settled_ms}) is before timing.started_ms "
            f"({timing.started_ms})"
        )


S = TypeVar("S", bound=msgspec.Struct)


def _as_struct(value: object, type_: type[S], name: str) -> S:
    """Accept a ``type_`` or its JSON object form (as messages are accepted), else refuse
    with `InvalidInputError` naming the argument."""
    if isinstance(value, type_):
        return value
    if isinstance(value, Mapping):
        # A misspelt field ({"input": 12} for input_tokens) would otherwise be dropped in
        # silence, and the record keep its default (0 tokens) as if that had been said.
        known = [f.encode_name for f in msgspec.structs.fields(type_)]
        unknown = [k for k in value if k not in known]
        if unknown:
            raise InvalidInputError(
                f"{name}: unknown field{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(repr(k) for k in unknown)} ({type_.__name__} has "
                f"{', '.join(known)})"
            )
        try:
            return msgspec.convert(dict(value), type_)
        except msgspec.ValidationError as exc:
            raise InvalidInputError(f"{name}: {exc}") from None
    raise InvalidInputError(
        f"{name} must be a {type_.__name__} or a mapping of its fields, not "
        f"{type(value).__name__}: {value!r:.80}"
    )


def _as_optional(value: object, type_: type[S], name: str) -> S | None:
    return None if value is None else _as_struct(value, type_, name)


def _as_structs(values: object, type_: type[S], name: str) -> list[S]:
    if isinstance(values, str | bytes | Mapping) or not isinstance(values, Iterable):
        raise InvalidInputError(
            f"{name} must be a sequence of {type_.__name__}, not {values!r:.80}"
        )
    return [_as_struct(v, type_, f"{name}[{i}]") for i, v in enumerate(values)]


RESERVED_KEY_PREFIXES = ("open:", "settle:")
"""Idempotency keys ThreadStore gives its own appends (``open:<turn id>``, ``settle:<turn
id>``); a caller's key may not begin with them, or it could stand in for a turn's opening or
settlement."""


def _check_caller_key(idempotency_key: str | None) -> None:
    if isinstance(idempotency_key, str) and idempotency_key.startswith(RESERVED_KEY_PREFIXES):
        raise InvalidInputError(
            f"idempotency_key {idempotency_key!r}: keys beginning "
            f"{' or '.join(map(repr, RESERVED_KEY_PREFIXES))} are ThreadStore's own (a turn's "
            "opening and settlement)"
        )


class ThreadStore:
    """The runtime Store: history window, state blocks, turn lifecycle and records.

    Every method takes an optional ``principal``; the access ``policy`` (default: allow all
    within the namespace) decides before anything is read or written.

    ``new_turn_id`` mints the ids of turns opened without one (default: ULIDs). Each must be
    new to its thread; `turn_tree` orders turns by id, which is the order they were opened
    only for ids that sort by creation time, as ULIDs do (random UUIDs do not).
    """

    def __init__(
        self,
        store: EventStore,
        *,
        state: StateProjection | None = None,
        policy: AccessPolicy | None = None,
        new_turn_id: Callable[[], str] = new_ulid,
    ) -> None:
        store = require_store(store, "ThreadStore")
        if state is not None and not isinstance(state, StateProjection):
            raise InvalidInputError(
                f"state must be a StateProjection or None, not {type(state).__name__}"
            )
        if not callable(new_turn_id):
            raise InvalidInputError(
                f"new_turn_id must be a function returning a new turn id, not {new_turn_id!r:.60}"
            )
        self.store = store
        self.projector = Projector(store, state=state)
        self.policy = check_policy(policy)
        self.new_turn_id = new_turn_id

    async def _allow(self, principal: Principal | None, action: str, thread_id: str | None) -> None:
        if thread_id is not None:
            validate_thread_id(thread_id)
        await authorize(self.policy, principal, action, self.store.namespace, thread_id)  # type: ignore[arg-type]

    async def _allow_state(
        self, principal: Principal | None, thread_id: str, view: str | None
    ) -> None:
        await self._allow(principal, "read", thread_id)
        await authorize_view(self.policy, principal, self.store.namespace, thread_id, view)

    # -- messages -------------------------------------------------------------------------------

    async def list_messages(
        self,
        thread_id: str,
        limit: int = DEFAULT_WINDOW,
        *,
        as_of: AsOf | None = None,
        principal: Principal | None = None,
    ) -> list[StoredMessage]:
        """The history window: the last ``limit`` messages (``limit=0``: none); ``as_of`` (a
        seq, or a time): as it was then, folded from the log (`Projector.last`)."""
        validate_count(limit, "limit")
        await self._allow(principal, "read", thread_id)
        return await self.projector.last(thread_id, limit, as_of=as_of)

    async def append_message(
        self,
        thread_id: str,
        message: Message | Mapping[str, Any],
        *,
        turn_id: str | None = None,
        idempotency_key: str | None = None,
        principal: Principal | None = None,
    ) -> AppendResult:
        """Add a message to the conversation directly (outside the turn lifecycle).

        A ``turn_id`` must name a turn opened in this thread (`TurnNotFoundError` otherwise).
        An ``idempotency_key`` may not begin with ``open:`` or ``settle:`` (ThreadStore's own).
        To retry after an unknown outcome (a timeout), pass the same ``idempotency_key`` on
        both calls: without one, a retry of a call that did land adds the message twice.
        """
        _check_caller_key(idempotency_key)
        await self._allow(principal, "write", thread_id)
        life = await self._require_turn(thread_id, turn_id)
        event = NewEvent(payload=MessageAppended(message=as_message(message), turn_id=turn_id))
        return await self._append_in_turns_life(
            thread_id, turn_id, [event], idempotency_key=idempotency_key, life=life
        )

    # -- state ----------------------------------------------------------------------------------

    async def state(
        self,
        thread_id: str,
        view: str | None = None,
        *,
        as_of: AsOf | None = None,
        principal: Principal | None = None,
    ) -> dict[str, Block]:
        """The state blocks reader view ``view`` selects (None: every block); ``as_of``: as
        they were then. A policy that confines the principal to a reader view
        (`ReaderViewPolicy`) refuses any other, at any point in time."""
        await self._allow_state(principal, thread_id, view)
        return await self.projector.state(thread_id, view, as_of=as_of)

    async def update_state(
        self,
        thread_id: str,
        block: str,
        value: Any,
        *,
        turn_id: str | None,
        expected_block_version: int | None = None,
        expected_incarnation: int | None = None,
        idempotency_key: str | None = None,
        principal: Principal | None = None,
    ) -> AppendResult:
        """Record a (runtime-validated) state block update.

        With ``expected_block_version`` the update applies only if the block is at exactly that
        version (0: the block must not exist); otherwise `ViewConflictError` and nothing is
        written. Block versions restart when a thread is deleted and written again: pass the
        `Context.incarnation` the block was read in as ``expected_incarnation`` too, and an
        update planned in a life that is gone raises `IncarnationConflictError` (nothing
        written) instead of landing in the next one. Failure is not rollback: an update
        recorded before its turn fails stays.
        A ``turn_id`` must name a turn opened in this thread (`TurnNotFoundError` otherwise).
        To retry after an unknown outcome (a timeout), pass the same ``idempotency_key`` on
        both calls: the retry of one that landed is then answered ``duplicate``, where without
        a key it records the update again, or, with ``expected_block_version``, finds the
        block moved by the first attempt and raises `ViewConflictError`.
        """
        if expected_block_version is not None:
            validate_count(expected_block_version, "expected_block_version")
        expected_incarnation_arg(expected_incarnation)  # refused before any read
        _check_caller_key(idempotency_key)
        await self._allow(principal, "write", thread_id)
        event = StateUpdated(
            block=block, value=value, turn_id=turn_id, expected_version=expected_block_version
        )
        new = NewEvent(payload=event, turn_id=turn_id)
        if turn_id is not None:  # a read comes first: refuse bad input before it
            _check_turn_id(turn_id)
            self.projector.validate([new])
        life = await self._require_turn(thread_id, turn_id)
        if expected_incarnation is not None:  # the caller's own life: its conflict is its own
            return await self.projector.append(
                thread_id,
                [new],
                idempotency_key=idempotency_key,
                expected_incarnation=expected_incarnation,
            )
        return await self._append_in_turns_life(
            thread_id, turn_id, [new], idempotency_key=idempotency_key, life=life
        )

    async def _require_turn(self, thread_id: str, turn_id: str | None) -> int | None:
        """A turn id an event is tagged with must be a turn of this thread: a typo would
        otherwise attach the event, in the log and in every audit, to a turn that never ran.
        One read of the turn's record (settled or not: a late update after settling is the
        runtime's to allow) and of the life it was found in, returned (None: no turn_id)."""
        if turn_id is None:
            return None
        _check_turn_id(turn_id)
        record, life = await self.projector.record_in_life(thread_id, turn_id)
        if record is None:
            raise TurnNotFoundError(f"turn {turn_id!r} was not opened in thread {thread_id!r}")
        return life

    async def _append_in_turns_life(
        self,
        thread_id: str,
        turn_id: str | None,
        events: list[NewEvent],
        *,
        idempotency_key: str | None,
        life: int | None,
    ) -> AppendResult:
        """Append events tagged with ``turn_id`` only in the life the turn was found in: the
        thread deleted (and perhaps written again) since is `TurnNotFoundError`, nothing
        written, where the events would have landed in a new life under a turn it never had."""
        try:
            return await self.projector.append(
                thread_id, events, idempotency_key=idempotency_key, expected_incarnation=life
            )
        except IncarnationConflictError:
            if turn_id is None:
                raise
            raise TurnNotFoundError(
                f"turn {turn_id!r} was opened in thread {thread_id!r} before it was deleted "
                "(the thread was deleted, or deleted and written again, meanwhile); nothing "
                "was written"
            ) from None

    # -- turns ----------------------------------------------------------------------------------

    async def open_turn(
        self,
        thread_id: str,
        *,
        parent_turn_id: str | None = None,
        grant: Grant | Mapping[str, Any] | None = None,
        request_message: Message | Mapping[str, Any] | None = None,
        turn_id: str | None = None,
        principal: Principal | None = None,
    ) -> str:
        """Admit a turn and return its id (a ULID unless ``turn_id`` is given).

        A root turn opened with a request adds the user message to the conversation in the
        same atomic append, before context assembly. A child turn's parent must be a turn of
        this thread. Re-opening the same ``turn_id`` is idempotent; an id minted by
        ``new_turn_id`` (none given) must be a new, valid turn id: one already opened in the
        thread raises `TurnConflictError` and writes nothing.

        To retry after an unknown outcome (a timeout: the turn may have been opened), pass the
        same ``turn_id``: mint it first (``turn_id = threads.new_turn_id()``) and reuse it. A
        retry without it opens a second turn, with a second copy of the request message.
        """
        await self._allow(principal, "write", thread_id)
        if turn_id is not None:
            _check_turn_id(turn_id)
        if parent_turn_id is not None:
            _check_turn_id(parent_turn_id, "parent_turn_id")
        grant = _as_optional(grant, Grant, "grant")
        _check_grant(grant)
        life: int | None = None  # a root turn opens in any life (it may create the thread)
        if parent_turn_id is not None:
            # The life read with the parent's record: the child is opened only in that life,
            # never in the thread written again after a delete (see settle_turn).
            parent, life = await self.projector.record_in_life(thread_id, parent_turn_id)
            if parent is None:
                raise TurnNotFoundError(
                    f"parent turn {parent_turn_id!r} was not opened in thread {thread_id!r}"
                )
        minted = turn_id is None
        if turn_id is None:
            turn_id = self.new_turn_id()
            _check_turn_id(turn_id, "new_turn_id()")
        request = as_message(request_message) if request_message is not None else None
        opened = TurnOpened(
            turn_id=turn_id, parent_turn_id=parent_turn_id, grant=grant, request=request
        )
        new = NewEvent(payload=opened, turn_id=turn_id)
        try:
            result = await self.projector.append(
                thread_id, [new], idempotency_key=f"open:{turn_id}", expected_incarnation=life
            )
        except IncarnationConflictError:
            raise TurnNotFoundError(
                f"parent turn {parent_turn_id!r} was opened in thread {thread_id!r} before it "
                "was deleted (deleted, or deleted and written again, as the child was opened); "
                "nothing was written"
            ) from None
        except IdempotencyKeyReusedError:
            if minted:
                raise _minted_twice(thread_id, turn_id) from None
            raise TurnConflictError(
                f"turn {turn_id!r} was already opened in thread {thread_id!r} with other details"
            ) from None
        if minted and result.duplicate and not await self._wrote(thread_id, result, new):
            # A fresh id answered from the ledger is an id generator that repeats itself
            # (a counter after a restart): taken as a re-open, this turn would be the old
            # one, and its request message would be dropped.
            raise _minted_twice(thread_id, turn_id)
        return turn_id

    async def _wrote(self, thread_id: str, result: AppendResult, new: NewEvent) -> bool:
        """Whether the append a duplicate ``result`` answers with is the one of ``new`` (a
        lost reply retried by the connection) rather than another's under the same key."""
        async for event in self.store.read(thread_id, start=result.first_seq, limit=1):
            return event.id == new.id
        return False

    async def settle_turn(
        self,
        thread_id: str,
        turn_id: str,
        *,
        outcome: Outcome,
        usage: Usage | Mapping[str, Any] | None = None,
        steps: int = 0,
        model_tier: str | None = None,
        fallbacks: Sequence[Fallback | Mapping[str, Any]] = (),
        timing: Timing | Mapping[str, Any] | None = None,
        error: TurnError | Mapping[str, Any] | None = None,
        assistant_message: Message | Mapping[str, Any] | None = None,
        state_updates: Iterable[StateUpdate | Mapping[str, Any]] = (),
        principal: Principal | None = None,
    ) -> Settlement:
        """Settle a turn: its record, its assistant message and final state updates, atomically.

        The assistant message joins the conversation only when a root turn completes; for any
        other outcome it is kept in the log for audit. Settling is idempotent per turn: a
        second settlement returns the first one (with the seqs its append wrote) and writes
        nothing. A turn that was not opened in this thread is refused with `TurnNotFoundError`.
        Bad input is refused before the turn is looked up, for a settled turn as well.
        ``usage``, ``timing``, ``error``, ``fallbacks`` and ``state_updates`` take their structs
        or the same as mappings of fields.

        The policy must allow the principal to write the thread and to read it: the answer is
        the turn's record as stored (its grant, and for a settled turn the first settlement,
        whoever made it).
        """
        await self._allow(principal, "write", thread_id)
        await self._allow(principal, "read", thread_id)
        _check_turn_id(turn_id)
        if outcome not in OUTCOMES:
            raise InvalidInputError(
                f"outcome must be one of {', '.join(OUTCOMES)}, not {outcome!r:.60}"
            )
        usage = _as_optional(usage, Usage, "usage")
        timing = _as_optional(timing, Timing, "timing")
        error = _as_optional(error, TurnError, "error")
        fallbacks = _as_structs(fallbacks, Fallback, "fallbacks")
        updates = _as_structs(state_updates, StateUpdate, "state_updates")
        _check_counts(steps, usage)
        _check_timing(timing)
        message = as_message(assistant_message) if assistant_message is not None else None
        events: list[NewEvent] = [
            NewEvent(
                payload=StateUpdated(
                    block=u.block,
                    value=u.value,
                    turn_id=turn_id,
                    expected_version=u.expected_version,
                ),
                turn_id=turn_id,
            )
            for u in updates
        ]
        settled = TurnSettled(
            turn_id=turn_id,
            outcome=outcome,
            steps=steps,
            model_tier=model_tier,
            fallbacks=fallbacks,
            usage=usage or Usage(),
            timing=timing or Timing(),
            error=error,
            assistant_message=message,
        )
        # Refused before the record is read: the turn's parent and grant, which only the
        # record holds, were checked when the turn was opened.
        self.projector.validate([*events, NewEvent(payload=settled, turn_id=turn_id)])
        # The life read with the open record: the settlement is appended only in that life,
        # never into the thread written again after a delete.
        current, life = await self.projector.record_in_life(thread_id, turn_id)
        if current is None:
            raise TurnNotFoundError(f"turn {turn_id!r} was not opened in thread {thread_id!r}")
        if not current.is_open:
            return await self._first_settlement(thread_id, turn_id, current)
        settled = msgspec.structs.replace(
            settled, parent_turn_id=current.parent_turn_id, grant=current.grant
        )
        events.append(NewEvent(payload=settled, turn_id=turn_id))
        try:
            result = await self.projector.append(
                thread_id,
                events,
                idempotency_key=f"settle:{turn_id}",
                expected_incarnation=life,
            )
        except IncarnationConflictError:
            raise TurnNotFoundError(
                f"turn {turn_id!r} was opened in thread {thread_id!r} before it was deleted "
                "(the thread was deleted, or deleted and written again, as it was settled); "
                "nothing was written"
            ) from None
        except IdempotencyKeyReusedError:
            # The key recorded another append: another instance settled the turn first, with
            # other details (the first wins), or, if the turn is still open, an append outside
            # ThreadStore took the key, and this settlement cannot be recorded under it.
            record = await self.projector.record(thread_id, turn_id)
            if record is None or record.is_open:
                raise TurnConflictError(
                    f"turn {turn_id!r} of thread {thread_id!r} is open, but its settlement's "
                    f"idempotency key 'settle:{turn_id}' was used by another append; keys "
                    "beginning 'open:' or 'settle:' are ThreadStore's own"
                ) from None
            return await self._first_settlement(thread_id, turn_id, record)
        record = await self.projector.record(thread_id, turn_id)
        if record is None:
            # Deleted right after the settlement landed: answer what it wrote.
            if result.duplicate:
                raise TurnNotFoundError(
                    f"turn {turn_id!r} of thread {thread_id!r} was settled before, and the "
                    "thread was deleted before its first settlement could be read"
                )
            record = RecordsProjection.record_of(thread_id, result.last_seq, events[-1])
            assert record is not None  # a TurnSettled makes one
        # A duplicate whose record was written by this very event is this call's own write,
        # answered from the ledger after the connection re-sent it (a lost reply): not a
        # settlement someone else made first.
        return Settlement(
            record=record,
            first_seq=result.first_seq,
            last_seq=result.last_seq,
            duplicate=result.duplicate and record.event_id != events[-1].id,
        )

    async def _first_settlement(
        self, thread_id: str, turn_id: str, record: TurnRecord
    ) -> Settlement:
        """A settled turn's `Settlement` as its first settlement returned it: the seqs its
        append wrote, from the idempotency ledger (the record's own seq for a turn settled by
        an append outside ThreadStore)."""
        first = await self.store.recorded_append(thread_id, f"settle:{turn_id}")
        if first is None:
            return Settlement(
                record=record, first_seq=record.seq, last_seq=record.seq, duplicate=True
            )
        return Settlement(
            record=record, first_seq=first.first_seq, last_seq=first.last_seq, duplicate=True
        )

    async def delete_thread(self, thread_id: str, *, principal: Principal | None = None) -> int:
        """Delete a thread, its events and its views (a tombstone reaches the change feed)."""
        await self._allow(principal, "write", thread_id)
        return await self.projector.delete_thread(thread_id)

    # -- records --------------------------------------------------------------------------------

    async def turn(
        self,
        thread_id: str,
        turn_id: str,
        *,
        as_of: AsOf | None = None,
        principal: Principal | None = None,
    ) -> TurnRecord | None:
        """One turn's record (open or settled), or None (``as_of``: as it was then)."""
        _check_turn_id(turn_id)
        await self._allow(principal, "read", thread_id)
        return await self.projector.record(thread_id, turn_id, as_of=as_of)

    async def turn_tree(
        self, thread_id: str, *, as_of: AsOf | None = None, principal: Principal | None = None
    ) -> list[TurnNode]:
        """Root turns with their child turns, each level in turn id order (the order the
        turns were opened for ULID turn ids); ``as_of``: as they were then."""
        await self._allow(principal, "read", thread_id)
        return await self.projector.turn_tree(thread_id, as_of=as_of)

    async def records(
        self,
        thread_id: str | None = None,
        *,
        limit: int = 50,
        after: str | None = None,
        as_of: AsOf | None = None,
        principal: Principal | None = None,
    ) -> RecordsPage:
        """Settled turn records, newest first: of one thread, or of every thread (None).
        (`context` gives a thread's latest records oldest first, as a prompt reads them.)

        ``after`` is the ``next_cursor`` of the previous page. A page across threads reads
        the records of every thread active since shortly (`CLOCK_SKEW_MS`) before the page's
        oldest record, `RECORDS_READ_AHEAD` threads at a time; records of one millisecond
        come by thread id there (no order across threads is finer than their clocks).
        ``as_of`` (one thread's only: a seq or a time is a point in one thread's log): the
        records as they were then.
        """
        validate_count(limit, "limit")  # 0: the empty page, as every read with a count
        if as_of is not None and thread_id is None:
            raise InvalidInputError(
                "as_of reads one thread as it was at a point of its log: give a thread_id"
            )
        await self._allow(principal, "read", thread_id)
        cursor = _parse_cursor(after)
        if limit == 0:
            if thread_id is not None and as_of is not None:
                # A point past the thread's end is refused, as every read with a count of 0.
                await self.projector.seq_of(thread_id, as_of)
            return RecordsPage(records=[], next_cursor=None)
        if thread_id is not None:
            found = await self.projector.records(thread_id, as_of=as_of)
            ordered = sorted(found, key=_newest_first)
        else:
            ordered = await self._records_everywhere(cursor, limit)
        if cursor is not None:
            ordered = [r for r in ordered if _newest_first(r) > cursor]
        page = ordered[:limit]
        more = len(ordered) > limit
        next_cursor = _cursor_of(page[-1]) if more and page else None
        return RecordsPage(records=page, next_cursor=next_cursor)

    async def _records_everywhere(self, cursor: SortKey | None, limit: int) -> list[TurnRecord]:
        # Threads come newest activity first, and no thread holds a record much newer than
        # its last activity (record times come from client ULIDs, activity from the server
        # clock: CLOCK_SKEW_MS absorbs the difference). Once `limit + 1` records are newer
        # than that, older threads cannot change the page.
        # The index is read a batch at a time, like the records: a page near the front of a
        # namespace of a million threads must not list them all first. A thread that becomes
        # active meanwhile moves to the index's front and is not listed again (`threads`
        # paging): this page may then miss its older records, as any read racing a write may.
        keep = limit + 1
        best: list[tuple[SortKey, TurnRecord]] = []  # the page so far, sorted, at most `keep`
        last: ThreadInfo | None = None
        while True:
            batch = await self.store.threads(limit=RECORDS_READ_AHEAD, after=last)
            if not batch or (
                len(best) == keep
                and best[-1][1].recorded_ms > batch[0].last_activity_ms + CLOCK_SKEW_MS
            ):
                break
            last = batch[-1]
            # A batch of threads read at once: one round trip's wait for many threads.
            found: list[list[TurnRecord]] = [[] for _ in batch]
            async with anyio.create_task_group() as tg:
                for i, info in enumerate(batch):
                    tg.start_soon(self._read_records, info.thread_id, found, i)
            for records in found:
                for r in records:
                    key = _newest_first(r)
                    if cursor is not None and key <= cursor:
                        continue
                    if len(best) == keep and key >= best[-1][0]:
                        continue
                    bisect.insort(best, (key, r), key=_first)
                    del best[keep:]
        return [r for _, r in best]

    async def _read_records(self, thread_id: str, into: list[list[TurnRecord]], i: int) -> None:
        into[i] = await self.projector.records(thread_id)

    async def context(
        self,
        thread_id: str,
        *,
        limit: int = DEFAULT_WINDOW,
        view: str | None = None,
        records: int = 0,
        as_of: AsOf | None = None,
        principal: Principal | None = None,
    ) -> Context:
        """History window, a reader view and the latest records in one round trip.

        Both lists are in the order a prompt reads them, oldest first: the last ``limit``
        messages, and the last ``records`` settled turn records in settle order (`records`
        pages the other way, newest first). ``view`` None reads every state block.
        ``as_of`` (a seq, or a time): the context as it was then, folded from the log.
        """
        validate_count(limit, "limit")
        validate_count(records, "records")
        await self._allow_state(principal, thread_id, view)
        return await self.projector.context(
            thread_id, n=limit, view=view, records=records, as_of=as_of
        )


# Newest first: by record time (ms), then thread id, then seq descending within a thread.
SortKey = tuple[int, str, int]


MAX_TURN_ID_CHARS = 256
"""The longest turn id taken: ULIDs have 26 characters, UUIDs 36; a turn id is also part of
the turn's idempotency keys, which have a limit of their own."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _check_turn_id(turn_id: object, name: str = "turn_id") -> None:
    if not isinstance(turn_id, str) or not turn_id:
        raise InvalidInputError(f"{name} must be a non-empty string, not {turn_id!r:.80}")
    if len(turn_id) > MAX_TURN_ID_CHARS:
        raise InvalidInputError(
            f"{name} is {len(turn_id)} characters long, the limit is {MAX_TURN_ID_CHARS}"
        )
    bad = _CONTROL.search(turn_id)
    if bad is not None:
        raise InvalidInputError(
            f"{name} {turn_id!r:.80} holds a control character {bad.group()!r} (not allowed, as "
            "in thread ids)"
        )


def _minted_twice(thread_id: str, turn_id: str) -> TurnConflictError:
    return TurnConflictError(
        f"new_turn_id() returned {turn_id!r}, the id of a turn already opened in thread "
        f"{thread_id!r}: a minted turn id must be new (nothing was written; ULIDs are)"
    )


def _first(pair: tuple[SortKey, TurnRecord]) -> SortKey:
    return pair[0]


def _newest_first(r: TurnRecord) -> SortKey:
    return (-r.recorded_ms, r.thread_id, -r.seq)


def _cursor_of(r: TurnRecord) -> str:
    return f"{r.recorded_ms}:{r.seq}:{r.thread_id}"


def _parse_cursor(after: str | None) -> SortKey | None:
    if after is None:
        return None
    if not isinstance(after, str):
        raise InvalidInputError(f"after must be a records cursor (a str) or None, not {after!r}")
    try:
        ms, seq, thread_id = after.split(":", 2)
        return (-int(ms), thread_id, -int(seq))
    except ValueError:
        raise InvalidInputError(f"not a records cursor: {after!r}") from None
