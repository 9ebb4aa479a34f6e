"""Incremental export to NDJSON and Parquet, crash safety, tombstones; memory and real Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.parquet as pq
import pytest

import eventstore as es
from adapters import Exporter, ThreadStore, read_parquet_dir
from eventstore.testing import read_all

pytestmark = [pytest.mark.anyio, pytest.mark.partitions(4)]


async def conversation(store: es.EventStore, thread: str, turns: int) -> None:
    threads = ThreadStore(store)
    for i in range(turns):
        turn = await threads.open_turn(thread, request_message={"role": "user", "content": f"q{i}"})
        await threads.update_state(thread, "plan", {"i": i}, turn_id=turn)
        await threads.settle_turn(
            thread,
            turn,
            outcome="completed" if i % 2 else "failed",
            assistant_message={"role": "assistant", "content": f"a{i}"},
            usage=es.Usage(input_tokens=10 + i, output_tokens=i),
            model_tier="small",
        )


async def log_rows(store: es.EventStore) -> set[tuple[str, int, str, str]]:
    out = set()
    for info in await store.threads():
        for e in await read_all(store, info.thread_id):
            out.add((e.thread_id, e.seq, e.id, e.type))
    return out


def ndjson_rows(directory: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(directory.glob("part-*.ndjson")):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


def keyset(rows: list[dict[str, Any]]) -> list[tuple[str, int, str, str]]:
    return [
        (r["thread"], r["seq"], r["id"], r["type"]) for r in rows if r["type"] != "thread.deleted"
    ]


@pytest.mark.parametrize("fmt", ["ndjson", "parquet"])
async def test_export_is_exactly_the_log_and_incremental(
    store: es.EventStore, tmp_path: Path, fmt: str
) -> None:
    for t in ("a", "b", "c"):
        await conversation(store, t, 3)
    exporter = Exporter(store, tmp_path, fmt=fmt)  # type: ignore[arg-type]
    first = await exporter.run()
    rows = ndjson_rows(tmp_path) if fmt == "ndjson" else list(read_parquet_dir(tmp_path))
    assert len(rows) == first.events
    assert sorted(keyset(rows)) == sorted(await log_rows(store))
    assert len(set(keyset(rows))) == len(rows)  # no duplicates
    settled = [r for r in rows if r["type"] == "turn.settled"]
    assert {r["outcome"] for r in settled} == {"completed", "failed"}
    assert all(r["model_tier"] == "small" and r["turn"] for r in settled)
    assert all(r["namespace"] == store.namespace for r in rows)
    assert json.loads(settled[0]["payload"])["type"] == "turn.settled"

    assert (await exporter.run()).files == []  # nothing new, nothing written
    await conversation(store, "a", 1)
    await store.delete_thread("b")
    second = await exporter.run()
    assert len(second.files) == 1 and second.tombstones == 1
    rows = ndjson_rows(tmp_path) if fmt == "ndjson" else list(read_parquet_dir(tmp_path))
    tombstones = [r for r in rows if r["type"] == "thread.deleted"]
    assert [(t["thread"], t["seq"]) for t in tombstones] == [("b", 9)]
    exported = keyset(rows)
    assert len(set(exported)) == len(exported)
    assert set(await log_rows(store)) <= set(exported)  # b's events were exported before


async def test_parquet_reads_back_in_duckdb(store: es.EventStore, tmp_path: Path) -> None:
    await conversation(store, "t", 4)
    await Exporter(store, tmp_path).run()
    table = pq.read_table(sorted(tmp_path.glob("part-*.parquet"))[0])
    assert table.num_rows == len(await log_rows(store))
    con = duckdb.connect()
    try:
        result = con.execute(
            f"""
            SELECT model_tier, count(*) AS turns, sum(input_tokens) AS tokens
            FROM read_parquet('{tmp_path}/part-*.parquet')
            WHERE type = 'turn.settled'
            GROUP BY model_tier
            """
        ).fetchall()
    finally:
        con.close()
    assert result == [("small", 4, 10 + 11 + 12 + 13)]


async def test_feed_trimming_waits_for_the_export(store: es.EventStore, tmp_path: Path) -> None:
    await conversation(store, "t", 2)
    exporter = Exporter(store, tmp_path, fmt="ndjson")
    await exporter.run()
    await conversation(store, "t", 1)
    trimmed = sum([await store.trim_feed(p) for p in range(store.partitions)])
    remaining = sum([len(await store.read_feed(p)) for p in range(store.partitions)])
    assert trimmed > 0 and remaining == 3  # only the exported appends went
    await exporter.run()
    assert sorted(keyset(ndjson_rows(tmp_path))) == sorted(await log_rows(store))


def test_unknown_format_is_refused(tmp_path: Path) -> None:
    with pytest.raises(es.InvalidInputError):
        Exporter(es.MemoryEventStore(), tmp_path, fmt="csv")  # type: ignore[arg-type]


EXPORTER = textwrap.dedent(
    """
    import sys, anyio, eventstore as es
    from adapters import Exporter

    async def main():
        store = await es.connect(sys.argv[1], namespace=sys.argv[2])
        await Exporter(store, sys.argv[3], fmt=sys.argv[4], batch=50, rows_per_part=300).run()

    anyio.run(main)
    """
)


@pytest.mark.parametrize("fmt", ["ndjson", "parquet"])
async def test_killed_exporter_leaves_no_duplicates_or_holes(
    redis_url: str, tmp_path: Path, fmt: str
) -> None:
    namespace = "x" + uuid.uuid4().hex[:12]
    store = await es.connect(redis_url, namespace=namespace, partitions=4)
    try:
        for i in range(40):
            await store.append(
                f"t{i}",
                [
                    es.MessageAppended(message=es.Message(role="user", content=str(n)))
                    for n in range(3)
                ],
            )
            for n in range(30):
                await store.append(
                    f"t{i}", [es.MessageAppended(message=es.Message(role="user", content="x" * n))]
                )
        expected = await log_rows(store)
        args = [sys.executable, "-c", EXPORTER, redis_url, namespace, str(tmp_path), fmt]
        cwd = os.path.dirname(os.path.dirname(__file__))
        with subprocess.Popen(args, cwd=cwd) as proc:
            deadline = time.monotonic() + 60
            while not list(tmp_path.glob(f"part-*.{fmt}")) and time.monotonic() < deadline:
                time.sleep(0.002)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        committed = sorted(tmp_path.glob(f"part-*.{fmt}"))
        assert committed, "the exporter was killed before committing anything"
        before = ndjson_rows(tmp_path) if fmt == "ndjson" else list(read_parquet_dir(tmp_path))
        assert 0 < len(before) < len(expected), "the kill did not land mid-export"
        # Rerun to completion, in process, and compare the union of parts with the log.
        result = await Exporter(store, tmp_path, fmt=fmt, batch=50, rows_per_part=300).run()  # type: ignore[arg-type]
        assert not list(tmp_path.glob(".part-*"))
        rows = ndjson_rows(tmp_path) if fmt == "ndjson" else list(read_parquet_dir(tmp_path))
        exported = keyset(rows)
        assert len(exported) == len(set(exported)), "duplicates"
        assert set(exported) == expected, "holes"
        # The rerun resumed at the committed positions: it wrote exactly the rest.
        assert result.events == len(expected) - len(before)
    finally:
        await store.close()
