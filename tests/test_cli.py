"""The `threadlog` command through its real entry point: output and exit code of every command.

Every run is a subprocess (``python -m adapters.cli``, and once the installed ``threadlog``
script) against the test Redis with a fresh namespace. ``THREADLOG_URL`` defaults to
``memory://`` in the child environment so that no run can start the embedded server in the
repository by accident; the one test of the embedded default runs in a temporary directory and
stops the server it started.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import json
import os
import re
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import termios
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any, TypeVar

import anyio
import msgspec
import pytest
import redis

import eventstore as es
from adapters import SessionStore, ThreadStore, read_parquet_dir
from adapters._export import SOURCE_FILE
from adapters._framework_events import StoredWrite, WritesPut
from eventstore._feed import parse_stream_id
from eventstore._keys import KeyLayout
from eventstore.servers import free_port, redis_server
from eventstore.testing import msg
from projections import Projector
from projections.testing import settled

ROOT = Path(__file__).resolve().parent.parent
CLI = (sys.executable, "-m", "adapters.cli")
T = TypeVar("T")


def child_env(**changes: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("THREADLOG_")}
    env.update(THREADLOG_URL="memory://", COLUMNS="160", PYTHONPATH=str(ROOT))
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@dataclass(frozen=True)
class Run:
    argv: Sequence[str]
    code: int
    out: str
    err: str

    def lines(self) -> list[str]:
        return [line for line in self.out.splitlines() if line.strip()]

    def json(self) -> Any:
        return json.loads(self.out)


def cli(
    *args: str,
    url: str | None = None,
    namespace: str | None = None,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    command: Sequence[str] = CLI,
    timeout: float = 60,
) -> Run:
    argv = [*args]
    if url is not None:
        argv += ["--url", url]
    if namespace is not None:
        argv += ["--namespace", namespace]
    done = subprocess.run(
        [*command, *argv],
        cwd=cwd,
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return Run(argv, done.returncode, done.stdout, done.stderr)


def assert_one_line_error(run: Run, code: int = 2) -> str:
    assert run.code == code, run
    assert "Traceback" not in run.err, run
    lines = run.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("threadlog: "), run
    return lines[0]


def _interruptible() -> None:
    """In the child, before it runs: SIGINT back to its default action. A test run started in
    the background by a shell (``cmd &``) inherits SIGINT ignored, and Python then installs no
    handler for it: the Ctrl-C tests would test nothing but that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def cli_children() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """``start(*args)`` runs the command line as a child with its output piped. However the
    block ends (a failed assertion, a `subprocess.TimeoutExpired`), no child outlives it: each
    one still running is killed, and every one is reaped and its pipes closed."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [*CLI, *args],
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_interruptible,
        )
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


def with_store(url: str, namespace: str, job: Callable[[es.EventStore], Awaitable[T]]) -> T:
    """Run ``job`` with an open store, in this process (setup and tampering)."""

    async def main() -> T:
        async with await es.connect(url, namespace=namespace) as store:
            return await job(store)

    return anyio.run(main)


def fresh_namespace() -> str:
    return "cli" + uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class Demo:
    url: str
    namespace: str
    thread: str
    run: Run
    version: int


@pytest.fixture(scope="module")
def demo(redis_url: str) -> Demo:
    """One demo recorded on the test Redis; tests that use it only read."""
    namespace = fresh_namespace()
    run = cli("demo", url=redis_url, namespace=namespace)
    assert run.code == 0, run
    match = re.search(r"thread\s+(demo-[0-9A-Z]+)", run.out)
    assert match is not None, run.out
    thread = match.group(1)
    version = with_store(redis_url, namespace, lambda s: s.version(thread))
    return Demo(redis_url, namespace, thread, run, version)


# -- help, usage errors, unreachable servers ------------------------------------------------------


def test_help_lists_every_command_and_the_exit_codes() -> None:
    run = cli("--help")
    assert run.code == 0, run
    for command in (
        "demo",
        "threads",
        "show",
        "replay",
        "tail",
        "verify",
        "export",
        "rebuild",
        "check",
        "import-jsonl",
        "export-jsonl",
    ):
        assert command in run.out
    assert "exit codes:" in run.out and "verification failed" in run.out
    sub = cli("show", "--help")
    assert (
        sub.code == 0 and "--as-of" in sub.out and "--url" in sub.out and "exit codes:" in sub.out
    )
    version = cli("--version")
    assert version.code == 0 and version.out.startswith("threadlog ")


USAGE_ERRORS: list[tuple[list[str], str]] = [
    ([], "choose a command"),
    (["frobnicate"], "invalid choice"),
    (["threads", "--bogus"], "unrecognized arguments"),
    (
        ["export-jsonl", "s1", "-", "--json"],
        "unrecognized arguments: --json (see 'threadlog export-jsonl --help')",
    ),
    (["--bogus"], "unrecognized arguments: --bogus (see 'threadlog --help')"),
    # An option of the command given before it: "unrecognized", with a pointer to a help
    # that lists it, read as a contradiction.
    (
        ["--json", "threads"],
        "--json is an option of 'threadlog threads': give it after the command",
    ),
    (["show", "t1", "--as-of", "-5"], "or a seq (1, 2, ...)"),
    (["verify"], "give a THREAD or --all"),
    (["check", "t1", "--all"], "not both"),
    (["show"], "required: THREAD"),
    (["show", "t1", "--as-of", "yesterday"], "not an ISO-8601 time"),
    (["export", "--format", "csv", "--out", "x"], "invalid choice: 'csv'"),
    (["export", "--out", "x", "--workers", "0"], "not 'auto' or a whole number >= 1"),
    (["export", "--out", "x", "--workers", "2"], "in-memory store cannot be shared"),
    (["tail", "--limit", "-1"], "must be >= 0"),
    (["export", "--out", ""], "the output directory is empty"),
    (["export", "--out", " ", "--format", "ndjson"], "the output directory is empty"),
    # Not stdout, as for export-jsonl: parts go into a directory, which '-' would have named.
    (["export", "--out", "-", "--format", "ndjson"], "'-' (stdout) is no directory"),
    (
        ["export", "--out", "x", "--format", "ndjson", "--compression", "zstd"],
        "--compression applies to --format parquet only",
    ),
    (["show", "no-such-thread"], "no thread 'no-such-thread'"),
    (["show", "bad{id}"], "forbidden character"),
    # A byte that is not UTF-8 in the command line (Python decodes it as a lone surrogate).
    (["replay", os.fsdecode(b"ab\xff")], "holds the byte 0xff, not UTF-8"),
    (["verify", "no-such-thread"], "no thread"),
    (["export-jsonl", "no-such-session", "-"], "no thread"),
    (["import-jsonl", "/nonexistent/x.jsonl", "s1"], "cannot read /nonexistent/x.jsonl"),
    (["threads", "--url", "foo://x"], "unsupported URL scheme 'foo'"),
    (["threads", "--url", ""], "--url is empty"),
    (["threads", "--namespace", "bad/ns"], "namespace 'bad/ns'"),
    (["show", "t1", "--as-of", "10000000d"], "reaches back before year 1"),
    (["tail", "--since", "99999999999d"], "reaches back before year 1"),
    (["show", "t1", "--as-of", "\u00b2"], "not an ISO-8601 time"),
    (["show", "t1", "--as-of", "0001-01-01T00:00"], "out of the range of times"),
    (["replay", "t1", "--to", "99999999999999999999999"], "is too large"),
    (["show", "t1", "--window", "100000000000000000000"], "is too large"),
    (["threads", "--url", "unix:///tmp/x.sock?ssl_cert_reqs=none"], "needs a rediss:// URL"),
    (["replay", "t1", "--from", "0"], "'0' is not a seq (seqs start at 1)"),
    (["replay", "t1", "--from", "-1"], "'-1' is not a seq (seqs start at 1)"),
    (["replay", "t1", "--to", "0"], "'0' is not a seq (seqs start at 1)"),
    (["tail"], "tail on memory:// would wait forever"),
    (["stop", "--url", "redis://localhost:1"], "unrecognized arguments: --url"),
]


def test_usage_errors_are_one_line_with_exit_code_2() -> None:
    # Started together: each is a separate interpreter, and they are independent. One that
    # hangs fails the test at its timeout, and is killed with the rest still running.
    with cli_children() as start:
        procs = [(argv, expected, start(*argv)) for argv, expected in USAGE_ERRORS]
        for argv, expected, proc in procs:
            out, err = proc.communicate(timeout=60)
            line = assert_one_line_error(Run(argv, proc.returncode, out, err))
            assert expected in line, (argv, line)
            assert out == "", (argv, out)


def test_children_a_test_leaves_running_are_killed_and_reaped(redis_url: str) -> None:
    """A child still running when its test fails (here: a hang past its timeout) does not
    outlive the test."""
    with pytest.raises(subprocess.TimeoutExpired), cli_children() as start:
        hung = start("tail", "--url", redis_url, "--namespace", fresh_namespace())
        other = start("tail", "--url", redis_url, "--namespace", fresh_namespace())
        hung.communicate(timeout=0.5)
    for proc in (hung, other):
        assert proc.returncode == -signal.SIGKILL  # killed, and reaped (its status collected)


def test_unreachable_redis_is_one_line_with_exit_code_2_and_no_password() -> None:
    url = f"redis://alice:s3cret@127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    for argv in (["threads"], ["verify", "--all"], ["demo"]):
        run = cli(*argv, url=url)
        line = assert_one_line_error(run)
        assert "cannot use redis at redis://alice:***@127.0.0.1" in line, line
        assert "s3cret" not in run.err + run.out
    assert time.monotonic() - started < 30


def test_a_closed_stdout_or_stderr_gives_the_documented_exit_codes(redis_url: str) -> None:
    """``threadlog ... >&-`` (a daemon, a cron line) ended in an internal error (exit 3) with
    stdout closed, and with stderr closed an error exited 1, the code for failed verification.
    A closed stdout is refused before anything is done (exit 2; nothing could be shown), and
    with stderr closed the exit code is still the error's own."""
    namespace = fresh_namespace()
    with_store(redis_url, namespace, lambda s: s.append("t", [msg("hi")]))

    def run_closing(fd: int, *argv: str) -> int:
        return subprocess.run(
            [*CLI, *argv, "--url", redis_url, "--namespace", namespace],
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.DEVNULL if fd == 2 else None,
            stderr=subprocess.PIPE if fd == 1 else None,
            preexec_fn=lambda: os.close(fd),
            timeout=60,
            check=False,
        ).returncode

    assert run_closing(1, "threads") == 2
    assert run_closing(2, "threads") == 0
    assert run_closing(2, "show", "no-such-thread") == 2
    assert run_closing(2, "verify", "t") == 0
    closed = subprocess.run(
        [*CLI, "threads", "--url", redis_url, "--namespace", namespace],
        cwd=ROOT,
        env=child_env(),
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.close(1),
        timeout=60,
        check=False,
    )
    assert closed.stderr == "threadlog: standard output is closed: nothing could be shown\n"


def test_a_stderr_that_fails_to_write_keeps_exit_codes_and_tail_following(
    redis_url: str,
) -> None:
    """Standard error on a full disk (/dev/full) or a pipe whose reader went away: the error
    message could not be written and the command ended as an unhandled exception, exit 1
    (failed verification) for a usage error; tail stopped at its first line on stderr (exit
    141) with its output's reader still there. The exit code is now the error's own, and
    tail shows what it was asked for."""
    namespace = fresh_namespace()
    with_store(redis_url, namespace, lambda s: s.append("t", [msg("hi")]))

    def run(stderr: int | IO[str], *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *argv, "--url", redis_url, "--namespace", namespace],
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            timeout=60,
            check=False,
        )

    read_end, gone = os.pipe()
    os.close(read_end)  # stderr's reader went away: a write gets EPIPE
    try:
        with open("/dev/full", "w") as full:
            for stderr in (full, gone):
                assert run(stderr, "show", "no-such-thread").returncode == 2
                assert run(stderr, "verify", "t").returncode == 0
                tail = run(stderr, "tail", "--since", "1h", "--limit", "1", "--json")
                assert tail.returncode == 0, tail
                assert json.loads(tail.stdout)["seq"] == 1, tail
    finally:
        os.close(gone)


def test_a_full_server_says_it_is_full(tmp_path: Path) -> None:
    """A server at its maxmemory (noeviction) refuses writes with "command not allowed when
    used memory > 'maxmemory'. script: <sha>, on @user_script:176": the error says the server
    is full and what to do, and the refused import wrote nothing."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"role":"user","content":"hi"}\n')
    with redis_server() as server:
        with_store(server.url, "default", lambda s: s.append("t", [msg("before")]))
        with redis.Redis.from_url(server.url) as admin:
            admin.config_set("maxmemory", "1")  # already over it
            line = assert_one_line_error(cli("import-jsonl", str(source), "s1", url=server.url))
            admin.config_set("maxmemory", "0")
            assert admin.exists(KeyLayout("default").log("s1")) == 0
    assert "maxmemory" in line and "the Redis server is full" in line, line
    assert "raise its maxmemory or free memory" in line, line


def test_a_url_that_reaches_no_redis_server_says_so() -> None:
    """A --url at the wrong port often reaches another service (an HTTP server, say): Redis's
    client only says 'Protocol error, got "H" as reply type byte', which names no cause."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_http() -> None:
        with listener:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(1024)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    server = threading.Thread(target=answer_http, daemon=True)
    server.start()
    try:
        line = assert_one_line_error(cli("threads", url=f"redis://127.0.0.1:{port}"))
    finally:
        listener.close()
    assert f"cannot use redis at redis://127.0.0.1:{port}" in line, line
    assert "does not answer as a Redis server does" in line and "check the host and port" in line, (
        line
    )


def test_a_server_that_evicts_any_key_is_one_line_with_exit_code_2(redis_url: str) -> None:
    namespace = fresh_namespace()
    # Set and reset with redis-py: no threadlog store opens on the server while it evicts.
    with redis.Redis.from_url(redis_url) as admin:
        (before,) = admin.config_get("maxmemory-policy").values()
        admin.config_set("maxmemory-policy", "allkeys-lru")
        try:
            for argv in (["threads"], ["demo"]):
                line = assert_one_line_error(cli(*argv, url=redis_url, namespace=namespace))
                assert "maxmemory-policy allkeys-lru" in line and "nothing was written" in line
        finally:
            admin.config_set("maxmemory-policy", before)
    # The refused demo wrote nothing: the namespace is still unknown, and a demo now runs.
    assert f"no namespace {namespace!r}" in cli("threads", url=redis_url, namespace=namespace).err
    assert cli("demo", url=redis_url, namespace=namespace).code == 0


def test_output_an_encoding_cannot_hold_is_escaped_and_json_is_utf8(redis_url: str) -> None:
    """On a latin-1 or ASCII terminal, a message in Chinese stopped replay half-way with an
    internal error (exit 3)."""
    namespace = fresh_namespace()
    text = "hello \u2192 \u4e16\u754c \U0001f389"  # no letter latin-1 has beyond ASCII

    async def setup(store: es.EventStore) -> None:
        await ThreadStore(store).append_message("t", {"role": "user", "content": text})

    with_store(redis_url, namespace, setup)
    for encoding in ("ascii", "latin-1"):
        env = child_env(PYTHONIOENCODING=encoding)
        for argv in (["replay", "t"], ["show", "t"]):
            run = cli(*argv, url=redis_url, namespace=namespace, env=env)
            assert run.code == 0 and "Traceback" not in run.err, run
            assert "\\u4e16\\u754c" in run.out, run.out
        run = cli("replay", "t", "--json", url=redis_url, namespace=namespace, env=env)
        assert run.code == 0, run
        contents = [json.dumps(row) for row in map(json.loads, run.lines())]
        assert any(json.dumps(text)[1:-1] in row for row in contents), run.out


def test_a_reader_that_goes_away_ends_the_command_quietly(redis_url: str) -> None:
    """``threadlog replay T | head -1``: exit 141 (SIGPIPE's code), nothing on stderr."""
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        # Far more output than a pipe buffers (64 KiB), so the writer meets the closed pipe.
        for n in range(20):
            # Through the projector: show reads the window the append keeps materialized.
            await Projector(store).append("long", [msg(f"line {n}.{i} " * 10) for i in range(100)])

    with_store(redis_url, namespace, setup)
    # show --json is one document of ~200 KiB written at once: Python's buffered stdout
    # dropped what the pipe did not take without a word, and the command said 0.
    for argv in (
        ["replay", "long"],
        ["replay", "long", "--json"],
        ["show", "long", "--window", "2000", "--json"],
    ):
        assert_quiet_when_the_reader_leaves(argv, redis_url, namespace, child_env(COLUMNS="40"))


def assert_quiet_when_the_reader_leaves(
    argv: Sequence[str], redis_url: str, namespace: str, env: dict[str, str]
) -> None:
    """The command's reader goes away after one line (``| head -1``): exit 141, nothing on
    stderr."""
    proc = subprocess.Popen(
        [*CLI, *argv, "--url", redis_url, "--namespace", namespace],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # the reader goes away after one line
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=60) == 141, (argv, err)
    assert err == b"", (argv, err)


def test_a_reader_that_goes_away_from_a_long_table_ends_the_command_quietly(
    redis_url: str,
) -> None:
    """``threadlog threads --limit 0 | head -1``: a table rich writes at once went to Python's
    buffered stdout, which dropped what the pipe did not take without a word: exit 0, not
    141."""
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        # Rows of ~120 characters: far more than a pipe buffers (64 KiB).
        ids = [f"thread-{n:04}-" + "x" * 60 for n in range(1000)]
        for start in range(0, len(ids), 100):
            await asyncio.gather(*(store.append(t, [msg("hi")]) for t in ids[start : start + 100]))

    with_store(redis_url, namespace, setup)
    for argv in (["threads", "--limit", "0"], ["threads", "--limit", "0", "--json"]):
        assert_quiet_when_the_reader_leaves(argv, redis_url, namespace, child_env())


# -- demo -----------------------------------------------------------------------------------------


