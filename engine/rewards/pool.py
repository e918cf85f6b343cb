"""Worker processes that run reward functions which may be slow, hang or crash.

Why processes: a reward that loops forever in C code (a sympy simplification, a pathological
regex) cannot be interrupted inside the calling process, and a user function may segfault or
call ``os._exit``. Such a call must cost one component score, never the run.

How time is limited, in two layers:

- Each worker arms ``SIGALRM`` (``setitimer``) around every call and turns it into an exception
  derived from ``BaseException`` (so ``except Exception`` in user code or math-verify does not
  swallow it). That stops anything that runs Python bytecode or sleeps, without losing the
  worker.
- The worker reports every result as soon as it has it, so the parent knows which call is
  running and when it started. A worker silent for longer than ``timeout_s`` plus a grace is
  stuck where signals cannot reach (C code, masked signals, a swallowed timeout): the parent
  kills it, counts that one call as a timeout, starts a replacement and requeues the rest of
  its chunk.

Items travel in chunks (one pipe message per chunk of items) and results stream back as small
messages that the worker sends without waiting for an answer: no round trip per item.
Workers are started with ``spawn``: the parent runs torch threads, and forking a threaded
process can deadlock.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

from engine.rewards.registry import ItemTuple, import_object, make_caller
from engine.rewards.sandbox import WorkerLimits, apply_limits

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
"""A worker that has not imported its reward functions by then is killed and replaced."""

MAX_START_FAILURES = 3
"""Consecutive workers dying before they are ready: then the pooled calls fail as errors."""

OK, ERROR, TIMEOUT = "ok", "error", "timeout"


class _CallTimeout(BaseException):
    """Raised by the SIGALRM handler; a BaseException so ``except Exception`` cannot catch it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _CallTimeout


def to_score(value: Any) -> float:
    """``value`` as a finite float; raises TypeError/ValueError for anything else.

    bool counts as a number (True -> 1.0); str does not, although ``float("1")`` would accept
    it: a string return is almost always a bug (returning the extracted answer by mistake).
    """
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        raise TypeError(f"returned {type(value).__name__} {_short(repr(value), 60)}, expected a float")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"returned a non-finite value ({result})")
    return result


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_error(name: str, exc: BaseException) -> str:
    """One line for the log: which component failed and how."""
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return _short(f"{name}: {type(exc).__name__}" + (f": {detail}" if detail else ""))


