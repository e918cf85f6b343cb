"""The DeepSpeed ZeRO trainer backend on CPU: 2 real rank processes against the torch backend.

Each stage (ZeRO-2, ZeRO-3) is one launch of this file as a 2-rank job through the engine's
own launcher (``engine.ranks.launch_ranks``): rank 0 drives ``DeepSpeedTrainer`` through
three training steps on fixed batches (old and reference log-probs, two PPO epochs of two
mini-batches, uneven micro-batches across ranks), checkpointing after step 1 with the
engine's checkpoint writer; then a fresh trainer resumes from that checkpoint and redoes
steps 2-3. The test process replays the same batches on ``TorchTrainer`` and compares.

The ranks reduce over plain gloo (``engine.trainer.deepspeed_backend.init_distributed``), so
nothing is compiled: DeepSpeed's shared-memory op took 95 s of this file's first setup on a fresh
machine before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
SAVE_AT = 1
METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm", "actor/lr")
# How far apart the two backends' weights may end. Each of the run's 12 Adam steps moves a weight by up
# to lr (3e-3), and a wrong accumulation (a micro-batch weighted wrongly, a rank's gradient lost)
# changes gradients by O(1), hence weights by O(lr) = 1e-3. Summing in another order (2 ranks against
# one process) changes a gradient by rounding only (~1e-7 of it), but Adam divides by the gradient's
# own scale, so where an element's gradient nearly cancels at some step its rounding is amplified:
# measured on an AMD EPYC over plain gloo (init_distributed's choice on CPU): 9.2e-6 in ZeRO-2, 9.4e-6 in
# ZeRO-3, both one element of a k_proj bias (2.1e-5 in ZeRO-2 with DeepSpeed's shared-memory reduction,
# which CPU ranks no longer use). 1e-4 is 5x the larger and 10x under a bug's effect.
WEIGHT_ATOL = 1e-4


def run_config(model_dir: Path, out_dir: Path, backend: str, stage: int) -> Any:
    from engine.config import build_config

    trainer: dict[str, Any] = {
        "backend": backend,
        "device": "cpu",
        "total_steps": STEPS,
        "prompts_per_step": 4,
        "ppo_mini_batch_size": 2,  # two optimiser steps per epoch
        "ppo_epochs": 2,
        "micro_batch_size": 2,  # a mini-batch of 6 rows: 3 per rank, as micro-batches of 2 and 1
        "seed": 3,
    }
    if backend == "deepspeed":
        trainer |= {"zero_stage": stage, "num_ranks": 2}
    return build_config(
        {
            "name": f"ds-{backend}-{stage}",
            "output_dir": str(out_dir),
            "preset": "grpo",  # KL loss: reference log-probs from the frozen copy
            "model": {"path": str(model_dir)},
            "rollout": {"n": 3, "max_new_tokens": 6, "temperature": 0.9},
            "optimizer": {"lr": 3e-3, "warmup_steps": 2, "schedule": "cosine", "grad_clip": 0.5},
            "trainer": trainer,
            "algorithm": {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coeff": 0.01},
        }
    )


def make_batch(vocab: int, step: int):
    """The step's rollouts: 4 prompts x 3 responses of random lengths, random advantages."""
    from engine.batch import Rollout, collate
    from engine.data import Prompt
    from engine.rollout import Completion

    gen = torch.Generator().manual_seed(100 + step)
    rows = []
    for g in range(4):
        prompt_ids = torch.randint(
            3, vocab, (int(torch.randint(2, 7, (1,), generator=gen)),), generator=gen
        ).tolist()
        prompt = Prompt(uid=f"s{step}p{g}", text="", raw="")
        for _ in range(3):
            r_len = int(torch.randint(1, 7, (1,), generator=gen))
            ids = torch.randint(3, vocab, (r_len,), generator=gen).tolist()
            rows.append(
                Rollout(prompt, prompt_ids, Completion(ids, [-1.0] * r_len, "", "stop", 0), 0.0, {}, f"g{g}")
            )
    batch = collate(rows, pad_id=0, policy_version=step - 1)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=gen) * batch.response_mask
    return batch


