"""How events become stream entries and back, and how the integrity chain is computed.

A stream entry has the same six fields for every event (so Redis stores the field names once per
listpack node): ``i`` event id (16 raw ULID bytes), ``v`` schema version, ``s`` server time in
ms, ``d`` the msgpack payload, ``m`` msgpack envelope meta (empty when there is none), ``h`` the
chain link. The entry id is ``<seq>-0``, so seq ranges are plain XRANGEs.

Chain: ``c = blake2b-128(thread, id, version, data, meta)``, keyed when the store has a secret
(with `namespace_chain_key`: the secret's key for the store's namespace);
``h(n) = sha1(h(n-1) | seq | time | c)[:32]``. ``c`` is never stored: with a secret, nobody
without it can recompute a link after changing, inserting, removing or moving an event.
"""

from __future__ import annotations

import hashlib
import operator
import re
from collections.abc import Sequence
from typing import Any

import msgspec
from ulid import ULID

from ._contract import ExpectedVersion, StreamState
from ._errors import (
    DECODE_ERRORS,
    CorruptEventError,
    EventTooLargeError,
    EventValidationError,
    InvalidInputError,
    OperationalError,
    UnknownEventTypeError,
)
from ._events import (
    Event,
    EventMeta,
    EventRegistry,
    NewEvent,
    PayloadRow,
    RecordedEvent,
    as_new_event,
)
from ._ids import mint_ulid, not_unicode, ulid_bytes, validate_thread_id
from ._ids import ulid_text as _ulid_str

DEFAULT_MAX_EVENT_BYTES = 1024 * 1024
# The latest event time a log can hold: 9999-12-31T23:59:59.999Z, the last a datetime shows.
# The server writes its own clock's (never below 0): any other time is damage, and would
# crash what shows it or exports it (a date, a Parquet int64).
MAX_EVENT_TIME_MS = 253_402_300_799_999
CHAIN_HEX_CHARS = 32
# The deepest an event may nest containers (lists, maps, structs; the event is level 1).
# msgspec encodes and decodes nesting by recursion, bounded by the interpreter: 3.11 refuses
# ~900 levels with a RecursionError, 3.13 stores 5,000 and refuses 20,000. Without a limit of
# its own, a store would refuse what another Python accepts, and a reader on 3.11 could not
# decode what a writer on 3.13 appended. 128 is serde_json's default and far beyond any
# message or state value an agent writes; every Python decodes it with room to spare.
MAX_NESTING = 128

_encoder = msgspec.msgpack.Encoder()
# An export writes each payload as JSON: the append asks the JSON encoder first.
_plain_decoder = msgspec.msgpack.Decoder()
_json_encoder = msgspec.json.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(EventMeta)
_EMPTY_META = b""
_EVENT_TYPES = (Event, NewEvent)  # a tuple: `A | B` would build a union on every call


# The msgpack bytes a container can start with (fixmap, fixarray, array 16/32, map 16/32),
# and the table that deletes every other byte.
_CONTAINER_HEADERS = bytes([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])
_NOT_CONTAINERS = bytes(b for b in range(256) if b not in _CONTAINER_HEADERS)


def too_deep(value: Any, *, level: int = 1) -> bool:
    """Whether ``value``, found at nesting ``level`` of an event, nests past `MAX_NESTING`.

    Iterative, so that it answers for any depth without recursing itself. Every field of a
    struct is visited, whatever its annotation says, as the encoder writes what is there.
    """
    pending: list[tuple[Any, int]] = [(value, level)]
    pop, push = pending.pop, pending.append
    while pending:
        item, depth = pop()
        kind = type(item)
        if kind is list or kind is tuple:
            children: Any = item
        elif kind is dict:
            children = item.values()
        elif isinstance(item, msgspec.Struct):
            children = [getattr(item, name) for name in kind.__struct_fields__]
        else:
            continue  # a scalar, bytes or another leaf the encoder judges
        if depth > MAX_NESTING:
            return True
        depth += 1
        for child in children:
            if not (type(child) is str or type(child) is int or child is None):
                push((child, depth))
    return False


