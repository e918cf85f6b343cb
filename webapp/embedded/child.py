"""The first program of each of ``serve``'s children: ``python -m webapp.embedded.child PID ARGV...``.

It asks the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``, which survives the
``execv`` below), so a ``serve`` that is killed, even by SIGKILL, never leaves a web server
holding its port or a worker holding a run. The parent's pid is checked after ``prctl``: if
``serve`` died before that call, the signal would never come, so the child exits instead. Then
it becomes the real program. Not ``preexec_fn``: ``serve`` is multi-threaded (one output reader
per child), and code between fork and exec in a threaded parent may deadlock.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    parent, program = int(argv[0]), argv[1:]
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent:
        sys.exit(1)
    os.execv(sys.executable, [sys.executable, *program])


if __name__ == "__main__":
    main(sys.argv[1:])
