"""Session stores: threadlog beside the OpenAI Agents SDK's RedisSession and LangChain's
RedisChatMessageHistory, on one Redis, with the same messages.

Run ``python -m bench.session [--quick]``. One private redis-server (unix socket) serves every
side. Messages are ~450 characters, alternating user and assistant; each side stores them in its
own native form (threadlog `Message`, SDK input items ``{"role", "content"}``, LangChain
``HumanMessage``/``AIMessage``). Rows:

* append one message: `SessionStore.append` (the transcript the load row reads; the baseline)
  and `ThreadStore.append_message` (the conversation the window row reads) beside
  ``RedisSession.add_items([item])`` and LangChain ``add_message`` / ``aadd_messages``;
* append to 64 sessions at once (informational, no target): one message to each of 64
  sessions, the calls started together, as an agent server appends for its open sessions;
  LangChain's sync method runs them one after another (each call blocks the event loop);
* load a 1,000-message transcript: `SessionStore.load` beside ``RedisSession.get_items()`` and
  LangChain ``messages`` / ``aget_messages()``;
* the last 6 messages: `ThreadStore.list_messages(limit=6)` beside
  ``RedisSession.get_items(limit=6)``; LangChain has no windowed read, so its side reads the
  whole 1,000-message history and slices it (timed with fewer ops, in its own pairing).

The append row carries two informational floors: LangChain's own ``LPUSH``, packed once and
sent with no client work, on asyncio streams and on a blocking socket. A floor plus the server
time threadlog's append script spends over an ``LPUSH`` is the least any append running that
script could take; the run prints whether that already exceeds LangChain's synchronous call.

The load and window rows carry an informational "what-if" side: threadlog's own parsing over a
plain ``LRANGE`` of the same view, i.e. what those reads would cost without the read script.

LangChain's class is synchronous (a blocking redis-py client). Its sync methods are timed as
called directly from the event loop (the cheapest way to use it, though it blocks the loop);
its async methods are the base class's defaults, which run the sync ones in a thread pool.
The SDK's RedisSession gets its own redis.asyncio client (hiredis), as an application would.

Ratios are another side's time over threadlog's time (>1: threadlog is faster), the median of
per-round paired ratios. Targets: faster than both peers on every row, and at least 3x faster
than ``RedisSession.add_items`` on the append row.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import warnings
from collections.abc import Awaitable, Callable
from typing import Any, cast

import hiredis
import redis
import redis.asyncio as aioredis
from agents.extensions.memory.redis_session import RedisSession
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, message_to_dict

from adapters import SessionStore, ThreadStore
from eventstore import (
    ListRange,
    Message,
    MessageAppended,
    NewEvent,
    RedisEventStore,
    Role,
    connect,
)
from eventstore._scripts import APPEND
from eventstore._views import decode_view_result
from eventstore._wire import pack_command, pack_script_call
from eventstore.servers import redis_server
from projections import MessagesProjection, TranscriptProjection

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

with warnings.catch_warnings():
    # langchain-community warns on import that it is being sunset; the class still works.
    warnings.simplefilter("ignore", DeprecationWarning)
    from langchain_community.chat_message_histories import RedisChatMessageHistory

N_MESSAGES = 1000
WINDOW = 6
TARGET_ADD_ITEMS = 3.0
CONCURRENT = 64  # sessions appended to at once in the "many sessions" append row


class Rows:
    """Rounds and ops per round of each row of a mode (flags may override rounds and ops)."""

    def __init__(
        self, name: str, rounds: int, append: int, load: int, window: int, warmup: int, many: int
    ) -> None:
        self.name, self.rounds, self.append, self.load = name, rounds, append, load
        self.window, self.warmup, self.many = window, warmup, many


QUICK = Rows("quick", rounds=3, append=200, load=8, window=200, warmup=100, many=8)
FULL = Rows("default", rounds=15, append=500, load=20, window=500, warmup=300, many=20)

TL_APPEND = "threadlog SessionStore.append"
TL_APPEND_MSG = "threadlog ThreadStore.append_message"
SDK_ADD = "SDK RedisSession.add_items"
LC_ADD = "LangChain add_message (sync)"
LC_AADD = "LangChain aadd_messages (async)"
TL_LOAD = "threadlog SessionStore.load"
SDK_GET = "SDK RedisSession.get_items()"
LC_GET = "LangChain messages (sync)"
LC_AGET = "LangChain aget_messages() (async)"
TL_WINDOW = "threadlog list_messages(limit=6)"
SDK_WINDOW = "SDK get_items(limit=6)"
LC_WINDOW = "LangChain messages[-6:] (sync)"
LC_AWINDOW = "LangChain aget_messages()[-6:]"
WHATIF_APPEND = "what-if: SessionStore.append, blocking I/O"
FLOOR_AIO = "floor: packed LPUSH, asyncio round trip"
FLOOR_SYNC = "floor: packed LPUSH, blocking round trip"
FLOORS = (FLOOR_AIO, FLOOR_SYNC)
PEERS = {SDK_ADD, LC_ADD, LC_AADD}  # the append sides that are not threadlog's own calls
WHATIF_LOAD = "what-if: LRANGE + threadlog parse"
WHATIF_WINDOW = "what-if: LRANGE + threadlog parse"


def role(i: int) -> Role:
    return "user" if i % 2 == 0 else "assistant"


class BlockingAppends:
    """What `SessionStore.append` would cost on a synchronous client (threadlog has none):
    every bit of its client work, then the script call sent and its reply read on a plain
    blocking unix socket, with no event loop in between. An upper bound on what a sync path
    could save, measured beside LangChain's synchronous `add_message`."""

    def __init__(self, store: RedisEventStore, socket_path: str) -> None:
        self.store = store
        self.sessions = SessionStore(store)
        self.socket_path = socket_path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(socket_path)
        self.reader = hiredis.Reader()
        self.sha = APPEND.sha.encode("ascii")
        # The store's one seam between building an append and sending it: its group commit.
        self._committer = store._group_commit
        store._group_commit = self  # type: ignore[assignment]

    @property
    def packs(self) -> bool:  # the store packs whole commands when its committer does
        return bool(self._committer.packs)

    @property
    def script(self) -> Any:
        return self._committer.script

    async def submit(self, first_key: Any, call: Any) -> Any:
        """The group commit's call, answered on the blocking socket (no await inside)."""
        if not isinstance(call, bytes):  # (keys, args): what the direct path would pack
            keys, args = call
            call = pack_script_call(b"EVALSHA", self.sha, keys, args)
        self.sock.sendall(call)
        reply = self.reader.gets()
        while reply is False:
            self.reader.feed(self.sock.recv(65536))
            reply = self.reader.gets()
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def aclose(self) -> None:
        await self._committer.aclose()

    def close(self) -> None:
        self.sock.close()


