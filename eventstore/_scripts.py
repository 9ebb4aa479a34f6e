"""The Lua scripts, loaded from package files and called by hash, surviving NOSCRIPT."""

from __future__ import annotations

import asyncio
import hashlib
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError

from ._wire import HeldConnections, can_hold, pack_script_call


class Script:
    """One Lua script: its source and SHA1, called with EVALSHA.

    After a restart, failover or ``SCRIPT FLUSH`` the server answers NOSCRIPT; the call is then
    repeated once with EVAL, which runs the script and caches it again. The script's first
    action cannot have happened on a NOSCRIPT reply, so the repeat is safe.
    """

    __slots__ = ("name", "sha", "source")

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode("utf-8"), usedforsecurity=False).hexdigest()

    @classmethod
    def from_package(cls, name: str) -> Script:
        """Load ``eventstore/lua/<name>.lua``."""
        source = resources.files("eventstore").joinpath("lua", f"{name}.lua").read_text("utf-8")
        return cls(name, source)

    async def __call__(self, client: Any, keys: list[Any], args: list[Any]) -> Any:
        # execute_command is what evalsha/eval call (standalone and cluster alike); calling it
        # directly spares two frames that re-pack every argument, on every append.
        try:
            return await client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await client.execute_command("EVAL", self.source, len(keys), *keys, *args)


class GroupCommit:
    """Group commit: calls of one script made while another is in flight share one pipeline.

    A call made when nothing is in flight goes out at once as a plain EVALSHA: a lone caller
    pays nothing. Calls made while a send is in flight queue up, and the queue goes out as one
    pipeline as soon as that send returns, or at once when it holds half of the calls waiting
    for a reply (at most ``max_batch``). Sending at half keeps two batches in turn: the server
    runs one while this process builds the next, instead of each waiting for the other (64
    concurrent appenders: ~19k/s one batch at a time, ~31k/s in halves). Batches in flight
    together travel on different connections, which Redis may serve in either order, so a
    queue holding a call for a thread (first key) that is already in flight waits for the
    send to return: one thread's calls are never in two sends at once, and reach the server
    in the order they were made.

    Each call keeps its own reply or error: the pipeline is not a transaction, every script
    call stays atomic on its own, and the server runs a pipeline's calls in submission order
    (two queued appends to one thread with consecutive expected versions both succeed).
    """

    def __init__(
        self,
        client: Any,
        script: Script,
        *,
        max_batch: int = 64,
        held: HeldConnections | None = None,
    ) -> None:
        self.client = client
        self.script = script
        self.max_batch = max(1, max_batch)
        self._queue: list[tuple[list[Any], list[Any], asyncio.Future[Any]]] = []
        self._in_flight = 0
        self._waiting = 0  # calls queued or in a pipeline, not yet answered
        self._busy: dict[Any, int] = {}  # first key -> calls in flight with it
        self._queue_waits = False  # the queue holds a call whose first key is in flight
        self._tasks: set[asyncio.Task[None]] = set()
        # Its own RESP path where it is exact (see `_wire`), redis-py's otherwise; a store
        # passes the connections it holds, to share them with its reads (and closes them).
        self._owns_held = held is None and can_hold(client)
        self._held = HeldConnections(client) if self._owns_held else held
        self._sha = script.sha.encode("ascii")
        self._source = script.source.encode("utf-8")
        # Counters for observability (and tests): calls sent alone, pipelines, calls in them.
        self.sent_alone = 0
        self.pipelines = 0
        self.pipelined_calls = 0

    async def __call__(self, keys: list[Any], args: list[Any]) -> Any:
        if self.max_batch == 1 or (not self._in_flight and not self._queue):
            self._in_flight += 1
            self.sent_alone += 1
            self._mark(keys[0], 1)
            try:
                return await self._one(keys, args)
            finally:
                self._mark(keys[0], -1)
                self._in_flight -= 1
                self._drain()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((keys, args, future))
        self._waiting += 1
        if keys[0] in self._busy:
            self._queue_waits = True
        if not self._queue_waits and len(self._queue) >= min(
            self.max_batch, max(2, self._waiting // 2)
        ):
            self._flush()
        # A queued batch is sent by its own task: a caller that is cancelled does not take the
        # other calls of its batch down with it (its own append may still land, as any
        # cancelled append may; retrying with the same idempotency key is safe).
        try:
            return await future
        finally:
            self._waiting -= 1

    async def _one(self, keys: list[Any], args: list[Any]) -> Any:
        if self._held is None:
            return await self.script(self.client, keys, args)
        (reply,) = await self._run([(keys, args)])
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def aclose(self) -> None:
        """Give back the connections held for the direct path, if this committer holds them."""
        if self._owns_held and self._held is not None:
            await self._held.close()

    def _drain(self) -> None:
        if self._queue and not self._in_flight:
            self._flush()

    def _mark(self, key: Any, delta: int) -> None:
        n = self._busy.get(key, 0) + delta
        if n:
            self._busy[key] = n
        else:
            del self._busy[key]

    def _flush(self) -> None:
        batch, self._queue = self._queue, []
        self._queue_waits = False
        for keys, _, _ in batch:
            self._mark(keys[0], 1)
        self._in_flight += 1
        self.pipelines += 1
        self.pipelined_calls += len(batch)
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._tasks.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._in_flight -= 1
        self._drain()

    async def _send(self, batch: list[tuple[list[Any], list[Any], asyncio.Future[Any]]]) -> None:
        try:
            try:
                replies = await self._run([(keys, args) for keys, args, _ in batch])
            finally:
                # Answered (or failed): its threads may go out again, even before its callers
                # resume and make their next calls.
                for keys, _, _ in batch:
                    self._mark(keys[0], -1)
        except BaseException as exc:
            for _, _, future in batch:
                _settle(future, error=exc)
            return
        for (_, _, future), reply in zip(batch, replies, strict=True):
            if isinstance(reply, Exception):
                _settle(future, error=reply)
            else:
                _settle(future, reply)

    async def _run(self, calls: list[tuple[list[Any], list[Any]]]) -> list[Any]:
        """The calls in one pipeline, a reply (or error) each, in order.

        The server may have forgotten the script (restart, failover, SCRIPT FLUSH): the calls
        it answered NOSCRIPT did nothing, so they are sent again with the source.
        """
        replies = await self._pipeline(calls, with_source=False)
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            again = await self._pipeline([calls[i] for i in missing], with_source=True)
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    async def _pipeline(
        self, calls: list[tuple[list[Any], list[Any]]], *, with_source: bool
    ) -> list[Any]:
        if self._held is not None:
            verb, body = (b"EVAL", self._source) if with_source else (b"EVALSHA", self._sha)
            payload = b"".join(pack_script_call(verb, body, keys, args) for keys, args in calls)
            return await self._held.exchange(payload, len(calls))
        command, text = (
            ("EVAL", self.script.source) if with_source else ("EVALSHA", self.script.sha)
        )
        pipe = self.client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.execute_command(command, text, len(keys), *keys, *args)
        return list(await pipe.execute(raise_on_error=False))


def _settle(
    future: asyncio.Future[Any], reply: Any = None, *, error: BaseException | None = None
) -> None:
    if future.done():  # its caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(reply)


APPEND = Script.from_package("append")
READ_VIEWS = Script.from_package("read_views")
LOAD_VIEWS = Script.from_package("load_views")
SWAP_VIEWS = Script.from_package("swap_views")
SEQ_AT = Script.from_package("seq_at")
DELETE_THREAD = Script.from_package("delete_thread")
APPLY_CHECKPOINTED = Script.from_package("apply_checkpointed")
