"""The shared conformance suite, run against the memory backend and a real redis-server."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from adapters import Auditor
from eventstore import (
    CorruptEventError,
    CorruptKeyError,
    EventStore,
    KeyLayout,
    MemoryEventStore,
    MemoryServer,
    OperationalError,
    RedisEventStore,
    connect,
    open_store,
)
from eventstore._connect import StoreSettings
from eventstore.testing import EventStoreConformance, message_texts, msg, read_all
from tests._redis_hooks import RedisHooks
from tests.test_security import with_query


class TestMemoryEventStore(EventStoreConformance):
    server = MemoryServer()

    async def make_store(self, namespace: str, **options: Any) -> EventStore:
        return MemoryEventStore(namespace=namespace, server=self.server, **options)

    async def write_raw_entry(
        self, store: EventStore, thread_id: str, entry_id: str, fields: dict[bytes, bytes]
    ) -> None:
        assert isinstance(store, MemoryEventStore)
        ms, seq = entry_id.split("-")
        thread = store.server.namespaces[store.namespace].threads[thread_id]
        thread.raw_xadd((int(ms), int(seq)), fields)

    async def forget_chain_key(self, store: EventStore, thread_id: str) -> None:
        assert isinstance(store, MemoryEventStore)
        store.server.namespaces[store.namespace].threads[thread_id].fingerprint = None

    async def unindex_thread(self, store: EventStore, thread_id: str) -> None:
        assert isinstance(store, MemoryEventStore)
        del store.server.namespaces[store.namespace].index[thread_id]

    async def set_last_activity(self, store: EventStore, thread_id: str, ms: int) -> None:
        assert isinstance(store, MemoryEventStore)
        store.server.namespaces[store.namespace].index[thread_id] = ms

    async def set_version(self, store: EventStore, thread_id: str, version: int) -> None:
        assert isinstance(store, MemoryEventStore)
        store.server.namespaces[store.namespace].threads[thread_id].version = version

    async def delete_meta(self, store: EventStore, thread_id: str) -> None:
        assert isinstance(store, MemoryEventStore)
        # What the Redis meta hash holds, gone; the entries (the log) stay.
        thread = store.server.namespaces[store.namespace].threads[thread_id]
        thread.version, thread.head, thread.created_ms = 0, "", 0
        thread.incarnation, thread.fingerprint = 0, None
        thread.ledger.clear()


class TestRedisEventStore(RedisHooks, EventStoreConformance):
    @pytest.fixture(autouse=True)
    def _redis(self, redis_url: str) -> None:
        self.url = redis_url

    async def make_store(self, namespace: str, **options: Any) -> EventStore:
        registry = options.pop("registry", None)
        settings = StoreSettings.from_url(self.url, namespace=namespace, **options)
        return await open_store(settings, registry=registry)

    async def flush_scripts(self, store: EventStore) -> None:
        assert isinstance(store, RedisEventStore)
        await store.client.script_flush()


class TestResp3EventStore(TestRedisEventStore):
    """The same on a RESP3 connection (``?protocol=3``): redis-py parses some replies into
    other shapes there (``XREADGROUP`` into a map, which consumer group reads failed on), and
    the store's fast paths read RESP3 replies on their own connections."""

    @pytest.fixture(autouse=True)
    def _redis(self, redis_url: str) -> None:
        self.url = with_query(redis_url, protocol="3")

    async def make_store(self, namespace: str, **options: Any) -> EventStore:
        store = await super().make_store(namespace, **options)
        assert isinstance(store, RedisEventStore)
        assert (await store.client.execute_command("HELLO"))[b"proto"] == 3
        assert store._held is not None and store._packs_chunks  # the fast paths too
        return store


class TestSentinelEventStore(TestRedisEventStore):
    """The same through Redis Sentinel (``redis+sentinel://``): redis-py's sentinel pool
    finds the primary, and the store's own fast paths (held connections, packed view loads)
    run on its connections, leaving a demoted primary as redis-py's reads would."""

    @pytest.fixture(autouse=True)
    def _redis(self, sentinel_url: str) -> None:
        self.url = sentinel_url

    async def make_store(self, namespace: str, **options: Any) -> EventStore:
        store = await super().make_store(namespace, **options)
        assert isinstance(store, RedisEventStore)
        assert store._held is not None and store._packs_chunks
        return store


# -- Redis's own: damage in the keys a whole namespace shares -----------------------------------


@pytest.fixture(params=["redis", "cluster"])
def any_redis_url(request: pytest.FixtureRequest) -> str:
    """Standalone Redis, then Redis Cluster."""
    url: str = request.getfixturevalue("redis_url" if request.param == "redis" else "cluster_url")
    return url


