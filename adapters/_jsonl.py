"""JSONL session files (one model message per line): import and export, byte-faithful.

Every message is exported exactly as it was imported: a line that re-encodes to the same bytes
is stored structurally, any other line also keeps its original text. An export says what
`SessionStore.load` says, one message per line: a message changed since (a redaction) is written
as it now is, in canonical JSON, since its original text no longer says it. What is not a
message is not kept: line ends (LF or CRLF) are written as LF, with a final newline, a leading
UTF-8 byte order mark is dropped, and so are blank lines at the end of the file. Import
validates the whole file before writing anything; malformed lines (a blank line before the last
message is one) are reported with their line numbers and either refuse the import or, with
``skip_bad``, are skipped and reported one by one. A file with no message to import is refused,
so that an import never reports success for a session it did not write. Importing the same
messages twice writes them once, even from a copy that differs only in what import drops, and
importing a file grown since writes only the messages added (`_ImportLayout`). Export
refuses a session with no transcript: one never written, or a thread that holds other events (a
conversation's messages) but no transcript event.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import stat
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.to_thread
import msgspec

from eventstore import (
    ConcurrencyError,
    EventStore,
    InvalidInputError,
    Message,
    MessageFormatError,
    TranscriptAppended,
    TranscriptReplaced,
    validate_thread_id,
)
from eventstore._codec import MAX_NESTING, encoded_too_deep
from eventstore._contract import require_store

from ._access import Principal, authorize
from ._files import temp_beside
from ._sessions import SessionStore, Transcript, chunk_by_size, event_budget

# Messages per transcript event are capped by bytes, so that no event nears the store's limit:
# at most this many, and fewer when the store's limit leaves less (`event_budget`).
EVENT_BUDGET_BYTES = 256 * 1024
EVENTS_PER_APPEND = 64
# How many times an import may find that another writer moved the session on between its plan
# and an append before it gives up (`ConcurrencyError`; see `write_import`).
IMPORT_ATTEMPTS = 20
_ENVELOPE_MARGIN = 512


_encoder = msgspec.msgpack.Encoder()


class JsonlLineError(msgspec.Struct, frozen=True):
    """One line that is not a message, or a message too large to store: its 1-based number
    and why."""

    line: int
    reason: str
    too_large: bool = False
    """A well-formed message over the store's size limit (not a malformed line)."""


class JsonlImportError(InvalidInputError):
    """Raised when a JSONL file has malformed lines and ``skip_bad`` is off, or holds no
    message to import (empty, or every line malformed); nothing is written."""

    def __init__(self, path: str, errors: list[JsonlLineError], *, empty: bool = False) -> None:
        self.path = path
        self.errors = errors
        self.empty = empty
        # Too large is not malformed: the line is a good message the store cannot hold, and
        # calling it malformed sent people looking for a syntax error that is not there.
        groups = [
            (f"{len(found)} {what}", found)
            for what, found in (
                ("malformed line(s)", [e for e in errors if not e.too_large]),
                ("line(s) too large to store", [e for e in errors if e.too_large]),
            )
            if found
        ]
        said = "; ".join(f"{title}: {_shown(found)}" for title, found in groups)
        if not empty:
            text = f"{said}; nothing written"
        elif errors:
            text = f"no message to import: every line is malformed or too large ({said})"
        else:
            text = "no message to import (the file is empty or blank); nothing written"
        super().__init__(f"{path}: {text}")


def _shown(errors: list[JsonlLineError]) -> str:
    shown = "; ".join(f"line {e.line}: {e.reason}" for e in errors[:5])
    return shown + (f" (and {len(errors) - 5} more)" if len(errors) > 5 else "")


class NoTranscriptError(InvalidInputError):
    """Raised when a session to export has no transcript: nothing was ever written to it, or
    its thread holds other events (a conversation's messages) but no transcript event."""


