"""Auditor: verify against tampering done with raw stream commands, replay and diff.

Every test runs on the memory backend and on a real redis-server. On Redis the damage is done
with raw commands through the store's client (XADD, XDEL, DEL and re-XADD with explicit ids);
on the memory backend the same edits are made to its stream twin.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import anyio
import msgspec
import pytest
from ulid import ULID

import eventstore as es
from adapters import Auditor, UnverifiedLogError, Verdict, _audit
from eventstore import _codec
from eventstore._connect import StoreSettings
from eventstore._keys import KeyLayout, partition_of
from eventstore._memory import _Thread
from projections import Projector, RebuildBusyError, RebuildError, SeqBeyondVersionError

pytestmark = pytest.mark.anyio

T = "audited"
Fields = dict[bytes, bytes]
SECRET = b"correct horse battery staple"


async def open_backend(
    request: pytest.FixtureRequest, namespace: str, secret: bytes | None
) -> es.EventStore:
    if request.param == "memory":
        return es.MemoryEventStore(namespace=namespace, secret=secret)
    url: str = request.getfixturevalue("redis_url")
    return await es.open_store(StoreSettings.from_url(url, namespace=namespace, secret=secret))


@pytest.fixture(params=["memory", "redis"])
async def keyed(request: pytest.FixtureRequest) -> AsyncIterator[es.EventStore]:
    opened = await open_backend(request, "k" + uuid.uuid4().hex[:12], SECRET)
    try:
        yield opened
    finally:
        await opened.close()


class Raw:
    """Writes straight into a thread's stream, past every check the append path makes."""

    def __init__(self, store: es.EventStore, thread_id: str = T) -> None:
        self.store = store
        self.thread_id = thread_id

    async def entries(self) -> list[tuple[str, Fields]]:
        rows = await self.store.read_raw(self.thread_id, count=1_000_000)
        return [(entry_id.decode("ascii"), fields) for entry_id, fields in rows]

    async def xadd(self, entry_id: str, fields: Fields) -> None:
        if isinstance(self.store, es.RedisEventStore):
            key = self.store.keys.log(self.thread_id)
            await self.store.client.xadd(key, fields, id=entry_id)
        else:
            ms, sub = entry_id.split("-")
            self._memory_thread().raw_xadd((int(ms), int(sub)), fields)

    async def xdel(self, entry_id: str) -> None:
        if isinstance(self.store, es.RedisEventStore):
            key = self.store.keys.log(self.thread_id)
            assert await self.store.client.xdel(key, entry_id) == 1
        else:
            thread = self._memory_thread()
            ms, sub = entry_id.split("-")
            index = thread.ids.index((int(ms), int(sub)))
            del thread.ids[index], thread.entries[index]

    async def rewrite(self, entries: list[tuple[str, Fields]]) -> None:
        """Replace the whole stream (the only way to put an entry below the stream's top id)."""
        if isinstance(self.store, es.RedisEventStore):
            key = self.store.keys.log(self.thread_id)
            await self.store.client.delete(key)
            for entry_id, fields in entries:
                await self.store.client.xadd(key, fields, id=entry_id)
        else:
            thread = self._memory_thread()
            thread.ids.clear()
            thread.entries.clear()
            for entry_id, fields in entries:
                await self.xadd(entry_id, fields)

    async def unindex(self) -> None:
        """Remove the thread from its partition's thread index (a ZREM), nothing else."""
        if isinstance(self.store, es.RedisEventStore):
            index = self.store.keys.index(self.store.keys.partition(self.thread_id))
            assert await self.store.client.zrem(index, self.thread_id) == 1
        else:
            assert isinstance(self.store, es.MemoryEventStore)
            del self.store.server.namespaces[self.store.namespace].index[self.thread_id]

    async def drop_keys(self) -> None:
        """Delete the thread's log and meta hash, leaving its thread index entry."""
        if isinstance(self.store, es.RedisEventStore):
            keys = self.store.keys
            assert await self.store.client.delete(keys.log(self.thread_id)) == 1
            assert await self.store.client.delete(keys.meta(self.thread_id)) == 1
        else:
            assert isinstance(self.store, es.MemoryEventStore)
            del self.store.server.namespaces[self.store.namespace].threads[self.thread_id]

    async def set_head(self, head: str) -> None:
        """Write the chain head the thread's meta records."""
        if isinstance(self.store, es.RedisEventStore):
            await self.store.client.hset(self.store.keys.meta(self.thread_id), "h", head)
        else:
            self._memory_thread().head = head

    def _memory_thread(self) -> _Thread:
        assert isinstance(self.store, es.MemoryEventStore)
        return self.store.server.namespaces[self.store.namespace].threads[self.thread_id]


def user(text: str) -> es.Message:
    return es.Message(role="user", content=text)


def assistant(text: str) -> es.Message:
    return es.Message(role="assistant", content=text)


async def populate(store: es.EventStore, rounds: int = 3) -> int:
    """A thread with every kind of event, appended through the projector; returns the version."""
    projector = Projector(store)
    for r in range(rounds):
        root, child = es.new_ulid(), es.new_ulid()
        await projector.append(
            T,
            [es.TurnOpened(turn_id=root, request=user(f"q{r}"), grant=es.Grant(max_steps=4))],
        )
        await projector.append(
            T,
            [
                es.TurnOpened(turn_id=child, parent_turn_id=root),
                es.StateUpdated(block="plan", value={"round": r}, turn_id=root),
                es.TurnSettled(turn_id=child, parent_turn_id=root, outcome="failed"),
            ],
        )
        await projector.append(T, [es.TranscriptAppended(messages=[user(f"q{r}")])])
        await projector.append(
            T,
            [
                es.TurnSettled(
                    turn_id=root, outcome="completed", steps=2, assistant_message=assistant(f"a{r}")
                ),
                es.MessageAppended(message=user(f"note {r}")),
            ],
        )
    await projector.append(T, [es.TranscriptReplaced(messages=[assistant("summary")])])
    return await store.version(T)


def assert_damage(verdict: Verdict, seq: int, kind: str) -> None:
    assert not verdict.ok, verdict
    assert (verdict.first_bad_seq, verdict.kind) == (seq, kind), verdict
    assert verdict.problems[0].seq == seq and verdict.problems[0].kind == kind
    assert verdict.detail.startswith(verdict.problems[0].detail)


def edited(fields: Fields, text: str) -> Fields:
    """The same entry with a different (still valid) payload."""
    payload = es.MessageAppended(message=user(text))
    return {**fields, b"d": msgspec.msgpack.encode(payload)}


# -- verify: clean ----------------------------------------------------------------------------


async def test_untouched_thread_verifies_clean(store: es.EventStore) -> None:
    version = await populate(store)
    verdict = await Auditor(store).verify(T)
    assert verdict.ok and verdict.problems == []
    assert (verdict.checked, verdict.version) == (version, version)
    assert verdict.first_bad_seq is None and verdict.kind is None
    (last,) = [e async for e in store.read(T, start=version)]
    assert verdict.head == last.chain
    assert not verdict.keyed


async def test_a_one_event_thread_verifies_in_the_singular(store: es.EventStore) -> None:
    await store.append("one", [es.MessageAppended(message=es.Message(role="user", content="x"))])
    verdict = await Auditor(store).verify("one")
    assert verdict.ok and verdict.detail.startswith("1 event verified, chain intact")


async def test_untouched_keyed_thread_verifies_clean(keyed: es.EventStore) -> None:
    version = await populate(keyed)
    verdict = await Auditor(keyed).verify(T)
    assert verdict.ok and verdict.keyed and verdict.checked == version


async def test_long_thread_spanning_read_batches_verifies_clean(store: es.EventStore) -> None:
    for start in range(0, 5000, 500):
        batch = [es.MessageAppended(message=user(str(start + i))) for i in range(500)]
        await store.append(T, batch)
    verdict = await Auditor(store).verify(T)
    assert verdict.ok and verdict.checked == 5000


async def test_a_thread_that_does_not_exist_is_not_verified(store: es.EventStore) -> None:
    # Nothing was verified, so the verdict must not read as "intact"; it says whether the
    # thread was never written or deleted (the change feed's tombstone).
    never = await Auditor(store).verify("nobody")
    assert not never.ok and never.checked == 0 and never.version == 0
    assert_damage(never, 0, "missing")
    assert "no thread 'nobody'" in never.detail and "never written" in never.detail
    await store.append("gone", [es.MessageAppended(message=user("hi"))])
    assert (await Auditor(store).verify("gone")).ok
    await store.delete_thread("gone")
    gone = await Auditor(store).verify("gone")
    assert_damage(gone, 0, "missing")
    assert "it was deleted (the change feed records its deletion at" in gone.detail
    assert "gone" not in await Auditor(store).verify_all()


async def test_a_thread_whose_keys_were_deleted_behind_the_index_is_deleted(
    store: es.EventStore,
) -> None:
    # The thread index still lists it: that is damage (delete_thread unlists a thread), not
    # a thread that was never there.
    await populate(store)
    await Raw(store).drop_keys()
    verdict = await Auditor(store).verify(T)
    assert_damage(verdict, 1, "deleted")
    assert "lists the thread but it has no log and no meta hash" in verdict.detail
    assert_damage((await Auditor(store).verify_all())[T], 1, "deleted")


