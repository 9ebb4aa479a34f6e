"""`TranscriptProjection`: the session's model-message transcript; a replace swaps it whole.

`TranscriptReplaced` (after compaction) resets the view, while the log keeps every earlier
message for audit.
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
    ListReset,
    Message,
    NewEvent,
    RecordedEvent,
    TranscriptAppended,
    TranscriptReplaced,
    ViewEntry,
    ViewOp,
    ViewRead,
    ViewResult,
)

from ._base import Projection, decode_entries, encoder

_message_decoder = msgspec.msgpack.Decoder(Message)
_NO_META = EventMeta()


class TranscriptMessage(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A transcript message with the seq of the event that wrote it."""

    # gc=False: as `StoredMessage` (one per message in a fold; holds no cycle).

    seq: int
    message: Message


class TranscriptProjection(Projection[list[TranscriptMessage]]):
    """The current transcript of a session (thread)."""

    name = "transcript"
    views = ("transcript",)
    handles = (TranscriptAppended, TranscriptReplaced)

    def initial(self) -> list[TranscriptMessage]:
        return []

    def apply(
        self, state: list[TranscriptMessage], event: RecordedEvent
    ) -> list[TranscriptMessage]:
        return self.apply_payload(state, event.seq, event.payload, b"", _NO_META)

    def apply_payload(
        self,
        state: list[TranscriptMessage],
        seq: int,
        payload: Event,
        event_id: bytes,
        meta: EventMeta,
    ) -> list[TranscriptMessage]:
        if isinstance(payload, TranscriptReplaced):
            state = []
        if isinstance(payload, TranscriptAppended | TranscriptReplaced):
            state.extend(TranscriptMessage(seq=seq, message=m) for m in payload.messages)
        return state

    def ops(self, events: Sequence[NewEvent]) -> list[ViewOp]:
        out: list[ViewOp] = []
        for index, new in enumerate(events):
            payload = new.payload
            if isinstance(payload, TranscriptAppended | TranscriptReplaced):
                values = tuple(encoder.encode(m) for m in payload.messages)
                if isinstance(payload, TranscriptReplaced):
                    out.append(ListReset("transcript", values, index))
                elif values:
                    out.append(ListPush("transcript", values, index))
        return out

    def materialize(self, state: list[TranscriptMessage]) -> list[ViewOp]:
        entries = tuple(ViewEntry(m.seq, encoder.encode(m.message)) for m in state)
        return [ListLoad("transcript", entries)]

    def full_reads(self) -> list[ViewRead]:
        return [ListRange("transcript", 0, -1)]

    @staticmethod
    def parse(result: ViewResult) -> list[TranscriptMessage]:
        """Decode a list result of the transcript view."""
        assert isinstance(result, list)
        messages = decode_entries(_message_decoder, result, "transcript")
        return [
            TranscriptMessage(seq=e.seq, message=m) for e, m in zip(result, messages, strict=True)
        ]

    @staticmethod
    def messages(result: ViewResult) -> list[Message]:
        """The messages of a list result of the transcript view, without their seqs."""
        assert isinstance(result, list)
        return decode_entries(_message_decoder, result, "transcript")
