"""`SessionStore`: the model-message transcript of a session, with compaction as an event.

``append`` adds messages; ``replace`` swaps the transcript after compaction, and the log keeps
the earlier messages for audit. `session_update` decides which of the two a runtime's new
transcript needs. A writer whose view of the transcript is stale gets a `ConcurrencyError`,
never a silent overwrite: "a writer" is a task (each request's task of a server sharing one
`SessionStore` is a writer of its own), and a `Transcript` handed to `session_update` carries
the version it was loaded at, and the life of the session it was loaded from (a session
deleted and written again restarts its versions at 1: only the life tells it from the one
loaded).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any, Literal, TypeVar

import msgspec

from eventstore import (
    ANY,
    AppendResult,
    ConcurrencyError,
    EventStore,
    EventTooLargeError,
    ExpectedVersion,
    IncarnationConflictError,
    InvalidInputError,
    Message,
    NewEvent,
    TranscriptAppended,
    TranscriptReplaced,
    validate_thread_id,
    version_satisfies,
)
from eventstore._contract import require_store
from projections import Projector, TranscriptMessage

from ._access import AccessPolicy, Principal, authorize, check_policy
from ._threads import as_messages


class Transcript(msgspec.Struct, frozen=True, kw_only=True):
    """A session's transcript as loaded, with the version to pass back when writing, and the
    session's life (`EventStore.incarnation`; None for a session that does not exist yet),
    read in the same step as the messages."""

    session_id: str
    messages: list[Message]
    version: int
    incarnation: int | None = None


class SessionUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """What to write after a turn: ``append`` the new tail, or ``replace`` the transcript.

    ``expected_version``, ``expected_incarnation`` and ``session_id`` are those of the
    `Transcript` it was computed from (None when it was computed from bare messages):
    `SessionStore.save` writes only to that session, and only if it is still at that version
    in that life (not deleted, and not deleted and written again to the same version).
    """

    mode: Literal["append", "replace"]
    messages: list[Message]
    expected_version: int | None = None
    session_id: str | None = None
    expected_incarnation: int | None = None


def session_update(
    before: Transcript | Sequence[Message | Mapping[str, Any]],
    result: Sequence[Message | Mapping[str, Any]],
) -> SessionUpdate:
    """Append when ``result`` extends ``before`` (only the new tail), replace otherwise.

    Given the `Transcript` that `SessionStore.load` returned as ``before``, the update carries
    its version and life, and saving it fails with `ConcurrencyError` if the session changed
    since (`IncarnationConflictError` if it was deleted, or deleted and written again).
    """
    loaded = before if isinstance(before, Transcript) else None
    version = loaded.version if loaded is not None else None
    session = loaded.session_id if loaded is not None else None
    life = loaded.incarnation if loaded is not None else None
    old = as_messages(loaded.messages if loaded is not None else before, "before")
    new = as_messages(result, "result")
    if len(new) >= len(old) and all(_same(a, b) for a, b in zip(old, new, strict=False)):
        return SessionUpdate(
            mode="append",
            messages=new[len(old) :],
            expected_version=version,
            session_id=session,
            expected_incarnation=life,
        )
    return SessionUpdate(
        mode="replace",
        messages=new,
        expected_version=version,
        session_id=session,
        expected_incarnation=life,
    )


_EVENT_SLACK = 4096  # what an event adds to its messages: type tag, reason, array headers
_size_encoder = msgspec.msgpack.Encoder()

T = TypeVar("T")


def chunk_by_size(values: Sequence[T], budget: int) -> list[list[T]]:
    """``values`` in order, in runs of at most ``budget`` encoded bytes each (a value larger
    than the budget alone in its run): the events of one atomic append that says what an
    event over the size limit would have said."""
    chunks: list[list[T]] = [[]]
    size = 0
    for value in values:
        n = len(_size_encoder.encode(value))
        if chunks[-1] and size + n > budget:
            chunks.append([])
            size = 0
        chunks[-1].append(value)
        size += n
    return chunks


def event_budget(store: EventStore) -> int:
    """How many bytes of values one event of ``store`` can carry (`chunk_by_size`)."""
    return store.max_event_bytes - _EVENT_SLACK


def _split(event: TranscriptAppended | TranscriptReplaced, budget: int) -> list[NewEvent]:
    """The same change as events of at most ``budget`` bytes of messages each: the messages
    in order, a replace first (then appends), so the fold gives the same transcript."""
    chunks = chunk_by_size(event.messages, budget)
    first: TranscriptAppended | TranscriptReplaced = (
        TranscriptReplaced(messages=chunks[0], reason=event.reason)
        if isinstance(event, TranscriptReplaced)
        else TranscriptAppended(messages=chunks[0])
    )
    rest = [TranscriptAppended(messages=chunk) for chunk in chunks[1:]]
    return [NewEvent(payload=first), *(NewEvent(payload=e) for e in rest)]


def _same(a: Message, b: Message) -> bool:
    """Equal as messages: the same JSON values, ``source`` aside (the original text of an
    imported line, kept for a byte-faithful export, is how a message was written, not what
    it says).

    Python's ``==`` alone says ``1 == True == 1.0`` and ``0.0 == -0.0``: a message whose value
    changed only so read as unchanged, the update appended after it, and the stored transcript
    kept the old value for good. Equal by ``==`` is confirmed on the encoded bytes, and where
    those differ (keys in another order) value by value, telling the JSON types apart."""
    if a is b:
        return True
    ca, cb = _content(a), _content(b)
    if ca != cb:
        return False
    if _encode(ca) == _encode(cb):
        return True
    return _same_json(msgspec.to_builtins(ca), msgspec.to_builtins(cb))


def _same_json(x: Any, y: Any) -> bool:
    """``x`` and ``y`` (decoded JSON: dicts, lists, str, int, float, bool, None) are the same
    JSON value: of the same types throughout, key order aside, and -0.0 is not 0.0."""
    if type(x) is not type(y):
        return False
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same_json(v, y[k]) for k, v in x.items())
    if isinstance(x, list):
        return len(x) == len(y) and all(_same_json(u, v) for u, v in zip(x, y, strict=True))
    if isinstance(x, float):
        return x == y and math.copysign(1.0, x) == math.copysign(1.0, y)
    return bool(x == y)


_encode = msgspec.msgpack.Encoder().encode


def _content(m: Message) -> Message:
    return msgspec.structs.replace(m, source=None) if m.source is not None else m


REMEMBER_BUCKETS = 16
REMEMBER_PER_BUCKET = 64
"""A task remembers about ``REMEMBER_BUCKETS * REMEMBER_PER_BUCKET`` (1,024) sessions: those it
loaded or wrote last, up to 64 among the sessions that share a bucket (by hash)."""

_Seen = tuple[int, int | None]  # (version, life)


class _Remembered:
    """What one task remembers of the sessions it served: session id -> (version, life).

    Persistent: `with_` returns a new map and never changes this one, so a task started
    earlier keeps the map its context inherited. It shares all buckets but the one it changes:
    a write copies at most 64 entries and 16 bucket references, where copying one whole dict
    made a worker task that serves session after session pay for every session it had served
    on each write (4.5 ms an append after 20,000 sessions, on the memory backend).

    Bounded: a bucket forgets its least recently remembered session past 64. A write to a
    forgotten session is checked as one before any load: not at all (the task has touched
    1,000-odd other sessions since, and would have to load it again to know its messages).
    """

    __slots__ = ("_buckets",)

    def __init__(self, buckets: tuple[dict[str, _Seen], ...]) -> None:
        self._buckets = buckets  # never changed once built: other maps share them

    def get(self, session_id: str) -> _Seen | None:
        return self._buckets[hash(session_id) % REMEMBER_BUCKETS].get(session_id)

    def with_(self, session_id: str, version: int | None, life: int | None) -> _Remembered:
        """This map with the session remembered at ``version`` and ``life`` (with ``version``
        None: forgotten)."""
        i = hash(session_id) % REMEMBER_BUCKETS
        bucket = dict(self._buckets[i])
        bucket.pop(session_id, None)  # re-inserted last: the bucket's order is its recency
        if version is not None:
            bucket[session_id] = (version, life)
            if len(bucket) > REMEMBER_PER_BUCKET:
                del bucket[next(iter(bucket))]
        buckets = self._buckets
        return _Remembered((*buckets[:i], bucket, *buckets[i + 1 :]))

    def __len__(self) -> int:
        return sum(map(len, self._buckets))


_NOTHING_REMEMBERED = _Remembered(({},) * REMEMBER_BUCKETS)


class SessionStore:
    """Load, append and replace session transcripts (one thread per session).

    The store remembers, per task, the version (and life) of each session the task last loaded
    or wrote, and uses it as the expected version of the task's next write: a writer that did
    not see another writer's change gets `ConcurrencyError`, also when concurrent requests
    share one `SessionStore`, and also when the session was deleted (an idle sweep, `delete`)
    and written again to the same version since (`IncarnationConflictError`, one). A task
    started after a load inherits what its parent remembered then (its own writes are not
    seen by the parent, whose next write then conflicts: the safe side). A write before any
    load is not checked, nor one to a session the task has forgotten: it remembers about 1,024
    sessions, those it loaded or wrote last (a worker task serving session after session
    keeps a bounded memory, and a write costs the same after a million sessions). Pass
    ``expected_version`` to choose explicitly
    (``ANY`` disables the check), or save a `session_update` of the loaded `Transcript`.
    Write a session's thread only through a `SessionStore`: any other append to it also
    counts as a change. An explicit ``expected_version`` is checked as given (the life is
    checked only with the version it was read with: the remembered one, or an update's).
    """

    def __init__(self, store: EventStore, *, policy: AccessPolicy | None = None) -> None:
        self.store = require_store(store, "SessionStore")
        self.projector = Projector(store)
        self.policy = check_policy(policy)
        # What this task last loaded or wrote of each session (`_Remembered`: a task started
        # earlier keeps the map it inherited, as its context holds it).
        self._versions: ContextVar[_Remembered] = ContextVar(
            f"threadlog.SessionStore.versions.{id(self)}", default=_NOTHING_REMEMBERED
        )

    def _seen(self, session_id: str) -> tuple[int, int | None] | None:
        """The version and life this task last loaded or wrote of the session (None: none)."""
        return self._versions.get().get(session_id)

    def _remember(
        self, session_id: str, version: int | None, incarnation: int | None = None
    ) -> None:
        """Record (or, with version None, forget) this task's version and life of the session."""
        self._versions.set(self._versions.get().with_(session_id, version, incarnation))

    async def _allow(
        self, principal: Principal | None, action: Literal["read", "write"], session_id: str
    ) -> None:
        validate_thread_id(session_id)
        await authorize(self.policy, principal, action, self.store.namespace, session_id)

    async def load(self, session_id: str, *, principal: Principal | None = None) -> Transcript:
        """The session's current transcript (empty for a new session)."""
        await self._allow(principal, "read", session_id)
        tp = self.projector.transcript_projection
        # The snapshot carries the life with the version, read in the same step.
        snap = await self.store.read_views(session_id, tp.full_reads())
        messages = tp.messages(snap.results[0])
        self._remember(session_id, snap.version, snap.incarnation)
        return Transcript(
            session_id=session_id,
            messages=messages,
            version=snap.version,
            incarnation=snap.incarnation,
        )

    async def history(
        self, session_id: str, *, principal: Principal | None = None
    ) -> list[TranscriptMessage]:
        """The transcript with the seq of the event that wrote each message."""
        await self._allow(principal, "read", session_id)
        return await self.projector.transcript(session_id)

    async def append(
        self,
        session_id: str,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        expected_version: ExpectedVersion | None = None,
        idempotency_key: str | None = None,
        principal: Principal | None = None,
    ) -> int:
        """Add ``messages`` to the end of the transcript; returns the new version."""
        event = TranscriptAppended(messages=as_messages(messages))
        return await self._write(
            session_id, event, expected_version, idempotency_key, principal, None
        )

    async def replace(
        self,
        session_id: str,
        messages: Sequence[Message | Mapping[str, Any]],
        *,
        reason: str = "compaction",
        expected_version: ExpectedVersion | None = None,
        idempotency_key: str | None = None,
        principal: Principal | None = None,
    ) -> int:
        """Swap the transcript for ``messages`` (the log keeps the old one); new version."""
        event = TranscriptReplaced(messages=as_messages(messages), reason=reason)
        return await self._write(
            session_id, event, expected_version, idempotency_key, principal, None
        )

    async def save(
        self,
        session_id: str,
        update: SessionUpdate,
        *,
        expected_version: ExpectedVersion | None = None,
        idempotency_key: str | None = None,
        principal: Principal | None = None,
    ) -> int:
        """Apply a `SessionUpdate` (see `session_update`); returns the new version.

        The expected version is ``expected_version`` if given, else the update's own (that of
        the `Transcript` it was computed from, checked in its life too), else this task's
        remembered one (and life). Anything
        but a `SessionUpdate` (the messages themselves, the loaded `Transcript`) is refused
        with `InvalidInputError`: `append` and `replace` take messages.

        With ``idempotency_key`` a save whose outcome is unknown (a timeout) can be sent again:
        if the first landed, the retry returns its version and writes nothing (the key is
        checked before the expected version, so the writer's own write is no conflict).
        """
        if not isinstance(update, SessionUpdate):
            raise InvalidInputError(
                "update must be a SessionUpdate (session_update(before, result)), not "
                f"{type(update).__name__}: to write messages as they are, use append or replace"
            )
        if update.session_id is not None and update.session_id != session_id:
            # Its tail and its version are another session's: appended here, the tail would
            # land after messages it was never compared with (whenever the versions agree).
            raise InvalidInputError(
                f"this update was computed from session {update.session_id!r}'s transcript, "
                f"not {session_id!r}'s; nothing was written"
            )
        life = None  # the life of the version expected, when it comes from the update
        if expected_version is None:
            expected_version = update.expected_version
            life = update.expected_incarnation
        if update.mode == "append":
            if not update.messages:
                # Nothing to write; the version is still the transcript's, whether or not this
                # store has loaded it. An explicit expected version is still checked: a caller
                # who asked for one must hear that it is stale.
                await self._allow(principal, "write", session_id)
                if expected_version is None:
                    seen = self._seen(session_id)
                    return seen[0] if seen is not None else await self.store.version(session_id)
                current = await self.store.version(session_id)
                if life is not None:
                    now = await self.store.incarnation(session_id)
                    if now != life:
                        raise IncarnationConflictError(
                            session_id, expected_version, current, life, now
                        )
                if not version_satisfies(expected_version, current):
                    raise ConcurrencyError(session_id, expected_version, current)
                return current
            event: TranscriptAppended | TranscriptReplaced = TranscriptAppended(
                messages=as_messages(update.messages)
            )
        else:
            event = TranscriptReplaced(messages=as_messages(update.messages), reason="compaction")
        return await self._write(
            session_id, event, expected_version, idempotency_key, principal, life
        )

    async def _write(
        self,
        session_id: str,
        event: TranscriptAppended | TranscriptReplaced,
        expected_version: ExpectedVersion | None,
        idempotency_key: str | None,
        principal: Principal | None,
        life: int | None,
    ) -> int:
        """Write ``event`` at ``expected_version`` (in the life ``life``, when given), or at
        the version and life this task remembers, or unchecked."""
        await self._allow(principal, "write", session_id)
        if isinstance(event, TranscriptAppended) and not event.messages:
            raise InvalidInputError("append needs at least one message")
        expected: ExpectedVersion
        if expected_version is not None:
            expected = expected_version
        else:
            seen = self._seen(session_id)
            # The remembered version is checked in the life it was read in: a session swept
            # (or deleted) and written again since restarts at 1 and could be at it again.
            expected, life = seen if seen is not None else (ANY, None)
        try:
            result = await self.projector.append(
                session_id,
                [NewEvent(payload=event)],
                expected_version=expected,
                idempotency_key=idempotency_key,
                expected_incarnation=life,
            )
        except EventTooLargeError:
            # Nothing was written (sizes are checked before anything is sent). A transcript
            # bigger than one event goes as several in one atomic append instead; only a
            # single message over the limit is still refused.
            events = _split(event, event_budget(self.store))
            if len(events) == 1:
                raise
            result = await self.projector.append(
                session_id,
                events,
                expected_version=expected,
                idempotency_key=idempotency_key,
                expected_incarnation=life,
            )
        # A retry answered from the ledger gives the original append's version: what this
        # writer last saw. Other writes since then make its next write conflict (the safe
        # side); forgetting it instead would let that write through unchecked. The life is
        # the one the append landed in (for a retry, the one the thread is in now).
        self._remember(session_id, result.last_seq, result.incarnation)
        return result.last_seq

    async def append_batches(
        self,
        session_id: str,
        batches: Sequence[Sequence[Message]],
        *,
        idempotency_key: str,
        expected_version: ExpectedVersion = ANY,
        principal: Principal | None = None,
    ) -> AppendResult:
        """Append several transcript events in one atomic append (bulk imports).

        Not checked for staleness against this task's `load`: only ``expected_version`` (the
        session thread's version, as for `EventStore.append`; any by default) is.
        """
        await self._allow(principal, "write", session_id)
        events = [NewEvent(payload=TranscriptAppended(messages=list(b))) for b in batches if b]
        result = await self.projector.append(
            session_id,
            events,
            expected_version=expected_version,
            idempotency_key=idempotency_key,
        )
        self._remember(session_id, None)
        return result

    async def delete(self, session_id: str, *, principal: Principal | None = None) -> int:
        """Delete a session's thread (events and views); returns its last version."""
        await self._allow(principal, "write", session_id)
        self._remember(session_id, None)
        return await self.projector.delete_thread(session_id)

    def forget(self, session_id: str) -> None:
        """Drop this task's remembered version (its next write will not check staleness)."""
        self._remember(session_id, None)
