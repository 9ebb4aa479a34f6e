"""Files the adapters write: made under a temporary name, renamed into place, normal modes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _umask() -> int:
    # Linux reports it without changing it; os.umask can only be read by setting it, which
    # another thread creating a file meanwhile would see (export parts are written in threads).
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temp_beside(path: Path) -> tuple[int, str]:
    """A new file next to ``path`` (same directory, so a rename is atomic), open for writing.

    mkstemp makes files 0600; the result here gets the mode a plain ``open()`` would (0666
    less the umask), so whoever may read the directory may read the export, as with any other
    file the user writes.
    """
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
    except BaseException:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    return fd, tmp
