"""Framework adapters: threadlog's OpenAI Agents SDK session and LangGraph checkpointer beside
the SDK's own RedisSession and langgraph-checkpoint-plainredis, on one Redis.

Run ``python -m bench.frameworks [--quick]``. One private redis-server (unix socket) serves
every side; the peers get their own redis.asyncio client (hiredis), as an application would.

* SDK session: `adapters.openai_agents.ThreadlogSession` beside
  ``agents.extensions.memory.RedisSession``: ``add_items`` of one item per call (~450
  characters; user messages and assistant output messages alternate), ``get_items()`` of a
  100-item session and ``get_items(limit=6)`` of the same session.
* Checkpointer: `adapters.langgraph.ThreadlogCheckpointSaver` beside
  ``langgraph_checkpoint_plainredis.AsyncRedisSaver`` (a saver for plain Redis, no modules),
  through their async API with identical checkpoints: a chat graph's channels (``messages``, a
  list that grows by one LangChain message per step; ``plan``, a dict updated every third step;
  ``step``, an int) and LangGraph's metadata. Each saver numbers channel versions with its own
  ``get_next_version``, as LangGraph would ask it to. ``aput`` is the mean over a
  60-step conversation that starts empty (each round a new thread); ``aget_tuple`` reads the
  latest checkpoint of a 60-message thread. Both use the default serializer
  (``JsonPlusSerializer``).

Ratios are the peer's time over threadlog's time (>1: threadlog is faster), the median of
per-round paired ratios. Target: ahead on every row.
"""

from __future__ import annotations

import asyncio
import sys
from datetime import UTC, datetime
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from agents.extensions.memory.redis_session import RedisSession
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    LATEST_VERSION,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
)
from langgraph.checkpoint.base.id import uuid6
from langgraph_checkpoint_plainredis import AsyncRedisSaver

from adapters.langgraph import ThreadlogCheckpointSaver
from adapters.openai_agents import ThreadlogSession
from eventstore import RedisEventStore, connect
from eventstore.servers import redis_server

from ._common import (
    Comparison,
    Op,
    Side,
    environment,
    loadavg,
    markdown_table,
    measure,
)
from .read import (
    OP_HEADERS,
    PROFILE_HEADERS,
    RATIO_NOTE,
    bench_main,
    op_rows,
    paired_ratio,
    print_block,
    profile_row,
    profile_side,
    prose,
    verdict,
)

SESSION_ITEMS = 100
WINDOW = 6
STEPS = 60


class Rows:
    """Rounds and ops per round of a mode (``--rounds``/``--ops`` override rounds and SDK ops)."""

    def __init__(self, name: str, rounds: int, sdk: int, get: int, warmup: int) -> None:
        self.name, self.rounds, self.sdk, self.get, self.warmup = name, rounds, sdk, get, warmup


QUICK = Rows("quick", rounds=4, sdk=200, get=60, warmup=60)
FULL = Rows("default", rounds=20, sdk=500, get=200, warmup=200)

TL_ADD = "threadlog ThreadlogSession.add_items"
SDK_ADD = "SDK RedisSession.add_items"
TL_GET = "threadlog ThreadlogSession.get_items()"
SDK_GET = "SDK RedisSession.get_items()"
TL_WIN = "threadlog get_items(limit=6)"
SDK_WIN = "SDK get_items(limit=6)"
TL_PUT = "threadlog ThreadlogCheckpointSaver.aput"
LG_PUT = "plainredis AsyncRedisSaver.aput"
TL_TUPLE = "threadlog aget_tuple"
LG_TUPLE = "plainredis aget_tuple"


