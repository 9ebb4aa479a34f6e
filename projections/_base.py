"""The projection contract: a pure fold over events plus the view ops that keep its views in step.

A projection never talks to Redis. It says three things about its read model:

* ``apply(state, event)``: the fold, used for rebuilds, checks and time travel;
* ``ops(events)``: the generic view ops an append of ``events`` must apply, computed from the
  new events alone so the store can apply them atomically with the append;
* ``materialize(state)``: the full contents of its views for a folded state (rebuilds), and
  ``full_reads()``: the view reads that fetch those contents back (checks).

The invariant every projection keeps: applying ``ops`` append by append produces exactly the
views that ``materialize(fold(log))`` produces.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar, cast

import msgspec

from eventstore import (
    Event,
    EventMeta,
    EventValidationError,
    InvalidInputError,
    NewEvent,
    OperationalError,
    RecordedEvent,
    ViewEntry,
    ViewOp,
    ViewRead,
    ViewResult,
)
from eventstore._codec import check_nesting
from eventstore._errors import DECODE_ERRORS

S = TypeVar("S")
T = TypeVar("T")

encoder = msgspec.msgpack.Encoder()


class UnknownReaderViewError(InvalidInputError):
    """Raised when a state read names a reader view that was never defined."""


class UnknownBlockError(InvalidInputError):
    """Raised when a state update names a block outside the projection's declared blocks."""


class Projection(abc.ABC, Generic[S]):
    """A read model kept in step with the log."""

    name: ClassVar[str]
    views: ClassVar[tuple[str, ...]]
    handles: ClassVar[tuple[type[Event], ...] | None] = None
    """The payload types ``apply`` reacts to; folds skip the projection for any other event,
    and an append asks its ``ops`` only when one of its events is of such a type (``validate``
    sees every event). None: every event reaches ``apply`` and ``ops``. A subclass that
    overrides ``apply`` without restating ``handles`` gets every event. A declaration that
    misses a type ``apply`` acts on shows up as views that differ from the fold, which the
    projection tests catch."""

    @abc.abstractmethod
    def initial(self) -> S:
        """The state before any event."""

    @abc.abstractmethod
    def apply(self, state: S, event: RecordedEvent) -> S:
        """Fold one event into the state (may mutate and return ``state``)."""

    def apply_payload(
        self, state: S, seq: int, payload: Event, event_id: bytes, meta: EventMeta
    ) -> S:
        """Optional: ``apply`` for an event given as the parts of a `PayloadRow` (the event id as
        16 raw bytes, `eventstore.event_id_text` gives its text).

        A projection that implements it folds exactly as its ``apply`` does; folds then skip
        building a `RecordedEvent` per event when every projection of the projector has it. A
        subclass that overrides ``apply`` below the class that implemented this one gets
        ``apply`` instead (as with ``handles``).
        """
        raise NotImplementedError

    @abc.abstractmethod
    def ops(self, events: Sequence[NewEvent]) -> list[ViewOp]:
        """The view ops for appending ``events`` (``op.event`` indexes into ``events``).

        Raises `InvalidInputError` subclasses for events this projection refuses; the append
        is then not attempted.
        """

    @abc.abstractmethod
    def materialize(self, state: S) -> list[ViewOp]:
        """Load ops that set every view of this projection to ``state``."""

    @abc.abstractmethod
    def full_reads(self) -> list[ViewRead]:
        """Reads that return every view of this projection in full (for `check`)."""

    def validate(self, payload: Event) -> None:
        """Refuse an event before it is appended (default: accept everything)."""


def check_payload(payload: Event, index: int) -> None:
    """Refuse a payload that would not come back from the log as it went in.

    The store runs the same round trip, but projections compute their view ops before the
    store sees the events; without this, a malformed payload would surface as whatever error
    projection code happens to hit (``AttributeError``, ``TypeError``) instead of
    `EventValidationError`, or as a misleading projection error.
    """
    try:
        msgspec.msgpack.decode(encoder.encode(payload), type=type(payload))
    except RecursionError as exc:
        # Nested past what this Python encodes; the store's own check (`check_nesting`,
        # run on every append) says so in the words it uses for any depth past its limit.
        check_nesting(payload, index)
        raise EventValidationError(
            f"event #{index} ({payload.event_type}) cannot be encoded: {exc}"
        ) from exc
    except (
        msgspec.EncodeError,
        msgspec.DecodeError,
        TypeError,
        OverflowError,
        UnicodeError,  # encoding a lone surrogate; decoding, before msgspec 0.23, bad UTF-8
    ) as exc:
        raise EventValidationError(
            f"event #{index} ({payload.event_type}) fails validation: {exc}"
        ) from exc


def decode_as(type_: type[Any], data: bytes, what: str) -> Any:
    """Decode a view value; damage raises `OperationalError` saying where (rebuild repairs it)."""
    try:
        return msgspec.msgpack.decode(data, type=type_)
    except DECODE_ERRORS as exc:
        raise OperationalError(f"{what} holds an undecodable value ({exc}); run rebuild") from None


def decode_entries(
    decoder: msgspec.msgpack.Decoder[T], entries: Sequence[ViewEntry], view: str
) -> list[T]:
    """Decode the values of list view entries with a reused decoder (the read hot path).

    Damage raises what `decode_as` raises, naming the view and the seq of the bad entry; the
    error text is only built then.
    """
    decode = decoder.decode
    try:
        return [decode(e.value) for e in entries]
    except DECODE_ERRORS:
        for e in entries:
            decode_as(cast(Any, decoder.type), e.value, f"{view} view (seq {e.seq})")
        raise


def results_as_dict(reads: Sequence[ViewRead], results: Sequence[ViewResult]) -> dict[str, Any]:
    """Pair each read's view name with its result."""
    return {r.view: res for r, res in zip(reads, results, strict=True)}
