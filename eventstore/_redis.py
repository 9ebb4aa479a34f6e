"""`RedisEventStore`: the event log on Redis Streams, standalone or Redis Cluster."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import heapq
import itertools
import operator
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar

import redis
import redis.asyncio as aioredis
from redis import exceptions as rex
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import MasterNotFoundError

from ._codec import (
    DEFAULT_MAX_EVENT_BYTES,
    UNKEYED_FINGERPRINT,
    EncodedEvent,
    caller_key_field,
    check_secret,
    damaged_time,
    decode_payload_rows,
    decode_rows,
    encode_append,
    expected_incarnation_arg,
    expected_version_arg,
    idempotency_key_for,
    idempotency_key_text,
    key_fingerprint,
    log_without_meta,
    missing_entry,
    namespace_chain_key,
    parse_ledger_entry,
)
from ._contract import (
    ANY,
    AppendResult,
    ChainHead,
    EventStore,
    ExpectedVersion,
    MetaSnapshot,
    RawRange,
    ThreadInfo,
    key_list,
    thread_id_list,
    threads_cursor,
)
from ._errors import (
    ChainKeyMismatchError,
    ConcurrencyError,
    CorruptEventError,
    CorruptKeyError,
    EventStoreError,
    FeedGroupNotFoundError,
    FeedTrimmedError,
    IdempotencyKeyReusedError,
    IncarnationConflictError,
    InvalidInputError,
    OperationalError,
    StoreClosedError,
    StoreConnectionError,
    StoreTimeoutError,
    ThreadReplacedError,
    UnstampedViewError,
    ViewConflictError,
    WrongKeyTypeError,
)
from ._events import Event, EventRegistry, NewEvent, PayloadRow, RecordedEvent
from ._events import registry as default_registry
from ._feed import (
    CheckpointedState,
    FeedEntry,
    FeedInfo,
    GroupInfo,
    entry_from_fields,
    parse_stream_id,
    validate_block_ms,
    validate_consumer,
    validate_feed_count,
    validate_group,
    validate_group_to_drop,
    validate_hash_names,
    validate_increments,
    validate_stream_ids,
)
from ._gc import paused_collector
from ._ids import (
    new_ulid,
    validate_count,
    validate_expected_deletion,
    validate_int,
    validate_limit,
    validate_partition,
    validate_seq_range,
    validate_thread_id,
    validate_view_name,
)
from ._keys import (
    DEFAULT_PARTITIONS,
    MAX_PARTITIONS,
    STAGING_TTL_S,
    KeyLayout,
    key_pattern,
    partition_of,
)
from ._scripts import (
    APPEND,
    APPLY_CHECKPOINTED,
    DELETE_CHECKPOINTED,
    DELETE_THREAD,
    LOAD_VIEWS,
    READ_VIEWS,
    SEQ_AT,
    SWAP_VIEWS,
    THREADS_AFTER,
    TRIM_FEED,
    GroupCommit,
)
from ._views import (
    HashDelete,
    HashGet,
    HashGetAll,
    HashLoad,
    HashSet,
    ListLoad,
    ListPop,
    ListPush,
    ListRange,
    ListReset,
    ViewClear,
    ViewEntry,
    ViewOp,
    ViewRead,
    ViewResult,
    ViewSnapshot,
    check_ops,
    check_reads,
    decode_view_result,
    redis_index,
    stamp_hash_value,
    stamp_list_value,
)
from ._wire import (
    BULK_HEADERS,
    HeldConnections,
    can_hold,
    evalsha_prefix,
    pack_bulks,
    pack_command,
    packs_like_redis_py,
)

T = TypeVar("T")
_MULTI = pack_command(("MULTI",))
_EXEC = pack_command(("EXEC",))
_PLAIN_READS = (ListRange, HashGetAll, HashGet)
_VALUE = operator.attrgetter("value")
READ_BATCH = 512
LEDGER_READ_CHUNK = 1000  # idempotency keys looked up per HMGET (`recorded_appends`)
LOAD_CHUNK_VALUES = 8192
LOAD_CHUNK_BYTES = 4 * 1024 * 1024
_APPEND_KEYS_MEMO = 4096  # threads whose encoded keys an append reuses; cleared when full
_VIEW_KEYS_MEMO = 16  # view keys kept per thread in that memo (a projector has a few views)
# Reads of an async projection's hash names before its state is deleted: more are needed only
# while a runner of it still writes new hashes (each attempt takes in the names it added).
DELETE_ATTEMPTS = 5


_WRONG_CREDENTIALS = ("WRONGPASS", "invalid username-password pair", "invalid password")
_NO_CREDENTIALS = ("NOAUTH", "Authentication required", "HELLO must be called with the client")
# Redis 7.0: "The user executing the script can't run this command ..." (or "can't access at
# least one of the keys ..."); Valkey 8: "ACL failure in script: User u has no permissions ...".
_SCRIPT_ACL_DENIALS = ("user executing the script can't", "ACL failure in script")


def _caused_by_timeout(exc: BaseException) -> bool:
    """Whether a timeout is among the errors ``exc`` was raised from (its first few causes)."""
    cause = exc.__cause__ or exc.__context__
    for _ in range(4):
        if cause is None:
            return False
        if isinstance(cause, TimeoutError | rex.TimeoutError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def translate_redis_error(exc: BaseException) -> EventStoreError:
    """The one place where redis-py errors become threadlog errors."""
    if isinstance(exc, rex.TimeoutError):
        return StoreTimeoutError(f"redis timed out: {exc}")
    if isinstance(exc, MasterNotFoundError):
        # redis-py (8.1) appends the repr of the last sentinel client it asked, every
        # connection setting of it, to "No master found for 'service'".
        said = str(exc).split(" : ", 1)[0]
        return StoreConnectionError(f"redis connection failed: {said} (no sentinel named one)")
    text = str(exc)
    # Asked first: redis-py 6 raises AuthenticationError for a password missing too.
    if any(words in text for words in _NO_CREDENTIALS):
        return StoreConnectionError(
            f"redis requires a password and none was given: {exc} (give it in the URL before "
            "the host, as :password@host, or user:password@host for an ACL user)"
        )
    # redis-py 8 raises a plain ConnectionError for refused credentials: known by their words.
    if isinstance(exc, rex.AuthenticationError | rex.AuthorizationError) or any(
        words in text for words in _WRONG_CREDENTIALS
    ):
        return StoreConnectionError(
            f"redis refused the credentials: {exc} (check the user name and password the URL "
            "gives before the host, as user:password@host)"
        )
    if isinstance(exc, rex.ConnectionError) and _caused_by_timeout(exc):
        # redis-py raises ConnectionError("Timeout reading from ...") for a timeout during a
        # reconnect's handshake, its retries spent: a stalled server ends that way.
        return StoreTimeoutError(f"redis timed out: {exc}")
    if isinstance(exc, rex.ConnectionError | rex.ClusterDownError | ConnectionError):
        return StoreConnectionError(f"redis connection failed: {exc}")
    # An ACL denial inside a script is a plain ERR, not NOPERM, in each server's own words.
    if isinstance(exc, rex.NoPermissionError) or any(
        words in text for words in _SCRIPT_ACL_DENIALS
    ):
        return OperationalError(f"redis denied the command (ACL): {exc}")
    if isinstance(exc, TimeoutError):
        return StoreTimeoutError(f"redis timed out: {exc}")
    # In a pipeline's error redis-py puts the command first ("Command # 2 (XRANGE ...) of
    # pipeline caused error: WRONGTYPE ..."): the key named, the same damage.
    if isinstance(exc, rex.ResponseError) and "WRONGTYPE" in text:
        return WrongKeyTypeError(
            "a key holds another kind of value than threadlog writes there (it was replaced "
            f"from outside threadlog): {exc}"
        )
    return OperationalError(f"redis error: {exc}")


# read_views.lua's words for a view key of a type no view is: its KEYS index and the type.
_FOREIGN_VIEW_KEY = re.compile(r"threadlog view key (\d+) holds a (\w+),")
_VIEW_TYPES = frozenset({"list", "hash", "none"})


def _foreign_view(thread_id: str, view: str, kind: str) -> UnstampedViewError:
    return UnstampedViewError(
        thread_id, view, f"its key holds a {kind}, which no view is: written from outside threadlog"
    )


async def _call(op: Awaitable[T]) -> T:
    try:
        return await op
    # RedisClusterException (e.g. "cannot be connected") is not a RedisError subclass.
    except (rex.RedisError, rex.RedisClusterException, OSError) as exc:
        raise translate_redis_error(exc) from exc


# What a connection disconnected under a call (by `close`) is translated to.
_CONNECTION_FAILURES = (OperationalError, StoreConnectionError, StoreTimeoutError)


async def _pipeline_executed(pipe: Any) -> list[Any]:
    """``pipe.execute(raise_on_error=False)``: error replies in their commands' places, but a
    connection or timeout error raised, which the cluster pipeline puts in a reply's place too:
    that is no answer of the server's, and the call failed (`_call` translates it; `_InFlight`
    tells a store closed under it)."""
    replies = list(await pipe.execute(raise_on_error=False))
    for reply in replies:
        if isinstance(reply, Exception) and not isinstance(reply, rex.ResponseError):
            raise reply
    return replies


def _replies_checked(replies: Iterable[Any]) -> list[Any]:
    """A redis-py pipeline's replies (read with ``raise_on_error=False``); an error reply is
    raised translated, as Redis worded it.

    Raised by the pipeline itself, the first error is reworded ("Command # 2 (XRANGE ...) of
    pipeline caused error: ..."), and redis-py up to 6.4 drops Redis's own words there (a
    format string never filled in): a log replaced by another type would not read as
    WRONGTYPE, the damage it is.
    """
    replies = list(replies)
    for reply in replies:
        if isinstance(reply, Exception):
            raise translate_redis_error(reply) from reply
    return replies


async def _group_call(op: Awaitable[T], partition: int, group: str) -> T:
    """`_call` for a command naming a consumer group: a missing group (or feed) is
    `FeedGroupNotFoundError`, named by partition and group rather than by Redis key."""
    try:
        return await op
    except rex.ResponseError as exc:
        text = str(exc)
        # XGROUP SETID on a feed that does not exist answers ERR, not NOGROUP.
        if text.startswith("NOGROUP") or "requires the key to exist" in text:
            raise FeedGroupNotFoundError(partition, group) from exc
        raise translate_redis_error(exc) from exc
    except (rex.RedisError, rex.RedisClusterException, OSError) as exc:
        raise translate_redis_error(exc) from exc


async def _cancel(pending: asyncio.Task[Any] | None) -> None:
    """Cancel a read-ahead nobody will take, and wait for it.

    Awaited, the read-ahead's own CancelledError could not be told from the caller's (whose
    cancellation would then be lost): `asyncio.wait` waits without raising either, and a
    cancellation of the caller's still raises in it."""
    if pending is not None:
        pending.cancel()
        await asyncio.wait((pending,))
        if not pending.cancelled():
            pending.exception()  # retrieved: an error of a page nobody reads is not logged


_MAX_ID_MS = 2**64 - 1  # the largest first part of a stream id
_CLOSE_WAIT_S = 1.0  # how long `close` waits for calls in flight to end (see `_call`)
_KNOWN_NAMESPACES_SCANS = 10  # SCAN calls (COUNT 1000) `known_namespaces` makes at most


def _upper(stop: int | None) -> bytes:
    """The id a read up to seq ``stop`` ends at; past the largest id a stream can hold is
    "+" (memory and Redis then agree: everything up to the end, not an invalid id)."""
    return b"+" if stop is None or stop >= _MAX_ID_MS else b"%d-0" % max(stop, 0)


def _lower(start: int) -> bytes:
    """The id a read from seq ``start`` begins at (seqs begin at 1)."""
    return b"%d-0" % min(max(start, 1), _MAX_ID_MS)


_Life = tuple[Any, bool]
"""A thread's life as a page read sees it: its meta ``n`` (the incarnation, None before one was
recorded) and whether the thread exists (its meta has a version)."""


def _same_life(thread_id: str, first: _Life | None, now: _Life) -> _Life:
    """The life a multi-page read is in: that of its first page, which every later page must
    share (a thread deleted, or deleted and written again, between two pages is another)."""
    if first is None or first == now:
        return now
    raise ThreadReplacedError(thread_id)


