"""`Projector`: inline appends, reads (now or as of any past point), rebuild and check.

The projector binds projections to an `EventStore`. Appends made through it carry the view ops
of every projection, so the read models are current the moment the append returns. Reads take
``as_of`` (an ``int`` seq or a ``datetime``) to answer from a fold of the log up to that point
instead of from the materialized views.
"""

from __future__ import annotations

import operator
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import anyio
import msgspec

from eventstore import (
    ANY,
    AppendResult,
    ConcurrencyError,
    CorruptEventError,
    Event,
    EventStore,
    EventStoreError,
    ExpectedVersion,
    HashGet,
    HashLoad,
    InvalidInputError,
    ListLoad,
    NewEvent,
    PayloadRow,
    RecordedEvent,
    ThreadReplacedError,
    UnstampedViewError,
    ViewEntry,
    ViewOp,
    ViewRead,
    ViewResult,
    WrongKeyTypeError,
    validate_count,
    validate_thread_id,
)
from eventstore._codec import decode_payload_rows, decode_rows
from eventstore._events import as_new_event
from eventstore._gc import paused_collector

from ._base import Projection, check_payload
from ._messages import DEFAULT_WINDOW, MessagesProjection, StoredMessage
from ._records import Anomaly, RecordsProjection, RecordsState, TurnNode, TurnRecord
from ._state import Block, StateProjection
from ._transcript import TranscriptMessage, TranscriptProjection

AsOf = int | datetime
"""A past point: a seq (``int``, 0: before the first event) or a wall-clock time
(``datetime``: the last event recorded at or before it, to the millisecond; a naive one is
local time, as `datetime.timestamp` reads it: pass ``tzinfo=UTC`` for a UTC time)."""

Progress = Callable[[int, int], None]
R = TypeVar("R")
# How many threads a namespace-wide rebuild, check or verify works on at once (`for_each_thread`).
AUDIT_CONCURRENCY = 8
"""Called as ``progress(done, total)`` while a namespace-wide job runs."""

REBUILD_ATTEMPTS = 5


class Folded(msgspec.Struct, frozen=True):
    """Every projection's state, folded from the log up to ``version``."""

    thread_id: str
    version: int
    states: dict[str, Any]
    incarnation: int | None = None
    """The life the log was folded in, when the fold read it (`Projector.fold` ``as_of`` a
    point); None otherwise."""


class Difference(msgspec.Struct, frozen=True, kw_only=True):
    """One place where a materialized view differs from the fold of the log."""

    view: str
    key: str
    expected: str
    actual: str


class CheckReport(msgspec.Struct, frozen=True, kw_only=True):
    """What `check` found for one thread at one version."""

    thread_id: str
    version: int
    differences: list[Difference]
    anomalies: list[Anomaly]

    @property
    def ok(self) -> bool:
        """True when every view equals the fold of the log."""
        return not self.differences

    @classmethod
    def unfoldable(
        cls, thread_id: str, version: int, error: CorruptEventError | WrongKeyTypeError
    ) -> CheckReport:
        """The report on a thread whose log or views could not be read or folded: one
        difference (view ``(log)``) saying why."""
        seq = getattr(error, "seq", None)
        return cls(
            thread_id=thread_id,
            version=version,
            differences=[
                Difference(
                    view="(log)",
                    key=f"seq {seq}" if seq is not None else "(keys)",
                    expected="a log that folds",
                    actual=str(error),
                )
            ],
            anomalies=[],
        )


class Materialized(msgspec.Struct, frozen=True, kw_only=True):
    """A thread's views as stored, read in one snapshot at ``version`` (`read_materialized`).

    ``views`` maps each view read to its contents; ``unstamped`` names the views that hold a
    value threadlog never wrote (not read), with what is wrong with it.
    """

    thread_id: str
    version: int
    views: dict[str, ViewResult]
    unstamped: dict[str, str]


class Context(msgspec.Struct, frozen=True, kw_only=True):
    """What a context assembler reads for one turn, taken in one round trip."""

    thread_id: str
    version: int
    messages: list[StoredMessage]
    state: dict[str, Block]
    records: list[TurnRecord]
    incarnation: int | None = None
    """The thread's life these were read in (`EventStore.incarnation`; in the same atomic step,
    or, ``as_of`` a past point, the life the fold read whole): what a write planned from them
    passes as ``expected_incarnation``, so that it lands only in this life. None for a thread
    without events."""