class RoundTrips:
    """The floors of the append row: LangChain's own ``LPUSH`` (its key, its JSON bytes), packed
    once, sent and its reply read with no client work at all. On asyncio streams it is the
    least any asyncio caller pays for a round trip on this machine; on a blocking socket, the
    least LangChain's synchronous call could pay. Beside them, every other side's time is its
    round trip plus its client work plus its server time over an ``LPUSH``'s."""

    def __init__(self, socket_path: str, value: bytes) -> None:
        self.socket_path = socket_path
        self.value = value
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(socket_path)
        self.stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    def command(self, key: str) -> bytes:
        return pack_command((b"LPUSH", key, self.value))

    async def setup_aio(self, r: int, n: int) -> Op:
        if self.stream is None:
            self.stream = await asyncio.open_unix_connection(self.socket_path)
        reader, writer = self.stream
        command = self.command(f"floor-aio-{r}")

        async def op() -> None:
            writer.write(command)
            # An LPUSH reply is one short line (":<length>\r\n"), read in one piece.
            if not (await reader.readline()).startswith(b":"):
                raise RuntimeError("LPUSH failed")

        return op

    async def setup_sync(self, r: int, n: int) -> Op:
        sock, command = self.sock, self.command(f"floor-sync-{r}")

        async def op() -> None:
            sock.sendall(command)
            if not sock.recv(64).startswith(b":"):
                raise RuntimeError("LPUSH failed")

        return op

    async def teardown(self, r: int) -> None:
        sock = self.sock
        sock.sendall(pack_command((b"DEL", f"floor-aio-{r}", f"floor-sync-{r}")))
        if not sock.recv(64).startswith(b":"):
            raise RuntimeError("DEL failed")

    async def aclose(self) -> None:
        self.sock.close()
        if self.stream is not None:
            self.stream[1].close()
            await self.stream[1].wait_closed()


