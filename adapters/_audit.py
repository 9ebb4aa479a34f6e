"""`Auditor`: replay a thread event by event, diff two points of it, and verify its integrity chain.

What `verify` proves depends on the key. Every stored entry carries ``h(n) = link(h(n-1), n, time,
c)``, where ``c`` digests the event's id, schema version, payload and meta. Without a secret,
``c`` is a plain hash: verification finds accidental damage and naive edits (a changed payload,
a removed, inserted or moved entry), but someone who can write to Redis can also recompute every
link after an edit, and that goes unnoticed. With a secret, ``c`` is a keyed MAC: a forger who
lacks the key cannot produce links that verify, so every edited or forged entry is reported.

Neither mode can see a thread cut short at its end when the meta version was lowered to match:
the last link is in `Verdict.head`, so an auditor who records it elsewhere can compare later.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Literal, TypeVar, overload

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream

from eventstore import (
    ChainHead,
    ConcurrencyError,
    CorruptEventError,
    EventStore,
    EventStoreError,
    FeedEntry,
    InvalidInputError,
    MetaSnapshot,
    RecordedEvent,
    StateUpdated,
    ThreadReplacedError,
    TranscriptAppended,
    TranscriptReplaced,
    TurnOpened,
    TurnSettled,
    WrongKeyTypeError,
    chain_link,
    content_digest,
    partition_of,
    validate_count,
    validate_thread_id,
)
from eventstore._codec import (
    MAX_EVENT_TIME_MS,
    UNKEYED_FINGERPRINT,
    decode_entry,
    key_fingerprint,
    namespace_chain_key,
)
from eventstore._contract import require_store
from eventstore._events import EventMeta
from projections import (
    REBUILD_ATTEMPTS,
    AsOf,
    Block,
    CheckReport,
    LogFold,
    Materialized,
    Progress,
    Projector,
    RebuildBusyError,
    RebuildError,
    RecordsProjection,
    RecordsState,
    StoredMessage,
    TranscriptMessage,
    TurnRecord,
)
from projections._projector import AUDIT_CONCURRENCY, for_each_thread, missing_from_log

DamageKind = Literal[
    "modified",
    "inserted",
    "deleted",
    "reordered",
    "undecodable",
    "meta",
    "unindexed",
    "wrong_key",
    "missing",
]
"""What `verify` found wrong at a seq. ``meta``: the thread's meta hash contradicts its log (a
version that is not a number, a chain head that is not the last event's link, a key
fingerprint other than the key every link verifies under). ``unindexed``: the thread exists
but its partition's thread index does not list it (seq 0). ``wrong_key``: the thread records
that it was written with another chain key than the check's, so its links cannot be judged
with this key (seq 0; one problem, not one per entry). ``missing``: there is no such thread
(seq 0; the detail says whether the change feed records its deletion)."""

_DAMAGED = "damaged"
"""A thread's life as an audit sees it when its meta hash cannot say (a life that is not a
number, or a key of another type)."""

VERIFY_BATCH = 2048
"""Stream entries read per round trip while verifying."""
WINDOW = 8
"""How far (in entries) `verify` looks around a broken link for the event's true position."""
MAX_PROBLEMS = 100
"""Problems listed in a `Verdict`; further ones are only counted."""
FEED_PAGE = 1024
"""Change-feed entries read per round trip while looking for a missing thread's deletion."""
MAX_CLASSIFIED = 1000
"""Broken links examined for their kind; beyond this (a forged log) they count as modified."""

T = TypeVar("T")
R = TypeVar("R")
_Rows = list[tuple[bytes, dict[bytes, bytes]]]

_meta_decoder = msgspec.msgpack.Decoder(EventMeta)


class Problem(msgspec.Struct, frozen=True, kw_only=True):
    """One place where the log is damaged."""

    seq: int
    kind: DamageKind
    detail: str


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """What `Auditor.verify` found for one thread.

    ``first_bad_seq``, ``kind`` and ``detail`` describe the first problem (the lowest seq);
    ``problems`` lists up to `MAX_PROBLEMS` of them in log order, ``problems_omitted`` counts the
    rest. ``head`` is the last stored link: record it elsewhere to detect later truncation.
    ``keyed`` says whether the chain was checked with a secret key. ``key_matches`` says
    whether that key is the one the thread records it was written with (None: it records
    none, as a thread from before key fingerprints were recorded). A thread that does not
    exist is not ok: kind ``missing``.
    """

    thread_id: str
    ok: bool
    checked: int
    version: int
    first_bad_seq: int | None
    kind: DamageKind | None
    detail: str
    problems: list[Problem]
    problems_omitted: int = 0
    head: str = ""
    keyed: bool = False
    key_matches: bool | None = None


class ThreadCheck(msgspec.Struct, frozen=True, kw_only=True):
    """What `Auditor.check` found for one thread: the verdict on its log, and the comparison
    of its views with the fold of that log (None when the log fails verification: views are
    not judged against a damaged log)."""

    verdict: Verdict
    report: CheckReport | None

    @property
    def ok(self) -> bool:
        """The log verifies, the thread index lists it, and every view equals its fold."""
        return self.verdict.ok and self.report is not None and self.report.ok


@dataclass(frozen=True, slots=True)
class ReplayStep:
    """One event and the read models as they stood right after it.

    ``messages`` and ``transcript`` are read-only sequences, ``state`` a read-only mapping of
    every block by name, ``records`` every turn (open or settled) in first-seen order. Steps
    share structure with each other, so holding on to many of them is cheap.
    """

    event: RecordedEvent
    messages: Sequence[StoredMessage]
    state: Mapping[str, Block]
    records: Sequence[TurnRecord]
    transcript: Sequence[TranscriptMessage]

    @property
    def seq(self) -> int:
        """The seq of the event."""
        return self.event.seq


class Diff(msgspec.Struct, frozen=True, kw_only=True):
    """What changed in the read models from point ``a`` to point ``b`` (both seqs).

    ``messages_added`` and ``messages_removed`` compare the conversation by the seq that added
    each message. ``state_changed`` and ``records_changed`` map a block or turn id to its
    ``(before, after)``, None where it did not exist. ``transcript`` is ``(before, after)``
    when the transcript differs; ``transcript_replaced`` says a replace (compaction) happened in
    between. ``a`` may be later than ``b``: the diff then runs backwards.
    """

    thread_id: str
    a: int
    b: int
    events: int
    messages_added: list[StoredMessage]
    messages_removed: list[StoredMessage]
    state_changed: dict[str, tuple[Block | None, Block | None]]
    records_changed: dict[str, tuple[TurnRecord | None, TurnRecord | None]]
    transcript: tuple[list[TranscriptMessage], list[TranscriptMessage]] | None
    transcript_replaced: bool

    @property
    def empty(self) -> bool:
        """True when nothing in the read models changed."""
        return not (
            self.messages_added
            or self.messages_removed
            or self.state_changed
            or self.records_changed
            or self.transcript
        )


