"""The store's own path to Redis for its hot calls: RESP packed here, sent on held connections.

An append is one script call and a history window one LRANGE, so their client cost is mostly
redis-py's per-command machinery: ``execute_command`` checks a connection out of the pool (a
lock, an ``async_timeout``, a ``can_read`` probe), wraps the call in its retry loop, records
observability metrics, packs each argument through the generic encoder and sends under
``asyncio.wait_for`` (a new task per command), then checks it back in. Measured here on
redis-py 8.1 that is ~40 us of CPU per call, more than the whole rest of an append.

`HeldConnections` keeps a few of the pool's connections checked out for the store's hot calls
(appends, view reads, versions) and talks RESP on them directly: the command bytes are built in
one format, written to the connection's stream, and the replies read with the connection's own
parser (hiredis when installed), under the connection's socket timeout and retry policy.
What stays the same as redis-py's path:

* Connections come from, and go back to, the client's pool (``close`` returns them), so
  authentication, TLS, ``SELECT`` and reconnects are redis-py's own ``connect``.
* Connection and timeout errors go through the connection's ``Retry`` (disconnect, back off,
  reconnect, send again). Every call sent this way is a read, or an append whose retry is a
  duplicate the script recognises by its idempotency key, so a repeat is safe.
* A call that ends any other way mid-exchange (cancelled, say) leaves replies unread: that
  connection is never reused as it is.

One thing differs on purpose. A connection whose replies stopped coming in time (a timeout,
or the caller cancelled) after its commands were written is not closed: closing it would not
take them back (they wait in the server's socket buffer and still run when a stalled server
wakes, possibly after commands sent later on other connections), it would only lose sight of
when they ran. It is read aside instead (`HeldConnections.draining`) until its replies have
all come, so the caller can hold back what must run after them; the retry goes on another
connection.

Used only where it is exact: a standalone or sentinel-managed ``redis.asyncio.Redis`` on RESP2,
or on RESP3 where hiredis tells push messages apart, without a single shared connection.
Anything else (cluster, a single-connection client) keeps redis-py's path. On a sentinel pool
these connections follow a failover as redis-py's do: a ``READONLY`` reply (the primary was
demoted) drops the connection and the retry reconnects through the sentinels, and a held
connection still on an old primary the pool has moved away from reconnects before it is used.
Calls sent this way do not appear in redis-py's own command metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._errors import StoreClosedError

# Connections kept between calls: group commit has one send in flight, rarely more. Never more
# than a quarter of the pool, so other commands on the same client are not starved of it.
_MAX_IDLE = 2
_READ_SIZE = 65536
# A connection read aside waits this many socket timeouts for its replies; then it is closed
# (what it sent may still run later: see `HeldConnections.draining`).
_DRAIN_TIMEOUTS = 4

_HIREDIS_PARSER: Any = None  # redis-py's hiredis parser class, read from directly when in use
NOT_ENOUGH_DATA: Any = None
_HIREDIS_PUSH: Any = None  # hiredis's type of a RESP3 push message (hiredis 3.2 and later)
try:
    from redis._parsers import hiredis as _redis_hiredis

    _HIREDIS_PARSER = _redis_hiredis._AsyncHiredisParser
    NOT_ENOUGH_DATA = _redis_hiredis.NOT_ENOUGH_DATA
    import hiredis as _hiredis

    if hasattr(_HIREDIS_PARSER, "handle_push_response"):
        _HIREDIS_PUSH = getattr(_hiredis, "PushNotification", None)
except (ImportError, AttributeError):  # another redis-py layout: its read_response is used
    pass


def _bulk(arg: Any) -> bytes:
    if type(arg) is bytes:
        return arg
    if isinstance(arg, str):
        return arg.encode("utf-8")
    if isinstance(arg, int) and not isinstance(arg, bool):
        return b"%d" % arg
    if isinstance(arg, bytes | bytearray | memoryview):
        return bytes(arg)
    raise TypeError(f"cannot send {type(arg).__name__} to redis")


BULK_HEADERS = [b"$%d\r\n" % n for n in range(1024)]
"""The RESP header of a bulk string, by its length (below 1024)."""


def pack_command(parts: Sequence[Any]) -> bytes:
    """One command in RESP (bytes, str and int arguments)."""
    return b"*%d\r\n" % len(parts) + pack_bulks(parts)


def pack_bulks(parts: Sequence[Any]) -> bytes:
    """``parts`` as RESP bulk strings, one after another (no array header): the arguments of
    a command whose head is packed already."""
    headers = BULK_HEADERS
    if all(type(p) is bytes for p in parts):
        # Each header looked up (not formatted) and concatenated with its value, then all
        # joined on CRLF: a quarter fewer instructions than a join of header, value and CRLF
        # as three items (callgrind, an append's ~25 arguments), though the values' bytes are
        # copied once more.
        return (
            b"\r\n".join(
                [(headers[n] if (n := len(b)) < 1024 else b"$%d\r\n" % n) + b for b in parts]
            )
            + b"\r\n"
        )
    return pack_bulks([p if type(p) is bytes else _bulk(p) for p in parts])


def pack_script_call(
    command: bytes, body: bytes, keys: Sequence[Any], args: Sequence[Any]
) -> bytes:
    """One ``EVALSHA``/``EVAL`` command in RESP: ``command body numkeys keys... args...``."""
    return pack_command((command, body, b"%d" % len(keys), *keys, *args))


def evalsha_prefix(sha: bytes) -> bytes:
    """The RESP of ``EVALSHA <sha>`` that follows a packed call's argument count."""
    return b"$7\r\nEVALSHA\r\n$%d\r\n%b\r\n" % (len(sha), sha)