class Projector:
    """Projections bound to a store: inline appends, reads, time travel, rebuild and check."""

    def __init__(
        self,
        store: EventStore,
        projections: Sequence[Projection[Any]] | None = None,
        *,
        state: StateProjection | None = None,
    ) -> None:
        self.store = store
        if projections is None:
            projections = [
                MessagesProjection(),
                state or StateProjection(),
                RecordsProjection(),
                TranscriptProjection(),
            ]
        self.projections = list(projections)
        names = [p.name for p in self.projections]
        views = [v for p in self.projections for v in p.views]
        if len(set(names)) != len(names) or len(set(views)) != len(views):
            raise InvalidInputError(f"projections must have distinct names and views: {names}")
        self._by_name = {p.name: p for p in self.projections}
        # payload type -> the projections whose ``handles`` take it: a fold calls only those.
        self._route: dict[type[Event], list[tuple[Projection[Any], str]]] = {}
        self._folds_payloads = all(_payload_apply(p) is not None for p in self.projections)
        self._fast_route: dict[type[Event], list[tuple[Any, str]]] = {}
        # payload type -> whether each projection's ``ops`` is asked about it (`view_ops`).
        self._ops_route: dict[type[Event], tuple[bool, ...]] = {}

    def _get(self, kind: type[Any]) -> Any:
        for p in self.projections:
            if isinstance(p, kind):
                return p
        raise InvalidInputError(f"this projector has no {kind.__name__}")

    @property
    def messages(self) -> MessagesProjection:
        return self._get(MessagesProjection)  # type: ignore[no-any-return]

    @property
    def state_projection(self) -> StateProjection:
        return self._get(StateProjection)  # type: ignore[no-any-return]

    @property
    def records_projection(self) -> RecordsProjection:
        return self._get(RecordsProjection)  # type: ignore[no-any-return]

    @property
    def transcript_projection(self) -> TranscriptProjection:
        return self._get(TranscriptProjection)  # type: ignore[no-any-return]

    # -- writes ---------------------------------------------------------------------------------

    def view_ops(self, events: Sequence[NewEvent]) -> list[ViewOp]:
        """Every projection's view ops for appending ``events``; raises if one refuses them.

        Raises:
            EventValidationError: a payload fails its schema (checked before any projection
                sees it).
            InvalidInputError: a projection refuses an event (e.g. `UnknownBlockError`).
        """
        self.validate(events)
        # A projection's ops are asked for only when an event is of a type it folds (its
        # `handles`): for any other its views stay as they are, or they would differ from a
        # rebuild's. Its ``validate`` has seen every event.
        route = self._ops_route
        asked: tuple[bool, ...] | None = None
        for new in events:
            kind = type(new.payload)
            wants = route.get(kind)
            if wants is None:
                targets = {id(p) for p, _ in self._targets(kind)}
                wants = route[kind] = tuple(id(p) in targets for p in self.projections)
            asked = wants if asked is None else tuple(map(operator.or_, asked, wants))
        ops: list[ViewOp] = []
        for p, ask in zip(self.projections, asked or (), strict=False):
            if ask:
                ops += p.ops(events)
        return ops

    def validate(self, events: Sequence[NewEvent]) -> None:
        """Refuse ``events`` as `append` would, without touching the store.

        For a caller that must read before it appends (a turn's record, say): bad input is
        then refused before that read, not after it. `append` checks again.

        Raises:
            EventValidationError: a payload fails its schema (checked before any projection
                sees it).
            InvalidInputError: a projection refuses an event (e.g. `UnknownBlockError`).
        """
        for index, new in enumerate(events):
            check_payload(new.payload, index)
        for p in self.projections:
            for new in events:
                p.validate(new.payload)

    async def append(
        self,
        thread_id: str,
        events: Sequence[Event | NewEvent],
        *,
        expected_version: ExpectedVersion = ANY,
        idempotency_key: str | None = None,
        expected_incarnation: int | None = None,
    ) -> AppendResult:
        """Append ``events`` and update every projection's views in the same atomic step.

        ``expected_incarnation``: only while the thread is in that life (`EventStore.append`).
        """
        if isinstance(events, Event | NewEvent) or not isinstance(events, Sequence):
            raise InvalidInputError("events must be a sequence of Event or NewEvent")
        news = [as_new_event(e) for e in events]
        return await self.store.append(
            thread_id,
            news,
            expected_version=expected_version,
            idempotency_key=idempotency_key,
            view_ops=self.view_ops(news),
            expected_incarnation=expected_incarnation,
        )

    # -- folds ----------------------------------------------------------------------------------

    async def seq_of(self, thread_id: str, as_of: AsOf) -> int:
        """The seq a past point stands for.

        Raises:
            SeqBeyondVersionError: ``as_of`` is a seq the thread has not reached. A fold up to
                it would answer with the thread as it is now, as if that were the past point
                asked about; a time after the last event is fine (it means "now").
            InvalidThreadIdError: ``thread_id`` is no thread id (whatever ``as_of`` is).
        """
        validate_thread_id(thread_id)
        if isinstance(as_of, datetime):
            try:
                ms = int(as_of.timestamp() * 1000)
            except (ValueError, OverflowError) as exc:  # datetime.min in a zone east of UTC
                raise InvalidInputError(f"as_of {as_of!r} is not a usable time: {exc}") from None
            return await self.store.seq_at(thread_id, ms)
        if isinstance(as_of, bool) or not isinstance(as_of, int) or as_of < 0:
            raise InvalidInputError(f"as_of must be a seq >= 0 or a datetime, not {as_of!r}")
        if as_of > 0:
            version = await self.store.version(thread_id)
            if as_of > version:
                raise SeqBeyondVersionError(thread_id, as_of, version)
        return as_of

    async def fold(self, thread_id: str, *, as_of: AsOf | None = None) -> Folded:
        """Fold the log (up to ``as_of``) through every projection.

        Raises:
            SeqBeyondVersionError: ``as_of`` is a seq the thread has not reached.
            CorruptEventError: an entry up to the point does not decode, or is missing from
                the log (a hole, or seqs the version holds that the log lost at its end).
            ThreadReplacedError: the thread was deleted and written again while each of a
                few attempts read it (the point and the fold are read in one life).
        """
        validate_thread_id(thread_id)
        if as_of is None:
            return await self._fold_to(thread_id, None)
        for _ in range(REBUILD_ATTEMPTS):
            # The point is found (a time search, the version) in one round trip and the log
            # is folded in others: a thread deleted and written again in between would be
            # folded up to a seq of its old life. The same life before and after (lives never
            # repeat) says both were read in one.
            life = await self.store.incarnation(thread_id)
            stop = await self.seq_of(thread_id, as_of)
            try:
                folded = await self._fold_to(thread_id, stop)
            except ThreadReplacedError:
                continue
            if await self.store.incarnation(thread_id) == life:
                if folded.version < stop:
                    # Seqs the version holds that the log lost at its end: the state at the
                    # last entry there is would pass for the point asked about.
                    raise missing_from_log(thread_id, folded.version + 1)
                return msgspec.structs.replace(folded, incarnation=life)
        raise ThreadReplacedError(thread_id)

    async def _fold_to(self, thread_id: str, stop: int | None) -> Folded:
        fold = self.start_fold(thread_id)
        if stop == 0:
            return fold.folded()
        if self._folds_payloads:
            # Every projection folds payload rows: no RecordedEvent per event.
            await self.store.fold_payloads(thread_id, fold.feed_payload_rows, stop=stop)
        else:
            async for batch in self.store.read_batches(thread_id, stop=stop):
                fold.feed_events(batch)
        return fold.folded()

    def start_fold(self, thread_id: str) -> LogFold:
        """A fold of the thread's log from seq 1 that the caller feeds, batch by batch.

        For a reader that has the log's entries anyway and must fold exactly what it read:
        `adapters.Auditor` verifies the integrity chain of the entries it folds, in one read.
        """
        return LogFold(self, validate_thread_id(thread_id))

    def _targets(self, kind: type[Event]) -> list[tuple[Projection[Any], str]]:
        """The projections an event of type ``kind`` reaches, in projection order."""
        out = []
        for p in self.projections:
            handles = _declared_handles(p)
            if handles is None or issubclass(kind, handles):
                out.append((p, p.name))
        return out

    # -- reads ----------------------------------------------------------------------------------

    async def _read(
        self, thread_id: str, reads: Sequence[ViewRead]
    ) -> tuple[int, list[ViewResult]]:
        snap = await self.store.read_views(thread_id, reads)
        return snap.version, snap.results

    async def last(
        self, thread_id: str, n: int = DEFAULT_WINDOW, *, as_of: AsOf | None = None
    ) -> list[StoredMessage]:
        """The history window: the last ``n`` messages (``n=0``: none)."""
        validate_count(n, "n")
        if as_of is not None:
            folded = await self.fold(thread_id, as_of=as_of)
            return MessagesProjection.window(folded.states[self.messages.name], n)
        if n == 0:
            validate_thread_id(thread_id)
            return []
        # The window needs no version: one plain LRANGE, the cheapest read of all.
        read = MessagesProjection.window_read(n)
        rows = await self.store.read_list(thread_id, read.view, read.start, read.stop)
        return MessagesProjection.parse(rows)

    async def state(
        self, thread_id: str, view: str | None = None, *, as_of: AsOf | None = None
    ) -> dict[str, Block]:
        """What reader view ``view`` sees of the state blocks (None: every block)."""
        sp = self.state_projection
        if as_of is not None:
            if view is not None:
                sp.reader_view(view)
            folded = await self.fold(thread_id, as_of=as_of)
            return sp.select(folded.states[sp.name], view)
        read = sp.read_for(view)
        _, (result,) = await self._read(thread_id, [read])
        return sp.parse(result, view)

    async def records(
        self, thread_id: str, *, last: int | None = None, as_of: AsOf | None = None
    ) -> list[TurnRecord]:
        """Settled turn records in settle order (only the latest ``last`` when given)."""
        if last is not None:
            validate_count(last, "last")
            if last == 0:
                validate_thread_id(thread_id)
                if as_of is not None:
                    await self.seq_of(thread_id, as_of)  # a point past the end is still refused
                return []
        rp = self.records_projection
        if as_of is not None:
            folded = await self.fold(thread_id, as_of=as_of)
            return rp.settled_records(thread_id, folded.states[rp.name], last)
        _, (result,) = await self._read(thread_id, [RecordsProjection.settled_read(last)])
        return RecordsProjection.parse(thread_id, result)

    async def turns(self, thread_id: str, *, as_of: AsOf | None = None) -> list[TurnRecord]:
        """Every turn, open or settled (an open turn that never settles crashed)."""
        rp = self.records_projection
        if as_of is not None:
            folded = await self.fold(thread_id, as_of=as_of)
            return rp.all_records(thread_id, folded.states[rp.name])
        _, (result,) = await self._read(thread_id, [rp.full_reads()[0]])
        return sorted(RecordsProjection.parse(thread_id, result), key=lambda r: r.turn_id)

    async def record(
        self, thread_id: str, turn_id: str, *, as_of: AsOf | None = None
    ) -> TurnRecord | None:
        """One turn's record, or None if the turn is unknown (or was, at ``as_of``)."""
        if as_of is not None:
            if not isinstance(turn_id, str):
                raise InvalidInputError(f"turn_id must be a str, not {turn_id!r}")
            rp = self.records_projection
            folded = await self.fold(thread_id, as_of=as_of)
            entry = folded.states[rp.name].entries().get(turn_id)
            if entry is None:
                return None
            return rp.all_records(thread_id, RecordsState(turns={turn_id: entry}))[0]
        _, (result,) = await self._read(thread_id, [HashGet("turns", (turn_id,))])
        found = RecordsProjection.parse(thread_id, result)
        return found[0] if found else None

    async def record_in_life(
        self, thread_id: str, turn_id: str
    ) -> tuple[TurnRecord | None, int | None]:
        """One turn's record (None if the turn is unknown) and the life of the thread it was
        read in (`ViewSnapshot.incarnation`), in one atomic read: a write that must land only
        where the turn is passes that life as ``expected_incarnation``, and is refused if
        the thread was deleted (and perhaps written again) since."""
        if not isinstance(turn_id, str):
            raise InvalidInputError(f"turn_id must be a str, not {turn_id!r}")
        snap = await self.store.read_views(thread_id, [HashGet("turns", (turn_id,))])
        found = RecordsProjection.parse(thread_id, snap.results[0])
        return (found[0] if found else None), snap.incarnation

    async def turn_tree(self, thread_id: str, *, as_of: AsOf | None = None) -> list[TurnNode]:
        """Root turns with their child turns."""
        return RecordsProjection.tree(await self.turns(thread_id, as_of=as_of))

    async def transcript(
        self, thread_id: str, *, as_of: AsOf | None = None
    ) -> list[TranscriptMessage]:
        """The current session transcript."""
        tp = self.transcript_projection
        if as_of is not None:
            folded = await self.fold(thread_id, as_of=as_of)
            return list(folded.states[tp.name])
        _, (result,) = await self._read(thread_id, tp.full_reads())
        return TranscriptProjection.parse(result)

    async def context(
        self,
        thread_id: str,
        *,
        n: int = DEFAULT_WINDOW,
        view: str | None = None,
        records: int = 0,
        as_of: AsOf | None = None,
    ) -> Context:
        """Messages window, a reader view and the latest records, in one round trip (with
        ``as_of``: as they were at that past point, folded from the log)."""
        validate_count(n, "n")
        validate_count(records, "records")
        sp = self.state_projection
        if as_of is not None:
            if view is not None:
                sp.reader_view(view)
            folded = await self.fold(thread_id, as_of=as_of)
            rp = self.records_projection
            return Context(
                thread_id=thread_id,
                version=folded.version,
                incarnation=folded.incarnation,
                messages=MessagesProjection.window(folded.states[self.messages.name], n),
                state=sp.select(folded.states[sp.name], view),
                records=(
                    rp.settled_records(thread_id, folded.states[rp.name], records)
                    if records
                    else []
                ),
            )
        reads: list[ViewRead] = [sp.read_for(view)]
        if n:
            reads.append(MessagesProjection.window_read(n))
        if records:
            reads.append(RecordsProjection.settled_read(records))
        snap = await self.store.read_views(thread_id, reads)
        results = snap.results
        state = sp.parse(results[0], view)
        messages = MessagesProjection.parse(results[1]) if n else []
        recs = RecordsProjection.parse(thread_id, results[-1]) if records else []
        return Context(
            thread_id=thread_id,
            version=snap.version,
            messages=messages,
            state=state,
            records=recs,
            incarnation=snap.incarnation,
        )

    async def delete_thread(self, thread_id: str) -> int:
        """Delete the thread with every view of these projections; returns its last version."""
        views = [v for p in self.projections for v in p.views]
        return await self.store.delete_thread(thread_id, views=views)

    # -- rebuild and check ----------------------------------------------------------------------

    def _materialize(self, folded: Folded) -> list[ViewOp]:
        ops: list[ViewOp] = []
        for p in self.projections:
            ops += p.materialize(folded.states[p.name])
        return ops

    async def rebuild(self, thread_id: str) -> int:
        """Recompute every view of the thread from its log; returns the version rebuilt at.

        The log is trusted as it is: whatever it holds, an edited or forged entry included,
        becomes what the views say (a hole or an undecodable entry stops it, but content that
        decodes is not checked against the integrity chain). To rebuild only a log that
        verifies, use `adapters.Auditor.rebuild`, which verifies the chain first.

        If appends land meanwhile, or the thread is deleted and written again, the fold is
        repeated (a bounded number of times), then `RebuildBusyError` is raised (appends
        landing every time: the views were left as they were).
        """
        validate_thread_id(thread_id)
        for _ in range(REBUILD_ATTEMPTS):
            try:
                # The write is guarded by the life read first as well as by the version: a
                # thread deleted and written again up to the same version after the fold
                # must not get the old life's views (lives never repeat). A fold that read
                # another life than this one is refused by the same check.
                life = await self.store.incarnation(thread_id)
                version = await self.store.version(thread_id)
                if life is None and version:
                    continue  # created between the two reads: read its life
                folded = await self._fold_to(thread_id, version)
                await self.store_views(folded, expected_incarnation=life)
            except (ConcurrencyError, ThreadReplacedError):
                continue  # appended to, or deleted and written again, meanwhile
            return folded.version
        raise RebuildBusyError(thread_id, REBUILD_ATTEMPTS, await self.store.version(thread_id))

    async def store_views(self, folded: Folded, *, expected_incarnation: int | None = None) -> None:
        """Replace every view of the thread with what ``folded`` holds, only if the thread is
        still at ``folded.version`` (the last step of `rebuild`) and, with
        ``expected_incarnation`` (the `EventStore.incarnation` read before the fold), still in
        that life.

        Raises:
            ConcurrencyError: the thread moved on (nothing written); fold again.
            IncarnationConflictError: (a `ConcurrencyError`) the thread was deleted, or deleted
                and written again, since its life was read (nothing written); fold again.
        """
        with paused_collector():
            ops = self._materialize(folded)
        await self.store.load_views(
            folded.thread_id,
            ops,
            expected_version=folded.version,
            expected_incarnation=expected_incarnation,
        )

    async def check(self, thread_id: str) -> CheckReport:
        """Compare every materialized view with the fold of the log at the same version."""
        validate_thread_id(thread_id)
        for attempt in range(1, REBUILD_ATTEMPTS + 1):
            snapshot = await self.read_materialized(thread_id)
            try:
                return self.compare(snapshot, await self._fold_to(thread_id, snapshot.version))
            except ThreadReplacedError:
                if attempt == REBUILD_ATTEMPTS:
                    raise  # deleted and written again while read, every time
        raise AssertionError("unreachable")

    async def read_materialized(self, thread_id: str) -> Materialized:
        """Every view of every projection, read in one snapshot (what `check` compares).

        A view holding a value threadlog never wrote (no stamp) is not read; it is named in
        `Materialized.unstamped` and `compare` reports it.
        """
        validate_thread_id(thread_id)
        reads = [r for p in self.projections for r in p.full_reads()]
        unstamped: dict[str, str] = {}
        while True:
            readable = [r for r in reads if r.view not in unstamped]
            try:
                version, results = await self._read(thread_id, readable)
                break
            except UnstampedViewError as exc:
                if exc.view in unstamped:
                    raise
                unstamped[exc.view] = exc.detail
        return Materialized(
            thread_id=thread_id,
            version=version,
            views={r.view: res for r, res in zip(readable, results, strict=True)},
            unstamped=unstamped,
        )

    def compare(self, snapshot: Materialized, folded: Folded) -> CheckReport:
        """What differs between the views read (`read_materialized`) and a fold of the log
        (`fold`, `start_fold`), which should have reached the snapshot's version."""
        unstamped = snapshot.unstamped
        differences: list[Difference] = [
            Difference(
                view=view,
                key="(values)",
                expected="values stamped by threadlog",
                actual=f"an unstamped value: {detail}",
            )
            for view, detail in unstamped.items()
        ]
        if folded.version != snapshot.version:
            differences.append(
                Difference(
                    view="(log)",
                    key="version",
                    expected=str(snapshot.version),
                    actual=f"log ends at seq {folded.version}",
                )
            )
        for op in self._materialize(folded):
            if op.view not in unstamped:
                differences += _compare(op, snapshot.views.get(op.view))
        anomalies: list[Anomaly] = []
        for state in folded.states.values():
            if isinstance(state, RecordsState):
                anomalies += state.anomalies
        return CheckReport(
            thread_id=snapshot.thread_id,
            version=snapshot.version,
            differences=differences,
            anomalies=anomalies,
        )

    async def rebuild_all(
        self,
        *,
        progress: Progress | None = None,
        threads: Sequence[str] | None = None,
        concurrency: int = AUDIT_CONCURRENCY,
    ) -> dict[str, int]:
        """Rebuild every thread of the namespace (those of the thread index, or ``threads``);
        returns thread -> version. Trusts every log as `rebuild` does. Up to ``concurrency``
        threads are rebuilt at once (`for_each_thread`).

        A thread whose log cannot be folded (damaged: `CorruptEventError`, `WrongKeyTypeError`)
        or that kept changing while it was rebuilt (`RebuildBusyError`) does not stop the
        others: they are all rebuilt first, then `RebuildError` names the threads that were not
        (their views are left as they were).
        """
        failed: dict[str, EventStoreError] = {}

        async def rebuild(thread_id: str) -> int | None:
            try:
                return await self.rebuild(thread_id)
            except (CorruptEventError, WrongKeyTypeError, RebuildBusyError) as exc:
                failed[thread_id] = exc
                return None

        done = await self._each_thread(rebuild, progress, threads, concurrency)
        rebuilt = {t: v for t, v in done.items() if v is not None}
        if failed:
            raise RebuildError(rebuilt, failed)
        return rebuilt

    async def check_all(
        self,
        *,
        progress: Progress | None = None,
        threads: Sequence[str] | None = None,
        concurrency: int = AUDIT_CONCURRENCY,
    ) -> dict[str, CheckReport]:
        """Check every thread of the namespace (those of the thread index, or ``threads``),
        up to ``concurrency`` at once. A thread whose log cannot be folded is reported as a
        difference (view ``(log)``), and the others are still checked."""

        async def check(thread_id: str) -> CheckReport:
            try:
                return await self.check(thread_id)
            except (CorruptEventError, WrongKeyTypeError) as exc:
                version = await _version_or_zero(self.store, thread_id)
                return CheckReport.unfoldable(thread_id, version, exc)

        return await self._each_thread(check, progress, threads, concurrency)

    async def _each_thread(
        self,
        job: Callable[[str], Awaitable[Any]],
        progress: Progress | None,
        threads: Sequence[str] | None,
        concurrency: int,
    ) -> dict[str, Any]:
        validate_count(concurrency, "concurrency", minimum=1)
        if threads is None:
            threads = [info.thread_id for info in await self.store.threads()]
        else:
            # Each once: two rebuilds of one thread at once would only race each other.
            threads = list(dict.fromkeys(validate_thread_id(t) for t in threads))
        return await for_each_thread(threads, job, progress=progress, concurrency=concurrency)


