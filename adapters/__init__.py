"""threadlog's adapters: the runtime Store, the session store, JSONL files and access control."""

from ._access import (
    AccessDenied,
    AccessPolicy,
    Action,
    AllowAll,
    CallbackPolicy,
    Principal,
    TenantPolicy,
    authorize,
)
from ._jsonl import (
    ImportReport,
    JsonlImportError,
    JsonlLineError,
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
    TurnNotFoundError,
    as_message,
)

__all__ = [
    "AccessDenied",
    "AccessPolicy",
    "Action",
    "AllowAll",
    "CallbackPolicy",
    "ImportReport",
    "JsonlImportError",
    "JsonlLineError",
    "Principal",
    "RecordsPage",
    "SessionStore",
    "SessionUpdate",
    "Settlement",
    "StateUpdate",
    "TenantPolicy",
    "ThreadStore",
    "Transcript",
    "TurnNotFoundError",
    "as_message",
    "authorize",
    "export_jsonl",
    "import_jsonl",
    "parse_jsonl",
    "session_update",
]
