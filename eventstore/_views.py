"""Generic view operations and view reads; the store applies them without knowing what they mean.

Projections describe how their materialized form changes with each append as a list of these
operations; the store applies them in the same atomic step as the append. Every stored view
value carries a small stamp: the seq of the event that wrote it and, in hashes, a per-field
version, so that readers get positions without reading the log.
"""

from __future__ import annotations

import msgspec

from ._errors import InvalidInputError, UnstampedViewError
from ._ids import validate_int, validate_view_name


class ViewEntry(msgspec.Struct, frozen=True):
    """One value of a view with its stamp: the writing event's seq and (hash fields) version."""

    seq: int
    value: bytes
    version: int = 0


# -- stamps: the byte format shared with the Lua scripts --------------------------------------


def stamp_list_value(seq: int, value: bytes) -> bytes:
    """``<seq>:<value>``: how list views store a value."""
    return b"%d:%s" % (seq, value)


def stamp_hash_value(version: int, seq: int, value: bytes) -> bytes:
    """``<version>:<seq>:<value>``: how hash views store a field."""
    return b"%d:%d:%s" % (version, seq, value)


def unstamp_list_value(raw: bytes) -> ViewEntry:
    """Split a stored list value into its stamp and value."""
    head, sep, value = raw.partition(b":")
    if not sep or not head.isdigit():
        raise ValueError("list view value has no seq stamp")
    return ViewEntry(int(head), value)


def unstamp_hash_value(raw: bytes) -> ViewEntry:
    """Split a stored hash field into its stamp and value."""
    ver, sep1, rest = raw.partition(b":")
    seq, sep2, value = rest.partition(b":")
    if not (sep1 and sep2 and ver.isdigit() and seq.isdigit()):
        raise ValueError("hash view value has no version/seq stamp")
    return ViewEntry(int(seq), value, int(ver))


# -- write operations, applied atomically with an append --------------------------------------


class ListPush(msgspec.Struct, frozen=True):
    """Append ``values`` to the list view, stamped with the seq of event #``event``."""

    view: str
    values: tuple[bytes, ...]
    event: int = 0


class ListReset(msgspec.Struct, frozen=True):
    """Replace the list view's contents with ``values``, stamped with event #``event``."""

    view: str
    values: tuple[bytes, ...]
    event: int = 0


class ListPop(msgspec.Struct, frozen=True):
    """Remove up to ``count`` values from the end of the list view."""

    view: str
    count: int = 1


class HashSet(msgspec.Struct, frozen=True):
    """Set a hash view field, bumping its version; stamped with the seq of event #``event``.

    With ``expected_version`` (0: the field must be absent) the whole append is refused with
    `ViewConflictError` unless the field is at exactly that version.
    """

    view: str
    field: str
    value: bytes
    event: int = 0
    expected_version: int | None = None


class HashDelete(msgspec.Struct, frozen=True):
    """Delete a hash view field, optionally guarded like `HashSet`."""

    view: str
    field: str
    expected_version: int | None = None


class ViewClear(msgspec.Struct, frozen=True):
    """Delete a view entirely."""

    view: str


class ListLoad(msgspec.Struct, frozen=True):
    """Replace a list view with pre-stamped entries (used by rebuilds, outside appends)."""

    view: str
    entries: tuple[ViewEntry, ...]


class HashLoad(msgspec.Struct, frozen=True):
    """Replace a hash view with pre-stamped fields (used by rebuilds, outside appends)."""

    view: str
    entries: dict[str, ViewEntry]


ViewOp = ListPush | ListReset | ListPop | HashSet | HashDelete | ViewClear | ListLoad | HashLoad


def _is_int(value: object) -> bool:
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


def check_field_name(field: object, what: str) -> None:
    """Refuse a hash field name that is no str, or that has no UTF-8 form (a lone surrogate):
    Redis stores the UTF-8, so such a name failed there with ``UnicodeEncodeError`` while the
    memory backend took it."""
    if not isinstance(field, str):
        raise InvalidInputError(f"{what} must be a str, not {field!r:.80}")
    if not field.isascii():
        try:
            field.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInputError(
                f"{what} {field!r:.80} is not valid text (a lone surrogate): Redis stores "
                "field names as UTF-8"
            ) from None


def _check_arguments(op: ViewOp) -> None:
    """The op's fields are of the types it declares (a Struct does not check them when built):
    what Redis cannot be sent is refused here, as this op's own error, not at send time, where
    it would fail every append of the batch it was sent with."""
    view = getattr(op, "view", None)
    if not isinstance(view, str):
        raise InvalidInputError(f"{type(op).__name__}.view must be a str, not {view!r}")
    values = getattr(op, "values", ())
    if not isinstance(values, tuple | list) or not all(
        isinstance(v, bytes | bytearray | memoryview) for v in values
    ):
        raise InvalidInputError(f"{type(op).__name__}.values must be bytes values")
    check_field_name(getattr(op, "field", ""), f"{type(op).__name__}.field")
    value = getattr(op, "value", b"")
    if not isinstance(value, bytes | bytearray | memoryview):
        raise InvalidInputError(f"{type(op).__name__}.value must be bytes, not {value!r}")
    for name in ("event", "count"):
        n = getattr(op, name, 0)
        if not _is_int(n):
            raise InvalidInputError(f"{type(op).__name__}.{name} must be an int, not {n!r}")
    expected = getattr(op, "expected_version", None)
    if expected is not None and not _is_int(expected):
        raise InvalidInputError(
            f"{type(op).__name__}.expected_version must be an int or None, not {expected!r}"
        )


