"""`ThreadlogSession`: the OpenAI Agents SDK's session protocol on a threadlog thread.

Install with ``pip install threadlog[openai-agents]``; the core never imports this module.

Each session is one thread (``agents:<session id>``). Every change is an event: ``add_items``
appends `ItemsAdded` (the items exactly as the SDK gave them), ``pop_item`` appends `ItemPopped`
and ``clear_session`` appends `SessionCleared`. The list view ``agents.items`` holds the current
items; the log keeps every popped and cleared item for audit.

* ``add_items`` is one atomic append, so items added concurrently by several processes are
  never lost, split or reordered.
* ``pop_item`` reads the tail and appends the pop expecting that exact thread version, so it
  always removes the item it returns. Pops in one process take turns; a pop that finds another
  process's write in between reads the new tail and tries again after a jittered backoff, for
  up to `POP_TIMEOUT` seconds. Concurrent pops each pop a distinct item.
* ``add_items`` retries a lost reply itself without adding twice; a caller that calls it again
  after it raised may add the items twice (see `ThreadlogSession.add_items`).
* A cancelled ``add_items`` or ``clear_session`` runs to its end, then raises the cancellation,
  as the SDK's own sessions do. A ``pop_item`` cancelled before its write pops nothing; once
  its write is sent (Redis runs it whenever it gets to it), it waits for it, as the SDK's
  ``SQLiteSession`` finishes a pop, and then raises the cancellation.
* ``ttl`` is a retention period: a session idle (no write) for longer is deleted when it is next
  touched, and `sweep_idle_sessions` deletes the idle sessions nobody touches. Nothing uses
  Redis ``EXPIRE``, so events never vanish from under the thread index and the change feed.
  The delete is made only if the session is still at the version the idle check read: a write
  landing between the two keeps the session.

Usage::

    session = ThreadlogSession("user-123", store)
    await Runner.run(agent, "Hello", session=session)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import random
import time
import weakref
from collections.abc import Coroutine, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import anyio
import anyio.lowlevel
import msgspec
from agents.items import TResponseInputItem

from eventstore import (
    ANY,
    EXISTS,
    AppendResult,
    ConcurrencyError,
    Event,
    EventStore,
    EventTooLargeError,
    EventValidationError,
    ExpectedVersion,
    InvalidInputError,
    InvalidThreadIdError,
    ListLoad,
    ListPop,
    ListPush,
    ListRange,
    NewEvent,
    OperationalError,
    RecordedEvent,
    StoreConnectionError,
    StoreTimeoutError,
    ViewClear,
    ViewEntry,
    ViewOp,
    ViewRead,
)
from eventstore._contract import require_store
from eventstore._errors import DECODE_ERRORS
from eventstore._ids import prefixed_thread_id, validate_int
from projections import Projection, Projector

from ._access import AccessPolicy, Action, Principal, authorize, check_policy
from ._framework_events import (
    ItemPopped,
    ItemsAdded,
    SessionCleared,
    register_session_events,
)
from ._sessions import chunk_by_size, event_budget

if TYPE_CHECKING:  # only recent openai-agents releases have it; only type checking needs it
    from agents.memory.session_settings import SessionSettings

__all__ = [
    "DEFAULT_THREAD_PREFIX",
    "ITEMS_VIEW",
    "ItemPopped",
    "ItemsAdded",
    "SessionCleared",
    "SessionItemsProjection",
    "ThreadlogSession",
    "register_session_events",
    "session_thread_id",
    "sweep_idle_sessions",
]

ITEMS_VIEW = "agents.items"
DEFAULT_THREAD_PREFIX = "agents:"
# How long a pop keeps retrying while other processes' writes change the tail under it, and
# the bounds of the jittered pause between tries.
POP_TIMEOUT = 30.0
POP_BACKOFF_MIN = 0.001
POP_BACKOFF_MAX = 0.05
TRANSIENT_ATTEMPTS = 3

_encoder = msgspec.msgpack.Encoder()


# -- events -----------------------------------------------------------------------------------


# -- projection -------------------------------------------------------------------------------


def encode_item(item: object) -> bytes:
    """The stored bytes of one item (msgpack; JSON-like values round-trip exactly)."""
    return _encoder.encode(item)


def item_digest(stored: bytes) -> str:
    """The digest an `ItemPopped` records for an item's stored bytes."""
    return hashlib.blake2b(stored, digest_size=16).hexdigest()


