"""One engine run from a preset, as the benchmarks that train a policy need it (shared by
``learning_curve.py`` and ``data_efficiency.py``).

The run goes through ``engine.run.execute`` (the same path as ``python -m engine run``) in this
process, with checkpoints and the progress bar off and its output in a temporary directory; the
result is the run's metric events by step and the wall time of ``execute`` (evals included).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import RunConfig, load_config
from engine.models.starter import starter_policy
from engine.run import execute


@dataclass
class PresetRun:
    """What a run left: its config, exit code, wall time (s) and metric values by step."""

    cfg: RunConfig
    code: int
    wall_s: float
    metrics: dict[int, dict[str, Any]]
    minutes: dict[int, float]  # wall minutes from the run's start to each step's metrics event

    @property
    def evals(self) -> dict[int, float]:
        """``eval/accuracy`` by step (step 0: before training)."""
        return {s: m["eval/accuracy"] for s, m in self.metrics.items() if "eval/accuracy" in m}


def build_starter(task: str = "arithmetic", difficulty: int = 1) -> float:
    """Build (or find cached) the starter policy; the seconds it took, kept out of the RL time."""
    t0 = time.perf_counter()
    starter_policy(task, difficulty)
    return time.perf_counter() - t0


def run_preset(preset: str, steps: int, eval_every: int, overrides: list[str]) -> PresetRun:
    """Train ``steps`` steps of ``preset`` with evals every ``eval_every`` steps; ``overrides`` are
    ``--set`` items applied after the bench's own (so they win)."""
    with tempfile.TemporaryDirectory() as tmp:
        events = Path(tmp) / "events.jsonl"
        cfg = load_config(
            preset,
            [
                f"trainer.total_steps={steps}",
                f"trainer.eval_every={eval_every}",
                f"output_dir={tmp}/run",
                "checkpoint.every_steps=0",
                "checkpoint.save_final=false",
                "logging.progress=off",
                *overrides,
            ],
        )
        t0, started = time.perf_counter(), time.time()
        code = execute(cfg, events=str(events))
        wall_s = time.perf_counter() - t0
        rows = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    metrics = {e["step"]: e["values"] for e in rows if e["type"] == "metrics"}
    minutes = {e["step"]: (e["time"] - started) / 60 for e in rows if e["type"] == "metrics"}
    return PresetRun(cfg, code, wall_s, metrics, minutes)