@pytest.mark.anyio
@pytest.mark.parametrize("recorded", [b"abc", b"0", b"-3", b"1e3", b"16385", b"99999999999999"])
async def test_a_damaged_partition_count_is_a_typed_error_naming_the_key(
    any_redis_url: str, recorded: bytes
) -> None:
    ns = "dmg" + uuid.uuid4().hex[:10]
    async with await connect(any_redis_url, namespace=ns, partitions=2) as writer:
        await writer.append("t", [msg("x")])
        assert isinstance(writer, RedisEventStore)
        key = KeyLayout.config_key(ns)
        await writer.client.hset(key, "partitions", recorded)
    for create in (True, False):
        with pytest.raises(CorruptKeyError, match="partition count") as info:
            await connect(any_redis_url, namespace=ns, create_namespace=create)
        assert info.value.key == key and repr(recorded) in str(info.value)


@pytest.mark.anyio
async def test_a_damaged_thread_index_is_a_typed_error_naming_the_key(any_redis_url: str) -> None:
    ns = "dmg" + uuid.uuid4().hex[:10]
    async with await connect(any_redis_url, namespace=ns, partitions=1) as store:
        assert isinstance(store, RedisEventStore)
        for name in ("a", "b", "c"):
            await store.append(name, [msg(name)])
        index = store.keys.index(0)
        listed = await store.threads()
        damage: list[tuple[bytes, float]] = [
            (b"\xff\xfe", 5),  # no UTF-8
            (b"bad{id}", 5),  # no thread id threadlog accepts
            (b"d", float("inf")),
            (b"d", float("-inf")),
            (b"d", 1.5),
        ]
        for member, score in damage:
            await store.client.zadd(index, {member: score})
            listings: list[dict[str, Any]] = [{}, {"limit": 10}]
            if score != float("inf"):  # (listings that reach below the newest thread)
                listings += [{"after": listed[0]}, {"before_ms": 2**52}]
            for kwargs in listings:
                with pytest.raises(CorruptKeyError) as info:
                    await store.threads(**kwargs)
                assert info.value.key == index, (member, score)
            await store.client.zrem(index, member)
        assert await store.threads() == listed


@pytest.mark.anyio
async def test_a_damaged_feed_entry_is_a_typed_error_naming_the_key(any_redis_url: str) -> None:
    """An entry of a feed stream that threadlog never writes (added from outside) stops a
    read of the feed with `CorruptKeyError` naming the key and the entry, not a KeyError."""
    ns = "dmg" + uuid.uuid4().hex[:10]
    async with await connect(any_redis_url, namespace=ns, partitions=1) as store:
        assert isinstance(store, RedisEventStore)
        await store.append("a", [msg("a")])
        feed = store.keys.feed(0)
        damage: list[dict[str, Any]] = [
            {"x": "y"},  # no thread
            {"t": "g1", "f": "abc", "l": "3"},  # a seq that is no number
            {"t": b"\xff", "f": "1", "l": "1"},  # no UTF-8
            {"t": "g1", "f": "2", "l": "1"},  # first after last
            {"t": "g1", "f": "1", "l": "1", "n": "-"},  # an incarnation that is no number
        ]
        for fields in damage:
            entry_id = (await store.client.xadd(feed, fields)).decode("ascii")
            with pytest.raises(CorruptKeyError, match=f"entry {entry_id}") as info:
                await store.read_feed(0)
            assert info.value.key == feed, fields
            await store.client.xdel(feed, entry_id)
        assert [e.thread_id for e in await store.read_feed(0)] == ["a"]


@pytest.mark.anyio
async def test_seq_at_refuses_an_entry_with_its_time_twice(any_redis_url: str) -> None:
    """An entry given a second time field (``s``) from outside, placed first: the search by
    time read the first, every other reader (and the integrity chain) the last, so a forged
    time steered time-travel reads while verify passed. It is damage, named."""
    ns = "dmg" + uuid.uuid4().hex[:10]
    async with await connect(any_redis_url, namespace=ns, partitions=1) as store:
        assert isinstance(store, RedisEventStore)
        await store.append("t", [msg("a"), msg("b"), msg("c")])
        log = store.keys.log("t")
        entries = await store.client.xrange(log)
        await store.client.delete(log)
        for entry_id, fields in entries:
            flat = [x for pair in fields.items() for x in pair]
            if entry_id == b"2-0":
                flat = [b"s", b"1000", *flat]
            await store.client.execute_command("XADD", log, entry_id, *flat)
        for when in (0, 2**50):
            with pytest.raises(CorruptEventError, match=r"field 's'.* twice") as info:
                await store.seq_at("t", when)
            assert (info.value.thread_id, info.value.seq) == ("t", 2)