def check_ops(ops: tuple[ViewOp, ...] | list[ViewOp], n_events: int, *, in_append: bool) -> None:
    """Reject malformed operations before anything is sent."""
    for op in ops:
        # The op every message append carries, well formed: what the checks below would
        # find, found with exact type tests (this runs on every append with views).
        if (
            type(op) is ListPush
            and in_append
            and type(op.view) is str
            and type(op.event) is int
            and 0 <= op.event < n_events
            and type(op.values) is tuple
            and all(type(v) is bytes for v in op.values)
        ):
            continue
        if not isinstance(op, ViewOp):
            raise InvalidInputError(f"not a view op: {op!r}")
        _check_arguments(op)
        if isinstance(op, ListPush | ListReset | HashSet):
            if not 0 <= op.event < max(n_events, 1):
                raise InvalidInputError(
                    f"view op on {op.view!r} refers to event #{op.event}, "
                    f"but the append has {n_events} events"
                )
            if in_append is False:
                raise InvalidInputError("event-stamped view ops are only valid in an append")
        if isinstance(op, ListPop) and op.count < 1:
            raise InvalidInputError("ListPop.count must be >= 1")
        if isinstance(op, HashSet | HashDelete) and (op.expected_version or 0) < 0:
            raise InvalidInputError("expected_version must be >= 0")


# -- reads, answered together in one round trip -----------------------------------------------


class ListRange(msgspec.Struct, frozen=True):
    """Read list view entries ``start..stop`` (inclusive, negative counts from the end)."""

    view: str
    start: int = 0
    stop: int = -1


class HashGetAll(msgspec.Struct, frozen=True):
    """Read every field of a hash view."""

    view: str


class HashGet(msgspec.Struct, frozen=True):
    """Read some fields of a hash view (absent fields are left out of the result)."""

    view: str
    fields: tuple[str, ...]


class HashGetListed(msgspec.Struct, frozen=True):
    """Read the hash fields named by a slice of a list view (e.g. the latest records by id).

    The list view's values are the field names; the result keeps the list's order.
    """

    view: str
    list_view: str
    start: int = 0
    stop: int = -1


ViewRead = ListRange | HashGetAll | HashGet | HashGetListed
ViewResult = list[ViewEntry] | dict[str, ViewEntry]


# Redis parses list indexes as signed 64-bit integers and refuses any other; no list is longer
# than the positive bound, so an index beyond either bound means what the bound means.
_INDEX_MIN, _INDEX_MAX = -(2**63), 2**63 - 1


def redis_index(index: int) -> int:
    """A list index as Redis takes it: clamped to 64 bits (the same entries either way)."""
    return _INDEX_MIN if index < _INDEX_MIN else _INDEX_MAX if index > _INDEX_MAX else index


def check_reads(reads: object) -> list[ViewRead]:
    """Refuse malformed view reads before anything is sent (both backends): each read a
    `ViewRead` with usable view names, int list indexes and str hash field names."""
    if isinstance(reads, str | bytes) or not isinstance(reads, list | tuple):
        raise InvalidInputError(f"reads must be a list of view reads, not {reads!r:.80}")
    for r in reads:
        if not isinstance(r, ListRange | HashGetAll | HashGet | HashGetListed):
            raise InvalidInputError(f"not a view read: {r!r:.80}")
        validate_view_name(r.view)
        if isinstance(r, ListRange | HashGetListed):
            validate_int(r.start, "start")
            validate_int(r.stop, "stop")
        if isinstance(r, HashGetListed):
            validate_view_name(r.list_view)
        if isinstance(r, HashGet):
            if not isinstance(r.fields, tuple | list):
                raise InvalidInputError(f"HashGet.fields must be a tuple of str, not {r.fields!r}")
            for f in r.fields:
                check_field_name(f, "a hash field name")
    return list(reads)


class ViewSnapshot(msgspec.Struct, frozen=True):
    """View reads taken atomically, with the thread's version at that moment.

    ``incarnation`` is the life the thread was in (`EventStore.incarnation`; None without a
    thread, or where none is recorded), read in the same step: a writer that writes after
    these reads passes it as ``expected_incarnation`` along with ``version``.
    """

    version: int
    results: list[ViewResult]
    incarnation: int | None = None


def decode_view_result(thread_id: str, read: ViewRead, raw: list[bytes]) -> ViewResult:
    try:
        if isinstance(read, ListRange):
            return [unstamp_list_value(v) for v in raw]
        it = iter(raw)
        return {f.decode("utf-8"): unstamp_hash_value(v) for f, v in zip(it, it, strict=True)}
    except ValueError as exc:
        raise UnstampedViewError(thread_id, read.view, str(exc)) from exc
