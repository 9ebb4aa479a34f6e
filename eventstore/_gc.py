"""`paused_collector`: the cyclic garbage collector paused for a synchronous stretch of work."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_collector() -> Iterator[None]:
    """Pause the cyclic collector for the block, which must not await.

    Bulk reads and rebuilds decode and build thousands of objects per batch, none in a cycle,
    and drop them a moment later. A collection in the middle finds them all alive, walks them
    for nothing and promotes them, and the promotions trigger full collections that walk every
    object of the process (measured: ~1-2 us an event at 100k events). With no await in the
    block, nothing else of the event loop runs while the collector is paused; other threads
    may, for that long (one batch: milliseconds). Reference counting frees as usual.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
