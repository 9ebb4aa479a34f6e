"""The redis-servers tests and benchmarks start die with the process that started them; the
embedded server threadlog starts does not (it is meant to outlive its command).

Each test starts a child Python process that starts servers through the code the test fixtures
and benchmarks use, SIGKILLs that child (as a killed test run ends: no teardown runs), and polls,
bounded, for the servers' pids. Anything a failing test leaves running is stopped by its pid.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import eventstore as es
from eventstore._binaries import is_server_process_name
from eventstore._connect import _ping

ROOT = Path(__file__).resolve().parents[1]

# Prints the pids of the servers it started, then waits to be killed.
CHILD = r"""
import sys, threading, time
from pathlib import Path
from eventstore.servers import RedisCluster, RedisServer

mode, directory = sys.argv[1], Path(sys.argv[2])

def server() -> RedisServer:
    return RedisServer(directory=directory, unix_socket=directory / "r.sock").start()

if mode in ("server", "os-exit"):
    pids = [server().process.pid]
elif mode == "from-a-thread":
    # Started from a thread that ends long before the process: the server must outlive it.
    started = []
    worker = threading.Thread(target=lambda: started.append(server()))
    worker.start()
    worker.join()
    task = Path(f"/proc/self/task/{worker.native_id}")
    deadline = time.monotonic() + 10
    while task.exists() and time.monotonic() < deadline:  # the OS thread is gone, not just
        time.sleep(0.01)                                   # its Python side
    # A signal sent when the thread exited is acted on before the server's next reply.
    assert not task.exists() and started[0].ping(), "the server died with its thread"
    pids = [started[0].process.pid]
elif mode == "cluster":
    cluster = RedisCluster(directory=directory).start()
    pids = [node.process.pid for node in cluster.nodes]
elif mode == "embedded":
    import eventstore as es
    es.embedded_url(directory, on_start=lambda d: None)
    pids = [int((directory / "redis.pid").read_text())]
print(" ".join(map(str, pids)), flush=True)
if mode == "os-exit":  # as pytest-timeout's thread method ends a run: no teardown, no atexit
    import os
    os._exit(1)
time.sleep(600)
"""


def _ours(pid: int, directory: Path) -> bool:
    """Whether ``pid`` is still a live server of ``directory`` (not a zombie waiting for its
    reaper, not a reused pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cwd = os.readlink(f"/proc/{pid}/cwd")
        args = Path(f"/proc/{pid}/cmdline").read_bytes()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    # The embedded server changes into its --dir; test servers name theirs in --dir.
    return (
        stat.rsplit(")", 1)[-1].split()[0] != "Z"
        and is_server_process_name(comm)
        and (str(directory) in os.fsdecode(args) or cwd.startswith(str(directory)))
    )


def _start_and_kill_child(mode: str, directory: Path) -> list[int]:
    """Run `CHILD` in ``mode``, read the pids of its servers, SIGKILL it (unless it has ended
    on its own); return the pids."""
    directory.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, str(directory)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            if not selector.select(60):
                raise AssertionError(f"the child started no server within 60 s ({mode})")
        line = proc.stdout.readline()
        assert line.strip(), f"the child exited with {proc.wait(10)} before starting servers"
        return [int(pid) for pid in line.split()]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


def _still_running(pids: list[int], directory: Path, timeout: float) -> list[int]:
    """The pids of ``pids`` still running as servers of ``directory`` after ``timeout`` s
    (returns as soon as none is)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if _ours(pid, directory)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


@pytest.fixture
def leftovers(tmp_path: Path) -> Iterator[list[int]]:
    """Pids a test found still running: killed afterwards, so a failure leaks nothing."""
    found: list[int] = []
    yield found
    for pid in found:
        if _ours(pid, tmp_path):
            os.kill(pid, signal.SIGKILL)


linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only"
)


@linux_only
@pytest.mark.parametrize("mode", ["server", "os-exit", "from-a-thread", "cluster"])
def test_servers_die_with_the_process_that_started_them(
    mode: str, tmp_path: Path, leftovers: list[int]
) -> None:
    directory = tmp_path / "s"
    pids = _start_and_kill_child(mode, directory)
    assert len(pids) == (3 if mode == "cluster" else 1)
    leftovers.extend(_still_running(pids, tmp_path, timeout=10))
    assert not leftovers, f"redis-server {leftovers} outlived the killed process ({mode})"


def test_the_embedded_server_outlives_the_process_that_started_it(tmp_path: Path) -> None:
    """It is meant to: `stop_embedded` (``threadlog stop``) stops it."""
    home = tmp_path / ".threadlog"
    try:
        pids = _start_and_kill_child("embedded", home)
        assert _ours(pids[0], home.resolve())
        assert _ping(home / "redis.sock") == "+PONG"
    finally:
        es.stop_embedded(home)


# A test that starts an embedded server, says its pid, and waits to be killed with its run.
INNER_TEST = r"""
import time
from pathlib import Path

import eventstore as es


def test_holds_an_embedded_server(tmp_path: Path) -> None:
    home = tmp_path / ".threadlog"
    es.embedded_url(home, on_start=lambda d: None)
    print("PID=" + (home / "redis.pid").read_text().strip(), flush=True)
    time.sleep(600)
"""


def test_a_killed_test_run_stops_the_embedded_servers_its_tests_started(tmp_path: Path) -> None:
    """The embedded server outlives its command by design, so a test that starts one stops it
    in a teardown, which a killed run never runs: conftest's reaper stops it instead."""
    (tmp_path / "inner").mkdir()
    test_file = tmp_path / "inner" / "test_inner.py"
    test_file.write_text(INNER_TEST)
    basetemp = tmp_path / "base"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-s", "-q",
         "-p", "no:cacheprovider", f"--basetemp={basetemp}", str(test_file)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    pid = None
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            while pid is None and time.monotonic() < deadline:
                if not selector.select(deadline - time.monotonic()):
                    break
                line = proc.stdout.readline()
                if not line:
                    break
                if "PID=" in line:
                    pid = int(line.split("PID=", 1)[1].split()[0])
        assert pid is not None, "the inner test run started no embedded server"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()
    try:
        left = _still_running([pid], basetemp.resolve(), timeout=30)
        assert not left, f"the embedded redis-server {pid} outlived the killed test run"
    finally:
        for home in basetemp.glob("*/.threadlog"):
            es.stop_embedded(home)