class _Prefix(Sequence[T]):
    """The first ``n`` items of a list that only ever grows: an O(1) read-only snapshot."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list[T], n: int) -> None:
        self._items = items
        self._n = n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return self._items[: self._n][index]
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError("index out of range")
        return self._items[index]

    def __iter__(self) -> Iterator[T]:
        items = self._items
        for i in range(self._n):
            yield items[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Prefix | list | tuple):
            return len(self) == len(other) and all(x == y for x, y in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._items[: self._n])


# -- verification -------------------------------------------------------------------------------


class _Entry:
    """A stream entry, parsed once: its id, and what the chain check needs."""

    __slots__ = ("bad", "c", "h", "i", "ms", "raw_id", "s", "sub")

    def __init__(
        self,
        raw_id: bytes,
        ms: int,
        sub: int,
        s: int,
        c: str | None,
        h: str | None,
        bad: str | None,
        i: bytes = b"",
    ) -> None:
        self.i = i  # the event id (16 bytes when it decodes)
        self.raw_id = raw_id
        self.ms = ms
        self.sub = sub
        self.s = s
        self.c = c
        self.h = h
        self.bad = bad


class _Scan:
    """One read of a thread's log: the verifier every entry goes to, and the fold (if any)
    that folds the same entries."""

    __slots__ = ("early", "fold", "fold_error", "last", "life", "verifier")

    def __init__(self, verifier: _Verifier, fold: LogFold | None) -> None:
        self.verifier = verifier
        self.fold = fold
        self.fold_error: CorruptEventError | None = None
        self.early: Verdict | None = None
        self.last = 0  # the highest seq read so far
        # The thread's life (`EventStore.incarnation`) when the scan began, or _DAMAGED.
        self.life: int | str | None = _DAMAGED

    def feed(self, rows: _Rows) -> None:
        self.verifier.feed(rows)
        self.last = max(self.last, _id_key(rows[-1][0])[0])
        if self.fold is not None and self.fold_error is None:
            try:
                self.fold.feed_entries(rows)
            except CorruptEventError as exc:
                # The verifier says what is wrong (the fold stops here); raised only if the
                # log verifies all the same.
                self.fold_error = exc


class _Verifier:
    """The chain check as a state machine fed entries in log order.

    Each entry is checked against the stored link of the entry before it, so one damaged
    entry is reported once and the entries after it still verify. An entry whose link does
    not hold waits until `WINDOW` entries after it have arrived, so that the damage can be
    explained: an event that verifies at another seq was moved (reordered), or the log was
    renumbered around removed or added events (deleted, inserted); otherwise it was changed
    (modified). Intact entries take the fast path: two hashes and a payload decode each.
    """

    def __init__(self, auditor: Auditor, thread_id: str, version: int) -> None:
        self.thread_id = thread_id
        self.registry = auditor.store.registry
        self.secret = auditor.secret
        self.version = version
        self.expected = 1  # the seq the next entry should have
        self.prev: str | None = ""  # the stored link before it (None: unknown, after a gap)
        self.offset = 0  # true seq minus entry seq, once a renumbering was found
        self.checked = 0
        self.classified = 0
        self.problems: list[Problem] = []
        self.omitted = 0
        self.first: Problem | None = None
        self.head = ""
        self.head_time: int | None = None  # the time of the entry whose link is `head`
        self.first_time: int | None = None  # the time of the entry of seq 1
        self.history: deque[_Entry] = deque(maxlen=WINDOW)
        self.ahead: deque[_Entry] = deque()
        self.recorded_key: str | None = None  # the thread's chain key fingerprint, if any
        self.fingerprint_edited = False  # set by `check_head`
        # Problems found by links that do not hold (indexes into `problems`, and how many in
        # all): under another key than the writers' they say nothing about the log.
        self.link_indexes: set[int] = set()
        self.link_failures = 0
        self.link_omitted = 0
        # The log without a version to hold it to (no meta hash, or one without 'v'): its
        # chain is checked alone, and the meta hash reported once (`finish`).
        self.no_meta = False
        # Entries beyond the recorded version whose links continue the chain (first, last):
        # the version was lowered, not events inserted.
        self.beyond: list[int] | None = None
        self.no_life = False  # a meta hash with a version but no incarnation ('n')
        self.ids: dict[bytes, int] = {}  # event id -> the first seq that holds it
        # the meta's (version, head, time of the last append)
        self.recorded_head: ChainHead | None = None

    # -- intake ------------------------------------------------------------------------------

    def feed(self, rows: Sequence[tuple[bytes, dict[bytes, bytes]]]) -> None:
        """Check the next entries of the log (in order, without repeats)."""
        thread, secret, registry = self.thread_id, self.secret, self.registry
        ahead, verified = self.ahead, self._verified
        for raw_id, f in rows:
            ms_b, _, sub_b = raw_id.partition(b"-")
            sub = int(sub_b)
            bad: str | None = None
            try:
                id_bytes, data, meta = f[b"i"], f[b"d"], f[b"m"]
                version = int(f[b"v"])
                s = int(f[b"s"])
                h: str | None = f[b"h"].decode("ascii")
            except (KeyError, ValueError, AttributeError):
                why = _why(self, raw_id, f) if sub == 0 else None
                e = _Entry(raw_id, int(ms_b), sub, 0, None, None, why)
            else:
                c = content_digest(thread, id_bytes, version, data, meta, secret)
                if sub == 0:
                    # What `decode_entry` checks, without building the event; whatever fails
                    # here goes to `decode_entry` itself, which decides and words the verdict.
                    try:
                        if len(id_bytes) != 16 or not 0 <= s <= MAX_EVENT_TIME_MS:
                            raise ValueError
                        registry.decode(data, version)
                        if meta:
                            _meta_decoder.decode(meta)
                    except Exception:
                        bad = _why(self, raw_id, f)
                e = _Entry(raw_id, int(ms_b), sub, s, c, h, bad, id_bytes)
            if ahead or not verified(e):
                ahead.append(e)
                self._drain(final=False)

    def finish(self) -> None:
        """Judge the entries still waiting for what follows them, and the log's end."""
        self._drain(final=True)
        if self.no_meta:
            self._problem(
                0,
                "meta",
                f"the thread has a log of {self.checked} entries but no meta hash, or one with "
                "no version (field 'v'): it was deleted or edited; the log's chain was checked "
                "without a version, chain head or key fingerprint to hold it to (appends to "
                "the thread fail until the meta hash is restored)",
            )
        elif self.beyond is not None:
            first, last = self.beyond
            who = (
                "written by appends under this check's key"
                if self.secret is not None
                else "written by appends, or by someone who recomputed their unkeyed links"
            )
            self._problem(
                0,
                "meta",
                f"the log runs past the thread's recorded version {self.version}: "
                f"{_span(first, last)} linked into its chain ({who}): the version in the "
                "thread's meta hash (field 'v') was lowered",
            )
        if self.no_life and not self.no_meta:
            self._problem(
                0,
                "meta",
                "the thread's meta hash has a version but no incarnation (field 'n', which "
                "every append records and every change of the feed names): it was edited; "
                "exports and readers of the feed refuse the thread's changes until it is back "
                "(the next append records a new one, which the older changes do not name)",
            )
        if not self.no_meta and self.expected + self.offset <= self.version:
            detail = (
                f"the log ends at seq {self.expected - 1} but the thread's version is "
                f"{self.version}: {_span(self.expected, self.version)} gone"
            )
            recorded = self.recorded_head
            if recorded is not None and self.head and recorded.head == self.head:
                detail += (
                    f", or the version was raised: the chain head the meta records is the "
                    f"link of seq {self.expected - 1}, the log's last"
                )
            self._problem(self.expected, "deleted", detail)

    def _verified(self, e: _Entry) -> bool:
        """The fast path: ``e`` is the next seq and its link holds. Accounts for it if so."""
        seq, prev = e.ms, self.prev
        if e.sub or e.bad is not None or seq != self.expected or prev is None:
            return False
        target = seq + self.offset
        if (target > self.version and not self.no_meta) or chain_link(
            prev, target, e.s, e.c or ""
        ) != e.h:
            return False
        self.prev = self.head = e.h
        self.head_time = e.s
        if seq == 1:
            self.first_time = e.s
        self.expected = seq + 1
        self.checked += 1
        self.history.append(e)
        self.ids.setdefault(e.i, seq)
        return True

    def _drain(self, *, final: bool) -> None:
        # An entry that does not verify waits until WINDOW entries after it have arrived
        # (or the log ends): they are what explains its damage.
        ahead = self.ahead
        while ahead:
            if self._verified(ahead[0]):
                ahead.popleft()
            elif final or len(ahead) > WINDOW:
                self._judge(ahead.popleft())
            else:
                return

    # -- judgement ---------------------------------------------------------------------------

    def _link_holds(self, prev: str | None, seq: int, e: _Entry) -> bool:
        """Whether entry ``e`` (at ``seq``) is linked to the link ``prev`` before it."""
        return (
            prev is not None
            and e.c is not None
            and e.h is not None
            and chain_link(prev, seq + self.offset, e.s, e.c) == e.h
        )

    def _problem(self, seq: int, kind: DamageKind, detail: str, *, link: bool = False) -> None:
        problem = Problem(seq=seq, kind=kind, detail=detail)
        if self.first is None:
            self.first = problem
        if link:
            self.link_failures += 1
        if len(self.problems) < MAX_PROBLEMS:
            if link:
                self.link_indexes.add(len(self.problems))
            self.problems.append(problem)
        else:
            self.omitted += 1
            self.link_omitted += link

    def _judge(self, e: _Entry) -> None:
        self.checked += 1
        self.history.append(e)
        if e.sub != 0:
            # Not a position of the log at all: it sits where seq `expected` should be.
            self._problem(
                self.expected,
                "inserted",
                f"stream entry {e.raw_id.decode()} is not <seq>-0: no append wrote it",
            )
            return
        seq = e.ms
        if seq > self.expected:
            if self.expected <= self.version:
                last = min(seq - 1, self.version)
                self._problem(
                    self.expected,
                    "deleted",
                    f"{_span(self.expected, last)} missing from the log; seq {seq} after it "
                    "cannot be verified (its link names the missing entry: a change to it "
                    "would not show)",
                )
            self.prev = None  # the link of `seq` points at an entry that is gone
        self.expected = seq + 1
        if e.h is not None:
            self.head, self.head_time = e.h, e.s
        if seq == 1:
            self.first_time = e.s
        if e.bad is not None:
            self._problem(seq, "undecodable", e.bad)
            # Continue the chain through it only if its own link holds.
            prev, self.prev = self.prev, None
            if self._link_holds(prev, seq, e):
                self.prev = e.h
            return
        if seq + self.offset > self.version and not self.no_meta:
            if self._link_holds(self.prev, seq, e):
                # Its link holds: an append wrote it, and the version is what was edited.
                self.prev = e.h
                if self.beyond is None:
                    self.beyond = [seq, seq]
                else:
                    self.beyond[1] = seq
                return
            self._problem(
                seq,
                "inserted",
                f"seq {seq} lies beyond the thread's recorded version {self.version}",
            )
            self.prev = e.h
            return
        assert e.c is not None and e.h is not None  # a decodable entry has every field
        earlier = self.ids.setdefault(e.i, seq)
        prev = self.prev
        self.prev = e.h
        if prev is None:
            # Unverifiable after a gap or an undecodable entry (that is the problem): not
            # counted among the events verified.
            self.checked -= 1
            return
        if chain_link(prev, seq + self.offset, e.s, e.c) == e.h:
            return
        if earlier != seq and seq - earlier > WINDOW:
            # Beyond the window `_explain` searches: the event id says where it comes from.
            self._problem(
                seq,
                "modified",
                f"seq {seq} holds a copy of the event at seq {earlier} (the same event id, "
                "replayed): its link does not verify here",
                link=True,
            )
            return
        self._explain(e, seq, prev)

    def _explain(self, e: _Entry, seq: int, prev: str) -> None:
        """Say why the link of entry ``seq`` (content ``e``, predecessor ``prev``) is broken."""
        assert e.c is not None and e.h is not None
        target = seq + self.offset
        hint = "" if self.secret is None else " (or was forged without the key)"
        if self.classified >= MAX_CLASSIFIED:
            self._problem(seq, "modified", f"seq {seq}: its link does not verify{hint}", link=True)
            return
        self.classified += 1
        seqs = range(max(1, target - WINDOW), target + WINDOW + 1)
        nearby = [x for x in (*self.history, *self.ahead) if x is not e]
        # 1. Does the entry verify after some nearby link, at some nearby seq?
        found: tuple[str, int] | None = None
        for p in dict.fromkeys([prev, "", *(x.h for x in nearby if x.h is not None)]):
            for k in seqs:
                if chain_link(p, k, e.s, e.c) == e.h:
                    found = (p, k)
                    break
            if found:
                break
        copy = any(x.h == e.h for x in nearby)
        if found is not None:
            p, k = found
            if k == target and not p and target > 1:
                # In place, but bound to nothing before it: the chain was started again (the
                # head removed from the meta before this append, or the entries before it
                # put in place of others). Nothing else would report it.
                self._problem(
                    seq,
                    "modified",
                    f"seq {seq} starts the chain again: it links to nothing, not to seq "
                    f"{target - 1} (the meta's chain head was removed before it was appended, "
                    "or the entries before it were replaced)",
                    link=True,
                )
                return
            if k == target:
                return  # intact and in place; its predecessor is the entry that moved
            if p == prev:
                self._shifted(seq, target, k)  # the chain runs on with shifted seqs
                return
            if not copy:
                self._problem(
                    seq, "reordered", f"seq {seq} holds the event written as seq {k}", link=True
                )
                return
        # 2. Does a later entry continue the chain from this entry's predecessor (this one is
        # an addition), or from this entry itself (this one is genuine but altered)?
        following = [x for x in self.ahead if x.sub == 0 and x.c is not None and x.h is not None]
        for x in following:
            assert x.c is not None
            if chain_link(prev, target, x.s, x.c) == x.h:
                self.prev = prev
                self.offset -= 1
                what = "a copy of another event" if copy else "not part of the chain"
                self._problem(
                    seq,
                    "inserted",
                    f"seq {seq} is {what}; entry {x.raw_id.decode()} continues the chain",
                    link=True,
                )
                return
        if following and not copy:
            nxt = following[0]
            assert nxt.c is not None
            for k in range(max(2, target + 1 - WINDOW), target + WINDOW + 2):
                if chain_link(e.h, k, nxt.s, nxt.c) == nxt.h:
                    if k - 1 != target:
                        self._shifted(seq, target, k - 1)
                        return
                    break
        if found is not None:
            detail = f"seq {seq} was overwritten with a copy of the event at seq {found[1]}"
        else:
            detail = f"seq {seq}: its content or link was changed after the append{hint}"
        self._problem(seq, "modified", detail, link=True)

    def _shifted(self, seq: int, target: int, original: int) -> None:
        """Entry ``seq`` is the event written as ``original`` where ``target`` was expected."""
        self.offset = original - seq
        if original > target:
            self._problem(
                seq,
                "deleted",
                f"{_span(target, original - 1)} gone and the later entries renumbered",
                link=True,
            )
        else:
            self._problem(
                seq,
                "inserted",
                f"{target - original} entries were added before seq {seq} and the later "
                "entries renumbered",
                link=True,
            )

    def unreadable(self, error: WrongKeyTypeError) -> Verdict:
        """The verdict for a thread whose keys the server refuses to read as a thread's."""
        self._problem(1, "undecodable", f"the thread's keys cannot be read as a log: {error}")
        return self.verdict()

    def damaged_meta(self, error: CorruptEventError) -> Verdict:
        """The verdict for a thread whose meta hash cannot say how long its log is."""
        self._problem(0, "meta", f"the thread's meta hash is damaged: {error.reason}")
        return self.verdict()

    def check_head(self, recorded: ChainHead | None) -> None:
        """Hold a log whose every link verified to what its meta records: the head and the
        times of its last and first events, read with the version (skipped when appends
        landed since the log was read), and the key fingerprint (every link verifies under
        this check's key, so a fingerprint naming another is an edit, which would turn the
        thread's own writers away)."""
        if recorded is not None and recorded.version == self.version == self.checked:
            version, head, last_ms = recorded.version, recorded.head, recorded.last_ms
            created_ms = recorded.created_ms
            if head == self.head and last_ms is not None and last_ms != self.head_time:
                # Each append stamps its events with the time it records there, and no event
                # is stamped before the last one: a time moved ahead would stamp every later
                # event with it (the chain then covers the forged times as given).
                self._problem(
                    version,
                    "meta",
                    f"the thread's meta records its last append at {last_ms} ms (field 's'), "
                    f"but its last event (seq {version}) was recorded at {self.head_time} ms: "
                    "the meta hash was edited, and later events would be stamped with that time",
                )
            elif (
                head == self.head
                and created_ms is not None
                and self.first_time is not None
                and (created_ms != self.first_time)
            ):
                # A life begins with its first append, which records its time there: a log
                # whose first event is of another time is another life's (a deleted one's,
                # copied back with its version and head), whatever its links say.
                self._problem(
                    1,
                    "meta",
                    f"the thread's current life began at {created_ms} ms (its meta's field "
                    f"'c'), but its first event was recorded at {self.first_time} ms: the log "
                    "is another life's (a deleted one's, put back), or the meta hash was edited",
                )
            elif not head and version:
                self._problem(
                    version,
                    "meta",
                    "the thread's meta hash records no chain head (its field 'h' was removed): "
                    "the next append would start the chain again, unbound to these events",
                )
            elif head != self.head:
                self._problem(
                    version,
                    "meta",
                    f"the chain head the thread's meta records is not the link of its last "
                    f"event (seq {version}): events after it were removed and the version "
                    "lowered, or the meta hash was edited",
                )
        if self.checked and self._key_mismatch() is not None:
            assert self.recorded_key is not None
            names = "no key" if self.recorded_key == UNKEYED_FINGERPRINT else "another key"
            self.fingerprint_edited = True
            self._problem(
                0,
                "meta",
                f"the thread's meta says it was written with {names} (field 'f': "
                f"{self.recorded_key!r}), but every link verifies under this check's key: the "
                f"meta hash was edited; its writers are refused until 'f' is "
                f"{key_fingerprint(self.secret)!r} again",
            )

    def _key_mismatch(self) -> str | None:
        """Why the thread's recorded chain key is not the verifier's (None if it is, or if
        the thread records none)."""
        recorded = self.recorded_key
        if recorded is None or recorded == key_fingerprint(self.secret):
            return None
        if recorded == UNKEYED_FINGERPRINT:
            return (
                "the thread was written without a chain key and this check used one: verify "
                "it through a store opened without THREADLOG_SECRET"
            )
        if self.secret is None:
            return (
                "the thread was written with a chain key and this check used none: verify it "
                "with THREADLOG_SECRET set to its writers' key"
            )
        return (
            "the thread was written with another chain key than this check's (another "
            "secret, or another namespace's: keys are per namespace, so a thread copied "
            "across fails here): verify it with its writers' key"
        )

    def missing(self, detail: str) -> Verdict:
        """The verdict for a thread that does not exist."""
        self._problem(0, "missing", detail)
        return self.verdict()

    def unindexed(self) -> None:
        """The thread exists but its partition's thread index does not list it."""
        self._problem(
            0,
            "unindexed",
            "the thread is not in its partition's thread index (its entry was removed): "
            "listings, retention sweeps and index-based jobs do not see it",
        )

    def verdict(self) -> Verdict:
        first = self.first
        mismatch = None if self.fingerprint_edited else self._key_mismatch()
        key_matches = None if self.recorded_key is None else mismatch is None
        problems, omitted = self.problems, self.omitted
        explained_by_key = False
        if mismatch is not None and self.link_failures:
            # The thread records another key than this check's: its links fail because of
            # the key, not because of N edits. One problem says so; what a key cannot explain
            # (holes, undecodable entries, ...) is still listed.
            first = Problem(
                seq=0,
                kind="wrong_key",
                detail=f"{mismatch} ({self.link_failures} of {self.checked} links fail under "
                "this check's key, so they say nothing about the log)",
            )
            problems = [first] + [p for i, p in enumerate(problems) if i not in self.link_indexes]
            omitted -= self.link_omitted
            mismatch = None  # said by the problem itself
            explained_by_key = True  # no guessing at the failures' cause below
        if first is None:
            noun = "event" if self.checked == 1 else "events"
            detail = f"{self.checked} {noun} verified, chain intact"
            detail += " (keyed)" if self.secret is not None else " (unkeyed)"
            if mismatch is not None:
                detail += f"; but {mismatch}"
        elif mismatch is not None:
            # The thread says which key wrote it: no guessing from the pattern of failures.
            detail = f"{first.detail}; {mismatch}"
        else:
            detail = first.detail
            total = len(self.problems) + self.omitted
            if (
                not explained_by_key
                and self.checked > 1
                and total >= self.checked
                and all(p.kind == "modified" for p in self.problems)
            ):
                # Every link fails but every entry decodes: the likeliest cause is a reader
                # with another chain key than the writer's, not an attacker rewriting it all,
                # unless the thread records that its key is the reader's: then its entries
                # were linked for another thread or namespace (copied or renamed).
                if self.recorded_key is not None:
                    detail += (
                        "; every entry fails under the key the thread records: were these "
                        "entries written for another thread or namespace (copied or renamed)?"
                    )
                else:
                    detail += "; every entry fails: was the thread written with another key?"
        return Verdict(
            thread_id=self.thread_id,
            ok=first is None,
            checked=self.checked,
            version=self.version,
            first_bad_seq=None if first is None else first.seq,
            kind=None if first is None else first.kind,
            detail=detail,
            problems=sorted(problems, key=lambda p: p.seq),
            problems_omitted=omitted,
            head=self.head,
            keyed=self.secret is not None,
            key_matches=key_matches,
        )


