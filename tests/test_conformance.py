"""The shared conformance suite, run against the memory backend and a real redis-server."""

from __future__ import annotations

from typing import Any

import pytest

from eventstore import EventStore, MemoryEventStore, MemoryServer, RedisEventStore, open_store
from eventstore._connect import StoreSettings
from eventstore.testing import EventStoreConformance


class TestMemoryEventStore(EventStoreConformance):
    server = MemoryServer()

    async def make_store(self, namespace: str, **options: Any) -> EventStore:
        return MemoryEventStore(namespace=namespace, server=self.server, **options)

    async def write_raw_entry(
        self, store: EventStore, thread_id: str, entry_id: str, fields: dict[bytes, bytes]
    ) -> None:
        assert isinstance(store, MemoryEventStore)
        ms, seq = entry_id.split("-")
        thread = store.server.namespaces[store.namespace].threads[thread_id]
        thread.raw_xadd((int(ms), int(seq)), fields)

    async def forget_chain_key(self, store: EventStore, thread_id: str) -> None:
        assert isinstance(store, MemoryEventStore)
        store.server.namespaces[store.namespace].threads[thread_id].fingerprint = None

    async def unindex_thread(self, store: EventStore, thread_id: str) -> None:
        assert isinstance(store, MemoryEventStore)
        del store.server.namespaces[store.namespace].index[thread_id]


class TestRedisEventStore(EventStoreConformance):
    @pytest.fixture(autouse=True)
    def _redis(self, redis_url: str) -> None:
        self.url = redis_url

    async def make_store(self, namespace: str, **options: Any) -> EventStore:
        registry = options.pop("registry", None)
        settings = StoreSettings.from_url(self.url, namespace=namespace, **options)
        return await open_store(settings, registry=registry)

    async def flush_scripts(self, store: EventStore) -> None:
        assert isinstance(store, RedisEventStore)
        await store.client.script_flush()

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