class ImportProgress(msgspec.Struct, frozen=True, kw_only=True):
    """How far an import has written: ``appends`` of ``of_appends`` atomic appends, holding
    ``messages`` of the ``of_messages`` messages to import; the session is at ``version``."""

    appends: int
    of_appends: int
    messages: int
    of_messages: int
    version: int


class ImportReport(msgspec.Struct, frozen=True, kw_only=True):
    """What an import did: of the ``lines`` of the file, ``imported`` messages are in the
    session, ``written`` of them by this import and the others by an earlier import of the
    file (one stopped half way, or one of the file before it grew); ``duplicate`` when this
    import wrote none. ``version`` is the session's version when it ended."""

    session_id: str
    lines: int
    imported: int
    skipped: list[JsonlLineError]
    duplicate: bool
    version: int
    written: int = 0


# A message sits at level 3 of the event that stores it (`TranscriptAppended`: its list of
# messages, then the message), and the event may nest `MAX_NESTING` levels.
_MESSAGE_LEVEL = 3
_TOO_DEEP = (
    f"JSON nested too deeply to store (an event may nest {MAX_NESTING} levels of arrays and "
    "objects, the two that hold a transcript's message included)"
)


def parse_jsonl(
    data: bytes, *, max_message_bytes: int
) -> tuple[list[Message], list[JsonlLineError]]:
    """Parse every line; returns the messages and the malformed lines (never raises for data)."""
    messages: list[Message] = []
    errors: list[JsonlLineError] = []
    # A UTF-8 byte order mark (some Windows editors write one) marks the encoding; it is not
    # part of the first message.
    lines = data.removeprefix(b"\xef\xbb\xbf").split(b"\n")
    # The newline that ends the last line does not open another, and blank lines after the
    # last message (an editor's, or a hand-edited file's) are no line of the file either; a
    # blank line before a message stays a malformed line.
    while lines and not lines[-1].strip():
        lines.pop()
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
        except RecursionError:
            errors.append(JsonlLineError(number, _TOO_DEEP))
            continue
        try:
            encoded = _encoder.encode(message)
        except RecursionError:
            errors.append(JsonlLineError(number, _TOO_DEEP))
            continue
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:
            errors.append(JsonlLineError(number, f"message cannot be stored: {exc}"))
            continue
        if encoded_too_deep(message, encoded, level=_MESSAGE_LEVEL):
            # Parsed (a newer Python's decoder recurses further), yet past what the log
            # stores: the same line is malformed on every Python.
            errors.append(JsonlLineError(number, _TOO_DEEP))
            continue
        stored = len(encoded)
        if stored > max_message_bytes:
            errors.append(_too_large(number, message, stored, max_message_bytes))
            continue
        messages.append(message)
    return messages, errors


def _too_large(number: int, message: Message, stored: int, limit: int) -> JsonlLineError:
    reason = f"the message stores as {stored:,} bytes, over the limit of {limit:,} bytes"
    if message.source is not None:
        # A line that does not re-encode byte for byte (spaces, key order, escapes) keeps its
        # original text beside the parsed message, for a byte-faithful export: about twice
        # the size. Saying what compact JSON would store tells whether that is the cause.
        compact = len(_encoder.encode(msgspec.structs.replace(message, source=None)))
        reason += (
            f" (it is not compact JSON, so its text is stored as written beside the parsed "
            f"message; written compactly it would store as about {compact:,} bytes)"
        )
    return JsonlLineError(number, reason, too_large=True)


def _sessions_of(sessions: object, caller: str) -> SessionStore:
    """A `SessionStore` for ``sessions``: itself, or one over an `EventStore` passed as it
    is (as `connect` returned it); anything else is `InvalidInputError`."""
    if isinstance(sessions, SessionStore):
        return sessions
    try:
        return SessionStore(require_store(sessions, caller))
    except InvalidInputError:
        raise InvalidInputError(
            f"{caller} needs a SessionStore or an EventStore, not {type(sessions).__name__}"
        ) from None


