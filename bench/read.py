"""Read paths: the history window, the batched context read and rebuild, beside raw redis-py.

Run ``python -m bench.read [--quick]``. One private redis-server (unix socket) and one
redis.asyncio client (hiredis parser) serve every side. The threads hold an agent's log:
root turns opened with a user message, a state update, a settlement with the assistant's
message, and a child turn every fourth turn (~450-character messages).

* ``last(thread, 6)`` (`Projector.last`) beside the least a hand-written reader of the same
  view needs: ``LRANGE <messages view> -6 -1``, split off each value's ``<seq>:`` stamp and
  decode the msgpack with a reused msgspec decoder into the same struct. Target: threadlog at
  most 1.2x the raw time. A third, informational side ("what-if") times threadlog's own
  parsing over a plain ``LRANGE``: what the window read would cost without the read script.
* The batched context read (`Projector.context`: window, a reader view of the state and the
  latest records in one atomic round trip) beside the same three reads made one by one through
  the projector, and beside hand-written redis-py (a pipeline, then an HMGET for the records
  the settle list names: two round trips, not atomic).
* Rebuild throughput: `Projector.rebuild` (fold the log through every projection, then load
  the views) of a 100k-event thread (20k with ``--quick``) beside ``XRANGE`` of the same
  stream in batches of the same size plus a msgspec decode of every payload. The fold alone
  (`Projector.fold`: read, decode, apply; no view writes) is shown as well. Target: threadlog
  events/s at least 0.8x the raw events/s.

Ratios are another side's time over threadlog's time, so >1 means threadlog is faster; they
are the median of per-round paired ratios (sides alternate order every round). A profile
follows: round trips per op, server time per op (``INFO commandstats``), client CPU per op and
where a rebuild spends its time.

The helpers in the first section are shared with `bench.session` and `bench.frameworks`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol

import msgspec
import redis
import redis.asyncio.connection as aio_connection
import redis.connection as sync_connection
from ulid import ULID

from eventstore import (
    Grant,
    Message,
    MessageAppended,
    NewEvent,
    RedisEventStore,
    StateUpdated,
    Timing,
    TurnOpened,
    TurnSettled,
    Usage,
    connect,
    new_ulid,
    registry,
)
from eventstore._codec import decode_entry, decode_payload_rows, decode_rows
from eventstore._ids import ulid_text
from eventstore._redis import READ_BATCH
from eventstore._views import decode_view_result
from eventstore._wire import HeldConnections
from eventstore.servers import redis_server
from projections import MessagesProjection, Projector, ReaderView, StateProjection
from projections._messages import _MessageValue
from projections._records import _RecordValue

from ._common import (
    Comparison,
    Mode,
    Op,
    Side,
    arg_parser,
    environment,
    format_table,
    loadavg,
    markdown_table,
    measure,
    time_cpu,
)

# -- shared helpers (also used by bench.session and bench.frameworks) ---------------------------

RATIO_NOTE = (
    "ratio = this side's time / threadlog's time (median of per-round paired ratios; "
    ">1 means threadlog is faster); p50 ratio = of pooled p50s"
)
OP_HEADERS = ("operation", *Comparison.HEADERS)
PROFILE_HEADERS = (
    "operation",
    "side",
    "round trips/op",
    "server us/op",
    "client CPU us/op",
    "server commands (calls/op x us/call)",
)
_SENTENCES = (
    "The agent read the tool result and wrote a short answer for the user. ",
    "It checked the plan against the budget before calling the search tool again. ",
    "The user asked for a summary of the three cheapest flights and their layovers. ",
    "A fallback model took over after the first one timed out on a long prompt. ",
)


def prose(i: int, chars: int = 450) -> str:
    """Deterministic, distinct prose-like text of exactly ``chars`` characters."""
    head = f"[{i}] "
    body = "".join(_SENTENCES[(i + k) % len(_SENTENCES)] for k in range(chars // 60 + 2))
    return (head + body)[:chars]


def op_rows(operation: str, comparison: Comparison) -> list[list[str]]:
    """`Comparison.rows` with the operation in front (its first side is the baseline)."""
    return [[operation, *row] for row in comparison.rows()]


def paired_ratio(comparison: Comparison, numerator: str, denominator: str) -> float:
    """The median over rounds of side ``numerator``'s mean over side ``denominator``'s."""
    by_name = {s.name: s for s in comparison.sides}
    num, den = by_name[numerator].round_means_ns, by_name[denominator].round_means_ns
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def verdict(met: bool) -> str:
    return "MEETS" if met else "MISSES"


class _Counters:
    def __init__(self) -> None:
        self.sends = 0


@contextlib.contextmanager
def counting_round_trips() -> Iterator[_Counters]:
    """Count requests written to Redis (a pipeline is one) by every redis-py connection, and
    by the store's direct path (`eventstore._wire.HeldConnections`), which writes its own RESP.

    Patches ``send_packed_command`` of the sync and asyncio connection classes and the direct
    path's exchange for the duration of the block; profiling only, never while timing.
    """
    counters = _Counters()
    aio_cls: Any = aio_connection.AbstractConnection
    sync_cls: Any = sync_connection.AbstractConnection
    aio_orig, sync_orig = aio_cls.send_packed_command, sync_cls.send_packed_command
    held_cls: Any = HeldConnections
    # As defined (a staticmethod once, a method now): restored as it was, and wrapped alike.
    held_static = inspect.getattr_static(held_cls, "_once")
    held_orig = held_cls._once

    async def held_once(*args: Any) -> Any:
        # Whatever `_once` takes (it has grown before, and gained a self): passed through.
        counters.sends += 1
        return await held_orig(*args)

    async def aio_send(self: Any, *args: Any, **kwargs: Any) -> Any:
        counters.sends += 1
        return await aio_orig(self, *args, **kwargs)

    def sync_send(self: Any, *args: Any, **kwargs: Any) -> Any:
        counters.sends += 1
        return sync_orig(self, *args, **kwargs)

    aio_cls.send_packed_command = aio_send
    sync_cls.send_packed_command = sync_send
    held_cls._once = staticmethod(held_once) if isinstance(held_static, staticmethod) else held_once
    try:
        yield counters
    finally:
        aio_cls.send_packed_command = aio_orig
        sync_cls.send_packed_command = sync_orig
        held_cls._once = held_static


async def profile_op(
    client: Any, op: Op, n: int, *, direct: Sequence[str] | None = None
) -> dict[str, Any]:
    """Round trips, server time (``INFO commandstats``) and client CPU per op, over ``n`` ops.

    Commands a script runs are counted again under their own names, and EXEC's time includes
    the commands it runs; so the server time per op adds up the commands in ``direct`` (those
    the side sends itself; default: every command but EXEC).
    """
    await client.config_resetstat()
    with counting_round_trips() as counters:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            await op()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        sends = counters.sends
    stats = await client.info("commandstats")
    commands: dict[str, dict[str, float]] = {}
    for key, value in sorted(stats.items()):
        name = key.removeprefix("cmdstat_")
        if name.startswith(("config", "info")):
            continue
        commands[name] = {
            "calls_per_op": round(int(value["calls"]) / n, 3),
            "usec_per_call": float(value["usec_per_call"]),
        }
    counted = [c for c in commands if c != "exec"] if direct is None else list(direct)
    server = sum(
        commands[c]["calls_per_op"] * commands[c]["usec_per_call"] for c in counted if c in commands
    )
    return {
        "round_trips_per_op": round(sends / n, 2),
        "server_us_per_op": round(server, 2),
        "client_cpu_us_per_op": round(cpu / n * 1e6, 1),
        "wall_us_per_op": round(wall / n * 1e6, 1),
        "commands": commands,
    }


PROFILE_ROUND = 1_000_000  # the round number `profile_side` hands to a side's setup


async def profile_side(
    client: Any, side: Side, n: int, *, direct: Sequence[str] | None = None
) -> dict[str, Any]:
    """`profile_op` over ``n`` ops of a side, set up and torn down as for a timed round."""
    op = await side.setup(PROFILE_ROUND, n)
    try:
        return await profile_op(client, op, n, direct=direct)
    finally:
        if side.teardown is not None:
            await side.teardown(PROFILE_ROUND)


def profile_row(operation: str, side: str, p: dict[str, Any]) -> list[str]:
    shown = ", ".join(
        f"{name.upper()} {c['calls_per_op']:g}x{c['usec_per_call']:.1f}"
        for name, c in p["commands"].items()
    )
    return [
        operation,
        side,
        f"{p['round_trips_per_op']:g}",
        f"{p['server_us_per_op']:.1f}",
        f"{p['client_cpu_us_per_op']:.1f}",
        shown,
    ]


def print_block(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a titled plain-text table."""
    print(f"\n{title}\n\n{format_table(headers, rows)}")


