"""The partitioned change feed: what consumers and exporters read, with consumer groups.

Every append writes one feed entry to its thread's partition in the same atomic step (thread,
first seq, last seq); a thread deletion writes a tombstone. Feed entry ids are Redis stream ids
(``<ms>-<n>``), ordered within a partition.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

from ._errors import CorruptKeyError, InvalidInputError
from ._ids import not_unicode, validate_count, validate_name, validate_view_name

_STREAM_ID_RE = re.compile(r"([0-9]{1,20})(?:-([0-9]{1,20}))?", re.ASCII)
_MAX_ID_PART = 2**64 - 1


class FeedEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One change: events ``first_seq..last_seq`` appended to a thread, or its deletion."""

    id: str
    partition: int
    thread_id: str
    first_seq: int
    last_seq: int
    deleted: bool = False
    incarnation: int | None = None
    """Which life of the thread the change belongs to (its creation time in us): a thread
    deleted and created again under the same id starts a new one. None on entries written
    before threadlog recorded it."""

    @property
    def time_ms(self) -> int:
        """When the change was recorded (the stream id's time part)."""
        return int(self.id.split("-", 1)[0])


class GroupInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A consumer group of one partition's feed."""

    name: str
    last_delivered: str
    pending: int
    oldest_pending: str | None


class CheckpointedState(msgspec.Struct, frozen=True, kw_only=True):
    """What `EventStore.delete_checkpointed` deleted of an async projection in a partition."""

    checkpoint: str | None
    """The checkpoint it had there, as stored (None: it had none)."""
    hashes: list[str]
    """The names of its partition-level hashes that were there, sorted."""


class FeedInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A partition's feed as it stands: what it holds, and how far it has been trimmed."""

    partition: int
    length: int
    """Entries it holds."""
    first_id: str | None
    """Its oldest entry (None: empty)."""
    last_id: str
    """The newest id it ever gave an entry ("0-0": none yet), trimmed or not."""
    trimmed_to: str
    """The newest id ever removed from it ("0-0": nothing ever was). A reader whose position
    is before this id has lost changes: they left the feed before it read them."""


def parse_stream_id(value: str) -> tuple[int, int]:
    """``"<ms>-<n>"`` (or ``"<ms>"``) as a pair of ints; raises `InvalidInputError` otherwise.

    Only what Redis takes as an id (ASCII digits, parts below 2**64): anything else would be
    refused by the server as an error that reads as retryable.
    """
    found = _STREAM_ID_RE.fullmatch(value) if isinstance(value, str) else None
    if found is None:
        raise InvalidInputError(f"not a stream id: {value!r}")
    ms, n = int(found.group(1)), int(found.group(2) or 0)
    if ms > _MAX_ID_PART or n > _MAX_ID_PART:
        raise InvalidInputError(f"not a stream id: {value!r}")
    return ms, n


def validate_stream_ids(ids: Sequence[str]) -> list[str]:
    """``ids`` as a list, each checked by `parse_stream_id`."""
    out = _id_list(ids)
    for value in out:
        parse_stream_id(value)
    return out


def parse_stream_ids(ids: Sequence[str]) -> list[tuple[int, int]]:
    """Each of ``ids`` parsed by `parse_stream_id` (as `validate_stream_ids` checks them)."""
    return [parse_stream_id(value) for value in _id_list(ids)]


def _id_list(ids: Sequence[str]) -> list[str]:
    if isinstance(ids, str | bytes):  # a lone id would be taken for its characters
        raise InvalidInputError(f"ids must be a sequence of stream ids, not {ids!r}")
    return list(ids)


def validate_group(group: object) -> str:
    """Return ``group`` if it is a usable consumer group name, else raise `InvalidInputError`."""
    return validate_name(group, "group name")


def validate_group_to_drop(group: object) -> str:
    """Return ``group`` if it may name a consumer group to drop, else raise
    `InvalidInputError`: any non-empty str. Looser than `validate_group` on purpose: a group
    registered by another tool (``XGROUP CREATE``) may have a name threadlog never gives one,
    and it holds trimming back all the same (`feed_group_lag` lists it)."""
    if not isinstance(group, str):
        raise InvalidInputError(f"group name must be a str, not {type(group).__name__}")
    if not group:
        raise InvalidInputError("the group name is empty")
    try:
        # A name Redis could hold; a byte that is not UTF-8 in a command line comes as a lone
        # surrogate, which the client cannot send (an encoding error, not "no such group").
        group.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"group name {not_unicode(group, exc)}") from exc
    return group


MAX_CONSUMER_CHARS = 256


def validate_consumer(consumer: object) -> str:
    """Return ``consumer`` if it is a usable consumer name, else raise `InvalidInputError`.

    Redis takes any bytes, but a consumer is named in `XPENDING` and `XINFO` output that
    operators read, and an empty name or a non-str (bytes, None) is a caller's mistake: a
    printable str, such as ``"host-1:4242"``, of 1-256 characters.
    """
    if (
        not isinstance(consumer, str)
        or not 0 < len(consumer) <= MAX_CONSUMER_CHARS
        or not consumer.isprintable()
    ):
        raise InvalidInputError(
            f"consumer name {consumer!r} must be a str of 1-{MAX_CONSUMER_CHARS} printable "
            "characters"
        )
    return consumer


def validate_feed_count(count: object) -> None:
    """A feed read's ``count``: at least one entry (redis-py refuses COUNT 0 for some commands,
    and XREADGROUP reads everything with it)."""
    validate_count(count, "count", minimum=1)