UNKNOWN_TYPE_NOTE = "a type this reader does not know"
"""How a verdict's detail says an entry names a type the verifier's registry lacks (the
command tells those apart from damage by it)."""


def _why(verifier: _Verifier, raw_id: bytes, fields: dict[bytes, bytes]) -> str | None:
    """Why `decode_entry` refuses an entry (None if it does not)."""
    try:
        decode_entry(verifier.thread_id, raw_id, fields, verifier.registry)
    except CorruptEventError as exc:
        if exc.unknown_type:
            return (
                f"{exc} ({UNKNOWN_TYPE_NOTE}: register its Event class, or import "
                "the adapter that defines it, before verifying; on the command line, "
                "--events MODULE)"
            )
        return str(exc)
    except Exception as exc:  # a codec bug must not stop an audit; report it at its seq
        return f"thread {verifier.thread_id!r} entry {raw_id.decode()}: {exc!r}"
    return None


def _span(first: int, last: int) -> str:
    return f"seq {first} is" if first == last else f"seqs {first}..{last} are"


# -- the auditor --------------------------------------------------------------------------------


class _Models:
    """The four read models, folded one event at a time.

    With ``steps``, it also keeps snapshots that share structure from step to step: the
    message and transcript lists only ever grow (a transcript replace starts a new list), so
    a snapshot of them is a length; state and records are copied only when an event changes
    them.
    """

    def __init__(self, auditor: Auditor, thread_id: str, *, steps: bool) -> None:
        self.thread_id = thread_id
        self.steps = steps
        self.mp = auditor.messages_projection
        self.sp = auditor.state_projection
        self.rp = auditor.records_projection
        self.tp = auditor.transcript_projection
        self.messages: list[StoredMessage] = self.mp.initial()
        self.state: dict[str, Block] = self.sp.initial()
        self.records: RecordsState = self.rp.initial()
        self.transcript: list[TranscriptMessage] = self.tp.initial()
        # Turn records by turn id, the order `Projector.turns` lists them in.
        self.turn_ids: list[str] = []
        self.turn_list: list[TurnRecord] = []
        self.state_view: Mapping[str, Block] = MappingProxyType({})
        self.records_view: tuple[TurnRecord, ...] = ()

    def apply(self, event: RecordedEvent) -> None:
        payload = event.payload
        self.messages = self.mp.apply(self.messages, event)
        if isinstance(payload, StateUpdated):
            self.state = self.sp.apply(self.state, event)
            if self.steps:
                self.state_view = MappingProxyType(dict(sorted(self.state.items())))
        elif isinstance(payload, TurnOpened | TurnSettled):
            self.records = self.rp.apply(self.records, event)
            if self.steps:
                self._record_changed(payload.turn_id)
        elif isinstance(payload, TranscriptAppended | TranscriptReplaced):
            self.transcript = self.tp.apply(self.transcript, event)

    def _record_changed(self, turn: str) -> None:
        one = RecordsState(turns={turn: self.records.turns[turn]})
        (record,) = RecordsProjection.all_records(self.thread_id, one)
        index = bisect.bisect_left(self.turn_ids, turn)
        if index < len(self.turn_ids) and self.turn_ids[index] == turn:
            self.turn_list[index] = record
        else:
            self.turn_ids.insert(index, turn)
            self.turn_list.insert(index, record)
        self.records_view = tuple(self.turn_list)

    def step(self, event: RecordedEvent) -> ReplayStep:
        return ReplayStep(
            event=event,
            messages=_Prefix(self.messages, len(self.messages)),
            state=self.state_view,
            records=self.records_view,
            transcript=_Prefix(self.transcript, len(self.transcript)),
        )

    def snapshot(self) -> _Snapshot:
        return _Snapshot(
            messages={m.seq: m for m in self.messages},
            state=dict(self.state),
            records={
                r.turn_id: r for r in RecordsProjection.all_records(self.thread_id, self.records)
            },
            transcript=list(self.transcript),
        )