# -- the data: an agent's log ------------------------------------------------------------------

WINDOW = 6
CONTEXT_RECORDS = 3
READER = ReaderView("planner", {"plan": None, "profile": ("name",)})
BLOCKS = ("plan", "profile", "notes")
WINDOW_TURNS = 300  # ~1,050 events, 600 messages


def state_projection() -> StateProjection:
    return StateProjection([READER], blocks=BLOCKS)


def _state_value(i: int) -> Any:
    block = BLOCKS[i % len(BLOCKS)]
    if block == "plan":
        return {"step": i, "goal": "book the trip", "todo": ["compare fares", "check visas"]}
    if block == "profile":
        return {"name": "Ada", "email": "ada@example.com", "tier": "gold", "turns": i}
    return {"text": prose(i, 120)}


def turn_events(i: int) -> list[NewEvent]:
    """One root turn: opened with a user message, a state update, maybe a child turn, and a
    completed settlement with the assistant's message (3 or 5 events)."""
    turn = new_ulid()
    now = 1_790_000_000_000 + i * 1000
    events = [
        NewEvent(
            payload=TurnOpened(
                turn_id=turn,
                grant=Grant(max_steps=8, max_tokens=20_000),
                request=Message(role="user", content=prose(2 * i)),
            ),
            turn_id=turn,
        ),
        NewEvent(
            payload=StateUpdated(
                block=BLOCKS[i % len(BLOCKS)], value=_state_value(i), turn_id=turn
            ),
            turn_id=turn,
        ),
    ]
    if i % 4 == 3:
        child = new_ulid()
        events += [
            NewEvent(payload=TurnOpened(turn_id=child, parent_turn_id=turn), turn_id=child),
            NewEvent(
                payload=TurnSettled(
                    turn_id=child,
                    parent_turn_id=turn,
                    outcome="completed",
                    steps=1,
                    model_tier="small",
                    usage=Usage(input_tokens=400, output_tokens=60),
                ),
                turn_id=child,
            ),
        ]
    events.append(
        NewEvent(
            payload=TurnSettled(
                turn_id=turn,
                outcome="completed",
                steps=3,
                model_tier="large",
                usage=Usage(input_tokens=1200 + i % 500, output_tokens=150, cached_tokens=800),
                timing=Timing(started_ms=now, settled_ms=now + 900),
                assistant_message=Message(role="assistant", content=prose(2 * i + 1)),
            ),
            turn_id=turn,
        )
    )
    return events