class SessionItemsProjection(Projection[list[ViewEntry]]):
    """The current items of a session: pushed by adds, popped by pops, emptied by clears."""

    name = "agents.session"
    views = (ITEMS_VIEW,)

    def initial(self) -> list[ViewEntry]:
        return []

    def apply(self, state: list[ViewEntry], event: RecordedEvent) -> list[ViewEntry]:
        payload = event.payload
        if isinstance(payload, ItemsAdded):
            state.extend(ViewEntry(event.seq, encode_item(i)) for i in payload.items)
        elif isinstance(payload, ItemPopped):
            if state:
                state.pop()
        elif isinstance(payload, SessionCleared):
            state.clear()
        return state

    def ops(self, events: Sequence[NewEvent]) -> list[ViewOp]:
        out: list[ViewOp] = []
        for index, new in enumerate(events):
            payload = new.payload
            if isinstance(payload, ItemsAdded) and payload.items:
                values = tuple(encode_item(i) for i in payload.items)
                out.append(ListPush(ITEMS_VIEW, values, index))
            elif isinstance(payload, ItemPopped):
                out.append(ListPop(ITEMS_VIEW))
            elif isinstance(payload, SessionCleared):
                out.append(ViewClear(ITEMS_VIEW))
        return out

    def materialize(self, state: list[ViewEntry]) -> list[ViewOp]:
        return [ListLoad(ITEMS_VIEW, tuple(state))]

    def full_reads(self) -> list[ViewRead]:
        return [ListRange(ITEMS_VIEW, 0, -1)]


# -- thread ids -------------------------------------------------------------------------------

_ESCAPED = frozenset("%{}\x7f") | frozenset(chr(c) for c in range(0x20))


def _escape(text: str) -> str:
    # Percent-encode what a thread id may not hold (braces, control characters) and ``%``
    # itself, so the mapping stays one-to-one and reversible.
    if not any(ch in _ESCAPED for ch in text):
        return text
    return "".join(f"%{ord(ch):02X}" if ch in _ESCAPED else ch for ch in text)


def session_thread_id(session_id: str, *, prefix: str = DEFAULT_THREAD_PREFIX) -> str:
    """The thread that stores session ``session_id``.

    The empty id is a session like any other, as in the SDK's `SQLiteSession` (its thread is
    the prefix alone, which no other id maps to). Raises `InvalidThreadIdError` for a
    non-string id, or one too long once prefixed (or empty with an empty prefix).
    """
    if not isinstance(session_id, str):
        raise InvalidThreadIdError(f"session id must be a str, not {session_id!r:.80}")
    if not isinstance(prefix, str):
        raise InvalidThreadIdError(f"thread prefix must be a str, not {prefix!r:.80}")
    return prefixed_thread_id(prefix, _escape(session_id), "session id")


def _ttl_ms(ttl: float | timedelta | None) -> int | None:
    if ttl is None:
        return None
    if not isinstance(ttl, timedelta | int | float) or isinstance(ttl, bool):
        raise InvalidInputError(
            f"ttl must be a number of seconds or a timedelta, not {type(ttl).__name__}: {ttl!r}"
        )
    seconds = ttl.total_seconds() if isinstance(ttl, timedelta) else float(ttl)
    if not (seconds > 0 and math.isfinite(seconds)):
        raise InvalidInputError(f"ttl must be a positive number of seconds, not {ttl!r}")
    return max(1, round(seconds * 1000))


def _json_item(index: int, item: object) -> dict[str, Any]:
    """An input item as a JSON store keeps it (what the SDK's `SQLiteSession` hands back):
    a JSON object of JSON values. Anything else (a non-dict, bytes, a set, NaN or an infinite
    number) would be stored and handed back to the SDK, which fails on it later, far from
    the bad call; tuples come back as lists and non-str keys as str, as from JSON."""
    if not isinstance(item, Mapping):
        raise InvalidInputError(
            f"items[{index}] must be an input item (a dict), not {type(item).__name__}"
        )
    try:
        return cast(dict[str, Any], json.loads(json.dumps(item, allow_nan=False)))
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"items[{index}] is not a JSON object: {exc}") from None


