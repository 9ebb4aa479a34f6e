"""The one fixture that provides a real Redis, and the anyio backend.

Order: ``THREADLOG_TEST_REDIS_URL`` if set; else testcontainers when a Docker engine answers;
else a ``redis-server`` from PATH on a unix socket, stopped after the session.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from eventstore.servers import RedisServerError, docker_engine_answers, redis_server


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    # redis-py's asyncio client runs on asyncio only.
    return "asyncio"


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
    try:
        with redis_server() as server:
            yield server.url
    except RedisServerError as exc:
        pytest.fail(f"no Redis available for the tests: {exc}")


@pytest.fixture
def namespace() -> str:
    """A fresh namespace per test, so tests never see each other's threads."""
    return "t" + uuid.uuid4().hex[:12]