def with_script_source(command: bytes, sha: bytes, source: bytes) -> bytes:
    """A packed ``EVALSHA <sha> ...`` as ``EVAL <source> ...``, every other argument as it was."""
    count, _, rest = command.partition(b"\r\n")
    prefix = evalsha_prefix(sha)
    if not (count[:1] == b"*" and rest.startswith(prefix)):
        raise ValueError("not a packed EVALSHA of this script")
    return b"%b\r\n$4\r\nEVAL\r\n$%d\r\n%b\r\n%b" % (
        count,
        len(source),
        source,
        rest[len(prefix) :],
    )


async def _make_ready(conn: Any) -> None:
    """What the pool checks when it hands a connection out, for one that waited here: a server
    that closed it meanwhile (a kill, a timeout) or left bytes on it means reconnect first."""
    # redis-py 8 names the probe can_read; earlier releases, can_read_destructive.
    probe = getattr(conn, "can_read", None) or conn.can_read_destructive
    try:
        stale = conn.is_connected and await probe()
    except (RedisConnectionError, OSError):
        stale = True
    if stale:
        await conn.disconnect()


def _left_behind(conn: Any, pool: Any) -> bool:
    """Whether a connected sentinel-managed connection is to another server than the
    primary its pool last heard of from the sentinels."""
    primary = pool.master_address
    return conn.is_connected and primary is not None and (conn.host, conn.port) != primary


def _raise_if_demoted(replies: list[Any]) -> None:
    """Raise a connection error if a reply (or a reply in a transaction's) is ``READONLY``:
    the primary this connection reached is a replica now. The replies before it are kept in
    ``replies``, which the caller reports as answered; the command refused, and those after
    it, ran nowhere (a replica writes nothing), so a retry on the new primary is safe.

    This is what redis-py's sentinel connection does in ``read_response``, which these reads
    skip: the retry's reconnect asks the sentinels for the primary again.
    """
    for i, reply in enumerate(replies):
        if isinstance(reply, ReadOnlyError) or (
            type(reply) is list and any(isinstance(r, ReadOnlyError) for r in reply)
        ):
            del replies[i:]
            raise RedisConnectionError("the primary is a replica now (READONLY): a failover")


async def _read_hiredis(parser: Any, replies: int, out: list[Any]) -> list[Any]:
    """``replies`` replies off redis-py's hiredis parser, without its per-read wrapper, into
    ``out`` (which keeps the ones read when a later one fails).

    The same reader and stream redis-py's ``read_response`` uses, so nothing is left behind in
    a buffer it does not see; error replies come back as its ``ResponseError`` subclasses
    (NOSCRIPT as ``NoScriptError``), in their place. On RESP3 a push message (out of band:
    no command's reply) goes to redis-py's handler, as its own read does, and is not counted.
    """
    reader, stream = parser._reader, parser._stream
    push = _HIREDIS_PUSH
    while len(out) < replies:
        reply = reader.gets()
        if reply is NOT_ENOUGH_DATA:
            chunk = await stream.read(_READ_SIZE)
            if not chunk:
                raise RedisConnectionError("redis closed the connection")
            reader.feed(chunk)
            continue
        if isinstance(reply, RedisConnectionError):
            raise reply
        if push is not None and isinstance(reply, push):
            await parser.handle_push_response(reply)
            continue
        out.append(reply)
    return out


