"""Identifier generation and validation: ULIDs, thread ids, namespaces and view names."""

from __future__ import annotations

import os
import re
import threading
import time

from ._errors import InvalidInputError, InvalidNamespaceError, InvalidThreadIdError

MAX_THREAD_ID_BYTES = 256
MAX_NAMESPACE_CHARS = 64

# Namespaces and view names become part of Redis key names and ACL key patterns, so they keep
# to a charset that no glob or hash-tag syntax can misread.
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")
# Thread ids are free text for the caller, minus what would break keys or logs: control
# characters (log injection, invisible ids) and braces (Redis Cluster hash tags).
_THREAD_FORBIDDEN_RE = re.compile(r"[\x00-\x1f\x7f{}]")


def new_ulid() -> str:
    """A new ULID as its 26-character Crockford base32 string (`mint_ulid`'s, as text)."""
    global last_new_ulid
    raw = mint_ulid()
    text = ulid_text(raw)
    # One assignment (a thread switch cannot split the pair): `ulid_bytes` reads it.
    last_new_ulid = (text, raw)
    return text


last_new_ulid: tuple[str, bytes] = ("", b"")
"""The text and bytes of the last id `new_ulid` returned: a `NewEvent` gets its default id
from it, and the append that takes the event turns that text back into bytes right away."""


def ulid_bytes(text: str) -> bytes | None:
    """The bytes of ``text`` if it is the very string `new_ulid` returned last (no parse)."""
    last = last_new_ulid
    return last[1] if text is last[0] else None


_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_ULID_PAIRS = [a + b for a in _CROCKFORD for b in _CROCKFORD]  # 10 bits -> two characters


def ulid_text(raw: bytes) -> str:
    """``str(ULID.from_bytes(raw))``: 26 Crockford digits of the 128 bits (2 leading zero bits),
    at a third of python-ulid's cost (ids are printed per event by bulk reads and minted per
    event by appends)."""
    n = int.from_bytes(raw, "big")
    p = _ULID_PAIRS
    # One join, not twelve concatenations: a quarter less time.
    return "".join((
        p[n >> 120], p[(n >> 110) & 1023], p[(n >> 100) & 1023], p[(n >> 90) & 1023],
        p[(n >> 80) & 1023], p[(n >> 70) & 1023], p[(n >> 60) & 1023], p[(n >> 50) & 1023],
        p[(n >> 40) & 1023], p[(n >> 30) & 1023], p[(n >> 20) & 1023], p[(n >> 10) & 1023],
        p[n & 1023],
    ))  # fmt: skip


_mint_lock = threading.Lock()
_last_minted = b""  # compared as bytes: same length, big-endian, so in the order of the ints
# Random bits for minted ids, read from the OS a batch at a time (a getrandom() call per id
# cost more than the rest of minting); emptied in a forked child, which must not reuse them.
_RANDOM_BATCH = 64 * 10
_random = b""
_random_at = 0


def _forget_random() -> None:
    global _random, _random_at
    _random, _random_at = b"", 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_random)


