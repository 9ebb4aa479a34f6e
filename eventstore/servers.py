"""Real redis-server processes for tests and benchmarks: one place that starts and stops them.

Servers listen on a unix socket (or a free loopback port) only, are started with bounded waits,
and are stopped by the pid they were started with.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


class RedisServerError(RuntimeError):
    """Raised when a redis-server cannot be found or does not come up."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RedisServer:
    """A redis-server child process this code started (and will stop)."""

    directory: Path
    port: int = 0
    unix_socket: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    binary: str | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.unix_socket is not None:
            return f"unix://{self.unix_socket}"
        return f"redis://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        binary = self.binary or shutil.which("redis-server")
        if binary is None:
            raise RedisServerError(
                "redis-server is not on PATH; run ./scripts/test (it installs it) "
                "or set THREADLOG_TEST_REDIS_URL"
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
        return args + self.extra_args

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait (bounded) until it answers PING."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
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
                return s.recv(64).startswith(b"+PONG")
            except OSError:
                return False

    def kill(self) -> None:
        """SIGKILL the server (fault injection); `start` brings it back on the same address."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

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
    *, unix: bool = True, extra_args: list[str] | None = None, directory: Path | None = None
) -> Iterator[RedisServer]:
    """Start a private redis-server for the duration of the block."""
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
        )
        server.start()
        try:
            yield server
        finally:
            server.stop()


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
