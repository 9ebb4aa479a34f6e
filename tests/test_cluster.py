"""Redis Cluster: the conformance suites on a real local cluster, and resharding under load.

The adapters' tests run on the cluster through the shared `store` fixture in conftest; this
module adds the eventstore and projections suites (by subclassing, as for standalone Redis) and
the one thing only a cluster can do: move slots between nodes while writers keep appending.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import pytest
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from adapters import Auditor
from eventstore import (
    EventStore,
    Message,
    MessageAppended,
    NewEvent,
    OperationalError,
    RedisEventStore,
    connect,
    open_store,
)
from eventstore._connect import StoreSettings
from eventstore._scripts import APPEND
from eventstore.servers import RedisCluster as RedisClusterServers
from eventstore.servers import redis_cluster
from eventstore.testing import EventStoreConformance, msg, read_all
from projections import Projector
from projections.testing import ProjectionConformance
from tests._redis_hooks import RedisHooks
from tests.test_security import with_query


async def _cached_on(client: RedisCluster, sha: str) -> list[str]:
    """The primaries that have script ``sha`` cached."""
    out = []
    for node in client.get_primaries():
        (found,) = await client.execute_command("SCRIPT EXISTS", sha, target_nodes=node)
        if found:
            out.append(node.name)
    return out


class TestClusterEventStore(RedisHooks, EventStoreConformance):
    @pytest.fixture(autouse=True)
    def _cluster(self, cluster_url: str) -> None:
        self.url = cluster_url

    async def make_store(self, namespace: str, **options: Any) -> EventStore:
        registry = options.pop("registry", None)
        settings = StoreSettings.from_url(self.url, namespace=namespace, **options)
        store = await open_store(settings, registry=registry)
        assert isinstance(store, RedisEventStore) and isinstance(store.client, RedisCluster)
        return store

    async def flush_scripts(self, store: EventStore) -> None:
        assert isinstance(store, RedisEventStore)
        # redis-py sends SCRIPT FLUSH to every primary; checked, because a script still cached
        # on the node serving the next call would hide a broken NOSCRIPT fallback.
        assert await store.client.script_flush()
        assert await _cached_on(store.client, APPEND.sha) == []


class TestResp3ClusterEventStore(TestClusterEventStore):
    """The same on RESP3 connections (``?protocol=3``)."""

    @pytest.fixture(autouse=True)
    def _cluster(self, cluster_url: str) -> None:
        self.url = with_query(cluster_url, protocol="3")


class TestClusterProjections(ProjectionConformance):
    @pytest.fixture(autouse=True)
    def _cluster(self, cluster_url: str) -> None:
        self.url = cluster_url

    async def make_store(self, namespace: str) -> EventStore:
        return await open_store(StoreSettings.from_url(self.url, namespace=namespace))

    async def delete_view(self, store: EventStore, thread_id: str, view: str) -> None:
        assert isinstance(store, RedisEventStore)
        assert await store.client.delete(store.keys.view(thread_id, view)) == 1


# -- resharding under write load -----------------------------------------------------------------

WRITERS = 8
THREADS = 64
PARTITIONS = 16
MOVED_BY_SETSLOT = 6  # partitions whose slot moves by hand (SETSLOT + MIGRATE), batch by batch
APPEND_DEADLINE_S = 30.0


@dataclass
class Ack:
    thread: str
    ids: list[str]
    first: int
    last: int
    duplicate: bool
    seconds: float


@dataclass
class Load:
    """What the writers did: acknowledged appends and the errors they retried past."""

    acks: list[Ack] = field(default_factory=list)
    retried: Counter[str] = field(default_factory=Counter)
    stop: anyio.Event = field(default_factory=anyio.Event)


def _error_kind(exc: Exception) -> str:
    text = str(exc)
    for kind in ("TRYAGAIN", "MOVED", "ASK", "CLUSTERDOWN", "TTL"):
        if kind in text:
            return kind
    return type(exc).__name__


async def _writer(store: EventStore, load: Load, w: int) -> None:
    projector = Projector(store)
    rng = random.Random(w)
    n = 0
    while not load.stop.is_set():
        thread = f"th-{rng.randrange(THREADS)}"
        news = [
            NewEvent(payload=MessageAppended(message=Message(role="user", content=f"{w}.{n}.{i}")))
            for i in range(rng.randint(1, 3))
        ]
        key = f"w{w}-{n}"
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                result = await projector.append(thread, news, idempotency_key=key)
                break
            except OperationalError as exc:  # StoreConnectionError and StoreTimeoutError too
                load.retried[_error_kind(exc)] += 1
                attempt += 1
                if time.monotonic() - started > APPEND_DEADLINE_S:
                    raise
                await anyio.sleep(min(0.01 * attempt, 0.2))
        load.acks.append(
            Ack(
                thread,
                [e.id for e in news],
                result.first_seq,
                result.last_seq,
                result.duplicate,
                time.monotonic() - started,
            )
        )
        n += 1


def _redirections(cluster: RedisClusterServers) -> Counter[str]:
    """The MOVED, ASK, TRYAGAIN and NOSCRIPT replies the nodes sent, summed over the nodes.

    (Plain ERR is left out: redis-py's ``CLIENT SETINFO`` on every new connection, which
    Redis 7.0 does not know, is most of it.)
    """
    total: Counter[str] = Counter()
    for node in cluster.nodes:
        with cluster.client(node) as c:
            for name, value in c.info("errorstats").items():
                kind = name.removeprefix("errorstat_")
                if kind in ("MOVED", "ASK", "TRYAGAIN", "NOSCRIPT"):
                    total[kind] += int(value["count"])
    return total


@pytest.mark.anyio
async def test_more_concurrent_calls_than_connections_wait_their_turn(cluster_url: str) -> None:
    """The cluster client's pools do not block: past its connection limit a command used to
    fail with MaxConnectionsError. Calls beyond it now wait, as on a standalone server."""
    store = await connect(cluster_url, namespace="mc" + uuid.uuid4().hex[:8])
    try:
        await store.append("t", [msg("x")])

        async def read() -> None:  # one thread: every read goes to the same node
            assert await store.version("t") == 1
            assert len(await read_all(store, "t")) == 1

        async def write(i: int) -> None:
            await store.append(f"w{i % 16}", [msg(str(i))])

        async with anyio.create_task_group() as tg:
            for i in range(400):
                tg.start_soon(read)
                tg.start_soon(write, i)
        assert sum([await store.version(f"w{i}") for i in range(16)]) == 400
    finally:
        await store.close()


@pytest.mark.slow
@pytest.mark.anyio
async def test_resharding_under_write_load_loses_nothing() -> None:
    """Slots move while 8 writers append: every acknowledged append is there exactly once.

    A private cluster (the test adds a node). Phase 1 moves the slots of six partitions to
    another primary by hand, two keys per MIGRATE with a pause between batches, so appends keep
    meeting a slot split between two nodes (ASK, and TRYAGAIN for a script whose keys are on
    both). Phase 2 scales out: a fourth primary joins and ``redis-cli --cluster reshard`` moves
    to it the lowest slots of one node, up to and including a partition's slot.
    """
    with redis_cluster(primaries=3) as cluster:
        namespace = "rs" + uuid.uuid4().hex[:8]
        store = await open_store(
            StoreSettings.from_url(cluster.url, namespace=namespace, partitions=PARTITIONS)
        )
        assert isinstance(store, RedisEventStore)
        slot_of = {p: key_slot(store.keys.feed(p).encode()) for p in range(PARTITIONS)}
        used = sorted({store.keys.partition(f"th-{i}") for i in range(THREADS)})
        load = Load()
        figures: dict[str, Any] = {}

        def reshard() -> None:
            time.sleep(0.5)  # let the load build up
            started = time.monotonic()
            keys = 0
            phase1 = used[:MOVED_BY_SETSLOT]
            for p in phase1:
                source = cluster.owner(slot_of[p])
                target = next(n for n in cluster.nodes if n is not source)
                keys += cluster.migrate_slot(
                    slot_of[p], target, batch=2, on_batch=lambda _: time.sleep(0.02)
                )
                assert cluster.owner(slot_of[p]) is target
            figures["phase1"] = {
                "partitions": len(phase1),
                "slots": len(phase1),
                "keys": keys,
                "seconds": round(time.monotonic() - started, 2),
            }
            started = time.monotonic()
            new = cluster.add_node()
            figures["add_node_seconds"] = round(time.monotonic() - started, 2)
            # redis-cli takes a source's lowest slots first: move enough to carry partition p2.
            p2 = next(p for p in used if p not in phase1)
            source = cluster.owner(slot_of[p2])
            slots = sorted(s for s, port in cluster.slot_map().items() if port == source.port)
            count = slots.index(slot_of[p2]) + 1
            carried = [p for p in range(PARTITIONS) if slot_of[p] in slots[:count]]
            started = time.monotonic()
            cluster.reshard(source, new, count)
            assert cluster.owner(slot_of[p2]) is new
            figures["phase2"] = {
                "slots": count,
                "partitions": len(carried),
                "seconds": round(time.monotonic() - started, 2),
            }
            time.sleep(0.5)  # and some load on the new layout

        try:
            started = time.monotonic()
            async with anyio.create_task_group() as tg:
                for w in range(WRITERS):
                    tg.start_soon(_writer, store, load, w)
                await anyio.to_thread.run_sync(reshard)
                load.stop.set()
            figures["seconds"] = round(time.monotonic() - started, 2)

            # Every acknowledged append is present exactly once, at the seqs it was given.
            acked: dict[str, tuple[str, int]] = {}
            for ack in load.acks:
                assert ack.last - ack.first + 1 == len(ack.ids)
                for offset, event_id in enumerate(ack.ids):
                    assert event_id not in acked
                    acked[event_id] = (ack.thread, ack.first + offset)
            stored: Counter[str] = Counter()
            where: dict[str, tuple[str, int]] = {}
            for i in range(THREADS):
                thread = f"th-{i}"
                events = await read_all(store, thread)
                assert [e.seq for e in events] == list(range(1, len(events) + 1)), thread
                assert len(events) == await store.version(thread)
                for e in events:
                    stored[e.id] += 1
                    where[e.id] = (thread, e.seq)
            lost = [i for i in acked if i not in stored]
            duplicated = [i for i, n in stored.items() if n > 1]
            unacked = [i for i in stored if i not in acked]
            assert lost == [] and duplicated == [] and unacked == []
            assert where == acked

            # The change feed holds every append once; views == fold(log); the chain verifies.
            feed: Counter[tuple[str, int]] = Counter()
            for p in range(PARTITIONS):
                after = "0-0"
                while entries := await store.read_feed(p, after=after):
                    for entry in entries:
                        for seq in range(entry.first_seq, entry.last_seq + 1):
                            feed[(entry.thread_id, seq)] += 1
                    after = entries[-1].id
            assert sorted(feed) == sorted(acked.values())
            assert set(feed.values()) == {1}
            verdicts = await Auditor(store).verify_all()
            assert len(verdicts) == len({a.thread for a in load.acks})
            assert all(v.ok for v in verdicts.values()), [v for v in verdicts.values() if not v.ok]
            checks = await Projector(store).check_all()
            assert all(c.ok for c in checks.values())

            figures.update(
                appends_acked=len(load.acks),
                events_acked=len(acked),
                events_present=sum(stored.values()),
                lost=len(lost),
                duplicated=len(duplicated),
                retry_duplicates=sum(a.duplicate for a in load.acks),
                client_retries=dict(load.retried),
                server_replies=dict(_redirections(cluster)),
                slowest_append_s=round(max(a.seconds for a in load.acks), 3),
            )
            print(f"\nreshard under load: {json.dumps(figures)}")
            assert figures["phase1"]["keys"] > 0 and figures["phase2"]["partitions"] >= 1
        finally:
            await store.close()