async def for_each_thread(
    threads: Sequence[str],
    job: Callable[[str], Awaitable[R]],
    *,
    progress: Progress | None,
    concurrency: int,
) -> dict[str, R]:
    """``job`` of each thread, up to ``concurrency`` at once; returns thread -> result in the
    order of ``threads``. ``progress(done, total)`` is called as each one ends.

    A small thread's audit is mostly waiting for its round trips, so several threads are
    worked on at once. An exception from one job stops the others from
    starting any new thread, lets those running end (a rebuild is not cut off between its
    writes), and is then raised as it is, never wrapped in an exception group.
    """
    validate_count(concurrency, "concurrency", minimum=1)
    results: dict[str, R] = {}
    pending = iter(threads)  # shared: each worker takes the next thread (no await between)
    failure: list[BaseException] = []

    async def worker() -> None:
        for thread_id in pending:
            try:
                results[thread_id] = await job(thread_id)
            except Exception as exc:
                failure.append(exc)
            if failure:
                return
            if progress is not None:
                progress(len(results), len(threads))

    async with anyio.create_task_group() as tasks:
        for _ in range(min(concurrency, len(threads))):
            tasks.start_soon(worker)
    if failure:
        raise failure[0]
    return {t: results[t] for t in threads if t in results}


class LogFold:
    """Every projection of a `Projector` folding one thread's log as it is fed, in order.

    Feed the log's batches from seq 1 on without a gap, as decoded rows (`feed_payload_rows`,
    `feed_events`) or as stored entries (`feed_entries`); `folded` gives the states so far. A
    batch that does not continue the log raises `CorruptEventError` (nothing of it folded).
    """

    def __init__(self, projector: Projector, thread_id: str) -> None:
        self.thread_id = thread_id
        self.version = 0
        self._projector = projector
        self._states = {p.name: p.initial() for p in projector.projections}

    def feed_entries(self, rows: Sequence[Any]) -> None:
        """Fold stored entries, ``(entry_id, fields)`` as `EventStore.read_raw` gives them.

        Raises:
            CorruptEventError: an entry does not decode, or the batch leaves a hole.
        """
        if not rows:
            return
        registry = self._projector.store.registry
        with paused_collector():
            if self._projector._folds_payloads:
                self.feed_payload_rows(decode_payload_rows(self.thread_id, rows, registry))
            else:
                self.feed_events(decode_rows(self.thread_id, rows, registry))

    def feed_payload_rows(self, rows: list[PayloadRow]) -> None:
        """Fold decoded payload rows (`EventStore.fold_payloads`); every projection must fold
        payloads (`Projection.apply_payload`)."""
        if not rows:
            return
        thread_id, states = self.thread_id, self._states
        last = _contiguous(thread_id, self.version, rows[0][0], rows[-1][0], len(rows), rows)
        fast = self._projector._fast_route
        targets_of = self._projector._targets
        for seq, payload, event_id, meta in rows:
            kind = type(payload)
            targets = fast.get(kind)
            if targets is None:
                targets = fast[kind] = [(_payload_apply(p), name) for p, name in targets_of(kind)]
            for apply, name in targets:
                states[name] = apply(states[name], seq, payload, event_id, meta)
        self.version = last

    def feed_events(self, batch: Sequence[RecordedEvent]) -> None:
        """Fold decoded events (`EventStore.read_batches`)."""
        if not batch:
            return
        thread_id, states = self.thread_id, self._states
        last = _contiguous(thread_id, self.version, batch[0].seq, batch[-1].seq, len(batch), batch)
        route = self._projector._route
        targets_of = self._projector._targets
        for event in batch:
            kind = type(event.payload)
            targets = route.get(kind)
            if targets is None:
                targets = route[kind] = targets_of(kind)
            for p, name in targets:
                states[name] = p.apply(states[name], event)
        self.version = last

    def folded(self) -> Folded:
        """The states folded so far. A projection may change its state in place: feeding more
        after this changes what it returned."""
        return Folded(self.thread_id, self.version, dict(self._states))


