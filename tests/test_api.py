"""The public surface: pinned names, the exception hierarchy, and the Redis key layout."""

from __future__ import annotations

import fnmatch
import inspect
import pickle
from collections.abc import Callable, Iterator
from fnmatch import fnmatchcase
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis import exceptions as rex
from redis.crc import key_slot

import eventstore
from eventstore import (
    ANY,
    NO_THREAD,
    ConcurrencyError,
    CorruptEventError,
    EventStoreError,
    EventTooLargeError,
    IdempotencyKeyReusedError,
    InvalidInputError,
    InvalidThreadIdError,
    KeyLayout,
    OperationalError,
    StoreConnectionError,
    StoreTimeoutError,
    ViewConflictError,
    acl_key_pattern,
    partition_of,
    translate_redis_error,
    validate_thread_id,
)
from eventstore._keys import key_pattern

# Adding or removing a public name is a decision: make it here too.
PUBLIC_NAMES = [
    "ACL_COMMANDS",
    "ACL_READ_COMMANDS",
    "ANY",
    "AppendResult",
    "ChainHead",
    "ChainKeyMismatchError",
    "CheckpointedState",
    "ConcurrencyError",
    "ConflictError",
    "ConnectTimeoutError",
    "CorruptEventError",
    "CorruptKeyError",
    "DEFAULT_PARTITIONS",
    "EXISTS",
    "Event",
    "EventMeta",
    "EventRegistry",
    "EventStore",
    "EventStoreError",
    "EventTooLargeError",
    "EventValidationError",
    "ExpectedVersion",
    "Fallback",
    "FeedEntry",
    "FeedGroupNotFoundError",
    "FeedInfo",
    "FeedResetError",
    "FeedTrimmedError",
    "FilePart",
    "Grant",
    "GroupCommit",
    "GroupInfo",
    "HashDelete",
    "HashGet",
    "HashGetAll",
    "HashGetListed",
    "HashLoad",
    "HashSet",
    "IdempotencyKeyReusedError",
    "ImagePart",
    "IncarnationConflictError",
    "InvalidInputError",
    "InvalidNamespaceError",
    "InvalidThreadIdError",
    "InvalidURLError",
    "KeyLayout",
    "ListLoad",
    "ListPop",
    "ListPush",
    "ListRange",
    "ListReset",
    "MemoryEventStore",
    "MemoryServer",
    "Message",
    "MessageAppended",
    "MessageFormatError",
    "MetaSnapshot",
    "NO_THREAD",
    "NewEvent",
    "OUTCOMES",
    "OperationalError",
    "OtherPart",
    "Outcome",
    "Part",
    "PayloadRow",
    "ROLES",
    "RawRange",
    "ReasoningPart",
    "RecordedEvent",
    "RedisEventStore",
    "Role",
    "StateUpdated",
    "StoreClosedError",
    "StoreConnectionError",
    "StoreSettings",
    "StoreTimeoutError",
    "StreamState",
    "TextPart",
    "ThreadInfo",
    "ThreadReplacedError",
    "Timing",
    "ToolCallPart",
    "ToolResultPart",
    "TranscriptAppended",
    "TranscriptReplaced",
    "TurnError",
    "TurnOpened",
    "TurnSettled",
    "UnknownEventTypeError",
    "UnsafeServerError",
    "UnstampedViewError",
    "Usage",
    "ViewClear",
    "ViewConflictError",
    "ViewEntry",
    "ViewOp",
    "ViewRead",
    "ViewResult",
    "ViewSnapshot",
    "WrongKeyTypeError",
    "acl_key_pattern",
    "acl_rules",
    "chain_link",
    "check_json_message",
    "connect",
    "content_digest",
    "embedded_url",
    "entry_digest",
    "event_id_text",
    "json_value_problem",
    "namespace_chain_key",
    "new_ulid",
    "open_store",
    "partition_of",
    "redact",
    "register_event",
    "registry",
    "stop_embedded",
    "translate_redis_error",
    "validate_consumer",
    "validate_count",
    "validate_group",
    "validate_limit",
    "validate_namespace",
    "validate_thread_id",
    "validate_view_name",
    "version_satisfies",
]