def encoded_too_deep(value: Any, data: bytes, *, level: int = 1) -> bool:
    """`too_deep`, for a ``value`` whose msgpack encoding is ``data``: every list, map or
    struct is encoded with one of the container header bytes, so an encoding holding no more
    of them than the levels left nests no deeper. One pass in C clears almost every value;
    only the others are walked."""
    left = MAX_NESTING - level + 1
    return (
        len(data) > left
        and len(data.translate(None, _NOT_CONTAINERS)) > left
        and too_deep(value, level=level)
    )


def non_finite_float(payload: Any) -> tuple[str, float] | None:
    """Where in a decoded payload (its fields a map) a NaN or an infinity sits
    (``"value['x'][1]"``), and which; None when it holds none."""
    pending: list[tuple[Any, str]] = (
        [(value, str(name)) for name, value in payload.items()]
        if isinstance(payload, dict)
        else [(payload, "")]  # an array-like struct: its fields by position
    )
    pending.reverse()  # a stack: the first one in field order is the one named
    while pending:
        item, where = pending.pop()
        if isinstance(item, float):
            if item - item != 0.0:  # NaN and infinities give NaN
                return where, item
        elif isinstance(item, list):
            pending += [(x, f"{where}[{i}]") for i, x in reversed(list(enumerate(item)))]
        elif isinstance(item, dict):
            pending += [(x, f"{where}[{key!r}]") for key, x in reversed(item.items())]
    return None


def check_nesting(payload: Event, index: int, thread_id: str | None = None) -> None:
    """Refuse an event that nests past `MAX_NESTING` (`encode_events` asks only for events
    whose encoding could, and for those the interpreter could not encode at all).

    Raises:
        EventValidationError: naming the event and the limit.
    """
    if too_deep(payload):
        where = "" if thread_id is None else f"thread {thread_id!r}: "
        raise EventValidationError(
            f"{where}event #{index} ({payload.event_type}) nests lists, maps or objects more "
            f"than {MAX_NESTING} levels deep (the event counting as one), deeper than "
            "threadlog stores: not every Python could decode it"
        )


class EncodedEvent(msgspec.Struct, frozen=True):
    """One event ready for the wire: every field the append script stores, plus its digest."""

    id_bytes: bytes
    version: int
    data: bytes
    meta: bytes
    digest: str

    @property
    def id(self) -> str:
        """The event id as text (made when asked: the Redis append path never needs it)."""
        return _ulid_str(self.id_bytes)


def chain_key(secret: bytes) -> bytes:
    """The BLAKE2b key a chain secret stands for: the secret itself up to 64 bytes (BLAKE2b's
    longest key), else its 64-byte BLAKE2b hash, as HMAC does with a key longer than a block.
    A passphrase of any length works; a secret that fits is used as it always was."""
    if len(secret) <= 64:
        return secret
    return hashlib.blake2b(secret, digest_size=64).digest()


def check_secret(secret: object) -> bytes | None:
    """``secret`` if it is a chain secret (bytes, at least one), None for None (no key).

    An empty secret is refused, not taken as no key: an empty ``THREADLOG_SECRET`` (a template
    whose key was never filled in) wrote unkeyed chains while its deployment meant them keyed,
    and an `Auditor` given it checked with a key derived from it. No key is None (the variable
    unset), and only that.

    Raises:
        InvalidInputError: ``secret`` is empty, or not bytes (a str: encode it).
    """
    if secret is None:
        return None
    if not isinstance(secret, bytes):
        raise InvalidInputError(
            f"secret must be bytes (e.g. text.encode()), not {type(secret).__name__}"
        )
    if not secret:
        raise InvalidInputError(
            "the chain secret is empty, which is no key: give the key, or None for a chain "
            "without one (THREADLOG_SECRET unset)"
        )
    return secret


def namespace_chain_key(secret: bytes, namespace: str) -> bytes:
    """The key a namespace's chains are linked with: a BLAKE2b MAC of the namespace's name
    under the secret (`chain_key`). A thread copied into another namespace, which its writers
    may share the secret with, then verifies there as written with another key instead of
    passing for one of its own. Stores derive it once; the secret itself never links.

    Raises:
        InvalidInputError: ``secret`` is empty or not bytes (`check_secret`).
    """
    if check_secret(secret) is None:
        raise InvalidInputError("secret must be bytes (e.g. text.encode()), not NoneType")
    label = b"threadlog chain key v2 for namespace " + namespace.encode("utf-8")
    return hashlib.blake2b(label, digest_size=64, key=chain_key(secret)).digest()


