"""Tenant isolation, TLS, and secrets kept out of errors and logs, on dedicated redis-servers.

Namespaces are tenants. Every key of namespace ``ns`` starts with ``tl:{ns:``, so a Redis ACL
user with the key pattern `eventstore.acl_key_pattern` (``~tl:{ns:*``) and the commands in
`TENANT_COMMANDS` can run a whole store and nothing else: the event-store conformance suite runs
here as such a user, one user per test namespace. Above Redis, the adapters' `TenantPolicy`
refuses a principal of another tenant before any command is sent.
"""

from __future__ import annotations

import logging
import re
import secrets
import traceback
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from redis.asyncio.connection import SSLConnection

import eventstore as es
from adapters import AccessDenied, Auditor, Principal, SessionStore, TenantPolicy, ThreadStore
from eventstore import (
    EventStore,
    KeyLayout,
    OperationalError,
    RedisEventStore,
    StoreConnectionError,
    acl_key_pattern,
    open_store,
)
from eventstore._connect import StoreSettings, redact
from eventstore.servers import RedisServer, RedisServerError, TlsFiles, redis_server
from eventstore.testing import EventStoreConformance, msg, read_all
from projections import ProjectionRunner, Projector, UsageProjection
from tests._redis_hooks import RedisHooks
from tests.test_cli import Run, assert_one_line_error, cli, with_store

pytestmark = pytest.mark.anyio

# What a tenant's user needs, and all it gets. Redis checks ACLs for the commands a Lua script
# calls too, so the list is the client's own commands plus those the scripts in eventstore/lua
# call. Nothing administrative: no SCRIPT, no KEYS/SCAN, no FLUSH*, no CONFIG, no pub/sub.
TENANT_COMMANDS = es.ACL_COMMANDS


def tenant_rules(namespace: str, password: str) -> list[str]:
    """``ACL SETUSER`` rules confining a user to ``namespace`` and `TENANT_COMMANDS`."""
    return [
        "reset", "on", f">{password}", acl_key_pattern(namespace), "resetchannels",
        "-@all", *TENANT_COMMANDS,
    ]  # fmt: skip


def admin(server: RedisServer) -> redis.Redis:
    """The default (unrestricted) user, over the server's unix socket or loopback port."""
    if server.unix_socket is not None:
        return redis.Redis(unix_socket_path=str(server.unix_socket), socket_timeout=5)
    return redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)


def add_tenant(server: RedisServer, namespace: str) -> tuple[str, str]:
    """Create the ACL user of tenant ``namespace``; returns (user, password)."""
    user, password = f"tenant-{namespace}", secrets.token_urlsafe(18)
    with admin(server) as c:
        c.execute_command("ACL", "SETUSER", user, *tenant_rules(namespace, password))
    return user, password


def tenant_url(server: RedisServer, user: str, password: str) -> str:
    return f"redis://{quote(user)}:{quote(password)}@127.0.0.1:{server.port}"


def key_dump(server: RedisServer, namespace: str) -> dict[bytes, bytes | None]:
    """Every key of ``namespace`` with its serialized value, as the admin sees them."""
    with admin(server) as c:
        keys = sorted(c.scan_iter(match=f"tl:{{{namespace}:*", count=1000))
        return {k: c.dump(k) for k in keys}


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    """A private redis-server on a loopback port, where each test adds its tenants' users."""
    try:
        with redis_server(unix=False) as server:
            yield server
    except RedisServerError as exc:
        pytest.fail(f"no redis-server for the security tests: {exc}")


def new_namespace() -> str:
    return "ten" + uuid.uuid4().hex[:10]


# -- the whole event-store contract, as a tenant's confined user ------------------------------