def agent_log(n_events: int) -> list[NewEvent]:
    """Exactly ``n_events`` events of consecutive turns (the last turn may be cut short)."""
    out: list[NewEvent] = []
    i = 0
    while len(out) < n_events:
        out += turn_events(i)
        i += 1
    return out[:n_events]


async def write_log(projector: Projector, thread: str, events: Sequence[NewEvent]) -> None:
    for start in range(0, len(events), 250):
        await projector.append(thread, events[start : start + 250])


# -- the benchmark -----------------------------------------------------------------------------

QUICK = Mode("quick", rounds=8, ops=300, warmup=200)
FULL = Mode("default", rounds=24, ops=1000, warmup=1000)
REBUILD_EVENTS = {"quick": 20_000, "default": 100_000}
REBUILD_ROUNDS = {"quick": 3, "default": 5}
TARGET_LAST = 1.2  # threadlog time / raw time, at most
TARGET_REBUILD = 0.8  # threadlog events/s / raw events/s, at least

TL_LAST = "threadlog last(6)"
RAW_LAST = "redis-py LRANGE+decode"
WHATIF_LAST = "what-if: LRANGE + threadlog parse"
TL_CONTEXT = "threadlog context()"
TL_THREE = "threadlog 3 reads"
RAW_CONTEXT = "redis-py pipeline+HMGET"
TL_REBUILD = "threadlog rebuild"
TL_FOLD = "threadlog fold only"
RAW_SCAN = "redis-py XRANGE+decode"