def _contiguous(
    thread_id: str, before: int, first: int, last: int, n: int, batch: Sequence[Any]
) -> int:
    """``last``, once a folded batch is known to continue the log without a hole.

    Seqs are dense, so a batch after seq ``before`` must hold exactly ``before + 1 .. last``;
    checking its ends and its length is enough. A hole (an entry removed from the log) is
    named, never folded over: views built across it would silently differ from the log.
    """
    if first == before + 1 and last - first + 1 == n:
        return last
    expected = before + 1
    for item in batch:
        seq = item[0] if isinstance(item, tuple) else item.seq
        if seq != expected:
            break
        expected += 1
    raise missing_from_log(thread_id, expected)


def missing_from_log(thread_id: str, seq: int) -> CorruptEventError:
    """The error for an entry of ``seq`` the thread's version holds and its log does not."""
    return CorruptEventError(thread_id, seq, "missing from the log (run 'verify')")


class SeqBeyondVersionError(InvalidInputError):
    """Raised when a past point is a seq the thread has not reached (time travel past the
    end): ``seq`` was asked for, ``version`` is the thread's last seq (0: no events)."""

    def __init__(self, thread_id: str, seq: int, version: int) -> None:
        self.thread_id = thread_id
        self.seq = seq
        self.version = version
        super().__init__(
            f"thread {thread_id!r} ends at seq {version}: seq {seq} lies beyond it, so there "
            "is no such point to go back to"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.thread_id, self.seq, self.version))