class TestTenantConfinedEventStore(RedisHooks, EventStoreConformance):
    """Every inherited test as the ACL user of its namespace: every key the store touches lies
    under the tenant's pattern, and `TENANT_COMMANDS` is enough for every operation (but
    `stored_threads`: SCAN is not confined to a key pattern, so tenants are not granted it)."""

    may_scan = False

    @pytest.fixture(autouse=True)
    def _server(self, acl_server: RedisServer) -> None:
        self.server = acl_server
        self.users: dict[str, tuple[str, str]] = {}

    async def make_store(self, namespace: str, **options: Any) -> EventStore:
        if namespace not in self.users:
            self.users[namespace] = add_tenant(self.server, namespace)
        url = tenant_url(self.server, *self.users[namespace])
        registry = options.pop("registry", None)
        store = await open_store(
            StoreSettings.from_url(url, namespace=namespace, **options), registry=registry
        )
        with admin(self.server) as c:
            users = {line["user"] for line in c.client_list()}
        assert self.users[namespace][0] in users, "the store is not connected as the tenant"
        return store

    async def flush_scripts(self, store: EventStore) -> None:
        with admin(self.server) as c:  # SCRIPT FLUSH is not the tenant's to run
            c.script_flush()


# -- isolation at the Redis level -------------------------------------------------------------


def assert_no_secret(text: str, *secrets_: str) -> None:
    for secret in secrets_:
        assert secret not in text, f"a secret leaked into: {text[:300]!r}"


def rendered(exc: BaseException) -> str:
    """Everything an exception can show: str, repr, the printed traceback and its whole chain."""
    parts = ["".join(traceback.format_exception(exc))]
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts += [str(current), repr(current)]
        current = current.__cause__ or current.__context__
    return "\n".join(parts)


def logged(caplog: pytest.LogCaptureFixture) -> str:
    """Every captured log record, formatted with its traceback if it has one."""
    formatter = logging.Formatter()
    return "\n".join(formatter.format(record) for record in caplog.records)


