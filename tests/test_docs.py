"""The documentation's examples run: Python blocks are executed, the SQL block runs in DuckDB."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import anyio
import duckdb
import pytest

import eventstore as es
from adapters import Exporter, ThreadStore

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(path.read_text()) if lang == language]


def test_readme_python_runs(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THREADLOG_URL", redis_url)
    (code,) = blocks(ROOT / "README.md", "python")
    # The example names a fixed namespace; give it a fresh one so reruns start clean.
    code = code.replace('namespace="acme"', f'namespace="docs{uuid.uuid4().hex[:8]}"')
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})


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
