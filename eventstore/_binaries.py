"""Which server binary (Redis or Valkey) and which of its tools threadlog runs.

Valkey installs its programs as ``valkey-server``, ``valkey-cli`` and ``valkey-check-aof``
(Debian's ``valkey-tools`` names no ``redis-*``), so a machine with Valkey only would otherwise
fall back to the in-memory backend. ``THREADLOG_REDIS_SERVER`` names a binary to use instead
of searching PATH (a build of one's own, or Valkey on a machine that has both); its tools are
then taken from the same directory when they are there.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ._errors import StoreConnectionError

SERVER_ENV = "THREADLOG_REDIS_SERVER"

# The two families of programs, in the order they are looked for: <flavour>-server,
# <flavour>-cli, <flavour>-check-aof.
_FLAVOURS = ("redis", "valkey")


def server_binary() -> str | None:
    """The server to start: ``$THREADLOG_REDIS_SERVER``, else ``redis-server`` on PATH, else
    ``valkey-server``; ``None`` when there is none. A set variable that names no executable
    file is `StoreConnectionError` (a typo must not silently pick another server)."""
    given = os.environ.get(SERVER_ENV)
    if given:
        found = shutil.which(given)
        if found is None:
            raise StoreConnectionError(
                f"{SERVER_ENV}={given!r} is not an executable file (nor a program on PATH)"
            )
        return found
    for flavour in _FLAVOURS:
        found = shutil.which(f"{flavour}-server")
        if found is not None:
            return found
    return None


def tool_binary(tool: str, server: str | None = None) -> str | None:
    """The server's companion ``tool`` (``"cli"``, ``"check-aof"``): the same flavour's, next
    to ``server`` (default: `server_binary`), else on PATH under either flavour's name, the
    server's own first."""
    if server is None:
        try:
            server = server_binary()
        except StoreConnectionError:
            server = None
    ordered = list(_FLAVOURS)
    if server is not None:
        mine = flavour_of(Path(server).name)
        if mine is not None:
            ordered.remove(mine)
            ordered.insert(0, mine)
            beside = Path(server).parent / f"{mine}-{tool}"
            if os.access(beside, os.X_OK) and beside.is_file():
                return str(beside)
    for flavour in ordered:
        found = shutil.which(f"{flavour}-{tool}")
        if found is not None:
            return found
    return None


def flavour_of(name: str) -> str | None:
    """``"redis"`` or ``"valkey"`` for a program or process name of theirs, else ``None``."""
    for flavour in _FLAVOURS:
        if name.startswith(f"{flavour}-"):
            return flavour
    return None


def is_server_process_name(comm: str) -> bool:
    """Whether a process named ``comm`` (``/proc/<pid>/comm``: the name it was started as, 15
    characters of it) is a Redis or Valkey server, or one started from
    ``$THREADLOG_REDIS_SERVER`` (whatever that file is called)."""
    if comm.startswith(tuple(f"{flavour}-server" for flavour in _FLAVOURS)):
        return True
    given = os.environ.get(SERVER_ENV)
    return given is not None and given != "" and comm == Path(given).name[:15]
