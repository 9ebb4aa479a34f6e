"""The agent event catalog: messages, state updates, turn lifecycle and transcript events.

Tags are stable wire names; field names are AI-SDK style where the runtime exchanges them.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from ._errors import DECODE_ERRORS, InvalidInputError
from ._events import Event, register_event

# -- model messages ------------------------------------------------------------------------------
#
# AI-SDK-style model messages. Stored losslessly as JSON values: every field of a message or a
# part comes back with its value. Fields threadlog does not model are kept in ``extra`` (in
# their original order), and so are modelled fields it cannot hold as such: one of another type,
# or one given at its default value (``"isError": false``, ``"id": null``), which the struct
# alone could not tell from an absent field (it omits defaults when stored). Parts of
# unmodelled types become `OtherPart`. What is not kept is the order of the modelled fields:
# they come first, in threadlog's order, then the others in theirs. A message read from JSON
# text that re-encodes differently keeps that text in ``source``, for a byte-faithful export.


class _Part(
    msgspec.Struct, tag_field="type", frozen=True, kw_only=True, omit_defaults=True, rename="camel"
):
    provider_options: dict[str, Any] | None = None
    extra: dict[str, Any] | None = None


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


class OtherPart(_Part, tag="x-threadlog-other", frozen=True):
    """A part whose type threadlog does not model (or whose fields do not fit), kept verbatim."""

    kind: str
    data: dict[str, Any] = msgspec.field(default_factory=dict)


Part = TextPart | ReasoningPart | ToolCallPart | ToolResultPart | FilePart | ImagePart | OtherPart
Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant", "tool")


class Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, rename="camel"):
    """A model message: a role and content given as text or as a list of parts.

    ``extra`` holds the fields threadlog does not model, and modelled fields given with a value
    their attribute cannot stand for (of another type, or their default: an explicit null or
    false); ``source`` the exact JSON text (one line) the message was read from, kept only when
    re-encoding would not reproduce it byte for byte.
    """

    role: Role
    content: str | list[Part]
    id: str | None = None
    provider_options: dict[str, Any] | None = None
    extra: dict[str, Any] | None = None
    source: str | None = None

    @property
    def text(self) -> str:
        """The message's text: the content string, or its text parts joined."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    @classmethod
    def from_json(cls, obj: Any) -> Message:
        """Build a message from a decoded JSON object, keeping every field.

        Raises `MessageFormatError` when ``obj`` is not a message at all (not an object, no
        known role, content neither a string nor a list of typed objects).
        """
        return _message_from_json(obj)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this message, every field included: the modelled ones first (a
        part's ``type`` first), then those of ``extra`` in their order. An attribute set to a
        value other than its default wins over a field of that name in ``extra``."""
        return _message_to_json(self)

    @classmethod
    def from_json_bytes(cls, text: bytes | str) -> Message:
        """Decode one JSON message; keeps ``text`` as ``source`` unless it re-encodes exactly
        or spans several lines (a JSONL file holds one message per line).

        Raises `MessageFormatError` saying what is wrong: not UTF-8, an unpaired surrogate
        escape (``"\\ud800"``, which names no character), not JSON, or not a message.
        """
        try:
            raw = text.encode("utf-8") if isinstance(text, str) else text
        except UnicodeEncodeError as exc:
            raise MessageFormatError(f"not encodable as UTF-8: {exc.reason}") from None
        try:
            obj = _json_decoder.decode(raw)
        except DECODE_ERRORS as exc:
            raise MessageFormatError(_json_problem(raw, exc)) from None
        message = _message_from_json(obj)
        if (
            b"\n" not in raw
            and b"\r" not in raw
            and _json_encoder.encode(_message_to_json(message)) != raw
        ):
            try:
                source = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise MessageFormatError(f"not valid UTF-8: {exc}") from None
            message = msgspec.structs.replace(message, source=source)
        return message

    def with_current_source(self) -> Message:
        """This message, without its ``source`` if that no longer says what the message does
        (a copy changed with ``msgspec.structs.replace``, e.g. a redaction): stored so, the
        original text would go on living in every event written from the copy."""
        if self.source is None or _source_says(
            self.source, _json_encoder.encode(_message_to_json(self))
        ):
            return self
        return msgspec.structs.replace(self, source=None)

    def to_json_bytes(self) -> bytes:
        """The JSON text of this message, on one line: its ``source`` if that still decodes to
        this very message (a copy changed with ``msgspec.structs.replace`` keeps the source
        of the original, which no longer says what the message does), else canonical JSON."""
        canonical = _json_encoder.encode(_message_to_json(self))
        if self.source is not None and _source_says(self.source, canonical):
            return self.source.encode("utf-8")
        return canonical


class MessageFormatError(InvalidInputError):
    """Raised when a JSON value is not a model message."""


_json_encoder = msgspec.json.Encoder()
_json_decoder = msgspec.json.Decoder()
_PART_TYPES: dict[str, type[_Part]] = {
    c.__struct_config__.tag: c  # type: ignore[misc]
    for c in (TextPart, ReasoningPart, ToolCallPart, ToolResultPart, FilePart, ImagePart)
}
# Wire names of the modelled fields; "extra" is ours, so a wire field of that name is unknown.
_PART_FIELDS = {
    tag: frozenset(f.encode_name for f in msgspec.structs.fields(c)) - {"extra"}
    for tag, c in _PART_TYPES.items()
}
# The modelled fields that have a default (None or False, compared by identity): given at it,
# they are kept in ``extra``, since the struct would drop them (omit_defaults).
_PART_DEFAULTS = {
    tag: {
        f.encode_name: f.default
        for f in msgspec.structs.fields(c)
        if f.default is not msgspec.NODEFAULT and f.encode_name != "extra"
    }
    for tag, c in _PART_TYPES.items()
}
_MESSAGE_FIELDS = frozenset({"role", "content", "id", "providerOptions"})
_NO_DEFAULT = object()


def _source_says(source: str, canonical: bytes) -> bool:
    """Whether ``source`` is one line of JSON text that decodes to the message ``canonical``
    encodes."""
    if "\n" in source or "\r" in source:
        return False  # kept by an earlier version, which did not refuse multi-line text
    try:
        decoded = _message_from_json(_json_decoder.decode(source.encode("utf-8")))
    except (UnicodeError, msgspec.DecodeError, MessageFormatError):  # UnicodeError: either way
        return False
    # Compared as JSON text, not as structs: 1 == 1.0 == True and 0.0 == -0.0 in Python.
    return _json_encoder.encode(_message_to_json(decoded)) == canonical


# A JSON string escape: a backslash and the character it escapes (\uXXXX whole), matched left
# to right so that an escaped backslash is never read as the start of another escape.
_ESCAPE = re.compile(rb"\\(u[0-9a-fA-F]{4}|.)", re.DOTALL)


def _json_problem(raw: bytes, exc: Exception) -> str:
    """What is wrong with JSON text the decoder refused, in words that name the cause.

    The decoder's own message misleads for two causes that are not syntax: bytes that are
    not UTF-8 ("Invalid UTF-8 encoded string", no position) and an unpaired surrogate escape
    such as ``"\\ud800"`` at the end of a string ("Input data was truncated").
    """
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        return f"not valid UTF-8: {bad.reason} at byte {bad.start}"
    pending: re.Match[bytes] | None = None  # a high surrogate escape, before its low half
    for found in _ESCAPE.finditer(raw):
        code = int(found[1][1:], 16) if len(found[1]) == 5 else -1
        low = 0xDC00 <= code <= 0xDFFF
        if pending is not None:
            if not (low and found.start() == pending.end()):
                return _unpaired(pending)
            pending = None
        elif low:
            return _unpaired(found)
        elif 0xD800 <= code <= 0xDBFF:
            pending = found
    if pending is not None:
        return _unpaired(pending)
    if str(exc).startswith("Number out of range"):
        # Valid JSON (its grammar sets no limit), past what a float holds (``1e400``):
        # stored, it would read back as infinity, which JSON cannot write.
        return f"a number too large to store (beyond a 64-bit float): {exc}"
    return f"not valid JSON: {exc}"


def _unpaired(escape: re.Match[bytes]) -> str:
    return (
        f"unpaired UTF-16 surrogate escape {escape[0].decode('ascii')} at byte {escape.start()}: "
        "it names no character, so the text is not valid Unicode (UTF-8 cannot encode it)"
    )


def json_value_problem(value: Any) -> tuple[str, str] | None:
    """Where in ``value`` (``"[0]['k']"``, ``""`` for the value itself) a part JSON cannot
    hold as it is sits, and what it is; None when JSON holds all of it.

    What JSON cannot hold would be stored as msgpack allows and come back, be shown or be
    exported as something else, or not at all: NaN and infinities, bytes, a set, a non-string
    key, an object of another type. Tuples count as lists (they come back as lists).
    """
    pending: list[tuple[Any, str]] = [(value, "")]
    while pending:
        item, where = pending.pop()
        if item is None or isinstance(item, str | bool | int):
            continue
        if isinstance(item, float):
            if item - item == 0.0:  # finite (NaN and infinities give NaN)
                continue
            return where, f"{item!r} (JSON has no NaN or infinity)"
        if isinstance(item, list | tuple):
            pending += [(x, f"{where}[{i}]") for i, x in enumerate(item)]
            continue
        if isinstance(item, dict):
            for key, x in item.items():
                if not isinstance(key, str):
                    return where, (
                        f"keyed by {key!r}, of type {type(key).__name__} (JSON keys are strings)"
                    )
                pending.append((x, f"{where}[{key!r}]"))
            continue
        return where, f"of type {type(item).__name__}, not a JSON type (convert it first)"
    return None


def check_json_message(message: Message) -> None:
    """Refuse a message holding what JSON cannot hold as it is (`json_value_problem`) in its
    free-form fields (a tool call's input, a tool result's output, provider options, unknown
    fields): it is exported, shown and written to JSONL files as JSON, and a message built in
    Python (not read from JSON) can hold anything.

    Raises:
        MessageFormatError: naming the field and where in its value the culprit is.
    """
    fields: list[tuple[str, Any]] = [
        ("providerOptions", message.provider_options),
        ("extra", message.extra),
    ]
    if not isinstance(message.content, str):
        for i, part in enumerate(message.content):
            fields += [
                (f"content[{i}].providerOptions", part.provider_options),
                (f"content[{i}].extra", part.extra),
            ]
            if isinstance(part, ToolCallPart):
                fields.append((f"content[{i}].input", part.input))
            elif isinstance(part, ToolResultPart):
                fields.append((f"content[{i}].output", part.output))
            elif isinstance(part, OtherPart):
                fields.append((f"content[{i}]", part.data))
    for name, value in fields:
        if value is None:
            continue
        found = json_value_problem(value)
        if found is not None:
            where, problem = found
            raise MessageFormatError(
                f"the message's {name}{where} is {problem}: JSON cannot hold it, and a message "
                "is exported and shown as JSON"
            )


def _part_from_json(obj: Any) -> _Part:
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise MessageFormatError("every content part must be an object with a string 'type'")
    kind = obj["type"]
    cls = _PART_TYPES.get(kind)
    if cls is not None:
        names = _PART_FIELDS[kind]
        defaults = _PART_DEFAULTS[kind]
        known: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for k, v in obj.items():
            if k == "type" or (k in names and v is not defaults.get(k, _NO_DEFAULT)):
                known[k] = v
            else:
                extra[k] = v
        try:
            part = msgspec.convert(known, cls)
        except msgspec.ValidationError:
            pass  # fields of the wrong shape: keep the part verbatim instead
        else:
            return msgspec.structs.replace(part, extra=extra) if extra else part
    return OtherPart(kind=kind, data={k: v for k, v in obj.items() if k != "type"})


def _part_to_json(part: _Part) -> dict[str, Any]:
    if isinstance(part, OtherPart):
        return {"type": part.kind, **part.data}
    out: dict[str, Any] = msgspec.to_builtins(msgspec.structs.replace(part, extra=None))
    if part.extra:
        for k, v in part.extra.items():
            out.setdefault(k, v)  # a modelled field set in the struct wins
    return out


def _message_from_json(obj: Any) -> Message:
    if not isinstance(obj, dict):
        raise MessageFormatError(f"a message must be a JSON object, not {type(obj).__name__}")
    role = obj.get("role")
    if "role" not in obj:
        raise MessageFormatError(f"a message needs a role (one of {', '.join(ROLES)}); it has none")
    if role not in ROLES:
        raise MessageFormatError(f"message role must be one of {', '.join(ROLES)}, not {role!r}")
    content = obj.get("content")
    parts: str | list[Part]
    if isinstance(content, str):
        parts = content
    elif isinstance(content, list):
        parts = [_part_from_json(p) for p in content]  # type: ignore[misc]
    elif "content" not in obj:
        raise MessageFormatError(
            "a message needs content (a string or a list of parts); it has none"
        )
    else:
        raise MessageFormatError(
            f"message content must be a string or a list of parts, not {type(content).__name__}"
        )
    msg_id = obj.get("id")
    options = obj.get("providerOptions")
    # An explicit null id or providerOptions is kept among the unknown fields (role and content
    # are never null here), and so is a known field of an unexpected shape.
    extra = {k: v for k, v in obj.items() if k not in _MESSAGE_FIELDS or v is None}
    if msg_id is not None and not isinstance(msg_id, str):
        extra["id"], msg_id = msg_id, None
    if options is not None and not isinstance(options, dict):
        extra["providerOptions"], options = options, None
    return Message(
        role=role,
        content=parts,
        id=msg_id,
        provider_options=options,
        extra=extra or None,
    )


def _message_to_json(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role}
    if isinstance(message.content, str):
        out["content"] = message.content
    else:
        out["content"] = [_part_to_json(p) for p in message.content]
    if message.id is not None:
        out["id"] = message.id
    if message.provider_options is not None:
        out["providerOptions"] = message.provider_options
    if message.extra:
        for k, v in message.extra.items():
            out.setdefault(k, v)  # a modelled field set in the struct wins
    return out


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