async def test_a_tenant_user_can_neither_read_nor_write_another_tenants_keys(
    acl_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    a = new_namespace()
    b = a + "-2"  # B's name extends A's: the pattern must not reach B by prefix
    user_a, password_a = add_tenant(acl_server, a)
    user_b, password_b = add_tenant(acl_server, b)
    url_a = tenant_url(acl_server, user_a, password_a)

    async with await es.connect(tenant_url(acl_server, user_b, password_b), namespace=b) as store_b:
        await Projector(store_b).append("t", [msg("b's secret")])
        assert isinstance(store_b, RedisEventStore)
        await store_b.create_feed_group(store_b.keys.partition("t"), "export")
        layout_b = store_b.keys
    before = key_dump(acl_server, b)
    assert before, "tenant B wrote nothing"

    async with await es.connect(url_a, namespace=a) as store_a:
        assert isinstance(store_a, RedisEventStore)
        await Projector(store_a).append("t", [msg("a's own")])  # its own tenant: fine
        client: Any = store_a.client
        p = layout_b.partition("t")
        log_b, meta_b = layout_b.log("t"), layout_b.meta("t")
        view_b, feed_b, index_b = (
            layout_b.view("t", "messages"),
            layout_b.feed(p),
            layout_b.index(p),
        )
        config_b = KeyLayout.config_key(b)
        a_key = store_a.keys.meta("t")
        attempts: list[Any] = [
            client.xrange(log_b),
            client.hgetall(meta_b),
            client.lrange(view_b, 0, -1),
            client.xrange(feed_b),
            client.zrevrangebyscore(index_b, "+inf", "-inf"),
            client.hget(config_b, "partitions"),
            client.xreadgroup("export", "a", {feed_b: ">"}),
            client.xadd(log_b, {b"d": b"forged"}, id="99-0"),
            client.hset(meta_b, "v", "99"),
            client.delete(log_b),
            client.hsetnx(config_b, "partitions", "1"),
            client.xgroup_create(feed_b, "spy", "0-0", mkstream=True),
            client.rpush(view_b, b"forged"),
            # A script declaring B's key, and one declaring only A's key but touching B's.
            client.eval("return redis.call('XRANGE', KEYS[1], '-', '+')", 1, log_b),
            client.eval("return redis.call('DEL', ARGV[1])", 1, a_key, log_b),
        ]
        for attempt in attempts:
            with pytest.raises(redis.ResponseError) as denied:
                await attempt
            # NOPERM before a command runs; a script's own call fails with ACL's wording for it.
            text = str(denied.value).lower()
            assert "no permissions" in text or "can't access" in text, text

        # Through the store API on B's namespace: typed errors that name the ACL.
        spy = RedisEventStore(client, namespace=b, owns_client=False)
        spy_calls: list[Any] = [
            spy.append("t", [msg("forged")]),
            read_all(spy, "t"),
            spy.version("t"),
            spy.threads(),
            spy.read_feed(p),
            spy.delete_thread("t"),
            Projector(spy).last("t"),
        ]
        for call in spy_calls:
            with pytest.raises(OperationalError) as info:
                await call
            assert "ACL" in str(info.value)
            assert_no_secret(rendered(info.value), password_a, password_b)

    # Opening B's namespace with A's user fails, typed, and says why without the password.
    with pytest.raises(StoreConnectionError) as refused:
        await es.connect(url_a, namespace=b)
    assert "ACL" in str(refused.value) and redact(url_a) in str(refused.value)
    assert_no_secret(rendered(refused.value), password_a, url_a)
    assert_no_secret(logged(caplog), password_a, password_b, url_a)

    assert key_dump(acl_server, b) == before  # B's keys: byte for byte as they were


async def test_a_read_only_auditor_can_verify_check_and_read_but_not_write(
    acl_server: RedisServer,
) -> None:
    """An auditor's user may only read (and run the read scripts): connecting must not need a
    write, and every audit works; a write is refused by Redis and changes nothing."""
    namespace = new_namespace()
    user, password = add_tenant(acl_server, namespace)
    writer = await open_store(
        StoreSettings.from_url(tenant_url(acl_server, user, password), namespace=namespace)
    )
    async with writer:
        await ThreadStore(writer).append_message("t", {"role": "user", "content": "hi"})
    empty = new_namespace()  # never written: connecting must not need to record it

    def auditor_of(ns: str) -> str:
        user, password = f"auditor-{ns}", secrets.token_urlsafe(18)
        with admin(acl_server) as c:
            rules = es.acl_rules(ns, read_only=True)
            c.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", *rules)
        return tenant_url(acl_server, user, password)

    before = key_dump(acl_server, namespace)
    async with await es.connect(auditor_of(empty), namespace=empty) as store:
        assert await store.threads() == []
    assert key_dump(acl_server, empty) == {}
    async with await es.connect(auditor_of(namespace), namespace=namespace) as store:
        assert isinstance(store, RedisEventStore)
        assert (await Auditor(store).verify("t")).ok
        assert (await Projector(store).check("t")).ok
        assert [m.message.text for m in await ThreadStore(store).list_messages("t")] == ["hi"]
        with pytest.raises(OperationalError, match=r"can.t run this command|denied"):
            await store.append("t", [msg("forged")])
    assert key_dump(acl_server, namespace) == before


async def test_access_policy_refuses_other_tenants_before_redis_is_asked(
    acl_server: RedisServer,
) -> None:
    a, b = new_namespace(), new_namespace()
    async with await es.connect(
        tenant_url(acl_server, *add_tenant(acl_server, a)), namespace=a
    ) as store:
        policy = TenantPolicy()
        threads, sessions = ThreadStore(store, policy=policy), SessionStore(store, policy=policy)
        alice, mallory = Principal(id="alice", tenant=a), Principal(id="mallory", tenant=b)
        await threads.append_message("t", es.Message(role="user", content="hi"), principal=alice)
        with admin(acl_server) as c:
            processed = int(c.info("stats")["total_commands_processed"])
            calls: list[Any] = [
                threads.list_messages("t", principal=mallory),
                threads.append_message(
                    "t", es.Message(role="user", content="x"), principal=mallory
                ),
                threads.state("t", principal=mallory),
                threads.records("t", principal=mallory),
                threads.records(principal=mallory),
                threads.open_turn("t", principal=mallory),
                sessions.load("t", principal=mallory),
                sessions.append("t", [es.Message(role="user", content="x")], principal=mallory),
                threads.list_messages("t"),  # no principal at all
            ]
            for call in calls:
                with pytest.raises(AccessDenied):
                    await call
            # Only the INFO above ran in between: the policy decided before any command.
            assert int(c.info("stats")["total_commands_processed"]) == processed + 1
        assert await store.version("t") == 1
        assert len(await threads.list_messages("t", principal=alice)) == 1


# -- the threadlog command as a tenant's users ---------------------------------------------------


def _recorded_demo(url: str, namespace: str) -> str:
    """Run ``threadlog demo`` as the given user; the thread it recorded."""
    run = cli("demo", url=url, namespace=namespace)
    assert run.code == 0, run
    found = re.search(r"thread\s+(demo-[0-9A-Z]+)", run.out)
    assert found is not None, run.out
    return found.group(1)


def test_every_command_runs_as_a_tenant_user_made_as_documented(
    acl_server: RedisServer, tmp_path: Path
) -> None:
    """docs/scaling.md: a user made with `acl_rules(ns)` runs the whole store. Every command of
    the README runs as that user; the namespace-wide audits alone need SCAN, which the rules
    leave out, and say so in one line (exit 2) rather than audit the index alone."""
    namespace = new_namespace()
    url = tenant_url(acl_server, *add_tenant(acl_server, namespace))
    thread = _recorded_demo(url, namespace)

    async def run_a_projection(store: EventStore) -> None:  # for forget-projection to find
        await ProjectionRunner(store, UsageProjection(), consumer="c").run_once()

    with_store(url, namespace, run_a_projection)  # as the tenant's user
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text('{"role":"user","content":"hi"}\n{"role":"assistant","content":"yo"}\n')
    for argv in (
        ["threads"],
        ["threads", "--json"],
        ["show", thread],
        ["show", thread, "--as-of", "5"],
        ["replay", thread],
        ["tail", "--since", "1h", "--limit", "3"],
        ["verify", thread],
        ["check", thread],
        ["rebuild", thread],
        ["feed"],
        ["export", "--format", "ndjson", "--out", str(tmp_path / "out"), "--name", "a"],
        ["export", "--format", "ndjson", "--out", str(tmp_path / "out-b"), "--name", "b"],
        ["trim-feed"],
        ["drop-group", "export-a"],
        ["forget-projection", "usage"],
        ["import-jsonl", str(jsonl), "s1"],
        ["export-jsonl", "s1", str(tmp_path / "back.jsonl")],
    ):
        run = cli(*argv, url=url, namespace=namespace)
        assert run.code == 0, run
    assert (tmp_path / "back.jsonl").read_text() == jsonl.read_text()
    for command in ("verify", "check", "rebuild"):
        run = cli(command, "--all", url=url, namespace=namespace)
        assert run.code == 0, run
        assert "of the thread index" in run.out and "may not SCAN" in run.err, run
        # ... and --help says so before anyone runs it.
        assert "+scan" in " ".join(cli(command, "--help").out.split()), command


def _scan_note(run: Run) -> None:
    """``run`` said once, in one line, that it audited the thread index's threads alone."""
    assert "Traceback" not in run.err, run
    notes = [line for line in run.err.splitlines() if "may not SCAN" in line]
    assert len(notes) == 1 and len(run.err.splitlines()) == 1, run
    assert "a thread missing from the index could not be looked for" in notes[0], run


def test_audits_of_every_thread_by_a_user_without_scan_cover_the_index_and_say_so(
    acl_server: RedisServer,
) -> None:
    """A tenant's user may not SCAN (`acl_rules` leaves it out): verify, check and rebuild
    --all audit the threads of the thread index, say once that a thread missing from it could
    not be looked for, and exit as for the threads they audited. They used to stop at the
    listing (exit 2), so a tenant could not audit its namespace at all. An admin (who may
    SCAN) finds the thread removed from the index as well."""
    namespace = new_namespace()
    url = tenant_url(acl_server, *add_tenant(acl_server, namespace))
    auditor_user, auditor_password = f"auditor-{namespace}", secrets.token_urlsafe(18)
    with admin(acl_server) as c:
        rules = es.acl_rules(namespace, read_only=True)
        c.execute_command(
            "ACL", "SETUSER", auditor_user, "reset", "on", f">{auditor_password}", *rules
        )
    auditor_url = tenant_url(acl_server, auditor_user, auditor_password)
    admin_url = f"redis://127.0.0.1:{acl_server.port}"

    async def setup(store: es.EventStore) -> None:
        threads = ThreadStore(store)
        for thread in ("alpha", "beta", "hidden"):
            await threads.append_message(thread, {"role": "user", "content": "hello"})
        # Damage only an admin can do: a view deleted, a thread taken out of the index.
        assert isinstance(store, RedisEventStore)
        with admin(acl_server) as c:
            assert c.delete(store.keys.view("alpha", "messages")) == 1
            assert c.zrem(store.keys.index(store.keys.partition("hidden")), "hidden") == 1

    with_store(url, namespace, setup)
    for who in (url, auditor_url):
        verify = cli("verify", "--all", url=who, namespace=namespace)
        assert verify.code == 0, verify
        assert "verified 2 threads (2 events) of the thread index" in verify.out, verify
        assert "all OK" in verify.out and "hidden" not in verify.out, verify
        _scan_note(verify)
        as_json = cli("verify", "--all", "--json", url=who, namespace=namespace)
        assert as_json.code == 0, as_json
        _scan_note(as_json)
        report = as_json.json()
        assert (report["ok"], report["index_only"]) == (True, True), report
        assert sorted(report["threads"]) == ["alpha", "beta"], report
        check = cli("check", "--all", url=who, namespace=namespace)
        assert check.code == 1, check  # alpha's views differ from its log
        assert "checked 2 threads of the thread index" in check.out, check
        assert "1 DIFFERENT" in check.out and "check alpha: DIFFERENT" in check.out, check
        _scan_note(check)
        checked = cli("check", "--all", "--json", url=who, namespace=namespace)
        assert checked.code == 1 and checked.json()["index_only"] is True, checked
    denied = cli("rebuild", "--all", url=auditor_url, namespace=namespace)
    assert denied.code == 2 and "rebuild writes" in denied.err, denied  # may not write views
    rebuilt = cli("rebuild", "--all", url=url, namespace=namespace)
    assert rebuilt.code == 0, rebuilt
    assert "rebuilt the views of 2 threads of the thread index" in rebuilt.out, rebuilt
    _scan_note(rebuilt)
    clean = cli("check", "--all", url=url, namespace=namespace)
    assert clean.code == 0 and "all OK" in clean.out, clean
    # A user who may SCAN (here the admin) looks at the keys too: the unindexed thread is
    # found, and no note is given.
    full = cli("verify", "--all", "--json", url=admin_url, namespace=namespace)
    assert full.code == 1 and full.err == "", full
    report = full.json()
    assert report["index_only"] is False, report
    assert report["threads"]["hidden"]["kind"] == "unindexed", report


async def test_an_auditor_of_the_index_alone_runs_as_a_tenant_user(acl_server: RedisServer) -> None:
    """`Auditor.verify_all` as a tenant's user (no +scan) stops and says why; with
    ``index_only`` it audits the threads the index lists, and a thread removed from the index
    is not among them (nothing else could find it)."""
    namespace = new_namespace()
    url = tenant_url(acl_server, *add_tenant(acl_server, namespace))
    async with await es.connect(url, namespace=namespace) as store:
        assert isinstance(store, RedisEventStore)
        for thread in ("a", "b"):
            await store.append(thread, [msg("hi")])
        with admin(acl_server) as c:
            assert c.zrem(store.keys.index(store.keys.partition("b")), "b") == 1
        auditor = Auditor(store)
        for everything in (auditor.threads(), auditor.verify_all(), auditor.check_all()):
            with pytest.raises(OperationalError, match=r"denied SCAN \(ACL\).*needs \+scan"):
                await everything
        assert await auditor.threads(index_only=True) == ["a"]
        assert list(await auditor.verify_all(index_only=True)) == ["a"]
        assert list(await auditor.check_all(index_only=True)) == ["a"]
        assert await auditor.rebuild_all(index_only=True) == {"a": 1}


def test_a_read_only_auditor_reads_and_a_writing_command_says_which_rules_it_needs(
    acl_server: RedisServer, tmp_path: Path
) -> None:
    """docs/scaling.md: a user made with `acl_rules(ns, read_only=True)` runs verify, check,
    show, replay and every read. A command that writes is refused by Redis, writes nothing,
    and says in one line (exit 2) that it was the ACL and which rules allow it: Redis itself
    names no command when it refuses one inside a script ("can't run this command")."""
    namespace = new_namespace()
    thread = _recorded_demo(tenant_url(acl_server, *add_tenant(acl_server, namespace)), namespace)
    user, password = f"auditor-{namespace}", secrets.token_urlsafe(18)
    with admin(acl_server) as c:
        rules = es.acl_rules(namespace, read_only=True)
        c.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", *rules)
    url = tenant_url(acl_server, user, password)
    before = key_dump(acl_server, namespace)
    for argv in (
        ["threads"],
        ["show", thread],
        ["replay", thread, "--json"],
        ["tail", "--since", "1h", "--limit", "3"],
        ["verify", thread],
        ["check", thread, "--json"],
        ["feed"],
        ["export-jsonl", thread, str(tmp_path / "t.jsonl")],
    ):
        run = cli(*argv, url=url, namespace=namespace)
        assert run.code == 0, run
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text('{"role":"user","content":"hi"}\n')
    for argv in (
        ["rebuild", thread],
        ["import-jsonl", str(jsonl), "s1"],
        ["export", "--format", "ndjson", "--out", str(tmp_path / "out")],
        ["drop-group", "export-a"],
        ["forget-projection", "usage"],
    ):
        line = assert_one_line_error(cli(*argv, url=url, namespace=namespace))
        assert "redis denied the command (ACL)" in line, line
        assert f"{argv[0]} writes" in line and "eventstore.acl_rules(ns)" in line, line
    assert key_dump(acl_server, namespace) == before
    assert not (tmp_path / "out").exists()


def test_a_tenant_user_outside_its_namespace_is_told_to_check_namespace(
    acl_server: RedisServer,
) -> None:
    """Without --namespace the command opens 'default', which a tenant's user cannot reach:
    the error names the namespace and points at --namespace, not only "no permissions to
    access one of the keys"."""
    url = tenant_url(acl_server, *add_tenant(acl_server, new_namespace()))
    other = new_namespace()
    for namespace, named in ((None, "default"), (other, other)):
        line = assert_one_line_error(cli("threads", url=url, namespace=namespace))
        assert "redis denied the command (ACL)" in line, line
        assert f"namespace {named!r}: this user's ACL" in line and "check --namespace" in line


# -- secrets in errors and logs ---------------------------------------------------------------


@pytest.mark.parametrize("failure", ["wrong password", "unknown user", "other tenant"])
async def test_failed_connects_name_no_password(
    acl_server: RedisServer, caplog: pytest.LogCaptureFixture, failure: str
) -> None:
    caplog.set_level(logging.DEBUG)
    a = new_namespace()
    user, password = add_tenant(acl_server, a)
    namespace = a
    if failure == "wrong password":
        password = secrets.token_urlsafe(18)
    elif failure == "unknown user":
        user = "nobody-" + uuid.uuid4().hex[:6]
    else:
        namespace = new_namespace()
    url = tenant_url(acl_server, user, password)
    with pytest.raises(StoreConnectionError) as info:
        await es.connect(url, namespace=namespace)
    assert redact(url) in str(info.value)
    assert_no_secret(rendered(info.value), password, url)
    assert_no_secret(logged(caplog), password, url)


# -- TLS ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(tls_files: TlsFiles) -> Iterator[RedisServer]:
    """TLS on a loopback port (plain TCP off); the admin uses the unix socket."""
    with redis_server(unix=True, tls=tls_files) as server:
        yield server


def with_query(url: str, **params: Path | str) -> str:
    joined = "&".join(f"{k}={quote(str(v))}" for k, v in params.items())
    return url + ("&" if "?" in url else "?") + joined


@pytest.fixture
async def tls_store(tls_server: RedisServer) -> AsyncIterator[EventStore]:
    store = await es.connect(tls_server.tls_url, namespace=new_namespace())
    try:
        yield store
    finally:
        await store.close()


async def test_tls_round_trip(tls_server: RedisServer, tls_store: EventStore) -> None:
    assert isinstance(tls_store, RedisEventStore)
    assert tls_store.client.connection_pool.connection_class is SSLConnection
    await Projector(tls_store).append("t", [msg("over TLS")])
    assert [e.payload for e in await read_all(tls_store, "t")] == [msg("over TLS")]
    # The port speaks TLS only: a plaintext client is turned away, with a typed error.
    with pytest.raises(StoreConnectionError):
        await es.connect(f"redis://127.0.0.1:{tls_server.tls_port}", namespace="x")


async def test_tls_with_a_tenant_user(
    tls_server: RedisServer, tls_files: TlsFiles, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    a = new_namespace()
    user, password = add_tenant(tls_server, a)
    url = with_query(
        f"rediss://{user}:{password}@127.0.0.1:{tls_server.tls_port}",
        ssl_ca_certs=tls_files.ca_cert,
    )
    async with await es.connect(url, namespace=a) as store:
        await store.append("t", [msg("confined and encrypted")])
        assert await store.version("t") == 1
    with pytest.raises(StoreConnectionError) as denied:
        await es.connect(url, namespace=new_namespace())
    assert "ACL" in str(denied.value)
    assert_no_secret(rendered(denied.value), password, url)
    assert_no_secret(logged(caplog), password, url)


async def test_tls_verifies_the_server_certificate(
    tls_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    a = new_namespace()
    user, password = add_tenant(tls_server, a)
    url = f"rediss://{user}:{password}@127.0.0.1:{tls_server.tls_port}"
    # Without the test CA the server's certificate is not trusted: refused, typed, no password.
    with pytest.raises(StoreConnectionError) as untrusted:
        await es.connect(url, namespace=a)
    assert "certificate" in str(untrusted.value).lower()
    assert_no_secret(rendered(untrusted.value), password, url)
    assert_no_secret(logged(caplog), password, url)
    # Verification can only be switched off by saying so.
    async with await es.connect(url + "?ssl_cert_reqs=none", namespace=a) as store:
        assert await store.version("t") == 0


async def test_mutual_tls(tls_files: TlsFiles) -> None:
    with redis_server(unix=True, tls=tls_files, tls_auth_clients="yes") as server:
        with pytest.raises(StoreConnectionError):
            await es.connect(server.tls_url, namespace=new_namespace())
        url = with_query(
            server.tls_url, ssl_certfile=tls_files.client_cert, ssl_keyfile=tls_files.client_key
        )
        async with await es.connect(url, namespace=new_namespace()) as store:
            await store.append("t", [msg("both sides verified")])
            assert await store.version("t") == 1