def train_steps(trainer: Any, vocab: int, steps: range) -> dict[int, dict[str, float]]:
    out = {}
    for step in steps:
        batch = make_batch(vocab, step)
        batch.old_log_probs = trainer.compute_log_probs(batch)
        batch.ref_log_probs = trainer.compute_log_probs(batch, reference=True)
        metrics = trainer.update_policy(batch)
        metrics["old_logprob_sum"] = float(batch.old_log_probs.sum())
        out[step] = metrics
    return out


# ----------------------------------------------------------------------------- rank side


def _rank_main(model_dir: Path, out_dir: Path, stage: int) -> None:
    from engine.checkpoint import CheckpointState, save_checkpoint
    from engine.models import load_model
    from engine.trainer.deepspeed_backend import DeepSpeedTrainer

    cfg = run_config(model_dir, out_dir, "deepspeed", stage)
    vocab = load_model(model_dir).config.vocab_size

    def trainer() -> DeepSpeedTrainer:
        torch.manual_seed(0)
        return DeepSpeedTrainer(load_model(model_dir), cfg, device=torch.device("cpu"), need_reference=True)

    first = trainer()
    if first.rank != 0:
        first.serve()
        trainer().serve()
        return
    t0 = time.perf_counter()
    metrics = train_steps(first, vocab, range(1, SAVE_AT + 1))
    state = CheckpointState(SAVE_AT, 0, {}, first.state(), {}, {}, cfg.model_dump(mode="json"))
    ckpt, _, _ = save_checkpoint(out_dir, state, first.save, keep_last=1)
    metrics |= train_steps(first, vocab, range(SAVE_AT + 1, STEPS + 1))
    save_file(
        {k: v.detach().clone() for k, v in first.rollout_weights().items()},
        str(out_dir / "final.safetensors"),
    )
    first.close()
    second = trainer()
    second.load(ckpt)
    second.load_state(state.trainer)
    resumed = train_steps(second, vocab, range(SAVE_AT + 1, STEPS + 1))
    save_file(
        {k: v.detach().clone() for k, v in second.rollout_weights().items()},
        str(out_dir / "resumed.safetensors"),
    )
    second.close()
    report = {
        "metrics": metrics,
        "resumed": resumed,
        "checkpoint": str(ckpt),
        "train_s": time.perf_counter() - t0,
    }
    (out_dir / "report.json").write_text(json.dumps(report))