def _check_storable(items: list[dict[str, Any]]) -> None:
    """Raise `InvalidInputError` naming the first item that holds what a JSON store would
    keep and the log cannot: a string that is not valid Unicode (a lone surrogate, as Python
    decodes a file name that is not UTF-8), or an int beyond 64 bits."""
    for index, item in enumerate(items):
        _check_item_storable(index, item)


def _check_item_storable(index: int, item: dict[str, Any]) -> None:
    try:
        encode_item(item)
    except UnicodeEncodeError as exc:
        raise InvalidInputError(
            f"items[{index}] cannot be stored: it holds a string that is not valid Unicode "
            f"(the lone surrogate {exc.object[exc.start]!r}, as Python decodes a byte that is "
            "not UTF-8, in a file name for instance); encode it, or replace it "
            "(str.encode('utf-8', 'replace'))"
        ) from None
    except OverflowError:
        raise InvalidInputError(
            f"items[{index}] cannot be stored: it holds an int beyond 64 bits (below -2**63 or "
            "above 2**64 - 1); store it as a string"
        ) from None


def _now_ms() -> int:
    return int(time.time() * 1000)


def _session_settings(value: object) -> SessionSettings | None:
    # What SQLiteSession accepts: a SessionSettings or a dict of its fields, coerced by the SDK's
    # own class so the runner can ``resolve`` it. Any mapping is taken as a dict.
    if value is None:
        return None
    try:
        from agents.memory.session_settings import SessionSettings
    except ImportError:  # an SDK without session settings has no use for them
        raise InvalidInputError(
            "session_settings needs an openai-agents release with SessionSettings"
        ) from None
    if isinstance(value, SessionSettings):
        return value
    if not isinstance(value, Mapping):
        raise InvalidInputError(
            f"session_settings must be a SessionSettings or a mapping, not {type(value).__name__}"
        )
    # The SDK's constructor ignores unknown names; its coerce_session_settings refuses them.
    known = {f.name for f in dataclasses.fields(SessionSettings) if f.init}
    unknown = [k for k in value if k not in known]
    if unknown:
        raise InvalidInputError(f"session_settings has unknown settings {unknown!r}")
    try:
        return SessionSettings(**value)
    except ValueError as exc:  # pydantic's ValidationError: a value of the wrong type
        raise InvalidInputError(f"session_settings {dict(value)!r}: {exc}") from None


# Pops of one session in this process share a lock (sessions are often built per request, so
# not per object): taking turns costs one round trip each, where racing would cost each loser a
# retry. The lock lives as long as a session holding it.
_PopKey = tuple[int, str]  # (id of the store, thread id)
_pop_locks: weakref.WeakValueDictionary[_PopKey, anyio.Lock] = weakref.WeakValueDictionary()


def _pop_lock(store: EventStore, thread_id: str) -> anyio.Lock:
    key = (id(store), thread_id)  # the session holds the store, so the id is not reused
    lock = _pop_locks.get(key)
    if lock is None:
        lock = _pop_locks[key] = anyio.Lock()
    return lock


_LastWrite = tuple[int, int, int | None]
"""A session's last event: its seq and time (ms), and the thread's life read just before."""


async def _last_event(store: EventStore, thread_id: str) -> _LastWrite | None:
    """The seq and time (ms) of the thread's last event, and the life (`incarnation`) read
    just before it; None for no thread."""
    life = await store.incarnation(thread_id)
    async for event in store.read(thread_id, backwards=True, limit=1):
        return event.seq, event.time_ms, life
    return None


async def _delete_if_still(store: EventStore, thread_id: str, last: _LastWrite) -> bool:
    """Delete an idle session if nothing was written to it since it was found idle (at its
    ``last`` event); False when a write came first: it is no longer idle, and kept. So is a
    session deleted and started again meanwhile, even up to the same version (its life
    differs from the one read)."""
    version, _, life = last
    try:
        await store.delete_thread(
            thread_id,
            views=list(SessionItemsProjection.views),
            expected_version=version,
            expected_incarnation=life,
        )
    except ConcurrencyError:
        return False
    return True


# -- the session ------------------------------------------------------------------------------


