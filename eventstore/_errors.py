"""The exception hierarchy: one root with conflict, input and operational branches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec


class EventStoreError(Exception):
    """Raised when the event store cannot do what was asked; the root of every threadlog error."""


# -- conflicts: the request was well formed but the store's state disagrees ------------------


class ConflictError(EventStoreError):
    """Raised when a request is refused because the stored state disagrees with the caller (an
    append's expectations, a feed consumer group that is not there)."""


# A symbolic expected version (a `StreamState`, not imported here: the contract imports this
# module) is shown by its name and what it means, not as "StreamState.NO_THREAD".
_EXPECTED_WORDS: dict[object, str] = {
    "NO_THREAD": "NO_THREAD (no events yet)",
    "EXISTS": "EXISTS (at least one event)",
    "ANY": "ANY",
}


class ConcurrencyError(ConflictError):
    """Raised when an append's expected version does not match the thread's actual version."""

    def __init__(self, thread_id: str, expected: object, actual: int) -> None:
        self.thread_id = thread_id
        self.expected = expected
        self.actual = actual
        shown = _EXPECTED_WORDS.get(getattr(expected, "name", None), expected)
        super().__init__(f"thread {thread_id!r}: expected version {shown}, actual version {actual}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.thread_id, self.expected, self.actual))


class IncarnationConflictError(ConcurrencyError):
    """Raised when an append's ``expected_incarnation`` is not the thread's life: the thread
    was deleted since the caller read it (``actual_incarnation`` None), or deleted and written
    again (another life, whose versions restarted at 1 and may equal the one expected).

    A `ConcurrencyError`, so a caller that reloads and retries on one handles it; ``expected``
    and ``actual`` are the append's expected version and the thread's version, as there.
    """

    def __init__(
        self,
        thread_id: str,
        expected: object,
        actual: int,
        expected_incarnation: int,
        actual_incarnation: int | None,
    ) -> None:
        self.expected_incarnation = expected_incarnation
        self.actual_incarnation = actual_incarnation
        # ConcurrencyError's message is about versions; this one names the lives instead.
        super().__init__(thread_id, expected, actual)
        now = "no longer exists" if actual_incarnation is None else (
            f"is in life {actual_incarnation} (version {actual})"
        )  # fmt: skip
        self.args = (
            f"thread {thread_id!r}: expected life {expected_incarnation}, the thread {now}",
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (
                self.thread_id,
                self.expected,
                self.actual,
                self.expected_incarnation,
                self.actual_incarnation,
            ),
        )


class ThreadReplacedError(ConflictError):
    """Raised when a thread was deleted (and perhaps written again under its id) while a read
    of several batches went through it: the events read so far belong to a life of the thread
    that is gone, so the read stops rather than go on in the next life. Read again."""

    def __init__(self, thread_id: str) -> None:
        self.thread_id = thread_id
        super().__init__(
            f"thread {thread_id!r} was deleted while it was read (the events read so far are "
            "of its previous life); read it again"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.thread_id,))


class IdempotencyKeyReusedError(ConflictError):
    """Raised when an idempotency key already recorded an append with different content."""

    def __init__(self, thread_id: str, key: str) -> None:
        self.thread_id = thread_id
        self.key = key
        """The caller's ``idempotency_key`` as given; ``e:<first event id>`` when the append
        gave none and the key was derived from its first event's id."""
        super().__init__(
            f"thread {thread_id!r}: idempotency key {key!r} was already used for different events"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.thread_id, self.key))


class FeedTrimmedError(ConflictError):
    """Raised when a feed was trimmed past a reader's position: changes the reader had not
    read are gone from the feed (never from the threads' logs), so it cannot go on exactly.

    Also raised for a consumer group whose delivered, unacknowledged entries were trimmed
    (by age, or by hand) before its consumer acknowledged them: ``lost`` names them. Read
    again as pending they stay pending, and this is raised each time, until the consumer
    acknowledges them (`EventStore.ack_feed`) after taking the changes from the threads' logs
    (or accepting they are gone); a claim (`EventStore.claim_feed`) drops them from the group
    as it raises.

    Not retryable: the entries will not come back. `EventStore.feed_info` tells how far the
    feed was trimmed.
    """

    def __init__(
        self,
        partition: int,
        reader: str,
        position: str,
        trimmed_to: str,
        lost: Sequence[str] = (),
    ) -> None:
        self.partition = partition
        self.reader = reader
        self.position = position
        self.trimmed_to = trimmed_to
        self.lost = tuple(lost)
        if self.lost:
            shown = ", ".join(self.lost[:5]) + (", ..." if len(self.lost) > 5 else "")
            message = (
                f"the change feed of partition {partition} was trimmed past entries "
                f"delivered to {reader} and not acknowledged ({len(self.lost)}: {shown}; "
                f"entries up to {trimmed_to} removed): those changes are gone from the feed "
                "(every event is still in its thread's log); acknowledge them to go on"
            )
        else:
            message = (
                f"the change feed of partition {partition} was trimmed past {reader}'s position "
                f"({position}; entries up to {trimmed_to} removed): changes it had not read are "
                "gone from the feed, so it cannot go on exactly (every event is still in its "
                "thread's log)"
            )
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.partition, self.reader, self.position, self.trimmed_to, self.lost),
        )