def test_demo_on_redis_shows_window_state_view_turn_tree_and_verdict(demo: Demo) -> None:
    out = demo.run.out
    assert f"store      redis at {demo.url}" in out
    assert f"namespace  {demo.namespace}" in out
    # Two turns failed, a user turn and its payment child: not two of the child turns.
    assert "Recorded 4 user turns and 5 child turns (2 of the 9 failed)" in out
    assert f"{demo.version} events" in out
    assert "History window: the last 6 messages" in out
    assert "Yes, book both please." in out  # the failed turn's request joined the conversation
    assert "State as the 'planner' reader view sees it" in out
    assert "Hidden from this reader: booking.total_eur, profile.email, profile.loyalty_no." in out
    assert "ada@example.com" not in out
    assert "Turn records: root turns and their child turns" in out
    assert "child_failed: booking aborted" in out and "tool_timeout" in out
    assert f"verify {demo.thread}: OK - {demo.version} events verified, chain intact" in out
    assert f"threadlog show {demo.thread} --url {demo.url} --namespace {demo.namespace}" in out
    assert demo.run.err == ""


def test_demo_on_the_memory_backend() -> None:
    run = cli("demo", url="memory://")
    assert run.code == 0, run
    assert "in-memory backend" in run.out
    assert ": OK - " in run.out
    assert "keeps nothing after this command exits" in run.out


def _installed_script() -> list[str]:
    beside = Path(sys.executable).parent / "threadlog"
    found = str(beside) if beside.exists() else shutil.which("threadlog")
    if found is None:
        pytest.skip("the threadlog console script is not installed (pip install -e .)")
    return [found]


def test_installed_script_runs_the_demo_on_the_embedded_default_repeatedly(
    tmp_path: Path,
) -> None:
    script = _installed_script()
    env = child_env(THREADLOG_URL=None)
    home = tmp_path / ".threadlog"
    try:
        first = cli("demo", cwd=tmp_path, env=env, command=script)
        second = cli("demo", cwd=tmp_path, env=env, command=script)
        listed = cli("threads", "--json", cwd=tmp_path, env=env, command=script)
    finally:
        es.stop_embedded(home)
    for run in (first, second, listed):
        assert run.code == 0, run
    threads = [re.search(r"thread\s+(demo-\w+)", r.out) for r in (first, second)]
    assert threads[0] is not None and threads[1] is not None
    assert threads[0].group(1) != threads[1].group(1)
    if shutil.which("redis-server") is not None:
        assert f"embedded redis-server in {home.resolve()}/" in first.out
        # The second run reused the server the first one started: both threads are there.
        ids = [t["thread"] for t in listed.json()["threads"]]
        assert ids == [threads[1].group(1), threads[0].group(1)]
    else:
        assert "in-memory backend" in first.out


def test_an_empty_threadlog_url_is_refused_not_taken_for_the_embedded_server(
    tmp_path: Path,
) -> None:
    """``THREADLOG_URL=$UNSET`` in a deployment: as an empty --url is, it is refused (exit 2),
    rather than start a redis-server in the working directory and answer from its empty
    data ("No threads")."""
    home = tmp_path / ".threadlog"
    try:
        runs = [
            cli(*argv, cwd=tmp_path, env=child_env(THREADLOG_URL=value))
            for argv in (["threads"], ["demo"])
            for value in ("", "  ")
        ]
    finally:
        es.stop_embedded(home)  # one started before the fix
    for run in runs:
        line = assert_one_line_error(run)
        assert "THREADLOG_URL is set but empty" in line, line
    assert not home.exists()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_the_embedded_server_is_announced_when_started_and_stopped_by_threadlog_stop(
    tmp_path: Path,
) -> None:
    env = child_env(THREADLOG_URL=None)
    home = (tmp_path / ".threadlog").resolve()
    try:
        first = cli("threads", cwd=tmp_path, env=env)
        second = cli("threads", cwd=tmp_path, env=env)
        refused = cli("stop", "--url", "redis://localhost:1", cwd=tmp_path, env=env)
        stopped = cli("stop", cwd=tmp_path, env=env)
        pid_file_left = (home / "redis.pid").exists()
        again = cli("stop", cwd=tmp_path, env=env)
    finally:
        es.stop_embedded(home)
    assert first.code == 0, first
    assert stat.S_IMODE((home / "lock").stat().st_mode) == 0o600
    assert f"started an embedded redis-server in {home}/" in first.err
    assert "'threadlog stop' stops it" in first.err
    assert second.code == 0 and "started" not in second.err, second
    assert_one_line_error(refused)
    assert stopped.code == 0 and f"stopped the embedded redis-server in {home}/" in stopped.out
    assert not pid_file_left  # redis-server removes it on a clean shutdown
    assert again.code == 0 and "no embedded redis-server is running" in again.out, again


def test_a_bad_namespace_is_refused_before_an_embedded_server_is_started(tmp_path: Path) -> None:
    env = child_env(THREADLOG_URL=None)
    try:
        run = cli("threads", "--namespace", "no spaces", cwd=tmp_path, env=env)
    finally:
        es.stop_embedded(tmp_path / ".threadlog")  # had one started after all, it stops here
    assert "namespace 'no spaces'" in assert_one_line_error(run)
    assert not (tmp_path / ".threadlog").exists()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["verify"], "give a THREAD or --all"),
        (["check"], "give a THREAD or --all"),
        (["rebuild", "t", "--all"], "give a THREAD or --all, not both"),
        (["export", "--format", "ndjson", "--compression", "zstd", "--out", "x"], "--compression"),
        (["drop-group", ""], "the group name is empty"),
        (["--namespace", "", "threads"], "namespace '' must be 1-64 characters"),
        (["forget-projection", "a b"], "projection name 'a b' must be"),
        (["forget-projection", "export-x"], "names an export's feed consumer group"),
        (["forget-projection", "usage", "--hash", ""], "hash name '' must be"),
        (["import-jsonl", "missing.jsonl", "s"], "cannot read missing.jsonl"),
        (["import-jsonl", "in.jsonl", ""], "session id must not be empty"),
        (["import-jsonl", "", "s"], "the file name is empty"),
        (["export-jsonl", "s", ""], "the file name is empty"),
        (["export-jsonl", "", "out.jsonl"], "session id must not be empty"),
    ],
)
def test_usage_errors_are_refused_before_an_embedded_server_is_started(
    tmp_path: Path, argv: list[str], said: str
) -> None:
    """A command line that cannot run says so without starting (and leaving running) the
    embedded server, or waiting for an unreachable --url, first."""
    (tmp_path / "in.jsonl").write_text('{"role":"user","content":"hi"}\n')
    env = child_env(THREADLOG_URL=None)
    try:
        run = cli(*argv, cwd=tmp_path, env=env)
    finally:
        es.stop_embedded(tmp_path / ".threadlog")  # had one started after all, it stops here
    assert said in assert_one_line_error(run)
    assert not (tmp_path / ".threadlog").exists()


def test_a_threadlog_redis_server_naming_nothing_is_one_line_and_starts_nothing(
    tmp_path: Path,
) -> None:
    env = child_env(THREADLOG_URL=None, THREADLOG_REDIS_SERVER=str(tmp_path / "redis-srv"))
    run = cli("threads", cwd=tmp_path, env=env)
    line = assert_one_line_error(run)
    assert f"THREADLOG_REDIS_SERVER='{tmp_path / 'redis-srv'}' is not an executable" in line
    assert not (tmp_path / ".threadlog").exists()


def test_stop_help_lists_no_store_options() -> None:
    run = cli("stop", "--help")
    assert run.code == 0, run
    options = run.out.split("options:", 1)[1].split("exit codes:", 1)[0]  # not the epilog
    assert "--url" not in options and "--namespace" not in options, run.out


def test_a_write_on_the_memory_backend_says_nothing_was_kept(tmp_path: Path) -> None:
    source = tmp_path / "s.jsonl"
    source.write_text('{"role": "user", "content": "hi"}\n')
    run = cli("import-jsonl", str(source), "s1")
    assert run.code == 0, run
    assert "memory:// keeps nothing" in run.err, run
    assert "memory://" not in cli("threads").err  # reads say nothing: there was nothing


# -- threads, show, replay ------------------------------------------------------------------------


def test_reading_commands_leave_a_namespace_never_written_without_a_key(redis_url: str) -> None:
    namespace = fresh_namespace()
    config = KeyLayout.config_key(namespace)

    async def exists() -> int:
        store = await es.connect(redis_url, namespace="probe" + uuid.uuid4().hex[:8])
        async with store:
            assert isinstance(store, es.RedisEventStore)
            return int(await store.client.exists(config))

    for argv in (("threads",), ("show", "t"), ("verify", "--all"), ("check", "--all")):
        run = cli(*argv, url=redis_url, namespace=namespace)
        assert run.code in (0, 2), run
        assert "Traceback" not in run.err, run
    assert anyio.run(exists) == 0
    first = {"role": "user", "content": "now it exists"}
    with_store(redis_url, namespace, lambda s: ThreadStore(s).append_message("t", first))
    assert anyio.run(exists) == 1


def test_threads_lists_newest_activity_first(redis_url: str) -> None:
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        threads = ThreadStore(store)
        for name in ("older", "middle", "newer"):
            await threads.append_message(name, {"role": "user", "content": name})
            await anyio.sleep(0.01)
        await threads.append_message("middle", {"role": "assistant", "content": "again"})

    with_store(redis_url, namespace, setup)
    run = cli("threads", "--json", url=redis_url, namespace=namespace)
    assert run.code == 0, run
    listed = run.json()
    # --url and --namespace work before the command name too.
    before = cli("--url", redis_url, "--namespace", namespace, "threads", "--json")
    assert before.code == 0 and before.json() == listed
    assert [t["thread"] for t in listed["threads"]] == ["middle", "newer", "older"]
    assert [t["version"] for t in listed["threads"]] == [2, 1, 1]
    assert listed["namespace"] == namespace and listed["more"] is False
    human = cli("threads", "--limit", "2", url=redis_url, namespace=namespace)
    assert human.code == 0, human
    assert human.out.index("middle") < human.out.index("newer")
    assert "older" not in human.out and "raise --limit" in human.out
    # The largest --limit accepted lists them all (its +1 went past what Redis takes).
    largest = cli(
        "threads", "--json", "--limit", str(2**63 - 1), url=redis_url, namespace=namespace
    )
    assert largest.code == 0 and largest.json() == listed, largest
    unknown = cli("threads", url=redis_url, namespace=fresh_namespace())
    assert "no namespace" in assert_one_line_error(unknown)
    empty = fresh_namespace()
    with_store(redis_url, empty, lambda store: store.namespace_exists())  # opened by a writer
    listed_empty = cli("threads", url=redis_url, namespace=empty)
    assert listed_empty.code == 0 and "No threads in namespace" in listed_empty.out
    # A damaged version among the threads asked together: that thread's is unknown, the
    # others' are still shown (versions are asked 512 threads a round trip).
    with_store(
        redis_url,
        namespace,
        lambda store: store.client.hset(store.keys.meta("newer"), "v", "x"),  # type: ignore[attr-defined]
    )
    damaged = cli("threads", "--json", url=redis_url, namespace=namespace)
    assert damaged.code == 0, damaged
    assert [t["version"] for t in damaged.json()["threads"]] == [2, None, 1]


def replay_rows(demo: Demo) -> list[dict[str, Any]]:
    run = cli("replay", demo.thread, "--json", url=demo.url, namespace=demo.namespace)
    assert run.code == 0, run
    return [json.loads(line) for line in run.lines()]


def test_show_prints_window_state_tree_records_and_transcript(demo: Demo) -> None:
    run = cli("show", demo.thread, url=demo.url, namespace=demo.namespace)
    assert run.code == 0, run
    for heading in (
        f"Thread {demo.thread}  namespace {demo.namespace}, version {demo.version}",
        "History window: the last 6 messages",
        "State: 3 blocks",
        "Turn tree: 9 turns",
        "Turn records in settle order: 9",
        "Session transcript: 5 messages",
    ):
        assert heading in run.out, heading
    assert "ada@example.com" in run.out  # every block, unfiltered
    assert "open (not settled)" not in run.out

    shown = cli("show", demo.thread, "--json", url=demo.url, namespace=demo.namespace).json()
    assert shown["version"] == demo.version and shown["as_of"] is None
    assert len(shown["messages"]) == 6
    assert shown["state"]["plan"]["value"]["status"] == "booked"
    roots = shown["turn_tree"]
    assert len(roots) == 4 and [len(r["children"]) for r in roots] == [2, 1, 1, 1]
    assert roots[1]["record"]["outcome"] == "failed"
    assert roots[1]["children"][0]["record"]["error"]["kind"] == "tool_timeout"
    assert len(shown["records"]) == 9
    assert shown["transcript"][0]["message"]["role"] == "system"  # compacted


def test_show_json_of_the_last_turns_counts_what_it_leaves_out(demo: Demo) -> None:
    """``show --turns 2`` says "the last 2 of 4 root turns" and "9, the last 2" records; its
    --json gave the 2 of each with no count of what was left out: a reader could not tell
    the last turns from all of them."""
    run = cli("show", demo.thread, "--turns", "2", url=demo.url, namespace=demo.namespace)
    assert "Turn tree: 9 turns, the last 2 of 4 root turns" in run.out, run
    assert "Turn records in settle order: 9, the last 2" in run.out, run
    argv = ("show", demo.thread, "--turns", "2", "--json")
    shown = cli(*argv, url=demo.url, namespace=demo.namespace).json()
    assert (shown["turns"], shown["root_turns"], shown["settled_turns"]) == (9, 4, 9)
    assert len(shown["turn_tree"]) == 2 and len(shown["records"]) == 2


def test_show_says_a_section_is_empty_instead_of_printing_an_empty_table(
    redis_url: str,
) -> None:
    """A thread of one message has no state block, turn or record: each section says so in
    one line (an empty table's bare header reads like output cut short); --json is as it was."""
    namespace = fresh_namespace()
    with_store(
        redis_url,
        namespace,
        lambda s: ThreadStore(s).append_message("e1", {"role": "user", "content": "hi"}),
    )
    run = cli("show", "e1", url=redis_url, namespace=namespace)
    assert run.code == 0, run
    for heading, empty in (
        ("State: 0 blocks", "(no state blocks)"),
        ("Turn tree: 0 turns", "(no turns)"),
        ("Turn records in settle order: 0", "(no turn records)"),
    ):
        at = run.out.index(heading)
        assert run.out[at:].splitlines()[1].strip() == empty, run.out
    for header in ("block   version", "outcome", "tokens in/out"):
        assert header not in run.out, run.out  # no header of an empty table
    assert "hi" in run.out  # the window that does hold a message is a table as before
    # A window of nothing: as of a seq before anything was recorded there is no window, but
    # a thread of only a transcript has an empty window.
    with_store(
        redis_url,
        namespace,
        lambda s: SessionStore(s).append("s1", [{"role": "user", "content": "yo"}]),
    )
    only_transcript = cli("show", "s1", url=redis_url, namespace=namespace)
    at = only_transcript.out.index("History window: the last 6 messages")
    assert only_transcript.out[at:].splitlines()[1].strip() == "(no messages)", only_transcript

    shown = cli("show", "e1", "--json", url=redis_url, namespace=namespace).json()
    assert (shown["state"], shown["turn_tree"], shown["records"]) == ({}, [], [])
    assert [m["message"]["content"] for m in shown["messages"]] == ["hi"]


def test_show_prints_values_that_look_like_markup_as_they_are(redis_url: str) -> None:
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        threads = ThreadStore(store)
        turn = await threads.open_turn(
            "m1", turn_id="[/]", request_message={"role": "user", "content": "[bold]hi"}
        )
        await threads.settle_turn("m1", turn, outcome="completed", model_tier="[red]gpt-[/]mini")

    with_store(redis_url, namespace, setup)
    run = cli("show", "m1", url=redis_url, namespace=namespace)
    assert run.code == 0, run
    assert "[red]gpt-[/]mini" in run.out and "[bold]hi" in run.out


def test_thread_ids_are_shown_with_bidi_and_c1_controls_escaped_by_every_command(
    redis_url: str,
) -> None:
    """A thread id may hold a bidi override (U+202E) or a C1 control (U+009B, CSI on some
    terminals): 'evil<RLO>gnp.exe' reads as 'evilexe.png'. show and replay escaped it; threads,
    tail, verify, check, rebuild and their error lines printed it as it is. --json keeps it."""
    namespace = fresh_namespace()
    thread = "evil\u202egnp\x9b31m.exe"

    async def setup(store: es.EventStore) -> None:
        threads = ThreadStore(store)
        turn = await threads.open_turn(thread, request_message={"role": "user", "content": "x"})
        await threads.settle_turn(thread, turn, outcome="completed")

    with_store(redis_url, namespace, setup)
    for argv in (
        ["threads"],
        ["show", thread],
        ["replay", thread],
        ["tail", "--since", "1h", "--limit", "2"],
        ["verify", thread],
        ["verify", "--all"],
        ["check", thread],
        ["rebuild", thread],
        ["export-jsonl", thread, "-"],  # refused: no transcript; the error names the thread
    ):
        run = cli(*argv, url=redis_url, namespace=namespace)
        assert run.code in (0, 2), run
        both = run.out + run.err
        assert "\u202e" not in both and "\x9b" not in both, (argv, both)
        if argv[0] != "replay" and argv != ["verify", "--all"]:  # those two name no thread
            assert "evil\\u202egnp\\x9b31m.exe" in both, (argv, both)
    listed = cli("threads", "--json", url=redis_url, namespace=namespace).json()
    assert [t["thread"] for t in listed["threads"]] == [thread]


def test_json_output_shows_messages_in_their_own_json_form(redis_url: str) -> None:
    namespace = fresh_namespace()
    text = b'{"role": "user",  "content": "hi", "zz": {"n": 1}}'  # spacing kept as source

    async def setup(store: es.EventStore) -> None:
        message = es.Message.from_json_bytes(text)
        assert message.source is not None and message.extra == {"zz": {"n": 1}}
        await ThreadStore(store).append_message("j1", message)

    with_store(redis_url, namespace, setup)
    replay = cli("replay", "j1", "--json", url=redis_url, namespace=namespace)
    assert replay.code == 0, replay
    payload = json.loads(replay.lines()[0])["payload"]
    assert payload["message"] == {"role": "user", "content": "hi", "zz": {"n": 1}}
    shown = cli("show", "j1", "--json", url=redis_url, namespace=namespace).json()
    assert shown["messages"][0]["message"] == {"role": "user", "content": "hi", "zz": {"n": 1}}


