"""The learning curve: starter policy to trained policy on the built-in arithmetic task.

Runs the engine itself (``engine.run.execute``, the same path as ``python -m engine run``)
with a preset for a number of steps, then prints eval accuracy before and after, the minutes
taken on this machine, and the per-step series that explain why learning slows down:
train accuracy, policy entropy and the fraction of groups whose rewards are all equal
(those groups carry no GRPO gradient).

    python bench/learning_curve.py                 # grpo, 60 steps
    python bench/learning_curve.py --preset dapo --steps 80 --set rollout.n=16
    python bench/learning_curve.py --preset dapo --steps 1800 --eval-every 150 \
        --set data.eval_size=512                   # issue 16's learning ceiling, at the default lr
    python bench/learning_curve.py --preset dapo --steps 1800 --eval-every 150 --set data.eval_size=512 \
        --set data.selection=difficulty_targeted --set algorithm.filter_groups.round_size=deficit \
        --set optimizer.lr=2e-4                    # its best combination (bench/README.md)

``--starter`` picks the starter policy RL starts from: one ``task:difficulty`` (default
``arithmetic:1``), the starter ``model.path: starter`` resolves to for that task (arithmetic's is
trained with its companion task, countdown: ``engine.models.starter.COMPANIONS``), or several joined
by ``+``, the mixture starter of exactly those tasks (SFT on all of them until each reaches its own
target). Built once and cached. The ``min`` column is the wall time from the
run's start to each printed step (evals included).

Targets: +20 points of eval accuracy within 5 minutes on 2 cores (issue "Engine"); 85% within 5
minutes and 95% within 15 with the best combination (issue 16).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_run import run_preset
from engine.models.starter import starter_for, starter_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="grpo")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--starter", default="arithmetic:1", help="task:difficulty, or several joined by '+'")
    args = ap.parse_args()

    pairs = [(task, int(level or 1)) for task, _, level in (p.partition(":") for p in args.starter.split("+"))]
    t0 = time.perf_counter()  # the starter is built once and cached; not part of the RL time
    path = starter_policy(*pairs[0]) if len(pairs) == 1 else starter_for(pairs)
    build_s = time.perf_counter() - t0
    overrides = [f"model.path={path}", *args.overrides]
    run = run_preset(args.preset, args.steps, args.eval_every, overrides)
    cfg, code, rl_s, metrics = run.cfg, run.code, run.wall_s, run.metrics
    evals = {s: m["eval/accuracy"] for s, m in metrics.items() if "eval/accuracy" in m}
    first, last = evals[min(evals)], evals[max(evals)]
    steps = sorted(s for s in metrics if s > 0)
    step_s = sorted(metrics[s]["timing_s/step"] for s in steps)
    gen_tps = sorted(metrics[s]["perf/gen_tokens_per_s"] for s in steps)
    samples = cfg.trainer.prompts_per_step * cfg.rollout.n

    print(f"preset {args.preset}, {len(steps)} steps of {samples} samples, exit code {code}")
    print(f"starter policy ready in {build_s:.1f} s (cached after the first build)")
    print(f"RL wall time: {rl_s / 60:.2f} min (includes evals), median step {step_s[len(step_s) // 2]:.3f} s, "
          f"median generation {gen_tps[len(gen_tps) // 2]:,.0f} tokens/s")
    print(f"eval accuracy (greedy, {cfg.data.eval_size} held-out prompts): {first:.3f} -> {last:.3f} "
          f"({(last - first) * 100:+.1f} points)")
    print()
    print(
        f"{'step':>5} {'min':>6} {'eval acc':>9} {'train acc':>9} {'reward':>8} {'entropy':>8} "
        f"{'zero-std':>9} {'len':>6}"
    )
    for s in sorted(metrics):
        m = metrics[s]
        if s == 0 or s % max(1, args.eval_every // 2) == 0 or s == steps[-1]:
            print(
                f"{s:>5} {run.minutes.get(s, float('nan')):>6.2f} {m.get('eval/accuracy', float('nan')):>9.3f} {m.get('train/accuracy', float('nan')):>9.3f} "
                f"{m.get('reward/mean', float('nan')):>8.3f} {m.get('actor/entropy', float('nan')):>8.3f} "
                f"{m.get('frac_reward_zero_std', float('nan')):>9.3f} {m.get('response_length/mean', float('nan')):>6.2f}"
            )


if __name__ == "__main__":
    main()
