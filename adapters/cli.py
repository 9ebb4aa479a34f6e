"""The `threadlog` command: record a demo, list, show, replay, follow, verify, export and repair.

Every command takes ``--url`` (default: ``THREADLOG_URL``, else the embedded redis-server under
``./.threadlog/``) and ``--namespace``. Output is rich tables and trees for people and, with
``--json``, JSON for machines; progress bars appear only on a terminal. Errors are one line on
stderr, ``threadlog: <message>``, with the exit codes of `EXIT_CODES`.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import difflib
import importlib
import io
import os
import re
import shlex
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import IO, Any, NoReturn, TextIO, TypeVar, cast

import anyio
import anyio.abc
import msgspec

import eventstore as es
from eventstore._codec import decode_entry, log_without_meta
from eventstore._errors import UNREACHABLE
from eventstore._feed import (
    parse_stream_id,
    validate_group_to_drop,
    validate_hash_names,
    validate_projection_name,
)
from projections import (
    DEFAULT_WINDOW,
    AsOf,
    Block,
    CheckReport,
    GroupLag,
    MessagesProjection,
    Projector,
    RebuildBusyError,
    RebuildError,
    RecordsProjection,
    SeqBeyondVersionError,
    StoredMessage,
    TranscriptMessage,
    TranscriptProjection,
    TurnNode,
    TurnRecord,
    drop_feed_group,
    feed_group_lag,
    forget_projection,
)

from ._audit import UNKNOWN_TYPE_NOTE, Auditor, ReplayStep, UnverifiedLogError, Verdict, _span
from ._demo import PLANNER_VIEW, demo_state, record_demo
from ._export import COMPRESSIONS, DEFAULT_COMPRESSION, Exporter, ExportResult
from ._jsonl import (
    ImportProgress,
    JsonlImportError,
    export_jsonl,
    read_import,
    transcript_to_export,
    write_import,
)
from ._sessions import SessionStore

try:
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.table import Table
    from rich.text import Text
    from rich.tree import Tree
except ModuleNotFoundError as _missing:  # pragma: no cover - rich ships with the cli extra
    sys.stderr.write(
        f"threadlog: the command needs rich ({_missing}); pip install 'threadlog[cli]'\n"
    )
    raise SystemExit(2) from None

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader went away
EXIT_CODES = """\
exit codes:
  0    ok
  1    verification failed, differences found, or a stored event or key is damaged
  2    usage error, bad input, or the store is unreachable or refused the request
  3    internal error (a bug in threadlog; THREADLOG_DEBUG=1 shows the traceback)
  130  interrupted (Ctrl-C, or SIGTERM, which stops a command as Ctrl-C does); tail
       stops with 0
  141  the output's reader went away (a pipe into head), nothing on stderr
verify, check and rebuild --all as a Redis user that may not SCAN (a tenant's) cover the
threads of the thread index, say once on stderr that a thread missing from it could not be
looked for, and exit as for the threads they covered.

environment:
  THREADLOG_URL           the store, when --url is not given (unset: the embedded server)
  THREADLOG_SECRET        the key the threads' hash chains are linked with (every command)
  THREADLOG_REDIS_SERVER  the server binary the embedded server runs (default: redis-server,
                          else valkey-server, from PATH)
  THREADLOG_EVENTS        modules to import first, comma-separated, when --events is not
                          given: those registering your application's event types
  THREADLOG_DEBUG         1: an internal error shows its traceback
"""
URL_ENV = "THREADLOG_URL"
EVENTS_ENV = "THREADLOG_EVENTS"
# Export writes files, consumer groups and the data set's id, but no event: a namespace it is
# pointed at must exist already (a misspelt --namespace must not create one).
READ_ONLY_COMMANDS = frozenset(
    {"threads", "show", "replay", "tail", "verify", "check", "export-jsonl", "export", "feed"}
)
FEED_COMMANDS = frozenset({"trim-feed", "drop-group", "forget-projection"})
"""Commands that change only the feed: like reads, they never create a namespace."""
# Only the commands that write new events create a namespace (demo, and import-jsonl once its
# file holds something to write): rebuild and the feed commands work on what is there, and a
# misspelt --namespace given to them is refused, not recorded as a new, empty tenant. tail is
# left out: following a namespace before its first event is what it is for.
WRITES: dict[str, str] = {
    "demo": "events",
    "import-jsonl": "events",
    "rebuild": "the threads' views",
    "export": "its feed consumer group",
    "trim-feed": "the change feed",
    "drop-group": "feed consumer groups",
    "forget-projection": "feed consumer groups and async projections' checkpoints and figures",
}
"""What each command writes besides reading: the ACL hint's words for a user who may only read."""
_ACL_DENIED = "(ACL)"  # how translate_redis_error marks a command Redis's ACL refused
# A key outside the user's ~patterns, in the server's words: Redis 7.0's, Valkey 8's.
_KEYS_DENIED = ("no permissions to access one of the keys", "no permissions to access a key")
_SCAN_DENIED = "redis denied SCAN (ACL)"  # the store's words (`EventStore.stored_threads`)
_NAMESPACE_MUST_EXIST = frozenset({*READ_ONLY_COMMANDS, *FEED_COMMANDS, "rebuild"} - {"tail"})
EMBEDDED_DIR = Path(".threadlog")
PLAIN_WIDTH = 120
TAIL_PAGE = 512  # events per read when a feed entry covers many
TAIL_FEED_PAGE = 256  # feed entries per read and partition
MAX_NUMBER = 2**63 - 1  # the largest seq, count or window the command accepts
"""Output width when stdout is not a terminal (and COLUMNS is unset): wide enough for ids."""
_MAX_STREAM_ID_SEQ = 2**64 - 1
_RUN_VERIFY = re.compile(r"\s*\(run 'verify'\)")  # the store's pointer; the CLI names the command
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^:/@\s]*):[^@\s]*@", re.IGNORECASE)


R = TypeVar("R")


class UsageError(Exception):
    """Raised when the command line or its input cannot be used (exit code 2)."""


class Failed(Exception):
    """Raised to end a command with exit code 1 after its report was printed."""


# -- argument parsing ---------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, raised rather than printed."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d)", re.IGNORECASE)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(text: str) -> datetime:
    """An ISO-8601 time (local time when it has no offset) or a duration ago (``15m``, ``2h``)."""
    match = _DURATION.fullmatch(text.strip())
    if match is not None:
        seconds = float(match.group(1)) * _UNITS[match.group(2).lower()]
        try:
            return datetime.now(UTC) - timedelta(seconds=seconds)
        except OverflowError:
            raise argparse.ArgumentTypeError(f"{text!r} reaches back before year 1") from None
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an ISO-8601 time (2024-06-13T09:40:00+02:00) or a duration "
            "ago (90s, 15m, 2h, 7d)"
        ) from None
    try:
        moment = moment if moment.tzinfo is not None else moment.astimezone()
        moment.timestamp()  # the store asks for it: a time it cannot give is refused here
    except (OverflowError, OSError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is out of the range of times") from None
    return moment


def parse_age(text: str) -> int:
    """A duration (``90s``, ``15m``, ``2h``, ``7d``) in milliseconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (90s, 15m, 2h, 7d)")
    ms = float(match.group(1)) * _UNITS[match.group(2).lower()] * 1000
    if ms > MAX_NUMBER:
        raise argparse.ArgumentTypeError(f"{text!r} is too long")
    return int(ms)


def parse_workers(text: str) -> int | str:
    """``auto`` or a whole number >= 1."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'auto' or a whole number >= 1")
    return n


def parse_as_of(text: str) -> AsOf:
    """A seq (digits) or a time (see `parse_time`)."""
    stripped = text.strip()
    if stripped.isascii() and stripped.isdigit():  # not "²" or "١٢": digits of other scripts
        return _positive(stripped)
    try:
        return parse_time(stripped)
    except argparse.ArgumentTypeError as exc:
        # parse_time speaks of times only; a seq is the other half of what is taken here.
        raise argparse.ArgumentTypeError(f"{exc}; or a seq (1, 2, ...)") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    if value > MAX_NUMBER:
        # Seqs and counts are 64-bit in Redis; a bigger number would reach it as a bad id.
        raise argparse.ArgumentTypeError(f"{text!r} is too large (at most {MAX_NUMBER})")
    return value


def _seq(text: str) -> int:
    with contextlib.suppress(ValueError):
        if int(text) < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not a seq (seqs start at 1)")
    return _positive(text)


def _file(text: str) -> Path:
    # Path("") is ".": an empty FILE (an unset shell variable) read as the working directory.
    if not text.strip():
        raise argparse.ArgumentTypeError("the file name is empty ('-': standard input or output)")
    return Path(text)


def _session(text: str) -> str:
    """A session id (a thread id, named as the command names it)."""
    try:
        return es.validate_thread_id(text)
    except es.InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("thread id", "session id")) from None


