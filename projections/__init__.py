"""threadlog's projections: pure folds over events, kept materialized by inline view ops.

This package never imports redis; it talks to any `eventstore.EventStore`.
"""

from ._base import Projection, UnknownBlockError, UnknownReaderViewError
from ._messages import DEFAULT_WINDOW, MessagesProjection, StoredMessage, conversation_message
from ._projector import (
    REBUILD_ATTEMPTS,
    AsOf,
    CheckReport,
    Context,
    Difference,
    Folded,
    LogFold,
    Materialized,
    Progress,
    Projector,
    RebuildBusyError,
    RebuildError,
    SeqBeyondVersionError,
)
from ._records import Anomaly, RecordsProjection, RecordsState, TurnNode, TurnRecord
from ._runner import (
    MIN_POLL_INTERVAL,
    AsyncProjection,
    ForgottenProjection,
    GroupLag,
    Increment,
    ProjectionRunner,
    UsageProjection,
    UsageRow,
    drop_feed_group,
    feed_group_lag,
    forget_projection,
    partitions_for,
)
from ._state import Block, ReaderView, StateProjection
from ._transcript import TranscriptMessage, TranscriptProjection

__all__ = [
    "DEFAULT_WINDOW",
    "Anomaly",
    "AsyncProjection",
    "AsOf",
    "Block",
    "CheckReport",
    "RebuildBusyError",
    "SeqBeyondVersionError",
    "RebuildError",
    "Context",
    "Difference",
    "Folded",
    "ForgottenProjection",
    "GroupLag",
    "LogFold",
    "Materialized",
    "REBUILD_ATTEMPTS",
    "Increment",
    "MIN_POLL_INTERVAL",
    "MessagesProjection",
    "Progress",
    "ProjectionRunner",
    "Projection",
    "Projector",
    "ReaderView",
    "RecordsProjection",
    "RecordsState",
    "StateProjection",
    "StoredMessage",
    "TranscriptMessage",
    "TranscriptProjection",
    "TurnNode",
    "TurnRecord",
    "UnknownBlockError",
    "UnknownReaderViewError",
    "UsageProjection",
    "UsageRow",
    "conversation_message",
    "drop_feed_group",
    "feed_group_lag",
    "forget_projection",
    "partitions_for",
]
