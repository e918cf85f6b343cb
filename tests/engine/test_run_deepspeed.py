"""Whole DeepSpeed runs through ``python -m engine run``: 2 rank processes started by the engine.

The same small run as ``test_run.py`` with ``trainer.backend: deepspeed`` (2 ranks on CPU with gloo)
against ``trainer.backend: torch``: one event log written by rank 0 alone, the same metrics step for
step (same rollouts, since the rollout backend samples from weights equal to the torch run's),
DeepSpeed's partitions in every checkpoint, and a cancel (SIGTERM to the launcher, as the job
supervisor sends it) that checkpoints and resumes.

The whole-run comparison runs ZeRO-3 with the optimizer and the parameters offloaded: the stage whose
rollout weights are gathered from shards held on the CPU, the most the run adds to the trainer. That
ZeRO-2 and ZeRO-3 train exactly as the torch backend does, step for step, is
``test_trainer_deepspeed.py``'s; the run's wiring at ZeRO-2 (rank 0 speaking for the run, partitions in
the checkpoints, cancel and resume, the asynchronous loop) is the other tests' here. A whole run here
costs 30-65 s of the suite on 2 cores (CI, 2026-11-29), so the stages the trainer tests cover are not
run whole a second time.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from engine.contracts import EXIT_SUCCEEDED
from tests.engine.test_run import cancel_then_resume, metrics_by_step, read_events, small_config

STEPS = 4
COMPARED = ("reward/mean", "actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm", "actor/lr")


def engine_run(cfg: dict, path: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    path.write_text(json.dumps(cfg))
    return subprocess.run(
        [sys.executable, "-m", "engine", "run", str(path), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def deepspeed(cfg: dict, stage: int, **options: str) -> dict:
    cfg["trainer"] |= {"backend": "deepspeed", "zero_stage": stage, "num_ranks": 2, "device": "cpu", **options}
    return cfg


@pytest.fixture(scope="module")
def torch_metrics(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[int, dict[str, float]]:
    out = tmp_path_factory.mktemp("torch")
    proc = engine_run(small_config(tiny_model_dir, out / "run", total_steps=STEPS), out / "run.json")
    assert proc.returncode == EXIT_SUCCEEDED, proc.stderr
    return metrics_by_step(read_events(out / "run" / "events.jsonl"))


@pytest.mark.slow
def test_an_offloaded_zero3_run_matches_the_torch_run(
    tiny_model_dir: Path, tmp_path: Path, torch_metrics: dict[int, dict[str, float]]
) -> None:
    cfg = small_config(tiny_model_dir, tmp_path / "run", total_steps=STEPS)
    cfg = deepspeed(cfg, 3, offload_optimizer="cpu", offload_param="cpu")
    proc = engine_run(cfg, tmp_path / "run.json")
    assert proc.returncode == EXIT_SUCCEEDED, proc.stderr
    assert proc.stderr.count("succeeded: events in") == 1, proc.stderr  # rank 0 alone speaks for the run

    events = read_events(tmp_path / "run" / "events.jsonl")
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))  # one writer
    statuses = [(e["state"], e["message"]) for e in events if e["type"] == "status"]
    # Rank 0 says it starts the ranks before it waits for them to join, then its preparing phases.
    assert statuses[0] == ("starting", "starting 2 ranks: waiting for each to join"), statuses
    assert [state for state, _ in statuses[1:]] == ["starting"] * (len(statuses) - 3) + ["running", "succeeded"]
    metrics = metrics_by_step(events)
    assert sorted(metrics) == sorted(torch_metrics)
    for step in range(1, STEPS + 1):
        for name in COMPARED:
            assert metrics[step][name] == pytest.approx(torch_metrics[step][name], rel=1e-3, abs=1e-4), (
                step,
                name,
            )
    assert metrics[2]["eval/accuracy"] == torch_metrics[2]["eval/accuracy"]

    checkpoints = [e for e in events if e["type"] == "checkpoint"]
    assert [c["step"] for c in checkpoints] == [2, 4]
    last = Path(checkpoints[-1]["path"])
    assert (last / "model.safetensors").is_file() and (last / "deepspeed" / "state").is_dir()
    # Both ranks' optimizer partitions, counted in the checkpoint's size.
    partitions = sorted(p.name for p in (last / "deepspeed" / "state").iterdir() if "optim_states" in p.name)
    assert len(partitions) == 2, partitions
    assert checkpoints[-1]["bytes"] == sum(f.stat().st_size for f in last.rglob("*") if f.is_file())


@pytest.mark.slow
def test_cancel_checkpoints_every_rank_and_resume_continues(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = deepspeed(small_config(tiny_model_dir, tmp_path / "run", total_steps=200), 2)
    ckpt = cancel_then_resume(cfg, tmp_path, more_steps=2)
    assert len(list((Path(ckpt["path"]) / "deepspeed" / "state").glob("*optim_states*"))) == 2


@pytest.mark.slow
@pytest.mark.parametrize("own_process", [False, True], ids=["thread", "own-process"])
def test_an_async_run_with_partial_rollouts_on_two_ranks(tiny_model_dir: Path, tmp_path: Path, own_process: bool) -> None:
    """The producer thread runs on rank 0 beside the trainer's commands to every rank; its backend
    generates in rank 0's process or in a child of its own, fed the weights ZeRO gathers. The ranks
    train under ``trainer.mixed_precision: bf16`` (bf16 autocast inside DeepSpeed's engine, the
    proximal log-probs recomputed under it), which costs this test nothing more."""
    cfg = deepspeed(small_config(tiny_model_dir, tmp_path / "run", total_steps=STEPS), 2, mixed_precision="bf16")
    cfg["async"] = {"max_staleness": 2, "partial_rollouts": True, "partial_chunk_tokens": 3}
    cfg["rollout"]["own_process"] = own_process
    proc = engine_run(cfg, tmp_path / "run.json")
    assert proc.returncode == EXIT_SUCCEEDED, proc.stderr
    metrics = metrics_by_step(read_events(tmp_path / "run" / "events.jsonl"))
    assert sorted(metrics) == list(range(STEPS + 1))
    assert all(metrics[s]["async/staleness_max"] <= 2 and "offpolicy/ess" in metrics[s] for s in range(1, STEPS + 1))
    assert all(math.isfinite(metrics[s]["actor/grad_norm"]) for s in range(1, STEPS + 1))