# -- names ------------------------------------------------------------------------------------


def test_all_is_pinned() -> None:
    assert sorted(PUBLIC_NAMES) == PUBLIC_NAMES
    assert len(eventstore.__all__) == len(set(eventstore.__all__)), "duplicates in __all__"
    assert sorted(eventstore.__all__) == PUBLIC_NAMES


def test_every_public_name_exists() -> None:
    missing = [name for name in eventstore.__all__ if not hasattr(eventstore, name)]
    assert missing == []


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, Any] = {}
    exec("from eventstore import *", namespace)  # the one way to exercise a star import
    assert sorted(k for k in namespace if k != "__builtins__") == PUBLIC_NAMES


# -- exceptions -------------------------------------------------------------------------------


def _public_exceptions() -> list[type[BaseException]]:
    out = []
    for name in eventstore.__all__:
        obj = getattr(eventstore, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            out.append(obj)
    return out


EXCEPTIONS = _public_exceptions()


def test_there_are_public_exceptions() -> None:
    assert EventStoreError in EXCEPTIONS and len(EXCEPTIONS) > 10


@pytest.mark.parametrize("cls", EXCEPTIONS, ids=lambda c: c.__name__)
def test_exception_has_root_and_docstring(cls: type[BaseException]) -> None:
    assert issubclass(cls, EventStoreError)
    doc = cls.__doc__ or ""
    assert doc.startswith("Raised when"), f"{cls.__name__}: {doc!r}"


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (StoreConnectionError, ConnectionError),
        (StoreTimeoutError, TimeoutError),
        (InvalidInputError, ValueError),
        (InvalidThreadIdError, ValueError),
        (StoreConnectionError, OperationalError),
        (StoreTimeoutError, OperationalError),
    ],
)
def test_exceptions_subclass_the_fitting_builtin(
    cls: type[BaseException], builtin: type[BaseException]
) -> None:
    assert issubclass(cls, builtin)


def test_operational_and_conflict_branches_are_separate() -> None:
    assert not issubclass(ConcurrencyError, OperationalError)
    assert not issubclass(OperationalError, InvalidInputError)
    assert not issubclass(ConcurrencyError, ValueError)


def _sample(cls: type[BaseException]) -> BaseException:
    """An instance of ``cls`` with every attribute its constructor takes."""
    samples: dict[type[BaseException], Callable[[], BaseException]] = {
        ConcurrencyError: lambda: ConcurrencyError("t:1", NO_THREAD, 3),
        IdempotencyKeyReusedError: lambda: IdempotencyKeyReusedError("t", "req-1"),
        eventstore.FeedGroupNotFoundError: lambda: eventstore.FeedGroupNotFoundError(3, "g"),
        eventstore.FeedResetError: lambda: eventstore.FeedResetError(
            3, "projection 'usage'", "5-0"
        ),
        eventstore.FeedTrimmedError: lambda: eventstore.FeedTrimmedError(
            3, "projection 'usage'", "5-0", "9-1"
        ),
        eventstore.ChainKeyMismatchError: lambda: eventstore.ChainKeyMismatchError(
            "t", True, False
        ),
        ViewConflictError: lambda: ViewConflictError("t", "state", "field", 1, 2),
        eventstore.IncarnationConflictError: lambda: eventstore.IncarnationConflictError(
            "t", 3, 3, 1_700_000_000_000_001, 1_700_000_000_000_002
        ),
        eventstore.ThreadReplacedError: lambda: eventstore.ThreadReplacedError("t"),
        EventTooLargeError: lambda: EventTooLargeError("t", 2_000_000, 1_048_576, 3),
        CorruptEventError: lambda: CorruptEventError("t", 12, "unknown", unknown_type=True),
        eventstore.ConnectTimeoutError: lambda: eventstore.ConnectTimeoutError(
            "rediss://:***@h:6380/0", 5.0, " (hint)"
        ),
        eventstore.CorruptKeyError: lambda: eventstore.CorruptKeyError(
            "tl:{ns:cfg}", "its partition count is b'abc'"
        ),
        eventstore.UnsafeServerError: lambda: eventstore.UnsafeServerError(
            "unix:///tmp/r.sock", "allkeys-lru"
        ),
        eventstore.UnstampedViewError: lambda: eventstore.UnstampedViewError(
            "t", "messages", "no stamp"
        ),
    }
    make = samples.get(cls)
    if make is not None:
        return make()
    # Every other exception takes just a message; a new one with attributes needs a sample.
    own_init = [k for k in cls.__mro__ if "__init__" in vars(k) and k.__module__ != "builtins"]
    assert own_init == [], f"{cls.__name__} takes attributes: add a sample for it"
    return cls(f"something about {cls.__name__}")


