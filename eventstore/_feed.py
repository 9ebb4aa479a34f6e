"""The partitioned change feed: what consumers and exporters read, with consumer groups.

Every append writes one feed entry to its thread's partition in the same atomic step (thread,
first seq, last seq); a thread deletion writes a tombstone. Feed entry ids are Redis stream ids
(``<ms>-<n>``), ordered within a partition.
"""

from __future__ import annotations

import msgspec

from ._errors import InvalidInputError


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


def parse_stream_id(value: str) -> tuple[int, int]:
    """``"<ms>-<n>"`` (or ``"<ms>"``) as a pair of ints; raises `InvalidInputError` otherwise."""
    head, _, tail = value.partition("-")
    try:
        ms, n = int(head), int(tail or 0)
    except ValueError:
        raise InvalidInputError(f"not a stream id: {value!r}") from None
    if ms < 0 or n < 0:
        raise InvalidInputError(f"not a stream id: {value!r}")
    return ms, n


def format_stream_id(parts: tuple[int, int]) -> str:
    """The inverse of `parse_stream_id`."""
    return f"{parts[0]}-{parts[1]}"


def entry_from_fields(partition: int, entry_id: str, fields: dict[bytes, bytes]) -> FeedEntry:
    """Decode a feed stream entry."""
    return FeedEntry(
        id=entry_id,
        partition=partition,
        thread_id=fields[b"t"].decode("utf-8"),
        first_seq=int(fields[b"f"]),
        last_seq=int(fields[b"l"]),
        deleted=fields.get(b"x") == b"deleted",
        incarnation=int(fields[b"n"]) if b"n" in fields else None,
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
