"""The fixtures that provide a real Redis and a real Redis Cluster, the shared `store` fixture,
and the anyio backend.

Redis: ``THREADLOG_TEST_REDIS_URL`` if set; else testcontainers when a Docker engine answers;
else a ``redis-server`` from PATH on a unix socket, stopped after the session
(``THREADLOG_REDIS_SERVER`` names another server binary: ``scripts/test-valkey`` runs the
suite on a ``valkey-server`` that way, its cluster and embedded servers included).

Redis Cluster: ``THREADLOG_TEST_CLUSTER_URL`` (``redis+cluster://h:p,h:p``) if set; else a local
cluster of three primaries started from ``redis-server`` and ``redis-cli`` on PATH, stopped
after the session.

Servers started here die with the test process however it ends (`eventstore.servers.spawn`): a
run killed outright, or ended by pytest-timeout's ``thread`` method, runs no teardown. Embedded
servers (which outlive their process by design) that tests start under the run's temporary
directories are stopped by a reaper process when the run ends, however it ends.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest

import eventstore as es
from eventstore.servers import (
    EmbeddedReaper,
    RedisServerError,
    TlsFiles,
    docker_engine_answers,
    make_tls_files,
    redis_cluster,
    redis_server,
    sentinel_group,
)

BACKENDS = ["memory", "redis", "cluster"]

# scripts/test-lowest installs no framework (their releases need newer core dependencies than
# the lowest it tests) and says so here; anywhere else a missing framework fails its tests.
WITHOUT_FRAMEWORKS = os.environ.get("THREADLOG_TEST_WITHOUT_FRAMEWORKS") == "1"
collect_ignore = (
    ["test_openai_agents.py", "test_langgraph.py", "test_framework_floors.py"]
    if WITHOUT_FRAMEWORKS
    else []
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "partitions(n): the partition count of the namespace the `store` fixture opens",
    )
    config.addinivalue_line(
        "markers", "frameworks: needs openai-agents or langgraph (scripts/test-lowest has none)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not WITHOUT_FRAMEWORKS:
        return
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        (dropped if item.get_closest_marker("frameworks") else kept).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    # redis-py's asyncio client runs on asyncio only.
    return "asyncio"


@pytest.fixture(scope="session", autouse=True)
def embedded_reaper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedReaper]:
    """Stops, when the run ends however it ends, every embedded server left running under the
    run's temporary directory or a root given to ``watch``: a killed run runs no teardown."""
    reaper = EmbeddedReaper.start(tmp_path_factory.getbasetemp())
    try:
        yield reaper
    finally:
        reaper.close()


def _started(what: str, start: Callable[[], AbstractContextManager[Any]]) -> Iterator[str]:
    """The ``url`` of what ``start()`` starts, for the session (stopped after it); a failure
    to start fails the tests that need it."""
    try:
        with start() as server:
            yield server.url
    except RedisServerError as exc:
        pytest.fail(f"no {what} available for the tests: {exc}")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A URL of a real Redis server for this test session."""
    given = os.environ.get("THREADLOG_TEST_REDIS_URL")
    if given:
        yield given
        return
    if docker_engine_answers():
        from testcontainers.redis import RedisContainer

        with RedisContainer("redis:7.0") as container:
            host = container.get_container_host_ip()
            port = container.get_exposed_port(6379)
            yield f"redis://{host}:{port}"
        return
    yield from _started("Redis", redis_server)


@pytest.fixture(scope="session")
def cluster_url() -> Iterator[str]:
    """A ``redis+cluster://`` URL of a real Redis Cluster for this test session."""
    given = os.environ.get("THREADLOG_TEST_CLUSTER_URL")
    if given:
        yield given
        return
    yield from _started("Redis Cluster", lambda: redis_cluster(primaries=3))


@pytest.fixture(scope="session")
def sentinel_url() -> Iterator[str]:
    """A ``redis+sentinel://`` URL of a real primary, replica and sentinel for this session."""
    given = os.environ.get("THREADLOG_TEST_SENTINEL_URL")
    if given:
        yield given
        return
    yield from _started("Redis Sentinel group", sentinel_group)


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A throwaway CA and the server and client certificates it signed (openssl CLI)."""
    try:
        return make_tls_files(tmp_path_factory.mktemp("tls"))
    except RedisServerError as exc:
        pytest.fail(f"cannot make test certificates: {exc}")


@pytest.fixture
def namespace() -> str:
    """A fresh namespace per test, so tests never see each other's threads."""
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[es.EventStore]:
    """A store on a fresh namespace: in memory, on standalone Redis, and on Redis Cluster.

    ``@pytest.mark.partitions(n)`` on the test (or its module or class) sets the namespace's
    partition count; the default is the store's own.
    """
    namespace = "s" + uuid.uuid4().hex[:12]
    marker = request.node.get_closest_marker("partitions")
    partitions: int | None = int(marker.args[0]) if marker is not None else None
    if request.param == "memory":
        opened: es.EventStore = es.MemoryEventStore(
            namespace=namespace, partitions=partitions or es.DEFAULT_PARTITIONS
        )
    else:
        url: str = request.getfixturevalue(
            "redis_url" if request.param == "redis" else "cluster_url"
        )
        opened = await es.connect(url, namespace=namespace, partitions=partitions)
    try:
        yield opened
    finally:
        await opened.close()