@pytest.mark.parametrize("cls", EXCEPTIONS, ids=lambda c: c.__name__)
def test_exceptions_pickle_with_their_attributes(cls: type[BaseException]) -> None:
    exc = _sample(cls)
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is cls
    assert str(again) == str(exc)
    assert again.args == exc.args
    assert vars(again) == vars(exc)


def test_incarnation_conflict_is_a_concurrency_error_with_its_lives() -> None:
    exc = pickle.loads(pickle.dumps(eventstore.IncarnationConflictError("t", 3, 0, 17, None)))
    assert isinstance(exc, eventstore.IncarnationConflictError)
    assert isinstance(exc, ConcurrencyError)
    assert (exc.thread_id, exc.expected, exc.actual) == ("t", 3, 0)
    assert (exc.expected_incarnation, exc.actual_incarnation) == (17, None)
    assert "no longer exists" in str(exc)


def test_a_connection_error_from_a_timeout_is_a_timeout() -> None:
    # redis-py's words when a reconnect's handshake times out, its retries spent.
    late = rex.ConnectionError("Timeout reading from /tmp/r.sock")
    late.__cause__ = rex.TimeoutError("Timeout reading from /tmp/r.sock")
    assert type(translate_redis_error(late)) is StoreTimeoutError
    refused = rex.ConnectionError("Error 111 connecting")
    refused.__cause__ = ConnectionRefusedError(111, "refused")
    assert type(translate_redis_error(refused)) is StoreConnectionError


def test_concurrency_error_keeps_expected_and_actual() -> None:
    exc = pickle.loads(pickle.dumps(ConcurrencyError("t", ANY, 7)))
    assert isinstance(exc, ConcurrencyError)
    assert (exc.thread_id, exc.expected, exc.actual) == ("t", ANY, 7)
    assert exc.expected is ANY


@pytest.mark.parametrize(
    ("raised", "translated"),
    [
        (rex.TimeoutError("slow"), StoreTimeoutError),
        (rex.ConnectionError("refused"), StoreConnectionError),
        (rex.AuthenticationError("bad password"), StoreConnectionError),
        (rex.BusyLoadingError("loading"), StoreConnectionError),
        (ConnectionResetError("reset"), StoreConnectionError),
        (TimeoutError("os timeout"), StoreTimeoutError),
        (rex.NoPermissionError("acl"), OperationalError),
        (rex.ResponseError("ERR something"), OperationalError),
        (rex.RedisClusterException("cannot be connected"), OperationalError),
    ],
)
def test_redis_errors_translate_one_to_one(
    raised: BaseException, translated: type[EventStoreError]
) -> None:
    exc = translate_redis_error(raised)
    assert type(exc) is translated


# -- key layout -------------------------------------------------------------------------------