def _incarnation_of(thread_id: str, n: Any) -> int:
    """A meta hash's incarnation (field ``n``) as a number; `CorruptEventError` if it is none."""
    try:
        return int(n)
    except ValueError:
        raise CorruptEventError(
            thread_id, None, f"its meta hash holds an unreadable incarnation (field 'n': {n!r}): "
            "damaged (run 'verify')"
        ) from None  # fmt: skip


def _other_life(
    thread_id: str, expected_version: object, expected_incarnation: int | None, reply: Any
) -> IncarnationConflictError:
    """The error a script's ``{"life", actual life or false, actual version}`` reply means."""
    assert expected_incarnation is not None  # the scripts check only a life they are given
    return IncarnationConflictError(
        thread_id,
        expected_version,
        int(reply[2]),
        expected_incarnation,
        None if reply[1] is None else _incarnation_of(thread_id, reply[1]),
    )


def _read_rows(reply: Any) -> list[Any]:
    """The entries of a one-stream ``XREAD``/``XREADGROUP`` reply as redis-py gives it: on
    RESP2 ``[[key, entries]]``, on RESP3 (a client made with ``protocol=3``) a map ``{key:
    [entries]}``; nothing (a block that timed out) either way."""
    if not reply:
        return []
    if isinstance(reply, dict):
        (value,) = reply.values()
        return list(value[0]) if value else []
    return list(reply[0][1])


def _checkpoint(key: str, name: str, raw: bytes) -> str:
    """A stored checkpoint (a feed id), or `CorruptKeyError` for what threadlog never writes
    there: read on, a runner would take it for the caller's bad input, or fail to decode it."""
    try:
        text = raw.decode("ascii")
        parse_stream_id(text)
    except (UnicodeDecodeError, InvalidInputError):
        raise CorruptKeyError(
            key,
            f"projection {name!r}'s checkpoint is {raw[:40]!r}, which is no feed id (a "
            "checkpoint is the id of the last change the projection applied: put that back)",
        ) from None
    return text


def _check_load_reply(
    thread_id: str, reply: Any, expected_version: int, expected_incarnation: int | None
) -> None:
    """Raise what a view load's refusal (`load_views.lua`, `swap_views.lua`) means."""
    status = reply[0]
    if status == b"conflict":
        raise ConcurrencyError(thread_id, expected_version, int(reply[1]))
    if status == b"life":
        raise _other_life(thread_id, expected_version, expected_incarnation, reply)
    if status == b"meta":
        raise _damaged_version(thread_id, reply[1], "; nothing was loaded")


def _in_life(
    thread_id: str, life: Any, incarnation: int, start: int, stop: int | None, rows: list[Any]
) -> bool:
    """Whether a range read in one atomic step with the thread's meta ``n`` and ``v`` (``life``)
    belongs to the thread's life ``incarnation``: False when the thread was deleted (no meta) or
    deleted and created again (another ``n``).

    A change names its life and its seqs, so a life that still holds the thread must hold
    them: a meta without ``n`` (every write records it), or a range of the life's seqs that
    reads as nothing (entries deleted from the log), is damage, reported as such, never a
    range to skip as though the thread had gone.
    """
    n, v = life
    if n is None:
        if v is None:
            return False
        raise CorruptEventError(
            thread_id, None, "its meta hash has a version but no incarnation (field 'n'), which "
            "every append records: damaged (run 'verify')"
        )  # fmt: skip
    if _incarnation_of(thread_id, n) != incarnation:
        return False
    version = _meta_version(thread_id, v)
    first = max(start, 1)
    if not rows and first <= version and (stop is None or first <= stop):
        raise CorruptEventError(
            thread_id, first, "missing from the log, though the thread's life holds it (run "
            "'verify')"
        )  # fmt: skip
    return True


def _recorded_hash_names(key: str, members: Iterable[bytes]) -> list[str]:
    """The hash names recorded in set ``key`` (`KeyLayout.aux_names`), sorted; a member that
    is no hash name was put there from outside threadlog (`CorruptKeyError`, nothing
    deleted)."""
    out = []
    for member in members:
        try:
            out.append(validate_view_name(member.decode("utf-8")))
        except (UnicodeDecodeError, InvalidInputError):
            raise CorruptKeyError(
                key, f"it holds {member!r}, which is no hash name (nothing was deleted)"
            ) from None
    return sorted(out)


def _text(value: Any) -> str:
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


def _life_of(thread_id: str, n: Any, v: Any) -> int | None:
    """`EventStore.incarnation` from a meta hash's ``n`` and ``v``."""
    if n is None or v is None:
        return None  # no thread (a meta without 'v' is none), or one that records no life
    return _incarnation_of(thread_id, n)


def _fingerprint_of(raw: bytes | None) -> str | None:
    """`EventStore.chain_key_fingerprint` from a meta hash's ``f``."""
    return raw.decode("ascii", "replace") if raw is not None else None


def _chain_head_of(thread_id: str, v: Any, h: Any, s: Any, c: Any) -> ChainHead | None:
    """`EventStore.chain_head` from a meta hash's ``v``, ``h``, ``s`` and ``c``."""
    if v is None:
        return None
    # A version without a head: the head was removed (every append writes both), said as the
    # empty head of no events, which verify holds the log's last link to.
    head = (h or b"").decode("ascii", "replace")
    return ChainHead(_meta_version(thread_id, v), head, _ms_or_none(s), _ms_or_none(c))


def _stored_damage(reply: Exception) -> EventStoreError:
    """An error reply to a snapshot's read, translated: stored damage (a key of another
    type) is kept for the field it concerns; anything else is raised now."""
    error = translate_redis_error(reply)
    if not isinstance(error, CorruptEventError | WrongKeyTypeError):
        raise error from reply
    return error


def _ms_or_none(raw: bytes | None) -> int | None:
    """A time a meta hash records, or None: none, or not a number (verify reads it only)."""
    return int(raw) if raw is not None and raw.isdigit() and len(raw) <= 20 else None


def _as_dict(fields: Any) -> dict[bytes, bytes]:
    """Stream entry fields as redis-py's reply callback gives them (the raw reply is flat)."""
    if isinstance(fields, dict):
        return fields
    it = iter(fields)
    return dict(zip(it, it, strict=True))


# An `AppendResult` built without its dataclass __init__, whose five object.__setattr__ calls
# (it is frozen) cost more than anything else an answered append does; slot by slot, the same
# object.
_new_object = object.__new__
_set_result_fields = tuple(
    vars(AppendResult)[name].__set__
    for name in ("thread_id", "first_seq", "last_seq", "duplicate", "incarnation")
)


def _append_result(
    thread_id: str, first: int, last: int, duplicate: bool, incarnation: int | None
) -> AppendResult:
    result: AppendResult = _new_object(AppendResult)
    set_thread, set_first, set_last, set_duplicate, set_incarnation = _set_result_fields
    set_thread(result, thread_id)
    set_first(result, first)
    set_last(result, last)
    set_duplicate(result, duplicate)
    set_incarnation(result, incarnation)
    return result


def _reply_life(raw: Any) -> int | None:
    """The incarnation an append reply carries (meta ``n``): None when the thread records
    none, or one that is not a number (damage `verify` reports; the append itself landed or
    was recorded, so it is not failed over it)."""
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None


# An append of one event without view ops is packed as one join of its pieces, the RESP
# headers of short arguments looked up in `_wire.BULK_HEADERS` rather than formatted (a
# %-format of the same command parses its format string on every call and costs half as much
# again).
_CRLF = b"\r\n"
_APPEND_EVENT = b"$%d\r\n%b\r\n" * 5
# A one-event append's arguments between its request digest and its event id: "1" event,
# "0" ops, then the expected incarnation, "-" (none) unless the writer names a life.
_ONE_NO_LIFE = b"\r\n$1\r\n1\r\n$1\r\n0\r\n$1\r\n-\r\n$16\r\n"


def _pack_append(
    head: bytes,
    exp: bytes,
    ikey: bytes,
    rdigest: bytes,
    life: bytes,
    encoded: Sequence[EncodedEvent],
) -> bytes:
    """An append of several events and no view ops, packed after the thread's memoized head."""
    n = b"%d" % len(encoded)
    parts = [
        b"*%d\r\n%b$%d\r\n%b\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$1\r\n0\r\n$%d\r\n%b\r\n"
        % (15 + 5 * len(encoded), head, len(exp), exp, len(ikey), ikey, len(rdigest), rdigest,
           len(n), n, len(life), life)
    ]  # fmt: skip
    for e in encoded:
        v, digest = b"%d" % e.version, e.digest.encode("ascii")
        parts.append(
            _APPEND_EVENT % (
                len(e.id_bytes), e.id_bytes, len(v), v, len(e.data), e.data, len(e.meta), e.meta,
                len(digest), digest,
            )
        )  # fmt: skip
    return b"".join(parts)


def _pack_stage(encode: Any, meta: str, stage: str, command: str, values: list[bytes]) -> bytes:
    """One chunk of a view load in RESP: ``HGET meta v``, ``command stage values...``,
    ``PEXPIRE stage <staging TTL>``; one %-format for all the values, no step per byte."""
    m, k, c = encode(meta), encode(stage), command.encode("ascii")
    ttl = b"%d" % (STAGING_TTL_S * 1000)
    n = len(values)
    flat: list[Any] = [b""] * (2 * n)
    flat[0::2] = map(len, values)
    flat[1::2] = values
    return b"".join(
        (
            b"*3\r\n$4\r\nHGET\r\n$%d\r\n%b\r\n$1\r\nv\r\n" % (len(m), m),
            b"*%d\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n" % (n + 2, len(c), c, len(k), k),
            (b"$%d\r\n%b\r\n" * n) % tuple(flat),
            b"*3\r\n$7\r\nPEXPIRE\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n" % (len(k), k, len(ttl), ttl),
        )
    )


SCAN_COUNT = 1000
"""Keys asked for per ``SCAN`` step while listing the threads the keys hold (audits only)."""


def _meta_version(thread_id: str, raw: Any) -> int:
    """A thread's version as its meta hash stores it (``v``; absent: 0). Anything but digits
    there is damage, reported for that thread as `CorruptEventError` (an audit of many threads
    reports it and goes on), not a bare ``ValueError``."""
    if raw is None:
        return 0
    if isinstance(raw, int):
        return raw
    if isinstance(raw, bytes) and raw.isdigit() and len(raw) <= 20:
        return int(raw)
    raise _damaged_version(thread_id, raw)


def _damaged_version(thread_id: str, raw: Any, also: str = "") -> CorruptEventError:
    return CorruptEventError(
        thread_id, None, f"its meta hash's version (field 'v') is {raw!r}, not a number: damaged "
        f"(run 'verify'){also}"
    )  # fmt: skip


def _recorded_partitions(key: str, recorded: Any) -> int:
    """The partition count a namespace's settings hash records, or `CorruptKeyError`."""
    raw = recorded if isinstance(recorded, bytes) else str(recorded).encode()
    if re.fullmatch(rb"[0-9]{1,5}", raw) is None or not 1 <= int(raw) <= MAX_PARTITIONS:
        raise CorruptKeyError(
            key,
            f"its partition count (field 'partitions') is {raw!r}, not a number in "
            f"1..{MAX_PARTITIONS}; set it back to the count the namespace was created with",
        )
    return int(raw)


def _index_rows(key: str, partition: int, rows: Any) -> list[ThreadInfo]:
    """`ThreadInfo`s of a thread index's ``(member, score)`` rows; a member or
    score threadlog cannot have written raises `CorruptKeyError` (nothing is skipped silently:
    a listing with holes would pass for a whole one)."""
    out = []
    for member, score in rows:
        try:
            thread_id = validate_thread_id(member.decode("utf-8"))
        except (UnicodeDecodeError, InvalidInputError):
            raise CorruptKeyError(
                key, f"it lists {member!r}, which is no thread id; remove it (ZREM)"
            ) from None
        ms = float(score)  # a float from redis-py, the text Redis formats in a script's reply
        if not ms.is_integer():  # inf, nan, a fraction
            raise CorruptKeyError(
                key,
                f"thread {thread_id!r} is listed with last activity {ms!r}, not a time in ms; "
                "remove it (ZREM) and rebuild the thread, which lists it again",
            )
        out.append(ThreadInfo(thread_id, int(ms), partition))
    return out


def _check_staged(thread_id: str, version: Any, expected_version: int) -> None:
    """Raise `ConcurrencyError` unless a chunk's read of the thread's version matches."""
    actual = _meta_version(thread_id, version)
    if actual != expected_version:
        raise ConcurrencyError(thread_id, expected_version, actual)


