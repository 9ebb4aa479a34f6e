"""The Lua scripts, loaded from package files and called by hash, surviving NOSCRIPT."""

from __future__ import annotations

import asyncio
import hashlib
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError


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


_SEND_ALONE = object()  # what a lone call's future resolves to: send it yourself


class GroupCommit:
    """Sends the calls of one script made within one event-loop tick as one pipeline.

    Each call keeps its own reply or error: the pipeline is not a transaction, every script
    call stays atomic on its own, and the server runs them in submission order (so two appends
    to one thread with consecutive expected versions both succeed). A lone call goes out as a
    plain EVALSHA, sent by its caller. ``max_batch`` caps a pipeline; a full batch is sent at
    once.
    """

    def __init__(self, client: Any, script: Script, *, max_batch: int = 64) -> None:
        self.client = client
        self.script = script
        self.max_batch = max(1, max_batch)
        self._queue: list[tuple[list[Any], list[Any], asyncio.Future[Any]]] = []
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def __call__(self, keys: list[Any], args: list[Any]) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append((keys, args, future))
        if len(self._queue) >= self.max_batch:
            self._flush()
        elif not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        # A batch is sent by its own task: a caller that is cancelled does not take the other
        # calls of its batch down with it (its own append may still land, as any cancelled
        # append may; retrying with the same idempotency key is safe). A call nobody joined is
        # sent by its caller, as it would be without group commit.
        reply = await future
        if reply is _SEND_ALONE:
            return await self.script(self.client, keys, args)
        return reply

    def _flush(self) -> None:
        self._scheduled = False
        batch, self._queue = self._queue, []
        if len(batch) == 1:
            # Nobody joined: the caller sends it itself, sparing a task and a loop hop.
            _settle(batch[0][2], _SEND_ALONE)
        elif batch:
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[list[Any], list[Any], asyncio.Future[Any]]]) -> None:
        if len(batch) == 1:
            keys, args, future = batch[0]
            try:
                reply = await self.script(self.client, keys, args)
            except BaseException as exc:
                _settle(future, error=exc)
            else:
                _settle(future, reply)
            return
        try:
            replies = await self._pipeline(batch, "EVALSHA", self.script.sha)
            missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
            if missing:
                # The server forgot the script (restart, failover, SCRIPT FLUSH): those calls
                # did nothing, so they are sent again with the source.
                again = await self._pipeline(
                    [batch[i] for i in missing], "EVAL", self.script.source
                )
                for i, reply in zip(missing, again, strict=True):
                    replies[i] = reply
        except BaseException as exc:
            for _, _, future in batch:
                _settle(future, error=exc)
            return
        for (_, _, future), reply in zip(batch, replies, strict=True):
            if isinstance(reply, Exception):
                _settle(future, error=reply)
            else:
                _settle(future, reply)

    async def _pipeline(
        self,
        batch: list[tuple[list[Any], list[Any], asyncio.Future[Any]]],
        command: str,
        body: str,
    ) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for keys, args, _ in batch:
            pipe.execute_command(command, body, len(keys), *keys, *args)
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
SEQ_AT = Script.from_package("seq_at")
DELETE_THREAD = Script.from_package("delete_thread")
APPLY_CHECKPOINTED = Script.from_package("apply_checkpointed")