class ThreadlogSession:
    """A conversation session of the OpenAI Agents SDK, stored as events in one thread.

    Implements the SDK's ``Session`` protocol: pass it as ``Runner.run(..., session=...)``.
    ``session_settings`` (a ``SessionSettings`` or a dict of its fields, as for the SDK's
    ``SQLiteSession``; anything else raises `InvalidInputError`) gives the default ``limit``
    of `get_items`. ``ttl`` (seconds or a `timedelta`) deletes the session, log included, when
    it is next touched after being idle (no write) for longer than that; see
    `sweep_idle_sessions` for sessions nobody touches.
    Idleness compares this machine's clock with the server time of the last event.

    ``policy`` and ``principal`` confine the session as `ThreadStore` and `SessionStore` are
    confined (the SDK passes no principal, so the session carries the one it serves): every
    call asks the policy first and raises `AccessDenied` before anything is read or written.
    `get_items` reads, `add_items`, `clear_session` and `delete` write, and `pop_item` does
    both (it returns the item it removes). The policy is asked about the session's thread
    (``thread_id``, e.g. ``agents:user-123``).
    """

    session_settings: SessionSettings | None

    def __init__(
        self,
        session_id: str,
        store: EventStore,
        *,
        ttl: float | timedelta | None = None,
        session_settings: SessionSettings | Mapping[str, Any] | None = None,
        thread_prefix: str = DEFAULT_THREAD_PREFIX,
        policy: AccessPolicy | None = None,
        principal: Principal | None = None,
    ) -> None:
        store = require_store(store, "ThreadlogSession")
        self.session_id = session_id
        self.store = store
        self.thread_id = session_thread_id(session_id, prefix=thread_prefix)
        self.ttl_ms = _ttl_ms(ttl)
        self.session_settings = _session_settings(session_settings)
        self.projection = SessionItemsProjection()
        self.projector = Projector(store, [self.projection])
        self.policy = check_policy(policy)
        self.principal = principal
        self._pop_lock = _pop_lock(store, self.thread_id)
        register_session_events(store.registry)
        # The latest time (ms) this object knows the session was written; while it is younger
        # than the ttl, no read is needed to know the session has not expired.
        self._active_ms: int | None = None

    def __repr__(self) -> str:
        return f"ThreadlogSession({self.session_id!r}, thread={self.thread_id!r})"

    # -- the Session protocol -----------------------------------------------------------------

    async def get_items(self, limit: int | None = None) -> list[TResponseInputItem]:
        """The session's items, oldest first; with ``limit``, only the latest ``limit``.

        ``limit`` defaults to ``session_settings.limit``; 0 returns nothing and a negative
        limit returns everything (as the SDK's SQLiteSession does).
        """
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise InvalidInputError(f"limit must be an int or None, not {limit!r}")
        await self._allow("read")
        await self._expire_if_idle()
        n = limit
        if n is None and self.session_settings is not None:
            n = self.session_settings.limit
        if n == 0:
            return []
        start = -n if n is not None and n > 0 else 0
        # No version is needed: one plain LRANGE is the cheapest read there is.
        entries = await self.store.read_list(self.thread_id, ITEMS_VIEW, start, -1)
        return [self._decode(e) for e in entries]

    async def add_items(self, items: list[TResponseInputItem]) -> None:
        """Append ``items`` in one atomic step (nothing to do for an empty list).

        A reply lost to a connection error is retried here without adding twice. If this
        raises `StoreConnectionError` or `StoreTimeoutError`, the items may have been added
        all the same, and calling again may add them twice: a key derived from the items
        cannot tell that retry from a second, legitimate add of equal items (a user saying
        "yes" twice), so none is used. Read the items back to decide.

        Cancelling the call does not cut the append short, as with the SDK's own sessions:
        it runs to its end, then the cancellation is raised; the items were added unless
        the append itself failed. (`pop_item` stays cancellable until its write is sent.)
        """
        if isinstance(items, Mapping | str | bytes) or not isinstance(items, Sequence):
            raise InvalidInputError("items must be a list of input items")
        stored = [_json_item(i, item) for i, item in enumerate(items)]
        await self._allow("write")
        if not items:
            return
        await _to_the_end(self._add(stored))

    async def _add(self, stored: list[dict[str, Any]]) -> None:
        await self._expire_if_idle()
        try:
            await self._append([ItemsAdded(items=stored)], expected_version=ANY)
        except EventValidationError:
            _check_storable(stored)  # nothing was written (encoded before anything is sent)
            raise
        except EventTooLargeError:
            # Nothing was written (sizes are checked before anything is sent). Items bigger
            # together than one event go as several events of one atomic append, as
            # `SessionStore` writes a long transcript; only one item over the limit is refused.
            chunks = chunk_by_size(stored, event_budget(self.store))
            if len(chunks) == 1:
                raise
            await self._append([ItemsAdded(items=c) for c in chunks], expected_version=ANY)

    async def pop_item(self) -> TResponseInputItem | None:
        """Remove and return the most recent item (None when the session is empty).

        Raises `ConcurrencyError` only if other processes' writes kept changing the tail for
        `POP_TIMEOUT` seconds.

        Cancelled while it reads the tail or waits to try again, it pops nothing. Cancelled
        once its write is sent, it waits for that write, then raises the cancellation: the
        item was popped (the log's `ItemPopped` names it) unless the write failed. A write
        cannot be called back once sent, and returning earlier would leave the session to
        change under the caller after the call ended.
        """
        await self._allow("read")
        await self._allow("write")
        await self._expire_if_idle()
        async with self._pop_lock:
            deadline = time.monotonic() + POP_TIMEOUT
            attempt = 0
            while True:
                snap = await self.store.read_views(self.thread_id, [ListRange(ITEMS_VIEW, -1, -1)])
                tail = snap.results[0]
                assert isinstance(tail, list)
                if not tail:
                    return None
                entry = tail[0]
                # Decoded before the pop is written: an item that does not decode raises with
                # the session as it was, rather than after it was removed.
                item = self._decode(entry)
                event = ItemPopped(added_seq=entry.seq, digest=item_digest(entry.value))
                # The thread version is the guard: every event of a session moves the tail, so
                # it is stricter than "this entry is still the tail" only after an add and a pop
                # that cancel out, and the view has no finer guard to offer. The life with it:
                # a session swept and written again to this version since has another tail.
                try:
                    await _to_the_end(
                        self._append(
                            [event],
                            expected_version=snap.version,
                            expected_incarnation=snap.incarnation,
                        )
                    )
                except ConcurrencyError:
                    if time.monotonic() >= deadline:
                        raise
                    # An add, or another process's pop, got in between. Full jitter keeps
                    # pops of several processes from colliding again in lockstep.
                    pause = min(POP_BACKOFF_MAX, POP_BACKOFF_MIN * 2 ** min(attempt, 16))
                    await anyio.sleep(random.uniform(0, pause))
                    attempt += 1
                    continue
                return item

    async def clear_session(self) -> None:
        """Remove every item from the session; the log keeps them. A cancelled call clears
        all the same (see `add_items`)."""
        await self._allow("write")
        await _to_the_end(self._clear())

    async def _clear(self) -> None:
        await self._expire_if_idle()
        # EXISTS: clearing a session that has no thread writes nothing.
        with contextlib.suppress(ConcurrencyError):
            await self._append([SessionCleared()], expected_version=EXISTS)

    async def _atomic_replace_items(self, items: list[TResponseInputItem]) -> bool:
        """Replace every item with ``items`` in one atomic append (`SessionCleared`, then
        `ItemsAdded`); the log keeps the replaced items.

        The SDK's compaction session (``OpenAIResponsesCompactionSession``) calls this hook
        when the session has it, as its own RedisSession and SQLite stores do; without it, it
        clears and then adds, and a reader in between, or a process that dies in between,
        finds the session empty. Returns False (the SDK then clears and adds through the
        public methods) for a subclass, which may transform what those methods store.
        A cancelled call runs to its end, as `add_items` does.
        """
        if type(self) is not ThreadlogSession:
            return False
        if isinstance(items, Mapping | str | bytes) or not isinstance(items, Sequence):
            raise InvalidInputError("items must be a list of input items")
        stored = [_json_item(i, item) for i, item in enumerate(items)]
        await self._allow("write")
        await _to_the_end(self._replace(stored))
        return True

    async def _replace(self, stored: list[dict[str, Any]]) -> None:
        await self._expire_if_idle()
        if not stored:
            await self._clear()
            return
        _check_storable(stored)  # each item is encoded to chunk them: named first
        chunks = chunk_by_size(stored, event_budget(self.store))
        events: list[Event] = [SessionCleared(), *(ItemsAdded(items=c) for c in chunks)]
        await self._append(events, expected_version=ANY)

    # -- beyond the protocol ------------------------------------------------------------------

    async def delete(self) -> int:
        """Delete the session and its log for good; returns the version it had."""
        await self._allow("write")
        self._active_ms = None
        return await self.store.delete_thread(self.thread_id, views=list(self.projection.views))

    # -- internals ----------------------------------------------------------------------------

    async def _allow(self, action: Action) -> None:
        await authorize(self.policy, self.principal, action, self.store.namespace, self.thread_id)

    def _decode(self, entry: ViewEntry) -> TResponseInputItem:
        try:
            return cast(TResponseInputItem, msgspec.msgpack.decode(entry.value))
        except DECODE_ERRORS as exc:
            raise OperationalError(
                f"session {self.session_id!r}: item written at seq {entry.seq} does not decode "
                f"({exc}); run rebuild"
            ) from None

    async def _append(
        self,
        events: list[Event],
        *,
        expected_version: ExpectedVersion,
        expected_incarnation: int | None = None,
    ) -> None:
        # The same NewEvents on every attempt: a retry after a lost reply carries the same
        # idempotency key and is answered from the ledger instead of appending twice.
        news = [NewEvent(payload=e) for e in events]
        result: AppendResult | None = None
        for attempt in range(TRANSIENT_ATTEMPTS):
            try:
                result = await self.projector.append(
                    self.thread_id,
                    news,
                    expected_version=expected_version,
                    expected_incarnation=expected_incarnation,
                )
                break
            except (StoreConnectionError, StoreTimeoutError):
                if attempt == TRANSIENT_ATTEMPTS - 1:
                    raise
                await anyio.sleep(0.05 * 2**attempt)
        assert result is not None
        self._active_ms = _now_ms()

    async def _expire_if_idle(self) -> None:
        if self.ttl_ms is None:
            return
        now = _now_ms()
        if self._active_ms is not None and now - self._active_ms < self.ttl_ms:
            return
        last = await _last_event(self.store, self.thread_id)
        if last is not None and now - last[1] > self.ttl_ms:
            if await _delete_if_still(self.store, self.thread_id, last):
                self._active_ms = None
                return
            last = await _last_event(self.store, self.thread_id)  # written meanwhile
        self._active_ms = last[1] if last is not None else None