class RebuildBusyError(ConcurrencyError):
    """Raised when a thread kept changing while it was rebuilt: appends landed between the fold
    and the swap of its views on every attempt. Its views were left as they were."""

    def __init__(self, thread_id: str, attempts: int, actual: int) -> None:
        super().__init__(thread_id, "a quiet moment", actual)
        self.attempts = attempts
        # ConcurrencyError's wording ("expected version a quiet moment") says nothing useful.
        self.args = (
            f"thread {thread_id!r} kept changing while it was rebuilt (appends landed during "
            f"each of {attempts} attempts; now at version {actual}): its views are as they "
            "were; rebuild it again when its writers pause",
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.thread_id, self.attempts, self.actual))


class RebuildError(EventStoreError):
    """Raised when `Projector.rebuild_all` could not rebuild some threads (their logs are
    damaged, or they kept changing); every other thread was rebuilt. ``failed`` maps each to
    its error."""

    def __init__(self, rebuilt: dict[str, int], failed: dict[str, EventStoreError]) -> None:
        self.rebuilt = rebuilt
        self.failed = failed
        first, error = next(iter(failed.items()))
        more = f" and {len(failed) - 1} more" if len(failed) > 1 else ""
        hint = "rebuild again later" if isinstance(error, RebuildBusyError) else "run 'verify'"
        done = f"{len(rebuilt)} thread" + ("" if len(rebuilt) == 1 else "s")
        super().__init__(f"rebuilt {done}; not {first!r}{more}: {error} ({hint})")


