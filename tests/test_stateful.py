"""Random histories applied to the memory and the Redis backend must agree at every step.

A hypothesis state machine appends (with every kind of expected version and idempotency key),
retries earlier appends, applies guarded view ops and reloads views, on both backends at once.
After each step both outcomes must be identical and match a small model of versions and the
idempotency ledger; the invariant compares the stored logs (byte for byte, bar time and chain,
which depend on the clock), each backend's integrity chain, the views and the thread index.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from eventstore import (
    ANY,
    EXISTS,
    NO_THREAD,
    ConcurrencyError,
    ConflictError,
    Event,
    EventStore,
    ExpectedVersion,
    HashDelete,
    HashGet,
    HashGetAll,
    HashGetListed,
    HashLoad,
    HashSet,
    IdempotencyKeyReusedError,
    ListLoad,
    ListPop,
    ListPush,
    ListRange,
    ListReset,
    MemoryEventStore,
    MemoryServer,
    Message,
    MessageAppended,
    NewEvent,
    RecordedEvent,
    RedisEventStore,
    StateUpdated,
    ViewClear,
    ViewConflictError,
    ViewEntry,
    ViewOp,
    ViewRead,
    chain_link,
    connect,
    entry_digest,
)
from eventstore.testing import read_all

T = TypeVar("T")

# Odd but valid ids on purpose: a colon-laden id that looks like another key, non-ASCII.
THREADS = ("t1", "a:log:b", "émoji-😀")
# List and hash ops share view names on purpose: an op may land on the other kind of view.
VIEWS = ("a", "b")
FIELDS = ("f", "g", "ü")
KEYS = ("k1", "k2")


# -- what a step sends ----------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One append as sent, kept so that a later step can send it again."""

    thread: str
    events: tuple[NewEvent, ...]
    key: str | None
    specs: tuple[OpSpec, ...]
    expected: ExpectedVersion

    @property
    def ikey(self) -> str:
        return "k:" + self.key if self.key is not None else "e:" + self.events[0].id

    @property
    def content(self) -> bytes:
        """What an idempotency key is bound to: payloads and envelope meta, not the ids."""
        return msgspec.msgpack.encode(
            [(e.payload, e.turn_id, e.correlation_id, e.causation_id) for e in self.events]
        )


Guard = int | str | None  # None: unguarded; "current" / "stale": resolved against the store


@dataclass(frozen=True)
class OpSpec:
    """A view op with its event index and guard still symbolic (resolved when sent)."""

    kind: str  # push | reset | pop | set | delete | clear
    view: str
    values: tuple[bytes, ...] = ()
    field: str = ""
    event: int = 0
    count: int = 1
    guard: Guard = None


def _resolve_guard(guard: Guard, current: int) -> int | None:
    if guard == "current":
        return current
    if guard == "stale":
        return current - 1 if current > 0 else current + 1
    assert guard is None or isinstance(guard, int)
    return guard


# -- strategies -----------------------------------------------------------------------------

texts = st.one_of(st.sampled_from(["hi", "ok", ""]), st.text(max_size=12))
json_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.text(max_size=6),
    st.lists(st.integers(0, 9), max_size=3),
)
payloads: st.SearchStrategy[Event] = st.one_of(
    st.builds(
        lambda role, text: MessageAppended(message=Message(role=role, content=text)),
        st.sampled_from(["user", "assistant"]),
        texts,
    ),
    st.builds(lambda block, value: StateUpdated(block=block, value=value), texts, json_values),
)
envelope_ids = st.sampled_from([None, "turn-1", "tûrn-✓"])
new_events = st.builds(
    lambda payload, turn, corr: NewEvent(payload=payload, turn_id=turn, correlation_id=corr),
    payloads,
    envelope_ids,
    envelope_ids,
)
event_lists = st.lists(new_events, min_size=1, max_size=4).map(tuple)
keys = st.one_of(st.none(), st.sampled_from(KEYS))
expected_specs = st.one_of(
    st.sampled_from(["any", "no_thread", "exists", "current", "current", "stale", "ahead"]),
    st.integers(0, 8),
)
views = st.sampled_from(VIEWS)
fields = st.sampled_from(FIELDS)
# List values double as field names for HashGetListed; some are not even UTF-8.
list_values = st.lists(
    st.one_of(st.sampled_from([f.encode() for f in FIELDS]), st.binary(max_size=3)),
    max_size=3,
).map(tuple)
guards: st.SearchStrategy[Guard] = st.one_of(
    st.none(), st.sampled_from(["current", "current", "stale"]), st.integers(0, 3)
)
op_specs = st.one_of(
    st.builds(
        OpSpec,
        st.sampled_from(["push", "reset"]),
        views,
        values=list_values,
        event=st.integers(0, 3),
    ),
    st.builds(OpSpec, st.just("pop"), views, count=st.integers(1, 3)),
    st.builds(
        OpSpec,
        st.just("set"),
        views,
        values=st.binary(max_size=3).map(lambda b: (b,)),
        field=fields,
        event=st.integers(0, 3),
        guard=guards,
    ),
    st.builds(OpSpec, st.just("delete"), views, field=fields, guard=guards),
    st.builds(OpSpec, st.just("clear"), views),
)
op_lists = st.lists(op_specs, max_size=3).map(tuple)


