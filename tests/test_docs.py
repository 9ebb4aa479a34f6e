"""The documentation's examples run: Python blocks are executed, the SQL block runs in DuckDB."""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import duckdb
import pytest

import eventstore as es
from adapters import Exporter, ThreadStore
from adapters.cli import UsageError, build_parser

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(path.read_text()) if lang == language]


def test_readme_python_runs(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THREADLOG_URL", redis_url)
    monkeypatch.delenv("THREADLOG_SECRET", raising=False)
    (code,) = blocks(ROOT / "README.md", "python")
    # The example names a fixed namespace; give it a fresh one so reruns start clean.
    namespace = f"docs{uuid.uuid4().hex[:8]}"
    assert code.count('namespace="acme"') == 1
    code = code.replace('namespace="acme"', f'namespace="{namespace}"')
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})

    # What the example says it did is what the store holds.
    async def written() -> None:
        async with await es.connect(redis_url, namespace=namespace) as store:
            threads = ThreadStore(store)
            history = await threads.list_messages("thread-1")
            assert [(m.message.role, m.message.content) for m in history] == [
                ("user", "hi"),
                ("assistant", "hello"),
            ]
            (record,) = (await threads.context("thread-1", records=3)).records
            assert record.outcome == "completed" and record.usage.output_tokens == 3
            state = await threads.state("thread-1")
            assert {name: block.value for name, block in state.items()} == {"plan": {"step": 1}}

    anyio.run(written)


# A placeholder of the README's command lines, and a value to try in its place.
_PLACEHOLDERS = {"THREAD": "t", "N": "5", "FILE": "in.jsonl", "SESSION": "s", "NAME": "g"}


def _command_lines() -> list[str]:
    """The ``threadlog ...`` command lines of the README's sh blocks, comments dropped and
    ``a  /  b`` lines split."""
    lines = []
    for block in blocks(ROOT / "README.md", "sh"):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            lines += [part.strip() for part in re.split(r"\s+/\s+", line)]
    return [line for line in lines if line.startswith("threadlog ")]


def _variants(line: str) -> Iterator[list[str]]:
    """Every argv a synopsis line stands for: ``[x]`` with and without x, ``a | b`` and
    ``v1|v2`` each way, placeholders filled in."""
    for argv in _expand(line.removeprefix("threadlog ")):
        yield [_PLACEHOLDERS.get(word, word) for word in argv]


def _expand(synopsis: str) -> Iterator[list[str]]:
    groups: list[list[list[str]]] = []
    pending_or = False
    for token in re.findall(r"\[[^\]]*\]|\S+", synopsis):
        if token == "|":
            pending_or = True
            continue
        if token.startswith("["):
            choices = [[], *_expand(token[1:-1])]
        elif "|" in token:
            choices = [[value] for value in token.split("|")]
        else:
            choices = [[token]]
        if pending_or:
            groups[-1] += choices
            pending_or = False
        else:
            groups.append(choices)
    for combination in itertools.product(*groups):
        yield [word for choice in combination for word in choice]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def test_every_readme_command_line_parses_as_shown() -> None:
    """Each command of the README's command block exists and takes the options and arguments
    it is shown with (each optional part with and without, each alternative); every command
    the CLI has is shown there."""
    lines = _command_lines()
    assert len(lines) >= 15, lines
    shown = set()
    for line in lines:
        for argv in _variants(line):
            shown.add(argv[0])
            try:
                build_parser().parse_args(argv)
            except UsageError as exc:
                pytest.fail(f"README: {line!r} as {argv!r}: {exc}")
    assert shown == set(_subparsers(build_parser())), "a command missing from the README"


def test_readme_command_comments_name_only_options_their_line_shows() -> None:
    """An option named in a command line's comment is in the line's synopsis too, where the
    test above parses it (``rebuild ... # ... [--trust-log]`` showed it in the comment only)."""
    for block in blocks(ROOT / "README.md", "sh"):
        for line in block.splitlines():
            synopsis, _, comment = line.partition("#")
            if synopsis.strip().startswith("threadlog "):
                hidden = set(re.findall(r"--[a-z][a-z-]*", comment)) - set(
                    re.findall(r"--[a-z][a-z-]*", synopsis)
                )
                assert not hidden, f"README: {line.strip()!r} names {sorted(hidden)} in a comment"


def test_every_option_the_readme_names_exists() -> None:
    """An option the README names anywhere (``--skip-bad``, ``--workers N``) is an option of a
    threadlog command, and ``--url``/``--namespace`` of every command but ``stop``, as it
    says."""
    text = (ROOT / "README.md").read_text().replace("mypy --strict", "mypy")
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text))
    commands = _subparsers(build_parser())
    known = {o for p in commands.values() for a in p._actions for o in a.option_strings}
    assert named and named <= known, sorted(named - known)
    for name, sub in commands.items():
        options = {o for a in sub._actions for o in a.option_strings}
        assert ({"--url", "--namespace"} <= options) == (name != "stop"), name