async def test_a_thread_removed_from_the_index_is_still_audited(store: es.EventStore) -> None:
    version = await populate(store)
    await store.append("listed", [es.MessageAppended(message=user("hi"))])
    await Raw(store).unindex()
    assert [t.thread_id for t in await store.threads()] == ["listed"]
    auditor = Auditor(store)
    assert await auditor.threads() == ["listed", T]
    verdicts = await auditor.verify_all()
    assert set(verdicts) == {T, "listed"} and verdicts["listed"].ok
    unlisted = verdicts[T]
    assert_damage(unlisted, 0, "unindexed")
    assert "not in its partition's thread index" in unlisted.detail
    assert unlisted.checked == version and len(unlisted.problems) == 1
    # Its log is intact: it may still be rebuilt from (the index is not the log), and the
    # rebuild lists it again, by its last append.
    last_ms = (await store.read_raw(T, start=version, count=1))[0][1][b"s"]
    assert await auditor.rebuild_all() == {"listed": 1, T: version}
    listed = {t.thread_id: t for t in await store.threads()}
    assert set(listed) == {T, "listed"} and listed[T].last_activity_ms == int(last_ms)
    assert all(found.ok for found in (await auditor.check_all()).values())


# -- verify: tampering -------------------------------------------------------------------------


async def test_edited_payload_is_modified(store: es.EventStore) -> None:
    version = await populate(store)
    raw = Raw(store)
    entries = await raw.entries()
    entries[5] = (entries[5][0], edited(entries[5][1], "I never said that"))
    await raw.rewrite(entries)
    # The edit decodes fine: only the chain catches it, at the edited seq and nowhere else.
    assert len([e async for e in store.read(T)]) == version
    verdict = await Auditor(store).verify(T)
    assert_damage(verdict, 6, "modified")
    assert len(verdict.problems) == 1 and verdict.checked == version


async def test_edited_event_metadata_is_modified(store: es.EventStore) -> None:
    """The metadata field (the turn an event belongs to) is in what the chain covers: moving
    an event to another turn is an edit like any other."""
    for turn in ("turn-a", "turn-b"):
        await store.append(
            T, [es.NewEvent(payload=es.MessageAppended(message=user(turn)), turn_id=turn)]
        )
    raw = Raw(store)
    entries = await raw.entries()
    assert entries[0][1][b"m"] and entries[0][1][b"m"] != entries[1][1][b"m"]
    entries[0] = (entries[0][0], {**entries[0][1], b"m": entries[1][1][b"m"]})
    await raw.rewrite(entries)
    assert [e.turn_id async for e in store.read(T)] == ["turn-b", "turn-b"]  # decodes fine
    verdict = await Auditor(store).verify(T)
    assert_damage(verdict, 1, "modified")
    assert len(verdict.problems) == 1


async def test_edited_last_entry_is_modified(store: es.EventStore) -> None:
    version = await populate(store)
    raw = Raw(store)
    entries = await raw.entries()
    entries[-1] = (entries[-1][0], {**entries[-1][1], b"s": b"1"})  # back-dated
    await raw.rewrite(entries)
    verdict = await Auditor(store).verify(T)
    assert_damage(verdict, version, "modified")
    assert len(verdict.problems) == 1


async def test_xdel_is_deleted(store: es.EventStore) -> None:
    version = await populate(store)
    await Raw(store).xdel("7-0")
    verdict = await Auditor(store).verify(T)
    assert_damage(verdict, 7, "deleted")
    # Seq 8's link names the entry that is gone: it cannot be verified, is not counted as
    # verified, and the problem says so (a change to it would not show).
    assert len(verdict.problems) == 1 and verdict.checked == version - 2
    assert "seq 8 after it cannot be verified" in verdict.detail


async def test_xdel_of_a_run_and_of_the_tail_are_deleted(store: es.EventStore) -> None:
    version = await populate(store)
    raw = Raw(store)
    for seq in (3, 4, 5, version):
        await raw.xdel(f"{seq}-0")
    verdict = await Auditor(store).verify(T)
    assert_damage(verdict, 3, "deleted")
    assert "3..5" in verdict.detail
    assert [(p.seq, p.kind) for p in verdict.problems] == [(3, "deleted"), (version, "deleted")]


async def test_xadd_with_a_forged_id_at_the_end_is_inserted(store: es.EventStore) -> None:
    version = await populate(store)
    raw = Raw(store)
    _, fields = (await raw.entries())[1]
    await raw.xadd(f"{version + 1}-0", edited(fields, "forged"))
    verdict = await Auditor(store).verify(T)
    assert_damage(verdict, version + 1, "inserted")
    assert len(verdict.problems) == 1


async def test_xadd_with_a_forged_id_mid_stream_is_inserted(store: es.EventStore) -> None:
    version = await populate(store)
    raw = Raw(store)
    entries = await raw.entries()
    entries.insert(3, ("3-5", edited(entries[1][1], "forged")))
    await raw.rewrite(entries)
    verdict = await Auditor(store).verify(T)
    # An entry between 3-0 and 4-0 takes the place of seq 4 in a reading of the log.
    assert_damage(verdict, 4, "inserted")
    assert "3-5" in verdict.detail
    assert len(verdict.problems) == 1 and verdict.checked == version + 1


async def test_swapped_entries_are_reordered(store: es.EventStore) -> None:
    await populate(store)
    raw = Raw(store)
    entries = await raw.entries()
    (id3, f3), (id6, f6) = entries[2], entries[5]
    entries[2], entries[5] = (id3, f6), (id6, f3)  # ids kept, contents swapped
    await raw.rewrite(entries)
    verdict = await Auditor(store).verify(T)
    assert_damage(verdict, 3, "reordered")
    assert [(p.seq, p.kind) for p in verdict.problems] == [(3, "reordered"), (6, "reordered")]
    assert "seq 6" in verdict.detail


async def test_adjacent_swap_is_reordered(store: es.EventStore) -> None:
    await populate(store)
    raw = Raw(store)
    entries = await raw.entries()
    (id9, f9), (id10, f10) = entries[8], entries[9]
    entries[8], entries[9] = (id9, f10), (id10, f9)
    await raw.rewrite(entries)
    verdict = await Auditor(store).verify(T)
    assert_damage(verdict, 9, "reordered")
    assert [(p.seq, p.kind) for p in verdict.problems] == [(9, "reordered"), (10, "reordered")]


async def test_garbage_entry_is_undecodable(store: es.EventStore) -> None:
    version = await populate(store)
    await Raw(store).xadd(f"{version + 1}-0", {b"x": b"y"})
    verdict = await Auditor(store).verify(T)
    assert_damage(verdict, version + 1, "undecodable")
    assert f"seq {version + 1}" in verdict.detail


async def test_garbage_payload_mid_stream_is_undecodable_only(store: es.EventStore) -> None:
    await populate(store)
    raw = Raw(store)
    entries = await raw.entries()
    entries[4] = (entries[4][0], {**entries[4][1], b"d": b"\xc1 not msgpack"})
    await raw.rewrite(entries)
    verdict = await Auditor(store).verify(T)
    assert_damage(verdict, 5, "undecodable")
    assert len(verdict.problems) == 1


async def test_removal_with_renumbering_is_deleted(store: es.EventStore) -> None:
    version = await populate(store)
    raw = Raw(store)
    entries = await raw.entries()
    kept = entries[:5] + entries[6:]
    await raw.rewrite([(f"{n}-0", fields) for n, (_, fields) in enumerate(kept, start=1)])
    verdict = await Auditor(store).verify(T)
    assert_damage(verdict, 6, "deleted")
    assert len(verdict.problems) == 1 and verdict.checked == version - 1


async def test_addition_with_renumbering_is_inserted(store: es.EventStore) -> None:
    version = await populate(store)
    raw = Raw(store)
    entries = await raw.entries()
    forged = {**edited(entries[1][1], "forged"), b"h": b"0" * 32}
    grown = [*entries[:5], ("", forged), *entries[5:]]
    await raw.rewrite([(f"{n}-0", fields) for n, (_, fields) in enumerate(grown, start=1)])
    verdict = await Auditor(store).verify(T)
    assert_damage(verdict, 6, "inserted")
    assert len(verdict.problems) == 1 and verdict.checked == version + 1


async def test_copied_entry_with_renumbering_is_inserted(store: es.EventStore) -> None:
    await populate(store)
    raw = Raw(store)
    entries = await raw.entries()
    grown = [*entries[:5], entries[2], *entries[5:]]  # seq 3 again, verbatim
    await raw.rewrite([(f"{n}-0", fields) for n, (_, fields) in enumerate(grown, start=1)])
    verdict = await Auditor(store).verify(T)
    assert_damage(verdict, 6, "inserted")
    assert len(verdict.problems) == 1


# -- verify: keyed chains ------------------------------------------------------------------------


async def forge_chain(raw: Raw, at: int, text: str) -> None:
    """Edit the payload of ``at`` and recompute every link from there on, without the key."""
    entries = await raw.entries()
    prev = entries[at - 2][1][b"h"].decode() if at > 1 else ""
    for index in range(at - 1, len(entries)):
        entry_id, fields = entries[index]
        if index == at - 1:
            fields = edited(fields, text)
        digest = es.entry_digest(raw.thread_id, fields, None)
        assert digest is not None
        prev = es.chain_link(prev, index + 1, int(fields[b"s"]), digest)
        entries[index] = (entry_id, {**fields, b"h": prev.encode()})
    await raw.rewrite(entries)
    await raw.set_head(prev)  # as a forger would: verify holds the meta's head to the log


async def test_forger_without_the_key_is_detected(keyed: es.EventStore) -> None:
    version = await populate(keyed)
    await forge_chain(Raw(keyed), 4, "forged")
    verdict = await Auditor(keyed).verify(T)
    assert_damage(verdict, 4, "modified")
    assert "without the key" in verdict.detail
    # Every re-linked entry is caught: none of their links holds under the key.
    assert [p.seq for p in verdict.problems] == list(range(4, version + 1))