def follows_failover(pool: Any) -> bool:
    """Whether ``pool``'s connections follow a primary that moves: a sentinel pool's ask the
    sentinels for the primary when they connect, and drop themselves when a reply says the
    server is a replica now (a failover). `HeldConnections` does the second itself, as its
    reads skip redis-py's ``read_response`` (`_raise_if_demoted`)."""
    return isinstance(pool, SentinelConnectionPool) and bool(getattr(pool, "is_master", False))


def packs_like_redis_py(client: Any) -> bool:
    """Whether commands the store packs itself and sends on this client's pool connections
    are exactly what redis-py would send there, and their replies read as it would: a plain
    standalone or sentinel-managed client (no shared connection) whose connections speak
    plain RESP."""
    kind = type(client)
    # A subclass may send commands its own way; one of threadlog's says it does not (only
    # that class: a subclass of it is checked again).
    if not (kind is aioredis.Redis or kind.__dict__.get("sends_as_redis_py", False)):
        return False
    if client.connection is not None:
        return False
    return speaks_plain_resp(getattr(client.connection_pool, "connection_kwargs", {}))


def can_hold(client: Any) -> bool:
    """Whether `HeldConnections` can serve this client exactly as redis-py would."""
    # A single-connection client makes its connection on its first command: the flag says.
    return (
        packs_like_redis_py(client)
        and not getattr(client, "single_connection_client", False)
        and hasattr(client.connection_pool, "get_connection")
    )


def speaks_plain_resp(connection_kwargs: Any) -> bool:
    """Whether replies on such connections come as the store reads them on its own: RESP2, or
    RESP3 where redis-py's reader tells push messages apart (hiredis 3.2 and later; the
    replies of the commands the store sends itself, arrays, strings, integers and nils, are
    the same objects on both protocols)."""
    protocol = str(connection_kwargs.get("protocol") or 2)
    if protocol == "2":
        return True
    return protocol == "3" and _HIREDIS_PUSH is not None


class _Deadline:
    """One exchange's read deadline (see `Deadlines`)."""

    __slots__ = ("at", "cancelling", "expired", "task")

    def __init__(self, at: float, task: asyncio.Task[Any]) -> None:
        self.at = at
        self.task = task
        # The task's pending cancellations when the deadline was set: only a cancellation of
        # ours beyond them turns into a timeout (as ``asyncio.timeout`` tells its own apart).
        self.cancelling = task.cancelling()
        self.expired = False


class Deadlines:
    """The read deadlines of the exchanges in flight, kept by one timer rather than one each.

    ``asyncio.timeout`` pushes a timer handle on the loop's heap and cancels it again around
    every read: a tenth of a `SessionStore.append`'s client instructions (callgrind: 372k with
    it, 334k with no deadline at all). Here an exchange registers its deadline and task; one
    timer, armed at the earliest deadline, cancels the tasks whose deadline has passed and is
    armed again at the next one; an exchange that ends in time only unregisters. Under a
    steady stream of calls the timer goes off about once per timeout.

    What a task sees is what ``asyncio.timeout`` gives: a `asyncio.CancelledError` at its
    await, which `expired` turns into a timeout unless the task was also cancelled by someone
    else.
    """

    def __init__(self) -> None:
        self._waiting: set[_Deadline] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, timeout: float) -> _Deadline:
        """Register the current task's deadline, ``timeout`` seconds from now."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise RuntimeError("a read deadline needs a task to cancel")
        deadline = _Deadline(loop.time() + timeout, task)
        self._waiting.add(deadline)
        if self._timer is None or deadline.at < self._timer_at or loop is not self._loop:
            self._arm(loop, deadline.at)
        return deadline

    def stop(self, deadline: _Deadline) -> None:
        """The exchange ended (in time or not): forget its deadline."""
        self._waiting.discard(deadline)

    def close(self) -> None:
        """Disarm the timer if no exchange is waiting on it."""
        if self._timer is not None and not self._waiting:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._loop, self._timer_at = loop, at
        self._timer = loop.call_at(at, self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_at = None, math.inf
        loop = self._loop
        assert loop is not None
        now = loop.time()
        following = math.inf
        for deadline in list(self._waiting):
            if deadline.task.get_loop() is not loop:
                continue  # of another loop (a store used from a second event loop)
            if deadline.at <= now:
                self._waiting.discard(deadline)
                deadline.expired = True
                deadline.task.cancel()
            elif deadline.at < following:
                following = deadline.at
        if following != math.inf:
            self._arm(loop, following)


def expired(deadline: _Deadline) -> bool:
    """Whether ``deadline`` cancelled its task and that is the task's only cancellation beyond
    those pending when it was set: then the `asyncio.CancelledError` the task sees means "timed
    out". The deadline's cancellation is withdrawn (``Task.uncancel``) on the first call."""
    if not deadline.expired:
        return False
    deadline.expired = False
    return deadline.task.uncancel() <= deadline.cancelling