def test_readme_shell_commands_exist() -> None:
    """``scripts/demo`` and ``scripts/test`` are there to run, and each extra the README
    installs is one the package declares."""
    for block in blocks(ROOT / "README.md", "sh"):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("scripts/"):
                script = ROOT / line.split()[0]
                assert script.is_file() and script.stat().st_mode & 0o111, script
            for extra in re.findall(r"threadlog\[([\w-]+)\]", line):
                project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                assert extra in project["optional-dependencies"], extra


def test_readme_duckdb_query_runs(tmp_path: Path) -> None:
    (sql,) = blocks(ROOT / "README.md", "sql")

    async def fill() -> None:
        store = es.MemoryEventStore(namespace="docs")
        threads = ThreadStore(store)
        for tier in ("small", "large", "small"):
            turn = await threads.open_turn("t")
            await threads.settle_turn(
                "t",
                turn,
                outcome="completed",
                model_tier=tier,
                usage=es.Usage(input_tokens=10, output_tokens=2),
            )
        await Exporter(store, tmp_path / "exports").run()

    anyio.run(fill)
    con = duckdb.connect()
    try:
        rows = con.execute(sql.replace("exports/", f"{tmp_path}/exports/")).fetchall()
    finally:
        con.close()
    assert [(r[1], r[2], r[3], r[4]) for r in rows] == [("large", 1, 10, 2), ("small", 2, 20, 4)]


def test_a_count_of_zero_reads_nothing_on_every_read_that_takes_one(redis_url: str) -> None:
    """README, "Using it": every read of `ThreadStore` that takes a count answers nothing for
    0 (the history window's `limit=0` always did; `records(limit=0)` used to be refused), and
    every one refuses a negative count or a bool alike."""
    namespace = f"docs{uuid.uuid4().hex[:8]}"

    async def main() -> None:
        async with await es.connect(redis_url, namespace=namespace) as store:
            threads = ThreadStore(store)
            turn = await threads.open_turn("t", request_message={"role": "user", "content": "hi"})
            await threads.settle_turn("t", turn, outcome="completed")
            assert (await threads.records("t")).records  # there is something not to read
            assert await threads.list_messages("t", limit=0) == []
            ctx = await threads.context("t", limit=0, records=0)
            assert (ctx.messages, ctx.records) == ([], [])
            for thread in ("t", None):  # one thread, and the page across threads
                page = await threads.records(thread, limit=0)
                assert (page.records, page.next_cursor) == ([], None)
            for bad in (-1, True):
                with pytest.raises(es.InvalidInputError, match="limit must be an int >= 0"):
                    await threads.list_messages("t", limit=bad)
                with pytest.raises(es.InvalidInputError, match="limit must be an int >= 0"):
                    await threads.records("t", limit=bad)

    anyio.run(main)


def test_every_test_the_guarantees_cite_exists() -> None:
    """docs/guarantees.md proves each guarantee by naming tests: a renamed or removed test
    would leave a proof that points at nothing."""
    text = (ROOT / "docs" / "guarantees.md").read_text()
    cited = set(re.findall(r"`(?:\w+(?:\.py)?::)?(test_\w+)`", text))
    sources = [*ROOT.glob("tests/*.py"), *ROOT.glob("*/testing.py")]
    defined = set(re.findall(r"def (test_\w+)\(", "".join(p.read_text() for p in sources)))
    assert len(cited) > 200  # the pattern still finds the citations
    assert sorted(cited - defined) == []


def test_the_quickstart_example_runs(redis_url: str, tmp_path: Path) -> None:
    """examples/quickstart.py runs against a real Redis, as a user would run it, and prints
    the thread it wrote."""
    env = {**os.environ, "THREADLOG_URL": redis_url, "PYTHONPATH": str(ROOT)}
    env.pop("THREADLOG_SECRET", None)
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "on RedisEventStore" in run.stdout, run.stdout
    assert "assistant: Storing changes as events." in run.stdout and "version 4" in run.stdout
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == ["quickstart.py"]


def test_every_environment_variable_threadlog_reads_is_in_the_commands_help() -> None:
    from adapters.cli import EXIT_CODES

    sources = [*ROOT.glob("eventstore/*.py"), *ROOT.glob("projections/*.py")]
    sources += [*ROOT.glob("adapters/*.py"), ROOT / "threadlog_cli.py"]
    read = {
        name
        for path in sources
        for name in re.findall(r'"(THREADLOG_[A-Z_]+)"', path.read_text())
        if not name.startswith("THREADLOG_TEST_")
    }
    assert read >= {"THREADLOG_URL", "THREADLOG_SECRET", "THREADLOG_REDIS_SERVER"}, read
    listed = set(re.findall(r"^  (THREADLOG_[A-Z_]+) ", EXIT_CODES, re.M))
    assert listed == read, (listed, read)
