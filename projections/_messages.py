"""`MessagesProjection`: the conversation message list the context assembler windows over.

Rules from the runtime: a root turn opened with a user request adds that message at admission;
a root turn adds its assistant message only when it settles ``completed``; child turns add
none; failed, cut, stopped, truncated and refused roots add no assistant message. Messages
stored directly (`MessageAppended`) always join.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from eventstore import (
    Event,
    EventMeta,
    ListLoad,
    ListPush,
    ListRange,
    Message,
    MessageAppended,
    NewEvent,
    RecordedEvent,
    TurnOpened,
    TurnSettled,
    ViewEntry,
    ViewOp,
    ViewRead,
    ViewResult,
)

from ._base import Projection, decode_entries, encoder

DEFAULT_WINDOW = 6


_MAX_LIST = 2**62  # more entries than any Redis list (or memory) can hold


class StoredMessage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A message of the conversation with the seq of the event that added it."""

    # gc=False: a fold of a long log holds one per message; untracked, the garbage collector
    # does not traverse them again and again while the fold grows. It holds a decoded message
    # and strings, which cannot form a reference cycle.

    seq: int
    message: Message
    turn_id: str | None = None


class _MessageValue(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    message: Message
    turn_id: str | None = None


_value_decoder = msgspec.msgpack.Decoder(_MessageValue)


def conversation_message(payload: object, turn_id: str | None) -> _MessageValue | None:
    """The message an event adds to the conversation, if any (the rules above)."""
    if isinstance(payload, MessageAppended):
        return _MessageValue(payload.message, payload.turn_id or turn_id)
    if isinstance(payload, TurnOpened):
        if payload.parent_turn_id is None and payload.request is not None:
            return _MessageValue(payload.request, payload.turn_id)
        return None
    if isinstance(payload, TurnSettled) and (
        payload.parent_turn_id is None
        and payload.outcome == "completed"
        and payload.assistant_message is not None
    ):
        return _MessageValue(payload.assistant_message, payload.turn_id)
    return None


class MessagesProjection(Projection[list[StoredMessage]]):
    """The conversation, in order; read as a window of the last N messages."""

    name = "messages"
    views = ("messages",)
    handles = (MessageAppended, TurnOpened, TurnSettled)

    def initial(self) -> list[StoredMessage]:
        return []

    def apply(self, state: list[StoredMessage], event: RecordedEvent) -> list[StoredMessage]:
        value = conversation_message(event.payload, event.turn_id)
        if value is not None:
            state.append(StoredMessage(seq=event.seq, message=value.message, turn_id=value.turn_id))
        return state

    def apply_payload(
        self, state: list[StoredMessage], seq: int, payload: Event, event_id: bytes, meta: EventMeta
    ) -> list[StoredMessage]:
        value = conversation_message(payload, meta.turn_id)
        if value is not None:
            state.append(StoredMessage(seq=seq, message=value.message, turn_id=value.turn_id))
        return state

    def ops(self, events: Sequence[NewEvent]) -> list[ViewOp]:
        out: list[ViewOp] = []
        for index, new in enumerate(events):
            value = conversation_message(new.payload, new.turn_id)
            if value is not None:
                out.append(ListPush("messages", (encoder.encode(value),), index))
        return out

    def materialize(self, state: list[StoredMessage]) -> list[ViewOp]:
        entries = tuple(
            ViewEntry(m.seq, encoder.encode(_MessageValue(m.message, m.turn_id))) for m in state
        )
        return [ListLoad("messages", entries)]

    def full_reads(self) -> list[ViewRead]:
        return [ListRange("messages", 0, -1)]

    # -- reads ---------------------------------------------------------------------------------

    @staticmethod
    def window_read(n: int = DEFAULT_WINDOW) -> ListRange:
        """The read for the last ``n`` messages (``n`` must be >= 1)."""
        # Any n beyond what a list can hold means "all of it"; Redis would refuse the index.
        return ListRange("messages", -min(n, _MAX_LIST), -1)

    @staticmethod
    def parse(result: ViewResult) -> list[StoredMessage]:
        """Decode a list result of the messages view."""
        assert isinstance(result, list)
        values = decode_entries(_value_decoder, result, "messages")
        return [
            StoredMessage(seq=e.seq, message=v.message, turn_id=v.turn_id)
            for e, v in zip(result, values, strict=True)
        ]

    @staticmethod
    def window(state: list[StoredMessage], n: int = DEFAULT_WINDOW) -> list[StoredMessage]:
        """The last ``n`` messages of a folded state (``n=0``: none)."""
        return state[-n:] if n > 0 else []
