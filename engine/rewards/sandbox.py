"""Limits a reward worker process puts on itself before it loads any reward function.

Reward functions are the one place a run executes code the engine did not write (a user's
``module:function``, a verifier library parsing model output). On a worker the whole engine is
already confined (``jobs/confine.py``); the scoring processes get tighter limits on top, so a
function that misbehaves costs its own scores, never the run or the machine:

- **memory**: ``RLIMIT_AS`` (``reward.worker_memory_mb``); an allocation beyond it fails with
  MemoryError, which the pool scores as that call's error;
- **CPU time**: ``RLIMIT_CPU`` (``reward.worker_cpu_s``, the process's whole life): past it the
  kernel ends the process and the pool replaces it (the call in flight counts as an error). The
  per-call wall-clock timeout (``reward.timeout_s``) stays the first line;
- **no child processes**: a seccomp filter fails ``fork``, ``vfork``, ``execve``/``execveat`` and
  any ``clone`` that does not make a thread (threads stay allowed) with EPERM, and ``clone3`` with
  ENOSYS (so that the C library falls back to ``clone`` for threads);
- **no writes**: a Landlock layer that allows writing only to ``$TMPDIR`` (the run's own
  ``tmp``) and ``/dev/null``.

The filters come from well-kept, dependency-free bindings (``seccompy``, ``landlockpy``) rather
than hand-written BPF. Where the kernel lacks seccomp or Landlock, or on another OS, that layer
is skipped and ``apply_limits`` says so (the pool puts it in the run's log).
"""

from __future__ import annotations

import errno
import os
import resource
import sys
from dataclasses import dataclass

_CLONE_THREAD = 0x00010000


@dataclass(frozen=True)
class WorkerLimits:
    memory_mb: int = 8192
    cpu_s: int = 3600


def _rlimits(limits: WorkerLimits) -> None:
    memory = limits.memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    # SIGXCPU (which ends the process) at the soft limit; SIGKILL a few seconds later at the hard.
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 5))


def _no_children() -> None:
    from seccompy import Action, ArgCmp, CmpOp, Filter, syscall_nr

    rules = Filter(Action.ALLOW)
    for name in ("fork", "vfork", "execve", "execveat"):
        try:
            syscall_nr(name)  # aarch64 has no fork/vfork
        except (KeyError, ValueError):
            continue
        rules.errno(name, errno.EPERM)
    rules.errno("clone3", errno.ENOSYS)
    rules.allow("clone", args=[ArgCmp(0, CmpOp.MASKED_EQ, _CLONE_THREAD, mask=_CLONE_THREAD)])
    rules.errno("clone", errno.EPERM)
    rules.load()


def _no_writes() -> None:
    from landlockpy import AccessFS, Ruleset

    writes = (
        AccessFS.WRITE_FILE | AccessFS.TRUNCATE | AccessFS.REMOVE_DIR | AccessFS.REMOVE_FILE
        | AccessFS.MAKE_DIR | AccessFS.MAKE_REG | AccessFS.MAKE_SOCK | AccessFS.MAKE_FIFO
        | AccessFS.MAKE_SYM | AccessFS.MAKE_CHAR | AccessFS.MAKE_BLOCK | AccessFS.REFER
    )  # fmt: skip
    with Ruleset(handled_fs=writes, handled_net=0) as rules:
        tmp = os.environ.get("TMPDIR", "")
        if tmp and os.path.isdir(tmp):
            rules.allow_path(tmp, writes)
        rules.allow_path("/dev/null", AccessFS.WRITE_FILE | AccessFS.TRUNCATE)
        rules.restrict()


def apply_limits(limits: WorkerLimits) -> list[str]:
    """Limit this process (irreversibly); returns the layers that could not be applied."""
    skipped: list[str] = []
    _rlimits(limits)
    if not sys.platform.startswith("linux"):
        return ["seccomp and Landlock (not Linux)"]
    import landlockpy
    import seccompy

    if seccompy.supported():
        _no_children()
    else:
        skipped.append("no-child-processes filter (the kernel has no seccomp filters)")
    if landlockpy.supported():
        _no_writes()
    else:
        skipped.append("no-writes rule (the kernel has no Landlock)")
    return skipped
