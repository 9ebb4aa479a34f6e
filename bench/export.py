"""Export throughput and memory: Parquet and NDJSON beside a raw ``XRANGE`` + decode, and verify.

Run ``python -m bench.export [--quick]``. One private redis-server (unix socket) holds a
namespace of 1,000,000 events (``--quick``: 100,000): agent turns, a ``turn.opened`` with the
user's request and a ``turn.settled`` with usage and the assistant's answer (~500-byte
payloads of varied prose, so files compress as real ones do), 1,000 events per thread,
appended 100 events per append by 16 concurrent tasks. Each side runs in a child process of
its own, so its wall time, CPU time and peak memory (``VmHWM``) are its alone:

- ``parquet`` / ``ndjson``: `adapters.Exporter` end to end — feed, log reads, decoding, files
  committed (fsync, rename) in a fresh directory — run as ``threadlog export`` runs it:
  ``workers="auto"`` (``--workers N`` to choose: this process and N - 1 worker processes share
  the partitions; auto is one per CPU, at most 3, for 200,000 events or more) and
  ``pause_gc=True``, Parquet with the default codec (snappy);
- ``parquet, zstd``: the same with ``compression="zstd"`` (``--compression zstd``): smaller
  files for more CPU;
- ``parquet, 1 process``: the same with ``workers=1`` (``threadlog export --workers 1``): the
  difference to ``parquet`` is the worker processes alone;
- ``raw XRANGE + decode``: redis-py ``XRANGE`` over every thread (4096 entries per call) and a
  msgpack decode of every payload — the floor any reader of these events pays;
- ``verify``: `adapters.Auditor.verify_all` (chain links, digests, payload decode).

An export's peak memory is the sum of its processes' peaks (``VmHWM`` of the exporting
process, plus each worker's, read from ``/proc`` every 50 ms while it runs): an upper bound on
what they held at any one moment. Its CPU time includes the workers' (``RUSAGE_CHILDREN``).

Sides alternate their order round after round; the table gives medians over rounds, and the
ratio to the raw read is the median of per-round ratios. redis-server's CPU per event comes
from ``INFO cpu`` around each side. The Parquet and NDJSON exports' peak memory is measured at
two log sizes (10x apart) to show it does not grow with the log, and the Parquet export runs
once more over a log appended 2 events per append (a feed entry per turn, as a runtime writes
it). Targets (issue 6): Parquet export at least 200,000 events/s end to end, peak memory
under 500 MB whatever the log's size.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from adapters._export import DEFAULT_COMPRESSION
from eventstore import (
    Message,
    NewEvent,
    RedisEventStore,
    StoreSettings,
    Timing,
    TurnOpened,
    TurnSettled,
    Usage,
    connect,
    new_ulid,
)
from eventstore.servers import redis_server

from ._common import environment, loadavg, markdown_table, print_table

NAME = "export"
TITLE = "Export throughput and memory"
TARGET_EVENTS_PER_S = 200_000
TARGET_PEAK_MB = 500
EVENTS_PER_APPEND = 100
EVENTS_PER_THREAD = 1000
LOADERS = 16
SIDES = (
    "raw XRANGE + decode", "parquet", "parquet, zstd", "parquet, 1 process", "ndjson", "verify"
)  # fmt: skip
# side -> (format, workers (None: WORKERS), Parquet compression)
EXPORT_SIDES: dict[str, tuple[str, int | None, str | None]] = {
    "parquet": ("parquet", None, DEFAULT_COMPRESSION),
    "parquet, zstd": ("parquet", None, "zstd"),  # smaller files, more CPU
    "parquet, 1 process": ("parquet", 1, DEFAULT_COMPRESSION),
    "ndjson": ("ndjson", None, None),  # NDJSON parts are plain: a codec is refused
}
WORKERS: int | str = "auto"
"""Processes of the export sides run as the CLI runs them (``--workers``; ``auto`` as the CLI)."""
# A side exports at most a few million events (seconds each); ten minutes means it hung.
CHILD_TIMEOUT_S = 600
SMALL_NAMESPACES = {"bench-small": EVENTS_PER_APPEND, "bench-turns": 2}
SMALL_SIDES = {
    f"parquet, {EVENTS_PER_APPEND} events per append": ("parquet", "bench-small"),
    f"ndjson, {EVENTS_PER_APPEND} events per append": ("ndjson", "bench-small"),
    "parquet, 2 events per append": ("parquet", "bench-turns"),
}
ROOT = str(Path(__file__).resolve().parent.parent)
QUICK = {"small": 10_000, "large": 100_000, "rounds": 1}
FULL = {"small": 100_000, "large": 1_000_000, "rounds": 3}

_VOCABULARY = (
    "agent tool result user answer model context window thread turn state plan step budget "
    "token cache retry search file page table query summary draft review note fix test run "
    "error timeout request response stream event log audit export index vector prompt reply "
    "the a of to and in for on with as by at from that this it is was be are not but"
)
_WORDS = _VOCABULARY.split(" ")


class Prose:
    """Deterministic, varied prose (seeded), so files compress as real conversations do."""

    def __init__(self, seed: int = 7, sentences: int = 4096) -> None:
        rng = random.Random(seed)
        self.rng = rng
        self.sentences = [
            " ".join(rng.choices(_WORDS, k=rng.randint(6, 18))).capitalize() + "."
            for _ in range(sentences)
        ]

    def text(self, chars: int) -> str:
        out: list[str] = []
        size = 0
        while size < chars:
            s = self.rng.choice(self.sentences)
            out.append(s)
            size += len(s) + 1
        return " ".join(out)[:chars]


def turn_events(prose: Prose, i: int) -> list[NewEvent]:
    """One root turn: opened with the user's request, settled completed with the answer."""
    turn = new_ulid()
    opened = TurnOpened(turn_id=turn, request=Message(role="user", content=prose.text(240)))
    settled = TurnSettled(
        turn_id=turn,
        outcome="completed",
        steps=1 + i % 4,
        model_tier=("small", "large")[i % 2],
        usage=Usage(input_tokens=900 + 37 * (i % 50), output_tokens=120 + 11 * (i % 30)),
        timing=Timing(started_ms=1_760_000_000_000 + i, settled_ms=1_760_000_000_900 + i),
        assistant_message=Message(role="assistant", content=prose.text(460)),
    )
    return [NewEvent(payload=opened, turn_id=turn), NewEvent(payload=settled, turn_id=turn)]