class ReadBench:
    """Every side of the three operations, sharing one store and client."""

    def __init__(self, store: RedisEventStore, window_thread: str, big_thread: str) -> None:
        self.store = store
        self.client: Any = store.client
        self.projector = Projector(store, state=state_projection())
        self.window = window_thread
        self.big = big_thread
        self.msg_decoder = msgspec.msgpack.Decoder(_MessageValue)
        self.any_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder()
        self.record_decoder = msgspec.msgpack.Decoder(_RecordValue)
        # What a hand-written reader of this log decodes payloads as: the union of its types.
        self.payload_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(
            MessageAppended | TurnOpened | StateUpdated | TurnSettled
        )
        keys = store.keys
        self.messages_key = keys.view(window_thread, "messages")
        self.state_key = keys.view(window_thread, "state")
        self.settled_key = keys.view(window_thread, "settled")
        self.turns_key = keys.view(window_thread, "turns")
        self.log_key = keys.log(big_thread)

    # -- last(6) -----------------------------------------------------------------------------

    async def tl_last(self) -> object:
        return await self.projector.last(self.window, WINDOW)

    async def raw_last(self) -> list[tuple[int, _MessageValue]]:
        decode = self.msg_decoder.decode
        out = []
        for raw in await self.client.lrange(self.messages_key, -WINDOW, -1):
            head, _, value = raw.partition(b":")
            out.append((int(head), decode(value)))
        return out

    async def whatif_last(self) -> object:
        """What last(6) would cost if the store served it with a plain LRANGE (no script)."""
        raws = await self.client.lrange(self.messages_key, -WINDOW, -1)
        read = MessagesProjection.window_read(WINDOW)
        return MessagesProjection.parse(decode_view_result(self.window, read, raws))

    # -- context -----------------------------------------------------------------------------

    async def tl_context(self) -> object:
        return await self.projector.context(
            self.window, n=WINDOW, view=READER.name, records=CONTEXT_RECORDS
        )

    async def tl_three(self) -> object:
        p = self.projector
        return (
            await p.last(self.window, WINDOW),
            await p.state(self.window, READER.name),
            await p.records(self.window, last=CONTEXT_RECORDS),
        )

    async def raw_context(self) -> tuple[dict[str, Any], list[Any], list[_RecordValue]]:
        pipe = self.client.pipeline(transaction=False)
        blocks = list(READER.blocks)
        pipe.hmget(self.state_key, blocks)
        pipe.lrange(self.messages_key, -WINDOW, -1)
        pipe.lrange(self.settled_key, -CONTEXT_RECORDS, -1)
        states, messages, settled = await pipe.execute()
        turn_ids = [raw.partition(b":")[2] for raw in settled]
        records = await self.client.hmget(self.turns_key, turn_ids)
        state: dict[str, Any] = {}
        for name, raw in zip(blocks, states, strict=True):
            if raw is None:
                continue
            _version, _seq, value = raw.split(b":", 2)
            decoded = self.any_decoder.decode(value)
            fields = READER.blocks[name]
            if fields is not None:
                decoded = {f: decoded[f] for f in fields if f in decoded}
            state[name] = decoded
        decode = self.msg_decoder.decode
        window = [decode(raw.partition(b":")[2]) for raw in messages]
        recs = [self.record_decoder.decode(raw.split(b":", 2)[2]) for raw in records if raw]
        return state, window, recs

    # -- rebuild -----------------------------------------------------------------------------

    async def tl_rebuild(self) -> object:
        return await self.projector.rebuild(self.big)

    async def tl_fold(self) -> object:
        return await self.projector.fold(self.big)

    async def raw_scan(self) -> int:
        decode = self.payload_decoder.decode
        client, key = self.client, self.log_key
        lo: bytes | str = "-"
        n = 0
        while True:
            rows = await client.xrange(key, lo, "+", count=READ_BATCH)
            for _entry_id, fields in rows:
                decode(fields[b"d"])
            n += len(rows)
            if len(rows) < READ_BATCH:
                return n
            lo = b"(" + rows[-1][0]

    # -- checks --------------------------------------------------------------------------------

    async def check_same_answers(self) -> None:
        """The sides must read the same data, or the comparison means nothing."""
        tl = await self.projector.last(self.window, WINDOW)
        raw = await self.raw_last()
        if [(m.seq, m.message) for m in tl] != [(s, v.message) for s, v in raw]:
            raise RuntimeError("raw LRANGE and last(6) disagree")
        ctx = await self.projector.context(
            self.window, n=WINDOW, view=READER.name, records=CONTEXT_RECORDS
        )
        state, window, recs = await self.raw_context()
        if {k: b.value for k, b in ctx.state.items()} != state:
            raise RuntimeError("raw state read and context() disagree")
        if [m.message for m in ctx.messages] != [v.message for v in window]:
            raise RuntimeError("raw window and context() disagree")
        if [r.usage for r in ctx.records] != [r.usage for r in recs]:
            raise RuntimeError("raw records and context() disagree")