def content_digest(
    thread_id: str, id_bytes: bytes, version: int, data: bytes, meta: bytes, secret: bytes | None
) -> str:
    """The per-event digest ``c`` linked into the chain (keyed MAC when ``secret`` is set)."""
    thread = thread_id.encode("utf-8")
    v = b"%d" % version
    # Each field as ``<len>:<bytes>``: length-prefixing makes the digest input unambiguous, no
    # two field splits collide. One format call, not a join: this runs for every event.
    framed = b"%d:%s%d:%s%d:%s%d:%s%d:%s" % (
        len(thread), thread, len(id_bytes), id_bytes, len(v), v, len(data), data, len(meta), meta
    )  # fmt: skip
    key = chain_key(secret) if secret else b""
    return hashlib.blake2b(framed, digest_size=16, key=key).hexdigest()


def chain_link(prev: str, seq: int, time_ms: int, digest: str) -> str:
    """The chain link of an event; the append script computes exactly the same string."""
    material = f"{prev}|{seq}|{time_ms}|{digest}".encode("ascii")
    return hashlib.sha1(material, usedforsecurity=False).hexdigest()[:CHAIN_HEX_CHARS]


# ULIDs on the append path: python-ulid parses and prints them in Python, a few microseconds
# each, so canonical (upper-case) strings take these C-level paths; anything else still goes
# through python-ulid, which decides what is valid and words the errors.
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_CANONICAL_ULID = re.compile(r"[0-7][0-9A-HJKMNP-TV-Z]{25}")
_CROCKFORD_TO_INT_DIGITS = str.maketrans(_CROCKFORD, "0123456789abcdefghijklmnopqrstuv")


def _parse_ulid(value: str, what: str) -> bytes:
    known = ulid_bytes(value)
    if known is not None:
        return known
    if isinstance(value, str) and _CANONICAL_ULID.fullmatch(value) is not None:
        # Crockford digits map one-to-one onto int()'s base-32 digits; [0-7] first: no overflow.
        return int(value.translate(_CROCKFORD_TO_INT_DIGITS), 32).to_bytes(16, "big")
    try:
        return bytes(ULID.from_str(value))
    except (ValueError, TypeError) as exc:
        raise InvalidInputError(f"{what} {value!r} is not a ULID") from exc


def encode_events(
    thread_id: str,
    events: Sequence[Event | NewEvent],
    registry: EventRegistry,
    *,
    max_event_bytes: int,
    secret: bytes | None,
) -> list[EncodedEvent]:
    """Validate and encode events for an append; raises before anything is sent.

    Each payload is encoded, then decoded back through the registry, so a payload that would
    not decode later (wrong field types, constraint violations) is refused now.
    """
    return _encode(thread_id, events, registry, max_event_bytes, secret, None, False)


def encode_append(
    thread_id: str,
    events: Sequence[Event | NewEvent],
    registry: EventRegistry,
    *,
    max_event_bytes: int,
    secret: bytes | None,
    thread_valid: bool = False,
) -> tuple[list[EncodedEvent], bytes]:
    """`encode_events` and the raw bytes of `request_digest` in one pass: both digests hash
    each event's framed content, which is formatted once. ``thread_valid``: the caller has
    already validated ``thread_id``."""
    request = _REQUEST_DIGEST.copy()
    encoded = _encode(thread_id, events, registry, max_event_bytes, secret, request, thread_valid)
    return encoded, request.digest()


UNKEYED_FINGERPRINT = "-"
"""What a thread written without a chain key records in place of a key fingerprint."""


def key_fingerprint(secret: bytes | None) -> str:
    """A short public name of a chain key: 16 hex digits of a BLAKE2b MAC, under the key, of
    a fixed label (`UNKEYED_FINGERPRINT` without a key). Each thread records the one it was
    created with, so a writer with another key is refused; the key itself is never sent.
    It is a MAC of a known input, so it tells no more about the key than any keyed link does.
    """
    if not secret:
        return UNKEYED_FINGERPRINT
    return hashlib.blake2b(
        b"threadlog chain key fingerprint v1", digest_size=8, key=chain_key(secret)
    ).hexdigest()