async def import_jsonl(
    sessions: SessionStore | EventStore,
    path: str | os.PathLike[str],
    session_id: str,
    *,
    skip_bad: bool = False,
    principal: Principal | None = None,
    progress: Callable[[ImportProgress], None] | None = None,
) -> ImportReport:
    """Append the messages of a JSONL file to a session's transcript.

    Raises `JsonlImportError` (nothing written) when lines are malformed or too large to store
    and ``skip_bad`` is off. Idempotent: each append is keyed by a hash of the file's messages
    up to its last, so an import stopped half way and run again writes only the rest, and so
    does an import of the file once it has grown (lines added at its end); an older, shorter
    copy imported after it writes nothing. Imports of one session at once write each line once
    (see `write_import`); one that finds other writers moving the session on between its plan
    and its append `IMPORT_ATTEMPTS` times raises `ConcurrencyError` (what it wrote stays).

    A large file is written in several appends (each atomic). ``progress`` is called
    before each one and once after the last, with what is written so far; an exception it
    raises stops the import there and propagates (what was written stays written).
    ``sessions`` is a `SessionStore` (its access policy applies) or an `EventStore`.
    """
    sessions = _sessions_of(sessions, "import_jsonl")
    messages, errors = await read_import(sessions, path, skip_bad=skip_bad)
    return await write_import(
        sessions, messages, errors, session_id, principal=principal, progress=progress
    )


async def read_import(
    sessions: SessionStore, path: str | os.PathLike[str], *, skip_bad: bool = False
) -> tuple[list[Message], list[JsonlLineError]]:
    """The first half of `import_jsonl`: the file read (once) and validated, nothing written;
    its messages and the lines skipped. Raises what `import_jsonl` raises before writing."""
    try:
        data = await anyio.Path(path).read_bytes()
    except OSError as exc:
        raise InvalidInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    limit = sessions.store.max_event_bytes - _ENVELOPE_MARGIN
    messages, errors = parse_jsonl(data, max_message_bytes=limit)
    if errors and not skip_bad:
        raise JsonlImportError(str(path), errors)
    if not messages:
        raise JsonlImportError(str(path), errors, empty=True)
    return messages, errors


async def write_import(
    sessions: SessionStore,
    messages: list[Message],
    errors: list[JsonlLineError],
    session_id: str,
    *,
    principal: Principal | None = None,
    progress: Callable[[ImportProgress], None] | None = None,
) -> ImportReport:
    """The second half of `import_jsonl`: append what `read_import` returned (at least one
    message), but for the messages an earlier import of these same first messages wrote."""
    layout = _ImportLayout(messages, min(EVENT_BUDGET_BYTES, event_budget(sessions.store)))
    # Asked before the ledger is read: a principal who may not write learns nothing of what
    # the session holds (append_batches asks again for each append).
    validate_thread_id(session_id)
    await authorize(sessions.policy, principal, "write", sessions.store.namespace, session_id)
    store = sessions.store
    new = 0  # messages written by this run
    conflicts = 0
    while True:
        # Each append expects the version the plan was made at (read before the ledger, so a
        # write landing between the two reads fails the first append rather than being
        # missed): another import of this session, of a shorter or longer copy of the file,
        # may be writing the same messages under other keys, and an append made after it
        # without this check would write them again. On a conflict, or an append another
        # import made first (a duplicate: it then counts among those found, so this ends),
        # the ledger is read again and the rest planned anew.
        version = await store.version(session_id)
        done = await layout.imported_before(store, session_id)
        plan = layout.appends_after(done)
        replan = False
        for i, (end, batches) in enumerate(plan):
            if progress is not None:
                progress(
                    ImportProgress(
                        appends=i,
                        of_appends=len(plan),
                        messages=done,
                        of_messages=len(messages),
                        version=version,
                    )
                )
            try:
                result = await sessions.append_batches(
                    session_id,
                    batches,
                    idempotency_key=layout.key(end),
                    expected_version=version,
                    principal=principal,
                )
            except ConcurrencyError:
                conflicts += 1
                if conflicts == IMPORT_ATTEMPTS:
                    raise
                replan = True
                break
            if result.duplicate:
                replan = True
                break
            version = result.last_seq
            new += end - done
            done = end
        if not replan:
            break
    if progress is not None:
        progress(
            ImportProgress(
                appends=len(plan),
                of_appends=len(plan),
                messages=done,
                of_messages=len(messages),
                version=version,
            )
        )
    lines = len(messages) + len(errors)
    return ImportReport(
        session_id=session_id,
        lines=lines,
        imported=len(messages),
        skipped=errors,
        duplicate=not new,
        version=version,
        written=new,
    )