async def fill(
    store: RedisEventStore,
    threads: list[str],
    events_per_thread: int,
    *,
    per_append: int = EVENTS_PER_APPEND,
    concurrency: int = LOADERS,
    seed: int = 7,
) -> float:
    """Append ``events_per_thread`` turn events to each thread; returns the seconds it took."""
    prose = Prose(seed)
    queue = list(reversed(threads))

    async def loader() -> None:
        while queue:
            thread = queue.pop()
            done = 0
            while done < events_per_thread:
                batch: list[NewEvent] = []
                while len(batch) < min(per_append, events_per_thread - done):
                    batch += turn_events(prose, done + len(batch))
                batch = batch[: events_per_thread - done]
                await store.append(thread, batch)
                done += len(batch)

    t0 = time.perf_counter()
    await asyncio.gather(*(loader() for _ in range(concurrency)))
    return time.perf_counter() - t0


# -- the child process: one side, measured alone ------------------------------------------------


def _status_mb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process, in MiB.

    Not ``ru_maxrss``: Linux keeps that across ``execve``, so a child would report the peak of
    the (forked) parent it started as.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _pid_mb(pid: int, field: str) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass  # gone
    return None


class WorkerPeaks:
    """The peak resident memory (``VmHWM``) of every child process started while it runs.

    Children are found by a scan of ``/proc`` every 0.25 s (worker start-up takes longer than
    that) until ``expected`` are known, and their ``VmHWM`` read every 50 ms, the last reading
    standing for the peak: it only grows, so at most the last 50 ms of a worker's life go
    unseen.
    """

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.peaks: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> WorkerPeaks:
        if self.expected:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.expected:
            self._thread.join()

    @property
    def total_mb(self) -> float:
        return sum(self.peaks.values())

    def _watch(self) -> None:
        me = str(os.getpid())
        known: set[int] = set()
        tick = 0
        while not self._stop.wait(0.05):
            if tick % 5 == 0 and len(known) < self.expected:
                for entry in os.listdir("/proc"):
                    if entry.isdigit() and int(entry) not in known:
                        try:
                            with open(f"/proc/{entry}/stat") as f:
                                ppid = f.read().rsplit(")", 1)[1].split()[1]
                        except (OSError, IndexError):
                            continue
                        if ppid == me:
                            known.add(int(entry))
            tick += 1
            for pid in known:
                mb = _pid_mb(pid, "VmHWM")
                if mb is not None:
                    self.peaks[pid] = max(self.peaks.get(pid, 0.0), mb)