def sdk_item(i: int) -> Any:
    """An input item as the SDK stores it: user messages and assistant output messages."""
    text = prose(i)
    if i % 2 == 0:
        return {"role": "user", "content": text}
    return {
        "id": f"msg_{i:08d}",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def chat_message(i: int) -> BaseMessage:
    if i % 2 == 0:
        return HumanMessage(content=prose(i), id=f"human-{i}")
    return AIMessage(
        content=prose(i),
        id=f"ai-{i}",
        response_metadata={"model_name": "gpt-4o-mini", "finish_reason": "stop"},
    )


Step = tuple[RunnableConfig, Checkpoint, CheckpointMetadata, ChannelVersions]


def conversation(saver: BaseCheckpointSaver[Any], thread: str, steps: int) -> list[Step]:
    """The ``aput`` calls of a chat graph over ``steps`` steps, versions numbered by ``saver``."""
    messages: list[BaseMessage] = []
    versions: dict[str, Any] = {}
    parent: str | None = None
    out: list[Step] = []
    plan: dict[str, Any] = {"goal": "book the trip", "done": []}
    for step in range(steps):
        messages = [*messages, chat_message(step)]
        changed = ["messages", "step"]
        if step % 3 == 0:
            plan = {"goal": plan["goal"], "done": [*plan["done"], f"task {step}"]}
            changed.append("plan")
        new_versions: dict[str, Any] = {}
        for ch in changed:
            versions[ch] = new_versions[ch] = saver.get_next_version(versions.get(ch), None)
        checkpoint = Checkpoint(
            v=LATEST_VERSION,
            id=str(uuid6(clock_seq=step)),
            ts=datetime.now(UTC).isoformat(),
            channel_values={"messages": messages, "plan": plan, "step": step},
            channel_versions=dict(versions),
            versions_seen={"agent": dict(versions), "__input__": {}},
            updated_channels=changed,
        )
        configurable: dict[str, Any] = {"thread_id": thread, "checkpoint_ns": ""}
        if parent is not None:
            configurable["checkpoint_id"] = parent
        metadata = cast(CheckpointMetadata, {"source": "loop", "step": step, "parents": {}})
        out.append(({"configurable": configurable}, checkpoint, metadata, new_versions))
        parent = checkpoint["id"]
    return out


class FrameworksBench:
    def __init__(self, store: RedisEventStore, peer_client: Any) -> None:
        self.store = store
        self.peer_client = peer_client
        self.items = [sdk_item(i) for i in range(SESSION_ITEMS)]
        self.tl_saver = ThreadlogCheckpointSaver(store)
        self.lg_saver = AsyncRedisSaver(client=peer_client)
        self.tl_session = ThreadlogSession("sdk-100", store)
        self.sdk_session = RedisSession("sdk-100", redis_client=peer_client)

    async def populate(self) -> None:
        await self.tl_session.add_items(self.items)
        await self.sdk_session.add_items(self.items)
        for saver, thread in ((self.tl_saver, "lg-read"), (self.lg_saver, "lg-read")):
            for config, checkpoint, metadata, new_versions in conversation(saver, thread, STEPS):
                await saver.aput(config, checkpoint, metadata, new_versions)

    async def check_same_data(self) -> None:
        """The sides must hold the same data, or the comparison means nothing."""
        if await self.tl_session.get_items() != await self.sdk_session.get_items():
            raise RuntimeError("the two SDK sessions hold different items")
        config: RunnableConfig = {"configurable": {"thread_id": "lg-read", "checkpoint_ns": ""}}
        a, b = await self.tl_saver.aget_tuple(config), await self.lg_saver.aget_tuple(config)
        if a is None or b is None:
            raise RuntimeError("a saver lost the benchmark's checkpoint")
        if a.checkpoint["channel_values"] != b.checkpoint["channel_values"]:
            raise RuntimeError("the two savers return different channel values")
        if len(a.checkpoint["channel_values"]["messages"]) != STEPS:
            raise RuntimeError("the checkpoint does not hold the whole conversation")

    # -- SDK sessions ------------------------------------------------------------------------

    async def setup_tl_add(self, r: int, n: int) -> Op:
        session, items = ThreadlogSession(f"sdk-add-{r}", self.store), self.items
        i = r * n

        async def op() -> None:
            nonlocal i
            await session.add_items([items[i % SESSION_ITEMS]])
            i += 1

        return op

    async def teardown_tl_add(self, r: int) -> None:
        await ThreadlogSession(f"sdk-add-{r}", self.store).delete()

    async def setup_sdk_add(self, r: int, n: int) -> Op:
        session, items = RedisSession(f"sdk-add-{r}", redis_client=self.peer_client), self.items
        i = r * n

        async def op() -> None:
            nonlocal i
            await session.add_items([items[i % SESSION_ITEMS]])
            i += 1

        return op

    async def teardown_sdk_add(self, r: int) -> None:
        await RedisSession(f"sdk-add-{r}", redis_client=self.peer_client).clear_session()

    async def tl_get(self) -> object:
        return await self.tl_session.get_items()

    async def sdk_get(self) -> object:
        return await self.sdk_session.get_items()

    async def tl_win(self) -> object:
        return await self.tl_session.get_items(limit=WINDOW)

    async def sdk_win(self) -> object:
        return await self.sdk_session.get_items(limit=WINDOW)

    # -- checkpointers -----------------------------------------------------------------------

    def _put_setup(self, saver: BaseCheckpointSaver[Any], prefix: str) -> Any:
        async def setup(r: int, n: int) -> Op:
            steps = iter(conversation(saver, f"{prefix}-{r}", n))

            async def op() -> None:
                await saver.aput(*next(steps))

            return op

        return setup

    def _put_teardown(self, saver: BaseCheckpointSaver[Any], prefix: str) -> Any:
        async def teardown(r: int) -> None:
            await saver.adelete_thread(f"{prefix}-{r}")

        return teardown

    def put_sides(self) -> list[Side]:
        return [
            Side(
                TL_PUT,
                self._put_setup(self.tl_saver, "put-tl"),
                self._put_teardown(self.tl_saver, "put-tl"),
            ),
            Side(
                LG_PUT,
                self._put_setup(self.lg_saver, "put-lg"),
                self._put_teardown(self.lg_saver, "put-lg"),
            ),
        ]

    async def tl_tuple(self) -> object:
        return await self.tl_saver.aget_tuple(
            {"configurable": {"thread_id": "lg-read", "checkpoint_ns": ""}}
        )

    async def lg_tuple(self) -> object:
        return await self.lg_saver.aget_tuple(
            {"configurable": {"thread_id": "lg-read", "checkpoint_ns": ""}}
        )


def fixed(op: Op) -> Any:
    async def setup(r: int, n: int) -> Op:
        return op

    return setup


async def _run(
    quick: bool, *, rounds: int | None, ops: int | None, progress: bool
) -> dict[str, Any]:
    base = QUICK if quick else FULL
    m = Rows(base.name, rounds or base.rounds, ops or base.sdk, ops or base.get, base.warmup)
    env = environment()
    with redis_server() as server:
        store = await connect(server.url, namespace="bench", partitions=16)
        assert isinstance(store, RedisEventStore)
        peer_client = aioredis.from_url(server.url)
        bench = FrameworksBench(store, peer_client)
        try:
            info = await store.client.info("server")
            await bench.populate()
            await bench.check_same_data()
            print(
                f"bench.frameworks ({m.name}): {m.rounds} rounds; ops per round: SDK {m.sdk}, "
                f"aput {STEPS} (one conversation), aget_tuple {m.get}; redis "
                f"{info['redis_version']} on a unix socket",
                file=sys.stderr,
            )
            add = await measure(
                [
                    Side(TL_ADD, bench.setup_tl_add, bench.teardown_tl_add),
                    Side(SDK_ADD, bench.setup_sdk_add, bench.teardown_sdk_add),
                ],
                rounds=m.rounds,
                ops=m.sdk,
                warmup=m.warmup,
                progress=progress,
            )
            get = await measure(
                [Side(TL_GET, fixed(bench.tl_get)), Side(SDK_GET, fixed(bench.sdk_get))],
                rounds=m.rounds,
                ops=m.get,
                warmup=m.warmup,
                progress=progress,
            )
            win = await measure(
                [Side(TL_WIN, fixed(bench.tl_win)), Side(SDK_WIN, fixed(bench.sdk_win))],
                rounds=m.rounds,
                ops=m.sdk,
                warmup=m.warmup,
                progress=progress,
            )
            put = await measure(
                bench.put_sides(), rounds=m.rounds, ops=STEPS, warmup=STEPS, progress=progress
            )
            tup = await measure(
                [Side(TL_TUPLE, fixed(bench.tl_tuple)), Side(LG_TUPLE, fixed(bench.lg_tuple))],
                rounds=m.rounds,
                ops=m.get,
                warmup=m.warmup,
                progress=progress,
            )

            c = store.client
            tl = ["evalsha"]
            n_fast, n_slow = (100, STEPS) if quick else (500, STEPS)
            put_sides = bench.put_sides()
            profile: dict[str, dict[str, Any]] = {
                "add_items": {
                    TL_ADD: await profile_side(
                        c,
                        Side(TL_ADD, bench.setup_tl_add, bench.teardown_tl_add),
                        n_fast,
                        direct=tl,
                    ),
                    SDK_ADD: await profile_side(
                        c, Side(SDK_ADD, bench.setup_sdk_add, bench.teardown_sdk_add), n_fast
                    ),
                },
                "get_items()": {
                    TL_GET: await profile_side(
                        c, Side(TL_GET, fixed(bench.tl_get)), n_fast, direct=tl
                    ),
                    SDK_GET: await profile_side(c, Side(SDK_GET, fixed(bench.sdk_get)), n_fast),
                },
                "get_items(limit=6)": {
                    TL_WIN: await profile_side(
                        c, Side(TL_WIN, fixed(bench.tl_win)), n_fast, direct=tl
                    ),
                    SDK_WIN: await profile_side(c, Side(SDK_WIN, fixed(bench.sdk_win)), n_fast),
                },
                "aput": {
                    TL_PUT: await profile_side(c, put_sides[0], n_slow, direct=tl),
                    LG_PUT: await profile_side(c, put_sides[1], n_slow),
                },
                "aget_tuple": {
                    TL_TUPLE: await profile_side(
                        c, Side(TL_TUPLE, fixed(bench.tl_tuple)), n_fast, direct=tl
                    ),
                    LG_TUPLE: await profile_side(c, Side(LG_TUPLE, fixed(bench.lg_tuple)), n_fast),
                },
            }
            env.update(
                redis_server=info["redis_version"],
                transport="unix socket",
                redis_py=redis.__version__,
                packages=_versions(),
            )
        finally:
            await peer_client.aclose()
            await store.close()
    env["loadavg_at_end"] = loadavg()
    return report(m, {"add": add, "get": get, "win": win, "put": put, "tuple": tup}, profile, env)


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    names = (
        "openai-agents",
        "langgraph",
        "langgraph-checkpoint",
        "langgraph-checkpoint-plainredis",
    )
    return {p: version(p) for p in names}


ROWS = {
    "add": ("add_items (1 item)", TL_ADD, SDK_ADD),
    "get": (f"get_items() of {SESSION_ITEMS} items", TL_GET, SDK_GET),
    "win": ("get_items(limit=6)", TL_WIN, SDK_WIN),
    "put": (f"aput (mean over a {STEPS}-step conversation)", TL_PUT, LG_PUT),
    "tuple": (f"aget_tuple (latest, {STEPS} messages)", TL_TUPLE, LG_TUPLE),
}


def report(
    m: Rows,
    comparisons: dict[str, Comparison],
    profile: dict[str, dict[str, Any]],
    env: dict[str, Any],
) -> dict[str, Any]:
    rows: list[list[str]] = []
    targets: list[dict[str, Any]] = []
    for key, (label, tl, peer) in ROWS.items():
        rows += op_rows(label, comparisons[key])
        value = paired_ratio(comparisons[key], peer, tl)
        targets.append(
            {
                "row": label,
                "peer": peer,
                "value": round(value, 3),
                "target": "> 1",
                "met": value > 1,
            }
        )
    print_block(f"Framework adapters ({RATIO_NOTE})", OP_HEADERS, rows)
    verdicts = [
        f"{verdict(t['met'])} target ({t['row']}): {t['peer']} / threadlog = {t['value']:.2f}x "
        f"(target {t['target']}x)"
        for t in targets
    ]
    prof_rows = [
        profile_row(op, side, p) for op, sides in profile.items() for side, p in sides.items()
    ]
    print_block(
        "Profile (untimed pass, one side at a time; server time from INFO commandstats; "
        "client CPU = process CPU time per op)",
        PROFILE_HEADERS,
        prof_rows,
    )

    print()
    for line in verdicts:
        print(line)
    return {
        "benchmark": "frameworks",
        "mode": m.name,
        "rounds": m.rounds,
        "ops_per_round": {"sdk": m.sdk, "get": m.get, "aput": STEPS, "aget_tuple": m.get},
        "session_items": SESSION_ITEMS,
        "conversation_steps": STEPS,
        "ratio_convention": RATIO_NOTE,
        "operations": {key: c.summary() for key, c in comparisons.items()},
        "targets": targets,
        "profile": profile,
        "environment": env,
        "tables": {"operations": rows, "profile": prof_rows},
        "verdicts": verdicts,
    }


def run(
    quick: bool, *, rounds: int | None = None, ops: int | None = None, progress: bool = True
) -> dict[str, Any]:
    """Run the benchmark, print its tables and return its JSON summary."""
    return asyncio.run(_run(quick, rounds=rounds, ops=ops, progress=progress))


def markdown(summary: dict[str, Any]) -> str:
    """The RESULTS.md section body for a summary returned by `run`."""
    env = summary["environment"]
    ops = summary["ops_per_round"]
    packages = ", ".join(f"{k} {v}" for k, v in env.get("packages", {}).items())
    out = [
        f"Mode `{summary['mode']}`: {summary['rounds']} rounds; ops per round: SDK {ops['sdk']}, "
        f"aput {ops['aput']} (one conversation per round), aget_tuple {ops['aget_tuple']}; "
        f"redis {env.get('redis_server')} on a unix socket, redis-py {env.get('redis_py')}, "
        f"{packages}; {env['cpus']} CPUs, load {env['loadavg_at_start']} at start.",
        "",
        f"{summary['ratio_convention']}.",
        "",
        markdown_table(OP_HEADERS, summary["tables"]["operations"]),
        "",
        *[f"- {line}" for line in summary["verdicts"]],
        "",
        "Profile (untimed, one side at a time):",
        "",
        markdown_table(PROFILE_HEADERS, summary["tables"]["profile"]),
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    return bench_main("frameworks", run, argv)


if __name__ == "__main__":
    sys.exit(main())