# Hash states before any input, copied for each digest: a copy costs a fraction of a constructor
# with keyword arguments. Unkeyed only: a store's secret is not kept at module level.
_REQUEST_DIGEST = hashlib.blake2b(digest_size=8)
_UNKEYED_CONTENT_DIGEST = hashlib.blake2b(digest_size=16)


def _encode(
    thread_id: str,
    events: Sequence[Event | NewEvent],
    registry: EventRegistry,
    max_event_bytes: int,
    secret: bytes | None,
    request: Any,
    thread_valid: bool,
) -> list[EncodedEvent]:
    if not thread_valid:
        validate_thread_id(thread_id)
    # A list or tuple needs no ABC check (an isinstance against Sequence is a slow one).
    if (type(events) is not list and type(events) is not tuple) and (
        isinstance(events, _EVENT_TYPES) or not isinstance(events, Sequence)
    ):
        raise InvalidInputError("events must be a sequence of Event or NewEvent")
    if not events:
        raise InvalidInputError(f"thread {thread_id!r}: an append needs at least one event")
    thread = thread_id.encode("utf-8")
    thread_part = b"%d:%s" % (len(thread), thread)
    # The registry's union decoder, for the check that each payload decodes: a payload it
    # accepts is one `registry.decode` returns as it is (it is at its class's current version);
    # one it refuses goes through `registry.decode`, which words the error. Asked for after
    # the first `version_of`, which refuses an unregistered type in its own words.
    check: Any = None
    out: list[EncodedEvent] = []
    seen: set[bytes] | None = None  # ids the caller chose, made when there is one
    index = -1
    for item in events:
        index += 1
        meta_obj: EventMeta | None = None
        if isinstance(item, Event):
            # What `as_new_event` does, minus the NewEvent: a fresh id, minted as bytes.
            payload = item
            id_bytes: bytes | None = mint_ulid()
            event_id = ""
        else:
            new = as_new_event(item)  # passes a NewEvent through, raises for anything else
            payload, event_id, id_bytes = new.payload, new.id, None
            if not (
                new.turn_id is None and new.correlation_id is None and new.causation_id is None
            ):
                meta_obj = EventMeta(
                    turn_id=new.turn_id,
                    correlation_id=new.correlation_id,
                    causation_id=new.causation_id,
                )
        version = registry.version_of(payload)
        try:
            data = _encoder.encode(payload)
        except (
            msgspec.EncodeError, TypeError, OverflowError, UnicodeEncodeError, RecursionError
        ) as exc:  # fmt: skip
            if isinstance(exc, RecursionError):
                check_nesting(payload, index, thread_id)  # past the limit: said in its words
            raise EventValidationError(
                f"thread {thread_id!r}: event #{index} ({payload.event_type}) "
                f"cannot be encoded: {exc}"
            ) from exc
        if encoded_too_deep(payload, data):
            check_nesting(payload, index, thread_id)  # says so in the limit's words
        try:
            # The payload itself, not its plain form an export writes: the same keys fail
            # (a tuple, None), in under half the time of decoding the plain form first.
            _json_encoder.encode(payload)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
            raise EventValidationError(
                f"thread {thread_id!r}: event #{index} ({payload.event_type}) holds what JSON "
                f"cannot hold ({exc}): an event is exported and shown as JSON"
            ) from None
        # msgspec writes every float as a float64 (0xcb), and a NaN's or an infinity's first
        # byte is 0x7f or 0xff: bytes no UTF-8 text holds, so the walk is rarely needed.
        if (b"\xcb\x7f" in data or b"\xcb\xff" in data) and (
            found := non_finite_float(_plain_decoder.decode(data))
        ):
            where, value = found
            raise EventValidationError(
                f"thread {thread_id!r}: event #{index} ({payload.event_type}) holds {value!r} "
                f"at {where}: JSON has no NaN or infinity, and an event is exported and shown "
                "as JSON"
            )
        if check is None:
            check = registry.fast_path()[0].decode
        try:
            try:
                check(data)
            except DECODE_ERRORS:
                registry.decode(data, version)
        except (EventValidationError, UnknownEventTypeError) as exc:
            raise EventValidationError(
                f"thread {thread_id!r}: event #{index} ({payload.event_type}) "
                f"fails validation: {exc}"
            ) from exc
        # No envelope fields: EventMeta() would encode to a map with nothing in it; store nothing.
        meta = _EMPTY_META if meta_obj is None else _encoder.encode(meta_obj)
        size = len(data) + len(meta)
        if size > max_event_bytes:
            raise EventTooLargeError(thread_id, size, max_event_bytes, index)
        if id_bytes is None:
            id_bytes = _parse_ulid(event_id, "event id")
            # Minted ids are new by construction; only ids the caller chose can repeat.
            if seen is None:
                seen = set()
            elif id_bytes in seen:
                shown = _ulid_str(id_bytes)
                raise InvalidInputError(f"thread {thread_id!r}: event id {shown} appears twice")
            seen.add(id_bytes)
        # `content_digest`, with its input in two parts: the second is also what
        # `request_digest` hashes for this event.
        v = b"%d" % version
        content = b"%d:%s%d:%s%d:%s" % (len(v), v, len(data), data, len(meta), meta)
        if secret:
            h = hashlib.blake2b(digest_size=16, key=chain_key(secret))
        else:
            h = _UNKEYED_CONTENT_DIGEST.copy()
        h.update(b"%b%d:%b" % (thread_part, len(id_bytes), id_bytes))
        h.update(content)
        if request is not None:
            request.update(content)
        out.append(EncodedEvent(id_bytes, version, data, meta, h.hexdigest()))
    return out


