"""Real redis-server processes for tests and benchmarks: one place that starts and stops them.

Servers listen on a unix socket (or a free loopback port) only, are started with bounded waits,
and are stopped by the pid they were started with. `RedisCluster` builds a local Redis Cluster
from such servers and moves slots between its nodes (resharding) for tests and benchmarks.

Every child started here dies with the process that started it (`spawn`): a test run killed
outright (SIGKILL, pytest-timeout's ``thread`` method, which ends the run with ``os._exit``, a
second Ctrl-C in a teardown) never gets to stop its servers, and they used to run forever.
threadlog's embedded server (`eventstore.embedded_url`) is not started here: it is meant to
outlive the command that starts it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis

from ._aof import repair_aof
from ._binaries import server_binary, tool_binary
from ._errors import StoreConnectionError


class RedisServerError(RuntimeError):
    """Raised when a redis-server cannot be found or does not come up."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- children that die with this process ----------------------------------------------------

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl() -> Any:
    """libc's ``prctl``, or None where there is none (not Linux): there `spawn`'s children do
    not die with their parent, as before."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


# Resolved once, in the parent: the child between fork and exec should do as little as it can.
_prctl = _load_prctl()


def _die_with(parent: int) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child get SIGKILL when the thread that forked it exits.

    SIGKILL, not SIGTERM: its owner is gone, nobody will read what a clean shutdown would save,
    and SIGKILL cannot be caught, ignored or put off by a busy child.
    """

    def preexec() -> None:
        if _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        # The parent may have died between fork and prctl: then nothing would ever signal us.
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


_Child = subprocess.Popen[Any]
_Request = tuple["concurrent.futures.Future[_Child]", list[str], dict[str, Any]]


