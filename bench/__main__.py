"""Run every benchmark: ``python -m bench [--quick] [--only NAME[,NAME]]``.

Each module runs in turn (its own redis-server, its own tables on stdout); then every summary
goes into ``bench/results.json``, the tables in ``bench/RESULTS.md`` are rewritten between
their markers (``<!-- bench:NAME:start -->`` / ``<!-- bench:NAME:end -->``; the prose around
them is kept), and ``bench/results.png`` is drawn from the summaries. With ``--only`` the other
modules' summaries already in ``results.json`` are kept. A ``--quick`` run (a smoke test, under
two minutes) leaves the files alone unless ``--write`` is given. A module whose optional peers
are not installed (e.g. the OpenAI Agents SDK for ``frameworks``) is skipped with a note.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import sys
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from ._common import add_recording_flags

HERE = Path(__file__).resolve().parent
RESULTS_JSON = HERE / "results.json"
RESULTS_MD = HERE / "RESULTS.md"
RESULTS_PNG = HERE / "results.png"
MODULES = ("append", "read", "session", "frameworks", "export", "concurrency", "flat", "memory")
TITLES = {
    "append": "Append latency",
    "read": "Read paths",
    "session": "Session store",
    "frameworks": "Framework adapters",
    "export": "Export throughput and memory",
    "concurrency": "Append throughput against concurrency",
    "flat": "Latency against thread length",
    "memory": "Memory per stored message",
}

Runner = tuple[Callable[[bool], dict[str, Any]], Callable[[dict[str, Any]], str]]


# -- results.json and RESULTS.md ------------------------------------------------------------------


def load_results(path: Path = RESULTS_JSON) -> dict[str, Any]:
    if path.exists():
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        data.setdefault("modules", {})
        return data
    return {"modules": {}}


def save_summary(name: str, summary: dict[str, Any]) -> None:
    """Record one module's summary in ``results.json`` and its table in RESULTS.md."""
    data = load_results()
    data["modules"][name] = summary
    data["updated"] = _now()
    _write_json(RESULTS_JSON, data)
    markdown = _markdown_of(name)
    if markdown is not None:
        update_results_md({name: markdown(summary)})


def module_main(
    name: str, run: Callable[[bool], dict[str, Any]], argv: list[str] | None, quick: str
) -> int:
    """``python -m bench.NAME``: run one module; record it as ``python -m bench`` would."""
    p = argparse.ArgumentParser(prog=f"python -m bench.{name}")
    p.add_argument("--quick", action="store_true", help=quick)
    add_recording_flags(p)
    args = p.parse_args(argv)
    record_run(name, run(args.quick), args)
    return 0