def test_show_as_of_a_seq_and_a_time_folds_the_past(demo: Demo) -> None:
    rows = replay_rows(demo)
    booking = next(
        r
        for r in rows
        if r["type"] == "state.updated" and r["payload"]["value"].get("status") == "booking"
    )
    seq = booking["seq"]
    run = cli(
        "show", demo.thread, "--as-of", str(seq), "--json", url=demo.url, namespace=demo.namespace
    )
    assert run.code == 0, run
    past = run.json()
    assert past["as_of"] == seq and past["version"] == seq
    assert past["latest_version"] == demo.version
    assert past["state"]["plan"]["value"]["status"] == "booking"  # failure is not rollback
    assert "booking" not in past["state"]
    assert len(past["transcript"]) == 6  # before the compaction

    human = cli("show", demo.thread, "--as-of", str(seq), url=demo.url, namespace=demo.namespace)
    assert human.code == 0 and f"as of seq {seq}, recorded " in human.out
    assert "open (not settled)" in human.out  # the failing turn had not settled yet

    moment = rows[seq - 1]["time_ms"]
    expected = max(r["seq"] for r in rows if r["time_ms"] <= moment)
    iso = datetime.fromtimestamp(moment / 1000, tz=UTC).isoformat(timespec="milliseconds")
    at_time = cli(
        "show", demo.thread, "--as-of", iso, "--json", url=demo.url, namespace=demo.namespace
    )
    assert at_time.code == 0, at_time
    assert at_time.json()["version"] == expected

    before = cli(
        "show",
        demo.thread,
        "--as-of",
        "2001-01-01T00:00:00Z",
        url=demo.url,
        namespace=demo.namespace,
    )
    assert before.code == 0 and "Nothing had been recorded" in before.out
    # So does replay (it said "--from 1 comes after --as-of ...", exit 2, with no --from).
    old = ("replay", demo.thread, "--as-of", "2001-01-01T00:00:00Z")
    replayed = cli(*old, url=demo.url, namespace=demo.namespace)
    assert replayed.code == 0 and "Nothing had been recorded" in replayed.out, replayed
    as_json = cli(*old, "--json", url=demo.url, namespace=demo.namespace)
    assert (as_json.code, as_json.out) == (0, ""), as_json
    # Replaying "up to" a point the thread has not reached is refused, not the whole thread.
    replay = cli(
        "replay",
        demo.thread,
        "--as-of",
        str(demo.version + 1),
        url=demo.url,
        namespace=demo.namespace,
    )
    line = assert_one_line_error(replay)
    assert f"--as-of {demo.version + 1}: thread {demo.thread!r} ends at seq {demo.version}" in line
    beyond = cli(
        "show",
        demo.thread,
        "--as-of",
        str(demo.version + 1),
        url=demo.url,
        namespace=demo.namespace,
    )
    assert f"ends at seq {demo.version}" in assert_one_line_error(beyond)
    # --from past the end is refused too: "No events in that range" with exit 0 (and nothing
    # at all with --json) reads as an empty thread to a script, not as a mistyped seq.
    for json_flag in ([], ["--json"]):
        past = cli(
            "replay",
            demo.thread,
            "--from",
            str(demo.version + 1),
            *json_flag,
            url=demo.url,
            namespace=demo.namespace,
        )
        line = assert_one_line_error(past)
        assert f"--from {demo.version + 1}: thread {demo.thread!r} ends at seq {demo.version}" in (
            line
        )
        assert past.out == ""


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_show_as_of_a_time_folds_one_life_of_the_thread(
    backend: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    """``show --as-of TIME`` finds the seq, then folds: a thread deleted and written again in
    between is shown as its current life stood then (nothing yet), never its new events up to
    a seq of the old life."""
    from io import StringIO

    from rich.console import Console

    from adapters import cli as cli_module

    async def main() -> dict[str, Any]:
        if backend == "memory":
            store: es.EventStore = es.MemoryEventStore(namespace=fresh_namespace())
        else:
            url: str = request.getfixturevalue("redis_url")
            store = await es.connect(url, namespace=fresh_namespace(), create_namespace=True)
        async with store:
            for n in range(3):
                await store.append("t", [msg(f"old{n}")])
                await anyio.sleep(0.003)
            (last,) = [e async for e in store.read("t", start=3)]
            await anyio.sleep(0.003)
            real = store.seq_at

            async def answer_then_recreate(thread_id: str, time_ms: int) -> int:
                store.seq_at = real  # type: ignore[method-assign]
                answer = await real(thread_id, time_ms)
                await store.delete_thread("t")
                await store.append("t", [msg(f"new{n}") for n in range(4)])
                return answer

            store.seq_at = answer_then_recreate  # type: ignore[method-assign]
            iso = last.time.isoformat()
            args = cli_module.build_parser().parse_args(["show", "t", "--as-of", iso, "--json"])
            console = Console(file=StringIO())
            where = cli_module.Where(url="memory://")
            ctx = cli_module.Ctx(console, console, where, store, True, False)
            await args.func(ctx, args)
        return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]

    shown = anyio.run(main)
    assert shown["messages"] == [] and shown["version"] == 0 and shown["as_of"] == 0


def test_replay_show_tail_and_check_print_no_control_characters_from_the_log(
    redis_url: str,
) -> None:
    """What a thread holds is written by agents and their users: an escape sequence in it must
    not reach the auditor's terminal as one (clear the screen, rewrite a line, hide text), nor
    a bidi override reorder what is shown. They are shown escaped; ``--json`` keeps them."""
    namespace = fresh_namespace()
    esc, rlo = "\x1b", "\u202e"
    turn = es.new_ulid()

    async def setup(store: es.EventStore) -> None:
        projector = Projector(store)
        text = f"hi {esc}[2J{esc}[H forged {rlo}txt\r\x07 end"
        await projector.append(
            "t", [es.MessageAppended(message=es.Message(role="user", content=text))]
        )
        await projector.append("t", [es.StateUpdated(block=f"notes{esc}[8m", value=f"v{esc}[31m")])
        await projector.append(
            "t",
            [
                es.TurnOpened(
                    turn_id=turn, request=es.Message(role="user", content=f"do {esc}]0;title\x07")
                ),
                es.TurnSettled(
                    turn_id=turn,
                    outcome="failed",
                    model_tier=f"big{esc}[1A",
                    error=es.TurnError(kind="tool", message=f"boom{esc}[2K"),
                ),
            ],
        )
        await projector.append(
            "t",
            [
                es.TranscriptReplaced(
                    messages=[es.Message(role="system", content=f"sum{esc}c")],
                    reason=f"cut{rlo}",
                )
            ],
        )

    async def damage_views(store: es.EventStore) -> None:
        assert isinstance(store, es.RedisEventStore)
        assert await store.client.delete(store.keys.view("t", "state")) == 1

    with_store(redis_url, namespace, setup)
    tail = ["tail", "t", "--since", "1h", "--limit", "5"]
    for args in (["replay", "t"], ["show", "t"], ["show", "t", "--as-of", "3"], tail):
        run = cli(*args, url=redis_url, namespace=namespace)
        assert run.code == 0, run
        for raw in ("\x1b", "\u202e", "\x07", "\r"):
            assert raw not in run.out, (args, raw, run.out)
        assert "\\x1b[2J" in run.out or "\\x1b[2K" in run.out, run.out
    # tail printed the events' summaries raw (the screen cleared), and check a differing
    # state block's name raw: a view's keys are the agent's too.
    with_store(redis_url, namespace, damage_views)
    for args in (["check", "t"], ["check", "--all"]):
        run = cli(*args, url=redis_url, namespace=namespace)
        assert run.code == 1 and "DIFFERENT" in run.out, run
        assert "\x1b" not in run.out and "notes\\x1b[8m" in run.out, (args, run.out)
    rows = [
        json.loads(line)
        for line in cli(
            "replay", "t", "--json", url=redis_url, namespace=namespace
        ).out.splitlines()
    ]
    assert "\x1b[2J" in rows[0]["payload"]["message"]["content"]


def test_replay_and_show_report_entries_lost_at_the_end_of_a_log(redis_url: str) -> None:
    """Entries the version holds but the log lost at its end (XDEL) are damage, as a hole in
    the middle is: ``replay`` shows what is there, then says which seq is missing (exit 1);
    ``show --as-of`` such a seq refuses to pass an earlier point off as it."""
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        for n in range(5):
            await Projector(store).append("t", [msg(f"m{n}")])
        assert isinstance(store, es.RedisEventStore)
        assert await store.client.xdel(store.keys.log("t"), "4-0", "5-0") == 2

    with_store(redis_url, namespace, setup)
    for extra in ([], ["--as-of", "5"], ["--to", "4"]):
        run = cli("replay", "t", *extra, url=redis_url, namespace=namespace)
        assert run.code == 1, run
        assert [line.split()[0] for line in run.lines()] == ["#1", "#2", "#3"], run
        assert "seq 4" in run.err and "missing from the log" in run.err, run
        assert "Traceback" not in run.err
    # With --json the lost entries are a row of the stream too (tail's kind), before the error;
    # up to a point before the end, the row stops there.
    for extra, last in (([], 5), (["--to", "4"], 4)):
        run = cli("replay", "t", "--json", *extra, url=redis_url, namespace=namespace)
        rows = [json.loads(line) for line in run.lines()]
        assert run.code == 1 and [row.get("seq") for row in rows] == [1, 2, 3, None], run
        hole = {"thread": "t", "type": "events.missing", "first": 4, "last": last}
        assert rows[3] == {**hole, "detail": "missing from the log: the log was damaged"}, rows
    for point in ("4", "5"):
        shown = cli("show", "t", "--as-of", point, url=redis_url, namespace=namespace)
        assert shown.code == 1 and "seq 4" in shown.err and not shown.out, shown
    assert cli("show", "t", "--as-of", "3", url=redis_url, namespace=namespace).code == 0
    assert cli("replay", "t", "--to", "3", url=redis_url, namespace=namespace).code == 0


def test_stored_keys_json_cannot_hold_are_shown_not_a_crash(redis_url: str) -> None:
    """A message stored whose tool call input is keyed by a bool and a tuple (every append
    refuses one now; one stored before is put in place here): show, replay and their --json
    crashed (exit 3) on every run; the keys are shown as JSON writers key them."""
    namespace = fresh_namespace()
    odd = es.Message(
        role="assistant",
        content=[es.ToolCallPart(tool_call_id="c", tool_name="f", input={True: 1, (1, 2): "t"})],
    )

    async def write(store: es.EventStore) -> None:
        await store.append("t1", [es.MessageAppended(message=es.Message(role="user", content="x"))])
        assert isinstance(store, es.RedisEventStore)
        log = store.keys.log("t1")
        [(entry_id, fields)] = await store.client.xrange(log)
        fields[b"d"] = msgspec.msgpack.encode(es.MessageAppended(message=odd))
        await store.client.delete(log)
        await store.client.xadd(log, fields, id=entry_id)

    with_store(redis_url, namespace, write)
    for command in (
        ["show", "t1"],
        ["show", "t1", "--json"],
        ["replay", "t1"],
        ["replay", "t1", "--json"],
    ):
        run = cli(*command, url=redis_url, namespace=namespace)
        assert run.code == 0 and "Traceback" not in run.err, (command, run)
    replayed = json.loads(cli("replay", "t1", "--json", url=redis_url, namespace=namespace).out)
    assert replayed["payload"]["message"]["content"][0]["input"] == {"true": 1, "(1, 2)": "t"}


class _CliScored(es.Event, tag="test_cli.scored", frozen=True):
    """An application's event type, as the module in `test_events_option...` defines it."""

    points: int = 0


APP_EVENTS_MODULE = """
import eventstore as es


@es.register_event
class Scored(es.Event, tag="test_cli.scored", frozen=True):
    points: int = 0
"""


def test_the_events_option_imports_an_applications_event_types(
    redis_url: str, tmp_path: Path
) -> None:
    """Without its module, an application's events are unknown types to the command: verify
    called every one of them undecodable (exit 1), a forgery among them looked the same.
    --events (or THREADLOG_EVENTS) imports the module that registers them."""
    if "test_cli.scored" not in es.registry:
        es.registry.register(_CliScored)
    namespace = fresh_namespace()
    (tmp_path / "myapp_events.py").write_text(APP_EVENTS_MODULE)

    async def write(store: es.EventStore) -> None:
        await store.append("t1", [_CliScored(points=i) for i in range(3)])

    with_store(redis_url, namespace, write)
    bare = cli("verify", "t1", url=redis_url, namespace=namespace, cwd=tmp_path)
    assert bare.code == 1 and "test_cli.scored" in bare.out + bare.err, bare
    assert "--events MODULE" in bare.out, bare
    # Elsewhere, a missing module, not damage: the way out is --events, not verify.
    line = assert_one_line_error(cli("replay", "t1", url=redis_url, namespace=namespace), 1)
    assert "--events MODULE" in line and "threadlog verify" not in line, line
    checked = cli("check", "t1", url=redis_url, namespace=namespace)
    assert checked.code == 1 and "UNVERIFIED (UNKNOWN EVENT TYPE)" in checked.out, checked
    assert "LOG DAMAGED" not in checked.out and "--events MODULE" in checked.out, checked
    every = cli("check", "--all", url=redis_url, namespace=namespace)
    assert every.code == 1 and "1 UNVERIFIED (UNKNOWN EVENT TYPE)" in every.out, every
    assert "LOG DAMAGED" not in every.out, every
    given = cli(
        "--events", "myapp_events", "verify", "t1", url=redis_url, namespace=namespace, cwd=tmp_path
    )
    assert given.code == 0 and "OK" in given.out, given
    env = child_env(THREADLOG_EVENTS="myapp_events")
    replayed = cli(
        "replay", "t1", "--json", url=redis_url, namespace=namespace, cwd=tmp_path, env=env
    )
    assert replayed.code == 0, replayed
    assert [json.loads(line)["payload"].get("points", 0) for line in replayed.out.splitlines()] == [
        0,
        1,
        2,
    ]
    missing = cli("--events", "no_such_module", "verify", "t1", url=redis_url, namespace=namespace)
    assert missing.code == 2 and "--events: cannot import 'no_such_module'" in missing.err, missing
    # Named as nothing, it was ignored; a module that exits as it is imported ended threadlog
    # with its code (0), nothing done and nothing said.
    empty = cli("--events", "", "verify", "t1", url=redis_url, namespace=namespace)
    assert "--events names no module" in assert_one_line_error(empty), empty
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    exits = cli(
        "--events", "exits_on_import", "verify", "t1", url=redis_url, namespace=namespace,
        cwd=tmp_path,
    )  # fmt: skip
    line = assert_one_line_error(exits)
    assert "cannot import 'exits_on_import': SystemExit" in line, line


def test_replay_prints_every_event_with_its_read_models(demo: Demo) -> None:
    run = cli("replay", demo.thread, url=demo.url, namespace=demo.namespace)
    assert run.code == 0, run
    lines = run.lines()
    assert len(lines) == demo.version
    assert lines[0].startswith("#1 ") and "turn.opened" in lines[0] and "(root)" in lines[0]
    assert "transcript replaced (compaction)" in run.out
    rows = replay_rows(demo)
    assert [r["seq"] for r in rows] == list(range(1, demo.version + 1))
    assert rows[-1]["models"] == {"messages": 7, "state_blocks": 3, "turns": 9, "transcript": 5}
    part = cli(
        "replay", demo.thread, "--from", "3", "--to", "5", url=demo.url, namespace=demo.namespace
    )
    assert part.code == 0 and [line.split()[0] for line in part.lines()] == ["#3", "#4", "#5"]
    # Past the end: replayed to the end, and said (a seq mistyped reads as no stopping point).
    past = cli(
        "replay", demo.thread, "--from", str(demo.version), "--to", "999",
        url=demo.url, namespace=demo.namespace,
    )  # fmt: skip
    assert past.code == 0 and past.lines()[0].startswith(f"#{demo.version} "), past
    assert past.lines()[-1] == f"--to 999: thread {demo.thread!r} ends at seq {demo.version}"
    as_json = cli(
        "replay", demo.thread, "--to", "999", "--json", url=demo.url, namespace=demo.namespace
    )
    assert as_json.code == 0 and len(as_json.lines()) == demo.version, as_json
    assert f"ends at seq {demo.version}" in as_json.err


def test_a_turn_of_one_step_is_said_in_the_singular(redis_url: str) -> None:
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        threads = ThreadStore(store)
        turn = await threads.open_turn("one", request_message={"role": "user", "content": "hi"})
        await threads.settle_turn("one", turn, outcome="completed", steps=1)

    with_store(redis_url, namespace, setup)
    for command in ("replay", "show"):
        run = cli(command, "one", url=redis_url, namespace=namespace)
        assert run.code == 0 and "1 step," in run.out and "1 steps" not in run.out, run


# -- verify, check, rebuild -----------------------------------------------------------------------


def test_a_meta_hash_replaced_by_another_type_is_one_damaged_thread(redis_url: str) -> None:
    # It failed the whole listing, and every command on the thread, with Redis's WRONGTYPE
    # words, which name no thread and no key.
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        assert isinstance(store, es.RedisEventStore)
        for t in ("fine", "hit"):
            await store.append(t, [msg("q")])
        await store.client.delete(store.keys.meta("hit"))
        await store.client.set(store.keys.meta("hit"), "x")

    with_store(redis_url, namespace, setup)
    listed = cli("threads", "--json", url=redis_url, namespace=namespace)
    assert listed.code == 0, listed
    rows = {row["thread"]: row for row in listed.json()["threads"]}
    assert (rows["hit"]["version"], rows["hit"]["damaged"]) == (None, True)
    assert (rows["fine"]["version"], rows["fine"]["damaged"]) == (1, False)
    text = cli("threads", url=redis_url, namespace=namespace)
    assert text.code == 0 and "damaged" in text.out and "fine" in text.out, text
    for command in ("show", "replay", "rebuild"):
        line = assert_one_line_error(cli(command, "hit", url=redis_url, namespace=namespace), 1)
        assert "thread 'hit': its meta hash was replaced" in line, (command, line)
        assert "threadlog verify hit" in line, (command, line)


