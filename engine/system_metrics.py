"""System metrics of a run: CPU, memory and GPUs of the engine's process tree, by phase.

A sampler thread reads, every ``interval`` seconds, the engine's own process and all its
descendants (the ranks of a multi-rank run, a rollout process, a vLLM server, the reward pool):
CPU use and resident memory with psutil; on a machine with NVIDIA GPUs, each GPU's utilisation,
power and memory, and the GPU memory the tree's own processes hold (``nvidia-smi``'s
``--query-compute-apps``, so another job on the same GPU is not counted as ours).

Each sample is tagged with the phases active when it was taken and those that ran since the
previous sample (``generate``, ``score``, ``train``, ``weight_sync``; several at once in
asynchronous mode, where generation overlaps training). A phase shorter than the interval is
thus read at the first sample after it, not lost; and at the end of a step, a phase of that step
no sample has seen yet gets one, taken then, so every phase a step ran has its figures whatever
the machine's timing. At the end of a step the samples since the last step become that step's
metrics:

- ``system/cpu_percent`` (mean; 100 = one core), ``system/rss_gb`` (max), ``system/processes``;
- per GPU ``i``: ``system/gpu{i}/util_percent`` (mean), ``system/gpu{i}/power_w`` (mean),
  ``system/gpu{i}/mem_gb`` (max, the device's use by every process);
- ``system/gpu_mem_gb`` (max of the tree's own GPU memory, all GPUs summed);
- by phase: ``system/rss_gb/<phase>`` and ``system/gpu_mem_gb/<phase>``, the max over the samples
  tagged with the phase: which phase holds the memory is what an OOM hunt needs
  (REFERENCES.md, "What goes wrong": out of memory with the rollout engine sharing GPUs).

They travel as ordinary ``metrics`` of the step, so they are stored, charted and compared like
any other (the dashboard's "System" panels). A step shorter than the interval still gets one
sample, taken when the step ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil

PHASES = ("generate", "score", "train", "weight_sync")
GB = 1024**3
MIB = 1024**2


class ActivePhases:
    """Which phases are running now; thread-safe, since generation may run beside training."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: Counter[str] = Counter()
        self._entries: Counter[str] = Counter()  # ever entered: a reader tells what ran since it last looked

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        with self._lock:
            self._active[phase] += 1
            self._entries[phase] += 1
        try:
            yield
        finally:
            with self._lock:
                self._active[phase] -= 1

    def since(self, seen: Counter[str]) -> tuple[tuple[str, ...], Counter[str]]:
        """(The phases active now or entered since ``seen`` was returned, the entries to pass next
        time). Each reader keeps its own ``seen``, so two samplers never take each other's phases."""
        with self._lock:
            ran = {p for p, n in self._active.items() if n > 0}
            ran |= {p for p, n in self._entries.items() if n > seen[p]}
            return tuple(sorted(ran)), self._entries.copy()

    def entered_since(self, seen: Counter[str]) -> bool:
        """Whether a phase was entered after ``since`` returned ``seen`` (the entries only grow)."""
        with self._lock:
            return self._entries != seen


PHASE = ActivePhases()
"""The process's phases: the loop marks them (``with PHASE("generate"):``), the sampler reads them."""


@dataclass
class GpuReading:
    index: int
    util_percent: float | None
    power_w: float | None
    mem_gb: float | None


@dataclass
class Sample:
    phases: tuple[str, ...]
    cpu_percent: float
    rss_gb: float
    processes: int
    gpus: list[GpuReading] = field(default_factory=list)
    own_gpu_mem_gb: float = 0.0


def _number(text: str) -> float | None:
    """A field of nvidia-smi's CSV: a number, or None for ``[N/A]``/``[Not Supported]``."""
    try:
        return float(text.strip())
    except ValueError:
        return None


def parse_gpu_csv(text: str) -> list[GpuReading]:
    """``nvidia-smi --query-gpu=index,utilization.gpu,power.draw,memory.used
    --format=csv,noheader,nounits``: one line per GPU, memory in MiB."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4 or not parts[0].isdigit():
            continue
        mem = _number(parts[3])
        out.append(
            GpuReading(
                int(parts[0]), _number(parts[1]), _number(parts[2]), None if mem is None else mem * MIB / GB
            )
        )
    return out


def parse_apps_csv(text: str, pids: set[int]) -> float:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits``: the GB
    held by the processes in ``pids`` (ours), memory in MiB."""
    total = 0.0
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids:
            total += _number(parts[1]) or 0.0
    return total * MIB / GB