@pytest.mark.anyio
async def test_seq_at_on_a_version_too_large_for_any_thread_is_damage(any_redis_url: str) -> None:
    """A meta version no thread reaches (10**15): the search formatted a seq as '1e+15' and
    Redis refused it ('Invalid stream ID'), unnamed. It is the damaged version it is."""
    ns = "dmg" + uuid.uuid4().hex[:10]
    async with await connect(any_redis_url, namespace=ns, partitions=1) as store:
        assert isinstance(store, RedisEventStore)
        await store.append("t", [msg("a")])
        for version in (10**15, 2**53 - 1, 10**19):
            await store.client.hset(store.keys.meta("t"), "v", str(version))
            with pytest.raises(CorruptEventError) as info:
                await store.seq_at("t", 2**40)
            assert info.value.thread_id == "t", version


@pytest.mark.anyio
async def test_a_thread_past_128_events_keeps_its_ledger_in_a_hashtable(any_redis_url: str) -> None:
    """The meta hash (with the ledger) stays a listpack up to 128 events, then becomes a
    hashtable, which a lookup of a missing key does not scan (append.lua); retries of appends
    from before and after are still answered from the ledger, and nothing else reads field
    ``x``."""
    ns = "enc" + uuid.uuid4().hex[:10]
    async with await connect(any_redis_url, namespace=ns) as store:
        assert isinstance(store, RedisEventStore)
        meta = store.keys.meta("t")
        first = await store.append("t", [msg("0")], idempotency_key="first")
        for i in range(1, 127):
            await store.append("t", [msg(str(i))])
        assert await store.client.object("encoding", meta) == b"listpack"
        # One append of three events crosses 128 (127 -> 130).
        crossing = await store.append("t", [msg("a"), msg("b"), msg("c")], idempotency_key="x")
        assert (crossing.first_seq, crossing.last_seq) == (128, 130)
        assert await store.client.object("encoding", meta) == b"hashtable"
        again = await store.append("t", [msg("0")], idempotency_key="first")
        assert again.duplicate and (again.first_seq, again.last_seq) == (1, 1) == (
            first.first_seq,
            first.last_seq,
        )
        again = await store.append("t", [msg("a"), msg("b"), msg("c")], idempotency_key="x")
        assert again.duplicate and (again.first_seq, again.last_seq) == (128, 130)
        assert await store.version("t") == 130
        texts = message_texts(await read_all(store, "t"))
        assert texts[:2] == ["0", "1"] and texts[-3:] == ["a", "b", "c"] and len(texts) == 130
        report = await Auditor(store).verify("t")
        assert report.ok, report


