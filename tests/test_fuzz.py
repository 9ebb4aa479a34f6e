"""Hostile input: property-based fuzzing of every decoder, validator and importer, and raw garbage
written straight into a thread's stream.

Decoders (stream entries, event payloads, JSON messages, JSONL files), validators (thread ids,
namespaces, store URLs) and the CLI's argument handling get arbitrary input and may answer only
with their documented typed errors: never another exception, never a hang. Garbage XADDed into
a thread's stream comes back as `CorruptEventError` naming the thread and the seq; a reader can
step past it, and `Auditor.verify` reports it and checks on. Size limits hold before anything
is sent: the server's per-command counters (``INFO commandstats``) do not move.

The bugs this fuzzing found (a list as an event type, ints beyond 64 bits in JSONL, lone
surrogates, failing upcasters, non-ASCII entry ids) are fixed; the regression tests at the end
keep them fixed.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import eventstore as es
from adapters import Auditor, JsonlImportError, SessionStore, import_jsonl, parse_jsonl
from eventstore._codec import decode_entry, encode_events, entry_fields
from eventstore._connect import _redis_client
from eventstore._ids import MAX_NAMESPACE_CHARS, MAX_THREAD_ID_BYTES
from eventstore.servers import RedisServer, redis_server
from eventstore.testing import read_all
from projections import Projector

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_TIMEOUT_S = 10.0
"""No single example may take longer than this: a hang is a failure, not a slow test."""

FAST = settings(max_examples=200, deadline=None)
REDIS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# -- strategies ------------------------------------------------------------------------------------

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1


def scalars(*, big_ints: bool) -> st.SearchStrategy[Any]:
    ints = st.integers() if big_ints else st.integers(INT64_MIN, UINT64_MAX)
    return st.one_of(
        st.none(), st.booleans(), ints, st.floats(allow_nan=False, allow_infinity=False), st.text()
    )


def json_values(*, big_ints: bool = True) -> st.SearchStrategy[Any]:
    return st.recursive(
        scalars(big_ints=big_ints),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
        max_leaves=12,
    )


msgpack_values = st.recursive(
    scalars(big_ints=False) | st.binary(max_size=16),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), inner, max_size=4)
    ),
    max_leaves=12,
)

PAYLOAD_FIELDS = [
    "message", "role", "content", "block", "value", "turn_id", "parent_turn_id", "outcome",
    "usage", "messages", "request", "grant", "assistant_message", "steps", "reason",
]  # fmt: skip
TAGS = es.registry.tags()
SAMPLE_EVENTS: list[es.Event] = [
    es.MessageAppended(message=es.Message(role="user", content="hello")),
    es.StateUpdated(block="plan", value={"steps": [1, 2]}, expected_version=1),
    es.TurnOpened(turn_id=es.new_ulid(), request=es.Message(role="user", content="q")),
    es.TurnSettled(
        turn_id=es.new_ulid(),
        outcome="failed",
        usage=es.Usage(input_tokens=3),
        error=es.TurnError(kind="timeout"),
    ),
    es.TranscriptAppended(messages=[es.Message(role="assistant", content=[es.TextPart(text="a")])]),
    es.TranscriptReplaced(messages=[]),
]
SAMPLE_DATA = [msgspec.msgpack.encode(e) for e in SAMPLE_EVENTS]


@st.composite
def mutated(draw: st.DrawFn, original: bytes) -> bytes:
    """``original`` truncated, or with bytes flipped, inserted or deleted."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        action = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        if action == "flip":
            data[at] ^= draw(st.integers(1, 255))
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif action == "delete":
            del data[at]
        else:
            del data[at:]
    return bytes(data)


payload_bytes = st.one_of(
    st.binary(max_size=48),
    msgpack_values.map(msgspec.msgpack.encode),
    st.builds(
        lambda tag, body: msgspec.msgpack.encode({"type": tag, **body}),
        st.sampled_from(TAGS) | st.text(max_size=10) | msgpack_values,
        st.dictionaries(st.sampled_from(PAYLOAD_FIELDS) | st.text(max_size=6), msgpack_values),
    ),
    st.sampled_from(SAMPLE_DATA).flatmap(mutated),
    st.sampled_from(SAMPLE_DATA),
)


def _good_entry() -> dict[bytes, bytes]:
    (encoded,) = encode_events(
        "fuzz", [SAMPLE_EVENTS[0]], es.registry, max_event_bytes=1 << 20, secret=None
    )
    return entry_fields(encoded, 1_700_000_000_000, "0" * 32)