def fixed(fn: Callable[[], Awaitable[object]]) -> Callable[[int, int], Awaitable[Op]]:
    """A `Side` setup that times ``fn`` as it is (the data does not change between rounds)."""

    async def setup(r: int, n: int) -> Op:
        return fn

    return setup


def _drop_rows(rows: object) -> None:
    """A fold that keeps nothing: `fold_payloads` timed on its own."""


async def rebuild_breakdown(bench: ReadBench, n_events: int, repeats: int) -> dict[str, Any]:
    """Where a rebuild's time goes, per event: each stage timed alone (median of ``repeats``)."""
    p, store, client, thread = bench.projector, bench.store, bench.client, bench.big
    stages: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        stages.setdefault(name, []).append(seconds / n_events * 1e6)

    async def xrange_only() -> None:
        lo: bytes | str = "-"
        while True:
            batch = await client.xrange(bench.log_key, lo, "+", count=READ_BATCH)
            if len(batch) < READ_BATCH:
                return
            lo = b"(" + batch[-1][0]

    for _ in range(repeats):
        t0 = time.perf_counter()
        await xrange_only()
        add(
            f"XRANGE, batches of {READ_BATCH} (server + hiredis + redis-py)",
            time.perf_counter() - t0,
        )
        t0 = time.perf_counter()
        async for _batch in store.read_batches(thread):
            pass
        add("store.read_batches: XRANGE (read-ahead) + decode_rows", time.perf_counter() - t0)
        t0 = time.perf_counter()
        await store.fold_payloads(thread, _drop_rows)
        add(
            "store.fold_payloads: XRANGE (read-ahead) + decode_payload_rows",
            time.perf_counter() - t0,
        )
        t0 = time.perf_counter()
        folded = await p.fold(thread)
        add("fold: fold_payloads + apply_payload (by event type)", time.perf_counter() - t0)
        t0 = time.perf_counter()
        ops = [op for proj in p.projections for op in proj.materialize(folded.states[proj.name])]
        add("materialize (encode view values)", time.perf_counter() - t0)
        await client.config_resetstat()
        t0 = time.perf_counter()
        await store.load_views(thread, ops, expected_version=folded.version)
        add("load_views (chunks to staging keys + swap script)", time.perf_counter() - t0)
        stats = await client.info("commandstats")
        # The commands the load sends itself (the swap script's own calls are in EVALSHA's).
        sent = ("evalsha", "hget", "rpush", "hset", "pexpire")
        server = sum(float(stats.get(f"cmdstat_{c}", {}).get("usec", 0)) for c in sent)
        add("  of which on the server", server / 1e6)

    # Per-event CPU of decode_entry's parts, on a sample of stored entries.
    sample = (await client.xrange(bench.log_key, "-", "+", count=2000))[:2000]
    payloads = [f[b"d"] for _, f in sample]
    ids = [f[b"i"] for _, f in sample]
    m = len(sample)

    def decode_all() -> None:
        for entry_id, fields in sample:
            decode_entry(thread, entry_id, fields, registry)

    raw_sample = await client.execute_command(b"XRANGE", bench.log_key, "-", "+", b"COUNT", 2000)

    def decode_batch() -> None:
        for i in range(0, len(raw_sample), READ_BATCH):
            decode_rows(thread, raw_sample[i : i + READ_BATCH], registry)

    def decode_payload_batch() -> None:
        for i in range(0, len(raw_sample), READ_BATCH):
            decode_payload_rows(thread, raw_sample[i : i + READ_BATCH], registry)

    def payload_only() -> None:
        decode = bench.payload_decoder.decode
        for d in payloads:
            decode(d)

    def registry_decode() -> None:
        for d in payloads:
            registry.decode(d, 1)

    def ulid_strings() -> None:
        for raw in ids:
            str(ULID.from_bytes(raw))

    def ulid_fast() -> None:
        for raw in ids:
            ulid_text(raw)

    cpu = {
        "decode_rows (the bulk path, raw replies)": time_cpu(decode_batch, n=3, batches=5) / m,
        "decode_payload_rows (a rebuild's bulk path: no RecordedEvent)": (
            time_cpu(decode_payload_batch, n=3, batches=5) / m
        ),
        "decode_entry (one entry, dict fields)": time_cpu(decode_all, n=3, batches=5) / m,
        "  registry.decode (payload)": time_cpu(registry_decode, n=3, batches=5) / m,
        "  event id text (threadlog's own base32)": time_cpu(ulid_fast, n=3, batches=5) / m,
        "  str(ULID.from_bytes(id)) (python-ulid, for scale)": (
            time_cpu(ulid_strings, n=3, batches=5) / m
        ),
        "raw side: msgspec decode (payload)": time_cpu(payload_only, n=3, batches=5) / m,
    }
    return {
        "stages_us_per_event": {k: round(statistics.median(v), 2) for k, v in stages.items()},
        "cpu_us_per_event": {k: round(v, 2) for k, v in cpu.items()},
    }


