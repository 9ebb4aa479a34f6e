"""Argument checks the adapters share."""

from __future__ import annotations

import inspect

from eventstore import EventStore, InvalidInputError


def require_store(store: object, owner: str) -> EventStore:
    """``store`` if it is an `EventStore`, else `InvalidInputError` saying what it is: most
    often the coroutine of a ``connect(...)`` that was not awaited, which would otherwise
    fail later, at first use, as an AttributeError of the coroutine."""
    if isinstance(store, EventStore):
        return store
    hint = (
        ": await it (store = await eventstore.connect(...))" if inspect.isawaitable(store) else ""
    )
    raise InvalidInputError(
        f"{owner} needs an EventStore (from eventstore.connect), not {type(store).__name__}{hint}"
    )
