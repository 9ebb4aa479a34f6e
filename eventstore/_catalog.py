"""The agent event catalog: messages, state updates, turn lifecycle and transcript events.

Tags are stable wire names; field names are AI-SDK style where the runtime exchanges them.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from ._events import Event, register_event

# -- model messages ------------------------------------------------------------------------------


class _Part(
    msgspec.Struct, tag_field="type", frozen=True, kw_only=True, omit_defaults=True, rename="camel"
):
    provider_options: dict[str, Any] | None = None


class TextPart(_Part, tag="text", frozen=True):
    """Plain text content."""

    text: str


class ReasoningPart(_Part, tag="reasoning", frozen=True):
    """Model reasoning text."""

    text: str


class ToolCallPart(_Part, tag="tool-call", frozen=True):
    """A tool call issued by the model."""

    tool_call_id: str
    tool_name: str
    input: Any = None


class ToolResultPart(_Part, tag="tool-result", frozen=True):
    """The result of a tool call."""

    tool_call_id: str
    tool_name: str
    output: Any = None
    is_error: bool = False


class FilePart(_Part, tag="file", frozen=True):
    """A file, by reference (URL) or inline (base64 data)."""

    media_type: str
    data: str | None = None
    url: str | None = None
    filename: str | None = None


class ImagePart(_Part, tag="image", frozen=True):
    """An image, by reference (URL) or inline (base64 data)."""

    image: str
    media_type: str | None = None


Part = TextPart | ReasoningPart | ToolCallPart | ToolResultPart | FilePart | ImagePart
Role = Literal["system", "user", "assistant", "tool"]


class Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, rename="camel"):
    """A model message: a role and content given as text or as a list of parts."""

    role: Role
    content: str | list[Part]
    id: str | None = None
    provider_options: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        """The message's text: the content string, or its text parts joined."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


# -- turn settlement details ------------------------------------------------------------------

Outcome = Literal["completed", "failed", "refused", "cut", "stopped", "truncated"]
OUTCOMES: tuple[Outcome, ...] = ("completed", "failed", "refused", "cut", "stopped", "truncated")


class Grant(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The budget a turn was admitted with."""

    max_steps: int | None = None
    max_tokens: int | None = None
    max_cost_usd: float | None = None
    deadline_ms: int | None = None


class Usage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Tokens (and optionally cost) a turn consumed."""

    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cost_usd: float | None = None

    @property
    def total_tokens(self) -> int:
        """Input plus output tokens."""
        return self.input_tokens + self.output_tokens


class Timing(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """When a turn started and settled (milliseconds since the epoch)."""

    started_ms: int = 0
    settled_ms: int = 0

    @property
    def duration_ms(self) -> int:
        """Settle time minus start time."""
        return max(0, self.settled_ms - self.started_ms)


class Fallback(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One switch from a model tier to another during a turn."""

    from_tier: str
    to_tier: str
    reason: str = ""


class TurnError(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What went wrong in a turn that did not complete."""

    kind: str
    message: str = ""
    retryable: bool = False


# -- the events -------------------------------------------------------------------------------


@register_event
class MessageAppended(Event, tag="message.appended", frozen=True):
    """A conversation message was stored directly, outside the turn lifecycle."""

    message: Message
    turn_id: str | None = None


@register_event
class StateUpdated(Event, tag="state.updated", frozen=True):
    """A state block was set to a new value (validated by the runtime before recording)."""

    block: str
    value: Any
    turn_id: str | None = None
    # The block version the writer required (None: unconditional); kept for audit.
    expected_version: int | None = None


@register_event
class TurnOpened(Event, tag="turn.opened", frozen=True):
    """A turn was admitted; root turns have no parent.

    ``request`` is the user message a root turn was opened with; it joins the conversation at
    admission, before context assembly. Child turns' requests stay in the log only.
    """

    turn_id: str
    parent_turn_id: str | None = None
    grant: Grant | None = None
    request: Message | None = None


@register_event
class TurnSettled(Event, tag="turn.settled", frozen=True):
    """A turn settled, whatever its outcome; this is the turn record.

    ``assistant_message`` joins the conversation only when a root turn settles ``completed``;
    for any other outcome, or a child turn, it stays in the log for audit.
    """

    turn_id: str
    outcome: Outcome
    parent_turn_id: str | None = None
    grant: Grant | None = None
    steps: int = 0
    model_tier: str | None = None
    fallbacks: list[Fallback] = msgspec.field(default_factory=list)
    usage: Usage = msgspec.field(default_factory=Usage)
    timing: Timing = msgspec.field(default_factory=Timing)
    error: TurnError | None = None
    assistant_message: Message | None = None


@register_event
class TranscriptAppended(Event, tag="transcript.appended", frozen=True):
    """Messages were added to the end of the session transcript."""

    messages: list[Message]


@register_event
class TranscriptReplaced(Event, tag="transcript.replaced", frozen=True):
    """The session transcript was swapped (after compaction); the log keeps the earlier one."""

    messages: list[Message]
    reason: str = "compaction"
