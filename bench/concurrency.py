"""Append throughput against concurrency: group commit on and off beside raw redis-py ``XADD``.

Run ``python -m bench.concurrency [--quick]``. One private redis-server (unix socket). Each side
makes the same number of appends of the same ~500-byte event (the msgpack bytes threadlog
stores, as in `bench.append`) at 1, 4, 16, 64 and 256 concurrent asyncio tasks, every task on
a thread (stream) of its own:

- ``threadlog, group commit``: `RedisEventStore.append` with the default ``max_batch=64`` —
  appends issued within one loop tick go out as one pipeline of atomic scripts;
- ``threadlog, no group commit``: the same with ``max_batch=1`` — one round trip per append;
- ``raw XADD, sequential``: one task awaiting one ``XADD`` after another (ignores the level);
- ``raw XADD, concurrent``: each task awaits its own ``XADD`` (redis-py hands each its own
  pooled connection);
- ``raw XADD, pipelined``: one task sending pipelines of 100 ``XADD`` (ignores the level).

Every side gets its own client and connection pool. Within a round every level runs every
side, in alternating orders; throughput is appends per second of wall time, and each figure
is the median over rounds (ratios: the median of per-round ratios). A second phase times a
lone append, one at a time (`bench._common.measure`), against a raw ``XADD`` round trip.

Targets (issue 7): at 64 tasks, group commit at least 3x the same appends issued one after
another and at least 0.6x the raw pipelined rate; a lone append at most 1.3x a raw ``XADD``.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from eventstore import RedisEventStore
from eventstore.servers import redis_server

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
from .append import encode_one, make_event

NAME = "concurrency"
TITLE = "Append throughput against concurrency"
LEVELS = (1, 4, 16, 64, 256)
PIPELINE = 100
TARGET_LEVEL = 64
TARGET_VS_SEQUENTIAL = 3.0
TARGET_VS_PIPELINED = 0.6
TARGET_LONE = 1.3
QUICK = {"rounds": 2, "appends": 1024, "lone_rounds": 6, "lone_ops": 200}
FULL = {"rounds": 7, "appends": 3072, "lone_rounds": 30, "lone_ops": 400}

GROUP = "threadlog, group commit"
NO_GROUP = "threadlog, no group commit"
RAW_SEQ = "raw XADD, sequential"
RAW_CONC = "raw XADD, concurrent"
RAW_PIPE = f"raw XADD, pipelined ({PIPELINE})"
SIDES = (GROUP, NO_GROUP, RAW_SEQ, RAW_CONC, RAW_PIPE)


def client_for(server: Any) -> Any:
    """A client of its own, with a pool big enough for 256 tasks each awaiting a command.

    redis-py 8's default pool holds at most 100 connections and raises "Too many connections"
    beyond that (it does not wait), so every side here gets room for the highest level.
    """
    return aioredis.Redis(unix_socket_path=str(server.unix_socket), max_connections=2 * max(LEVELS))


async def open_redis_store(server: Any, namespace: str, max_batch: int) -> RedisEventStore:
    store = RedisEventStore(
        client_for(server), namespace=namespace, partitions=16, max_batch=max_batch
    )
    await store.ensure_namespace(explicit_partitions=True)
    return store


class Bench:
    """The sides, each with its own client; a round of one side at one level is `run`."""

    def __init__(
        self, group: RedisEventStore, no_group: RedisEventStore, raw: Any, payload: bytes
    ) -> None:
        self.stores = {GROUP: group, NO_GROUP: no_group}
        self.raw = raw
        self.fields = {b"d": payload}
        self.events = [make_event()]

    async def server_cpu(self) -> float:
        info = await self.raw.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    async def run(
        self, side: str, level: int, appends: int, tag: str
    ) -> tuple[float, float, float]:
        """Appends per second of ``side`` at ``level`` tasks, and the client's and the server's
        CPU microseconds per append (keys removed afterwards).
        """
        names = [f"cc-{tag}-{i}" for i in range(level)]
        per_task = appends // level
        work: Callable[[], Awaitable[Any]]
        if side in self.stores:
            store = self.stores[side]

            async def appender(thread: str) -> None:
                version = 0
                for _ in range(per_task):
                    version = (
                        await store.append(thread, self.events, expected_version=version)
                    ).last_seq

            def work() -> Awaitable[Any]:
                return asyncio.gather(*(appender(t) for t in names))

            keys = [k for t in names for k in store.keys.thread_keys(t)[:3]]
        else:
            keys = [f"bench:cc:{tag}:{i}" for i in range(level)]
            work = self._raw_work(side, keys, per_task)
        server0 = await self.server_cpu()
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        await work()
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        server = await self.server_cpu() - server0
        await self.raw.unlink(*keys)
        n = per_task * level
        return n / elapsed, cpu / n * 1e6, server / n * 1e6

    def _raw_work(self, side: str, keys: list[str], per_task: int) -> Callable[[], Awaitable[Any]]:
        raw, fields = self.raw, self.fields
        total = per_task * len(keys)
        if side == RAW_CONC:

            async def one(key: str) -> None:
                for _ in range(per_task):
                    await raw.xadd(key, fields)

            return lambda: asyncio.gather(*(one(k) for k in keys))
        if side == RAW_SEQ:

            async def sequential() -> None:
                for i in range(total):
                    await raw.xadd(keys[i % len(keys)], fields)

            return sequential

        async def pipelined() -> None:
            for start in range(0, total, PIPELINE):
                pipe = raw.pipeline(transaction=False)
                for i in range(start, min(total, start + PIPELINE)):
                    pipe.xadd(keys[i % len(keys)], fields)
                await pipe.execute()

        return pipelined

    # -- a lone append ---------------------------------------------------------------------------

    def lone_sides(self) -> list[Side]:
        raw, fields = self.raw, self.fields

        async def setup_raw(r: int, n: int) -> Op:
            key = f"bench:lone:{r}"
            await raw.unlink(key)

            async def op() -> None:
                await raw.xadd(key, fields)

            return op

        def setup_store(name: str) -> Callable[[int, int], Awaitable[Op]]:
            store = self.stores[name]

            async def setup(r: int, n: int) -> Op:
                thread = f"lone-{SIDES.index(name)}-{r}"
                await raw.unlink(*store.keys.thread_keys(thread)[:3])
                version = 0

                async def op() -> None:
                    nonlocal version
                    result = await store.append(thread, self.events, expected_version=version)
                    version = result.last_seq

                return op

            return setup

        return [
            Side("raw XADD", setup_raw),
            Side(GROUP, setup_store(GROUP)),
            Side(NO_GROUP, setup_store(NO_GROUP)),
        ]


async def measure_all(quick: bool, *, progress: bool = True) -> dict[str, Any]:
    mode = QUICK if quick else FULL
    rounds, appends = mode["rounds"], mode["appends"]
    encoded, _ = encode_one(make_event())
    payload = encoded[0].data
    env = environment()
    results: dict[int, dict[str, list[float]]] = {n: {s: [] for s in SIDES} for n in LEVELS}
    cpu: dict[int, dict[str, list[tuple[float, float]]]] = {
        n: {s: [] for s in SIDES} for n in LEVELS
    }
    with redis_server() as server:
        group = await open_redis_store(server, "bench", 64)
        no_group = await open_redis_store(server, "bench", 1)
        raw = client_for(server)
        try:
            info = await raw.info("server")
            env.update(redis_server=info["redis_version"], transport="unix socket")
            bench = Bench(group, no_group, raw, payload)
            # Warm every side once (connections, script cache, allocator) before timing.
            for side in SIDES:
                await bench.run(side, 64, 256, f"warm-{SIDES.index(side)}")
            for r in range(rounds):
                levels = LEVELS if r % 2 == 0 else tuple(reversed(LEVELS))
                for level in levels:
                    order = list(SIDES) if (r + LEVELS.index(level)) % 2 == 0 else SIDES[::-1]
                    for side in order:
                        tag = f"{r}-{level}-{SIDES.index(side)}"
                        rate, client_us, server_us = await bench.run(side, level, appends, tag)
                        results[level][side].append(rate)
                        cpu[level][side].append((client_us, server_us))
                if progress:
                    line = "  ".join(
                        f"{n}:{results[n][GROUP][-1]:,.0f}/{results[n][RAW_PIPE][-1]:,.0f}"
                        for n in LEVELS
                    )
                    print(
                        f"  round {r + 1}/{rounds} group-commit/pipelined per level: {line}",
                        file=sys.stderr,
                        flush=True,
                    )
            lone = await measure(
                bench.lone_sides(),
                rounds=mode["lone_rounds"],
                ops=mode["lone_ops"],
                warmup=mode["lone_ops"],
                progress=False,
            )
        finally:
            await group.close()
            await no_group.close()
            await raw.aclose()
    env["loadavg_at_end"] = loadavg()
    return summarize(quick, rounds, appends, len(payload), results, cpu, lone, env)


def _median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def summarize(
    quick: bool,
    rounds: int,
    appends: int,
    payload_bytes: int,
    results: dict[int, dict[str, list[float]]],
    cpu: dict[int, dict[str, list[tuple[float, float]]]],
    lone: Comparison,
    env: dict[str, Any],
) -> dict[str, Any]:
    levels: dict[str, Any] = {}
    for level, by_side in results.items():
        levels[str(level)] = {
            side: {
                "appends_per_s": round(statistics.median(rates)),
                "rounds": [round(x) for x in rates],
                "ratio_to_pipelined": round(_median_ratio(rates, by_side[RAW_PIPE]), 3),
                "ratio_to_sequential_raw": round(_median_ratio(rates, by_side[RAW_SEQ]), 3),
                "client_cpu_us": round(statistics.median(c for c, _ in cpu[level][side]), 1),
                "server_cpu_us": round(statistics.median(s for _, s in cpu[level][side]), 1),
            }
            for side, rates in by_side.items()
        }
    at = results[TARGET_LEVEL]
    vs_sequential = _median_ratio(at[GROUP], results[1][GROUP])
    vs_pipelined = _median_ratio(at[GROUP], at[RAW_PIPE])
    lone_summary = lone.summary()
    lone_ratio = lone_summary["ratios"][GROUP]["median_paired_ratio"]
    return {
        "benchmark": NAME,
        "mode": "quick" if quick else "default",
        "rounds": rounds,
        "appends_per_side": appends,
        "payload_bytes": payload_bytes,
        "levels": levels,
        "lone_append": lone_summary,
        "targets": {
            "level": TARGET_LEVEL,
            "group_commit_vs_sequential": round(vs_sequential, 2),
            "group_commit_vs_sequential_target": TARGET_VS_SEQUENTIAL,
            "meets_vs_sequential": vs_sequential >= TARGET_VS_SEQUENTIAL,
            "group_commit_vs_pipelined": round(vs_pipelined, 3),
            "group_commit_vs_pipelined_target": TARGET_VS_PIPELINED,
            "meets_vs_pipelined": vs_pipelined >= TARGET_VS_PIPELINED,
            "lone_append_ratio": lone_ratio,
            "lone_append_target": TARGET_LONE,
            "meets_lone_append": lone_ratio <= TARGET_LONE,
        },
        "environment": env,
    }


def table_rows(summary: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["side", *(f"{n} tasks" for n in LEVELS)]
    rows = []
    for side in SIDES:
        cells = [side]
        for n in LEVELS:
            s = summary["levels"][str(n)][side]
            cells.append(f"{s['appends_per_s']:,} ({s['ratio_to_pipelined']:.2f}x)")
        rows.append(cells)
    return headers, rows


CPU_HEADERS = (
    "side", "client CPU us/append", "redis CPU us/append", "appends/s",
    "bound by one client core", "bound by the redis core",
)  # fmt: skip


def cpu_rows(summary: dict[str, Any]) -> list[list[str]]:
    """Where an append's time goes at the target level: CPU per append on each side."""
    out = []
    for side, s in summary["levels"][str(TARGET_LEVEL)].items():
        out.append(
            [side, f"{s['client_cpu_us']:.1f}", f"{s['server_cpu_us']:.1f}",
             f"{s['appends_per_s']:,}", f"{1e6 / max(s['client_cpu_us'], 0.1):,.0f}",
             f"{1e6 / max(s['server_cpu_us'], 0.1):,.0f}"]
        )  # fmt: skip
    return out


