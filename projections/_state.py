"""`StateProjection`: application state blocks, and reader views that select what a reader sees.

Each block keeps its value, a per-block version (1 on the first update) and the seq of the
event that last set it. A reader view names blocks, and optionally fields within a block (for
dict-valued blocks); a read returns only what the view selects. An update may require the
block to be at an exact version; otherwise nothing is written and `ViewConflictError` says
which version was found.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from eventstore import (
    Event,
    EventMeta,
    EventValidationError,
    HashGet,
    HashGetAll,
    HashLoad,
    HashSet,
    InvalidInputError,
    NewEvent,
    RecordedEvent,
    StateUpdated,
    ViewEntry,
    ViewOp,
    ViewRead,
    ViewResult,
    json_value_problem,
    validate_view_name,
)

from ._base import Projection, UnknownBlockError, UnknownReaderViewError, decode_as, encoder

_NO_META = EventMeta()


def check_json_value(block: str, value: Any) -> None:
    """Refuse a block value that JSON cannot hold as it is (`json_value_problem`).

    State is application data that readers, ``threadlog show`` and exports see as JSON. A
    value that would change on the way (NaN and infinities, bytes, a set, a non-string key,
    an object of another type) would otherwise be stored as msgpack allows and come back, or
    be exported, as something else. Tuples are taken as lists (they come back as lists).

    Raises:
        EventValidationError: naming the block and where in the value the culprit is.
    """
    found = json_value_problem(value)
    if found is not None:
        where, problem = found
        raise EventValidationError(
            f"state block {block!r}: the value{' at ' + where if where else ''} is {problem}"
        )


class ReaderView(msgspec.Struct, frozen=True):
    """A named selection of state: block name -> None (whole block) or the fields to show.

    Fields select from a block whose value is an object; a block holding anything else (a
    string, a list) shows as ``{}`` through a field selection: it hides what it does not name,
    whatever shape the value has."""

    name: str
    blocks: Mapping[str, tuple[str, ...] | None]

    def __post_init__(self) -> None:
        validate_view_name(self.name)
        if not isinstance(self.blocks, Mapping):
            raise InvalidInputError(
                f"reader view {self.name!r}: blocks are a mapping of block name -> None or "
                f"field names, not {type(self.blocks).__name__}: {self.blocks!r:.60}"
            )
        for block, fields in self.blocks.items():
            if not isinstance(block, str):
                raise InvalidInputError(f"reader view {self.name!r}: block names are strings")
            # A lone string is the classic missing comma, ("name") for ("name",): iterated,
            # it would select the fields "n", "a", "m", "e" and hide the one meant.
            if fields is not None and (
                isinstance(fields, str | bytes)
                or not isinstance(fields, tuple | list | frozenset | set)
                or not all(isinstance(f, str) for f in fields)
            ):
                raise InvalidInputError(
                    f"reader view {self.name!r}, block {block!r}: fields are None (the whole "
                    f"block) or a tuple of field names, not {fields!r:.60}"
                )


class Block(msgspec.Struct, frozen=True, kw_only=True):
    """A state block as a reader sees it."""

    name: str
    value: Any
    version: int
    seq: int


class StateProjection(Projection[dict[str, Block]]):
    """State blocks by name, with reader views.

    ``blocks`` declares the known blocks; together with the blocks reader views name, they
    form the schema, and an update to any other block is refused with `UnknownBlockError`.
    With no views and no blocks declared, any block name is accepted.
    """

    name = "state"
    views = ("state",)
    handles = (StateUpdated,)

    def __init__(
        self, views: Iterable[ReaderView] = (), *, blocks: Iterable[str] | None = None
    ) -> None:
        if isinstance(views, ReaderView) or not isinstance(views, Iterable):
            raise InvalidInputError(
                f"views must be a list of ReaderView, not {type(views).__name__}"
            )
        self.reader_views: dict[str, ReaderView] = {}
        for v in views:
            if not isinstance(v, ReaderView):
                raise InvalidInputError(
                    f"views must be a list of ReaderView, not of {type(v).__name__}: {v!r:.60}"
                )
            if v.name in self.reader_views:
                # The later one would replace the first unseen: a reader confined to the view
                # would be shown what the other definition selects.
                raise InvalidInputError(f"reader view {v.name!r} is defined twice")
            self.reader_views[v.name] = v
        # A lone string would declare its letters as the blocks ("plan": p, l, a, n).
        if blocks is not None:
            if isinstance(blocks, str | bytes) or not isinstance(blocks, Iterable):
                raise InvalidInputError(
                    f"blocks must be a list of block names (str), not {blocks!r:.60}"
                )
            blocks = list(blocks)
            if not all(isinstance(b, str) for b in blocks):
                raise InvalidInputError(
                    f"blocks must be a list of block names (str), not {blocks!r:.60}"
                )
        declared = set(blocks or ())
        for v in self.reader_views.values():
            declared.update(v.blocks)
        self.known_blocks: frozenset[str] | None = (
            frozenset(declared) if declared or blocks is not None else None
        )

    def initial(self) -> dict[str, Block]:
        return {}

    def validate(self, payload: object) -> None:
        if isinstance(payload, StateUpdated):
            if not payload.block:
                raise UnknownBlockError("a state block needs a non-empty name")
            if self.known_blocks is not None and payload.block not in self.known_blocks:
                raise UnknownBlockError(
                    f"state block {payload.block!r} is not declared "
                    f"(known: {', '.join(sorted(self.known_blocks)) or 'none'})"
                )
            check_json_value(payload.block, payload.value)

    def apply(self, state: dict[str, Block], event: RecordedEvent) -> dict[str, Block]:
        return self.apply_payload(state, event.seq, event.payload, b"", _NO_META)

    def apply_payload(
        self, state: dict[str, Block], seq: int, payload: Event, event_id: bytes, meta: EventMeta
    ) -> dict[str, Block]:
        if isinstance(payload, StateUpdated):
            prior = state.get(payload.block)
            state[payload.block] = Block(
                name=payload.block,
                value=payload.value,
                version=(prior.version if prior else 0) + 1,
                seq=seq,
            )
        return state

    def ops(self, events: Sequence[NewEvent]) -> list[ViewOp]:
        out: list[ViewOp] = []
        for index, new in enumerate(events):
            payload = new.payload
            if isinstance(payload, StateUpdated):
                self.validate(payload)
                out.append(
                    HashSet(
                        "state",
                        payload.block,
                        encoder.encode(payload.value),
                        index,
                        payload.expected_version,
                    )
                )
        return out

    def materialize(self, state: dict[str, Block]) -> list[ViewOp]:
        entries = {
            name: ViewEntry(b.seq, encoder.encode(b.value), b.version) for name, b in state.items()
        }
        return [HashLoad("state", entries)]

    def full_reads(self) -> list[ViewRead]:
        return [HashGetAll("state")]

    # -- reads ---------------------------------------------------------------------------------

    def reader_view(self, view: str) -> ReaderView:
        """The reader view called ``view``; raises `UnknownReaderViewError` if none is."""
        if not isinstance(view, str):  # a list or a dict would fail as an unhashable key
            raise UnknownReaderViewError(
                f"a reader view is named by a str (or None: every block), not "
                f"{type(view).__name__}: {view!r:.60}"
            )
        try:
            return self.reader_views[view]
        except KeyError:
            defined = ", ".join(sorted(self.reader_views)) or "none"
            raise UnknownReaderViewError(f"no reader view {view!r} (defined: {defined})") from None

    def read_for(self, view: str | None) -> ViewRead:
        """The read for a reader view (None: every block, unfiltered)."""
        if view is None:
            return HashGetAll("state")
        return HashGet("state", tuple(self.reader_view(view).blocks))

    def parse(self, result: ViewResult, view: str | None) -> dict[str, Block]:
        """Decode a hash result of the state view and apply the reader view's selection."""
        assert isinstance(result, dict)
        blocks = {
            name: Block(
                name=name,
                value=decode_as(Any, e.value, f"state view (block {name!r})"),
                version=e.version,
                seq=e.seq,
            )
            for name, e in result.items()
        }
        return self.select(blocks, view)

    def select(self, blocks: dict[str, Block], view: str | None) -> dict[str, Block]:
        """What reader view ``view`` sees of ``blocks`` (None: everything)."""
        if view is None:
            return dict(sorted(blocks.items()))
        spec = self.reader_view(view)
        out: dict[str, Block] = {}
        for name, fields in spec.blocks.items():
            block = blocks.get(name)
            if block is None:
                continue
            if fields is not None:
                value = block.value
                picked = (
                    {f: value[f] for f in fields if f in value} if isinstance(value, dict) else {}
                )
                block = msgspec.structs.replace(block, value=picked)
            out[name] = block
        return out