_NO_META = EventMeta()


def request_digest(encoded: Sequence[EncodedEvent]) -> str:
    """What an idempotency key is bound to: the events' content, ids and times left out.

    A retry that rebuilt its events (fresh ids) with the same content is the same request.
    """
    h = hashlib.blake2b(digest_size=8)
    for e in encoded:
        v = b"%d" % e.version
        # Framed like `content_digest`'s input: ``<len>:<bytes>`` per field.
        h.update(b"%d:%s%d:%s%d:%s" % (len(v), v, len(e.data), e.data, len(e.meta), e.meta))
    return h.hexdigest()


def entry_fields(e: EncodedEvent, time_ms: int, link: str) -> dict[bytes, bytes]:
    """The stream entry of an event (used by the memory backend; the script mirrors it)."""
    return {
        b"i": e.id_bytes,
        b"v": b"%d" % e.version,
        b"s": b"%d" % time_ms,
        b"d": e.data,
        b"m": e.meta,
        b"h": link.encode("ascii"),
    }


def seq_of_entry_id(thread_id: str, entry_id: bytes | str) -> int:
    """The seq encoded in a stream entry id ``<seq>-0``."""
    raw = entry_id.decode("ascii", "replace") if isinstance(entry_id, bytes) else entry_id
    head, _, tail = raw.partition("-")
    # Redis ids are ASCII and at most 20 digits a part; anything else is damage.
    if not (head.isascii() and head.isdigit() and len(head) <= 20) or tail != "0":
        shown = raw if len(raw) <= 64 else raw[:61] + "..."
        raise CorruptEventError(thread_id, None, f"stream entry id {shown!r} is not <seq>-0")
    return int(head)


def damaged_time(
    thread_id: str, entry_id: bytes | str, raw: bytes | None, *, twice: bool = False
) -> CorruptEventError:
    """The error for an entry whose time (field ``s``) is missing, not a number or given
    twice, met by a search over times (`EventStore.seq_at`): it names the seq as
    `decode_entry` would."""
    try:
        seq: int | None = seq_of_entry_id(thread_id, entry_id)
    except CorruptEventError:
        seq = None
    if twice:
        what = "given twice (written from outside threadlog)"
    else:
        what = "missing" if raw is None else f"{raw!r}, not a number"
    return CorruptEventError(thread_id, seq, f"malformed envelope: its time (field 's') is {what}")


def missing_entry(thread_id: str, seq: int, version: int) -> CorruptEventError:
    """The error for the entry of a seq the thread's version holds but its log does not, met
    by a search over times (`EventStore.seq_at`): never stepped over, nor searched below."""
    return CorruptEventError(
        thread_id, seq, f"missing from the log, though the thread's version ({version}) holds "
        "it: damaged (run 'verify')"
    )  # fmt: skip


def log_without_meta(thread_id: str, then: str = "") -> CorruptEventError:
    """The error for a log that holds events while no meta hash records the thread's version
    (deleted, or 0): `EventStore.seq_at` cannot say where the log ends, and an append would
    reuse seq 1. ``then`` says what the call did about it ("; nothing was appended")."""
    return CorruptEventError(
        thread_id, None, "its log holds events but its meta hash (gone, or at version 0) "
        f"records none of them: damaged (run 'verify'){then}"
    )  # fmt: skip


