"""Incremental export to NDJSON and Parquet, crash safety, tombstones; memory and real Redis."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import duckdb
import msgspec
import pyarrow.parquet as pq
import pytest

import eventstore as es
from adapters import (
    COLUMNS,
    ExportBusyError,
    Exporter,
    ExportSourceError,
    ExportWorkerError,
    ThreadStore,
    committed_positions,
    read_parquet_dir,
)
from adapters._export import (
    FIRST_READ,
    LEGACY_SOURCE_FILE,
    PAGE,
    RUN_RECORD_FILE,
    SOURCE_FILE,
    _Child,
    _fence_earlier_workers,
    _ulid_array,
    _ulid_text,
    _WorkerJob,
    directory_export_name,
)
from eventstore._keys import KeyLayout
from eventstore.servers import free_port
from eventstore.testing import msg, read_all

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


def thread_in_partition(store: es.EventStore, partition: int) -> str:
    """A thread id of the store's namespace that falls in ``partition``."""
    names = (f"t{i}" for i in range(10_000))
    return next(t for t in names if es.partition_of(t, store.partitions) == partition)


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


@pytest.mark.parametrize("fmt", ["ndjson", "parquet"])
async def test_deletion_rows_are_written_as_event_rows_are(
    store: es.EventStore, tmp_path: Path, fmt: str
) -> None:
    await conversation(store, "b", 1)
    await store.delete_thread("b")
    await Exporter(store, tmp_path, fmt=fmt).run()  # type: ignore[arg-type]
    if fmt == "ndjson":
        lines = [
            line
            for p in sorted(tmp_path.glob("part-*.ndjson"))
            for line in p.read_bytes().splitlines()
        ]
        rows = [json.loads(line) for line in lines]
        assert all(list(r) == list(COLUMNS) for r in rows)  # every column, in order
    else:
        rows = list(read_parquet_dir(tmp_path))
    (deleted,) = [r for r in rows if r["type"] == "thread.deleted"]
    events = [r for r in rows if r["type"] != "thread.deleted"]
    # A deletion is no event: no event id (not its feed entry id, which is no ULID).
    assert deleted["id"] is None and all(len(r["id"]) == 26 for r in events)
    assert (deleted["thread"], deleted["seq"], deleted["namespace"]) == ("b", 3, store.namespace)
    # Its payload is JSON as every event's is: compact, "type" first.
    assert deleted["payload"] == '{"type":"thread.deleted","version":3}'
    assert all(r["payload"].startswith('{"type":"') and ", " not in r["payload"] for r in events)


async def test_a_thread_deleted_and_created_again_before_the_export_is_exported_once(
    store: es.EventStore, tmp_path: Path
) -> None:
    def said(text: str) -> es.MessageAppended:
        return es.MessageAppended(message=es.Message(role="user", content=text))

    await store.append("t", [said("old 1"), said("old 2"), said("old 3")])
    await store.append("u", [said("other")])
    await store.delete_thread("t")
    await store.append("t", [said("new 1"), said("new 2")])
    result = await Exporter(store, tmp_path, fmt="ndjson").run()
    rows = ndjson_rows(tmp_path)
    # The old life's events are gone; its feed entry must not read the new life's seqs 1-2
    # (that exported them twice). What remains: its tombstone, and each new event once.
    assert sorted((r["thread"], r["seq"], r["type"]) for r in rows) == [
        ("t", 1, "message.appended"), ("t", 2, "message.appended"), ("t", 3, "thread.deleted"),
        ("u", 1, "message.appended"),
    ]  # fmt: skip
    events = [r for r in rows if r["thread"] == "t" and r["type"] == "message.appended"]
    assert sorted(json.loads(r["payload"])["message"]["content"] for r in events) == [
        "new 1",
        "new 2",
    ]
    assert result.events == 3 and result.tombstones == 1


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


async def test_pyarrow_reads_the_directory_as_a_whole(store: es.EventStore, tmp_path: Path) -> None:
    # pandas.read_parquet(directory) goes through this: before, the positions sidecars and the
    # source record were taken for parts (ArrowInvalid: "Parquet file size is 38 bytes").
    await conversation(store, "t", 2)
    await Exporter(store, tmp_path).run()
    await conversation(store, "u", 1)
    assert (await Exporter(store, tmp_path).run()).files
    assert len(list(tmp_path.glob("part-*.parquet"))) == 2
    assert (tmp_path / SOURCE_FILE).exists()
    table = pq.read_table(tmp_path)
    assert table.num_rows == len(await log_rows(store)) == 9
    assert sorted(set(table.column("thread").to_pylist())) == ["t", "u"]


@pytest.mark.parametrize("fmt", ["ndjson", "parquet"])
async def test_a_directory_with_the_records_named_as_before_is_continued(
    redis_store: es.EventStore, tmp_path: Path, fmt: str
) -> None:
    # Directories written before the records took their "_" names: "source.json" and
    # "part-N.positions.json". A run reads them, renames them, and exports only what is new.
    await conversation(redis_store, "t", 2)
    await Exporter(redis_store, tmp_path, fmt=fmt).run()  # type: ignore[arg-type]
    (tmp_path / SOURCE_FILE).rename(tmp_path / LEGACY_SOURCE_FILE)
    sidecar = tmp_path / "_part-00000001.positions.json"
    sidecar.rename(tmp_path / "part-00000001.positions.json")
    assert committed_positions(tmp_path)[0] == 1  # read under its old name, as it stands
    await conversation(redis_store, "t", 1)
    second = await Exporter(redis_store, tmp_path, fmt=fmt).run()  # type: ignore[arg-type]
    assert second.events == 3  # the new turn only: open, message, settlement
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "_part-00000001.positions.json", "_part-00000002.positions.json", RUN_RECORD_FILE,
        SOURCE_FILE, f"part-00000001.{fmt}", f"part-00000002.{fmt}",
    ]  # fmt: skip
    rows = ndjson_rows(tmp_path) if fmt == "ndjson" else list(read_parquet_dir(tmp_path))
    assert sorted(keyset(rows)) == sorted(await log_rows(redis_store))  # each once


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


async def test_bad_targets_and_arguments_are_refused_clearly(tmp_path: Path) -> None:
    store = es.MemoryEventStore()
    await store.append("t", [msg("x")])
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    with pytest.raises(es.InvalidInputError, match="not a directory"):
        await Exporter(store, a_file, fmt="ndjson").run()
    with pytest.raises(es.InvalidInputError, match="since must be a datetime"):
        await Exporter(store, tmp_path / "out", fmt="ndjson").run(since="1h")  # type: ignore[arg-type]
    # One format per directory: a glob over part-*.parquet must see every row.
    mixed = tmp_path / "mixed"
    assert (await Exporter(store, mixed, fmt="ndjson").run()).events == 1
    with pytest.raises(es.InvalidInputError, match="holds ndjson parts"):
        await Exporter(store, mixed, fmt="parquet").run()
    # Parts are made as any file the user writes: 0666 less the umask, not mkstemp's 0600.
    mask = os.umask(0o022)
    os.umask(mask)
    (part,) = mixed.glob("part-*.ndjson")
    assert part.stat().st_mode & 0o777 == 0o666 & ~mask
    # An empty path is the working directory to the OS: refused, not exported into.
    for empty in ("", " "):
        with pytest.raises(es.InvalidInputError, match="export directory is empty"):
            Exporter(store, empty, fmt="ndjson")
    # A codec does nothing to NDJSON parts: asking for one is refused, not ignored.
    with pytest.raises(es.InvalidInputError, match="applies to Parquet parts only"):
        Exporter(store, tmp_path / "nd", fmt="ndjson", compression="zstd")
    assert not (tmp_path / "nd").exists()
    # Sizes are refused when the exporter is made, naming the argument (rows_per_part=0 wrote
    # a part a chunk, "10" failed mid-run with a TypeError, batch=0 was called 'count').
    for kwargs in (
        {"rows_per_part": 0}, {"rows_per_part": -5}, {"rows_per_part": "10"},
        {"rows_per_part": True}, {"batch": 0}, {"batch": 2.5},
    ):  # fmt: skip
        name = next(iter(kwargs))
        with pytest.raises(es.InvalidInputError, match=f"^{name} must be an int >= 1"):
            Exporter(store, tmp_path / "sizes", fmt="ndjson", **kwargs)
    assert not (tmp_path / "sizes").exists()


EXPORTER = textwrap.dedent(
    """
    import sys, anyio, eventstore as es
    from adapters import Exporter

    async def main():
        store = await es.connect(sys.argv[1], namespace=sys.argv[2])
        settings = es.StoreSettings.from_url(sys.argv[1], namespace=sys.argv[2])
        workers = int(sys.argv[5])
        await Exporter(
            store, sys.argv[3], fmt=sys.argv[4], batch=50, rows_per_part=300, workers=workers,
            settings=settings,
        ).run()

    anyio.run(main)
    """
)