def test_check_says_which_turns_are_odd_for_one_thread_and_for_all(redis_url: str) -> None:
    # A settlement of a turn never opened is recorded and flagged, not a difference: check
    # passes, and says so, for --all too (it said only "all OK").
    namespace = fresh_namespace()
    ghost = es.new_ulid()

    async def setup(store: es.EventStore) -> None:
        projector = Projector(store)  # the views kept as a runtime keeps them
        await projector.append("plain", [msg("q")])
        await projector.append("odd", [msg("q")])
        await projector.append("odd", [settled(ghost, "failed")])

    with_store(redis_url, namespace, setup)
    one = cli("check", "odd", url=redis_url, namespace=namespace)
    assert one.code == 0 and f"note: seq 2: turn {ghost} settled without open" in one.out, one
    every = cli("check", "--all", url=redis_url, namespace=namespace)
    assert every.code == 0, every
    assert "all OK (1 thread with turn notes)" in every.out, every.out
    assert f"note: odd seq 2: turn {ghost} settled without open" in every.out, every.out
    assert "plain" not in every.out, every.out
    rows = cli("check", "--all", "--json", url=redis_url, namespace=namespace).json()["threads"]
    assert (
        rows["odd"]["anomalies"] == [{"kind": "settled_without_open", "seq": 2, "turn_id": ghost}]
        and rows["plain"]["anomalies"] == []
    )


def test_verify_passes_intact_threads_and_fails_tampered_ones(redis_url: str) -> None:
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        threads = ThreadStore(store)
        for thread in ("intact", "tampered", "garbled", "clobbered", "metaless", "miscounted"):
            turn = await threads.open_turn(
                thread, request_message={"role": "user", "content": "hi"}
            )
            await threads.update_state(thread, "plan", {"step": 1}, turn_id=turn)
            await threads.settle_turn(thread, turn, outcome="completed", steps=1)
        assert isinstance(store, es.RedisEventStore)
        assert await store.client.xdel(store.keys.log("tampered"), "2-0") == 1
        # Garble the payload of seq 2: the stream is rewritten, ids and all other fields kept.
        key = store.keys.log("garbled")
        entries = await store.client.xrange(key)
        await store.client.delete(key)
        for entry_id, fields in entries:
            if entry_id == b"2-0":
                fields[b"d"] = b"\xc1 not msgpack"
            await store.client.xadd(key, fields, id=entry_id)
        # The log replaced by a string; the meta hash (the thread's version) deleted.
        await store.client.delete(store.keys.log("clobbered"))
        await store.client.set(store.keys.log("clobbered"), "hello")
        assert await store.client.delete(store.keys.meta("metaless")) == 1
        await store.client.hset(store.keys.meta("miscounted"), "v", "abc")

    with_store(redis_url, namespace, setup)
    ok = cli("verify", "intact", url=redis_url, namespace=namespace)
    assert ok.code == 0, ok
    assert "verify intact: OK - 3 events verified, chain intact (unkeyed)" in ok.out

    bad = cli("verify", "tampered", url=redis_url, namespace=namespace)
    assert bad.code == 1, bad
    assert "verify tampered: FAILED" in bad.out and "deleted" in bad.out
    verdict = cli("verify", "tampered", "--json", url=redis_url, namespace=namespace)
    assert verdict.code == 1
    assert verdict.json()["ok"] is False and verdict.json()["first_bad_seq"] == 2

    # Replaying a damaged log shows where the hole is and ends with exit code 1.
    holed = cli("replay", "tampered", url=redis_url, namespace=namespace)
    assert holed.code == 1, holed
    assert "seq 2 is missing from the log" in holed.out and "#3 " in holed.out, holed.out
    holed = cli("replay", "tampered", "--json", url=redis_url, namespace=namespace)
    assert holed.code == 1 and "seq 2 is missing" in holed.err, holed
    rows = [json.loads(line) for line in holed.lines()]
    assert [row.get("seq") for row in rows] == [1, None, 3], rows
    detail = "missing from the log: the log was damaged"
    hole = {"thread": "tampered", "type": "events.missing", "first": 2, "last": 2}
    assert rows[1] == {**hole, "detail": detail}, rows
    backwards = cli(
        "replay", "intact", "--from", "3", "--to", "2", url=redis_url, namespace=namespace
    )
    assert "comes before --from 3" in assert_one_line_error(backwards)
    after = cli(
        "replay", "intact", "--from", "3", "--as-of", "2", url=redis_url, namespace=namespace
    )
    assert "--from 3 comes after --as-of 2 (seq 2)" in assert_one_line_error(after)
    # --to and --as-of together: the replay ends at whichever comes first.
    for ends in (("--to", "1", "--as-of", "2"), ("--to", "2", "--as-of", "1")):
        both = cli("replay", "intact", "--json", *ends, url=redis_url, namespace=namespace)
        assert both.code == 0, both
        assert [json.loads(line)["seq"] for line in both.lines()] == [1], both

    garbled = cli("verify", "garbled", url=redis_url, namespace=namespace)
    assert garbled.code == 1 and "undecodable" in garbled.out, garbled
    # Reading the damaged log elsewhere is exit code 1 too, with a pointer to verify.
    replay = cli("replay", "garbled", url=redis_url, namespace=namespace)
    line = assert_one_line_error(replay, code=1)
    assert "seq 2" in line and "run 'threadlog verify garbled'" in line

    clobbered = cli("verify", "clobbered", url=redis_url, namespace=namespace)
    assert clobbered.code == 1 and "undecodable" in clobbered.out, clobbered
    assert "cannot be read as a log" in clobbered.out and "WRONGTYPE" in clobbered.out
    # Reading it elsewhere is stored damage too (exit 1), said as such.
    line = assert_one_line_error(
        cli("replay", "clobbered", url=redis_url, namespace=namespace), code=1
    )
    assert "replaced from outside threadlog" in line and "WRONGTYPE" in line, line
    # Without its meta hash the thread still has a log: not "no thread", but damage.
    metaless = cli("verify", "metaless", url=redis_url, namespace=namespace)
    assert metaless.code == 1 and "meta" in metaless.out, metaless
    assert "inserted" not in metaless.out, metaless
    # Read elsewhere it is that damage too (exit 1), not an empty thread or a seq 0 end.
    for command in ("replay", "show"):
        line = assert_one_line_error(
            cli(command, "metaless", url=redis_url, namespace=namespace), code=1
        )
        assert "meta hash (gone, or at version 0)" in line, (command, line)
        assert "run 'threadlog verify metaless'" in line, (command, line)
    for command in ("check", "rebuild"):  # their reports say it, pointing to verify
        run = cli(command, "metaless", url=redis_url, namespace=namespace)
        assert run.code == 1 and "threadlog verify metaless" in run.out + run.err, run
    # A version that is not a number: damage to that thread, never an internal error.
    miscounted = cli("verify", "miscounted", url=redis_url, namespace=namespace)
    assert miscounted.code == 1 and "meta hash is damaged" in miscounted.out, miscounted
    assert "b'abc'" in miscounted.out
    listed = cli("threads", url=redis_url, namespace=namespace)
    assert listed.code == 0 and "damaged" in listed.out, listed
    damaged = {
        row["thread"]
        for row in cli("threads", "--json", url=redis_url, namespace=namespace).json()["threads"]
        if row["version"] is None
    }
    assert damaged == {"metaless", "miscounted"}, damaged
    for command in ("check", "rebuild"):
        run = cli(command, "--all", url=redis_url, namespace=namespace)
        assert run.code == 1 and "miscounted" in run.out and "Traceback" not in run.err, run

    # One thread's damage does not stop the audit of the others.
    everything = cli("verify", "--all", url=redis_url, namespace=namespace)
    assert everything.code == 1, everything
    assert "verified 6 threads" in everything.out and "5 FAILED" in everything.out
    for thread in ("tampered", "garbled", "clobbered", "metaless", "miscounted"):
        assert thread in everything.out
    report = cli("verify", "--all", "--json", url=redis_url, namespace=namespace).json()
    assert report["ok"] is False and report["threads"]["intact"]["ok"] is True


@pytest.mark.frameworks
def test_threads_of_the_framework_adapters_verify_and_replay(redis_url: str) -> None:
    """The command decodes what the SDK session and the LangGraph saver append: their event
    types are known to every reader of `adapters`, frameworks installed or not."""
    from adapters.openai_agents import ThreadlogSession

    namespace = fresh_namespace()
    with_store(redis_url, namespace, lambda store: store.namespace_exists())  # opened by a writer
    empty = cli("verify", "--all", url=redis_url, namespace=namespace)
    assert empty.code == 0 and "nothing was verified (is the namespace right?)" in empty.out

    async def setup(store: es.EventStore) -> None:
        session = ThreadlogSession("user-1", store)
        await session.add_items(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        )
        write = StoredWrite(task_id="t1", idx=0, channel="messages", type="json", data=b"1")
        await store.append("lg:g1", [WritesPut(ns="", checkpoint_id="c1", writes=[write])])

    with_store(redis_url, namespace, setup)
    verified = cli("verify", "--all", url=redis_url, namespace=namespace)
    assert verified.code == 0, verified
    assert "verified 2 threads" in verified.out and "all OK" in verified.out
    replay = cli("replay", "agents:user-1", url=redis_url, namespace=namespace)
    assert replay.code == 0 and "agents.items_added" in replay.out, replay
    replay = cli("replay", "lg:g1", url=redis_url, namespace=namespace)
    assert replay.code == 0 and "langgraph.writes_put" in replay.out, replay


def test_check_finds_differences_and_rebuild_repairs_them(redis_url: str) -> None:
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        threads = ThreadStore(store)
        for thread in ("alpha", "beta"):
            await threads.append_message(thread, {"role": "user", "content": "hello"})
            await threads.append_message(thread, {"role": "assistant", "content": "hi"})

    async def damage(store: es.EventStore) -> None:
        assert isinstance(store, es.RedisEventStore)
        assert await store.client.delete(store.keys.view("alpha", "messages")) == 1

    with_store(redis_url, namespace, setup)
    assert cli("check", "--all", url=redis_url, namespace=namespace).code == 0
    with_store(redis_url, namespace, damage)

    found = cli("check", "alpha", url=redis_url, namespace=namespace)
    assert found.code == 1, found
    assert "check alpha: DIFFERENT" in found.out and "messages" in found.out
    assert "'threadlog rebuild alpha' restores the views" in found.out
    as_json = cli("check", "alpha", "--json", url=redis_url, namespace=namespace)
    assert as_json.code == 1 and as_json.json()["ok"] is False
    assert as_json.json()["differences"][0]["view"] == "messages"
    every = cli("check", "--all", url=redis_url, namespace=namespace)
    assert every.code == 1 and "checked 2 threads" in every.out and "1 DIFFERENT" in every.out

    rebuilt = cli("rebuild", "alpha", url=redis_url, namespace=namespace)
    assert rebuilt.code == 0 and "rebuilt the views of alpha at version 2" in rebuilt.out
    assert cli("check", "alpha", url=redis_url, namespace=namespace).code == 0
    all_rebuilt = cli("rebuild", "--all", url=redis_url, namespace=namespace)
    assert all_rebuilt.code == 0 and "rebuilt the views of 2 threads" in all_rebuilt.out
    clean = cli("check", "--all", url=redis_url, namespace=namespace)
    assert clean.code == 0 and "all OK" in clean.out
    assert clean.err == ""  # no progress bar without a terminal

    async def more_damage(store: es.EventStore) -> None:
        # A view value threadlog never wrote, and a log with an undecodable entry.
        assert isinstance(store, es.RedisEventStore)
        await store.client.lset(store.keys.view("beta", "messages"), 0, "zzz")
        await ThreadStore(store).append_message("gamma", {"role": "user", "content": "x"})
        ((_, fields),) = await store.read_raw("gamma")
        log = store.keys.log("gamma")
        await store.client.delete(log)
        await store.client.xadd(log, {**fields, b"d": b"\xc1 not msgpack"}, id="1-0")

    with_store(redis_url, namespace, more_damage)
    unstamped = cli("check", "beta", url=redis_url, namespace=namespace)
    assert unstamped.code == 1 and "an unstamped value" in unstamped.out, unstamped
    # Reading the damaged view is stored damage too (exit 1), with the command that mends it.
    shown = cli("show", "beta", url=redis_url, namespace=namespace)
    line = assert_one_line_error(shown, code=1)
    assert "unstamped value" in line and "run 'threadlog rebuild beta'" in line, line
    every = cli("check", "--all", url=redis_url, namespace=namespace)
    assert every.code == 1 and "checked 3 threads" in every.out, every
    assert "1 DIFFERENT, 1 LOG DAMAGED" in every.out and "beta" in every.out
    assert "check gamma: LOG DAMAGED" in every.out
    partly = cli("rebuild", "--all", url=redis_url, namespace=namespace)
    assert partly.code == 1, partly
    assert "rebuilt the views of 2 threads" in partly.out and "1 NOT REBUILT" in partly.out
    assert "1 whose logs fail verification" in partly.out and "gamma" in partly.out
    assert cli("check", "beta", url=redis_url, namespace=namespace).code == 0


def test_check_and_rebuild_never_fold_over_a_hole_in_the_log(redis_url: str) -> None:
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        threads = ThreadStore(store)
        for text in ("one", "two", "three"):
            await threads.append_message("holed", {"role": "user", "content": text})
        assert isinstance(store, es.RedisEventStore)
        assert await store.client.xdel(store.keys.log("holed"), "2-0") == 1

    with_store(redis_url, namespace, setup)
    check = cli("check", "holed", url=redis_url, namespace=namespace)
    assert check.code == 1 and "check holed: LOG DAMAGED" in check.out, check
    assert "seq 2 is missing from the log" in check.out
    rebuild = cli("rebuild", "holed", url=redis_url, namespace=namespace)
    line = assert_one_line_error(rebuild, code=1)
    assert "seq 2 is missing from the log" in line, line
    every = cli("rebuild", "--all", url=redis_url, namespace=namespace)
    assert every.code == 1 and "1 NOT REBUILT" in every.out, every
    # Trusted as it is, the log still cannot be folded over its hole.
    trusted = cli("rebuild", "holed", "--trust-log", url=redis_url, namespace=namespace)
    line = assert_one_line_error(trusted, code=1)
    assert "seq 2" in line and "missing from the log" in line, line


def _forge(thread: str, text: str) -> Callable[[es.EventStore], Awaitable[None]]:
    """Edit the payload of seq 2 of ``thread`` (a message) to ``text``, ids and links kept."""

    async def job(store: es.EventStore) -> None:
        assert isinstance(store, es.RedisEventStore)
        key = store.keys.log(thread)
        entries = await store.client.xrange(key)
        await store.client.delete(key)
        for entry_id, fields in entries:
            if entry_id == b"2-0":
                forged = es.MessageAppended(message=es.Message(role="assistant", content=text))
                fields[b"d"] = msgspec.msgpack.encode(forged)
            await store.client.xadd(key, fields, id=entry_id)

    return job


def _window(url: str, namespace: str, thread: str, env: dict[str, str] | None = None) -> str:
    run = cli("show", thread, "--json", url=url, namespace=namespace, env=env)
    assert run.code == 0, run
    return json.dumps(run.json()["messages"])


def test_check_and_rebuild_never_trust_a_forged_log(redis_url: str) -> None:
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        threads = ThreadStore(store)
        for thread in ("forged", "fine"):
            await threads.append_message(thread, {"role": "user", "content": "hello"})
            await threads.append_message(thread, {"role": "assistant", "content": "hi"})

    with_store(redis_url, namespace, setup)
    with_store(redis_url, namespace, _forge("forged", "FORGED"))
    assert "FORGED" not in _window(redis_url, namespace, "forged")

    check = cli("check", "forged", url=redis_url, namespace=namespace)
    assert check.code == 1, check
    assert "check forged: LOG DAMAGED - the log itself fails verification (modified" in check.out
    assert "run 'threadlog verify forged'" in check.out
    assert "threadlog rebuild" not in check.out  # no advice to copy the forgery
    as_json = cli("check", "forged", "--json", url=redis_url, namespace=namespace)
    assert as_json.code == 1 and as_json.json()["ok"] is False
    assert as_json.json()["log_verified"] is False
    assert as_json.json()["verdict"]["kind"] == "modified"
    every = cli("check", "--all", url=redis_url, namespace=namespace)
    assert every.code == 1 and "1 LOG DAMAGED" in every.out, every
    assert "threadlog rebuild" not in every.out

    refused = cli("rebuild", "forged", url=redis_url, namespace=namespace)
    line = assert_one_line_error(refused, code=1)
    assert "its log fails verification (modified" in line and "--trust-log" in line, line
    assert "FORGED" not in _window(redis_url, namespace, "forged")  # nothing written
    everything = cli("rebuild", "--all", url=redis_url, namespace=namespace)
    assert everything.code == 1, everything
    assert "rebuilt the views of 1 thread" in everything.out, everything
    assert "1 NOT REBUILT (1 whose logs fail verification" in everything.out
    assert "FORGED" not in _window(redis_url, namespace, "forged")

    # The override says what it does: the log as it is becomes the views.
    trusted = cli("rebuild", "forged", "--trust-log", url=redis_url, namespace=namespace)
    assert trusted.code == 0 and "rebuilt the views of forged at version 2" in trusted.out
    assert "FORGED" in _window(redis_url, namespace, "forged")
    helped = cli("rebuild", "--help")
    assert "--trust-log" in helped.out and "forged entry" in helped.out


def test_rebuild_verifies_keyed_chains_with_the_secret(redis_url: str) -> None:
    namespace = fresh_namespace()
    keyed = child_env(THREADLOG_SECRET="s3cret")

    async def setup(store: es.EventStore) -> None:
        await ThreadStore(store).append_message("k", {"role": "user", "content": "hi"})

    async def main() -> None:
        async with await es.connect(redis_url, namespace=namespace, secret=b"s3cret") as store:
            await setup(store)

    anyio.run(main)
    wrong = child_env(THREADLOG_SECRET="another")
    refused = cli("rebuild", "k", url=redis_url, namespace=namespace, env=wrong)
    line = assert_one_line_error(refused, code=1)
    assert "wrong_key" in line and "another chain key than this check's" in line, line
    unkeyed = cli("check", "k", url=redis_url, namespace=namespace)
    # Not damage: the check holds no key, the thread's writers one.
    said = "check k: UNVERIFIED (WRONG CHAIN KEY) - its log could not be verified under this"
    assert unkeyed.code == 1 and said in unkeyed.out, unkeyed
    assert "LOG DAMAGED" not in unkeyed.out and "THREADLOG_SECRET" in unkeyed.out
    every = cli("check", "--all", url=redis_url, namespace=namespace, env=wrong)
    assert every.code == 1 and ": 1 UNVERIFIED (WRONG CHAIN KEY)" in every.out, every
    assert "LOG DAMAGED" not in every.out
    ok = cli("rebuild", "k", url=redis_url, namespace=namespace, env=keyed)
    assert ok.code == 0 and "rebuilt the views of k at version 1" in ok.out, ok
    assert cli("check", "k", url=redis_url, namespace=namespace, env=keyed).code == 0