def mint_ulid() -> bytes:
    """A new ULID as its 16 bytes: ms timestamp, 80 random bits; increasing within the process.

    The append path mints one per event: python-ulid's ``ULID()`` costs about three times as
    much. An id that would not sort after the previous one (same ms, lower random part, or a
    clock step back) is the previous one plus one, as ULID's monotonic mode does.
    """
    global _last_minted, _random, _random_at
    stamp = (time.time_ns() // 1_000_000).to_bytes(6, "big")
    # acquire/release: a `with` block costs twice as much, and this runs for every event.
    _mint_lock.acquire()
    try:
        at = _random_at
        if at + 10 > len(_random):
            _random, at = os.urandom(_RANDOM_BATCH), 0
        _random_at = at + 10
        raw = stamp + _random[at : at + 10]
        if raw <= _last_minted:
            raw = (int.from_bytes(_last_minted, "big") + 1).to_bytes(16, "big")
        _last_minted = raw
    finally:
        _mint_lock.release()
    return raw


def validate_count(value: object, name: str, *, minimum: int = 0) -> None:
    """Refuse a count that is not an int >= ``minimum`` (0 unless told): `InvalidInputError`
    naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInputError(f"{name} must be an int >= {minimum}, not {value!r}")


def validate_limit(limit: object, name: str = "limit") -> None:
    """`validate_count` for a limit that may also be None (no limit)."""
    if limit is not None:
        validate_count(limit, name)


def validate_partition(partition: object, partitions: int) -> int:
    """``partition`` if it is one of ``partitions`` (an int in 0..partitions-1, not a bool),
    else `InvalidInputError`."""
    if isinstance(partition, bool) or not isinstance(partition, int):
        raise InvalidInputError(
            f"partition must be an int in 0..{partitions - 1}, not {partition!r:.40}"
        )
    if not 0 <= partition < partitions:
        raise InvalidInputError(f"partition must be in 0..{partitions - 1}, not {partition}")
    return partition


def validate_expected_deletion(expected_version: object) -> str:
    """A deletion's expected version as the delete script takes it: "" for none (any), else
    its digits; `InvalidInputError` unless None or an int >= 0."""
    if expected_version is None:
        return ""
    validate_count(expected_version, "expected_version")
    return str(expected_version)


def validate_int(value: object, name: str) -> None:
    """Refuse a value that is not an int (a time in ms, a list index): `InvalidInputError`
    naming the argument. Any sign: what a negative one means is the caller's business."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{name} must be an int, not {value!r}")


def validate_seq_range(start: object, stop: object) -> None:
    """Refuse a seq range whose ``start`` is not an int >= 0 or whose ``stop`` is neither an
    int >= 0 nor None (the last event): negative seqs name no event, and read as nothing
    rather than as "from the end"."""
    validate_count(start, "start")
    if stop is not None and (isinstance(stop, bool) or not isinstance(stop, int) or stop < 0):
        raise InvalidInputError(f"stop must be an int >= 0 or None (the last event), not {stop!r}")


def not_unicode(text: str, exc: UnicodeEncodeError) -> str:
    """What makes ``text`` (which failed to encode as UTF-8 with ``exc``) not valid unicode,
    for an error message: "'...' is not valid unicode: it holds ... (at character N)"."""
    # A lone surrogate: in Python's own strings, or a byte that is not UTF-8 in a command
    # line or file name (decoded with surrogateescape, as U+DC80..U+DCFF).
    code = ord(text[exc.start])
    what = (
        f"the byte 0x{code - 0xDC00:02x}, not UTF-8"
        if 0xDC80 <= code <= 0xDCFF
        else f"a lone surrogate U+{code:04X}"
    )
    return f"{text!r} is not valid unicode: it holds {what} (at character {exc.start})"


def prefixed_thread_id(prefix: str, escaped: str, what: str) -> str:
    """The thread id ``prefix + escaped`` of an adapter's own id (``what`` names it: "LangGraph
    thread_id"), validated; one too long is said in the caller's terms, not as the length of
    a thread id it never wrote."""
    thread_id = prefix + escaped
    try:
        size = len(thread_id.encode("utf-8"))
    except UnicodeEncodeError:
        size = 0  # validate_thread_id says what is wrong with it
    if size > MAX_THREAD_ID_BYTES:
        raise InvalidThreadIdError(
            f"{what} is too long: it is stored as a thread id of {size} bytes (the prefix "
            f"{prefix!r}, then the id in UTF-8 with each '%', brace or control character "
            f"written as 3), and a thread id holds at most {MAX_THREAD_ID_BYTES}"
        )
    return validate_thread_id(thread_id)


def validate_thread_id(thread_id: object) -> str:
    """Return ``thread_id`` if it is a usable thread id, else raise `InvalidThreadIdError`."""
    if not isinstance(thread_id, str):
        raise InvalidThreadIdError(f"thread id must be a str, not {type(thread_id).__name__}")
    if not thread_id:
        raise InvalidThreadIdError("thread id must not be empty")
    try:
        size = len(thread_id.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidThreadIdError(f"thread id {not_unicode(thread_id, exc)}") from exc
    if size > MAX_THREAD_ID_BYTES:
        raise InvalidThreadIdError(
            f"thread id is {size} bytes long, the limit is {MAX_THREAD_ID_BYTES}"
        )
    bad = _THREAD_FORBIDDEN_RE.search(thread_id)
    if bad is not None:
        raise InvalidThreadIdError(
            f"thread id {thread_id!r} holds a forbidden character {bad.group()!r} "
            "(control characters and braces are not allowed)"
        )
    return thread_id


def validate_namespace(namespace: object) -> str:
    """Return ``namespace`` if it is a usable namespace, else raise `InvalidNamespaceError`."""
    if not isinstance(namespace, str):
        raise InvalidNamespaceError(f"namespace must be a str, not {type(namespace).__name__}")
    if not 0 < len(namespace) <= MAX_NAMESPACE_CHARS or _NAME_RE.fullmatch(namespace) is None:
        raise InvalidNamespaceError(
            f"namespace {namespace!r} must be 1-{MAX_NAMESPACE_CHARS} characters "
            "of A-Z a-z 0-9 _ . -"
        )
    return namespace


def validate_view_name(view: object) -> str:
    """Return ``view`` if it is a usable view name, else raise `InvalidInputError`."""
    return validate_name(view, "view name")


def validate_name(value: object, what: str) -> str:
    """Return ``value`` if it is a usable key-part name (a view, a feed group), else raise
    `InvalidInputError` calling it ``what``."""
    if not isinstance(value, str) or _NAME_RE.fullmatch(value) is None or len(value) > 64:
        raise InvalidInputError(f"{what} {value!r} must be 1-64 characters of A-Z a-z 0-9 _ . -")
    return value