class SessionBench:
    """Every side, with the same 1,000 message texts in each store's own form."""

    def __init__(
        self, store: RedisEventStore, url: str, sdk_client: Any, blocking: BlockingAppends
    ) -> None:
        self.store = store
        self.url = url
        self.blocking = blocking
        self.sessions = SessionStore(store)
        self.threads = ThreadStore(store)
        self.sdk_client = sdk_client
        self.texts = [prose(i) for i in range(N_MESSAGES)]
        self.tl_messages = [Message(role=role(i), content=t) for i, t in enumerate(self.texts)]
        self.sdk_items: list[Any] = [
            {"role": role(i), "content": t} for i, t in enumerate(self.texts)
        ]
        self.lc_messages: list[BaseMessage] = [
            HumanMessage(content=t) if i % 2 == 0 else AIMessage(content=t)
            for i, t in enumerate(self.texts)
        ]
        self.lc = RedisChatMessageHistory("lc-1000", url=url)
        self.lc_async = RedisChatMessageHistory("lc-1000", url=url)
        self.lc_append = RedisChatMessageHistory("lc-append", url=url)
        self.lc_aappend = RedisChatMessageHistory("lc-aappend", url=url)
        self._lc_open: list[RedisChatMessageHistory] = []
        self.sdk_1000 = RedisSession("sdk-1000", redis_client=sdk_client)
        assert blocking.socket_path is not None
        self.floors = RoundTrips(
            blocking.socket_path, json.dumps(message_to_dict(self.lc_messages[0])).encode()
        )

    async def populate(self) -> None:
        """The 1,000-message data each read row reads (the same texts on every side)."""
        for start in range(0, N_MESSAGES, 100):
            chunk = slice(start, start + 100)
            await self.sessions.append("tl-1000", self.tl_messages[chunk])
            await self.threads.projector.append(
                "tl-window-1000",
                [NewEvent(payload=MessageAppended(message=m)) for m in self.tl_messages[chunk]],
            )
            await self.sdk_1000.add_items(self.sdk_items[chunk])
        self.lc.add_messages(self.lc_messages)

    async def check_same_data(self) -> None:
        """Every side must hold the same texts, or the comparison means nothing."""
        want = self.texts
        loaded = await self.sessions.load("tl-1000")
        got = {
            TL_LOAD: [m.content for m in loaded.messages],
            SDK_GET: [cast(Any, i)["content"] for i in await self.sdk_1000.get_items()],
            LC_GET: [m.content for m in self.lc.messages],
            TL_WINDOW: [
                m.message.content for m in await self.threads.list_messages("tl-window-1000")
            ],
            SDK_WINDOW: [
                cast(Any, i)["content"] for i in await self.sdk_1000.get_items(limit=WINDOW)
            ],
        }
        windows = {TL_WINDOW, SDK_WINDOW}
        for name, texts in got.items():
            expected = want[-WINDOW:] if name in windows else want
            if texts != expected:
                raise RuntimeError(f"{name} does not hold the benchmark's messages")

    # -- append ----------------------------------------------------------------------------

    def _session_appends(self, sessions: SessionStore, sid: str, r: int, n: int) -> Op:
        """One message appended to session ``sid`` per call, round ``r``'s share of texts."""
        msgs = self.tl_messages
        i = r * n

        async def op() -> None:
            nonlocal i
            await sessions.append(sid, [msgs[i % N_MESSAGES]])
            i += 1

        return op

    async def setup_tl_append(self, r: int, n: int) -> Op:
        return self._session_appends(self.sessions, f"tl-append-{r}", r, n)

    async def teardown_tl_append(self, r: int) -> None:
        await self.sessions.delete(f"tl-append-{r}")

    async def setup_tl_append_msg(self, r: int, n: int) -> Op:
        tid, threads, msgs = f"tl-append-msg-{r}", self.threads, self.tl_messages
        i = r * n

        async def op() -> None:
            nonlocal i
            await threads.append_message(tid, msgs[i % N_MESSAGES])
            i += 1

        return op

    async def teardown_tl_append_msg(self, r: int) -> None:
        await self.threads.delete_thread(f"tl-append-msg-{r}")

    async def setup_whatif_append(self, r: int, n: int) -> Op:
        return self._session_appends(self.blocking.sessions, f"tl-blocking-{r}", r, n)

    async def teardown_whatif_append(self, r: int) -> None:
        await self.sessions.delete(f"tl-blocking-{r}")

    async def setup_sdk_add(self, r: int, n: int) -> Op:
        session, items = (
            RedisSession(f"sdk-append-{r}", redis_client=self.sdk_client),
            self.sdk_items,
        )
        i = r * n

        async def op() -> None:
            nonlocal i
            await session.add_items([items[i % N_MESSAGES]])
            i += 1

        return op

    async def teardown_sdk_add(self, r: int) -> None:
        await RedisSession(f"sdk-append-{r}", redis_client=self.sdk_client).clear_session()

    async def setup_lc_add(self, r: int, n: int) -> Op:
        history, msgs = self.lc_append, self.lc_messages
        history.session_id = f"lc-append-{r}"
        history.redis_client.ping()  # connect outside the timed ops
        i = r * n

        async def op() -> None:
            nonlocal i
            history.add_message(msgs[i % N_MESSAGES])
            i += 1

        return op

    async def teardown_lc_add(self, r: int) -> None:
        self.lc_append.clear()

    async def setup_lc_aadd(self, r: int, n: int) -> Op:
        history, msgs = self.lc_aappend, self.lc_messages
        history.session_id = f"lc-aappend-{r}"
        history.redis_client.ping()
        i = r * n

        async def op() -> None:
            nonlocal i
            await history.aadd_messages([msgs[i % N_MESSAGES]])
            i += 1

        return op

    async def teardown_lc_aadd(self, r: int) -> None:
        self.lc_aappend.clear()

    def append_sides(self) -> list[Side]:
        return [
            Side(TL_APPEND, self.setup_tl_append, self.teardown_tl_append),
            Side(TL_APPEND_MSG, self.setup_tl_append_msg, self.teardown_tl_append_msg),
            Side(SDK_ADD, self.setup_sdk_add, self.teardown_sdk_add),
            Side(LC_ADD, self.setup_lc_add, self.teardown_lc_add),
            Side(LC_AADD, self.setup_lc_aadd, self.teardown_lc_aadd),
            Side(WHATIF_APPEND, self.setup_whatif_append, self.teardown_whatif_append),
            Side(FLOOR_AIO, self.floors.setup_aio, self.floors.teardown),
            Side(FLOOR_SYNC, self.floors.setup_sync, self.floors.teardown),
        ]

    # -- append, many sessions at once ---------------------------------------------------
    # An agent server appends for many sessions at once. One op: one message appended to each
    # of CONCURRENT sessions, the calls started together (LangChain's sync method can only be
    # called one after another: it blocks the event loop for each).

    async def setup_tl_append_many(self, r: int, n: int) -> Op:
        sessions, msgs = self.sessions, self.tl_messages
        sids = [f"tl-many-{r}-{k}" for k in range(CONCURRENT)]

        async def each(i: int) -> None:
            await asyncio.gather(*(sessions.append(sid, [msgs[i]]) for sid in sids))

        return cycling(each)

    async def teardown_tl_append_many(self, r: int) -> None:
        for k in range(CONCURRENT):
            await self.sessions.delete(f"tl-many-{r}-{k}")

    async def setup_sdk_add_many(self, r: int, n: int) -> Op:
        client, items = self.sdk_client, self.sdk_items
        sessions = [
            RedisSession(f"sdk-many-{r}-{k}", redis_client=client) for k in range(CONCURRENT)
        ]

        async def each(i: int) -> None:
            await asyncio.gather(*(s.add_items([items[i]]) for s in sessions))

        return cycling(each)

    async def teardown_sdk_add_many(self, r: int) -> None:
        for k in range(CONCURRENT):
            await RedisSession(f"sdk-many-{r}-{k}", redis_client=self.sdk_client).clear_session()

    def _lc_many(self, r: int) -> list[RedisChatMessageHistory]:
        """One history object per session, all on one client (one connection pool), as a
        server holding many sessions would keep them (the class takes a URL, not a client)."""
        histories = []
        for k in range(CONCURRENT):
            h = RedisChatMessageHistory(f"lc-many-{r}-{k}", url=self.url)
            h.redis_client.close()  # its own client, never used: nothing was connected
            h.redis_client = self.lc_append.redis_client
            histories.append(h)
        histories[0].redis_client.ping()
        self._lc_open = histories
        return histories

    async def setup_lc_add_many(self, r: int, n: int) -> Op:
        histories, msgs = self._lc_many(r), self.lc_messages

        async def each(i: int) -> None:
            for h in histories:
                h.add_message(msgs[i])

        return cycling(each)

    async def setup_lc_aadd_many(self, r: int, n: int) -> Op:
        histories, msgs = self._lc_many(r), self.lc_messages

        async def each(i: int) -> None:
            await asyncio.gather(*(h.aadd_messages([msgs[i]]) for h in histories))

        return cycling(each)

    async def teardown_lc_many(self, r: int) -> None:
        for h in self._lc_open:
            h.clear()
        self._lc_open = []

    def append_many_sides(self) -> list[Side]:
        return [
            Side(TL_APPEND, self.setup_tl_append_many, self.teardown_tl_append_many),
            Side(SDK_ADD, self.setup_sdk_add_many, self.teardown_sdk_add_many),
            Side(LC_ADD, self.setup_lc_add_many, self.teardown_lc_many),
            Side(LC_AADD, self.setup_lc_aadd_many, self.teardown_lc_many),
        ]

    # -- load ------------------------------------------------------------------------------

    async def tl_load(self) -> object:
        return await self.sessions.load("tl-1000")

    async def sdk_get(self) -> object:
        return await self.sdk_1000.get_items()

    async def whatif_load(self) -> object:
        """What load would cost if the store served it with a plain LRANGE (no script)."""
        read = ListRange("transcript", 0, -1)
        raws = await self.store.client.lrange(self.store.keys.view("tl-1000", read.view), 0, -1)
        return TranscriptProjection.messages(decode_view_result("tl-1000", read, raws))

    async def lc_get(self) -> object:
        return self.lc.messages

    async def lc_aget(self) -> object:
        return await self.lc_async.aget_messages()

    # -- window ----------------------------------------------------------------------------

    async def tl_window(self) -> object:
        return await self.threads.list_messages("tl-window-1000", limit=WINDOW)

    async def sdk_window(self) -> object:
        return await self.sdk_1000.get_items(limit=WINDOW)

    async def whatif_window(self) -> object:
        read = MessagesProjection.window_read(WINDOW)
        key = self.store.keys.view("tl-window-1000", read.view)
        raws = await self.store.client.lrange(key, -WINDOW, -1)
        return MessagesProjection.parse(decode_view_result("tl-window-1000", read, raws))

    async def lc_window(self) -> object:
        return self.lc.messages[-WINDOW:]

    async def lc_awindow(self) -> object:
        return (await self.lc_async.aget_messages())[-WINDOW:]

    def close(self) -> None:
        for h in (self.lc, self.lc_async, self.lc_append, self.lc_aappend):
            h.redis_client.close()