class FeedResetError(ConflictError):
    """Raised when a partition's feed holds no trace of a reader's position: neither the entry
    there nor a trim record reaching it. The feed was deleted (and perhaps written again) or
    replaced since the reader got there, and whatever it held after that position went
    without a record, so reading on would silently skip it.

    Not retryable: the lost entries will not come back (the events are still in the threads'
    logs). A projection counts them again under a new name with ``backfill=True``.
    """

    def __init__(self, partition: int, reader: str, position: str) -> None:
        self.partition = partition
        self.reader = reader
        self.position = position
        super().__init__(
            f"the change feed of partition {partition} is not the one {reader} read up to "
            f"{position}: it holds neither that entry nor a record of its trimming (the feed "
            "was deleted or replaced), so changes after it may be gone without a trace and "
            "reading on would skip them (every event is still in its thread's log)"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.partition, self.reader, self.position))


class FeedGroupNotFoundError(ConflictError, LookupError):
    """Raised when a consumer group is not registered on a feed partition (never created, or
    the partition's feed was deleted): `EventStore.create_feed_group` registers it.

    Not retryable as it is: nothing will create the group but a `create_feed_group`.
    """

    def __init__(self, partition: int, group: str) -> None:
        self.partition = partition
        self.group = group
        super().__init__(f"no consumer group {group!r} on feed partition {partition}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.partition, self.group))


class ViewConflictError(ConflictError):
    """Raised when a guarded view operation finds a different version than the caller expected."""

    def __init__(self, thread_id: str, view: str, field: str, expected: int, actual: int) -> None:
        self.thread_id = thread_id
        self.view = view
        self.field = field
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"thread {thread_id!r}: view {view!r} field {field!r} "
            f"expected version {expected}, actual version {actual}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            type(self),
            (self.thread_id, self.view, self.field, self.expected, self.actual),
        )


class ChainKeyMismatchError(ConflictError):
    """Raised when an append's chain key (``THREADLOG_SECRET``) is not the one the thread was
    written with, or one side has a key and the other none; nothing is written.

    Each thread records a fingerprint of its key when it is created (never the key itself):
    links made with another key would fail every later `verify` under the thread's own key.
    """

    def __init__(self, thread_id: str, thread_keyed: bool, store_keyed: bool) -> None:
        self.thread_id = thread_id
        self.thread_keyed = thread_keyed
        self.store_keyed = store_keyed
        if thread_keyed and not store_keyed:
            what = "was written with a chain key and this store has none"
            fix = "set THREADLOG_SECRET to the key its other writers use"
        elif store_keyed and not thread_keyed:
            what = "was written without a chain key and this store has one"
            fix = "leave THREADLOG_SECRET unset, as its other writers do"
        else:
            what = "was written with a different chain key"
            fix = "set THREADLOG_SECRET to the key its other writers use"
        super().__init__(f"thread {thread_id!r} {what}: {fix}; nothing was written")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.thread_id, self.thread_keyed, self.store_keyed))


# -- bad input: rejected before anything reaches the server ----------------------------------


class InvalidInputError(EventStoreError, ValueError):
    """Raised when an argument is malformed; nothing is written."""


class InvalidThreadIdError(InvalidInputError):
    """Raised when a thread id is empty, too long, or holds control characters or braces."""


class InvalidNamespaceError(InvalidInputError):
    """Raised when a namespace name is empty, too long or outside ``[A-Za-z0-9_.-]``."""


