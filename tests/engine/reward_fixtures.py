"""User reward functions for tests/engine/test_rewards.py, imported by 'module:function'.

They run in the reward worker processes, so they must live in an importable module (not in
the test file's local scope).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def contains_answer(completion, answer):
    """A good user function that declares only part of the signature."""
    return 1.0 if answer is not None and answer in completion else 0.0


def scaled_length(text: str, *, response_length: int, scale: float) -> float:
    """First parameter not named 'completion', a required parameter set from the config."""
    return scale * response_length + (0.0 * len(text))


def keyword_only(*, completion: str, finish_reason: str) -> float:
    return 1.0 if finish_reason == "stop" and completion else 0.0


def echo_everything(completion: str, **kwargs: Any) -> float:
    """Takes **kwargs: receives every input field (checked by the test through the value)."""
    expected = {"answer", "prompt", "metadata", "response_length", "max_response_length", "finish_reason"}
    return 1.0 if expected <= set(kwargs) and kwargs["metadata"].get("tag") == "x" else 0.0


def raises(completion: str) -> float:
    raise RuntimeError("boom from user code")


def swallows_everything(completion: str) -> float:
    """Catches Exception around a hang: the timeout must still get through."""
    try:
        time.sleep(3600)
    except Exception:
        return -1.0  # would show if the timeout had been swallowed
    return 1.0


def hangs(completion: str) -> float:
    """Hangs in an interruptible way (sleep) when asked to; scores 1.0 otherwise."""
    if "hang" in completion:
        time.sleep(3600)
    return 1.0


def hangs_hard(completion: str) -> float:
    """Hangs where no signal reaches it (like a long C call) when asked to; 1.0 otherwise.

    Blocking SIGALRM stands in for C code that never returns to the interpreter.
    """
    if "hang" in completion:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    return 1.0


def crashes(completion: str) -> float:
    """Kills its own process when asked to (like a segfault in an extension)."""
    if "crash" in completion:
        os._exit(3)
    return 1.0


def returns_string(completion: str) -> Any:
    return "1.0"


def returns_nan(completion: str) -> float:
    return float("nan")


def returns_none(completion: str) -> Any:
    return None


def returns_bool(completion: str) -> bool:
    return completion.startswith("y")


def worker_pid(completion: str) -> float:
    return float(os.getpid())


NOT_CALLABLE = 42


def _in_reward_worker() -> bool:
    import multiprocessing

    return multiprocessing.parent_process() is not None


def __getattr__(name: str) -> Any:
    """``dies_on_load`` resolves in the test process but kills a reward worker that loads it."""
    if name == "dies_on_load":
        if _in_reward_worker():
            os._exit(7)
        return contains_answer
    raise AttributeError(name)


def sandbox_probe(completion: str) -> float:
    """What a reward function may do in a scoring process, as bits of its score (1: fork,
    2: run a program, 4: write outside $TMPDIR, 8: start a thread, 16: allocate 1 GiB past the
    memory limit the test sets, 32: write in $TMPDIR)."""
    import subprocess
    import tempfile
    import threading

    bits = 0
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        bits |= 1
    except OSError:
        pass
    try:
        subprocess.run(["true"], check=False)
        bits |= 2
    except OSError:
        pass
    try:
        with open(completion, "w") as fh:  # the test passes a path outside $TMPDIR
            fh.write("x")
        bits |= 4
    except OSError:
        pass
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
    bits |= 8
    try:
        block = bytearray(1536 * 1024 * 1024)
        del block
        bits |= 16
    except MemoryError:
        pass
    try:
        with tempfile.NamedTemporaryFile() as fh:
            fh.write(b"x")
        bits |= 32
    except OSError:
        pass
    return float(bits)


def burns_cpu(completion: str) -> float:
    """Spins until the kernel's CPU-time limit ends the process."""
    while True:
        pass
