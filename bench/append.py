"""Single-append latency: `RedisEventStore.append` beside a raw redis-py ``XADD`` of the same bytes.

Run ``python -m bench.append [--quick]``. One private redis-server (unix socket) and one
redis.asyncio client (hiredis parser) serve both sides. Per op, the raw side awaits
``XADD <key> * d <payload>`` with the msgpack bytes threadlog stores for the event; the threadlog
side awaits ``append(thread, [event], expected_version=v)`` with the thread's exact version and
a bare payload, so the timed call mints the event id, encodes and validates the payload,
computes the digests and runs the append script (idempotency ledger, version check, chain link,
meta, change feed, thread index). A third side does the same on a store with group commit off
(``max_batch=1``), which shows what the default's one-tick batching window costs a lone append.
Rounds alternate the order of the sides; each round uses a fresh stream key and fresh threads.

Two untimed-by-the-table phases follow: ``INFO commandstats`` (after ``CONFIG RESETSTAT``, one
side at a time) gives the server time per call, and a CPU-only loop gives threadlog's
client-side encoding time, so the gap between the sides can be split into server and client.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import redis
from redis.asyncio.connection import DefaultParser

from eventstore import Message, MessageAppended, RedisEventStore, connect, registry
from eventstore._codec import (
    DEFAULT_MAX_EVENT_BYTES,
    EncodedEvent,
    encode_append,
)
from eventstore.servers import redis_server

from ._common import (
    Comparison,
    Mode,
    Op,
    Side,
    arg_parser,
    environment,
    loadavg,
    markdown_table,
    measure,
    print_table,
    time_cpu,
    time_ops,
)

QUICK = Mode("quick", rounds=10, ops=300, warmup=300)
FULL = Mode("default", rounds=80, ops=500, warmup=1000)
TARGET_RATIO = 1.3
MESSAGE_CHARS = 450
SENTENCE = "The agent read the tool result and wrote a short answer for the user. "
RAW = "redis-py XADD"
THREADLOG = "threadlog append"
UNBATCHED = "threadlog append, max_batch=1"
STATS_ROUND = 1_000_000  # round number of the commandstats phase (keys unused by the rounds)


def message_text(chars: int = MESSAGE_CHARS) -> str:
    """Deterministic prose-like text of exactly ``chars`` characters."""
    return (SENTENCE * (chars // len(SENTENCE) + 1))[:chars]


def make_event() -> MessageAppended:
    """The benchmark's event: a user message of `MESSAGE_CHARS` characters (~500 bytes)."""
    return MessageAppended(message=Message(role="user", content=message_text()))


def encode_one(event: MessageAppended) -> tuple[list[EncodedEvent], bytes]:
    """The append's client-side encoding, as `RedisEventStore.append` does it: `encode_append`
    (the events and both digests in one pass)."""
    return encode_append(
        "bench-append", [event], registry, max_event_bytes=DEFAULT_MAX_EVENT_BYTES, secret=None
    )


class AppendBench:
    """The sides, sharing one client (and so one connection pool)."""

    def __init__(self, store: RedisEventStore, payload: bytes) -> None:
        self.store = store
        self.client: Any = store.client
        self.unbatched = RedisEventStore(
            self.client,
            namespace=store.namespace,
            partitions=store.partitions,
            max_batch=1,
            owns_client=False,
        )
        self.payload = payload
        self.event = make_event()

    @staticmethod
    def raw_key(r: int) -> str:
        return f"bench:raw:{r}"

    async def setup_raw(self, r: int, n: int) -> Op:
        client, key, fields = self.client, self.raw_key(r), {b"d": self.payload}
        await client.unlink(key)

        async def op() -> None:
            await client.xadd(key, fields)

        return op

    async def teardown_raw(self, r: int) -> None:
        await self.client.unlink(self.raw_key(r))

    def threadlog_side(self, name: str, store: RedisEventStore, tag: str) -> Side:
        events = [self.event]

        def thread(r: int) -> str:
            return f"bench-{tag}-{r}"

        async def setup(r: int, n: int) -> Op:
            thread_id = thread(r)
            await self.client.unlink(*store.keys.thread_keys(thread_id))
            version = 0

            async def op() -> None:
                nonlocal version
                result = await store.append(thread_id, events, expected_version=version)
                version = result.last_seq

            return op

        async def teardown(r: int) -> None:
            await self.client.unlink(*store.keys.thread_keys(thread(r)))

        return Side(name, setup, teardown)

    def sides(self) -> list[Side]:
        return [
            Side(RAW, self.setup_raw, self.teardown_raw),
            self.threadlog_side(THREADLOG, self.store, "append"),
            self.threadlog_side(UNBATCHED, self.unbatched, "append-unbatched"),
        ]

    async def server_time(self, n: int) -> dict[str, Any]:
        """Server time per call from ``INFO commandstats``, one side at a time.

        Commands a script runs are counted under their own names too, so each side gets its own
        ``CONFIG RESETSTAT``; for the script, the commands it ran are listed beside it.
        """
        out: dict[str, Any] = {}
        for side, command in zip(self.sides()[:2], ("xadd", "evalsha"), strict=True):
            op = await side.setup(STATS_ROUND, n)
            await self.client.config_resetstat()
            await time_ops(op, n)
            stats = await self.client.info("commandstats")
            assert side.teardown is not None
            await side.teardown(STATS_ROUND)
            entry = stats.get(f"cmdstat_{command}", {})
            out[side.name] = {
                "command": command.upper(),
                "calls": int(entry.get("calls", 0)),
                "usec_per_call": float(entry.get("usec_per_call", 0.0)),
            }
            if command == "evalsha":
                out[side.name]["inside_script"] = {
                    k.removeprefix("cmdstat_"): {
                        "calls": int(v["calls"]),
                        "usec_per_call": float(v["usec_per_call"]),
                    }
                    for k, v in sorted(stats.items())
                    if k.startswith("cmdstat_") and k not in ("cmdstat_evalsha",)
                    and not k.startswith("cmdstat_config")
                }  # fmt: skip
        return out


