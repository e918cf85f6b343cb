"""The runs a worker process holds and the GPUs lent to each: one run per GPU set at a time.

A worker with GPUs lends each run its own set (``CUDA_VISIBLE_DEVICES`` of the engine), so two
runs never share a device; a run that finds too few free GPUs goes back to its queue (the task
is retried later, and another worker may take it meanwhile). Thread-safe: the ``threads`` pool
runs several supervisors in one process.
"""

from __future__ import annotations

import threading


class WorkerSlots:
    def __init__(self, gpus: list[int] | None = None) -> None:
        self._lock = threading.Lock()
        self.gpus = list(gpus or [])
        self._lent: dict[str, list[int]] = {}  # run id -> GPU indices

    def set_gpus(self, gpus: list[int]) -> None:
        with self._lock:
            self.gpus = list(gpus)

    def free(self) -> int:
        with self._lock:
            return len(self._free())

    def _free(self) -> list[int]:
        busy = {g for lent in self._lent.values() for g in lent}
        return [g for g in self.gpus if g not in busy]

    def acquire(self, run_id: int | str, n_gpus: int) -> list[int] | None:
        """Lend ``n_gpus`` free GPUs to ``run_id`` (lowest indices first); ``None`` if too few are free."""
        with self._lock:
            free = self._free()
            if n_gpus > len(free):
                return None
            self._lent[str(run_id)] = free[:n_gpus]
            return list(self._lent[str(run_id)])

    def release(self, run_id: int | str) -> None:
        with self._lock:
            self._lent.pop(str(run_id), None)

    def state(self) -> tuple[list[str], list[int]]:
        """``(run ids held, GPU indices lent)`` for the worker's registry entry."""
        with self._lock:
            return sorted(self._lent), sorted(g for lent in self._lent.values() for g in lent)


SLOTS = WorkerSlots()
"""This process's slots (the worker's GPUs are set when it starts: ``jobs.tasks``)."""