async def last_cpu_parts(bench: ReadBench) -> dict[str, float]:
    """Client CPU of the window read's parts that the two sides do differently (us per call)."""
    client = bench.client
    raws = await client.lrange(bench.messages_key, -WINDOW, -1)
    read = MessagesProjection.window_read(WINDOW)
    conn = client.connection_pool.make_connection()
    keys = [bench.store.keys.meta(bench.window), bench.messages_key]
    args = [1, "lr", 2, -WINDOW, -1]
    decode = bench.msg_decoder.decode

    def raw_decode() -> object:
        return [(int(h), decode(v)) for h, _, v in (r.partition(b":") for r in raws)]

    def tl_decode() -> object:
        return MessagesProjection.parse(decode_view_result(bench.window, read, raws))

    return {
        "raw: split stamps + msgspec decode x6": round(time_cpu(raw_decode), 2),
        "threadlog: decode_view_result + MessagesProjection.parse": round(time_cpu(tl_decode), 2),
        "raw: pack LRANGE": round(
            time_cpu(lambda: conn.pack_command("LRANGE", keys[1], -6, -1)), 2
        ),
        "threadlog: pack EVALSHA read_views": round(
            time_cpu(lambda: conn.pack_command("EVALSHA", "0" * 40, 2, *keys, *args)), 2
        ),
        "threadlog: key layout + read args": round(
            time_cpu(
                lambda: (
                    bench.store.keys.meta(bench.window),
                    bench.store.keys.view(bench.window, "messages"),
                )
            ),
            2,
        ),
    }


