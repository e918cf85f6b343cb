"""Checkpoints: everything needed to continue a run exactly.

A checkpoint is a directory ``<run_dir>/checkpoints/step_<N>/`` holding the policy as a plain
transformers model directory (``model.safetensors``, config, tokenizer: usable as
``model.path`` of a new run), ``optimizer.pt`` (optimiser and scheduler; a DeepSpeed run has its ranks' partitions in
``deepspeed/`` instead), and ``state.json``
(step, last event seq, data position with the prompt statistics and the selection's draw count
(``sampler``: ``engine/data/selection.py``), RNG states, controller values, the config, the partial
rollouts in flight that a resume continues, and the rollout replay buffer). It is
written into a temporary directory and renamed into place, so a crash never leaves a
half-written checkpoint where resume would find it.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "state.json"


@dataclass
class CheckpointState:
    step: int
    last_seq: int
    sampler: dict[str, Any]
    trainer: dict[str, Any]
    rng: dict[str, str]
    extra: dict[str, Any]
    config: dict[str, Any]
    # Rollouts drawn and partly generated but not yet trained (async.partial_rollouts, see
    # engine/pipeline/partial.py: pool_state); empty otherwise and in older checkpoints.
    in_flight: dict[str, Any] = field(default_factory=dict)
    # The rollout replay buffer (replay.ratio > 0, engine/data/replay.py: state_dict); empty otherwise.
    replay: dict[str, Any] = field(default_factory=dict)
    # The success replay bank (replay.successes, engine/data/success_replay.py: state_dict); empty otherwise.
    success_replay: dict[str, Any] = field(default_factory=dict)


def capture_rng() -> dict[str, str]:
    """The global RNG states, base64-encoded so state.json stays JSON."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return {k: base64.b64encode(pickle.dumps(v)).decode() for k, v in states.items()}


def restore_rng(states: dict[str, str]) -> None:
    # The pickles were written by this engine into its own checkpoint (trusted input).
    loaded = {k: pickle.loads(base64.b64decode(v)) for k, v in states.items()}
    torch.set_rng_state(loaded["torch"])
    random.setstate(loaded["python"])
    np.random.set_state(loaded["numpy"])
    if "cuda" in loaded and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(loaded["cuda"])


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(
    run_dir: Path,
    state: CheckpointState,
    write_model: Any,
    *,
    keep_last: int,
    announce: Callable[[Path, int, list[Path]], Any] | None = None,
) -> tuple[Path, int, list[Path]]:
    """Write a checkpoint atomically; ``write_model(dir)`` writes the weights and optimiser.

    Returns the checkpoint's path, its size in bytes and the checkpoints it deleted. Older
    checkpoints beyond ``keep_last`` are deleted after the new one is in place, and so are those of
    later steps: they belong to a branch this run left when it resumed from an earlier checkpoint
    (a rewind), so neither "the latest checkpoint" nor the pruning may take them for this branch's.

    ``announce(path, nbytes, doomed)`` (the engine's ``checkpoint`` event) is called once the new
    checkpoint is in place and *before* anything is deleted: whoever hears of checkpoints (the web
    app offers them to resume from) learns of a deletion no later than it happens. A crash between
    the two leaves files that are announced deleted, never a deleted one that is still offered.
    """
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state.step:06d}"
    tmp = root / f".tmp-step_{state.step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_model(tmp)
    (tmp / STATE_FILE).write_text(json.dumps(state.__dict__, indent=1))
    for f in _files(tmp):  # a trainer backend may write subdirectories (DeepSpeed's partitions)
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    nbytes = sum(f.stat().st_size for f in _files(final))
    later = [p for p in list_checkpoints(run_dir) if _step_of(p) > state.step]
    kept = [p for p in list_checkpoints(run_dir) if p not in later]
    doomed = later + kept[:-keep_last]
    if announce is not None:
        announce(final, nbytes, doomed)
    for old in doomed:
        shutil.rmtree(old, ignore_errors=True)
    return final, nbytes, doomed


def _step_of(checkpoint: Path) -> int:
    digits = checkpoint.name.removeprefix("step_")
    return int(digits) if digits.isdigit() else -1


def _files(directory: Path) -> list[Path]:
    return [f for f in directory.rglob("*") if f.is_file()]


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file())


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from ``--resume``: the checkpoint itself, a run directory, or
    its ``checkpoints`` directory (then the latest one)."""
    p = Path(path)
    if (p / STATE_FILE).is_file():
        return p
    for run_dir in (p, p.parent):
        found = list_checkpoints(run_dir)
        if found:
            return found[-1]
    raise FileNotFoundError(
        f"--resume {path}: no checkpoint there (expected a step_* directory with {STATE_FILE})"
    )


def load_state(checkpoint: Path) -> CheckpointState:
    return CheckpointState(**json.loads((checkpoint / STATE_FILE).read_text()))