# ----------------------------------------------------------------------------- test side


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def ds_run(request, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from engine.ranks import launch_ranks

    stage = request.param
    out = tmp_path_factory.mktemp(f"zero{stage}")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    code = launch_ranks([sys.executable, __file__, str(tiny_model_dir), str(out), str(stage)], 2, env=env)
    assert code == 0, f"the 2-rank ZeRO-{stage} job failed with exit code {code} (its output is above)"
    report = json.loads((out / "report.json").read_text())
    report |= {"stage": stage, "out": out, "wall_s": time.perf_counter() - t0}
    print(f"ZeRO-{stage}, 2 ranks: {report['wall_s']:.1f} s wall ({report['train_s']:.1f} s training)")
    return report


@pytest.fixture(scope="module")
def torch_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from engine.models import load_model
    from engine.trainer import TorchTrainer

    cfg = run_config(tiny_model_dir, tmp_path_factory.mktemp("torch"), "torch", 0)
    torch.manual_seed(0)
    model = load_model(tiny_model_dir)
    trainer = TorchTrainer(model, cfg, device=torch.device("cpu"), need_reference=True)
    metrics = train_steps(trainer, model.config.vocab_size, range(1, STEPS + 1))
    return {"metrics": metrics, "weights": {k: v.clone() for k, v in trainer.rollout_weights().items()}}


@pytest.mark.slow
def test_losses_match_the_torch_backend_step_for_step(
    ds_run: dict[str, Any], torch_run: dict[str, Any]
) -> None:
    """Sharding rows over 2 ranks, uneven micro-batches and ZeRO's reduced gradients must give
    the torch backend's exact accumulation: same losses, gradient norms, LR and weights."""
    for step in range(1, STEPS + 1):
        ds, ref = ds_run["metrics"][str(step)], torch_run["metrics"][step]
        for key in (*METRICS, "old_logprob_sum"):
            assert ds[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-5), f"step {step} {key}"
    final = load_file(str(ds_run["out"] / "final.safetensors"))
    assert set(final) == set(torch_run["weights"])
    for name, w in torch_run["weights"].items():
        torch.testing.assert_close(final[name], w, atol=WEIGHT_ATOL, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_resume_from_a_deepspeed_checkpoint_continues_exactly(ds_run: dict[str, Any]) -> None:
    """Optimizer moments, LR schedule position and weights come back from DeepSpeed's
    checkpoint: the resumed steps equal the uninterrupted run's bit for bit."""
    ckpt = Path(ds_run["checkpoint"])
    assert ckpt.name == f"step_{SAVE_AT:06d}" and (ckpt / "state.json").is_file()
    assert (ckpt / "deepspeed" / "state").is_dir() and (ckpt / "model.safetensors").is_file()
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert ds_run["resumed"][str(step)] == ds_run["metrics"][str(step)], f"step {step}"
    final = load_file(str(ds_run["out"] / "final.safetensors"))
    resumed = load_file(str(ds_run["out"] / "resumed.safetensors"))
    for name, w in final.items():
        assert torch.equal(resumed[name], w), name


@pytest.mark.slow
def test_export_loads_in_transformers(ds_run: dict[str, Any], tmp_path: Path) -> None:
    """``python -m engine export-checkpoint`` merges the ranks' fp32 partitions into a plain
    transformers directory equal to the checkpoint's own safetensors model."""
    from transformers import AutoModelForCausalLM

    ckpt = Path(ds_run["checkpoint"])
    out = tmp_path / "exported"
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "export-checkpoint", str(ckpt), str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    saved = load_file(str(ckpt / "model.safetensors"))
    state = model.state_dict()
    for name, w in saved.items():
        torch.testing.assert_close(state[name], w, atol=0, rtol=0, msg=name)
    assert (out / "tokenizer.json").is_file()


def test_config_errors_name_the_field_and_the_fix() -> None:
    from engine.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"trainer.num_ranks: 2 needs trainer.backend 'deepspeed'"):
        load_config("grpo", ["trainer.num_ranks=2"])
    with pytest.raises(ConfigError, match=r"trainer.offload_param: 'cpu' needs trainer.zero_stage 3"):
        load_config("grpo", ["trainer.backend=deepspeed", "trainer.offload_param=cpu"])
    cfg = load_config(
        "grpo", ["trainer.backend=deepspeed", "trainer.zero_stage=3", "trainer.offload_param=cpu"]
    )
    assert cfg.trainer.offload_param == "cpu"


@pytest.mark.slow
def test_cpu_ranks_reduce_over_plain_gloo_and_compile_nothing(tmp_path: Path) -> None:
    """``init_distributed("cpu")`` leaves DeepSpeed's shared-memory reduce op unbuilt: collectives
    go through ``torch.distributed`` on gloo, the same on every CPU, and nothing lands in a fresh
    torch extensions directory (the op's JIT build took 95-176 s on a fresh machine)."""
    code = (
        "from engine.trainer.deepspeed_backend import init_distributed\n"
        "init_distributed('cpu')\n"
        "import deepspeed.comm.comm as c, torch.distributed as d\n"
        "print('shm', c.cdb.shm_comm_op, d.get_backend())\n"
    )
    extensions = tmp_path / "torch_extensions"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shm None gloo" in proc.stdout, proc.stdout[-2000:]
    assert not extensions.exists()


if __name__ == "__main__":
    from engine.trainer.deepspeed_backend import distributed

    with distributed("cpu"):  # a CI run's ZeRO-3 rank aborted at exit without it (code 134)
        _rank_main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