class _ImportLayout:
    """How a file's messages are written: in events of at most ``budget`` bytes of messages,
    `EVENTS_PER_APPEND` events an append, laid out from the file's first message, each append
    keyed by a digest of the file's messages up to its last (`key`).

    So an import run again, of the same file or of the file grown since (the append-only
    session files runtimes keep), finds how many of its first messages were written
    (`imported_before`) and writes only the rest (`appends_after`): the appends end where the
    layout from the first message ends them, wherever a run starts, so the keys a later run
    looks for are the ones earlier runs wrote. The key names the messages, not the file's
    bytes: a copy that differs only in what an import drops (CRLF line ends, a byte order
    mark, trailing blank lines, skipped lines) is the same import.
    """

    def __init__(self, messages: list[Message], budget: int) -> None:
        self.messages = messages
        self.events = chunk_by_size(messages, budget)
        self.event_ends = list(itertools.accumulate(map(len, self.events)))
        # Where the appends end when the file is written from its first message.
        self.ends = self.event_ends[EVENTS_PER_APPEND - 1 :: EVENTS_PER_APPEND]
        if not self.ends or self.ends[-1] != len(messages):
            self.ends.append(len(messages))
        # The digest of the first i messages, for every i (one pass).
        h = hashlib.sha256()
        self._prefix = [""]
        for m in messages:
            h.update(m.to_json_bytes() + b"\n")
            self._prefix.append(h.copy().hexdigest()[:32])
        # Before the prefix keys, an append was keyed by the whole file's digest and its
        # index in this same layout: an import written that way is found by those keys.
        self._whole = self._prefix[-1]

    def key(self, end: int) -> str:
        """The idempotency key of an append that ends after message ``end`` (1-based)."""
        return f"jsonl:{end}:{self._prefix[end]}"

    def _whole_file_key(self, index: int) -> str:
        return f"jsonl:{self._whole}:{index}"

    async def imported_before(self, store: EventStore, session_id: str) -> int:
        """How many of the first messages earlier imports wrote into the session (0: none).

        The most that an append keyed for them says; then, when the session's log goes on
        after that append with the file's next messages, those too: an import of a longer
        copy of the file (the file grown since) wrote them, in an append that ends past this
        file's end under a key this file cannot name.
        """
        keys = [self.key(end) for end in self.ends]
        legacy = [self._whole_file_key(i) for i in range(len(self.ends))]
        found = await store.recorded_appends(session_id, [*keys, *legacy])
        done, last_seq = 0, 0
        for end, key, old in zip(self.ends, keys, legacy, strict=True):
            result = found.get(key) or found.get(old)
            if result is not None:
                done, last_seq = end, result.last_seq
        # An earlier import of fewer messages (the file before it grew) ended its last append
        # where its own messages ended, between two of these ends: after the last one found.
        after = [end for end in self.ends if end > done]
        if after:
            between = {self.key(e): e for e in range(done + 1, after[0])}
            recorded = await store.recorded_appends(session_id, list(between))
            for key, result in recorded.items():
                if between[key] > done:
                    done, last_seq = between[key], result.last_seq
        if done and done < len(self.messages):
            done += await self._written_after(store, session_id, last_seq, done)
        return done

    async def _written_after(self, store: EventStore, session_id: str, seq: int, done: int) -> int:
        """How many of the messages after the first ``done`` the transcript events right
        after ``seq`` (the end of an import's append of the first ``done``) hold, in order."""
        rest = self.messages[done:]
        matched = 0
        # Each event holds at least one message: no more events than messages can match.
        async for event in store.read(session_id, start=seq + 1, stop=seq + len(rest)):
            payload = event.payload
            if not isinstance(payload, TranscriptAppended):
                break
            for message in payload.messages:
                if message.to_json_bytes() != rest[matched].to_json_bytes():
                    return matched
                matched += 1
                if matched == len(rest):
                    return matched
        return matched

    def appends_after(self, done: int) -> list[tuple[int, list[list[Message]]]]:
        """The appends that write the messages after the first ``done``: each its end and its
        events, the first cut to start after ``done``."""
        plan: list[tuple[int, list[list[Message]]]] = []
        event = 0
        for end in self.ends:
            batches: list[list[Message]] = []
            while event < len(self.events) and self.event_ends[event] <= end:
                first = self.event_ends[event] - len(self.events[event])
                if self.event_ends[event] > done:
                    batches.append(self.events[event][max(done - first, 0) :])
                event += 1
            if end > done:
                plan.append((end, batches))
        return plan


