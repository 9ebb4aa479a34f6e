"""Events: the payload base class, the registry of tags and schema versions, the envelopes."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar, overload

import msgspec

from ._errors import DECODE_ERRORS, EventValidationError, InvalidInputError, UnknownEventTypeError
from ._ids import new_ulid


class Event(
    msgspec.Struct,
    tag_field="type",
    frozen=True,
    kw_only=True,
    omit_defaults=True,
    forbid_unknown_fields=False,
):
    """Base class of every event payload.

    Subclasses name an explicit, stable tag (``class X(Event, tag="x.happened")``): the tag,
    not the class name, is what is stored, so renaming a class never changes stored bytes.
    Schema evolution: new fields get defaults; a field's type never changes; a breaking change
    bumps the registered version and ships an upcaster from the previous one.
    """

    @property
    def event_type(self) -> str:
        """The stable tag this payload is stored under."""
        tag = self.__struct_config__.tag
        assert isinstance(tag, str)
        return tag


_TAG_RE = re.compile(r"[a-z0-9_\-]+(\.[a-z0-9_\-]+)+")
E = TypeVar("E", bound=type[Event])
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


class _TypeInfo(msgspec.Struct, frozen=True):
    cls: type[Event]
    version: int
    # upcasters[v] turns a payload stored at version v into version v + 1.
    upcasters: Mapping[int, Upcaster]


class EventRegistry:
    """Maps stable type tags to payload classes, schema versions and upcasters.

    Decoding goes through one msgspec decoder over the tagged union of every registered type,
    rebuilt when a type is registered.
    """

    def __init__(self) -> None:
        self._types: dict[str, _TypeInfo] = {}
        self._lock = threading.Lock()
        self._decoder: msgspec.msgpack.Decoder[Any] | None = None
        self._versions: dict[type[Event], int] = {}
        self._class_versions: dict[type[Event], int] = {}  # for `version_of`, kept by register

    def register(
        self,
        cls: type[Event],
        *,
        version: int = 1,
        upcasters: Mapping[int, Upcaster] | None = None,
    ) -> None:
        """Register ``cls`` under its explicit tag at schema ``version``.

        Raises `InvalidInputError` if the class has no explicit string tag, if the tag is taken
        by another class, if ``version`` is not an int >= 1, or if an upcaster is missing (or
        not callable) for some version below ``version``.
        """
        if not (isinstance(cls, type) and issubclass(cls, Event)):
            raise InvalidInputError(f"{cls!r} is not an Event subclass")
        tag = cls.__struct_config__.tag
        # An untagged msgspec subclass silently takes its class name as tag, which would tie
        # stored bytes to a class name; requiring a dotted tag makes the choice explicit.
        if not isinstance(tag, str) or _TAG_RE.fullmatch(tag) is None:
            raise InvalidInputError(
                f"{cls.__name__} needs an explicit dotted tag, e.g. "
                f'class {cls.__name__}(Event, tag="myapp.something_happened")'
            )
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise InvalidInputError(f"{cls.__name__}: version must be an int >= 1, not {version!r}")
        if upcasters is not None and not isinstance(upcasters, Mapping):
            raise InvalidInputError(
                f"{cls.__name__}: upcasters must be a mapping of version to function, "
                f"not {type(upcasters).__name__}"
            )
        ups = dict(upcasters or {})
        missing = [v for v in range(1, version) if v not in ups]
        if missing:
            raise InvalidInputError(
                f"{cls.__name__} is at version {version} but has no upcaster from {missing}"
            )
        # Checked here, not when the first old event is read: a reader would fail far from
        # the registration that was wrong.
        uncallable = [v for v in range(1, version) if not callable(ups[v])]
        if uncallable:
            raise InvalidInputError(
                f"{cls.__name__}: the upcasters from {uncallable} are not callable"
            )
        with self._lock:
            known = self._types.get(tag)
            if known is not None and known.cls is not cls:
                raise InvalidInputError(
                    f"event tag {tag!r} is already registered to {known.cls.__qualname__}"
                )
            self._types[tag] = _TypeInfo(cls, version, ups)
            self._class_versions[cls] = version
            self._decoder = None

    def __contains__(self, tag: object) -> bool:
        return tag in self._types

    def tags(self) -> list[str]:
        """Every registered tag."""
        return sorted(self._types)

    def version_of(self, payload: Event) -> int:
        """The schema version ``payload`` is written at; raises if its type is unregistered."""
        # By class first: every append asks, and a tag is registered to one class only.
        version = self._class_versions.get(type(payload))
        if version is not None:
            return version
        info = self._types.get(payload.event_type)
        if info is None or info.cls is not type(payload):
            raise UnknownEventTypeError(
                f"event type {type(payload).__qualname__} (tag {payload.event_type!r}) "
                "is not registered"
            )
        return info.version

    def _union_decoder(self) -> msgspec.msgpack.Decoder[Any]:
        decoder = self._decoder
        if decoder is None:
            with self._lock:
                classes = tuple(info.cls for info in self._types.values())
                if not classes:
                    raise UnknownEventTypeError("no event types are registered")
                union: Any = classes[0] if len(classes) == 1 else _union_of(classes)
                self._versions = {info.cls: info.version for info in self._types.values()}
                decoder = self._decoder = msgspec.msgpack.Decoder(union)
        return decoder

    def fast_path(self) -> tuple[msgspec.msgpack.Decoder[Any], dict[type[Event], int]]:
        """The union decoder and each class's current version, for bulk reads.

        A payload that the decoder accepts and whose stored version is its class's current one
        needs nothing else; anything else (an error, an older version) must go through
        `decode`, which upcasts or raises.
        """
        decoder = self._union_decoder()
        return decoder, self._versions

    def decode(self, data: bytes, version: int) -> Event:
        """Decode a stored payload written at ``version`` into its current class.

        Raises `UnknownEventTypeError` for an unregistered tag or a stored version above the
        registered one (written by newer code: this reader, not the data, is behind), and
        `EventValidationError` when the bytes do not match the schema (or an upcaster fails on
        them); the caller adds thread and seq.
        """
        try:
            if version <= 0:
                raise EventValidationError(f"invalid schema version {version}")
            try:
                event = self._union_decoder().decode(data)
            except msgspec.ValidationError as exc:
                # Not valid as the current schema: unknown, newer, damaged, or an older version.
                info = self._info_of(msgspec.msgpack.decode(data))
                if version > info.version:
                    # Said before the schema's complaint, which a newer schema explains.
                    raise _newer(info, version) from None
                if version == info.version:
                    raise EventValidationError(str(exc)) from None
                return self._upcast(data, version)
            assert isinstance(event, Event)
            info = self._types[event.event_type]
            if version == info.version:
                return event
            if version > info.version:
                raise _newer(info, version)
            return self._upcast(data, version)
        except DECODE_ERRORS as exc:
            raise EventValidationError(str(exc)) from None

    def _info_of(self, raw: Any) -> _TypeInfo:
        tag = raw.get("type") if isinstance(raw, dict) else None
        info = self._types.get(tag) if isinstance(tag, str) else None
        if info is None:
            raise UnknownEventTypeError(f"unknown event type {tag!r}")
        return info

    def _upcast(self, data: bytes, version: int) -> Event:
        raw = msgspec.msgpack.decode(data)
        info = self._info_of(raw)
        tag = info.cls.__struct_config__.tag
        for v in range(version, info.version):
            try:
                raw = info.upcasters[v](raw)
            except Exception as exc:  # an upcaster meeting data it did not expect
                raise EventValidationError(
                    f"upcasting {tag!r} from version {v} failed: {exc!r}"
                ) from None
            if not isinstance(raw, dict):
                raise EventValidationError(
                    f"the upcaster of {tag!r} from version {v} did not return a dict"
                )
            raw["type"] = tag
        try:
            return msgspec.convert(raw, info.cls)
        except msgspec.ValidationError as exc:
            raise EventValidationError(str(exc)) from None


def _newer(info: _TypeInfo, version: int) -> UnknownEventTypeError:
    tag = info.cls.__struct_config__.tag
    return UnknownEventTypeError(
        f"stored version {version} of {tag!r} is newer than this code knows ({info.version}): "
        "read it with code that registers that version"
    )


def _union_of(classes: tuple[type[Event], ...]) -> Any:
    from typing import Union

    return Union[classes]  # noqa: UP007 - built at run time from a tuple


registry = EventRegistry()
"""The default registry, holding the built-in catalog; ``register_event`` adds to it."""


@overload
def register_event(
    cls: E,
    *,
    version: int = 1,
    upcasters: Mapping[int, Upcaster] | None = None,
    into: EventRegistry | None = None,
) -> E: ...


@overload
def register_event(
    cls: None = None,
    *,
    version: int = 1,
    upcasters: Mapping[int, Upcaster] | None = None,
    into: EventRegistry | None = None,
) -> Callable[[E], E]: ...


def register_event(
    cls: E | None = None,
    *,
    version: int = 1,
    upcasters: Mapping[int, Upcaster] | None = None,
    into: EventRegistry | None = None,
) -> E | Callable[[E], E]:
    """Class decorator registering an `Event` subclass (in the default registry unless ``into``)."""

    def wrap(c: E) -> E:
        (into or registry).register(c, version=version, upcasters=upcasters)
        return c

    return wrap if cls is None else wrap(cls)


class NewEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An event to append: the payload plus the envelope fields the caller may choose.

    ``id`` defaults to a fresh ULID; a retry that reuses the same `NewEvent` objects reuses
    the ids, and with them the derived idempotency key.
    """

    payload: Event
    id: str = msgspec.field(default_factory=new_ulid)
    turn_id: str | None = None
    correlation_id: str | None = None
    causation_id: str | None = None