class HeldConnections:
    """A few pool connections held for appends, spoken to in RESP directly."""

    def __init__(self, client: Any) -> None:
        self._pool: Any = client.connection_pool
        self._idle: list[Any] = []
        self._keep = min(_MAX_IDLE, int(getattr(self._pool, "max_connections", 0)) // 4)
        self._held: set[Any] = set()
        # A sentinel pool's primary moves: a connection to the old one is left (`_once`).
        self._failover = follows_failover(self._pool)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._deadlines = Deadlines()
        # Connection -> the task reading it aside: its exchange ended (timed out, cancelled)
        # after its commands were written, with their replies still to come. Until it ends,
        # those commands may not have run yet; when it ends they have (or, if it gave up
        # after _DRAIN_TIMEOUTS socket timeouts, may still, later).
        self.draining: dict[Any, asyncio.Task[None]] = {}

    async def exchange(
        self, payload: bytes, replies: int, answered: list[Any] | None = None
    ) -> list[Any]:
        """Send ``payload`` (``replies`` commands) and read their replies, in order.

        An error reply is returned in its place as a ``ResponseError``; connection and timeout
        errors are retried by the connection's policy and raised when it gives up. Then
        ``answered`` (if given) holds the longest run of replies one attempt read before it
        failed: the first commands', which ran and answered so (the rest may or may not have
        run).
        """
        try:
            conn = await self._ready_connection()
        except Exception as exc:
            if self._closed:  # closed while it connected: nothing was sent
                raise StoreClosedError("the store is closed") from exc
            raise
        # The connection the next attempt uses; None when the last one was read aside (the
        # next attempt takes another from the pool).
        using: list[Any] = [conn]
        sent = [False]  # an attempt wrote the payload: it may have run

        async def attempt() -> list[Any]:
            if self._closed:  # closed before this call's attempt: none is made
                if not sent[0]:
                    raise StoreClosedError("the store is closed")
                raise StoreClosedError.in_flight()
            sent[0] = True
            c = using[0]
            if c is None:
                c = using[0] = await self._check_out()
            return await self._once(c, payload, replies, answered)

        async def failed(error: Exception) -> None:
            c = using[0]
            if c is not None:
                if c in self.draining:
                    using[0] = None
                else:
                    await c.disconnect()

        try:
            result: list[Any] = await conn.retry.call_with_retry(attempt, failed)
        except BaseException as exc:
            # Replies may be left unread on it (a retry given up, a cancelled connect): never
            # reuse it as it is. Disconnecting and returning it is done aside, so a cancelled
            # caller is not held up. One read aside is given back by its reader.
            c = using[0]
            if c is not None and c not in self.draining:
                self._drop(c)
            if (
                self._closed
                and isinstance(exc, Exception)
                and not isinstance(exc, StoreClosedError)
            ):
                # Disconnected under it by `close`: redis-py then fails in whatever it was
                # doing (an AttributeError on a writer gone, a TypeError on a reader gone).
                raise (
                    StoreClosedError.in_flight()
                    if sent[0]
                    else StoreClosedError("the store is closed")
                ) from exc
            raise
        conn = using[0]
        if self._closed or len(self._idle) >= self._keep:
            self._held.discard(conn)
            await self._pool.release(conn)
        else:
            self._idle.append(conn)
        return result

    async def _ready_connection(self) -> Any:
        """An idle connection made ready, else one checked out of the pool."""
        if not self._idle:
            return await self._check_out()
        conn = self._idle.pop()
        try:
            await _make_ready(conn)  # may wait: disconnecting one the server closed
            if self._failover and _left_behind(conn, self._pool):
                # Another connection found the primary moved (a failover): this one, kept
                # here, still talks to the old one, a replica now or soon, whose reads may
                # miss what was written to the new one. It reconnects (`_once`).
                await conn.disconnect()
        except BaseException:
            self._drop(conn)  # out of the idle list: given back here, or never
            raise
        return conn

    async def _check_out(self) -> Any:
        conn = await self._pool.get_connection()
        self._held.add(conn)
        return conn

    async def _once(
        self, conn: Any, payload: bytes, replies: int, answered: list[Any] | None
    ) -> list[Any]:
        """One attempt of `exchange`; when it fails, ``answered`` keeps the replies it read if
        they are more than an earlier attempt's."""
        if not conn.is_connected:
            await conn.connect()
        parser = conn._parser
        # redis-py's hiredis reader keeps what it was fed when a read stops between two
        # chunks, so a connection read that way can be read on later (`_read_aside`).
        hiredis = (
            _HIREDIS_PARSER is not None
            and type(parser) is _HIREDIS_PARSER
            and getattr(parser, "_reader", None) is not None
            and getattr(parser, "_connected", True)
        )
        out: list[Any] = []
        writer = conn._writer
        writer.write(payload)
        try:
            try:
                # A small command leaves the transport's buffer empty (written at once); only
                # a large one waits for the socket, under the connection's timeout as
                # redis-py's send does (the rest is still written if that wait stops).
                if writer.transport.get_write_buffer_size():
                    try:
                        async with asyncio.timeout(conn.socket_timeout):
                            await writer.drain()
                    except TimeoutError:
                        raise RedisTimeoutError("Timeout writing to socket") from None
                # One deadline for all the replies, not redis-py's timer per read.
                timeout = conn.socket_timeout
                deadline = None if timeout is None else self._deadlines.start(timeout)
                try:
                    if hiredis:
                        await _read_hiredis(parser, replies, out)
                        if self._failover:
                            _raise_if_demoted(out)
                        return out
                    for _ in range(replies):
                        try:
                            out.append(await conn.read_response(timeout=math.inf))
                        except ResponseError as exc:
                            out.append(exc)
                    return out
                except asyncio.CancelledError:
                    if deadline is not None and expired(deadline):
                        raise RedisTimeoutError("Timeout reading from redis") from None
                    raise
                finally:
                    if deadline is not None:
                        self._deadlines.stop(deadline)
                        # Ended some other way after the deadline's cancellation was sent
                        # (the replies came in the same loop turn): withdrawn, as
                        # ``asyncio.timeout`` withdraws its own.
                        expired(deadline)
            except RedisConnectionError:  # closed, or a reply it cannot parse: spent
                await conn.disconnect(nowait=True)
                raise
            except OSError as exc:  # the connection broke: the server let go of it
                await conn.disconnect(nowait=True)
                raise RedisConnectionError(f"Error while talking to redis: {exc}") from exc
            except BaseException:
                # Timed out or cancelled with replies to come: what was sent still runs.
                if hiredis and conn.is_connected:
                    self._read_aside(conn, replies - len(out))
                else:
                    await conn.disconnect(nowait=True)  # a reply may be half read: spent
                raise
        except BaseException:
            # The first commands' replies were read: they ran and answered so. Kept for the
            # caller, who must not report those as failed (see `GroupCommit._run`).
            if answered is not None and len(out) > len(answered):
                answered[:] = out
            raise

    def _read_aside(self, conn: Any, replies: int) -> None:
        """Read a connection's ``replies`` outstanding replies in a task of its own, then give
        it back (see `draining`)."""
        task = asyncio.get_running_loop().create_task(self._drain(conn, replies))
        self.draining[conn] = task

    async def _drain(self, conn: Any, replies: int) -> None:
        timeout = conn.socket_timeout
        try:
            async with asyncio.timeout(None if timeout is None else timeout * _DRAIN_TIMEOUTS):
                await _read_hiredis(conn._parser, replies, [])
        except BaseException as exc:
            self._held.discard(conn)
            await self._release(conn, disconnect=True)
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            del self.draining[conn]
        if self._closed or len(self._idle) >= self._keep:
            self._held.discard(conn)
            await self._pool.release(conn)
        else:
            self._idle.append(conn)

    def _drop(self, conn: Any) -> None:
        self._held.discard(conn)
        task = asyncio.get_running_loop().create_task(self._release(conn, disconnect=True))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, conn: Any, *, disconnect: bool) -> None:
        with contextlib.suppress(Exception):
            if disconnect:
                await conn.disconnect(nowait=True)
            await self._pool.release(conn)

    async def close(self) -> None:
        """Return every held connection to the pool; a call still using one fails (it is
        disconnected under it) with `StoreClosedError`, and gives it back itself."""
        self._closed = True
        self._deadlines.close()
        drains = list(self.draining.values())
        for task in drains:
            task.cancel()  # it disconnects and returns its connection
        if drains:
            await asyncio.gather(*drains, return_exceptions=True)
        idle, self._idle = self._idle, []
        for conn in idle:
            self._held.discard(conn)
            await self._release(conn, disconnect=False)
        # Not handed back here: the pool would give a connection still read by its call to
        # another, which then read it too ("read() called while another coroutine is
        # already waiting"), and the call's own release would find it released (KeyError).
        for conn in self._held:
            with contextlib.suppress(Exception):
                await conn.disconnect(nowait=True)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
