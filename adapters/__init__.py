"""threadlog's adapters: the runtime Store, the session store, JSONL files and access control.

Each takes an open `eventstore.EventStore` (``await eventstore.connect(...)``):
``ThreadStore(store)`` for a conversation's turns, messages and state blocks,
``SessionStore(store)`` for model-message transcripts (``load`` / ``save(session_update(...))``).
"""

from ._access import (
    AccessDenied,
    AccessPolicy,
    Action,
    AllowAll,
    CallbackPolicy,
    Principal,
    ReaderViewPolicy,
    TenantPolicy,
    authorize,
)
from ._audit import (
    Auditor,
    DamageKind,
    Diff,
    Problem,
    ReplayStep,
    ThreadCheck,
    UnverifiedLogError,
    Verdict,
    log_verified,
)
from ._export import (
    COLUMNS,
    ExportBusyError,
    Exporter,
    ExportResult,
    ExportSourceError,
    ExportWorkerError,
    committed_positions,
    read_parquet_dir,
)

# Imported for its effect too: the framework adapters' event types join the default registry, so
# every reader decodes their threads without the frameworks installed.
from ._framework_events import register_framework_events
from ._jsonl import (
    ImportProgress,
    ImportReport,
    JsonlImportError,
    JsonlLineError,
    NoTranscriptError,
    export_jsonl,
    import_jsonl,
    parse_jsonl,
)
from ._sessions import SessionStore, SessionUpdate, Transcript, session_update
from ._threads import (
    RecordsPage,
    Settlement,
    StateUpdate,
    ThreadStore,
    TurnConflictError,
    TurnNotFoundError,
    as_message,
)

__all__ = [
    "register_framework_events",
    "COLUMNS",
    "ExportBusyError",
    "ExportResult",
    "ExportSourceError",
    "ExportWorkerError",
    "Exporter",
    "committed_positions",
    "read_parquet_dir",
    "AccessDenied",
    "AccessPolicy",
    "Action",
    "AllowAll",
    "Auditor",
    "CallbackPolicy",
    "DamageKind",
    "Diff",
    "ImportProgress",
    "ImportReport",
    "JsonlImportError",
    "JsonlLineError",
    "NoTranscriptError",
    "Principal",
    "Problem",
    "RecordsPage",
    "ReplayStep",
    "SessionStore",
    "SessionUpdate",
    "Settlement",
    "StateUpdate",
    "ReaderViewPolicy",
    "TenantPolicy",
    "ThreadStore",
    "Transcript",
    "TurnConflictError",
    "TurnNotFoundError",
    "ThreadCheck",
    "UnverifiedLogError",
    "Verdict",
    "as_message",
    "authorize",
    "export_jsonl",
    "import_jsonl",
    "log_verified",
    "parse_jsonl",
    "session_update",
]
