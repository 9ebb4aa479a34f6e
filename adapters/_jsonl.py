"""JSONL session files (one model message per line): import and export, byte-faithful.

Every message is exported exactly as it was imported: a line that re-encodes to the same bytes
is stored structurally, any other line also keeps its original text. Import validates the
whole file before writing anything; malformed lines are reported with their line numbers and
either refuse the import or, with ``skip_bad``, are skipped and reported one by one.
Importing the same file twice writes it once.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import anyio
import anyio.to_thread
import msgspec

from eventstore import InvalidInputError, Message, MessageFormatError

from ._access import Principal
from ._files import temp_beside
from ._sessions import SessionStore

# Messages per transcript event are capped by bytes, so that no event nears the store's limit.
EVENT_BUDGET_BYTES = 256 * 1024
EVENTS_PER_APPEND = 64
_ENVELOPE_MARGIN = 512


_encoder = msgspec.msgpack.Encoder()


class JsonlLineError(msgspec.Struct, frozen=True):
    """One line that is not a message: its 1-based number and why."""

    line: int
    reason: str


class JsonlImportError(InvalidInputError):
    """Raised when a JSONL file has malformed lines and ``skip_bad`` is off; nothing is written."""

    def __init__(self, path: str, errors: list[JsonlLineError]) -> None:
        self.path = path
        self.errors = errors
        shown = "; ".join(f"line {e.line}: {e.reason}" for e in errors[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        super().__init__(f"{path}: {len(errors)} malformed line(s): {shown}{more}")


class ImportReport(msgspec.Struct, frozen=True, kw_only=True):
    """What an import did."""

    session_id: str
    lines: int
    imported: int
    skipped: list[JsonlLineError]
    duplicate: bool
    version: int


def parse_jsonl(
    data: bytes, *, max_message_bytes: int
) -> tuple[list[Message], list[JsonlLineError]]:
    """Parse every line; returns the messages and the malformed lines (never raises for data)."""
    messages: list[Message] = []
    errors: list[JsonlLineError] = []
    # A UTF-8 byte order mark (some Windows editors write one) marks the encoding; it is not
    # part of the first message.
    lines = data.removeprefix(b"\xef\xbb\xbf").split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the newline that ends the last line does not open another
    for number, raw in enumerate(lines, start=1):
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if not raw.strip():
            errors.append(JsonlLineError(number, "empty line"))
            continue
        try:
            message = Message.from_json_bytes(raw)
        except MessageFormatError as exc:
            errors.append(JsonlLineError(number, str(exc)))
            continue
        try:
            stored = len(_encoder.encode(message))
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:
            errors.append(JsonlLineError(number, f"message cannot be stored: {exc}"))
            continue
        if stored > max_message_bytes:
            errors.append(
                JsonlLineError(
                    number, f"message stores as {stored} bytes, limit {max_message_bytes}"
                )
            )
            continue
        messages.append(message)
    return messages, errors


def _batches(messages: list[Message]) -> list[list[Message]]:
    out: list[list[Message]] = []
    current: list[Message] = []
    size = 0
    for m in messages:
        n = len(_encoder.encode(m))
        if current and size + n > EVENT_BUDGET_BYTES:
            out.append(current)
            current, size = [], 0
        current.append(m)
        size += n
    if current:
        out.append(current)
    return out


async def import_jsonl(
    sessions: SessionStore,
    path: str | os.PathLike[str],
    session_id: str,
    *,
    skip_bad: bool = False,
    principal: Principal | None = None,
) -> ImportReport:
    """Append the messages of a JSONL file to a session's transcript.

    Raises `JsonlImportError` (nothing written) when lines are malformed and ``skip_bad`` is
    off. Idempotent: the appends are keyed by the file's content hash.
    """
    try:
        data = await anyio.Path(path).read_bytes()
    except OSError as exc:
        raise InvalidInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    limit = getattr(sessions.store, "max_event_bytes", 1024 * 1024) - _ENVELOPE_MARGIN
    messages, errors = parse_jsonl(data, max_message_bytes=limit)
    if errors and not skip_bad:
        raise JsonlImportError(str(path), errors)
    digest = hashlib.sha256(data).hexdigest()[:32]
    events = _batches(messages)
    duplicate = True
    version = 0
    for start in range(0, len(events), EVENTS_PER_APPEND):
        chunk = events[start : start + EVENTS_PER_APPEND]
        key = f"jsonl:{digest}:{start // EVENTS_PER_APPEND}"
        result = await sessions.append_batches(
            session_id, chunk, idempotency_key=key, principal=principal
        )
        duplicate = duplicate and result.duplicate
        version = result.last_seq
    if not events:
        duplicate = False
        version = (await sessions.load(session_id, principal=principal)).version
    lines = len(messages) + len(errors)
    return ImportReport(
        session_id=session_id,
        lines=lines,
        imported=len(messages),
        skipped=errors,
        duplicate=duplicate,
        version=version,
    )


def _write_atomically(path: Path, chunks: list[bytes]) -> None:
    if path.is_dir():
        raise InvalidInputError(f"cannot write {path}: it is a directory; give a file name")
    try:
        fd, tmp = temp_beside(path)
    except OSError as exc:
        raise InvalidInputError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as out:
            out.writelines(chunks)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


async def export_jsonl(
    sessions: SessionStore,
    session_id: str,
    path: str | os.PathLike[str],
    *,
    principal: Principal | None = None,
) -> int:
    """Write the session's current transcript as JSONL (atomically); returns the line count."""
    transcript = await sessions.load(session_id, principal=principal)
    chunks = [m.to_json_bytes() + b"\n" for m in transcript.messages]
    await anyio.to_thread.run_sync(_write_atomically, Path(path), chunks)
    return len(transcript.messages)