def test_audits_of_every_thread_see_one_removed_from_the_index(redis_url: str) -> None:
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        threads = ThreadStore(store)
        for thread in ("listed", "unlisted"):
            await threads.append_message(thread, {"role": "user", "content": "hello"})
        assert isinstance(store, es.RedisEventStore)
        index = store.keys.index(store.keys.partition("unlisted"))
        assert await store.client.zrem(index, "unlisted") == 1

    with_store(redis_url, namespace, setup)
    listed = cli("threads", url=redis_url, namespace=namespace)
    assert "unlisted" not in listed.out  # the listing reads the index
    verify = cli("verify", "--all", url=redis_url, namespace=namespace)
    assert verify.code == 1 and "verified 2 threads" in verify.out, verify
    assert "1 FAILED" in verify.out and "unlisted" in verify.out and "unindexed" in verify.out
    one = cli("verify", "unlisted", url=redis_url, namespace=namespace)
    assert one.code == 1 and "not in its partition's thread index" in one.out, one
    check = cli("check", "--all", url=redis_url, namespace=namespace)
    assert check.code == 1 and "checked 2 threads" in check.out, check
    assert "1 NOT IN THE THREAD INDEX" in check.out
    assert "check unlisted: NOT IN THE THREAD INDEX" in check.out
    # The repair, not another audit: the log verifies, and a rebuild lists the thread again.
    assert "(its log verifies: 'threadlog rebuild unlisted' lists it again)" in check.out
    report = cli("check", "--all", "--json", url=redis_url, namespace=namespace).json()
    assert report["ok"] is False and report["threads"]["unlisted"]["verdict"]["kind"] == "unindexed"
    # Its log verifies, so its views are rebuilt with the others.
    rebuilt = cli("rebuild", "--all", url=redis_url, namespace=namespace)
    assert rebuilt.code == 0 and "rebuilt the views of 2 threads" in rebuilt.out, rebuilt


async def unlist(store: es.EventStore, *threads: str) -> None:
    """Remove threads from their partition's thread index, as damage from outside would."""
    assert isinstance(store, es.RedisEventStore)
    for thread in threads:
        index = store.keys.index(store.keys.partition(thread))
        assert await store.client.zrem(index, thread) == 1


async def listed_unlisted_holed(store: es.EventStore) -> None:
    """Three threads of two messages: "unlisted" missing from the thread index, "holed"
    missing its first entry (and listed, unless a test unlists it)."""
    threads = ThreadStore(store)
    for thread in ("listed", "unlisted", "holed"):
        for text in ("one", "two"):
            await threads.append_message(thread, {"role": "user", "content": text})
    assert isinstance(store, es.RedisEventStore)
    assert await store.client.xdel(store.keys.log("holed"), "1-0") == 1
    await unlist(store, "unlisted")


def test_rebuild_all_says_which_threads_it_listed_in_the_index_again(redis_url: str) -> None:
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        await listed_unlisted_holed(store)
        await unlist(store, "holed")

    with_store(redis_url, namespace, setup)
    relisted = (
        "  unlisted: NOT IN THE THREAD INDEX - listed in it again (its entry was removed: "
        "listings, retention sweeps and index-based jobs did not see it)"
    )
    rebuilt = cli("rebuild", "--all", url=redis_url, namespace=namespace)
    assert rebuilt.code == 1, rebuilt
    lines = rebuilt.lines()
    assert lines[0] == (
        f"rebuilt the views of 2 threads in namespace {namespace!r}; 1 NOT IN THE THREAD "
        "INDEX (listed in it again); 1 NOT REBUILT (1 whose logs fail verification: run verify)"
    ), rebuilt
    assert lines[1] == relisted, rebuilt
    # A thread that was not rebuilt was not listed again either: only its failure is said.
    assert lines[2].startswith("  holed: ") and len(lines) == 3, rebuilt
    assert "unlisted" in cli("threads", url=redis_url, namespace=namespace).out
    again = cli("rebuild", "--all", url=redis_url, namespace=namespace)
    assert again.lines()[0] == (
        f"rebuilt the views of 2 threads in namespace {namespace!r}; 1 NOT REBUILT "
        "(1 whose logs fail verification: run verify)"
    ), again
    assert "unlisted" not in again.out

    # Without verification (--trust-log) the rebuild lists the thread again too, and says so.
    async def unlist_again(store: es.EventStore) -> None:
        await unlist(store, "unlisted")
        await store.delete_thread("holed")

    with_store(redis_url, namespace, unlist_again)
    trusted = cli("rebuild", "--all", "--trust-log", url=redis_url, namespace=namespace)
    assert trusted.code == 0, trusted
    assert trusted.lines() == [
        f"rebuilt the views of 2 threads in namespace {namespace!r}; 1 NOT IN THE THREAD "
        "INDEX (listed in it again)",
        relisted,
    ], trusted


def test_rebuild_of_one_thread_says_it_listed_it_in_the_index_again(redis_url: str) -> None:
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        await ThreadStore(store).append_message("unlisted", {"role": "user", "content": "hi"})
        await unlist(store, "unlisted")

    with_store(redis_url, namespace, setup)
    note = (
        "  unlisted: NOT IN THE THREAD INDEX - listed in it again (its entry was removed: "
        "listings, retention sweeps and index-based jobs did not see it)"
    )
    for trust in ((), ("--trust-log",)):
        rebuilt = cli("rebuild", "unlisted", *trust, url=redis_url, namespace=namespace)
        assert rebuilt.code == 0, rebuilt
        assert rebuilt.lines() == ["rebuilt the views of unlisted at version 1", note], rebuilt
        assert "unlisted" in cli("threads", url=redis_url, namespace=namespace).out
        again = cli("rebuild", "unlisted", *trust, url=redis_url, namespace=namespace)
        assert again.lines() == ["rebuilt the views of unlisted at version 1"], again
        with_store(redis_url, namespace, lambda store: unlist(store, "unlisted"))


def test_rebuild_json_says_what_became_of_each_thread(redis_url: str) -> None:
    namespace = fresh_namespace()

    with_store(redis_url, namespace, listed_unlisted_holed)
    every = cli("rebuild", "--all", "--json", url=redis_url, namespace=namespace)
    assert every.code == 1 and every.err == "", every
    report = every.json()
    assert (report["namespace"], report["ok"], report["index_only"]) == (namespace, False, False)
    rows = report["threads"]
    assert set(rows) == {"listed", "unlisted", "holed"}, report
    blank = {"failure": None, "detail": "", "verdict": None}
    assert rows["listed"] == {
        "ok": True,
        "thread_id": "listed",
        "version": 2,
        "listed_again": False,
        **blank,
    }
    assert rows["unlisted"] == {
        "ok": True,
        "thread_id": "unlisted",
        "version": 2,
        "listed_again": True,
        **blank,
    }
    holed = rows["holed"]
    assert (holed["ok"], holed["version"], holed["failure"]) == (False, None, "unverified")
    assert holed["verdict"]["kind"] == "deleted" and "threadlog verify holed" in holed["detail"]
    one = cli("rebuild", "holed", "--json", url=redis_url, namespace=namespace)
    assert one.code == 1 and one.err == "" and one.json() == holed, one
    trusted = cli("rebuild", "holed", "--trust-log", "--json", url=redis_url, namespace=namespace)
    assert trusted.code == 1, trusted  # a hole stops even a trusting rebuild: stored damage
    ok = cli("rebuild", "listed", "--json", url=redis_url, namespace=namespace)
    assert ok.code == 0 and ok.json() == rows["listed"], ok


def test_tables_align_thread_ids_shown_escaped_or_two_cells_wide(redis_url: str) -> None:
    from rich.cells import cell_len

    namespace = fresh_namespace()
    # Thread id -> as a table shows it: C1 and bidi controls escaped, CJK and emoji as they
    # are (two terminal cells a character).
    shown = {
        "plain": "plain",
        "c1\x9bz": "c1\\x9bz",
        "bidi\u202eevil": "bidi\\u202eevil",
        "日本語スレッド": "日本語スレッド",
        "emoji🙂x": "emoji🙂x",
    }

    async def setup(store: es.EventStore) -> None:
        threads = ThreadStore(store)
        assert isinstance(store, es.RedisEventStore)
        for thread in shown:
            await threads.append_message(thread, {"role": "user", "content": "hello"})
            index = store.keys.index(store.keys.partition(thread))
            assert await store.client.zrem(index, thread) == 1

    def rows_by_thread(run: Run, heading: str) -> tuple[str, dict[str, str]]:
        lines = run.out.splitlines()
        header = next(line for line in lines if line.startswith("  thread   ") and heading in line)
        rows = {t: next(x for x in lines if x.startswith(f"  {s} ")) for t, s in shown.items()}
        return header, rows

    with_store(redis_url, namespace, setup)
    verify = cli("verify", "--all", url=redis_url, namespace=namespace)
    assert verify.code == 1, verify
    header, rows = rows_by_thread(verify, "first bad seq")
    # Each row's first bad seq (0: an unindexed thread's) ends where its heading does.
    seq_ends = header.index("first bad seq") + len("first bad seq")
    for thread, row in rows.items():
        assert cell_len(row[: row.index(" 0   unindexed") + 2]) == seq_ends, (thread, verify)
    assert rows["plain"].startswith("  plain                        0   unindexed   "), verify

    assert cli("rebuild", "--all", url=redis_url, namespace=namespace).code == 0
    listed = cli("threads", url=redis_url, namespace=namespace)
    header, rows = rows_by_thread(listed, "events")
    events_end = header.index("events") + len("events")
    for thread, row in rows.items():
        assert cell_len(row[: row.index(" 1   ") + 2]) == events_end, (thread, listed)


def test_audits_of_every_thread_stop_on_an_edited_partition_count(redis_url: str) -> None:
    # An edited partition count moved every thread out of where readers look: `verify --all`
    # passed with those threads unseen. Now it names the damaged key and fails (exit 1: stored
    # damage, as for a thread's own keys).
    namespace = fresh_namespace()
    threads = [f"t{i}" for i in range(6)]

    async def setup(store: es.EventStore) -> None:
        for thread in threads:
            await store.append(
                thread, [es.MessageAppended(message=es.Message(role="user", content="x"))]
            )
        assert isinstance(store, es.RedisEventStore)
        await store.client.hset(es.KeyLayout.config_key(namespace), "partitions", 3)

    with_store(redis_url, namespace, setup)
    for command in (("verify", "--all"), ("check", "--all"), ("rebuild", "--all")):
        run = cli(*command, url=redis_url, namespace=namespace)
        assert run.code == 1, run
        assert "is damaged: it records a partition count of 3" in run.err, run


def test_verify_of_a_thread_that_is_not_there_says_why(redis_url: str) -> None:
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        await store.append("gone", [msg("hi")])
        await store.delete_thread("gone")

    with_store(redis_url, namespace, setup)
    gone = cli("verify", "gone", url=redis_url, namespace=namespace)
    assert "no thread 'gone'" in (line := assert_one_line_error(gone)), gone
    assert "it was deleted (the change feed records its deletion at" in line
    never = cli("verify", "never", url=redis_url, namespace=namespace)
    assert "no thread 'never'" in (line := assert_one_line_error(never)) and "never written" in line


# -- export, JSONL --------------------------------------------------------------------------------


def test_export_ndjson_and_parquet_incrementally(demo: Demo, tmp_path: Path) -> None:
    nd = tmp_path / "nd"
    run = cli(
        "export", "--format", "ndjson", "--out", str(nd), url=demo.url, namespace=demo.namespace
    )
    assert run.code == 0, run
    assert f"Exported {demo.version} events and 0 deletions" in run.out
    assert run.err == ""
    rows = [
        json.loads(line)
        for path in nd.glob("part-*.ndjson")
        for line in path.read_text().splitlines()
    ]
    assert sorted(r["seq"] for r in rows) == list(range(1, demo.version + 1))
    again = cli(
        "export", "--format", "ndjson", "--out", str(nd), url=demo.url, namespace=demo.namespace
    )
    assert again.code == 0 and "Nothing new to export" in again.out

    pq = tmp_path / "pq"
    result = cli(
        "export",
        "--out",
        str(pq),
        "--since",
        "1h",
        "--json",
        url=demo.url,
        namespace=demo.namespace,
    )
    assert result.code == 0, result
    assert result.json()["events"] == demo.version
    assert len(list(read_parquet_dir(pq))) == demo.version
    future = cli(
        "export", "--format", "ndjson", "--out", str(tmp_path / "future"), "--since",
        "2999-01-01T00:00:00+00:00", "--json", url=demo.url, namespace=demo.namespace,
    )  # fmt: skip
    assert future.code == 0 and future.json()["events"] == 0
    # Said as it is: a directory the run made and removed again was not written.
    future = cli(
        "export", "--format", "ndjson", "--out", str(tmp_path / "future"), "--since",
        "2999-01-01T00:00:00+00:00", url=demo.url, namespace=demo.namespace,
    )  # fmt: skip
    assert future.code == 0 and "future was not written" in future.out, future
    # A directory name holding an escape sequence is shown escaped, as errors show it.
    odd = tmp_path / "ev\x1b[31mil"
    shown = cli(
        "export", "--format", "ndjson", "--out", str(odd), url=demo.url, namespace=demo.namespace
    )
    assert shown.code == 0 and "\x1b" not in shown.out and "ev\\x1b[31mil" in shown.out, shown

    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    error = cli("export", "--out", str(blocked / "x"), url=demo.url, namespace=demo.namespace)
    assert str(blocked) in assert_one_line_error(error)


def test_export_with_worker_processes_writes_the_same_rows(redis_url: str, tmp_path: Path) -> None:
    namespace = fresh_namespace()

    async def record(store: es.EventStore) -> None:
        threads = ThreadStore(store)
        for i in range(12):  # threads over several partitions
            turn = await threads.open_turn(
                f"w{i}", request_message={"role": "user", "content": "q"}
            )
            await threads.settle_turn(f"w{i}", turn, outcome="completed", model_tier="small")

    with_store(redis_url, namespace, record)
    runs = {}
    for workers in ("1", "3"):
        out = tmp_path / workers
        run = cli(
            "export", "--out", str(out), "--workers", workers, "--json",
            url=redis_url, namespace=namespace,
        )  # fmt: skip
        assert run.code == 0, run
        runs[workers] = sorted(tuple(r.values()) for r in read_parquet_dir(out))
        assert run.json()["events"] == len(runs[workers]) == 24
    assert runs["1"] == runs["3"]


def test_export_directories_belong_to_one_source(redis_url: str, tmp_path: Path) -> None:
    first, second = fresh_namespace(), fresh_namespace()

    def record(threads: int) -> Callable[[es.EventStore], Awaitable[None]]:
        async def job(store: es.EventStore) -> None:
            for i in range(threads):
                await store.append(f"t{i}", [msg("q"), msg("a", role="assistant")])

        return job

    # The second namespace's events are older than the first's last position.
    with_store(redis_url, second, record(3))
    with_store(redis_url, first, record(4))
    out = tmp_path / "ex"
    run = cli("export", "--out", str(out), "--format", "ndjson", url=redis_url, namespace=first)
    assert "Exported 8 events" in run.out, run
    refused = cli(
        "export", "--out", str(out), "--format", "ndjson", url=redis_url, namespace=second
    )
    line = assert_one_line_error(refused)
    assert repr(first) in line and repr(second) in line and "another directory" in line
    alone = cli(
        "export", "--out", str(tmp_path / "ex2"), "--format", "ndjson", "--workers", "100",
        url=redis_url, namespace=second,
    )  # fmt: skip
    assert alone.code == 0 and "Exported 6 events" in alone.out, alone
    assert "--workers 100: exported with" in alone.err  # fewer processes, and why

    # --since: a run finding nothing leaves the directory new (one it made, not there at all);
    # then a full export.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    future = cli(
        "export", "--out", str(fresh), "--format", "ndjson", "--since", "2099-01-01",
        url=redis_url, namespace=first,
    )  # fmt: skip
    assert future.code == 0 and "stays new" in future.out, future
    assert not list(fresh.glob("part-*")) and not (fresh / SOURCE_FILE).exists()
    # ... and no consumer group of it at 0-0 holds trimming back.
    feed = cli("feed", "--json", url=redis_url, namespace=first).json()
    assert not any(g["name"].startswith("export-fresh-") for g in feed["groups"]), feed
    full = cli("export", "--out", str(fresh), "--format", "ndjson", url=redis_url, namespace=first)
    assert "Exported 8 events" in full.out, full
    since = cli(
        "export", "--out", str(fresh), "--format", "ndjson", "--since", "1h",
        url=redis_url, namespace=first,
    )  # fmt: skip
    assert "only starts a new export directory" in assert_one_line_error(since)


def test_export_directories_under_the_default_name_continue_independently(
    redis_url: str, tmp_path: Path
) -> None:
    namespace = fresh_namespace()

    def record(thread: str) -> None:
        with_store(redis_url, namespace, lambda s: s.append(thread, [msg("q"), msg("a")]))

    def export(out: str) -> Run:
        return cli(
            "export", "--out", out, "--format", "ndjson", url=redis_url, namespace=namespace,
            cwd=tmp_path,
        )  # fmt: skip

    record("t")
    assert "Exported 2 events" in export("d1").out
    assert "Exported 2 events" in export("d2").out
    record("u")
    for out in ("d1", "d2"):  # the first directory is not stuck behind the second's group
        run = export(out)
        assert run.code == 0 and "Exported 2 events" in run.out, run
        assert "Nothing new" in export(out).out
    # Directories that do share a name (given, or from before each had its own): the one
    # left behind is refused, and the remedy the message gives works as written.
    for out in ("s1", "s2"):
        shared = cli(
            "export", "--out", out, "--format", "ndjson", "--name", "shared",
            url=redis_url, namespace=namespace, cwd=tmp_path,
        )  # fmt: skip
        assert shared.code == 0, shared
    record("v")
    assert cli(
        "export", "--out", "s2", "--format", "ndjson", "--name", "shared",
        url=redis_url, namespace=namespace, cwd=tmp_path,
    ).code == 0  # fmt: skip
    stuck = export("s1")  # its recorded name, "shared"
    line = assert_one_line_error(stuck)
    assert "export into a new directory, without --name" in line, line
    assert "Exported 6 events" in export("s3").out