class EventTooLargeError(InvalidInputError):
    """Raised when an encoded event exceeds the store's configured size limit."""

    def __init__(self, thread_id: str, size: int, limit: int, index: int) -> None:
        self.thread_id = thread_id
        self.size = size
        self.limit = limit
        self.index = index
        super().__init__(
            f"thread {thread_id!r}: event #{index} encodes to {size} bytes, limit is {limit}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.thread_id, self.size, self.limit, self.index))


class UnknownEventTypeError(InvalidInputError):
    """Raised when an event's type is not registered in the event catalog."""


class EventValidationError(InvalidInputError):
    """Raised when an event's payload does not satisfy its schema."""


class InvalidURLError(InvalidInputError):
    """Raised when a connection URL cannot be parsed or names an unsupported scheme."""


# -- stored data that does not decode ----------------------------------------------------------


class CorruptEventError(EventStoreError):
    """Raised when a stored event cannot be decoded; names the thread and the seq."""

    def __init__(
        self, thread_id: str, seq: int | None, reason: str, *, unknown_type: bool = False
    ) -> None:
        self.thread_id = thread_id
        self.seq = seq
        self.reason = reason
        self.unknown_type = unknown_type
        """The entry is whole but names an event type (or version) the reader's registry does
        not know: the reader, not the log, may be what is missing."""
        # An entry the log lost is no event that failed to decode, and damage no seq names (a
        # meta hash's) is about the thread: the reason says it all.
        if seq is None:
            super().__init__(f"thread {thread_id!r}: {reason}")
        elif reason.startswith("missing from the log"):
            super().__init__(f"thread {thread_id!r} seq {seq}: {reason}")
        else:
            super().__init__(f"thread {thread_id!r} seq {seq}: undecodable event: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_corrupt_event_error,
            (type(self), self.thread_id, self.seq, self.reason, self.unknown_type),
        )


def _rebuild_corrupt_event_error(
    cls: type[CorruptEventError], thread_id: str, seq: int | None, reason: str, unknown: bool
) -> CorruptEventError:
    return cls(thread_id, seq, reason, unknown_type=unknown)


class CorruptKeyError(EventStoreError):
    """Raised when a key threadlog keeps for a whole namespace (its settings hash, a partition's
    thread index) holds what threadlog never writes there: it was changed from outside
    threadlog. Names the key and what is wrong; nothing is guessed in its place.

    Not retryable, and no connection failure: the stored value stays wrong until it is put
    right (the message says how).
    """

    def __init__(self, key: str, detail: str) -> None:
        self.key = key
        self.detail = detail
        super().__init__(f"key {key!r} is damaged: {detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.detail))


# -- the server: set up to lose what threadlog writes -------------------------------------------


class UnsafeServerError(EventStoreError):
    """Raised when the Redis server is set up to delete what threadlog writes: an eviction
    policy that removes any key under memory pressure (``maxmemory-policy allkeys-*``) would
    drop logs, ledgers and feeds in silence. Nothing was written."""

    def __init__(self, server: str, policy: str) -> None:
        self.server = server
        self.policy = policy
        super().__init__(
            f"redis at {server} evicts keys under memory pressure (maxmemory-policy {policy}): "
            "threadlog's logs would be deleted without a trace. Set maxmemory-policy to "
            "noeviction (appends then fail with an error when memory is full) or to a "
            "volatile-* policy; nothing was written"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.server, self.policy))


# -- operational: the server or the connection failed -------------------------------------------


class OperationalError(EventStoreError):
    """Raised when the backing server fails or misbehaves; the append may or may not have landed.

    Retrying an append with the same idempotency key is always safe.
    """


class StoreConnectionError(OperationalError, ConnectionError):
    """Raised when the store cannot reach its server, or the connection drops mid-request."""


class StoreTimeoutError(OperationalError, TimeoutError):
    """Raised when the server does not answer within the configured timeout."""


DECODE_ERRORS: tuple[type[Exception], ...] = (msgspec.DecodeError, UnicodeDecodeError, TypeError)
"""What decoding damaged bytes with msgspec (JSON or msgpack) raises: msgspec.DecodeError, or,
before msgspec 0.23, Python's own errors, which a caller catching DecodeError alone lets
through as a crash: the codec's UnicodeDecodeError for a string that is not UTF-8, and
TypeError ("unhashable type") for a map used as a map's key. Catch it around decoding only."""

UNREACHABLE = (StoreConnectionError, StoreTimeoutError)
"""The errors of a store that cannot be reached (its retries spent), as opposed to one that
answers with an error: what a long-running reader (a projection runner, ``threadlog tail``)
waits out instead of stopping."""


class ConnectTimeoutError(StoreConnectionError, StoreTimeoutError):
    """Raised when opening a store gets no answer from its server within the connect timeout
    (``connect_timeout``): a port that accepts connections but never completes a TLS
    handshake or answers PING. Both a `StoreConnectionError` and a `StoreTimeoutError`.

    ``url`` is the store URL with any password masked; ``timeout`` the connect timeout in
    seconds.
    """

    def __init__(self, url: str, timeout: float, hint: str = "") -> None:
        self.url = url
        self.timeout = timeout
        self.hint = hint
        super().__init__(
            f"cannot connect to redis at {url}: no answer within the connect timeout of "
            f"{timeout:g} s (connect_timeout){hint}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.url, self.timeout, self.hint))


class StoreClosedError(OperationalError):
    """Raised when a closed store is used, or a call is still in flight when it closes."""

    @classmethod
    def in_flight(cls) -> StoreClosedError:
        """The error of a call the store was closed under after it was sent."""
        return cls(
            "the store was closed while this call was in flight: it may have been applied "
            "(read it back with a new store)"
        )


class UnstampedViewError(OperationalError):
    """Raised when a materialized view holds a value threadlog did not write (no version/seq
    stamp): the view was changed from outside; `rebuild` restores it."""

    def __init__(self, thread_id: str, view: str, detail: str) -> None:
        self.thread_id = thread_id
        self.view = view
        self.detail = detail
        super().__init__(
            f"thread {thread_id!r}: view {view!r} holds an unstamped value ({detail}); run rebuild"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.thread_id, self.view, self.detail))


class WrongKeyTypeError(OperationalError):
    """Raised when one of a thread's keys holds another kind of value than threadlog wrote
    there (Redis's ``WRONGTYPE``): the data was replaced from outside threadlog."""
