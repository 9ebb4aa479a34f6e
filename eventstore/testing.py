"""The conformance suite every `EventStore` backend passes, shipped for outside backends too.

Subclass `EventStoreConformance` in a test module, implement `make_store` (and the two
backend hooks if the backend can do them), and every inherited test runs against the backend::

    class TestMyBackend(EventStoreConformance):
        async def make_store(self, namespace, **options):
            return MyEventStore(namespace=namespace, **options)

Requires pytest and the anyio pytest plugin.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from math import inf, nan
from typing import Any, ClassVar

import anyio
import msgspec
import pytest

from ._catalog import Message, MessageAppended, StateUpdated, ToolCallPart, TurnOpened
from ._codec import (
    MAX_NESTING,
    UNKEYED_FINGERPRINT,
    decode_rows,
    event_id_text,
    key_fingerprint,
    namespace_chain_key,
)
from ._contract import ANY, EXISTS, NO_THREAD, EventStore, ExpectedVersion, RawRange
from ._errors import (
    ChainKeyMismatchError,
    ConcurrencyError,
    ConflictError,
    CorruptEventError,
    EventTooLargeError,
    EventValidationError,
    FeedGroupNotFoundError,
    FeedTrimmedError,
    IdempotencyKeyReusedError,
    IncarnationConflictError,
    InvalidInputError,
    InvalidThreadIdError,
    OperationalError,
    StoreClosedError,
    ThreadReplacedError,
    UnknownEventTypeError,
    ViewConflictError,
)
from ._events import Event, EventRegistry, NewEvent, PayloadRow, RecordedEvent, register_event
from ._events import registry as default_registry
from ._feed import CheckpointedState
from ._views import (
    HashDelete,
    HashGet,
    HashGetAll,
    HashGetListed,
    HashLoad,
    HashSet,
    ListLoad,
    ListPop,
    ListPush,
    ListRange,
    ListReset,
    ViewClear,
    ViewEntry,
    ViewOp,
    ViewRead,
)

__all__ = ["EventStoreConformance", "msg", "read_all"]


def msg(text: str, role: str = "user") -> MessageAppended:
    """A message event with ``text``."""
    return MessageAppended(message=Message(role=role, content=text))  # type: ignore[arg-type]


async def read_all(store: EventStore, thread_id: str, **kwargs: Any) -> list[RecordedEvent]:
    """Every event ``store.read`` yields, as a list."""
    return [e async for e in store.read(thread_id, **kwargs)]


async def _read_between(store: EventStore, thread_id: str, **kwargs: Any) -> list[RecordedEvent]:
    """Every event ``store.read_between`` yields, as a list."""
    return [e async for e in store.read_between(thread_id, **kwargs)]


async def _drain(batches: AsyncIterator[Any]) -> None:
    async for _ in batches:
        pass


def message_texts(events: Sequence[RecordedEvent]) -> list[str]:
    """The text of each event, every one a `MessageAppended` (asserted)."""
    out = []
    for e in events:
        assert isinstance(e.payload, MessageAppended)
        out.append(e.payload.message.text)
    return out


class _Unregistered(Event, tag="testing.unregistered", frozen=True):
    """A payload type nobody registered."""

    x: int = 0


def _fields(fields: Any) -> dict[bytes, bytes]:
    """Stored fields as `EventStore.read_raw` gives them (a dict), from either form."""
    if isinstance(fields, dict):
        return fields
    return dict(zip(fields[0::2], fields[1::2], strict=True))


class EventStoreConformance:
    """Behaviour every backend shares. Subclasses implement `make_store` and, if they can, the
    hooks `flush_scripts` and `write_raw_entry`."""

    pytestmark: ClassVar[Any] = pytest.mark.anyio
    supports_raw_writes: ClassVar[bool] = True
    may_scan: ClassVar[bool] = True
    """False for a store whose server refuses ``SCAN`` (an ACL user made by `acl_rules`)."""

    async def make_store(self, namespace: str, **options: Any) -> EventStore:
        """Open a store of this backend on ``namespace``; ``options`` go to the constructor."""
        raise NotImplementedError

    async def flush_scripts(self, store: EventStore) -> None:
        """Make the server forget its cached scripts (Redis: ``SCRIPT FLUSH``)."""

    async def write_raw_entry(
        self, store: EventStore, thread_id: str, entry_id: str, fields: dict[bytes, bytes]
    ) -> None:
        """Write a stream entry straight into the thread's log, bypassing every check."""
        raise NotImplementedError

    async def forget_chain_key(self, store: EventStore, thread_id: str) -> None:
        """Remove the thread's recorded chain key fingerprint, as in a thread written before
        fingerprints were recorded (Redis: ``HDEL`` of its meta field ``f``)."""
        raise NotImplementedError

    async def unindex_thread(self, store: EventStore, thread_id: str) -> None:
        """Remove the thread from its partition's thread index and nothing else, as an edit
        of that one key would (Redis: ``ZREM``)."""
        raise NotImplementedError

    async def set_last_activity(self, store: EventStore, thread_id: str, ms: int) -> None:
        """List the thread in its partition's thread index as last active at ``ms`` and change
        nothing else (Redis: ``ZADD``), so that many threads can share one millisecond."""
        raise NotImplementedError

    async def set_version(self, store: EventStore, thread_id: str, version: int) -> None:
        """Record ``version`` as the thread's version and change nothing else, as an edit of
        its meta hash would (Redis: ``HSET`` of field ``v``)."""
        raise NotImplementedError

    async def delete_meta(self, store: EventStore, thread_id: str) -> None:
        """Remove the thread's meta hash (its version, chain head, life and ledger) and
        nothing else, leaving its log as it is (Redis: ``DEL`` of its meta key)."""
        raise NotImplementedError

    @pytest.fixture
    async def store(self) -> AsyncIterator[EventStore]:
        store = await self.make_store("c" + uuid.uuid4().hex[:12])
        try:
            yield store
        finally:
            await store.close()

    # -- ordering and positions ----------------------------------------------------------------

    async def test_append_returns_first_and_last_seq(self, store: EventStore) -> None:
        r1 = await store.append("t", [msg("a")])
        r2 = await store.append("t", [msg("b"), msg("c"), msg("d")])
        assert (r1.first_seq, r1.last_seq) == (1, 1)
        assert (r2.first_seq, r2.last_seq, r2.version) == (2, 4, 4)
        assert not r1.duplicate and not r2.duplicate
        assert await store.version("t") == 4

    async def test_events_read_back_in_order_with_contiguous_seq(self, store: EventStore) -> None:
        for i in range(0, 30, 3):
            await store.append("t", [msg(str(i)), msg(str(i + 1)), msg(str(i + 2))])
        events = await read_all(store, "t")
        assert [e.seq for e in events] == list(range(1, 31))
        assert message_texts(events) == [str(i) for i in range(30)]
        assert all(e.thread_id == "t" for e in events)

    async def test_envelope_fields_round_trip(self, store: EventStore) -> None:
        new = NewEvent(
            payload=msg("hello"), turn_id="turn-1", correlation_id="corr", causation_id="cause"
        )
        await store.append("t", [new])
        (event,) = await read_all(store, "t")
        assert event.id == new.id
        assert event.payload == new.payload
        assert (event.turn_id, event.correlation_id, event.causation_id) == (
            "turn-1",
            "corr",
            "cause",
        )
        assert event.type == "message.appended"
        assert event.schema_version == 1
        assert event.time_ms > 1_600_000_000_000
        assert len(event.chain) == 32

    async def test_times_never_decrease_within_a_thread(self, store: EventStore) -> None:
        for i in range(20):
            await store.append("t", [msg(str(i))])
        times = [e.time_ms for e in await read_all(store, "t")]
        assert times == sorted(times)

    async def test_threads_are_independent(self, store: EventStore) -> None:
        await store.append("a", [msg("a1"), msg("a2")])
        await store.append("b", [msg("b1")])
        assert message_texts(await read_all(store, "a")) == ["a1", "a2"]
        assert message_texts(await read_all(store, "b")) == ["b1"]
        assert await store.version("missing") == 0
        assert await read_all(store, "missing") == []

    # -- reads ---------------------------------------------------------------------------------

    async def test_read_ranges_forwards_and_backwards(self, store: EventStore) -> None:
        await store.append("t", [msg(str(i)) for i in range(1, 1201)])
        assert [e.seq for e in await read_all(store, "t", start=5, stop=9)] == [5, 6, 7, 8, 9]
        assert [e.seq for e in await read_all(store, "t", start=1195)] == list(range(1195, 1201))
        back = await read_all(store, "t", backwards=True)
        assert [e.seq for e in back] == list(range(1200, 0, -1))
        back_range = await read_all(store, "t", start=3, stop=7, backwards=True)
        assert [e.seq for e in back_range] == [7, 6, 5, 4, 3]
        limited = await read_all(store, "t", start=10, limit=700)
        assert [e.seq for e in limited] == list(range(10, 710))
        back_limited = await read_all(store, "t", backwards=True, limit=3)
        assert [e.seq for e in back_limited] == [1200, 1199, 1198]
        assert await read_all(store, "t", start=1201) == []
        assert await read_all(store, "t", start=8, stop=7) == []
        # Bounds past any stream id: the same answers on every backend, never a server error.
        huge = 10**30
        assert len(await read_all(store, "t", start=1190, stop=huge)) == 11
        assert len(await read_all(store, "t", start=1198, stop=huge, backwards=True)) == 3
        assert await read_all(store, "t", start=huge) == []
        assert len(await store.read_raw("t", start=1199, stop=huge)) == 2
        batches = [b async for b in store.read_batches("t", start=1199, stop=huge)]
        assert [e.seq for b in batches for e in b] == [1199, 1200]

    async def test_payload_batches_are_the_events_in_parts(self, store: EventStore) -> None:
        news = [
            NewEvent(payload=msg(str(i)), turn_id=f"turn-{i // 7}" if i % 3 else None)
            for i in range(1, 1201)
        ]
        await store.append("t", news[:600])
        await store.append("t", news[600:])
        events = [e async for b in store.read_batches("t", start=3, stop=1100) for e in b]
        batches: list[list[PayloadRow]] = []
        await store.fold_payloads("t", lambda rows: batches.append(list(rows)), start=3, stop=1100)
        assert all(batches)
        rows = [row for b in batches for row in b]
        assert [
            (seq, payload, event_id_text(i), meta.turn_id) for seq, payload, i, meta in rows
        ] == [(e.seq, e.payload, e.id, e.turn_id) for e in events]
        assert [r[0] for r in rows] == list(range(3, 1101))
        await store.fold_payloads("missing", batches.append)
        assert sum(map(len, batches)) == len(rows)

    async def test_a_read_never_goes_on_in_the_next_life_of_a_thread(
        self, store: EventStore
    ) -> None:
        """A thread deleted and written again while a read of several batches goes through
        it: the read stops with `ThreadReplacedError`; every event it gave is of the first
        life (never the old life's first pages followed by the new life's later ones)."""

        async def two_lives() -> None:
            await store.delete_thread("t")
            for part in range(3):
                await store.append("t", [msg(f"new {part}-{i}") for i in range(600)])

        async def first_life_then_replaced(reads: Any) -> list[str]:
            seen: list[str] = []
            for part in range(3):
                await store.append("t", [msg(f"old {part}-{i}") for i in range(600)])
            with pytest.raises(ThreadReplacedError, match="was deleted while it was read"):
                async for text in reads():
                    if not seen:
                        await two_lives()
                    seen.append(text)
            await store.delete_thread("t")
            assert seen and all(t.startswith("old ") for t in seen), seen[-3:]
            return seen

        def texts_of(events: Any) -> Any:
            async def gen() -> Any:
                async for e in events:
                    yield e.payload.message.content

            return gen()

        def batch_texts(batches: Any) -> Any:
            async def gen() -> Any:
                async for batch in batches:
                    for e in batch:
                        yield e.payload.message.content

            return gen()

        await first_life_then_replaced(lambda: texts_of(store.read("t")))
        backwards = await first_life_then_replaced(
            lambda: texts_of(store.read("t", backwards=True))
        )
        assert backwards[0] == "old 2-599"
        await first_life_then_replaced(lambda: batch_texts(store.read_batches("t")))
        # fold_payloads reads its batches as read_batches does (the same pages and checks).

    async def test_read_by_time(self, store: EventStore) -> None:
        await store.append("t", [msg("early")])
        await anyio.sleep(0.02)
        await store.append("t", [msg("middle-1"), msg("middle-2")])
        await anyio.sleep(0.02)
        await store.append("t", [msg("late")])
        events = await read_all(store, "t")
        t_mid = events[1].time_ms
        assert events[0].time_ms < t_mid < events[3].time_ms
        assert await store.seq_at("t", events[0].time_ms - 1) == 0
        assert await store.seq_at("t", t_mid) == 3
        assert await store.seq_at("t", events[3].time_ms + 10_000) == 4
        between = [e async for e in store.read_between("t", t_mid, t_mid)]
        assert message_texts(between) == ["middle-1", "middle-2"]
        since = [e async for e in store.read_between("t", since=events[1].time)]
        assert message_texts(since) == ["middle-1", "middle-2", "late"]
        until_back = [e async for e in store.read_between("t", until=t_mid, backwards=True)]
        assert message_texts(until_back) == ["middle-2", "middle-1", "early"]
        assert await store.seq_at("missing", 10**15) == 0

    async def test_read_by_time_never_mixes_two_lives_of_a_thread(self, store: EventStore) -> None:
        # The seqs a time range stands for are found before the events are read: a thread
        # deleted and written again in between must not be read between seqs of its old life.
        for n in range(3):
            await store.append("t", [msg(f"old{n}")])
            await anyio.sleep(0.003)
        old = await read_all(store, "t")
        await anyio.sleep(0.003)
        real = store.seq_at
        calls = 0

        async def answer_then_recreate(thread_id: str, time_ms: int) -> int:
            nonlocal calls
            calls += 1
            answer = await real(thread_id, time_ms)
            if calls == 1:
                await store.delete_thread("t")
                await store.append("t", [msg(f"new{n}") for n in range(5)])
            return answer

        async def start_over() -> list[RecordedEvent]:
            """The old life written again, the recreation to happen at the next lookup."""
            nonlocal calls
            calls = 0
            await store.delete_thread("t")
            for n in range(3):
                await store.append("t", [msg(f"old{n}")])
            events = await read_all(store, "t")
            await anyio.sleep(0.003)
            return events

        store.seq_at = answer_then_recreate  # type: ignore[method-assign]
        # Every event of the new life came after the old one's last: all since, none until.
        since = [e async for e in store.read_between("t", since=old[2].time)]
        assert message_texts(since) == [f"new{n}" for n in range(5)]
        old = await start_over()
        assert [e async for e in store.read_between("t", until=old[2].time)] == []
        old = await start_over()
        both = [e async for e in store.read_between("t", old[1].time, old[2].time_ms + 60_000)]
        assert message_texts(both) == [f"new{n}" for n in range(5)]

    # -- expected versions ---------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("prefill", "expected", "ok"),
        [
            (0, ANY, True),
            (2, ANY, True),
            (0, NO_THREAD, True),
            (2, NO_THREAD, False),
            (0, EXISTS, False),
            (2, EXISTS, True),
            (0, 0, True),
            (2, 2, True),
            (2, 1, False),
            (2, 3, False),
            (0, 1, False),
        ],
    )
    async def test_expected_version(
        self, store: EventStore, prefill: int, expected: ExpectedVersion, ok: bool
    ) -> None:
        if prefill:
            await store.append("t", [msg(str(i)) for i in range(prefill)])
        if ok:
            result = await store.append("t", [msg("x")], expected_version=expected)
            assert result.first_seq == prefill + 1
        else:
            with pytest.raises(ConcurrencyError) as info:
                await store.append("t", [msg("x")], expected_version=expected)
            assert info.value.expected == expected
            assert info.value.actual == prefill
            assert info.value.thread_id == "t"
            assert await store.version("t") == prefill

    async def test_versions_of_several_threads_in_their_order(self, store: EventStore) -> None:
        await store.append("a", [msg("1"), msg("2")])
        await store.append("b", [msg("1")])
        assert await store.versions(["b", "none", "a", "b"]) == [1, 0, 2, 1]
        assert await store.versions([]) == []
        for bad in ("ab", ["a", ""], [b"a"]):
            with pytest.raises(InvalidInputError):
                await store.versions(bad)  # type: ignore[arg-type]

    @pytest.mark.parametrize("bad", [-1, "3", 1.5, True, None])
    async def test_malformed_expected_version_is_rejected(
        self, store: EventStore, bad: Any
    ) -> None:
        with pytest.raises(InvalidInputError):
            await store.append("t", [msg("x")], expected_version=bad)
        assert await store.version("t") == 0

    # -- atomicity ------------------------------------------------------------------------------

    async def test_refused_multi_event_append_writes_nothing(self, store: EventStore) -> None:
        await store.append(
            "t", [msg("a")], view_ops=[ListPush("messages", (b"a",)), HashSet("s", "f", b"1")]
        )
        before = await store.read_views("t", [ListRange("messages"), HashGetAll("s")])
        threads_before = await store.threads()
        with pytest.raises(ConcurrencyError):
            await store.append(
                "t",
                [msg("b"), msg("c")],
                expected_version=0,
                idempotency_key="r",
                view_ops=[ListPush("messages", (b"b", b"c"))],
            )
        with pytest.raises(ViewConflictError) as info:
            await store.append(
                "t",
                [msg("b"), msg("c")],
                idempotency_key="r",
                view_ops=[ListPush("messages", (b"b", b"c")), HashSet("s", "f", b"2", 1, 0)],
            )
        assert (info.value.view, info.value.field) == ("s", "f")
        assert (info.value.expected, info.value.actual) == (0, 1)
        assert message_texts(await read_all(store, "t")) == ["a"]
        assert await store.read_views("t", [ListRange("messages"), HashGetAll("s")]) == before
        assert await store.threads() == threads_before
        # The refused requests did not burn their idempotency keys.
        result = await store.append(
            "t", [msg("b"), msg("c")], idempotency_key="r", view_ops=[ListPush("m", (b"x",))]
        )
        assert (result.first_seq, result.last_seq, result.duplicate) == (2, 3, False)

    # -- idempotency ---------------------------------------------------------------------------

    async def test_retry_with_same_key_returns_original_and_writes_nothing(
        self, store: EventStore
    ) -> None:
        first = await store.append(
            "t", [msg("a"), msg("b")], idempotency_key="req-1", view_ops=[ListPush("m", (b"a",))]
        )
        await store.append("t", [msg("c")])
        again = await store.append(
            "t", [msg("a"), msg("b")], idempotency_key="req-1", view_ops=[ListPush("m", (b"a",))]
        )
        assert again == first
        assert again.duplicate and not first.duplicate
        assert await store.version("t") == 3
        snap = await store.read_views("t", [ListRange("m")])
        assert [e.value for e in snap.results[0]] == [b"a"]  # type: ignore[union-attr]

    async def test_retry_of_same_event_objects_is_deduplicated_without_a_key(
        self, store: EventStore
    ) -> None:
        events = [NewEvent(payload=msg("a")), NewEvent(payload=msg("b"))]
        first = await store.append("t", events)
        again = await store.append("t", events, expected_version=0)
        assert again == first and again.duplicate
        assert await store.version("t") == 2

    async def test_retry_wins_over_a_now_stale_expected_version(self, store: EventStore) -> None:
        first = await store.append("t", [msg("a")], expected_version=NO_THREAD, idempotency_key="k")
        again = await store.append("t", [msg("a")], expected_version=NO_THREAD, idempotency_key="k")
        assert again == first

    async def test_reused_key_with_different_events_is_refused(self, store: EventStore) -> None:
        await store.append("t", [msg("a")], idempotency_key="k")
        with pytest.raises(IdempotencyKeyReusedError) as info:
            await store.append("t", [msg("something else")], idempotency_key="k")
        assert info.value.thread_id == "t"
        # The caller's key, not the ledger field it is recorded under ("k:k").
        assert info.value.key == "k"
        assert "idempotency key 'k' " in str(info.value)
        assert await store.version("t") == 1

    async def test_recorded_append_answers_what_a_key_wrote(self, store: EventStore) -> None:
        assert await store.recorded_append("t", "k") is None  # no thread
        await store.append("t", [msg("a")], idempotency_key="one")
        many = await store.append("t", [msg("b"), msg("c"), msg("d")], idempotency_key="many")
        await store.append("t", [msg("e")])
        found = await store.recorded_append("t", "many")
        assert found is not None and found.duplicate
        assert (found.thread_id, found.first_seq, found.last_seq) == ("t", 2, 4)
        assert found == many
        one = await store.recorded_append("t", "one")
        assert one is not None and (one.first_seq, one.last_seq) == (1, 1)
        assert await store.recorded_append("t", "never") is None
        assert await store.recorded_append("other", "many") is None  # keys are per thread
        for bad in ["", None, 5, "x" * 513]:
            with pytest.raises(InvalidInputError, match="idempotency_key"):
                await store.recorded_append("t", bad)  # type: ignore[arg-type]
        await store.delete_thread("t")
        assert await store.recorded_append("t", "many") is None  # the ledger went with the thread

    async def test_recorded_appends_answers_for_many_keys_at_once(self, store: EventStore) -> None:
        assert await store.recorded_appends("t", ["k"]) == {}  # no thread
        keys = [f"key-{i}" for i in range(2500)]  # more than one chunk of the Redis backend's
        for key in keys[::500]:
            await store.append("t", [msg(key)], idempotency_key=key)
        many = await store.append("t", [msg("b"), msg("c")], idempotency_key="many")
        found = await store.recorded_appends("t", [*keys, "many", "never"])
        assert sorted(found) == sorted([*keys[::500], "many"])
        assert found["many"] == many and found["many"].duplicate
        assert [found[k].first_seq for k in keys[::500]] == [1, 2, 3, 4, 5]
        assert found == {
            k: r for k in [*keys, "many"] if (r := await store.recorded_append("t", k)) is not None
        }
        assert await store.recorded_appends("t", []) == {}
        assert await store.recorded_appends("other", ["many"]) == {}  # keys are per thread
        for bad in ["many", [""], [None], ["x" * 513], 5]:
            with pytest.raises(InvalidInputError, match="idempotency_key"):
                await store.recorded_appends("t", bad)  # type: ignore[arg-type]
        await store.delete_thread("t")
        assert await store.recorded_appends("t", ["many"]) == {}  # gone with the thread

    async def test_idempotency_keys_are_per_thread(self, store: EventStore) -> None:
        a = await store.append("a", [msg("x")], idempotency_key="k")
        b = await store.append("b", [msg("x")], idempotency_key="k")
        assert not a.duplicate and not b.duplicate

    async def test_ledger_outlives_any_time_window(self, store: EventStore) -> None:
        first = await store.append("t", [msg("a")], idempotency_key="old")
        for i in range(300):
            await store.append("t", [msg(str(i))])
        again = await store.append("t", [msg("a")], idempotency_key="old")
        assert again == first and again.duplicate

    # -- concurrency ---------------------------------------------------------------------------

    async def test_concurrent_appenders_with_exact_versions(self, store: EventStore) -> None:
        writers, per_writer = 16, 200
        conflicts: list[ConcurrencyError] = []
        written: list[tuple[int, int]] = []

        async def writer(w: int) -> None:
            done = 0
            version = await store.version("t")
            while done < per_writer:
                try:
                    result = await store.append("t", [msg(f"{w}:{done}")], expected_version=version)
                except ConcurrencyError as exc:
                    conflicts.append(exc)
                    version = exc.actual
                    continue
                written.append((w, done))
                version = result.last_seq
                done += 1

        async with anyio.create_task_group() as tg:
            for w in range(writers):
                tg.start_soon(writer, w)
        total = writers * per_writer
        events = await read_all(store, "t")
        assert [e.seq for e in events] == list(range(1, total + 1))
        texts = message_texts(events)
        assert len(set(texts)) == total
        for w in range(writers):
            mine = [int(t.split(":")[1]) for t in texts if t.split(":")[0] == str(w)]
            assert mine == list(range(per_writer))  # each writer's events in its own order
        assert len(written) == total
        assert all(isinstance(c.actual, int) and c.actual > 0 for c in conflicts)
        assert all(c.expected != c.actual for c in conflicts)

    # -- views ---------------------------------------------------------------------------------

    async def test_list_views_push_reset_pop(self, store: EventStore) -> None:
        await store.append(
            "t",
            [msg("a"), msg("b")],
            view_ops=[ListPush("l", (b"a",), 0), ListPush("l", (b"b",), 1)],
        )
        snap = await store.read_views("t", [ListRange("l")])
        assert snap.version == 2
        assert snap.results == [[ViewEntry(1, b"a"), ViewEntry(2, b"b")]]
        await store.append("t", [msg("c")], view_ops=[ListPush("l", (b"c", b"d"))])
        snap = await store.read_views("t", [ListRange("l", -2, -1), ListRange("l", 0, 0)])
        assert snap.results == [[ViewEntry(3, b"c"), ViewEntry(3, b"d")], [ViewEntry(1, b"a")]]
        await store.append("t", [msg("pop")], view_ops=[ListPop("l", 2)])
        snap = await store.read_views("t", [ListRange("l")])
        assert [e.value for e in snap.results[0]] == [b"a", b"b"]  # type: ignore[union-attr]
        await store.append("t", [msg("reset")], view_ops=[ListReset("l", (b"z",))])
        snap = await store.read_views("t", [ListRange("l"), ListRange("l", -6, -1)])
        assert snap.results == [[ViewEntry(5, b"z")], [ViewEntry(5, b"z")]]
        await store.append("t", [msg("clear")], view_ops=[ViewClear("l")])
        assert (await store.read_views("t", [ListRange("l")])).results == [[]]

    async def test_hash_views_versions_and_guards(self, store: EventStore) -> None:
        await store.append("t", [msg("a")], view_ops=[HashSet("h", "x", b"1", 0, 0)])
        await store.append(
            "t", [msg("b")], view_ops=[HashSet("h", "x", b"2", 0, 1), HashSet("h", "y", b"9")]
        )
        snap = await store.read_views("t", [HashGetAll("h"), HashGet("h", ("y", "nope"))])
        assert snap.results[0] == {"x": ViewEntry(2, b"2", 2), "y": ViewEntry(2, b"9", 1)}
        assert snap.results[1] == {"y": ViewEntry(2, b"9", 1)}
        with pytest.raises(ViewConflictError):
            await store.append("t", [msg("c")], view_ops=[HashDelete("h", "x", 1)])
        await store.append("t", [msg("c")], view_ops=[HashDelete("h", "x", 2)])
        snap = await store.read_views("t", [HashGetAll("h")])
        assert list(snap.results[0]) == ["y"]
        assert snap.version == 3

    async def test_guards_see_the_ops_before_them_in_the_same_append(
        self, store: EventStore
    ) -> None:
        """As if the append's events came one by one: a guard reads the field's version after
        the earlier sets, deletes and clears of the same append."""
        await store.append("t", [msg("a")], view_ops=[HashSet("h", "x", b"1")])  # x at 1
        await store.append(
            "t",
            [msg("b")],
            view_ops=[HashSet("h", "x", b"2", 0, 1), HashSet("h", "x", b"3", 0, 2)],
        )
        # Two writers' worth of "I saw version 3" in one append: the second is a lost update.
        before = await store.read_views("t", [HashGetAll("h")])
        with pytest.raises(ViewConflictError) as caught:
            await store.append(
                "t",
                [msg("c")],
                view_ops=[HashSet("h", "x", b"4", 0, 3), HashSet("h", "x", b"5", 0, 3)],
            )
        assert (caught.value.expected, caught.value.actual) == (3, 4)
        assert await store.read_views("t", [HashGetAll("h")]) == before
        # A delete, a clear or a list op on the key starts the field again from 0.
        await store.append(
            "t",
            [msg("d")],
            view_ops=[HashDelete("h", "x", 3), HashSet("h", "x", b"6", 0, 0)],
        )
        await store.append(
            "t",
            [msg("e")],
            view_ops=[HashSet("h", "y", b"1", 0, 0), ViewClear("h"), HashSet("h", "y", b"2", 0, 0)],
        )
        await store.append(
            "t",
            [msg("f")],
            view_ops=[ListPush("h", (b"v",)), HashSet("h", "y", b"3", 0, 0)],
        )
        snap = await store.read_views("t", [HashGetAll("h")])
        assert snap.results[0] == {"y": ViewEntry(5, b"3", 1)}
        assert snap.version == 5

    async def test_hash_fields_listed_by_a_list_view(self, store: EventStore) -> None:
        ops: list[ViewOp] = []
        for i in range(5):
            ops += [HashSet("rec", f"turn{i}", b"r%d" % i), ListPush("order", (b"turn%d" % i,))]
        await store.append("t", [msg("x")], view_ops=ops)
        snap = await store.read_views("t", [HashGetListed("rec", "order", -2, -1)])
        assert list(snap.results[0]) == ["turn3", "turn4"]

    async def test_read_list_is_a_plain_window(self, store: EventStore) -> None:
        await store.append(
            "t", [msg("a"), msg("b")], view_ops=[ListPush("l", (b"a", b"b", b"c"), 1)]
        )
        assert await store.read_list("t", "l", -2, -1) == [ViewEntry(2, b"b"), ViewEntry(2, b"c")]
        assert await store.read_list("t", "l") == await store.read_list("t", "l", 0, -1)
        assert await store.read_list("t", "missing") == []
        assert await store.read_list("nobody", "l") == []
        await store.append("t", [msg("c")], view_ops=[HashSet("h", "f", b"1")])
        assert await store.read_list("t", "h") == []  # a view of the other kind reads empty
        with pytest.raises(InvalidThreadIdError):
            await store.read_list("{bad}", "l")

    async def test_a_push_replaces_a_view_of_the_other_kind(self, store: EventStore) -> None:
        # Each push comes in an append of its own, which must find out what the key holds
        # (Redis: the script asks its type once), and one push has no values at all.
        await store.append("t", [msg("a")], view_ops=[HashSet("v", "f", b"1")])
        await store.append("t", [msg("b")], view_ops=[ListPush("v", (b"x", b"y"))])
        snap = await store.read_views("t", [ListRange("v"), HashGetAll("v")])
        assert snap.results == [[ViewEntry(2, b"x"), ViewEntry(2, b"y")], {}]
        await store.append("t", [msg("c")], view_ops=[ListPush("v", (b"z",))])
        assert [e.value for e in await store.read_list("t", "v")] == [b"x", b"y", b"z"]
        await store.append("t", [msg("d")], view_ops=[HashSet("w", "f", b"1")])
        await store.append("t", [msg("e")], view_ops=[ListPush("w", ())])
        snap = await store.read_views("t", [ListRange("w"), HashGetAll("w")])
        assert snap.results == [[], {}]

    async def test_reading_thousands_of_hash_fields(self, store: EventStore) -> None:
        fields = [f"f{i}" for i in range(9000)]
        ops: list[ViewOp] = [HashSet("h", f, b"v") for f in fields[::2]]
        ops += [ListPush("names", tuple(f.encode() for f in fields))]
        await store.append("t", [msg("x")], view_ops=ops)
        snap = await store.read_views(
            "t", [HashGet("h", tuple(fields)), HashGetListed("h", "names", 0, -1)]
        )
        assert list(snap.results[0]) == fields[::2]
        assert list(snap.results[1]) == fields[::2]
        with pytest.raises(InvalidInputError):
            await store.append("t", [msg("y")], view_ops=[HashSet("h", "f", b"v", 0, -1)])

    async def test_view_reads_of_missing_thread_are_empty(self, store: EventStore) -> None:
        snap = await store.read_views("nope", [ListRange("l"), HashGetAll("h")])
        assert snap.version == 0 and snap.results == [[], {}]

    async def test_malformed_view_reads_are_refused_and_huge_indexes_mean_the_ends(
        self, store: EventStore
    ) -> None:
        await store.append(
            "t", [msg("x")], view_ops=[ListPush("l", (b"a", b"b")), HashSet("h", "f", b"v")]
        )
        bad_reads: list[Any] = [
            HashGet("h", (None,)),  # type: ignore[arg-type]
            HashGet("h", (b"f",)),  # type: ignore[arg-type]
            ListRange("l", 0.5),  # type: ignore[arg-type]
            ListRange("l", 0, "1"),  # type: ignore[arg-type]
            HashGetListed("h", "bad view!"),
            ListRange("bad view!"),
            "l",
        ]
        for read in bad_reads:
            with pytest.raises(InvalidInputError):
                await store.read_views("t", [read])
                pytest.fail(f"{read!r} was read")
        with pytest.raises(InvalidInputError):
            await store.read_list("t", "l", 0, None)  # type: ignore[arg-type]
        # An index beyond any 64-bit one means the end of the list, on every backend.
        ends = (-(2**64), 2**64)
        snap = await store.read_views("t", [ListRange("l", *ends), HashGetListed("h", "l", *ends)])
        assert [e.value for e in snap.results[0]] == [b"a", b"b"]  # type: ignore[union-attr]
        assert [e.value for e in await store.read_list("t", "l", *ends)] == [b"a", b"b"]
        assert await store.read_list("t", "l", -(2**70), -(2**70)) == []

    async def test_load_views_only_at_the_expected_version(self, store: EventStore) -> None:
        await store.append("t", [msg("a")], view_ops=[ListPush("l", (b"stale",))])
        await store.load_views(
            "t",
            [ListLoad("l", (ViewEntry(1, b"fresh"),)), HashLoad("h", {"f": ViewEntry(1, b"v", 3)})],
            expected_version=1,
        )
        snap = await store.read_views("t", [ListRange("l"), HashGetAll("h")])
        assert snap.results == [[ViewEntry(1, b"fresh")], {"f": ViewEntry(1, b"v", 3)}]
        with pytest.raises(ConcurrencyError):
            await store.load_views("t", [ListLoad("l", ())], expected_version=0)
        assert (await store.read_views("t", [ListRange("l")])).results[0] != []

    async def test_load_views_only_in_the_expected_life(self, store: EventStore) -> None:
        """A load folded in one life refuses another at the same version (ABA): the thread
        deleted and written again since, or deleted; nothing is written either way."""
        await store.append("t", [msg("a")], view_ops=[ListPush("l", (b"old",))])
        old = await store.incarnation("t")
        assert old is not None
        fresh = [ListLoad("l", (ViewEntry(1, b"fresh"),))]
        await store.delete_thread("t", views=["l"])
        with pytest.raises(IncarnationConflictError) as gone:
            await store.load_views("t", fresh, expected_version=0, expected_incarnation=old)
        assert (gone.value.expected_incarnation, gone.value.actual_incarnation) == (old, None)
        await store.append("t", [msg("b")], view_ops=[ListPush("l", (b"new",))])
        new = await store.incarnation("t")
        assert new is not None and new != old
        with pytest.raises(IncarnationConflictError) as replaced:
            await store.load_views("t", fresh, expected_version=1, expected_incarnation=old)
        assert (replaced.value.actual_incarnation, replaced.value.actual) == (new, 1)
        assert isinstance(replaced.value, ConcurrencyError)  # a rebuild's retry handles it
        got = (await store.read_views("t", [ListRange("l")])).results[0]
        assert [e.value for e in got] == [b"new"]  # type: ignore[union-attr]
        await store.load_views("t", fresh, expected_version=1, expected_incarnation=new)
        got = (await store.read_views("t", [ListRange("l")])).results[0]
        assert [e.value for e in got] == [b"fresh"]  # type: ignore[union-attr]
        for bad in (0, -1, True, "1", 1.0):
            with pytest.raises(InvalidInputError, match="expected_incarnation"):
                await store.load_views(
                    "t",
                    [ListLoad("l", ())],
                    expected_version=1,
                    expected_incarnation=bad,  # type: ignore[arg-type]
                )
        got = (await store.read_views("t", [ListRange("l")])).results[0]
        assert [e.value for e in got] == [b"fresh"]  # type: ignore[union-attr]

    async def test_view_op_referring_to_missing_event_is_rejected(self, store: EventStore) -> None:
        with pytest.raises(InvalidInputError):
            await store.append("t", [msg("a")], view_ops=[ListPush("l", (b"x",), event=1)])
        with pytest.raises(InvalidInputError):
            await store.append("t", [msg("a")], view_ops=[ListPush("bad:name", (b"x",))])
        assert await store.version("t") == 0

    async def test_hash_field_names_are_text_on_every_backend(self, store: EventStore) -> None:
        # A lone surrogate has no UTF-8 form: Redis cannot store it, so no backend takes it.
        for op in (HashSet("h", "\ud800", b"x"), HashDelete("h", "a\udfff")):
            with pytest.raises(InvalidInputError, match="lone surrogate"):
                await store.append("t", [msg("a")], view_ops=[op])
        assert await store.version("t") == 0
        await store.append("t", [msg("a")], view_ops=[HashSet("h", "naïve ✓", b"x")])
        with pytest.raises(InvalidInputError, match="lone surrogate"):
            await store.read_views("t", [HashGet("h", ("\ud800",))])
        snap = await store.read_views("t", [HashGet("h", ("naïve ✓",))])
        assert snap.results == [{"naïve ✓": ViewEntry(1, b"x", 1)}]

    async def test_idempotency_keys_are_text_on_every_backend(self, store: EventStore) -> None:
        # It was a bare UnicodeEncodeError from append, recorded_append(s) and every adapter
        # that takes a key; nothing was written, but no typed error said why.
        for bad in ("\ud800", "k\udcff"):
            with pytest.raises(InvalidInputError, match=r"idempotency_key .* not valid unicode"):
                await store.append("t", [msg("a")], idempotency_key=bad)
            with pytest.raises(InvalidInputError, match="not valid unicode"):
                await store.recorded_append("t", bad)
            with pytest.raises(InvalidInputError, match="not valid unicode"):
                await store.recorded_appends("t", ["fine", bad])
        assert await store.version("t") == 0

    # -- listing -------------------------------------------------------------------------------

    async def test_threads_listed_by_recent_activity(self, store: EventStore) -> None:
        for name in ("one", "two", "three"):
            await store.append(name, [msg(name)])
            await anyio.sleep(0.005)
        await store.append("one", [msg("again")])
        listed = await store.threads()
        assert [t.thread_id for t in listed] == ["one", "three", "two"]
        assert [t.thread_id for t in await store.threads(limit=2)] == ["one", "three"]
        older = await store.threads(before_ms=listed[0].last_activity_ms)
        assert [t.thread_id for t in older] == ["three", "two"]

    async def test_threads_of_one_partition(self, store: EventStore) -> None:
        """``partition`` lists that partition's threads alone, in the same order and with the
        same limits and cursors; a partition the store has not is refused, as by the feed."""
        from ._keys import partition_of

        names = [f"p{i}" for i in range(40)]
        for name in names:
            await store.append(name, [msg(name)])
        everything = await store.threads()
        for p in range(store.partitions):
            mine = [t for t in everything if t.partition == p]
            assert await store.threads(partition=p) == mine
            assert {t.thread_id for t in mine} == {
                n for n in names if partition_of(n, store.partitions) == p
            }
            if mine:
                assert await store.threads(partition=p, limit=1) == mine[:1]
                assert await store.threads(partition=p, after=mine[0]) == mine[1:]
        listed = [t for p in range(store.partitions) for t in await store.threads(partition=p)]
        assert len(listed) == 40
        for bad in (-1, store.partitions, True, "0", 1.0):
            with pytest.raises(InvalidInputError, match="partition"):
                await store.threads(partition=bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidInputError, match="partition"):
                await store.read_feed(bad)  # type: ignore[arg-type]

    async def test_threads_page_exactly_through_threads_sharing_a_millisecond(
        self, store: EventStore
    ) -> None:
        names = [f"t{i:02d}" for i in range(40)] + ["ä", "z", "Z", "a:b", "t1", "t100", "€"]
        for name in names:
            await store.append(name, [msg(name)])
        base = 1_700_000_000_000
        # Most threads in two milliseconds, a few on their own; every partition holds ties.
        times = {n: base + (5 if i % 3 == 0 else 0 if i % 7 else -9) for i, n in enumerate(names)}
        for name, ms in times.items():
            await self.set_last_activity(store, name, ms)
        # Newest first, ties by thread id descending (code points: the UTF-8 byte order).
        expected = sorted(names, key=lambda n: (times[n], n), reverse=True)
        listed = await store.threads()
        assert [t.thread_id for t in listed] == expected
        assert [t.last_activity_ms for t in listed] == [times[n] for n in expected]
        for k in (1, 3, 10, len(names)):
            assert [t.thread_id for t in await store.threads(limit=k)] == expected[:k]
        for size in (1, 4, 7, 100):
            seen: list[str] = []
            cursor = None
            while page := await store.threads(limit=size, after=cursor):
                assert len(page) <= size
                seen += [t.thread_id for t in page]
                cursor = page[-1]
            assert seen == expected, f"pages of {size}"
        # A cursor as a pair, and one naming no listed thread (deleted, or moved on since).
        i = expected.index("t10")
        after_pair = await store.threads(after=(times["t10"], "t10"))
        assert [t.thread_id for t in after_pair] == expected[i + 1 :]
        await store.delete_thread("t10")
        rest = await store.threads(limit=3, after=(times["t10"], "t10"))
        assert [t.thread_id for t in rest] == expected[i + 1 : i + 4]
        expected.remove("t10")
        # before_ms keeps meaning "last active before", alone and with a cursor.
        older = [n for n in expected if times[n] < base + 5]
        assert [t.thread_id for t in await store.threads(before_ms=base + 5)] == older
        assert [t.thread_id for t in await store.threads(before_ms=base + 5, after=listed[0])] == (
            older
        )
        last_tie = older.index(next(n for n in older if times[n] == base)) + 2
        cursor_info = (times[older[last_tie]], older[last_tie])
        assert [
            t.thread_id for t in await store.threads(before_ms=base + 5, after=cursor_info)
        ] == older[last_tie + 1 :]
        assert await store.threads(after=(base - 10, "zzz")) == []

    @pytest.mark.parametrize(
        "bad", [5, "t", (1, 2), (1.5, "t"), (True, "t"), (1, "bad{id}"), (1, "t", 3), [1, "t"]]
    )
    async def test_a_threads_cursor_that_is_not_one_is_refused(
        self, store: EventStore, bad: Any
    ) -> None:
        await store.append("t", [msg("a")])
        with pytest.raises(InvalidInputError):
            await store.threads(after=bad)

    async def test_stored_threads_come_from_the_keys_not_the_index(self, store: EventStore) -> None:
        odd = ["a:b", "log:x", "meta:y", "*", "100%", "ünï cödé", "view:messages:t"]
        names = ["one", "two", *odd]
        for name in names:
            await store.append(name, [msg(name)])
        if not self.may_scan:
            with pytest.raises(OperationalError, match=r"denied SCAN \(ACL\).*needs \+scan"):
                await store.stored_threads()
            assert await store.indexed("one") and not await store.indexed("never")
            return
        await store.append("gone", [msg("x")], view_ops=[ListPush("l", (b"a",))])
        await store.delete_thread("gone")  # its view is left behind: not a thread
        # A namespace whose name starts with this one's holds none of its threads.
        other = await self.make_store(store.namespace + "x")
        try:
            await other.append("elsewhere", [msg("x")])
            assert await other.stored_threads() == ["elsewhere"]
        finally:
            await other.close()
        assert await store.stored_threads() == sorted(names)
        assert all([await store.indexed(n) for n in names])
        assert not await store.indexed("gone") and not await store.indexed("never")
        await self.unindex_thread(store, "two")
        assert not await store.indexed("two")
        assert "two" not in [t.thread_id for t in await store.threads()]
        # The edited index hides nothing from the keys.
        assert await store.stored_threads() == sorted(names)
        with pytest.raises(InvalidThreadIdError):
            await store.indexed("bad{id}")

    @pytest.mark.parametrize("bad", [-1, -3, 1.5, "2", True])
    async def test_a_limit_that_is_not_a_count_is_refused(
        self, store: EventStore, bad: Any
    ) -> None:
        for name in ("one", "two", "three"):
            await store.append(name, [msg(name)])
        with pytest.raises(InvalidInputError, match="limit"):
            await store.threads(limit=bad)
        with pytest.raises(InvalidInputError, match="limit"):
            await read_all(store, "one", limit=bad)
        assert await store.threads(limit=0) == []
        assert await read_all(store, "one", limit=0) == []

    @pytest.mark.parametrize(("start", "stop"), [(-1, None), (1, -1), (-3, -1), ("1", None)])
    async def test_negative_seqs_are_refused(
        self, store: EventStore, start: Any, stop: Any
    ) -> None:
        await store.append("t", [msg("a"), msg("b")])
        reads: dict[str, Any] = {
            "read": lambda: read_all(store, "t", start=start, stop=stop),
            "read backwards": lambda: read_all(store, "t", start=start, stop=stop, backwards=True),
            "read_raw": lambda: store.read_raw("t", start=start, stop=stop),
            "read_raw_ranges": lambda: store.read_raw_ranges([RawRange("t", start, stop)]),
            "read_batches": lambda: _drain(store.read_batches("t", start=start, stop=stop)),
            "fold_payloads": lambda: store.fold_payloads(
                "t", lambda rows: None, start=start, stop=stop
            ),
        }
        for name, read in reads.items():
            with pytest.raises(InvalidInputError, match=r"start|stop"):
                await read()
                pytest.fail(f"{name} took start={start!r} stop={stop!r}")
        # 0 is no event, not "from the end": from the first, and up to nothing.
        assert [e.seq for e in await read_all(store, "t", start=0)] == [1, 2]
        assert await read_all(store, "t", stop=0) == []
        assert await store.read_raw("t", stop=0) == []

    @pytest.mark.parametrize("bad", ["5", 1.5, None, True])
    async def test_times_that_are_not_ints_are_refused(self, store: EventStore, bad: Any) -> None:
        await store.append("t", [msg("a")])
        with pytest.raises(InvalidInputError, match="time_ms"):
            await store.seq_at("t", bad)
        if bad is not None:
            with pytest.raises(InvalidInputError, match="before_ms"):
                await store.threads(before_ms=bad)
        with pytest.raises(InvalidInputError, match="start"):
            await store.read_list("t", "l", start=bad)

    @pytest.mark.parametrize("bad", ["2026-01-01", 1.5e12, True, b"1"])
    async def test_read_between_refuses_times_that_are_neither_datetimes_nor_ms(
        self, store: EventStore, bad: Any
    ) -> None:
        await store.append("t", [msg("a")])
        with pytest.raises(InvalidInputError, match="since"):
            await _read_between(store, "t", since=bad)
        with pytest.raises(InvalidInputError, match="until"):
            await _read_between(store, "t", until=bad)

    async def test_read_between_reads_a_naive_datetime_as_local_time(
        self, store: EventStore
    ) -> None:
        await store.append("t", [msg("a")])
        (event,) = await read_all(store, "t")
        # The event's time as a local wall-clock reading without a zone: as datetime.timestamp
        # and the command line's --since read it (documented on read_between).
        naive = event.time.astimezone().replace(tzinfo=None)
        assert [e.seq for e in await _read_between(store, "t", since=naive, until=naive)] == [1]

    async def test_seq_at_reports_an_entry_whose_time_is_not_a_number(
        self, store: EventStore
    ) -> None:
        if not self.supports_raw_writes:
            pytest.skip("backend cannot write raw entries")
        await store.append("good", [msg("a")])
        good = (await store.read_raw("good"))[0][1]
        for i, bad in enumerate([b"soon", b"1e3", b"", None]):
            thread = f"t{i}"
            await store.append(thread, [msg("a")])
            fields = {k: v for k, v in good.items() if k != b"s" or bad is not None}
            if bad is not None:
                fields[b"s"] = bad
            await self.write_raw_entry(store, thread, "2-0", fields)
            await self.set_version(store, thread, 2)
            # As read reports it: the thread and the seq, never a silent 0 or 1.
            with pytest.raises(CorruptEventError, match="field 's'") as info:
                await store.seq_at(thread, 2**50)
            assert (info.value.thread_id, info.value.seq) == (thread, 2), bad
            with pytest.raises(CorruptEventError) as info:
                await read_all(store, thread)
            assert info.value.seq == 2
            assert await store.seq_at(thread, 0) == 0  # the search never reached it

    async def test_an_entry_whose_time_is_out_of_range_is_damage(self, store: EventStore) -> None:
        """A time no server clock writes (beyond 64 bits, past year 9999, negative) crashed
        what shows or exports it (a date, a Parquet int64): every read path raises
        `CorruptEventError` naming thread and seq instead."""
        if not self.supports_raw_writes:
            pytest.skip("backend cannot write raw entries")
        await store.append("good", [msg("a")])
        good = (await store.read_raw("good"))[0][1]
        for i, bad in enumerate([b"99999999999999999999999", b"253402300800000", b"-5"]):
            thread = f"time{i}"
            await store.append(thread, [msg("a")])
            await self.write_raw_entry(store, thread, "2-0", {**good, b"s": bad})
            await self.set_version(store, thread, 2)
            with pytest.raises(CorruptEventError, match="out of range") as info:
                await read_all(store, thread)
            assert (info.value.thread_id, info.value.seq) == (thread, 2), bad
            with pytest.raises(CorruptEventError, match="out of range"):
                async for _ in store.read_batches(thread):
                    pass
            with pytest.raises(CorruptEventError, match="out of range"):
                await store.fold_payloads(thread, lambda rows: None)

    async def test_seq_at_reports_a_missing_entry_it_meets(self, store: EventStore) -> None:
        """The search looked at the first entry at or after each seq it tried: a missing one
        was stepped over (answered from the entry after it), or the search went on below it
        as though the thread ended there. An entry the thread's version holds but the log
        does not is damage, reported as such, with its seq."""
        if not self.supports_raw_writes:
            pytest.skip("backend cannot write raw entries")
        await store.append("good", [msg("a")])
        good = (await store.read_raw("good"))[0][1]
        await store.append("hole", [msg("a")])  # seqs 1 and 3 of 3
        await self.write_raw_entry(store, "hole", "3-0", dict(good))
        await self.set_version(store, "hole", 3)
        await store.append("short", [msg("a"), msg("b")])  # seqs 1 and 2 of 3
        await self.set_version(store, "short", 3)
        for thread, when, seq in [("hole", 2**50, 2), ("hole", 0, 2), ("short", 2**50, 3)]:
            with pytest.raises(CorruptEventError, match="missing from the log") as info:
                await store.seq_at(thread, when)
            assert (info.value.thread_id, info.value.seq) == (thread, seq), (thread, when)
        with pytest.raises(CorruptEventError, match="missing from the log"):
            await _read_between(store, "hole", since=0)
        assert await store.seq_at("short", 0) == 0  # the search never reached seq 3

    async def test_an_append_to_a_log_without_its_meta_hash_is_refused(
        self, store: EventStore
    ) -> None:
        """With the meta hash gone the version reads 0: Redis refused the append with a raw
        "ID specified in XADD is equal or smaller" error, and the memory backend wrote a
        second seq 1. It is damage, said as such, and nothing is written."""
        if not self.supports_raw_writes:
            pytest.skip("backend cannot write raw entries")
        await store.append("t", [msg("a"), msg("b")])
        await self.delete_meta(store, "t")
        for expected in (ANY, NO_THREAD, 0):
            with pytest.raises(CorruptEventError, match="meta hash") as info:
                await store.append("t", [msg("c")], expected_version=expected)
            assert (info.value.thread_id, info.value.seq) == ("t", None)
        assert message_texts(await read_all(store, "t")) == ["a", "b"]
        assert (await store.append("fresh", [msg("x")])).first_seq == 1  # new threads: as ever

    async def test_seq_at_reports_a_log_without_its_meta_hash(self, store: EventStore) -> None:
        """With the meta hash gone the search had no version to search below and answered 0
        ("no event that old") for a log full of events: `read_between` then read nothing. A
        log without a version is damage; a thread that never was, or was deleted, is 0."""
        if not self.supports_raw_writes:
            pytest.skip("backend cannot write raw entries")
        await store.append("t", [msg("a"), msg("b")])
        first, last = await read_all(store, "t")
        await self.delete_meta(store, "t")
        assert [e.seq for e in await read_all(store, "t")] == [1, 2]  # the log is still there
        for when in (0, first.time_ms, last.time_ms + 1):
            with pytest.raises(CorruptEventError, match="meta hash") as info:
                await store.seq_at("t", when)
            assert (info.value.thread_id, info.value.seq) == ("t", None)
        with pytest.raises(CorruptEventError, match="meta hash"):
            await _read_between(store, "t", since=first.time_ms)
        assert await store.seq_at("never", 2**50) == 0
        await store.append("gone", [msg("a")])
        await store.delete_thread("gone")
        assert await store.seq_at("gone", 2**50) == 0

    async def test_incarnation_names_the_threads_life(self, store: EventStore) -> None:
        """The life a thread is in: the `FeedEntry.incarnation` of its changes, the same
        across appends, another once it is deleted and written again, None without a thread.
        A reader of several steps that sees the same life before and after read one life."""
        assert await store.incarnation("t") is None
        await store.append("t", [msg("a")])
        life = await store.incarnation("t")
        assert isinstance(life, int)
        await store.append("t", [msg("b")])
        assert await store.incarnation("t") == life
        from ._keys import partition_of

        partition = partition_of("t", store.partitions)
        changes = [e for e in await store.read_feed(partition) if e.thread_id == "t"]
        assert {e.incarnation for e in changes} == {life}
        await store.delete_thread("t")
        assert await store.incarnation("t") is None
        await store.append("t", [msg("c")])
        again = await store.incarnation("t")
        assert again is not None and again != life

    async def test_a_meta_snapshot_answers_as_the_reads_of_the_same_names(
        self, store: EventStore
    ) -> None:
        """`meta_snapshot`: one read of what an audit reads before and after a log (one
        round trip on Redis), each answer what the read of the same name gives."""

        async def assert_as_the_reads(thread_id: str) -> None:
            snapshot = await store.meta_snapshot(thread_id)
            assert snapshot.thread_id == thread_id
            assert snapshot.incarnation() == await store.incarnation(thread_id)
            assert snapshot.version() == await store.version(thread_id)
            fingerprint = await store.chain_key_fingerprint(thread_id)
            assert snapshot.chain_key_fingerprint() == fingerprint
            assert snapshot.chain_head() == await store.chain_head(thread_id)
            assert snapshot.indexed() == await store.indexed(thread_id)

        await assert_as_the_reads("t")  # no such thread
        await store.append("t", [msg("a"), msg("b")])
        await assert_as_the_reads("t")
        head = (await store.meta_snapshot("t")).chain_head()
        assert head is not None and head.version == 2 and head.head
        assert (await store.meta_snapshot("t")).indexed()
        await store.delete_thread("t")
        await assert_as_the_reads("t")
        await store.append("t", [msg("c")])
        await assert_as_the_reads("t")
        with pytest.raises(InvalidInputError):
            await store.meta_snapshot("bad id {x}")

    async def test_an_append_in_the_life_it_expects_lands_and_returns_the_life(
        self, store: EventStore
    ) -> None:
        first = await store.append("t", [msg("a")], expected_version=NO_THREAD)
        life = await store.incarnation("t")
        assert first.incarnation == life and life is not None
        landed = await store.append("t", [msg("b")], expected_version=1, expected_incarnation=life)
        assert (landed.first_seq, landed.incarnation) == (2, life)
        several = await store.append(
            "t", [msg("c"), msg("d")], expected_incarnation=life, view_ops=[ListPush("l", (b"c",))]
        )
        assert (several.last_seq, several.incarnation) == (4, life)
        assert message_texts(await read_all(store, "t")) == ["a", "b", "c", "d"]

    async def test_an_append_to_a_life_that_is_gone_writes_nothing(self, store: EventStore) -> None:
        """The ABA of a recreated thread: versions and view field versions restart at 1, so an
        expected version (and guarded view ops) read in the old life can match the new one.
        Only the life tells them apart: refused, nothing written, the thread as it was."""
        from ._keys import partition_of

        await store.append("t", [msg("a")], view_ops=[HashSet("s", "f", b"old")])
        old = await store.incarnation("t")
        assert old is not None
        await store.delete_thread("t", views=["s"])
        stale: dict[str, Any] = {"expected_version": 1, "expected_incarnation": old}
        with pytest.raises(IncarnationConflictError) as gone:
            await store.append("t", [msg("stale")], **stale)
        assert isinstance(gone.value, ConcurrencyError)
        assert (gone.value.expected_incarnation, gone.value.actual_incarnation) == (old, None)
        assert (gone.value.actual, await store.version("t")) == (0, 0)
        # Written again by another writer up to the version the stale one read.
        await store.append("t", [msg("new")], view_ops=[HashSet("s", "f", b"new")])
        new = await store.incarnation("t")
        p = partition_of("t", store.partitions)
        feed_before = await store.read_feed(p)
        with pytest.raises(IncarnationConflictError) as replaced:
            await store.append(
                "t",
                [msg("stale")],
                idempotency_key="stale",
                view_ops=[HashSet("s", "f", b"stale", 0, 1)],  # its guard passes by coincidence
                **stale,
            )
        assert (replaced.value.actual_incarnation, replaced.value.actual) == (new, 1)
        assert replaced.value.expected == 1
        assert message_texts(await read_all(store, "t")) == ["new"]
        snap = await store.read_views("t", [HashGetAll("s")])
        assert snap.results[0] == {"f": ViewEntry(1, b"new", 1)}
        assert await store.read_feed(p) == feed_before
        assert await store.recorded_append("t", "stale") is None
        # In the life it names, the same append lands.
        ok = await store.append("t", [msg("fresh")], expected_version=1, expected_incarnation=new)
        assert (ok.first_seq, ok.incarnation) == (2, new)

    async def test_a_retry_of_an_append_that_landed_returns_it_whatever_the_life(
        self, store: EventStore
    ) -> None:
        """As for the expected version: the ledger answers first, so a retry of an append
        that landed (its reply lost) gets its result, with the life the thread is in."""
        await store.append("t", [msg("a")])
        life = await store.incarnation("t")
        assert life is not None
        events = [msg("b")]
        first = await store.append(
            "t", events, expected_version=1, expected_incarnation=life, idempotency_key="k"
        )
        again = await store.append(
            "t", events, expected_version=1, expected_incarnation=life + 1, idempotency_key="k"
        )
        assert again == first and again.duplicate and again.incarnation == life
        recorded = await store.recorded_append("t", "k")
        assert recorded == first and recorded is not None and recorded.incarnation == life
        assert await store.version("t") == 2

    @pytest.mark.parametrize("bad", [0, -1, True, False, "1", 1.0])
    async def test_malformed_expected_incarnation_is_rejected(
        self, store: EventStore, bad: Any
    ) -> None:
        with pytest.raises(InvalidInputError):
            await store.append("t", [msg("x")], expected_incarnation=bad)
        assert await store.version("t") == 0

    # -- deletion -------------------------------------------------------------------------------

    async def test_delete_thread(self, store: EventStore) -> None:
        await store.append(
            "t", [msg("a"), msg("b")], view_ops=[ListPush("l", (b"a",)), HashSet("h", "f", b"1")]
        )
        await store.append("other", [msg("x")])
        assert await store.delete_thread("t", views=["l", "h"]) == 2
        assert await store.version("t") == 0
        assert await read_all(store, "t") == []
        snap = await store.read_views("t", [ListRange("l"), HashGetAll("h")])
        assert snap.results == [[], {}]
        assert [t.thread_id for t in await store.threads()] == ["other"]
        assert await store.delete_thread("t") == 0
        assert await store.delete_thread("never") == 0
        again = await store.append("t", [msg("new life")], expected_version=NO_THREAD)
        assert (again.first_seq, again.duplicate) == (1, False)
        assert message_texts(await read_all(store, "other")) == ["x"]

    async def test_a_deletion_takes_every_view_named_or_not(self, store: EventStore) -> None:
        """A deletion that names no view (or some of them) removes them all: a view left
        behind was read as the next life's when the id was written again (a new thread's
        history window opening with the deleted conversation), and no audit found it. The
        views a rebuild loads count too, and a store that never wrote them deletes them."""
        await store.append(
            "t", [msg("a"), msg("b")], view_ops=[ListPush("l", (b"a",)), HashSet("h", "f", b"1")]
        )
        await store.load_views("t", [ListLoad("loaded", (ViewEntry(1, b"x"),))], expected_version=2)
        reads: list[ViewRead] = [ListRange("l"), HashGetAll("h"), ListRange("loaded")]
        assert (await store.read_views("t", reads)).results == [
            [ViewEntry(1, b"a")],
            {"f": ViewEntry(1, b"1", 1)},
            [ViewEntry(1, b"x")],
        ]
        assert await store.delete_thread("t", views=["h"]) == 2
        assert (await store.read_views("t", reads)).results == [[], {}, []]
        await store.append("t", [msg("new life")], view_ops=[ListPush("l", (b"new",))])
        assert (await store.read_views("t", reads)).results == [[ViewEntry(1, b"new")], {}, []]
        other = await self.make_store(store.namespace)  # as in another process
        try:
            assert await other.delete_thread("t") == 1
        finally:
            await other.close()
        assert (await store.read_views("t", reads)).results == [[], {}, []]

    async def test_delete_thread_at_an_expected_version(self, store: EventStore) -> None:
        """A deletion decided on a version (a session found idle) keeps a thread written
        since: ConcurrencyError, and nothing deleted, not even a tombstone on the feed."""
        from ._keys import partition_of

        await store.append("t", [msg("a"), msg("b")], view_ops=[ListPush("l", (b"a",))])
        p = partition_of("t", store.partitions)
        feed_before = await store.read_feed(p)
        with pytest.raises(ConcurrencyError) as caught:
            await store.delete_thread("t", views=["l"], expected_version=1)
        assert (caught.value.expected, caught.value.actual) == (1, 2)
        assert message_texts(await read_all(store, "t")) == ["a", "b"]
        assert (await store.read_views("t", [ListRange("l")])).results != [[]]
        assert await store.read_feed(p) == feed_before
        assert [t.thread_id for t in await store.threads()] == ["t"]
        for bad in (-1, "2", True, 1.0):
            with pytest.raises(InvalidInputError):
                await store.delete_thread("t", expected_version=bad)  # type: ignore[arg-type]
        assert await store.delete_thread("t", views=["l"], expected_version=2) == 2
        assert await store.version("t") == 0
        assert await store.delete_thread("t", expected_version=0) == 0  # no thread: at 0
        with pytest.raises(ConcurrencyError):
            await store.delete_thread("never", expected_version=3)

    async def test_delete_thread_in_an_expected_life(self, store: EventStore) -> None:
        """A deletion decided on one life keeps another at the same version (the thread was
        deleted and written again since): nothing deleted, not even a tombstone."""
        from ._keys import partition_of

        await store.append("t", [msg("a")])
        old = await store.incarnation("t")
        assert old is not None
        await store.delete_thread("t")
        await store.append("t", [msg("b")], view_ops=[ListPush("l", (b"b",))])
        new = await store.incarnation("t")
        p = partition_of("t", store.partitions)
        feed_before = await store.read_feed(p)
        for version in (1, None):
            with pytest.raises(IncarnationConflictError) as caught:
                await store.delete_thread(
                    "t", views=["l"], expected_version=version, expected_incarnation=old
                )
            assert caught.value.actual_incarnation == new and caught.value.actual == 1
        assert message_texts(await read_all(store, "t")) == ["b"]
        assert (await store.read_views("t", [ListRange("l")])).results != [[]]
        assert await store.read_feed(p) == feed_before
        for bad in (0, -1, "2", True, 1.0):
            with pytest.raises(InvalidInputError, match="expected_incarnation"):
                await store.delete_thread("t", expected_incarnation=bad)  # type: ignore[arg-type]
        assert await store.version("t") == 1
        assert await store.delete_thread("t", views=["l"], expected_incarnation=new) == 1
        with pytest.raises(IncarnationConflictError) as gone:
            await store.delete_thread("t", expected_incarnation=new)
        assert gone.value.actual_incarnation is None

    # -- the change feed ------------------------------------------------------------------------

    async def _partition_with_two_threads(self, store: EventStore) -> tuple[int, str, str]:
        from ._keys import partition_of

        names = [f"th{i}" for i in range(200)]
        by_partition: dict[int, list[str]] = {}
        for n in names:
            by_partition.setdefault(partition_of(n, store.partitions), []).append(n)
        p, pair = next((p, ts) for p, ts in by_partition.items() if len(ts) >= 2)
        return p, pair[0], pair[1]

    async def test_feed_records_every_append_and_deletion(self, store: EventStore) -> None:
        p, a, b = await self._partition_with_two_threads(store)
        await store.append(a, [msg("1"), msg("2")])
        await store.append(b, [msg("3")])
        await store.append(a, [msg("4")])
        await store.delete_thread(b)
        entries = await store.read_feed(p)
        assert [(e.thread_id, e.first_seq, e.last_seq, e.deleted) for e in entries] == [
            (a, 1, 2, False),
            (b, 1, 1, False),
            (a, 3, 3, False),
            (b, 0, 1, True),
        ]
        assert all(e.partition == p for e in entries)
        later = await store.read_feed(p, after=entries[1].id, count=1)
        assert [e.id for e in later] == [entries[2].id]
        assert entries[0].time_ms > 1_600_000_000_000
        with pytest.raises(InvalidInputError):
            await store.read_feed(store.partitions)

    async def test_feed_entries_tell_a_recreated_thread_from_the_deleted_one(
        self, store: EventStore
    ) -> None:
        p, a, _ = await self._partition_with_two_threads(store)
        await store.append(a, [msg("old 1"), msg("old 2")])
        await store.append(a, [msg("old 3")])
        await store.delete_thread(a)
        await store.append(a, [msg("new 1")])
        first, second, tombstone, reborn = await store.read_feed(p)
        assert first.incarnation is not None and first.incarnation > 0
        assert second.incarnation == tombstone.incarnation == first.incarnation
        assert tombstone.deleted
        assert reborn.incarnation is not None and reborn.incarnation != first.incarnation
        # The old life's seqs now name the new life's events: the checked read refuses them.
        assert await store.read_raw(a, start=1, stop=2, incarnation=first.incarnation) == []
        fresh = await store.read_raw(a, start=1, stop=1, incarnation=reborn.incarnation)
        assert [entry_id for entry_id, _ in fresh] == [b"1-0"]
        assert await store.read_raw(a, start=1, incarnation=reborn.incarnation + 1) == []
        await store.delete_thread(a)
        assert await store.read_raw(a, start=1, incarnation=reborn.incarnation) == []

    async def test_read_raw_ranges_is_read_raw_in_bulk(self, store: EventStore) -> None:
        await store.append("a", [msg(f"a{i}") for i in range(5)])
        await store.append("b", [msg(f"b{i}") for i in range(3)])
        ranges = [
            RawRange("a", 1, 2),
            RawRange("b", 1, 3),
            RawRange("a", 3, 5),
            RawRange("a", 6, 9),  # past the end: empty
            RawRange("nobody", 1, 5),  # no such thread: empty
            RawRange("b", 2, 2),
            RawRange("a", 4),  # to the end
            RawRange("a", 0, 1),  # seqs start at 1
        ]
        found = await store.read_raw_ranges(ranges)
        assert [[(i, _fields(f)) for i, f in rows] for rows in found] == [
            await store.read_raw(r.thread_id, start=r.start, stop=r.stop) for r in ranges
        ]
        assert [[i for i, _ in rows] for rows in found] == [
            [b"1-0", b"2-0"], [b"1-0", b"2-0", b"3-0"], [b"3-0", b"4-0", b"5-0"], [], [],
            [b"2-0"], [b"4-0", b"5-0"], [b"1-0"],
        ]  # fmt: skip
        # At most ``count`` entries a range; many ranges in one call keep their order.
        assert [len(rows) for rows in await store.read_raw_ranges(ranges[:3], count=2)] == [2, 2, 2]
        many = [RawRange(t, s, s) for s in range(1, 4) for t in ("a", "b")] * 50
        rows = await store.read_raw_ranges(many)
        assert [(r.thread_id, x[0][0]) for r, x in zip(many, rows, strict=True)] == [
            (r.thread_id, b"%d-0" % r.start) for r in many
        ]
        assert await store.read_raw_ranges([]) == []

    async def test_read_raw_ranges_only_in_the_incarnation_asked(self, store: EventStore) -> None:
        p, a, b = await self._partition_with_two_threads(store)
        await store.append(a, [msg("old 1"), msg("old 2")])
        await store.append(b, [msg("b 1")])
        await store.delete_thread(a)
        await store.append(a, [msg("new 1")])
        first, other, _, reborn = await store.read_feed(p)
        assert first.incarnation is not None and reborn.incarnation is not None
        found = await store.read_raw_ranges(
            [
                RawRange(a, 1, 2, first.incarnation),  # deleted since: nothing
                RawRange(a, 1, 2, reborn.incarnation),
                RawRange(b, 1, 1, other.incarnation),
                RawRange(a, 1, 2),  # unchecked: whatever is there now
                RawRange(a, 1, 1, reborn.incarnation + 1),
            ]
        )
        assert [[i for i, _ in rows] for rows in found] == [[], [b"1-0"], [b"1-0"], [b"1-0"], []]
        await store.delete_thread(a)
        assert await store.read_raw_ranges([RawRange(a, 1, 1, reborn.incarnation)]) == [[]]

    async def test_read_raw_ranges_give_damaged_entries_as_stored(self, store: EventStore) -> None:
        if not self.supports_raw_writes:
            pytest.skip("backend cannot write raw entries")
        await store.append("t", [msg("a"), msg("b")])
        good = (await store.read_raw("t", start=1, stop=1))[0][1]
        await self.write_raw_entry(store, "t", "3-0", {**good, b"d": b"\xc1not msgpack"})
        await self.write_raw_entry(store, "t", "4-0", {b"x": b"y"})
        await self.write_raw_entry(store, "t", "4-5", good)
        ((whole,),) = [await store.read_raw_ranges([RawRange("t", 1)])]
        assert [(i, _fields(f)) for i, f in whole] == await store.read_raw("t")
        assert [i for i, _ in whole] == [b"1-0", b"2-0", b"3-0", b"4-0", b"4-5"]
        # Decoding them fails as reading them does: naming the thread and the damaged seq.
        with pytest.raises(CorruptEventError) as info:
            decode_rows("t", whole, store.registry)
        assert (info.value.thread_id, info.value.seq) == ("t", 3)
        with pytest.raises(CorruptEventError) as info:
            decode_rows("t", whole[3:4], store.registry)
        assert (info.value.thread_id, info.value.seq) == ("t", 4)

    async def test_feed_consumer_groups(self, store: EventStore) -> None:
        p, a, _ = await self._partition_with_two_threads(store)
        assert await store.create_feed_group(p, "g") is True
        assert await store.create_feed_group(p, "g") is False
        for i in range(5):
            await store.append(a, [msg(str(i))])
        first = await store.read_feed_group(p, "g", "c1", count=3)
        assert [e.last_seq for e in first] == [1, 2, 3]
        again = await store.read_feed_group(p, "g", "c1", pending=True)
        assert [e.id for e in again] == [e.id for e in first]
        rest = await store.read_feed_group(p, "g", "c2", count=10)
        assert [e.last_seq for e in rest] == [4, 5]
        assert await store.read_feed_group(p, "g", "c2", count=10) == []
        assert await store.ack_feed(p, "g", [first[0].id]) == 1
        assert await store.ack_feed(p, "g", [first[0].id]) == 0
        (info,) = await store.feed_groups(p)
        assert (info.name, info.pending, info.oldest_pending) == ("g", 4, first[1].id)
        assert info.last_delivered == rest[-1].id
        # A crashed consumer's entries are taken over once idle.
        assert await store.claim_feed(p, "g", "c3", min_idle_ms=60_000) == []
        await anyio.sleep(0.03)
        claimed = await store.claim_feed(p, "g", "c3", min_idle_ms=20, count=2)
        assert [e.last_seq for e in claimed] == [2, 3]
        mine = await store.read_feed_group(p, "g", "c3", pending=True)
        assert [e.last_seq for e in mine] == [2, 3]
        # Trimming stops at the oldest entry a group still needs.
        assert await store.trim_feed(p) == 1
        assert [e.last_seq for e in await store.read_feed(p)] == [2, 3, 4, 5]
        await store.ack_feed(p, "g", [e.id for e in claimed + rest])
        assert await store.trim_feed(p) == 4
        assert await store.read_feed(p) == []

    async def test_feed_group_advanced_by_a_self_tracking_reader(self, store: EventStore) -> None:
        p, a, _ = await self._partition_with_two_threads(store)
        await store.create_feed_group(p, "export")
        for i in range(4):
            await store.append(a, [msg(str(i))])
        entries = await store.read_feed(p)
        assert await store.trim_feed(p) == 0
        await store.advance_feed_group(p, "export", entries[1].id)
        assert await store.trim_feed(p) == 2
        await store.read_feed_group(p, "export", "c")  # delivers the last two
        await store.advance_feed_group(p, "export", entries[3].id)
        (info,) = await store.feed_groups(p)
        assert (info.pending, info.last_delivered) == (0, entries[3].id)
        assert await store.trim_feed(p) == 2

    async def test_feed_trim_by_age_and_without_groups(self, store: EventStore) -> None:
        p, a, _ = await self._partition_with_two_threads(store)
        await store.append(a, [msg("old")])
        assert await store.trim_feed(p) == 0  # nobody acknowledged anything: keep all
        await anyio.sleep(0.05)
        await store.append(a, [msg("new")])
        assert await store.trim_feed(p, max_age_ms=30) == 1
        assert [e.last_seq for e in await store.read_feed(p)] == [2]

    async def test_pending_entries_trimmed_before_their_ack_are_said_and_hold_nothing_back(
        self, store: EventStore
    ) -> None:
        """A consumer crashed with entries delivered and not acknowledged; an age limit
        trimmed them. Reading them again as pending raises `FeedTrimmedError` naming them
        (each time, until acknowledged), a claim raises it once (the group drops them), and
        the group no longer holds trimming back."""
        p, a, _ = await self._partition_with_two_threads(store)
        for i in range(3):
            await store.append(a, [msg(str(i))])
        await store.create_feed_group(p, "g", start="0-0")
        await store.create_feed_group(p, "h", start="0-0")
        lost = [e.id for e in await store.read_feed_group(p, "g", "c1", count=3)]
        h_lost = [e.id for e in await store.read_feed_group(p, "h", "c1", count=2)]
        await anyio.sleep(0.03)
        assert await store.trim_feed(p, max_age_ms=10) == 3
        for _ in range(2):
            with pytest.raises(FeedTrimmedError) as info:
                await store.read_feed_group(p, "g", "c1", pending=True)
            assert info.value.lost == tuple(lost) and info.value.partition == p
            assert "acknowledge them" in str(info.value)
        # Trimming goes on past them: new entries read and acknowledged by both groups go.
        for i in range(2):
            await store.append(a, [msg(f"new {i}")])
        for group in ("g", "h"):
            fresh = await store.read_feed_group(p, group, "c2", count=10)
            assert [e.last_seq for e in fresh] == [4, 5]  # "h" never got 3: trimmed unread
            await store.ack_feed(p, group, [e.id for e in fresh])
        assert await store.trim_feed(p) == 2
        assert await store.ack_feed(p, "g", lost) == 3  # accepted as gone: pending no more
        assert await store.read_feed_group(p, "g", "c1", pending=True) == []
        assert await store.ack_feed(p, "h", h_lost) == 2
        # A claim of trimmed entries says so once, and drops them from the group.
        assert await store.trim_feed(p, max_age_ms=0) == 0  # nothing held
        await store.append(a, [msg("claimed")])
        (entry,) = await store.read_feed_group(p, "h", "c3")
        await anyio.sleep(0.03)
        assert await store.trim_feed(p, max_age_ms=10) == 1
        with pytest.raises(FeedTrimmedError) as info:
            await store.claim_feed(p, "h", "c4", min_idle_ms=0)
        assert info.value.lost == (entry.id,)
        assert await store.claim_feed(p, "h", "c4", min_idle_ms=0) == []
        (h,) = [g for g in await store.feed_groups(p) if g.name == "h"]
        assert h.pending == 0

    async def test_an_age_reaching_back_before_the_epoch_trims_nothing(
        self, store: EventStore
    ) -> None:
        p, a, _ = await self._partition_with_two_threads(store)
        await store.append(a, [msg("x")])
        for age in (int(time.time() * 1000) + 1, 30_000 * 86_400_000, 10**30):
            assert await store.trim_feed(p, max_age_ms=age) == 0
        # A group that has read nothing keeps everything: the same point, 0-0, from the group.
        await store.create_feed_group(p, "g", start="0-0")
        assert await store.trim_feed(p, max_age_ms=10**30) == 0
        assert len(await store.read_feed(p)) == 1
        assert (await store.feed_info(p)).trimmed_to == "0-0"

    async def test_feed_info_says_how_far_the_feed_was_trimmed(self, store: EventStore) -> None:
        p, a, _ = await self._partition_with_two_threads(store)
        empty = await store.feed_info(p)
        assert (empty.partition, empty.length, empty.first_id) == (p, 0, None)
        assert (empty.last_id, empty.trimmed_to) == ("0-0", "0-0")
        for i in range(3):
            await store.append(a, [msg(str(i))])
        ids = [e.id for e in await store.read_feed(p)]
        whole = await store.feed_info(p)
        assert (whole.length, whole.first_id, whole.last_id) == (3, ids[0], ids[2])
        assert whole.trimmed_to == "0-0"
        await store.create_feed_group(p, "g")
        await store.advance_feed_group(p, "g", ids[1])
        assert await store.trim_feed(p) == 2
        cut = await store.feed_info(p)
        assert (cut.length, cut.first_id, cut.last_id, cut.trimmed_to) == (
            1,
            ids[2],
            ids[2],
            ids[1],
        )
        with pytest.raises(InvalidInputError, match="partition"):
            await store.feed_info(store.partitions)

    async def test_a_deleted_feed_group_no_longer_holds_trimming_back(
        self, store: EventStore
    ) -> None:
        p, a, _ = await self._partition_with_two_threads(store)
        assert await store.delete_feed_group(p, "g") is False  # no feed yet
        await store.append(a, [msg("x")])
        await store.create_feed_group(p, "g")
        await store.create_feed_group(p, "other")
        assert await store.delete_feed_group(p, "nobody") is False
        await store.advance_feed_group(p, "other", (await store.read_feed(p))[0].id)
        assert await store.trim_feed(p) == 0  # "g" has read nothing
        assert await store.delete_feed_group(p, "g") is True
        assert [g.name for g in await store.feed_groups(p)] == ["other"]
        assert await store.trim_feed(p) == 1
        with pytest.raises(FeedGroupNotFoundError):
            await store.read_feed_group(p, "g", "c")
        with pytest.raises(InvalidInputError, match="group name"):
            await store.delete_feed_group(p, "")

    async def test_feed_blocking_read_waits_for_new_entries(self, store: EventStore) -> None:
        p, a, _ = await self._partition_with_two_threads(store)
        await store.create_feed_group(p, "g", start="0-0")

        async def later() -> None:
            await anyio.sleep(0.05)
            await store.append(a, [msg("x")])

        async with anyio.create_task_group() as tg:
            tg.start_soon(later)
            got = await store.read_feed_group(p, "g", "c", block_ms=2000)
        assert [e.thread_id for e in got] == [a]

    @pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, None])
    async def test_feed_and_raw_counts_below_one_are_refused(
        self, store: EventStore, bad: Any
    ) -> None:
        p, a, _ = await self._partition_with_two_threads(store)
        await store.append(a, [msg("x")])
        await store.create_feed_group(p, "g")
        reads: dict[str, Any] = {
            "read_feed": lambda: store.read_feed(p, count=bad),
            "read_feed_group": lambda: store.read_feed_group(p, "g", "c", count=bad),
            "pending": lambda: store.read_feed_group(p, "g", "c", count=bad, pending=True),
            "claim_feed": lambda: store.claim_feed(p, "g", "c", min_idle_ms=0, count=bad),
            "read_raw": lambda: store.read_raw(a, count=bad),
            "read_raw_ranges": lambda: store.read_raw_ranges([RawRange(a)], count=bad),
            "no ranges": lambda: store.read_raw_ranges([], count=bad),
        }
        for name, read in reads.items():
            with pytest.raises(InvalidInputError, match="count"):
                await read()
                pytest.fail(f"{name} took count={bad!r}")
        (info,) = await store.feed_groups(p)
        assert (info.pending, info.last_delivered) == (0, "0-0")  # nothing was delivered

    @pytest.mark.parametrize("bad", [0, -1, 1.5, "10", True])
    async def test_feed_waits_are_positive_or_none(self, store: EventStore, bad: Any) -> None:
        p, _, _ = await self._partition_with_two_threads(store)
        await store.create_feed_group(p, "g")
        # Redis's BLOCK 0 waits forever: refused at once, never sent.
        with anyio.fail_after(5):
            with pytest.raises(InvalidInputError, match="block_ms must be > 0") as info:
                await store.read_feed_group(p, "g", "c", block_ms=bad)
        assert "None (do not wait)" in str(info.value)
        assert await store.read_feed_group(p, "g", "c", block_ms=None) == []
        assert await store.read_feed_group(p, "g", "c", block_ms=1) == []

    @pytest.mark.parametrize("bad", ["", b"c", None, 7, "a\nb", "x" * 257])
    async def test_consumer_names_are_checked_before_anything_is_delivered(
        self, store: EventStore, bad: Any
    ) -> None:
        p, a, _ = await self._partition_with_two_threads(store)
        await store.create_feed_group(p, "g")
        await store.append(a, [msg("x")])
        with pytest.raises(InvalidInputError, match="consumer name"):
            await store.read_feed_group(p, "g", bad)
        with pytest.raises(InvalidInputError, match="consumer name"):
            await store.claim_feed(p, "g", bad, min_idle_ms=0)
        (info,) = await store.feed_groups(p)
        assert (info.pending, info.last_delivered) == (0, "0-0")  # nothing was delivered
        # A name as operators write them (host and pid) is taken.
        assert [e.thread_id for e in await store.read_feed_group(p, "g", "host-1:4242")] == [a]

    @pytest.mark.parametrize("bad", [-1, 1.5, "0", True, None])
    async def test_claim_idle_time_is_an_int_of_zero_or_more(
        self, store: EventStore, bad: Any
    ) -> None:
        p, a, _ = await self._partition_with_two_threads(store)
        await store.create_feed_group(p, "g")
        await store.append(a, [msg("x")])
        assert len(await store.read_feed_group(p, "g", "c1")) == 1
        with pytest.raises(InvalidInputError, match="min_idle_ms"):
            await store.claim_feed(p, "g", "c2", min_idle_ms=bad)
        assert [e.thread_id for e in await store.claim_feed(p, "g", "c2", min_idle_ms=0)] == [a]

    @pytest.mark.parametrize("bad", [-1, 1.5, "60000"])
    async def test_trim_age_is_an_int_of_zero_or_more(self, store: EventStore, bad: Any) -> None:
        p, a, _ = await self._partition_with_two_threads(store)
        await store.append(a, [msg("x")])
        with pytest.raises(InvalidInputError, match="max_age_ms"):
            await store.trim_feed(p, max_age_ms=bad)
        assert len(await store.read_feed(p)) == 1  # a negative age would have trimmed it

    @pytest.mark.parametrize(
        "bad",
        ["garbage", "1-x", " 1-0", "1_0-0", "-1-0", "1-0-0", "\u0661-0", f"{2**64}-0", "", 5, None],
    )
    async def test_feed_ids_are_checked_before_anything_is_sent(
        self, store: EventStore, bad: Any
    ) -> None:
        p, a, _ = await self._partition_with_two_threads(store)
        await store.create_feed_group(p, "g")
        await store.append(a, [msg("x")])
        (entry,) = await store.read_feed_group(p, "g", "c")
        # Bad input is InvalidInputError on every backend, never a retryable OperationalError.
        with pytest.raises(InvalidInputError, match="stream id"):
            await store.ack_feed(p, "g", [entry.id, bad])
        with pytest.raises(InvalidInputError):
            await store.ack_feed(p, "g", entry.id)  # one id, not a list of them
        with pytest.raises(InvalidInputError, match="stream id"):
            await store.advance_feed_group(p, "g", bad)
        with pytest.raises(InvalidInputError, match="stream id"):
            await store.read_feed(p, after=bad)
        with pytest.raises(InvalidInputError, match="stream id"):
            await store.create_feed_group(p, "h", start=bad)
        (info,) = await store.feed_groups(p)
        assert info.pending == 1  # the good id in the refused batch was not acknowledged
        assert await store.ack_feed(p, "g", [entry.id]) == 1

    @pytest.mark.parametrize("bad", ["", "a b", "x" * 65, "{g}", 7, None])
    async def test_group_names_are_checked(self, store: EventStore, bad: Any) -> None:
        p, _, _ = await self._partition_with_two_threads(store)
        with pytest.raises(InvalidInputError, match="group name") as info:
            await store.create_feed_group(p, bad)
        assert "view" not in str(info.value)
        with pytest.raises(InvalidInputError, match="group name"):
            await store.read_feed_group(p, bad, "c")
        with pytest.raises(InvalidInputError, match="group name"):
            await store.ack_feed(p, bad, ["1-0"])

    async def test_a_missing_feed_group_is_a_typed_error_on_every_group_method(
        self, store: EventStore
    ) -> None:
        p, a, _ = await self._partition_with_two_threads(store)
        await store.append(a, [msg("x")])
        await store.create_feed_group(p, "g")
        # A partition whose feed has entries but not this group, and one with no feed at all.
        empty = (p + 1) % store.partitions
        assert await store.read_feed(empty) == [] or store.partitions == 1
        for partition in dict.fromkeys([p, empty]):
            calls: list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]] = [
                ("read_feed_group", store.read_feed_group, ("c",), {}),
                ("pending", store.read_feed_group, ("c",), {"pending": True}),
                ("blocking", store.read_feed_group, ("c",), {"block_ms": 10}),
                ("claim_feed", store.claim_feed, ("c",), {"min_idle_ms": 0}),
                ("ack_feed", store.ack_feed, (["1-0"],), {}),
                ("ack_feed of nothing", store.ack_feed, ([],), {}),
                ("advance_feed_group", store.advance_feed_group, ("1-0",), {}),
            ]
            for name, method, args, kwargs in calls:
                with pytest.raises(FeedGroupNotFoundError) as info:
                    await method(partition, "nope", *args, **kwargs)
                    pytest.fail(f"{name} on partition {partition} found a group")
                exc = info.value
                assert isinstance(exc, ConflictError) and isinstance(exc, LookupError)
                assert (exc.partition, exc.group) == (partition, "nope"), name
                text = str(exc)
                assert text == f"no consumer group 'nope' on feed partition {partition}", name
                assert store.namespace not in text  # no Redis key names
        # The group that exists is untouched, and works.
        assert [e.thread_id for e in await store.read_feed_group(p, "g", "c")] == [a]

    async def test_checkpointed_writes_apply_once(self, store: EventStore) -> None:
        incr = [("usage", "2026-01-01|small", 10), ("usage", "turns", 1)]
        assert await store.checkpoint_of(0, "stats") == "0-0"
        apply = store.apply_checkpointed
        assert await apply(0, "stats", expected="0-0", checkpoint="5-0", incr=incr) is True
        assert await apply(0, "stats", expected="0-0", checkpoint="5-0", incr=incr) is False
        assert await apply(0, "stats", expected="0-0", checkpoint="9-0", incr=incr) is False
        assert await apply(0, "stats", expected="5-0", checkpoint="5-1", incr=incr[:1]) is True
        assert await store.read_aux(0, "stats", "usage") == {"2026-01-01|small": 20, "turns": 1}
        assert await store.checkpoint_of(0, "stats") == "5-1"
        assert await store.checkpoint_of(1, "stats") == "0-0"
        assert await apply(0, "other", expected="0-0", checkpoint="2-0") is True
        assert await store.checkpoints(0) == {"stats": "5-1", "other": "2-0"}
        assert await store.checkpoints(1) == {}
        with pytest.raises(InvalidInputError):
            await store.checkpoints(store.partitions)
        with pytest.raises(InvalidInputError):
            await apply(0, "stats", expected="5-1", checkpoint="nope")
        with pytest.raises(InvalidInputError):
            await apply(0, "stats", expected="5-1", checkpoint="5-1")

    async def test_checkpointed_state_is_deleted_whole_and_alone(self, store: EventStore) -> None:
        """`delete_checkpointed` removes one projection's checkpoint and every hash it wrote
        in one partition, and nothing of another projection or partition; deleting nothing
        is no error, and the projection can start again from scratch."""
        apply = store.apply_checkpointed
        incr = [("usage", "day|small", 10), ("turns", "day|small", 1)]
        assert await apply(0, "stats", expected="0-0", checkpoint="5-0", incr=incr)
        assert await apply(0, "stats", expected="5-0", checkpoint="6-0", incr=[("late", "k", 0)])
        assert await apply(0, "other", expected="0-0", checkpoint="2-0", incr=[("usage", "k", 3)])
        last = store.partitions - 1  # partition 0 again with one partition
        if last:
            assert await apply(last, "stats", expected="0-0", checkpoint="3-0", incr=incr)
        state = await store.delete_checkpointed(0, "stats")
        assert state == CheckpointedState(checkpoint="6-0", hashes=["late", "turns", "usage"])
        for hash_name in ("usage", "turns", "late"):
            assert await store.read_aux(0, "stats", hash_name) == {}
        assert await store.checkpoints(0) == {"other": "2-0"}
        assert await store.read_aux(0, "other", "usage") == {"k": 3}
        if last:
            assert await store.checkpoint_of(last, "stats") == "3-0"
            assert await store.read_aux(last, "stats", "usage") == {"day|small": 10}
        assert await store.delete_checkpointed(0, "stats") == CheckpointedState(
            checkpoint=None, hashes=[]
        )
        # Named hashes that do not exist are no error, and are not reported as deleted.
        gone = await store.delete_checkpointed(0, "stats", hashes=["usage", "never"])
        assert gone == CheckpointedState(checkpoint=None, hashes=[])
        # From scratch: the compare-and-set starts from no checkpoint again.
        assert not await apply(0, "stats", expected="6-0", checkpoint="7-0", incr=incr)
        assert await apply(0, "stats", expected="0-0", checkpoint="7-0", incr=incr[:1])
        assert await store.read_aux(0, "stats", "usage") == {"day|small": 10}
        assert await store.delete_checkpointed(0, "stats") == CheckpointedState(
            checkpoint="7-0", hashes=["usage"]
        )
        bad: list[tuple[int, str, Any]] = [
            (store.partitions, "stats", ()),
            (0, "bad name", ()),
            (0, "stats", "usage"),  # a str: no sequence of names
            (0, "stats", ["usage", "a:b"]),
        ]
        for partition, name, hashes in bad:
            with pytest.raises(InvalidInputError):
                await store.delete_checkpointed(partition, name, hashes=hashes)
        assert await store.checkpoints(0) == {"other": "2-0"}  # refused calls touched nothing
        assert await store.read_aux(0, "other", "usage") == {"k": 3}

    async def test_namespace_id_is_one_per_data_set(self, store: EventStore) -> None:
        first = await store.namespace_id()
        assert len(first) == 26 and await store.namespace_id() == first
        again = await self.make_store(store.namespace)
        other = await self.make_store("c" + uuid.uuid4().hex[:12])
        try:
            assert await again.namespace_id() == first  # kept, for every client
            assert await other.namespace_id() not in ("", first)
        finally:
            await again.close()
            await other.close()

    async def test_a_written_namespace_exists_and_is_known(self, store: EventStore) -> None:
        await store.append("t", [msg("hello")])
        assert await store.namespace_exists()
        known = await store.known_namespaces()
        assert known is None or store.namespace in known
        assert await store.version("t") == 1  # asking wrote nothing

    # -- bad input -----------------------------------------------------------------------------

    @pytest.mark.parametrize(
        "thread_id",
        ["", "x" * 257, "é" * 129, "a\nb", "a\x00b", "tab\there", "{tag}", "a}b", 42, None],
    )
    async def test_invalid_thread_ids_are_rejected(self, store: EventStore, thread_id: Any) -> None:
        with pytest.raises(InvalidThreadIdError):
            await store.append(thread_id, [msg("x")])
        with pytest.raises(InvalidThreadIdError):
            await read_all(store, thread_id)
        with pytest.raises(InvalidThreadIdError):
            await store.version(thread_id)
        assert await store.threads() == []

    async def test_odd_but_valid_thread_ids(self, store: EventStore) -> None:
        ids = ["x" * 256, "é" * 128, "a:log:b", "sp ace", "emoji-😀", "view:l:x"]
        for t in ids:
            await store.append(t, [msg(t)], view_ops=[ListPush("l", (t.encode(),))])
        for t in ids:
            assert message_texts(await read_all(store, t)) == [t]
            snap = await store.read_views(t, [ListRange("l")])
            assert [e.value for e in snap.results[0]] == [t.encode()]  # type: ignore[union-attr]

    async def test_oversized_event_is_rejected(self) -> None:
        store = await self.make_store("c" + uuid.uuid4().hex[:12], max_event_bytes=2048)
        try:
            await store.append("t", [msg("x" * 1500)])
            with pytest.raises(EventTooLargeError) as info:
                await store.append("t", [msg("ok"), msg("x" * 3000)])
            assert (info.value.index, info.value.limit) == (1, 2048)
            assert await store.version("t") == 1
        finally:
            await store.close()

    async def test_default_limit_is_one_mebibyte(self, store: EventStore) -> None:
        await store.append("t", [msg("x" * (1024 * 1024 - 200))])
        with pytest.raises(EventTooLargeError):
            await store.append("t", [msg("x" * (1024 * 1024 + 1))])
        assert await store.version("t") == 1

    async def test_unknown_event_type_is_rejected(self, store: EventStore) -> None:
        with pytest.raises(UnknownEventTypeError):
            await store.append("t", [msg("fine"), _Unregistered(x=1)])
        assert await store.version("t") == 0

    async def test_payload_failing_validation_is_rejected(self, store: EventStore) -> None:
        bad = StateUpdated(block=123, value=1)  # type: ignore[arg-type]
        with pytest.raises(EventValidationError):
            await store.append("t", [bad])
        bad_role = MessageAppended(message=Message(role="robot", content="x"))  # type: ignore[arg-type]
        with pytest.raises(EventValidationError):
            await store.append("t", [bad_role])
        assert await store.version("t") == 0

    async def test_non_finite_floats_are_refused(self, store: EventStore) -> None:
        """An event is exported and shown as JSON, which has no NaN or infinity: a payload
        holding one is refused whole, naming where, instead of being exported as null."""
        tool_call = ToolCallPart(tool_call_id="c1", tool_name="f", input={"limits": [1.0, -inf]})
        cases: list[tuple[Event, str]] = [
            (StateUpdated(block="b", value=nan), r"nan .*at value"),
            (StateUpdated(block="b", value={"x": [0.5, inf]}), r"inf .*at value\['x'\]\[1\]"),
            (
                MessageAppended(message=Message(role="assistant", content=[tool_call])),
                r"-inf .*at message\['content'\]\[0\]\['input'\]\['limits'\]\[1\]",
            ),
        ]
        await store.append("t", [msg("before")])
        for event, where in cases:
            with pytest.raises(EventValidationError, match=where):
                await store.append("t", [msg("a"), event])
        assert await store.version("t") == 1
        # Bytes that only look like a float64 NaN's start (an int's, here) are no NaN.
        lookalike = StateUpdated(block="b", value=[0xCB7FF000, 0xCBFFF000, -0.0, 1e308])
        await store.append("t", [lookalike])
        assert [e.payload async for e in store.read("t", start=2)] == [lookalike]

    async def test_payloads_an_export_cannot_write_are_refused(self, store: EventStore) -> None:
        """A payload JSON cannot hold at all (a map keyed by a list or by None) is refused
        whole: stored, it would stop every export of the namespace at it."""
        for value in ({(1, 2): 3}, {None: 1}, [{"ok": {(3,): "deep"}}]):
            with pytest.raises(EventValidationError, match="JSON cannot hold"):
                await store.append("t", [msg("a"), StateUpdated(block="b", value=value)])
        assert await store.version("t") == 0
        # Keys JSON writes as text (numbers) are exported as they are written: accepted.
        await store.append("t", [StateUpdated(block="b", value={1: "one", 2.5: "x"})])
        assert await store.version("t") == 1

    async def test_nesting_has_one_limit_on_every_python(self, store: EventStore) -> None:
        """Up to MAX_NESTING levels (the event is the first) are stored and read back; one more
        is refused whole, typed, and so is a depth the interpreter itself cannot encode (3.11:
        ~900 levels) or could encode but another Python could not decode (3.13: 5,000)."""

        def nested(levels: int) -> Any:
            value: Any = []
            for _ in range(levels - 1):
                value = [value]
            return value

        # The value sits at level 2 of its StateUpdated: MAX_NESTING - 1 levels of lists fit.
        deepest = nested(MAX_NESTING - 1)
        await store.append("t", [msg("before")])
        await store.append("t", [StateUpdated(block="b", value=deepest)])
        for levels in (MAX_NESTING, 1_000, 5_000, 50_000):
            with pytest.raises(EventValidationError, match=f"more than {MAX_NESTING} levels"):
                await store.append("t", [msg("a"), StateUpdated(block="b", value=nested(levels))])
        # A deep value where the event's annotations want a string: refused too, typed.
        for levels in (MAX_NESTING, 5_000):
            wrong = MessageAppended(
                message=Message(role="user", content="x"), turn_id=nested(levels)
            )
            with pytest.raises(EventValidationError):
                await store.append("t", [wrong])
        assert await store.version("t") == 2
        stored = [e.payload async for e in store.read("t")]
        assert stored[1] == StateUpdated(block="b", value=deepest)

    @pytest.mark.parametrize("events", [[], "text", [object()], msg("bare")])
    async def test_malformed_event_lists_are_rejected(self, store: EventStore, events: Any) -> None:
        with pytest.raises(InvalidInputError):
            await store.append("t", events)
        assert await store.version("t") == 0

    async def test_bad_event_id_and_duplicate_ids_are_rejected(self, store: EventStore) -> None:
        with pytest.raises(InvalidInputError):
            await store.append("t", [NewEvent(payload=msg("x"), id="not-a-ulid")])
        same = NewEvent(payload=msg("x"))
        with pytest.raises(InvalidInputError):
            await store.append("t", [same, same])
        assert await store.version("t") == 0

    async def test_undecodable_stored_entries_name_thread_and_seq(self, store: EventStore) -> None:
        if not self.supports_raw_writes:
            pytest.skip("backend cannot write raw entries")
        await store.append("t", [msg("a"), msg("b")])
        good = (await store.read_raw("t", start=1, stop=1))[0][1]
        garbage: list[dict[bytes, bytes]] = [
            {**good, b"d": b"\xc1not msgpack"},
            {b"x": b"y"},
            {**good, b"d": msgspec.msgpack.encode({"type": "nobody.knows"})},
            {**good, b"v": b"abc"},
            {**good, b"i": b"short"},
            {**good, b"m": b"\xc1"},
        ]
        for n, fields in enumerate(garbage, start=3):
            await self.write_raw_entry(store, "t", f"{n}-0", fields)
        await self.write_raw_entry(store, "t", "99-5", good)
        for seq in range(3, 3 + len(garbage)):
            with pytest.raises(CorruptEventError) as info:
                await read_all(store, "t", start=seq, stop=seq)
            assert (info.value.thread_id, info.value.seq) == ("t", seq)
            assert f"seq {seq}" in str(info.value)
        with pytest.raises(CorruptEventError) as info:
            await read_all(store, "t", start=99)
        assert info.value.thread_id == "t"
        for seq in range(3, 3 + len(garbage)):
            with pytest.raises(CorruptEventError) as info:
                await store.fold_payloads("t", lambda rows: None, start=seq, stop=seq)
            assert (info.value.thread_id, info.value.seq) == ("t", seq)
        # Reading stops at the damage, never skips it silently; the good prefix is readable.
        assert message_texts(await read_all(store, "t", stop=2)) == ["a", "b"]

    # -- schema evolution ----------------------------------------------------------------------

    async def test_upcasting_old_versions(self) -> None:
        old_registry = EventRegistry()

        class NoteV1(Event, tag="testing.note", frozen=True):
            text: str

        old_registry.register(NoteV1)
        new_registry = EventRegistry()

        class NoteV2(Event, tag="testing.note", frozen=True):
            body: str
            author: str = "unknown"

        def v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
            return {"body": raw["text"], "author": "migrated"}

        new_registry.register(NoteV2, version=2, upcasters={1: v1_to_v2})
        ns = "c" + uuid.uuid4().hex[:12]
        writer = await self.make_store(ns, registry=old_registry)
        try:
            await writer.append("t", [NoteV1(text="hello")])
        finally:
            await writer.close()
        reader = await self.make_store(ns, registry=new_registry)
        try:
            await reader.append("t", [NoteV2(body="new", author="me")])
            events = await read_all(reader, "t")
        finally:
            await reader.close()
        assert [e.payload for e in events] == [
            NoteV2(body="hello", author="migrated"),
            NoteV2(body="new", author="me"),
        ]
        assert [e.schema_version for e in events] == [1, 2]

    async def test_an_older_reader_is_told_the_stored_version_is_newer(self) -> None:
        class NoteV1(Event, tag="testing.newer", frozen=True):
            text: str

        class NoteV2(Event, tag="testing.newer", frozen=True):
            body: str
            text: str = ""

        old_registry = EventRegistry()
        old_registry.register(NoteV1)
        new_registry = EventRegistry()
        new_registry.register(NoteV2, version=2, upcasters={1: lambda raw: {"body": raw["text"]}})
        ns = "c" + uuid.uuid4().hex[:12]
        writer = await self.make_store(ns, registry=new_registry)
        try:
            # One the old schema cannot decode, one it can (it has a "text"): both are newer.
            await writer.append("t", [NoteV2(body="b"), NoteV2(body="b", text="t")])
        finally:
            await writer.close()
        reader = await self.make_store(ns, registry=old_registry)
        try:

            async def attempt(how: str, seq: int) -> None:
                if how == "read":
                    await read_all(reader, "t", start=seq, stop=seq)
                elif how == "read_batches":
                    await _drain(reader.read_batches("t", start=seq, stop=seq))
                else:
                    await reader.fold_payloads("t", lambda rows: None, start=seq, stop=seq)

            for seq in (1, 2):
                for how in ("read", "read_batches", "fold_payloads"):
                    with pytest.raises(CorruptEventError) as info:
                        await attempt(how, seq)
                    assert "stored version 2 of 'testing.newer' is newer than this code knows" in (
                        str(info.value)
                    ), (how, seq, str(info.value))
                    assert info.value.unknown_type and info.value.seq == seq
        finally:
            await reader.close()

    # -- one chain key per thread ----------------------------------------------------------------

    async def _snapshot(self, store: EventStore, thread_id: str) -> tuple[Any, ...]:
        """Everything an append can change: version, log, views, feed, thread index."""
        from ._keys import partition_of

        views = await store.read_views(thread_id, [ListRange("l"), HashGetAll("h")])
        feed = await store.read_feed(partition_of(thread_id, store.partitions))
        return (
            await store.version(thread_id),
            await store.read_raw(thread_id),
            views.results,
            [(e.thread_id, e.first_seq, e.last_seq) for e in feed],
            [t.thread_id for t in await store.threads()],
            await store.chain_key_fingerprint(thread_id),
        )

    async def _refused(
        self, writer: EventStore, owner: EventStore, *, thread_keyed: bool, store_keyed: bool
    ) -> None:
        """``owner`` wrote thread "t"; every append ``writer`` tries is refused, writing nothing."""
        before = await self._snapshot(owner, "t")
        attempts: list[dict[str, Any]] = [
            {},
            {
                "idempotency_key": "k1",
                "view_ops": [ListPush("l", (b"x",)), HashSet("h", "f", b"2")],
            },
            {"expected_version": await owner.version("t")},
            {"expected_version": EXISTS},
        ]
        for kwargs in attempts:
            for events in ([msg("x")], [msg("x"), msg("y")]):
                with pytest.raises(ChainKeyMismatchError) as info:
                    await writer.append("t", events, **kwargs)
                assert info.value.thread_id == "t"
                assert (info.value.thread_keyed, info.value.store_keyed) == (
                    thread_keyed,
                    store_keyed,
                )
                assert "THREADLOG_SECRET" in str(info.value)
                assert "nothing was written" in str(info.value)
        assert await self._snapshot(owner, "t") == before
        assert await self._snapshot(writer, "t") == before
        # The refused request did not burn its idempotency key: the thread's own writer can use it.
        done = await owner.append("t", [msg("z")], idempotency_key="k1")
        assert not done.duplicate and done.first_seq == before[0] + 1

    @pytest.mark.parametrize("secret", [b"", "", "s3cret"], ids=repr)
    async def test_an_empty_or_text_secret_is_refused(self, secret: Any) -> None:
        """An empty secret is no key: taken as one, it wrote unkeyed links while its caller
        believed the chain keyed (an unfilled ``THREADLOG_SECRET=${KEY}``, say). No key is
        ``secret=None``; a str is refused as it always was (a TypeError before, on memory)."""
        with pytest.raises(InvalidInputError, match="secret"):
            store = await self.make_store("c" + uuid.uuid4().hex[:12], secret=secret)
            await store.close()

    async def test_writer_without_the_threads_chain_key_is_refused(self) -> None:
        namespace = "c" + uuid.uuid4().hex[:12]
        keyed = await self.make_store(namespace, secret=b"s3cret")
        plain = await self.make_store(namespace)
        try:
            await keyed.append(
                "t", [msg("a")], view_ops=[ListPush("l", (b"a",)), HashSet("h", "f", b"1")]
            )
            await self._refused(plain, keyed, thread_keyed=True, store_keyed=False)
        finally:
            await keyed.close()
            await plain.close()

    async def test_keyed_writer_of_an_unkeyed_thread_is_refused(self) -> None:
        namespace = "c" + uuid.uuid4().hex[:12]
        plain = await self.make_store(namespace)
        keyed = await self.make_store(namespace, secret=b"s3cret")
        try:
            await plain.append(
                "t", [msg("a")], view_ops=[ListPush("l", (b"a",)), HashSet("h", "f", b"1")]
            )
            await self._refused(keyed, plain, thread_keyed=False, store_keyed=True)
        finally:
            await keyed.close()
            await plain.close()

    async def test_writer_with_another_chain_key_is_refused(self) -> None:
        namespace = "c" + uuid.uuid4().hex[:12]
        owner = await self.make_store(namespace, secret=b"s3cret")
        other = await self.make_store(namespace, secret=b"another")
        try:
            await owner.append(
                "t", [msg("a")], view_ops=[ListPush("l", (b"a",)), HashSet("h", "f", b"1")]
            )
            await self._refused(other, owner, thread_keyed=True, store_keyed=True)
        finally:
            await owner.close()
            await other.close()

    async def test_writers_with_the_same_chain_key_share_a_thread(self) -> None:
        namespace = "c" + uuid.uuid4().hex[:12]
        stores = [await self.make_store(namespace, secret=b"s3cret") for _ in range(2)]
        plain = [await self.make_store(namespace) for _ in range(2)]
        try:
            for i in range(4):
                await stores[i % 2].append("keyed", [msg(str(i))])
                await plain[i % 2].append("plain", [msg(str(i))])
            assert await stores[0].version("keyed") == await plain[0].version("plain") == 4
            linked = namespace_chain_key(b"s3cret", namespace)  # the key the namespace links with
            assert await plain[0].chain_key_fingerprint("keyed") == key_fingerprint(linked)
            assert await stores[0].chain_key_fingerprint("plain") == UNKEYED_FINGERPRINT
            assert await stores[0].chain_key_fingerprint("nothing here") is None
            # A fingerprint names the key without giving it away, and tells keys apart.
            fp = key_fingerprint(b"s3cret")
            assert len(fp) == 16 and b"s3cret".hex() not in fp
            assert fp != key_fingerprint(b"s3cres") and key_fingerprint(None) == "-"
            # One secret, two namespaces: two keys (a thread copied across does not verify).
            assert linked != namespace_chain_key(b"s3cret", namespace + "x")
        finally:
            for store in (*stores, *plain):
                await store.close()

    async def test_retry_of_a_landed_append_is_a_duplicate_whatever_the_key(self) -> None:
        namespace = "c" + uuid.uuid4().hex[:12]
        keyed = await self.make_store(namespace, secret=b"s3cret")
        plain = await self.make_store(namespace)
        try:
            first = await keyed.append("t", [msg("a"), msg("b")], idempotency_key="req")
            again = await keyed.append("t", [msg("a"), msg("b")], idempotency_key="req")
            assert again.duplicate and (again.first_seq, again.last_seq) == (1, 2)
            # The key is checked after the ledger: a retry of what landed writes nothing either
            # way, so it answers with the original result rather than a refusal.
            other = await plain.append("t", [msg("a"), msg("b")], idempotency_key="req")
            assert other == again and not first.duplicate
            with pytest.raises(IdempotencyKeyReusedError):
                await plain.append("t", [msg("changed")], idempotency_key="req")
            with pytest.raises(ChainKeyMismatchError):
                await plain.append("t", [msg("c")], idempotency_key="new")
            assert await keyed.version("t") == 2
        finally:
            await keyed.close()
            await plain.close()

    async def test_thread_from_before_key_fingerprints_adopts_its_next_writers_key(
        self,
    ) -> None:
        namespace = "c" + uuid.uuid4().hex[:12]
        keyed = await self.make_store(namespace, secret=b"s3cret")
        plain = await self.make_store(namespace)
        try:
            await plain.append("old", [msg("a")], idempotency_key="first")
            await keyed.append("old-keyed", [msg("a")])
            for thread in ("old", "old-keyed"):
                try:
                    await self.forget_chain_key(plain, thread)
                except NotImplementedError:
                    pytest.skip("the backend cannot make a thread from before key fingerprints")
                assert await plain.chain_key_fingerprint(thread) is None
            # Its earlier appends are still recognised, and nothing is recorded by a retry.
            retry = await keyed.append("old", [msg("a")], idempotency_key="first")
            assert retry.duplicate and await plain.chain_key_fingerprint("old") is None
            # The first writer after the upgrade records its key; from then on it is enforced.
            await plain.append("old", [msg("b")])
            assert await plain.chain_key_fingerprint("old") == UNKEYED_FINGERPRINT
            with pytest.raises(ChainKeyMismatchError):
                await keyed.append("old", [msg("c")])
            await keyed.append("old-keyed", [msg("b")])
            assert await plain.chain_key_fingerprint("old-keyed") == key_fingerprint(
                namespace_chain_key(b"s3cret", namespace)
            )
            with pytest.raises(ChainKeyMismatchError):
                await plain.append("old-keyed", [msg("c")])
            assert await plain.version("old") == await plain.version("old-keyed") == 2
        finally:
            await keyed.close()
            await plain.close()

    async def test_a_recreated_thread_records_its_new_writers_key(self) -> None:
        namespace = "c" + uuid.uuid4().hex[:12]
        keyed = await self.make_store(namespace, secret=b"s3cret")
        plain = await self.make_store(namespace)
        try:
            await keyed.append("t", [msg("a")], view_ops=[ListPush("l", (b"a",))])
            await plain.delete_thread("t", views=["l"])
            assert await plain.chain_key_fingerprint("t") is None
            await plain.append("t", [msg("new life")], expected_version=NO_THREAD)
            assert await plain.chain_key_fingerprint("t") == UNKEYED_FINGERPRINT
            with pytest.raises(ChainKeyMismatchError):
                await keyed.append("t", [msg("b")])
        finally:
            await keyed.close()
            await plain.close()

    # -- lifecycle -----------------------------------------------------------------------------

    async def test_scripts_reload_after_flush(self, store: EventStore) -> None:
        await store.append("t", [msg("a")], view_ops=[ListPush("l", (b"a",))])
        await self.flush_scripts(store)
        await store.append("t", [msg("b")], view_ops=[ListPush("l", (b"b",))])
        await self.flush_scripts(store)
        snap = await store.read_views("t", [ListRange("l")])
        assert [e.value for e in snap.results[0]] == [b"a", b"b"]  # type: ignore[union-attr]
        await self.flush_scripts(store)
        assert await store.seq_at("t", 10**15) == 2
        await self.flush_scripts(store)
        await store.load_views("t", [ListLoad("l", ())], expected_version=2)

    async def test_closed_store_refuses_work(self) -> None:
        store = await self.make_store("c" + uuid.uuid4().hex[:12])
        async with store:
            await store.append("t", [msg("a")])
        with pytest.raises(StoreClosedError):
            await store.append("t", [msg("b")])

    async def test_registering_types(self) -> None:
        reg = EventRegistry()
        with pytest.raises(InvalidInputError):

            class Untagged(Event, frozen=True):
                x: int = 0

            reg.register(Untagged)

        class Custom(Event, tag="testing.custom", frozen=True):
            n: int

        register_event(Custom, into=reg)
        with pytest.raises(InvalidInputError):

            class Clash(Event, tag="testing.custom", frozen=True):
                m: int

            reg.register(Clash)
        with pytest.raises(InvalidInputError):
            reg.register(Custom, version=3, upcasters={1: lambda r: r})
        # Checked when registering, not when the first old event is read.
        for version in ("2", 1.5, True, 0):
            with pytest.raises(InvalidInputError, match="version must be an int"):
                reg.register(Custom, version=version)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError, match="not callable"):
            reg.register(Custom, version=2, upcasters={1: 5})  # type: ignore[dict-item]
        with pytest.raises(InvalidInputError, match="mapping"):
            reg.register(Custom, version=2, upcasters=[lambda r: r])  # type: ignore[arg-type]
        assert reg.version_of(Custom(n=1)) == 1  # the refused registrations changed nothing
        store = await self.make_store("c" + uuid.uuid4().hex[:12], registry=reg)
        try:
            await store.append("t", [Custom(n=5)])
            assert [e.payload for e in await read_all(store, "t")] == [Custom(n=5)]
            with pytest.raises(UnknownEventTypeError):
                await store.append("t", [msg("not in this registry")])
        finally:
            await store.close()
        assert "message.appended" in default_registry

    async def test_turn_events_round_trip(self, store: EventStore) -> None:
        await store.append("t", [TurnOpened(turn_id="01TURN", parent_turn_id=None)])
        (event,) = await read_all(store, "t")
        assert event.payload == TurnOpened(turn_id="01TURN")