GOOD_ENTRY = _good_entry()
numbers = st.one_of(
    st.integers().map(lambda n: b"%d" % n),
    st.from_regex(rb"\A[ +\-_0-9a-f.]{0,12}\Z"),
    st.binary(max_size=8),
)
field_values: dict[bytes, st.SearchStrategy[bytes]] = {
    b"i": st.binary(min_size=14, max_size=18) | st.binary(max_size=30),
    b"v": numbers,
    b"s": numbers,
    b"d": payload_bytes,
    b"m": st.binary(max_size=12)
    | msgpack_values.map(msgspec.msgpack.encode)
    | st.dictionaries(st.sampled_from(["t", "c", "k"]), msgpack_values).map(msgspec.msgpack.encode),
    b"h": st.binary(max_size=40),
}


@st.composite
def damaged_entry(draw: st.DrawFn) -> dict[bytes, bytes]:
    """A valid entry with some fields dropped or replaced by hostile values."""
    fields = dict(GOOD_ENTRY)
    for name in draw(st.lists(st.sampled_from(sorted(field_values)), min_size=1, unique=True)):
        if draw(st.booleans()):
            del fields[name]
        else:
            fields[name] = draw(field_values[name])
    if draw(st.booleans()):
        fields[draw(st.binary(max_size=3))] = draw(st.binary(max_size=8))
    return fields


entry_fields_strategy = st.one_of(
    damaged_entry(),
    st.dictionaries(
        st.sampled_from(sorted(field_values)) | st.binary(max_size=3),
        st.binary(max_size=40),
        max_size=8,
    ),
)
entry_ids = st.one_of(
    st.tuples(st.integers(0, UINT64_MAX), st.integers(0, UINT64_MAX)).map(lambda t: b"%d-%d" % t),
    st.from_regex(rb"\A[0-9]{0,24}-?[0-9]{0,4}\Z"),
    st.binary(max_size=24),
)


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def portal() -> Iterator[BlockingPortal]:
    """An event loop in a thread: hypothesis drives sync tests, the store is async."""
    with start_blocking_portal(backend="asyncio") as portal:
        yield portal


@pytest.fixture(scope="module")
def store(portal: BlockingPortal, redis_url: str) -> Iterator[es.RedisEventStore]:
    opened = portal.call(lambda: es.connect(redis_url, namespace="z" + uuid.uuid4().hex[:12]))
    assert isinstance(opened, es.RedisEventStore)
    try:
        yield opened
    finally:
        portal.call(opened.close)


def run(portal: BlockingPortal, job: Callable[[], Awaitable[T]]) -> T:
    """Run ``job`` on the portal's loop, failing (not hanging) after `EXAMPLE_TIMEOUT_S`."""

    async def bounded() -> T:
        with anyio.fail_after(EXAMPLE_TIMEOUT_S):
            return await job()

    return portal.call(bounded)


# -- stream entries and payloads -------------------------------------------------------------------


def _seq_of(entry_id: bytes) -> int | None:
    head, sep, tail = entry_id.partition(b"-")
    # Redis writes at most 20 digits a part: a longer run of digits is damage, not a seq.
    return int(head) if sep and head.isdigit() and len(head) <= 20 and tail == b"0" else None


@FAST
@given(entry_id=entry_ids, fields=entry_fields_strategy)
def test_decode_entry_raises_only_corrupt_event_error(
    entry_id: bytes, fields: dict[bytes, bytes]
) -> None:
    seq = _seq_of(entry_id)
    outcome: es.RecordedEvent | es.CorruptEventError
    try:
        outcome = decode_entry("fuzz", entry_id, fields, es.registry)
    except es.CorruptEventError as exc:
        outcome = exc
    event(type(outcome).__name__)
    if isinstance(outcome, es.CorruptEventError):
        assert (outcome.thread_id, outcome.seq) == ("fuzz", seq)
        assert "'fuzz'" in str(outcome)
    else:
        assert (outcome.thread_id, outcome.seq) == ("fuzz", seq)
        assert outcome.type in TAGS


@FAST
@given(data=payload_bytes, version=st.integers(-3, 4) | st.integers())
# A map as a map's key: msgspec before 0.23 raised TypeError (scripts/test-lowest found it).
@example(data=b"\x81\x81\xa5steps\x92\x01\x02\x01", version=1)
def test_registry_decode_raises_only_typed_errors(data: bytes, version: int) -> None:
    try:
        decoded = es.registry.decode(data, version)
    except (es.EventValidationError, es.UnknownEventTypeError) as exc:
        event(type(exc).__name__)
        return
    event("decoded")
    assert isinstance(decoded, es.Event) and decoded.event_type in TAGS