def record_run(name: str, summary: dict[str, Any], args: argparse.Namespace) -> None:
    """Where a ``python -m bench.NAME`` run's summary goes: to ``--json`` if given, and into
    results.json and RESULTS.md unless ``--no-write``, or ``--quick`` without ``--write`` (a
    smoke run must not replace the recorded figures)."""
    if args.json is not None:
        _write_json(args.json, summary)
    if args.write if args.write is not None else not args.quick:
        save_summary(name, summary)
    else:
        print("(results.json and RESULTS.md left alone: --write records a quick run)")


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path}")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def update_results_md(sections: dict[str, str], path: Path = RESULTS_MD) -> None:
    """Rewrite the text between each module's markers; prose outside them is left alone.

    A module without markers gets them at the end of its ``## ... (bench.NAME)`` section, or
    a new section at the end of the file.
    """
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n"
    for name, body in sections.items():
        start, end = _markers(name)
        block = f"{start}\n\n{body.strip()}\n\n{end}"
        if start in text and end in text:
            head, rest = text.split(start, 1)
            _, tail = rest.split(end, 1)
            text = head + block + tail
            continue
        latest = f"### Latest recorded run (rewritten by `python -m bench`)\n\n{block}\n"
        heading = f"(bench.{name})"
        lines = text.splitlines(keepends=True)
        at = next(
            (i for i, line in enumerate(lines) if line.startswith("## ") and heading in line),
            None,
        )
        if at is None:
            title = TITLES.get(name, name)
            text = text.rstrip("\n") + f"\n\n## {title} (bench.{name})\n\n{latest}"
            continue
        nxt = next((i for i in range(at + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        before = "".join(lines[:nxt]).rstrip("\n")
        after = "".join(lines[nxt:])
        text = before + "\n\n" + latest + ("\n" + after if after else "")
    path.write_text(text.rstrip("\n") + "\n", encoding="utf-8")
    print(f"wrote {path}")


# -- running the modules --------------------------------------------------------------------------


def _markdown_of(name: str) -> Callable[[dict[str, Any]], str] | None:
    try:
        module = importlib.import_module(f"bench.{name}")
    except ImportError:
        return None
    if name == "append" and not hasattr(module, "markdown"):
        return _append_markdown
    fn = getattr(module, "markdown", None)
    return fn if callable(fn) else None


def _append_markdown(summary: dict[str, Any]) -> str:
    verdict = "meets" if summary.get("meets_target") else "misses"
    ratio = summary.get("ratios", {}).get("threadlog append", {}).get("median_paired_ratio")
    head = (
        f"Mode `{summary.get('mode')}`: {summary.get('rounds')} rounds x "
        f"{summary.get('ops_per_round')} ops per side, {summary.get('payload_bytes')}-byte "
        f"payload; load {summary.get('environment', {}).get('loadavg_at_start')} at start."
    )
    lines = [head, "", str(summary.get("markdown", ""))]
    if ratio is not None:
        lines += ["", f"- threadlog/raw = {ratio:.2f}x: {verdict} the 1.3x target"]
    return "\n".join(lines)


def _append_runner(module: ModuleType) -> Runner:
    """`bench.append` predates the ``run(quick)`` / ``markdown(summary)`` interface."""

    def run(quick: bool) -> dict[str, Any]:
        mode = module.QUICK if quick else module.FULL
        comparison, extra = asyncio.run(module.run(mode, progress=True))
        summary: dict[str, Any] = module.report(mode, comparison, extra)
        return summary

    return run, _append_markdown


def runner(name: str) -> Runner | str:
    """The module's ``run`` and ``markdown``, or why it cannot run here."""
    try:
        module = importlib.import_module(f"bench.{name}")
    except ImportError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        return f"skipped: {missing} is not installed ({exc})"
    run = getattr(module, "run", None)
    markdown = getattr(module, "markdown", None)
    if callable(run) and callable(markdown) and "quick" in inspect.signature(run).parameters:
        return run, markdown
    if name == "append":
        return _append_runner(module)
    return f"skipped: bench.{name} has no run(quick) / markdown(summary)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="every module in quick mode (< 2 min)")
    p.add_argument("--only", help="comma-separated module names, e.g. export,memory")
    p.add_argument(
        "--write",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="record the run in results.json, RESULTS.md and results.png "
        "(default: yes, but not for --quick: a smoke run must not replace recorded figures)",
    )
    args = p.parse_args(argv)
    write = args.write if args.write is not None else not args.quick
    names = list(MODULES)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in MODULES]
        if unknown:
            p.error(f"unknown module(s) {', '.join(unknown)}; known: {', '.join(MODULES)}")
    data = load_results()
    notes: dict[str, str] = {}
    sections: dict[str, str] = {}
    durations: dict[str, float] = {}
    failed = False
    t_all = time.perf_counter()
    for name in names:
        print(f"\n=== bench.{name} ({'quick' if args.quick else 'default'}) ===", flush=True)
        found = runner(name)
        if isinstance(found, str):
            notes[name] = found
            print(found, flush=True)
            continue
        run, markdown = found
        t0 = time.perf_counter()
        try:
            summary = run(args.quick)
        except Exception as exc:
            failed = True
            notes[name] = f"failed: {type(exc).__name__}: {exc}"
            traceback.print_exc()
            continue
        durations[name] = round(time.perf_counter() - t0, 1)
        summary.setdefault("wall_s", durations[name])
        data["modules"][name] = summary
        sections[name] = markdown(summary)
    total = round(time.perf_counter() - t_all, 1)
    print(f"\n=== done in {total} s: " + ", ".join(f"{k} {v} s" for k, v in durations.items()))
    for name, note in notes.items():
        print(f"  {name}: {note}")
    if not write:
        print("(files left alone: --write records a quick run)")
        return 1 if failed else 0
    data["updated"] = _now()
    data["last_run"] = {
        "quick": args.quick,
        "modules": names,
        "seconds": durations,
        "total_seconds": total,
        "notes": notes,
    }
    _write_json(RESULTS_JSON, data)
    if sections:
        update_results_md(sections)
    draw(data["modules"], RESULTS_PNG)
    return 1 if failed else 0


# -- the figure -----------------------------------------------------------------------------------


def draw(modules: dict[str, Any], path: Path) -> None:
    """Latency against thread length, throughput against concurrency, per-event job cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    _draw_flat(axes[0], modules.get("flat"))
    _draw_concurrency(axes[1], modules.get("concurrency"))
    _draw_jobs(axes[2], modules.get("flat"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def _empty(ax: Any, title: str) -> None:
    ax.set_title(title)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)


def _draw_flat(ax: Any, flat: dict[str, Any] | None) -> None:
    title = "Latency against thread length"
    if not flat or "lengths" not in flat:
        _empty(ax, title)
        return
    lengths = sorted(int(n) for n in flat["lengths"])
    for op, label in (("append", "append (1 message)"), ("list_messages", "list_messages(6)")):
        ys = [flat["lengths"][str(n)][op]["p50_us"] for n in lengths]
        ax.plot(lengths, ys, marker="o", label=f"{label}, p50")
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("events in the thread")
    ax.set_ylabel("microseconds")
    ax.set_title(title)
    ax.legend()
    ax.grid(True, alpha=0.3)


def _draw_concurrency(ax: Any, conc: dict[str, Any] | None) -> None:
    title = "Append throughput against concurrency"
    if not conc or "levels" not in conc:
        _empty(ax, title)
        return
    levels = sorted(int(n) for n in conc["levels"])
    sides = list(conc["levels"][str(levels[0])])
    for side in sides:
        ys = [conc["levels"][str(n)][side]["appends_per_s"] for n in levels]
        style = "--" if side.startswith("raw") else "-"
        ax.plot(levels, ys, style, marker="o", label=side)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(n) for n in levels])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrent tasks")
    ax.set_ylabel("appends per second")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)


def _draw_jobs(ax: Any, flat: dict[str, Any] | None) -> None:
    title = "Rebuild and export: time per event"
    if not flat or "jobs" not in flat:
        _empty(ax, title)
        return
    for job, rows in flat["jobs"].items():
        sizes = sorted(int(n) for n in rows)
        ys = [rows[str(n)]["us_per_event"] for n in sizes]
        ax.plot(sizes, ys, marker="o", label=job)
        for n, y in zip(sizes, ys, strict=True):
            if "failed_with_defaults" in rows[str(n)]:
                ax.annotate(
                    "times out with the default\nsocket timeout (5 s);\ntimed with 600 s",
                    (n, y),
                    textcoords="offset points",
                    xytext=(-150, -40),
                    fontsize=8,
                    arrowprops={"arrowstyle": "->"},
                )
    ax.set_xscale("log")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("events")
    ax.set_ylabel("microseconds per event")
    ax.set_title(title)
    ax.legend()
    ax.grid(True, alpha=0.3)


if __name__ == "__main__":
    sys.exit(main())