def decode_entry(
    thread_id: str,
    entry_id: bytes | str,
    fields: dict[bytes, bytes] | dict[Any, Any],
    registry: EventRegistry,
) -> RecordedEvent:
    """Decode one stream entry; any damage raises `CorruptEventError` naming thread and seq."""
    seq = seq_of_entry_id(thread_id, entry_id)
    try:
        id_bytes = fields[b"i"]
        version = int(fields[b"v"])
        time_ms = int(fields[b"s"])
        data = fields[b"d"]
        meta_raw = fields[b"m"]
        link = fields[b"h"].decode("ascii")
    except KeyError as exc:
        raise CorruptEventError(thread_id, seq, f"missing field {exc.args[0]!r}") from None
    except (ValueError, AttributeError, UnicodeDecodeError) as exc:
        raise CorruptEventError(thread_id, seq, f"malformed envelope: {exc}") from None
    if not 0 <= time_ms <= MAX_EVENT_TIME_MS:
        raise CorruptEventError(
            thread_id, seq, f"malformed envelope: time {time_ms} ms is out of range (0 to "
            f"{MAX_EVENT_TIME_MS}, 9999-12-31)"
        )  # fmt: skip
    if len(id_bytes) != 16:
        raise CorruptEventError(thread_id, seq, "event id is not 16 bytes")
    try:
        payload = registry.decode(data, version)
    except (EventValidationError, UnknownEventTypeError) as exc:
        unknown = isinstance(exc, UnknownEventTypeError)
        raise CorruptEventError(thread_id, seq, str(exc), unknown_type=unknown) from None
    try:
        meta = _meta_decoder.decode(meta_raw) if meta_raw else _NO_META
    except DECODE_ERRORS as exc:
        raise CorruptEventError(thread_id, seq, f"malformed meta: {exc}") from None
    return RecordedEvent(
        thread_id=thread_id,
        seq=seq,
        id=_ulid_str(id_bytes),
        time_ms=time_ms,
        payload=payload,
        schema_version=version,
        turn_id=meta.turn_id,
        correlation_id=meta.correlation_id,
        causation_id=meta.causation_id,
        chain=link,
    )


_FIELD_ORDER = [b"i", b"v", b"s", b"d", b"m", b"h"]
_pick_fields = operator.itemgetter(*_FIELD_ORDER)
_DECODE_FAILURES = (
    ValueError, TypeError, IndexError, AttributeError, UnicodeDecodeError, msgspec.DecodeError
)  # fmt: skip


def decode_rows(
    thread_id: str, rows: Sequence[Any], registry: EventRegistry
) -> list[RecordedEvent]:
    """Decode a batch of stream entries as ``XRANGE`` returns them, in order.

    Each row is ``(entry_id, fields)`` with ``fields`` the flat ``[name, value, ...]`` list the
    server sends (or a dict, as redis-py's reply callback makes it). Entries with the fields in
    the order the append script writes them take a fast path: no dict, the payload decoded
    with the registry's union decoder directly. Every other entry, and any entry the fast path
    cannot decode, goes through `decode_entry`, so damage raises exactly what it raises there:
    `CorruptEventError` naming thread and seq.
    """
    return _decode_rows(thread_id, rows, registry)


