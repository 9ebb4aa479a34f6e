"""Bytes per stored message, everything included, against the message's encoded payload.

Run ``python -m bench.memory [--quick]``. One private redis-server (unix socket). Messages of
~500 bytes (`bench.append`'s event: a `MessageAppended` of 450 characters) go in through
`ThreadStore.append_message`, one append each, as a runtime stores them; then ``MEMORY USAGE
<key> SAMPLES 0`` (every element counted) is read for every key of the namespace (``SCAN``)
and summed per component:

- **log**: the threads' event streams;
- **views**: the materialized views (here the messages list);
- **feed**: the partitions' change feeds (one entry per append);
- **meta + ledger + index**: per-thread meta hashes, which hold the idempotency ledger (one
  field per append), the partitions' thread indexes, the namespace's settings hash.

Stream memory is mostly listpack nodes. Redis closes a node at ``stream-node-max-bytes``
(default 4096) or ``stream-node-max-entries`` (default 100), whichever comes first, and the
allocator rounds every node up to its size class: ~600-byte entries waste a good part of 4 KiB
nodes, and 100 of them end just short of a 64 KiB class. So each workload runs in four
configurations: Redis's defaults; 65536 bytes (entries still capped at 100); what threadlog's
embedded server uses (16384 bytes, 1000 entries); and the same with the change feed trimmed
after a consumer group has read and acknowledged it (what `trim_feed` does once exporters and
projection runners have caught up). Two workloads: one thread of N messages, and N/10 threads
of 10 messages (per-thread keys weigh more).

Target (issue 7): everything stored per message at most 2.5x the message's encoded payload.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from typing import Any

import msgspec

from adapters import ThreadStore
from eventstore import Message, MessageAppended, RedisEventStore, connect
from eventstore.servers import redis_server

from ._common import environment, loadavg, markdown_table, print_table
from .append import message_text

NAME = "memory"
TITLE = "Memory per stored message"
TARGET_RATIO = 2.5
COMPONENTS = ("log", "views", "feed", "meta + ledger + index")
QUICK = {"messages": 2000}
FULL = {"messages": 10000}


@dataclass(frozen=True)
class Config:
    name: str
    node_bytes: int  # stream-node-max-bytes
    node_entries: int  # stream-node-max-entries
    trim_feed: bool


# What `eventstore.connect` starts its embedded redis-server with (eventstore/_connect.py).
EMBEDDED_NODE_BYTES, EMBEDDED_NODE_ENTRIES = 16384, 1000
CONFIGS = (
    Config("redis defaults (4096 B, 100 entries)", 4096, 100, trim_feed=False),
    Config("65536 B, 100 entries", 65536, 100, trim_feed=False),
    Config(
        f"embedded: {EMBEDDED_NODE_BYTES} B, {EMBEDDED_NODE_ENTRIES} entries",
        EMBEDDED_NODE_BYTES,
        EMBEDDED_NODE_ENTRIES,
        trim_feed=False,
    ),
    Config(
        "embedded, feed trimmed",
        EMBEDDED_NODE_BYTES,
        EMBEDDED_NODE_ENTRIES,
        trim_feed=True,
    ),
)


def component(key: bytes) -> str:
    text = key.decode("utf-8", "replace")
    if ":log:" in text:
        return "log"
    if ":view:" in text:
        return "views"
    if text.endswith(":feed"):
        return "feed"
    return "meta + ledger + index"


async def usage_by_component(client: Any, namespace: str) -> dict[str, int]:
    """``MEMORY USAGE ... SAMPLES 0`` of every key of the namespace, summed per component."""
    out = dict.fromkeys(COMPONENTS, 0)
    async for key in client.scan_iter(match=f"tl:{{{namespace}:*", count=1000):
        used = await client.memory_usage(key, samples=0)
        out[component(key)] += int(used or 0)
    return out


async def store_messages(ts: ThreadStore, threads: int, per_thread: int, message: Message) -> None:
    async def one(i: int) -> None:
        for _ in range(per_thread):
            await ts.append_message(f"m-{i}", message)

    await asyncio.gather(*(one(i) for i in range(threads)))


async def trim_feeds(store: RedisEventStore) -> int:
    """What an up-to-date consumer does: read and acknowledge every feed entry, then trim."""
    trimmed = 0
    for p in range(store.partitions):
        await store.create_feed_group(p, "bench-consumer")
        while entries := await store.read_feed_group(p, "bench-consumer", "c1", count=1000):
            await store.ack_feed(p, "bench-consumer", [e.id for e in entries])
        trimmed += await store.trim_feed(p)
    return trimmed


async def measure_all(quick: bool, *, progress: bool = True) -> dict[str, Any]:
    n = (QUICK if quick else FULL)["messages"]
    message = Message(role="user", content=message_text())
    payload_bytes = len(msgspec.msgpack.encode(MessageAppended(message=message)))
    workloads = {"one thread": (1, n), "threads of 10 messages": (n // 10, 10)}
    env = environment()
    rows: dict[str, dict[str, Any]] = {}
    with redis_server() as server:
        admin = await connect(server.url, namespace="admin")
        assert isinstance(admin, RedisEventStore)
        client = admin.client
        try:
            info = await client.info("server")
            env.update(redis_server=info["redis_version"])
            defaults = await client.config_get("stream-node-max-*")
            for w, (wname, (n_threads, n_per)) in enumerate(workloads.items()):
                for c, config in enumerate(CONFIGS):
                    await client.config_set("stream-node-max-bytes", config.node_bytes)
                    await client.config_set("stream-node-max-entries", config.node_entries)
                    namespace = f"mem{w}x{c}"
                    store = await connect(server.url, namespace=namespace, partitions=16)
                    assert isinstance(store, RedisEventStore)
                    try:
                        await store_messages(ThreadStore(store), n_threads, n_per, message)
                        if config.trim_feed:
                            await trim_feeds(store)
                        used = await usage_by_component(client, namespace)
                    finally:
                        await store.close()
                    stored = n_threads * n_per
                    per_msg = {k: v / stored for k, v in used.items()}
                    total = sum(per_msg.values())
                    rows[f"{wname} | {config.name}"] = {
                        "workload": wname,
                        "config": config.name,
                        "threads": n_threads,
                        "messages": stored,
                        "stream_node_max_bytes": config.node_bytes,
                        "stream_node_max_entries": config.node_entries,
                        "feed_trimmed": config.trim_feed,
                        "bytes_per_message": {k: round(v, 1) for k, v in per_msg.items()},
                        "total_bytes_per_message": round(total, 1),
                        "ratio_to_payload": round(total / payload_bytes, 3),
                    }
                    if progress:
                        print(
                            f"  {wname:24s} {config.name:38s} {total:7.1f} bytes/message "
                            f"({total / payload_bytes:.2f}x)",
                            file=sys.stderr,
                            flush=True,
                        )
            for name, value in defaults.items():
                await client.config_set(name, value)
        finally:
            await admin.close()
    env["loadavg_at_end"] = loadavg()
    best = min(r["ratio_to_payload"] for r in rows.values() if r["workload"] == "one thread")
    return {
        "benchmark": NAME,
        "mode": "quick" if quick else "default",
        "messages": n,
        "payload_bytes": payload_bytes,
        "rows": rows,
        "targets": {
            "ratio_target": TARGET_RATIO,
            "best_ratio_one_thread": best,
            "meets": best <= TARGET_RATIO,
        },
        "environment": env,
    }


HEADERS = (
    "workload", "configuration", *(f"{c} B/msg" for c in COMPONENTS), "total B/msg", "x payload"
)  # fmt: skip


def table_rows(summary: dict[str, Any]) -> list[list[str]]:
    out = []
    for row in summary["rows"].values():
        per = row["bytes_per_message"]
        out.append(
            [
                f"{row['workload']} ({row['messages']:,} msgs)",
                row["config"],
                *(f"{per[c]:,.1f}" for c in COMPONENTS),
                f"{row['total_bytes_per_message']:,.1f}",
                f"{row['ratio_to_payload']:.2f}x",
            ]
        )
    return out


def verdicts(summary: dict[str, Any]) -> list[str]:
    t = summary["targets"]
    word = "meets" if t["meets"] else "misses"
    return [
        f"best configuration, one thread: {t['best_ratio_one_thread']:.2f}x the "
        f"{summary['payload_bytes']}-byte payload ({word} the {TARGET_RATIO}x target)"
    ]


def markdown(summary: dict[str, Any]) -> str:
    env = summary["environment"]
    return "\n".join(
        [
            f"Run of {env.get('date')}, {summary['mode']} mode: {summary['messages']:,} "
            "messages of "
            f"{summary['payload_bytes']} encoded bytes per workload and configuration, one "
            f"`append_message` each; `MEMORY USAGE SAMPLES 0` of every key; redis "
            f"{env.get('redis_server', '?')}:",
            "",
            markdown_table(HEADERS, table_rows(summary)),
            "",
            *(f"- {v}" for v in verdicts(summary)),
        ]
    )


def report(summary: dict[str, Any]) -> None:
    print_table(
        f"{TITLE}: bytes per message by component ({summary['payload_bytes']}-byte payload)",
        HEADERS,
        table_rows(summary),
    )
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

    return module_main(NAME, run, argv, quick="2,000 messages")


if __name__ == "__main__":
    sys.exit(main())
