"""Repairing an append-only file cut by a hard kill, before a server loads it.

Why this exists: a SIGKILL (or power loss) can cut the AOF inside the ``MULTI``/``EXEC`` block
that Redis writes for one script's effects. Redis 7.0 then loads the file with
``aof-load-truncated yes`` (its default) by cutting it after the last *complete command*, which
can leave that block's ``MULTI`` open at the end of the file. Everything the restarted server
appends lands after it, inside the open block: the next restart drops it as an incomplete
transaction (acknowledged writes lost), or replays it against state the block never had.
``redis-check-aof --fix`` cuts the file before the open ``MULTI`` instead, which is the last
state the server acknowledged as a whole. See docs/guarantees.md (crash durability).
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

from ._binaries import tool_binary

log = logging.getLogger("threadlog")

#: Redis's default ``appenddirname``: the multi-part AOF (Redis >= 7) lives in it.
AOF_DIRNAME = "appendonlydir"


class AofRepairError(RuntimeError):
    """``redis-check-aof`` could not make the append-only file loadable."""


def repair_aof(
    directory: Path, *, dirname: str = AOF_DIRNAME, timeout: float = 600.0
) -> str | None:
    """Run ``redis-check-aof --fix`` on the multi-part AOF under ``directory``, if there is one.

    Returns what it did (its last lines) when it had to cut the file, ``None`` when the file
    was intact or there is no AOF there. Call it only while no server has the file open.
    Raises `AofRepairError` when the tool is missing or cannot fix the file; the file is then
    as it was (the tool only ever truncates, after asking).
    """
    manifests = sorted((directory / dirname).glob("*.manifest"))
    if not manifests:
        return None
    tool = tool_binary("check-aof")
    if tool is None:
        raise AofRepairError(
            "redis-check-aof (or valkey-check-aof) is not on PATH (Debian: package "
            "redis-tools, or valkey-tools); it is needed to "
            f"repair {directory / dirname} after an unclean shutdown"
        )
    # The tool asks before it truncates; "y" is the answer --fix exists for.
    done = subprocess.run(
        [tool, "--fix", str(manifests[-1])],
        input="y\n",
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        tail = " | ".join(output.splitlines()[-3:])
        raise AofRepairError(f"redis-check-aof --fix failed on {manifests[-1]}: {tail}")
    cut = [line for line in output.splitlines() if "truncated" in line or "shrink" in line]
    if not cut:
        return None
    summary = "; ".join(cut)
    log.warning("threadlog: repaired the AOF under %s: %s", directory, summary)
    return summary


__all__ = ["AOF_DIRNAME", "AofRepairError", "repair_aof"]
