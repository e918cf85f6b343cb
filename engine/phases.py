"""What the engine does before its first step, said as it happens.

Between a worker taking a run and its first step the engine may spend minutes: building the
starter policy on first use (a supervised warm-up of its own), loading the model and the data,
starting the ranks of a multi-rank run, starting the rollout engine (vLLM, or a rollout process).
A page that says nothing meanwhile, or still says what was true before (issue 15: minutes of
"Waiting for a worker" on a run its worker was preparing), lies. So each phase is a ``status``
event with state ``starting`` and a message naming the phase, with its progress where there is
any ("building the starter policy: 180/1500 steps, 31% accuracy"); the web app keeps the latest
as the run's status message. Status events are durable (fsynced), so progress within a phase is
written at most every ``every`` seconds.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tributary.events import EventSink

PROGRESS_EVERY_S = 2.0
"""Seconds between two progress messages of one phase (a phase's first message is never held back)."""

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class Phases:
    """Reports the engine's preparing phases as ``starting`` status events on ``sink``."""

    def __init__(
        self, sink: EventSink, *, every: float = PROGRESS_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.sink = sink
        self.every = every
        self.clock = clock
        self._last_progress = -float("inf")

    def __call__(self, message: str) -> None:
        """A new phase begins (always written)."""
        self.sink.status("starting", message)
        self._last_progress = -float("inf")

    def progress(self, message: str, *, last: bool = False) -> None:
        """Progress within the current phase: written unless one was written less than ``every``
        seconds ago (``last``: the phase's final count, always written)."""
        now = self.clock()
        if last or now - self._last_progress >= self.every:
            self.sink.status("starting", message)
            self._last_progress = now

    def starter(self, task: str, difficulty: int, target_accuracy: float) -> Callable[..., None]:
        """The ``progress`` callback of a starter-policy build (``engine.models.starter.ProgressFn``)."""
        what = f"building the starter policy for {task} (difficulty {difficulty}, first use)"
        self(f"{what}: preparing")

        def report(step: int, total: int, _loss: float, accuracy: float | None) -> None:
            checked = (
                f", {accuracy:.0%} accuracy (done at {target_accuracy:.0%})" if accuracy is not None else ""
            )
            self.progress(f"{what}: {step}/{total} steps{checked}", last=step == total)

        return report


def model_files(path: Path) -> str:
    """The weights of a model directory in words: "1 file, 4.1 MB", "3 shards, 14.2 GB"."""
    files = (
        [p for p in path.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES] if path.is_dir() else []
    )
    if not files:
        return "no weight files found yet"
    size = sum(p.stat().st_size for p in files)
    count = f"{len(files)} shards" if len(files) > 1 else "1 file"
    return f"{count}, {human_bytes(size)}"


def human_bytes(n: int) -> str:
    """A size in bytes as people read it: "812 bytes", "4.1 MB"."""
    if n < 1000:
        return f"{n} bytes"
    power = min(3, int(math.log10(n)) // 3)
    return f"{n / 1000**power:.1f} {('kB', 'MB', 'GB')[power - 1]}"


def data_words(data: Any) -> str:
    """Where a run's prompts come from, in words (``DataConfig``): no path of the worker's disk.

    A staged run (``data.stages``) names each stage's own source in order, which is what it
    loads; its base ``data`` only fills the fields a stage leaves unset."""
    stages = getattr(data, "stages", None)
    if stages:
        return f"{len(stages)} stages: " + ", ".join(
            f"{stage.name} from {data_words(stage.data_config(data))}" for stage in stages
        )
    if data.source == "builtin":
        return f"built-in task {data.task}"
    name = Path(str(getattr(data, "path", "") or "")).name
    return f"{data.source} {name}".strip()