async def test_without_a_key_a_recomputed_chain_goes_unnoticed(store: es.EventStore) -> None:
    # The documented limit of unkeyed chains: whoever can write to Redis can re-link.
    await populate(store)
    await forge_chain(Raw(store), 4, "forged")
    assert (await Auditor(store).verify(T)).ok


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_chain_secret_longer_than_blake2b_keys_works(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """BLAKE2b keys stop at 64 bytes; a longer secret (a passphrase) stands for its hash."""
    namespace = "l" + uuid.uuid4().hex[:12]
    url = "memory://" + namespace if backend == "memory" else request.getfixturevalue("redis_url")
    long_secret = b"correct horse battery staple " * 4  # 116 bytes
    async with await es.connect(url, namespace=namespace, secret=long_secret) as store:
        await store.append(T, [es.MessageAppended(message=user("kept"))])
        assert (await Auditor(store).verify(T)).ok
        assert not (await Auditor(store, secret=long_secret + b"!").verify(T)).ok
    async with await es.connect(url, namespace=namespace, secret=long_secret + b"!") as other:
        with pytest.raises(es.ChainKeyMismatchError):
            await other.append(T, [es.MessageAppended(message=user("refused"))])
    # A secret that fits is the key itself, as it always was.
    assert (
        _codec.key_fingerprint(b"s3cret")
        == hashlib.blake2b(
            b"threadlog chain key fingerprint v1", digest_size=8, key=b"s3cret"
        ).hexdigest()
    )


@pytest.mark.parametrize("secret", [b"", ""], ids=repr)
async def test_an_empty_secret_is_refused_not_checked_as_a_key(
    keyed: es.EventStore, secret: Any
) -> None:
    """``Auditor(store, secret=b"")`` checked with the key derived from an empty secret, while
    a store given the same empty secret linked without one: the two disagreed about what the
    empty secret meant. It means nothing: refused, as the stores refuse it. No key to check
    with is a store opened without one (None: the store's own key)."""
    with pytest.raises(es.InvalidInputError, match="secret"):
        Auditor(keyed, secret=secret)
    with pytest.raises(es.InvalidInputError, match="secret"):
        es.namespace_chain_key(secret, keyed.namespace)


async def test_wrong_key_fails_every_entry_and_says_so(keyed: es.EventStore) -> None:
    version = await populate(keyed)
    good = await Auditor(keyed, secret=SECRET).verify(T)
    assert good.ok and good.key_matches is True
    verdict = await Auditor(keyed, secret=b"another key").verify(T)
    # The thread records which key wrote it: one problem says the key does not match, not
    # one "modified" per entry.
    assert_damage(verdict, 0, "wrong_key")
    assert len(verdict.problems) == 1 and verdict.problems_omitted == 0
    assert verdict.key_matches is False and verdict.checked == version
    assert "written with another chain key than this check's" in verdict.detail
    assert f"{version} of {version} links fail under this check's key" in verdict.detail
    # What no key explains is still reported beside it.
    raw = Raw(keyed)
    entries = await raw.entries()
    entries[2] = (entries[2][0], {**entries[2][1], b"d": b"\xc1 not msgpack"})
    await raw.rewrite(entries)
    verdict = await Auditor(keyed, secret=b"another key").verify(T)
    assert_damage(verdict, 0, "wrong_key")
    assert [(p.seq, p.kind) for p in verdict.problems] == [(0, "wrong_key"), (3, "undecodable")]


async def twin(store: es.EventStore, secret: bytes | None) -> es.EventStore:
    """Another store on ``store``'s namespace (and server), with chain key ``secret``."""
    if isinstance(store, es.MemoryEventStore):
        return es.MemoryEventStore(namespace=store.namespace, server=store.server, secret=secret)
    assert isinstance(store, es.RedisEventStore)
    return es.RedisEventStore(
        store.client,
        namespace=store.namespace,
        partitions=store.partitions,
        secret=secret,
        owns_client=False,
    )


async def test_verify_says_when_the_thread_was_written_with_or_without_a_key(
    keyed: es.EventStore,
) -> None:
    await populate(keyed)
    plain = await twin(keyed, None)
    verdict = await Auditor(plain).verify(T)
    assert_damage(verdict, 0, "wrong_key")
    assert verdict.key_matches is False and not verdict.keyed
    assert "written with a chain key and this check used none" in verdict.detail
    assert "THREADLOG_SECRET" in verdict.detail
    await plain.append("plain", [es.MessageAppended(message=user("hi"))] * 2)
    verdict = await Auditor(keyed).verify("plain")
    assert_damage(verdict, 0, "wrong_key")
    assert verdict.key_matches is False
    assert "written without a chain key and this check used one" in verdict.detail
    assert (await Auditor(plain).verify("plain")).key_matches is True


async def test_a_wrong_key_verdict_does_not_also_guess_at_copied_entries(
    keyed: es.EventStore,
) -> None:
    """The thread's recorded key explains why every link fails; the verdict says that alone,
    not also "every entry fails under the key the thread records: copied or renamed?", which
    is false (they verify under that key) and sends the reader after a forgery."""
    await populate(keyed)
    plain = await twin(keyed, None)
    await plain.append("plain", [es.MessageAppended(message=user("hi"))] * 2)
    for auditor, thread in ((Auditor(plain), T), (Auditor(keyed), "plain")):
        verdict = await auditor.verify(thread)
        assert_damage(verdict, 0, "wrong_key")
        assert "every entry fails" not in verdict.detail, verdict.detail
        assert "copied or renamed" not in verdict.detail, verdict.detail
    assert (await Auditor(plain).verify("plain")).ok and (await Auditor(keyed).verify(T)).ok


async def test_a_writer_without_the_key_is_refused_so_verify_stays_clean(
    keyed: es.EventStore,
) -> None:
    # The defect this guards against: a worker deployed without THREADLOG_SECRET appended
    # to a keyed thread, and the next audit reported its events as tampered.
    await populate(keyed)
    plain = await twin(keyed, None)
    with pytest.raises(es.ChainKeyMismatchError):
        await plain.append(T, [es.MessageAppended(message=user("unkeyed"))])
    assert (await Auditor(keyed).verify(T)).ok


# -- verify across a namespace -------------------------------------------------------------------


class _OnlyTheWriterKnows(es.Event, tag="testing.writer-only", frozen=True):
    note: str


async def test_an_event_type_the_reader_does_not_know_is_named_as_such(redis_url: str) -> None:
    namespace = "u" + uuid.uuid4().hex[:12]
    writers = es.EventRegistry()
    writers.register(_OnlyTheWriterKnows)
    async with await es.connect(redis_url, namespace=namespace, registry=writers) as writer:
        await writer.append(T, [_OnlyTheWriterKnows(note="x")])
    async with await es.connect(redis_url, namespace=namespace) as reader:
        verdict = await Auditor(reader).verify(T)
    assert_damage(verdict, 1, "undecodable")
    assert "a type this reader does not know: register its Event class" in verdict.detail


async def test_verify_all_names_the_damaged_thread(store: es.EventStore) -> None:
    await populate(store)
    for name in ("clean-1", "clean-2"):
        await store.append(name, [es.MessageAppended(message=user("hi"))] * 1)
    await Raw(store).xdel("2-0")
    calls: list[tuple[int, int]] = []
    verdicts = await Auditor(store).verify_all(progress=lambda d, t: calls.append((d, t)))
    assert set(verdicts) == {T, "clean-1", "clean-2"}
    assert verdicts["clean-1"].ok and verdicts["clean-2"].ok
    assert_damage(verdicts[T], 2, "deleted")
    assert calls == [(1, 3), (2, 3), (3, 3)]


async def test_audits_of_every_thread_say_the_same_one_thread_at_a_time_or_several(
    store: es.EventStore,
) -> None:
    await populate(store)
    await Raw(store).xdel("2-0")  # T: a hole
    projector = Projector(store)
    for i in range(12):
        await projector.append(f"c{i:02d}", [es.MessageAppended(message=user(f"hi {i}"))])
    auditor = Auditor(store)
    listed = await auditor.threads()
    seen: dict[int, tuple[object, ...]] = {}
    for concurrency in (1, 5):
        verdicts = await auditor.verify_all(concurrency=concurrency)
        checks = await auditor.check_all(concurrency=concurrency)
        with pytest.raises(RebuildError) as caught:
            await auditor.rebuild_all(concurrency=concurrency)
        assert list(verdicts) == listed and list(checks) == listed
        assert list(caught.value.rebuilt) == [t for t in listed if t != T]
        assert list(caught.value.failed) == [T]
        seen[concurrency] = (verdicts, checks, caught.value.rebuilt)
    assert seen[1] == seen[5]
    assert_damage(seen[5][0][T], 2, "deleted")  # type: ignore[index]
    for bad in (0, True, "3"):
        for audit in (auditor.verify_all, auditor.check_all, auditor.rebuild_all):
            with pytest.raises(es.InvalidInputError, match="concurrency"):
                await audit(concurrency=bad)  # type: ignore[arg-type]


# -- rebuild, verified first --------------------------------------------------------------------


async def three_messages(store: es.EventStore) -> Projector:
    """Thread T with three messages, one, two and three (views current)."""
    projector = Projector(store)
    for text in ("one", "two", "three"):
        await projector.append(T, [es.MessageAppended(message=user(text))])
    return projector


async def forged_thread(store: es.EventStore) -> Projector:
    """Thread T with three messages (views current), whose second entry was then edited."""
    projector = await three_messages(store)
    raw = Raw(store)
    entries = await raw.entries()
    entries[1] = (entries[1][0], edited(entries[1][1], "I never said that"))
    await raw.rewrite(entries)
    return projector


async def texts(projector: Projector) -> list[str]:
    return [str(m.message.content) for m in await projector.last(T, 10)]


async def test_rebuild_refuses_a_log_that_fails_verification(store: es.EventStore) -> None:
    projector = await forged_thread(store)
    await store.append("clean", [es.MessageAppended(message=user("hi"))])
    auditor = Auditor(store)
    with pytest.raises(UnverifiedLogError) as info:
        await auditor.rebuild(T)
    assert info.value.thread_id == T and info.value.verdict.kind == "modified"
    assert "its log fails verification (modified" in str(info.value)
    assert await texts(projector) == ["one", "two", "three"]  # nothing written
    with pytest.raises(RebuildError) as failed:
        await auditor.rebuild_all()
    assert failed.value.rebuilt == {"clean": 1}
    assert isinstance(failed.value.failed[T], UnverifiedLogError)
    assert await texts(projector) == ["one", "two", "three"]
    # Projector.rebuild (and the explicit override) take the log as it is: the forgery
    # becomes what the views say. This is what the check above is for.
    assert await auditor.rebuild(T, trust_log=True) == 3
    assert await texts(projector) == ["one", "I never said that", "three"]


async def test_rebuild_with_another_key_than_the_writers_is_refused(keyed: es.EventStore) -> None:
    projector = Projector(keyed)
    await projector.append(T, [es.MessageAppended(message=user("hi"))])
    with pytest.raises(UnverifiedLogError) as info:
        await Auditor(keyed, secret=b"another key").rebuild(T)
    assert info.value.verdict.kind == "wrong_key"
    assert await Auditor(keyed, secret=SECRET).rebuild(T) == 1


async def edit_after_first_read(
    monkeypatch: pytest.MonkeyPatch, store: es.EventStore, text: str
) -> None:
    """Make the store's next read of T's log return the log as it is, then forge entry 2:
    an edit landing while an audit runs, after its verification read the entry."""
    original = store.read_raw
    done = False

    async def read_then_forge(thread_id: str, **kwargs: Any) -> list[tuple[bytes, Fields]]:
        nonlocal done
        rows = await original(thread_id, **kwargs)
        if thread_id == T and rows and not done:
            done = True
            raw = Raw(store)
            entries = await raw.entries()
            entries[1] = (entries[1][0], edited(entries[1][1], text))
            await raw.rewrite(entries)
        return rows

    monkeypatch.setattr(store, "read_raw", read_then_forge)


async def test_appends_landing_while_a_log_is_read_are_not_deletions(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify reads the version again when it reads entries beyond it; appends landing just
    then put the version past the last entry read: those entries are read too, never
    reported as deleted (a live thread is not a tampered one)."""
    projector = await three_messages(store)
    original_snapshot, original_version = store.meta_snapshot, store.version
    calls = 0

    async def append_live() -> None:
        nonlocal calls
        calls += 1
        await projector.append(T, [es.MessageAppended(message=user(f"live {calls}"))])

    async def snapshot_then_append(thread_id: str) -> es.MetaSnapshot:
        snapshot = await original_snapshot(thread_id)
        if thread_id == T and calls == 0:  # the scan's first read: its version is now stale
            await append_live()
        return snapshot

    async def version_while_appending(thread_id: str) -> int:
        if thread_id == T and calls == 1:  # read again as entries beyond it are read
            await append_live()
        return await original_version(thread_id)

    monkeypatch.setattr(store, "meta_snapshot", snapshot_then_append)
    monkeypatch.setattr(store, "version", version_while_appending)
    auditor = Auditor(store)
    verdict = await auditor.verify(T)
    assert verdict.ok, verdict
    assert verdict.checked == 5 and verdict.version == 5
    calls = 0
    assert await auditor.rebuild(T) >= 6
    calls = 0
    found = await auditor.check(T)
    assert found.ok, found


async def test_a_thread_deleted_while_the_namespace_is_audited_is_left_out(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    projector = await three_messages(store)
    await projector.append("other", [es.MessageAppended(message=user("hi"))])
    original = store.read_raw
    deleted = False

    async def read_then_delete(thread_id: str, **kwargs: Any) -> list[tuple[bytes, Fields]]:
        nonlocal deleted
        rows = await original(thread_id, **kwargs)
        if thread_id == T and not deleted:
            deleted = True  # the thread goes while its log is being read
            await projector.delete_thread(T)
        return rows

    monkeypatch.setattr(store, "read_raw", read_then_delete)
    auditor = Auditor(store)
    verdicts = await auditor.verify_all()
    assert deleted and set(verdicts) == {"other"} and verdicts["other"].ok
    # Deleted and written again while it was read: the second read judges the new life.
    deleted = False
    await projector.append(T, [es.MessageAppended(message=user("again"))])

    async def read_then_rewrite(thread_id: str, **kwargs: Any) -> list[tuple[bytes, Fields]]:
        nonlocal deleted
        rows = await original(thread_id, **kwargs)
        if thread_id == T and not deleted:
            deleted = True
            await projector.delete_thread(T)
            for text in ("x", "y", "z"):
                await projector.append(T, [es.MessageAppended(message=user(text))])
        return rows

    monkeypatch.setattr(store, "read_raw", read_then_rewrite)
    found = await auditor.check_all()
    assert deleted and set(found) == {T, "other"}
    assert all(f.ok for f in found.values()), found


def replace_between_pages(
    monkeypatch: pytest.MonkeyPatch, store: es.EventStore, texts: list[str], *, every: bool = False
) -> list[int]:
    """Make the store's next read of T's log return its page as it was read, then delete T
    and write it again with ``texts`` (another life under the same id), before the next page
    is read; with ``every``, after each page read. Returns the list of pages so replaced."""
    original = store.read_raw
    replaced: list[int] = []

    async def read_then_replace(thread_id: str, **kwargs: Any) -> list[tuple[bytes, Fields]]:
        rows = await original(thread_id, **kwargs)
        if thread_id == T and rows and (every or not replaced):
            replaced.append(len(rows))
            projector = Projector(store)
            await projector.delete_thread(T)
            for text in texts:
                await projector.append(T, [es.MessageAppended(message=user(text))])
        return rows

    monkeypatch.setattr(store, "read_raw", read_then_replace)
    return replaced


@pytest.mark.parametrize("again", [10, 3, 0], ids=["as long", "shorter", "deleted"])
async def test_a_thread_replaced_between_two_pages_is_judged_in_one_life(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch, again: int
) -> None:
    """The log was read page by page with no check of the thread's life: deleted and written
    again under its id after the first page, its verdict joined two lives (the new entries'
    links do not follow the old ones: "modified"; a shorter new life: "deleted"; no new life:
    "deleted" rather than gone). Each audit now reads in one life of the thread: the new one
    is judged whole, a deleted one is missing."""
    monkeypatch.setattr(_audit, "VERIFY_BATCH", 4)
    projector = Projector(store)
    new = [f"new {i}" for i in range(again)]
    auditor = Auditor(store)

    async def ten_old() -> list[int]:
        """T with ten messages, in a life of its own; replaced after the audit's first page."""
        monkeypatch.undo()
        monkeypatch.setattr(_audit, "VERIFY_BATCH", 4)
        await projector.delete_thread(T)
        for i in range(10):
            await projector.append(T, [es.MessageAppended(message=user(f"old {i}"))])
        return replace_between_pages(monkeypatch, store, new)

    replaced = await ten_old()
    verdict = await auditor.verify(T)
    assert replaced == [4], replaced  # after the first page of four
    if again:
        assert verdict.ok and (verdict.checked, verdict.version) == (again, again), verdict
    else:
        assert verdict.kind == "missing" and "it was deleted" in verdict.detail, verdict

    replaced = await ten_old()
    found = await auditor.check(T)
    assert replaced == [4], replaced
    if again:
        assert found.ok and found.verdict.checked == again, found
        assert found.report is not None and found.report.version == again
    else:
        assert found.verdict.kind == "missing" and found.report is None, found

    replaced = await ten_old()
    if again:
        assert await auditor.rebuild(T) == again
        assert await texts(projector) == new
    else:
        with pytest.raises(UnverifiedLogError) as info:
            await auditor.rebuild(T)
        assert info.value.verdict.kind == "missing"
    assert replaced == [4], replaced


@pytest.mark.parametrize("trust_log", [False, True], ids=["verified", "trusted"])
async def test_a_thread_replaced_just_before_rebuild_writes_gets_its_own_views(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch, trust_log: bool
) -> None:
    """Between the rebuild's last read and its write, the thread deleted and written again up
    to the same version: a write guarded by the version only put the old life's views on the
    new one. The write names the life it was folded in and is refused; the new life is rebuilt
    (by `Auditor.rebuild`, and by `Projector.rebuild`, which ``trust_log`` runs)."""
    projector = Projector(store)
    auditor = Auditor(store)
    for text in ("one", "two", "three"):
        await projector.append(T, [es.MessageAppended(message=user(text))])
    original = auditor.projector.store_views
    replaced: list[bool] = []

    seen: list[list[str]] = []  # the window after each write

    async def replace_then_store(folded: Any, **guard: Any) -> None:
        if not replaced:
            replaced.append(True)
            await projector.delete_thread(T)
            for text in ("uno", "dos", "tres"):
                await projector.append(T, [es.MessageAppended(message=user(text))])
        try:
            await original(folded, **guard)
        finally:
            seen.append(await texts(projector))

    monkeypatch.setattr(auditor.projector, "store_views", replace_then_store)
    assert await auditor.rebuild(T, trust_log=trust_log) == 3
    # The first write was refused: the old life's window was never there.
    assert seen == [["uno", "dos", "tres"]] * 2
    assert (await auditor.check(T)).ok


async def test_a_meta_hash_replaced_by_a_string_is_reported_not_raised(redis_url: str) -> None:
    """The life an audit reads before and after the log comes from the meta hash: one that
    is no hash (WRONGTYPE) is the damage the verdict reports, not an error of the audit."""
    store = await es.open_store(StoreSettings.from_url(redis_url, namespace=uuid.uuid4().hex))
    try:
        assert isinstance(store, es.RedisEventStore)
        await Projector(store).append(T, [es.MessageAppended(message=user("hi"))])
        await store.client.delete(store.keys.meta(T))
        await store.client.set(store.keys.meta(T), "hello")
        verdict = await Auditor(store).verify(T)
        assert verdict.kind == "undecodable" and "WRONGTYPE" in verdict.detail, verdict
        assert (await Auditor(store).check(T)).verdict == verdict
    finally:
        await store.close()


async def test_a_thread_replaced_at_every_read_is_not_judged(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread deleted and written again while each attempt reads it gets no verdict (no
    life was read whole): `ThreadReplacedError` after a bounded number of attempts, and
    `RebuildBusyError` from rebuild, as `Projector.rebuild` says for a thread that keeps
    changing."""
    monkeypatch.setattr(_audit, "VERIFY_BATCH", 2)
    projector = Projector(store)
    for i in range(5):
        await projector.append(T, [es.MessageAppended(message=user(f"old {i}"))])
    replaced = replace_between_pages(monkeypatch, store, ["a", "b", "c"], every=True)
    auditor = Auditor(store)
    with pytest.raises(es.ThreadReplacedError):
        await auditor.verify(T)
    with pytest.raises(es.ThreadReplacedError):
        await auditor.check(T)
    with pytest.raises(RebuildBusyError):
        await auditor.rebuild(T)
    assert replaced
    monkeypatch.undo()
    assert (await auditor.verify(T)).ok


async def test_rebuild_folds_exactly_the_entries_it_verified(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    projector = await three_messages(store)
    await edit_after_first_read(monkeypatch, store, "forged after the check")
    assert await Auditor(store).rebuild(T) == 3
    # The forgery landed after the entries were read and verified: what the views were
    # rebuilt from is what was verified, never a second read of the log.
    assert await texts(projector) == ["one", "two", "three"]
    monkeypatch.undo()
    assert_damage(await Auditor(store).verify(T), 2, "modified")


async def test_check_compares_the_views_with_the_entries_it_verified(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await three_messages(store)
    await edit_after_first_read(monkeypatch, store, "forged after the check")
    found = await Auditor(store).check(T)
    assert found.verdict.ok and found.report is not None and found.report.ok, found
    assert found.ok


async def test_check_reads_the_log_once(redis_url: str) -> None:
    store = await es.open_store(StoreSettings.from_url(redis_url, namespace=uuid.uuid4().hex))
    try:
        assert isinstance(store, es.RedisEventStore)
        projector = Projector(store)
        for start in range(0, 5000, 500):
            await projector.append(
                T, [es.MessageAppended(message=user(f"m{i}")) for i in range(start, start + 500)]
            )
        auditor = Auditor(store)

        async def xranges(job: Any) -> int:
            await store.client.config_resetstat()
            await job
            stats = await store.client.info("commandstats")
            return int(stats.get("cmdstat_xrange", {"calls": 0})["calls"])

        verify_reads = await xranges(auditor.verify(T))
        check_reads = await xranges(auditor.check(T))
        rebuild_reads = await xranges(auditor.rebuild(T))
        assert verify_reads >= 3  # 5,000 entries, VERIFY_BATCH at a time
        assert check_reads == verify_reads
        assert rebuild_reads == verify_reads
    finally:
        await store.close()


async def test_check_of_a_damaged_log_judges_no_views(store: es.EventStore) -> None:
    projector = await forged_thread(store)
    await projector.append("clean", [es.MessageAppended(message=user("hi"))])
    auditor = Auditor(store)
    found = await auditor.check(T)
    assert found.report is None and not found.ok
    assert_damage(found.verdict, 2, "modified")
    every = await auditor.check_all()
    assert set(every) == {T, "clean"}
    assert every["clean"].ok and every[T].report is None


async def test_check_of_a_thread_with_a_stale_view_reports_the_difference(
    store: es.EventStore,
) -> None:
    projector = Projector(store)
    for text in ("one", "two"):
        await projector.append(T, [es.MessageAppended(message=user(text))])
    await store.append(T, [es.MessageAppended(message=user("behind the projector's back"))])
    found = await Auditor(store).check(T)
    assert found.verdict.ok and found.report is not None and not found.ok
    assert {d.view for d in found.report.differences} == {"messages"}
    assert found.report.version == 3


# -- replay and diff -----------------------------------------------------------------------------


async def test_replay_matches_time_travel_at_every_step(store: es.EventStore) -> None:
    version = await populate(store)
    projector = Projector(store)
    auditor = Auditor(store, projector)
    steps = [step async for step in auditor.replay(T)]
    assert [s.seq for s in steps] == list(range(1, version + 1))
    # Steps are snapshots: each still shows its own point after the replay moved on.
    for step in steps:
        assert list(step.messages) == await projector.last(T, 1000, as_of=step.seq)
        assert dict(step.state) == await projector.state(T, as_of=step.seq)
        assert list(step.records) == await projector.turns(T, as_of=step.seq)
        assert list(step.transcript) == await projector.transcript(T, as_of=step.seq)
    assert [m.message.text for m in steps[-1].transcript] == ["summary"]
    assert [m.message.text for m in steps[-2].transcript] == ["q0", "q1", "q2"]


async def test_replay_window_and_as_of(store: es.EventStore) -> None:
    version = await populate(store)
    auditor = Auditor(store)
    window = [s async for s in auditor.replay(T, start=5, stop=9)]
    assert [s.seq for s in window] == [5, 6, 7, 8, 9]
    # Events before `start` are folded in: the first step already shows them.
    assert window[0].messages == [s async for s in auditor.replay(T, stop=5)][-1].messages
    capped = [s async for s in auditor.replay(T, start=5, as_of=7)]
    assert [s.seq for s in capped] == [5, 6, 7]
    now = datetime.now(UTC)
    assert len([s async for s in auditor.replay(T, as_of=now)]) == version
    assert [s async for s in auditor.replay(T, start=5, stop=4)] == []
    with pytest.raises(es.InvalidInputError):
        [s async for s in auditor.replay(T, start=0)]
    async for step in auditor.replay(T):
        assert step.seq == 1
        break  # leaving early is fine
    # Times no clock reads: a naive datetime.min (local time) has no timestamp (year 0).
    projector = Projector(store)
    with pytest.raises(es.InvalidInputError, match="is not a usable time"):
        await projector.state(T, as_of=datetime.min)
    assert await projector.last(T, as_of=datetime.min.replace(tzinfo=UTC)) == []
    east = timezone(timedelta(hours=1))
    assert await projector.last(T, as_of=datetime.min.replace(tzinfo=east)) == []
    assert len(await projector.last(T, 100, as_of=datetime.max.replace(tzinfo=UTC))) > 0


async def test_diff_between_two_points(store: es.EventStore) -> None:
    await populate(store, rounds=2)
    auditor = Auditor(store)
    # Round 0 is seqs 1..7; round 1 opens with seq 8 (its request message).
    d = await auditor.diff(T, 7, 14)
    assert d.events == 7
    assert [m.message.text for m in d.messages_added] == ["q1", "a1", "note 1"]
    assert d.messages_removed == []
    before, after = d.state_changed["plan"]
    assert before is not None and after is not None
    assert (before.value, after.value) == ({"round": 0}, {"round": 1})
    assert len(d.records_changed) == 2  # round 1's root and child turns, new
    assert all(old is None for old, _ in d.records_changed.values())
    assert d.transcript is not None
    assert [m.message.text for m in d.transcript[1]] == ["q0", "q1"]
    assert not d.transcript_replaced and not d.empty

    back = await auditor.diff(T, 14, 7)
    assert back.messages_removed == d.messages_added and back.messages_added == []
    assert (await auditor.diff(T, 4, 4)).empty


async def test_diff_shows_a_transcript_replace(store: es.EventStore) -> None:
    version = await populate(store)
    d = await Auditor(store).diff(T, version - 1, version)
    assert d.transcript_replaced and d.transcript is not None
    old, new = d.transcript
    assert [m.message.text for m in old] == ["q0", "q1", "q2"]
    assert [m.message.text for m in new] == ["summary"]
    assert d.messages_added == [] and d.state_changed == {} and d.records_changed == {}
    everything = await Auditor(store).diff(T, 0, datetime.now(UTC))
    assert everything.b == version and everything.events == version


def _recreate_after(store: es.EventStore, name: str, thread: str, texts: list[str]) -> None:
    """The next call of ``store.<name>`` answers, then ``thread`` is deleted and written again
    with ``texts`` (a new life), before the caller reads on."""
    real = getattr(store, name)

    async def answer_then_recreate(*args: Any) -> Any:
        setattr(store, name, real)  # once
        answer = await real(*args)
        await Projector(store).delete_thread(thread)
        news = [es.MessageAppended(message=es.Message(role="user", content=t)) for t in texts]
        await Projector(store).append(thread, news)
        return answer

    setattr(store, name, answer_then_recreate)


async def test_replay_and_diff_never_mix_two_lives_of_a_thread(store: es.EventStore) -> None:
    """The point is found (a time search, the version) before the log is read: a thread
    deleted and written again in between is replayed in one life, never its new events up to a
    seq of its old life."""
    version = await populate(store)
    (last,) = [e async for e in store.read(T, start=version)]
    moment = last.time
    await anyio.sleep(0.005)
    auditor = Auditor(store)
    _recreate_after(store, "seq_at", T, ["new0", "new1", "new2"])
    assert [s.seq async for s in auditor.replay(T, as_of=moment)] == []
    # By seq: the life the thread is in now ends at seq 3.
    _recreate_after(store, "version", T, ["new0", "new1", "new2"])
    with pytest.raises(SeqBeyondVersionError):
        [s async for s in auditor.replay(T, as_of=5)]
    _recreate_after(store, "seq_at", T, ["new0", "new1", "new2"])
    d = await auditor.diff(T, 0, datetime.now(UTC) - timedelta(milliseconds=10))
    assert (d.a, d.b, d.events) == (0, 0, 0) and d.empty
    _recreate_after(store, "version", T, ["other"])
    with pytest.raises(SeqBeyondVersionError):
        await auditor.diff(T, 0, 2)


async def test_a_past_point_whose_last_entries_are_gone_is_damage_not_an_earlier_point(
    store: es.EventStore,
) -> None:
    """The version holds seqs the log lost at its end (XDEL): time travel to them, and a
    replay or diff up to them, raise `CorruptEventError` naming the first one missing, as a
    hole in the middle does, instead of answering with the last entry there is as that
    point."""
    version = await populate(store)
    raw = Raw(store)
    for entry_id, _ in (await raw.entries())[-2:]:
        await raw.xdel(entry_id)
    projector, auditor = Projector(store), Auditor(store)
    missing = version - 1
    # (A time after them: the search over times meets a lost entry, and says so first.)
    for at in (version, missing, datetime.now(UTC)):
        by_seq = isinstance(at, int)
        with pytest.raises(es.CorruptEventError) as info:
            await projector.fold(T, as_of=at)
        assert info.value.thread_id == T and info.value.seq in (missing, version)
        assert info.value.seq == missing or not by_seq
        with pytest.raises(es.CorruptEventError):
            await projector.transcript(T, as_of=at)
        seen: list[int] = []
        with pytest.raises(es.CorruptEventError) as info:
            async for step in auditor.replay(T, as_of=at):
                seen.append(step.seq)
        # What the log holds up to the loss is replayed before the error.
        assert seen == (list(range(1, missing)) if by_seq else [])
        with pytest.raises(es.CorruptEventError):
            await auditor.diff(T, 1, at)
    # The points the log still holds read as before.
    assert (await projector.fold(T, as_of=missing - 1)).version == missing - 1
    assert len([s async for s in auditor.replay(T, as_of=missing - 1)]) == missing - 1
    assert (await auditor.diff(T, 1, missing - 1)).b == missing - 1


async def test_tiny_read_batches_see_every_entry_once(
    store: es.EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_audit, "VERIFY_BATCH", 3)
    version = await populate(store)
    assert (await Auditor(store).verify(T)).ok
    raw = Raw(store)
    entries = await raw.entries()
    forged = [(f"4-{n}", entries[0][1]) for n in range(1, 8)]  # more than a batch shares seq 4
    await raw.rewrite([*entries[:4], *forged, *entries[4:]])
    verdict = await Auditor(store).verify(T)
    assert verdict.checked == version + 7
    assert [(p.seq, p.kind) for p in verdict.problems] == [(5, "inserted")] * 7


async def test_a_meta_version_that_is_not_a_number_is_damage_to_that_thread(
    redis_url: str,
) -> None:
    """Every reader of the version reports it for the thread (`CorruptEventError`); an append
    writes nothing; the thread can still be deleted, tombstone and all."""
    async with await es.connect(redis_url, namespace="v" + uuid.uuid4().hex[:12]) as store:
        assert isinstance(store, es.RedisEventStore)
        await store.append(T, [es.MessageAppended(message=user("hi"))])
        await store.client.hset(store.keys.meta(T), "v", "abc")
        for read in (
            lambda: store.version(T),
            lambda: store.read_views(T, [es.ListRange("messages")]),
            lambda: store.read_views(T, [es.HashGetListed("turns", "settled")]),
            lambda: store.append(T, [es.MessageAppended(message=user("more"))]),
            # time travel: the seq at a time (a script that compared the version as a number)
            lambda: store.seq_at(T, 2**40),
            lambda: Projector(store).fold(T, as_of=datetime.now(UTC)),
        ):
            with pytest.raises(es.CorruptEventError, match="field 'v'"):
                await read()
        assert len(await store.read_raw(T)) == 1  # the append wrote nothing
        verdict = await Auditor(store).verify(T)
        assert not verdict.ok and "meta hash is damaged" in verdict.detail
        assert await store.delete_thread(T) == 0  # the version it had is unknown: 0
        assert await store.read_raw(T) == []
        (tombstone,) = [e for e in await store.read_feed(store.keys.partition(T)) if e.deleted]
        assert tombstone.thread_id == T


@pytest.mark.parametrize("stored", ["1e1", " 10", "10 ", "0x0a", "10.0", "+10"])
async def test_a_meta_version_only_lua_would_read_as_a_number_is_damage_in_every_script(
    redis_url: str, stored: str
) -> None:
    """Lua's ``tonumber`` reads each of these as 10; the client's readers take digits only. The
    scripts do the same: the append and the view load report the damage as the readers do and
    write nothing, and a deletion's tombstone says 0 (the version is unknown)."""
    async with await es.connect(redis_url, namespace="v" + uuid.uuid4().hex[:12]) as store:
        assert isinstance(store, es.RedisEventStore)
        await store.append(T, [es.MessageAppended(message=user(f"m{i}")) for i in range(10)])
        view = (es.ViewEntry(10, b"kept"),)
        await store.load_views(T, [es.ListLoad("v", view)], expected_version=10)
        meta = store.keys.meta(T)
        await store.client.hset(meta, "v", stored)
        log = await store.read_raw(T)
        more = [es.MessageAppended(message=user("more"))]
        for call in (
            lambda: store.append(T, more),
            lambda: store.append(T, more, expected_version=10),
            lambda: store.load_views(T, [es.ViewClear("v")], expected_version=10),
            lambda: store.version(T),
        ):
            with pytest.raises(es.CorruptEventError, match="field 'v'"):
                await call()
        assert await store.read_raw(T) == log  # nothing appended
        assert await store.client.hget(meta, "v") == stored.encode()
        # Nothing loaded (read raw: every reader of the views refuses the damaged version).
        assert await store.client.lrange(store.keys.view(T, "v"), 0, -1) == [b"10:kept"]
        assert await store.delete_thread(T) == 0  # the version it had is unknown: 0
        (tombstone,) = [e for e in await store.read_feed(store.keys.partition(T)) if e.deleted]
        assert tombstone.last_seq == 0


@pytest.mark.parametrize("stored", ["1e15", "soon", " 17"])
async def test_a_damaged_last_append_time_holds_no_append_back(redis_url: str, stored: str) -> None:
    """The meta's last-append time keeps event times from running backwards. Damaged, it
    must neither stop appends (a Lua error) nor move every later event's time (tonumber
    reads '1e15' as a date in the year 33658): it counts as no time, and is rewritten."""
    async with await es.connect(redis_url, namespace="s" + uuid.uuid4().hex[:12]) as store:
        assert isinstance(store, es.RedisEventStore)
        await store.append(T, [es.MessageAppended(message=user("before"))])
        meta = store.keys.meta(T)
        await store.client.hset(meta, "s", stored)
        before_ms = int(time.time() * 1000)
        await store.append(T, [es.MessageAppended(message=user("after"))])
        (event,) = [e async for e in store.read(T, start=2)]
        assert before_ms - 5 <= event.time_ms <= int(time.time() * 1000) + 5
        assert await store.client.hget(meta, "s") == str(event.time_ms).encode()
        assert (await Auditor(store).verify(T)).ok


async def test_a_keyed_thread_copied_into_another_namespace_does_not_verify_there(
    redis_url: str,
) -> None:
    """Namespaces that share a secret link with keys of their own: a copy (DUMP/RESTORE of
    another tenant's thread) fails every link, and the verdict says it was copied."""
    a_ns, b_ns = ("n" + uuid.uuid4().hex[:12] for _ in range(2))
    a = await es.connect(redis_url, namespace=a_ns, secret=SECRET)
    b = await es.connect(redis_url, namespace=b_ns, secret=SECRET)
    try:
        assert isinstance(a, es.RedisEventStore) and isinstance(b, es.RedisEventStore)
        for store, n in ((a, 2), (b, 3)):
            for i in range(n):
                await store.append(T, [es.MessageAppended(message=user(f"{i}"))])
        assert (await Auditor(b).verify(T)).ok
        for key_of in (a.keys.log, a.keys.meta):
            dumped = await a.client.dump(key_of(T))
            target = (b.keys.log if key_of == a.keys.log else b.keys.meta)(T)
            await b.client.restore(target, 0, dumped, replace=True)
        verdict = await Auditor(b).verify(T)
        assert_damage(verdict, 0, "wrong_key")
        assert [p.seq for p in verdict.problems] == [0]
        assert "another namespace's" in verdict.detail and verdict.key_matches is False
        # With b's fingerprint forged into the copy's meta, the links still fail, and say how.
        await b.append("other", [es.MessageAppended(message=user("x"))])
        await b.client.hset(b.keys.meta(T), "f", await b.chain_key_fingerprint("other") or "")
        verdict = await Auditor(b).verify(T)
        assert_damage(verdict, 1, "modified")
        assert "another thread or namespace (copied or renamed)" in verdict.detail
        assert (await Auditor(a).verify(T)).ok
    finally:
        await a.close()
        await b.close()


async def test_a_chain_head_that_is_not_the_last_link_is_meta_damage(
    store: es.EventStore,
) -> None:
    version = await populate(store)
    raw = Raw(store)
    await raw.set_head("0" * 32)
    verdict = await Auditor(store).verify(T)
    assert_damage(verdict, version, "meta")
    assert "chain head" in verdict.detail


async def test_a_last_append_time_moved_in_the_meta_is_damage(redis_url: str) -> None:
    """The meta's time of the last append (field 's') moved ahead: every later event would be
    stamped with it (times never run backwards in a thread), and verify did not look."""
    async with await es.connect(redis_url, namespace="h" + uuid.uuid4().hex[:12]) as store:
        assert isinstance(store, es.RedisEventStore)
        version = await populate(store, rounds=1)
        assert (await Auditor(store).verify(T)).ok
        await store.client.hset(store.keys.meta(T), "s", "4102444800000")  # 2100-01-01
        verdict = await Auditor(store).verify(T)
        assert_damage(verdict, version, "meta")
        assert "field 's'" in verdict.detail and "4102444800000" in verdict.detail


async def test_a_deleted_lifes_log_put_back_is_damage_even_with_a_key(redis_url: str) -> None:
    """A life's log, version and head saved, the thread deleted and written again, then the
    old log put back over the new one: every link verifies (the key made them), so verify
    passed, and check offered a rebuild from it. Its first event predates the current life."""
    namespace = "h" + uuid.uuid4().hex[:12]
    settings = StoreSettings.from_url(redis_url, namespace=namespace, secret=SECRET)
    async with await es.open_store(settings) as store:
        assert isinstance(store, es.RedisEventStore)
        await populate(store, rounds=1)
        log, meta = store.keys.log(T), store.keys.meta(T)
        old_entries = await store.client.xrange(log)
        old_v, old_h = await store.client.hmget(meta, "v", "h")
        await store.delete_thread(T)
        await anyio.sleep(0.01)  # the new life begins at a later millisecond
        await populate(store, rounds=2)
        await store.client.delete(log)
        for entry_id, fields in old_entries:
            await store.client.xadd(log, fields, id=entry_id)
        await store.client.hset(
            meta, mapping={"v": old_v, "h": old_h, "s": old_entries[-1][1][b"s"]}
        )
        verdict = await Auditor(store).verify(T)
        assert not verdict.ok and (verdict.first_bad_seq, verdict.kind) == (1, "meta"), verdict
        assert "another life's" in verdict.detail


async def test_a_chain_head_removed_from_the_meta_is_damage(redis_url: str) -> None:
    """The meta's chain head (field 'h') deleted: verify took its absence for a thread that
    records none and passed; the next append then started the chain again from nothing, and
    that entry, unbound to the ones before it, passed as "intact and in place" too."""
    namespace = "h" + uuid.uuid4().hex[:12]
    settings = StoreSettings.from_url(redis_url, namespace=namespace, secret=SECRET)
    async with await es.open_store(settings) as store:
        assert isinstance(store, es.RedisEventStore)
        version = await populate(store, rounds=2)
        assert await store.client.hdel(store.keys.meta(T), "h") == 1
        verdict = await Auditor(store).verify(T)
        assert_damage(verdict, version, "meta")
        assert "chain head" in verdict.detail
        # An append refuses to start the chain again; one that did (an older threadlog, a
        # script's copy) is reported where it did.
        with pytest.raises(es.CorruptEventError, match="no chain head"):
            await store.append(T, [es.MessageAppended(message=user("after"))])
        assert await store.version(T) == version
        last = (await store.read_raw(T, start=version, stop=version))[0][1]
        payload = msgspec.msgpack.encode(es.MessageAppended(message=user("after")))
        fields = {**last, b"i": ULID().bytes, b"d": payload, b"m": b""}
        digest = es.entry_digest(T, fields, store._secret)  # the writers' key: no forgery
        assert digest is not None
        link = es.chain_link("", version + 1, int(fields[b"s"]), digest)
        await Raw(store).xadd(f"{version + 1}-0", {**fields, b"h": link.encode()})
        await store.client.hset(store.keys.meta(T), mapping={"v": version + 1, "h": link})
        verdict = await Auditor(store).verify(T)
        assert not verdict.ok and verdict.first_bad_seq == version + 1, verdict
        assert "starts the chain again" in verdict.detail, verdict


async def test_a_tail_cut_with_its_version_lowered_is_meta_damage(redis_url: str) -> None:
    """The cut the version alone cannot show: the head the meta kept names the old tail."""
    async with await es.connect(redis_url, namespace="h" + uuid.uuid4().hex[:12]) as store:
        assert isinstance(store, es.RedisEventStore)
        version = await populate(store)
        await store.client.xtrim(store.keys.log(T), minid=0)  # no-op: keeps every entry
        for seq in (version, version - 1):
            await store.client.xdel(store.keys.log(T), f"{seq}-0")
        await store.client.hset(store.keys.meta(T), "v", version - 2)
        verdict = await Auditor(store).verify(T)
        assert_damage(verdict, version - 2, "meta")


async def test_a_key_fingerprint_edited_to_turn_writers_away_is_meta_damage(
    keyed: es.EventStore,
) -> None:
    await populate(keyed)
    if isinstance(keyed, es.RedisEventStore):
        await keyed.client.hset(keyed.keys.meta(T), "f", "-")
    else:
        Raw(keyed)._memory_thread().fingerprint = "-"
    verdict = await Auditor(keyed).verify(T)
    assert_damage(verdict, 0, "meta")
    assert "every link verifies under this check's key" in verdict.detail
    assert "THREADLOG_SECRET" not in verdict.detail  # no advice to verify without the key


# -- verify: tampering with the meta hash and the namespace's settings -------------------------


async def lower_version(store: es.EventStore, version: int) -> None:
    """Write the version the thread's meta records, nothing else."""
    if isinstance(store, es.RedisEventStore):
        await store.client.hset(store.keys.meta(T), "v", version)
    else:
        assert isinstance(store, es.MemoryEventStore)
        store.server.namespaces[store.namespace].threads[T].version = version


async def test_a_lowered_version_is_meta_damage_not_an_inserted_event(
    keyed: es.EventStore,
) -> None:
    # The last two events verify under the key: an append wrote them. Only the meta's version
    # was edited; calling them insertions sent the reader after a forger who was not there.
    version = await populate(keyed)
    await lower_version(keyed, version - 2)
    verdict = await Auditor(keyed).verify(T)
    assert_damage(verdict, 0, "meta")
    assert [(p.seq, p.kind) for p in verdict.problems] == [(0, "meta")]
    assert f"recorded version {version - 2}" in verdict.detail
    assert f"seqs {version - 1}..{version} are linked into its chain" in verdict.detail
    assert verdict.checked == version and verdict.head != ""
    # An entry beyond the version whose link does not hold is still an insertion.
    await lower_version(keyed, version)
    rows = await Raw(keyed).entries()
    await Raw(keyed).xadd(f"{version + 1}-0", rows[0][1])
    verdict = await Auditor(keyed).verify(T)
    assert_damage(verdict, version + 1, "inserted")


@pytest.mark.parametrize("secret", [SECRET, None], ids=["keyed", "unkeyed"])
async def test_a_log_without_its_meta_hash_is_meta_damage_not_every_event_inserted(
    secret: bytes | None, redis_url: str
) -> None:
    namespace = "m" + uuid.uuid4().hex[:12]
    settings = StoreSettings.from_url(redis_url, namespace=namespace, secret=secret)
    async with await es.open_store(settings) as store:
        version = await populate(store)
        assert isinstance(store, es.RedisEventStore)
        await store.client.delete(store.keys.meta(T))
        verdict = await Auditor(store).verify(T)
        # One problem, the meta hash; the log's own chain is still checked, and holds.
        assert_damage(verdict, 0, "meta")
        assert [(p.seq, p.kind) for p in verdict.problems] == [(0, "meta")]
        assert "no meta hash" in verdict.detail and f"{version} entries" in verdict.detail
        assert verdict.checked == version
        # Damage in that log is still found, at its seq.
        rows = await Raw(store).entries()
        rows[3] = (rows[3][0], edited(rows[3][1], "changed"))
        await Raw(store).rewrite(rows)
        verdict = await Auditor(store).verify(T)
        assert [(p.seq, p.kind) for p in verdict.problems] == [(0, "meta"), (4, "modified")]
        # Only the version gone from the meta hash is the same damage.
        await store.client.hset(store.keys.meta(T), "h", "x")
        verdict = await Auditor(store).verify(T)
        assert verdict.problems[0].kind == "meta" and "no version" in verdict.problems[0].detail


async def test_a_cut_at_the_end_with_the_head_rewritten_passes_even_with_a_key(
    keyed: es.EventStore,
) -> None:
    # The documented limit (docs/guarantees.md, section 6): the head a cut log needs is the
    # stored link of its new last entry, which anyone who can read the log has; no key is
    # needed to rewrite it. Only a head kept outside Redis shows the cut.
    version = await populate(keyed)
    before = await Auditor(keyed).verify(T)
    raw = Raw(keyed)
    rows = await raw.entries()
    await raw.xdel(rows[-1][0])
    await lower_version(keyed, version - 1)
    assert_damage(await Auditor(keyed).verify(T), version - 1, "meta")  # the old head gives it away
    await raw.set_head(rows[-2][1][b"h"].decode())
    if isinstance(keyed, es.RedisEventStore):  # and the time of the last append, as it was
        await keyed.client.hset(keyed.keys.meta(T), "s", rows[-2][1][b"s"])
    after = await Auditor(keyed).verify(T)
    assert after.ok and after.keyed and after.checked == version - 1
    assert after.head != before.head  # what a head kept elsewhere would show


async def test_thread_keys_outside_their_partition_stop_the_audit_of_every_thread(
    redis_url: str,
) -> None:
    # The partition count in the namespace's settings hash decides where each thread's keys
    # are. Edited, every reader (and the audit) looked for the threads in other partitions:
    # `verify_all` found their keys but dropped them as "not theirs" and passed with nothing
    # verified. Now the keys that no partition of the recorded count holds stop it, named.
    namespace = "p" + uuid.uuid4().hex[:12]
    threads = [f"t{i}" for i in range(6)]
    async with await es.open_store(StoreSettings.from_url(redis_url, namespace=namespace)) as store:
        for t in threads:
            await store.append(t, [es.MessageAppended(message=user("kept"))])
        assert set(await Auditor(store).verify_all()) == set(threads)
        assert isinstance(store, es.RedisEventStore)
        config = KeyLayout.config_key(namespace)
        await store.client.hset(config, "partitions", 3)
        settings = StoreSettings.from_url(redis_url, namespace=namespace)
        async with await es.open_store(settings) as edited_store:
            assert edited_store.partitions == 3
            moved = sorted(t for t in threads if store.keys.partition(t) != partition_of(t, 3))
            assert moved
            with pytest.raises(es.CorruptKeyError) as info:
                await Auditor(edited_store).verify_all()
            assert info.value.key == config
            assert "partition count" in str(info.value) and moved[0] in str(info.value)
        await store.client.hset(config, "partitions", store.partitions)
        # One thread's keys moved into another partition's tag: named the same way.
        tag = store.keys.partition("t0")
        other = (tag + 1) % store.partitions
        for kind in ("log", "meta"):
            key = getattr(store.keys, kind)("t0")
            await store.client.rename(key, key.replace(f":{tag}}}", f":{other}}}"))
        with pytest.raises(es.CorruptKeyError, match="'t0'"):
            await Auditor(store).verify_all()


async def test_a_meta_hash_without_its_incarnation_is_meta_damage(redis_url: str) -> None:
    # Exports and feed readers refuse a thread whose meta lost 'n' ("run 'verify'"); verify
    # passed it as intact.
    settings = StoreSettings.from_url(redis_url, namespace="n" + uuid.uuid4().hex[:12])
    async with await es.open_store(settings) as store:
        version = await populate(store)
        assert isinstance(store, es.RedisEventStore)
        assert await store.client.hdel(store.keys.meta(T), "n") == 1
        verdict = await Auditor(store).verify(T)
        assert_damage(verdict, 0, "meta")
        assert "no incarnation (field 'n'" in verdict.detail and verdict.checked == version
        # The next append records a life again; the thread verifies.
        await store.append(T, [es.MessageAppended(message=user("after"))])
        assert (await Auditor(store).verify(T)).ok


@pytest.mark.parametrize("where", ["redis", "cluster"])
async def test_damage_in_a_meta_snapshot_is_raised_by_the_field_it_is_in(
    request: pytest.FixtureRequest, where: str
) -> None:
    """One round trip reads every field an audit needs of a thread's meta hash and index;
    damage in one field raises there, as its own read would, and the others still answer."""
    url = request.getfixturevalue("redis_url" if where == "redis" else "cluster_url")
    namespace = "s" + uuid.uuid4().hex[:12]
    async with await es.open_store(StoreSettings.from_url(url, namespace=namespace)) as store:
        assert isinstance(store, es.RedisEventStore)
        client, meta = store.client, store.keys.meta(T)
        await populate(store)
        life = await store.incarnation(T)
        await client.hset(meta, "v", "x")  # a version that is not a number
        snapshot = await store.meta_snapshot(T)
        for damaged in ("version", "chain_head"):
            with pytest.raises(es.CorruptEventError, match="not a number"):
                getattr(snapshot, damaged)()
            with pytest.raises(es.CorruptEventError, match="not a number"):
                await getattr(store, damaged)(T)
        assert snapshot.incarnation() == life and snapshot.indexed()
        assert snapshot.chain_key_fingerprint() == await store.chain_key_fingerprint(T)
        await client.delete(meta)
        await client.set(meta, "a string where the meta hash was")
        snapshot = await store.meta_snapshot(T)
        for read in ("incarnation", "version", "chain_key_fingerprint", "chain_head"):
            with pytest.raises(es.WrongKeyTypeError):
                getattr(snapshot, read)()
            with pytest.raises(es.WrongKeyTypeError):
                await getattr(store, read)(T)
        assert snapshot.indexed()
        index = store.keys.index(store.keys.partition(T))
        await client.delete(index)
        await client.set(index, "a string where the thread index was")
        snapshot = await store.meta_snapshot(T)
        with pytest.raises(es.WrongKeyTypeError):
            snapshot.indexed()
        with pytest.raises(es.WrongKeyTypeError):
            await store.indexed(T)


async def test_what_verify_does_not_hold_to_the_chain(redis_url: str) -> None:
    """The documented limits (docs/guarantees.md, section 6, "What verify cannot see"): the
    meta hash's ledger, incarnation and key fingerprint, and a thread removed with every
    trace, are outside the chain. Edits to them pass `verify`, even keyed."""
    namespace = "w" + uuid.uuid4().hex[:12]
    settings = StoreSettings.from_url(redis_url, namespace=namespace, secret=SECRET)
    async with await es.open_store(settings) as store:
        assert isinstance(store, es.RedisEventStore)
        client, meta = store.client, store.keys.meta(T)
        a, b = [es.MessageAppended(message=user("a"))], [es.MessageAppended(message=user("b"))]
        await store.append(T, a, idempotency_key="k1")
        await store.append(T, b, idempotency_key="k2")
        # The ledger: a field pointed at another append's seqs answers a retry with them...
        first = await client.hget(meta, "k:k1")
        second = await client.hget(meta, "k:k2")
        await client.hset(meta, "k:k2", first[:1] + second[1:])
        retry = await store.append(T, b, idempotency_key="k2")
        assert retry.duplicate and (retry.first_seq, retry.last_seq) == (1, 1)
        # ... and a removed field lets a retry write its events again.
        await client.hdel(meta, "k:k1")
        again = await store.append(T, a, idempotency_key="k1")
        assert not again.duplicate and again.first_seq == 3
        assert (await Auditor(store).verify(T)).ok
        # The incarnation changed to another number (not removed: that is `meta` damage).
        await client.hset(meta, "n", 12345)
        assert (await Auditor(store).verify(T)).ok
        # The key fingerprint removed: the thread's next writer's key is adopted.
        await client.hdel(meta, "f")
        assert (await Auditor(store).verify(T)).ok
        # A thread removed with every trace: its keys, its index entry and its feed entries.
        await store.append("wiped", a)
        feed = store.keys.feed(store.keys.partition("wiped"))
        for entry in await store.read_feed(store.keys.partition("wiped")):
            if entry.thread_id == "wiped":
                await client.xdel(feed, entry.id)
        await client.delete(store.keys.log("wiped"), store.keys.meta("wiped"))
        await client.zrem(store.keys.index(store.keys.partition("wiped")), "wiped")
        assert set(await Auditor(store).verify_all()) == {T}
        gone = await Auditor(store).verify("wiped")
        assert gone.kind == "missing" and "never written" in gone.detail


async def test_an_old_entry_replayed_far_from_its_seq_is_named_as_a_copy(
    keyed: es.EventStore,
) -> None:
    # Seq 1 appended again at the end (the version raised to hold it): it was "changed after
    # the append"; the event id says which event it repeats.
    version = await populate(keyed)
    raw = Raw(keyed)
    first = (await raw.entries())[0][1]
    await raw.xadd(f"{version + 1}-0", first)
    await lower_version(keyed, version + 1)
    verdict = await Auditor(keyed).verify(T)
    assert_damage(verdict, version + 1, "modified")
    assert "holds a copy of the event at seq 1" in verdict.detail


async def test_a_raised_version_says_the_head_is_the_logs_last_link(keyed: es.EventStore) -> None:
    version = await populate(keyed)
    await lower_version(keyed, version + 2)
    verdict = await Auditor(keyed).verify(T)
    assert_damage(verdict, version + 1, "deleted")
    assert "or the version was raised" in verdict.detail
    assert f"the link of seq {version}, the log's last" in verdict.detail
    # Events cut from the end with the version left: the head is the old last link.
    await lower_version(keyed, version)
    raw = Raw(keyed)
    await raw.xdel((await raw.entries())[-1][0])
    verdict = await Auditor(keyed).verify(T)
    assert_damage(verdict, version, "deleted")
    assert "raised" not in verdict.detail