async def _child_work(
    side: str, url: str, namespace: str, out: str, workers: int | str
) -> dict[str, Any]:
    store = await connect(url, namespace=namespace)
    try:
        if side in EXPORT_SIDES:
            from adapters import Exporter

            fmt, fixed, compression = EXPORT_SIDES[side]
            n = fixed or (workers if workers == "auto" else int(workers))
            exporter = Exporter(
                store,
                out,
                fmt=fmt,  # type: ignore[arg-type]
                name=f"bench{new_ulid().lower()}",
                workers=n,  # type: ignore[arg-type]
                settings=StoreSettings.from_url(url, namespace=namespace),
                pause_gc=True,  # as `threadlog export` runs it
                compression=compression,  # type: ignore[arg-type]
            )
            with WorkerPeaks(exporter.workers - 1) as peaks:
                result = await exporter.run()
            return {
                "events": result.events,
                "files": len(result.files),
                "workers": result.workers,
                "worker_peak_rss_mb": peaks.total_mb,
            }
        if side == "verify":
            from adapters import Auditor

            verdicts = await Auditor(store).verify_all()
            bad = [t for t, v in verdicts.items() if not v.ok]
            return {"events": sum(v.checked for v in verdicts.values()), "bad_threads": len(bad)}
        import msgspec

        assert isinstance(store, RedisEventStore)
        decode = msgspec.msgpack.Decoder().decode
        client, events = store.client, 0
        for info in await store.threads():
            key, lo = store.keys.log(info.thread_id), "-"
            while True:
                rows = await client.xrange(key, lo, "+", count=4096)
                for _, fields in rows:
                    decode(fields[b"d"])
                events += len(rows)
                if len(rows) < 4096:
                    break
                lo = b"(" + rows[-1][0]
        return {"events": events}
    finally:
        await store.close()