# -- comparing ------------------------------------------------------------------------------

Outcome = tuple[Any, ...]


def _essence(e: RecordedEvent) -> tuple[Any, ...]:
    return (
        e.thread_id,
        e.seq,
        e.id,
        e.type,
        e.payload,
        e.schema_version,
        e.turn_id,
        e.correlation_id,
        e.causation_id,
    )


def _stored_bytes(raw: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Any]:
    # Time (s) and chain link (h) depend on the clock; everything else is identical bytes.
    return [
        (entry_id, {k: v for k, v in f.items() if k not in (b"s", b"h")}) for entry_id, f in raw
    ]


def _check_chain(thread: str, raw: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
    prev = ""
    for entry_id, fields_ in raw:
        digest = entry_digest(thread, fields_, None)
        assert digest is not None
        link = chain_link(prev, int(entry_id.split(b"-")[0]), int(fields_[b"s"]), digest)
        assert fields_[b"h"] == link.encode("ascii"), (thread, entry_id)
        prev = link


VIEW_READS: list[ViewRead] = [
    *(ListRange(v) for v in VIEWS),
    *(ListRange(v, -2, -1) for v in VIEWS),
    *(HashGetAll(v) for v in VIEWS),
    *(HashGet(v, FIELDS) for v in VIEWS),
    *(HashGetListed(h, lst) for h in VIEWS for lst in VIEWS),
]


@dataclass
class ThreadModel:
    version: int = 0
    # idempotency key -> (first seq, last seq, content)
    ledger: dict[str, tuple[int, int, bytes]] = field(default_factory=dict)


# -- the machine ----------------------------------------------------------------------------


class StoresAgree(RuleBasedStateMachine):
    """Every step goes to both stores; outcomes, logs and views must stay identical."""

    requests = Bundle("requests")

    def __init__(self, portal: BlockingPortal, url: str) -> None:
        super().__init__()
        self.portal = portal
        self.url = url
        self.namespace = "s" + uuid.uuid4().hex[:12]
        self.stores: list[EventStore] = []
        self.model = {t: ThreadModel() for t in THREADS}

    def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        return self.portal.call(fn)

    def on_both(self, fn: Callable[[EventStore], Awaitable[T]]) -> tuple[T, T]:
        """``fn`` run on the memory store, then on the Redis store."""
        mem, red = (self.portal.call(fn, store) for store in self.stores)
        return mem, red

    def outcomes(self, fn: Callable[[EventStore], Awaitable[Any]]) -> tuple[Outcome, Outcome]:
        """``("ok", result)`` or ``("err", type, attributes)`` per store; only refusals are
        expected, anything else fails the test."""
        out: list[Outcome] = []
        for store in self.stores:
            try:
                out.append(("ok", self.portal.call(fn, store)))
            except ConflictError as exc:
                out.append(("err", type(exc), vars(exc)))
        return out[0], out[1]

    @property
    def memory(self) -> EventStore:
        return self.stores[0]

    @initialize(partitions=st.sampled_from([1, 3, 16]))
    def open_stores(self, partitions: int) -> None:
        self.stores.append(
            MemoryEventStore(namespace=self.namespace, partitions=partitions, server=MemoryServer())
        )
        redis = self.call(
            lambda: connect(self.url, namespace=self.namespace, partitions=partitions)
        )
        assert isinstance(redis, RedisEventStore)
        self.stores.append(redis)

    def teardown(self) -> None:
        for store in self.stores:
            if isinstance(store, RedisEventStore):
                self.portal.call(_delete_namespace, store)
            self.portal.call(store.close)

    # -- helpers --------------------------------------------------------------------------

    def field_version(self, thread: str, view: str, field_: str) -> int:
        snap = self.call(lambda: self.memory.read_views(thread, [HashGet(view, (field_,))]))
        entries = snap.results[0]
        assert isinstance(entries, dict)
        return entries[field_].version if field_ in entries else 0

    def build_ops(self, req: Request) -> list[ViewOp]:
        n = len(req.events)
        ops: list[ViewOp] = []
        for s in req.specs:
            if s.kind in ("push", "reset"):
                cls = ListPush if s.kind == "push" else ListReset
                ops.append(cls(s.view, s.values, s.event % n))
            elif s.kind == "pop":
                ops.append(ListPop(s.view, s.count))
            elif s.kind in ("set", "delete"):
                guard = _resolve_guard(s.guard, self.field_version(req.thread, s.view, s.field))
                if s.kind == "set":
                    ops.append(HashSet(s.view, s.field, s.values[0], s.event % n, guard))
                else:
                    ops.append(HashDelete(s.view, s.field, guard))
            else:
                ops.append(ViewClear(s.view))
        return ops

    def resolve_expected(self, thread: str, spec: str | int) -> ExpectedVersion:
        version = self.model[thread].version
        symbolic: dict[str, ExpectedVersion] = {
            "any": ANY,
            "no_thread": NO_THREAD,
            "exists": EXISTS,
            "current": version,
            "stale": version - 1 if version else 1,
            "ahead": version + 1,
        }
        if isinstance(spec, int):
            return spec
        return symbolic[spec]

    def send(self, req: Request) -> None:
        """Send ``req`` to both stores, compare the outcomes, check them against the model."""
        model = self.model[req.thread]
        ops = self.build_ops(req)
        mem, red = self.outcomes(
            lambda s: s.append(
                req.thread,
                req.events,
                expected_version=req.expected,
                idempotency_key=req.key,
                view_ops=ops,
            )
        )
        if mem[0] == "ok" and red[0] == "ok":
            # AppendResult equality ignores `duplicate`; compare it on its own.
            assert (mem[1], mem[1].duplicate) == (red[1], red[1].duplicate)
        else:
            assert mem == red
        outcome = mem

        prior = model.ledger.get(req.ikey)
        version = model.version
        if prior is not None:
            if prior[2] == req.content:
                assert outcome[0] == "ok", outcome
                result = outcome[1]
                assert (result.first_seq, result.last_seq, result.duplicate) == (
                    prior[0],
                    prior[1],
                    True,
                )
            else:
                assert outcome[:2] == ("err", IdempotencyKeyReusedError), outcome
            return
        expected = req.expected
        conflict = (
            (expected is NO_THREAD and version != 0)
            or (expected is EXISTS and version == 0)
            or (isinstance(expected, int) and expected != version)
        )
        if conflict:
            assert outcome[:2] == ("err", ConcurrencyError), outcome
            assert outcome[2]["actual"] == version and outcome[2]["expected"] == expected
            return
        if outcome[0] == "err":
            assert outcome[1] is ViewConflictError, outcome
            assert any(
                isinstance(op, HashSet | HashDelete) and op.expected_version is not None
                for op in ops
            )
            return
        result = outcome[1]
        n = len(req.events)
        assert (result.first_seq, result.last_seq, result.duplicate) == (
            version + 1,
            version + n,
            False,
        )
        model.version += n
        model.ledger[req.ikey] = (result.first_seq, result.last_seq, req.content)

    # -- rules ----------------------------------------------------------------------------

    @rule(
        target=requests,
        thread=st.sampled_from(THREADS),
        events=event_lists,
        key=keys,
        expected=expected_specs,
        specs=op_lists,
    )
    def append(
        self,
        thread: str,
        events: tuple[NewEvent, ...],
        key: str | None,
        expected: str | int,
        specs: tuple[OpSpec, ...],
    ) -> Request:
        req = Request(thread, events, key, specs, self.resolve_expected(thread, expected))
        self.send(req)
        return req

    @rule(
        target=requests,
        earlier=requests,
        expected=st.one_of(st.just("original"), expected_specs),
        rebuild=st.booleans(),
        elsewhere=st.one_of(st.none(), st.sampled_from(THREADS)),
    )
    def retry(
        self, earlier: Request, expected: str | int, rebuild: bool, elsewhere: str | None
    ) -> Request:
        """Send an earlier append again: the same objects, or rebuilt with fresh ids, maybe to
        another thread (ledgers are per thread) and with any expected version (the ledger is
        checked first, so a retry wins over a now stale version)."""
        thread = elsewhere or earlier.thread
        events = earlier.events
        if rebuild:
            events = tuple(
                NewEvent(payload=e.payload, turn_id=e.turn_id, correlation_id=e.correlation_id)
                for e in events
            )
        exp = (
            earlier.expected if expected == "original" else self.resolve_expected(thread, expected)
        )
        req = Request(thread, events, earlier.key, earlier.specs, exp)
        self.send(req)
        return req

    @rule(
        thread=st.sampled_from(THREADS),
        view=views,
        as_hash=st.booleans(),
        values=list_values,
        seq=st.integers(0, 9),
        expected=expected_specs,
    )
    def load_views(
        self,
        thread: str,
        view: str,
        as_hash: bool,
        values: tuple[bytes, ...],
        seq: int,
        expected: str | int,
    ) -> None:
        """A rebuild's view load, applied only at the exact version."""
        exp = self.resolve_expected(thread, expected)
        if not isinstance(exp, int):
            exp = self.model[thread].version
        op: ViewOp
        if as_hash:
            op = HashLoad(
                view, {f: ViewEntry(seq, v, 2) for f, v in zip(FIELDS, values, strict=False)}
            )
        else:
            op = ListLoad(view, tuple(ViewEntry(seq, v) for v in values))
        version = exp
        outcomes = self.outcomes(lambda s: s.load_views(thread, [op], expected_version=version))
        assert outcomes[0] == outcomes[1]
        if exp == self.model[thread].version:
            assert outcomes[0] == ("ok", None)
        else:
            assert outcomes[0][:2] == ("err", ConcurrencyError)

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def stores_agree(self) -> None:
        if len(self.stores) < 2:
            return
        for thread in THREADS:
            self.check_thread(thread)
        mem_threads, red_threads = self.on_both(lambda s: s.threads())
        assert {(t.thread_id, t.partition) for t in mem_threads} == {
            (t.thread_id, t.partition) for t in red_threads
        }
        assert {t.thread_id for t in mem_threads} == {t for t in THREADS if self.model[t].version}

    def check_thread(self, thread: str) -> None:
        version = self.model[thread].version
        mem_raw, red_raw = self.on_both(lambda s: s.read_raw(thread, count=10_000))
        assert len(mem_raw) == len(red_raw) == version
        assert _stored_bytes(mem_raw) == _stored_bytes(red_raw)
        _check_chain(thread, mem_raw)
        _check_chain(thread, red_raw)
        mem_log, red_log = self.on_both(lambda s: read_all(s, thread))
        assert [_essence(e) for e in mem_log] == [_essence(e) for e in red_log]
        assert [e.seq for e in mem_log] == list(range(1, version + 1))
        assert self.on_both(lambda s: s.version(thread)) == (version, version)
        mem_views, red_views = self.on_both(lambda s: s.read_views(thread, VIEW_READS))
        assert (mem_views.version, mem_views.results) == (red_views.version, red_views.results)
        assert mem_views.version == version
        # Each backend mints its own lives: both name one exactly when the thread exists, and
        # the one its change feed and `incarnation` name.
        lives = self.on_both(lambda s: s.incarnation(thread))
        assert (mem_views.incarnation, red_views.incarnation) == lives
        assert (lives[0] is None) == (lives[1] is None) == (version == 0)


async def _delete_namespace(store: RedisEventStore) -> None:
    client = store.client
    # The pattern is literal up to the '*': namespaces hold no glob characters.
    async for key in client.scan_iter(match=f"tl:{{{store.namespace}:*", count=500):
        await client.delete(key)


@pytest.fixture(scope="module")
def portal() -> Iterator[BlockingPortal]:
    with start_blocking_portal(backend="asyncio") as portal:
        yield portal


def test_memory_and_redis_backends_agree(portal: BlockingPortal, redis_url: str) -> None:
    # Hypothesis is typed differently across releases (untyped before 6.16x, a class after);
    # the cast keeps this call checkable under both.
    run: Any = run_state_machine_as_test
    run(
        lambda: StoresAgree(portal, redis_url),
        settings=settings(
            max_examples=30,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