# -- JSON messages and JSONL files -----------------------------------------------------------------

PART_TYPES = ["text", "reasoning", "tool-call", "tool-result", "file", "image"]
PART_FIELDS = [
    "text", "toolCallId", "toolName", "input", "output", "isError", "mediaType", "data", "url",
    "filename", "image", "providerOptions", "extra", "kind",
]  # fmt: skip


def message_objects(*, big_ints: bool) -> st.SearchStrategy[Any]:
    """Message-shaped JSON objects: mostly well formed, some with any field of any shape."""
    values = json_values(big_ints=big_ints)
    texts = st.text(max_size=12)
    good_parts = st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
        st.fixed_dictionaries(
            {"type": st.just("tool-call"), "toolCallId": texts, "toolName": texts},
            optional={"input": values, "providerOptions": st.dictionaries(texts, values)},
        ),
        st.fixed_dictionaries(
            {"type": st.just("tool-result"), "toolCallId": texts, "toolName": texts},
            optional={"output": values, "isError": st.booleans(), "x-extra": values},
        ),
        st.fixed_dictionaries({"type": st.just("image"), "image": texts}),
    )
    any_parts = st.one_of(
        good_parts,
        st.builds(
            lambda kind, body: {"type": kind, **body},
            st.sampled_from(PART_TYPES) | st.text(max_size=8),
            st.dictionaries(st.sampled_from(PART_FIELDS) | st.text(max_size=5), values, max_size=5),
        ),
        values,
    )
    roles = st.sampled_from(list(es.ROLES))
    well_formed = st.fixed_dictionaries(
        {"role": roles, "content": texts | st.lists(good_parts, max_size=3)},
        optional={"id": texts, "providerOptions": st.dictionaries(texts, values), "x": values},
    )
    hostile = st.fixed_dictionaries(
        {"role": roles | values},
        optional={
            "content": st.text() | st.lists(any_parts, max_size=4) | values,
            "id": values,
            "providerOptions": values,
            "extra": values,
            "source": values,
            "x-unknown": values,
        },
    )
    return well_formed | hostile


def message_lines(*, big_ints: bool) -> st.SearchStrategy[bytes]:
    objects = message_objects(big_ints=big_ints)
    return st.one_of(
        objects.map(msgspec.json.encode),
        # Formatting msgspec would not produce: such lines are kept verbatim as ``source``.
        st.builds(
            lambda obj, ascii_only, spaced: json.dumps(
                obj, ensure_ascii=ascii_only, separators=(", ", ": ") if spaced else None
            ).encode(),
            objects,
            st.booleans(),
            st.booleans(),
        ),
        objects.map(msgspec.json.encode).flatmap(mutated),
        json_values(big_ints=big_ints).map(msgspec.json.encode),
        st.binary(max_size=40),
    )


@FAST
@given(raw=message_lines(big_ints=True))
@example(raw=b'{"role": "user",\n  "content": "pretty"}')
@example(raw=b'{"role":"user",\r"content":"cr"}')
def test_message_from_json_bytes_is_typed_and_byte_faithful(raw: bytes) -> None:
    try:
        message = es.Message.from_json_bytes(raw)
    except es.MessageFormatError:
        event("MessageFormatError")
        return
    event("message, kept as source" if message.source is not None else "message")
    exported = message.to_json_bytes()
    if b"\n" in raw or b"\r" in raw:
        # A JSONL line cannot hold it: the canonical text instead, one line.
        event("multi-line")
        assert message.source is None and b"\n" not in exported and b"\r" not in exported
        assert es.Message.from_json_bytes(exported) == message
    else:
        assert exported == raw
    # The same text given as str decodes to the same message.
    assert es.Message.from_json_bytes(raw.decode("utf-8")) == message


@FAST
@given(
    lines=st.lists(message_lines(big_ints=False), max_size=6),
    newline=st.sampled_from([b"\n", b"\r\n"]),
    trailing=st.booleans(),
    limit=st.integers(16, 2048),
)
def test_parse_jsonl_accounts_for_every_line(
    lines: list[bytes], newline: bytes, trailing: bool, limit: int
) -> None:
    data = newline.join(lines) + (newline if trailing and lines else b"")
    physical = data.split(b"\n")
    while physical and not physical[-1].strip():
        physical.pop()  # the final newline, and blank lines after the last message
    messages, errors = parse_jsonl(data, max_message_bytes=limit)
    event(f"lines: {len(messages)} messages, {len(errors)} errors")
    assert len(messages) + len(errors) == len(physical)
    bad = [e.line for e in errors]
    assert bad == sorted(set(bad)) and all(1 <= n <= len(physical) for n in bad)
    good = [n for n in range(1, len(physical) + 1) if n not in set(bad)]
    for n, message in zip(good, messages, strict=True):
        line = physical[n - 1]
        line = line[:-1] if line.endswith(b"\r") else line
        if b"\r" in line:  # a CR inside a line: exported canonical, on one line
            assert b"\r" not in message.to_json_bytes() and message.source is None
        else:
            assert message.to_json_bytes() == line
        assert len(msgspec.msgpack.encode(message)) <= limit


