"""Shared benchmark machinery: interleaved side-by-side timing, percentiles, tables and JSON.

A benchmark describes each contender as a `Side`: an untimed ``setup`` that returns the
operation to time, and an optional untimed ``teardown``. `measure` runs the sides in
alternating order round after round (A B, B A, A B, ...) on the same event loop, so drift on a
noisy machine lands on both sides alike, and reports per-round means, pooled per-op latencies
and the per-round paired ratio against the first side (the baseline).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

Op = Callable[[], Awaitable[object]]
"""One operation to time; awaited sequentially, one at a time."""


@dataclass(frozen=True)
class Side:
    """One contender: ``setup(round, n_ops)`` returns the op to time; both hooks are untimed."""

    name: str
    setup: Callable[[int, int], Awaitable[Op]]
    teardown: Callable[[int], Awaitable[None]] | None = None


@dataclass
class SideResult:
    """What `measure` collected for one side."""

    name: str
    round_means_ns: list[float] = field(default_factory=list)
    latencies_ns: list[int] = field(default_factory=list)

    @property
    def ops(self) -> int:
        return len(self.latencies_ns)

    @property
    def median_round_us(self) -> float:
        """The median over rounds of the mean per-op latency, in microseconds."""
        return statistics.median(self.round_means_ns) / 1000

    def percentile_us(self, q: float) -> float:
        return percentile(sorted(self.latencies_ns), q) / 1000

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ns)
        return {
            "ops": len(lat),
            "rounds": len(self.round_means_ns),
            "median_round_mean_us": round(self.median_round_us, 2),
            "p50_us": round(percentile(lat, 50) / 1000, 2),
            "p90_us": round(percentile(lat, 90) / 1000, 2),
            "p99_us": round(percentile(lat, 99) / 1000, 2),
            "max_us": round(lat[-1] / 1000, 2),
            "ops_per_s": round(1e9 / statistics.median(self.round_means_ns), 1),
            "round_means_us": [round(m / 1000, 2) for m in self.round_means_ns],
        }


@dataclass
class Comparison:
    """The sides of one `measure` run; the first side is the baseline of every ratio."""

    sides: list[SideResult]

    @property
    def baseline(self) -> SideResult:
        return self.sides[0]

    def paired_ratios(self, side: SideResult) -> list[float]:
        """Per round: this side's mean over the baseline's mean in the same round."""
        return [
            m / b for m, b in zip(side.round_means_ns, self.baseline.round_means_ns, strict=True)
        ]

    def ratio(self, side: SideResult) -> float:
        """The median of the per-round paired ratios (robust to rounds hit by noise)."""
        return statistics.median(self.paired_ratios(side))

    def p50_ratio(self, side: SideResult) -> float:
        return side.percentile_us(50) / self.baseline.percentile_us(50)

    def rows(self) -> list[list[str]]:
        """Table rows: side, ops, median round mean, p50, p99, ops/s, ratio, p50 ratio."""
        out = []
        for s in self.sides:
            out.append(
                [
                    s.name,
                    str(s.ops),
                    f"{s.median_round_us:.1f}",
                    f"{s.percentile_us(50):.1f}",
                    f"{s.percentile_us(99):.1f}",
                    f"{1e6 / s.median_round_us:,.0f}",
                    f"{self.ratio(s):.2f}x",
                    f"{self.p50_ratio(s):.2f}x",
                ]
            )
        return out

    HEADERS = ("side", "ops", "median us/op", "p50 us", "p99 us", "ops/s", "ratio", "p50 ratio")

    def summary(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline.name,
            "sides": {s.name: s.summary() for s in self.sides},
            "ratios": {
                s.name: {
                    "median_paired_ratio": round(self.ratio(s), 3),
                    "p50_ratio": round(self.p50_ratio(s), 3),
                    "min_paired_ratio": round(min(self.paired_ratios(s)), 3),
                    "max_paired_ratio": round(max(self.paired_ratios(s)), 3),
                }
                for s in self.sides[1:]
            },
        }


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of already sorted values."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


async def time_ops(op: Op, n: int) -> list[int]:
    """Await ``op()`` ``n`` times in sequence; the latency of each call in nanoseconds."""
    clock = time.perf_counter_ns
    out = [0] * n
    for i in range(n):
        t0 = clock()
        await op()
        out[i] = clock() - t0
    return out


def time_cpu(fn: Callable[[], object], *, n: int = 2000, batches: int = 7) -> float:
    """Microseconds per call of a synchronous ``fn``: the fastest of ``batches`` batches.

    The minimum, not the median: what is wanted is the work itself, and on a shared machine
    everything slower than the fastest batch is somebody else's work.
    """
    clock = time.perf_counter_ns
    best = math.inf
    for _ in range(batches):
        t0 = clock()
        for _ in range(n):
            fn()
        best = min(best, (clock() - t0) / n)
    return best / 1000


async def measure(
    sides: Sequence[Side],
    *,
    rounds: int,
    ops: int,
    warmup: int = 0,
    progress: bool = True,
) -> Comparison:
    """Time every side for ``rounds`` rounds of ``ops`` sequential ops, alternating the order.

    Each side first runs one untimed warm-up round of ``warmup`` ops. A full collection runs
    before every timed round so garbage left by one side is not collected on the other's clock.
    What is alive when the measurement starts (the imported libraries, the sides' clients and
    data) is frozen out of the collector meanwhile (`gc.freeze`): with the peers' frameworks
    imported, a full collection of it took ~150 ms, half of a quick run of bench.session, and
    it is no side's garbage.
    """
    results = [SideResult(s.name) for s in sides]
    gc.collect()
    gc.freeze()
    try:
        if warmup > 0:
            for s in sides:
                await _run_round(s, -1, warmup)
        for r in range(rounds):
            order = list(range(len(sides)))
            if r % 2:
                order.reverse()
            for i in order:
                lat = await _run_round(sides[i], r, ops)
                results[i].round_means_ns.append(sum(lat) / len(lat))
                results[i].latencies_ns.extend(lat)
            if progress:
                means = "  ".join(
                    f"{res.name} {res.round_means_ns[-1] / 1000:7.1f} us" for res in results
                )
                print(f"  round {r + 1:>3}/{rounds}  {means}", file=sys.stderr, flush=True)
    finally:
        gc.unfreeze()
    return Comparison(results)


async def _run_round(side: Side, r: int, n: int) -> list[int]:
    op = await side.setup(r, n)
    gc.collect()
    try:
        return await time_ops(op, n)
    finally:
        if side.teardown is not None:
            await side.teardown(r)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    print(f"\n{title}\n")
    print(format_table(headers, rows))


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The same table in GitHub markdown, for RESULTS.md."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, where the platform has them."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def environment(**extra: Any) -> dict[str, Any]:
    """Facts about the machine a result was measured on (call it when the run starts)."""
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "cpus": os.cpu_count(),
        "loadavg_at_start": loadavg(),
        **extra,
    }


def arg_parser(prog: str, *, warmup: bool = False) -> argparse.ArgumentParser:
    """The flags of the paired-timing benchmarks; ``--rounds``/``--ops``/``--warmup`` override
    the mode, ``--json``/``--write`` say where the summary goes (as ``python -m bench``'s)."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--quick", action="store_true", help="few rounds; well under 30 s")
    p.add_argument("--rounds", type=positive_int, help="timed rounds per side")
    p.add_argument("--ops", type=positive_int, help="sequential ops per round")
    if warmup:  # only where the run takes it: a flag accepted and ignored would mislead
        p.add_argument("--warmup", type=non_negative_int, help="untimed ops per side first")
    add_recording_flags(p)
    p.add_argument("--quiet", action="store_true", help="no per-round progress on stderr")
    return p


def add_recording_flags(p: argparse.ArgumentParser) -> None:
    """``--json`` and ``--write``: where a ``python -m bench.NAME`` run's summary goes
    (`bench.__main__.record_run`)."""
    p.add_argument("--json", type=Path, help="also write the summary to this file")
    p.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="record the run in results.json and RESULTS.md (default: yes, not for --quick)",
    )


def positive_int(text: str) -> int:
    value = non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


@dataclass(frozen=True)
class Mode:
    """Rounds and ops of one run, from ``--quick`` or the defaults, overridable by flags."""

    name: str
    rounds: int
    ops: int
    warmup: int

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, quick: Mode, full: Mode) -> Mode:
        base = quick if args.quick else full
        return cls(
            name=base.name,
            rounds=args.rounds or base.rounds,
            ops=args.ops or base.ops,
            warmup=base.warmup if getattr(args, "warmup", None) is None else args.warmup,
        )
