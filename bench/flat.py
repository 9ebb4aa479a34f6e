"""Latency against thread length, and rebuild and export cost per event against log size.

Run ``python -m bench.flat [--quick]``. One private redis-server (unix socket). Threads of
10, 1,000, 10,000, 100,000 and 1,000,000 events (``--quick``: up to 100,000) hold stored
messages (`MessageAppended`, ~450 characters of varied prose, user and assistant in turn),
written through `Projector.append` 1,000 events per append, so the messages view is kept
with the log exactly as the runtime keeps it.

- **Latency.** `ThreadStore.append_message` (one message, with its view op) and
  `ThreadStore.list_messages(limit=6)` on a thread of each length, timed one call at a time
  by `bench._common.measure`: every length is a side, the sides alternate their order round
  after round, and the ratio is the median of per-round ratios to the 10-event thread. A
  10-event side appends to fresh 10-event threads (one per op), a 1,000-event side to a fresh
  1,000-event thread each round; longer threads grow by at most a few percent.
- **Jobs.** `Projector.rebuild` (fold the whole log, reload the views) and a Parquet
  `Exporter` run over a namespace holding one thread of 10,000, 100,000 and 1,000,000 events
  (``--quick``: 10,000 and 100,000): seconds and microseconds per event.

Target (issue 7): append and ``list_messages(limit=6)`` at 1,000,000 events at most 1.1x the
latency at 10 events; rebuild and export linear in the number of events (flat per event).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from adapters import Exporter, ThreadStore
from eventstore import (
    EventStoreError,
    Message,
    MessageAppended,
    NewEvent,
    RedisEventStore,
    connect,
    new_ulid,
)
from eventstore.servers import redis_server
from projections import Projector

from ._common import (
    Comparison,
    Op,
    Side,
    environment,
    loadavg,
    markdown_table,
    measure,
    print_table,
)
from .export import Prose

NAME = "flat"
TITLE = "Latency against thread length"
TARGET_RATIO = 1.1
PER_APPEND = 1000


@dataclass(frozen=True)
class FlatMode:
    name: str
    lengths: tuple[int, ...]
    rounds: int
    ops: int
    job_rounds: int


QUICK = FlatMode("quick", (10, 1_000, 10_000, 100_000), rounds=4, ops=100, job_rounds=1)
FULL = FlatMode("default", (10, 1_000, 10_000, 100_000, 1_000_000), 20, 200, job_rounds=2)
PATIENT_TIMEOUT = 600.0  # seconds; for a job that times out with the default (5 s)
LONG = 10_000  # threads at least this long live in a namespace of their own, filled once
MESSAGE_CHARS = 450


def messages(prose: Prose, n: int, start: int = 0) -> list[NewEvent]:
    return [
        NewEvent(
            payload=MessageAppended(
                message=Message(
                    role="user" if (start + i) % 2 == 0 else "assistant",
                    content=prose.text(MESSAGE_CHARS),
                )
            )
        )
        for i in range(n)
    ]


async def fill(
    projector: Projector, thread: str, n: int, prose: Prose, *, inflight: int = 3
) -> None:
    """Append ``n`` messages to ``thread``, ``PER_APPEND`` per append, a few appends in flight."""
    sem = asyncio.Semaphore(inflight)

    async def one(start: int) -> None:
        async with sem:
            count = min(PER_APPEND, n - start)
            await projector.append(thread, messages(prose, count, start))

    await asyncio.gather(*(one(s) for s in range(0, n, PER_APPEND)))


class FlatBench:
    """The latency sides: one per thread length, for appends and for the history window."""

    def __init__(self, short: ThreadStore, long: dict[int, ThreadStore], prose: Prose) -> None:
        self.short = short
        self.long = long
        self.prose = prose
        self.message = Message(role="user", content=prose.text(MESSAGE_CHARS))

    def store_for(self, length: int) -> tuple[ThreadStore, str]:
        if length >= LONG:
            return self.long[length], "long"
        return self.short, f"read-{length}"

    async def prepare_short(self, lengths: tuple[int, ...]) -> None:
        for length in lengths:
            if length < LONG:
                await fill(self.short.projector, f"read-{length}", length, self.prose)

    def list_side(self, length: int) -> Side:
        async def setup(r: int, n: int) -> Op:
            ts, thread = self.store_for(length)

            async def op() -> None:
                await ts.list_messages(thread, 6)

            return op

        return Side(f"list_messages(6) @ {length:,}", setup)

    def append_side(self, length: int) -> Side:
        message = self.message
        made: list[str] = []

        async def setup(r: int, n: int) -> Op:
            if length >= LONG:
                ts, thread = self.store_for(length)

                async def op_long() -> None:
                    await ts.append_message(thread, message)

                return op_long
            ts = self.short
            if length <= 100:
                # One fresh thread per op, each exactly ``length`` events long when appended to.
                threads = [f"a{length}-{r}-{i}-{new_ulid()}" for i in range(n)]
                await asyncio.gather(
                    *(fill(ts.projector, t, length, self.prose, inflight=1) for t in threads)
                )
            else:
                threads = [f"a{length}-{r}-{new_ulid()}"]
                await fill(ts.projector, threads[0], length, self.prose)
            made.extend(threads)
            it = iter(range(n))

            async def op_short() -> None:
                await ts.append_message(threads[next(it) % len(threads)], message)

            return op_short

        async def teardown(r: int) -> None:
            for t in made:
                await self.short.delete_thread(t)
            made.clear()

        return Side(f"append_message @ {length:,}", setup, teardown)


async def time_jobs(
    long: dict[int, ThreadStore],
    patient: Callable[[int], Awaitable[ThreadStore]],
    sizes: list[int],
    rounds: int,
    log: Callable[[str], None],
) -> dict[str, dict[str, dict[str, Any]]]:
    """Seconds per rebuild and per Parquet export at each size, medians over rounds.

    A job that fails with the default settings is recorded as such and timed again on a store
    with a long socket timeout (``patient``), once per round.
    """
    found: dict[str, dict[int, list[float]]] = {"rebuild": {}, "export (parquet)": {}}
    failed: dict[tuple[str, int], str] = {}

    async def rebuild(ts: ThreadStore) -> int:
        return await ts.projector.rebuild("long")

    async def export(ts: ThreadStore) -> int:
        with tempfile.TemporaryDirectory(prefix="tl-flat-") as out:
            result = await Exporter(ts.store, out, name=f"flat{new_ulid().lower()}").run()
        return result.events

    jobs: dict[str, Callable[[ThreadStore], Awaitable[int]]] = {
        "rebuild": rebuild,
        "export (parquet)": export,
    }
    # Untimed: the first export imports pyarrow and starts the worker thread.
    await export(long[sizes[0]])
    for r in range(rounds):
        order = sizes if r % 2 == 0 else sizes[::-1]
        for job, fn in jobs.items():
            for size in order:
                ts = long[size] if (job, size) not in failed else await patient(size)
                t0 = time.perf_counter()
                try:
                    events = await fn(ts)
                except EventStoreError as exc:
                    failed[(job, size)] = f"{type(exc).__name__}: {exc}"
                    log(
                        f"  {job} of {size:,} events failed after "
                        f"{time.perf_counter() - t0:.1f} s: {failed[(job, size)]}"
                    )
                    ts = await patient(size)
                    t0 = time.perf_counter()
                    events = await fn(ts)
                elapsed = time.perf_counter() - t0
                if events < size:
                    raise RuntimeError(f"{job} at {size:,} covered only {events:,} events")
                found[job].setdefault(size, []).append(elapsed)
                log(f"  {job} of {size:,} events: {elapsed:.2f} s")
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for job, by_size in found.items():
        out[job] = {}
        for size, times in by_size.items():
            row: dict[str, Any] = {
                "events": size,
                "seconds": round(statistics.median(times), 3),
                "us_per_event": round(statistics.median(times) / size * 1e6, 2),
            }
            if (job, size) in failed:
                row["failed_with_defaults"] = failed[(job, size)]
                row["socket_timeout_s"] = PATIENT_TIMEOUT
            out[job][str(size)] = row
    return out


async def measure_all(quick: bool, *, progress: bool = True) -> dict[str, Any]:
    mode = QUICK if quick else FULL
    lengths = mode.lengths
    env = environment()

    def log(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    prose = Prose(seed=3)
    stores: list[RedisEventStore] = []
    with redis_server() as server:

        async def open_ns(namespace: str) -> ThreadStore:
            store = await connect(server.url, namespace=namespace, partitions=16)
            assert isinstance(store, RedisEventStore)
            stores.append(store)
            return ThreadStore(store)

        try:
            short = await open_ns("flat")
            long = {n: await open_ns(f"flat{n}") for n in lengths if n >= LONG}
            env["redis_server"] = (await stores[0].client.info("server"))["redis_version"]
            t0 = time.perf_counter()
            await asyncio.gather(*(fill(ts.projector, "long", n, prose) for n, ts in long.items()))
            bench = FlatBench(short, long, prose)
            await bench.prepare_short(lengths)
            fill_s = time.perf_counter() - t0
            log(
                f"bench.flat: filled threads of {', '.join(f'{n:,}' for n in lengths)} "
                f"in {fill_s:.1f} s"
            )
            patient: dict[int, ThreadStore] = {}

            async def patient_store(size: int) -> ThreadStore:
                if size not in patient:
                    store = await connect(
                        server.url, namespace=f"flat{size}", socket_timeout=PATIENT_TIMEOUT
                    )
                    assert isinstance(store, RedisEventStore)
                    stores.append(store)
                    patient[size] = ThreadStore(store)
                return patient[size]

            jobs = await time_jobs(long, patient_store, sorted(long), mode.job_rounds, log)
            latency: dict[str, Comparison] = {}
            for name, make in (("append", bench.append_side), ("list_messages", bench.list_side)):
                latency[name] = await measure(
                    [make(n) for n in lengths],
                    rounds=mode.rounds,
                    ops=mode.ops,
                    warmup=mode.ops,
                    progress=progress,
                )
            used = (await stores[0].client.info("memory"))["used_memory"]
        finally:
            for store in stores:
                await store.close()
    env["loadavg_at_end"] = loadavg()
    return summarize(mode, latency, jobs, fill_s, used, env)


def summarize(
    mode: FlatMode,
    latency: dict[str, Comparison],
    jobs: dict[str, Any],
    fill_s: float,
    redis_bytes: int,
    env: dict[str, Any],
) -> dict[str, Any]:
    lengths = mode.lengths
    by_length: dict[str, dict[str, Any]] = {str(n): {} for n in lengths}
    for op, comparison in latency.items():
        for n, side in zip(lengths, comparison.sides, strict=True):
            s = side.summary()
            by_length[str(n)][op] = {
                "median_round_mean_us": s["median_round_mean_us"],
                "p50_us": s["p50_us"],
                "p99_us": s["p99_us"],
                "ratio_to_10": round(comparison.ratio(side), 3) if n != lengths[0] else 1.0,
            }
    longest = str(lengths[-1])
    ratios = {op: by_length[longest][op]["ratio_to_10"] for op in latency}
    linear = {}
    for job, rows in jobs.items():
        per = [rows[k]["us_per_event"] for k in sorted(rows, key=int)]
        linear[job] = round(max(per) / min(per), 3) if per else None
    return {
        "benchmark": NAME,
        "mode": mode.name,
        "rounds": mode.rounds,
        "ops_per_round": mode.ops,
        "job_rounds": mode.job_rounds,
        "message_chars": MESSAGE_CHARS,
        "events_per_fill_append": PER_APPEND,
        "fill_seconds": round(fill_s, 1),
        "redis_used_memory_mb": round(redis_bytes / 2**20, 1),
        "lengths": by_length,
        "jobs": jobs,
        "targets": {
            "longest": lengths[-1],
            "ratio_target": TARGET_RATIO,
            "ratios_at_longest": ratios,
            "meets": {op: r <= TARGET_RATIO for op, r in ratios.items()},
            "per_event_spread": linear,
        },
        "environment": env,
    }


LAT_HEADERS = (
    "events in thread",
    "append p50 us",
    "append ratio",
    "list(6) p50 us",
    "list(6) ratio",
)
JOB_HEADERS = ("job", "events", "seconds", "us/event", "note")


def _note(row: dict[str, Any]) -> str:
    if "failed_with_defaults" not in row:
        return ""
    error = row["failed_with_defaults"].split(":", 1)[0]
    return (
        f"{error} with the default 5 s socket timeout; timed with {row['socket_timeout_s']:.0f} s"
    )


def table_rows(summary: dict[str, Any]) -> tuple[list[list[str]], list[list[str]]]:
    lat = []
    for n, ops in summary["lengths"].items():
        a, r = ops["append"], ops["list_messages"]
        lat.append(
            [f"{int(n):,}", f"{a['p50_us']:.1f}", f"{a['ratio_to_10']:.2f}x", f"{r['p50_us']:.1f}",
             f"{r['ratio_to_10']:.2f}x"]
        )  # fmt: skip
    jobs = [
        [job, f"{int(n):,}", f"{row['seconds']:.2f}", f"{row['us_per_event']:.2f}", _note(row)]
        for job, rows in summary["jobs"].items()
        for n, row in sorted(rows.items(), key=lambda kv: int(kv[0]))
    ]
    return lat, jobs


def verdicts(summary: dict[str, Any]) -> list[str]:
    t = summary["targets"]
    out = []
    for op, ratio in t["ratios_at_longest"].items():
        word = "meets" if t["meets"][op] else "misses"
        out.append(
            f"{op} at {t['longest']:,} events: {ratio:.2f}x the latency at 10 events "
            f"({word} the {TARGET_RATIO}x target)"
        )
    for job, spread in t["per_event_spread"].items():
        out.append(f"{job}: the slowest size costs {spread:.2f}x the fastest per event")
    for job, rows in summary["jobs"].items():
        for n, row in rows.items():
            if "failed_with_defaults" in row:
                out.append(
                    f"{job} of {int(n):,} events fails with the defaults: "
                    f"{row['failed_with_defaults']}"
                )
    if summary["mode"] == "quick":
        out.append(f"quick mode: the longest thread is {t['longest']:,} events, not 1,000,000")
    return out


def markdown(summary: dict[str, Any]) -> str:
    lat, jobs = table_rows(summary)
    env = summary["environment"]
    return "\n".join(
        [
            f"Run of {env.get('date')}, {summary['mode']} mode: {summary['rounds']} rounds x "
            f"{summary['ops_per_round']} ops per side, ratios: median of per-round ratios to the "
            f"10-event thread; jobs: median of {summary['job_rounds']} run(s); redis "
            f"{env.get('redis_server', '?')}, {env.get('cpus')} CPUs, load "
            f"{env.get('loadavg_at_start')}:",
            "",
            markdown_table(LAT_HEADERS, lat),
            "",
            markdown_table(JOB_HEADERS, jobs),
            "",
            *(f"- {v}" for v in verdicts(summary)),
        ]
    )


def report(summary: dict[str, Any]) -> None:
    lat, jobs = table_rows(summary)
    print_table(
        f"{TITLE} (p50 per call; ratio: median of per-round ratios to the 10-event thread)",
        LAT_HEADERS,
        lat,
    )
    print_table("Rebuild and export against log size", JOB_HEADERS, jobs)
    print()
    for v in verdicts(summary):
        print(v)


def run(quick: bool) -> dict[str, Any]:
    """Measure, print the tables, and return the summary (for ``python -m bench``)."""
    summary = asyncio.run(measure_all(quick))
    report(summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    from .__main__ import module_main

    return module_main(NAME, run, argv, quick="threads up to 100,000 events")


if __name__ == "__main__":
    sys.exit(main())