class EventMeta(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    omit_defaults=True,
    rename={"turn_id": "t", "correlation_id": "c", "causation_id": "k"},
):
    """Envelope fields stored beside the payload (short names: they are stored per event)."""

    turn_id: str | None = None
    correlation_id: str | None = None
    causation_id: str | None = None


class RecordedEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An event as stored: its position in the thread, its identity, time and payload."""

    thread_id: str
    seq: int
    id: str
    time_ms: int
    payload: Event
    schema_version: int = 1
    turn_id: str | None = None
    correlation_id: str | None = None
    causation_id: str | None = None
    chain: str = ""

    @property
    def type(self) -> str:
        """The payload's stable type tag."""
        return self.payload.event_type

    @property
    def time(self) -> datetime:
        """The server-assigned wall-clock time of the append, in UTC."""
        return datetime.fromtimestamp(self.time_ms / 1000, tz=UTC)


PayloadRow = tuple[int, Event, bytes, EventMeta]
"""An event as a fold over payloads sees it: ``(seq, payload, event id as 16 raw bytes, meta)``.

What `EventStore.fold_payloads` hands its fold; no `RecordedEvent` is built (see
`eventstore.event_id_text` for the id's text)."""


def as_new_event(item: Event | NewEvent) -> NewEvent:
    """Wrap a bare payload in a `NewEvent`; pass a `NewEvent` through."""
    if isinstance(item, NewEvent):
        return item
    if isinstance(item, Event):
        return NewEvent(payload=item)
    raise InvalidInputError(f"expected an Event or NewEvent, got {type(item).__name__}")