_ThreadMemo = tuple[
    KeyLayout, bytes, tuple[bytes, ...], bytes, dict[str, bytes], dict[tuple[bytes, ...], bytes]
]
"""What `RedisEventStore._memo_thread` keeps per thread: the key layout it was made for, the
thread id and its log, meta, feed and index keys encoded, the RESP head of an append without
view ops (empty off the direct path), its view keys encoded, by view, and the RESP heads of
its appends with view ops, by the view keys they name (both filled as used)."""


class _KeyIndex:
    """Numbers the view keys an op list touches, for the script's KEYS array (keys of one
    kind, all str or all encoded, as the base keys are)."""

    def __init__(self, base: list[Any]) -> None:
        self.keys = list(base)
        self._pos: dict[str | bytes, int] = {}

    def __call__(self, key: str | bytes) -> int:
        pos = self._pos.get(key)
        if pos is None:
            self.keys.append(key)
            pos = self._pos[key] = len(self.keys)  # Lua arrays are 1-based
        return pos


def _check_client(client: object) -> None:
    """`InvalidInputError` for a client the store cannot work through, before anything is
    sent: a decoding client's appends landed and were then reported failed (its replies are
    str), a synchronous one failed with TypeError at the first call, a URL with
    AttributeError."""
    if not isinstance(client, aioredis.Redis | RedisCluster):
        hint = ""
        if isinstance(client, redis.Redis | redis.RedisCluster):
            hint = ": a synchronous client; give a redis.asyncio one"
        elif isinstance(client, str):
            hint = ": a URL; eventstore.connect(url) opens a store from one"
        raise InvalidInputError(
            "RedisEventStore needs a redis.asyncio client (Redis or RedisCluster), not "
            f"{type(client).__name__}{hint}"
        )
    if client.get_encoder().decode_responses:
        raise InvalidInputError(
            "RedisEventStore needs a client made with decode_responses=False (redis-py's "
            "default): it reads replies as bytes"
        )


class _InFlight:
    """A store's call to Redis while it is in flight.

    - Counted (`RedisEventStore._calls`): `close` waits for such calls to end, then closes the
      connections they took from the pool meanwhile (which they give back connected).
    - One the store was closed under fails with `StoreClosedError`: `close` disconnects the
      connections in use, and redis-py then fails in whatever the call was doing (an
      AttributeError on a writer gone, a TypeError on a reader gone, a connection error),
      none of which says why.
    - A cancellation that came during the call is raised, if the call returned normally:
      Python 3.11's ``asyncio.wait_for``, which redis-py sends and connects through, returns
      its operation's result when the task is cancelled just as that completes, and the
      cancellation is lost (a caller's timeout never fires; 3.12 fixed it). Seen in about half
      of the cancellations of a read 0-1 ms in.
    """

    __slots__ = ("_cancels", "_store", "_task")

    def __init__(self, store: RedisEventStore) -> None:
        self._store = store

    def __enter__(self) -> None:
        if self._store._closed:  # none starts after close: `close` waits for those counted
            raise StoreClosedError("the store is closed")
        task = self._task = asyncio.current_task()
        self._cancels = 0 if task is None else task.cancelling()
        self._store._calls += 1

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        store = self._store
        store._calls -= 1
        if not store._calls and store._calls_ended is not None:
            store._calls_ended.set()
        if exc is None:
            task = self._task
            if task is not None and task.cancelling() > self._cancels:
                raise asyncio.CancelledError
        elif isinstance(exc, Exception):
            store._raise_if_closed_under(exc)


