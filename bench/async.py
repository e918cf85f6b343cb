"""Asynchronous RL: the synchronous loop against async.max_staleness k = 1, 2, 4, k = 2 with partial
rollouts (chunks of 2 tokens), k = 2 with the rollout backend in a process of its own, and the
periodic mode, same task and budget; then the same with vLLM (synchronous, k = 2 in a producer thread,
k = 2 in its own process) when vLLM is installed.

The periodic mode overlaps the reference (and old) log-prob passes with generation; DAPO has
neither, so that pair runs with the KL loss on (a reference pass per step), against the same
synchronous run with the KL loss.

Usage::

    python bench/async.py              # DAPO from the arithmetic starter, 60 steps, eval on 512 prompts
    python bench/async.py --steps 30   # shorter

Every setting trains the same starter policy on the same prompts for the same number of steps
(the same number of samples: steps x prompts_per_step x n, plus DAPO's extra rounds), each in a
process of its own, one after the other. Per setting:

- **tokens/s**: generated tokens over the training wall time (the sum of ``timing_s/step``);
- **trainer idle**: the share of step time the trainer waited for rollouts. Synchronous: the
  generation and reward time of the step (``timing_s/gen + timing_s/reward``), since the trainer
  cannot start before them; asynchronous: ``async/trainer_wait_s``;
- **staleness**: mean lag of the trained samples (policy versions);
- **eval accuracy** after the last step (greedy, 512 held-out prompts), against the starting one.

The last column is a model, not a measurement: the speedup the synchronous run's own timings
predict for a machine where rollout and training each have devices of their own (k >= 1), per
step ``(T_gen + T_train) / max(T_gen, T_train)``. On this machine both threads share the same
cores, so the measured ratio is far below it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run(out: Path, steps: int, staleness: int, seed: int, mode: str = "") -> list[dict]:
    cmd = [
        sys.executable, "-m", "engine", "run", "dapo",
        "--set", "data.eval_size=512",
        "--set", f"trainer.total_steps={steps}",
        "--set", f"trainer.eval_every={steps}",
        "--set", "trainer.eval_pass_k=0",
        "--set", f"trainer.seed={seed}",
        "--set", f"async.max_staleness={staleness}",
        "--set", f"output_dir={out}",
        "--set", "checkpoint.every_steps=0",
        "--set", "checkpoint.save_final=false",
        "--set", "logging.progress=off",
    ]  # fmt: skip
    if mode == "partial":
        cmd += ["--set", "async.partial_rollouts=true", "--set", "async.partial_chunk_tokens=2"]
    if mode in ("kl", "periodic"):
        cmd += ["--set", "algorithm.use_kl_loss=true"]
    if mode == "periodic":
        cmd += ["--set", "async.periodic=true"]
    if mode.startswith("vllm"):
        cmd += ["--set", "rollout.backend=vllm"]
    if mode.endswith("process"):
        cmd += ["--set", "rollout.own_process=true"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise SystemExit(f"k={staleness} failed:\n{proc.stderr[-3000:]}")
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    return [e for e in events if e["type"] == "metrics"]


def summarise(metrics: list[dict], staleness: int) -> dict[str, float]:
    steps = [m["values"] for m in metrics if m["step"] > 0]
    wall = sum(v["timing_s/step"] for v in steps)
    tokens = sum(v["rollout/gen_tokens"] for v in steps)
    if staleness == 0:  # the synchronous loop (the periodic mode reports its own waits: summarised as k > 0)
        idle = sum(v["timing_s/gen"] + v["timing_s/reward"] for v in steps) / wall
    else:
        idle = sum(v["async/trainer_wait_s"] for v in steps) / wall
    gen = [v["timing_s/gen"] + v["timing_s/reward"] for v in steps]
    train = [v["timing_s/step"] - g for v, g in zip(steps, gen, strict=True)]
    model = statistics.mean((g + t) / max(g, t) for g, t in zip(gen, train, strict=True))
    by_step = {m["step"]: m["values"] for m in metrics}
    last = max(by_step)
    return {
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "idle": idle,
        "staleness": statistics.mean(v.get("async/staleness_mean", 0.0) for v in steps),
        "eval_before": by_step[0]["eval/accuracy"],
        "eval_after": by_step[last]["eval/accuracy"],
        "two_device_model": model,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 4], help="staleness bounds (0 = synchronous)")
    parser.add_argument(
        "--partial", type=int, nargs="*", default=[2], help="staleness bounds to run again with partial rollouts"
    )
    parser.add_argument(
        "--own-process",
        type=int,
        nargs="*",
        default=[2],
        help="staleness bounds to run again with the rollout backend in a process of its own",
    )
    parser.add_argument(
        "--vllm",
        type=int,
        nargs="*",
        default=[2],
        help="staleness bounds to run with vLLM (in the trainer's process, then in its own), against vLLM "
        "synchronous; none when vLLM is not installed",
    )
    parser.add_argument(
        "--no-periodic", dest="periodic", action="store_false", help="skip the periodic pair (sync and periodic, KL loss)"
    )
    args = parser.parse_args()
    print(f"DAPO, arithmetic starter, {args.steps} steps, seed {args.seed}, {os.cpu_count()} cores")
    print("| setting | train s | tokens/s | vs sync | trainer idle | staleness | eval before -> after | 2-device model |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    references: dict[str, float] = {}  # each row against its synchronous run (plain, or with the KL loss)
    with tempfile.TemporaryDirectory() as tmp:
        settings = [(k, "") for k in args.k] + [(k, "partial") for k in args.partial]
        settings += [(k, "process") for k in args.own_process]
        if args.periodic:
            settings += [(0, "kl"), (0, "periodic")]
        if args.vllm and importlib.util.find_spec("vllm") is not None:
            settings += [(0, "vllm")] + [(k, m) for k in args.vllm for m in ("vllm", "vllm+process")]
        for k, mode in settings:
            s = summarise(run(Path(tmp) / f"k{k}{mode}", args.steps, k, args.seed, mode), k if mode != "periodic" else 1)
            pair = {"kl": "kl", "periodic": "kl", "vllm": "vllm", "vllm+process": "vllm"}.get(mode, "")
            reference = references.setdefault(pair, s["tokens_per_s"])
            name = {
                "": "synchronous" if k == 0 else f"async k={k}",
                "partial": f"async k={k} + partial rollouts",
                "process": f"async k={k}, rollout in its own process",
                "kl": "synchronous, with KL loss",
                "periodic": "periodic, with KL loss",
                "vllm": "vLLM, synchronous" if k == 0 else f"vLLM, async k={k} (producer thread)",
                "vllm+process": f"vLLM, async k={k}, in its own process",
            }[mode]
            model = f"{s['two_device_model']:.2f}x" if mode in ("", "kl", "vllm") and k == 0 else ""
            print(
                f"| {name} | {s['wall_s']:.1f} | {s['tokens_per_s']:,.0f} | {s['tokens_per_s'] / reference:.2f}x | "
                f"{s['idle']:.2f} | {s['staleness']:.2f} | {s['eval_before']:.3f} -> {s['eval_after']:.3f} | {model} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