def parser_name(client: Any) -> str:
    conns = getattr(client.connection_pool, "_available_connections", [])
    if conns:
        return type(conns[0]._parser).__name__
    return DefaultParser.__name__


async def run(mode: Mode, *, progress: bool) -> tuple[Comparison, dict[str, Any]]:
    event = make_event()
    encoded, _ = encode_one(event)
    payload = encoded[0].data
    env = environment()
    with redis_server() as server:
        store = await connect(server.url, namespace="bench", partitions=16)
        assert isinstance(store, RedisEventStore)
        try:
            info = await store.client.info("server")
            bench = AppendBench(store, payload)
            print(
                f"bench.append ({mode.name}): {mode.rounds} rounds x {mode.ops} ops per side, "
                f"{len(payload)}-byte payload, redis {info['redis_version']} on a unix socket",
                file=sys.stderr,
            )
            comparison = await measure(
                bench.sides(),
                rounds=mode.rounds,
                ops=mode.ops,
                warmup=mode.warmup,
                progress=progress,
            )
            server_side = await bench.server_time(min(mode.ops * 2, 2000))
            env.update(
                redis_server=info["redis_version"],
                transport="unix socket",
                redis_py=redis.__version__,
                parser=parser_name(store.client),
            )
        finally:
            await store.close()
    client_encode_us = time_cpu(lambda: encode_one(event))
    env["loadavg_at_end"] = loadavg()
    extra = {
        "payload_bytes": len(payload),
        "server_side": server_side,
        "client_encode_us": round(client_encode_us, 2),
        "environment": env,
    }
    return comparison, extra


def report(mode: Mode, comparison: Comparison, extra: dict[str, Any]) -> dict[str, Any]:
    rows = comparison.rows()
    print_table(
        f"Append latency, one {extra['payload_bytes']}-byte event per op "
        f"(ratio: median of per-round ratios to {RAW}; p50 ratio: of pooled p50s)",
        Comparison.HEADERS,
        rows,
    )
    server = extra["server_side"]
    srows = [
        [name, s["command"], str(s["calls"]), f"{s['usec_per_call']:.2f}"]
        for name, s in server.items()
    ]
    srows.append(
        [THREADLOG, "encode (client CPU)", "-", f"{extra['client_encode_us']:.2f}"],
    )
    print_table(
        "Where the time goes (server: INFO commandstats; encode: encode_append, as appends run it)",
        ("side", "what", "calls", "us/call"),
        srows,
    )
    tl = comparison.sides[1]
    ratio = comparison.ratio(tl)
    verdict = "meets" if ratio <= TARGET_RATIO else "misses"
    print(f"\nthreadlog/raw = {ratio:.2f}x: {verdict} the {TARGET_RATIO}x target")
    return {
        "benchmark": "append",
        "mode": mode.name,
        "rounds": mode.rounds,
        "ops_per_round": mode.ops,
        "warmup": mode.warmup,
        "payload_bytes": extra["payload_bytes"],
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio <= TARGET_RATIO,
        **comparison.summary(),
        "server_side": server,
        "client_encode_us": extra["client_encode_us"],
        "environment": extra["environment"],
        "markdown": markdown_table(Comparison.HEADERS, rows),
    }


def main(argv: list[str] | None = None) -> int:
    from .__main__ import record_run

    args = arg_parser("python -m bench.append", warmup=True).parse_args(argv)
    mode = Mode.from_args(args, quick=QUICK, full=FULL)
    comparison, extra = asyncio.run(run(mode, progress=not args.quiet))
    record_run("append", report(mode, comparison, extra), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