def _write_atomically(path: Path, chunks: list[bytes]) -> None:
    if path.is_dir():
        raise InvalidInputError(f"cannot write {path}: it is a directory; give a file name")
    try:
        existing = path.lstat()
    except FileNotFoundError:
        existing = None
    except OSError as exc:
        raise InvalidInputError(f"cannot write {path}: {exc.strerror or exc}") from None
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        # The file is written beside and renamed into place (atomic): that would replace a
        # symlink, a FIFO or a device node with a regular file, not write through it.
        raise InvalidInputError(
            f"cannot write {path}: it is not a regular file (a symlink, FIFO or device); "
            "give a file name, or '-' for standard output"
        )
    try:
        fd, tmp = temp_beside(path)
    except OSError as exc:
        raise InvalidInputError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        if existing is not None:  # a file written again keeps its permissions (0600 stays)
            os.fchmod(fd, stat.S_IMODE(existing.st_mode))
        with os.fdopen(fd, "wb") as out:
            out.writelines(chunks)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


async def export_jsonl(
    sessions: SessionStore | EventStore,
    session_id: str,
    path: str | os.PathLike[str],
    *,
    principal: Principal | None = None,
) -> int:
    """Write the session's current transcript as JSONL (atomically); returns the line count.

    Raises `NoTranscriptError` (nothing written) for a session with no transcript.
    ``sessions`` is a `SessionStore` (its access policy applies) or an `EventStore`.
    """
    sessions = _sessions_of(sessions, "export_jsonl")
    transcript = await transcript_to_export(sessions, session_id, principal=principal)
    chunks = [m.to_json_bytes() + b"\n" for m in transcript.messages]
    await anyio.to_thread.run_sync(_write_atomically, Path(path), chunks)
    return len(transcript.messages)


async def transcript_to_export(
    sessions: SessionStore, session_id: str, *, principal: Principal | None = None
) -> Transcript:
    """The session's transcript, for export; raises `NoTranscriptError` when it has none.

    A transcript compacted to nothing (a replace with no message) is a transcript: it
    exports as an empty file.
    """
    transcript = await sessions.load(session_id, principal=principal)
    if transcript.messages:
        return transcript
    store = sessions.store
    where = f"in namespace {store.namespace!r}"
    if transcript.version == 0 and not await store.read_raw(session_id, count=1):
        raise NoTranscriptError(
            f"no session {session_id!r} {where}: nothing was ever written to it"
        )
    # Only an empty transcript gets here: one scan of its thread, stopping at the first
    # transcript event.
    events = 0
    async for event in store.read(session_id):
        if isinstance(event.payload, TranscriptAppended | TranscriptReplaced):
            return transcript
        events += 1
    raise NoTranscriptError(
        f"thread {session_id!r} {where} has no session transcript: its {events} event(s) "
        f"hold no transcript event (a conversation's messages are not a transcript; "
        f"'threadlog show {session_id}' shows them)"
    )