KEY_KINDS = ["log", "meta", "view", "feed", "threads", "ckpt", "aux", "auxnames", "cfg"]
# Ids built from key-name parts on purpose: "log:b" and "b:meta" would collide if the thread
# id did not come last in every key.
THREADS = [
    *(f"{k}:{base}" for k in KEY_KINDS for base in ("b", "x:y")),
    *(f"{base}:{k}" for k in KEY_KINDS for base in ("b", "x:y")),
    *KEY_KINDS,
    "b",
    "x:y",
    "view:l:b",
    "aux:p:h",
    ":",
    "::",
    ":b",
    "b:",
    "sp ace",
    "é",
    "emoji-😀",
    "*",
    "?",
    "[a]",
    "tl:(ns:0):log:a",
]
VIEWS = ["l", "x", "log", "a.b", "y"]
AUX = [("p", "h"), ("p.q", "h"), ("n", "h")]
NAMESPACES = ["a", "ab", "a.b", "A", "x-1", "x", "a_b", "default", "n.s-9"]


def _key_functions(layout: KeyLayout) -> Iterator[tuple[str, Callable[..., Any], list[str]]]:
    for name, fn in inspect.getmembers(layout, inspect.ismethod):
        sig = inspect.signature(fn)
        if name.startswith("_") or sig.return_annotation not in ("str", str):
            continue
        yield name, fn, list(sig.parameters)


def _keys_by_owner(
    layout: KeyLayout, threads: list[str], views: list[str]
) -> dict[str, tuple[Any, ...]]:
    """Every key the layout builds for these threads (and all partitions), by its owner."""
    out: dict[str, tuple[Any, ...]] = {}

    def add(key: str, owner: tuple[Any, ...]) -> None:
        assert key not in out or out[key] == owner, f"{key!r}: {out[key]} vs {owner}"
        out[key] = owner

    for name, fn, params in _key_functions(layout):
        if params == ["thread_id"]:
            for t in threads:
                add(fn(t), ("thread", t, name))
        elif params == ["thread_id", "view"]:
            for t in threads:
                for v in views:
                    add(fn(t, v), ("thread", t, name, v))
        elif params == ["thread_id", "token", "n"]:
            for t in threads:
                for token, index in (("a1b2", 0), ("a1b2", 1), ("a1", 10)):
                    add(fn(t, token, index), ("thread", t, name, token, index))
        elif params == ["partition"]:
            for p in range(layout.partitions):
                add(fn(p), ("partition", p, name))
        elif params == ["partition", "name", "hash_name"]:
            for p in range(layout.partitions):
                for n, h in AUX:
                    add(fn(p, n, h), ("partition", p, name, n, h))
        elif params == ["partition", "name"]:
            for p in range(layout.partitions):
                for n in dict.fromkeys(n for n, _ in AUX):
                    add(fn(p, n), ("partition", p, name, n))
        elif params == ["namespace"]:
            add(fn(layout.namespace), ("namespace", name))
        else:
            pytest.fail(f"KeyLayout.{name}{params}: teach this test about the new key")
    return out


def _hash_tag(key: str) -> str:
    start = key.index("{")
    return key[start + 1 : key.index("}", start)]


@pytest.mark.parametrize("partitions", [1, 3, 16])
def test_thread_keys_share_the_partition_tag_and_slot(partitions: int) -> None:
    layout = KeyLayout("ns", partitions)
    keys = _keys_by_owner(layout, THREADS, VIEWS)
    assert {owner[2] for owner in keys.values() if owner[0] == "thread"} >= {
        "log",
        "meta",
        "view",
    }
    for t in THREADS:
        p = partition_of(t, partitions)
        assert layout.partition(t) == p
        mine = [k for k, owner in keys.items() if owner[0] == "thread" and owner[1] == t]
        mine += [k for k, owner in keys.items() if owner[0] == "partition" and owner[1] == p]
        mine += layout.thread_keys(t)
        for key in mine:
            assert f"{{ns:{p}}}" in key
            assert _hash_tag(key) == f"ns:{p}"
        slots = {key_slot(k.encode("utf-8")) for k in mine}
        assert len(slots) == 1, (t, slots)


