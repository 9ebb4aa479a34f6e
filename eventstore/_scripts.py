"""The Lua scripts, loaded from package files and called by hash, surviving NOSCRIPT."""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError


class Script:
    """One Lua script: its source and SHA1, called with EVALSHA.

    After a restart, failover or ``SCRIPT FLUSH`` the server answers NOSCRIPT; the call is then
    repeated once with EVAL, which runs the script and caches it again. The script's first
    action cannot have happened on a NOSCRIPT reply, so the repeat is safe.
    """

    __slots__ = ("name", "sha", "source")

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode("utf-8"), usedforsecurity=False).hexdigest()

    @classmethod
    def from_package(cls, name: str) -> Script:
        """Load ``eventstore/lua/<name>.lua``."""
        source = resources.files("eventstore").joinpath("lua", f"{name}.lua").read_text("utf-8")
        return cls(name, source)

    async def __call__(self, client: Any, keys: list[Any], args: list[Any]) -> Any:
        # execute_command is what evalsha/eval call (standalone and cluster alike); calling it
        # directly spares two frames that re-pack every argument, on every append.
        try:
            return await client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await client.execute_command("EVAL", self.source, len(keys), *keys, *args)


APPEND = Script.from_package("append")
READ_VIEWS = Script.from_package("read_views")
LOAD_VIEWS = Script.from_package("load_views")
SEQ_AT = Script.from_package("seq_at")
DELETE_THREAD = Script.from_package("delete_thread")
APPLY_CHECKPOINTED = Script.from_package("apply_checkpointed")
