"""Trainer backends: step time of DeepSpeed ZeRO-2 (1 and 2 ranks) against the torch backend.

Usage::

    python bench/trainer_backends.py            # make_model's small and base, 5 timed steps each
    python bench/trainer_backends.py --quick    # base only, 3 timed steps

A step is what the learner asks of a trainer every RL step: old log-probs, reference
log-probs, then ``update_policy`` (GRPO with the KL loss: 1 epoch of 2 mini-batches of
micro-batches of 8). The batch is the same for every backend: 16 prompts x n=8 responses
of 64 tokens (random tokens, random advantages), built from a fixed seed. Each backend runs in
a process of its own (the torch backend too, so each starts equally cold), with the same total
of torch threads: the machine's cores, split between ranks as ``engine.ranks`` does. After one
warm-up step, the median of ``--steps`` step times is reported, with the ratio torch / backend
(higher is faster than the torch backend).

On one machine's CPU, 2 data-parallel ranks split the same cores, so the ratio shows what the
sharding and the gradient reduction cost, not a speedup: on GPUs each rank has a device of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

PROMPTS, N, PROMPT_LEN, RESPONSE_LEN = 16, 8, 24, 64


def run_config(model_dir: Path, backend: str, ranks: int, steps: int):
    from engine.config import build_config

    trainer = {
        "backend": backend,
        "device": "cpu",
        "total_steps": steps,
        "prompts_per_step": PROMPTS,
        "ppo_mini_batch_size": PROMPTS // 2,
        "ppo_epochs": 1,
        "micro_batch_size": 8,
    }
    if backend == "deepspeed":
        trainer |= {"zero_stage": 2, "num_ranks": ranks}
    return build_config(
        {
            "name": "bench",
            "preset": "grpo",
            "model": {"path": str(model_dir)},
            "rollout": {"n": N, "max_new_tokens": RESPONSE_LEN},
            "trainer": trainer,
            "algorithm": {"use_kl_loss": True, "kl_loss_coef": 0.01},
        }
    )


def make_batch(vocab: int, step: int):
    from engine.batch import Rollout, collate
    from engine.data import Prompt
    from engine.rollout import Completion

    gen = torch.Generator().manual_seed(step)
    rows = []
    for g in range(PROMPTS):
        prompt_ids = torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist()
        prompt = Prompt(uid=f"p{g}", text="", raw="")
        for _ in range(N):
            ids = torch.randint(3, vocab, (RESPONSE_LEN,), generator=gen).tolist()
            completion = Completion(ids, [-1.0] * RESPONSE_LEN, "", "length", 0)
            rows.append(Rollout(prompt, prompt_ids, completion, 0.0, {}, f"g{g}"))
    batch = collate(rows, pad_id=0, policy_version=step)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=gen) * batch.response_mask
    return batch


def worker(model_dir: Path, backend: str, ranks: int, steps: int, out: Path) -> None:
    """One backend's timed steps (every rank of a DeepSpeed job runs this; rank 0 reports)."""
    from engine.models import load_model

    cfg = run_config(model_dir, backend, ranks, steps + 1)
    torch.manual_seed(0)
    model = load_model(model_dir)
    vocab = model.config.vocab_size
    if backend == "deepspeed":
        from engine.trainer.deepspeed_backend import DeepSpeedTrainer

        trainer = DeepSpeedTrainer(model, cfg, device=torch.device("cpu"), need_reference=True)
        if trainer.rank != 0:
            trainer.serve()
            return
    else:
        from engine.trainer import TorchTrainer

        trainer = TorchTrainer(model, cfg, device=torch.device("cpu"), need_reference=True)
    times = []
    for step in range(steps + 1):
        batch = make_batch(vocab, step)
        t0 = time.perf_counter()
        batch.old_log_probs = trainer.compute_log_probs(batch)
        batch.ref_log_probs = trainer.compute_log_probs(batch, reference=True)
        trainer.update_policy(batch)
        if step:  # step 0 warms up
            times.append(time.perf_counter() - t0)
    trainer.close()
    out.write_text(json.dumps({"times": times, "threads": torch.get_num_threads()}))


def measure(model_dir: Path, backend: str, ranks: int, steps: int) -> dict:
    from engine.ranks import launch_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, __file__, "--worker", str(model_dir), backend, str(ranks), str(steps), str(out)]
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        env.pop("OMP_NUM_THREADS", None)
        if backend == "deepspeed":
            code = launch_ranks(argv, ranks, env=env)
        else:
            code = subprocess.run(argv, env=env).returncode
        if code != 0:
            raise SystemExit(f"{backend} x{ranks} failed with exit code {code}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="base only, 3 timed steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per backend (default 5, quick 3)")
    args = parser.parse_args()
    steps = args.steps or (3 if args.quick else 5)
    sizes = ["base"] if args.quick else ["small", "base"]

    from engine.models import make_model
    from engine.models.build import count_parameters

    print(f"{PROMPTS} prompts x n={N}, {PROMPT_LEN} prompt + {RESPONSE_LEN} response tokens; {os.cpu_count()} cores")
    print("| model | params | backend | ranks x threads | median step s | torch / backend |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            model_dir = make_model(Path(tmp) / size, arch="qwen2", size=size, seed=0)
            from engine.models import load_model

            params = count_parameters(load_model(model_dir))
            reference = None
            for backend, ranks in (("torch", 1), ("deepspeed", 1), ("deepspeed", 2)):
                result = measure(model_dir, backend, ranks, steps)
                median = statistics.median(result["times"])
                reference = reference or median
                label = "torch" if backend == "torch" else "DeepSpeed ZeRO-2"
                print(
                    f"| {size} | {params / 1e6:.2f}M | {label} | {ranks} x {result['threads']} | "
                    f"{median:.3f} | {reference / median:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        backend = sys.argv[3]
        if backend == "deepspeed":
            from engine.trainer.deepspeed_backend import distributed

            joined = distributed("cpu")
        else:
            joined = contextlib.nullcontext()
        with joined:
            worker(Path(sys.argv[2]), backend, int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6]))
    else:
        main()