def _cpu_seconds() -> float:
    """CPU time of this process and of its waited-for children (export workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def child_main(side: str, url: str, namespace: str, out: str, workers: str = "auto") -> None:
    """Run one side and print what it measured as one JSON line."""
    if side in EXPORT_SIDES:
        # Imported before the baseline is taken, as a long-lived exporter process has them.
        import pyarrow.parquet  # noqa: F401
    rss_before = _status_mb("VmRSS")
    cpu0 = _cpu_seconds()
    t0 = time.perf_counter()
    found = asyncio.run(_child_work(side, url, namespace, out, workers))
    wall = time.perf_counter() - t0
    found.update(
        seconds=wall,
        cpu_seconds=_cpu_seconds() - cpu0,
        rss_before_mb=rss_before,
        peak_rss_mb=_status_mb("VmHWM") + found.pop("worker_peak_rss_mb", 0.0),
    )
    print(json.dumps(found))


def output_bytes(directory: str) -> int:
    return sum(p.stat().st_size for p in Path(directory).glob("part-*"))


async def server_cpu_seconds(client: Any) -> float:
    """CPU seconds redis-server has used so far (user + system, all its threads)."""
    info = await client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def run_side(side: str, url: str, namespace: str, client: Any) -> dict[str, Any]:
    """One side in a child process, in a fresh output directory (removed afterwards)."""
    out = tempfile.mkdtemp(prefix="tl-export-")
    try:
        server0 = await server_cpu_seconds(client)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.export", "--child", side, url, namespace, out,
            str(WORKERS),
            stdout=asyncio.subprocess.PIPE,
            cwd=ROOT,
        )  # fmt: skip
        try:
            # Bounded: a child that hangs (a stuck server, a deadlock) must fail the run, not
            # hold CI until its own limit.
            stdout, _ = await asyncio.wait_for(proc.communicate(), CHILD_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeError(
                f"bench.export child {side!r} did not finish within {CHILD_TIMEOUT_S} s"
            ) from None
        if proc.returncode != 0:
            raise RuntimeError(f"bench.export child {side!r} failed with {proc.returncode}")
        found: dict[str, Any] = json.loads(stdout.decode().strip().splitlines()[-1])
        found["server_cpu_seconds"] = await server_cpu_seconds(client) - server0
        found["output_mb"] = output_bytes(out) / 2**20
        return found
    finally:
        shutil.rmtree(out, ignore_errors=True)


# -- the run -----------------------------------------------------------------------------------


def _threads(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:05d}" for i in range(n)]


async def measure(quick: bool, *, progress: bool = True) -> dict[str, Any]:
    mode = QUICK if quick else FULL
    small, large, rounds = mode["small"], mode["large"], mode["rounds"]
    env = environment()
    namespace = "bench"

    def log(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    with redis_server() as server:
        store = await _open(server.url, namespace)
        try:
            info = await store.client.info("server")
            env.update(redis_server=info["redis_version"], transport="unix socket")
            load_s = await fill(store, _threads("t", large // EVENTS_PER_THREAD), EVENTS_PER_THREAD)
            used = await store.client.info("memory")
            # A tenth of the events twice more: as above (for the memory against log size),
            # and appended a turn (2 events) at a time, as a runtime does: a feed entry each.
            for ns, per_append in SMALL_NAMESPACES.items():
                other = await _open(server.url, ns)
                try:
                    small_threads = _threads("s", small // EVENTS_PER_THREAD)
                    load_s += await fill(
                        other, small_threads, EVENTS_PER_THREAD, per_append=per_append, seed=5
                    )
                finally:
                    await other.close()
            log(f"bench.export: loaded {large + 2 * small:,} events in {load_s:.1f} s")
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
            small_runs: dict[str, list[dict[str, Any]]] = {label: [] for label in SMALL_SIDES}
            for r in range(rounds):
                order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
                for side in order:
                    found = await run_side(side, server.url, namespace, store.client)
                    runs[side].append(_checked(found, large, side))
                    log(
                        f"  round {r + 1}/{rounds} {side:20s} "
                        f"{found['events'] / found['seconds']:>10,.0f} events/s  "
                        f"peak {found['peak_rss_mb']:.0f} MB"
                    )
                labels = list(SMALL_SIDES) if r % 2 == 0 else list(reversed(SMALL_SIDES))
                for label in labels:
                    fmt, ns = SMALL_SIDES[label]
                    found = await run_side(fmt, server.url, ns, store.client)
                    small_runs[label].append(_checked(found, small, label))
                    log(
                        f"  round {r + 1}/{rounds} {label:36s} "
                        f"{found['events'] / found['seconds']:>10,.0f} events/s  "
                        f"peak {found['peak_rss_mb']:.0f} MB"
                    )
        finally:
            await store.close()
    env["loadavg_at_end"] = loadavg()
    return summarize(
        quick, small, large, rounds, runs, small_runs, load_s, used["used_memory"], env
    )


def _checked(found: dict[str, Any], expected: int, side: str) -> dict[str, Any]:
    if found["events"] != expected:
        raise RuntimeError(f"{side} saw {found['events']} events, not {expected}")
    return found


async def _open(url: str, namespace: str) -> RedisEventStore:
    store = await connect(url, namespace=namespace, partitions=16)
    assert isinstance(store, RedisEventStore)
    return store


def _medians(found: list[dict[str, Any]], events: int) -> dict[str, Any]:
    return {
        "events": events,
        "events_per_s": round(statistics.median(f["events"] / f["seconds"] for f in found)),
        "cpu_us_per_event": round(
            statistics.median(f["cpu_seconds"] / f["events"] * 1e6 for f in found), 2
        ),
        "server_cpu_us_per_event": round(
            statistics.median(f["server_cpu_seconds"] / f["events"] * 1e6 for f in found), 2
        ),
        "peak_rss_mb": round(max(f["peak_rss_mb"] for f in found), 1),
    }


def summarize(
    quick: bool,
    small: int,
    large: int,
    rounds: int,
    runs: dict[str, list[dict[str, Any]]],
    small_runs: dict[str, list[dict[str, Any]]],
    load_s: float,
    redis_bytes: int,
    env: dict[str, Any],
) -> dict[str, Any]:
    raw = runs[SIDES[0]]
    sides: dict[str, Any] = {}
    for side, found in runs.items():
        rates = [f["events"] / f["seconds"] for f in found]
        ratios = [
            (f["events"] / f["seconds"]) / (b["events"] / b["seconds"])
            for f, b in zip(found, raw, strict=True)
        ]
        sides[side] = {
            "events": large,
            "events_per_s": round(statistics.median(rates)),
            "events_per_s_rounds": [round(x) for x in rates],
            "ratio_to_raw": round(statistics.median(ratios), 3),
            "cpu_us_per_event": round(
                statistics.median(f["cpu_seconds"] / f["events"] * 1e6 for f in found), 2
            ),
            "server_cpu_us_per_event": round(
                statistics.median(f["server_cpu_seconds"] / f["events"] * 1e6 for f in found), 2
            ),
            "peak_rss_mb": round(max(f["peak_rss_mb"] for f in found), 1),
            "workers": found[0].get("workers", 1),
            "rss_before_mb": round(statistics.median(f["rss_before_mb"] for f in found), 1),
            "output_mb": round(statistics.median(f["output_mb"] for f in found), 1),
        }
    small_sides = {label: _medians(found, small) for label, found in small_runs.items()}
    memory = {
        fmt: {
            "small_events": small,
            "small_peak_rss_mb": small_sides[f"{fmt}, {EVENTS_PER_APPEND} events per append"][
                "peak_rss_mb"
            ],
            "large_events": large,
            "large_peak_rss_mb": sides[fmt]["peak_rss_mb"],
        }
        for fmt in ("parquet", "ndjson")
    }
    turns = small_runs["parquet, 2 events per append"]
    bulk = small_runs[f"parquet, {EVENTS_PER_APPEND} events per append"]
    append_size = {
        label: small_sides[label]
        for label in (
            "parquet, 2 events per append",
            f"parquet, {EVENTS_PER_APPEND} events per append",
        )
    }
    append_size["parquet, 2 events per append"]["ratio_to_bulk"] = round(
        statistics.median(
            (t["events"] / t["seconds"]) / (b["events"] / b["seconds"])
            for t, b in zip(turns, bulk, strict=True)
        ),
        3,
    )
    parquet = sides["parquet"]
    return {
        "benchmark": NAME,
        "mode": "quick" if quick else "default",
        "rounds": rounds,
        "events": large,
        "events_per_append": EVENTS_PER_APPEND,
        "events_per_thread": EVENTS_PER_THREAD,
        "workers": WORKERS,
        "load_seconds": round(load_s, 1),
        "redis_used_memory_mb": round(redis_bytes / 2**20, 1),
        "sides": sides,
        "memory_vs_log_size": memory,
        "append_size": append_size,
        "targets": {
            "parquet_events_per_s": TARGET_EVENTS_PER_S,
            "peak_rss_mb": TARGET_PEAK_MB,
            "meets_throughput": parquet["events_per_s"] >= TARGET_EVENTS_PER_S,
            "meets_memory": all(
                m[k] < TARGET_PEAK_MB
                for m in memory.values()
                for k in ("small_peak_rss_mb", "large_peak_rss_mb")
            ),
        },
        "environment": env,
    }


HEADERS = (
    "side", "events", "events/s", "ratio to raw", "client CPU us/event",
    "redis CPU us/event", "RSS before MB", "peak RSS MB", "output MB",
)  # fmt: skip
MEMORY_HEADERS = ("format", "events", "peak RSS MB", "10x the events", "peak RSS MB at 10x")


def table_rows(summary: dict[str, Any]) -> tuple[list[list[str]], list[list[str]]]:
    rows = [
        [
            f"{side} ({s['workers']} processes)" if s.get("workers", 1) > 1 else side,
            f"{s['events']:,}", f"{s['events_per_s']:,}", f"{s['ratio_to_raw']:.2f}x",
            f"{s['cpu_us_per_event']:.2f}", f"{s['server_cpu_us_per_event']:.2f}",
            f"{s['rss_before_mb']:.0f}", f"{s['peak_rss_mb']:.0f}",
            f"{s['output_mb']:.0f}" if side in EXPORT_SIDES else "-",
        ]
        for side, s in summary["sides"].items()
    ]  # fmt: skip
    mem = [
        [
            fmt, f"{m['small_events']:,}", f"{m['small_peak_rss_mb']:.0f}",
            f"{m['large_events']:,}", f"{m['large_peak_rss_mb']:.0f}",
        ]
        for fmt, m in summary["memory_vs_log_size"].items()
    ]  # fmt: skip
    return rows, mem


APPEND_SIZE_HEADERS = (
    "Parquet export of",
    "events/s",
    "ratio",
    "client CPU us/event",
    "redis CPU us/event",
    "peak RSS MB",
)


def append_size_rows(summary: dict[str, Any]) -> list[list[str]]:
    return [
        [
            f"{r['events']:,} events, {label.split(', ', 1)[1]}", f"{r['events_per_s']:,}",
            f"{r.get('ratio_to_bulk', 1.0):.2f}x", f"{r['cpu_us_per_event']:.2f}",
            f"{r['server_cpu_us_per_event']:.2f}", f"{r['peak_rss_mb']:.0f}",
        ]
        for label, r in summary.get("append_size", {}).items()
    ]  # fmt: skip


def verdicts(summary: dict[str, Any]) -> list[str]:
    t = summary["targets"]
    p = summary["sides"]["parquet"]
    worst = max(
        max(m["small_peak_rss_mb"], m["large_peak_rss_mb"])
        for m in summary["memory_vs_log_size"].values()
    )
    return [
        f"Parquet export {p['events_per_s']:,} events/s: "
        f"{'meets' if t['meets_throughput'] else 'misses'} the {TARGET_EVENTS_PER_S:,}/s target",
        f"peak RSS at most {worst:.0f} MB: "
        f"{'meets' if t['meets_memory'] else 'misses'} the {TARGET_PEAK_MB} MB target",
    ]


def markdown(summary: dict[str, Any]) -> str:
    rows, mem = table_rows(summary)
    env = summary["environment"]
    lines = [
        f"Run of {env.get('date')}: {summary['events']:,} events ({summary['mode']} mode, "
        f"{summary['rounds']} round(s), "
        f"medians; each side in its own process; parquet and ndjson with workers="
        f"{summary.get('workers', 1)}; redis {env.get('redis_server', '?')}, "
        f"{env.get('cpus')} CPUs, load {env.get('loadavg_at_start')}):",
        "",
        markdown_table(HEADERS, rows),
        "",
        "Peak memory of an export against the log's size:",
        "",
        markdown_table(MEMORY_HEADERS, mem),
        "",
        "The Parquet export of a log appended a turn at a time (a feed entry per 2 events) "
        f"beside the same events appended 100 at a time (medians of {summary['rounds']} "
        "round(s); ratio: median of per-round ratios):",
        "",
        markdown_table(APPEND_SIZE_HEADERS, append_size_rows(summary)),
        "",
        *(f"- {v}" for v in verdicts(summary)),
    ]
    return "\n".join(lines)


def report(summary: dict[str, Any]) -> None:
    rows, mem = table_rows(summary)
    print_table(
        f"{TITLE}: {summary['events']:,} events, medians over {summary['rounds']} round(s) "
        "(client CPU: the side's process and its export workers; "
        f"workers={summary.get('workers', 1)})",
        HEADERS,
        rows,
    )
    print_table("Peak memory against the log's size", MEMORY_HEADERS, mem)
    print_table(
        "Append size (ratio: median of per-round ratios to 100 events per append)",
        APPEND_SIZE_HEADERS,
        append_size_rows(summary),
    )
    print()
    for v in verdicts(summary):
        print(v)


def run(quick: bool) -> dict[str, Any]:
    """Measure, print the tables, and return the summary (for ``python -m bench``)."""
    summary = asyncio.run(measure(quick))
    report(summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child_main(*argv[1:6])
        return 0
    if "--workers" in argv:
        # Not a `module_main` option (that parser is shared by every module): taken out here.
        global WORKERS
        at = argv.index("--workers")
        WORKERS = argv[at + 1] if argv[at + 1] == "auto" else int(argv[at + 1])
        argv = argv[:at] + argv[at + 2 :]
    from .__main__ import module_main

    return module_main(NAME, run, argv, quick=f"{QUICK['large']:,} events, one round")


if __name__ == "__main__":
    sys.exit(main())