@dataclass(frozen=True, slots=True)
class _Snapshot:
    messages: dict[int, StoredMessage]
    state: dict[str, Block]
    records: dict[str, TurnRecord]
    transcript: list[TranscriptMessage]


class Auditor:
    """Replay, diff and verify threads of one store.

    ``projector`` supplies the messages, state, records and transcript projections (default:
    the standard ones). ``secret`` is the key the integrity chain is checked with; None uses
    the store's own (the one it appends with). An empty secret is refused
    (`InvalidInputError`): it is no key, and a chain without one is checked through a store
    opened without one.
    """

    def __init__(
        self,
        store: EventStore,
        projector: Projector | None = None,
        *,
        secret: bytes | None = None,
    ) -> None:
        self.store = require_store(store, "Auditor")
        self.projector = projector or Projector(store)
        if self.projector.store is not store:
            raise InvalidInputError("the projector must be bound to the auditor's store")
        # The store keeps the key its namespace links with; a secret given here is turned
        # into the same (`namespace_chain_key`).
        self.secret: bytes | None = (
            namespace_chain_key(secret, store.namespace)
            if secret is not None
            else _store_secret(store)
        )
        self.messages_projection = self.projector.messages
        self.state_projection = self.projector.state_projection
        self.records_projection = self.projector.records_projection
        self.transcript_projection = self.projector.transcript_projection

    # -- verify ---------------------------------------------------------------------------------

    async def verify(self, thread_id: str) -> Verdict:
        """Check seq continuity, decodability and the integrity chain of one thread.

        Every entry is read once, in batches (memory stays bounded by the batch), and
        checking goes on after the first problem; the verdict names the first. Kinds:
        ``modified`` (content or link changed), ``inserted`` (an entry no append wrote: an id
        not of the form ``<seq>-0``, a seq beyond the thread's version, or an addition that
        shifted the seqs), ``deleted`` (missing seqs, a log shorter than its version, or a
        removal that shifted the seqs), ``reordered`` (an event that verifies at another
        seq) and ``undecodable``. An inserted entry with a foreign id is reported at the seq
        whose place it takes. Thread-level problems carry seq 0: ``meta``, ``unindexed`` (the
        thread exists but the thread index does not list it), ``wrong_key`` (the thread
        records another chain key than this check's: its links cannot be judged) and
        ``missing`` (no such thread: the verdict is not ok, and says whether the change feed
        records a deletion). See the module docstring for what a key adds.

        The verdict is of one life of the thread: read in pages, a thread deleted (and perhaps
        written again under its id) meanwhile is read again, the new life whole (or found
        missing), never judged from pages of two lives.

        Raises:
            ThreadReplacedError: the thread was replaced while each of several attempts
                read it.
        """
        validate_thread_id(thread_id)
        for _ in range(REBUILD_ATTEMPTS):
            verdict, same_life = await self._concluded(await self._scan(thread_id))
            if same_life:
                return verdict
        raise ThreadReplacedError(thread_id)

    async def check(self, thread_id: str) -> ThreadCheck:
        """Verify the thread's log and compare its views with the fold of that log.

        One read of the log does both: the entries folded are the entries verified, so an
        edit made while the check runs cannot slip between the two. The views are compared
        (`Projector.compare`) only when the log verifies (`log_verified`); otherwise
        `ThreadCheck.report` is None and the verdict says what is wrong with the log. Log and
        views are of one life of the thread, as in `verify` (which raises as this does).
        """
        validate_thread_id(thread_id)
        for _ in range(REBUILD_ATTEMPTS):
            found = await self._check_once(thread_id)
            if found is not None:
                return found
        raise ThreadReplacedError(thread_id)

    async def _check_once(self, thread_id: str) -> ThreadCheck | None:
        """`check`, or None when the thread was replaced while it was read (read again)."""
        projector = self.projector
        fold = projector.start_fold(thread_id)
        scan = await self._scan(thread_id, fold)
        if scan.early is not None:
            if not await self._same_life(scan):
                return None
            return ThreadCheck(verdict=scan.early, report=None)
        snapshot: Materialized | None = None
        error: CorruptEventError | WrongKeyTypeError | None = None
        try:
            snapshot = await projector.read_materialized(thread_id)
        except (CorruptEventError, WrongKeyTypeError) as exc:
            error = exc  # the views cannot be read; the log's verdict still comes first
        if snapshot is not None and snapshot.version > scan.last and not scan.verifier.first:
            # Appends landed after the log was read: verify and fold theirs too, up to the
            # version the views were read at.
            await self._scan_more(scan, snapshot.version)
        verdict, same_life = await self._concluded(scan)
        if not same_life:
            return None  # the log, or the views, may be of another life of the thread
        if not log_verified(verdict):
            return ThreadCheck(verdict=verdict, report=None)
        error = error or scan.fold_error
        if snapshot is None or error is not None:
            assert error is not None
            report = CheckReport.unfoldable(thread_id, verdict.version, error)
            return ThreadCheck(verdict=verdict, report=report)
        return ThreadCheck(verdict=verdict, report=projector.compare(snapshot, fold.folded()))

    async def _scan(self, thread_id: str, fold: LogFold | None = None) -> _Scan:
        """Read the thread's log once, feeding every entry to a verifier (and to ``fold``).

        ``_Scan.early`` is the verdict when there is no log to read (missing thread, damaged
        meta, a key of the wrong type); otherwise `_conclude` turns the verifier into one.
        """
        store = self.store
        scan = _Scan(_Verifier(self, thread_id, 0), fold)
        verifier = scan.verifier
        try:
            try:
                # The life first: every read after it is of that life if it is the same at
                # the end (`_same_life`); lives never repeat.
                start = await store.meta_snapshot(thread_id)  # one round trip on Redis
                scan.life = start.incarnation()
                verifier.version = start.version()
            except CorruptEventError as exc:
                scan.early = verifier.damaged_meta(exc)
                return scan
            if verifier.version == 0 and not await store.read_raw(thread_id, count=1):
                # No log and no version: nothing was verified, which must not read as "intact".
                if start.indexed():
                    verifier._problem(
                        1,
                        "deleted",
                        "the thread index lists the thread but it has no log and no meta hash: "
                        "its keys were deleted (delete_thread would have unlisted it)",
                    )
                    scan.early = verifier.verdict()
                else:
                    scan.early = verifier.missing(await self._why_missing(thread_id))
                return scan
            verifier.no_meta = verifier.version == 0
            verifier.no_life = scan.life is None
            verifier.recorded_key = start.chain_key_fingerprint()
            send, receive = anyio.create_memory_object_stream[_Rows](1)
            async with anyio.create_task_group() as tg, receive:
                # The next batch is read while this one is hashed.
                tg.start_soon(self._read_log, thread_id, send)
                async for rows in receive:
                    if _id_key(rows[-1][0])[0] > verifier.version:
                        # Appends may have landed since the version was read; entries within
                        # the current version are theirs, not insertions.
                        verifier.version = await store.version(thread_id)
                        verifier.no_meta = verifier.version == 0
                    scan.feed(rows)
            if verifier.version > scan.last:
                # The version was read again after appends (above) while the reader had
                # already read its last batch: the entries up to it are read too, or they
                # would pass for deleted.
                await self._scan_more(scan, verifier.version)
        except* WrongKeyTypeError as group:
            # A log or meta key replaced by another type of value: damage to report, not a
            # reason to stop an audit. Every other error (losing the server) is raised.
            leaf: BaseException = group
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            wrong = leaf if isinstance(leaf, WrongKeyTypeError) else WrongKeyTypeError(leaf)
            scan.early = verifier.unreadable(wrong)
        return scan

    async def _same_life(self, scan: _Scan) -> bool:
        """Whether the thread is still in the life ``scan`` began in: then all it read (and
        what was read after it) is of that one life. False when the thread was deleted, and
        perhaps written again under its id, meanwhile: read it again."""
        return _life_in(await self.store.meta_snapshot(scan.verifier.thread_id)) == scan.life

    async def _scan_more(self, scan: _Scan, stop: int) -> None:
        """Continue a scan whose log grew: the entries after its last seq, up to ``stop``."""
        scan.verifier.version = max(scan.verifier.version, stop)
        start = scan.last + 1
        while start <= stop:
            rows = await self.store.read_raw(
                scan.verifier.thread_id, start=start, stop=stop, count=VERIFY_BATCH
            )
            if not rows:
                return  # the log ends short of ``stop``: the verifier reports the gap
            scan.feed(rows)
            start = _id_key(rows[-1][0])[0] + 1

    async def _concluded(self, scan: _Scan) -> tuple[Verdict, bool]:
        """The verdict of a scan that read the whole log (or its early one), and whether the
        thread is still in the life the scan began in (`_same_life`). The meta's head, the
        index entry and the life at the end are one snapshot: one round trip on Redis."""
        if scan.early is not None:
            return scan.early, await self._same_life(scan)
        verifier = scan.verifier
        end = await self.store.meta_snapshot(verifier.thread_id)
        verifier.recorded_head = end.chain_head()
        verifier.finish()
        if verifier.first is None:
            verifier.check_head(verifier.recorded_head)
        if not end.indexed():
            verifier.unindexed()
        verdict = verifier.verdict()
        return verdict, _life_in(end) == scan.life

    async def _why_missing(self, thread_id: str) -> str:
        """Say whether a thread that does not exist was deleted (its partition's change feed
        records the deletion) or has no trace there. Reads the partition's whole feed: a cold
        path, taken only for a thread that is not there."""
        store = self.store
        partition = partition_of(thread_id, store.partitions)
        last: FeedEntry | None = None
        after = "0-0"
        while True:
            entries = await store.read_feed(partition, after=after, count=FEED_PAGE)
            for entry in entries:
                if entry.thread_id == thread_id:
                    last = entry
            if len(entries) < FEED_PAGE:
                break
            after = entries[-1].id
        where = f"no thread {thread_id!r} in namespace {store.namespace!r}"
        if last is not None and last.deleted:
            when = datetime.fromtimestamp(last.time_ms / 1000, UTC).isoformat(
                timespec="milliseconds"
            )
            return f"{where}: it was deleted (the change feed records its deletion at {when})"
        if last is not None:
            # The feed saw it written and never deleted, yet nothing is left of it.
            return (
                f"{where}: the change feed records appends to it (the last up to seq "
                f"{last.last_seq}) and no deletion, yet it has no log, meta hash or index entry: "
                "its keys were removed"
            )
        return (
            f"{where}: never written (its partition's change feed has no trace of it; a "
            "deletion older than the feed's trimming would not show either)"
        )

    async def _read_log(self, thread_id: str, send: MemoryObjectSendStream[_Rows]) -> None:
        """Send the thread's stream entries in batches, each entry once, in order."""
        async with send:
            start, count = 1, VERIFY_BATCH
            last: tuple[int, int] = (0, 0)
            while True:
                rows = await self.store.read_raw(thread_id, start=start, count=count)
                # Each batch restarts at the last entry's seq (that entry is read again and
                # skipped): an entry ``<seq>-<n>`` after ``<seq>-0`` must not fall in between.
                skip = 0
                while skip < len(rows) and _id_key(rows[skip][0]) <= last:
                    skip += 1
                if skip < len(rows):
                    last = _id_key(rows[-1][0])
                    start = last[0]
                    await send.send(rows[skip:])
                if len(rows) < count:
                    return
                if skip == len(rows):
                    count *= 2  # a full batch of entries that share one seq: read wider

    async def threads(self, *, index_only: bool = False) -> list[str]:
        """Every thread an audit of the namespace covers: those of the thread index (most
        recent activity first), then those only the stored keys hold (by id).

        The keys are scanned too (`EventStore.stored_threads`) so that a thread removed from
        the index is not hidden from the audit; `verify` reports it (kind ``unindexed``).
        ``index_only`` lists the index alone, for a Redis user that may not ``SCAN`` (a
        tenant's, made with `eventstore.acl_rules`): a thread removed from the index is then
        not listed, and an audit of what is listed cannot say it is missing.

        Raises:
            OperationalError: the Redis user may not ``SCAN`` (and ``index_only`` is False).
        """
        listed = [info.thread_id for info in await self.store.threads()]
        if index_only:
            return listed
        known = set(listed)
        return listed + [t for t in await self.store.stored_threads() if t not in known]

    async def verify_all(
        self,
        *,
        progress: Progress | None = None,
        index_only: bool = False,
        concurrency: int = AUDIT_CONCURRENCY,
    ) -> dict[str, Verdict]:
        """Verify every thread of the namespace (`threads`: the index's and the keys', or the
        index's alone with ``index_only``), up to ``concurrency`` at once; returns thread ->
        verdict, in the order of `threads`. A thread deleted since it was listed is left out."""
        return await self._each_thread(self.verify, _verdict_of, progress, index_only, concurrency)

    async def check_all(
        self,
        *,
        progress: Progress | None = None,
        index_only: bool = False,
        concurrency: int = AUDIT_CONCURRENCY,
    ) -> dict[str, ThreadCheck]:
        """`check` every thread of the namespace (`threads`: the index's and the keys', or the
        index's alone with ``index_only``), up to ``concurrency`` at once; returns thread ->
        what was found, in the order of `threads`. A thread deleted since it was listed is
        left out."""
        return await self._each_thread(
            self.check, _verdict_of_check, progress, index_only, concurrency
        )

    async def _each_thread(
        self,
        job: Callable[[str], Awaitable[R]],
        verdict_of: Callable[[R], Verdict],
        progress: Progress | None,
        index_only: bool,
        concurrency: int,
    ) -> dict[str, R]:
        validate_count(concurrency, "concurrency", minimum=1)  # before the listing
        threads = await self.threads(index_only=index_only)

        async def twice_if_bad(thread_id: str) -> R | None:
            found = await job(thread_id)
            if not verdict_of(found).ok:
                # Once more before it is reported: a thread deleted (or deleted and written
                # again) while it was read looks damaged for that one read; damage that is
                # there is there again.
                found = await job(thread_id)
            # None: deleted since it was listed.
            return None if verdict_of(found).kind == "missing" else found

        found = await for_each_thread(
            threads, twice_if_bad, progress=progress, concurrency=concurrency
        )
        return {t: f for t, f in found.items() if f is not None}

    # -- rebuild, verified first --------------------------------------------------------------

    async def rebuild(
        self,
        thread_id: str,
        *,
        trust_log: bool = False,
        listed_again: Callable[[str], None] | None = None,
    ) -> int:
        """Verify the thread's log, then rebuild its views from it (`Projector.rebuild`);
        returns the version rebuilt at.

        `Projector.rebuild` copies whatever the log holds into the views, a forged entry
        included. This refuses a log that fails `verify` with `UnverifiedLogError` (nothing
        is written); a thread missing from the thread index only is rebuilt (its log is
        intact) and listed again: ``listed_again`` is then called with it, once rebuilt. The
        log is read once: what is folded into the views is what was verified.
        ``trust_log=True`` skips the check: the log is taken as it is.

        Raises:
            UnverifiedLogError: the log fails verification.
            RebuildBusyError: appends kept landing, or the thread was deleted and written
                again while each attempt read it; the views were left as they were.
        """
        validate_thread_id(thread_id)
        projector = self.projector
        if trust_log:
            # No verdict to say it: the index is asked (one ZSCORE), only when someone listens.
            unlisted = listed_again is not None and not await self.store.indexed(thread_id)
            version = await projector.rebuild(thread_id)
            if unlisted and listed_again is not None:
                listed_again(thread_id)
            return version
        for _ in range(REBUILD_ATTEMPTS):
            fold = projector.start_fold(thread_id)
            scan = await self._scan(thread_id, fold)
            verdict, same_life = await self._concluded(scan)
            if not same_life:
                continue  # deleted (and perhaps written again) while it was read
            if not log_verified(verdict):
                raise UnverifiedLogError(verdict)
            if scan.fold_error is not None:
                raise scan.fold_error
            # The write is guarded by the life the scan began in as well as by the version:
            # a thread replaced between the last read and the write refuses it.
            life = scan.life if isinstance(scan.life, int) else None
            try:
                await projector.store_views(fold.folded(), expected_incarnation=life)
            except ConcurrencyError:
                continue  # appended to or replaced meanwhile: verify and fold again
            if life is None and not await self._same_life(scan):
                # No life to guard the write with (none recorded): what was written may be
                # another life's if the thread was replaced meanwhile. Rebuild that one.
                continue
            if listed_again is not None and any(p.kind == "unindexed" for p in verdict.problems):
                listed_again(thread_id)
            return fold.version
        raise RebuildBusyError(thread_id, REBUILD_ATTEMPTS, await self.store.version(thread_id))

    async def rebuild_all(
        self,
        *,
        progress: Progress | None = None,
        trust_log: bool = False,
        index_only: bool = False,
        listed_again: Callable[[str], None] | None = None,
        concurrency: int = AUDIT_CONCURRENCY,
    ) -> dict[str, int]:
        """`rebuild` every thread of the namespace (`threads`: the index's and the keys', or
        the index's alone with ``index_only``), up to ``concurrency`` at once; returns thread
        -> version, in the order of `threads`.

        Threads whose log fails verification (unless ``trust_log``), cannot be folded or kept
        changing are left as they were, and after all the others were rebuilt `RebuildError`
        names them (``failed`` maps each to its `UnverifiedLogError`, `CorruptEventError`,
        `WrongKeyTypeError` or `RebuildBusyError`).

        A thread the thread index did not list is listed in it again by its rebuild:
        ``listed_again`` is called with each such thread once rebuilt (as `rebuild` does).
        """
        validate_count(concurrency, "concurrency", minimum=1)  # before the listing
        threads = await self.threads(index_only=index_only)
        failures: dict[str, EventStoreError] = {}

        async def rebuild(thread_id: str) -> int | None:
            try:
                try:
                    return await self.rebuild(
                        thread_id, trust_log=trust_log, listed_again=listed_again
                    )
                except UnverifiedLogError:
                    # Once more, as `verify_all` does: a thread deleted (and perhaps written
                    # again) while it was read fails that one read only.
                    return await self.rebuild(
                        thread_id, trust_log=trust_log, listed_again=listed_again
                    )
            except UnverifiedLogError as exc:
                if exc.verdict.kind != "missing":  # else deleted since it was listed
                    failures[thread_id] = exc
            except (CorruptEventError, WrongKeyTypeError, RebuildBusyError) as exc:
                failures[thread_id] = exc
            return None

        done = await for_each_thread(threads, rebuild, progress=progress, concurrency=concurrency)
        rebuilt = {t: v for t, v in done.items() if v is not None}
        if failures:
            failed = {t: failures[t] for t in threads if t in failures}  # in listing order
            raise RebuildError(rebuilt, failed)
        return rebuilt

    # -- replay and diff ------------------------------------------------------------------------

    async def _stop_for(self, thread_id: str, stop: int | None, as_of: AsOf | None) -> int | None:
        if stop is not None and (isinstance(stop, bool) or not isinstance(stop, int) or stop < 0):
            raise InvalidInputError(f"stop must be a seq >= 0, not {stop!r}")
        if as_of is None:
            return stop
        cap = await self.projector.seq_of(thread_id, as_of)
        return cap if stop is None else min(stop, cap)

    async def replay(
        self,
        thread_id: str,
        *,
        start: int = 1,
        stop: int | None = None,
        as_of: AsOf | None = None,
    ) -> AsyncIterator[ReplayStep]:
        """Yield each event with ``start <= seq <= stop`` and the read models right after it.

        ``as_of`` (a seq or a datetime) caps ``stop``. Events before ``start`` are folded but
        not yielded; the fold is incremental, one projection step per event.

        The point ``as_of`` stands for and the events are read in one life of the thread: a
        thread deleted and written again between finding the point and reading its first
        events is asked again (`ThreadReplacedError` after a few tries; once events were
        yielded, as `EventStore.read` raises it).

        Damage: an entry that does not decode raises `CorruptEventError` where it is (the
        steps before it were yielded), and so does the first seq up to ``as_of`` that the log
        lost at its end. A hole in the middle of the log is stepped over, not raised: the
        step after it has a seq that does not follow the one before, and its read models
        lack the missing events (`threadlog replay` reports it, exit 1; `Projector` reads
        ``as_of`` such a point raise).
        """
        validate_thread_id(thread_id)
        if isinstance(start, bool) or not isinstance(start, int) or start < 1:
            raise InvalidInputError(f"start must be a seq >= 1, not {start!r}")
        for _ in range(REBUILD_ATTEMPTS):
            life = None if as_of is None else await self.store.incarnation(thread_id)
            last = await self._stop_for(thread_id, stop, as_of)
            if last is not None and last < start:
                return
            models = _Models(self, thread_id, steps=True)
            checked = as_of is None
            seen = 0
            events = self.store.read(thread_id, stop=last)
            try:
                async for event in events:
                    seen = event.seq
                    if not checked:
                        # The first page came in the life the point was found in (lives
                        # never repeat), or the point was a seq of a life that is gone.
                        if await self.store.incarnation(thread_id) != life:
                            break
                        checked = True
                    models.apply(event)
                    if event.seq >= start:
                        yield models.step(event)
            finally:
                aclose = getattr(events, "aclose", None)  # a generator left early: end it now
                if aclose is not None:
                    await aclose()
            if checked or await self.store.incarnation(thread_id) == life:
                if as_of is not None and last is not None and seen < last:
                    # The point is a seq the version holds: the log lost entries at its end.
                    raise missing_from_log(thread_id, seen + 1)
                return  # replayed; or nothing to read, in the life the point was found in
        raise ThreadReplacedError(thread_id)

    async def diff(self, thread_id: str, a: AsOf, b: AsOf) -> Diff:
        """What changed in messages, state blocks, turn records and transcript from ``a`` to ``b``.

        ``a`` and ``b`` are seqs or datetimes (0: before the first event). The log is read
        once, up to the later point.
        """
        validate_thread_id(thread_id)
        for _ in range(REBUILD_ATTEMPTS):
            # Both points and the events in one life of the thread: one deleted and written
            # again meanwhile is asked again (lives never repeat).
            life = await self.store.incarnation(thread_id)
            seq_a = await self.projector.seq_of(thread_id, a)
            seq_b = await self.projector.seq_of(thread_id, b)
            lo, hi = sorted((seq_a, seq_b))
            models = _Models(self, thread_id, steps=False)
            early: _Snapshot | None = None
            events = 0
            replaced = False
            seen = 0
            try:
                if hi > 0:
                    async for event in self.store.read(thread_id, stop=hi):
                        seen = event.seq
                        if event.seq > lo:
                            if early is None:
                                early = models.snapshot()
                            events += 1
                            replaced = replaced or isinstance(event.payload, TranscriptReplaced)
                        models.apply(event)
            except ThreadReplacedError:
                continue
            if await self.store.incarnation(thread_id) == life:
                if seen < hi:  # a point the version holds, lost at the log's end
                    raise missing_from_log(thread_id, seen + 1)
                break
        else:
            raise ThreadReplacedError(thread_id)
        late = models.snapshot()
        if early is None:
            early = late
        before, after = (early, late) if seq_a <= seq_b else (late, early)
        return Diff(
            thread_id=thread_id,
            a=seq_a,
            b=seq_b,
            events=events,
            messages_added=[m for s, m in after.messages.items() if s not in before.messages],
            messages_removed=[m for s, m in before.messages.items() if s not in after.messages],
            state_changed=_changes(before.state, after.state),
            records_changed=_changes(before.records, after.records),
            transcript=(
                None
                if before.transcript == after.transcript
                else (before.transcript, after.transcript)
            ),
            transcript_replaced=replaced,
        )


