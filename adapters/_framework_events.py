"""The event types the framework adapters write, without the frameworks themselves.

`adapters.openai_agents` and `adapters.langgraph` need their frameworks installed; the events
they append do not. They are defined here and registered in the default registry whenever
`adapters` is imported, so the ``threadlog`` command, `Auditor`, `Exporter` and any other
reader decode a session's or a checkpointer's thread, whether or not the framework is there
(an unknown type would read as an undecodable event, and `verify` would report damage).
"""

from __future__ import annotations

from typing import Any

import msgspec

from eventstore import Event, EventRegistry

Typed = tuple[str, bytes]
Version = str | int | float


# -- OpenAI Agents SDK sessions (`adapters.openai_agents`) --------------------------------------


class ItemsAdded(Event, tag="agents.items_added", frozen=True):
    """Items appended to a session, in order, exactly as the SDK handed them over."""

    items: list[Any]


class ItemPopped(Event, tag="agents.item_popped", frozen=True):
    """The session's last item was removed (the item stays in the `ItemsAdded` that added it).

    ``added_seq`` is the seq of the event that added it and ``digest`` the blake2b-128 of its
    stored bytes, so an auditor can tell exactly which item went.
    """

    added_seq: int
    digest: str


class SessionCleared(Event, tag="agents.session_cleared", frozen=True):
    """Every item was removed from the session (the log keeps them)."""


SESSION_EVENTS: tuple[type[Event], ...] = (ItemsAdded, ItemPopped, SessionCleared)


def register_session_events(into: EventRegistry) -> None:
    """Register the session's event types in ``into`` (done for the default registry on import).

    A `ThreadlogSession` calls this for its store's registry, so a private `EventRegistry`
    works too.
    """
    for cls in SESSION_EVENTS:
        if cls.__struct_config__.tag not in into:
            into.register(cls)


# -- LangGraph checkpoints (`adapters.langgraph`) ----------------------------------------------


class Record(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A checkpoint as stored: everything but its channel values, which live in blobs.

    ``checkpoint`` and ``metadata`` are serialized with the saver's serde (the channel versions
    are in ``checkpoint``); ``run_id`` is repeated for `delete_for_runs`. ``lists`` holds the
    ``(start, count)`` runs of the list values the saver knew when it wrote the checkpoint, so
    a read finds their elements without looking up ``lg.ranges`` first (one round trip less);
    a list channel missing there is found through ``lg.ranges`` as before.
    """

    ns: str
    checkpoint_id: str
    parent_id: str | None = None
    checkpoint: Typed
    metadata: Typed
    run_id: str | None = None
    lists: dict[str, list[tuple[int, int]]] = msgspec.field(default_factory=dict)


class InlineBlob(msgspec.Struct, frozen=True, array_like=True):
    """One channel value at one version (``type`` "empty": the channel has no value)."""

    channel: str
    version: Version
    type: str
    data: bytes


class ListBlob(msgspec.Struct, frozen=True, array_like=True):
    """A list value at one version: ``(start, count)`` runs of its channel's lineage."""

    channel: str
    version: Version
    ranges: list[tuple[int, int]]


class Elements(msgspec.Struct, frozen=True, array_like=True):
    """New elements of a channel's lineage, at indexes ``start``, ``start + 1``, ..."""

    channel: str
    start: int
    items: list[Typed]


class StoredWrite(msgspec.Struct, frozen=True, array_like=True):
    """A pending write: ``idx`` is the write's index, or its `WRITES_IDX_MAP` slot."""

    task_id: str
    idx: int
    channel: str
    type: str
    data: bytes
    task_path: str = ""


class BlobsPut(Event, tag="langgraph.blobs_put", frozen=True):
    """Channel values of the versions the next checkpoint of ``ns`` introduces."""

    ns: str
    values: list[InlineBlob] = msgspec.field(default_factory=list)
    lists: list[ListBlob] = msgspec.field(default_factory=list)
    elements: list[Elements] = msgspec.field(default_factory=list)


class CheckpointPut(Event, tag="langgraph.checkpoint_put", frozen=True):
    """A checkpoint was saved (its new channel values are in the `BlobsPut` before it)."""

    record: Record


class WritesPut(Event, tag="langgraph.writes_put", frozen=True):
    """A task's pending writes for a checkpoint (only those that were not stored yet)."""

    ns: str
    checkpoint_id: str
    writes: list[StoredWrite]


class CheckpointRef(msgspec.Struct, frozen=True, array_like=True):
    ns: str
    checkpoint_id: str


class BlobRef(msgspec.Struct, frozen=True, array_like=True):
    ns: str
    channel: str
    version: Version


class CheckpointsRemoved(Event, tag="langgraph.checkpoints_removed", frozen=True):
    """Checkpoints left the views (``reason``: "prune:keep_latest", "delete_for_runs", ...).

    ``heads`` is each affected namespace's latest checkpoint afterwards (None: none left);
    ``unreferenced`` the channel versions no remaining checkpoint refers to any more.
    """

    reason: str
    checkpoints: list[CheckpointRef]
    heads: dict[str, Record | None] = msgspec.field(default_factory=dict)
    unreferenced: list[BlobRef] = msgspec.field(default_factory=list)


LANGGRAPH_EVENTS: tuple[type[Event], ...] = (BlobsPut, CheckpointPut, WritesPut, CheckpointsRemoved)


def register_langgraph_events(into: EventRegistry) -> None:
    """Register the saver's event types in ``into`` (done for the default registry on import)."""
    for cls in LANGGRAPH_EVENTS:
        if cls.__struct_config__.tag not in into:
            into.register(cls)


def register_framework_events(into: EventRegistry) -> None:
    """Register every framework adapter's event types in ``into``."""
    register_session_events(into)
    register_langgraph_events(into)


def _register_default() -> None:
    from eventstore import registry

    register_framework_events(registry)


_register_default()