def _out_dir(text: str) -> Path:
    # Path("") is ".": an empty --out (an unset shell variable) would export into the
    # working directory.
    if not text.strip():
        raise argparse.ArgumentTypeError("the output directory is empty")
    # export-jsonl takes '-' for stdout; here it would silently make a directory named '-'.
    if text == "-":
        raise argparse.ArgumentTypeError(
            "'-' (stdout) is no directory: export writes part files into --out DIR"
        )
    return Path(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.01 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 0.01 and 3600 seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``threadlog`` argument parser with every subcommand."""
    # SUPPRESS: --url and --namespace may come before or after the command name.
    common = _Parser(add_help=False)
    common.add_argument(
        "--url",
        default=argparse.SUPPRESS,
        help=f"store URL: redis://, rediss://, unix:///path, redis+cluster:// (rediss+cluster:// "
        f"with TLS), redis+sentinel://host:port/service (rediss+sentinel://), memory:// "
        f"(default: ${URL_ENV}, else a private redis-server under ./{EMBEDDED_DIR}/)",
    )
    common.add_argument(
        "--namespace",
        default=argparse.SUPPRESS,
        help="namespace (tenant) of the store (default: the URL's ?namespace=, else 'default')",
    )
    common.add_argument(
        "--events",
        action="append",
        default=argparse.SUPPRESS,
        metavar="MODULE",
        help=f"import MODULE first (repeatable; importable from the current directory or "
        f"PYTHONPATH): the one that registers your application's event types, so that "
        f"verify, check, rebuild, show, replay and tail decode them (default: "
        f"${EVENTS_ENV}, comma-separated)",
    )
    json_parent = _Parser(add_help=False)
    json_parent.add_argument("--json", action="store_true", help="print JSON for machines")
    target = _Parser(add_help=False)
    target.add_argument("thread", nargs="?", metavar="THREAD", help="one thread")
    target.add_argument(
        "--all",
        action="store_true",
        help="every thread of the namespace, indexed or not: the keys are scanned (+scan). A "
        "user without it (eventstore.acl_rules, a tenant's) gets the thread index's threads, "
        "and a note that one missing from the index could not be looked for",
    )

    formatter = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog="threadlog",
        description="threadlog: event-sourced storage for AI agent runtimes on Redis Streams.",
        epilog=EXIT_CODES,
        formatter_class=formatter,
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"threadlog {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def add(
        name: str,
        summary: str,
        func: Callable[[Ctx, argparse.Namespace], Awaitable[None]],
        *,
        parents: Sequence[_Parser] = (),
        description: str | None = None,
        store_options: bool = True,
    ) -> argparse.ArgumentParser:
        inherited = [common, *parents] if store_options else list(parents)
        p = sub.add_parser(
            name,
            help=summary,
            description=description or summary,
            epilog=EXIT_CODES,
            formatter_class=formatter,
            parents=inherited,
        )
        p.set_defaults(func=func)
        return p

    add(
        "demo",
        "record a multi-turn agent conversation and show what threadlog keeps of it",
        cmd_demo,
        description="Record a travel assistant's conversation into a new thread (child turns, "
        "a failed turn, state updates, a transcript compaction), then show the history window, "
        "a reader view of the state, the turn-record tree and the integrity verdict. "
        "Each run uses a new thread.",
    )
    stop_parser = add(
        "stop",
        f"stop the embedded redis-server of this directory (./{EMBEDDED_DIR}/)",
        cmd_stop,
        description=f"Stop the private redis-server that threadlog started under "
        f"./{EMBEDDED_DIR}/ (any command run here without --url or ${URL_ENV} starts it, and "
        "it keeps running between commands). Its data stays; the next command starts it "
        "again. A server that does not stop within 10 s (it cannot write its final "
        "snapshot, or runs a long script) is reported, exit 2, and left running; --force "
        "kills it then.",
        store_options=False,
    )
    stop_parser.add_argument(
        "--force",
        action="store_true",
        help="kill the server if it has not stopped within 10 s (what it had not written to "
        "its append-only file is lost; the next start checks the file)",
    )
    p = add(
        "threads", "list threads, most recent activity first", cmd_threads, parents=[json_parent]
    )
    p.add_argument(
        "--limit",
        type=_positive,
        default=100,
        metavar="N",
        help="show at most N threads (0: all; default 100)",
    )
    p = add(
        "show",
        "show a thread: history window, state blocks, turn tree, records, transcript",
        cmd_show,
        parents=[json_parent],
    )
    p.add_argument("thread", metavar="THREAD")
    p.add_argument(
        "--as-of",
        type=parse_as_of,
        metavar="SEQ|TIME",
        help="show the thread as it stood at a seq, or at an ISO-8601 time (or 15m, 2h ago)",
    )
    p.add_argument(
        "--window",
        type=_positive,
        default=DEFAULT_WINDOW,
        metavar="N",
        help=f"messages in the history window (default {DEFAULT_WINDOW})",
    )
    p.add_argument(
        "--turns",
        type=_positive,
        default=20,
        metavar="N",
        help="the last N root turns in the tree and N records in the table (default 20; 0: all)",
    )
    p = add(
        "replay",
        "replay a thread event by event, with its read models after each event",
        cmd_replay,
        parents=[json_parent],
    )
    p.add_argument("thread", metavar="THREAD")
    p.add_argument(
        "--from", dest="start", type=_seq, default=1, metavar="SEQ", help="first seq (default 1)"
    )
    p.add_argument(
        "--to",
        dest="stop",
        type=_seq,
        metavar="SEQ",
        help="last seq (default: end; with --as-of, whichever comes first)",
    )
    p.add_argument(
        "--as-of",
        type=parse_as_of,
        metavar="SEQ|TIME",
        help="stop at this point (with --to, whichever comes first)",
    )
    p = add(
        "tail",
        "follow new events as they are appended (one thread, or all); Ctrl-C stops",
        cmd_tail,
        parents=[json_parent],
    )
    p.add_argument("thread", nargs="?", metavar="THREAD")
    p.add_argument(
        "--since",
        type=parse_time,
        metavar="TIME",
        help="start at a past time: ISO-8601, or a duration ago (15m, 2h)",
    )
    p.add_argument(
        "--limit",
        type=_positive,
        metavar="N",
        help="exit after N events or deletions shown (0: no limit)",
    )
    p.add_argument(
        "--interval", type=_seconds, default=0.25, metavar="SEC", help="poll interval (0.25)"
    )
    add(
        "feed",
        "show the change feed: entries per partition, how far it was trimmed, consumer groups",
        cmd_feed,
        parents=[json_parent],
        description="Show the namespace's change feed (one stream per partition; exports and "
        "projection runners keep a consumer group on it at their position): how many entries "
        "each partition holds, from when to when, how far it was trimmed, and each consumer "
        "group's position, entries left unread and pending entries. A group whose position "
        "the feed was trimmed past has lost changes, and is flagged; one whose unread entries "
        "keep growing is read by nobody (a renamed projection, an export given up) and holds "
        "trimming back: 'threadlog drop-group' removes it ('threadlog forget-projection' "
        "removes a retired projection's checkpoints and figures too).",
    )
    p = add(
        "trim-feed",
        "remove feed entries every consumer group has read (the logs keep every event)",
        cmd_trim_feed,
        parents=[json_parent],
        description="Remove, from every partition's change feed, the entries every consumer "
        "group has read (without groups: none), and with --max-age also every entry older "
        "than that, read or not. Only the feed shrinks: every event stays in its thread's log. "
        "A group that had not read what --max-age removes loses those changes (an export "
        "stops with an error rather than skip them); 'threadlog feed' shows the groups.",
    )
    p.add_argument(
        "--max-age",
        type=parse_age,
        metavar="AGE",
        help="also remove entries older than this (90s, 15m, 2h, 7d), read or not",
    )
    p = add(
        "drop-group",
        "forget a feed consumer group (an old export's, a retired projection's), so trimming "
        "stops waiting for it",
        cmd_drop_group,
        description="Forget a consumer group on every partition's feed: its position and its "
        "pending entries. Trimming waits for every group, so a group nobody reads any more "
        "(an export directory thrown away, a retired projection runner) holds the feed back "
        "for ever. An export directory under that name takes the group up again on its next "
        "run, from its own position, unless the feed was trimmed past it meanwhile; a "
        "projection runner still running registers it again when it next applies a change.",
    )
    p.add_argument(
        "name",
        metavar="NAME",
        help="the group, as 'threadlog feed' lists it: an export's is export-<its --name>, an "
        "async projection's is the projection's name",
    )
    p = add(
        "forget-projection",
        "remove a retired async projection: its groups, checkpoints and figures",
        cmd_forget_projection,
        parents=[json_parent],
        description="Remove every trace of an async projection from the namespace: its "
        "consumer group on every partition's feed (as drop-group does), then its checkpoint "
        "and figures (every hash it counted into), partition by partition. For a projection "
        "retired or renamed for good: drop-group alone keeps the checkpoint, listed by "
        "'threadlog feed' as a reader that lost its feed once a feed is deleted, and the "
        "figures. Stop its runners first: a runner still running counts again from the start "
        "of the feed. The events are not touched; the projection started again later counts "
        "from scratch (backfill=True counts what the logs hold).",
    )
    p.add_argument("name", metavar="NAME", help="the async projection's name")
    p.add_argument(
        "--hash",
        dest="hashes",
        action="append",
        default=[],
        metavar="HASH",
        help="also delete this hash of its figures (repeatable): for figures written by a "
        "release from before their hashes' names were recorded",
    )
    add(
        "verify",
        "verify integrity chains: nothing altered, removed, inserted or reordered",
        cmd_verify,
        parents=[target, json_parent],
    )
    p = add(
        "export",
        "export events (incrementally) to Parquet or NDJSON part files",
        cmd_export,
        parents=[json_parent],
    )
    p.add_argument("--format", dest="fmt", choices=("parquet", "ndjson"), default="parquet")
    p.add_argument("--out", type=_out_dir, required=True, metavar="DIR", help="output directory")
    p.add_argument(
        "--since",
        type=parse_time,
        metavar="TIME",
        help="start a new directory at this time (ISO-8601, or a duration ago: 15m, 2h): "
        "older events are never exported into it; refused on a directory with positions",
    )
    p.add_argument(
        "--name",
        help="export name: its feed consumer group, one per directory (default: the one the "
        "directory recorded; a new directory gets its own, from its path)",
    )
    p.add_argument(
        "--workers",
        type=parse_workers,
        default="auto",
        metavar="N|auto",
        help="processes sharing the partitions, at most one per partition with changes "
        "waiting (default auto: one per CPU, at most 3, when at least 200,000 events wait; "
        "1 exports in this process only)",
    )
    p.add_argument(
        "--compression",
        choices=COMPRESSIONS,
        help=f"Parquet compression codec (default {DEFAULT_COMPRESSION}; snappy writes faster, "
        "zstd smaller files); not with --format ndjson, whose parts are plain",
    )
    p = add(
        "rebuild",
        "recompute materialized views from the log, once the log verifies",
        cmd_rebuild,
        parents=[target, json_parent],
        description="Recompute the materialized views of a thread (or of every thread) from its "
        "log. Each log is verified first, as 'threadlog verify' does (with THREADLOG_SECRET for "
        "keyed chains): a thread whose log fails is not rebuilt (exit 1, nothing written), "
        "since its views would copy the damage - an edited or forged entry - from the log.",
    )
    p.add_argument(
        "--trust-log",
        action="store_true",
        help="rebuild from the log as it is, without verifying its integrity chain first: "
        "whatever the log holds, an edited or forged entry included, becomes the views",
    )
    add(
        "check",
        "prove materialized views equal the fold of the log (a log that verifies)",
        cmd_check,
        parents=[target, json_parent],
        description="Verify each thread's log (as 'threadlog verify' does), then compare its "
        "materialized views with the fold of the log. A log that fails verification is "
        "reported as damaged (exit 1) and its views are not compared: a fold of it proves "
        "nothing, and rebuilding from it would copy the damage.",
    )
    p = add(
        "import-jsonl",
        "append a JSONL file of model messages to a session's transcript",
        cmd_import_jsonl,
        parents=[json_parent],
    )
    p.add_argument("file", type=_file, metavar="FILE", help="JSONL file ('-': standard input)")
    p.add_argument("session", type=_session, metavar="SESSION")
    p.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip malformed lines and messages too large to store (and list them)",
    )
    p = add("export-jsonl", "write a session's transcript as a JSONL file", cmd_export_jsonl)
    p.add_argument("session", type=_session, metavar="SESSION")
    p.add_argument("file", type=_file, metavar="FILE", help="output file ('-': stdout)")
    return parser


def write_stdout(data: bytes) -> None:
    """Write every byte to stdout, or raise BrokenPipeError (exit 141). Python's buffered
    stdout loses the rest of a write larger than its buffer without a word when the reader
    goes away (a show --json of a long window into ``| head``: exit 0, output cut short).
    JSON goes out as UTF-8 whatever the locale, as `_tolerant_output` says."""
    sys.stdout.flush()  # what rich or print left in the buffer goes first
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a test's capture: no fd
        sys.stdout.write(data.decode("utf-8"))
        return
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("threadlog")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"


# -- the context every command gets -------------------------------------------------------------


@dataclass(frozen=True)
class Where:
    """Where the data lives: the URL and, for the embedded server, its directory."""

    url: str
    embedded: Path | None = None
    given: bool = False

    def describe(self) -> str:
        if self.url.startswith("memory:"):
            return "in-memory backend (memory://: nothing persists after this command)"
        if self.embedded is not None:
            return f"embedded redis-server in {self.embedded}/ (unix socket, AOF on)"
        return f"redis at {es.redact(self.url)}"


@dataclass
class Ctx:
    """What a command works with."""

    out: Console
    err: Console
    where: Where
    store: es.EventStore
    namespace_given: bool
    progress_ok: bool

    @property
    def projector(self) -> Projector:
        return Projector(self.store)

    def json(self, value: Any) -> None:
        write_stdout(msgspec.json.format(json_bytes(json_ready(value)), indent=2) + b"\n")

    def progress(self, description: str, unit: str | None = None) -> _Progress:
        return _Progress(self.err, description, enabled=self.progress_ok, unit=unit)


def resolve_where(url: str | None) -> Where:
    """The store location: ``--url``, else ``THREADLOG_URL``, else the embedded server."""
    if url is not None:
        if not url.strip():
            raise UsageError("--url is empty")
        return Where(url, given=True)
    env = os.environ.get(URL_ENV)
    if env is not None and not env.strip():
        # As an empty --url is: set from an unset variable in a deployment, it would start a
        # redis-server in the working directory and answer from its empty data ("No threads").
        raise UsageError(
            f"{URL_ENV} is set but empty: set it to the store's URL, or unset it for the "
            f"embedded redis-server under ./{EMBEDDED_DIR}/"
        )
    if env:
        return Where(env)
    found = es.embedded_url(EMBEDDED_DIR, on_start=_say_started)  # started when needed
    if found.startswith("unix://"):
        return Where(found, embedded=EMBEDDED_DIR.resolve())
    return Where(found)


def _say_started(directory: Path) -> None:
    sys.stderr.write(
        f"threadlog: started an embedded redis-server in {directory}/ for this directory; "
        "it keeps running for the next command ('threadlog stop' stops it)\n"
    )


async def cmd_stop(ctx: Ctx, args: argparse.Namespace) -> None:
    raise AssertionError("stop runs without a store: see main")  # pragma: no cover


def _stop_embedded(args: argparse.Namespace) -> int:
    if getattr(args, "url", None) is not None or getattr(args, "namespace", None) is not None:
        raise UsageError(
            "stop takes no --url or --namespace: it stops the embedded redis-server of this "
            f"directory (./{EMBEDDED_DIR}/)"
        )
    home = EMBEDDED_DIR.resolve()
    if es.stop_embedded(EMBEDDED_DIR, force=args.force):
        print(f"stopped the embedded redis-server in {home}/ (its data stays there)")
    else:
        print(f"no embedded redis-server is running in {home}/")
    return EXIT_OK


class _Progress:
    """A rich progress bar on a terminal; nothing at all otherwise (pipes, tests, --json)."""

    def __init__(
        self, console: Console, description: str, *, enabled: bool, unit: str | None = None
    ) -> None:
        self.bar: Progress | None = None
        self.task: Any = None
        if enabled:
            # With a unit the total is unknown: a running count instead of a bar.
            counter = (
                (TextColumn(f"{{task.completed:,.0f}} {unit}"),)
                if unit is not None
                else (BarColumn(), MofNCompleteColumn())
            )
            self.bar = Progress(
                SpinnerColumn(),
                TextColumn("[progress.description]{task.description}"),
                *counter,
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )
            self.task = self.bar.add_task(description, total=None)

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, done: int, total: int | None = None) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total)


# -- formatting ---------------------------------------------------------------------------------


def fmt_time(ms: int) -> str:
    """An epoch-ms time as local ISO-8601 with milliseconds and offset."""
    if ms <= 0:
        return "-"
    moment = datetime.fromtimestamp(ms / 1000, tz=UTC).astimezone()
    return moment.isoformat(sep=" ", timespec="milliseconds")


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def fmt_duration(ms: int) -> str:
    if ms < 1000:
        return f"{ms} ms"
    if ms < 120_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms / 60_000:.1f} min"


def json_bytes(value: Any) -> bytes:
    """``value`` as JSON. Stored data JSON cannot hold as it is (a non-string key, which an
    application's own event may carry) is shown with its keys as JSON writers key them
    (``true``, ``1``), never a crash half-way through a command."""
    try:
        return msgspec.json.encode(value)
    except TypeError:
        return msgspec.json.encode(_string_keys(value))


def _string_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {_key_text(k): _string_keys(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_string_keys(v) for v in value]
    if isinstance(value, msgspec.Struct):
        return _string_keys(msgspec.to_builtins(value, str_keys=True))
    return value


def _key_text(key: Any) -> str:
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool):
        return {None: "null", True: "true", False: "false"}[key]
    if isinstance(key, int | float):
        return repr(key)
    return str(key)


def compact_json(value: Any, limit: int | None = None) -> str:
    text = json_bytes(value).decode("utf-8")
    if limit is not None and len(text) > limit:
        return text[: limit - 3] + "..."
    return text


def _escapes(keep: str) -> dict[int, str]:
    """``str.translate`` table: every control character (C0, DEL, C1) but ``keep``, and the
    bidi controls, to a visible escape (``\\x1b``, ``\\u202e``)."""
    codes = [*range(0x20), *range(0x7F, 0xA0), 0x061C, 0x200E, 0x200F]
    codes += [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]
    return {c: ascii(chr(c))[1:-1] for c in codes if chr(c) not in keep}


_ONE_LINE = _escapes("")
_LINES = _escapes("\n\t")


_TERMINAL_UNSAFE = {
    c: e for c, e in _ONE_LINE.items() if c >= 0x80
}  # C1 controls and bidi controls: characters rich never writes itself
"""What every line the command writes has escaped, whatever it prints (see `_Escaping`)."""


class _Escaping:
    """A console's stream that escapes `_TERMINAL_UNSAFE` in everything written through it.
    Thread ids may hold them (only C0 controls are refused), and they are printed in many
    places besides show and replay: a bidi override makes 'evil<RLO>gnp.exe' read as
    'evilexe.png', and U+009B is CSI on some terminals. Rich's own styling is C0 (ESC), which
    passes through. The stream is looked up when written to (tests replace sys.stdout)."""

    def __init__(self, stream: Callable[[], Any]) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        stream = self._stream()
        escaped = text.translate(_TERMINAL_UNSAFE)
        if stream is sys.stdout and _has_fd(stream):
            # Through write_stdout: a table rich writes at once (threads of a large
            # namespace) is larger than a pipe takes, and Python's buffered stdout drops the
            # rest without a word when the reader goes away (exit 0, not 141).
            write_stdout(escaped.encode(stream.encoding, stream.errors or "strict"))
        else:
            stream.write(escaped)
        return len(text)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, flush...
        return getattr(self._stream(), name)


def _has_fd(stream: Any) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a test's capture: no fd
        return False
    return True


def printable(text: str, *, lines: bool = False) -> str:
    """``text`` as the terminal is to show it: what a thread holds was written by agents and
    their users, and an escape sequence in it (clear the screen, move the cursor, rewrite a
    line) or a bidi override would change what an auditor sees. Those come out escaped;
    ``lines`` keeps newlines and tabs (a message shown in full)."""
    return text.translate(_LINES if lines else _ONE_LINE)


def short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_id(turn_id: str | None) -> str:
    """The tail of a ULID: its random part, which tells turns apart."""
    if not turn_id:
        return "-"
    return "~" + turn_id[-8:] if len(turn_id) > 10 else turn_id


def message_text(message: es.Message) -> str:
    """A message's content as one readable line: text, tool calls and results, attachments."""
    if isinstance(message.content, str):
        return message.content
    bits: list[str] = []
    for part in message.content:
        if isinstance(part, es.TextPart):
            bits.append(part.text)
        elif isinstance(part, es.ReasoningPart):
            bits.append(f"(reasoning) {part.text}")
        elif isinstance(part, es.ToolCallPart):
            bits.append(f"call {part.tool_name}({compact_json(part.input, 80)})")
        elif isinstance(part, es.ToolResultPart):
            flag = " (error)" if part.is_error else ""
            bits.append(f"result of {part.tool_name}{flag}: {compact_json(part.output, 80)}")
        elif isinstance(part, es.FilePart):
            bits.append(f"[file {part.filename or part.media_type}]")
        elif isinstance(part, es.ImagePart):
            bits.append("[image]")
        elif isinstance(part, es.OtherPart):
            bits.append(f"[{part.kind}]")
    return " ".join(bits)


def tokens(usage: es.Usage) -> str:
    return f"{usage.input_tokens:,} in / {usage.output_tokens:,} out"


def outcome_style(status: str) -> str:
    return {
        "completed": "green",
        "open": "magenta",
        "failed": "red",
        "refused": "red",
    }.get(status, "yellow")


def record_label(record: TurnRecord) -> Text:
    """One line describing a turn record, for the turn tree."""
    status = record.outcome or "open"
    label = Text(printable(record.turn_id) + "  ")
    label.append(status if record.outcome else "open (not settled)", style=outcome_style(status))
    details = []
    if record.outcome is not None:
        details.append(plural(record.steps, "step"))
        if record.model_tier:
            details.append(record.model_tier)
        details.append(tokens(record.usage) + " tokens")
        if record.timing.settled_ms:
            details.append(fmt_duration(record.timing.duration_ms))
    for fb in record.fallbacks:
        details.append(f"fallback {fb.from_tier}->{fb.to_tier}")
    if details:
        label.append(printable("  " + ", ".join(details)), style="dim")
    if record.error is not None:
        error = f"{record.error.kind}: {record.error.message}"
        label.append("\n" + printable(error, lines=True), style="red")
    return label


def event_summary(event: es.RecordedEvent) -> str:
    """What an event says, in one line."""
    p = event.payload
    if isinstance(p, es.TurnOpened):
        kind = f"child of {short_id(p.parent_turn_id)}" if p.parent_turn_id else "root"
        text = f"turn {short_id(p.turn_id)} opened ({kind})"
        if p.request is not None:
            text += f": {short(message_text(p.request), 80)}"
        return text
    if isinstance(p, es.TurnSettled):
        text = f"turn {short_id(p.turn_id)} {p.outcome}, {plural(p.steps, 'step')}"
        if p.model_tier:
            text += f", {p.model_tier}"
        text += f", {tokens(p.usage)} tokens"
        if p.error is not None:
            text += f"; {p.error.kind}: {p.error.message}"
        if p.assistant_message is not None:
            text += f"; assistant: {short(message_text(p.assistant_message), 60)}"
        return text
    if isinstance(p, es.MessageAppended):
        return f"{p.message.role}: {short(message_text(p.message), 100)}"
    if isinstance(p, es.StateUpdated):
        return f"{p.block} = {compact_json(p.value, 100)}"
    if isinstance(p, es.TranscriptAppended):
        return f"+{len(p.messages)} transcript message{'s' if len(p.messages) != 1 else ''}"
    if isinstance(p, es.TranscriptReplaced):
        return f"transcript replaced ({p.reason}) by {plural(len(p.messages), 'message')}"
    return compact_json(p, 100)


def event_json(event: es.RecordedEvent) -> dict[str, Any]:
    return {
        "thread": event.thread_id,
        "seq": event.seq,
        "id": event.id,
        "time_ms": event.time_ms,
        "time": event.time.isoformat(),
        "type": event.type,
        "turn": event.turn_id,
        "payload": json_ready(event.payload),
    }


def json_ready(value: Any) -> Any:
    """``value`` as JSON-ready builtins, with every `Message` in its own JSON form (`to_json`:
    unknown fields in place, no ``extra`` / ``source`` bookkeeping)."""
    if isinstance(value, es.Message):
        return value.to_json()
    if isinstance(value, msgspec.Struct):
        out = msgspec.to_builtins(value)
        names = value.__struct_encode_fields__
        for index, field in enumerate(value.__struct_fields__):
            sub = getattr(value, field)
            if not _holds_message(sub):
                continue
            if isinstance(out, list):
                out[index] = json_ready(sub)
            elif names[index] in out:  # absent: left out as a default
                out[names[index]] = json_ready(sub)
        return out
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    return msgspec.to_builtins(value)


def _holds_message(value: Any) -> bool:
    if isinstance(value, es.Message):
        return True
    if isinstance(value, msgspec.Struct):
        return any(_holds_message(getattr(value, f)) for f in value.__struct_fields__)
    if isinstance(value, dict):
        return any(_holds_message(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_message(v) for v in value)
    return False


def messages_table(title: str, messages: Sequence[StoredMessage | TranscriptMessage]) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, expand=False)
    table.add_column("seq", justify="right", no_wrap=True)
    table.add_column("role", no_wrap=True)
    if messages and isinstance(messages[0], StoredMessage):
        table.add_column("turn", no_wrap=True)
    table.add_column("message", overflow="fold")
    for m in messages:
        row = [str(m.seq), m.message.role]
        if isinstance(m, StoredMessage):
            row.append(short_id(m.turn_id))
        row.append(message_text(m.message))
        table.add_row(*(Text(printable(cell, lines=True)) for cell in row))
    return table


def state_table(title: str, blocks: dict[str, Block]) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("block", no_wrap=True)
    table.add_column("version", justify="right", no_wrap=True)
    table.add_column("seq", justify="right", no_wrap=True)
    table.add_column("value", overflow="fold")
    for name, block in blocks.items():
        table.add_row(
            Text(printable(name)),
            str(block.version),
            str(block.seq),
            Text(printable(compact_json(block.value))),
        )
    return table


def turn_tree(title: str, nodes: Sequence[TurnNode]) -> Tree:
    tree = Tree(Text(title, style="bold"), guide_style="dim")

    def add(parent: Tree, node: TurnNode) -> None:
        branch = parent.add(record_label(node.record))
        for child in node.children:
            add(branch, child)

    for node in nodes:
        add(tree, node)
    return tree


def records_table(title: str, records: Sequence[TurnRecord]) -> Table:
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for name, justify in (
        ("seq", "right"),
        ("turn", "left"),
        ("parent", "left"),
        ("outcome", "left"),
        ("steps", "right"),
        ("tier", "left"),
        ("tokens in/out", "right"),
        ("took", "right"),
        ("error / fallbacks", "left"),
    ):
        table.add_column(name, justify=justify, no_wrap=name != "error / fallbacks")  # type: ignore[arg-type]
    for r in records:
        notes = []
        if r.error is not None:
            notes.append(f"{r.error.kind}: {r.error.message}")
        notes += [f"fallback {f.from_tier}->{f.to_tier} ({f.reason})" for f in r.fallbacks]
        status = r.outcome or "open"
        # Every value a caller chose goes in as Text: as a plain str, rich would read it as
        # markup ("[/]" in a turn id raises, "[red]" in a model tier is swallowed).
        table.add_row(
            str(r.seq),
            Text(printable(short_id(r.turn_id))),
            Text(printable(short_id(r.parent_turn_id))),
            Text(status, style=outcome_style(status)),
            str(r.steps),
            Text(printable(r.model_tier or "-")),
            f"{r.usage.input_tokens:,}/{r.usage.output_tokens:,}",
            fmt_duration(r.timing.duration_ms) if r.timing.settled_ms else "-",
            Text(printable("; ".join(notes), lines=True)),
        )
    return table


# -- commands -----------------------------------------------------------------------------------


async def _require_thread(ctx: Ctx, thread: str, *, reports_damage: bool = False) -> int:
    """The thread's version; a usage error when the thread has no events.

    Version 0 with entries in the log is not "no thread": its meta hash was lost or tampered
    with. A command that ``reports_damage`` (check, rebuild) says so in its report; any other
    would read the thread as empty (show) or its end as seq 0 (replay), so it fails here as
    the store's own reads do (`CorruptEventError`, exit 1, pointing to verify)."""
    es.validate_thread_id(thread)
    try:
        version = await ctx.store.version(thread)
    except es.WrongKeyTypeError:
        # Redis's words name no key: the thread whose meta hash it is, and where to look.
        raise es.WrongKeyTypeError(
            f"thread {thread!r}: its meta hash was replaced from outside threadlog by another "
            f"type of value (WRONGTYPE); run 'threadlog verify {thread}'"
        ) from None
    if version == 0:
        if not await ctx.store.read_raw(thread, count=1):
            raise UsageError(f"no thread {thread!r} in namespace {ctx.store.namespace!r}")
        if not reports_damage:
            raise log_without_meta(thread)
    return version


def _target(args: argparse.Namespace) -> str | None:
    """THREAD or --all (exactly one); returns the thread or None for --all."""
    if args.all and args.thread is not None:
        raise UsageError(
            f"give a THREAD or --all, not both (see 'threadlog {args.command} --help')"
        )
    if not args.all and args.thread is None:
        raise UsageError(f"give a THREAD or --all (see 'threadlog {args.command} --help')")
    thread: str | None = args.thread
    return thread


def _hint_args(ctx: Ctx, args: argparse.Namespace) -> str:
    """The --url/--namespace options a follow-up command needs to find the same data."""
    parts = []
    if ctx.where.given:
        parts.append(f"--url {shlex.quote(es.redact(ctx.where.url))}")
    if ctx.namespace_given:
        parts.append(f"--namespace {args.namespace}")
    return (" " + " ".join(parts)) if parts else ""


async def cmd_demo(ctx: Ctx, args: argparse.Namespace) -> None:
    out, store = ctx.out, ctx.store
    thread = f"demo-{es.new_ulid()}"
    out.print("[bold]threadlog demo[/]: a travel assistant's conversation, recorded as events")
    out.print(f"  store      {escape(ctx.where.describe())}")
    out.print(f"  namespace  {escape(store.namespace)} ({store.partitions} partitions)")
    out.print(f"  thread     {escape(thread)}")
    out.print()
    summary = await record_demo(store, thread)
    out.print(
        f"Recorded {summary.root_turns} user turns and {summary.child_turns} child turns "
        f"({summary.failed_turns} of the {summary.root_turns + summary.child_turns} failed), "
        f"{summary.state_updates} state updates and "
        f"{summary.compactions} transcript compaction: [bold]{summary.version} events[/], each "
        "append atomic with its views."
    )
    out.print()
    projector = Projector(store, state=demo_state())
    window = await projector.last(thread)
    out.print(
        messages_table(
            f"History window: the last {DEFAULT_WINDOW} messages, as the context assembler "
            "reads them",
            window,
        )
    )
    out.print(
        Text(
            "  The failed turn added its user message but no assistant reply; child turns "
            "added none.",
            style="dim",
        )
    )
    out.print()
    full = await projector.state(thread)
    view = await projector.state(thread, PLANNER_VIEW)
    out.print(state_table(f"State as the {PLANNER_VIEW!r} reader view sees it", view))
    hidden = _hidden_fields(full, view)
    if hidden:
        out.print(Text(f"  Hidden from this reader: {', '.join(hidden)}.", style="dim"))
    out.print()
    nodes = await projector.turn_tree(thread)
    out.print(turn_tree("Turn records: root turns and their child turns", nodes), soft_wrap=False)
    out.print()
    verdict = await Auditor(store).verify(thread)
    _print_verdict(ctx, verdict)
    out.print()
    extra = _hint_args(ctx, args)
    if ctx.where.url.startswith("memory:"):
        out.print("The in-memory backend keeps nothing after this command exits.")
    else:
        out.print("Explore it further:")
        for command in ("show", "replay", "verify"):
            out.print(Text(f"  threadlog {command} {thread}{extra}"))
        out.print(
            Text(
                f"  threadlog show {thread} --as-of {summary.failing_seq}{extra}   "
                "(the thread while its turn was failing)"
            )
        )
    if not ctx.where.given and ctx.where.embedded is not None:
        out.print(
            Text(
                "The embedded redis-server keeps running for the next command; "
                "'threadlog stop' stops it.",
                style="dim",
            )
        )
    if not verdict.ok:
        raise Failed


def _hidden_fields(full: dict[str, Block], view: dict[str, Block]) -> list[str]:
    hidden: list[str] = []
    for name, block in full.items():
        seen = view.get(name)
        if seen is None:
            hidden.append(name)
        elif isinstance(block.value, dict) and isinstance(seen.value, dict):
            hidden += [f"{name}.{key}" for key in block.value if key not in seen.value]
    return hidden


async def _version_or_none(store: es.EventStore, thread_id: str) -> int | None:
    """A listed thread's version; None when its meta is damaged (a listing names the thread
    and goes on: `verify` says what is wrong), a meta replaced by another type of value too."""
    try:
        return await store.version(thread_id)
    except (es.CorruptEventError, es.WrongKeyTypeError):
        return None


async def _versions_or_none(store: es.EventStore, thread_ids: list[str]) -> list[int | None]:
    """`_version_or_none` of each thread, asked 512 threads a round trip (a listing of every
    thread of a large namespace made one round trip a thread)."""
    out: list[int | None] = []
    for i in range(0, len(thread_ids), 512):
        chunk = thread_ids[i : i + 512]
        try:
            out += await store.versions(chunk)
        except (es.CorruptEventError, es.WrongKeyTypeError):  # each alone says which
            out += [await _version_or_none(store, t) for t in chunk]
    for i, (thread_id, version) in enumerate(zip(thread_ids, out, strict=True)):
        # Listed with no version: its meta hash is gone while its log is there (damage), or
        # it was deleted after the index was read (its log is gone too: 0 events it is).
        if version == 0 and await store.read_raw(thread_id, count=1):
            out[i] = None
    return out


async def cmd_threads(ctx: Ctx, args: argparse.Namespace) -> None:
    store = ctx.store
    limit = args.limit or None
    # One more than shown says whether there are more; not past the 64-bit limit Redis takes
    # (--limit 9223372036854775807 was "redis error: value is not an integer").
    asked = None if limit is None or limit >= MAX_NUMBER else limit + 1
    infos = await store.threads(limit=asked)
    more = limit is not None and len(infos) > limit
    infos = infos[:limit] if limit is not None else infos
    versions = await _versions_or_none(store, [info.thread_id for info in infos])
    rows = list(zip(infos, versions, strict=True))
    if args.json:
        ctx.json(
            {
                "namespace": store.namespace,
                "threads": [
                    {
                        "thread": info.thread_id,
                        "version": version,
                        # Said as the table says it: a null version alone reads as unknown.
                        "damaged": version is None,
                        "last_activity_ms": info.last_activity_ms,
                        "last_activity": fmt_time(info.last_activity_ms),
                        "partition": info.partition,
                    }
                    for info, version in rows
                ],
                "more": more,
            }
        )
        return
    if not rows:
        ctx.out.print(f"No threads in namespace {escape(store.namespace)!r}.")
        return
    table = Table(
        title=f"Threads in namespace {store.namespace!r}, most recent activity first",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("thread", overflow="fold")
    table.add_column("events", justify="right", no_wrap=True)
    table.add_column("last activity", no_wrap=True)
    table.add_column("partition", justify="right", no_wrap=True)
    for info, version in rows:
        table.add_row(
            Text(printable(info.thread_id)),  # escaped before rich measures the column
            "damaged" if version is None else str(version),
            fmt_time(info.last_activity_ms),
            str(info.partition),
        )
    ctx.out.print(table)
    if more:
        ctx.out.print(Text(f"(more threads: raise --limit {limit} or use --limit 0)", style="dim"))


@dataclass
class _Shown:
    version: int
    messages: list[StoredMessage]
    state: dict[str, Block]
    turns: list[TurnRecord]
    records: list[TurnRecord]
    transcript: list[TranscriptMessage]


async def _read_thread(
    projector: Projector, thread: str, window: int, as_of: AsOf | None
) -> _Shown:
    """The read models of a thread: current ones in one atomic read, past ones by a fold (which
    finds the seq ``as_of`` stands for in the life of the thread it folds)."""
    sp, rp, tp = (
        projector.state_projection,
        projector.records_projection,
        projector.transcript_projection,
    )
    if as_of is not None:
        folded = await projector.fold(thread, as_of=as_of)
        records_state = folded.states[rp.name]
        return _Shown(
            version=folded.version,
            messages=MessagesProjection.window(folded.states[projector.messages.name], window),
            state=sp.select(folded.states[sp.name], None),
            turns=RecordsProjection.all_records(thread, records_state),
            records=RecordsProjection.settled_records(thread, records_state),
            transcript=list(folded.states[tp.name]),
        )
    reads = [
        sp.read_for(None),
        rp.full_reads()[0],
        RecordsProjection.settled_read(None),
        *tp.full_reads(),
    ]
    if window:
        reads.append(MessagesProjection.window_read(window))
    snap = await projector.store.read_views(thread, reads)
    results = snap.results
    turns = sorted(RecordsProjection.parse(thread, results[1]), key=lambda r: r.turn_id)
    return _Shown(
        version=snap.version,
        messages=MessagesProjection.parse(results[4]) if window else [],
        state=sp.parse(results[0], None),
        turns=turns,
        records=RecordsProjection.parse(thread, results[2]),
        transcript=TranscriptProjection.parse(results[3]),
    )


async def _as_of_seq(projector: Projector, thread: str, as_of: AsOf) -> int:
    """The seq ``--as-of`` stands for; a seq the thread has not reached is a usage error (a
    fold "up to" it would pass the thread as it is now for the past point asked about)."""
    try:
        return await projector.seq_of(thread, as_of)
    except SeqBeyondVersionError as exc:
        raise _beyond(thread, exc) from None


def _beyond(thread: str, exc: SeqBeyondVersionError) -> UsageError:
    return UsageError(f"--as-of {exc.seq}: thread {thread!r} ends at seq {exc.version}")


async def cmd_show(ctx: Ctx, args: argparse.Namespace) -> None:
    thread: str = args.thread
    version = await _require_thread(ctx, thread)
    projector = ctx.projector
    try:
        # The point is found by the fold itself: a seq found beforehand could be one of a
        # life of the thread that was replaced before the fold read it.
        shown = await _read_thread(projector, thread, args.window, args.as_of)
    except SeqBeyondVersionError as exc:
        raise _beyond(thread, exc) from None
    as_of = None if args.as_of is None else shown.version
    whole_tree = RecordsProjection.tree(shown.turns)
    limit: int | None = args.turns or None
    tree = whole_tree[-limit:] if limit else whole_tree
    records = shown.records[-limit:] if limit else shown.records
    if args.json:
        ctx.json(
            {
                "namespace": ctx.store.namespace,
                "thread": thread,
                "version": shown.version,
                "latest_version": version,
                "as_of": as_of,
                "messages": shown.messages,
                "state": shown.state,
                "turns": len(shown.turns),
                # What --turns left out, as the human titles say it ("the last 2 of 4 root
                # turns"): the lists alone cannot tell the last turns from all of them.
                "root_turns": len(whole_tree),
                "settled_turns": len(shown.records),
                "turn_tree": tree,
                "records": records,
                "transcript": shown.transcript,
            }
        )
        return
    out = ctx.out
    head = Text("Thread ", style="bold")
    head.append(printable(thread))
    head.append(f"  namespace {ctx.store.namespace}, version {version}")
    out.print(head)
    if as_of is not None:
        when = ""
        if shown.version:
            async for event in ctx.store.read(thread, start=shown.version, stop=shown.version):
                when = f", recorded {fmt_time(event.time_ms)}"
        out.print(Text(f"as of seq {shown.version}{when} (folded from the log)", style="yellow"))
        if shown.version == 0:
            out.print("Nothing had been recorded in this thread by then.")
            return
    out.print()
    n = args.window
    if n:
        title = f"History window: the last {plural(n, 'message')}"
        if shown.messages:
            out.print(messages_table(title, shown.messages))
        else:
            _print_empty(out, title, "(no messages)")
    title = f"State: {plural(len(shown.state), 'block')}"
    if shown.state:
        out.print(state_table(title, shown.state))
    else:
        _print_empty(out, title, "(no state blocks)")
    title = f"Turn tree: {plural(len(shown.turns), 'turn')}"
    if len(tree) < len(whole_tree):
        title += f", the last {len(tree)} of {len(whole_tree)} root turns"
    if tree:
        out.print(turn_tree(title, tree), soft_wrap=False)
        out.print()
    else:
        _print_empty(out, title, "(no turns)")
    title = f"Turn records in settle order: {len(shown.records)}"
    if len(records) < len(shown.records):
        title += f", the last {len(records)}"
    if records:
        out.print(records_table(title, records))
    else:
        _print_empty(out, title, "(no turn records)")
    if shown.transcript:
        title = f"Session transcript: {plural(len(shown.transcript), 'message')}"
        recent = shown.transcript[-n:] if n else []
        if not recent:
            out.print(title)
            return
        if len(recent) < len(shown.transcript):
            title += f", the last {len(recent)}"
        out.print(messages_table(title, recent))


def _print_empty(out: Console, title: str, empty: str) -> None:
    """A section with nothing in it: its title and one line saying so, not a table of headers
    alone, which reads like output cut short (or a bug)."""
    out.print(Text(title, style="italic"))
    out.print(Text(f"  {empty}"))
    out.print()


async def cmd_replay(ctx: Ctx, args: argparse.Namespace) -> None:
    thread: str = args.thread
    version = await _require_thread(ctx, thread)
    if args.as_of is not None:  # refused before anything is printed when past the end
        point = await _as_of_seq(ctx.projector, thread, args.as_of)
        if point == 0:  # a time before its first event: nothing to replay, as show says
            if not args.json:
                ctx.out.print("Nothing had been recorded in this thread by then.")
            return
        if args.start > point:
            # An empty replay would read as a range with no events, not as options that
            # contradict each other.
            shown = args.as_of if isinstance(args.as_of, int) else args.as_of.isoformat()
            raise UsageError(f"--from {args.start} comes after --as-of {shown} (seq {point})")
    # Without --as-of, up to the version there was when the replay began: a point the log
    # must reach. Entries it lost at its end are then damage, said as a hole is (an open
    # end would stop at the last entry there is without a word).
    as_of: AsOf = version if args.as_of is None else args.as_of
    if args.stop is not None and args.stop < args.start:
        raise UsageError(f"--to {args.stop} comes before --from {args.start}")
    if args.start > version:
        # As --as-of past the end is: an empty replay (nothing at all with --json) would read
        # as a thread with nothing there, not as a seq mistyped or from another thread.
        raise UsageError(f"--from {args.start}: thread {thread!r} ends at seq {version}")
    auditor = Auditor(ctx.store)
    out = ctx.out
    type_width = _type_width(ctx.store.registry)
    count = 0
    expected = args.start
    gaps = 0

    def missing_row(first: int, last: int) -> None:
        # In --json mode a hole is a row of the stream (tail's kind), so that a reader of the
        # stream alone sees it, besides the note on stderr for whoever watches the run.
        row = {"thread": thread, "type": "events.missing", "first": first, "last": last}
        detail = "missing from the log: the log was damaged"
        write_stdout(json_bytes({**row, "detail": detail}) + b"\n")

    steps = _replaced_if_shorter(
        thread,
        auditor.replay(thread, start=args.start, stop=args.stop, as_of=as_of),
        given=args.as_of is not None,
    )
    if args.json:
        end = point if args.as_of is not None else version
        steps = _missing_end_as_row(steps, min(end, args.stop or end), missing_row)
    async for step in steps:
        count += 1
        event = step.event
        if event.seq != expected:
            # Seqs are dense; a hole means entries were removed from the log. Say so where
            # it is and end with exit code 1, as verify would.
            gaps += 1
            hole = f"{_span(expected, event.seq - 1)} missing from the log"
            note = f"{hole}: the log was damaged (run 'threadlog verify {thread}')"
            if args.json:
                missing_row(expected, event.seq - 1)
                ctx.err.print(Text(f"threadlog: {note}"))
            else:
                out.print(Text(f"!      {note}", style="bold red"))
        expected = event.seq + 1
        if args.json:
            row = event_json(event)
            row["models"] = {
                "messages": len(step.messages),
                "state_blocks": len(step.state),
                "turns": len(step.records),
                "transcript": len(step.transcript),
            }
            write_stdout(json_bytes(row) + b"\n")
            continue
        line = Text(f"#{event.seq:<5} {fmt_time(event.time_ms)}  ")
        line.append(f"{event.type:<{type_width}} ", style="cyan")
        line.append(printable(event_summary(event)))
        models = (
            f"  [messages {len(step.messages)}, blocks {len(step.state)}, "
            f"turns {len(step.records)}, transcript {len(step.transcript)}]"
        )
        line.append(models, style="dim")
        out.print(line)
    if count == 0 and not args.json:
        out.print("No events in that range.")
    if args.stop is not None and args.stop > version and args.as_of is None:
        # Replayed to the end, which is fine; said, so that a seq mistyped (or meant for
        # another thread) is not read as the point the replay stopped at.
        note = f"--to {args.stop}: thread {thread!r} ends at seq {version}"
        if args.json:
            ctx.err.print(Text(printable(f"threadlog: {note}")))
        else:
            out.print(Text(printable(note), style="yellow"))
    if gaps:
        raise Failed


async def _missing_end_as_row(
    steps: AsyncIterator[ReplayStep], end: int, missing_row: Callable[[int, int], None]
) -> AsyncIterator[ReplayStep]:
    """``steps``; entries lost at the end of the range (the replay ends with a
    `CorruptEventError` at the first) are written as a row first, as a hole inside it is."""
    try:
        async for step in steps:
            yield step
    except es.CorruptEventError as exc:
        if exc.seq is not None and exc.reason.startswith("missing from the log"):
            missing_row(exc.seq, max(exc.seq, end))
        raise


async def _replaced_if_shorter(
    thread: str, steps: AsyncIterator[ReplayStep], *, given: bool
) -> AsyncIterator[ReplayStep]:
    """``steps``; a version the replay began at that the thread no longer reaches (it was
    deleted and written again since) is said as such, not as a past point asked for."""
    try:
        async for step in steps:
            yield step
    except SeqBeyondVersionError:
        if given:
            raise
        raise es.ThreadReplacedError(thread) from None


async def _feed_positions(
    store: es.EventStore, partitions: Sequence[int], since: datetime | None
) -> dict[int, str]:
    """Where following starts in each partition: at ``since``, or at the feed's current end."""
    if since is not None:
        ms = int(since.timestamp() * 1000)
        start = f"{ms - 1}-{_MAX_STREAM_ID_SEQ}" if ms > 0 else "0-0"
        return dict.fromkeys(partitions, start)
    # The newest id each feed ever gave: what comes after it is new. (Not a time read off the
    # threads' activity and read on from: under a high append rate that is a long read before
    # anything is shown, and a server clock that stepped back past it gives new changes ids
    # below it, which tail then passed over.) It is never before what was trimmed already.
    return {p: (await store.feed_info(p)).last_id for p in partitions}


@dataclass(frozen=True)
class _FeedGap:
    """Changes trimmed from a partition's feed before tail read them: every one after
    ``after`` (tail's position) up to ``id`` (the newest removed), which places it in time."""

    partition: int
    after: str
    id: str


async def _read_partition(
    store: es.EventStore, partition: int, position: str
) -> list[es.FeedEntry | _FeedGap]:
    """The next page of a partition's feed after ``position``, led by a `_FeedGap` when the
    feed was trimmed past ``position`` before the page was read: never skipped in silence."""
    page: list[es.FeedEntry | _FeedGap] = []
    page += await store.read_feed(partition, after=position, count=TAIL_FEED_PAGE)
    # Asked after the read: a trim that came first removed everything up to its newest id, so
    # the page starts above it. A trim that came after the read (the page starts at or below
    # its newest id) took entries the page holds, and those after it the next read reports.
    trimmed = (await store.feed_info(partition)).trimmed_to
    newest_removed = parse_stream_id(trimmed)
    if newest_removed > parse_stream_id(position) and (
        not page or newest_removed < parse_stream_id(page[0].id)
    ):
        page.insert(0, _FeedGap(partition, position, trimmed))
    return page


_OUTAGE_FIRST_BACKOFF = 0.2
_OUTAGE_LAST_BACKOFF = 5.0


class _Outage:
    """A long-running command's wait for a server that stopped answering: said once on
    stderr when it starts and once when it ends, with backoffs doubling in between."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.backoff = _OUTAGE_FIRST_BACKOFF

    async def wait(self, exc: Exception) -> None:
        if self.since is None:
            self.since = time.monotonic()
            sys.stderr.write(
                f"threadlog: the server does not answer ({printable(str(exc))}); waiting for it "
                "(Ctrl-C stops)\n"
            )
            sys.stderr.flush()
        await anyio.sleep(self.backoff)
        self.backoff = min(self.backoff * 2, _OUTAGE_LAST_BACKOFF)

    def over(self, then: str = "following on") -> None:
        if self.since is not None:
            sys.stderr.write(
                f"threadlog: the server answers again after {time.monotonic() - self.since:.1f}"
                f" s; {then}\n"
            )
            sys.stderr.flush()
            self.since, self.backoff = None, _OUTAGE_FIRST_BACKOFF


async def _stop_on_signal(
    scope: anyio.CancelScope, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            scope.cancel()
            return


async def _await_namespace(
    ctx: Ctx, interval: float, stack: contextlib.AsyncExitStack
) -> es.EventStore | None:
    """A store of the namespace as it is written, once it exists; None when it existed
    already (``ctx.store`` is that). A store opened before its namespace was written took
    the default settings, not the ones its first writer records (a partition count of
    4 puts threads in other partitions than 16 would): tail opens it again once it is there."""
    store = ctx.store
    if await store.namespace_exists():
        return None
    sys.stderr.write(
        f"threadlog: namespace {store.namespace!r} has not been written yet; waiting for it\n"
    )
    sys.stderr.flush()
    outage = _Outage()  # a restart while tail waits is waited out, as one while it follows
    while True:
        await anyio.sleep(interval)
        try:
            if not await store.namespace_exists():
                outage.over("still waiting for the namespace")
                continue
            opened = await es.connect(
                ctx.where.url, namespace=store.namespace, create_namespace=False
            )
        except UNREACHABLE as exc:
            await outage.wait(exc)
            continue
        outage.over()
        return await stack.enter_async_context(opened)


async def cmd_tail(ctx: Ctx, args: argparse.Namespace) -> None:
    thread: str | None = args.thread
    if thread is not None:
        es.validate_thread_id(thread)
    async with contextlib.AsyncExitStack() as stack, anyio.create_task_group() as tg:
        await tg.start(_stop_on_signal, tg.cancel_scope)
        reopened = await _await_namespace(ctx, args.interval, stack)
        await _tail(ctx, reopened or ctx.store, args, new=reopened is not None)
        tg.cancel_scope.cancel()


async def _tail(ctx: Ctx, store: es.EventStore, args: argparse.Namespace, *, new: bool) -> None:
    """Follow ``store``'s feed; ``new``: its namespace was written after tail started, so all
    it holds is new (unless ``--since`` says where to start)."""
    thread: str | None = args.thread
    if thread is not None:
        partitions = [es.partition_of(thread, store.partitions)]
    else:
        partitions = list(range(store.partitions))
    limit: int | None = args.limit or None
    shown = 0

    def say(line: Text | dict[str, Any]) -> None:
        if isinstance(line, dict):
            write_stdout(json_bytes(line) + b"\n")
        else:
            ctx.out.print(line)

    def emit(line: Text | dict[str, Any]) -> bool:
        """Show a line about events (or a deletion): one of the --limit's N."""
        nonlocal shown
        say(line)
        shown += 1
        return limit is not None and shown >= limit

    async def follow(positions: dict[int, str]) -> None:
        # Changes are shown in feed-id (time) order across partitions, not partition by
        # partition: a partition's next change is shown only once every other partition has
        # one pending or has none waiting, so a catch-up from --since reads as one timeline.
        pending: dict[int, deque[es.FeedEntry | _FeedGap]] = {p: deque() for p in partitions}
        more: set[int] = set()  # partitions whose last read filled a page: more may follow
        outage = _Outage()
        while True:
            try:
                done = await step(pending, more, positions)
            except UNREACHABLE as exc:
                # A restart or failover: wait for the server and go on where tail was (the
                # positions and the changes pending move only once shown), as `tail -f` does.
                await outage.wait(exc)
                continue
            outage.over()
            if done:
                return

    async def step(
        pending: dict[int, deque[es.FeedEntry | _FeedGap]],
        more: set[int],
        positions: dict[int, str],
    ) -> bool:
        """Read and show what the feeds hold next; True once the --limit is reached."""
        for p in partitions:
            if not pending[p]:
                page = await _read_partition(store, p, positions[p])
                pending[p].extend(page)
                if page:
                    positions[p] = page[-1].id
                if sum(isinstance(e, es.FeedEntry) for e in page) == TAIL_FEED_PAGE:
                    more.add(p)
                else:
                    more.discard(p)
        if not any(pending.values()):
            await anyio.sleep(args.interval)
            return False
        while True:
            heads = [p for p in partitions if pending[p]]
            if not heads or any(not pending[q] for q in more):
                break  # a partition to read on before anything later is shown
            p = min(heads, key=lambda q: parse_stream_id(pending[q][0].id))
            entry = pending[p].popleft()
            if isinstance(entry, _FeedGap):
                _show_gap(entry, say, json=args.json)  # a notice, not one of the --limit's
                continue
            if thread is not None and entry.thread_id != thread:
                continue
            if es.partition_of(entry.thread_id, store.partitions) != p:
                # Its events are not where this store looks: read with the wrong layout,
                # they would all be shown as deleted.
                raise UsageError(
                    f"namespace {store.namespace!r} no longer has the {store.partitions} "
                    "partitions tail started with (deleted and written again?): run tail "
                    "again"
                )
            shown_to = [entry.first_seq]
            try:
                if await _show_change(store, entry, emit, json=args.json, shown_to=shown_to):
                    return True
            except UNREACHABLE:
                # Shown up to a page boundary: the rest of the change is shown when the
                # server answers again, nothing twice.
                pending[p].appendleft(msgspec.structs.replace(entry, first_seq=shown_to[0]))
                raise
        return False

    if new and args.since is None:
        positions = dict.fromkeys(partitions, "0-0")
    else:
        positions = await _feed_positions(store, partitions, args.since)
    what = f"thread {thread!r}" if thread is not None else "every thread"
    since = f" since {args.since.isoformat(timespec='seconds')}" if args.since else ""
    if args.since is not None and args.since > datetime.now(UTC):
        # Else it reads as a hang: changes made before then are not shown, now or later.
        since += " (a time still to come: changes made before it are not shown)"
    sys.stderr.write(
        f"threadlog: following {what} in namespace {store.namespace!r}{since}; Ctrl-C stops\n"
    )
    sys.stderr.flush()
    await follow(positions)


def _show_gap(gap: _FeedGap, say: Callable[[Text | dict[str, Any]], None], *, json: bool) -> None:
    """Say that changes were trimmed from the feed unseen (tail goes on after them)."""
    ms = parse_stream_id(gap.id)[0]
    if json:
        row = {"type": "feed.trimmed", "partition": gap.partition, "after": gap.after}
        say({**row, "trimmed_to": gap.id, "time_ms": ms})
        return
    since = "" if gap.after == "0-0" else f" after {_id_time(gap.after)}"
    line = Text(f"{fmt_time(ms)}  partition {gap.partition}  ")
    line.append(
        f"changes{since} up to {fmt_time(ms)} not shown: the change feed was trimmed past "
        "them (their events are still in the threads' logs; run 'threadlog feed')",
        style="red",
    )
    say(line)


def _type_width(registry: es.EventRegistry) -> int:
    """The event-type column's width: the longest type name the registry knows (the
    framework adapters' names are longer than the core's)."""
    return max(map(len, registry.tags()), default=20)


async def _show_change(
    store: es.EventStore,
    entry: es.FeedEntry,
    emit: Callable[[Text | dict[str, Any]], bool],
    *,
    json: bool,
    shown_to: list[int] | None = None,
) -> bool:
    """Print the events of one feed entry; True once the --limit is reached. ``shown_to[0]``
    is kept at the first seq not yet shown (a read that fails leaves the rest to show)."""
    type_width = _type_width(store.registry)
    if entry.deleted:
        if json:
            row = {"thread": entry.thread_id, "type": "thread.deleted", "version": entry.last_seq}
            return emit({**row, "time_ms": entry.time_ms})
        line = Text(f"{fmt_time(entry.time_ms)}  {entry.thread_id}  ")
        line.append(f"thread deleted (it had {plural(entry.last_seq, 'event')})", style="red")
        return emit(line)
    # Read in the feed entry's own incarnation: if the thread was deleted (and perhaps created
    # again) since, its seqs name other events now, or none, and those must not be shown as
    # these. Each page checks the incarnation and reads in one atomic step.
    seq, last = entry.first_seq, entry.last_seq

    def damaged(first: int, upto: int, why: str, kind: str = "events.missing") -> bool:
        # Never skipped in silence: events the feed names that the thread's own life no
        # longer holds (or holds undecodable) are damage to the log, shown where they would
        # have been; an event of a type this process does not know is said as such.
        if json:  # each row type written out: the README lists them (a test reads these)
            thread = entry.thread_id
            if kind == "events.unknown_type":
                row = {"thread": thread, "type": "events.unknown_type", "first": first}
            elif kind == "events.undecodable":
                row = {"thread": thread, "type": "events.undecodable", "first": first}
            else:
                row = {"thread": thread, "type": "events.missing", "first": first}
            return emit({**row, "last": upto, "time_ms": entry.time_ms, "detail": why})
        span = f"events #{first}..{upto}" if first < upto else f"event #{first}"
        line = Text(f"{fmt_time(entry.time_ms)}  {entry.thread_id}  ")
        hint = (
            _UNKNOWN_TYPE_HINT
            if kind == "events.unknown_type"
            else f"run 'threadlog verify {entry.thread_id}'"
        )
        line.append(printable(f"{span}: {why} ({hint})"), style="red")
        return emit(line)

    def undecodable(first: int, upto: int, exc: es.CorruptEventError) -> bool:
        kind = "events.unknown_type" if exc.unknown_type else "events.undecodable"
        return damaged(first, upto, _RUN_VERIFY.sub("", exc.reason), kind)

    while seq <= last:
        if shown_to is not None:
            shown_to[0] = seq  # a page shows whole or not at all: the read is its only await
        stop = min(last, seq + TAIL_PAGE - 1)
        try:
            rows = await store.read_raw(
                entry.thread_id,
                start=seq,
                stop=stop,
                count=TAIL_PAGE,
                incarnation=entry.incarnation,
            )
        except es.CorruptEventError as exc:
            if undecodable(seq, stop, exc):
                return True
            seq = stop + 1
            continue
        if not rows:
            gone = f"events #{seq}..{last}" if seq < last else f"event #{seq}"
            note = f"{gone}: not in the log any more (the thread was deleted since)"
            if json:
                row = {"thread": entry.thread_id, "type": "events.gone", "first": seq}
                return emit({**row, "last": last, "time_ms": entry.time_ms})
            line = Text(f"{fmt_time(entry.time_ms)}  {entry.thread_id}  ")
            line.append(note, style="yellow")
            return emit(line)
        for raw_id, fields in rows:
            at = int(raw_id.split(b"-", 1)[0])
            if at > seq and damaged(seq, at - 1, "missing from the log"):
                return True
            try:
                event = decode_entry(entry.thread_id, raw_id, fields, store.registry)
            except es.CorruptEventError as exc:
                if undecodable(at, at, exc):
                    return True
                seq = at + 1
                continue
            if json:
                done = emit(event_json(event))
            else:
                line = Text(f"{fmt_time(event.time_ms)}  {event.thread_id} #{event.seq}  ")
                line.append(f"{event.type:<{type_width}} ", style="cyan")
                line.append(printable(event_summary(event)))  # as replay: see `printable`
                done = emit(line)
            if done:
                return True
            seq = event.seq + 1
        if seq <= stop:
            if damaged(seq, stop, "missing from the log"):
                return True
            seq = stop + 1
    return False


def _entries(n: int) -> str:
    return f"{n:,} entry" if n == 1 else f"{n:,} entries"


def _id_time(feed_id: str | None) -> str:
    return "-" if feed_id is None or feed_id == "0-0" else fmt_time(parse_stream_id(feed_id)[0])


async def cmd_feed(ctx: Ctx, args: argparse.Namespace) -> None:
    store = ctx.store
    infos = [await store.feed_info(p) for p in range(store.partitions)]
    # Where each group's reader has got to (a projection's checkpoint when it has one), how
    # much it has left, and whether the feed was trimmed past it: `feed_group_lag`.
    groups: dict[str, list[GroupLag]] = {}
    for row in await feed_group_lag(store):
        groups.setdefault(row.name, []).append(row)
    if args.json:
        ctx.json(
            {
                "namespace": store.namespace,
                "partitions": [msgspec.to_builtins(i) for i in infos],
                "groups": [
                    {
                        "name": g.name,
                        "last_delivered": g.last_delivered,
                        "pending": g.pending,
                        "oldest_pending": g.oldest_pending,
                        "partition": g.partition,
                        "reached": g.position,
                        "lost_changes": g.lost_changes,
                        "unread": g.unread,
                        "registered": g.registered,
                        "feed_reset": g.feed_reset,
                        "damaged": g.damaged,
                    }
                    for members in groups.values()
                    for g in members
                ],
            }
        )
        return
    out = ctx.out
    used = [i for i in infos if i.last_id != "0-0"]
    total = sum(i.length for i in infos)
    out.print(
        f"Change feed of namespace {store.namespace!r}: {_entries(total)} in "
        f"{plural(len(used), 'partition')} of {store.partitions}"
    )
    if used:
        table = Table(box=box.SIMPLE_HEAD)
        for name in ("partition", "entries", "oldest", "newest", "trimmed up to"):
            table.add_column(name, justify="right" if name in {"partition", "entries"} else "left")
        for i in used:
            table.add_row(
                str(i.partition),
                f"{i.length:,}",
                _id_time(i.first_id),
                _id_time(i.last_id),
                _id_time(i.trimmed_to) if i.trimmed_to != "0-0" else "never trimmed",
            )
        out.print(table)
    if not groups:
        out.print("No consumer groups: trimming removes entries only by age (--max-age).")
        return
    table = Table(title="Consumer groups", title_justify="left", box=box.SIMPLE_HEAD)
    for name in ("group", "reader", "partitions", "unread", "unread from", "pending", "note"):
        right = name in {"partitions", "unread", "pending"}
        table.add_column(name, justify="right" if right else "left")
    for name, members in sorted(groups.items()):
        unread = [g.oldest_unread for g in members if g.oldest_unread is not None]
        damaged = [g.partition for g in members if g.lost_changes]
        reset = [g.partition for g in members if g.feed_reset]
        broken = [g for g in members if g.damaged is not None]
        note = Text()
        if damaged:
            where = ", ".join(str(p) for p in damaged)
            note.append(f"lost changes: the feed was trimmed past it (partition {where})", "red")
        if reset:
            # A projection whose feed was deleted under it: no group left, its runner stops.
            where = ", ".join(str(p) for p in reset)
            note.append(
                f"{'; ' if damaged else ''}feed reset under it (partition {where}): run the "
                "projection under a new name with backfill (a retired one: forget-projection)",
                "red",
            )
        for g in broken:
            # Its reader stops on that partition until the checkpoint is put right.
            note.append(
                f"{'; ' if len(note) else ''}damaged checkpoint (partition {g.partition}): "
                f"{printable(g.damaged or '')}",
                "red",
            )
        reader = f"export --name {name[7:]}" if name.startswith("export-") else "projection runner"
        table.add_row(
            # As Text: a group made by another tool may be named anything, and as a plain str
            # rich reads it as markup ("[/]" stopped the command with an internal error).
            Text(printable(name)),
            Text(printable(reader)),
            str(len(members)),
            f"{sum(g.unread for g in members):,}",
            _id_time(min(unread, key=parse_stream_id)) if unread else "nothing unread",
            f"{sum(g.pending for g in members):,}",
            note,
        )
    out.print(table)


async def cmd_trim_feed(ctx: Ctx, args: argparse.Namespace) -> None:
    store = ctx.store
    removed = 0
    for p in range(store.partitions):
        removed += await store.trim_feed(p, max_age_ms=args.max_age)
    left = sum([(await store.feed_info(p)).length for p in range(store.partitions)])
    if args.json:
        ctx.json({"namespace": store.namespace, "removed": removed, "left": left})
        return
    ctx.out.print(
        f"Removed {_entries(removed)} from the change feed of namespace {store.namespace!r}; "
        f"it holds {_entries(left)} (every event stays in its thread's log)"
    )


async def cmd_drop_group(ctx: Ctx, args: argparse.Namespace) -> None:
    store = ctx.store
    name = validate_group_to_drop(args.name)
    dropped = await drop_feed_group(store, name)
    if not dropped:
        known = sorted(
            {g.name for p in range(store.partitions) for g in await store.feed_groups(p)}
        )
        has = f"its groups: {', '.join(known)}" if known else "it has none"
        raise UsageError(
            f"no consumer group {name!r} in namespace {store.namespace!r} ({has}; an export's "
            "group is export-<its --name>)"
        )
    # escape: a group another tool made may be named "[/]", which rich reads as markup.
    ctx.out.print(
        escape(f"Dropped consumer group {name!r} from {plural(len(dropped), 'partition')}; ")
        + "trimming no longer waits for it"
    )


async def cmd_forget_projection(ctx: Ctx, args: argparse.Namespace) -> None:
    store = ctx.store
    forgotten = await forget_projection(store, args.name, hashes=args.hashes)
    if not forgotten.found:
        known = sorted(
            {n for p in range(store.partitions) for n in await store.checkpoints(p, damaged={})}
        )
        has = f"its async projections: {', '.join(known)}" if known else "it has none"
        raise UsageError(
            f"no async projection {args.name!r} in namespace {store.namespace!r} ({has}; "
            "'threadlog feed' lists the feed's readers)"
        )
    if args.json:
        ctx.json(forgotten)
        return
    figures = sorted({h for names in forgotten.hashes.values() for h in names})
    parts = [
        f"its group on {plural(len(forgotten.groups), 'partition')}",
        f"its checkpoint on {plural(len(forgotten.checkpoints), 'partition')}",
        (f"{len(figures)} hash" if len(figures) == 1 else f"{len(figures)} hashes")
        + " of figures"
        + (f" ({', '.join(figures)})" if figures else ""),
    ]
    ctx.out.print(
        escape(f"Forgot async projection {args.name!r} in namespace {store.namespace!r}: ")
        + "; ".join(parts)
    )


_OF_THE_INDEX = " of the thread index"  # an audit of every thread by a user without +scan


class _EveryThread:
    """An audit of every thread of the namespace (verify, check, rebuild --all) that falls
    back to the thread index's threads when the Redis user may not SCAN the keys: a tenant's
    user (`eventstore.acl_rules`) is refused SCAN, as Redis does not confine it to the user's
    key pattern, and would otherwise not be able to audit its namespace at all."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.index_only = False

    async def run(self, job: Callable[[bool], Awaitable[R]]) -> R:
        """``job(index_only)``: first with the keys scanned; without, once SCAN was denied
        (the listing comes first, so nothing was audited twice)."""
        try:
            return await job(False)
        except es.OperationalError as exc:
            if _SCAN_DENIED not in str(exc):
                raise
        self.index_only = True
        self.ctx.err.print(
            Text(
                "threadlog: this Redis user may not SCAN (ACL; eventstore.acl_rules leaves "
                "+scan out), so only the threads of the thread index are covered: a thread "
                "missing from the index could not be looked for (a user with +scan finds it)"
            )
        )
        return await job(True)


def _print_verdict(ctx: Ctx, verdict: Verdict) -> None:
    line = Text(f"verify {verdict.thread_id}: ")
    if verdict.ok:
        line.append("OK", style="bold green")
    else:
        line.append("FAILED", style="bold red")
    line.append(printable(f" - {verdict.detail}"))
    ctx.out.print(line)
    if not verdict.ok:
        table = Table(box=box.SIMPLE_HEAD)
        table.add_column("seq", justify="right", no_wrap=True)
        table.add_column("damage", no_wrap=True)
        table.add_column("detail", overflow="fold")
        for problem in verdict.problems:
            table.add_row(
                str(problem.seq), Text(problem.kind, style="red"), Text(printable(problem.detail))
            )
        ctx.out.print(table)
        if verdict.problems_omitted:
            ctx.out.print(f"... and {verdict.problems_omitted} more problems")


async def cmd_verify(ctx: Ctx, args: argparse.Namespace) -> None:
    thread = _target(args)
    auditor = Auditor(ctx.store)
    if thread is not None:
        verdict = await auditor.verify(thread)
        if verdict.kind == "missing":
            # Nothing to verify: a usage error (a misspelt name), worded by the verdict, which
            # says whether the thread was deleted or never written.
            raise UsageError(verdict.detail)
        if args.json:
            ctx.json(verdict)
        else:
            _print_verdict(ctx, verdict)
        if not verdict.ok:
            raise Failed
        return
    listing = _EveryThread(ctx)
    with ctx.progress("verifying") as bar:
        verdicts = await listing.run(
            lambda index_only: auditor.verify_all(progress=bar.update, index_only=index_only)
        )
    index_only = listing.index_only
    bad = [v for v in verdicts.values() if not v.ok]
    if args.json:
        ns = ctx.store.namespace
        ctx.json({"namespace": ns, "ok": not bad, "index_only": index_only, "threads": verdicts})
    else:
        events = sum(v.checked for v in verdicts.values())
        line = Text(
            f"verified {plural(len(verdicts), 'thread')} ({plural(events, 'event')})"
            f"{_OF_THE_INDEX if index_only else ''} in namespace {ctx.store.namespace!r}: "
        )
        if bad:
            line.append(f"{len(bad)} FAILED", style="bold red")
        elif not verdicts:
            # Most likely a misspelt --namespace: "all OK" would read as a clean audit.
            line.append("no threads there - nothing was verified (is the namespace right?)")
        else:
            line.append("all OK", style="bold green")
        ctx.out.print(line)
        if bad:
            table = Table(box=box.SIMPLE_HEAD)
            table.add_column("thread", overflow="fold")
            table.add_column("first bad seq", justify="right", no_wrap=True)
            table.add_column("damage", no_wrap=True)
            table.add_column("problems", justify="right", no_wrap=True)
            table.add_column("detail", overflow="fold")
            for v in bad:
                table.add_row(
                    # Escaped here, not by the stream: rich sizes the column by what it is given.
                    Text(printable(v.thread_id)),
                    str(v.first_bad_seq),
                    Text(v.kind or "", style="red"),
                    str(len(v.problems) + v.problems_omitted),
                    Text(printable(v.detail)),
                )
            ctx.out.print(table)
    if bad:
        raise Failed


async def cmd_export(ctx: Ctx, args: argparse.Namespace) -> None:
    if args.fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ModuleNotFoundError:
            raise UsageError(
                "parquet export needs pyarrow: pip install 'threadlog[export]' "
                "(or use --format ndjson)"
            ) from None
    if args.compression is not None and args.fmt != "parquet":
        raise UsageError(
            f"--compression applies to --format parquet only; {args.fmt} parts are written "
            "uncompressed (see 'threadlog export --help')"
        )
    exporter = Exporter(
        ctx.store,
        args.out,
        fmt=args.fmt,
        name=args.name,
        workers=args.workers,
        # Workers open their own connections: to the same URL, in the store's namespace.
        settings=es.StoreSettings.from_url(ctx.where.url, namespace=ctx.store.namespace),
        pause_gc=True,  # this process does nothing else meanwhile
        compression=args.compression,
    )
    if not await ctx.store.namespace_exists():
        # Only the default namespace gets here (a named one was refused): nothing was ever
        # written to it, and an export would create its groups and id for nothing.
        if args.json:
            ctx.json(ExportResult(files=[], events=0, tombstones=0, positions={}))
        else:
            ctx.out.print(
                Text(
                    printable(
                        f"Nothing to export: namespace {ctx.store.namespace!r} holds no "
                        f"events yet; {args.out} was not written."
                    )
                )
            )
        return
    with ctx.progress("exporting", unit="events") as bar:
        result = await exporter.run(since=args.since, progress=bar.update)
    if args.json:
        # JSON text cannot hold a name's bytes that are not UTF-8 (Linux allows them): they
        # are written as \xNN escapes rather than failing after the export.
        files = [os.fsencode(f).decode("utf-8", "backslashreplace") for f in result.files]
        ctx.json(msgspec.structs.replace(result, files=files))
        return
    asked = args.workers
    if isinstance(asked, int) and result.workers < asked:
        # Say why fewer processes ran than were asked for (stderr: stdout is the report).
        busy = result.busy_partitions
        partitions = plural(ctx.store.partitions, "partition")
        why = (
            f"{plural(busy, 'partition')} had changes waiting"
            if busy is not None
            else f"namespace {ctx.store.namespace!r} has {partitions}"
        )
        used = "1 process" if result.workers == 1 else f"{result.workers} processes"
        ctx.err.print(
            Text(f"--workers {asked}: exported with {used} ({why}; one per partition at most)")
        )
    if not result.files:
        if args.since is not None:
            # A directory the run made is removed again: it is not "new", it is not there.
            done = "stays new" if args.out.is_dir() else "was not written"
            text = f"No event since {args.since.isoformat()} to export; {args.out} {done}."
        elif not args.out.is_dir() or next(args.out.glob("part-*"), None) is None:
            # No last run to speak of: the directory holds no part (or was never made).
            text = (
                f"Nothing to export: namespace {ctx.store.namespace!r} has no change to "
                f"export; {args.out} was not written."
            )
        else:
            text = f"Nothing new to export to {args.out} since the last run."
        # A directory's name is the user's, and may hold an escape sequence: shown escaped,
        # as every error that names it is.
        ctx.out.print(Text(printable(text)))
        return
    names = ", ".join(Path(f).name for f in result.files)
    ctx.out.print(
        Text(
            printable(
                f"Exported {plural(result.events, 'event')} and "
                f"{plural(result.tombstones, 'deletion')} of namespace "
                f"{ctx.store.namespace!r} to {args.out}: {names}"
            )
        )
    )


def _every_view(store: es.EventStore) -> Projector:
    """A projector over every view threadlog writes: the core projections, and the LangGraph
    checkpointer's (`lg.*`) when its extra is installed. check and rebuild with the core ones
    alone would call an `lg:` thread's damaged views OK and leave them as they are."""
    projections = Projector(store).projections  # the core ones, as every other command has
    try:
        from .langgraph import LangGraphProjection
    except ImportError:  # threadlog without [langgraph]: no thread of it can have lg.* views
        pass
    else:
        projections.append(LangGraphProjection())
    return Projector(store, projections)


async def cmd_rebuild(ctx: Ctx, args: argparse.Namespace) -> None:
    thread = _target(args)
    auditor = Auditor(ctx.store, _every_view(ctx.store))
    listed_again: list[str] = []
    if thread is not None:
        await _require_thread(ctx, thread, reports_damage=True)
        try:
            version = await auditor.rebuild(
                thread, trust_log=args.trust_log, listed_again=listed_again.append
            )
        except UnverifiedLogError as exc:
            if args.json:
                ctx.json(_rebuild_row(thread, None, listed_again=False, error=exc))
            else:
                ctx.err.print(Text(printable(f"threadlog: {_refused(exc)}")))
            raise Failed from exc
        if args.json:
            ctx.json(_rebuild_row(thread, version, listed_again=bool(listed_again)))
            return
        ctx.out.print(Text(printable(f"rebuilt the views of {thread} at version {version}")))
        for relisted in listed_again:
            ctx.out.print(Text(printable(f"  {relisted}: {_listed_again_note()}"), style="yellow"))
        return
    failed: dict[str, es.EventStoreError] = {}
    listing = _EveryThread(ctx)
    with ctx.progress("verifying and rebuilding") as bar:
        try:
            done = await listing.run(
                lambda index_only: auditor.rebuild_all(
                    progress=bar.update,
                    trust_log=args.trust_log,
                    index_only=index_only,
                    listed_again=listed_again.append,
                )
            )
        except RebuildError as exc:
            done, failed = exc.rebuilt, exc.failed
    again = set(listed_again)
    listed_again = [t for t in done if t in again]  # as listed (threads end in any order)
    if args.json:
        rows = {t: _rebuild_row(t, v, listed_again=t in again) for t, v in done.items()}
        for t, error in failed.items():
            rows[t] = _rebuild_row(t, None, listed_again=False, error=error)
        ns, index_only = ctx.store.namespace, listing.index_only
        ctx.json({"namespace": ns, "ok": not failed, "index_only": index_only, "threads": rows})
        if failed:
            raise Failed
        return
    line = Text(
        f"rebuilt the views of {plural(len(done), 'thread')}"
        f"{_OF_THE_INDEX if listing.index_only else ''} in namespace {ctx.store.namespace!r}"
    )
    if listed_again:
        # A repair, said as check --all says the damage: listings and retention sweeps
        # skipped the thread until now, which its owner may need to know.
        repaired = f"; {len(listed_again)} NOT IN THE THREAD INDEX (listed in it again)"
        line.append(repaired, style="yellow")
    busy = {t for t, e in failed.items() if isinstance(e, RebuildBusyError)}
    unverified = {t for t, e in failed.items() if isinstance(e, UnverifiedLogError)}
    if failed:
        why = []
        if unverified:
            why.append(f"{len(unverified)} whose logs fail verification: run verify")
        if damaged := len(failed) - len(busy) - len(unverified):
            why.append(f"{damaged} with damaged logs: run verify")
        if busy:
            why.append(f"{len(busy)} kept changing: run rebuild again when writers pause")
        line.append(f"; {len(failed)} NOT REBUILT ({'; '.join(why)})", style="bold red")
    ctx.out.print(line)
    for thread in listed_again:
        ctx.out.print(Text(printable(f"  {thread}: {_listed_again_note()}"), style="yellow"))
    for thread, error in failed.items():
        text = _refused(error) if isinstance(error, UnverifiedLogError) else str(error)
        ctx.out.print(Text(printable(f"  {thread}: {text}"), style="red"))
    if failed:
        raise Failed


def _listed_again_note() -> str:
    """A rebuild's repair of the thread index, said as check says the damage: listings and
    retention sweeps skipped the thread until now, which its owner may need to know."""
    return (
        "NOT IN THE THREAD INDEX - listed in it again (its entry was removed: listings, "
        "retention sweeps and index-based jobs did not see it)"
    )


def _rebuild_row(
    thread: str,
    version: int | None,
    *,
    listed_again: bool,
    error: es.EventStoreError | None = None,
) -> dict[str, Any]:
    """One thread's rebuild as JSON: the version rebuilt at, or why it was not rebuilt
    (``failure``: unverified, damaged or busy, as the human report groups them; ``verdict``
    is verify's, for a log that fails it)."""
    row: dict[str, Any] = {
        "ok": error is None,
        "thread_id": thread,
        "version": version,
        "listed_again": listed_again,
        "failure": None,
        "detail": "",
        "verdict": None,
    }
    if isinstance(error, UnverifiedLogError):
        row.update(failure="unverified", detail=_refused(error), verdict=error.verdict)
    elif isinstance(error, RebuildBusyError):
        row.update(failure="busy", detail=str(error))
    elif error is not None:
        row.update(failure="damaged", detail=str(error))
    return row


def _refused(error: UnverifiedLogError) -> str:
    """Why a thread was not rebuilt, and what to do about it."""
    return (
        f"{error}: rebuilding would copy that into the views; run 'threadlog verify "
        f"{error.thread_id}' (or rebuild with --trust-log to take the log as it is)"
    )


def _print_report(ctx: Ctx, report: CheckReport, verdict: Verdict | None = None) -> None:
    line = Text(f"check {report.thread_id}: ")
    unindexed = verdict is not None and not verdict.ok
    if report.ok and unindexed:
        line.append("NOT IN THE THREAD INDEX", style="bold red")
        line.append(
            f" - its log verifies and every view equals the fold of the log at version "
            f"{report.version}"
        )
    elif report.ok:
        line.append("OK", style="bold green")
        line.append(f" - every view equals the fold of the log at version {report.version}")
    else:
        line.append("DIFFERENT", style="bold red")
        line.append(
            f" - {plural(len(report.differences), 'difference')} at version {report.version}; "
            f"'threadlog rebuild {report.thread_id}' restores the views"
        )
    ctx.out.print(line)
    if verdict is not None and not verdict.ok:
        # Only index damage lets a log through to the comparison (the log itself verified).
        ctx.out.print(
            Text(
                printable(
                    f"  damaged: {verdict.detail} (its log verifies: 'threadlog rebuild "
                    f"{report.thread_id}' lists it again)"
                ),
                style="red",
            )
        )
    if report.differences:
        table = Table(box=box.SIMPLE_HEAD)
        for name in ("view", "key", "from the log", "materialized"):
            table.add_column(name, overflow="fold")
        for d in report.differences:
            # A state block's name (a view key) is the agent's: it may hold an escape sequence.
            cells = (d.view, d.key, d.expected, d.actual)
            table.add_row(*(Text(printable(cell)) for cell in cells))
        ctx.out.print(table)
    _print_anomalies(ctx, report)


def _print_anomalies(ctx: Ctx, report: CheckReport, *, named: bool = False) -> None:
    """The report's turn anomalies (a settlement of a turn never opened, ...): notes, not
    differences; ``named`` puts the thread in each, for a listing of many."""
    thread = f"{report.thread_id} " if named else ""
    for a in report.anomalies:
        note = f"  note: {thread}seq {a.seq}: turn {a.turn_id} {a.kind.replace('_', ' ')}"
        ctx.out.print(Text(printable(note), style="yellow"))


def _print_damaged_log(ctx: Ctx, verdict: Verdict) -> None:
    """A check whose log failed verification: no comparison, and no advice to rebuild."""
    line = Text(f"check {verdict.thread_id}: ")
    if verdict.kind == "wrong_key":
        # Not damage: the check holds another chain key than the thread's writers did.
        line.append(_WRONG_KEY, style="bold red")
        line.append(
            printable(
                f" - its log could not be verified under this check's key ({verdict.detail}); "
                "its views were not compared with it"
            )
        )
        ctx.out.print(line)
        return
    if UNKNOWN_TYPE_NOTE in verdict.detail:
        # Not damage: an application's events, whose module this command was not given.
        line.append(_UNKNOWN_TYPE, style="bold red")
        line.append(
            printable(
                f" - its log could not be verified by this command ({verdict.detail}); its "
                f"views were not compared with it: {_UNKNOWN_TYPE_HINT}"
            )
        )
        ctx.out.print(line)
        return
    line.append("LOG DAMAGED", style="bold red")
    line.append(
        printable(
            f" - the log itself fails verification ({verdict.kind}: {verdict.detail}); "
            f"its views were not compared with it and must not be rebuilt from it: run "
            f"'threadlog verify {verdict.thread_id}'"
        )
    )
    ctx.out.print(line)


_WRONG_KEY = "UNVERIFIED (WRONG CHAIN KEY)"
_UNKNOWN_TYPE = "UNVERIFIED (UNKNOWN EVENT TYPE)"
_UNKNOWN_TYPE_HINT = (
    "its type is not registered in this process: pass --events MODULE (or set "
    "THREADLOG_EVENTS) naming the module of the application that registers it"
)


def _check_row(verdict: Verdict, report: CheckReport | None) -> dict[str, Any]:
    """One thread's check as JSON: the verdict of its log, and the comparison if it ran."""
    ok = verdict.ok and report is not None and report.ok
    row: dict[str, Any] = {"ok": ok, "thread_id": verdict.thread_id, "log_verified": False}
    if report is not None:
        row.update(msgspec.to_builtins(report), log_verified=True)
    row["verdict"] = verdict
    return row


async def cmd_check(ctx: Ctx, args: argparse.Namespace) -> None:
    thread = _target(args)
    auditor = Auditor(ctx.store, _every_view(ctx.store))
    if thread is not None:
        await _require_thread(ctx, thread, reports_damage=True)
        found = await auditor.check(thread)
        verdict, report = found.verdict, found.report
        if args.json:
            ctx.json(_check_row(verdict, report))
        elif report is None:
            _print_damaged_log(ctx, verdict)
        else:
            _print_report(ctx, report, verdict)
        if report is None or not report.ok or not verdict.ok:
            raise Failed
        return
    listing = _EveryThread(ctx)
    with ctx.progress("verifying and checking") as bar:
        found_all = await listing.run(
            lambda index_only: auditor.check_all(progress=bar.update, index_only=index_only)
        )
    verdicts = {t: f.verdict for t, f in found_all.items()}
    reports = {t: f.report for t, f in found_all.items() if f.report is not None}
    rows = {t: _check_row(f.verdict, f.report) for t, f in found_all.items()}
    bad = [t for t, row in rows.items() if not row["ok"]]
    if args.json:
        ns, index_only = ctx.store.namespace, listing.index_only
        ctx.json({"namespace": ns, "ok": not bad, "index_only": index_only, "threads": rows})
    else:
        line = Text(
            f"checked {plural(len(verdicts), 'thread')}"
            f"{_OF_THE_INDEX if listing.index_only else ''} in namespace "
            f"{ctx.store.namespace!r}: "
        )
        unverified = [t for t in bad if t not in reports]
        wrong_key = [t for t in unverified if verdicts[t].kind == "wrong_key"]
        unknown = [t for t in unverified if UNKNOWN_TYPE_NOTE in verdicts[t].detail]
        damaged = [t for t in unverified if t not in wrong_key and t not in unknown]
        different = [t for t in bad if t in reports and not reports[t].ok]
        # Threads that check OK but whose turns are odd: said, or a listing would hide them.
        noted = [t for t in reports if t not in bad and reports[t].anomalies]
        if bad:
            parts = []
            if different:
                parts.append(f"{len(different)} DIFFERENT")
            if damaged:
                parts.append(f"{len(damaged)} LOG DAMAGED")
            if wrong_key:
                parts.append(f"{len(wrong_key)} {_WRONG_KEY}")
            if unknown:
                parts.append(f"{len(unknown)} {_UNKNOWN_TYPE}")
            if unlisted := len(bad) - len(different) - len(unverified):
                parts.append(f"{unlisted} NOT IN THE THREAD INDEX")
            line.append(", ".join(parts), style="bold red")
        else:
            line.append("all OK", style="bold green")
        if noted:
            line.append(f" ({plural(len(noted), 'thread')} with turn notes)", style="yellow")
        ctx.out.print(line)
        for t in bad:
            if t in reports:
                _print_report(ctx, reports[t], verdicts[t])
            else:
                _print_damaged_log(ctx, verdicts[t])
        for t in noted:
            _print_anomalies(ctx, reports[t], named=True)
    if bad:
        raise Failed


class _StopImport(Exception):
    """Raised between two appends of an import that Ctrl-C asked to stop."""


async def cmd_import_jsonl(ctx: Ctx, args: argparse.Namespace) -> None:
    es.validate_thread_id(args.session)
    # Ctrl-C cancels this task wherever it awaits: in the middle of an append, which may then
    # commit or not, and "interrupted" would not say which. So the import runs as its own
    # task, shielded: Ctrl-C lets the append in flight finish, stops the import before the
    # next one, and the report says exactly what was written.
    seen: list[ImportProgress] = []
    stopping = False

    def progress(now: ImportProgress) -> None:
        seen.append(now)
        if stopping and now.appends < now.of_appends:
            raise _StopImport

    sessions = SessionStore(ctx.store)
    # Read and validated before the namespace is created: a refused file (empty, malformed)
    # into a misspelt --namespace leaves no key behind.
    try:
        messages, skipped = await read_import(sessions, args.file, skip_bad=args.skip_bad)
    except JsonlImportError as exc:
        if args.json:
            # Every refused line, which the one-line error (below, on stderr) only begins.
            refused = {"ok": False, "file": str(args.file), "session_id": args.session}
            ctx.json({**refused, "empty": exc.empty, "errors": exc.errors})
        raise
    if isinstance(ctx.store, es.RedisEventStore) and not await ctx.store.namespace_exists():
        await ctx.store.ensure_namespace()  # records the partition count before the first append
    task = asyncio.ensure_future(
        write_import(sessions, messages, skipped, args.session, progress=progress)
    )
    try:
        report = await asyncio.shield(task)
    except asyncio.CancelledError:
        stopping = True
        try:
            report = await task  # a second Ctrl-C stops this wait (plain "interrupted")
        except _StopImport:
            raise SystemExit(_fail(_stopped_import(args, seen[-1]), 130)) from None
    if args.json:
        ctx.json({"ok": True, "file": str(args.file), **msgspec.structs.asdict(report)})
        return
    where = f"session {report.session_id} (version {report.version})"
    if report.duplicate:
        text = f"{args.file}: already imported into {where}; nothing written"
    else:
        lines = plural(report.lines, "line")
        text = f"{args.file}: imported {report.imported:,} of {lines} into {where}"
        if already := report.imported - report.written:
            # An import stopped half way and run again, or the file grown since its import:
            # say what this run added.
            text += (
                f": {report.written:,} newly written, {already:,} already there from an "
                "earlier import of this file"
            )
    ctx.out.print(Text(printable(text)))
    for bad in report.skipped:
        ctx.out.print(Text(printable(f"  skipped line {bad.line}: {bad.reason}"), style="yellow"))


def _stopped_import(args: argparse.Namespace, done: ImportProgress) -> str:
    if not done.appends:
        return f"interrupted; nothing of {args.file} was imported"
    return (
        f"interrupted: {args.file}: wrote {done.messages} of {done.of_messages} messages "
        f"({done.appends} of {done.of_appends} appends) into session {args.session} (version "
        f"{done.version}) before stopping; the same import-jsonl command writes the rest (it "
        "is idempotent: what was written is not written twice)"
    )


async def cmd_export_jsonl(ctx: Ctx, args: argparse.Namespace) -> None:
    session: str = args.session
    await _require_thread(ctx, session)
    sessions = SessionStore(ctx.store)
    if str(args.file) == "-":
        transcript = await transcript_to_export(sessions, session)
        write_stdout(b"".join(m.to_json_bytes() + b"\n" for m in transcript.messages))
        return
    lines = await export_jsonl(sessions, session, args.file)
    wrote = f"wrote {plural(lines, 'message')} of session {session} to {args.file}"
    ctx.err.print(Text(printable(wrote)))


# -- the entry point ----------------------------------------------------------------------------


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich exits with 1 here, the code for "verification failed": let main() say 141.
        raise BrokenPipeError


def _consoles() -> tuple[Console, Console]:
    width = None
    if not sys.stdout.isatty() and "COLUMNS" not in os.environ:
        width = PLAIN_WIDTH
    out = _Console(
        file=cast("IO[str]", _Escaping(lambda: sys.stdout)),
        highlight=False,
        soft_wrap=True,
        width=width,
    )
    err = _Console(
        file=cast("IO[str]", _Escaping(lambda: sys.stderr)), highlight=False, soft_wrap=True
    )
    return out, err


async def _run(args: argparse.Namespace, where: Where) -> None:
    out, err = _consoles()
    if where.url.startswith("memory:") and args.command == "tail":
        raise UsageError(
            "tail on memory:// would wait forever: the in-memory store lives and dies with "
            "this one command, so nothing else can append to it (follow a Redis store: "
            "--url redis://..., or run without --url for the embedded one)"
        )
    namespace: str | None = getattr(args, "namespace", None)
    # Commands that write no event leave a namespace that was never written without any key
    # (a misspelt --namespace must not create one); import-jsonl creates it once it writes.
    try:
        store = await es.connect(
            where.url, namespace=namespace, create_namespace=args.command == "demo"
        )
    except es.StoreConnectionError as exc:
        if "Protocol error" in str(exc):
            # redis-py's words for a reply that is no RESP at all: another service (HTTP, SSH)
            # answered on that port, which its message does not say.
            raise es.StoreConnectionError(
                f"{exc} (the server there does not answer as a Redis server does: check the "
                "host and port of --url or $THREADLOG_URL)"
            ) from None
        if not any(words in str(exc).lower() for words in _KEYS_DENIED):
            raise
        # A tenant's user reaches one namespace's keys; the likeliest cause is a --namespace
        # left out (so 'default'), which Redis's own words do not say.
        named = namespace or es.StoreSettings.from_url(where.url).namespace
        raise es.StoreConnectionError(
            f"{exc} (namespace {named!r}: this user's ACL key patterns do not reach "
            "its keys; a tenant's user reaches only its own namespace: check --namespace)"
        ) from None
    async with store:
        if args.command in _NAMESPACE_MUST_EXIST and store.namespace != "default":
            # Named on purpose (--namespace, or the URL's ?namespace=): one never written is a
            # misspelling far more often than an empty tenant, and reading it as empty would
            # answer "no threads", "all OK" or "nothing to export" for the wrong one.
            await _require_namespace(store, where)
        ctx = Ctx(
            out=out,
            err=err,
            where=where,
            store=store,
            namespace_given=namespace is not None,
            progress_ok=err.is_terminal and not getattr(args, "json", False),
        )
        await args.func(ctx, args)
    if where.url.startswith("memory:") and args.command not in {*READ_ONLY_COMMANDS, "demo"}:
        # Said once the command has done its work (the demo says it itself): what it wrote
        # was real, but only for as long as this process lived.
        sys.stderr.write(
            "threadlog: memory:// keeps nothing: what this command wrote is gone now that it "
            "has exited\n"
        )


async def _require_namespace(store: es.EventStore, where: Where) -> None:
    """A usage error, naming the namespaces there are (when cheap), for a namespace never
    written; nothing is created either way."""
    if await store.namespace_exists():
        return
    known = await store.known_namespaces()
    if known is None:
        hint = ""
    elif len(known) > 10:
        # Many tenants: the ones spelt most like the name asked for are the useful ones.
        close = difflib.get_close_matches(store.namespace, known, n=3, cutoff=0.6)
        hint = f" ({len(known)} namespaces there" + (
            f"; the closest: {', '.join(close)})" if close else ")"
        )
    elif known:
        hint = f" (namespaces there: {', '.join(known)})"
    else:
        hint = " (it holds no namespace yet)"
    if where.url.startswith("memory:"):
        place, hint = "the in-memory backend (a new, empty one in every process)", ""
    elif where.embedded is not None:
        place = f"the embedded redis-server in {where.embedded}/"
    else:
        place = f"redis at {es.redact(where.url)}"
    raise UsageError(
        f"no namespace {store.namespace!r} in {place}{hint}; check --namespace "
        "(nothing was created)"
    )


def _one_line(text: str) -> str:
    text = " ".join(_URL_PASSWORD.sub(r"\1:***@", text).split())
    # Every control character, C0 too: an error may quote what an agent wrote (a block name).
    return printable(text)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, es.EventStoreError):
        return f"{exc.filename}: {exc.strerror}" if exc.filename is not None else exc.strerror
    return str(exc) or type(exc).__name__


def _unwrap(exc: BaseException) -> BaseException:
    """The error inside task-group exception groups (the first one that says something)."""
    while isinstance(exc, BaseExceptionGroup):
        inner = exc.exceptions
        chosen = next((e for e in inner if isinstance(e, es.EventStoreError | OSError)), inner[0])
        exc = chosen
    return exc


def _preflight(args: argparse.Namespace) -> None:
    """The checks of a command line that need no store, made before one is opened: a command
    that cannot run says so without starting the embedded server (which then keeps running)
    or waiting for an unreachable ``--url`` first. The commands check again as they run."""
    if hasattr(args, "all") and hasattr(args, "thread"):
        _target(args)
    if isinstance(getattr(args, "thread", None), str):
        es.validate_thread_id(args.thread)
    if args.command == "export" and args.compression is not None and args.fmt != "parquet":
        raise UsageError(
            f"--compression applies to --format parquet only; {args.fmt} parts are written "
            "uncompressed (see 'threadlog export --help')"
        )
    if args.command == "drop-group":
        validate_group_to_drop(args.name)
    if args.command == "forget-projection":
        validate_projection_name(args.name)
        validate_hash_names(args.hashes)
    if args.command == "import-jsonl":
        if str(args.file) == "-":
            # As export-jsonl writes '-' to stdout ('cat f | threadlog import-jsonl - s1'):
            # standard input, by the name under which the import reads it as any file.
            args.file = Path("/dev/stdin")
        # Looked at, not opened: a pipe (``<(...)``) must keep its data for the import.
        try:
            os.stat(args.file)
        except OSError as exc:
            raise es.InvalidInputError(f"cannot read {args.file}: {exc.strerror or exc}") from None
        if not os.access(args.file, os.R_OK):
            raise es.InvalidInputError(f"cannot read {args.file}: Permission denied")


def _import_event_modules(given: list[str] | None) -> None:
    """Import the modules that register an application's event types (``--events``, else
    ``THREADLOG_EVENTS``): without them its events are unknown types to every command (verify
    calls them undecodable, replay stops at them)."""
    where = "--events" if given is not None else EVENTS_ENV
    if given is not None and not any(n.strip() for n in given):
        # Asked for and naming nothing: a variable that expanded to "" in a script, say.
        raise UsageError("--events names no module: give the module that registers them")
    names = given if given is not None else os.environ.get(EVENTS_ENV, "").split(",")
    names = [n.strip() for n in names if n.strip()]
    if not names:
        return
    if os.getcwd() not in sys.path:  # as `python -m` finds a module of the current directory
        sys.path.insert(0, os.getcwd())
    for name in names:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as exc:  # the module's own code may do anything
            # SystemExit too: a module that exits as it is imported ended threadlog with its
            # code (0: nothing done, and nothing said).
            raise UsageError(
                f"{where}: cannot import {name!r}: {type(exc).__name__}: {exc}"
            ) from None


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"threadlog: {_one_line(message)}\n")
    sys.stderr.flush()
    return code


def _tolerant_output(*, json_lines: bool) -> None:
    """Text the output's encoding cannot hold (a message in Chinese on a latin-1 or ASCII
    terminal) is written escaped (``\\u4e16``), never a crash half-way through a command;
    JSON lines go out as UTF-8 whatever the locale says, as JSON is exchanged."""
    for stream in (sys.stdout, _ForgivingStderr.unwrapped(sys.stderr)):
        if not isinstance(stream, io.TextIOWrapper):
            continue  # replaced (a test's buffer): its owner decides
        try:
            utf8 = codecs.lookup(stream.encoding).name == "utf-8"
        except LookupError:
            utf8 = False
        if utf8:
            continue
        if stream is sys.stdout and json_lines:
            stream.reconfigure(encoding="utf-8")
        else:
            stream.reconfigure(errors="backslashreplace")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    with _sigterm_as_ctrl_c(), _ForgivingStderr.installed():
        return _main(argv)


class _ForgivingStderr:
    """Standard error that, once a write to it fails, writes nowhere. A full disk (``2>log``
    on a full file system), a reader gone (``2> >(...)``) or a terminal hung up fail the
    write of an error message, which then left the command as an unhandled exception: exit 1,
    the code of a failed verification, for a usage error; tail stopped following (exit 141)
    with its output's reader still there. What goes to stderr is said about the command,
    never a reason to change what it does or its exit code."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.broken = False

    @staticmethod
    def unwrapped(stream: Any) -> Any:
        return stream.stream if isinstance(stream, _ForgivingStderr) else stream

    @classmethod
    @contextlib.contextmanager
    def installed(cls) -> Iterator[None]:
        """``sys.stderr`` wrapped for the block (tests run `main` in their own process)."""
        original = sys.stderr
        if original is None:  # closed: `_main` gives it /dev/null
            yield
            return
        sys.stderr = cast("TextIO", cls(original))
        try:
            yield
        finally:
            sys.stderr = original

    def _fail(self) -> None:
        self.broken = True
        # What the stream still buffers goes to /dev/null, not to a failing flush at exit.
        with contextlib.suppress(AttributeError, OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self.stream.fileno())
            finally:
                os.close(devnull)

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self.stream.write(text)
            except OSError:
                self._fail()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self.stream.flush()
            except OSError:
                self._fail()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding...
        return getattr(self.stream, name)


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM, a supervisor's stop (systemd, Kubernetes, ``timeout``), stops the command as
    Ctrl-C does: an import lets its append in flight finish and says what it wrote, an export
    removes its unfinished part. Python's default would end the process at once, in silence.
    (The previous handler comes back afterwards: tests run `main` in their own process.)"""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set in the main thread
        return

    def as_sigint(signum: int, frame: object) -> None:
        signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGTERM, as_sigint)
    try:
        yield
    finally:
        if previous is not None:  # None: a handler set outside Python, which cannot be put back
            signal.signal(signal.SIGTERM, previous)


