"""The Lua scripts, loaded from package files and called by hash, surviving NOSCRIPT."""

from __future__ import annotations

import asyncio
import hashlib
import re
from importlib import resources
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError, ResponseError

from ._wire import HeldConnections, can_hold, pack_command, pack_script_call, with_script_source

Call = tuple[list[Any], list[Any]] | bytes
"""One call of a script: its keys and args, or (direct path only) its packed ``EVALSHA``."""

Batch = list[tuple[Any, Call, "asyncio.Future[Any]"]]
"""Calls sent together: each one's first key, the call, and its caller's future."""


_INCLUDE = re.compile(r"^--#include (\w+)$", re.MULTILINE)
_MULTI = pack_command((b"MULTI",))
_EXEC = pack_command((b"EXEC",))


def _lua_source(name: str) -> str:
    return resources.files("eventstore").joinpath("lua", f"{name}.lua").read_text("utf-8")


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
        """Load ``eventstore/lua/<name>.lua``, each ``--#include <part>`` line replaced by
        ``eventstore/lua/_<part>.lua`` (steps several scripts share)."""
        return cls(name, _INCLUDE.sub(lambda m: _lua_source(f"_{m[1]}"), _lua_source(name)))

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
    (two queued appends to one thread with consecutive expected versions both succeed). A
    batch holding one thread twice is the exception: it goes in one ``MULTI``/``EXEC``, or in
    rounds, so that a script cached again mid-batch cannot reorder it (`_run_in_order`). On
    Redis Cluster a batch goes as one pipeline per node (`_per_node`).

    A call whose outcome is unknown (timed out, cancelled) after it was written holds back its
    thread's next calls until what it sent has run (`_hold_back`); a caller whose send task was
    cancelled, not itself, gets an error saying its outcome is unknown (`_sent`).
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
        self._queue: Batch = []
        self._in_flight = 0
        self._waiting = 0  # calls queued or in a pipeline, not yet answered
        self._busy: dict[Any, int] = {}  # first key -> calls in flight with it
        self._queue_waits = False  # the queue holds a call whose first key is in flight
        # First key -> calls of unknown outcome holding it back: what they sent is being read
        # aside (`HeldConnections.draining`) and may not have run yet (`_hold_back`).
        self._in_doubt: dict[Any, int] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        # Send task -> its batch, and whether the send let go of the batch's threads (a task
        # cancelled before it ran never did: `_sent` does it then).
        self._tasks: dict[asyncio.Task[None], tuple[Batch, list[bool]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the last send
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

    @property
    def packs(self) -> bool:
        """Whether `submit` takes calls packed as RESP (``EVALSHA <sha> ...``, the whole
        command): on the direct path, where they are sent as they are."""
        return self._held is not None

    async def __call__(self, keys: list[Any], args: list[Any]) -> Any:
        return await self.submit(keys[0], (keys, args))

    async def submit(self, first_key: Any, call: Call) -> Any:
        """Run one call of the script: ``(keys, args)``, or on the direct path (`packs`) the
        whole ``EVALSHA`` command as RESP bytes (see `_wire.evalsha_prefix`), whose first key
        is ``first_key``. Returns its reply; an error reply is raised."""
        busy = self._busy
        # Alone when nothing is in flight; with max_batch 1 (no batches), when nothing is
        # queued and its thread is not in flight: one thread's calls are never in two sends.
        if (
            not self._queue
            and not self._in_doubt
            and (not self._in_flight or (self.max_batch == 1 and first_key not in busy))
        ):
            self._in_flight += 1
            self.sent_alone += 1
            busy[first_key] = busy.get(first_key, 0) + 1
            # The next burst may run on another loop: its first queued call asks for it.
            self._loop = None
            try:
                return await self._one(call)
            except BaseException as exc:
                if not isinstance(exc, ResponseError):  # outcome unknown
                    self._hold_back([first_key])
                raise
            finally:
                self._mark(first_key, -1)
                self._in_flight -= 1
                if self._queue and not self._in_flight:
                    self._flush()
        # Something is in flight, or queued behind it, on this loop (a lone call or a send
        # task): the loop is the burst's, asked once per burst (asyncio's get_running_loop
        # costs a getpid() system call every time).
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        queue = self._queue
        queue.append((first_key, call, future))
        self._waiting += 1
        if self._in_doubt and not self._in_flight:
            self._flush()  # no send returns to do it: the calls not held back go now
        elif first_key in busy:
            self._queue_waits = True
        elif not self._queue_waits:
            # Half of the calls waiting, at least 2 and at most max_batch (>= 2 here).
            limit = self._waiting >> 1
            if limit > self.max_batch:
                limit = self.max_batch
            elif limit < 2:
                limit = 2
            if len(queue) >= limit:
                self._flush()
        # A queued batch is sent by its own task: a caller that is cancelled does not take the
        # other calls of its batch down with it (its own append may still land, as any
        # cancelled append may; retrying with the same idempotency key is safe).
        try:
            return await future
        finally:
            self._waiting -= 1

    async def _one(self, call: Call) -> Any:
        if self._held is None:
            assert not isinstance(call, bytes)  # packed calls are for the direct path only
            return await self.script(self.client, *call)
        (reply,) = await self._run([call])
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def aclose(self) -> None:
        """Give back the connections held for the direct path, if this committer holds them."""
        if self._owns_held and self._held is not None:
            await self._held.close()

    def _mark(self, key: Any, delta: int) -> None:
        n = self._busy.get(key, 0) + delta
        if n:
            self._busy[key] = n
        else:
            del self._busy[key]

    def _flush(self) -> None:
        n, busy = self.max_batch, self._busy
        while True:
            queue = self._queue
            held: Batch = []
            if self._in_doubt:
                # The calls of a thread in doubt stay queued, in order, until it is let go.
                doubt = self._in_doubt
                held = [c for c in queue if c[0] in doubt]
                if held:
                    queue = [c for c in queue if c[0] not in doubt]
                    if not queue:
                        return
            if len(queue) <= n:
                batch, self._queue = queue, held
                self._queue_waits = False
            else:
                # A queue held back behind a thread in flight grows past max_batch: it goes
                # out max_batch calls at a time, in order.
                batch, self._queue = queue[:n], held + queue[n:]
            # A thread with two calls in the batch: its keys were not busy before (a queue
            # holding a busy thread waits), so a count already above 0 is this batch's own.
            repeats = False
            for key, _, _ in batch:
                count = busy.get(key, 0)
                busy[key] = count + 1
                if count:
                    repeats = True
            self._in_flight += 1
            self.pipelines += 1
            self.pipelined_calls += len(batch)
            loop = self._loop = asyncio.get_running_loop()
            released = [False]
            task = loop.create_task(self._send(batch, repeats, released))
            self._tasks[task] = (batch, released)
            task.add_done_callback(self._sent)
            rest = self._queue
            if not rest:
                return
            # The rest waits for the sends in flight when it holds one of their threads; else
            # a full batch of it goes out now, and a shorter one when they return.
            self._queue_waits = any(key in busy for key, _, _ in rest)
            if self._queue_waits or len(rest) < n:
                return

    def _sent(self, task: asyncio.Task[None]) -> None:
        batch, released = self._tasks.pop(task)
        self._in_flight -= 1
        # A send cancelled (an application tearing its tasks down) or stopped by a
        # KeyboardInterrupt: its callers were not cancelled themselves, and a CancelledError
        # would read to them as their own cancellation. Each still waiting gets an error that
        # says its outcome is unknown (the call may have been sent).
        if task.cancelled() or task.exception() is not None:
            if not released[0]:  # cancelled before it ran: its threads are still marked
                self._release(batch)
            self._hold_back([key for key, _, _ in batch])
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(
                        RedisError(
                            "the task sending this call was cancelled; its outcome is unknown "
                            "(it may have been sent): retry it with the same idempotency key"
                        )
                    )
        if self._queue and not self._in_flight:
            self._flush()

    def _release(self, batch: Batch) -> None:
        busy = self._busy
        for key, _, _ in batch:
            n = busy[key] - 1
            if n:
                busy[key] = n
            else:
                del busy[key]

    async def _send(self, batch: Batch, repeats: bool, released: list[bool]) -> None:
        try:
            try:
                calls = [call for _, call, _ in batch]
                if repeats:
                    replies = await self._run_in_order(calls, [key for key, _, _ in batch])
                else:
                    replies = await self._run(calls)
            finally:
                # Answered (or failed): its threads may go out again, even before its callers
                # resume and make their next calls.
                self._release(batch)
                released[0] = True
        except Exception as exc:
            self._hold_back([key for key, _, _ in batch])
            for _, _, future in batch:
                if not future.done():  # its caller was cancelled
                    future.set_exception(exc)
            return
        for (key, _, future), reply in zip(batch, replies, strict=True):
            if isinstance(reply, Exception):
                if _outcome_unknown(reply):
                    self._hold_back([key])
                if not future.done():  # else its caller was cancelled
                    future.set_exception(reply)
            elif not future.done():
                future.set_result(reply)

    def _hold_back(self, keys: list[Any]) -> None:
        """Hold back the next calls of these threads (first keys), whose last call's outcome is
        unknown, until what it sent has been read aside (`HeldConnections.draining`).

        A call that timed out (or whose caller was cancelled) was written: its bytes wait in
        the server's socket buffer when the server is stalled, and still run when it wakes.
        Closing the connection does not take them back, and Redis may serve another
        connection first when it wakes (a large call is read in several passes): a thread's
        next call, made after the caller was told "outcome unknown", landed before it. Its
        connection is read aside instead; once its replies are in, it has run, and the
        thread's calls go on. Held at most `_wire._DRAIN_TIMEOUTS` socket timeouts.
        """
        held = self._held
        if held is None or not held.draining:
            return  # nothing sent is still to run (or, through redis-py, nothing to watch)
        doubt = self._in_doubt
        for key in keys:
            doubt[key] = doubt.get(key, 0) + 1
        task = asyncio.get_running_loop().create_task(
            self._let_go(keys, list(held.draining.values()))
        )
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _let_go(self, keys: list[Any], drains: list[asyncio.Task[None]]) -> None:
        try:
            await asyncio.wait(drains)
        finally:
            doubt = self._in_doubt
            for key in keys:
                n = doubt[key] - 1
                if n:
                    doubt[key] = n
                else:
                    del doubt[key]
            if self._queue and not self._in_flight:
                self._flush()

    async def _run(self, calls: list[Call], *, atomic: bool = False) -> list[Any]:
        """The calls in one pipeline (``atomic``: in one ``MULTI``/``EXEC``), a reply or an
        error each, in order; raised only when the first send fails (no call's outcome known).

        The server may have forgotten the script (restart, failover, SCRIPT FLUSH): the calls
        it answered NOSCRIPT did nothing, so they are sent again with the source, in order.
        That keeps each thread's calls in the order they were made only because no call of a
        thread that answered NOSCRIPT is followed by one of the same thread that ran: a batch
        holding a thread twice is sent so that none can be (`_run_in_order`), and a thread's
        next send waits for this one to return, re-send included (the ``_busy`` rule).

        A re-send that fails leaves the calls the first send answered with their answers
        (those that ran must not be reported failed: a caller retrying without an idempotency
        key would append twice); the calls it carried get its error, which for a connection
        or a timeout says that their outcome is unknown.
        """
        answered: list[Any] = []
        try:
            replies = await self._pipeline(
                calls, with_source=False, atomic=atomic, answered=answered
            )
        except Exception as exc:
            if not answered:
                raise
            # The send failed part way: the calls answered before it keep their answers, the
            # rest get its error (their outcome is unknown). Re-sending the answered NOSCRIPT
            # ones below cannot reorder a thread: a batch of distinct threads is the only one
            # that can end so (a `MULTI` block answers its calls at once).
            replies = answered + [exc] * (len(calls) - len(answered))
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            again: list[Any] = []
            try:
                again = await self._pipeline(
                    [calls[i] for i in missing], with_source=True, answered=again
                )
            except Exception as exc:
                again += [exc] * (len(missing) - len(again))
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    async def _run_in_order(self, calls: list[Call], keys: list[Any]) -> list[Any]:
        """`_run` for a batch holding some thread (first key) more than once.

        A pipeline is not atomic: another client may cache the script again between two calls
        of one thread, after the first answered NOSCRIPT and before the second runs (after a
        failover every client's NOSCRIPT fallback does). Re-sending the first would then put it
        after the second. On the direct path the batch goes in one ``MULTI``/``EXEC``, which
        runs its calls with no other client's command between them, so they all see the same
        script cache: all NOSCRIPT, or none. Through redis-py (a cluster pipeline spans nodes,
        a single-connection client sends one call at a time) it goes in rounds instead, each
        thread's n-th call in round n, each round answered and re-sent before the next.
        """
        if self._held is not None:
            return await self._run(calls, atomic=True)
        rounds: list[list[int]] = []
        seen: dict[Any, int] = {}
        for i, key in enumerate(keys):
            n = seen.get(key, 0)
            seen[key] = n + 1
            if n == len(rounds):
                rounds.append([])
            rounds[n].append(i)
        replies: list[Any] = [None] * len(calls)
        doubt: dict[Any, Exception] = {}  # thread -> the error of its call of unknown outcome
        for indices in rounds:
            # A thread whose earlier call may or may not have landed sends no more: its next
            # call could land before a retry of that one. It gets the same error (it did not
            # land, so a retry of it is safe); the other threads go on.
            send = []
            for i in indices:
                lost = doubt.get(keys[i])
                if lost is None:
                    send.append(i)
                else:
                    replies[i] = lost
            if not send:
                continue
            got: list[Any]
            try:
                got = await self._run([calls[i] for i in send])
            except Exception as exc:
                got = [exc] * len(send)
            for i, reply in zip(send, got, strict=True):
                replies[i] = reply
                if _outcome_unknown(reply):
                    doubt[keys[i]] = reply
        return replies

    async def _pipeline(
        self,
        calls: list[Call],
        *,
        with_source: bool,
        atomic: bool = False,
        answered: list[Any] | None = None,
    ) -> list[Any]:
        """The calls sent once, a reply each. When the send fails part way, ``answered`` (if
        given) holds the replies of the first calls, read before it failed."""
        if self._held is not None:
            sha, source = self._sha, self._source
            if with_source:
                payload = b"".join(
                    with_script_source(c, sha, source)
                    if type(c) is bytes
                    else pack_script_call(b"EVAL", source, *c)
                    for c in calls
                )
            else:
                try:
                    payload = b"".join(calls)  # type: ignore[arg-type]  # all packed, mostly
                except TypeError:
                    payload = b"".join(
                        c if type(c) is bytes else pack_script_call(b"EVALSHA", sha, *c)
                        for c in calls
                    )
            if not atomic:
                return await self._held.exchange(payload, len(calls), answered)
            return _executed(
                await self._held.exchange(b"".join((_MULTI, payload, _EXEC)), len(calls) + 2)
            )
        assert not atomic  # redis-py's path runs such a batch in rounds
        command, text = (
            ("EVAL", self.script.source) if with_source else ("EVALSHA", self.script.sha)
        )
        if getattr(self.client, "single_connection_client", False):
            # Its one connection is the only one it uses; a pipeline would take another from
            # its pool. The calls go one after another on it, in order, an error each.
            replies: list[Any] = []
            for call in calls:
                assert not isinstance(call, bytes)
                keys, args = call
                try:
                    replies.append(
                        await self.client.execute_command(command, text, len(keys), *keys, *args)
                    )
                except ResponseError as exc:
                    replies.append(exc)
                except Exception:
                    # The calls before it were answered; this one's outcome is unknown, and
                    # the ones after it were never sent.
                    if answered is not None:
                        answered[:] = replies
                    raise
            return replies
        if isinstance(self.client, RedisCluster) and len(calls) > 1:
            return await self._per_node(calls, command, text)
        return await self._one_pipeline(calls, command, text)

    async def _one_pipeline(self, calls: list[Call], command: str, text: str) -> list[Any]:
        pipe = self.client.pipeline(transaction=False)
        for call in calls:
            assert not isinstance(call, bytes)  # packed calls are for the direct path only
            keys, args = call
            pipe.execute_command(command, text, len(keys), *keys, *args)
        return list(await pipe.execute(raise_on_error=False))

    async def _per_node(self, calls: list[Call], command: str, text: str) -> list[Any]:
        """A cluster batch as one pipeline per node, sent together. One pipeline for all
        raises for all when one node fails (redis-py's, after its retries), and does so as
        soon as that node fails, before the others have answered: the calls other nodes ran
        were reported failed (a caller retrying them without an idempotency key would append
        them twice). Per node, each node's calls get its own outcome."""
        groups: dict[Any, list[int]] = {}
        try:
            for i, call in enumerate(calls):
                assert not isinstance(call, bytes)
                node = self.client.get_node_from_key(call[0][0])
                groups.setdefault(None if node is None else node.name, []).append(i)
        except Exception:  # a slot without a known node: the pipeline finds (or refreshes) it
            groups = {None: list(range(len(calls)))}
        if len(groups) == 1:
            return await self._one_pipeline(calls, command, text)
        indices = list(groups.values())
        outcomes = await asyncio.gather(
            *(self._one_pipeline([calls[i] for i in idx], command, text) for idx in indices),
            return_exceptions=True,
        )
        replies: list[Any] = [None] * len(calls)
        errors: list[BaseException] = []
        for idx, outcome in zip(indices, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):
                    raise outcome
                errors.append(outcome)
                for i in idx:
                    replies[i] = outcome
            else:
                for i, reply in zip(idx, outcome, strict=True):
                    replies[i] = reply
        if len(errors) == len(indices):
            raise errors[0]  # no call's outcome is known
        return replies


def _outcome_unknown(reply: Any) -> bool:
    """Whether a call's outcome is unknown: it failed without an answer from the script
    (a connection error or a timeout), not with an error reply."""
    return isinstance(reply, Exception) and not isinstance(reply, ResponseError)


def _executed(replies: list[Any]) -> list[Any]:
    """The calls' replies out of the replies to ``MULTI``, each call and ``EXEC``."""
    executed = replies[-1]
    if isinstance(executed, list):
        return executed
    # EXECABORT: a call was refused when queued, and none ran; each gets its own refusal, or
    # the EXEC's error.
    if not isinstance(executed, Exception):
        executed = ResponseError(f"EXEC answered {executed!r}: no call of the batch ran")
    return [r if isinstance(r, Exception) else executed for r in replies[1:-1]]


APPEND = Script.from_package("append")
READ_VIEWS = Script.from_package("read_views")
LOAD_VIEWS = Script.from_package("load_views")
SWAP_VIEWS = Script.from_package("swap_views")
SEQ_AT = Script.from_package("seq_at")
DELETE_THREAD = Script.from_package("delete_thread")
APPLY_CHECKPOINTED = Script.from_package("apply_checkpointed")
DELETE_CHECKPOINTED = Script.from_package("delete_checkpointed")
TRIM_FEED = Script.from_package("trim_feed")
THREADS_AFTER = Script.from_package("threads_after")