class RedisEventStore(EventStore):
    """The event log on Redis Streams.

    Build it with `eventstore.connect` (which also pins the namespace's partition count), or
    hand it a redis-py asyncio client (``decode_responses=False``) and ``await ensure_namespace()``;
    any other client (a decoding or synchronous one, a URL) is `InvalidInputError`.
    """

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        *,
        namespace: str = "default",
        partitions: int = DEFAULT_PARTITIONS,
        registry: EventRegistry | None = None,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        secret: bytes | None = None,
        owns_client: bool = True,
        max_batch: int = 64,
        load_chunk_values: int = LOAD_CHUNK_VALUES,
        load_chunk_bytes: int = LOAD_CHUNK_BYTES,
    ) -> None:
        _check_client(client)
        self.keys = KeyLayout(namespace, partitions)
        self.namespace = self.keys.namespace
        self.partitions = partitions
        self.registry = registry or default_registry
        self.max_event_bytes = max_event_bytes
        # The key the chain is linked with: derived for this namespace (`namespace_chain_key`).
        # An empty secret is refused, not taken as no key (`check_secret`).
        key = check_secret(secret)
        self._secret = None if key is None else namespace_chain_key(key, self.namespace)
        # Sent with every append (in the memoized part of the command): the script refuses a
        # thread created with another key.
        self._fingerprint = key_fingerprint(self._secret).encode("ascii")
        self._client: Any = client
        self._is_cluster = isinstance(client, RedisCluster)
        self._owns_client = owns_client
        self._closed = False
        self._calls = 0  # calls in flight through `_call`, waited for by `close`
        self._calls_ended: asyncio.Event | None = None  # set when they have, once closed
        # The event loop the store's connections belong to: the first one it was used in.
        self._loop: asyncio.AbstractEventLoop | None = None
        # Chunks of a view load are packed here and sent on a pool connection where that is
        # exactly what redis-py would send: a standalone client (RESP2, or RESP3 with push
        # messages told apart) with a pool. Packing
        # each value through redis-py's generic per-argument encoder costs more than the rest
        # of a chunk's client time; the cluster client keeps its pipeline.
        self._packs_chunks = packs_like_redis_py(client)
        # A view load (rebuild) above either limit goes in chunks of at most this size.
        self.load_chunk_values = max(2, load_chunk_values)
        self.load_chunk_bytes = max(1, load_chunk_bytes)
        # Connections held for the hot calls (appends, window and view reads), spoken to in
        # RESP directly where that is exact (`_wire`); None: everything goes through redis-py.
        self._held = HeldConnections(client) if can_hold(client) else None
        # Every append goes through it; with max_batch=1 it sends every call alone (group
        # commit off), but queues one whose thread is in flight behind it.
        self._group_commit = GroupCommit(client, APPEND, max_batch=max_batch, held=self._held)
        # thread id -> what its appends send (`_memo_thread`)
        self._append_keys: dict[str, _ThreadMemo] = {}
        # (partition's feed key, view name) this store recorded in the partition's
        # `KeyLayout.view_names` set
        self._views_recorded: set[tuple[bytes, str]] = set()
        self._evalsha = self._group_commit.script.sha.encode("ascii")

    def _check_usable(self) -> None:
        """`StoreClosedError` when the store is closed, or used from another event loop than
        its own.

        The connections belong to the loop the store was first used in. Used from another
        after that one closed (``asyncio.run`` twice), a call would fail inside redis-py
        (``RuntimeError: Event loop is closed``) and the next would reconnect by chance; from
        another loop while that one still runs (a thread of its own), a call was sent on the
        first loop's connections, landed, and then failed with a RuntimeError (a future of
        another loop), leaving the connection to its own loop's next call. Refused before
        anything is sent, either way.
        """
        if self._closed:
            raise StoreClosedError("the store is closed")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # the client property, read outside any loop (tooling)
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            if self._loop.is_closed():
                raise StoreClosedError(
                    "this store was opened in an event loop that has closed since (each "
                    "asyncio.run or anyio.run is a new loop): open the store in the loop that "
                    "uses it"
                )
            raise StoreClosedError(
                "this store belongs to the event loop it was opened in, which still runs: it "
                "was used from another (a thread's own loop); nothing was sent. Open a store "
                "in each loop that uses one, or hand the call to the store's own loop "
                "(asyncio.run_coroutine_threadsafe)"
            )

    async def _call(self, op: Awaitable[T], group: tuple[int, str] | None = None) -> T:
        """`_call` (`_group_call` for a command naming a consumer group, ``(partition, name)``),
        in flight as `_InFlight` says."""
        with _InFlight(self):
            return await (_call(op) if group is None else _group_call(op, *group))

    async def _pipeline_replies(self, pipe: Any) -> list[Any]:
        """A pipeline's replies, sent by `_call`, checked by `_replies_checked`."""
        return _replies_checked(await self._call(_pipeline_executed(pipe)))

    def _raise_if_closed_under(self, exc: Exception) -> None:
        """`StoreClosedError` (from ``exc``) if the store was closed meanwhile and ``exc`` is
        not an answer of the server's (a conflict, a refusal)."""
        if not self._closed or isinstance(exc, StoreClosedError | rex.ResponseError):
            return
        if not isinstance(exc, EventStoreError) or type(exc) in _CONNECTION_FAILURES:
            raise StoreClosedError.in_flight() from exc

    @property
    def client(self) -> Any:
        """The underlying redis-py client (for tests and tooling)."""
        self._check_usable()
        return self._client

    async def ensure_namespace(
        self, *, explicit_partitions: bool = False, create: bool = True
    ) -> None:
        """Record this namespace's partition count, or adopt the one already recorded.

        The count is fixed for the life of a namespace because it decides where every thread's
        keys live. Raises `InvalidInputError` if ``explicit_partitions`` and the recorded count
        differs from this store's. With ``create=False`` (a reader's store) a namespace with no
        count recorded is left unrecorded: it has never been written, so it reads as empty
        with any count, and a misspelt name leaves nothing behind. Raises `CorruptKeyError`
        when the recorded count is not a count (``abc``, ``0``): guessing one would put every
        thread's keys somewhere else.
        """
        key = KeyLayout.config_key(self.namespace)
        recorded = await self._call(self.client.hget(key, "partitions"))
        if recorded is None and not create:
            return
        if recorded is None:
            with _InFlight(self):
                try:
                    await self.client.hsetnx(key, "partitions", self.partitions)
                except rex.NoPermissionError:
                    # A user with read-only rights (an auditor) cannot record the count. A
                    # namespace with no count recorded has never been written, so this store's
                    # own count reads it as well as any other.
                    return
                except (rex.RedisError, rex.RedisClusterException, OSError) as exc:
                    raise translate_redis_error(exc) from exc
            recorded = await self._call(self.client.hget(key, "partitions"))
        stored = _recorded_partitions(key, recorded)
        if stored != self.partitions:
            if explicit_partitions:
                raise InvalidInputError(
                    f"namespace {self.namespace!r} has {stored} partitions, not {self.partitions}"
                )
            self.keys = KeyLayout(self.namespace, stored)
            self.partitions = stored

    # -- append ---------------------------------------------------------------------------------

    async def append(
        self,
        thread_id: str,
        events: Sequence[Event | NewEvent],
        *,
        expected_version: ExpectedVersion = ANY,
        idempotency_key: str | None = None,
        view_ops: Sequence[ViewOp] = (),
        expected_incarnation: int | None = None,
    ) -> AppendResult:
        # (Anything but a str is refused by `_memo_thread`'s validation, unhashable ids too.)
        memo = self._append_keys.get(thread_id) if isinstance(thread_id, str) else None
        if memo is None or memo[0] is not self.keys:
            memo = self._memo_thread(thread_id)
        _, thread, thread_keys, head, view_keys, op_heads = memo
        encoded, rdigest = encode_append(
            thread_id,
            events,
            self.registry,
            max_event_bytes=self.max_event_bytes,
            secret=self._secret,
            thread_valid=True,  # by `_memo_thread`
        )
        if type(expected_version) is int and expected_version >= 0:
            exp = b"%d" % expected_version
        else:
            exp = expected_version_arg(expected_version).encode("ascii")
        # No life, or a plain int life, without a call (every append takes this path); the
        # rest (refused, or an int subclass) through the validation.
        if expected_incarnation is None:
            life = b"-"
        elif type(expected_incarnation) is int and expected_incarnation >= 1:
            life = b"%d" % expected_incarnation
        else:
            life = expected_incarnation_arg(expected_incarnation)
        ops = list(view_ops) if view_ops else []
        if ops:
            check_ops(ops, len(encoded), in_append=True)
        if idempotency_key is None:
            ikey = b"e" + encoded[0].id_bytes  # `idempotency_key_for`, inlined for the default
        else:
            ikey = idempotency_key_for(idempotency_key, encoded[0].id_bytes)

        # Arguments go as the bytes redis-py would send: its per-argument encoding is a large
        # share of an append's client time. Numbers and ASCII tokens are formatted here, the
        # thread's keys come encoded from a per-thread memo. On the direct path an append
        # without view ops is packed here whole: the thread's part of the command is memoized
        # as RESP, and the rest is joined (one event) or formatted (several) after it.
        call: Any
        keys: Any = thread_keys  # with the view keys, when there are ops
        unrecorded: list[str] = []
        if head and not ops:
            if len(encoded) == 1:
                e = encoded[0]
                v, data, meta = b"%d" % e.version, e.data, e.meta
                b = BULK_HEADERS
                n_ikey, n_data, n_meta = len(ikey), len(data), len(meta)
                # The thread's head (to its chain key fingerprint), expected version,
                # idempotency key, request digest, "1" event, "0" ops, expected incarnation,
                # then the event's id, version, data, meta and digest. Fixed lengths by
                # construction: request digest 8 bytes, id 16, content digest 32 hex digits.
                mid = _ONE_NO_LIFE if expected_incarnation is None else (
                    b"\r\n$1\r\n1\r\n$1\r\n0\r\n$%d\r\n%b\r\n$16\r\n" % (len(life), life)
                )  # fmt: skip
                call = b"".join((
                    b"*20\r\n", head, b[len(exp)], exp, _CRLF,
                    b[n_ikey] if n_ikey < 1024 else b"$%d\r\n" % n_ikey, ikey,
                    b"\r\n$8\r\n", rdigest, mid, e.id_bytes,
                    _CRLF, b[len(v)], v, _CRLF,
                    b[n_data] if n_data < 1024 else b"$%d\r\n" % n_data, data, _CRLF,
                    b[n_meta] if n_meta < 1024 else b"$%d\r\n" % n_meta, meta,
                    b"\r\n$32\r\n", e.digest.encode(), _CRLF,
                ))  # fmt: skip
            else:
                call = _pack_append(head, exp, ikey, rdigest, life, encoded)
        else:
            keys = list(thread_keys)
            args: list[Any] = [
                thread, self._fingerprint, exp, ikey, rdigest, b"%d" % len(encoded),
                b"%d" % len(ops), life,
            ]  # fmt: skip
            for e in encoded:
                args += (e.id_bytes, b"%d" % e.version, e.data, e.meta, e.digest.encode("ascii"))
            if ops:
                index = _KeyIndex(keys)
                for op in ops:
                    args += self._op_args(thread_id, op, index, view_keys)
                # The names of views this store has not recorded in the partition's set yet
                # (`KeyLayout.view_names`, what `delete_thread` deletes), recorded by the
                # script in the same atomic step as the write (the feed key names the
                # partition).
                unrecorded = self._unrecorded_views(thread_keys[2], ops)
                if unrecorded:
                    partition = self.keys.partition(thread_id)
                    k = b"%d" % index(self.keys.view_names(partition).encode("utf-8"))
                    for name in unrecorded:
                        args += (b"vn", k, name.encode("utf-8"))
                    args[6] = b"%d" % (len(ops) + len(unrecorded))
                keys = index.keys
            # On the direct path packed now, as an append without ops is: at send time a
            # batch holding an unpacked call is joined only after a failed attempt. What
            # comes before the expected version (EVALSHA, keys, thread id, fingerprint) is
            # the same for every append of the thread that names the same views: memoized.
            if head:
                named = tuple(keys[4:])
                op_head = op_heads.get(named)
                if op_head is None:
                    op_head = self._append_head(keys, thread)
                    if len(op_heads) < _VIEW_KEYS_MEMO:
                        op_heads[named] = op_head
                call = b"*%d\r\n%b%b" % (len(keys) + len(args) + 3, op_head, pack_bulks(args[2:]))
            else:
                call = (keys, args)
        self._check_usable()
        try:
            # Counted in flight: `close` waits for it (the cluster client, which it sends on,
            # would otherwise connect again after close).
            with _InFlight(self):
                reply = await self._group_commit.submit(thread_keys[0], call)
        # RedisClusterException (e.g. "cannot be connected") is not a RedisError subclass.
        except (rex.RedisError, rex.RedisClusterException, OSError) as exc:
            raise translate_redis_error(exc) from exc
        status = reply[0]
        if status == b"ok":
            if unrecorded:
                self._views_recorded.update((thread_keys[2], name) for name in unrecorded)
            try:  # inline: `_reply_life` is a call more on every append
                life_now = int(reply[4])
            except ValueError:
                life_now = None  # a damaged "n" (verify reports it); the append landed
            return _append_result(thread_id, int(reply[1]), int(reply[2]), False, life_now)
        if status == b"dup":
            life_now = _reply_life(reply[3]) if len(reply) > 3 else None
            return _append_result(thread_id, int(reply[1]), int(reply[2]), True, life_now)
        if status == b"conflict":
            raise ConcurrencyError(thread_id, expected_version, int(reply[1]))
        if status == b"life":
            raise _other_life(thread_id, expected_version, expected_incarnation, reply)
        if status == b"reused":
            raise IdempotencyKeyReusedError(
                thread_id, idempotency_key_text(idempotency_key, encoded[0].id)
            )
        if status == b"key":
            raise ChainKeyMismatchError(
                thread_id, reply[1] != UNKEYED_FINGERPRINT.encode(), bool(self._secret)
            )
        if status == b"meta":
            raise _damaged_version(thread_id, reply[1], "; nothing was appended")
        if status == b"lost":
            raise log_without_meta(thread_id, "; nothing was appended")
        if status == b"nohead":
            raise CorruptEventError(
                thread_id, None, "its meta hash records no chain head (field 'h' was removed): "
                "damaged (run 'verify'); nothing was appended"
            )  # fmt: skip
        if status == b"view":
            key = keys[int(reply[1]) - 1].decode("utf-8")
            view = key.split(":view:", 1)[1].split(":", 1)[0]
            raise ViewConflictError(
                thread_id, view, reply[2].decode("utf-8"), int(reply[3]), int(reply[4])
            )
        raise OperationalError(f"unexpected append reply {reply!r}")

    def _memo_thread(self, thread_id: str) -> _ThreadMemo:
        """Validate the thread id and memoize, per thread (bounded) and per layout (which
        `ensure_namespace` may swap), what its appends send: the thread id and its log, meta,
        feed and index keys, encoded as the client encodes, and on the direct path (else empty)
        the RESP of ``EVALSHA <sha> 4 <keys> <thread id> <key fingerprint>``, which begins
        each of its appends without view ops.
        """
        validate_thread_id(thread_id)
        encode = self._client.get_encoder().encode
        thread = encode(thread_id)
        keys = tuple(encode(k) for k in self.keys.thread_keys(thread_id))
        head = self._append_head(keys, thread) if self._group_commit.packs else b""
        if len(self._append_keys) >= _APPEND_KEYS_MEMO:
            self._append_keys.clear()
        memo = self._append_keys[thread_id] = (self.keys, thread, keys, head, {}, {})
        return memo

    def _append_head(self, keys: Sequence[bytes], thread: bytes) -> bytes:
        """The RESP of an append's ``EVALSHA <sha> <numkeys> <keys> <thread id> <key
        fingerprint>``, without the array header: what the thread's appends naming the same
        keys share."""
        return evalsha_prefix(self._evalsha) + pack_bulks(
            (b"%d" % len(keys), *keys, thread, self._fingerprint)
        )

    def _unrecorded_views(self, feed: bytes, ops: Sequence[ViewOp]) -> list[str]:
        """The names of the views ``ops`` write that this store has not recorded in the
        partition's view-name set (the partition named by its ``feed`` key), each once."""
        recorded = self._views_recorded
        return [
            name for name in dict.fromkeys(op.view for op in ops) if (feed, name) not in recorded
        ]

    async def _record_views(self, thread_id: str, ops: Sequence[ViewOp]) -> None:
        """Record the names of the views ``ops`` write in the thread's partition's
        `KeyLayout.view_names` set, before they are written (once per store and name): for
        view loads; an append records them in its own script."""
        partition = self.keys.partition(thread_id)
        feed = self.keys.feed(partition).encode("utf-8")  # names the partition, as in append
        new = self._unrecorded_views(feed, ops)
        if not new:
            return
        for name in new:
            self.keys.view(thread_id, name)  # validated before anything is sent
        self._check_usable()
        await self._call(self.client.sadd(self.keys.view_names(partition), *new))
        self._views_recorded.update((feed, name) for name in new)

    def _op_args(
        self, thread_id: str, op: ViewOp, index: _KeyIndex, view_keys: dict[str, bytes]
    ) -> list[Any]:
        """The script's arguments for ``op`` (`append.lua`), as bytes where the op's own are
        not: its view key, encoded once per thread and view (``view_keys``), goes to KEYS."""
        key = view_keys.get(op.view)
        if key is None:
            key = self.keys.view(thread_id, op.view).encode("utf-8")
            if len(view_keys) < _VIEW_KEYS_MEMO:
                view_keys[op.view] = key
        k = b"%d" % index(key)
        if isinstance(op, ListPush | ListReset):
            code = b"lp" if isinstance(op, ListPush) else b"lr"
            return [code, k, b"%d" % op.event, b"%d" % len(op.values), *op.values]
        if isinstance(op, ListPop):
            return [b"lo", k, b"%d" % op.count]
        if isinstance(op, HashSet):
            exp = b"" if op.expected_version is None else b"%d" % op.expected_version
            return [b"hs", k, op.field.encode("utf-8"), op.value, b"%d" % op.event, exp]
        if isinstance(op, HashDelete):
            exp = b"" if op.expected_version is None else b"%d" % op.expected_version
            return [b"hd", k, op.field.encode("utf-8"), exp]
        if isinstance(op, ViewClear):
            return [b"vc", k]
        raise InvalidInputError(f"{type(op).__name__} is not valid inside an append")

    # -- reads ----------------------------------------------------------------------------------

    async def version(self, thread_id: str) -> int:
        validate_thread_id(thread_id)
        raw = await self._command("HGET", self.keys.meta(thread_id), "v")
        return _meta_version(thread_id, raw)

    async def versions(self, thread_ids: Sequence[str]) -> list[int]:
        ids = thread_id_list(thread_ids)
        if not ids:
            return []
        if self._is_cluster:
            # redis-py's cluster pipeline sends each node its commands in one go.
            pipe = self.client.pipeline(transaction=False)
            for thread_id in ids:
                pipe.hget(self.keys.meta(thread_id), "v")
            replies = await self._pipeline_replies(pipe)
        else:
            commands = [(b"HGET", self.keys.meta(t), b"v") for t in ids]
            replies = await self._raw_replies(commands)
        out = []
        for thread_id, raw in zip(ids, replies, strict=True):
            if isinstance(raw, Exception):
                raise translate_redis_error(raw) from raw
            out.append(_meta_version(thread_id, raw))
        return out

    async def chain_key_fingerprint(self, thread_id: str) -> str | None:
        validate_thread_id(thread_id)
        return _fingerprint_of(await self._command("HGET", self.keys.meta(thread_id), "f"))

    async def incarnation(self, thread_id: str) -> int | None:
        validate_thread_id(thread_id)
        n, v = await self._command("HMGET", self.keys.meta(thread_id), "n", "v")
        return _life_of(thread_id, n, v)

    async def chain_head(self, thread_id: str) -> ChainHead | None:
        validate_thread_id(thread_id)
        v, h, s, c = await self._command("HMGET", self.keys.meta(thread_id), "v", "h", "s", "c")
        return _chain_head_of(thread_id, v, h, s, c)

    async def meta_snapshot(self, thread_id: str) -> MetaSnapshot:
        validate_thread_id(thread_id)
        meta = self.keys.meta(thread_id)
        index = self.keys.index(self.keys.partition(thread_id))
        fields = (b"n", b"v", b"f", b"h", b"s", b"c")
        if self._is_cluster:  # one slot: the cluster pipeline sends both in one go
            pipe = self.client.pipeline(transaction=False)
            pipe.hmget(meta, list(fields))
            pipe.zscore(index, thread_id)
            found, score = await self._call(_pipeline_executed(pipe))
        else:
            found, score = await self._raw_replies(
                [(b"HMGET", meta, *fields), (b"ZSCORE", index, thread_id)]
            )
        parts: dict[str, object] = {}
        if isinstance(found, Exception):
            damage = _stored_damage(found)
            for name in ("incarnation", "version", "chain_key_fingerprint", "chain_head"):
                parts[name] = damage
        else:
            n, v, f, h, s, c = found
            parses: dict[str, Callable[[], object]] = {
                "incarnation": lambda: _life_of(thread_id, n, v),
                "version": lambda: _meta_version(thread_id, v),
                "chain_key_fingerprint": lambda: _fingerprint_of(f),
                "chain_head": lambda: _chain_head_of(thread_id, v, h, s, c),
            }
            for name, parse in parses.items():
                try:
                    parts[name] = parse()
                except CorruptEventError as exc:  # as its own read raises it, when asked
                    parts[name] = exc
        parts["indexed"] = (
            _stored_damage(score) if isinstance(score, Exception) else (score is not None)
        )
        return MetaSnapshot(thread_id, parts)

    async def recorded_append(self, thread_id: str, idempotency_key: str) -> AppendResult | None:
        validate_thread_id(thread_id)
        ikey = caller_key_field(idempotency_key)
        raw, n = await self._command("HMGET", self.keys.meta(thread_id), ikey, "n")
        if raw is None:
            return None
        first, last = parse_ledger_entry(thread_id, raw)
        return _append_result(thread_id, first, last, True, _reply_life(n))

    async def recorded_appends(
        self, thread_id: str, idempotency_keys: Sequence[str]
    ) -> dict[str, AppendResult]:
        validate_thread_id(thread_id)
        keys = key_list(idempotency_keys)
        found: dict[str, AppendResult] = {}
        meta = self.keys.meta(thread_id)
        # The ledger is the meta hash: its fields read in chunks (one HMGET of thousands of
        # fields would hold the server for as long as it takes to answer).
        for start in range(0, len(keys), LEDGER_READ_CHUNK):
            chunk = keys[start : start + LEDGER_READ_CHUNK]
            *raws, n = await self._command(
                "HMGET", meta, *(caller_key_field(k) for k in chunk), "n"
            )
            for key, raw in zip(chunk, raws, strict=True):
                if raw is not None:
                    first, last = parse_ledger_entry(thread_id, raw)
                    found[key] = _append_result(thread_id, first, last, True, _reply_life(n))
        return found

    async def _command(self, *parts: Any) -> Any:
        """One command whose reply redis-py would not reshape (no reply callback), on the held
        connections when there are some. Error replies raise translated."""
        if self._held is None:
            return await self._call(self.client.execute_command(*parts))
        self._check_usable()
        (reply,) = await self._call(self._held.exchange(pack_command(parts), 1))
        if isinstance(reply, Exception):
            raise translate_redis_error(reply) from reply
        return reply

    async def read_raw(
        self,
        thread_id: str,
        *,
        start: int = 1,
        stop: int | None = None,
        count: int = READ_BATCH,
        incarnation: int | None = None,
    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        validate_thread_id(thread_id)
        validate_seq_range(start, stop)
        validate_feed_count(count)
        hi = _upper(stop)
        log, lo = self.keys.log(thread_id), _lower(start)
        if incarnation is None:
            rows = await self._call(self.client.xrange(log, lo, hi, count=count))
        else:
            life, rows = await self._transaction(
                [
                    ("HMGET", self.keys.meta(thread_id), "n", "v"),
                    ("XRANGE", log, lo, hi, "COUNT", count),
                ]
            )
            for reply in (life, rows):
                if isinstance(reply, Exception):
                    raise translate_redis_error(reply)
            if not _in_life(thread_id, life, incarnation, start, stop, rows):
                return []
        return [(entry_id, _as_dict(fields)) for entry_id, fields in rows]

    async def read_raw_ranges(
        self, ranges: Sequence[RawRange], *, count: int = READ_BATCH
    ) -> list[list[tuple[bytes, Any]]]:
        validate_feed_count(count)
        if self._is_cluster or not ranges:
            # A cluster's ranges live on several nodes: one read_raw each, as before.
            return await super().read_raw_ranges(ranges, count=count)
        keys = self.keys
        commands: list[tuple[Any, ...]] = []
        for r in ranges:
            validate_thread_id(r.thread_id)
            validate_seq_range(r.start, r.stop)
            hi = _upper(r.stop)
            xrange = (
                b"XRANGE",
                keys.log(r.thread_id),
                _lower(r.start),
                hi,
                b"COUNT",
                count,
            )
            if r.incarnation is None:
                commands.append(xrange)
            else:
                # Check and read in a MULTI/EXEC block of their own: atomic, without holding
                # the server for all the ranges.
                commands += [
                    (b"MULTI",),
                    (b"HMGET", keys.meta(r.thread_id), b"n", b"v"),
                    xrange,
                    (b"EXEC",),
                ]
        replies = iter(await self._raw_replies(commands))
        out: list[list[tuple[bytes, Any]]] = []
        for r in ranges:
            if r.incarnation is None:
                rows = next(replies)
            else:
                *queued, executed = (next(replies) for _ in range(4))  # OK QUEUED QUEUED [...]
                for reply in (*queued, executed):
                    if isinstance(reply, Exception):  # refused when queued: EXECABORT
                        raise translate_redis_error(reply) from reply
                life, rows = executed
                if isinstance(life, Exception):
                    raise translate_redis_error(life) from life
                if not isinstance(rows, Exception) and not _in_life(
                    r.thread_id, life, r.incarnation, r.start, r.stop, rows
                ):
                    rows = []
            if isinstance(rows, Exception):
                raise translate_redis_error(rows) from rows
            out.append(rows)
        return out

    async def _raw_replies(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Replies to ``commands`` sent as one pipeline, as hiredis builds them (no reply
        callbacks: entries stay flat lists); error replies in their commands' places."""
        self._check_usable()
        if self._held is not None:
            payload = b"".join([pack_command(c) for c in commands])
            return await self._call(self._held.exchange(payload, len(commands)))
        # Command names as bytes and an empty callback table: redis-py reshapes nothing.
        pipe = aioredis.client.Pipeline(self.client.connection_pool, {}, False, None)
        for command in commands:
            pipe.execute_command(*command)
        return list(await self._call(_pipeline_executed(pipe)))

    async def read(
        self,
        thread_id: str,
        *,
        start: int = 1,
        stop: int | None = None,
        backwards: bool = False,
        limit: int | None = None,
    ) -> AsyncIterator[RecordedEvent]:
        validate_thread_id(thread_id)
        validate_limit(limit)
        validate_seq_range(start, stop)
        remaining = limit
        lo = max(start, 1)
        hi_id, lo_id = _upper(stop), _lower(lo)
        first_life: _Life | None = None
        while remaining is None or remaining > 0:
            count = READ_BATCH if remaining is None else min(READ_BATCH, remaining)
            life, rows = await self._page(thread_id, lo_id, hi_id, count, backwards=backwards)
            first_life = _same_life(thread_id, first_life, life)
            try:
                events = decode_rows(thread_id, rows, self.registry)
            except CorruptEventError:
                # The events before the damaged entry are still given, one at a time, then
                # its error: a reader can step past it (read on from the next seq).
                for row in rows:
                    yield decode_rows(thread_id, [row], self.registry)[0]
                raise
            for event in events:
                yield event
            if len(rows) < count:
                return
            if remaining is not None:
                remaining -= len(rows)
            if backwards:
                last_seq = int(rows[-1][0].split(b"-", 1)[0])
                if last_seq <= lo:
                    return
                hi_id = b"%d-0" % (last_seq - 1)
            else:
                lo_id = b"(" + rows[-1][0]

    async def read_batches(
        self, thread_id: str, *, start: int = 1, stop: int | None = None
    ) -> AsyncIterator[list[RecordedEvent]]:
        validate_thread_id(thread_id)
        validate_seq_range(start, stop)
        hi = _upper(stop)
        first_life: _Life | None = None
        pending: asyncio.Task[tuple[_Life, list[Any]]] | None
        pending = self._fetch_ahead(thread_id, _lower(start), hi)
        try:
            while pending is not None:
                life, rows = await pending
                first_life = _same_life(thread_id, first_life, life)
                pending = self._fetch_next(thread_id, rows, hi)
                if pending is not None:
                    await asyncio.sleep(0)  # the read-ahead's command goes out now
                if rows:
                    with paused_collector():
                        batch = decode_rows(thread_id, rows, self.registry)
                    del rows  # not held while the caller folds the batch
                    yield batch
                    del batch  # nor while the next one is read
        finally:
            await _cancel(pending)

    async def fold_payloads(
        self,
        thread_id: str,
        fold: Callable[[list[PayloadRow]], None],
        *,
        start: int = 1,
        stop: int | None = None,
    ) -> None:
        validate_thread_id(thread_id)
        validate_seq_range(start, stop)
        hi = _upper(stop)
        first_life: _Life | None = None
        pending: asyncio.Task[tuple[_Life, list[Any]]] | None
        pending = self._fetch_ahead(thread_id, _lower(start), hi)
        try:
            while pending is not None:
                life, rows = await pending
                first_life = _same_life(thread_id, first_life, life)
                pending = self._fetch_next(thread_id, rows, hi)
                if pending is not None:
                    await asyncio.sleep(0)  # the read-ahead's command goes out now
                # Decoded and folded with the collector paused, and dropped before it resumes
                # (see `paused_collector`): nothing is left for a collection to promote.
                with paused_collector():
                    if rows:
                        fold(decode_payload_rows(thread_id, rows, self.registry))
                    del rows
        finally:
            await _cancel(pending)

    def _fetch_ahead(
        self, thread_id: str, lo: bytes, hi: bytes
    ) -> asyncio.Task[tuple[_Life, list[Any]]]:
        return asyncio.ensure_future(self._page(thread_id, lo, hi, READ_BATCH))

    def _fetch_next(
        self, thread_id: str, rows: list[Any], hi: bytes
    ) -> asyncio.Task[tuple[_Life, list[Any]]] | None:
        """The read of the batch after ``rows``, started now (None after the last batch).

        Read ahead: the next batch travels and the server answers it while this one is
        decoded and folded.
        """
        if len(rows) < READ_BATCH:
            return None
        return self._fetch_ahead(thread_id, b"(" + rows[-1][0], hi)

    async def _page(
        self, thread_id: str, lo: bytes, hi: bytes, count: int, *, backwards: bool = False
    ) -> tuple[_Life, list[Any]]:
        """One page of the thread's log, with its life (`_Life`) read in the same atomic step,
        so that a read of several pages can tell the thread was deleted between two of them.

        Sent on a pooled connection (not the held ones appends use: a page can be large).
        """
        log, meta = self.keys.log(thread_id), self.keys.meta(thread_id)
        bounds = (hi, lo) if backwards else (lo, hi)
        pipe = self.client.pipeline(transaction=True)
        if self._is_cluster:
            # The cluster client needs str names to find the keys' slot (the reply callback
            # then makes a dict per entry, which `decode_rows` takes too).
            pipe.execute_command("HMGET", meta, "n", "v")
            pipe.execute_command(
                "XREVRANGE" if backwards else "XRANGE", log, *bounds, "COUNT", count
            )
        else:
            # Bytes names: redis-py applies no reply callback, so entries come as hiredis
            # builds them (flat field lists), about a microsecond an event cheaper.
            pipe.execute_command(b"HMGET", meta, b"n", b"v")
            pipe.execute_command(
                b"XREVRANGE" if backwards else b"XRANGE", log, *bounds, b"COUNT", count
            )
        life, rows = await self._pipeline_replies(pipe)
        n, v = life
        return (n, v is not None), rows

    async def seq_at(self, thread_id: str, time_ms: int) -> int:
        validate_thread_id(thread_id)
        validate_int(time_ms, "time_ms")
        keys = [self.keys.log(thread_id), self.keys.meta(thread_id)]
        reply = await self._call(SEQ_AT(self.client, keys, [int(time_ms)]))
        if isinstance(reply, list):
            if reply[0] == b"entry":  # {'entry', id, s}: an entry's time is not a number
                raise damaged_time(thread_id, reply[1], reply[2] if len(reply) > 2 else None)
            if reply[0] == b"twice":  # {'twice', id}: an entry holds its time field twice
                raise damaged_time(thread_id, reply[1], None, twice=True)
            if reply[0] == b"missing":  # {'missing', seq, v}: the version holds it, the log not
                raise missing_entry(thread_id, int(reply[1]), int(reply[2]))
            if reply[0] == b"nometa":  # a log, and no version: its meta hash is gone
                raise log_without_meta(thread_id)
            raise _damaged_version(thread_id, reply[1])  # {'meta', v}
        return int(reply)

    # -- views ----------------------------------------------------------------------------------

    async def read_list(
        self, thread_id: str, view: str, start: int = 0, stop: int = -1
    ) -> list[ViewEntry]:
        validate_thread_id(thread_id)
        validate_int(start, "start")
        validate_int(stop, "stop")
        try:
            raw = await self._command(
                "LRANGE", self.keys.view(thread_id, view), redis_index(start), redis_index(stop)
            )
        except OperationalError as exc:
            if "WRONGTYPE" in str(exc):
                await self._check_view_type(thread_id, view)
                return []  # a view of the other kind reads as empty, as in read_views
            raise
        result = decode_view_result(thread_id, ListRange(view, start, stop), raw)
        assert isinstance(result, list)
        return result

    async def _check_view_type(self, thread_id: str, view: str) -> None:
        """Raise `UnstampedViewError` if the view's key is of a type no view ever is (a
        string, a set: written from outside threadlog), which would otherwise read as an
        empty view, without a word."""
        kind = await self._command("TYPE", self.keys.view(thread_id, view))
        kind = kind.decode("ascii", "replace") if isinstance(kind, bytes) else str(kind)
        if kind not in _VIEW_TYPES:
            raise _foreign_view(thread_id, view, kind)

    async def read_views(self, thread_id: str, reads: Sequence[ViewRead]) -> ViewSnapshot:
        validate_thread_id(thread_id)
        reads = check_reads(reads)
        if not self._is_cluster and all(isinstance(r, _PLAIN_READS) for r in reads):
            return await self._read_views_multi(thread_id, reads)
        index = _KeyIndex([self.keys.meta(thread_id)])
        args: list[Any] = [len(reads)]
        views: dict[int, str] = {}  # KEYS index -> view name, for a key of no view's type
        for r in reads:
            k = index(self.keys.view(thread_id, r.view))
            views[k] = r.view
            if isinstance(r, ListRange):
                args += ("lr", k, redis_index(r.start), redis_index(r.stop))
            elif isinstance(r, HashGetAll):
                args += ("ha", k)
            elif isinstance(r, HashGet):
                args += ("hg", k, len(r.fields), *r.fields)
            else:  # HashGetListed (`check_reads` refused anything else)
                lk = index(self.keys.view(thread_id, r.list_view))
                views[lk] = r.list_view
                args += ("hl", k, lk, redis_index(r.start), redis_index(r.stop))
        try:
            reply = await self._call(READ_VIEWS(self.client, index.keys, args))
        except WrongKeyTypeError as exc:
            found = _FOREIGN_VIEW_KEY.search(str(exc))
            if found is None or int(found[1]) not in views:
                raise
            raise _foreign_view(thread_id, views[int(found[1])], found[2]) from None
        results: list[ViewResult] = []
        for r, raw in zip(reads, reply[1:-1], strict=True):
            results.append(decode_view_result(thread_id, r, raw))
        return ViewSnapshot(_meta_version(thread_id, reply[0]), results, _reply_life(reply[-1]))

    async def _read_views_multi(self, thread_id: str, reads: Sequence[ViewRead]) -> ViewSnapshot:
        # Plain reads in MULTI/EXEC: the same atomic snapshot as the script, without Lua
        # copying every value (a 1,000-value list costs ~10x less on the server).
        commands: list[tuple[Any, ...]] = [("HMGET", self.keys.meta(thread_id), "v", "n")]
        for r in reads:
            key = self.keys.view(thread_id, r.view)
            if isinstance(r, ListRange):
                commands.append(("LRANGE", key, redis_index(r.start), redis_index(r.stop)))
            elif isinstance(r, HashGetAll):
                commands.append(("HGETALL", key))
            elif isinstance(r, HashGet):
                # EXISTS for no fields keeps the reply positions aligned.
                commands.append(("HMGET", key, *r.fields) if r.fields else ("EXISTS", key))
        replies = await self._transaction(commands)
        meta = replies[0]
        if isinstance(meta, Exception):
            raise translate_redis_error(meta)
        version, life = meta
        # As the script: a meta without a version is no thread, whatever life it still names.
        incarnation = None if version is None else _reply_life(life)
        results: list[ViewResult] = []
        for r, raw in zip(reads, replies[1:], strict=True):
            if isinstance(raw, Exception):
                if "WRONGTYPE" not in str(raw):
                    raise translate_redis_error(raw)
                # A view of the other kind reads as empty, as in the script; a key of no
                # view's type is damage (asked after the snapshot: only on this path).
                await self._check_view_type(thread_id, r.view)
                raw = []
            if isinstance(r, HashGet):
                values = raw if isinstance(raw, list) else []
                raw = [
                    x
                    for f, v in zip(r.fields, values, strict=False)
                    if v is not None
                    for x in (f.encode("utf-8"), v)
                ]
            elif isinstance(r, HashGetAll) and isinstance(raw, dict):
                raw = [x for kv in raw.items() for x in kv]
            results.append(decode_view_result(thread_id, r, raw))
        return ViewSnapshot(_meta_version(thread_id, version), results, incarnation)

    async def _transaction(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """The commands in one MULTI/EXEC; their replies, an error reply in its command's place."""
        if self._held is None:
            pipe = self.client.pipeline(transaction=True)
            for command in commands:
                pipe.execute_command(*command)
            return list(await self._call(_pipeline_executed(pipe)))
        self._check_usable()
        payload = b"".join([_MULTI, *(pack_command(c) for c in commands), _EXEC])
        replies = await self._call(self._held.exchange(payload, len(commands) + 2))
        executed = replies[-1]
        if isinstance(executed, Exception):  # EXECABORT: a command was refused when queued
            raise translate_redis_error(next(r for r in replies if isinstance(r, Exception)))
        return list(executed)

    async def load_views(
        self,
        thread_id: str,
        ops: Sequence[ViewOp],
        *,
        expected_version: int,
        expected_incarnation: int | None = None,
    ) -> None:
        validate_thread_id(thread_id)
        life = expected_incarnation_arg(expected_incarnation)
        values = size = 0
        sizes: list[list[int]] = []  # per op: the bytes of each value (hash: field and value)
        for op in ops:
            self.keys.view(thread_id, op.view)  # validates the name before anything is sent
            # Mapped, not a comprehension: no Python step per value (a rebuild loads ~1 a event).
            if isinstance(op, ListLoad):
                sizes.append(list(map(len, map(_VALUE, op.entries))))
                values += len(op.entries)
            elif isinstance(op, HashLoad):
                lengths = map(len, map(_VALUE, op.entries.values()))
                sizes.append(list(map(operator.add, map(len, op.entries), lengths)))
                values += 2 * len(op.entries)
            elif isinstance(op, ViewClear):
                sizes.append([])
            else:
                raise InvalidInputError(f"{type(op).__name__} cannot be loaded outside an append")
            size += sum(sizes[-1])
        await self._record_views(thread_id, ops)
        if expected_version > 0 and (
            values > self.load_chunk_values or size > self.load_chunk_bytes
        ):
            await self._load_views_chunked(
                thread_id, ops, sizes, expected_version, expected_incarnation
            )
            return
        index = _KeyIndex([self.keys.meta(thread_id)])
        args: list[Any] = [expected_version, life, len(ops)]
        for op in ops:
            k = index(self.keys.view(thread_id, op.view))
            if isinstance(op, ListLoad):
                args += ("ll", k, len(op.entries))
                args += [stamp_list_value(e.seq, e.value) for e in op.entries]
            elif isinstance(op, HashLoad):
                args += ("hl", k, len(op.entries))
                for field, e in op.entries.items():
                    args += (field, stamp_hash_value(e.version, e.seq, e.value))
            elif isinstance(op, ViewClear):
                args += ("vc", k)
            else:
                raise InvalidInputError(f"{type(op).__name__} cannot be loaded outside an append")
        self._index_last(index, args, thread_id)
        reply = await self._call(LOAD_VIEWS(self.client, index.keys, args))
        _check_load_reply(thread_id, reply, expected_version, expected_incarnation)

    def _index_last(self, index: _KeyIndex, args: list[Any], thread_id: str) -> None:
        """End a view load's keys with the thread index and its args with the thread id: the
        load lists a thread with events in the index (a rebuild repairs a lost listing)."""
        index(self.keys.index(self.keys.partition(thread_id)))
        args.append(thread_id)

    async def _load_views_chunked(
        self,
        thread_id: str,
        ops: Sequence[ViewOp],
        sizes: list[list[int]],
        expected_version: int,
        expected_incarnation: int | None,
    ) -> None:
        """A load too big for one command: bounded chunks to staging keys, then one swap.

        One script call carrying a whole large thread's views (hundreds of MB at a million
        events) outlives the socket timeout and blocks the server for seconds. Chunks are plain
        RPUSH/HSET to staging keys in the thread's slot, each sent with a read of the thread's
        version (a concurrent append ends the load early) and a TTL; `swap_views.lua` then
        checks the version once more, atomically with renaming the staging keys over the views.
        Whatever fails or is cancelled on the way deletes the staging keys it wrote.
        """
        token = secrets.token_hex(8)
        meta = self.keys.meta(thread_id)
        index = _KeyIndex([meta])
        life = expected_incarnation_arg(expected_incarnation)
        args: list[Any] = [expected_version, life, len(ops)]
        staged: list[str] = []
        plan: list[tuple[ListLoad | HashLoad, str, list[tuple[int, int]]]] = []
        for n, op in enumerate(ops):
            view = index(self.keys.view(thread_id, op.view))
            if not isinstance(op, ListLoad | HashLoad) or not op.entries:
                args += (view, 0, 0)  # a ViewClear, or a load that empties
                continue
            stage = self.keys.staging(thread_id, token, n)
            staged.append(stage)
            width = 1 if isinstance(op, ListLoad) else 2
            plan.append((op, stage, self._chunk_bounds(sizes[n], width)))
            args += (view, index(stage), len(op.entries))
        self._index_last(index, args, thread_id)

        encoder = self._client.get_encoder()
        charset, errors = encoder.encoding, encoder.encoding_errors

        def chunks() -> Iterator[tuple[str, str, list[bytes]]]:
            """(staging key, command, values) per chunk, stamped when asked for: the formats
            of `stamp_list_value` and `stamp_hash_value`, inlined (a call per value cost more
            than the stamping), and field names encoded as the client encodes them."""
            for op, stage, bounds in plan:
                if isinstance(op, ListLoad):
                    entries = op.entries
                    for a, b in bounds:
                        values = [b"%d:%b" % (e.seq, e.value) for e in entries[a:b]]
                        yield stage, "RPUSH", values
                else:
                    fields = list(op.entries.items())
                    for a, b in bounds:
                        pairs: list[bytes] = [b""] * (2 * (b - a))
                        part = fields[a:b]
                        pairs[0::2] = [f.encode(charset, errors) for f, _ in part]
                        pairs[1::2] = [b"%d:%d:%b" % (e.version, e.seq, e.value) for _, e in part]
                        yield stage, "HSET", pairs

        try:
            if self._packs_chunks:
                await self._stage_pipelined(thread_id, meta, chunks(), expected_version)
            else:
                for stage, command, values in chunks():
                    await self._stage(thread_id, meta, stage, command, values, expected_version)
            reply = await self._call(SWAP_VIEWS(self.client, index.keys, args))
        except BaseException:
            if staged:
                # Best effort: never raised in place of the error that stopped the load.
                with _InFlight(self), contextlib.suppress(Exception):
                    await self.client.unlink(*staged)
            raise
        _check_load_reply(thread_id, reply, expected_version, expected_incarnation)
        if reply[0] == b"lost":
            lost = index.keys[int(reply[1]) - 1]
            raise OperationalError(
                f"thread {thread_id!r}: the staged contents of {lost} vanished before the load "
                "completed (expired or deleted); nothing was loaded, run the rebuild again"
            )

    def _chunk_bounds(self, sizes: Sequence[int], width: int) -> list[tuple[int, int]]:
        """Cut items of ``sizes`` bytes (``width`` values each) into chunks within the limits."""
        per_chunk = max(1, self.load_chunk_values // width)
        limit = self.load_chunk_bytes
        # Running byte totals (each item with ~24 bytes of stamp and framing), then one bisect
        # per chunk: no Python step per value.
        ends = list(itertools.accumulate(map(operator.add, sizes, itertools.repeat(24))))
        bounds: list[tuple[int, int]] = []
        start, base, n = 0, 0, len(sizes)
        while start < n:
            stop = bisect.bisect_right(ends, base + limit, start, min(start + per_chunk, n))
            stop = max(stop, start + 1)  # an item above the limit goes alone
            bounds.append((start, stop))
            start, base = stop, ends[stop - 1]
        return bounds

    async def _stage(
        self,
        thread_id: str,
        meta: str,
        stage: str,
        command: str,
        values: list[Any],
        expected_version: int,
    ) -> None:
        """One chunk through a redis-py pipeline (the cluster client's way)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(meta, "v")
        pipe.execute_command(command, stage, *values)
        pipe.pexpire(stage, STAGING_TTL_S * 1000)
        version, _, _ = await self._pipeline_replies(pipe)
        _check_staged(thread_id, version, expected_version)
        await self._staged(stage)

    async def _stage_pipelined(
        self,
        thread_id: str,
        meta: str,
        chunks: Iterator[tuple[str, str, list[Any]]],
        expected_version: int,
    ) -> None:
        """Chunks packed by the store on one pool connection, the next sent before the replies
        of the one before are read: the server stores a chunk while this process stamps and
        packs the next, instead of each side idle while the other works. (Measured on a busy
        2-vCPU machine the gain was within the noise: most of a load's wait is the server
        reading the 4 MiB chunks, during the send.) At most two chunks are in flight, and each
        still reads the version: an append ends the load at the chunk after the next.

        A failure or cancellation disconnects the connection (replies may be left unread).
        """
        encode = self._client.get_encoder().encode
        pool = self.client.connection_pool
        conn = await self._call(pool.get_connection())
        in_flight: str | None = None  # the staging key of the chunk whose replies are unread
        try:
            while True:
                with paused_collector():  # stamping and packing: no await
                    chunk = next(chunks, None)
                    payload = None if chunk is None else _pack_stage(encode, meta, *chunk)
                if payload is not None:
                    await self._call(conn.send_packed_command(payload))
                    del payload
                if in_flight is not None:
                    version, _, _ = [await self._call(conn.read_response()) for _ in range(3)]
                    try:
                        _check_staged(thread_id, version, expected_version)
                    except ConcurrencyError:
                        if chunk is not None:
                            # Let the chunk sent meanwhile land before the caller deletes the
                            # staging keys: it would otherwise race the delete, and could
                            # recreate a key (with a TTL, or none if cut before its PEXPIRE).
                            for _ in range(3):
                                await self._call(conn.read_response())
                        raise
                    await self._staged(in_flight)
                if chunk is None:
                    return
                in_flight = chunk[0]
        except ConcurrencyError:
            raise  # every reply was read: the connection is clean
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)

    async def _staged(self, stage: str) -> None:
        """Called when a chunk has landed in ``stage`` (tests hook in here)."""

    # -- listing --------------------------------------------------------------------------------

    async def threads(
        self,
        *,
        limit: int | None = None,
        before_ms: int | None = None,
        after: ThreadInfo | tuple[int, str] | None = None,
        partition: int | None = None,
    ) -> list[ThreadInfo]:
        validate_limit(limit)
        cursor = threads_cursor(before_ms, after)
        if partition is not None:
            validate_partition(partition, self.partitions)
        if limit == 0:
            return []
        per_partition: list[list[ThreadInfo]] = []
        for p in range(self.partitions) if partition is None else (partition,):
            key = self.keys.index(p)
            rows: Any
            if cursor is None or not cursor[1]:
                # No thread id to resume after: a plain range by time.
                hi = "+inf" if cursor is None else f"({cursor[0]}"
                kwargs: dict[str, Any] = {"withscores": True}
                if limit is not None:
                    kwargs.update(start=0, num=limit)
                rows = await self._call(self.client.zrevrangebyscore(key, hi, "-inf", **kwargs))
            else:
                flat = await self._call(
                    THREADS_AFTER(self.client, [key], [cursor[0], cursor[1], limit or -1])
                )
                rows = zip(flat[0::2], flat[1::2], strict=True)
            per_partition.append(_index_rows(key, p, rows))
        # Each partition comes newest first, ties by thread id descending (ZREVRANGE's order:
        # bytes, which for UTF-8 is the code points' order); the merge keeps that across them.
        merged = heapq.merge(
            *per_partition, key=lambda t: (t.last_activity_ms, t.thread_id), reverse=True
        )
        return list(merged if limit is None else itertools.islice(merged, limit))

    async def indexed(self, thread_id: str) -> bool:
        validate_thread_id(thread_id)
        p = self.keys.partition(thread_id)
        return await self._command("ZSCORE", self.keys.index(p), thread_id) is not None

    async def stored_threads(self) -> list[str]:
        found: set[str] = set()
        misplaced: dict[str, int] = {}  # thread -> the partition its keys' tag names
        pattern, keys = key_pattern(self.namespace), self.keys
        client = self.client

        def take(key: bytes | str) -> None:
            tagged = keys.tagged_thread_of(key)
            if tagged is None:
                return
            thread_id, partition = tagged
            if partition_of(thread_id, keys.partitions) == partition:
                found.add(thread_id)
            else:
                misplaced[thread_id] = partition

        with _InFlight(self):
            try:
                if isinstance(client, RedisCluster):
                    # Each primary holds its own slots' keys: every one is scanned, replicas not
                    # (they hold copies).
                    for node in client.get_primaries():
                        cursor = 0
                        while True:
                            # The cluster client answers SCAN per node: ({node: cursor}, keys).
                            cursors, batch = await client.execute_command(
                                "SCAN", cursor, "MATCH", pattern, "COUNT", SCAN_COUNT,
                                target_nodes=node,
                            )  # fmt: skip
                            cursor = int(cursors[node.name])
                            for k in batch:
                                take(k)
                            if cursor == 0:
                                break
                else:
                    async for key in client.scan_iter(match=pattern, count=SCAN_COUNT):
                        take(key)
            except rex.NoPermissionError as exc:
                raise OperationalError(
                    f"redis denied SCAN (ACL): {exc}; finding the threads the keys hold needs "
                    "+scan, which `acl_rules` leaves out because Redis does not confine SCAN to a "
                    "key pattern (the user would see every namespace's key names): grant it to "
                    "an auditing user that may see them, or audit threads one by one"
                ) from exc
            except (rex.RedisError, rex.RedisClusterException, OSError) as exc:
                raise translate_redis_error(exc) from exc
        if misplaced:
            # Keys no reader of this partition count looks at: passing over them would pass
            # an audit with those threads unseen (an edited count hides every thread it moves).
            shown = sorted(misplaced)[:10]
            more = f" and {len(misplaced) - len(shown)} more" if len(misplaced) > len(shown) else ""
            where = ", ".join(f"{t!r} (in partition {misplaced[t]})" for t in shown)
            raise CorruptKeyError(
                KeyLayout.config_key(self.namespace),
                f"it records a partition count of {keys.partitions}, but the keys of threads "
                f"{where}{more} lie in partitions where that count never puts them, so every "
                "reader looks for those threads elsewhere and finds none: the count was edited "
                "(restore the one their keys were written with) or their keys were moved to "
                "another partition's tag (move them back)",
            )
        return sorted(found)

    async def delete_thread(
        self,
        thread_id: str,
        *,
        views: Sequence[str] = (),
        expected_version: int | None = None,
        expected_incarnation: int | None = None,
    ) -> int:
        validate_thread_id(thread_id)
        expected = validate_expected_deletion(expected_version)
        life = expected_incarnation_arg(expected_incarnation)
        names = list(dict.fromkeys(views))
        for view in names:
            self.keys.view(thread_id, view)  # validated before anything is sent
        # Every view any writer recorded for the partition (`_record_views`), named or not: a
        # view left behind would be read as the next life's (a new thread under this id).
        partition = self.keys.partition(thread_id)
        recorded = await self._call(self.client.smembers(self.keys.view_names(partition)))
        for raw in sorted(recorded):
            try:
                name = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
                self.keys.view(thread_id, name)
            except (UnicodeDecodeError, ValueError):
                continue  # not a name threadlog records (the set was edited): no view of it
            names.append(name)
        keys = list(self.keys.thread_keys(thread_id))
        keys += [self.keys.view(thread_id, v) for v in dict.fromkeys(names)]
        reply = await self._call(DELETE_THREAD(self.client, keys, [thread_id, expected, life]))
        if isinstance(reply, list):  # {"conflict", actual} | {"life", actual life, version}
            if reply[0] == b"life":
                raise _other_life(thread_id, expected_version, expected_incarnation, reply)
            raise ConcurrencyError(thread_id, expected_version, int(reply[1]))
        return int(reply)

    # -- the change feed ------------------------------------------------------------------------

    def _feed_key(self, partition: int) -> str:
        return self.keys.feed(validate_partition(partition, self.partitions))

    def _entries(self, partition: int, rows: Any) -> list[FeedEntry]:
        out = []
        key = self.keys.feed(partition)
        for entry_id, fields in rows or ():
            if fields:  # a trimmed entry still pending comes back without fields
                out.append(entry_from_fields(key, partition, entry_id.decode("ascii"), fields))
        return out

    async def read_feed(
        self,
        partition: int,
        *,
        after: str = "0-0",
        count: int = READ_BATCH,
        reader: str | None = None,
    ) -> list[FeedEntry]:
        parse_stream_id(after)
        validate_feed_count(count)
        key = self._feed_key(partition)
        if reader is None:
            rows = await self._call(self.client.xrange(key, f"({after}", "+", count))
            return self._entries(partition, rows)
        # The range and the stream's trim record (max-deleted-entry-id, which the trim script
        # moves) in one atomic step: a trim landing just before the read is seen by it.
        pipe = self.client.pipeline(transaction=True)
        # execute_command, not pipe.xrange/xinfo_stream: redis-py 6.4's cluster transaction
        # hands those methods' `keys=` argument on to the reply callback, which refuses it.
        pipe.execute_command("XRANGE", key, f"({after}", "+", "COUNT", count)
        pipe.execute_command("XINFO STREAM", key)
        rows, info = await self._call(_pipeline_executed(pipe))
        if isinstance(info, Exception):
            if "no such key" in str(info).lower():
                return []  # no feed: nothing was trimmed either
            raise translate_redis_error(info) from info
        if isinstance(rows, Exception):
            raise translate_redis_error(rows) from rows
        trimmed_to = _text(info.get("max-deleted-entry-id", b"0-0"))
        if parse_stream_id(trimmed_to) > parse_stream_id(after):
            raise FeedTrimmedError(partition, reader, after, trimmed_to)
        return self._entries(partition, rows)

    async def create_feed_group(self, partition: int, group: str, *, start: str = "0-0") -> bool:
        validate_group(group)
        parse_stream_id(start)
        with _InFlight(self):
            try:
                feed = self._feed_key(partition)
                await self.client.xgroup_create(feed, group, start, mkstream=True)
            except rex.ResponseError as exc:
                if "BUSYGROUP" in str(exc):
                    return False
                raise translate_redis_error(exc) from exc
            except (rex.RedisError, rex.RedisClusterException, OSError) as exc:
                raise translate_redis_error(exc) from exc
        return True

    async def read_feed_group(
        self,
        partition: int,
        group: str,
        consumer: str,
        *,
        count: int = READ_BATCH,
        block_ms: int | None = None,
        pending: bool = False,
    ) -> list[FeedEntry]:
        validate_group(group)
        validate_consumer(consumer)
        validate_feed_count(count)
        validate_block_ms(block_ms)
        key = self._feed_key(partition)
        reply = await self._call(
            self.client.xreadgroup(
                group, consumer, {key: "0" if pending else ">"}, count=count, block=block_ms
            ),
            (partition, group),
        )
        rows = _read_rows(reply)
        # A pending entry trimmed before it was acknowledged comes back without fields.
        lost = [_text(entry_id) for entry_id, fields in rows or () if not fields]
        if lost:
            await self._lost_pending(partition, group, lost)
        return self._entries(partition, rows)

    async def _lost_pending(self, partition: int, group: str, lost: list[str]) -> NoReturn:
        info = await self.feed_info(partition)
        raise FeedTrimmedError(partition, f"group {group!r}", lost[0], info.trimmed_to, lost)

    async def claim_feed(
        self,
        partition: int,
        group: str,
        consumer: str,
        *,
        min_idle_ms: int,
        count: int = READ_BATCH,
    ) -> list[FeedEntry]:
        validate_group(group)
        validate_consumer(consumer)
        validate_count(min_idle_ms, "min_idle_ms")
        validate_feed_count(count)
        key = self._feed_key(partition)
        out: list[FeedEntry] = []
        lost: list[str] = []
        start = "0-0"
        # XAUTOCLAIM scans a bounded window per call; a few calls cover any backlog.
        for _ in range(64):
            reply = await self._call(
                self.client.xautoclaim(
                    key, group, consumer, min_idle_ms, start_id=start, count=count - len(out)
                ),
                (partition, group),
            )
            out += self._entries(partition, reply[1])
            # Redis 7: the ids it found trimmed, dropped from the group's pending entries.
            lost += [_text(i) for i in (reply[2] if len(reply) > 2 else ())]
            start = _text(reply[0])
            if start == "0-0" or len(out) >= count:
                break
        if lost:
            await self._lost_pending(partition, group, lost)
        return out

    async def ack_feed(self, partition: int, group: str, ids: Sequence[str]) -> int:
        ids = validate_stream_ids(ids)
        validate_group(group)
        key = self._feed_key(partition)
        done = (
            int(await self._call(self.client.xack(key, group, *ids), (partition, group)))
            if ids
            else 0
        )
        if not done:
            # XACK answers 0 for a group that does not exist; ask (XPENDING answers NOGROUP),
            # only when nothing was acknowledged, so the usual ack costs no extra round trip.
            await self._call(self.client.xpending(key, group), (partition, group))
        return done

    async def advance_feed_group(self, partition: int, group: str, to: str) -> None:
        parse_stream_id(to)
        validate_group(group)
        key = self._feed_key(partition)
        await self._call(self.client.xgroup_setid(key, group, to), (partition, group))
        # SETID leaves older pending entries in place; acknowledge them so trimming can pass.
        # (A group dropped meanwhile is as missing as one the SETID did not find.)
        while True:
            rows = await self._call(
                self.client.xpending_range(key, group, "-", to, 512), (partition, group)
            )
            if not rows:
                return
            ids = [r["message_id"] for r in rows]
            await self._call(self.client.xack(key, group, *ids), (partition, group))

    async def feed_groups(self, partition: int) -> list[GroupInfo]:
        key = self._feed_key(partition)
        if not await self._call(self.client.exists(key)):
            return []
        groups = await self._call(self.client.xinfo_groups(key))
        out = []
        for g in groups:
            # A group made outside threadlog (XGROUP CREATE) may be named in bytes that are
            # not UTF-8: listed with those bytes escaped (\xff), asked about by its own bytes.
            raw_name = g["name"]
            name = raw_name.decode("utf-8", "backslashreplace")
            try:
                summary = await self._call(self.client.xpending(key, raw_name), (partition, name))
            except FeedGroupNotFoundError:
                continue  # dropped since XINFO GROUPS listed it: no longer there
            oldest = summary.get("min")
            out.append(
                GroupInfo(
                    name=name,
                    last_delivered=g["last-delivered-id"].decode("ascii"),
                    pending=int(g["pending"]),
                    oldest_pending=oldest.decode("ascii") if oldest else None,
                )
            )
        return out

    async def feed_info(self, partition: int) -> FeedInfo:
        key = self._feed_key(partition)
        with _InFlight(self):
            try:
                info = await self.client.xinfo_stream(key)
            except rex.ResponseError as exc:
                if "no such key" not in str(exc).lower():
                    raise translate_redis_error(exc) from exc
                info = {}  # no feed yet: the empty one
            except (rex.RedisError, rex.RedisClusterException, OSError) as exc:
                raise translate_redis_error(exc) from exc
        first = info.get("first-entry")
        return FeedInfo(
            partition=partition,
            length=int(info.get("length", 0)),
            first_id=_text(first[0]) if first else None,
            last_id=_text(info.get("last-generated-id", b"0-0")),
            # Redis 7.0 and Valkey keep it; the contract needs 7.0 (see docs/scaling.md).
            trimmed_to=_text(info.get("max-deleted-entry-id", b"0-0")),
        )

    async def delete_feed_group(self, partition: int, group: str) -> bool:
        validate_group_to_drop(group)
        key = self._feed_key(partition)
        if not await self._call(self.client.exists(key)):
            return False
        return bool(await self._call(self.client.xgroup_destroy(key, group)))

    async def trim_feed(self, partition: int, *, max_age_ms: int | None = None) -> int:
        validate_limit(max_age_ms, "max_age_ms")
        key = self._feed_key(partition)
        aged = ""
        if max_age_ms is not None:
            now_ms = int(time.time() * 1000)
            aged = f"{max(now_ms - max_age_ms, 0)}-0"
        # The script reads the groups itself, in the same atomic step as the trim: a group
        # registered after a read here would not have been waited for.
        return int(await self._call(TRIM_FEED(self.client, [key], [aged])))

    async def apply_checkpointed(
        self,
        partition: int,
        name: str,
        *,
        expected: str,
        checkpoint: str,
        incr: Sequence[tuple[str, str, int]] = (),
    ) -> bool:
        self._feed_key(partition)
        validate_view_name(name)
        if parse_stream_id(checkpoint) <= parse_stream_id(expected):
            raise InvalidInputError(f"checkpoint {checkpoint} must be above {expected}")
        increments = validate_increments(incr)
        keys = self.keys
        index = _KeyIndex([keys.checkpoints(partition), keys.aux_names(partition, name)])
        args: list[Any] = [name, expected, checkpoint, len(increments)]
        hash_names: dict[str, None] = {}  # in KEYS order: a dict keeps the first-seen order
        for hash_name, field, amount in increments:
            args += (index(keys.aux(partition, name, hash_name)), field, amount)
            hash_names[hash_name] = None
        args += (len(hash_names), *hash_names)
        reply = await self._call(APPLY_CHECKPOINTED(self.client, index.keys, args))
        if isinstance(reply, list):  # an increment HINCRBY refused: all were undone
            key = _text(index.keys[int(reply[1]) - 1])
            field, why = _text(reply[2]), _text(reply[3])
            if "overflow" in why:
                raise InvalidInputError(
                    f"increment of field {field!r} of {key!r} would overflow a 64-bit int: "
                    "nothing written, the checkpoint stays"
                )
            raise CorruptKeyError(key, f"field {field!r}: {why} (nothing written)")
        return bool(reply)

    async def delete_checkpointed(
        self, partition: int, name: str, *, hashes: Sequence[str] = ()
    ) -> CheckpointedState:
        self._feed_key(partition)
        validate_view_name(name)
        names = dict.fromkeys(validate_hash_names(hashes))
        keys = self.keys
        base = [keys.checkpoints(partition), keys.aux_names(partition, name)]
        for _ in range(DELETE_ATTEMPTS):
            recorded = await self._call(self.client.smembers(base[1]))
            names.update(dict.fromkeys(_recorded_hash_names(base[1], recorded)))
            hash_keys = [keys.aux(partition, name, h) for h in names]
            reply = await self._call(
                DELETE_CHECKPOINTED(self.client, [*base, *hash_keys], [name, *names])
            )
            if reply[0] == 1:
                raw = reply[1]
                # As stored, damage included: it is gone now, and saying what it was must
                # not fail (a checkpoint changed from outside may hold any bytes).
                return CheckpointedState(
                    checkpoint=raw.decode("utf-8", "backslashreplace") if raw else None,
                    hashes=sorted(_text(h) for h in reply[2]),
                )
            # Names recorded since they were read (a runner still at work): with them too.
            names.update(dict.fromkeys(_recorded_hash_names(base[1], reply[1])))
        raise OperationalError(
            f"the state of async projection {name!r} on partition {partition} kept gaining "
            f"hashes while it was deleted ({DELETE_ATTEMPTS} attempts): stop its runners first"
        )

    async def read_aux(self, partition: int, name: str, hash_name: str) -> dict[str, int]:
        self._feed_key(partition)
        raw = await self._call(self.client.hgetall(self.keys.aux(partition, name, hash_name)))
        return {k.decode("utf-8"): int(v) for k, v in raw.items()}

    async def checkpoint_of(self, partition: int, name: str) -> str:
        self._feed_key(partition)
        key = self.keys.checkpoints(partition)
        raw = await self._call(self.client.hget(key, name))
        return _checkpoint(key, name, raw) if raw else "0-0"

    async def checkpoints(
        self, partition: int, *, damaged: dict[str, CorruptKeyError] | None = None
    ) -> dict[str, str]:
        self._feed_key(partition)
        key = self.keys.checkpoints(partition)
        raw = await self._call(self.client.hgetall(key))
        out = {}
        for field, value in raw.items():
            name = field.decode("utf-8", "backslashreplace")
            try:
                if name.encode("utf-8") != field:
                    raise CorruptKeyError(
                        key, f"it holds a field named {field!r}, which is no projection's name"
                    )
                out[name] = _checkpoint(key, name, value)
            except CorruptKeyError as exc:
                if damaged is None:
                    raise
                damaged[name] = exc
        return out

    async def namespace_id(self) -> str:
        key = KeyLayout.config_key(self.namespace)
        recorded = await self._call(self.client.hget(key, "id"))
        if recorded is None:
            # HSETNX: of two clients asking at once, the first one's id is everybody's.
            await self._call(self.client.hsetnx(key, "id", new_ulid()))
            recorded = await self._call(self.client.hget(key, "id"))
        return str(recorded.decode("ascii"))

    async def namespace_exists(self) -> bool:
        # A writer's store records the partition count when it opens the namespace; a reader's
        # (create_namespace=False) does not, so this is "was ever opened to be written".
        # (HGET, as `ensure_namespace` reads it: a tenant's ACL user may run no HEXISTS.)
        key = KeyLayout.config_key(self.namespace)
        return await self._call(self.client.hget(key, "partitions")) is not None

    async def known_namespaces(self) -> list[str] | None:
        # SCAN walks the whole keyspace: bounded to a few round trips, and not on a cluster
        # (one walk per node). A large data set answers None rather than a slow hint.
        self._check_usable()
        if self._is_cluster:
            return None
        pattern = KeyLayout.CONFIG_KEY_PATTERN.encode()
        found: set[str] = set()
        cursor = 0
        with _InFlight(self):
            try:
                for _ in range(_KNOWN_NAMESPACES_SCANS):
                    cursor, keys = await self.client.scan(cursor, match=pattern, count=1000)
                    names = (KeyLayout.namespace_of_config_key(k) for k in keys)
                    found.update(n for n in names if n is not None)
                    if not cursor:
                        return sorted(found)
            except (rex.RedisError, OSError):  # e.g. an ACL user without SCAN: no hint, no error
                return None
        return None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        home = self._loop
        if home is not None and home.is_closed():
            # Its connections died with their loop; closing them here would fail.
            return
        if home is not None and home is not asyncio.get_running_loop():
            # Closed from another loop while its own still runs: its connections are that
            # loop's, and are closed there.
            done = asyncio.run_coroutine_threadsafe(self._close_connections(), home)
            await asyncio.wrap_future(done)
            return
        await self._close_connections()

    async def _close_connections(self) -> None:
        with contextlib.suppress(rex.RedisError, OSError):
            if self._held is not None:
                await self._held.close()
        if self._owns_client:
            # A call in flight may have the cluster client find its nodes again meanwhile,
            # which replaces the node objects (redis-py before 8 leaves the old ones' open
            # connections to the collector): each node seen now is disconnected at the end.
            nodes = list(self._client.get_nodes()) if self._is_cluster else []
            with contextlib.suppress(rex.RedisError, OSError):
                await self._client.aclose()
            # A call in flight may have taken a connection since (its own, disconnected, it
            # reconnects), even while that aclose ran, and gives it back connected: closed
            # again once those calls end, whether or not any is left by now.
            if self._calls:
                self._calls_ended = asyncio.Event()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_CLOSE_WAIT_S):
                        await self._calls_ended.wait()
            with contextlib.suppress(rex.RedisError, OSError):
                await self._client.aclose()
                if self._is_cluster:
                    # The cluster client's aclose does nothing twice (it takes itself for
                    # closed) unless a call had it find the nodes again meanwhile.
                    for node in {id(n): n for n in [*nodes, *self._client.get_nodes()]}.values():
                        await node.disconnect()