def _misplaced_option(
    parser: argparse.ArgumentParser, command: str | None, extra: Sequence[str]
) -> str | None:
    """The first of ``extra`` (arguments no parser took) that is an option of ``command``:
    given before the command's name, where only threadlog's own options go."""
    if command is None:
        return None
    for action in parser._actions:  # argparse keeps its subparsers here, and nowhere public
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            options = {s for a in action.choices[command]._actions for s in a.option_strings}
            return next((x for x in extra if x.split("=", 1)[0] in options), None)
    return None


def _main(argv: Sequence[str] | None) -> int:
    if sys.stderr is None:
        # Closed (``2>&-``): Python has no stream to write to, and the first error would
        # end the process with exit 1, the code of a failed verification. Errors go nowhere;
        # the exit code still says what happened.
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (kept for the life of the process)
    if sys.stdout is None:
        # Closed (``>&-``): refused before anything is done, as nothing could be shown.
        return _fail("standard output is closed: nothing could be shown", EXIT_USAGE)
    parser = build_parser()
    command: str | None = None
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            # argparse leaves them to the top parser, whose help does not list a command's
            # options: point to the command's own.
            helped = f"threadlog {args.command}" if args.command else "threadlog"
            misplaced = _misplaced_option(parser, args.command, extra)
            if misplaced is not None:
                # "--json" before "threads": the command's help lists it, so "unrecognized"
                # with a pointer to that help reads as a contradiction.
                raise UsageError(
                    f"{misplaced} is an option of '{helped}': give it after the command "
                    f"({helped} {misplaced} ...)"
                )
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} (see '{helped} --help')")
        _tolerant_output(json_lines=bool(getattr(args, "json", False)))
        command = args.command
        if command is None:
            names = ", ".join(_command_names(parser))
            raise UsageError(f"choose a command: {names} (see 'threadlog --help')")
        if command == "stop":  # before resolve_where, which would start the server
            return _stop_embedded(args)
        namespace = getattr(args, "namespace", None)
        if namespace is not None:  # refused before an embedded server is started for nothing
            es.validate_namespace(namespace)
        _preflight(args)
        _import_event_modules(getattr(args, "events", None))
        where = resolve_where(getattr(args, "url", None))
        anyio.run(_run, args, where)
    except KeyboardInterrupt:
        if command == "tail":
            return EXIT_OK
        return _fail("interrupted", 130)
    except BrokenPipeError:
        return _reader_gone()
    except Failed:
        return EXIT_FAILED
    except SystemExit:
        raise
    except BaseException as caught:
        exc = _unwrap(caught)
        if isinstance(exc, Failed):
            return EXIT_FAILED
        if isinstance(exc, KeyboardInterrupt):
            return EXIT_OK if command == "tail" else _fail("interrupted", 130)
        if isinstance(exc, BrokenPipeError):
            return _reader_gone()
        if isinstance(exc, UsageError):
            return _fail(str(exc), EXIT_USAGE)
        if isinstance(exc, es.CorruptEventError):
            # The store's own pointer to verify, made exact (said once, not twice); for an
            # event whose type this process does not know, what is missing is the module that
            # registers it, not the log's integrity.
            hint = (
                _UNKNOWN_TYPE_HINT
                if exc.unknown_type
                else f"run 'threadlog verify {exc.thread_id}'"
            )
            text = str(exc)
            text = (
                text.replace("run 'verify'", hint) if "run 'verify'" in text else f"{text} ({hint})"
            )
            return _fail(text, EXIT_FAILED)
        if isinstance(exc, es.CorruptKeyError | es.UnstampedViewError | es.WrongKeyTypeError):
            # Stored damage (a key, a view value or a key's type changed from outside), as a
            # thread's undecodable event is: not a usage error.
            text = _describe(exc)
            if isinstance(exc, es.UnstampedViewError):
                text = text.replace("; run rebuild", f"; run 'threadlog rebuild {exc.thread_id}'")
            return _fail(text, EXIT_FAILED)
        if isinstance(exc, es.EventStoreError | OSError):
            hint = _acl_hint(command, exc) or _full_hint(exc)
            described = _describe(exc)
            return _fail(described.rstrip(".") + hint if hint else described, EXIT_USAGE)
        if not isinstance(exc, Exception):
            raise
        if os.environ.get("THREADLOG_DEBUG"):
            traceback.print_exception(exc)
        return _fail(f"internal error: {type(exc).__name__}: {exc}", EXIT_INTERNAL)
    return EXIT_OK