class NvidiaSmi:
    """GPU readings from the ``nvidia-smi`` command (present wherever the NVIDIA driver is)."""

    GPU_QUERY = ("--query-gpu=index,utilization.gpu,power.draw,memory.used", "--format=csv,noheader,nounits")
    APPS_QUERY = ("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")

    def __init__(self, command: str | None = None) -> None:
        self.command = command or shutil.which("nvidia-smi")

    def read(self, pids: set[int]) -> tuple[list[GpuReading], float]:
        if not self.command:
            return [], 0.0
        try:
            gpus = subprocess.run([self.command, *self.GPU_QUERY], capture_output=True, text=True, timeout=10)
            apps = subprocess.run(
                [self.command, *self.APPS_QUERY], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return [], 0.0
        if gpus.returncode != 0:
            return [], 0.0
        return parse_gpu_csv(gpus.stdout), parse_apps_csv(apps.stdout, pids) if apps.returncode == 0 else 0.0


class ProcessTree:
    """The engine's process and its descendants, with psutil's per-process CPU counters kept
    between readings (``cpu_percent`` is the use since the previous reading of that process)."""

    def __init__(self, root: int | None = None) -> None:
        self.root = psutil.Process(root or os.getpid())
        self._known: dict[int, psutil.Process] = {}

    def read(self) -> tuple[float, float, set[int]]:
        """(CPU percent summed, resident GB summed, the pids) of the tree now."""
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            procs = [self.root]
        cpu = rss = 0.0
        pids: set[int] = set()
        for proc in procs:
            known = self._known.setdefault(proc.pid, proc)
            try:
                with known.oneshot():
                    cpu += known.cpu_percent(None)
                    rss += known.memory_info().rss
                pids.add(proc.pid)
            except psutil.Error:  # exited between the listing and the reading
                self._known.pop(proc.pid, None)
        for pid in set(self._known) - pids:
            self._known.pop(pid, None)
        return cpu, rss / GB, pids


class SystemSampler:
    """Samples the process tree every ``interval`` seconds on a daemon thread; ``step_metrics``
    turns the samples since the previous call into one step's metrics."""

    def __init__(
        self,
        interval: float = 5.0,
        *,
        phases: ActivePhases = PHASE,
        tree: ProcessTree | None = None,
        gpus: Callable[[set[int]], tuple[list[GpuReading], float]] | None = None,
    ) -> None:
        self.interval = interval
        self.phases = phases
        self.tree = tree or ProcessTree()
        self.gpus = gpus or NvidiaSmi().read
        self._samples: list[Sample] = []
        # Held while a sample is taken and filed, and while a step's end files the samples: a reading
        # takes the phases entered since the last one, so it must land in the step that ends if it
        # started before the end did (the thread's reading and the step's end both take samples).
        self._lock = threading.Lock()
        _, self._seen = self.phases.since(Counter())  # phases entered before this sampler are not its own
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.tree.read()  # prime psutil's CPU counters: the first reading is a baseline

    def _take(self) -> Sample:
        """A reading now (the caller holds ``_lock``)."""
        cpu, rss, pids = self.tree.read()
        gpus, own = self.gpus(pids)
        phases, self._seen = self.phases.since(self._seen)
        return Sample(phases, cpu, rss, len(pids), gpus, own)

    def sample(self) -> Sample:
        with self._lock:
            taken = self._take()
            self._samples.append(taken)
        return taken

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:  # a reading must never take the run down with it
                time.sleep(self.interval)

    def start(self) -> SystemSampler:
        self._thread = threading.Thread(target=self._loop, name="system-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)

    def __enter__(self) -> SystemSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @staticmethod
    def off() -> SystemSampler:
        """A sampler that samples nothing (``logging.system_metrics_s: 0``)."""
        return _Off()

    def step_metrics(self) -> dict[str, float]:
        """The metrics of the samples since the last call, with one taken now if there are none
        or a phase ran that no sample has seen."""
        with self._lock:
            samples, self._samples = self._samples, []
            if not samples or self.phases.entered_since(self._seen):
                samples.append(self._take())
        return summarize(samples)


class _Off(SystemSampler):
    def __init__(self) -> None:  # no tree to read, no thread
        pass

    def start(self) -> SystemSampler:
        return self

    def stop(self) -> None:
        pass

    def step_metrics(self) -> dict[str, float]:
        return {}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarize(samples: list[Sample]) -> dict[str, float]:
    """One step's ``system/*`` metrics from its samples (see the module docstring)."""
    out = {
        "system/cpu_percent": _mean([s.cpu_percent for s in samples]),
        "system/rss_gb": max(s.rss_gb for s in samples),
        "system/processes": float(max(s.processes for s in samples)),
    }
    by_gpu: dict[int, list[GpuReading]] = {}
    for s in samples:
        for g in s.gpus:
            by_gpu.setdefault(g.index, []).append(g)
    for index, readings in sorted(by_gpu.items()):
        for name, values, reduce in (
            ("util_percent", [g.util_percent for g in readings], _mean),
            ("power_w", [g.power_w for g in readings], _mean),
            ("mem_gb", [g.mem_gb for g in readings], max),
        ):
            known = [v for v in values if v is not None]
            if known:
                out[f"system/gpu{index}/{name}"] = reduce(known)
    if by_gpu:
        out["system/gpu_mem_gb"] = max(s.own_gpu_mem_gb for s in samples)
    for phase in PHASES:
        during = [s for s in samples if phase in s.phases]
        if during:
            out[f"system/rss_gb/{phase}"] = max(s.rss_gb for s in during)
            if by_gpu:
                out[f"system/gpu_mem_gb/{phase}"] = max(s.own_gpu_mem_gb for s in during)
    return out