# -- thread ids, namespaces and URLs ---------------------------------------------------------------

no_surrogates = st.characters(codec="utf-8")
thread_id_candidates = st.one_of(
    st.text(max_size=300),
    st.text(no_surrogates, min_size=250, max_size=260),
    st.text("ab{}\x00\n\x7f é😀:", max_size=20),
    st.binary(max_size=8),
    st.integers(),
    st.none(),
)


@FAST
@given(thread_id=thread_id_candidates)
def test_thread_ids_are_accepted_or_refused_with_a_typed_error(thread_id: object) -> None:
    try:
        accepted = es.validate_thread_id(thread_id)
    except es.InvalidThreadIdError:
        event("refused")
        return
    event("accepted")
    assert accepted is thread_id and isinstance(accepted, str)
    assert 0 < len(accepted.encode("utf-8")) <= MAX_THREAD_ID_BYTES
    assert not any(c in accepted for c in "{}\x7f") and min(accepted) >= " "


@REDIS
@given(thread_id=st.text(no_surrogates, min_size=1, max_size=64) | st.text(" :é😀ab", min_size=1))
def test_accepted_thread_ids_round_trip_through_redis(
    portal: BlockingPortal, store: es.RedisEventStore, thread_id: str
) -> None:
    try:
        es.validate_thread_id(thread_id)
    except es.InvalidThreadIdError:
        event("refused")
        return
    event("accepted: appended and read back")

    async def round_trip() -> None:
        projector = Projector(store)
        before = await store.version(thread_id)
        event = es.MessageAppended(message=es.Message(role="user", content=thread_id))
        result = await projector.append(thread_id, [event])
        assert result.last_seq == before + 1
        (stored,) = await read_all(store, thread_id, start=result.last_seq)
        assert (stored.thread_id, stored.payload) == (thread_id, event)
        (window,) = await projector.last(thread_id, 1)
        assert window.message.text == thread_id
        assert thread_id in {t.thread_id for t in await store.threads()}

    run(portal, round_trip)


namespace_candidates = st.one_of(
    st.text(max_size=70),
    st.text("aZ09_.-", min_size=1, max_size=MAX_NAMESPACE_CHARS + 2),
    st.text("aZ09_.-*?[]{}:~ \n", min_size=1, max_size=10),
    st.binary(max_size=4),
    st.none(),
)


@REDIS
@given(namespace=namespace_candidates)
def test_namespaces_are_accepted_or_refused_and_accepted_ones_work(
    portal: BlockingPortal, store: es.RedisEventStore, namespace: object
) -> None:
    try:
        accepted = es.validate_namespace(namespace)
    except es.InvalidNamespaceError:
        event("refused")
        return
    event("accepted: appended and read back")
    assert accepted is namespace and isinstance(accepted, str)

    async def round_trip() -> None:
        tenant = es.RedisEventStore(store.client, namespace=accepted, owns_client=False)
        await tenant.ensure_namespace()
        before = await tenant.version("t")
        result = await tenant.append(
            "t", [es.MessageAppended(message=es.Message(role="user", content="x"))]
        )
        assert result.last_seq == before + 1
        assert tenant.keys.log("t").startswith("tl:{" + accepted + ":")
        assert await store.client.exists(tenant.keys.log("t")) == 1

    run(portal, round_trip)