def _acl_hint(command: str | None, exc: BaseException) -> str:
    """For a writing command that Redis's ACL refused: what it writes and which rules allow it.
    Redis names no command when a script is refused (and no rule ever), so an auditor's user
    running rebuild would otherwise read only "can't run this command"."""
    text = str(exc)
    if command not in WRITES or _ACL_DENIED not in text or "needs +" in text:
        return ""  # ("needs +scan": the namespace-wide audits say what they need themselves)
    return (
        f"; {command} writes {WRITES[command]}, which a read-only user "
        "(eventstore.acl_rules(ns, read_only=True)) may not: run it as a user with "
        "eventstore.acl_rules(ns)"
    )


def _full_hint(exc: BaseException) -> str:
    """For a write a full server refused (maxmemory, under noeviction): Redis's words name a
    limit, not a cause or a remedy, and end in a script's sha."""
    if "command not allowed when used memory > 'maxmemory'" not in str(exc):
        return ""
    return (
        "; the Redis server is full (its maxmemory is reached): raise its maxmemory or free "
        "memory, then run the command again"
    )


def _reader_gone() -> int:
    """Stop quietly when stdout's reader has gone (``| head``), as shell tools do. Python
    flushes stdout once more at exit and would fail again: it goes to /dev/null first."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return EXIT_PIPE


def _command_names(parser: argparse.ArgumentParser) -> Iterable[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices


def _entry() -> NoReturn:
    sys.exit(main())


if __name__ == "__main__":
    _entry()


__all__ = ["EXIT_CODES", "build_parser", "main", "parse_as_of", "parse_time"]
