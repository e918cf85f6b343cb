"""The N rank processes of a multi-rank engine run, started by the engine itself.

A DeepSpeed run (``trainer.backend: deepspeed``) is ``trainer.num_ranks`` processes on one
machine, each ``python -m engine run ...`` with the ``RANK``/``WORLD_SIZE``/``MASTER_*``
variables ``torch.distributed`` reads (the environment ``torchrun`` would set). ``python -m
engine run`` starts them itself through ``launch_ranks`` when it is not already a rank, so the
same command works from a terminal and from the job supervisor.

Why not ``torchrun``: the supervisor cancels a run by sending SIGTERM to the engine's process
group, and the engine stops cleanly only on exactly one SIGTERM (a second one means "stop now,
no checkpoint"). Under torchrun, rank 0 would get the group's signal and torchrun's forwarded
one. Here the ranks live in their own process group, the launcher forwards each signal it gets
once to every rank, rank 0 checkpoints and tells the others to stop (they ignore signals and
follow rank 0), and the launcher exits with rank 0's code (3 when cancelled).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

RANK_ENV = "RANK"
LAUNCHED_ENV = "TRIBUTARY_RANKS_LAUNCHED"
FOLLOWER_EXIT_GRACE_S = 30.0
"""How long the other ranks may take to exit after rank 0 did before they are killed."""


def is_rank_process() -> bool:
    """True inside a rank started by ``launch_ranks`` (or by torchrun / another launcher)."""
    return RANK_ENV in os.environ


def rank_info() -> tuple[int, int, int]:
    """(rank, world size, local rank) of this process; (0, 1, 0) when not launched as a rank."""
    rank = int(os.environ.get(RANK_ENV, "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    return rank, world, local


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for ``MASTER_PORT`` (the ranks' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    # Runs in the child between fork and exec: if the launcher dies (even by SIGKILL), the
    # kernel kills the rank instead of leaving it waiting forever on its peers.
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def launch_ranks(argv: Sequence[str], num_ranks: int, *, env: dict[str, str] | None = None) -> int:
    """Run ``argv`` as ``num_ranks`` processes of one ``torch.distributed`` job; returns the exit code.

    Rank 0 inherits stdout (the event log may be ``--events -``); the other ranks write to
    stderr. SIGTERM/SIGINT received here are forwarded once each to every rank. When rank 0
    exits, the others get ``FOLLOWER_EXIT_GRACE_S`` to finish; a rank that fails takes the
    job down (the others are killed) and the launcher exits non-zero.
    """
    base = dict(os.environ if env is None else env)
    base.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(num_ranks),
            "LOCAL_WORLD_SIZE": str(num_ranks),
            LAUNCHED_ENV: "1",
        }
    )
    # As torchrun does: ranks that each start one intra-op thread per core oversubscribe the
    # machine (on 2 cores, 2 ranks spent more time in the kernel than computing). Split the cores.
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_ranks)))
    procs: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for rank in range(num_ranks):
            rank_env = base | {RANK_ENV: str(rank), "LOCAL_RANK": str(rank)}
            procs.append(
                subprocess.Popen(
                    list(argv),
                    env=rank_env,
                    stdout=None if rank == 0 else sys.stderr.fileno(),
                    start_new_session=True,  # signals reach the ranks only through forward()
                    preexec_fn=die_with_parent,
                )
            )
        return _wait(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for s, h in old.items():
            signal.signal(s, h)


def _wait(procs: list[subprocess.Popen[bytes]]) -> int:
    leader = procs[0]
    deadline: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes[1:] if c not in (None, 0)]
        if failed:
            # A follower died: rank 0 would wait forever on its collectives.
            print(f"engine ranks: a rank exited with code {failed[0]}; stopping the run", file=sys.stderr)
            return 1 if codes[0] in (None, 0, 3) else codes[0]
        if codes[0] is not None:
            if all(c is not None for c in codes):
                return _exit_code(codes[0])
            deadline = deadline or time.monotonic() + (FOLLOWER_EXIT_GRACE_S if codes[0] in (0, 3) else 0.0)
            if time.monotonic() > deadline:
                if codes[0] in (0, 3):
                    print("engine ranks: ranks did not exit after rank 0; killed", file=sys.stderr)
                return _exit_code(codes[0])
        with contextlib.suppress(subprocess.TimeoutExpired, StopIteration):
            (leader if codes[0] is None else next(p for p in procs if p.poll() is None)).wait(timeout=0.2)


def _exit_code(code: int) -> int:
    # A rank killed by a signal: report it as the shell would (128 + signal number).
    return 128 - code if code < 0 else code
