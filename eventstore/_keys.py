"""The Redis key layout: every key threadlog writes is built here, hash tag included.

All keys of a namespace start with ``tl:{<namespace>:`` so that one Redis ACL pattern
(``~tl:{<namespace>:*``) confines a user to one tenant. A thread's keys carry the hash tag of
its partition, ``{<namespace>:<partition>}``: the thread's log, meta (with the idempotency
ledger) and views, the partition's change feed and thread index all live in one Cluster slot,
so one atomic script can write all of them. The thread id comes last in every key and views
are named from a colon-free charset, so no two threads' keys can collide whatever their ids
contain.
"""

from __future__ import annotations

import zlib

from ._ids import validate_namespace, validate_thread_id, validate_view_name

PREFIX = "tl"
DEFAULT_PARTITIONS = 16
MAX_PARTITIONS = 16384  # one per Cluster slot is the most that can ever spread out
STAGING_TTL_S = 600
"""How long a staging key of a chunked view load lives unless the load completes (each chunk
renews it): a rebuild that dies half way leaves its partial copy behind for this long at most."""


def partition_of(thread_id: str, partitions: int) -> int:
    """The partition a thread belongs to: a stable hash, identical in every process."""
    return zlib.crc32(thread_id.encode("utf-8")) % partitions


ACL_COMMANDS: tuple[str, ...] = (
    # connect(): PING, then the namespace's settings hash
    "+ping", "+hsetnx", "+hget",
    # reads (plain, and MULTI/EXEC snapshots of several views), the change feed and its groups
    "+xrange", "+xrevrange", "+zrevrangebyscore", "+hgetall", "+exists", "+multi", "+exec",
    # paging the thread index after a thread (`threads(after=...)`, a read script)
    "+zcount", "+zrevrange",
    # audits: is a thread in the thread index. (Not +scan, which `stored_threads` sends: Redis
    # does not confine SCAN to the user's key pattern, so it would list every tenant's keys.)
    "+zscore",
    "+xgroup|create", "+xgroup|setid", "+xgroup|destroy", "+xreadgroup", "+xautoclaim",
    "+xack", "+xpending", "+xinfo|groups", "+xinfo|stream", "+xtrim", "+xsetid",
    # the scripts (called by SHA, re-sent with EVAL after NOSCRIPT) and what they call
    "+evalsha", "+eval",
    "+time", "+type", "+xadd", "+hset", "+hmget", "+hdel", "+hincrby", "+del",
    # the names of an async projection's hashes (recorded when written, read to delete them)
    "+sadd", "+smembers",
    "+rpush", "+rpop", "+lrange", "+zadd", "+zrem",
    # chunked view loads: staging keys with a TTL, checked and renamed over the views
    "+pexpire", "+llen", "+hlen", "+rename", "+persist", "+unlink",
)  # fmt: skip
"""Every command a store sends, or its scripts call (Redis checks both against the user)."""


ACL_READ_COMMANDS: tuple[str, ...] = (
    # connect() (it records nothing when it may not), plain reads and MULTI/EXEC snapshots
    "+ping", "+hget", "+xrange", "+xrevrange", "+zrevrangebyscore", "+hgetall", "+exists",
    "+multi", "+exec", "+lrange", "+llen", "+hlen", "+hmget", "+type", "+zscore",
    "+zcount", "+zrevrange",
    # the change feed as it stands (`feed_info`, `feed_groups`): no group is written
    "+xinfo|stream", "+xinfo|groups", "+xpending",
    # the read scripts (read_views, seq_at, threads_after), by SHA and re-sent with EVAL; the
    # commands they call are all above
    "+evalsha", "+eval",
)  # fmt: skip
"""What a read-only user (an auditor) needs: verify, check, show, replay and every read, but
no append, no view write, no change-feed group (export and projection runners write those)."""


def acl_rules(namespace: str, *, read_only: bool = False) -> list[str]:
    """``ACL SETUSER`` rules (after ``on`` and the password) confining a user to one namespace;
    with ``read_only``, to reading it (`ACL_READ_COMMANDS`)."""
    commands = ACL_READ_COMMANDS if read_only else ACL_COMMANDS
    return [acl_key_pattern(namespace), "resetchannels", "-@all", *commands]


def key_pattern(namespace: str) -> str:
    """A glob (``SCAN MATCH``) covering exactly one namespace's keys (its charset holds no
    glob character)."""
    return f"{PREFIX}:{{{validate_namespace(namespace)}:*"


def acl_key_pattern(namespace: str) -> str:
    """The Redis ACL key pattern that covers exactly one namespace's keys."""
    return f"~{key_pattern(namespace)}"