@pytest.mark.anyio
async def test_deleting_a_projections_state_finds_its_hashes_by_their_recorded_names(
    any_redis_url: str,
) -> None:
    """On Redis the names of a projection's hashes are recorded as they are written (a set
    beside them), so `delete_checkpointed` deletes them with no SCAN: the set goes too. A hash
    written before names were recorded is deleted when named; one recorded between the read
    of the names and the delete (a runner still at work) is taken in by another attempt, and
    a runner that never stops adding them is an error, not a half delete."""
    ns = "ck" + uuid.uuid4().hex[:10]
    async with await connect(any_redis_url, namespace=ns) as store:
        assert isinstance(store, RedisEventStore)
        client: Any = store.client
        keys = store.keys
        names_key = keys.aux_names(0, "p")
        one = [("a", "k", 1)]
        await store.apply_checkpointed(0, "p", expected="0-0", checkpoint="1-0", incr=one)
        assert await client.smembers(names_key) == {b"a"}
        legacy = keys.aux(0, "p", "old")
        await client.hincrby(legacy, "k", 5)  # as a release before the names were recorded
        state = await store.delete_checkpointed(0, "p")
        assert state.hashes == ["a"] and await client.hgetall(legacy) == {b"k": b"5"}
        assert await client.exists(names_key, keys.aux(0, "p", "a")) == 0
        state = await store.delete_checkpointed(0, "p", hashes=["old"])
        assert state.hashes == ["old"] and await client.exists(legacy) == 0

        await store.apply_checkpointed(0, "p", expected="0-0", checkpoint="2-0", incr=one)
        read_names = client.smembers
        landed: list[str] = []

        async def a_batch_lands_after_the_read(key: str) -> Any:
            names = await read_names(key)
            if len(landed) < 2:  # two batches land, each after a read: three attempts
                landed.append(f"new{len(landed)}")
                incr = [(landed[-1], "k", 1)]
                at = await store.checkpoint_of(0, "p")
                checkpoint = f"{int(at.split('-')[0]) + 1}-0"
                assert await store.apply_checkpointed(
                    0, "p", expected=at, checkpoint=checkpoint, incr=incr
                )
            return names

        client.smembers = a_batch_lands_after_the_read
        state = await store.delete_checkpointed(0, "p")
        assert state.checkpoint == "4-0" and state.hashes == ["a", "new0", "new1"]
        assert await client.exists(names_key, *(keys.aux(0, "p", h) for h in state.hashes)) == 0
        assert await store.checkpoints(0) == {}

        async def a_batch_lands_after_every_read(key: str) -> Any:
            names = await read_names(key)
            await client.sadd(key, uuid.uuid4().hex)
            return names

        client.smembers = a_batch_lands_after_every_read
        await store.apply_checkpointed(0, "p", expected="0-0", checkpoint="9-0", incr=one)
        with pytest.raises(OperationalError, match="stop its runners first"):
            await store.delete_checkpointed(0, "p")
        del client.smembers
        assert await store.checkpoint_of(0, "p") == "9-0"  # nothing deleted
        assert await store.read_aux(0, "p", "a") == {"k": 1}
        # A damaged checkpoint (any bytes, from outside threadlog) is deleted and reported.
        await client.hset(keys.checkpoints(0), "p", b"\xff\xfe")
        state = await store.delete_checkpointed(0, "p")
        assert state.checkpoint == "\\xff\\xfe" and state.hashes == ["a"]
        assert await store.checkpoints(0) == {}
        await store.apply_checkpointed(0, "p", expected="0-0", checkpoint="9-0", incr=one)
        # A member put in the set from outside threadlog is damage, named; nothing deleted.
        await client.delete(names_key)
        await client.sadd(names_key, "a")
        for damage in (b"a:b", b"\xff"):
            await client.sadd(names_key, damage)
            with pytest.raises(CorruptKeyError) as info:
                await store.delete_checkpointed(0, "p")
            assert info.value.key == names_key and repr(damage) in info.value.detail
            await client.srem(names_key, damage)
            assert await store.checkpoint_of(0, "p") == "9-0"
            assert await store.read_aux(0, "p", "a") == {"k": 1}


@pytest.mark.anyio
@pytest.mark.parametrize("protocol", [2, 3])
async def test_a_view_key_of_no_views_type_is_damage_not_an_empty_view(
    any_redis_url: str, protocol: int
) -> None:
    """A view key replaced from outside threadlog by a string (or a set...) read as an empty
    view: a transcript with no messages, a window with none, without a word. Every read path
    (the one-snapshot script, the MULTI of plain reads, a lone list read) says it is damage,
    naming thread and view; the other kind of view (a hash where a list was) still reads as
    empty, as view ops may turn one into the other."""
    from adapters import SessionStore
    from eventstore import HashGetAll, HashGetListed, ListRange, UnstampedViewError
    from projections import Projector

    ns = "dmg" + uuid.uuid4().hex[:10]
    url = with_query(any_redis_url, protocol=str(protocol))
    async with await connect(url, namespace=ns, partitions=2) as store:
        assert isinstance(store, RedisEventStore)
        sessions = SessionStore(store)
        await sessions.append("s", [{"role": "user", "content": "hi"}])
        key = store.keys.view("s", "transcript")
        projector = Projector(store)
        for kind in ("string", "set"):
            await store.client.delete(key)
            if kind == "string":
                await store.client.set(key, "x")
            else:
                await store.client.sadd(key, "x")
            with pytest.raises(UnstampedViewError, match="which no view is") as info:
                await sessions.load("s")
            assert (info.value.thread_id, info.value.view) == ("s", "transcript")
            with pytest.raises(UnstampedViewError, match="which no view is"):
                await store.read_list("s", "transcript")
            # The script: a read it alone makes (a hash's fields named by a list) beside it.
            for reads in (
                [HashGetAll("records"), ListRange("transcript")],
                [HashGetListed("records", "transcript")],
            ):
                with pytest.raises(UnstampedViewError, match="which no view is") as info:
                    await store.read_views("s", [*reads, HashGetListed("other", "none")])
                assert info.value.view == "transcript"
            report = await projector.check("s")  # check names it among the differences
            assert not report.ok and "which no view is" in str(report.differences), report
        await projector.rebuild("s")
        assert [m.text for m in (await sessions.load("s")).messages] == ["hi"]
        # The other kind of view is no damage: a hash where the list was reads as empty.
        await store.client.delete(key)
        await store.client.hset(key, "f", "1:1:x")
        assert (await sessions.load("s")).messages == []
        assert await store.read_list("s", "transcript") == []