async def _version_or_zero(store: EventStore, thread_id: str) -> int:
    try:
        return await store.version(thread_id)
    except (WrongKeyTypeError, CorruptEventError):  # a damaged meta hash: the report says so
        return 0


def _declared_handles(p: Projection[Any]) -> tuple[type[Event], ...] | None:
    """``p.handles``, unless a subclass overrides ``apply`` below the class that declared it.

    A subclass of, say, `StateProjection` whose ``apply`` also reacts to other events inherits
    ``handles`` meant for the parent's ``apply``; trusting it would skip those events in folds
    (and rebuilds) without a word. Such a projection gets every event instead.
    """
    if "handles" in vars(p):
        return p.handles
    for cls in type(p).__mro__:
        if "handles" in vars(cls):
            return p.handles if type(p).apply is cls.apply else None  # type: ignore[attr-defined]
    return None


def _payload_apply(p: Projection[Any]) -> Any:
    """``p.apply_payload`` if it folds as ``p.apply`` does, else None.

    It does when the class that implements it is the class that defines ``apply`` or a
    subclass of it; a subclass that overrides ``apply`` alone must get ``apply``.
    """
    if "apply" in vars(p) or "apply_payload" in vars(p):
        return None
    mro = type(p).__mro__
    apply_cls = next(c for c in mro if "apply" in vars(c))
    payload_cls = next(c for c in mro if "apply_payload" in vars(c))
    if payload_cls is Projection or not issubclass(payload_cls, apply_cls):
        return None
    return p.apply_payload


