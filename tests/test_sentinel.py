"""Redis Sentinel: ``redis+sentinel://`` URLs, and a store that outlives its primary.

The event-store and projection contracts through Sentinel run in test_conformance.py and
test_projections.py (`TestSentinelEventStore`, `TestSentinelProjections`); here, what is
Sentinel's own: the URL, and a primary that dies under a store that keeps writing.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest

from adapters import Auditor
from eventstore import (
    EventStore,
    InvalidURLError,
    OperationalError,
    RedisEventStore,
    StoreConnectionError,
    connect,
)
from eventstore._connect import StoreSettings, _redis_client
from eventstore._wire import pack_command
from eventstore.servers import (
    RedisServerError,
    SentinelGroup,
    TlsFiles,
    free_port,
    sentinel_group,
)
from eventstore.testing import message_texts, msg, read_all
from tests.test_cli import cli

pytestmark = pytest.mark.anyio


def _ns() -> str:
    return "sn" + uuid.uuid4().hex[:10]


async def _role(store: EventStore) -> str:
    """The replication role of the server the store writes to now."""
    assert isinstance(store, RedisEventStore)
    return str((await store.client.info("replication"))["role"])


# -- the URL ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "sentinels", "service", "db", "password", "sentinels_password"),
    [
        (
            "redis+sentinel://10.0.0.1:26379,10.0.0.2:26380/mymaster",
            [("10.0.0.1", 26379), ("10.0.0.2", 26380)],
            "mymaster",
            0,
            None,
            None,
        ),
        (
            "redis+sentinel://10.0.0.1/my-service?db=3",
            [("10.0.0.1", 26379)],
            "my-service",
            3,
            None,
            None,
        ),
        (
            "redis+sentinel://user:hunter2@[::1]:26379/mymaster?namespace=app&protocol=3",
            [("::1", 26379)],
            "mymaster",
            0,
            "hunter2",
            None,
        ),
        (
            "redis+sentinel://user:hunter2@h:26379/mymaster?sentinel_auth=same",
            [("h", 26379)],
            "mymaster",
            0,
            "hunter2",
            "hunter2",
        ),
    ],
)
async def test_a_sentinel_url_names_the_sentinels_the_service_and_the_primarys_settings(
    url: str,
    sentinels: list[tuple[str, int]],
    service: str,
    db: int,
    password: str | None,
    sentinels_password: str | None,
) -> None:
    settings = StoreSettings.from_url(url)
    assert "hunter2" not in repr(settings)
    client = _redis_client(settings)  # no connection is made until a command
    try:
        pool = client.connection_pool
        assert pool.service_name == service
        asked = [
            (
                s.connection_pool.connection_kwargs["host"],
                s.connection_pool.connection_kwargs["port"],
            )
            for s in pool.sentinel_manager.sentinels
        ]
        assert asked == sentinels
        assert pool.connection_kwargs["db"] == db
        assert pool.connection_kwargs["password"] == password
        assert [
            s.connection_pool.connection_kwargs.get("password")
            for s in pool.sentinel_manager.sentinels
        ] == [sentinels_password] * len(sentinels)
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://10.0.0.1:26379", "names the service"),
        ("redis+sentinel://10.0.0.1:26379/", "names the service"),
        ("redis+sentinel://10.0.0.1:26379/mymaster/3", r"the database goes in \?db="),
        ("redis+sentinel://10.0.0.1:99999/mymaster", "port out of range"),
        ("redis+sentinel://10.0.0.1:x/mymaster", "bad sentinel"),
        ("redis+sentinel://[::1/mymaster", "Invalid IPv6 URL"),
        ("redis+sentinel://[::1]x/mymaster", "bad sentinel"),
        ("redis+sentinel://10.0.0.1/mymaster?ssl_ca_certs=/ca.pem", "needs a rediss:// URL"),
        ("redis+sentinel://10.0.0.1/mymaster?db=-1", "db must be >= 0"),
        ("redis+sentinel://10.0.0.1/mymaster?sentinel_auth=yes", "sentinel_auth must be none"),
        ("redis://10.0.0.1?sentinel_auth=same", "how to log in to the sentinels"),
        ("rediss+sentinel://10.0.0.1/mymaster?ssl_cert_reqs=maybe", "ssl_cert_reqs must be"),
        ("redis+sentinels://10.0.0.1/mymaster", "unsupported URL scheme"),
    ],
)
def test_a_bad_sentinel_url_is_refused_saying_why(url: str, says: str) -> None:
    with pytest.raises(InvalidURLError, match=says):
        StoreSettings.from_url(url)


async def test_an_unknown_service_is_a_connection_error_naming_it(sentinel_url: str) -> None:
    url = sentinel_url.rsplit("/", 1)[0] + "/no-such-service"
    with pytest.raises(StoreConnectionError, match="No master found for 'no-such-service'") as e:
        await connect(url, namespace=_ns())
    assert "monitors no service 'no-such-service'" in str(e.value)  # asked of the sentinel
    assert "<redis" not in str(e.value)  # redis-py's repr of its client is left out


async def test_no_sentinel_answering_is_a_connection_error_saying_so() -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(StoreConnectionError, match=f"sentinel 127.0.0.1:{port}: .*111"):
        await connect(f"redis+sentinel://127.0.0.1:{port}/mymaster", namespace=_ns())
    assert time.monotonic() - started < 5.0  # not the connect timeout: it is refused at once


async def test_the_store_writes_to_the_primary_the_sentinels_name(sentinel_url: str) -> None:
    ns = _ns()
    async with await connect(sentinel_url, namespace=ns) as store:
        assert isinstance(store, RedisEventStore)
        await store.append("t", [msg("one"), msg("two")])
        assert await _role(store) == "master"
        assert message_texts(await read_all(store, "t")) == ["one", "two"]


def test_the_command_line_takes_a_sentinel_url(sentinel_url: str) -> None:
    ns = _ns()
    done = cli("demo", url=sentinel_url, namespace=ns)
    assert done.code == 0, done.err
    listed = cli("threads", url=sentinel_url, namespace=ns)
    assert listed.code == 0, listed.err
    assert listed.lines(), "the demo's threads are listed"
    checked = cli("verify", "--all", url=sentinel_url, namespace=ns)
    assert checked.code == 0, checked.out + checked.err


def test_sentinels_with_a_password_are_reached_with_sentinel_auth_same() -> None:
    """Sentinels that require a password (``requirepass`` in sentinel.conf, often the data
    nodes' own): without ``sentinel_auth=same`` they refuse to name the primary."""
    password = "pw-" + uuid.uuid4().hex[:8]
    with sentinel_group(password=password) as group:
        hosts = group.url.removeprefix("redis+sentinel://")
        authed = f"redis+sentinel://default:{password}@{hosts}"

        async def main() -> None:
            ns = _ns()
            async with await connect(authed + "?sentinel_auth=same", namespace=ns) as store:
                await store.append("t", [msg("in")])
                assert message_texts(await read_all(store, "t")) == ["in"]
            with pytest.raises(StoreConnectionError, match="refuses the login") as refused:
                await connect(authed, namespace=ns, connect_timeout=2.0)
            assert "add ?sentinel_auth=same" in str(refused.value)
            assert password not in str(refused.value)

        asyncio.run(main())


async def test_rediss_sentinel_speaks_tls_to_sentinels_and_primary(tls_files: TlsFiles) -> None:
    """Every node and sentinel serves TLS only on the ports the URL and the sentinels name;
    the store gets there, follows a failover there, and a plain URL to the same ports fails."""
    with sentinel_group(tls=tls_files) as group:
        assert group.url.startswith("rediss+sentinel://")
        ns = _ns()
        async with await connect(group.url, namespace=ns) as store:
            assert isinstance(store, RedisEventStore)
            await store.append("t", [msg("before")])
            pool = store.client.connection_pool
            assert all(
                s.connection_pool.connection_kwargs.get("ssl_ca_certs") == str(tls_files.ca_cert)
                for s in pool.sentinel_manager.sentinels
            )
            await asyncio.to_thread(group.wait_synced)
            await asyncio.to_thread(group.kill_primary)
            await store.append("t", [msg("after")])
            assert message_texts(await read_all(store, "t")) == ["before", "after"]
        plain = group.url.split("?", 1)[0].replace("rediss+", "redis+", 1)
        with pytest.raises(StoreConnectionError):
            await connect(plain, namespace=ns, connect_timeout=2.0)


# -- failover ---------------------------------------------------------------------------------


@pytest.fixture
def group() -> Iterator[SentinelGroup]:
    """A group of its own: the test kills its primary."""
    try:
        with sentinel_group(replicas=1, sentinels=1) as started:
            yield started
    except RedisServerError as exc:
        pytest.fail(f"no Redis Sentinel group for the failover test: {exc}")


async def test_a_store_follows_its_primary_to_the_promoted_replica(group: SentinelGroup) -> None:
    """The primary is killed under a store that keeps appending. Appends in flight across the
    failover succeed or fail with a typed error (never anything else); once a replica is
    promoted the same store appends again, and the thread's log stays gapless and verifies.
    What the replica had when the primary died survives: Redis replicates asynchronously,
    so an append acknowledged in the last moment before the kill may not (Redis's promise,
    not threadlog's to extend)."""
    ns = _ns()
    async with await connect(group.url, namespace=ns, connect_timeout=2.0) as store:
        for i in range(20):
            await store.append("t", [msg(f"before {i}")])
        await asyncio.to_thread(group.wait_synced)
        old_primary = group.primary_port()

        outcomes: list[str] = []
        stop = asyncio.Event()

        async def keep_appending() -> None:
            i = 0
            while not stop.is_set():
                try:
                    await store.append("t", [msg(f"during {i}")])
                    outcomes.append("ok")
                except OperationalError as exc:
                    outcomes.append(type(exc).__name__)
                    await asyncio.sleep(0.05)
                i += 1

        writer = asyncio.create_task(keep_appending())
        await asyncio.sleep(0.2)
        new_primary = await asyncio.to_thread(group.kill_primary)
        await asyncio.sleep(0.5)
        stop.set()
        await writer
        assert new_primary != old_primary
        assert "ok" in outcomes  # the writer ran before the kill (and perhaps after)
        assert set(outcomes) <= {"ok", "StoreConnectionError", "StoreTimeoutError"}

        # The same store, no reconnect by hand: it asks the sentinels again.
        after = await store.append("t", [msg("after")])
        assert await _role(store) == "master"
        events = await read_all(store, "t")
        assert [e.seq for e in events] == list(range(1, len(events) + 1))  # no gap, no dup
        texts = message_texts(events)
        assert texts[:20] == [f"before {i}" for i in range(20)]  # replicated before the kill
        assert texts[-1] == "after" and after.last_seq == len(events)
        report = await Auditor(store).verify("t")
        assert report.ok, report


async def test_a_store_follows_a_switchover_off_a_primary_that_lives_on(
    group: SentinelGroup,
) -> None:
    """The old primary is alive and a replica now: a connection to it is not broken, it
    answers every write with ``READONLY``. The store must leave it for the new primary, not
    fail on it for ever."""
    ns = _ns()
    async with await connect(group.url, namespace=ns) as store:
        for i in range(5):
            await store.append("t", [msg(f"before {i}")])
        await asyncio.to_thread(group.wait_synced)
        old_primary = group.primary_port()
        await asyncio.to_thread(group.switchover)
        assert group._role(old_primary) == "slave"
        for i in range(5):
            await store.append("t", [msg(f"after {i}")])
        texts = message_texts(await read_all(store, "t"))
        assert texts == [f"before {i}" for i in range(5)] + [f"after {i}" for i in range(5)]
        assert await _role(store) == "master"


async def test_an_append_retried_across_a_failover_writes_once(group: SentinelGroup) -> None:
    """A caller who did not hear back retries with the same idempotency key after the
    failover; an append that had reached the replica is answered from its ledger."""
    ns = _ns()
    async with await connect(group.url, namespace=ns) as store:
        first = await store.append("t", [msg("once")], idempotency_key="k-1")
        await asyncio.to_thread(group.wait_synced)
        await asyncio.to_thread(group.kill_primary)
        again = await store.append("t", [msg("once")], idempotency_key="k-1")
        assert again.last_seq == first.last_seq
        assert message_texts(await read_all(store, "t")) == ["once"]


async def test_a_held_connection_left_on_the_old_primary_is_not_read_from(
    group: SentinelGroup,
) -> None:
    """The store's held connections (its fast path for appends and view reads) are its own:
    redis-py does not drop them when it learns of a new primary. One that a switchover left on
    the old primary (a replica now: its reads may miss what was written to the new one) must
    reconnect before it is used again, once the store has found the new primary."""
    ns = _ns()
    async with await connect(group.url, namespace=ns) as store:
        assert isinstance(store, RedisEventStore)
        held = store._held
        assert held is not None  # the fast path runs on sentinel connections
        role = pack_command([b"ROLE"])

        async def roles() -> list[bytes]:
            # Two at once: each takes its own connection, so both held ones are used.
            replies = await asyncio.gather(held.exchange(role, 1), held.exchange(role, 1))
            return [reply[0][0] for reply in replies]

        assert await roles() == [b"master", b"master"]
        await store.append("t", [msg("before")])
        await asyncio.to_thread(group.wait_synced)
        await asyncio.to_thread(group.switchover)
        # A transaction whose script writes: on the old primary, its READONLY comes inside
        # EXEC's reply. The exchange leaves that connection for the new primary and runs it
        # there; the other held connection is still on the old primary.
        key = f"tl:{{{ns}:}}probe".encode()
        script = b"return redis.call('SET', KEYS[1], 'x')"
        multi = b"".join(
            (
                pack_command([b"MULTI"]),
                pack_command([b"EVAL", script, b"1", key]),
                pack_command([b"EXEC"]),
            )
        )
        assert (await held.exchange(multi, 3))[2] == [b"OK"]
        assert await store.client.get(key) == b"x"
        await store.append("t", [msg("after")])
        assert await roles() == [b"master", b"master"]
        assert message_texts(await read_all(store, "t")) == ["before", "after"]
