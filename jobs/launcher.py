"""The engine's launcher: a small single-threaded process between the run supervisor and the engine.

``python -m jobs.launcher PARENT_PID GRACE_S PLAN_JSON -- python -m engine run ...``

1. **Confinement.** It applies the run's ``ConfinementPlan`` (``jobs/confine.py``: Landlock, no
   capabilities) to itself before it starts the engine, so the engine and everything the engine
   starts (ranks, reward workers, the rollout process) inherit it. A plan that is required but
   cannot be applied ends the launcher with exit code 1 and the reason on stderr (the run's
   ``engine.log``), before any of the run's code has run.
2. **Orphan handling.** Should the supervisor's process die (even by SIGKILL), the kernel tells
   the launcher (``PR_SET_PDEATHSIG``, SIGUSR1), which sends the engine one SIGTERM (it
   checkpoints and stops instead of training on unsupervised), then SIGKILL after the grace
   period. Not PDEATHSIG on the engine itself: the worker is multi-threaded, and the kernel sends
   the signal again each time the child passes to another dying thread; a second SIGTERM makes
   the engine stop without its checkpoint.
3. The process group's SIGTERM/SIGINT reaches the engine itself once it runs; the launcher's own
   copy is ignored then (a Python handler, reset to the default in the engine by exec). One that
   comes before the engine exists (the supervisor cancels while the launcher confines itself) is
   kept: the engine is not started, or, arriving during its start, is sent to it once started.
   The launcher exits as the engine did (same code, or same signal).

It imports nothing heavy (no Celery, no torch): it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

from jobs.confine import ConfinementPlan, ConfinementUnavailable, confine

_PR_SET_PDEATHSIG = 1


class _Launcher:
    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.child: subprocess.Popen[bytes] | None = None
        self.orphaned = False
        self.stop_before_start = False  # a SIGTERM/SIGINT came before the engine existed

    def group_stop(self, signum: int, frame: object) -> None:
        if self.child is None:
            self.stop_before_start = True

    def parent_gone(self, signum: int, frame: object) -> None:
        if not self.orphaned:
            self.orphaned = True
            if self.child is not None:
                self.stop()

    def stop(self) -> None:
        assert self.child is not None
        os.kill(self.child.pid, signal.SIGTERM)
        signal.setitimer(signal.ITIMER_REAL, max(self.grace, 0.01))

    def kill(self, signum: int, frame: object) -> None:
        if self.child is not None:
            os.kill(self.child.pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 5 or argv[3] != "--":
        print("usage: python -m jobs.launcher PARENT_PID GRACE_S PLAN_JSON -- COMMAND...", file=sys.stderr)
        return 2
    parent, grace, plan = int(argv[0]), float(argv[1]), ConfinementPlan.from_json(argv[2])
    command = argv[4:]
    launcher = _Launcher(grace)
    signal.signal(signal.SIGTERM, launcher.group_stop)
    signal.signal(signal.SIGINT, launcher.group_stop)
    signal.signal(signal.SIGUSR1, launcher.parent_gone)
    signal.signal(signal.SIGALRM, launcher.kill)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGUSR1))
    if os.getppid() != parent:
        print("the run supervisor exited before the engine started", file=sys.stderr)
        return 1
    try:
        print(f"launcher: {confine(plan)}", file=sys.stderr, flush=True)
    except ConfinementUnavailable as exc:
        print(f"launcher: the run was not started: {exc}", file=sys.stderr, flush=True)
        return 1
    if launcher.stop_before_start:  # cancelled while confining: end as a SIGTERM'd engine would
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    launcher.child = subprocess.Popen(command)
    if launcher.orphaned or launcher.stop_before_start:  # either came while the engine started
        launcher.stop()
    code = launcher.child.wait()
    if code < 0:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
