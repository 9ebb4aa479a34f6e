"""Settings from a URL, `connect()`, and the embedded private redis-server in ./.threadlog/."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import fcntl
import hashlib
import logging
import math
import os
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio import BlockingConnectionPool
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import (
    Sentinel,
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import PRIMARY
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._aof import AofRepairError, repair_aof
from ._binaries import is_server_process_name, server_binary
from ._codec import DEFAULT_MAX_EVENT_BYTES, check_secret
from ._contract import EventStore
from ._errors import (
    ConnectTimeoutError,
    InvalidInputError,
    InvalidURLError,
    OperationalError,
    StoreConnectionError,
    StoreTimeoutError,
    UnsafeServerError,
)
from ._events import EventRegistry
from ._ids import validate_namespace
from ._keys import DEFAULT_PARTITIONS
from ._memory import MemoryEventStore, MemoryServer
from ._redis import RedisEventStore, _call, translate_redis_error

log = logging.getLogger("threadlog")

URL_ENV = "THREADLOG_URL"
SECRET_ENV = "THREADLOG_SECRET"
EMBEDDED_DIR = Path(".threadlog")
_SCHEMES = (
    "memory",
    "redis",
    "rediss",
    "unix",
    "redis+cluster",
    "rediss+cluster",
    "redis+sentinel",
    "rediss+sentinel",
)


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """Everything needed to open a store; build it with `from_url`.

    ``url`` schemes: ``memory://[name]``, ``redis://``, ``rediss://`` (TLS), ``unix:///path``,
    ``redis+cluster://host:port[,host:port...]`` and ``rediss+cluster://`` (Redis Cluster, whose
    only database is 0: a path other than ``/`` or ``/0`` is refused), and
    ``redis+sentinel://host:port[,host:port...]/service`` and ``rediss+sentinel://`` (Redis
    Sentinel, the second with TLS to sentinels and data nodes alike: the store writes to
    the primary the sentinels name for ``service``, and follows a failover; credentials in the
    URL are the primary's, and the sentinels' too with ``sentinel_auth=same``; by default the
    sentinels are asked without any).
    Query parameters ``namespace`` and ``partitions`` override the defaults, and so do
    ``socket_timeout`` and ``connect_timeout`` on Redis; ``protocol`` (``2``, the default, or
    ``3`` for RESP3), ``db`` (standalone Redis) and
    ``ssl_cert_reqs`` / ``ssl_ca_certs`` / ``ssl_certfile`` / ``ssl_keyfile`` (``rediss``) go
    to redis-py. Any other parameter, or one the scheme would not use, is refused rather than
    ignored; so is a field out of range, whether it comes from the URL (`InvalidURLError`) or
    is given directly (`InvalidInputError`).
    """

    url: str
    namespace: str = "default"
    partitions: int | None = None
    max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
    secret: bytes | None = None
    socket_timeout: float = 5.0
    # Bounds opening a store's first contact as a whole (TCP connect, TLS handshake, PING, and
    # redis-py's retries of them): a port that accepts and never answers is a
    # `ConnectTimeoutError` after this long, not after every retry's own socket timeout.
    connect_timeout: float = 5.0
    retries: int = 3
    # Connections per store (standalone Redis); callers beyond it wait for one to free up.
    max_connections: int = 64
    # Group commit: appends issued within one event-loop tick share one pipeline of at most
    # this many scripts (1 turns group commit off).
    max_batch: int = 64

    def __post_init__(self) -> None:
        for name in _CHECKED:
            _check_setting(name, getattr(self, name))

    @property
    def scheme(self) -> str:
        return urlsplit(self.url).scheme

    def __repr__(self) -> str:
        # Settings get logged; the password and the chain secret must not be.
        secret = "***" if self.secret is not None else "None"
        return (
            f"StoreSettings(url={redact(self.url)!r}, namespace={self.namespace!r}, "
            f"partitions={self.partitions!r}, max_event_bytes={self.max_event_bytes}, "
            f"secret={secret}, socket_timeout={self.socket_timeout}, "
            f"connect_timeout={self.connect_timeout}, retries={self.retries}, "
            f"max_batch={self.max_batch}, max_connections={self.max_connections})"
        )

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> StoreSettings:
        """Parse ``url``; keyword overrides win over query parameters.

        Raises `InvalidURLError` for an unknown scheme, a malformed host, port, path or node
        list, and unknown, unused or malformed parameters; `InvalidInputError` for a malformed
        override.
        """
        if not isinstance(url, str) or "://" not in url:
            raise InvalidURLError(f"not a store URL: {_mask(str(url))!r}")
        try:
            parts = urlsplit(url)
            query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
        except ValueError as exc:
            raise InvalidURLError(f"bad store URL {_mask(url)!r}: {exc}") from None
        if parts.scheme not in _SCHEMES:
            raise InvalidURLError(
                f"unsupported URL scheme {parts.scheme!r}; use one of {', '.join(_SCHEMES)}"
            )
        _check_location(parts)
        unknown = sorted(set(query) - _PARAMS)
        if unknown:
            # A silently ignored typo (``namespce=``) would write into another tenant's data.
            raise InvalidURLError(
                f"unknown URL parameter {unknown[0]!r}; known: {', '.join(sorted(_PARAMS))}"
            )
        unused = sorted(set(query) - _scheme_params(parts.scheme))
        if unused:
            raise InvalidURLError(
                f"URL parameter {unused[0]!r} has no meaning for a {parts.scheme}:// URL "
                f"({_PARAM_USE[unused[0]]})"
            )
        repeated = sorted(k for k, v in query.items() if len(v) > 1)
        if repeated:
            # The last one won, silently: namespace=a&namespace=b wrote into b.
            given = ", ".join(repr(v) for v in query[repeated[0]])
            raise InvalidURLError(
                f"URL parameter {repeated[0]!r} is given {len(query[repeated[0]])} times "
                f"({given}): give it once"
            )
        last = {k: v[-1] for k, v in query.items()}
        values: dict[str, Any] = {}
        try:
            if "namespace" in last:
                values["namespace"] = validate_namespace(last["namespace"])
            if "partitions" in last:
                values["partitions"] = _url_number(int, "partitions", last["partitions"])
            for name in ("socket_timeout", "connect_timeout"):
                if name in last:
                    values[name] = _url_number(float, name, last[name])
            for name, value in values.items():
                _check_setting(name, value)
            if "db" in last and _url_number(int, "db", last["db"]) < 0:
                raise ValueError("db must be >= 0")
            if "protocol" in last and last["protocol"] not in ("2", "3"):
                raise ValueError(
                    f"protocol must be 2 (RESP2, the default) or 3 (RESP3), not "
                    f"{last['protocol']!r}"
                )
            if "sentinel_auth" in last and last["sentinel_auth"] not in _SENTINEL_AUTH:
                raise ValueError(
                    "sentinel_auth must be none (the sentinels ask for no password, the "
                    "default) or same (they take the URL's user and password, as the primary "
                    f"does), not {last['sentinel_auth']!r}"
                )
            if "ssl_cert_reqs" in last and last["ssl_cert_reqs"] not in _CERT_REQS:
                raise ValueError(f"ssl_cert_reqs must be one of {', '.join(_CERT_REQS)}")
            for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
                if key in last and not last[key]:
                    raise ValueError(f"{key} must name a file")
        except ValueError as exc:  # InvalidNamespaceError is a ValueError too
            raise InvalidURLError(f"bad URL parameter: {exc}") from None
        # Overrides are checked by the constructor (InvalidInputError, not a URL error).
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(url=url, **values)


_PARAMS = frozenset(
    {
        "namespace",
        "partitions",
        "socket_timeout",
        "connect_timeout",
        "db",
        "protocol",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_certfile",
        "ssl_keyfile",
        "sentinel_auth",
    }
)
_TLS_PARAMS = frozenset({"ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile"})
# Why a parameter is refused on a scheme that would not use it.
_PARAM_USE = {
    "socket_timeout": "it is a Redis connection setting",
    "connect_timeout": "it is a Redis connection setting",
    "protocol": "it is a Redis connection setting",
    "db": "a database number is for standalone Redis (or Sentinel); Redis Cluster has only "
    "database 0",
    **{k: "it is a TLS setting: it needs a rediss:// URL" for k in _TLS_PARAMS},
    "sentinel_auth": "it says how to log in to the sentinels of a redis+sentinel:// URL",
}
_SENTINEL_AUTH = ("none", "same")
_CERT_REQS = ("none", "optional", "required")  # what redis-py accepts for ssl_cert_reqs
# The settings checked whenever a `StoreSettings` is made, from a URL or given directly.
_CHECKED = (
    "namespace",
    "partitions",
    "max_event_bytes",
    "secret",
    "socket_timeout",
    "connect_timeout",
    "retries",
    "max_connections",
    "max_batch",
)


def _scheme_params(scheme: str) -> frozenset[str]:
    """The query parameters a URL of ``scheme`` uses."""
    if scheme == "memory":
        return frozenset({"namespace", "partitions"})
    params = {"namespace", "partitions", "socket_timeout", "connect_timeout", "protocol"}
    if not scheme.endswith("+cluster"):
        params.add("db")
    if scheme.startswith("rediss"):
        params |= _TLS_PARAMS
    if scheme.endswith("+sentinel"):
        params.add("sentinel_auth")
    return frozenset(params)


def _url_number(kind: Callable[[str], Any], name: str, text: str) -> Any:
    """``text`` (a URL parameter's value) as ``kind``: a ValueError that names the parameter
    and what it takes (Python's own words name neither: "could not convert string to float")."""
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number of seconds"
        raise ValueError(f"{name} must be {what}, not {text!r}") from None


def _check_setting(name: str, value: Any) -> None:
    """Raise `InvalidInputError` if ``value`` is no valid setting ``name``.

    The same check for a URL parameter and a keyword argument: a timeout of -1 or NaN, or an
    event size limit of 0, given as a keyword was accepted and then failed every call."""
    if name == "namespace":
        if not isinstance(value, str):
            raise InvalidInputError(f"namespace must be a string, not {type(value).__name__}")
        validate_namespace(value)
    elif name == "secret":
        check_secret(value)  # bytes, never empty: None is no key
    elif name in ("socket_timeout", "connect_timeout"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidInputError(f"{name} must be a number of seconds, not {value!r}")
        if not 0 < value < math.inf:
            raise InvalidInputError(f"{name} must be a positive number of seconds, not {value}")
    elif value is not None or name != "partitions":
        low, high = _INT_RANGES[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidInputError(f"{name} must be an integer, not {value!r}")
        if not low <= value <= high:
            raise InvalidInputError(f"{name} must be in {low}..{high}, not {value}")


_INT_RANGES = {
    "partitions": (1, 16384),
    # Redis refuses bulk strings above 512 MiB (proto-max-bulk-len).
    "max_event_bytes": (1, 512 * 1024 * 1024),
    "retries": (0, 1000),
    "max_connections": (1, 1_000_000),
    "max_batch": (1, 1_000_000),
}


def _mask(text: str) -> str:
    """``text`` with everything before its last ``@`` hidden: a password may hide there."""
    return "***@" + text.rsplit("@", 1)[1] if "@" in text else text


def _check_location(parts: SplitResult) -> None:
    """Reject what redis-py would misread or silently ignore in the host, port and path."""
    scheme = parts.scheme
    if scheme == "memory":
        return
    if scheme == "unix":
        if parts.hostname or not parts.path.startswith("/"):
            raise InvalidURLError("a unix URL takes an absolute socket path: unix:///path/to.sock")
        return
    if scheme.endswith("+sentinel"):
        _host_ports(parts, "sentinel", SENTINEL_PORT)
        _sentinel_service(parts)
        return
    if scheme.endswith("+cluster"):
        _host_ports(parts)
        # redis-py's cluster client ignores the path: a /3 would silently write database 0.
        db = parts.path.strip("/")
        if db not in ("", "0"):
            raise InvalidURLError(
                f"the path of a cluster URL can only name database 0 (Redis Cluster has no "
                f"other), not {db!r}: drop the path"
            )
        return
    try:
        port = parts.port
    except ValueError as exc:
        raise InvalidURLError(f"bad port in redis URL: {exc}") from None
    if port == 0:
        raise InvalidURLError("bad port in redis URL: 0")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise InvalidURLError(f"the path of a redis URL is a database number, not {db!r}")


SENTINEL_PORT = 26379  # Redis Sentinel's default port


def _host_ports(
    parts: SplitResult, what: str = "cluster node", default_port: int = 6379
) -> list[tuple[str, int]]:
    """The ``host:port`` nodes of a cluster or sentinel URL (no host: loopback; no port:
    ``default_port``); ``what`` names one in errors."""
    nodes = []
    for hostport in parts.netloc.rsplit("@", 1)[-1].split(","):
        if hostport.startswith("["):  # an IPv6 address: [::1] or [::1]:7000
            host, bracket, port = hostport[1:].partition("]")
            if not bracket or (port and not port.startswith(":")):
                raise InvalidURLError(f"bad {what} {hostport!r}")
            port = port[1:]
        else:
            host, sep, port = hostport.rpartition(":")
            if not sep:
                host, port = hostport, ""
        try:
            number = int(port or default_port)
        except ValueError:
            raise InvalidURLError(f"bad {what} {hostport!r}") from None
        if not 1 <= number <= 65535:
            raise InvalidURLError(f"bad {what} {hostport!r}: port out of range")
        nodes.append((host or "127.0.0.1", number))
    return nodes


def _sentinel_service(parts: SplitResult) -> str:
    """The service (master) name a sentinel URL's path names: ``/mymaster``."""
    service = unquote(parts.path.strip("/"))
    if not service or "/" in service or any(c.isspace() or not c.isprintable() for c in service):
        raise InvalidURLError(
            "a sentinel URL names the service its sentinels monitor as its path, one segment: "
            f"redis+sentinel://host:26379/mymaster (not {parts.path!r}); the database goes "
            "in ?db="
        )
    return service


def redact(url: str) -> str:
    """``url`` with any password replaced, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = parts.username or ""
    return url.replace(netloc[0] + "@", f"{user}:***@", 1)


async def connect(
    url: str | None = None,
    *,
    namespace: str | None = None,
    partitions: int | None = None,
    registry: EventRegistry | None = None,
    max_event_bytes: int | None = None,
    secret: bytes | None = None,
    socket_timeout: float | None = None,
    connect_timeout: float | None = None,
    max_batch: int | None = None,
    embedded_dir: str | os.PathLike[str] | None = None,
    create_namespace: bool = True,
) -> EventStore:
    """Open an event store: ``async with await connect(...) as store:``, or `close` it.

    ``url``: ``redis://[user:password@]host[:port][/db]``, ``rediss://`` (TLS),
    ``unix:///path/to/redis.sock``, ``redis+cluster://host:port,host:port`` or
    ``memory://[name]`` (in this process only); ``?namespace=`` in the URL or ``namespace``
    here (default ``default``) names the tenant whose keys the store reads and writes.
    With no ``url`` and no ``THREADLOG_URL``, starts (or reuses) a private redis-server under
    ``./.threadlog/`` when the binary exists, else falls back to the in-memory backend;
    starting one, or falling back, is logged as a WARNING on the ``threadlog`` logger (stderr
    when logging is not configured). That server keeps running after the process exits:
    `stop_embedded` stops it.

    A store on Redis belongs to the event loop it was opened in: open one per loop (each
    ``asyncio.run`` or ``anyio.run`` is a new loop), inside it; used from a loop that has
    closed since, it raises `StoreClosedError`.

    ``secret`` (default: ``THREADLOG_SECRET``) keys the integrity chain;
    without either the chain is unkeyed. An empty secret, or ``THREADLOG_SECRET`` set to
    nothing, is refused (`InvalidInputError`), not taken as no key.
    A namespace's partition count is recorded in Redis the first time a store opens it;
    ``create_namespace=False`` is for readers (audits, listings): a namespace never written
    is then left without any key, and reads as empty. Do not write through such a store.

    ``connect_timeout`` (default 5 s; ``?connect_timeout=`` in the URL) bounds the first
    contact with the server as a whole, TLS handshake and retries included; ``socket_timeout``
    (default 5 s) bounds each command after that.

    Raises `InvalidURLError` for a bad URL (and for ``THREADLOG_URL`` set but empty, which is
    no URL rather than none), `StoreConnectionError` if the server does not
    answer (`ConnectTimeoutError`, which names the URL without its password and the timeout,
    when nothing answered within ``connect_timeout``), and `UnsafeServerError` for a server
    that may evict any key.
    """
    if secret is None and SECRET_ENV in os.environ:
        if not os.environ[SECRET_ENV]:
            # Set to nothing (a template whose key was never filled in) read as unset, and
            # chains were written unkeyed while the deployment meant them keyed.
            raise InvalidInputError(
                f"{SECRET_ENV} is set but empty, which is no key: set it to the chain key, or "
                "unset it to write and verify without one"
            )
        secret = os.environ[SECRET_ENV].encode("utf-8")
    overrides = {
        "namespace": namespace,
        "partitions": partitions,
        "max_event_bytes": max_event_bytes,
        "secret": secret,
        "socket_timeout": socket_timeout,
        "connect_timeout": connect_timeout,
        "max_batch": max_batch,
    }
    # Checked before the embedded server may be started for a call that cannot succeed.
    for name, value in overrides.items():
        if value is not None:
            _check_setting(name, value)
    if url is None:
        url = os.environ.get(URL_ENV)
        if url is not None and not url.strip():
            # Set to nothing (`THREADLOG_URL=${REDIS_URL}` with REDIS_URL unset) read as unset,
            # a deployment would write to a new redis-server in its working directory instead
            # of its Redis, and read its empty data as the truth.
            raise InvalidURLError(
                f"{URL_ENV} is set but empty: set it to the store's URL, or unset it for the "
                "embedded server"
            )
        if url is None:
            # Blocking work (a lock wait, starting a daemon, polling its socket): off the loop.
            url = await asyncio.to_thread(embedded_url, embedded_dir or EMBEDDED_DIR)
    settings = StoreSettings.from_url(url, **overrides)
    return await open_store(settings, registry=registry, create_namespace=create_namespace)


async def open_store(
    settings: StoreSettings,
    *,
    registry: EventRegistry | None = None,
    create_namespace: bool = True,
) -> EventStore:
    """Open the store ``settings`` describe (``create_namespace``: see `connect`)."""
    parts = urlsplit(settings.url)
    if parts.scheme == "memory":
        name = (parts.netloc + parts.path).strip("/")
        server = MemoryServer.named(name) if name else MemoryServer()
        memory = MemoryEventStore(
            namespace=settings.namespace,
            partitions=settings.partitions or DEFAULT_PARTITIONS,
            registry=registry,
            max_event_bytes=settings.max_event_bytes,
            secret=settings.secret,
            server=server,
        )
        # The same rule as `RedisEventStore.ensure_namespace`: an explicit count must agree.
        if settings.partitions is not None and memory.partitions != settings.partitions:
            await memory.close()
            raise InvalidInputError(
                f"namespace {settings.namespace!r} has {memory.partitions} partitions, "
                f"not {settings.partitions}"
            )
        return memory
    client = _redis_client(settings)
    store = RedisEventStore(
        client,
        namespace=settings.namespace,
        partitions=settings.partitions or DEFAULT_PARTITIONS,
        registry=registry,
        max_event_bytes=settings.max_event_bytes,
        secret=settings.secret,
        max_batch=settings.max_batch,
    )
    try:
        await _first_contact(client, settings)
        await _refuse_evicting_server(client, settings.url)
        await store.ensure_namespace(
            explicit_partitions=settings.partitions is not None, create=create_namespace
        )
    except ConnectTimeoutError:
        await store.close()
        raise  # already names the URL and the timeout
    except OperationalError as exc:
        hint = _tls_hint(settings) if isinstance(exc, StoreTimeoutError) else ""
        hint += await _sentinel_hint(client)
        await store.close()
        raise StoreConnectionError(
            f"cannot use redis at {redact(settings.url)}: "
            f"{_strip_url(str(exc), settings.url)}{hint}"
        ) from None
    except BaseException:
        await store.close()
        raise
    return store


async def _first_contact(client: Any, settings: StoreSettings) -> None:
    """PING the server, bounded as a whole by ``connect_timeout``.

    redis-py bounds each attempt only (``socket_connect_timeout`` for the TCP connect and the
    TLS handshake, ``socket_timeout`` for the reply), and retries a timeout ``retries`` times:
    a port that accepts and never answers held `connect` ~20 s with the defaults.
    """
    bound = asyncio.timeout(settings.connect_timeout)
    try:
        async with bound:
            await _call(client.ping())
    except TimeoutError:
        if not bound.expired():
            raise  # one attempt's own timeout (a StoreTimeoutError): reported as before
        raise ConnectTimeoutError(
            redact(settings.url),
            settings.connect_timeout,
            _tls_hint(settings) + await _sentinel_hint(client),
        ) from None


async def _sentinel_hint(client: Any, bound: float = 1.0) -> str:
    """Why the sentinels of a sentinel client named no primary, asked of each in turn (within
    ``bound`` seconds): redis-py keeps its reasons to itself and says only "No master found",
    or, retrying that until the connect timeout, nothing at all. Empty when one names a
    primary (the trouble is elsewhere) or the client has no sentinels."""
    pool = getattr(client, "connection_pool", None)
    if not isinstance(pool, SentinelConnectionPool):
        return ""
    problems: list[str] = []
    service = pool.service_name
    try:
        async with asyncio.timeout(bound):
            for sentinel in pool.sentinel_manager.sentinels:
                kwargs = sentinel.connection_pool.connection_kwargs
                where = f"{kwargs.get('host')}:{kwargs.get('port')}"
                try:
                    named = await sentinel.execute_command(
                        "SENTINEL", "GET-MASTER-ADDR-BY-NAME", service
                    )
                except redis.exceptions.AuthenticationError as exc:
                    login = (
                        "add ?sentinel_auth=same to log in with the URL's user and password"
                        if kwargs.get("password") is None
                        else "the URL's user and password are not theirs"
                    )
                    problems.append(f"sentinel {where} refuses the login ({exc}): {login}")
                except (redis.exceptions.RedisError, OSError) as exc:
                    problems.append(f"sentinel {where}: {exc}")
                else:
                    if named:
                        return ""
                    problems.append(f"sentinel {where} monitors no service {service!r}")
    except TimeoutError:
        problems.append(f"no more answers within {bound:g} s")
    return " (" + "; ".join(problems) + ")" if problems else ""


def _tls_hint(settings: StoreSettings) -> str:
    """What a timeout means on a TLS URL: a plain server never answers a TLS handshake, and
    "timed out" alone sends the user looking at the network."""
    if not settings.scheme.startswith("rediss"):
        return ""
    return (
        " (a server that does not speak TLS never answers the TLS handshake: use "
        f"{settings.scheme.replace('rediss', 'redis', 1)}:// for a plain server)"
    )


# Policies that delete any key under memory pressure. The volatile-* ones delete only keys with
# a TTL; threadlog sets one only on the staging keys of a chunked view load, and the load checks
# that each staging key still holds everything it was sent before it swaps it in.
_EVICTING_POLICIES = frozenset({"allkeys-lru", "allkeys-lfu", "allkeys-random"})


async def _refuse_evicting_server(client: Any, url: str) -> None:
    """`UnsafeServerError` when the server (any primary of a cluster) may evict any key.

    Asked once, when a store opens (``INFO memory``): a policy changed later is not seen. A
    user the server does not allow ``INFO`` (a tenant confined by ACL), or a server that has
    renamed it away (``rename-command``, as hardened deployments do), opens unchecked.
    """
    try:
        if isinstance(client, RedisCluster):
            reply = await client.info("memory", target_nodes=RedisCluster.PRIMARIES)
            # One node's reply is returned as it is; several come keyed by node name.
            infos = list(reply.values()) if "maxmemory_policy" not in reply else [reply]
        else:
            infos = [await client.info("memory")]
    except redis.exceptions.NoPermissionError:
        return
    except redis.exceptions.ResponseError as exc:
        if str(exc).lower().startswith("unknown command"):
            return
        raise translate_redis_error(exc) from exc
    except (redis.exceptions.RedisError, OSError) as exc:
        raise translate_redis_error(exc) from exc
    for info in infos:
        policy = str(info.get("maxmemory_policy", "")) if isinstance(info, dict) else ""
        if policy in _EVICTING_POLICIES:
            raise UnsafeServerError(redact(url), policy)


def _strip_url(message: str, url: str) -> str:
    return message.replace(url, redact(url))


class _ClusterClient(RedisCluster):
    """redis-py's cluster client, able to follow an ASK to a primary that serves no slot yet,
    and waiting for a free connection instead of failing when all are busy.

    While a reshard moves a slot onto a newly added node, the slot's owner answers ASK with that
    node's address. redis-py (8.1) looks the address up among the nodes ``CLUSTER SLOTS`` listed,
    which a slotless node is not, and fails with AttributeError (redis/redis-py#4015). This adds
    the node as its MOVED handling does for a new owner. (The other callers that look a node up
    by name, ``set_default_node`` and sharded pub/sub, are not used by threadlog.)

    Its connection pools do not block: a command that finds ``max_connections`` busy on its
    node fails with MaxConnectionsError, so 200 concurrent reads failed where the standalone
    store (a blocking pool) makes them wait. Here at most ``max_connections`` commands and
    pipelines are in flight at once (each holds at most one connection per node); the others
    wait for a turn, up to the socket timeout, as the standalone pool's callers do.
    """

    def __init__(self, *, max_connections: int, wait_s: float | None, **kwargs: Any) -> None:
        super().__init__(max_connections=max_connections, **kwargs)
        self._turns = asyncio.Semaphore(max_connections)
        self._wait_s = wait_s

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self._wait_s):
                await self._turns.acquire()
        except TimeoutError:
            raise MaxConnectionsError(
                f"no free connection within {self._wait_s} s (max_connections per node)"
            ) from None
        try:
            yield
        finally:
            self._turns.release()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with self._turn():
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        pipe = super().pipeline(transaction, shard_hint)
        run = pipe.execute

        async def execute(raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
            async with self._turn():
                return await run(raise_on_error, allow_redirections)

        pipe.execute = execute  # type: ignore[method-assign]
        return pipe

    def get_node(
        self, host: str | None = None, port: int | None = None, node_name: str | None = None
    ) -> ClusterNode | None:
        node = super().get_node(host, port, node_name)
        if node is None and node_name and ":" in node_name:
            manager = self.nodes_manager
            address, _, number = node_name.rpartition(":")
            node = ClusterNode(address, int(number), PRIMARY, **manager.connection_kwargs)
            manager.set_nodes(manager.nodes_cache, {node.name: node})
        return node


_RETRYING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "threadlog_retrying", default=False
)


class _OutermostRetry(Retry):
    """redis-py's retry, taken only by the outermost call in a task: within a retried call
    another (the reconnect that an attempt makes, which redis-py 8 retries as a whole) makes
    one attempt, and a failure goes to the outer loop.

    Retried inside each retry, reconnecting to a server that takes connections and answers
    nothing (stopped, paused, swapped out) held a held-connection append ~19 socket timeouts
    (3.7 s at ``socket_timeout=0.2``; ~66 s at the default 5 s) instead of ~4.
    """

    async def call_with_retry(  # across redis-py 6 and 8: the rest passed on as given
        self,
        do: Callable[[], Awaitable[Any]],
        fail: Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if not _RETRYING.get():
            token = _RETRYING.set(True)
            try:
                return await super().call_with_retry(do, fail, *args, **kwargs)
            finally:
                _RETRYING.reset(token)
        try:
            return await do()
        except self._supported_errors as error:
            # The failure handler as the loop calls it (redis-py 8 may ask for the count).
            with_count = kwargs.get("with_failure_count", args[1] if len(args) > 1 else False)
            await (fail(error, 1) if with_count else fail(error))
            raise


def _redis_client(settings: StoreSettings) -> Any:
    retry = _OutermostRetry(ExponentialBackoff(cap=0.5, base=0.02), settings.retries)
    common: dict[str, Any] = {
        "decode_responses": False,
        "socket_timeout": settings.socket_timeout,
        "socket_connect_timeout": settings.connect_timeout,
        "retry": retry,
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }
    parts = urlsplit(settings.url)
    # Strip threadlog's own query parameters; redis-py rejects what it does not know.
    base_url = settings.url.split("?", 1)[0]
    extra: dict[str, Any] = {}
    query = parse_qs(parts.query)
    for key in ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        if key in query:
            extra[key] = query[key][-1]
    if "protocol" in query:
        # RESP3 replies come as redis-py parses them (maps for XREAD, ...), which the store
        # reads either way; its own fast paths (held connections, packed view loads) read
        # the replies of their own commands, the same objects on both (`_wire`).
        common["protocol"] = int(query["protocol"][-1])
    if parts.scheme.endswith("+sentinel"):
        return _sentinel_client(settings, parts, common, query, extra)
    if parts.scheme.endswith("+cluster"):
        return _ClusterClient(
            startup_nodes=[ClusterNode(host, port) for host, port in _host_ports(parts)],
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
            ssl=parts.scheme.startswith("rediss"),
            # A MOVED reply names the slot's new owner: patch that one slot. The default (a full
            # re-initialization every 5th MOVED) disconnects every node's connections, including
            # those other tasks are using mid-command; during a reshard under load that surfaces
            # as AttributeError from inside redis-py (8.1), not as a redis error.
            reinitialize_steps=0,
            max_connections=settings.max_connections,
            wait_s=settings.socket_timeout,
            **common,
            **(extra if parts.scheme.startswith("rediss") else {}),
        )
    if "db" in query:
        extra["db"] = int(query["db"][-1])
    try:
        # A blocking pool: under a burst of concurrent calls, callers wait (up to the socket
        # timeout) for a free connection instead of failing with "Too many connections".
        pool = BlockingConnectionPool.from_url(
            base_url,
            max_connections=settings.max_connections,
            timeout=settings.socket_timeout,
            **common,
            **extra,
        )
        return aioredis.Redis.from_pool(pool)
    except ValueError as exc:
        raise InvalidURLError(f"bad redis URL {redact(settings.url)!r}: {exc}") from None


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """redis-py's sentinel pool (each new connection asks the sentinels for the primary, and
    one that finds the old primary demoted is dropped), waiting for a free connection when all
    are busy, as the standalone store's pool does, instead of failing ("Too many connections")
    under a burst of concurrent calls."""


class _SentinelConnection(SentinelManagedConnection):
    """redis-py's sentinel connection, asking the sentinels where the primary is whenever it
    connects, also when redis-py reconnects it to retry a command.

    redis-py (8.1) asks only in ``connect``; a retried command reconnects through
    ``connect_check_health`` instead, to the address the connection had: after a failover,
    every retry went back to the old primary (a replica now: ``READONLY`` again) and the
    command failed (redis/redis-py#3874).
    """

    _addressed = False  # within connect_to: the sentinels were just asked

    async def connect_to(self, address: tuple[str, int]) -> None:
        self._addressed = True
        try:
            await super().connect_to(address)  # type: ignore[no-untyped-call]  # redis-py: untyped
        finally:
            self._addressed = False

    async def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if not (self._addressed or self.is_connected) and self.connection_pool.is_master:
            self.host, self.port = await self.connection_pool.get_master_address()
        await super().connect_check_health(check_health, retry_socket_connect)


class _SentinelTlsConnection(_SentinelConnection, SentinelManagedSSLConnection):
    """`_SentinelConnection` over TLS."""


class _SentinelPrimary(aioredis.Redis):
    """A client of the primary a sentinel pool finds: closing it closes the pool and the
    clients that ask the sentinels too (redis-py leaves those open)."""

    # Commands go out as a plain client's do (`_wire.packs_like_redis_py`): only closing differs.
    sends_as_redis_py = True

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        pool = self.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            for sentinel in pool.sentinel_manager.sentinels:
                await sentinel.aclose()


def _sentinel_client(
    settings: StoreSettings,
    parts: SplitResult,
    common: dict[str, Any],
    query: dict[str, Any],
    tls: dict[str, Any],
) -> Any:
    """A client of the primary the URL's sentinels name for its service.

    A failover shows up on a connection to the old primary as a ``READONLY`` reply (it is a
    replica now) or as a broken connection: redis-py's sentinel connection (and the store's
    held connections, `_wire._raise_if_demoted`) turns the first into a connection error too,
    and the client's retries (``retry_on_error``) reconnect through the sentinels to the new
    primary. A write refused that way never ran (a replica writes nothing),
    and an append that may have run is answered from the ledger when retried.
    """
    sentinels = _host_ports(parts, "sentinel", SENTINEL_PORT)
    credentials = {
        "username": unquote(parts.username) if parts.username else None,
        "password": unquote(parts.password) if parts.password else None,
    }
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": settings.socket_timeout,
        "socket_connect_timeout": settings.connect_timeout,
        "decode_responses": False,
        # Each sentinel is asked once: the next one in the list is the retry (and the
        # primary's connection retries the whole lookup). redis-py's default retries with
        # backoff spent ~4 s on a sentinel that refuses connections, on every lookup it came
        # first in, before asking the next.
        "retry": Retry(NoBackoff(), 0),
    }
    if query.get("sentinel_auth", ["none"])[-1] == "same":
        sentinel_kwargs.update(credentials)
    secure = parts.scheme.startswith("rediss")
    if secure:  # sentinels and data nodes alike, with the same TLS settings
        sentinel_kwargs.update(ssl=True, **tls)
    # redis-py's Sentinel has no annotations.
    manager = cast(Any, Sentinel)(sentinels, sentinel_kwargs=sentinel_kwargs)
    primary: dict[str, Any] = {
        **common,
        **credentials,
        "db": int(query["db"][-1]) if "db" in query else 0,
        "max_connections": settings.max_connections,
        "timeout": settings.socket_timeout,
        "connection_class": _SentinelTlsConnection if secure else _SentinelConnection,
        **(tls if secure else {}),
    }
    return manager.master_for(
        _sentinel_service(parts),
        redis_class=_SentinelPrimary,
        connection_pool_class=_BlockingSentinelPool,
        **primary,
    )


# -- the embedded server ---------------------------------------------------------------------


def embedded_url(
    directory: str | os.PathLike[str],
    *,
    on_start: Callable[[Path], None] | None = None,
    lock_timeout: float = 30.0,
) -> str:
    """A URL for the private redis-server under ``directory``, started if needed.

    ``on_start(directory)`` is called when this call started the server (it keeps running
    after the process exits: `stop_embedded` stops it); without one, starting it is logged
    as a WARNING on the ``threadlog`` logger, which a program that configured no logging
    sees on stderr. The directory is private to its owner
    (mode 0700) and the server's files are created 0600: they hold every conversation.
    Falls back to ``memory://`` (with a logged notice) when no redis-server binary exists.

    A server is started only when none serves the directory: nothing listens on its socket and
    its pid file names no live redis-server of the directory. One that is there but busy (no
    reply yet, ``BUSY``, ``LOADING``) is used; one that refuses commands (``NOAUTH``,
    ``MISCONF``, ...) is a `StoreConnectionError` saying so, and is left alone: a second server
    on the same files would ruin them. Starting waits at most ``lock_timeout`` seconds for
    another process starting it (the directory's ``lock``). An unusable directory is a
    `StoreConnectionError` naming the path and the reason.
    """
    binary = server_binary()
    if binary is None:
        log.warning(
            "threadlog: no redis-server (nor valkey-server) found on PATH; using the in-memory "
            "backend (nothing will persist). Install redis-server or set %s.",
            URL_ENV,
        )
        return "memory://"
    directory = Path(directory).resolve()
    try:
        return _embedded_url(binary, directory, on_start, lock_timeout)
    except StoreConnectionError:
        raise  # a ConnectionError, so an OSError too: already says what is wrong
    except OSError as exc:
        where = "" if exc.filename in (None, str(directory)) else f"{exc.filename}: "
        raise StoreConnectionError(
            f"cannot keep the embedded redis-server in {directory}: {where}"
            f"{exc.strerror or exc} (fix it, or set {URL_ENV})"
        ) from None


def _embedded_url(
    binary: str, directory: Path, on_start: Callable[[Path], None] | None, lock_timeout: float
) -> str:
    try:
        created = not directory.exists()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # mkdir's mode passes through the umask; and a directory an earlier release made (its
        # lock file says so) was made 0755, with files other users could read.
        if created or (
            (directory / "lock").exists() and stat.S_IMODE(directory.stat().st_mode) != 0o700
        ):
            directory.chmod(0o700)
    except (FileExistsError, NotADirectoryError):
        raise StoreConnectionError(
            f"cannot keep the embedded redis-server in {directory}: it is not a directory "
            f"(move it away, or set {URL_ENV})"
        ) from None
    sock = _socket_path(directory)
    url = f"unix://{sock}"
    # A running server needs no lock (whoever holds it may be stalled).
    if _there(directory, sock):
        return url
    lock_path = directory / "lock"
    # 0600 like everything else in the directory (the directory's 0700 already guards it).
    with os.fdopen(os.open(lock_path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as lock:
        deadline = time.monotonic() + lock_timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            # The holder may be starting the server: once it answers, it serves us too.
            if _there(directory, sock):
                return url
            if time.monotonic() >= deadline:
                raise StoreConnectionError(
                    f"the embedded redis-server in {directory} is not running, and another "
                    f"process has held {lock_path} for {lock_timeout:g} s (starting it, or "
                    "stalled); try again, or stop that process"
                )
            time.sleep(0.05)
        if _there(directory, sock):
            return url
        pid = _serving_pid(directory, sock)
        if pid is not None:
            raise StoreConnectionError(
                f"the embedded redis-server in {directory} (pid {pid}) is running but does not "
                f"accept connections on {sock}; it was not replaced (a second server on its "
                f"files would ruin them): stop it (kill {pid}) and try again"
            )
        if sock.exists() and not sock.is_socket():
            raise StoreConnectionError(
                f"cannot keep the embedded redis-server in {directory}: {sock} is not a socket "
                f"(move it away, or set {URL_ENV})"
            )
        _start_server(binary, directory, sock)
        (on_start or _notice_started)(directory)
    return url


def _notice_started(directory: Path) -> None:
    """Say that a server was started: it outlives this process, and its files hold data."""
    log.warning(
        "threadlog: started an embedded redis-server in %s (no URL given and %s unset); it "
        "keeps running after this process exits: eventstore.stop_embedded() or "
        "'threadlog stop' stops it, and its data stays there",
        directory,
        URL_ENV,
    )


def _socket_path(directory: Path) -> Path:
    sock = directory / "redis.sock"
    # Unix socket paths are limited to 107 bytes (bytes: a path of accented letters is twice
    # as long as it looks); deep directories get a short alias.
    if len(os.fsencode(sock)) < 100:
        return sock
    digest = hashlib.sha1(os.fsencode(directory), usedforsecurity=False).hexdigest()[:12]
    alias = Path(tempfile.gettempdir()) / f"threadlog-{digest}.sock"
    return alias


# What a server that is there but cannot answer PING yet replies, if anything: it serves us soon.
_BUSY_REPLIES = ("+PONG", "-LOADING", "-BUSY")


def _there(directory: Path, sock: Path) -> bool:
    """Whether a server is there on ``sock`` to be used; raise if it is there but unusable.

    Any reply means a server is there, and so does a connection it accepts without a reply (a
    script running, or stopped): starting another one on the same files would ruin them.
    """
    reply = _ping(sock)
    if reply is None:
        return False
    if reply == "" or reply.split(" ", 1)[0] in _BUSY_REPLIES:
        return True
    pid = _serving_pid(directory, sock)
    raise StoreConnectionError(
        f"the embedded redis-server in {directory}{f' (pid {pid})' if pid else ''} refuses "
        f"commands: {reply.lstrip('-+')!r}; it was left running, not replaced (a second server "
        f"on its files would ruin them); see {directory / 'redis.log'}"
    )


def _ping(sock: Path, timeout: float = 1.0) -> str | None:
    """The first line of what answers PING on ``sock``: None when nothing listens there (no
    socket, connection refused, closed unanswered), ``""`` when the connection was accepted
    but no reply came within ``timeout`` (or it failed otherwise: something is there)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(str(sock))
        except (FileNotFoundError, ConnectionRefusedError, NotADirectoryError):
            return None
        except OSError:
            return ""  # e.g. not ours to connect to (EACCES), or a full backlog: not absent
        try:
            s.sendall(b"PING\r\n")
            reply = s.recv(512)
        except OSError:
            return ""
    if not reply:
        return None  # closed unanswered: a server shutting down
    return reply.split(b"\r\n", 1)[0].decode("utf-8", "replace")


def _start_server(binary: str, directory: Path, sock: Path) -> None:
    # The caller holds the lock and found no server of the directory: these are leftovers.
    sock.unlink(missing_ok=True)
    _repair_after_crash(directory, sock)
    args = [
        binary,
        "--port", "0",
        "--unixsocket", str(sock),
        "--unixsocketperm", "700",
        "--dir", str(directory),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--save", "",
        # Stream nodes close at 16 KiB instead of 100 entries / 4 KiB: an event of ~600 bytes
        # then costs ~600 bytes instead of ~800 (bench.memory), and a point read stays as
        # fast (bigger nodes make it scan longer).
        "--stream-node-max-bytes", "16384",
        "--stream-node-max-entries", "1000",
        "--daemonize", "yes",
        "--pidfile", str(directory / "redis.pid"),
        "--logfile", str(directory / "redis.log"),
    ]  # fmt: skip
    pidfile = directory / "redis.pid"
    pidfile.unlink(
        missing_ok=True
    )  # stale (no server of the directory): the new one writes its own
    # umask 077: the AOF, the log and the pid file are readable by their owner only.
    try:
        done = subprocess.run(
            args, capture_output=True, text=True, timeout=30, check=False, umask=0o077
        )
    except subprocess.TimeoutExpired:
        raise StoreConnectionError(
            f"the embedded redis-server in {directory} did not start within 30 s "
            f"(see {directory / 'redis.log'})"
        ) from None
    if done.returncode != 0:
        # What it said; a binary that says nothing (not a redis-server at all, killed) gets
        # its exit status and the command, which is all there is to go on.
        said = (done.stderr.strip() or done.stdout.strip()) or (
            f"{args[0]} exited with status {done.returncode} and said nothing (is it a "
            f"redis-server? see also {directory / 'redis.log'})"
        )
        raise StoreConnectionError(f"could not start the embedded redis-server: {said}")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _ping(sock) == "+PONG":
            return
        if _exited(pidfile):
            break
        time.sleep(0.05)
    else:
        raise StoreConnectionError(
            f"the embedded redis-server did not answer on {sock} within 10 s "
            f"(see {directory / 'redis.log'})"
        )
    raise StoreConnectionError(
        f"the embedded redis-server in {directory} stopped as it started: "
        f"{_last_warning(directory / 'redis.log')} (see {directory / 'redis.log'})"
    )


def _exited(pidfile: Path) -> bool:
    """Whether the daemon that wrote ``pidfile`` has exited (False while there is none yet)."""
    pid = _pidfile_pid(pidfile)
    return pid is not None and not _alive(pid)


def _pidfile_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def _last_warning(
    logfile: Path, *, lines: int = 1, since: int = 0, none: str = "its log gives no reason"
) -> str:
    """The last warning line (or ``lines`` lines, joined by "; ") of a redis-server log
    (``<pid>:<role> <time> # <text>``), among those written from byte ``since`` on; ``none``
    when there is none."""
    try:
        with open(logfile, "rb") as f:
            f.seek(since)
            logged = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return "it left no log"
    warnings: list[str] = []
    for line in reversed(logged):
        _, sep, text = line.partition(" # ")
        if sep and text.strip():
            warnings.insert(0, text.strip())
            if len(warnings) == lines:
                break
    return "; ".join(warnings) or none


def _repair_after_crash(directory: Path, sock: Path) -> None:
    """Repair the AOF if the last server here did not shut down cleanly.

    redis-server deletes its pid file when it shuts down; one left behind, naming no live
    redis-server of this directory, means it was killed (or the machine went down), so the AOF
    may end inside a script's MULTI block, which Redis 7.0 would load badly (see `repair_aof`).
    The pid alone proves nothing: after a reboot it may name any process.
    """
    pidfile = directory / "redis.pid"
    if not pidfile.exists() or _serving_pid(directory, sock) is not None:
        return
    try:
        repair_aof(directory)
    except (AofRepairError, OSError, subprocess.TimeoutExpired) as exc:
        raise StoreConnectionError(
            f"the embedded redis-server under {directory} was not shut down cleanly and its "
            f"append-only file could not be checked: {exc}"
        ) from exc
    pidfile.unlink(missing_ok=True)


def stop_embedded(
    directory: str | os.PathLike[str] = EMBEDDED_DIR, *, timeout: float = 10.0, force: bool = False
) -> bool:
    """Stop the embedded server started under ``directory`` (default: ``.threadlog`` of the
    current directory, where `connect` starts it) and wait (bounded) until it is gone. Its
    data stays; the next `connect` without a URL starts it again.

    True if a server was running there and has stopped, busy or refusing commands as it may
    be; False if none was. The pid file alone is not trusted: after a crash or a reboot it may
    name an unrelated process, so it must name a redis-server serving the directory.

    With ``force``, a server still running after ``timeout`` seconds is killed (SIGKILL): what
    it had not written to its append-only file is lost, and the next start checks the file
    (see `repair_aof`).

    Raises:
        OperationalError: without ``force``, the server is still running after ``timeout``
            seconds: it refused to shut down (a final snapshot it could not write, with save
            points configured), or is still running a script. The message gives the reason
            its log gives.
    """
    directory = Path(directory).resolve()
    sock = _socket_path(directory)
    pid = _serving_pid(directory, sock)
    if pid is None:
        return False
    logfile = directory / "redis.log"
    try:
        logged_before = logfile.stat().st_size  # what it says from here on is about the stop
    except OSError:
        logged_before = 0
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    if _gone_within(pid, sock, timeout):
        return True
    if force:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if _gone_within(pid, sock, timeout):
            return True
    # Saying "none was running" here (as it did) left a server running that its user believed
    # stopped, and its directory free to be removed under it.
    still = (
        f"the embedded redis-server in {directory} (pid {pid}) is still running {timeout:g} s "
        "after it was asked to stop"
    )
    if _process_state(pid) in ("T", "t"):
        # Its log then says nothing at all: the lines before the request are not the reason.
        raise OperationalError(
            f"{still}: the process is stopped (SIGSTOP, job control or a debugger) and acts on "
            f"nothing until it is resumed (kill -CONT {pid}); or stop it with --force"
        )
    said = _last_warning(logfile, lines=3, since=logged_before, none="it has logged nothing since")
    raise OperationalError(
        f"{still}: {said} (a script it is still running also holds it; see {logfile})"
    )


def _process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` from /proc (R, S, T, Z, ...); None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[0] if fields else None


def _gone_within(pid: int, sock: Path, timeout: float) -> bool:
    """Whether the server ``pid`` has exited (and nothing answers on ``sock``) within
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid) and _ping(sock, timeout=0.2) is None:
            return True
        time.sleep(0.02)
    return False


def _serving_pid(directory: Path, sock: Path) -> int | None:
    """The pid in ``directory``'s pid file if it is a live redis-server serving ``directory``.

    The pid file alone is not trusted: after a crash or a reboot it may name an unrelated
    process. On Linux the process must be a redis-server whose working directory is
    ``directory`` (it changes into its ``--dir``), which holds while it is busy or refuses
    commands; elsewhere the server answering on ``sock`` must report that same pid.
    """
    pid = _pidfile_pid(directory / "redis.pid")
    if pid is None or not _alive(pid):
        return None
    proc = Path(f"/proc/{pid}")
    if Path("/proc/self").exists():
        try:
            command = (proc / "comm").read_text().strip()
            here = os.stat(proc / "cwd")
            there = os.stat(directory)
        except OSError:
            return None
        if is_server_process_name(command) and (here.st_dev, here.st_ino) == (
            there.st_dev,
            there.st_ino,
        ):
            return pid
        return None
    try:
        with redis.Redis(unix_socket_path=str(sock), socket_timeout=2.0) as client:
            answered = client.info("server").get("process_id")
    except (redis.RedisError, OSError):
        return None
    return pid if answered == pid else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A daemonized server is reparented; until that parent reaps it, it lingers as a zombie.
    return _process_state(pid) != "Z"


__all__ = ["StoreSettings", "connect", "embedded_url", "open_store", "redact", "stop_embedded"]