def validate_block_ms(block_ms: object) -> None:
    """``block_ms`` is None (do not wait) or a positive wait: Redis's BLOCK 0 waits forever,
    and a consumer that waits forever cannot stop cleanly."""
    if block_ms is not None and (
        isinstance(block_ms, bool) or not isinstance(block_ms, int) or block_ms <= 0
    ):
        raise InvalidInputError(
            f"block_ms must be > 0 (ms to wait) or None (do not wait), not {block_ms!r}"
        )


INCREMENT_MAX = 2**63 - 1
"""The largest amount (and, negated, the smallest) an `apply_checkpointed` increment may add,
and the range a projection's hash field stays in: Redis keeps them as 64-bit ints."""


def validate_increments(incr: Sequence[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """``incr`` as a list, each ``(hash name, field, amount)`` with a usable hash name, a str
    field and an int amount (not a bool, a float or a numeric str, which would be truncated or
    read) within +-`INCREMENT_MAX`; raises `InvalidInputError` otherwise."""
    if isinstance(incr, str | bytes) or not isinstance(incr, Sequence):
        raise InvalidInputError(f"increments must be a sequence of triples, not {incr!r}")
    out = list(incr)
    for item in out:
        if not isinstance(item, tuple | list) or len(item) != 3:
            raise InvalidInputError(f"an increment must be (hash, field, amount), not {item!r}")
        hash_name, field, amount = item
        validate_view_name(hash_name)
        if not isinstance(field, str):
            raise InvalidInputError(f"an increment's field must be a str, not {field!r}")
        if (
            isinstance(amount, bool)
            or not isinstance(amount, int)
            or not -INCREMENT_MAX <= amount <= INCREMENT_MAX
        ):
            raise InvalidInputError(
                f"increment {item!r}: the amount must be an int within +-(2**63 - 1)"
            )
    return out


def validate_hash_names(hashes: Sequence[str]) -> list[str]:
    """``hashes`` (names of an async projection's hashes) as a list without repeats, each a
    usable name; raises `InvalidInputError` otherwise (a lone str too: not a sequence of
    names, though Python iterates it)."""
    if isinstance(hashes, str | bytes) or not isinstance(hashes, Sequence):
        raise InvalidInputError(f"hashes must be a sequence of hash names, not {hashes!r}")
    return list(dict.fromkeys(validate_name(h, "hash name") for h in hashes))


EXPORT_GROUP_PREFIX = "export-"
"""An export's feed consumer group is ``export-<its name>``; no projection's may look like one."""


def validate_projection_name(name: object) -> str:
    """Return ``name`` if it is a usable async projection name, else raise
    `InvalidInputError`. A projection's name is its feed consumer group's, so it may not start
    with ``export-``: that would be an export's group (a runner and an export sharing one
    would each move the other's position, and forgetting the projection would drop the
    export's)."""
    checked = validate_name(name, "projection name")
    if checked.startswith(EXPORT_GROUP_PREFIX):
        raise InvalidInputError(
            f"projection name {checked!r} starts with {EXPORT_GROUP_PREFIX!r}, which names an "
            f"export's feed consumer group ({EXPORT_GROUP_PREFIX}<its name>), not an async "
            "projection's; to remove an export's group, drop it (drop_feed_group, threadlog "
            "drop-group)"
        )
    return checked


def format_stream_id(parts: tuple[int, int]) -> str:
    """The inverse of `parse_stream_id`."""
    return f"{parts[0]}-{parts[1]}"


def entry_from_fields(
    key: str, partition: int, entry_id: str, fields: dict[bytes, bytes]
) -> FeedEntry:
    """Decode a feed stream entry (of stream ``key``).

    Raises:
        CorruptKeyError: the entry is none threadlog writes (it was added from outside):
            naming the key and the entry, which a reader of the feed cannot pass over.
    """
    try:
        entry = FeedEntry(
            id=entry_id,
            partition=partition,
            thread_id=fields[b"t"].decode("utf-8"),
            first_seq=int(fields[b"f"]),
            last_seq=int(fields[b"l"]),
            deleted=fields.get(b"x") == b"deleted",
            incarnation=int(fields[b"n"]) if b"n" in fields else None,
        )
        problem = None
    except KeyError as exc:
        problem = f"it has no field {exc.args[0].decode('ascii', 'replace')!r}"
    except (ValueError, UnicodeDecodeError) as exc:  # int() and decode()
        problem = f"a field holds what threadlog never writes there ({exc})"
    if problem is None:
        # A deletion says seqs 0..version; an append at least one seq from 1.
        lowest = 0 if entry.deleted else 1
        if entry.thread_id and lowest <= entry.first_seq <= entry.last_seq:
            return entry
        problem = f"its thread and seqs ({fields!r:.200}) are none threadlog writes"
    raise CorruptKeyError(
        key,
        f"feed entry {entry_id} is not one threadlog writes: {problem}; a change feed holds "
        "only threadlog's entries (remove that one with XDEL to read the feed on)",
    )


def safe_trim_point(groups: list[GroupInfo]) -> str | None:
    """The lowest feed id some group still needs: nothing below it may be trimmed.

    A group needs its oldest pending entry, and everything after its last delivered one.
    None when no group is registered (then only a maximum age may trim).
    """
    if not groups:
        return None
    needs: list[tuple[int, int]] = []
    for g in groups:
        if g.oldest_pending is not None:
            needs.append(parse_stream_id(g.oldest_pending))
        ms, n = parse_stream_id(g.last_delivered)
        needs.append((ms, n + 1))
    return format_stream_id(min(needs))