def decode_payload_rows(
    thread_id: str, rows: Sequence[Any], registry: EventRegistry
) -> list[PayloadRow]:
    """`decode_rows`, each event as a `PayloadRow` ``(seq, payload, id bytes, meta)``.

    The same checks and the same errors; only the `RecordedEvent` (and the event id's text,
    a quarter of a bulk decode) is not built, for folds that need no more than this.
    """
    decode, versions = registry.fast_path()
    decode_payload = decode.decode
    decode_meta = _meta_decoder.decode
    pick = _pick_fields
    last_raw, last_meta = b"", _NO_META
    out: list[PayloadRow] = []
    append = out.append
    # `_decode_rows` minus what a row leaves out; the same checks, in its order where it
    # matters (a failure falls through to `decode_entry`, which raises or decodes as there).
    for entry_id, fields in rows:
        try:
            if type(fields) is list and len(fields) == 12:
                (
                    n_i, id_bytes, n_v, version_raw, n_s, time_raw,
                    n_d, data, n_m, meta_raw, n_h, link,
                ) = fields  # fmt: skip
                named = (
                    n_i == b"i" and n_v == b"v" and n_s == b"s" and n_d == b"d" and n_m == b"m"
                    and n_h == b"h"
                )  # fmt: skip
            elif type(fields) is dict and len(fields) == 6:
                id_bytes, version_raw, time_raw, data, meta_raw, link = pick(fields)
                named = True
            else:
                named = False
            seq_raw = entry_id[:-2]
            if (
                named
                and len(id_bytes) == 16
                and entry_id[-2:] == b"-0"
                and seq_raw.isdigit()
                and len(seq_raw) <= 20
            ):
                version = int(version_raw)
                payload = decode_payload(data)
                if versions.get(type(payload)) == version:
                    if meta_raw != last_raw:
                        last_meta = decode_meta(meta_raw) if meta_raw else _NO_META
                        last_raw = meta_raw
                    if not 0 <= int(time_raw) <= MAX_EVENT_TIME_MS:  # as the full path checks
                        raise ValueError("time out of range")
                    if type(link) is bytes and link.isascii():  # the full path: .decode("ascii")
                        append((int(seq_raw), payload, id_bytes, last_meta))
                        continue
        except (*_DECODE_FAILURES, KeyError):
            pass  # decode_entry below says what is wrong, in its words
        if type(fields) is list:
            it = iter(fields)
            fields = dict(zip(it, it, strict=False))
        append(payload_row(decode_entry(thread_id, entry_id, fields, registry)))
    return out


def payload_row(event: RecordedEvent) -> PayloadRow:
    """The `PayloadRow` of a decoded event."""
    meta = (
        _NO_META
        if event.turn_id is None and event.correlation_id is None and event.causation_id is None
        else EventMeta(
            turn_id=event.turn_id,
            correlation_id=event.correlation_id,
            causation_id=event.causation_id,
        )
    )
    return (event.seq, event.payload, _parse_ulid(event.id, "event id"), meta)


def event_id_text(id_bytes: bytes) -> str:
    """The text of an event id given as its 16 raw bytes (as in a `PayloadRow`)."""
    return _ulid_str(id_bytes)


def _decode_rows(
    thread_id: str, rows: Sequence[Any], registry: EventRegistry
) -> list[RecordedEvent]:
    decode, versions = registry.fast_path()
    decode_payload = decode.decode
    decode_meta = _meta_decoder.decode
    pick = _pick_fields
    last_raw, last_meta = b"", _NO_META
    out: list[RecordedEvent] = []
    append = out.append
    for entry_id, fields in rows:
        try:
            if type(fields) is list and len(fields) == 12:
                # Unpacked in one step and the names compared one by one: the cheapest check.
                (
                    n_i, id_bytes, n_v, version_raw, n_s, time_raw,
                    n_d, data, n_m, meta_raw, n_h, link,
                ) = fields  # fmt: skip
                if not (
                    n_i == b"i" and n_v == b"v" and n_s == b"s" and n_d == b"d" and n_m == b"m"
                    and n_h == b"h"
                ):  # fmt: skip
                    id_bytes = b""  # fields in another order: decode_entry judges them
            elif type(fields) is dict and len(fields) == 6:
                id_bytes, version_raw, time_raw, data, meta_raw, link = pick(fields)
            else:
                id_bytes = b""  # not the layout the script writes: decode_entry judges it
            seq_raw = entry_id[:-2]
            # "<seq>-0" with the seq as `seq_of_entry_id` accepts it (int() would take more).
            if (
                len(id_bytes) == 16
                and entry_id[-2:] == b"-0"
                and seq_raw.isdigit()
                and len(seq_raw) <= 20
            ):
                version = int(version_raw)
                payload = decode_payload(data)
                if versions.get(type(payload)) == version:
                    # Consecutive events mostly share their envelope (a turn's events carry
                    # its turn id): equal bytes decode to an equal frozen struct, reused.
                    if meta_raw != last_raw:
                        last_meta = decode_meta(meta_raw) if meta_raw else _NO_META
                        last_raw = meta_raw
                    meta = last_meta
                    time_ms = int(time_raw)
                    if not 0 <= time_ms <= MAX_EVENT_TIME_MS:
                        raise ValueError("time out of range")  # decode_entry says it
                    append(
                        RecordedEvent(
                            thread_id=thread_id,
                            seq=int(seq_raw),
                            id=_ulid_str(id_bytes),
                            time_ms=time_ms,
                            payload=payload,
                            schema_version=version,
                            turn_id=meta.turn_id,
                            correlation_id=meta.correlation_id,
                            causation_id=meta.causation_id,
                            chain=link.decode("ascii"),
                        )
                    )
                    continue
        except (*_DECODE_FAILURES, KeyError):
            pass  # decode_entry below says what is wrong, in its words
        if type(fields) is list:
            it = iter(fields)
            fields = dict(zip(it, it, strict=False))
        append(decode_entry(thread_id, entry_id, fields, registry))
    return out