def cycling(call: Callable[[int], Awaitable[None]]) -> Op:
    """An op that calls ``call(i)`` with the index of the next message to send, in turn."""
    i = 0

    async def op() -> None:
        nonlocal i
        await call(i % N_MESSAGES)
        i += 1

    return op


def fixed(op: Op) -> Any:
    async def setup(r: int, n: int) -> Op:
        return op

    return setup


async def _run(
    quick: bool, *, rounds: int | None, ops: int | None, progress: bool
) -> dict[str, Any]:
    base = QUICK if quick else FULL
    m = Rows(
        base.name,
        rounds or base.rounds,
        ops or base.append,
        max((ops or base.append) // 20, 3) if ops else base.load,
        ops or base.window,
        base.warmup,
        max((ops or base.append) // 25, 3) if ops else base.many,
    )
    env = environment()
    with redis_server() as server:
        store = await connect(server.url, namespace="bench", partitions=16)
        assert isinstance(store, RedisEventStore)
        sdk_client = aioredis.from_url(server.url)
        blocking_store = await connect(server.url, namespace="bench", partitions=16)
        assert isinstance(blocking_store, RedisEventStore)
        assert server.unix_socket is not None
        blocking = BlockingAppends(blocking_store, str(server.unix_socket))
        bench = SessionBench(store, server.url, sdk_client, blocking)
        try:
            info = await store.client.info("server")
            await bench.populate()
            await bench.check_same_data()
            print(
                f"bench.session ({m.name}): {m.rounds} rounds; ops per round: append {m.append}, "
                f"load {m.load}, window {m.window}; redis {info['redis_version']} on a unix socket",
                file=sys.stderr,
            )
            append = await measure(
                bench.append_sides(),
                rounds=m.rounds,
                ops=m.append,
                warmup=m.warmup,
                progress=progress,
            )
            append_many = await measure(
                bench.append_many_sides(),
                rounds=m.rounds,
                ops=m.many,
                warmup=3,
                progress=progress,
            )
            load = await measure(
                [
                    Side(TL_LOAD, fixed(bench.tl_load)),
                    Side(SDK_GET, fixed(bench.sdk_get)),
                    Side(LC_GET, fixed(bench.lc_get)),
                    Side(LC_AGET, fixed(bench.lc_aget)),
                    Side(WHATIF_LOAD, fixed(bench.whatif_load)),
                ],
                rounds=m.rounds,
                ops=m.load,
                warmup=3,
                progress=progress,
            )
            window = await measure(
                [
                    Side(TL_WINDOW, fixed(bench.tl_window)),
                    Side(SDK_WINDOW, fixed(bench.sdk_window)),
                    Side(WHATIF_WINDOW, fixed(bench.whatif_window)),
                ],
                rounds=m.rounds,
                ops=m.window,
                warmup=m.warmup,
                progress=progress,
            )
            # LangChain reads all 1,000 messages for a window: fewer ops, its own pairing.
            window_lc = await measure(
                [
                    Side(TL_WINDOW, fixed(bench.tl_window)),
                    Side(LC_WINDOW, fixed(bench.lc_window)),
                    Side(LC_AWINDOW, fixed(bench.lc_awindow)),
                ],
                rounds=m.rounds,
                ops=m.load,
                warmup=3,
                progress=progress,
            )

            n_append, n_read, n_slow = (100, 100, 5) if quick else (500, 500, 20)
            c = store.client
            tl = ["evalsha"]
            sides = {s.name: s for s in bench.append_sides()}
            profile: dict[str, dict[str, Any]] = {
                "append": {
                    name: await profile_side(
                        c,
                        side,
                        n_append,
                        direct=tl if "SessionStore" in name or "threadlog" in name else None,
                    )
                    for name, side in sides.items()
                },
                "load 1,000": {
                    TL_LOAD: await profile_side(
                        c, Side(TL_LOAD, fixed(bench.tl_load)), n_slow, direct=tl
                    ),
                    SDK_GET: await profile_side(c, Side(SDK_GET, fixed(bench.sdk_get)), n_slow),
                    LC_GET: await profile_side(c, Side(LC_GET, fixed(bench.lc_get)), n_slow),
                    LC_AGET: await profile_side(c, Side(LC_AGET, fixed(bench.lc_aget)), n_slow),
                },
                "last 6": {
                    TL_WINDOW: await profile_side(
                        c, Side(TL_WINDOW, fixed(bench.tl_window)), n_read, direct=tl
                    ),
                    SDK_WINDOW: await profile_side(
                        c, Side(SDK_WINDOW, fixed(bench.sdk_window)), n_read
                    ),
                    LC_WINDOW: await profile_side(
                        c, Side(LC_WINDOW, fixed(bench.lc_window)), n_slow
                    ),
                },
            }
            env.update(
                redis_server=info["redis_version"],
                transport="unix socket",
                redis_py=redis.__version__,
                packages=_versions(),
            )
        finally:
            bench.close()
            await bench.floors.aclose()
            blocking.close()
            await blocking_store.close()
            await sdk_client.aclose()
            await store.close()
    env["loadavg_at_end"] = loadavg()
    return report(m, append, append_many, load, window, window_lc, profile, env)


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("openai-agents", "langchain-community", "langchain-core")}


def report(
    m: Rows,
    append: Comparison,
    append_many: Comparison,
    load: Comparison,
    window: Comparison,
    window_lc: Comparison,
    profile: dict[str, dict[str, Any]],
    env: dict[str, Any],
) -> dict[str, Any]:
    rows = op_rows("append one message", append)
    rows += op_rows(f"append to {CONCURRENT} sessions at once", append_many)
    rows += op_rows(f"load {N_MESSAGES:,}-message transcript", load)
    rows += op_rows("last 6 messages", window)
    rows += op_rows("last 6 messages (LangChain pairing)", window_lc)
    print_block(f"Session stores ({RATIO_NOTE})", OP_HEADERS, rows)

    # Every peer against the threadlog side that does the same job.
    checks: list[tuple[str, Comparison, str, str, float]] = [
        ("append", append, TL_APPEND, SDK_ADD, TARGET_ADD_ITEMS),
        ("append", append, TL_APPEND, LC_ADD, 1.0),
        ("append", append, TL_APPEND, LC_AADD, 1.0),
        ("append", append, TL_APPEND_MSG, SDK_ADD, TARGET_ADD_ITEMS),
        ("append", append, TL_APPEND_MSG, LC_ADD, 1.0),
        ("append", append, TL_APPEND_MSG, LC_AADD, 1.0),
        ("load 1,000", load, TL_LOAD, SDK_GET, 1.0),
        ("load 1,000", load, TL_LOAD, LC_GET, 1.0),
        ("load 1,000", load, TL_LOAD, LC_AGET, 1.0),
        ("last 6", window, TL_WINDOW, SDK_WINDOW, 1.0),
        ("last 6", window_lc, TL_WINDOW, LC_WINDOW, 1.0),
        ("last 6", window_lc, TL_WINDOW, LC_AWINDOW, 1.0),
    ]
    targets: list[dict[str, Any]] = []
    for row, comparison, tl, peer, need in checks:
        value = paired_ratio(comparison, peer, tl)
        targets.append(
            {
                "row": row,
                "threadlog": tl,
                "peer": peer,
                "value": round(value, 3),
                "target": f"> {need:g}" if need == 1.0 else f">= {need:g}",
                "met": value > need if need == 1.0 else value >= need,
            }
        )
    verdicts = [
        f"{verdict(t['met'])} target ({t['row']}): {t['peer']} / {t['threadlog']} = "
        f"{t['value']:.2f}x (target {t['target']}x)"
        for t in targets
    ]
    whatif_sync = paired_ratio(append, LC_ADD, WHATIF_APPEND)
    verdicts.append(
        f"INFO (append; no such API, what a synchronous client path could reach): {LC_ADD} / "
        f"{WHATIF_APPEND} = {whatif_sync:.2f}x"
    )
    for peer in (SDK_ADD, LC_ADD, LC_AADD):
        value = paired_ratio(append_many, peer, TL_APPEND)
        verdicts.append(
            f"INFO (append to {CONCURRENT} sessions at once; no target): {peer} / {TL_APPEND} = "
            f"{value:.2f}x"
        )
    floors = append_floors(append, profile["append"])
    verdicts += floors["verdicts"]
    prof_rows = [
        profile_row(op, side, p) for op, sides in profile.items() for side, p in sides.items()
    ]
    print_block(
        "Profile (untimed pass, one side at a time; server time from INFO commandstats; "
        "client CPU = process CPU time per op, thread pool included)",
        PROFILE_HEADERS,
        prof_rows,
    )

    print()
    for line in verdicts:
        print(line)
    return {
        "benchmark": "session",
        "mode": m.name,
        "rounds": m.rounds,
        "ops_per_round": {
            "append": m.append,
            "append_many": m.many,
            "load": m.load,
            "window": m.window,
            "window_langchain": m.load,
        },
        "messages": N_MESSAGES,
        "concurrent": CONCURRENT,
        "message_chars": len(prose(0)),
        "ratio_convention": RATIO_NOTE,
        "operations": {
            "append": append.summary(),
            "append_many": append_many.summary(),
            "load": load.summary(),
            "window": window.summary(),
            "window_langchain": window_lc.summary(),
        },
        "targets": targets,
        "whatif_sync_append_vs_langchain_sync": round(whatif_sync, 3),
        "append_floors": floors["figures"],
        "profile": profile,
        "environment": env,
        "tables": {"operations": rows, "profile": prof_rows},
        "verdicts": verdicts,
    }


def append_floors(append: Comparison, profile: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the floors say about the LangChain (sync) row, from this run's own figures.

    An append's time is at least a round trip with no client work (the floor) plus the server
    time its script spends over the ``LPUSH`` LangChain sends (the profile), before any client
    work. Whether that already exceeds LangChain's whole call decides if the row can be won.
    """
    p50 = {s.name: s.percentile_us(50) for s in append.sides}
    script_extra = profile[TL_APPEND]["server_us_per_op"] - profile[LC_ADD]["server_us_per_op"]
    langchain = p50[LC_ADD]
    figures: dict[str, Any] = {
        "langchain_sync_p50_us": round(langchain, 1),
        "script_server_us_over_lpush": round(script_extra, 1),
        "client_cpu_us": {
            name: round(profile[name]["client_cpu_us_per_op"], 1)
            for name in (TL_APPEND, WHATIF_APPEND, LC_ADD)
        },
    }
    cpu = figures["client_cpu_us"]
    verdicts = []
    for floor, how in ((FLOOR_AIO, "an asyncio"), (FLOOR_SYNC, "a synchronous")):
        least = p50[floor] + script_extra
        room = langchain - least
        figures[floor] = {"p50_us": round(p50[floor], 1), "least_append_p50_us": round(least, 1)}
        if room <= 0:
            outcome = f"no {how.split()[1]} append running this script can be faster"
        else:
            outcome = f"{room:.1f} us left for {how} path's client work"
        verdicts.append(
            f"INFO (append floor): {floor} {p50[floor]:.1f} us p50 + the append script's "
            f"server time over an LPUSH's {script_extra:.1f} us = {least:.1f} us before any "
            f"client work, against {LC_ADD} {langchain:.1f} us p50: {outcome} "
            f"(client CPU per op in the profile: threadlog {cpu[TL_APPEND]:.1f} us from "
            f"asyncio, {cpu[WHATIF_APPEND]:.1f} us blocking; LangChain {cpu[LC_ADD]:.1f} us)"
        )
    return {"figures": figures, "verdicts": verdicts}


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
        f"Mode `{summary['mode']}`: {summary['rounds']} rounds; ops per round: append "
        f"{ops['append']}, append to {summary.get('concurrent', CONCURRENT)} sessions at once "
        f"{ops.get('append_many', '-')} (an op: one message to each), load {ops['load']}, "
        f"window {ops['window']} (LangChain pairing "
        f"{ops['window_langchain']}); {summary['message_chars']}-character messages; redis "
        f"{env.get('redis_server')} on a unix socket, redis-py {env.get('redis_py')}, {packages}; "
        f"{env['cpus']} CPUs, load {env['loadavg_at_start']} at start.",
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
    return bench_main("session", run, argv)


if __name__ == "__main__":
    sys.exit(main())