SCHEMES = ["memory", "redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "http", "REDIS"]
URL_PARAMS = ["namespace", "partitions", "socket_timeout", "db", "ssl_cert_reqs", "bogus"]
urls = st.one_of(
    st.text(max_size=60),
    st.builds(
        lambda scheme, rest: f"{scheme}://{rest}",
        st.sampled_from(SCHEMES) | st.text(max_size=6),
        st.text(max_size=40),
    ),
    st.builds(
        lambda scheme, user, host, port, path, query: (
            f"{scheme}://{user}{host}{port}{path}"
            + ("?" + "&".join(f"{k}={v}" for k, v in query) if query else "")
        ),
        st.sampled_from(SCHEMES[:6]),
        st.sampled_from(["", "u:p@", ":s3cret@", "a@b@"]),
        st.sampled_from(["localhost", "127.0.0.1", "[::1]", "[::1", "h,h:1", ""])
        | st.text(max_size=8),
        st.sampled_from(["", ":6379", ":0", ":65536", ":-1", ":x", ",127.0.0.1:7001"]),
        st.sampled_from(["", "/", "/0", "/15", "/x", "/tmp/r.sock", "//"]) | st.text(max_size=6),
        st.lists(
            st.tuples(
                st.sampled_from(URL_PARAMS),
                st.sampled_from(["", "0", "-1", "1.5", "nan", "inf", "16385", "ok", "a b"])
                | st.text(max_size=6),
            ),
            max_size=3,
        ),
    ),
)


@FAST
@given(url=urls)
def test_store_urls_parse_or_raise_invalid_url(url: str) -> None:
    try:
        settings_ = es.StoreSettings.from_url(url)
    except es.InvalidInputError as exc:  # InvalidURLError, or e.g. a bad namespace
        event(type(exc).__name__)
        return
    event("parsed")
    assert es.validate_namespace(settings_.namespace) == settings_.namespace
    assert settings_.partitions is None or 1 <= settings_.partitions <= 16384
    assert 0 < settings_.socket_timeout < float("inf")
    if settings_.scheme != "memory":
        with contextlib.suppress(es.InvalidURLError):
            _redis_client(settings_)  # builds the client; connects to nothing


# -- garbage written straight into a thread's stream -----------------------------------------------

garbage_fields = st.one_of(
    damaged_entry().filter(bool),  # XADD needs at least one field
    st.dictionaries(
        st.sampled_from(sorted(field_values)) | st.binary(max_size=3),
        st.binary(max_size=40),
        min_size=1,
        max_size=8,
    ),
)


async def _damaged_thread(
    store: es.RedisEventStore, fields: dict[bytes, bytes], where: str
) -> tuple[str, str]:
    """A 5-event thread rewritten with ``fields`` at ``where``: ``replace`` puts them at seq 3,
    ``insert`` adds them as entry ``2-7`` between seq 2 and seq 3. Returns (thread, entry id)."""
    thread = "g-" + uuid.uuid4().hex[:10]
    for n in range(5):
        await store.append(
            thread, [es.MessageAppended(message=es.Message(role="user", content=str(n)))]
        )
    rows = await store.read_raw(thread)
    key = store.keys.log(thread)
    await store.client.delete(key)
    entry_id = "3-0" if where == "replace" else "2-7"
    for raw_id, good in rows:
        seq = int(raw_id.split(b"-")[0])
        if where == "insert" and seq == 3:
            await store.client.xadd(key, fields, id=entry_id)
        if where == "replace" and seq == 3:
            await store.client.xadd(key, fields, id=entry_id)
        else:
            await store.client.xadd(key, good, id=raw_id)
    return thread, entry_id


@REDIS
@given(fields=garbage_fields, where=st.sampled_from(["replace", "insert"]))
# A time no clock writes: reads call it damage, so verify must call it undecodable (it said
# "modified", its link broken, and nothing about the time; found by a CI run).
@example(fields={**GOOD_ENTRY, b"s": b"-1"}, where="replace")
@example(fields={**GOOD_ENTRY, b"s": b"99999999999999999999999"}, where="replace")
def test_garbage_in_a_stream_is_a_typed_error_a_reader_can_step_past(
    portal: BlockingPortal, store: es.RedisEventStore, fields: dict[bytes, bytes], where: str
) -> None:

    async def check() -> str:
        thread, entry_id = await _damaged_thread(store, fields, where)
        seen: list[int] = []
        error: es.CorruptEventError | None = None
        try:
            async for recorded in store.read(thread):
                seen.append(recorded.seq)
        except es.CorruptEventError as exc:
            error = exc
        if where == "insert":
            # Never a position of the log: no seq to name, the thread is named.
            assert error is not None and (error.thread_id, error.seq) == (thread, None)
            assert entry_id in str(error) and seen == [1, 2]
            after = [e.seq for e in await read_all(store, thread, start=3)]
            assert after == [3, 4, 5]
        elif error is not None:
            assert (error.thread_id, error.seq) == (thread, 3) and seen == [1, 2]
            assert [e.seq for e in await read_all(store, thread, start=4)] == [4, 5]
        else:  # the garbage happens to decode: it is an event like any other
            assert seen == [1, 2, 3, 4, 5]
        verdict = await Auditor(store).verify(thread)
        assert verdict.thread_id == thread and not verdict.ok
        # It went on past the damage: seq 5 verifies (an entry after garbage whose link names
        # it, seq 4 when the garbage replaced seq 3, is unverifiable, and not counted).
        assert verdict.checked >= 4
        kinds = {(p.seq, p.kind) for p in verdict.problems}
        if where == "replace" and error is not None:
            assert (3, "undecodable") in kinds, verdict
        if where == "insert":
            assert any(kind == "inserted" for _, kind in kinds), verdict
        return f"{where}: {'CorruptEventError' if error else 'decoded'}"

    event(run(portal, check))


@pytest.mark.anyio
async def test_a_reader_steps_past_a_corrupt_seq_and_verify_keeps_going(redis_url: str) -> None:
    async with await es.connect(redis_url, namespace="z" + uuid.uuid4().hex[:12]) as store:
        assert isinstance(store, es.RedisEventStore)
        thread, _ = await _damaged_thread(store, {**GOOD_ENTRY, b"d": b"\xc1junk"}, "replace")
        with pytest.raises(es.CorruptEventError) as info:
            await read_all(store, thread)
        seq = info.value.seq
        assert (info.value.thread_id, seq) == (thread, 3) and seq is not None
        assert f"{thread!r} seq 3" in str(info.value)
        survivors = [e.seq for e in await read_all(store, thread, stop=2)]
        survivors += [e.seq for e in await read_all(store, thread, start=seq + 1)]
        assert survivors == [1, 2, 4, 5]
        verdict = await Auditor(store).verify(thread)
        # Seqs 1, 2, 3 (judged) and 5 count; seq 4's link names the garbled seq 3: unverifiable.
        assert (verdict.first_bad_seq, verdict.kind, verdict.checked) == (3, "undecodable", 4)
        assert [(p.seq, p.kind) for p in verdict.problems] == [(3, "undecodable")]
        # Time travel up to the damage still works; past it, it names the damage.
        assert [m.message.text for m in await Projector(store).last(thread, 6, as_of=2)] == [
            "0",
            "1",
        ]
        with pytest.raises(es.CorruptEventError):
            await Projector(store).last(thread, 6, as_of=4)


# -- size limits hold before anything is sent ------------------------------------------------------

LIMIT = 4096


@pytest.fixture(scope="module")
def quiet_redis() -> Iterator[RedisServer]:
    """A private server: its command counters move only for what this module sends."""
    with redis_server() as server:
        yield server


@pytest.fixture
async def limited(quiet_redis: RedisServer) -> AsyncIterator[es.RedisEventStore]:
    store = await es.connect(
        quiet_redis.url, namespace="z" + uuid.uuid4().hex[:12], max_event_bytes=LIMIT
    )
    assert isinstance(store, es.RedisEventStore)
    try:
        yield store
    finally:
        await store.close()


async def commands_sent(store: es.RedisEventStore) -> Counter[str]:
    """Calls per command since the server started, minus the INFO calls that ask."""
    stats = await store.client.info("commandstats")
    return Counter(
        {
            name.removeprefix("cmdstat_"): int(value["calls"])
            for name, value in stats.items()
            if name != "cmdstat_info"
        }
    )


def msg(text: str) -> es.MessageAppended:
    return es.MessageAppended(message=es.Message(role="user", content=text))


REFUSALS: dict[str, Callable[[es.RedisEventStore], Awaitable[object]]] = {
    "oversized event": lambda s: s.append("t", [msg("x" * LIMIT)]),
    "oversized second event": lambda s: s.append("t", [msg("ok"), msg("x" * LIMIT)]),
    "oversized through a Projector": lambda s: Projector(s).append("t", [msg("x" * LIMIT)]),
    "thread id too long": lambda s: s.append("x" * 257, [msg("ok")]),
    "thread id with a brace": lambda s: s.append("a{b}", [msg("ok")]),
    "idempotency key too long": lambda s: s.append("t", [msg("ok")], idempotency_key="k" * 513),
    "bad expected version": lambda s: s.append("t", [msg("ok")], expected_version=-1),
    "payload failing its schema": lambda s: s.append("t", [es.StateUpdated(block=1, value=0)]),  # type: ignore[arg-type]
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", sorted(REFUSALS))
async def test_refused_input_sends_nothing_to_redis(limited: es.RedisEventStore, case: str) -> None:
    before = await commands_sent(limited)
    with pytest.raises(es.InvalidInputError):
        await REFUSALS[case](limited)
    assert await commands_sent(limited) == before
    await limited.append("t", [msg("fine")])  # and the counters do see an append
    assert (await commands_sent(limited))["evalsha"] == before["evalsha"] + 1


@pytest.mark.anyio
async def test_oversized_jsonl_line_sends_nothing_to_redis(
    limited: es.RedisEventStore, tmp_path: Path
) -> None:
    path = tmp_path / "big.jsonl"
    small = b'{"role":"user","content":"hi"}\n'
    path.write_bytes(small + json.dumps({"role": "user", "content": "x" * LIMIT}).encode() + b"\n")
    sessions = SessionStore(limited)
    before = await commands_sent(limited)
    with pytest.raises(JsonlImportError) as info:
        await import_jsonl(sessions, path, "s")
    assert [e.line for e in info.value.errors] == [2]
    assert "limit" in info.value.errors[0].reason
    assert await commands_sent(limited) == before
    path.write_bytes(small)
    report = await import_jsonl(sessions, path, "s")
    assert report.imported == 1 and (await commands_sent(limited)) != before


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.integers(LIMIT - 64, LIMIT + 64))
def test_the_size_limit_is_exact_and_checked_client_side(
    portal: BlockingPortal, quiet_redis: RedisServer, size: int
) -> None:
    async def check() -> None:
        async with await es.connect(
            quiet_redis.url, namespace="z" + uuid.uuid4().hex[:12], max_event_bytes=LIMIT
        ) as store:
            assert isinstance(store, es.RedisEventStore)
            event = es.StateUpdated(block="b", value=b"\0" * size)
            stored = len(msgspec.msgpack.encode(event))
            before = await commands_sent(store)
            if stored > LIMIT:
                with pytest.raises(es.EventTooLargeError) as info:
                    await store.append("t", [event])
                assert (info.value.size, info.value.limit) == (stored, LIMIT)
                assert await commands_sent(store) == before
            else:
                await store.append("t", [event])
                assert await store.version("t") == 1

    run(portal, check)


# -- the CLI's arguments ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_works() -> bool:
    """True when ``python -m adapters.cli --help`` runs (the CLI may be missing in a checkout)."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "adapters.cli", "--help"],
            cwd=ROOT,
            capture_output=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture(scope="module")
def cli_namespace(redis_url: str) -> str:
    """A namespace with one short conversation in thread ``t1``, for the CLI to chew on."""
    namespace = "fz" + uuid.uuid4().hex[:10]

    async def fill() -> None:
        async with await es.connect(redis_url, namespace=namespace) as store:
            turn = es.new_ulid()
            await Projector(store).append(
                "t1",
                [
                    es.TurnOpened(turn_id=turn, request=es.Message(role="user", content="hi")),
                    es.StateUpdated(block="plan", value={"step": 1}, turn_id=turn),
                    es.TurnSettled(
                        turn_id=turn,
                        outcome="completed",
                        assistant_message=es.Message(role="assistant", content="hello"),
                    ),
                ],
            )

    anyio.run(fill)
    return namespace


argv_text = st.text(no_surrogates.filter(lambda c: c != "\x00"), max_size=16)
cli_values = st.one_of(
    st.just("t1"),  # the thread `cli_namespace` holds
    argv_text,
    st.sampled_from(["0", "-1", "1", "99999999999999999999", "1.5", "now", "2026-01-01T00:00:00"]),
    st.sampled_from(["2026-13-45", "yesterday", "1e9", "--", "-", "{x}", "a\nb", "é😀"]),
)
# Per subcommand: positionals ("?" marks an optional one), options taking a value, flags.
# ``tail`` is left out: it follows a thread until its --limit is reached, by design.
CLI_SPEC: dict[str, tuple[list[str], list[str], list[str]]] = {
    "threads": ([], ["--limit"], ["--json"]),
    "show": (["thread"], ["--as-of", "--window", "--turns"], ["--json"]),
    "replay": (["thread"], ["--from", "--to", "--as-of"], ["--json"]),
    "verify": (["thread?"], [], ["--all", "--json"]),
    "check": (["thread?"], [], ["--all", "--json"]),
    "rebuild": (["thread?"], [], ["--all"]),
    "export": ([], ["--format", "--since", "--name"], ["--json"]),
    "import-jsonl": (["file", "thread"], [], ["--skip-bad"]),
    "export-jsonl": (["thread", "out"], [], []),
}
JUNK = ["--bogus", "-x", "--json=1", "--", "nonsense", "--limit"]


@st.composite
def cli_argv(draw: st.DrawFn) -> tuple[list[str], bytes]:
    """A subcommand with fuzzed positionals and option values (now and then a junk argument or
    an unknown command), and the bytes of a JSONL file it may import."""
    sub = draw(st.sampled_from([*CLI_SPEC, "nonsense"]))
    positionals, options, flags = CLI_SPEC.get(sub, ([], [], []))
    args = [sub]
    for name in positionals:
        if name.endswith("?") and draw(st.booleans()):
            continue
        args.append({"file": "in.jsonl", "out": "out.jsonl"}.get(name) or draw(cli_values))
    if sub == "export":
        args += ["--out", "parts"]
    for option in (
        draw(st.lists(st.sampled_from(options), max_size=2, unique=True)) if options else []
    ):
        args += [option, draw(cli_values)]
    args += draw(st.lists(st.sampled_from(flags), max_size=2, unique=True)) if flags else []
    if draw(st.integers(0, 9)) == 0:
        args.insert(draw(st.integers(1, len(args))), draw(st.sampled_from(JUNK)))
    lines = draw(st.lists(message_lines(big_ints=False), max_size=3))
    return args, b"\n".join(lines)


@pytest.mark.slow
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=cli_argv(), bad_namespace=st.none() | st.sampled_from(["bad ns", "a{b}"]) | argv_text)
def test_cli_arguments_never_crash(
    cli_works: bool,
    cli_namespace: str,
    redis_url: str,
    tmp_path: Path,
    case: tuple[list[str], bytes],
    bad_namespace: str | None,
) -> None:
    if not cli_works:
        pytest.skip("adapters.cli is not available")
    namespace = cli_namespace if bad_namespace is None else bad_namespace
    args, jsonl = case
    work = tmp_path / uuid.uuid4().hex[:8]
    work.mkdir()
    (work / "in.jsonl").write_bytes(jsonl)  # relative paths in ``args`` resolve in ``work``
    env = {k: v for k, v in os.environ.items() if not k.startswith("THREADLOG_")}
    # memory:// as the fallback: no run may start the embedded server by accident.
    env.update(THREADLOG_URL="memory://", PYTHONPATH=str(ROOT), COLUMNS="120")
    argv = [sys.executable, "-m", "adapters.cli", "--url", redis_url]
    argv += ["--namespace", namespace, *args]
    done = subprocess.run(
        argv, cwd=work, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    event(f"exit {done.returncode}")
    assert done.returncode in {0, 1, 2}, (argv, done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, (argv, done.stderr[-2000:])
    if done.returncode == 2:
        assert done.stderr.strip(), argv
    assert not (work / ".threadlog").exists()


# -- regressions: bugs this fuzzing found, fixed ------------------------------------------------


@pytest.mark.anyio
async def test_payload_type_that_is_a_list_is_corrupt_not_a_type_error(redis_url: str) -> None:
    async with await es.connect(redis_url, namespace="z" + uuid.uuid4().hex[:12]) as store:
        assert isinstance(store, es.RedisEventStore)
        garbage = {**GOOD_ENTRY, b"d": msgspec.msgpack.encode({"type": [1]})}
        thread, _ = await _damaged_thread(store, garbage, "replace")
        with pytest.raises(es.CorruptEventError):
            await read_all(store, thread)


def test_jsonl_int_beyond_64_bits_is_a_reported_line() -> None:
    messages, errors = parse_jsonl(
        b'{"role":"user","content":"x","n":18446744073709551616}\n', max_message_bytes=1 << 20
    )
    assert (len(messages), len(errors)) in {(0, 1), (1, 0)}


def test_str_with_a_lone_surrogate_is_a_format_error() -> None:
    with pytest.raises(es.MessageFormatError):
        es.Message.from_json_bytes('{"role":"user","content":"\ud800"}')


def test_failing_upcaster_is_a_corrupt_event() -> None:
    registry = es.EventRegistry()

    class NoteV2(es.Event, tag="fuzz.note", frozen=True):
        body: str

    registry.register(NoteV2, version=2, upcasters={1: lambda raw: {"body": raw["text"]}})
    with pytest.raises(es.CorruptEventError):
        decode_entry(
            "t",
            b"1-0",
            {**GOOD_ENTRY, b"v": b"1", b"d": msgspec.msgpack.encode({"type": "fuzz.note"})},
            registry,
        )


@pytest.mark.parametrize("entry_id", ["²-0", b"1" * 5000 + b"-0"], ids=["superscript", "huge"])
def test_entry_ids_int_cannot_parse_are_corrupt(entry_id: str | bytes) -> None:
    with pytest.raises(es.CorruptEventError):
        decode_entry("t", entry_id, GOOD_ENTRY, es.registry)