class KeyLayout:
    """Builds the key names of one namespace with a fixed number of partitions."""

    __slots__ = ("_tags", "namespace", "partitions")

    def __init__(self, namespace: str, partitions: int = DEFAULT_PARTITIONS) -> None:
        self.namespace = validate_namespace(namespace)
        if not 1 <= partitions <= MAX_PARTITIONS:
            raise ValueError(f"partitions must be in 1..{MAX_PARTITIONS}, not {partitions}")
        self.partitions = partitions
        self._tags = [f"{PREFIX}:{{{namespace}:{p}}}" for p in range(partitions)]

    @staticmethod
    def config_key(namespace: str) -> str:
        """The namespace's settings hash (fixes the partition count for every client)."""
        return f"{PREFIX}:{{{validate_namespace(namespace)}:cfg}}"

    CONFIG_KEY_PATTERN = f"{PREFIX}:{{*:cfg}}"
    """A glob (``SCAN MATCH``) covering every namespace's settings hash (`config_key`)."""

    @staticmethod
    def namespace_of_config_key(key: bytes | str) -> str | None:
        """The namespace whose `config_key` ``key`` is (None for any other key)."""
        text = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
        head, tail = f"{PREFIX}:{{", ":cfg}"
        if not (text.startswith(head) and text.endswith(tail)):
            return None
        try:
            return validate_namespace(text[len(head) : -len(tail)])
        except ValueError:
            return None

    def partition(self, thread_id: str) -> int:
        """The partition of ``thread_id``."""
        return partition_of(thread_id, self.partitions)

    def _tag(self, thread_id: str) -> str:
        return self._tags[partition_of(thread_id, self.partitions)]

    def log(self, thread_id: str) -> str:
        """The thread's event stream."""
        return f"{self._tag(thread_id)}:log:{thread_id}"

    def meta(self, thread_id: str) -> str:
        """The thread's meta hash: version, chain head, last time, creation time, and the
        idempotency ledger (one field per append: key -> first seq, last seq, request digest)."""
        return f"{self._tag(thread_id)}:meta:{thread_id}"

    def view(self, thread_id: str, view: str) -> str:
        """One materialized view of the thread."""
        return f"{self._tag(thread_id)}:view:{validate_view_name(view)}:{thread_id}"

    def staging(self, thread_id: str, token: str, n: int) -> str:
        """A staging key of a chunked view load: contents for the load's ``n``-th op, renamed
        over the view at the end (``token`` tells concurrent loads apart)."""
        return f"{self._tag(thread_id)}:load:{token}:{n}:{thread_id}"

    def feed(self, partition: int) -> str:
        """The partition's change feed stream."""
        return f"{self._tags[partition]}:feed"

    def index(self, partition: int) -> str:
        """The partition's thread index: a sorted set of thread ids by last activity (ms)."""
        return f"{self._tags[partition]}:threads"

    def checkpoints(self, partition: int) -> str:
        """The partition's hash of async-projection checkpoints (name -> feed id)."""
        return f"{self._tags[partition]}:ckpt"

    def view_names(self, partition: int) -> str:
        """The partition's set of the view names any append or view load of its threads wrote
        to, recorded before the first write of each: so that a thread is deleted with every
        view it has (`EventStore.delete_thread`), whatever the caller names, without a SCAN."""
        return f"{self._tags[partition]}:viewnames"

    def aux(self, partition: int, name: str, hash_name: str) -> str:
        """A partition-level hash owned by async projection ``name``."""
        validate_view_name(name)
        validate_view_name(hash_name)
        return f"{self._tags[partition]}:aux:{name}:{hash_name}"

    def aux_names(self, partition: int, name: str) -> str:
        """The partition's set of the names of async projection ``name``'s hashes (`aux`):
        every one it ever wrote to, so that its state can be deleted without a SCAN."""
        validate_view_name(name)
        return f"{self._tags[partition]}:auxnames:{name}"

    def thread_of(self, key: bytes | str) -> str | None:
        """The thread whose log or meta hash ``key`` is (None for any other key, or for one no
        store of this layout writes: a thread id in another partition's tag, an invalid id)."""
        found = self.tagged_thread_of(key)
        if found is None or partition_of(found[0], self.partitions) != found[1]:
            return None
        return found[0]

    def tagged_thread_of(self, key: bytes | str) -> tuple[str, int] | None:
        """The thread whose log or meta hash ``key`` is, with the partition its tag names,
        whether or not this layout puts the thread there (`thread_of` checks that): a thread's
        keys in another partition's tag are keys of the namespace's that readers look for
        elsewhere (its partition count was edited, or the keys were moved)."""
        try:
            text = key.decode("utf-8") if isinstance(key, bytes) else key
        except UnicodeDecodeError:
            return None
        head = f"{PREFIX}:{{{self.namespace}:"
        if not text.startswith(head):
            return None
        partition, sep, rest = text[len(head) :].partition("}:")
        if not sep or not partition.isdigit():
            return None
        for kind in ("log:", "meta:"):
            if rest.startswith(kind):
                thread_id = rest[len(kind) :]
                try:
                    validate_thread_id(thread_id)
                except ValueError:
                    return None
                return thread_id, int(partition)
        return None

    def thread_keys(self, thread_id: str) -> tuple[str, str, str, str]:
        """Log, meta, feed and index keys of the thread, in the append script's order."""
        p = partition_of(thread_id, self.partitions)
        tag = self._tags[p]
        return (
            f"{tag}:log:{thread_id}",
            f"{tag}:meta:{thread_id}",
            f"{tag}:feed",
            f"{tag}:threads",
        )