def test_export_from_an_empty_store_leaves_the_directory_for_a_real_one(
    redis_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    for url in ("memory://", "memory://"):  # a new, empty data set in every process
        empty = cli("export", "--out", str(out), "--format", "ndjson", url=url)
        assert empty.code == 0 and "Nothing to export" in empty.out, empty
    assert not out.exists() or not (out / SOURCE_FILE).exists()
    namespace = fresh_namespace()
    with_store(redis_url, namespace, lambda s: s.append("t", [msg("q")]))
    real = cli(
        "export", "--out", str(out), "--format", "ndjson", url=redis_url, namespace=namespace
    )
    assert real.code == 0 and "Exported 1 event" in real.out, real


def test_an_export_of_a_namespace_without_changes_says_so_for_a_new_directory(
    redis_url: str, tmp_path: Path
) -> None:
    namespace = fresh_namespace()

    async def nothing(store: es.EventStore) -> None:
        pass

    with_store(redis_url, namespace, nothing)  # the namespace is there, without a change
    out = tmp_path / "out"
    run = cli("export", "--out", str(out), url=redis_url, namespace=namespace)
    # Not "nothing new since the last run": there was none, and the directory is not there.
    assert run.code == 0 and "since the last run" not in run.out, run
    assert "Nothing to export" in run.out and "was not written" in run.out, run
    assert not out.exists()


def test_export_into_a_directory_whose_name_is_not_utf8(redis_url: str, tmp_path: Path) -> None:
    namespace = fresh_namespace()
    with_store(redis_url, namespace, lambda s: s.append("t", [msg("q")]))
    out = os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9")  # a name Linux allows

    def export(*args: str) -> Run:
        argv = ["export", "--out", *args, "--url", redis_url, "--namespace", namespace]
        done = subprocess.run([*CLI, *argv], env=child_env(), capture_output=True, timeout=60)
        # The name's bytes come back as they are: read them as the file system's.
        return Run(argv, done.returncode, os.fsdecode(done.stdout), os.fsdecode(done.stderr))

    for fmt in ("parquet", "ndjson"):
        target = f"{out}-{fmt}"
        run = export(target, "--format", fmt)
        assert run.code == 0 and run.out.startswith("Exported "), run  # (exit 3: parquet)
        with_store(redis_url, namespace, lambda s: s.append("t", [msg("q")]))
        # --json says the name as well as JSON can (it was an internal error, exit 3).
        run = export(target, "--format", fmt, "--json")
        assert run.code == 0, run
        (part,) = run.json()["files"]
        assert part.endswith(f"caf\\xe9-{fmt}/part-00000002.{fmt}"), part
        assert run.json()["events"] == 1


def test_an_export_refused_for_a_trimmed_feed_leaves_no_group_and_no_source(
    redis_url: str, tmp_path: Path
) -> None:
    namespace = fresh_namespace()
    with_store(redis_url, namespace, lambda s: s.append("t", [msg("q")]))
    time.sleep(0.01)
    trimmed = cli("trim-feed", "--max-age", "0s", url=redis_url, namespace=namespace)
    assert "Removed 1 entry" in trimmed.out, trimmed
    # A new directory on the trimmed feed is refused, and leaves nothing behind.
    refused = tmp_path / "refused"
    argv = ("export", "--out", str(refused), "--format", "ndjson")
    line = assert_one_line_error(cli(*argv, url=redis_url, namespace=namespace))
    assert "lack every change before" in line, line
    assert not (refused / SOURCE_FILE).exists()
    assert cli("feed", "--json", url=redis_url, namespace=namespace).json()["groups"] == []


def test_an_unknown_namespace_is_refused_and_nothing_is_created(
    redis_url: str, tmp_path: Path
) -> None:
    known = fresh_namespace()
    with_store(redis_url, known, lambda s: s.append("t", [msg("q")]))
    misspelt = known + "x"
    out = tmp_path / "out"
    for argv in (
        ("export", "--out", str(out)),
        ("export", "--out", str(out), "--format", "ndjson", "--json"),
        ("threads",),
        ("show", "t"),
        ("replay", "t"),
        ("verify", "--all"),
        ("check", "t"),
        ("export-jsonl", "t", "-"),
        # Commands that write views but no event: refused the same way, creating nothing.
        ("rebuild", "--all"),
        ("rebuild", "t"),
        ("rebuild", "t", "--trust-log"),
    ):
        run = cli(*argv, url=redis_url, namespace=misspelt)
        line = assert_one_line_error(run)
        assert f"no namespace {misspelt!r}" in line and known in line, line  # known ones named
        assert run.out == "", run
    # The namespace in the URL is named on purpose as well.
    url = f"{redis_url}{'&' if '?' in redis_url else '?'}namespace={misspelt}"
    assert f"no namespace {misspelt!r}" in assert_one_line_error(cli("threads", url=url))
    assert not out.exists()
    assert _namespace_keys(redis_url, misspelt) == []


def _namespace_keys(url: str, namespace: str) -> list[bytes]:
    async def keys(store: es.EventStore) -> list[bytes]:
        assert isinstance(store, es.RedisEventStore)
        return [k async for k in store.client.scan_iter(match=f"tl:{{{namespace}:*")]

    return with_store(url, "default", keys)


def test_import_jsonl_creates_a_namespace_only_when_it_writes(
    redis_url: str, tmp_path: Path
) -> None:
    namespace = fresh_namespace()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    for argv in (("import-jsonl", str(empty), "s1"), ("import-jsonl", str(bad), "s1")):
        line = assert_one_line_error(cli(*argv, url=redis_url, namespace=namespace))
        assert "nothing written" in line or "nothing was written" in line, (argv, line)
    assert _namespace_keys(redis_url, namespace) == []
    # ...so a read of it is still refused (a misspelt --namespace stays one).
    threads = cli("threads", url=redis_url, namespace=namespace)
    assert "no namespace" in assert_one_line_error(threads)
    # An import that writes creates the namespace, with its settings recorded.
    good = tmp_path / "good.jsonl"
    good.write_text('{"role":"user","content":"hi"}\n')
    url = f"{redis_url}{'&' if '?' in redis_url else '?'}partitions=4"
    imported = cli("import-jsonl", str(good), "s1", url=url, namespace=namespace)
    assert imported.code == 0, imported
    assert KeyLayout.config_key(namespace).encode() in _namespace_keys(redis_url, namespace)

    async def partitions(store: es.EventStore) -> int:
        return store.partitions

    assert with_store(redis_url, namespace, partitions) == 4
    assert (
        cli("export-jsonl", "s1", "-", url=redis_url, namespace=namespace).out == good.read_text()
    )


# SIGTERM is how a supervisor (systemd, Kubernetes, `timeout`) stops a job: it used to kill the
# command at once, saying nothing of what it had written; it stops it as Ctrl-C does.
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_import_stopped_by_ctrl_c_says_what_it_wrote(
    redis_url: str,
    tmp_path: Path,
    popen: Callable[..., subprocess.Popen[str]],
    signum: signal.Signals,
) -> None:
    namespace = fresh_namespace()
    source = tmp_path / "big.jsonl"
    line = '{"role":"user","content":"%s"}\n'
    # Two atomic appends' worth (64 events of 256 KiB each per append).
    source.write_text("".join(line % (f"{i} " + "x" * 100_000) for i in range(200)))

    async def blocked_writers(store: es.EventStore) -> int:
        assert isinstance(store, es.RedisEventStore)
        clients = await store.client.client_list()
        return sum("b" in c["flags"] and c["cmd"].startswith("eval") for c in clients)

    async def pause(store: es.EventStore, ms: int) -> None:
        assert isinstance(store, es.RedisEventStore)
        await store.client.execute_command("CLIENT", "PAUSE", ms, "WRITE")

    async def unpause(store: es.EventStore) -> None:
        assert isinstance(store, es.RedisEventStore)
        await store.client.execute_command("CLIENT", "UNPAUSE")

    # The server holds the first append; Ctrl-C comes while it is in flight. It lands once
    # the server goes on, and the import stops before the second.
    with_store(redis_url, namespace, lambda s: pause(s, 20_000))
    try:
        proc = popen(
            "import-jsonl", str(source), "s1", "--url", redis_url, "--namespace", namespace
        )
        deadline = time.monotonic() + 15
        while not with_store(redis_url, namespace, blocked_writers):
            assert time.monotonic() < deadline and proc.poll() is None, "no append was held"
            time.sleep(0.05)
        proc.send_signal(signum)
        time.sleep(1.0)  # time for the signal to reach the loop, even on a loaded machine
    finally:
        with_store(redis_url, namespace, unpause)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "wrote 128 of 200 messages (1 of 2 appends) into session s1 (version 64)" in err, err
    assert "idempotent" in err
    assert with_store(redis_url, namespace, lambda s: s.version("s1")) == 64
    rest = cli("import-jsonl", str(source), "s1", url=redis_url, namespace=namespace)
    assert rest.code == 0 and "(version 100)" in rest.out, rest
    # The second run says what it added, not only what the session now holds.
    assert "imported 200 of 200 lines into session s1" in rest.out, rest
    assert ": 72 newly written, 128 already there from an earlier import" in rest.out, rest
    exported = cli("export-jsonl", "s1", "-", url=redis_url, namespace=namespace)
    assert exported.out == source.read_text()  # every message once, in order


def test_import_jsonl_reads_standard_input_from_dash(redis_url: str, tmp_path: Path) -> None:
    """export-jsonl writes to '-' (stdout); import-jsonl read '-' as a file name ("cannot
    read -: No such file or directory"), so 'cat f | threadlog import-jsonl - s1' failed."""
    namespace = fresh_namespace()
    text = '{"role":"user","content":"hi"}\n{"role":"assistant","content":"yo"}\n'
    done = subprocess.run(
        [*CLI, "import-jsonl", "-", "s1", "--url", redis_url, "--namespace", namespace],
        cwd=ROOT,
        env=child_env(),
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done
    assert "imported 2 of 2 lines into session s1" in done.stdout, done
    back = cli("export-jsonl", "s1", "-", url=redis_url, namespace=namespace)
    assert back.out == text


def test_jsonl_lines_too_large_to_store_are_reported_as_such(
    redis_url: str, tmp_path: Path
) -> None:
    namespace = fresh_namespace()
    path = tmp_path / "big.jsonl"
    # Not compact JSON: its text is kept beside the parsed message, about twice the size.
    path.write_text(
        '{"role":"user","content":"ok"}\n{"role": "user", "content": "%s"}\n' % ("x" * 700_000)
    )
    run = cli("import-jsonl", str(path), "s1", url=redis_url, namespace=namespace)
    line = assert_one_line_error(run)
    assert "malformed" not in line and "1 line(s) too large to store: line 2:" in line, line
    assert "over the limit of 1,048,064 bytes" in line and "not compact JSON" in line, line


def test_jsonl_blank_lines_empty_files_and_threads_without_a_transcript(
    redis_url: str, tmp_path: Path
) -> None:
    namespace = fresh_namespace()
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    nothing = cli("import-jsonl", str(empty), "s2", url=redis_url, namespace=namespace)
    assert "no message to import" in assert_one_line_error(nothing)
    # The refused import wrote nothing, not even the namespace.
    never = cli("export-jsonl", "s2", "-", url=redis_url, namespace=namespace)
    assert f"no namespace {namespace!r}" in assert_one_line_error(never)

    # CRLF line ends and blank lines after the last message: messages byte for byte, LF ends.
    edited = tmp_path / "edited.jsonl"
    edited.write_bytes(b'{"role":"user","content":"a"}\r\n{"role":"user", "content":"b"}\r\n\r\n\n')
    run = cli("import-jsonl", str(edited), "s3", url=redis_url, namespace=namespace)
    assert run.code == 0 and "imported 2 of 2 lines" in run.out, run
    never = cli("export-jsonl", "s2", "-", url=redis_url, namespace=namespace)
    assert "no thread 's2'" in assert_one_line_error(never)
    out = cli("export-jsonl", "s3", "-", url=redis_url, namespace=namespace)
    assert out.out == '{"role":"user","content":"a"}\n{"role":"user", "content":"b"}\n'
    middle = tmp_path / "middle.jsonl"
    middle.write_bytes(b'{"role":"user","content":"a"}\n\n{"role":"user","content":"b"}\n')
    refused = cli("import-jsonl", str(middle), "s4", url=redis_url, namespace=namespace)
    assert "line 2: empty line" in assert_one_line_error(refused)

    async def converse(store: es.EventStore) -> None:
        threads = ThreadStore(store)
        turn = await threads.open_turn("chat", request_message={"role": "user", "content": "hi"})
        await threads.settle_turn("chat", turn, outcome="completed")

    with_store(redis_url, namespace, converse)
    target = tmp_path / "chat.jsonl"
    for where in (str(target), "-"):
        no_transcript = cli("export-jsonl", "chat", where, url=redis_url, namespace=namespace)
        assert "has no session transcript" in assert_one_line_error(no_transcript)
    assert not target.exists()


def test_jsonl_import_and_export_round_trip(redis_url: str, tmp_path: Path) -> None:
    namespace = fresh_namespace()
    source = tmp_path / "session.jsonl"
    data = (
        b'{"role":"user","content":"Plan my trip"}\n'
        b'{"role": "assistant",  "content": [{"type": "text", "text": "Where to?"}], "x": 1}\n'
        b'{"role":"user","content":"Lisbon"}\n'
    )
    source.write_bytes(data)
    run = cli("import-jsonl", str(source), "s1", url=redis_url, namespace=namespace)
    assert run.code == 0, run
    assert "imported 3 of 3 lines into session s1 (version 1)" in run.out
    again = cli("import-jsonl", str(source), "s1", url=redis_url, namespace=namespace)
    assert again.code == 0 and "already imported into session s1" in again.out
    many = tmp_path / "many.jsonl"
    many.write_text("".join(f'{{"role":"user","content":"{i}"}}\n' for i in range(1000)))
    run = cli("import-jsonl", str(many), "s2", url=redis_url, namespace=namespace)
    assert run.code == 0 and "imported 1,000 of 1,000 lines into session s2" in run.out, run
    assert "newly written" not in run.out, run

    target = tmp_path / "out.jsonl"
    written = cli("export-jsonl", "s1", str(target), url=redis_url, namespace=namespace)
    assert written.code == 0, written
    assert target.read_bytes() == data  # byte for byte
    to_stdout = cli("export-jsonl", "s1", "-", url=redis_url, namespace=namespace)
    assert to_stdout.code == 0 and to_stdout.out.encode() == data

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"role":"user","content":"ok"}\n{"oops"\n')
    refused = cli("import-jsonl", str(bad), "s2", url=redis_url, namespace=namespace)
    assert "1 malformed line(s): line 2" in assert_one_line_error(refused)
    skipped = cli("import-jsonl", str(bad), "s2", "--skip-bad", url=redis_url, namespace=namespace)
    assert skipped.code == 0, skipped
    assert "imported 1 of 2 lines" in skipped.out and "skipped line 2" in skipped.out


def test_import_jsonl_json_reports_every_line_it_refused_or_skipped(
    redis_url: str, tmp_path: Path
) -> None:
    namespace = fresh_namespace()
    bad = tmp_path / "bad.jsonl"
    good = '{"role":"user","content":"ok"}\n'
    # Seven bad lines: more than the one-line error names (five, "and 2 more").
    bad.write_text(good + "".join(f'{{"oops{i}"\n' for i in range(7)) + good)
    refused = cli("import-jsonl", str(bad), "s1", "--json", url=redis_url, namespace=namespace)
    assert "(and 2 more)" in assert_one_line_error(refused), refused
    report = refused.json()
    assert report["ok"] is False and report["empty"] is False, report
    assert (report["file"], report["session_id"]) == (str(bad), "s1"), report
    assert [e["line"] for e in report["errors"]] == [2, 3, 4, 5, 6, 7, 8], report
    assert all(e["reason"] and e["too_large"] is False for e in report["errors"]), report
    never = cli("export-jsonl", "s1", "-", url=redis_url, namespace=namespace)
    assert f"no namespace {namespace!r}" in assert_one_line_error(never)  # nothing written

    args = ("import-jsonl", str(bad), "s1", "--skip-bad", "--json")
    skipped = cli(*args, url=redis_url, namespace=namespace)
    assert skipped.code == 0 and skipped.err == "", skipped
    report = skipped.json()
    assert {k: report[k] for k in ("ok", "session_id", "lines", "imported", "written")} == {
        "ok": True,
        "session_id": "s1",
        "lines": 9,
        "imported": 2,
        "written": 2,
    }, report
    assert report["duplicate"] is False and report["version"] == 1, report
    assert [e["line"] for e in report["skipped"]] == [2, 3, 4, 5, 6, 7, 8], report
    again = cli(*args, url=redis_url, namespace=namespace).json()
    assert (again["duplicate"], again["written"], again["imported"]) == (True, 0, 2), again


def test_a_writer_without_the_threads_chain_key_is_a_one_line_error(
    redis_url: str, tmp_path: Path
) -> None:
    namespace = fresh_namespace()
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_bytes(b'{"role":"user","content":"Plan my trip"}\n')
    second.write_bytes(b'{"role":"user","content":"Lisbon"}\n')
    keyed = child_env(THREADLOG_SECRET="s3cret")
    run = cli("import-jsonl", str(first), "s1", url=redis_url, namespace=namespace, env=keyed)
    assert run.code == 0, run
    refused = cli("import-jsonl", str(second), "s1", url=redis_url, namespace=namespace)
    line = assert_one_line_error(refused, 2)
    assert "'s1' was written with a chain key and this store has none" in line
    assert "set THREADLOG_SECRET to the key its other writers use" in line
    assert "nothing was written" in line
    other = child_env(THREADLOG_SECRET="another")
    wrong = cli("import-jsonl", str(second), "s1", url=redis_url, namespace=namespace, env=other)
    assert "was written with a different chain key" in assert_one_line_error(wrong, 2)
    ok = cli("import-jsonl", str(second), "s1", url=redis_url, namespace=namespace, env=keyed)
    assert ok.code == 0, ok
    verified = cli("verify", "s1", url=redis_url, namespace=namespace, env=keyed)
    assert verified.code == 0 and "OK - 2 events verified, chain intact (keyed)" in verified.out
    unkeyed = cli("verify", "s1", url=redis_url, namespace=namespace)
    assert unkeyed.code == 1, unkeyed
    assert "written with a chain key and this check used none" in unkeyed.out
    # Said once, as what it is: not one "modified" row per entry.
    assert "wrong_key" in unkeyed.out and "modified" not in unkeyed.out
    assert "2 of 2 links fail under this check's key" in unkeyed.out
    as_json = cli("verify", "s1", "--json", url=redis_url, namespace=namespace).json()
    assert as_json["kind"] == "wrong_key" and len(as_json["problems"]) == 1


# -- tail -----------------------------------------------------------------------------------------


def test_tail_since_a_time_with_a_limit(demo: Demo) -> None:
    run = cli(
        "tail", demo.thread, "--since", "1h", "--limit", "5", url=demo.url, namespace=demo.namespace
    )
    assert run.code == 0, run
    lines = run.lines()
    assert len(lines) == 5
    assert f"{demo.thread} #1 " in lines[0] and f"{demo.thread} #5 " in lines[4]
    assert "following thread" in run.err
    as_json = cli(
        "tail", "--since", "1h", "--limit", "3", "--json", url=demo.url, namespace=demo.namespace
    )
    assert as_json.code == 0, as_json
    assert [json.loads(line)["seq"] for line in as_json.lines()] == [1, 2, 3]


def test_tail_never_shows_a_recreated_threads_events_as_the_deleted_ones(redis_url: str) -> None:
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        await store.append("tt-1", [msg(f"old{i}") for i in range(3)])
        await store.delete_thread("tt-1")
        await store.append("tt-1", [msg(f"NEW{i}") for i in range(2)])

    with_store(redis_url, namespace, setup)
    run = cli("tail", "--since", "1h", "--limit", "4", url=redis_url, namespace=namespace)
    assert run.code == 0, run
    lines = run.lines()
    # The first life's events are gone from the log: said so, never replaced by the new ones.
    assert "events #1..3: not in the log any more" in lines[0], lines
    assert "thread deleted (it had 3 events)" in lines[1], lines
    assert "#1 " in lines[2] and "NEW0" in lines[2], lines
    assert "#2 " in lines[3] and "NEW1" in lines[3], lines
    assert sum("NEW0" in line for line in lines) == 1, lines
    as_json = cli(
        "tail", "--since", "1h", "--json", "--limit", "2", url=redis_url, namespace=namespace
    )
    gone = json.loads(as_json.lines()[0])
    assert gone == {**gone, "type": "events.gone", "thread": "tt-1", "first": 1, "last": 3}


def test_every_row_tail_writes_besides_events_is_in_the_readme() -> None:
    # tail --json writes event rows and these: a reader must learn each from the README.
    source = (ROOT / "adapters" / "cli.py").read_text()
    kinds = set(re.findall(r'"type": "([a-z.]+)"', source))
    assert kinds >= {"events.missing", "events.gone", "feed.trimmed", "thread.deleted"}, kinds
    cli_section = (ROOT / "README.md").read_text().split("## The `threadlog` command")[1]
    assert {k for k in kinds if f"`{k}`" not in cli_section.split("\n## ")[0]} == set()


def _threads_in_two_partitions(partitions: int) -> tuple[str, str]:
    first = "to-a"
    other = next(
        f"to-b{i}"
        for i in range(1000)
        if es.partition_of(f"to-b{i}", partitions) != es.partition_of(first, partitions)
    )
    return first, other


def test_tail_shows_changes_in_time_order_across_partitions(redis_url: str) -> None:
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> list[tuple[str, int]]:
        a, b = _threads_in_two_partitions(store.partitions)
        order = []
        for i in range(4):
            for thread in (a, b):
                result = await store.append(thread, [msg(f"{thread}-{i}")])
                order.append((thread, result.first_seq))
                await anyio.sleep(0.003)  # feed ids are per-millisecond
        return order

    order = with_store(redis_url, namespace, setup)
    run = cli("tail", "--since", "1h", "--limit", "8", "--json", url=redis_url, namespace=namespace)
    assert run.code == 0, run
    rows = [json.loads(line) for line in run.lines()]
    assert [(r["thread"], r["seq"]) for r in rows] == order


def test_tail_shows_events_missing_from_the_log_as_damage_and_goes_on(redis_url: str) -> None:
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        await store.append("th-1", [msg(f"m{i}") for i in range(5)])  # one change: #1..5
        await store.append("th-1", [msg("m5"), msg("m6")])  # #6..7
        await store.append("th-1", [msg("m7")])  # #8
        assert isinstance(store, es.RedisEventStore)
        log = KeyLayout(namespace, store.partitions).log("th-1")
        await store.client.execute_command("XDEL", log, "3-0", "6-0", "7-0")

    with_store(redis_url, namespace, setup)
    run = cli("tail", "th-1", "--since", "1h", "--limit", "7", url=redis_url, namespace=namespace)
    assert run.code == 0, run
    lines = run.lines()
    assert "th-1 #2 " in lines[1] and "event #3: missing from the log" in lines[2], lines
    assert "run 'threadlog verify th-1'" in lines[2], lines
    assert "th-1 #4 " in lines[3] and "th-1 #5 " in lines[4], lines
    assert "events #6..7: missing from the log" in lines[5], lines
    assert "th-1 #8 " in lines[6], lines
    as_json = cli(
        "tail", "th-1", "--since", "1h", "--limit", "3", "--json", url=redis_url,
        namespace=namespace,
    )  # fmt: skip
    missing = json.loads(as_json.lines()[2])
    assert missing == {**missing, "type": "events.missing", "first": 3, "last": 3}


def test_tail_says_an_unknown_type_or_an_undecodable_event_for_what_it_is(
    redis_url: str,
) -> None:
    # Both were events.missing rows, though the log holds them: a reader was told data was
    # lost, and pointed to verify for events that only need their module (--events).
    if "test_cli.scored" not in es.registry:
        es.registry.register(_CliScored)
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        assert isinstance(store, es.RedisEventStore)
        await store.append("tu", [msg("a"), _CliScored(points=1), msg("c")])
        log = store.keys.log("tu")
        entries = await store.client.xrange(log)
        await store.client.delete(log)  # rewritten, ids and all other fields kept
        for entry_id, fields in entries:
            if entry_id == b"3-0":
                fields[b"d"] = b"\xc1 not msgpack"
            await store.client.xadd(log, fields, id=entry_id)

    with_store(redis_url, namespace, setup)
    rows = [
        json.loads(line)
        for line in cli(
            "tail", "tu", "--since", "1h", "--limit", "3", "--json", url=redis_url,
            namespace=namespace,
        ).lines()
    ]  # fmt: skip
    assert [r["type"] for r in rows] == [
        "message.appended", "events.unknown_type", "events.undecodable",
    ], rows  # fmt: skip
    assert rows[1]["first"] == rows[1]["last"] == 2 and "test_cli.scored" in rows[1]["detail"]
    assert rows[2]["first"] == rows[2]["last"] == 3
    text = cli("tail", "tu", "--since", "1h", "--limit", "3", url=redis_url, namespace=namespace)
    lines = text.lines()
    assert "event #2:" in lines[1] and "--events MODULE" in lines[1], lines
    assert "event #3:" in lines[2] and "run 'threadlog verify tu'" in lines[2], lines


async def _trim_every_feed(store: es.EventStore) -> int:
    await anyio.sleep(0.01)  # by age 0: every entry of an earlier millisecond
    return sum([await store.trim_feed(p, max_age_ms=0) for p in range(store.partitions)])


def test_tail_reports_changes_trimmed_from_the_feed_before_it_read_them(redis_url: str) -> None:
    """A catch-up (--since) over a feed trimmed since that time: the changes it can no longer
    read are said to be missing, in their place in the timeline, and tail goes on after them."""
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        await store.append("tr-1", [msg("gone0"), msg("gone1")])
        await store.append("tr-2", [msg("gone2")])
        assert await _trim_every_feed(store) == 2
        await store.append("tr-1", [msg("kept3")])
        await anyio.sleep(0.003)  # feed ids are per-millisecond
        await store.append("tr-2", [msg("kept4")])
        # More than the --limit below needs: a tail that skipped the gap would exit, not hang.
        await store.append("tr-1", [msg("kept5")])
        await store.append("tr-1", [msg("kept6")])

    with_store(redis_url, namespace, setup)
    run = cli("tail", "tr-1", "--since", "1h", "--limit", "2", url=redis_url, namespace=namespace)
    assert run.code == 0, run
    lines = run.lines()
    partition = es.partition_of("tr-1", es.DEFAULT_PARTITIONS)
    assert f"partition {partition}  changes after " in lines[0], lines
    assert "not shown: the change feed was trimmed past them" in lines[0], lines
    assert "tr-1 #3 " in lines[1] and "kept3" in lines[1], lines
    # The notice is not one of the --limit's events: two events follow it.
    assert "tr-1 #4 " in lines[2] and "kept5" in lines[2] and len(lines) == 3, lines
    as_json = cli(
        "tail", "--since", "1h", "--limit", "2", "--json", url=redis_url, namespace=namespace
    )  # fmt: skip
    assert as_json.code == 0, as_json
    rows = [json.loads(line) for line in as_json.lines()]
    gaps = [r for r in rows if r["type"] == "feed.trimmed"]
    shown = [(r["thread"], r["seq"]) for r in rows if r["type"] == "message.appended"]
    assert shown == [("tr-1", 3), ("tr-2", 2)], rows
    assert {g["partition"] for g in gaps} == {
        es.partition_of(t, es.DEFAULT_PARTITIONS) for t in ("tr-1", "tr-2")
    }, rows
    assert rows.index(gaps[-1]) < rows.index(next(r for r in rows if "seq" in r)), rows
    assert all(g["after"] == rows[0]["after"] and g["trimmed_to"] for g in gaps), rows


def test_tail_reports_changes_trimmed_while_it_follows(
    redis_url: str, popen: Callable[..., subprocess.Popen[str]]
) -> None:
    """Changes trimmed before tail started are none of its business; those trimmed while it
    follows, before it read them, are reported."""
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        await store.append("live", [msg("before")])
        assert await _trim_every_feed(store) == 1

    with_store(redis_url, namespace, setup)
    proc = popen(
        "tail", "live", "--limit", "2", "--json", "--interval", "5", "--url", redis_url,
        "--namespace", namespace,
    )  # fmt: skip
    assert proc.stderr is not None
    assert "following thread 'live'" in _read_line(proc.stderr, 30)
    time.sleep(1)  # past tail's first read; its next comes 5 s after it

    async def write(store: es.EventStore) -> None:
        await store.append("live", [msg("unseen")])
        assert await _trim_every_feed(store) == 1
        await store.append("live", [msg("after")])
        await store.append("live", [msg("more")])
        await store.append("live", [msg("beyond the limit")])  # a skipped gap: not hung

    with_store(redis_url, namespace, write)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    # The notice is not one of the --limit's two events.
    gap, *events = (json.loads(line) for line in out.splitlines())
    assert gap["type"] == "feed.trimmed", gap
    assert gap["partition"] == es.partition_of("live", es.DEFAULT_PARTITIONS), gap
    assert parse_stream_id(gap["after"]) < parse_stream_id(gap["trimmed_to"]), gap
    shown = [(e["seq"], e["payload"]["message"]["content"]) for e in events]
    assert shown == [(3, "after"), (4, "more")], events


def _read_line(stream: IO[str], timeout: float) -> str:
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise AssertionError(f"no output within {timeout} s")
    return stream.readline()


@pytest.fixture
def popen() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    with cli_children() as start:
        yield start


def test_tail_follows_new_events_until_its_limit(
    redis_url: str, popen: Callable[..., subprocess.Popen[str]]
) -> None:
    namespace = fresh_namespace()
    with_store(
        redis_url,
        namespace,
        lambda s: ThreadStore(s).append_message("live", {"role": "user", "content": "old"}),
    )
    proc = popen("tail", "live", "--limit", "3", "--url", redis_url, "--namespace", namespace)
    assert proc.stderr is not None
    assert "following thread 'live'" in _read_line(proc.stderr, 30)

    async def write(store: es.EventStore) -> None:
        threads = ThreadStore(store)
        await threads.append_message("elsewhere", {"role": "user", "content": "not followed"})
        turn = await threads.open_turn("live", request_message={"role": "user", "content": "new"})
        await threads.update_state("live", "plan", {"step": 1}, turn_id=turn)
        await threads.settle_turn(
            "live",
            turn,
            outcome="completed",
            assistant_message={"role": "assistant", "content": "ok"},
        )

    with_store(redis_url, namespace, write)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 3, out
    assert "live #2" in lines[0] and "turn.opened" in lines[0]
    assert "live #3" in lines[1] and 'plan = {"step":1}' in lines[1]
    assert "live #4" in lines[2] and "completed" in lines[2]
    assert "old" not in out and "elsewhere" not in out


def test_tail_waits_out_a_server_restart_and_follows_on(
    popen: Callable[..., subprocess.Popen[str]],
) -> None:
    """A server stopped for longer than the client's retries and started again: tail says it
    waits, says when the server answers, and shows what was written after, once."""
    with redis_server(extra_args=["--appendonly", "yes", "--appendfsync", "always"]) as server:
        namespace = fresh_namespace()

        def say(text: str) -> Callable[[es.EventStore], Awaitable[object]]:
            return lambda s: ThreadStore(s).append_message(
                "live", {"role": "user", "content": text}
            )

        with_store(server.url, namespace, say("before"))
        proc = popen("tail", "live", "--limit", "2", "--interval", "0.05", "--url", server.url,
                     "--namespace", namespace)  # fmt: skip
        assert proc.stderr is not None
        assert "following thread 'live'" in _read_line(proc.stderr, 30)
        with_store(server.url, namespace, say("first"))
        assert proc.stdout is not None and "first" in _read_line(proc.stdout, 30)
        server.stop()
        assert "the server does not answer" in _read_line(proc.stderr, 30)
        server.start()
        with_store(server.url, namespace, say("second"))
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "the server answers again" in err
        (shown,) = [line for line in out.splitlines() if line.strip()]
        assert "live #3" in shown and "second" in shown


def test_tail_waiting_for_its_namespace_waits_out_a_server_restart(
    popen: Callable[..., subprocess.Popen[str]],
) -> None:
    """tail started before its namespace was written waits for it; a restart of the server
    meanwhile is waited out as one while it follows (it ended tail, exit 2)."""
    with redis_server(extra_args=["--appendonly", "yes", "--appendfsync", "always"]) as server:
        namespace = fresh_namespace()
        proc = popen("tail", "--json", "--limit", "1", "--interval", "0.05",
                     "--url", server.url, "--namespace", namespace)  # fmt: skip
        assert proc.stderr is not None
        assert "has not been written yet; waiting for it" in _read_line(proc.stderr, 30)
        server.stop()
        assert "the server does not answer" in _read_line(proc.stderr, 30)
        server.start()
        assert "still waiting for the namespace" in _read_line(proc.stderr, 30)
        with_store(server.url, namespace, lambda s: s.append("t", [msg("after")]))
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert (row["thread"], row["seq"]) == ("t", 1), row


def _pipe_is_full(stream: IO[str], room: int) -> bool:
    """Whether a pipe the test reads from has less than ``room`` bytes free: a writer of
    that much (no more than PIPE_BUF, written whole or not at all) is blocked."""
    waiting = array.array("i", [0])
    fcntl.ioctl(stream.fileno(), termios.FIONREAD, waiting)
    return fcntl.fcntl(stream.fileno(), fcntl.F_GETPIPE_SZ) - waiting[0] < room


@pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="needs Linux pipe sizes")
def test_tail_resumes_a_change_cut_by_a_server_restart_where_it_was(
    popen: Callable[..., subprocess.Popen[str]],
) -> None:
    """One append of more events than tail reads at once (a feed entry shown over several
    pages), and the server stops after the first page was shown: tail shows the rest once it
    answers again, from the first event not shown, nothing twice and nothing skipped."""
    from adapters.cli import TAIL_PAGE

    events = 2 * TAIL_PAGE + 100
    with redis_server(extra_args=["--appendonly", "yes", "--appendfsync", "always"]) as server:
        namespace = fresh_namespace()
        pad = "x" * 2100  # lines of ~2.4 KB: a 4 KB pipe has room for one
        first = with_store(
            server.url,
            namespace,
            lambda s: s.append("big", [msg(f"{i} {pad}") for i in range(events)]),
        )
        assert (first.first_seq, first.last_seq) == (1, events)
        proc = popen("tail", "big", "--json", "--since", "1h", "--limit", str(events),
                     "--url", server.url, "--namespace", namespace)  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        fcntl.fcntl(proc.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)
        assert "following thread 'big'" in _read_line(proc.stderr, 30)
        deadline = time.monotonic() + 30
        while not _pipe_is_full(proc.stdout, 2048):  # tail blocked writing its first page
            assert time.monotonic() < deadline, "tail wrote nothing"
            time.sleep(0.01)
        server.stop()
        rows: list[dict[str, Any]] = []
        stdout = proc.stdout
        drain = threading.Thread(target=lambda: rows.extend(map(json.loads, stdout)))
        drain.start()
        assert "the server does not answer" in _read_line(proc.stderr, 30)
        time.sleep(0.5)  # the drain reads what tail wrote before it found the server gone
        assert [r["seq"] for r in rows] == list(range(1, TAIL_PAGE + 1))  # cut mid-change
        server.start()
        drain.join(timeout=60)
        proc.wait(timeout=30)
        err = proc.stderr.read()
    assert proc.returncode == 0, err
    assert "the server answers again" in err, err
    assert [r["seq"] for r in rows] == list(range(1, events + 1))
    assert {r["thread"] for r in rows} == {"big"}
    assert rows[-1]["payload"]["message"]["content"].startswith(f"{events - 1} ")


def test_tail_since_a_time_to_come_says_so(
    redis_url: str, popen: Callable[..., subprocess.Popen[str]]
) -> None:
    namespace = fresh_namespace()
    with_store(redis_url, namespace, lambda s: s.append("t", [msg("x")]))
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat(timespec="seconds")
    proc = popen("tail", "--since", later, "--url", redis_url, "--namespace", namespace)
    assert proc.stderr is not None
    line = _read_line(proc.stderr, 30)
    assert "a time still to come" in line, line
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_tail_starts_at_each_feeds_end_whatever_the_threads_activity_says(
    redis_url: str, popen: Callable[..., subprocess.Popen[str]]
) -> None:
    """The newest thread activity lies an hour ahead of the feeds (written before the server's
    clock stepped back): a change made now has an id below it, and tail shows it all the
    same, as it starts at each partition's newest feed id."""
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        assert isinstance(store, es.RedisEventStore)
        await store.append("ahead", [msg("before the clock stepped back")])
        await store.append("live", [msg("old")])
        p = es.partition_of("ahead", store.partitions)
        ahead = int(time.time() * 1000) + 3_600_000
        await store.client.zadd(store.keys.index(p), {"ahead": ahead})

    with_store(redis_url, namespace, setup)
    proc = popen(
        "tail", "--json", "--limit", "1", "--interval", "0.05",
        "--url", redis_url, "--namespace", namespace,
    )  # fmt: skip
    assert proc.stderr is not None
    assert "following every thread" in _read_line(proc.stderr, 30)
    with_store(redis_url, namespace, lambda s: s.append("live", [msg("new")]))
    try:
        out, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("tail passed over the change made after it started") from None
    assert proc.returncode == 0, err
    (row,) = [json.loads(line) for line in out.splitlines()]
    assert (row["thread"], row["seq"]) == ("live", 2), row


@pytest.mark.parametrize("named", [True, False], ids=["named", "default"])
def test_tail_started_before_its_namespace_follows_it_as_it_is_laid_out(
    redis_url: str, popen: Callable[..., subprocess.Popen[str]], named: bool
) -> None:
    with contextlib.ExitStack() as stack:
        if named:
            url, namespace = redis_url, fresh_namespace()
            where: tuple[str, ...] = ("--url", url, "--namespace", namespace)
        else:  # the default namespace, never written: a server of its own
            url, namespace = stack.enter_context(redis_server()).url, "default"
            where = ("--url", url)
        proc = popen("tail", "--json", "--limit", "8", "--interval", "0.05", *where)
        assert proc.stderr is not None
        assert f"namespace {namespace!r}" in _read_line(proc.stderr, 30)  # it has started

        async def write(store: es.EventStore) -> None:
            # 4 partitions, not the default 16: most threads live in other partitions then.
            assert store.partitions == 4
            for i in range(8):
                await store.append(f"t{i}", [msg(f"hello {i}")])

        sep = "&" if "?" in url else "?"
        with_store(f"{url}{sep}partitions=4", namespace, write)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    # Every event shown, none as deleted ("events.gone").
    assert sorted((r["thread"], r["type"]) for r in rows) == [
        (f"t{i}", "message.appended") for i in range(8)
    ], rows


def test_tail_stops_cleanly_on_ctrl_c(
    redis_url: str, popen: Callable[..., subprocess.Popen[str]]
) -> None:
    namespace = fresh_namespace()
    proc = popen("tail", "--url", redis_url, "--namespace", namespace)
    assert proc.stdout is not None and proc.stderr is not None
    assert "has not been written yet; waiting for it" in _read_line(proc.stderr, 30)
    with_store(
        redis_url,
        namespace,
        lambda s: ThreadStore(s).append_message("t9", {"role": "user", "content": "ping"}),
    )
    assert "t9 #1" in _read_line(proc.stdout, 30)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def _catches_sigint(pid: int) -> bool | None:
    """Whether the process has a SIGINT handler of its own (``SigCgt``); None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    caught = re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M)
    assert caught is not None, status
    return bool(int(caught.group(1), 16) & (1 << (signal.SIGINT - 1)))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_ctrl_c_while_the_command_line_is_still_loading_prints_no_traceback(
    redis_url: str,
) -> None:
    """A Ctrl-C before the command line's own handler exists (its imports take ~0.3 s) ends the
    process quietly, killed by SIGINT, instead of printing a KeyboardInterrupt traceback."""
    script = _installed_script()
    for _ in range(5):  # the window is ~0.3 s; a very slow start may let it pass unseen
        proc = subprocess.Popen(
            [*script, "tail", "--url", redis_url, "--namespace", fresh_namespace()],
            env=child_env(),
            preexec_fn=_interruptible,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        # Python starts with a handler of its own; the console script sets the default action
        # for its imports (no handler), and the command line puts a handler back after them.
        seen_python_handler = hit_window = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            caught = _catches_sigint(proc.pid)
            if caught is None:
                break
            if caught and seen_python_handler and hit_window:
                break
            if caught:
                seen_python_handler = True
            elif seen_python_handler:
                proc.send_signal(signal.SIGINT)
                hit_window = True
                break
            time.sleep(0.0005)
        if not hit_window:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        if hit_window:
            assert proc.returncode == -signal.SIGINT, (proc.returncode, err)
            return
        assert proc.returncode == 0, (proc.returncode, err)  # tail's own quiet stop
    pytest.fail("never caught the process while it was loading")


# -- the change feed ------------------------------------------------------------------------------


def test_drop_group_of_a_name_that_is_not_utf8_is_a_usage_error(redis_url: str) -> None:
    """A byte that is not UTF-8 in NAME (Python decodes it as a lone surrogate) reached the
    Redis client, which cannot encode it: an internal error (exit 3), not a usage error."""
    namespace = fresh_namespace()
    with_store(redis_url, namespace, lambda store: store.append("dg-1", [msg("a")]))
    run = cli("drop-group", os.fsdecode(b"ab\xff"), url=redis_url, namespace=namespace)
    assert "holds the byte 0xff, not UTF-8" in assert_one_line_error(run), run


def test_feed_trim_feed_and_drop_group_keep_the_feed_in_check(redis_url: str) -> None:
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> int:
        result = await store.append("fd-1", [msg("a")])
        await store.append("fd-1", [msg("b")])
        p = es.partition_of("fd-1", store.partitions)
        await store.create_feed_group(p, "reader")
        first = (await store.read_feed(p))[0]
        await store.advance_feed_group(p, "reader", first.id)
        assert result.first_seq == 1
        return p

    p = with_store(redis_url, namespace, setup)
    shown = cli("feed", "--json", url=redis_url, namespace=namespace)
    assert shown.code == 0, shown
    feed = shown.json()
    assert feed["partitions"][p]["length"] == 2 and feed["partitions"][p]["trimmed_to"] == "0-0"
    (group,) = feed["groups"]
    assert (group["name"], group["partition"], group["lost_changes"]) == ("reader", p, False)
    # Only what every group has read goes; the logs keep every event.
    trimmed = cli("trim-feed", "--json", url=redis_url, namespace=namespace)
    assert trimmed.code == 0 and trimmed.json() == {"namespace": namespace, "removed": 1, "left": 1}
    # By age, what the group has not read goes too, and the group is flagged as having lost it.
    time.sleep(0.01)
    aged = cli("trim-feed", "--max-age", "0s", url=redis_url, namespace=namespace)
    assert aged.code == 0 and "Removed 1 entry" in aged.out, aged
    table = cli("feed", url=redis_url, namespace=namespace)
    assert f"lost changes: the feed was trimmed past it (partition {p})" in table.out, table.out
    assert with_store(redis_url, namespace, lambda s: s.version("fd-1")) == 2
    missing = cli("drop-group", "readr", url=redis_url, namespace=namespace)
    assert "its groups: reader" in assert_one_line_error(missing)
    dropped = cli("drop-group", "reader", url=redis_url, namespace=namespace)
    assert dropped.code == 0 and "from 1 partition;" in dropped.out, dropped
    assert cli("feed", "--json", url=redis_url, namespace=namespace).json()["groups"] == []
    assert "--max-age" in cli("trim-feed", "--help").out


def test_forget_projection_removes_a_retired_projection_whole(redis_url: str) -> None:
    """`threadlog forget-projection` drops the projection's groups, checkpoints and figures,
    says what it removed (text and --json), and refuses a name it finds nothing of, naming
    the projections there are, or one that is no projection name, as one-line errors."""
    from projections import ProjectionRunner, UsageProjection

    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> tuple[int, int, int]:
        turn = es.new_ulid()
        usage = es.Usage(input_tokens=5, output_tokens=2)
        settled = es.TurnSettled(turn_id=turn, outcome="completed", usage=usage)
        await store.append("fp-1", [es.TurnOpened(turn_id=turn), settled])
        await store.apply_checkpointed(0, "other", expected="0-0", checkpoint="1-0")
        applied = await ProjectionRunner(store, UsageProjection(), consumer="c").run_once()
        return applied, es.partition_of("fp-1", store.partitions), store.partitions

    applied, p, partitions = with_store(redis_url, namespace, setup)
    assert applied == 1
    missing = cli("forget-projection", "usag", url=redis_url, namespace=namespace)
    assert "its async projections: other, usage" in assert_one_line_error(missing)
    bad = cli("forget-projection", "us age", url=redis_url, namespace=namespace)
    assert "projection name 'us age' must be" in assert_one_line_error(bad)
    bad = cli("forget-projection", "usage", "--hash", "a:b", url=redis_url, namespace=namespace)
    assert "hash name 'a:b' must be" in assert_one_line_error(bad)
    done = cli("forget-projection", "usage", "--json", url=redis_url, namespace=namespace)
    assert done.code == 0, done
    shown = done.json()
    assert shown["name"] == "usage" and shown["groups"] == list(range(partitions))
    assert list(shown["checkpoints"]) == [str(p)]
    assert shown["hashes"] == {str(p): ["input_tokens", "output_tokens", "turns"]}
    assert with_store(redis_url, namespace, lambda s: UsageProjection().report(s)) == []
    again = cli("forget-projection", "other", url=redis_url, namespace=namespace)
    assert again.code == 0, again
    assert (
        f"Forgot async projection 'other' in namespace {namespace!r}: its group on 0 "
        "partitions; its checkpoint on 1 partition; 0 hashes of figures"
    ) in again.out.replace("\n", " ")
    gone = cli("forget-projection", "other", url=redis_url, namespace=namespace)
    assert "it has none" in assert_one_line_error(gone)


def test_feed_lists_every_group_past_a_damaged_checkpoint(redis_url: str) -> None:
    """A checkpoint changed from outside threadlog into something that is no feed id stopped
    the whole listing with `CorruptKeyError`; each row now says what is wrong where, and
    the other groups are listed as before."""
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> int:
        assert isinstance(store, es.RedisEventStore)
        await store.append("t", [msg("a")])
        p = es.partition_of("t", store.partitions)
        await store.create_feed_group(p, "reader")
        await store.create_feed_group(p, "usage")
        checkpoints = store.keys.checkpoints(p)
        await store.client.hset(checkpoints, mapping={"usage": b"garbage", "gone": b"\xff"})
        return p

    p = with_store(redis_url, namespace, setup)
    shown = cli("feed", "--json", url=redis_url, namespace=namespace)
    assert shown.code == 0, shown
    rows = {g["name"]: g for g in shown.json()["groups"]}
    assert set(rows) == {"reader", "usage", "gone"}
    assert rows["reader"]["damaged"] is None and rows["reader"]["unread"] == 1
    assert "no feed id" in rows["usage"]["damaged"] and rows["usage"]["registered"]
    assert rows["gone"]["damaged"] is not None and not rows["gone"]["registered"]
    table = cli("feed", url=redis_url, namespace=namespace)
    assert table.code == 0, table
    assert f"damaged checkpoint (partition {p})" in table.out, table.out


def test_feed_and_export_get_past_a_group_another_tool_named_in_bytes_not_utf8(
    redis_url: str, tmp_path: Path
) -> None:
    """A consumer group an admin created with a name that is not UTF-8 stopped 'threadlog
    feed' (--json too) and every incremental export of the namespace with an internal error
    (exit 3): the name was decoded as UTF-8."""
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        assert isinstance(store, es.RedisEventStore)
        await store.append("t", [msg("a")])
        feed = store.keys.feed(es.partition_of("t", store.partitions))
        await store.client.xgroup_create(feed, b"odd\xff\x1b[2J", "0-0")

    with_store(redis_url, namespace, setup)
    run = cli("feed", url=redis_url, namespace=namespace)
    assert run.code == 0, run
    assert "odd\\xff\\x1b[2J" in run.out and "\x1b" not in run.out, run.out
    shown = cli("feed", "--json", url=redis_url, namespace=namespace)
    assert shown.code == 0, shown
    assert [g["name"] for g in shown.json()["groups"]] == ["odd\\xff\x1b[2J"]
    argv = ("export", "--format", "ndjson", "--out", str(tmp_path / "out"))
    exported = cli(*argv, url=redis_url, namespace=namespace)
    assert exported.code == 0 and exported.out.startswith("Exported 1 event"), exported


def test_feed_shows_a_group_another_tool_named_as_it_is_named(redis_url: str) -> None:
    """Consumer groups on the feed made outside threadlog (an admin's XGROUP CREATE) may be
    named anything: '[/]' stopped 'threadlog feed' with an internal error (rich markup), and an
    escape sequence in a name reached the terminal raw."""
    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        assert isinstance(store, es.RedisEventStore)
        await store.append("t", [msg("a")])
        feed = store.keys.feed(es.partition_of("t", store.partitions))
        for name in ("[/]", "[red]x", "evil\x1b[2J"):
            await store.client.xgroup_create(feed, name, "0-0")

    with_store(redis_url, namespace, setup)
    run = cli("feed", url=redis_url, namespace=namespace)
    assert run.code == 0, run
    assert "[/]" in run.out and "[red]x" in run.out and "evil\\x1b[2J" in run.out, run.out
    assert "\x1b" not in run.out, run.out
    # Listed as holding trimming back, each can be dropped by its name, whatever it is (a
    # name threadlog would not give a group was refused: the listing could not be acted on).
    for name in ("[/]", "[red]x", "evil\x1b[2J", "a group"):
        if name == "a group":
            missing = cli("drop-group", name, url=redis_url, namespace=namespace)
            assert "no consumer group 'a group'" in assert_one_line_error(missing)
            continue
        dropped = cli("drop-group", name, url=redis_url, namespace=namespace)
        assert dropped.code == 0, dropped
        assert f"Dropped consumer group {name!r} from 1 partition;" in dropped.out, dropped
        assert "\x1b" not in dropped.out, dropped
    assert cli("feed", "--json", url=redis_url, namespace=namespace).json()["groups"] == []


def test_trim_feed_by_an_age_longer_than_the_epoch_removes_nothing(redis_url: str) -> None:
    namespace = fresh_namespace()
    with_store(redis_url, namespace, lambda s: s.append("old-1", [msg("a")]))
    # The cutoff lies before 1970: nothing is that old (it was a raw redis error).
    run = cli("trim-feed", "--max-age", "30000d", "--json", url=redis_url, namespace=namespace)
    assert run.code == 0, run
    assert run.json() == {"namespace": namespace, "removed": 0, "left": 1}


def test_feed_judges_a_projection_by_its_checkpoint_not_its_groups_position(
    redis_url: str,
) -> None:
    from projections import ProjectionRunner, UsageProjection

    namespace = fresh_namespace()

    async def run_projection(store: es.EventStore) -> int:
        return await ProjectionRunner(store, UsageProjection(), consumer="c").run_once()

    def flagged() -> dict[int, bool]:
        feed = cli("feed", "--json", url=redis_url, namespace=namespace)
        assert feed.code == 0, feed
        return {g["partition"]: g["lost_changes"] for g in feed.json()["groups"]}

    with_store(redis_url, namespace, lambda s: s.append("fj-1", [msg("a"), msg("b")]))
    assert with_store(redis_url, namespace, run_projection) == 1
    assert cli("trim-feed", url=redis_url, namespace=namespace).code == 0
    assert cli("drop-group", "usage", url=redis_url, namespace=namespace).code == 0
    # Registered again at 0-0, behind the trim; its checkpoint is past every trimmed change.
    assert with_store(redis_url, namespace, run_projection) == 0
    lost = flagged()
    assert len(lost) == 16 and not any(lost.values()), lost
    table = cli("feed", url=redis_url, namespace=namespace)
    assert "lost changes" not in table.out and "nothing unread" in table.out, table.out
    # A change trimmed (by age) before the projection applied it is lost, and flagged.
    with_store(redis_url, namespace, lambda s: s.append("fj-1", [msg("c")]))
    time.sleep(0.01)
    aged = cli("trim-feed", "--max-age", "0s", url=redis_url, namespace=namespace)
    assert "Removed 1 entry" in aged.out, aged
    p = es.partition_of("fj-1", len(lost))
    assert [q for q, was_lost in flagged().items() if was_lost] == [p]


def test_feed_commands_never_create_a_namespace(redis_url: str) -> None:
    namespace = fresh_namespace()
    for argv in (
        ["feed"],
        ["trim-feed"],
        ["trim-feed", "--max-age", "1d"],
        ["drop-group", "x"],
        ["forget-projection", "x"],
    ):
        line = assert_one_line_error(cli(*argv, url=redis_url, namespace=namespace))
        assert f"no namespace {namespace!r}" in line, (argv, line)
    keys = with_store(redis_url, "default", lambda s: s.client.keys(f"tl:{{{namespace}*"))  # type: ignore[attr-defined]
    assert keys == []


@pytest.mark.frameworks
def test_check_and_rebuild_cover_the_langgraph_views(redis_url: str) -> None:
    from langgraph.checkpoint.base import empty_checkpoint

    from adapters.langgraph import RECORDS, ThreadlogCheckpointSaver

    namespace = fresh_namespace()

    async def setup(store: es.EventStore) -> None:
        saver = ThreadlogCheckpointSaver(store)
        config = {"configurable": {"thread_id": "g1", "checkpoint_ns": ""}}
        await saver.aput(config, empty_checkpoint(), {}, {})  # type: ignore[arg-type]
        assert isinstance(store, es.RedisEventStore)
        await store.client.delete(store.keys.view("lg:g1", RECORDS))  # the saver's view, lost

    with_store(redis_url, namespace, setup)
    found = cli("check", "lg:g1", url=redis_url, namespace=namespace)
    assert found.code == 1 and RECORDS in found.out, found  # never "OK"
    rebuilt = cli("rebuild", "lg:g1", url=redis_url, namespace=namespace)
    assert rebuilt.code == 0, rebuilt
    again = cli("check", "lg:g1", url=redis_url, namespace=namespace)
    assert again.code == 0 and "OK" in again.out, again


def test_an_empty_threadlog_secret_is_a_usage_error(redis_url: str) -> None:
    """``THREADLOG_SECRET=`` (set, but to nothing) read as unset: a command wrote and verified
    unkeyed chains while the deployment meant them keyed. Refused: exit 2, one line naming the
    variable, and nothing written."""
    namespace = fresh_namespace()
    empty = child_env(THREADLOG_SECRET="")
    for args in (["demo"], ["threads"], ["verify", "--all"]):
        run = cli(*args, url=redis_url, namespace=namespace, env=empty)
        line = assert_one_line_error(run, code=2)
        assert "THREADLOG_SECRET" in line and "empty" in line, line
    unset = cli("threads", url=redis_url, namespace=namespace)
    assert unset.code == 2 and "no namespace" in unset.err, unset  # the demo wrote nothing