async def sweep_idle_sessions(
    store: EventStore,
    ttl: float | timedelta,
    *,
    thread_prefix: str = DEFAULT_THREAD_PREFIX,
    now_ms: int | None = None,
) -> list[str]:
    """Delete every session idle (no write) for longer than ``ttl``; returns their thread ids.

    Lists candidates with ``store.threads(before_ms=...)`` and checks each thread's last event
    again right before deleting it, so a session written since the listing is kept. Run it
    periodically (a cron job, a background task) for sessions nobody touches again.
    """
    ttl_ms = _ttl_ms(ttl)
    if ttl_ms is None:
        raise InvalidInputError("ttl must be a positive number of seconds or a timedelta, not None")
    if not isinstance(thread_prefix, str):
        raise InvalidInputError(f"thread_prefix must be a str, not {thread_prefix!r:.80}")
    if now_ms is not None:
        validate_int(now_ms, "now_ms")
    cutoff = (now_ms if now_ms is not None else _now_ms()) - ttl_ms
    deleted: list[str] = []
    for info in await store.threads(before_ms=cutoff):
        if not info.thread_id.startswith(thread_prefix):
            continue
        last = await _last_event(store, info.thread_id)
        if last is None or last[1] >= cutoff:
            continue
        if await _delete_if_still(store, info.thread_id, last):
            deleted.append(info.thread_id)
    return deleted


async def _to_the_end(write: Coroutine[Any, Any, None]) -> None:
    """Await ``write`` to its end even if the caller is cancelled meanwhile, then raise the
    cancellation: a write the SDK's caller cancelled is either done or failed, never unknown.

    On asyncio (the SDK's loop) the write runs as a task of its own that the caller's
    cancellation does not reach; elsewhere it is awaited in a shielded cancel scope.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # another event loop (trio)
        on_asyncio = False
    else:
        on_asyncio = True
    if not on_asyncio:
        with anyio.CancelScope(shield=True):
            await write
        await anyio.lowlevel.checkpoint_if_cancelled()
        return
    task = asyncio.ensure_future(write)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError as exc:
            cancelled = cancelled or exc  # the write goes on; the caller hears of it after
    if cancelled is None:
        task.result()
        return
    if not task.cancelled():
        task.exception()  # retrieved (not logged as never retrieved): the cancellation wins
    raise cancelled