@pytest.mark.parametrize("partitions", [1, 3, 16])
def test_thread_of_names_the_thread_of_its_log_and_meta_keys_only(partitions: int) -> None:
    layout = KeyLayout("ns", partitions)
    keys = _keys_by_owner(layout, THREADS, VIEWS)
    for key, owner in keys.items():
        expected = owner[1] if owner[0] == "thread" and owner[2] in ("log", "meta") else None
        assert layout.thread_of(key) == expected, key
        assert layout.thread_of(key.encode("utf-8")) == expected
        assert fnmatch.fnmatchcase(key, key_pattern("ns"))
        assert not fnmatch.fnmatchcase(key, key_pattern("n"))
    # Keys no store of this layout writes name no thread.
    other = KeyLayout("other", partitions)
    assert other.thread_of(layout.log(THREADS[0])) is None
    wrong = next(p for p in range(partitions + 1) if p != layout.partition(THREADS[0]))
    assert layout.thread_of(f"tl:{{ns:{wrong}}}:log:{THREADS[0]}") is None
    assert layout.thread_of(b"tl:{ns:0}:log:\xff") is None
    assert layout.thread_of("tl:{ns:cfg}") is None


def test_thread_keys_tuple_matches_the_key_functions() -> None:
    layout = KeyLayout("ns", 8)
    for t in THREADS:
        p = layout.partition(t)
        assert layout.thread_keys(t) == (
            layout.log(t),
            layout.meta(t),
            layout.feed(p),
            layout.index(p),
        )


@pytest.mark.parametrize("partitions", [1, 16])
def test_no_two_owners_share_a_key(partitions: int) -> None:
    # _keys_by_owner fails on the first key two owners would share.
    keys = _keys_by_owner(KeyLayout("ns", partitions), THREADS, VIEWS)
    assert len(keys) >= len(THREADS) * (3 + len(VIEWS))


valid_thread_ids = st.text(min_size=1, max_size=40).filter(
    lambda t: "{" not in t and "}" not in t and all(c >= " " and c != "\x7f" for c in t)
)
view_names = st.text(alphabet="abcxyz._-019", min_size=1, max_size=8)


@given(
    st.lists(valid_thread_ids, min_size=2, max_size=4, unique=True),
    st.lists(view_names, min_size=1, max_size=3, unique=True),
)
def test_no_key_collisions_for_any_thread_ids(threads: list[str], views: list[str]) -> None:
    for t in threads:
        validate_thread_id(t)
    _keys_by_owner(KeyLayout("ns", 1), threads, views)


def test_config_key_is_in_its_namespace() -> None:
    key = KeyLayout.config_key("ns")
    assert fnmatchcase(key, acl_key_pattern("ns")[1:])
    assert not fnmatchcase(key, acl_key_pattern("n")[1:])


def _acl_glob(namespace: str) -> str:
    pattern = acl_key_pattern(namespace)
    assert pattern.startswith("~")
    return pattern[1:]


@pytest.mark.parametrize("a", NAMESPACES)
def test_acl_pattern_covers_exactly_one_namespace(a: str) -> None:
    keys = list(_keys_by_owner(KeyLayout(a, 4), THREADS, VIEWS))
    assert all(fnmatchcase(k, _acl_glob(a)) for k in keys)
    for b in NAMESPACES:
        if b != a:
            leaked = [k for k in keys if fnmatchcase(k, _acl_glob(b))]
            assert leaked == [], f"keys of {a!r} match the pattern of {b!r}"


namespaces = st.text(
    alphabet="abcAB019._-",
    min_size=1,
    max_size=6,
)


@given(namespaces, namespaces, st.sampled_from(THREADS))
def test_acl_patterns_never_overlap(a: str, b: str, thread: str) -> None:
    layout = KeyLayout(a, 2)
    keys = [*layout.thread_keys(thread), layout.view(thread, "v"), KeyLayout.config_key(a)]
    for key in keys:
        assert fnmatchcase(key, _acl_glob(a))
        assert fnmatchcase(key, _acl_glob(b)) == (a == b)