def _life_in(snapshot: MetaSnapshot) -> int | str | None:
    """A thread's life as a scan compares it, `_DAMAGED` for a meta hash whose life cannot be
    read: one the scan reported as damaged, or reads again and will."""
    try:
        return snapshot.incarnation()
    except (CorruptEventError, WrongKeyTypeError):
        return _DAMAGED


def _verdict_of(verdict: Verdict) -> Verdict:
    return verdict


def _verdict_of_check(found: ThreadCheck) -> Verdict:
    return found.verdict


def log_verified(verdict: Verdict) -> bool:
    """Whether a verdict lets the views be rebuilt from the log: it verified, or its only
    problem is that the thread index does not list the thread (the log itself is intact)."""
    return all(p.kind == "unindexed" for p in verdict.problems) and not verdict.problems_omitted


class UnverifiedLogError(EventStoreError):
    """Raised by `Auditor.rebuild` for a thread whose log fails verification: rebuilding
    would copy its damage (an edited or forged entry, a hole, ...) into the views. Nothing was
    written. ``verdict`` is what `Auditor.verify` found."""

    def __init__(self, verdict: Verdict) -> None:
        self.verdict = verdict
        self.thread_id = verdict.thread_id
        super().__init__(
            f"thread {verdict.thread_id!r}: its log fails verification ({verdict.kind}: "
            f"{verdict.detail}); its views were not rebuilt from it"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.verdict,))


def _changes(
    before: Mapping[str, T], after: Mapping[str, T]
) -> dict[str, tuple[T | None, T | None]]:
    out: dict[str, tuple[T | None, T | None]] = {}
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if old != new:
            out[key] = (old, new)
    return out


def _id_key(raw_id: bytes) -> tuple[int, int]:
    ms, _, sub = raw_id.partition(b"-")
    return int(ms), int(sub or b"0")


def _store_secret(store: EventStore) -> bytes | None:
    # Both backends keep the key they append with here; the contract does not expose it.
    secret: Any = getattr(store, "_secret", None)
    return secret if isinstance(secret, bytes) else None