def _worker_main(
    conn: Connection, functions: list[tuple[str, str, dict[str, Any]]], limits: WorkerLimits
) -> None:
    """Entry point of a worker: limit itself, load the functions, then score chunks until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGALRM, _on_alarm)
    skipped = apply_limits(limits)  # before any reward module is imported (engine/rewards/sandbox.py)
    callers: list[Any] = []
    for name, ref, params in functions:
        try:
            fn = import_object(ref)
            callers.append(make_caller(fn, params))
            warmup = getattr(fn, "reward_warmup", None)
            if warmup is not None:
                warmup()
        except Exception as exc:
            callers.append(f"{name}: cannot load {ref} in the reward worker: {describe_error(name, exc)}")
    conn.send(("ready", os.getpid(), skipped))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if message is None:
            return
        timeout_s, jobs = message
        for k, (index, item) in enumerate(jobs):
            caller = callers[index]
            if isinstance(caller, str):
                conn.send((k, ERROR, caller))
                continue
            conn.send((k, *_call(caller, functions[index][0], item, timeout_s)))


def _call(caller: Any, name: str, item: ItemTuple, timeout_s: float) -> tuple[str, Any]:
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            value = caller(item)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        return OK, to_score(value)
    except _CallTimeout:
        return TIMEOUT, f"{name}: timed out after {timeout_s:g} s"
    except BaseException as exc:  # SystemExit from user code included: it must not end the worker
        return ERROR, describe_error(name, exc)


# ----------------------------------------------------------------------------- parent side


@dataclass
class _Chunk:
    jobs: list[tuple[int, int]]  # (function index, item index)
    items: Sequence[ItemTuple]


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    started: float
    ready: bool = False
    chunk: _Chunk | None = None
    done: int = 0  # results received for the current chunk
    deadline: float = 0.0


@dataclass
class PoolOutcome:
    """Results of one ``RewardPool.run``: ``(function index, item index, status, value or message)``."""

    results: list[tuple[int, int, str, Any]] = field(default_factory=list)
    killed: int = 0  # workers killed for hanging or found dead


class RewardPool:
    """``workers`` processes that each hold every pooled reward function, ready to call.

    ``functions`` are ``(component name, "module:qualname", params)``; workers import them by
    reference, so they need nothing from the parent but an import path.
    """

    def __init__(
        self,
        functions: list[tuple[str, str, dict[str, Any]]],
        *,
        timeout_s: float,
        workers: int,
        limits: WorkerLimits | None = None,
    ) -> None:
        self._functions = functions
        self._limits = limits or WorkerLimits()
        self.skipped_limits: list[str] = []  # sandbox layers the kernel could not apply
        self._timeout_s = timeout_s
        self._grace_s = 1.0 + 0.25 * timeout_s  # the worker's own alarm should win the race
        self._ctx = mp.get_context("spawn")
        self._start_failures = 0
        self._closed = False
        self._workers = [self._spawn() for _ in range(workers)]

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main, args=(child_conn, self._functions, self._limits), name="reward-worker", daemon=True
        )
        proc.start()
        child_conn.close()
        return _Worker(proc=proc, conn=parent_conn, started=time.monotonic())

    def _replace(self, worker: _Worker) -> _Worker:
        _kill(worker)
        new = self._spawn()
        self._workers[self._workers.index(worker)] = new
        return new

    def run(
        self,
        items: Sequence[ItemTuple],
        function_ids: Sequence[int],
        meanwhile: Callable[[], None] | None = None,
    ) -> PoolOutcome:
        """Call every function in ``function_ids`` on every item; never raises for a bad call.

        ``meanwhile`` is called once, after the first chunks are on their way, so the caller's
        own work overlaps the workers'.
        """
        if self._closed:
            raise RuntimeError("the reward pool is closed")
        outcome = PoolOutcome()
        if not items or not function_ids:
            if meanwhile is not None:
                meanwhile()
            return outcome
        queue: deque[_Chunk] = deque()
        # ~4 chunks per worker balances load; 64 items per chunk bounds the work redone or
        # waited on when a worker is lost.
        per_chunk = max(1, min(64, -(-len(items) // (4 * len(self._workers)))))
        for start in range(0, len(items), per_chunk):
            jobs = [(f, i) for i in range(start, min(start + per_chunk, len(items))) for f in function_ids]
            queue.append(_Chunk(jobs, items))
        try:
            self._loop(queue, len(items) * len(function_ids), outcome, meanwhile)
        except BaseException:
            # Interrupted (Ctrl-C): a worker still busy would send stale results into the next
            # run, so busy workers are replaced.
            for w in list(self._workers):
                if w.chunk is not None:
                    self._replace(w)
            raise
        return outcome

    def _loop(
        self,
        queue: deque[_Chunk],
        pending: int,
        outcome: PoolOutcome,
        meanwhile: Callable[[], None] | None,
    ) -> None:
        self._start_failures = 0
        first = True
        while pending or first:
            now = time.monotonic()
            for w in self._workers:
                while w.ready and w.chunk is None and queue:  # a chunk may settle without work
                    pending -= self._dispatch(w, queue.popleft(), now, outcome)
            if first:
                first = False
                if meanwhile is not None:
                    meanwhile()
                continue  # first dispatch to workers that became ready meanwhile
            if self._start_failures >= MAX_START_FAILURES and not any(w.ready for w in self._workers):
                self._fail_queued(queue, outcome)  # nothing is in flight: no worker is ready
                return
            # Only busy and starting workers have deadlines (an idle worker's is stale).
            deadlines = [w.deadline for w in self._workers if w.ready and w.chunk is not None]
            deadlines += [w.started + STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 1.0
            wait([w.conn for w in self._workers] + [w.proc.sentinel for w in self._workers], timeout)
            for w in list(self._workers):
                pending -= self._drain(w, queue, outcome)
            now = time.monotonic()
            for w in list(self._workers):
                if w.ready and w.chunk is not None and now > w.deadline and not w.conn.poll():
                    reason = f"timed out after {self._timeout_s:g} s"
                    pending -= self._lose(w, queue, outcome, TIMEOUT, reason)
                elif not w.ready and now > w.started + STARTUP_TIMEOUT_S:
                    self._start_failures += 1
                    self._replace(w)

    def _dispatch(self, w: _Worker, chunk: _Chunk, now: float, outcome: PoolOutcome) -> int:
        """Send ``chunk`` to ``w``; returns how many jobs were settled here (unpicklable items)."""
        payload = [(f, chunk.items[i]) for f, i in chunk.jobs]
        try:
            data = ForkingPickler.dumps((self._timeout_s, payload))
        except Exception:
            # Some item (its metadata, usually) cannot be pickled: those items are errors,
            # the others still go.
            good, settled = [], 0
            for job, entry in zip(chunk.jobs, payload):
                try:
                    ForkingPickler.dumps(entry)
                    good.append(job)
                except Exception as exc:
                    name = self._functions[job[0]][0]
                    message = f"{name}: cannot send the item to a reward worker: {describe_error(name, exc)}"
                    outcome.results.append((job[0], job[1], ERROR, message))
                    settled += 1
            if good:
                settled += self._dispatch(w, _Chunk(good, chunk.items), now, outcome)
            return settled
        w.chunk, w.done = chunk, 0
        w.deadline = now + self._timeout_s + self._grace_s
        w.conn.send_bytes(data)
        return 0

    def _drain(self, w: _Worker, queue: deque[_Chunk], outcome: PoolOutcome) -> int:
        """Read everything ``w`` has sent; returns how many jobs got settled."""
        settled = 0
        try:
            while w.conn.poll():
                message = w.conn.recv()
                if message[0] == "ready":
                    w.ready = True
                    self._start_failures = 0
                    if message[2] and not self.skipped_limits:
                        self.skipped_limits = list(message[2])
                        log.warning("reward workers run without: %s", "; ".join(message[2]))
                    continue
                k, status, value = message
                assert w.chunk is not None
                f, i = w.chunk.jobs[k]
                outcome.results.append((f, i, status, value))
                settled += 1
                w.done = k + 1
                w.deadline = time.monotonic() + self._timeout_s + self._grace_s
                if w.done == len(w.chunk.jobs):
                    w.chunk = None
        except (EOFError, OSError):
            pass
        if not w.proc.is_alive():
            w.proc.join(0.1)
            if w.ready:
                reason = f"reward worker process died (exit code {w.proc.exitcode})"
                settled += self._lose(w, queue, outcome, ERROR, reason)
            else:
                self._start_failures += 1
                self._replace(w)
        return settled

    def _lose(self, w: _Worker, queue: deque[_Chunk], outcome: PoolOutcome, status: str, reason: str) -> int:
        """Replace ``w``; blame the call it was running, requeue the rest of its chunk."""
        settled = 0
        chunk, done = w.chunk, w.done
        outcome.killed += 1
        self._replace(w)
        if chunk is not None and done < len(chunk.jobs):
            f, i = chunk.jobs[done]
            name = self._functions[f][0]
            outcome.results.append((f, i, status, f"{name}: {reason}"))
            settled = 1
            if done + 1 < len(chunk.jobs):
                queue.appendleft(_Chunk(chunk.jobs[done + 1 :], chunk.items))
        return settled

    def _fail_queued(self, queue: deque[_Chunk], outcome: PoolOutcome) -> None:
        """No worker can start: every call still queued is an error (the run goes on)."""
        for chunk in queue:
            for f, i in chunk.jobs:
                message = f"{self._functions[f][0]}: reward worker processes die while starting (see stderr)"
                outcome.results.append((f, i, ERROR, message))
        queue.clear()

    def close(self) -> None:
        """Ask workers to exit; kill those that do not within a second."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            with contextlib.suppress(OSError, ValueError):
                w.conn.send(None)
        deadline = time.monotonic() + 1.0
        for w in self._workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
            _kill(w)


def _kill(w: _Worker) -> None:
    if w.proc.is_alive():
        w.proc.kill()
    w.proc.join(1.0)
    w.conn.close()
