"""The conformance suite's raw-write hooks for a Redis-backed store, shared by the standalone,
Cluster and tenant-confined test classes (each edits one key as its own client)."""

from __future__ import annotations

from eventstore import EventStore, RedisEventStore


class RedisHooks:
    """`EventStoreConformance` hooks that write one Redis key straight, bypassing the store."""

    async def write_raw_entry(
        self, store: EventStore, thread_id: str, entry_id: str, fields: dict[bytes, bytes]
    ) -> None:
        assert isinstance(store, RedisEventStore)
        await store.client.xadd(store.keys.log(thread_id), fields, id=entry_id)

    async def forget_chain_key(self, store: EventStore, thread_id: str) -> None:
        assert isinstance(store, RedisEventStore)
        assert await store.client.hdel(store.keys.meta(thread_id), "f") == 1

    async def unindex_thread(self, store: EventStore, thread_id: str) -> None:
        assert isinstance(store, RedisEventStore)
        index = store.keys.index(store.keys.partition(thread_id))
        assert await store.client.zrem(index, thread_id) == 1

    async def set_last_activity(self, store: EventStore, thread_id: str, ms: int) -> None:
        assert isinstance(store, RedisEventStore)
        index = store.keys.index(store.keys.partition(thread_id))
        await store.client.zadd(index, {thread_id: ms})

    async def set_version(self, store: EventStore, thread_id: str, version: int) -> None:
        assert isinstance(store, RedisEventStore)
        await store.client.hset(store.keys.meta(thread_id), "v", version)

    async def delete_meta(self, store: EventStore, thread_id: str) -> None:
        assert isinstance(store, RedisEventStore)
        assert await store.client.delete(store.keys.meta(thread_id)) == 1