def lone_rows(summary: dict[str, Any]) -> list[list[str]]:
    lone = summary["lone_append"]
    out = []
    for name, s in lone["sides"].items():
        ratio = lone["ratios"].get(name, {}).get("median_paired_ratio", 1.0)
        out.append(
            [name, f"{s['median_round_mean_us']:.1f}", f"{s['p50_us']:.1f}", f"{s['p99_us']:.1f}",
             f"{ratio:.2f}x"]
        )  # fmt: skip
    return out


LONE_HEADERS = ("side", "median us/op", "p50 us", "p99 us", "ratio to raw XADD")


def verdicts(summary: dict[str, Any]) -> list[str]:
    t = summary["targets"]

    def word(ok: bool) -> str:
        return "meets" if ok else "misses"

    return [
        f"{TARGET_LEVEL} tasks with group commit: {t['group_commit_vs_sequential']:.2f}x the same "
        f"appends one after another ({word(t['meets_vs_sequential'])} the "
        f"{TARGET_VS_SEQUENTIAL}x target)",
        f"{TARGET_LEVEL} tasks with group commit: {t['group_commit_vs_pipelined']:.2f}x the raw "
        f"pipelined XADD rate ({word(t['meets_vs_pipelined'])} the {TARGET_VS_PIPELINED}x target)",
        f"a lone append with group commit: {t['lone_append_ratio']:.2f}x a raw XADD round trip "
        f"({word(t['meets_lone_append'])} the {TARGET_LONE}x target)",
    ]