def _show(entry: ViewEntry | None) -> str:
    if entry is None:
        return "(absent)"
    value = entry.value if len(entry.value) <= 60 else entry.value[:57] + b"..."
    return f"seq={entry.seq} v={entry.version} {value!r}"


def _compare(expected: ViewOp, actual: ViewResult | None) -> list[Difference]:
    out: list[Difference] = []
    if isinstance(expected, ListLoad):
        got = actual if isinstance(actual, list) else []
        want = list(expected.entries)
        for i in range(max(len(got), len(want))):
            w = want[i] if i < len(want) else None
            g = got[i] if i < len(got) else None
            if w != g:
                out.append(
                    Difference(view=expected.view, key=f"[{i}]", expected=_show(w), actual=_show(g))
                )
                break  # the first differing position says enough; the rest is shifted
        if len(got) != len(want):
            out.append(
                Difference(
                    view=expected.view,
                    key="length",
                    expected=str(len(want)),
                    actual=str(len(got)),
                )
            )
    elif isinstance(expected, HashLoad):
        got_h = actual if isinstance(actual, dict) else {}
        for key in sorted(set(got_h) | set(expected.entries)):
            w, g = expected.entries.get(key), got_h.get(key)
            if w != g:
                out.append(
                    Difference(view=expected.view, key=key, expected=_show(w), actual=_show(g))
                )
    return out