class _Spawner:
    """One thread that forks every child `spawn` starts, and lives as long as the process.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process: a
    server started from a short-lived thread (``asyncio.to_thread``, a worker of a test) would
    be killed as soon as that thread ended. The main thread would do, but servers are started
    from other threads too; this daemon thread only ends with the process.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def popen(self, args: list[str], **kwargs: Any) -> _Child:
        with self._lock:
            # After a fork the thread is not there in the child: start another.
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._requests = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._serve, args=(self._requests,), name="servers-spawner", daemon=True
                )
                self._thread.start()
                self._pid = os.getpid()
            requests = self._requests
        future: concurrent.futures.Future[_Child] = concurrent.futures.Future()
        requests.put((future, args, kwargs))
        try:
            return future.result()
        except BaseException:
            # Interrupted (Ctrl-C) while the child was being started: nobody will stop it.
            future.add_done_callback(_kill_unclaimed)
            raise

    @staticmethod
    def _serve(requests: queue.SimpleQueue[_Request]) -> None:
        while True:
            future, args, kwargs = requests.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                proc = subprocess.Popen(args, preexec_fn=_die_with(os.getpid()), **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(proc)


def _kill_unclaimed(future: concurrent.futures.Future[_Child]) -> None:
    if not future.cancelled() and future.exception() is None:
        proc = future.result()
        proc.kill()
        proc.wait()


_spawner = _Spawner()


def spawn(args: list[str], **kwargs: Any) -> _Child:
    """``subprocess.Popen(args, **kwargs)`` for a child that must not outlive this process.

    On Linux the child gets SIGKILL when this process ends, however it ends (PR_SET_PDEATHSIG,
    set from a thread that lives as long as the process: see `_Spawner`). Elsewhere it is a plain
    ``Popen``, and a child of a killed process keeps running.
    """
    if _prctl is None:
        return subprocess.Popen(args, **kwargs)
    return _spawner.popen(args, **kwargs)


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(args, capture_output=True, text=True, timeout=timeout)`` through `spawn`:
    a redis-cli waiting on a stuck node must not outlive a killed test run either."""
    proc = spawn(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(args, proc.returncode, str(out), str(err))


# -- TLS ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost and a client certificate."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path, *, days: int = 2, timeout: float = 30.0) -> TlsFiles:
    """Generate a test CA and certificates it signed into ``directory``, with the openssl CLI.

    Raises `RedisServerError` when openssl is missing or fails.
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RedisServerError("the openssl CLI is not on PATH; it is needed to make test certs")
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        try:
            done = _run([openssl, *args], timeout)
        except subprocess.TimeoutExpired as exc:
            raise RedisServerError(f"openssl {args[0]} timed out") from exc
        if done.returncode != 0:
            raise RedisServerError(f"openssl {args[0]} failed: {done.stderr.strip()[-1000:]}")

    run(
        "req", "-x509", *ec, "-days", str(days), "-subj", "/CN=threadlog test CA",
        "-keyout", str(files.ca_key), "-out", str(files.ca_cert),
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    leaves = [
        ("server", files.server_cert, files.server_key, "serverAuth"),
        ("client", files.client_cert, files.client_key, "clientAuth"),
    ]
    for name, cert, key, usage in leaves:
        csr = directory / f"{name}.csr"
        ext = directory / f"{name}.ext"
        ext.write_text(
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
            "basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            f"extendedKeyUsage={usage}\n"
        )
        run(
            "req", *ec, "-subj", f"/CN=threadlog test {name}", "-keyout", str(key), "-out", str(csr)
        )
        run(
            "x509", "-req", "-in", str(csr), "-days", str(days),
            "-CA", str(files.ca_cert), "-CAkey", str(files.ca_key),
            "-set_serial", "0x" + os.urandom(8).hex(), "-extfile", str(ext), "-out", str(cert),
        )  # fmt: skip
    return files


@dataclass
class RedisServer:
    """A redis-server child process this code started (and will stop)."""

    directory: Path
    port: int = 0
    unix_socket: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    binary: str | None = None
    process: subprocess.Popen[bytes] | None = None
    tls: TlsFiles | None = None
    tls_port: int = 0
    tls_auth_clients: str = "no"
    #: After `kill`, the next `start` first repairs the AOF (``redis-check-aof --fix``), as an
    #: operator (or threadlog's embedded server) must after a hard kill: see `repair_aof`.
    repair_after_kill: bool = True
    aof_repairs: list[str] = field(default_factory=list)
    _killed: bool = False

    @property
    def url(self) -> str:
        if self.unix_socket is not None:
            return f"unix://{self.unix_socket}"
        return f"redis://127.0.0.1:{self.port}"

    @property
    def tls_url(self) -> str:
        """``rediss://127.0.0.1:<tls_port>`` trusting the test CA (the server must have TLS)."""
        if self.tls is None:
            raise RedisServerError("this server was started without TLS")
        return f"rediss://127.0.0.1:{self.tls_port}?ssl_ca_certs={quote(str(self.tls.ca_cert))}"

    def args(self) -> list[str]:
        try:
            binary = self.binary or server_binary()
        except StoreConnectionError as exc:
            raise RedisServerError(str(exc)) from None
        if binary is None:
            raise RedisServerError(
                "neither redis-server nor valkey-server is on PATH; run ./scripts/test (it "
                "installs redis-server) or set THREADLOG_TEST_REDIS_URL"
            )
        args = [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        if self.unix_socket is not None:
            args += ["--unixsocket", str(self.unix_socket), "--unixsocketperm", "700"]
        if self.tls is not None:
            args += [
                "--tls-port", str(self.tls_port),
                "--tls-cert-file", str(self.tls.server_cert),
                "--tls-key-file", str(self.tls.server_key),
                "--tls-ca-cert-file", str(self.tls.ca_cert),
                "--tls-auth-clients", self.tls_auth_clients,
            ]  # fmt: skip
        return args + self.extra_args

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait (bounded) until it answers PING."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._killed and self.repair_after_kill:
            repaired = repair_aof(self.directory)
            if repaired is not None:
                self.aof_repairs.append(repaired)
        self._killed = False
        self.process = spawn(self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                raise RedisServerError(f"redis-server exited with {self.process.returncode}: {log}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RedisServerError(f"redis-server did not answer within {timeout} s")

    def ping(self) -> bool:
        """True if the server answers PING right now."""
        family = socket.AF_UNIX if self.unix_socket is not None else socket.AF_INET
        address: str | tuple[str, int] = (
            str(self.unix_socket) if self.unix_socket is not None else ("127.0.0.1", self.port)
        )
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            try:
                s.connect(address)
                s.sendall(b"PING\r\n")
                # A server with a password answers NOAUTH: up all the same.
                return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
            except OSError:
                return False

    def kill(self) -> None:
        """SIGKILL the server (fault injection); `start` brings it back on the same address."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
            self._killed = True

    def stop(self) -> None:
        """Stop the server this object started, by its pid."""
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def redis_server(
    *,
    unix: bool = True,
    extra_args: list[str] | None = None,
    directory: Path | None = None,
    tls: TlsFiles | None = None,
    tls_auth_clients: str = "no",
) -> Iterator[RedisServer]:
    """Start a private redis-server for the duration of the block.

    With ``tls`` it also serves TLS on a free loopback port (`RedisServer.tls_port`);
    ``tls_auth_clients`` is redis-server's ``--tls-auth-clients`` (``no``, ``yes``, ``optional``).
    """
    with contextlib.ExitStack() as stack:
        if directory is None:
            # Short base path: unix socket paths are limited to ~107 bytes.
            directory = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="tl-", dir="/tmp"))
            )
        server = RedisServer(
            directory=directory,
            port=0 if unix else free_port(),
            unix_socket=directory / "r.sock" if unix else None,
            extra_args=list(extra_args or []),
            tls=tls,
            tls_port=free_port() if tls is not None else 0,
            tls_auth_clients=tls_auth_clients,
        )
        server.start()
        try:
            yield server
        finally:
            server.stop()


# -- Redis Cluster ------------------------------------------------------------------------------

CLUSTER_SLOTS = 16384
_BUS_OFFSET = 10000  # a cluster node also listens on port + 10000 (the cluster bus)


def free_cluster_port() -> int:
    """A loopback port that, like its cluster-bus port (+10000), was free a moment ago."""
    for _ in range(100):
        port = free_port()
        if port + _BUS_OFFSET > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port + _BUS_OFFSET))
            except OSError:
                continue
        return port
    raise RedisServerError("no free pair of loopback ports for a cluster node")


def _redis_cli() -> str:
    binary = tool_binary("cli")
    if binary is None:
        raise RedisServerError(
            "redis-cli (or valkey-cli) is not on PATH; it is needed to build a Redis Cluster"
        )
    return binary


@dataclass
class RedisCluster:
    """A local Redis Cluster of ``primaries`` redis-server children (no replicas) on loopback.

    `start` launches the nodes with ``cluster-enabled yes``, joins them with
    ``redis-cli --cluster create`` and waits (bounded) until every node reports
    ``cluster_state:ok`` and the same slot map. `add_node`, `migrate_slot` and `reshard` move
    slots while clients keep working; `stop` stops every node by its pid.
    """

    directory: Path
    primaries: int = 3
    node_timeout_ms: int = 5000
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...`` over every node."""
        return "redis+cluster://" + ",".join(self.addresses)

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{node.port}" for node in self.nodes]

    def _launch(self, index: int, timeout: float) -> RedisServer:
        last: RedisServerError | None = None
        for _ in range(5):  # a "free" port may be taken by the time the node binds it
            node = RedisServer(
                directory=self.directory / f"node{index}",
                port=free_cluster_port(),
                extra_args=[
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(self.node_timeout_ms),
                    "--cluster-require-full-coverage", "yes",
                ],
            )  # fmt: skip
            try:
                return node.start(timeout)
            except RedisServerError as exc:
                last = exc
                with contextlib.suppress(OSError):
                    (node.directory / "nodes.conf").unlink()
        raise RedisServerError(f"cluster node {index} did not start: {last}")

    def start(self, timeout: float = 60.0) -> RedisCluster:
        """Start the nodes, create the cluster, and wait until it is ready (bounded)."""
        if self.primaries < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 primaries")
        deadline = time.monotonic() + timeout
        try:
            for index in range(self.primaries):
                self.nodes.append(self._launch(index, timeout=10.0))
            self._cli(
                ["--cluster", "create", *self.addresses, "--cluster-replicas", "0"],
                deadline,
            )
            self.wait_ready(deadline - time.monotonic())
        except BaseException:
            self.stop()
            raise
        return self

    def _cli(self, args: list[str], deadline: float) -> str:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RedisServerError(f"no time left for redis-cli {' '.join(args[:2])}")
        try:
            done = _run([_redis_cli(), *args, "--cluster-yes"], remaining)
        except subprocess.TimeoutExpired as exc:
            raise RedisServerError(f"redis-cli {' '.join(args[:2])} timed out") from exc
        if done.returncode != 0 or "[ERR]" in done.stdout:
            raise RedisServerError(
                f"redis-cli {' '.join(args[:2])} failed ({done.returncode}): "
                f"{(done.stdout + done.stderr)[-2000:]}"
            )
        return done.stdout

    def client(self, node: RedisServer) -> redis.Redis:
        """A plain (non-cluster) client of one node, for cluster administration."""
        return redis.Redis(
            host="127.0.0.1", port=node.port, socket_timeout=10.0, decode_responses=True
        )

    def _ask(self, node: RedisServer, *args: Any) -> Any:
        with self.client(node) as c:
            return c.execute_command(*args)

    def node_id(self, node: RedisServer) -> str:
        """The cluster node id of ``node``."""
        return str(self._ask(node, "CLUSTER", "MYID"))

    def slot_map(self, node: RedisServer | None = None) -> dict[int, int]:
        """Slot -> port of the primary that serves it, as ``node`` (default: the first) sees it."""
        rows = self._ask(node or self.nodes[0], "CLUSTER", "SLOTS")
        out: dict[int, int] = {}
        for row in rows:
            start, end, primary = int(row[0]), int(row[1]), row[2]
            for slot in range(start, end + 1):
                out[slot] = int(primary[1])
        return out

    def owner(self, slot: int) -> RedisServer:
        """The node that serves ``slot`` now."""
        port = self.slot_map()[slot]
        return next(node for node in self.nodes if node.port == port)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait (bounded) until every node says ``cluster_state:ok``, knows every other node
        and reports the same full slot map."""
        deadline = time.monotonic() + timeout
        problem = "not checked"
        while time.monotonic() < deadline:
            problem = self._not_ready()
            if not problem:
                return
            time.sleep(0.05)
        raise RedisServerError(
            f"the cluster did not become ready within {timeout:.0f} s: {problem}"
        )

    def _not_ready(self) -> str:
        maps = []
        try:
            for node in self.nodes:
                info = self._ask(node, "CLUSTER", "INFO")
                text = info if isinstance(info, str) else str(info)
                fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
                if fields.get("cluster_state") != "ok":
                    return f"{node.port}: cluster_state:{fields.get('cluster_state')}"
                if int(fields.get("cluster_known_nodes", 0)) != len(self.nodes):
                    return f"{node.port} knows {fields.get('cluster_known_nodes')} nodes"
                maps.append(self.slot_map(node))
        except (redis.RedisError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        if len(maps[0]) != CLUSTER_SLOTS:
            return f"{CLUSTER_SLOTS - len(maps[0])} slots unassigned"
        if any(m != maps[0] for m in maps[1:]):
            return "the nodes disagree on the slot map"
        return ""

    def add_node(self, timeout: float = 30.0) -> RedisServer:
        """Start an empty primary and join it to the cluster (it serves no slots yet)."""
        deadline = time.monotonic() + timeout
        node = self._launch(len(self.nodes), timeout=10.0)
        try:
            self._cli(
                ["--cluster", "add-node", f"127.0.0.1:{node.port}", self.addresses[0]], deadline
            )
        except BaseException:
            node.stop()
            raise
        self.nodes.append(node)
        self.wait_ready(deadline - time.monotonic())
        return node

    def migrate_slot(
        self,
        slot: int,
        target: RedisServer,
        *,
        batch: int = 10,
        on_batch: Callable[[int], None] | None = None,
        timeout_ms: int = 5000,
    ) -> int:
        """Move ``slot`` to ``target`` the way ``redis-cli --cluster reshard`` does, while
        clients keep writing: SETSLOT IMPORTING/MIGRATING, MIGRATE the keys ``batch`` at a time,
        then SETSLOT NODE on the target, the source and every other node. Returns the number
        of keys moved. ``on_batch(moved_so_far)`` runs after each MIGRATE (to widen the window
        in which the slot is split between two nodes, for tests).
        """
        source = self.owner(slot)
        if source is target:
            return 0
        source_id, target_id = self.node_id(source), self.node_id(target)
        self._ask(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        self._ask(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        moved = 0
        while True:
            keys = self._ask(source, "CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not keys:
                break
            self._ask(source, "MIGRATE", "127.0.0.1", target.port, "", 0, timeout_ms, "KEYS", *keys)
            moved += len(keys)
            if on_batch is not None:
                on_batch(moved)
        # The order redis-cli uses: the target first, so it never answers MOVED back.
        for node in [target, source, *(n for n in self.nodes if n not in (target, source))]:
            self._ask(node, "CLUSTER", "SETSLOT", slot, "NODE", target_id)
        return moved

    def reshard(
        self, source: RedisServer, target: RedisServer, slots: int, timeout: float = 120.0
    ) -> str:
        """Move ``slots`` slots from ``source`` to ``target`` (``redis-cli --cluster reshard``)."""
        deadline = time.monotonic() + timeout
        out = self._cli(
            [
                "--cluster", "reshard", self.addresses[0],
                "--cluster-from", self.node_id(source),
                "--cluster-to", self.node_id(target),
                "--cluster-slots", str(slots),
            ],
            deadline,
        )  # fmt: skip
        self.wait_ready(deadline - time.monotonic())
        return out

    def stop(self) -> None:
        """Stop every node this object started, by its pid."""
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def redis_cluster(*, primaries: int = 3, directory: Path | None = None) -> Iterator[RedisCluster]:
    """Start a private local Redis Cluster for the duration of the block."""
    with contextlib.ExitStack() as stack:
        if directory is None:
            directory = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="tlc-", dir="/tmp"))
            )
        cluster = RedisCluster(directory=directory, primaries=primaries).start()
        try:
            yield cluster
        finally:
            cluster.stop()


@dataclass
class SentinelServer(RedisServer):
    """A redis-server in sentinel mode (``--sentinel``), monitoring `SentinelGroup`'s primary.

    Sentinel rewrites its configuration file as it learns (replicas, other sentinels, the
    current primary after a failover), so it gets a file of its own in its directory.
    """

    monitor: tuple[str, int, int] = ("mymaster", 0, 1)  # service, primary's port, quorum
    down_after_ms: int = 1000
    password: str | None = None  # the data nodes' and its own (``requirepass``)
    failover_timeout_ms: int = 10000

    def args(self) -> list[str]:
        args = super().args()
        service, port, quorum = self.monitor
        conf = self.directory / "sentinel.conf"
        conf.write_text(
            f"sentinel monitor {service} 127.0.0.1 {port} {quorum}\n"
            f"sentinel down-after-milliseconds {service} {self.down_after_ms}\n"
            f"sentinel failover-timeout {service} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {service} 1\n"
            + (
                f"sentinel auth-pass {service} {self.password}\nrequirepass {self.password}\n"
                if self.password
                else ""
            )
        )
        # The configuration file comes first, then the options a data node gets too (sentinel
        # mode takes them: redis-server 7.0 and valkey-server 8.0).
        return [args[0], str(conf), "--sentinel", *args[1:]]


@dataclass
class SentinelGroup:
    """A primary, its replicas and the sentinels that watch them: every one a redis-server
    child on a loopback port, for tests of Redis Sentinel deployments (failover included).

    `start` waits (bounded) until every sentinel knows the primary and every replica is in
    sync; `kill_primary` kills the primary and waits until the sentinels have promoted a
    replica; `switchover` promotes one while the primary lives, which then becomes a replica.
    `stop` stops every process by its pid.
    """

    directory: Path
    replicas: int = 1
    sentinels: int = 1
    service: str = "mymaster"
    password: str | None = None  # every node's and sentinel's (``requirepass``), when set
    # With TLS files: every node and sentinel also serves TLS on a port of its own (its
    # `RedisServer.tls_port`), replicates and monitors over TLS, and announces that port: the
    # ports the sentinels name, and these methods take and return, are then the TLS ones.
    tls: TlsFiles | None = None
    data: list[RedisServer] = field(default_factory=list)  # the primary first, at start
    watchers: list[SentinelServer] = field(default_factory=list)
    dead: list[RedisServer] = field(default_factory=list)  # killed primaries (`kill_primary`)

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:s1[,...]/<service>`` over every sentinel (with TLS:
        ``rediss+sentinel://`` over their TLS ports, trusting the test CA)."""
        if self.tls is None:
            hosts = ",".join(f"127.0.0.1:{w.port}" for w in self.watchers)
            return f"redis+sentinel://{hosts}/{self.service}"
        hosts = ",".join(f"127.0.0.1:{w.tls_port}" for w in self.watchers)
        ca = quote(str(self.tls.ca_cert))
        return f"rediss+sentinel://{hosts}/{self.service}?ssl_ca_certs={ca}"

    def _announced(self, server: RedisServer) -> int:
        return server.tls_port if self.tls is not None else server.port

    def _ask(self, port: int, *args: Any) -> Any:
        """A command to the node or sentinel announced at ``port``, over its plain port."""
        plain = next(
            (
                n.port
                for n in [*self.data, *self.dead, *self.watchers]
                if self._announced(n) == port
            ),
            port,
        )
        with redis.Redis(
            host="127.0.0.1",
            port=plain,
            password=self.password,
            socket_timeout=5.0,
            decode_responses=True,
        ) as c:
            return c.execute_command(*args)

    def primary_port(self) -> int:
        """The port of the primary the first sentinel names now, as clients see it.

        ``SENTINEL MASTER`` (what redis-py's clients ask) names the promoted replica only once
        a failover has finished (the old primary until then, its flags saying
        ``failover_in_progress``); ``GET-MASTER-ADDR-BY-NAME`` names it as soon as it is
        promoted, while clients are still sent to the old primary.
        """
        return int(self._master_state(self.watchers[0].port)["port"])

    def _master_state(self, sentinel_port: int) -> dict[str, str]:
        """``SENTINEL MASTER <service>`` as a dict (unparsed by redis-py, whose parser of it
        fails in some releases: 6.4's takes no ``return_responses``)."""
        return _sentinel_fields(self._ask(sentinel_port, "SENTINEL", "MASTER", self.service))

    def start(self, timeout: float = 30.0) -> SentinelGroup:
        deadline = time.monotonic() + timeout
        try:
            # A replica's first sync waits 5 s by default for more replicas to share it.
            common = ["--repl-diskless-sync-delay", "0"]
            if self.password:
                common += ["--requirepass", self.password, "--masterauth", self.password]
            if self.tls is not None:
                common += ["--tls-replication", "yes"]  # and sentinels monitor over TLS

            def tls_port() -> int:
                return free_port() if self.tls is not None else 0

            primary = RedisServer(
                directory=self.directory / "data0",
                port=free_port(),
                extra_args=common,
                tls=self.tls,
                tls_port=tls_port(),
            ).start()
            self.data.append(primary)
            for index in range(1, self.replicas + 1):
                follow = ["--replicaof", "127.0.0.1", str(self._announced(primary))]
                replica = RedisServer(
                    directory=self.directory / f"data{index}",
                    port=free_port(),
                    extra_args=[*common, *follow],
                    tls=self.tls,
                    tls_port=tls_port(),
                )
                self.data.append(replica.start())
            for index in range(self.sentinels):
                watcher = SentinelServer(
                    directory=self.directory / f"sentinel{index}",
                    port=free_port(),
                    monitor=(self.service, self._announced(primary), 1),
                    password=self.password,
                    extra_args=["--tls-replication", "yes"] if self.tls is not None else [],
                    tls=self.tls,
                    tls_port=tls_port(),
                )
                watcher.start()
                self.watchers.append(watcher)
            self.wait_ready(self._announced(primary), deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, primary: int, deadline: float, *, replicas_seen: bool = True) -> None:
        """Wait until every sentinel names ``primary`` (and, with ``replicas_seen``, has found
        every replica: a failover needs one), and every replica replicates from it with its
        link up."""
        problem = "not checked"
        while time.monotonic() < deadline:
            problem = self._not_ready(primary, replicas_seen)
            if not problem:
                return
            time.sleep(0.05)
        raise RedisServerError(f"the sentinel group did not become ready: {problem}")

    def _not_ready(self, primary: int, replicas_seen: bool) -> str:
        try:
            for watcher in self.watchers:
                state = self._master_state(watcher.port)
                if int(state["port"]) != primary or "failover" in str(state.get("flags", "")):
                    return f"sentinel {watcher.port}: {state.get('port')} {state.get('flags')}"
                if not replicas_seen:
                    continue
                known = self._ask(watcher.port, "SENTINEL", "REPLICAS", self.service)
                ok = [r for r in known if "s_down" not in _sentinel_fields(r).get("flags", "")]
                if len(ok) < self.replicas:
                    return f"sentinel {watcher.port} sees {len(ok)} of {self.replicas} replicas"
            for node in self.data:
                port = self._announced(node)
                if port == primary:
                    continue
                fields = {
                    k: str(v) for k, v in self._ask(port, "INFO", "replication").items()
                }  # redis-py parses INFO into a dict
                if fields.get("master_port") != str(primary):
                    return f"{port} replicates from {fields.get('master_port')}"
                if fields.get("master_link_status") != "up":
                    return f"{port}: master_link_status:{fields.get('master_link_status')}"
        except (redis.RedisError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    def kill_primary(self, timeout: float = 30.0) -> int:
        """SIGKILL the primary and wait until the sentinels have promoted a replica and it
        serves as the primary: returns its port. (A primary that fails, as opposed to a
        ``SENTINEL FAILOVER`` of a live one, which keeps taking writes until the sentinels
        next poll it, up to 10 s, and then throws them away to follow the new primary.)"""
        deadline = time.monotonic() + timeout
        old = self.primary_port()
        primary = next(node for node in self.data if self._announced(node) == old)
        primary.kill()
        self.data.remove(primary)
        self.dead.append(primary)
        while time.monotonic() < deadline:
            new = self.primary_port()
            if new != old and self._role(new) == "master":
                self.wait_ready(new, deadline, replicas_seen=False)
                return new
            time.sleep(0.05)
        raise RedisServerError(f"no failover within {timeout:.0f} s: the primary is still {old}")

    def switchover(self, timeout: float = 30.0) -> int:
        """Promote a replica of the live primary (``SENTINEL FAILOVER``) and wait until the old
        primary follows it: returns the new primary's port.

        The sentinels would point the old primary at the new one at their next poll of it (up
        to 10 s); this does it at once, as they would, so that no write lands on it meanwhile.
        """
        deadline = time.monotonic() + timeout
        old = self.primary_port()
        while True:
            try:
                self._ask(self.watchers[0].port, "SENTINEL", "FAILOVER", self.service)
                break
            except redis.ResponseError as exc:
                # A sentinel promotes only a replica it has polled lately (every 10 s at most).
                if "NOGOODSLAVE" not in str(exc) or time.monotonic() > deadline:
                    raise RedisServerError(f"SENTINEL FAILOVER: {exc}") from None
                time.sleep(0.1)
        while time.monotonic() < deadline:
            new = self.primary_port()
            if new != old and self._role(new) == "master":
                self._ask(old, "REPLICAOF", "127.0.0.1", str(new))
                self.wait_ready(new, deadline, replicas_seen=False)
                return new
            time.sleep(0.05)
        raise RedisServerError(f"no switchover within {timeout:.0f} s: the primary is still {old}")

    def _role(self, port: int) -> str:
        try:
            return str(self._ask(port, "ROLE")[0])
        except (redis.RedisError, OSError):
            return "unreachable"

    def wait_synced(self, timeout: float = 10.0) -> None:
        """Wait until every replica has everything the primary has written (its offset)."""
        deadline = time.monotonic() + timeout
        primary = self.primary_port()
        while time.monotonic() < deadline:
            want = int(self._ask(primary, "INFO", "replication")["master_repl_offset"])
            have = [
                int(self._ask(port, "INFO", "replication").get("slave_repl_offset", -1))
                for port in map(self._announced, self.data)
                if port != primary
            ]
            if all(h >= want for h in have):
                return
            time.sleep(0.02)
        raise RedisServerError(f"the replicas did not catch up within {timeout:.0f} s")

    def stop(self) -> None:
        """Stop every process this object started, by its pid."""
        for server in [*self.watchers, *self.data, *self.dead]:
            server.stop()


def _sentinel_fields(row: Any) -> dict[str, str]:
    """A ``SENTINEL REPLICAS`` row (a flat name, value list, or a dict on RESP3) as a dict."""
    if isinstance(row, dict):
        return {str(k): str(v) for k, v in row.items()}
    return {str(row[i]): str(row[i + 1]) for i in range(0, len(row) - 1, 2)}


@contextlib.contextmanager
def sentinel_group(
    *,
    replicas: int = 1,
    sentinels: int = 1,
    password: str | None = None,
    tls: TlsFiles | None = None,
) -> Iterator[SentinelGroup]:
    """Start a private primary, replicas and sentinels for the duration of the block."""
    with tempfile.TemporaryDirectory(prefix="tls-", dir="/tmp") as directory:
        group = SentinelGroup(
            Path(directory), replicas=replicas, sentinels=sentinels, password=password, tls=tls
        ).start()
        try:
            yield group
        finally:
            group.stop()


def docker_engine_answers(timeout: float = 2.0) -> bool:
    """True when a Docker engine (not just the client) answers ``GET /_ping``.

    Probed over the engine's socket directly: docker-py leaks its socket when the engine is
    absent, which pytest's warnings-as-errors turns into a failure.
    """
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        if host.startswith("unix://"):
            path = host[len("unix://") :]
            if not os.path.exists(path):
                return False
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: str | tuple[str, int] = path
        elif host.startswith("tcp://"):
            hostname, _, port = host[len("tcp://") :].partition(":")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            address = (hostname, int(port or 2375))
        else:
            return False
        with sock:
            sock.settimeout(timeout)
            sock.connect(address)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            status_line = sock.recv(64).split(b"\r\n", 1)[0]
            return status_line.startswith(b"HTTP/1.") and b" 200" in status_line
    except (OSError, ValueError):
        return False


# -- embedded servers that tests start ---------------------------------------------------------


def stop_embedded_under(roots: list[Path]) -> list[Path]:
    """Stop every embedded server (`eventstore.embedded_url`) in a directory under ``roots``;
    return their directories. Only a live redis-server serving the directory its pid file is
    in is signalled (`eventstore.stop_embedded`), so a stale pid file harms nothing; one that
    does not stop when asked is killed (``force``): a test left it refusing to."""
    from ._connect import stop_embedded

    stopped = []
    for root in roots:
        for directory, _, files in os.walk(root):
            if "redis.pid" in files and stop_embedded(directory, force=True):
                stopped.append(Path(directory))
    return stopped


@dataclass
class EmbeddedReaper:
    """A watchdog process that stops the embedded servers under the roots it was given once
    the process that started it ends, however it ends.

    The embedded server is meant to outlive the command that starts it, so it cannot die with
    its parent as test servers do (`spawn`); a test that starts one stops it in a teardown,
    which a killed test run never runs. The reaper waits for end of file on its stdin, which
    comes when this process closes it (`close`) or dies, then sweeps ``roots`` and exits.
    """

    process: subprocess.Popen[bytes]

    @classmethod
    def start(cls, *roots: Path) -> EmbeddedReaper:
        process = subprocess.Popen(
            [sys.executable, "-m", "eventstore.servers", "reap-embedded"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            # Its own session: the Ctrl-C that ends the run must not end the reaper too.
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        reaper = cls(process)
        for root in roots:
            reaper.watch(root)
        return reaper

    def watch(self, root: Path) -> None:
        """Also sweep ``root`` (a directory that embedded servers may be started under)."""
        assert self.process.stdin is not None
        self.process.stdin.write(os.fsencode(Path(root).resolve()) + b"\n")
        self.process.stdin.flush()

    def close(self, timeout: float = 60.0) -> None:
        """Sweep now and wait (bounded) for the reaper to finish."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _reap_embedded() -> None:
    roots = [Path(os.fsdecode(line.rstrip(b"\n"))) for line in sys.stdin.buffer]
    for directory in stop_embedded_under(roots):
        print(f"stopped the embedded redis-server left running in {directory}", file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1:] != ["reap-embedded"]:
        sys.exit("usage: python -m eventstore.servers reap-embedded  (roots on stdin)")
    _reap_embedded()