@pytest.mark.parametrize(("fmt", "workers"), [("ndjson", 1), ("parquet", 1), ("parquet", 3)])
async def test_killed_exporter_leaves_no_duplicates_or_holes(
    redis_url: str, tmp_path: Path, fmt: str, workers: int
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
        args.append(str(workers))
        cwd = os.path.dirname(os.path.dirname(__file__))
        with subprocess.Popen(args, cwd=cwd) as proc:
            deadline = time.monotonic() + 60
            while not list(tmp_path.glob(f"part-*.{fmt}")) and time.monotonic() < deadline:
                time.sleep(0.002)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        if workers > 1:
            # Its workers die with it (the kernel kills them); wait until they are gone, as a
            # rerun does, so that what was committed is final before it is counted.
            await _fence_earlier_workers(tmp_path)
        committed = sorted(tmp_path.glob(f"part-*.{fmt}"))
        assert committed, "the exporter was killed before committing anything"
        before = ndjson_rows(tmp_path) if fmt == "ndjson" else list(read_parquet_dir(tmp_path))
        assert 0 < len(before) < len(expected), "the kill did not land mid-export"
        # Rerun to completion, in process, and compare the union of parts with the log. (With
        # workers, the killed run's workers die with it; the rerun waits until they are gone.)
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


# -- parallel export: worker processes -------------------------------------------------------


async def fill_partitions(store: es.EventStore, threads: int, appends: int) -> None:
    """``threads`` threads, each ``appends`` appends of three messages (spread over partitions)."""
    for i in range(threads):
        for n in range(appends):
            await store.append(
                f"t{i}",
                [
                    es.MessageAppended(message=es.Message(role="user", content=f"{n}:{k}"))
                    for k in range(3)
                ],
            )


def sorted_rows(rows: Iterable[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Rows as tuples of all their columns, sorted (nulls, as a deletion's id, first)."""
    return sorted(
        (tuple(r.values()) for r in rows),
        key=lambda row: tuple((v is not None, v if v is not None else 0) for v in row),
    )


def parquet_rows(directory: Path) -> list[tuple[Any, ...]]:
    """Every exported row as a tuple of all its columns, sorted."""
    return sorted_rows(read_parquet_dir(directory))


def worker_pids() -> list[int]:
    """This process's export worker children (found by the bootstrap in their command line)."""
    me = str(os.getpid())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, IndexError):
            continue
        if ppid == me and b"_worker_main" in cmdline:
            found.append(int(entry))
    return found


@pytest.fixture
async def redis_store(redis_url: str, namespace: str) -> Any:
    store = await es.connect(redis_url, namespace=namespace, partitions=4)
    try:
        yield store
    finally:
        await store.close()


def settings_of(store: es.EventStore, url: str) -> es.StoreSettings:
    return es.StoreSettings.from_url(url, namespace=store.namespace)


@pytest.mark.parametrize("fmt", ["ndjson", "parquet"])
async def test_parallel_export_writes_exactly_the_rows_of_one_process(
    redis_store: es.EventStore, redis_url: str, tmp_path: Path, fmt: str
) -> None:
    store = redis_store
    for t in ("a", "b", "c", "d", "e"):
        await conversation(store, t, 3)
    one, many = tmp_path / "one", tmp_path / "many"
    single = Exporter(store, one, fmt=fmt, name="one", pause_gc=True)  # type: ignore[arg-type]
    parallel = Exporter(
        store, many, fmt=fmt, name="many", workers=3, settings=settings_of(store, redis_url),  # type: ignore[arg-type]
        batch=2, rows_per_part=10,
    )  # fmt: skip

    def rows(directory: Path) -> list[tuple[Any, ...]]:
        if fmt == "parquet":
            return parquet_rows(directory)
        return sorted_rows(ndjson_rows(directory))

    seen: list[int] = []
    first = await parallel.run(progress=seen.append)
    expected = await single.run()
    assert gc.isenabled()  # paused for the run only
    assert rows(many) == rows(one) and first.events == expected.events == len(rows(one))
    assert first.positions == expected.positions
    assert seen and seen[-1] == first.events  # progress sums every process's rows
    assert not list(many.glob(".part-*"))
    # Each sidecar names only the partitions its process exported, and the merge of all of
    # them is where the run ended.
    assert committed_positions(many)[1] == expected.positions
    assert (await parallel.run()).files == []  # nothing new, nothing written

    await conversation(store, "a", 2)
    await conversation(store, "f", 1)
    await store.delete_thread("b")
    second = await parallel.run()
    again = await single.run()
    assert second.tombstones == again.tombstones == 1
    assert second.events == again.events
    assert rows(many) == rows(one)
    exported = keyset([dict(zip(COLUMNS, r, strict=True)) for r in rows(many)])
    assert len(exported) == len(set(exported))  # no duplicates across runs and processes
    # Workers advanced their own partitions' consumer groups, so trimming waits for them too.
    for p in range(store.partitions):
        groups = {g.name: g.last_delivered for g in await store.feed_groups(p)}
        assert groups["export-many"] == groups["export-one"]


@pytest.mark.parametrize("workers", [1, 3])
async def test_parts_loaded_and_removed_leave_the_directory_able_to_continue(
    redis_store: es.EventStore, redis_url: str, tmp_path: Path, workers: int
) -> None:
    """A pipeline that loads the parts and removes them: after a parallel run (each sidecar
    names only its own process's partitions), or with the newest parts removed, the next run
    was refused ('the feed consumer group is ahead of the directory'). Each run records where
    it ended (``_positions.json``), which the parts' removal does not touch."""
    store = redis_store
    for t in ("a", "b", "c", "d", "e"):
        await conversation(store, t, 3)
    out, loaded = tmp_path / "out", tmp_path / "loaded"
    loaded.mkdir()
    exporter = Exporter(
        store, out, fmt="ndjson", workers=workers, settings=settings_of(store, redis_url),
        batch=2, rows_per_part=10,
    )  # fmt: skip
    first = await exporter.run()
    assert len(first.files) > 2 and (out / RUN_RECORD_FILE).exists()
    for part in sorted(out.glob("part-*"))[:-1] if workers == 1 else sorted(out.glob("part-*")):
        part.rename(loaded / part.name)  # loaded elsewhere, then removed
    await conversation(store, "a", 2)
    await conversation(store, "f", 1)
    second = await exporter.run()
    assert second.events == 3 * 2 + 3 * 1 and second.files
    # Every event exactly once across what was loaded and what is there now, and numbered on
    # after the removed parts (no name is used twice).
    rows = ndjson_rows(out) + ndjson_rows(loaded)
    assert sorted(keyset(rows)) == sorted(await log_rows(store))
    names = [p.name for p in [*out.glob("part-*"), *loaded.glob("part-*")]]
    assert len(names) == len(set(names))
    # A damaged record is refused by name, never guessed around.
    (out / RUN_RECORD_FILE).write_text("{not json")
    with pytest.raises(ExportSourceError, match=RUN_RECORD_FILE):
        await exporter.run()


async def test_a_run_ends_at_the_changes_there_when_it_started(
    redis_store: es.EventStore, redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """Writers that keep pace with an export do not keep it running: what they append during
    a run is the next run's, exported once."""
    store = redis_store
    for t in ("a", "b", "c", "d"):
        await conversation(store, t, 5)
    stop = threading.Event()
    appended: list[int] = []

    def writer() -> None:
        # Another process's worth of appends, from a thread with a store of its own, for at
        # most WRITER_S: the export would run until then if it read on until the feeds ran dry.
        async def main() -> None:
            async with await es.connect(redis_url, namespace=namespace) as other:
                threads = ThreadStore(other)
                deadline = time.monotonic() + WRITER_S
                while not stop.is_set() and time.monotonic() < deadline:
                    n = len(appended)
                    await threads.append_message(f"w{n % 8}", {"role": "user", "content": f"m{n}"})
                    appended.append(1)

        anyio.run(main)

    def slow_progress(rows: int) -> None:
        time.sleep(0.01)  # the export falls behind the writer (which runs meanwhile)

    thread = threading.Thread(target=writer)
    exporter = Exporter(store, tmp_path / "out", fmt="ndjson", batch=4)
    thread.start()
    try:
        with anyio.fail_after(10):
            while not appended:
                assert thread.is_alive(), "the writer failed"
                await anyio.sleep(0.01)
        with anyio.move_on_after(WRITER_S / 2) as waited:
            first = await exporter.run(progress=slow_progress)
        writer_still_running = thread.is_alive() and not stop.is_set()
    finally:
        stop.set()
        thread.join()
    assert not waited.cancelled_caught, "the run went on while the writer kept appending"
    assert writer_still_running, "the writer stopped first: the test proves nothing"
    assert first.events < len(await log_rows(store))  # it left the writer's later appends
    second = await exporter.run()
    rows = keyset(ndjson_rows(tmp_path / "out"))
    assert second.events > 0 and first.events + second.events == len(rows)
    assert len(set(rows)) == len(rows) and set(rows) == await log_rows(store)


WRITER_S = 20.0


async def test_a_killed_worker_is_reported_and_the_rerun_is_exact(
    redis_store: es.EventStore, redis_url: str, tmp_path: Path
) -> None:
    store = redis_store
    await fill_partitions(store, 40, 20)
    expected = await log_rows(store)
    exporter = Exporter(
        store, tmp_path, workers=2, settings=settings_of(store, redis_url), batch=5,
        rows_per_part=200,
    )  # fmt: skip

    async def kill_the_worker() -> None:
        while not (pids := worker_pids()):
            await anyio.sleep(0.001)
        os.kill(pids[0], signal.SIGKILL)

    async with anyio.create_task_group() as tg:
        tg.start_soon(kill_the_worker)
        with pytest.raises(ExportWorkerError, match="killed by SIGKILL"):
            await exporter.run()
    assert worker_pids() == []  # nothing left running
    result = await exporter.run()
    exported = keyset(list(read_parquet_dir(tmp_path)))
    assert len(exported) == len(set(exported)), "duplicates"
    assert set(exported) == expected, "holes"
    assert result.events <= len(expected)


async def test_a_worker_error_surfaces_as_its_own_type(
    redis_store: es.EventStore, redis_url: str, tmp_path: Path
) -> None:
    store = redis_store
    await fill_partitions(store, 8, 3)
    # The workers connect from the settings: here a port nothing listens on. This process's
    # own share succeeds; the worker's StoreConnectionError is raised here, as itself.
    nowhere = es.StoreSettings.from_url(
        f"redis://127.0.0.1:{free_port()}", namespace=store.namespace
    )
    exporter = Exporter(store, tmp_path, workers=2, settings=nowhere)
    with pytest.raises(es.StoreConnectionError) as caught:
        with anyio.fail_after(60):
            await exporter.run()
    assert any("export worker 1" in note for note in getattr(caught.value, "__notes__", []))
    assert not list(tmp_path.glob(".part-*")), "this process's open part was not discarded"
    assert worker_pids() == []
    await Exporter(store, tmp_path, workers=2, settings=settings_of(store, redis_url)).run()
    exported = keyset(list(read_parquet_dir(tmp_path)))
    assert len(exported) == len(set(exported)) and set(exported) == await log_rows(store)


async def test_a_hung_worker_is_stopped_within_the_timeout(
    redis_store: es.EventStore, redis_url: str, tmp_path: Path
) -> None:
    store = redis_store
    await fill_partitions(store, 40, 20)
    exporter = Exporter(
        store, tmp_path, workers=2, settings=settings_of(store, redis_url), batch=5,
        worker_timeout=2.0,
    )  # fmt: skip

    async def freeze_the_worker() -> None:
        while not (pids := worker_pids()):
            await anyio.sleep(0.001)
        os.kill(pids[0], signal.SIGSTOP)

    started = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(freeze_the_worker)
        with pytest.raises(ExportWorkerError, match="sent nothing for 2 s"):
            await exporter.run()
    assert time.monotonic() - started < 30
    assert worker_pids() == []


async def test_a_cancelled_run_stops_its_workers(
    redis_store: es.EventStore, redis_url: str, tmp_path: Path
) -> None:
    store = redis_store
    await fill_partitions(store, 40, 20)
    exporter = Exporter(
        store, tmp_path, workers=2, settings=settings_of(store, redis_url), batch=5,
        rows_per_part=100,
    )  # fmt: skip

    async def cancel_mid_run(scope: anyio.CancelScope) -> None:
        # The worker is started with the run, and this process commits a part every 100 rows
        # of the 2,400: cancel once both are under way (bounded, should the run end first).
        with anyio.fail_after(30):
            while not worker_pids() or not list(tmp_path.glob("part-*.parquet")):
                await anyio.sleep(0.001)
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel_mid_run, tg.cancel_scope)
        await exporter.run()
        pytest.fail("the run ended before it was cancelled")
    assert worker_pids() == []
    assert not list(tmp_path.glob(".part-*")), "an open part was left behind"
    await exporter.run()
    exported = keyset(list(read_parquet_dir(tmp_path)))
    assert len(exported) == len(set(exported)) and set(exported) == await log_rows(store)


async def test_one_run_at_a_time_per_directory(redis_store: es.EventStore, tmp_path: Path) -> None:
    import fcntl

    await conversation(redis_store, "t", 1)
    with open(tmp_path / ".export.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        with pytest.raises(ExportBusyError):
            await Exporter(redis_store, tmp_path).run()
    assert (await Exporter(redis_store, tmp_path).run()).events == 3


def test_parallel_export_settings_are_checked(tmp_path: Path) -> None:
    memory = es.MemoryEventStore(partitions=4)
    with pytest.raises(es.InvalidInputError, match="workers"):
        Exporter(memory, tmp_path, workers=0)
    with pytest.raises(es.InvalidInputError, match="settings"):
        Exporter(memory, tmp_path, workers=2)
    with pytest.raises(es.InvalidInputError, match="in-memory"):
        Exporter(memory, tmp_path, workers=2, settings=es.StoreSettings.from_url("memory://"))
    # More workers than partitions: one per partition, and one partition needs no worker.
    assert Exporter(es.MemoryEventStore(partitions=1), tmp_path, workers=8).workers == 1
    # "auto" never asks for what cannot work: an in-memory store, or no settings, is one process.
    assert Exporter(memory, tmp_path, workers="auto").workers == 1
    with pytest.raises(es.InvalidInputError, match="'auto'"):
        Exporter(memory, tmp_path, workers="many")  # type: ignore[arg-type]


async def test_auto_workers_start_only_for_a_large_backlog(
    redis_store: es.EventStore, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = redis_store
    await fill_partitions(store, 8, 3)
    settings = settings_of(store, redis_url)
    small = await Exporter(store, tmp_path / "small", workers="auto", settings=settings).run()
    assert small.workers == 1 and small.events == 72  # 72 events do not repay a worker
    monkeypatch.setattr("adapters._export.PARALLEL_MIN_EVENTS", 50)
    large = await Exporter(store, tmp_path / "large", workers="auto", settings=settings).run()
    assert large.workers == min(os.cpu_count() or 1, 3)
    assert parquet_rows(tmp_path / "large") == parquet_rows(tmp_path / "small")


def test_ulid_text_of_a_whole_column_matches_one_at_a_time() -> None:
    ids = [os.urandom(16) for _ in range(1000)] + [
        b"\x00" * 16,
        b"\xff" * 16,
        b"\x80" + b"\x00" * 15,
    ]
    assert _ulid_array(ids).to_pylist() == [_ulid_text(i) for i in ids]
    assert [_ulid_text(i) for i in ids[-3:-1]] == ["0" * 26, "7" + "Z" * 25]


async def _write_undecodable_entry(
    store: es.RedisEventStore, thread: str, seq: int, payload: bytes = b"\xc1not msgpack"
) -> None:
    """Written past every check, as the next entry of ``thread`` (at ``seq``): an entry whose
    payload does not decode (or is ``payload``), the version it takes, and a feed entry naming
    it."""
    client, keys = store.client, store.keys
    ((_, good),) = await store.read_raw(thread, start=1, stop=1)
    await client.xadd(keys.log(thread), {**good, b"d": payload}, id=f"{seq}-0")
    await client.hset(keys.meta(thread), "v", seq)
    life = await client.hget(keys.meta(thread), "n")
    feed = {"t": thread, "f": seq, "l": seq, "n": life}
    await client.xadd(keys.feed(keys.partition(thread)), feed)


@pytest.mark.parametrize("fmt", ["ndjson", "parquet"])
async def test_a_damaged_entry_stops_the_export_naming_thread_and_seq(
    redis_store: es.EventStore, tmp_path: Path, fmt: str
) -> None:
    """Damage in a later read of a long thread (reads hand the decoder ~PAGE events at a time)
    is reported as the log's readers report it, never skipped."""
    store = redis_store
    assert isinstance(store, es.RedisEventStore)
    damaged, total = PAGE + 150, PAGE + 300
    for lo in range(1, damaged, 100):
        await store.append("long", [msg(f"m{i}") for i in range(lo, min(lo + 100, damaged))])
    await _write_undecodable_entry(store, "long", damaged)
    for lo in range(damaged + 1, total + 1, 100):
        await store.append("long", [msg(f"m{i}") for i in range(lo, min(lo + 100, total + 1))])
    with pytest.raises(es.CorruptEventError) as info:
        await Exporter(store, tmp_path, fmt=fmt).run()  # type: ignore[arg-type]
    assert (info.value.thread_id, info.value.seq) == ("long", damaged)


@pytest.mark.parametrize("fmt", ["ndjson", "parquet"])
@pytest.mark.parametrize("typed", [None, 7], ids=["no-type", "type-not-text"])
async def test_a_payload_that_names_no_type_stops_the_export(
    redis_store: es.EventStore, tmp_path: Path, fmt: str, typed: int | None
) -> None:
    """Every read path calls an event without its type tag damage; the export wrote it as a
    row of type null."""
    store = redis_store
    assert isinstance(store, es.RedisEventStore)
    await store.append("t", [msg("a"), msg("b")])
    payload = {"message": {"role": "user", "content": "c"}}
    if typed is not None:
        payload["type"] = typed  # type: ignore[assignment]
    await _write_undecodable_entry(store, "t", 3, msgspec.msgpack.encode(payload))
    with pytest.raises(es.CorruptEventError) as read:
        await read_all(store, "t")
    assert read.value.seq == 3
    with pytest.raises(es.CorruptEventError, match="names no event type") as info:
        await Exporter(store, tmp_path, fmt=fmt).run()  # type: ignore[arg-type]
    assert (info.value.thread_id, info.value.seq) == ("t", 3)
    assert not list(tmp_path.glob("part-*"))


@pytest.mark.parametrize("removed", [5, 20], ids=["mid-log", "last"])
async def test_an_entry_removed_from_the_log_stops_the_export(
    redis_store: es.EventStore, tmp_path: Path, removed: int
) -> None:
    """An XDEL'd event (mid-log, or the thread's last) is named, not left out of the export:
    the feed says the thread's life holds every seq it covers."""
    store = redis_store
    assert isinstance(store, es.RedisEventStore)
    for lo in range(1, 21, 5):
        await store.append("holed", [msg(f"m{i}") for i in range(lo, lo + 5)])
    await store.append("whole", [msg("fine")])
    assert await store.client.xdel(store.keys.log("holed"), f"{removed}-0") == 1
    with pytest.raises(es.CorruptEventError) as info:
        await Exporter(store, tmp_path, fmt="ndjson").run()
    assert (info.value.thread_id, info.value.seq) == ("holed", removed)
    assert "missing from the log" in str(info.value)


@pytest.mark.parametrize(
    "damage", ["xdel-new-events", "del-log", "hdel-incarnation", "other-incarnation"]
)
async def test_a_change_whose_events_left_the_log_without_a_deletion_stops_the_export(
    redis_store: es.EventStore, tmp_path: Path, damage: str
) -> None:
    """A page of a change that reads as nothing is skipped only for a recorded deletion: a
    log or meta damaged so that the thread seems to have left the change's life is named,
    the positions stay where they were, and a second run says the same (never "nothing new")."""
    store = redis_store
    assert isinstance(store, es.RedisEventStore)
    client, keys = store.client, store.keys
    await store.append("t", [msg(f"m{i}") for i in range(3)])
    await store.append("other", [msg("fine")])
    assert (await Exporter(store, tmp_path, fmt="ndjson").run()).events == 4
    await store.append("t", [msg(f"n{i}") for i in range(3)])  # seqs 4-6: not exported yet
    log, meta = keys.log("t"), keys.meta("t")
    if damage == "xdel-new-events":
        assert await client.xdel(log, "4-0", "5-0", "6-0") == 3
    elif damage == "del-log":
        assert await client.delete(log) == 1
    elif damage == "hdel-incarnation":
        assert await client.hdel(meta, "n") == 1
    else:
        await client.hset(meta, "n", 12345)
    for _ in range(2):
        with pytest.raises(es.CorruptEventError) as info:
            await Exporter(store, tmp_path, fmt="ndjson").run()
        assert info.value.thread_id == "t"
        assert "run 'verify'" in str(info.value)
    assert len(ndjson_rows(tmp_path)) == 4  # nothing of the damaged change was committed


async def test_read_change_names_a_change_whose_events_left_the_log(
    redis_store: es.EventStore,
) -> None:
    """What async projections read (`ProjectionRunner`): the same damage, the same error."""
    store = redis_store
    assert isinstance(store, es.RedisEventStore)
    await store.append("t", [msg("a"), msg("b")])
    (entry,) = await store.read_feed(store.keys.partition("t"))
    assert [e.seq for e in await store.read_change(entry)] == [1, 2]
    await store.client.xdel(store.keys.log("t"), "1-0", "2-0")
    with pytest.raises(es.CorruptEventError, match="missing from the log") as info:
        await store.read_change(entry)
    assert (info.value.thread_id, info.value.seq) == ("t", 1)
    await store.delete_thread("t")  # a deletion: the change is history, read as nothing
    assert await store.read_change(entry) == []


async def test_a_thread_deleted_and_created_again_exports_both_lives(
    redis_store: es.EventStore, tmp_path: Path
) -> None:
    """The legitimate case the check above must keep: a change of a life since deleted."""
    store = redis_store
    await store.append("t", [msg("first life")])
    await store.delete_thread("t")
    await store.append("t", [msg("second life")])
    result = await Exporter(store, tmp_path, fmt="ndjson").run()
    rows = ndjson_rows(tmp_path)
    assert [(r["type"], r["seq"]) for r in rows] == [
        ("thread.deleted", 1),
        ("message.appended", 1),
    ]
    assert result.events == 1 and result.tombstones == 1


def export_rows(directory: Path, fmt: str) -> list[dict[str, Any]]:
    return ndjson_rows(directory) if fmt == "ndjson" else list(read_parquet_dir(directory))


@pytest.mark.parametrize("fmt", ["ndjson", "parquet"])
async def test_rows_name_the_life_of_their_thread(
    store: es.EventStore, tmp_path: Path, fmt: str
) -> None:
    """A thread deleted and written again starts at seq 1 again: (thread, seq) names two
    events, (thread, incarnation, seq) one. The deletion row names the life it ended."""
    await store.append("t", [msg("first 1"), msg("first 2")])
    first_life = await store.incarnation("t")
    exporter = Exporter(store, tmp_path, fmt=fmt)  # type: ignore[arg-type]
    await exporter.run()
    await store.delete_thread("t")
    await store.append("t", [msg("second 1")])
    second_life = await store.incarnation("t")
    assert first_life is not None and second_life is not None and first_life != second_life
    await exporter.run()
    rows = export_rows(tmp_path, fmt)
    assert [(r["type"], r["incarnation"], r["seq"]) for r in rows] == [
        ("message.appended", first_life, 1),
        ("message.appended", first_life, 2),
        ("thread.deleted", first_life, 2),
        ("message.appended", second_life, 1),
    ]
    assert all(list(r) == list(COLUMNS) for r in rows)
    if fmt == "parquet":
        assert str(pq.read_table(tmp_path).schema.field("incarnation").type) == "int64"


@pytest.mark.parametrize("fmt", ["ndjson", "parquet"])
async def test_a_directory_from_before_the_incarnation_column_keeps_its_columns(
    store: es.EventStore, tmp_path: Path, fmt: str
) -> None:
    """Its parts stay one table: a run into it writes the columns its record names (none
    recorded: those before the incarnation column); a new directory gets every column."""
    await conversation(store, "t", 1)
    await Exporter(store, tmp_path, fmt=fmt).run()  # type: ignore[arg-type]
    # As the previous release left it: parts without the column, a record naming none.
    source = json.loads((tmp_path / SOURCE_FILE).read_text())
    assert source["columns"] == list(COLUMNS)
    del source["columns"]
    (tmp_path / SOURCE_FILE).write_text(json.dumps(source))
    (part,) = tmp_path.glob(f"part-*.{fmt}")
    if fmt == "ndjson":
        old = [{k: v for k, v in r.items() if k != "incarnation"} for r in ndjson_rows(tmp_path)]
        part.write_text("".join(json.dumps(r) + "\n" for r in old))
    else:
        pq.write_table(pq.read_table(part).drop_columns(["incarnation"]), part)
    await conversation(store, "u", 1)
    assert (await Exporter(store, tmp_path, fmt=fmt).run()).events == 3  # type: ignore[arg-type]
    legacy = [c for c in COLUMNS if c != "incarnation"]
    if fmt == "ndjson":
        assert all(list(r) == legacy for r in ndjson_rows(tmp_path))
    else:
        assert pq.read_table(tmp_path).schema.names == legacy  # one table
    assert sorted(keyset(export_rows(tmp_path, fmt))) == sorted(await log_rows(store))
    assert "columns" not in json.loads((tmp_path / SOURCE_FILE).read_text())

    # A record lost from a directory with the column: its parts say which columns it has.
    fresh = tmp_path / "fresh"
    await Exporter(store, fresh, fmt=fmt).run()  # type: ignore[arg-type]
    (fresh / SOURCE_FILE).unlink()
    await conversation(store, "v", 1)
    await Exporter(store, fresh, fmt=fmt).run()  # type: ignore[arg-type]
    assert len(list(fresh.glob(f"part-*.{fmt}"))) == 2
    assert all(list(r) == list(COLUMNS) for r in export_rows(fresh, fmt))
    assert json.loads((fresh / SOURCE_FILE).read_text())["columns"] == list(COLUMNS)


async def test_workers_write_an_older_directorys_columns(
    redis_store: es.EventStore, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = redis_store
    jobs: list[_WorkerJob] = []
    start = _Child.start.__func__  # type: ignore[attr-defined]

    def recorded(cls: type[_Child], job: _WorkerJob) -> _Child:
        jobs.append(job)
        return start(cls, job)  # type: ignore[no-any-return]

    monkeypatch.setattr(_Child, "start", classmethod(recorded))
    await conversation(store, "t", 1)
    await Exporter(store, tmp_path).run()
    source = json.loads((tmp_path / SOURCE_FILE).read_text())
    del source["columns"]  # as the previous release left it
    (tmp_path / SOURCE_FILE).write_text(json.dumps(source))
    (part,) = tmp_path.glob("part-*.parquet")
    pq.write_table(pq.read_table(part).drop_columns(["incarnation"]), part)
    for p in range(store.partitions):
        await conversation(store, thread_in_partition(store, p), 1)
    parallel = Exporter(store, tmp_path, workers=2, settings=settings_of(store, redis_url))
    result = await parallel.run()
    legacy = tuple(c for c in COLUMNS if c != "incarnation")
    # (Whether the worker gets a partition before the parent has done them all is a race.)
    assert [job.columns for job in jobs] == [legacy] and result.events == 3 * store.partitions
    assert pq.read_table(tmp_path).schema.names == list(legacy)
    assert sorted(keyset(list(read_parquet_dir(tmp_path)))) == sorted(await log_rows(store))


async def test_a_record_naming_columns_this_release_does_not_write_is_refused(
    store: es.EventStore, tmp_path: Path
) -> None:
    await conversation(store, "t", 1)
    await Exporter(store, tmp_path, fmt="ndjson").run()
    source = json.loads((tmp_path / SOURCE_FILE).read_text())
    source["columns"] = [*COLUMNS, "cost_usd"]  # a newer release's, say
    (tmp_path / SOURCE_FILE).write_text(json.dumps(source))
    before = sorted(p.name for p in tmp_path.iterdir())
    await conversation(store, "t", 1)
    with pytest.raises(ExportSourceError, match=r"records columns this threadlog does not write"):
        await Exporter(store, tmp_path, fmt="ndjson").run()
    assert sorted(p.name for p in tmp_path.iterdir()) == before


async def test_parquet_compression_is_chosen_and_checked(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    store = es.MemoryEventStore()
    await store.append("t", [msg("x")])
    for codec, expected in ((None, "SNAPPY"), ("zstd", "ZSTD"), ("none", "UNCOMPRESSED")):
        out = tmp_path / str(codec)
        extra: dict[str, Any] = {} if codec is None else {"compression": codec}
        await Exporter(store, out, **extra).run()
        (part,) = out.glob("part-*.parquet")
        column = pq.ParquetFile(part).metadata.row_group(0).column(0)
        assert column.compression == expected
    with pytest.raises(es.InvalidInputError, match="unknown Parquet compression"):
        Exporter(store, tmp_path / "bad", compression="gzip")  # type: ignore[arg-type]


# -- one source per directory -------------------------------------------------------------------


async def test_a_directory_holds_one_namespace_of_one_data_set(
    redis_url: str, tmp_path: Path
) -> None:
    first, second = ("x" + uuid.uuid4().hex[:12] for _ in range(2))
    a = await es.connect(redis_url, namespace=first, partitions=4)
    b = await es.connect(redis_url, namespace=second, partitions=4)
    try:
        await conversation(a, "t", 3)
        # b's events are older than a's last position: resumed from a's positions, they were
        # skipped ("nothing new").
        await conversation(b, "u", 1)
        await conversation(a, "t", 1)
        assert (await Exporter(a, tmp_path, fmt="ndjson").run()).events == 12
        source = json.loads((tmp_path / SOURCE_FILE).read_text())
        assert source["namespace"] == first and source["store"] == await a.namespace_id()
        with pytest.raises(ExportSourceError) as refused:
            await Exporter(b, tmp_path, fmt="ndjson").run()
        assert repr(first) in str(refused.value) and repr(second) in str(refused.value)
        assert (await Exporter(b, tmp_path / "b", fmt="ndjson").run()).events == 3
        assert (await Exporter(a, tmp_path, fmt="ndjson").run()).files == []  # still a's
        # The data set's id gone (as after FLUSHALL, or on another server): a new one is made,
        # and the directory's positions no longer apply.
        await a.client.hdel(KeyLayout.config_key(first), "id")  # type: ignore[attr-defined]
        with pytest.raises(ExportSourceError, match="flushed or replaced"):
            await Exporter(a, tmp_path, fmt="ndjson").run()
        assert len(ndjson_rows(tmp_path)) == 12  # nothing written by the refused runs
    finally:
        await a.close()
        await b.close()


async def test_a_directory_keeps_its_export_name(store: es.EventStore, tmp_path: Path) -> None:
    await conversation(store, "t", 1)
    await Exporter(store, tmp_path, fmt="ndjson", name="daily").run()
    with pytest.raises(ExportSourceError, match="--name daily"):
        await Exporter(store, tmp_path, fmt="ndjson", name="weekly").run()
    await conversation(store, "t", 1)
    # With no name given, the directory's own (recorded) name is used.
    default = Exporter(store, tmp_path, fmt="ndjson")
    assert (await default.run()).events == 3
    assert default.name == "daily"


async def test_two_directories_under_one_export_name_are_refused(
    store: es.EventStore, tmp_path: Path
) -> None:
    await conversation(store, "t", 1)
    one, two = tmp_path / "one", tmp_path / "two"
    assert (await Exporter(store, one, fmt="ndjson", name="shared").run()).events == 3
    await conversation(store, "u", 1)
    # A new directory takes the group over (an abandoned directory's would hold it back)...
    assert (await Exporter(store, two, fmt="ndjson", name="shared").run()).events == 6
    await conversation(store, "t", 1)
    # ... and the first one finds the group ahead of its positions: the two share it.
    with pytest.raises(ExportSourceError, match="another export directory uses") as refused:
        await Exporter(store, one, fmt="ndjson", name="shared").run()
    assert "export into a new directory, without --name" in str(refused.value)
    assert (await Exporter(store, two, fmt="ndjson", name="shared").run()).events == 3
    # The remedy the message gives works: a new directory, no name.
    assert (await Exporter(store, tmp_path / "three", fmt="ndjson").run()).events == 9


async def test_directories_under_the_default_name_each_have_their_own(
    store: es.EventStore, tmp_path: Path
) -> None:
    await conversation(store, "t", 1)
    one, two = tmp_path / "one", tmp_path / "two"
    assert (await Exporter(store, one, fmt="ndjson").run()).events == 3
    assert (await Exporter(store, two, fmt="ndjson").run()).events == 3
    names = {json.loads((d / SOURCE_FILE).read_text())["name"] for d in (one, two)}
    assert len(names) == 2 and all(n.startswith(("one-", "two-")) for n in names)
    for _ in range(2):  # both continue incrementally, in either order
        await conversation(store, "u", 1)
        assert (await Exporter(store, two, fmt="ndjson").run()).events == 3
        assert (await Exporter(store, one, fmt="ndjson").run()).events == 3
        assert (await Exporter(store, one, fmt="ndjson").run()).files == []
    assert sorted(keyset(ndjson_rows(one))) == sorted(keyset(ndjson_rows(two)))
    # A directory moved elsewhere keeps its name (recorded), so its group too.
    moved = tmp_path / "moved"
    one.rename(moved)
    await conversation(store, "t", 1)
    assert (await Exporter(store, moved, fmt="ndjson").run()).events == 3
    assert json.loads((moved / SOURCE_FILE).read_text())["name"] in names
    # An older directory, recorded under the old default name, keeps it.
    legacy = tmp_path / "legacy"
    await Exporter(store, legacy, fmt="ndjson", name="export").run()
    again = Exporter(store, legacy, fmt="ndjson")
    await again.run()
    assert again.name == "export"


async def test_a_run_that_exports_nothing_leaves_no_source(tmp_path: Path) -> None:
    # memory:// is a new, empty data set in every process: a record of one must not bind.
    empty = es.MemoryEventStore(partitions=4)
    nothing = await Exporter(empty, tmp_path, fmt="ndjson").run()
    assert nothing.files == [] and not (tmp_path / SOURCE_FILE).exists()
    full = es.MemoryEventStore(partitions=4)
    await conversation(full, "t", 1)
    assert (await Exporter(full, tmp_path, fmt="ndjson").run()).events == 3
    # A directory an earlier version left with a record but no part is not bound by it.
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / SOURCE_FILE).write_text(
        json.dumps({"namespace": "other", "store": es.new_ulid(), "name": "export"})
    )
    assert (await Exporter(full, stale, fmt="ndjson").run()).events == 3
    assert json.loads((stale / SOURCE_FILE).read_text())["namespace"] == full.namespace


async def test_an_older_directory_without_a_source_record(
    store: es.EventStore, tmp_path: Path
) -> None:
    other = es.MemoryEventStore(namespace="someone-else", partitions=store.partitions)
    await conversation(store, "t", 2)
    await Exporter(store, tmp_path, fmt="ndjson").run()
    (tmp_path / SOURCE_FILE).unlink()  # as a directory exported before sources were recorded
    await conversation(store, "t", 1)
    assert (await Exporter(store, tmp_path, fmt="ndjson").run()).events == 3  # adopted
    assert json.loads((tmp_path / SOURCE_FILE).read_text())["namespace"] == store.namespace
    (tmp_path / SOURCE_FILE).unlink()
    await conversation(other, "t", 1)
    with pytest.raises(ExportSourceError, match="holds an export of namespace"):
        await Exporter(other, tmp_path, fmt="ndjson").run()  # its rows name their namespace

    # Positions the feed contradicts (entries before them, none at them): another feed's.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    feeds = [await store.read_feed(p) for p in range(store.partitions)]
    entry = next(feed[-1] for feed in feeds if feed)
    ms, n = entry.id.split("-")  # just past the partition's last entry
    (legacy / "part-00000001.ndjson").write_text("")
    (legacy / "part-00000001.positions.json").write_text(
        json.dumps({str(entry.partition): f"{ms}-{int(n) + 1}"})
    )
    with pytest.raises(ExportSourceError, match="does not hold"):
        await Exporter(store, legacy, fmt="ndjson").run()


async def test_since_starts_a_new_directory_only(store: es.EventStore, tmp_path: Path) -> None:
    await conversation(store, "t", 2)
    future = datetime(2099, 1, 1, tzinfo=UTC)
    # Nothing since then: no part, no position; the directory stays new...
    nothing = await Exporter(store, tmp_path, fmt="ndjson").run(since=future)
    assert (nothing.files, nothing.events, nothing.positions) == ([], 0, {})
    assert committed_positions(tmp_path) == (0, {})
    group = f"export-{directory_export_name(tmp_path)}"
    for p in range(store.partitions):  # and no group of it is left to hold trimming back
        assert group not in {g.name for g in await store.feed_groups(p)}
    assert not (tmp_path / SOURCE_FILE).exists()
    # ... so a later run without since exports everything before.
    assert (await Exporter(store, tmp_path, fmt="ndjson").run()).events == 6
    # On a directory with positions, since would skip events for good: refused.
    await conversation(store, "t", 1)
    with pytest.raises(es.InvalidInputError, match="only starts a new export directory"):
        await Exporter(store, tmp_path, fmt="ndjson").run(since=datetime(2000, 1, 1, tzinfo=UTC))
    assert (await Exporter(store, tmp_path, fmt="ndjson").run()).events == 3
    # A since run that finds events keeps them (and from then on continues without since).
    recent = await Exporter(store, tmp_path / "recent", fmt="ndjson").run(
        since=datetime(2000, 1, 1, tzinfo=UTC)
    )
    assert recent.events == 9


async def test_explicit_workers_start_no_more_processes_than_partitions_with_changes(
    redis_store: es.EventStore, redis_url: str, tmp_path: Path
) -> None:
    store = redis_store
    await conversation(store, "t", 2)  # one thread: one partition with changes
    settings = settings_of(store, redis_url)
    result = await Exporter(store, tmp_path, workers=100, settings=settings).run()
    assert (result.workers, result.busy_partitions, result.events) == (1, 1, 6)
    assert worker_pids() == []
    await fill_partitions(store, 8, 1)
    again = await Exporter(store, tmp_path, workers=100, settings=settings).run()
    assert again.busy_partitions == again.workers > 1
    assert again.events == 24


async def test_a_feed_trimmed_past_the_directory_stops_the_export(
    store: es.EventStore, tmp_path: Path
) -> None:
    await conversation(store, "t", 2)
    exporter = Exporter(store, tmp_path / "a", fmt="ndjson")
    await exporter.run()
    await conversation(store, "t", 1)
    await anyio.sleep(0.01)
    # By age, the trim takes changes the export has not read: continuing would leave a hole.
    assert sum([await store.trim_feed(p, max_age_ms=0) for p in range(store.partitions)]) > 0
    before = sorted(p.name for p in (tmp_path / "a").iterdir())
    with pytest.raises(ExportSourceError, match="cannot continue without a hole"):
        await exporter.run()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == before  # nothing written
    # A new directory would lack everything before the trim: refused too, unless it asks only
    # for what follows the trim.
    with pytest.raises(ExportSourceError, match="lack every change before"):
        await Exporter(store, tmp_path / "b", fmt="ndjson").run()
    await anyio.sleep(0.01)
    since = datetime.now(UTC)
    await conversation(store, "u", 1)
    result = await Exporter(store, tmp_path / "c", fmt="ndjson").run(since=since)
    assert result.events > 0
    assert {row["thread"] for row in ndjson_rows(tmp_path / "c")} == {"u"}


async def test_a_feed_trimmed_by_age_while_a_run_reads_it_stops_the_run(
    store: es.EventStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trim by age landing after the run read its first page of a partition, past what it
    had read: the run went on from what the feed still held, committed past the hole, and
    every later run passed its start check. Each page after the first now asks the feed, in
    the same atomic step as the read, whether it was trimmed past the run's position."""
    thread = "t"
    p = es.partition_of(thread, store.partitions)
    for i in range(12):
        await store.append(thread, [msg(f"m{i}")])
    await anyio.sleep(0.01)
    read_feed = type(store).read_feed
    pages = 0

    async def trimmed_after_the_first_page(self: Any, partition: int, **kw: Any) -> Any:
        nonlocal pages
        entries = await read_feed(self, partition, **kw)
        if partition == p:
            pages += 1
            if pages == 1:  # everything older than now goes, read or not
                assert await self.trim_feed(partition, max_age_ms=0) == 12
        return entries

    monkeypatch.setattr(type(store), "read_feed", trimmed_after_the_first_page)
    out = tmp_path / "out"
    with pytest.raises(ExportSourceError, match=r"trimmed .* while this export read it"):
        await Exporter(store, out, fmt="ndjson", batch=4).run()
    monkeypatch.setattr(type(store), "read_feed", read_feed)
    # Refused again (the run failed before committing a position: as a new directory).
    with pytest.raises(ExportSourceError, match="was trimmed"):
        await Exporter(store, out, fmt="ndjson", batch=4).run()


@pytest.mark.parametrize("since", [False, True], ids=["new", "new-since"])
async def test_a_trim_by_age_between_the_start_check_and_the_first_read_stops_the_run(
    store: es.EventStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, since: bool
) -> None:
    """A trim by age landing after a new directory's start check, before its first page (while
    its groups are being made): the first page read from what the feed still held, and the
    directory began with a silent hole. Every page, the first too, now checks the trim record
    against where it reads from (the start, or the trim the check accepted)."""
    thread = "t"
    p = es.partition_of(thread, store.partitions)
    if since:  # a trim older than the directory's start is accepted, and read past
        await store.append(thread, [msg("old")])
        await anyio.sleep(0.01)
        assert await store.trim_feed(p, max_age_ms=0) == 1
        await anyio.sleep(0.01)
    started = datetime.now(UTC)
    for i in range(6):
        await store.append(thread, [msg(f"m{i}")])
    await anyio.sleep(0.01)
    check = Exporter._check_not_trimmed

    async def trimmed_after_the_check(self: Exporter, *args: Any) -> Any:
        floors = await check(self, *args)
        assert await self.store.trim_feed(p, max_age_ms=0) == 6
        return floors

    monkeypatch.setattr(Exporter, "_check_not_trimmed", trimmed_after_the_check)
    out = tmp_path / "out"
    with pytest.raises(ExportSourceError, match=r"trimmed .* while this export read it"):
        await Exporter(store, out, fmt="ndjson").run(since=started if since else None)
    assert not list(out.glob("part-*"))


async def test_a_directory_with_positions_on_a_trimmed_feed_is_told_to_start_a_new_one(
    store: es.EventStore, tmp_path: Path
) -> None:
    """The refusal told a directory that has positions to pass --since, which it then refused
    on that directory (--since starts a new one only): a dead end."""
    first, other = "t", thread_in_partition(store, 1)
    assert es.partition_of(first, store.partitions) != 1
    await store.append(first, [msg("a")])
    exporter = Exporter(store, tmp_path, fmt="ndjson")
    assert (await exporter.run()).events == 1
    for p in range(store.partitions):  # its group gone: nothing holds the feeds' trimming back
        await store.delete_feed_group(p, exporter.group)
    await store.append(other, [msg("b")])
    await anyio.sleep(0.01)
    assert await store.trim_feed(1, max_age_ms=0) == 1
    with pytest.raises(ExportSourceError, match="export into a new directory with --since"):
        await Exporter(store, tmp_path, fmt="ndjson").run()
    since = datetime.now(UTC)
    with pytest.raises(es.InvalidInputError, match="only starts a new export directory"):
        await Exporter(store, tmp_path, fmt="ndjson").run(since=since)
    assert (await Exporter(store, tmp_path / "new", fmt="ndjson").run(since=since)).events == 0


async def test_a_new_directory_that_commits_nothing_puts_the_group_back(
    store: es.EventStore, tmp_path: Path
) -> None:
    """A new directory takes over the group of a removed one of the same name; a run that
    commits nothing there (nothing since --since, or refused) leaves it where it stood."""
    await conversation(store, "t", 2)
    first = await Exporter(store, tmp_path / "a", fmt="ndjson", name="n").run()

    async def group() -> dict[int, str]:
        found: dict[int, str] = {}
        for p in range(store.partitions):
            groups = await store.feed_groups(p)
            found.update((p, g.last_delivered) for g in groups if g.name == "export-n")
        return found

    before = await group()
    assert first.positions.items() <= before.items()
    future = datetime(2099, 1, 1, tzinfo=UTC)
    nothing = await Exporter(store, tmp_path / "b", fmt="ndjson", name="n").run(since=future)
    assert nothing.files == [] and await group() == before
    assert not (tmp_path / "b" / SOURCE_FILE).exists()


class GroupReadsStore(es.RedisEventStore):
    """A real Redis store that counts its consumer group reads (``feed_groups``) per partition."""

    group_reads: dict[int, int]

    async def feed_groups(self, partition: int) -> list[es.GroupInfo]:
        self.group_reads[partition] = self.group_reads.get(partition, 0) + 1
        return await super().feed_groups(partition)


async def test_a_run_reads_each_partitions_consumer_groups_once(
    redis_store: es.EventStore, tmp_path: Path
) -> None:
    """The checks at a run's start need where the export's group stands: one read of the
    groups per partition (XINFO GROUPS and an XPENDING per group), shared by every check."""
    assert isinstance(redis_store, es.RedisEventStore)
    store = GroupReadsStore(
        redis_store.client, namespace=redis_store.namespace, partitions=redis_store.partitions
    )
    store.group_reads = {}
    try:
        await conversation(store, "t", 1)  # changes in one partition: the others have none
        exporter = Exporter(store, tmp_path, fmt="ndjson")
        await exporter.run()
        assert len(committed_positions(tmp_path)[1]) == 1
        assert all(n == 1 for n in store.group_reads.values()), store.group_reads
        await conversation(store, "t", 1)
        store.group_reads = {}
        assert (await exporter.run()).events > 0
        assert store.group_reads == dict.fromkeys(range(store.partitions), 1)
    finally:
        await store.close()  # its client is the fixture's: closed there


# -- the derived columns keep their types ------------------------------------------------------


class _Scored(es.Event, tag="test_export.scored", frozen=True):
    """An application's event whose field names are those the export derives columns from,
    with values of other types (a score, a tier number, usage counted in fractions)."""

    outcome: Any = None
    model_tier: Any = None
    usage: Any = None
    turn_id: Any = None
    parent_turn_id: Any = None


@pytest.mark.parametrize("fmt", ["ndjson", "parquet"])
async def test_a_payload_json_cannot_hold_stops_the_export_naming_its_event(
    redis_store: es.EventStore, tmp_path: Path, fmt: str
) -> None:
    """An application's event holding a non-string key (msgpack stores it, JSON cannot):
    the export crashed with a TypeError (exit 3) on it, every run. It stops with
    `CorruptEventError` naming thread and seq, and writes nothing. (The append refuses such
    an event now; one stored before it did is put in place here.)"""
    if "test_export.scored" not in es.registry:
        es.registry.register(_Scored)
    with pytest.raises(es.EventValidationError, match="JSON cannot hold"):
        await redis_store.append("t", [_Scored(outcome={True: 1})])
    await redis_store.append("t", [_Scored(outcome="fine"), _Scored(outcome="later")])
    assert isinstance(redis_store, es.RedisEventStore)
    log = redis_store.keys.log("t")
    entries = await redis_store.client.xrange(log)
    entries[1][1][b"d"] = msgspec.msgpack.encode(_Scored(outcome={True: 1}))
    await redis_store.client.delete(log)
    for entry_id, fields in entries:  # the stream rewritten: ids and other fields kept
        await redis_store.client.xadd(log, fields, id=entry_id)
    with pytest.raises(es.CorruptEventError, match="holds what JSON cannot") as info:
        await Exporter(redis_store, tmp_path / "out", fmt=fmt).run()  # type: ignore[arg-type]
    assert (info.value.thread_id, info.value.seq) == ("t", 2)
    assert not list((tmp_path / "out").glob("part-*"))


@pytest.mark.parametrize("fmt", ["ndjson", "parquet"])
async def test_derived_columns_keep_their_types_whatever_an_event_holds(
    redis_store: es.EventStore, tmp_path: Path, fmt: str
) -> None:
    if "test_export.scored" not in es.registry:
        es.registry.register(_Scored)
    odd = [
        _Scored(
            outcome={"ok": True}, model_tier=3, turn_id=7, parent_turn_id=["x"],
            usage={"input_tokens": 1.5, "output_tokens": "12"},
        ),
        _Scored(outcome=True, usage={"input_tokens": True, "output_tokens": 2**64 - 1}),
        _Scored(usage=[1, 2]),
        _Scored(outcome="won", model_tier="large", usage={"input_tokens": 4, "output_tokens": 5}),
    ]  # fmt: skip
    turn = "01J00000000000000000000000"  # the events' metadata names it
    await redis_store.append("t", [es.NewEvent(payload=e, turn_id=turn) for e in odd])
    result = await Exporter(redis_store, tmp_path, fmt=fmt).run()  # type: ignore[arg-type]
    assert result.events == 4
    rows = ndjson_rows(tmp_path) if fmt == "ndjson" else list(read_parquet_dir(tmp_path))
    # A value of another type stays in the payload only: a column never holds a number
    # where its schema says text (Parquet refused the whole run: the directory was stuck),
    # nor (NDJSON) text, a map or a fraction where it says a whole number.
    derived = [
        (r["outcome"], r["model_tier"], r["turn"], r["parent_turn"], r["input_tokens"],
         r["output_tokens"])
        for r in rows
    ]  # fmt: skip
    assert derived == [
        (None, None, turn, None, None, None),
        (None, None, turn, None, None, None),
        (None, None, turn, None, None, None),
        ("won", "large", turn, None, 4, 5),
    ]
    assert json.loads(rows[0]["payload"])["usage"] == {"input_tokens": 1.5, "output_tokens": "12"}


@pytest.mark.parametrize("fmt", ["ndjson", "parquet"])
async def test_a_turn_records_token_counts_of_zero_are_exported_as_zero(
    redis_store: es.EventStore, tmp_path: Path, fmt: str
) -> None:
    def settled(turn: str, usage: es.Usage) -> es.TurnSettled:
        return es.TurnSettled(turn_id=turn, outcome="completed", usage=usage)

    # The log stores a count left at its default (0) as no field at all.
    await redis_store.append(
        "t",
        [
            settled("01J00000000000000000000001", es.Usage(input_tokens=10, output_tokens=0)),
            settled("01J00000000000000000000002", es.Usage()),  # refused before the model
            settled("01J00000000000000000000003", es.Usage(input_tokens=0, output_tokens=3)),
            es.MessageAppended(message=es.Message(role="user", content="no turn record")),
        ],
    )
    await Exporter(redis_store, tmp_path, fmt=fmt).run()  # type: ignore[arg-type]
    rows = ndjson_rows(tmp_path) if fmt == "ndjson" else list(read_parquet_dir(tmp_path))
    # A turn record says how many tokens the turn used, none included: 0, not unknown (null
    # fell out of avg() and count(), and "= 0" found none of the refused turns).
    assert [(r["input_tokens"], r["output_tokens"]) for r in rows] == [
        (10, 0), (0, 0), (0, 3), (None, None),
    ]  # fmt: skip


async def test_since_holds_for_the_runs_that_finish_an_interrupted_one(
    redis_store: es.EventStore, tmp_path: Path
) -> None:

    early, late = thread_in_partition(redis_store, 0), thread_in_partition(redis_store, 3)
    await redis_store.append(late, [msg("before")])
    await anyio.sleep(0.01)
    since = datetime.now(UTC)
    await anyio.sleep(0.01)
    await redis_store.append(early, [msg("after")])

    class Crash(Exception):
        pass

    calls = []

    def crash_on_the_second_chunk(rows: int) -> None:
        calls.append(rows)
        if len(calls) == 2:
            raise Crash

    # Partition 0's chunk commits a part; the run stops at partition 3's, before its position.
    exporter = Exporter(redis_store, tmp_path, fmt="ndjson", rows_per_part=1)
    with pytest.raises(Crash):
        await exporter.run(since=since, progress=crash_on_the_second_chunk)
    assert [r["thread"] for r in ndjson_rows(tmp_path)] == [early]
    # The rerun (since is refused now: the directory has positions) finishes partition 3
    # from its start, and the events there from before the time stay out of the directory.
    await Exporter(redis_store, tmp_path, fmt="ndjson").run()
    contents = [json.loads(r["payload"])["message"]["content"] for r in ndjson_rows(tmp_path)]
    assert contents == ["after"]
    await redis_store.append(late, [msg("later")])
    await Exporter(redis_store, tmp_path, fmt="ndjson").run()
    contents = [json.loads(r["payload"])["message"]["content"] for r in ndjson_rows(tmp_path)]
    assert contents == ["after", "later"]


async def test_a_run_that_commits_nothing_leaves_no_directory_it_made(
    redis_store: es.EventStore, tmp_path: Path
) -> None:
    await conversation(redis_store, "t", 1)
    future = datetime(2099, 1, 1, tzinfo=UTC)
    # Nothing since the time: the directories it made (with its lock files) are gone again.
    out = tmp_path / "made" / "out"
    assert (await Exporter(redis_store, out).run(since=future)).files == []
    assert list(tmp_path.iterdir()) == []
    # A refused run (a feed trimmed before a new directory) leaves nothing either.
    for p in range(redis_store.partitions):
        await redis_store.trim_feed(p, max_age_ms=0)
    with pytest.raises(ExportSourceError, match="trimmed"):
        await Exporter(redis_store, out).run()
    assert list(tmp_path.iterdir()) == []
    # A directory that was there stays, as it was.
    (tmp_path / "mine").mkdir()
    assert (await Exporter(redis_store, tmp_path / "mine").run(since=future)).files == []
    assert (tmp_path / "mine").is_dir()
    # A run that commits a part keeps it, of course.
    await anyio.sleep(0.01)
    now = datetime.now(UTC)
    await conversation(redis_store, "t", 1)
    assert (await Exporter(redis_store, out).run(since=now)).files
    assert sorted(p.name for p in out.glob("*part-*")) == [
        "_part-00000001.positions.json", "part-00000001.parquet",
    ]  # fmt: skip


MEASURED_EXPORT = textwrap.dedent(
    """
    import resource, sys, anyio, eventstore as es
    from adapters import Exporter

    async def main():
        store = await es.connect(sys.argv[1], namespace=sys.argv[2])
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        exporter = Exporter(store, sys.argv[3], fmt=sys.argv[4])
        exporter._prepare_directory()  # pyarrow and the writer's imports, before measuring
        import pyarrow.parquet
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result = await exporter.run()
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(result.events, grown // 1024)

    anyio.run(main)
    """
)


@pytest.mark.parametrize("fmt", ["ndjson", "parquet"])
async def test_large_events_are_exported_in_bounded_memory(
    redis_store: es.EventStore, redis_url: str, tmp_path: Path, fmt: str
) -> None:
    # 600 messages of 256 kB: 150 MB, one chunk by its event count (CHUNK_EVENTS). Read,
    # decoded and written whole, it grew the process by as much again (and a chunk of 8,192
    # events of 1 MiB would hold up to 8 GiB).
    text = "é" * (128 * 1024)
    for i in range(600):
        await redis_store.append(f"t{i % 8}", [msg(f"{i} {text}")])
    script = tmp_path / "measure.py"
    script.write_text(MEASURED_EXPORT)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(script), redis_url, redis_store.namespace, str(out), fmt],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    events, grown_mb = map(int, done.stdout.split())
    assert events == 600
    assert grown_mb < 80, f"the export grew by {grown_mb} MB"
    rows = ndjson_rows(out) if fmt == "ndjson" else list(read_parquet_dir(out))
    assert sorted(int(json.loads(r["payload"])["message"]["content"].split()[0]) for r in rows) == (
        list(range(600))
    )
    assert all(json.loads(r["payload"])["message"]["content"].endswith(text) for r in rows)
    for t in range(8):  # 150 MB less in the test server
        await redis_store.delete_thread(f"t{t}")


def test_a_bad_export_name_is_refused_as_an_export_name(tmp_path: Path) -> None:
    store = es.MemoryEventStore()
    # 60 characters: a good view name, but its group, export-<name>, is too long.
    for bad, shown in (("a" * 60, "a" * 60), ("bad name", "bad name"), ("x" * 300, "x" * 61)):
        with pytest.raises(es.InvalidInputError) as caught:
            Exporter(store, tmp_path, name=bad)
        assert str(caught.value).startswith(f"export name '{shown}")
        assert "1-57 characters" in str(caught.value)
    Exporter(store, tmp_path, name="a" * 57)


async def test_a_missing_or_damaged_positions_file_is_refused_naming_it(
    redis_store: es.EventStore, tmp_path: Path
) -> None:
    await conversation(redis_store, "t", 1)
    await Exporter(redis_store, tmp_path, fmt="ndjson").run()
    sidecar = tmp_path / "_part-00000001.positions.json"
    good = sidecar.read_bytes()
    # The sidecars of a directory from before the run record (which holds their merge).
    (tmp_path / RUN_RECORD_FILE).unlink()
    await conversation(redis_store, "t", 1)
    # Each was an internal error (JSONDecodeError, AttributeError: exit 3 in the command).
    for damaged, why in (
        (b'{"0": ', "Expecting value"), (b'["x"]', "not a JSON object"),
        (b'{"0": 5}', "not a stream id"), (b'{"a": "1-0"}', "invalid literal"),
    ):  # fmt: skip
        sidecar.write_bytes(damaged)
        with pytest.raises(ExportSourceError, match=f"{sidecar} is damaged \\({why}"):
            await Exporter(redis_store, tmp_path, fmt="ndjson").run()
    sidecar.unlink()
    with pytest.raises(ExportSourceError, match="has part-00000001 without its positions"):
        await Exporter(redis_store, tmp_path, fmt="ndjson").run()
    assert sorted(p.name for p in tmp_path.glob("part-*")) == ["part-00000001.ndjson"]
    sidecar.write_bytes(good)  # restored: the run goes on from there
    assert (await Exporter(redis_store, tmp_path, fmt="ndjson").run()).events == 3


async def test_a_directory_whose_parts_were_removed_is_not_exported_again(
    redis_store: es.EventStore, tmp_path: Path
) -> None:
    import gzip

    await conversation(redis_store, "t", 2)
    first = await Exporter(redis_store, tmp_path, fmt="ndjson").run()
    assert first.events == 6
    # The user compresses the parts to keep them (or moves them to a warehouse): the directory
    # no longer holds a part, but its run record says where it ended: it continues there.
    for part in tmp_path.glob("part-*.ndjson"):
        part.with_suffix(".ndjson.gz").write_bytes(gzip.compress(part.read_bytes()))
        part.unlink()
    await conversation(redis_store, "t", 1)
    assert (await Exporter(redis_store, tmp_path, fmt="ndjson").run()).events == 3
    assert [p.name for p in tmp_path.glob("part-*.ndjson")] == ["part-00000002.ndjson"]
    # A directory from before the run record: its source record and its group say what it
    # exported, and a run would export it all again: refused, and refused again.
    for part in tmp_path.glob("part-*.ndjson"):
        part.with_suffix(".ndjson.gz").write_bytes(gzip.compress(part.read_bytes()))
        part.unlink()
    (tmp_path / RUN_RECORD_FILE).unlink()
    await conversation(redis_store, "t", 1)
    for _ in range(2):
        with pytest.raises(ExportSourceError, match="holds no part"):
            await Exporter(redis_store, tmp_path, fmt="ndjson").run()
        assert (tmp_path / SOURCE_FILE).exists()
    assert list(tmp_path.glob("part-*.ndjson")) == []  # (every event again, before)
    # Put back, they continue where they ended: the refused runs kept their positions files
    # (which were removed as a crash's leftovers).
    for packed in tmp_path.glob("part-*.ndjson.gz"):
        packed.with_suffix("").write_bytes(gzip.decompress(packed.read_bytes()))
        packed.unlink()
    assert (await Exporter(redis_store, tmp_path, fmt="ndjson").run()).events == 3
    # Told to start over (the source record removed, as with the whole directory), it does,
    # whatever its run record said.
    for part in tmp_path.glob("part-*.ndjson"):
        part.unlink()
    (tmp_path / SOURCE_FILE).unlink()
    assert (tmp_path / RUN_RECORD_FILE).exists()
    assert (await Exporter(redis_store, tmp_path, fmt="ndjson").run()).events == 12


@pytest.mark.parametrize("fmt", ["ndjson", "parquet"])
async def test_damage_after_a_chunks_first_rows_were_written_commits_none_of_them(
    redis_store: es.EventStore, tmp_path: Path, fmt: str
) -> None:
    """Large events go to the writer before their chunk ends (`ROWS_BYTES`); damage later in
    the chunk must not leave them in a committed part, whose position (the chunk before)
    would have a rerun export them again."""
    store = redis_store
    assert isinstance(store, es.RedisEventStore)
    text = "x" * (256 * 1024)
    await store.append("small", [msg("first")])  # a chunk of its own before the large ones
    # The first read takes FIRST_READ events (16 MB, written at once), the next ones fewer.
    damaged = FIRST_READ + 11
    for lo in range(1, damaged, 10):
        await store.append("long", [msg(f"{i} {text}") for i in range(lo, min(lo + 10, damaged))])
    await _write_undecodable_entry(store, "long", damaged)
    with pytest.raises(es.CorruptEventError):
        await Exporter(store, tmp_path, fmt=fmt, batch=1000).run()  # type: ignore[arg-type]
    rows = ndjson_rows(tmp_path) if fmt == "ndjson" else list(read_parquet_dir(tmp_path))
    assert {r["thread"] for r in rows} <= {"small"}, "rows of an unfinished chunk committed"


@pytest.mark.parametrize("fmt", ["ndjson", "parquet"])
async def test_a_directory_whose_name_is_not_utf8_is_exported_into(
    redis_store: es.EventStore, tmp_path: Path, fmt: str
) -> None:
    # Linux names are bytes: pyarrow took the part's path for text (a URI) and failed with
    # UnicodeEncodeError, an internal error of the command.
    out = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9"))
    await conversation(redis_store, "t", 1)
    assert (await Exporter(redis_store, out, fmt=fmt).run()).events == 3  # type: ignore[arg-type]
    await conversation(redis_store, "t", 1)
    assert (await Exporter(redis_store, out, fmt=fmt).run()).events == 3  # type: ignore[arg-type]
    rows = ndjson_rows(out) if fmt == "ndjson" else list(read_parquet_dir(out))
    assert len(rows) == 6


async def test_the_since_a_trimmed_feed_asks_for_is_one_that_is_accepted(
    redis_store: es.EventStore, tmp_path: Path
) -> None:
    import re

    # Partitions trimmed up to different times: the first to be checked has the earliest.
    await redis_store.append(thread_in_partition(redis_store, 0), [msg("early")])
    await anyio.sleep(0.02)
    await redis_store.append(thread_in_partition(redis_store, 3), [msg("later")])
    await anyio.sleep(0.01)
    for p in range(redis_store.partitions):
        await redis_store.trim_feed(p, max_age_ms=0)
    with pytest.raises(ExportSourceError, match="--since") as refused:
        await Exporter(redis_store, tmp_path).run()
    # The time the message names as the one to pass (it named partition 0's trim time, which
    # was refused as it stood, and partition 3's after it).
    asked = re.findall(r"\d{4}-\d\d-\d\dT[\d:.]+\+00:00", str(refused.value))[-1]
    result = await Exporter(redis_store, tmp_path).run(since=datetime.fromisoformat(asked))
    assert result.files == []


async def test_a_directory_started_at_a_time_continues_over_a_feed_trimmed_before_it(
    redis_store: es.EventStore, tmp_path: Path
) -> None:
    # The feed is trimmed (by age) before the directory exists, in every partition; the
    # directory then starts at a time after the trim and gets changes in one partition only.
    # Its later runs must go on: what the feed lost is older than the directory's start, in
    # the partitions it has read from and in those it has not (its group there stands at
    # the feed's start, before the trim).
    old, fresh, other = (thread_in_partition(redis_store, p) for p in (0, 1, 2))
    await redis_store.append(old, [msg("before the trim")])
    await redis_store.append(other, [msg("before the trim too")])
    await anyio.sleep(0.01)
    for p in range(redis_store.partitions):
        await redis_store.trim_feed(p, max_age_ms=0)
    await anyio.sleep(0.01)
    since = datetime.now(UTC)
    await redis_store.append(fresh, [msg("after the start")])
    out = tmp_path / "out"
    first = await Exporter(redis_store, out, fmt="ndjson").run(since=since)
    assert first.events == 1
    second = await Exporter(redis_store, out, fmt="ndjson").run()
    assert second.events == 0
    await redis_store.append(other, [msg("after the start, elsewhere")])
    await redis_store.append(fresh, [msg("after the start, again")])
    third = await Exporter(redis_store, out, fmt="ndjson").run()
    assert third.events == 2
    assert sorted((r["thread"], r["seq"]) for r in ndjson_rows(out)) == sorted(
        [(fresh, 1), (fresh, 2), (other, 2)]
    )
    # A trim by age after the start, past what the directory has not read, is still refused.
    await redis_store.append(other, [msg("never exported")])
    await anyio.sleep(0.01)
    for p in range(redis_store.partitions):
        await redis_store.trim_feed(p, max_age_ms=0)
    with pytest.raises(ExportSourceError, match="was trimmed past"):
        await Exporter(redis_store, out, fmt="ndjson").run()


async def test_runs_into_one_new_directory_at_once_are_each_done_or_busy(
    redis_url: str, tmp_path: Path
) -> None:
    """Three runs into one new directory, of a namespace with nothing to export, started
    0-40 ms apart: each ends done or `ExportBusyError`. A run that made the directory and had
    nothing to commit removes it, with its lock file; a run that had found it there then
    failed with the OS's FileNotFoundError opening its lock, or "File exists" making it."""
    rng = random.Random(1)
    store = await es.connect(redis_url, namespace="x" + uuid.uuid4().hex[:12])
    outcomes: list[str] = []
    try:
        for i in range(40):
            target = tmp_path / f"new-{i}"
            runs = (started_late(store, target, k * rng.random() * 0.04) for k in range(3))
            outcomes += await asyncio.gather(*runs)
            # Nothing was committed: no part, no record. (The directory itself stays when a
            # run made its lock file in it just before the run that made it removed it.)
            left = [p.name for p in target.iterdir()] if target.exists() else []
            assert set(left) <= {".export.lock", ".workers.lock"}, left
    finally:
        await store.close()
    assert set(outcomes) <= {"done", "busy"} and "done" in outcomes, outcomes


async def started_late(store: es.EventStore, target: Path, delay: float) -> str:
    """An export run into ``target`` started after ``delay`` s: "done", or "busy"."""
    await anyio.sleep(delay)
    try:
        await Exporter(store, target, fmt="ndjson").run()
    except ExportBusyError:
        return "busy"
    return "done"


class RacedExporter(Exporter):
    """An exporter whose directory is removed right after it prepared it, ``races`` times: as
    another run that made it, committed nothing and removed it (`_remove_made`) would."""

    races = 1

    def _prepare_directory(self) -> list[Path]:
        made = super()._prepare_directory()
        if self.races:
            self.races -= 1
            shutil.rmtree(self.directory)
        return made


async def test_a_directory_removed_before_the_run_locks_it_is_made_again(
    tmp_path: Path,
) -> None:
    store = es.MemoryEventStore()
    await store.append("t", [msg("x")])
    raced = RacedExporter(store, tmp_path / "out", fmt="ndjson")
    assert (await raced.run()).events == 1  # made again, exported into
    assert raced.races == 0 and list((tmp_path / "out").glob("part-*.ndjson"))
    # Removed every time: said, typed, not the OS's FileNotFoundError.
    always = RacedExporter(store, tmp_path / "other", fmt="ndjson")
    always.races = 3
    with pytest.raises(ExportBusyError, match="kept removing it"):
        await always.run()
    assert not (tmp_path / "other").exists()