def entry_digest(thread_id: str, fields: dict[bytes, bytes], secret: bytes | None) -> str | None:
    """Recompute ``c`` from a stored entry, or None when the entry lacks the fields."""
    try:
        return content_digest(
            thread_id, fields[b"i"], int(fields[b"v"]), fields[b"d"], fields[b"m"], secret
        )
    except (KeyError, ValueError):
        return None


def expected_version_arg(expected: ExpectedVersion) -> str:
    if isinstance(expected, StreamState):
        return expected.value
    if isinstance(expected, bool) or not isinstance(expected, int) or expected < 0:
        raise InvalidInputError(
            f"expected_version must be ANY, NO_THREAD, EXISTS or an int >= 0, not {expected!r}"
        )
    return str(expected)


def expected_incarnation_arg(expected: object) -> bytes:
    """An append's expected incarnation as the append script takes it: ``-`` for none, else
    its digits; `InvalidInputError` unless None or an int >= 1 (a bool is no life)."""
    if expected is None:
        return b"-"
    if isinstance(expected, bool) or not isinstance(expected, int) or expected < 1:
        raise InvalidInputError(
            f"expected_incarnation must be None or an int >= 1, not {expected!r}"
        )
    return b"%d" % expected


def version_satisfies(expected: ExpectedVersion, version: int) -> bool:
    """Whether a thread at ``version`` meets ``expected``, as an append checks it (the script
    compares the same way); raises `InvalidInputError` for a malformed expected version."""
    arg = expected_version_arg(expected)
    if arg == "any":
        return True
    if arg == "no_thread":
        return version == 0
    if arg == "exists":
        return version > 0
    return version == int(arg)


def idempotency_key_for(given: str | None, first_event_id: bytes) -> bytes:
    """The ledger field an append is recorded under: ``k:`` + the caller's key, or ``e`` + the
    first event's id as 16 raw bytes (a retry that reuses the events reuses their ids).
    """
    if given is None:
        return b"e" + first_event_id
    return caller_key_field(given)


def caller_key_field(given: object) -> bytes:
    """The ledger field of a caller's idempotency key: ``k:`` + the key."""
    if not isinstance(given, str) or not given or len(given) > 512:
        raise InvalidInputError("idempotency_key must be a non-empty str of at most 512 chars")
    try:
        return b"k:" + given.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"idempotency_key {not_unicode(given, exc)}") from None


def idempotency_key_text(given: str | None, first_event_id: str) -> str:
    """The idempotency key as errors name it: the caller's key as given, or ``e:<first event
    id>`` for the key derived when none was given (not the ledger field, whose ``k:`` prefix
    is internal)."""
    return "e:" + first_event_id if given is None else given


LEDGER_DIGEST_BYTES = 6
"""How much of the request digest a ledger entry keeps (a false "duplicate" for a reused key
with other content takes a 48-bit collision)."""


def parse_ledger_entry(thread_id: str, raw: bytes) -> tuple[int, int]:
    """The first and last seq of a Redis ledger entry, ``<first>[ <last>]`` followed by
    `LEDGER_DIGEST_BYTES` of the request digest (the append script writes it)."""
    span = raw[:-LEDGER_DIGEST_BYTES].split(b" ")
    if len(raw) <= LEDGER_DIGEST_BYTES or len(span) > 2 or not all(p.isdigit() for p in span):
        raise OperationalError(f"thread {thread_id!r}: unreadable idempotency ledger entry {raw!r}")
    return int(span[0]), int(span[-1])