def markdown(summary: dict[str, Any]) -> str:
    headers, rows = table_rows(summary)
    env = summary["environment"]
    return "\n".join(
        [
            f"Run of {env.get('date')}: appends per second ({summary['mode']} mode, "
            f"{summary['rounds']} rounds, medians; "
            f"{summary['appends_per_side']:,} appends of a {summary['payload_bytes']}-byte event "
            f"per side per level; in brackets: the ratio to raw pipelined XADD; redis "
            f"{env.get('redis_server', '?')}, {env.get('cpus')} CPUs, load "
            f"{env.get('loadavg_at_start')}):",
            "",
            markdown_table(headers, rows),
            "",
            f"CPU per append at {TARGET_LEVEL} tasks (client: this process, all threads; redis: "
            "`INFO cpu`), and the rate each alone would allow:",
            "",
            markdown_table(CPU_HEADERS, cpu_rows(summary)),
            "",
            "A lone append, one at a time:",
            "",
            markdown_table(LONE_HEADERS, lone_rows(summary)),
            "",
            *(f"- {v}" for v in verdicts(summary)),
        ]
    )


def report(summary: dict[str, Any]) -> None:
    headers, rows = table_rows(summary)
    print_table(
        f"{TITLE}: appends/s, medians over {summary['rounds']} rounds "
        "(in brackets: ratio to raw pipelined XADD)",
        headers,
        rows,
    )
    print_table(
        f"CPU per append at {TARGET_LEVEL} tasks, and the rate each side's CPU alone would allow",
        CPU_HEADERS,
        cpu_rows(summary),
    )
    print_table("A lone append, one at a time", LONE_HEADERS, lone_rows(summary))
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

    return module_main(NAME, run, argv, quick="two rounds, a few seconds")


if __name__ == "__main__":
    sys.exit(main())