async def _run(
    quick: bool, *, rounds: int | None, ops: int | None, progress: bool
) -> dict[str, Any]:
    mode = QUICK if quick else FULL
    mode = Mode(mode.name, rounds or mode.rounds, ops or mode.ops, mode.warmup)
    n_events = REBUILD_EVENTS[mode.name]
    rebuild_rounds = REBUILD_ROUNDS[mode.name] if rounds is None else max(2, rounds // 6)
    env = environment()
    with redis_server() as server:
        store = await connect(server.url, namespace="bench", partitions=16)
        assert isinstance(store, RedisEventStore)
        try:
            info = await store.client.info("server")
            bench = ReadBench(store, "read-window", "read-big")
            t0 = time.perf_counter()
            await write_log(bench.projector, bench.window, agent_log(WINDOW_TURNS * 7 // 2))
            await write_log(bench.projector, bench.big, agent_log(n_events))
            built_s = time.perf_counter() - t0
            await bench.check_same_answers()
            print(
                f"bench.read ({mode.name}): {mode.rounds} rounds x {mode.ops} ops per side; "
                f"rebuild: {n_events:,} events x {rebuild_rounds} rounds; redis "
                f"{info['redis_version']} on a unix socket (data written in {built_s:.1f} s)",
                file=sys.stderr,
            )

            last = await measure(
                [
                    Side(TL_LAST, fixed(bench.tl_last)),
                    Side(RAW_LAST, fixed(bench.raw_last)),
                    Side(WHATIF_LAST, fixed(bench.whatif_last)),
                ],
                rounds=mode.rounds,
                ops=mode.ops,
                warmup=mode.warmup,
                progress=progress,
            )
            context = await measure(
                [
                    Side(TL_CONTEXT, fixed(bench.tl_context)),
                    Side(TL_THREE, fixed(bench.tl_three)),
                    Side(RAW_CONTEXT, fixed(bench.raw_context)),
                ],
                rounds=mode.rounds,
                ops=max(mode.ops // 2, 1),
                warmup=mode.warmup // 2,
                progress=progress,
            )
            rebuild = await measure(
                [
                    Side(TL_REBUILD, fixed(bench.tl_rebuild)),
                    Side(TL_FOLD, fixed(bench.tl_fold)),
                    Side(RAW_SCAN, fixed(bench.raw_scan)),
                ],
                rounds=rebuild_rounds,
                ops=1,
                warmup=1,
                progress=progress,
            )
            report = await bench.projector.check(bench.big)
            if not report.ok:
                raise RuntimeError(f"views differ from the log after rebuild: {report}")

            n_prof = 300 if quick else 2000
            profile = {
                "last(6)": {
                    TL_LAST: await profile_op(
                        store.client, bench.tl_last, n_prof, direct=["evalsha"]
                    ),
                    RAW_LAST: await profile_op(store.client, bench.raw_last, n_prof),
                    WHATIF_LAST: await profile_op(store.client, bench.whatif_last, n_prof),
                },
                "context": {
                    TL_CONTEXT: await profile_op(
                        store.client, bench.tl_context, n_prof, direct=["evalsha"]
                    ),
                    TL_THREE: await profile_op(
                        store.client, bench.tl_three, n_prof, direct=["evalsha"]
                    ),
                    RAW_CONTEXT: await profile_op(store.client, bench.raw_context, n_prof),
                },
                "rebuild": {
                    TL_REBUILD: await profile_op(
                        store.client,
                        bench.tl_rebuild,
                        1,
                        direct=["evalsha", "hget", "xrange", "rpush", "hset", "pexpire"],
                    ),
                    RAW_SCAN: await profile_op(store.client, bench.raw_scan, 1),
                },
            }
            cpu_parts = await last_cpu_parts(bench)
            breakdown = await rebuild_breakdown(bench, n_events, 1 if quick else 2)
            env.update(
                redis_server=info["redis_version"],
                transport="unix socket",
                redis_py=redis.__version__,
            )
        finally:
            await store.close()
    env["loadavg_at_end"] = loadavg()

    # -- tables ------------------------------------------------------------------------------
    rows = op_rows("last(thread, 6)", last) + op_rows("context (6 msgs, view, 3 records)", context)
    rows += op_rows(f"rebuild, {n_events:,} events", rebuild)
    print_block(f"Read paths ({RATIO_NOTE})", OP_HEADERS, rows)

    throughput_rows = []
    for s in rebuild.sides:
        seconds = s.median_round_us / 1e6
        throughput_rows.append(
            [s.name, f"{seconds:.3f}", f"{n_events / seconds:,.0f}", f"{rebuild.ratio(s):.2f}x"]
        )
    tp_headers = ("side", "s per pass", "events/s", "ratio")
    print_block(
        f"Rebuild throughput, {n_events:,}-event thread (median of {rebuild_rounds} rounds)",
        tp_headers,
        throughput_rows,
    )

    last_ratio = paired_ratio(last, TL_LAST, RAW_LAST)  # threadlog time / raw time
    # raw time / threadlog time, which is threadlog events/s over raw events/s
    rebuild_ratio = paired_ratio(rebuild, RAW_SCAN, TL_REBUILD)
    targets: list[dict[str, Any]] = [
        {
            "name": "last(6) threadlog time / raw LRANGE+decode time",
            "value": round(last_ratio, 3),
            "target": f"<= {TARGET_LAST}",
            "met": last_ratio <= TARGET_LAST,
        },
        {
            "name": "rebuild events/s threadlog / raw XRANGE+decode",
            "value": round(rebuild_ratio, 3),
            "target": f">= {TARGET_REBUILD}",
            "met": rebuild_ratio >= TARGET_REBUILD,
        },
    ]
    verdict_lines = [
        f"{verdict(t['met'])} target: {t['name']} = {t['value']:.2f}x (target {t['target']}x)"
        for t in targets
    ]
    whatif = paired_ratio(last, WHATIF_LAST, RAW_LAST)
    verdict_lines.append(
        f"(information) without the read script, last(6) would be {whatif:.2f}x the raw time: "
        "threadlog's parse over a plain LRANGE"
    )

    prof_rows = [
        profile_row(op, side, p) for op, sides in profile.items() for side, p in sides.items()
    ]
    print_block(
        "Profile (untimed pass, one side at a time; server time from INFO commandstats; "
        "client CPU = process CPU time per op)",
        PROFILE_HEADERS,
        prof_rows,
    )
    cpu_rows = [[k, f"{v:.2f}"] for k, v in cpu_parts.items()]
    print_block("last(6): client CPU of the parts that differ", ("part", "us/call"), cpu_rows)
    stage_rows = [[k, f"{v:.2f}"] for k, v in breakdown["stages_us_per_event"].items()]
    stage_rows += [[k, f"{v:.2f}"] for k, v in breakdown["cpu_us_per_event"].items()]
    print_block(
        "Rebuild: where the time goes (each stage timed alone; CPU rows: fastest batch)",
        ("stage", "us/event"),
        stage_rows,
    )
    print()
    for line in verdict_lines:
        print(line)

    return {
        "benchmark": "read",
        "mode": mode.name,
        "rounds": mode.rounds,
        "ops_per_round": mode.ops,
        "context_ops_per_round": max(mode.ops // 2, 1),
        "warmup": mode.warmup,
        "rebuild_events": n_events,
        "rebuild_rounds": rebuild_rounds,
        "ratio_convention": RATIO_NOTE,
        "operations": {
            "last(6)": last.summary(),
            "context": context.summary(),
            "rebuild": {
                **rebuild.summary(),
                "events_per_s": {
                    s.name: round(n_events / (s.median_round_us / 1e6)) for s in rebuild.sides
                },
            },
        },
        "targets": targets,
        "profile": profile,
        "last_cpu_parts_us": cpu_parts,
        "rebuild_breakdown": breakdown,
        "environment": env,
        "tables": {
            "operations": rows,
            "throughput": throughput_rows,
            "profile": prof_rows,
            "last_cpu": cpu_rows,
            "rebuild_stages": stage_rows,
        },
        "verdicts": verdict_lines,
    }


def run(
    quick: bool, *, rounds: int | None = None, ops: int | None = None, progress: bool = True
) -> dict[str, Any]:
    """Run the benchmark, print its tables and return its JSON summary."""
    return asyncio.run(_run(quick, rounds=rounds, ops=ops, progress=progress))


def markdown(summary: dict[str, Any]) -> str:
    """The RESULTS.md section body for a summary returned by `run`."""
    t = summary["tables"]
    env = summary["environment"]
    out = [
        f"Mode `{summary['mode']}`: {summary['rounds']} rounds x {summary['ops_per_round']} ops "
        f"per side (context: {summary['context_ops_per_round']}), rebuild of a "
        f"{summary['rebuild_events']:,}-event thread x {summary['rebuild_rounds']} rounds; "
        f"redis {env.get('redis_server')} on a unix socket, redis-py {env.get('redis_py')}, "
        f"Python {env['python']}, {env['cpus']} CPUs, load {env['loadavg_at_start']} at start.",
        "",
        f"{summary['ratio_convention']}.",
        "",
        markdown_table(OP_HEADERS, t["operations"]),
        "",
        markdown_table(("side", "s per pass", "events/s", "ratio"), t["throughput"]),
        "",
        *[f"- {line}" for line in summary["verdicts"]],
        "",
        "Profile (untimed, one side at a time):",
        "",
        markdown_table(PROFILE_HEADERS, t["profile"]),
        "",
        markdown_table(("last(6) part", "us/call"), t["last_cpu"]),
        "",
        markdown_table(("rebuild stage", "us/event"), t["rebuild_stages"]),
    ]
    return "\n".join(out)


class RunFn(Protocol):
    def __call__(
        self, quick: bool, *, rounds: int | None = ..., ops: int | None = ..., progress: bool = ...
    ) -> dict[str, Any]: ...


def bench_main(name: str, run: RunFn, argv: list[str] | None) -> int:
    """The command line of one paired-timing benchmark: run it, write its JSON summary."""
    from .__main__ import record_run

    args = arg_parser(f"python -m bench.{name}").parse_args(argv)
    t0 = time.perf_counter()
    summary = run(args.quick, rounds=args.rounds, ops=args.ops, progress=not args.quiet)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    record_run(name, summary, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("read", run, argv)


if __name__ == "__main__":
    sys.exit(main())
