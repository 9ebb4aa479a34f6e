"""The ``threadlog`` console script: a module light enough to own Ctrl-C from the first moment.

``adapters.cli`` takes ~0.3 s to import (redis, msgspec, anyio, the adapters). Python turns a
Ctrl-C in that time into a KeyboardInterrupt with a traceback, printed before the command line's
own handler exists. Until that handler is in place, SIGINT keeps the operating system's default
action: the process ends at once, quietly, killed by the signal as any interrupted program is
(a shell reports status 130). Nothing has been written by then.
"""

from __future__ import annotations

import signal
import sys


def main() -> int:
    """Run the ``threadlog`` command line."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from adapters.cli import main as run_command_line

    signal.signal(signal.SIGINT, signal.default_int_handler)
    return run_command_line()


if __name__ == "__main__":
    sys.exit(main())
