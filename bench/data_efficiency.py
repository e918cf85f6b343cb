"""Data efficiency (issue 16): prompt selection and rollout replay against uniform sampling, and
earlier-stage replay against forgetting, from the arithmetic starter policy with DAPO.

Part 1, selection. The same DAPO run (same seed, steps, prompts per step, evals) with
``data.selection`` uniform, with ``difficulty_targeted`` (DOTS: prompts whose estimated pass rate is
near 1/2, predicted from similar prompts), with ``likelihood_targeted`` (the same selection with the
policy's own likelihood of the reference answer as the predictor, ``predictor: answer_likelihood``),
and with ``difficulty_targeted`` plus rollout replay (``replay.ratio``; RR). Both from
Sun et al. 2025, "Improving Data Efficiency for LLM RL Fine-tuning Through Difficulty-targeted
Online Data Selection and Rollout Replay", arXiv:2506.05316, which reports 23-62% less wall time to
the same accuracy. Per arm: the training time and generated tokens to reach +20 points of greedy
eval accuracy over the starting policy, and to reach uniform's final accuracy, and their ratio to
uniform's (target: selection + replay at most 0.75x uniform's time to the same accuracy).

Part 2, continual. Stage 1 trains arithmetic, stage 2 the second task (countdown by default) in
one run (``data.stages``), without and with ``replay.previous_stages`` (a share of each stage-2
batch drawn from stage 1's prompts). Both arms start from what ``model.path: starter`` resolves to
for these stages (``engine.models.starter.starter_tasks``): the *mixture* starter of the two tasks
(arithmetic's own starter already is, with countdown as its companion). A starter trained on
arithmetic alone scores 0 on countdown, so every stage-2 group would be all-wrong, DAPO's filter
would drop every stage-2 step, and there would be no stage-2 learning and no forgetting to measure.
Forgetting = arithmetic accuracy at the end of stage 1 minus at the end of the run (target: replay halves it, while the second task's final accuracy is at
least 0.9x the run without replay).

Time is the sum of ``timing_s/step`` up to the eval point (training only: eval passes are not
counted, so an arm is not charged for how often it is evaluated); tokens are the sum of
``rollout/gen_tokens`` (every sampled token, DAPO's extra generation rounds included; replayed
groups cost none). Tokens do not depend on the machine's load, time does: on a shared machine
compare tokens first. A crossing is read at eval points (the first one at or above the bar), so
its resolution is ``--eval-every`` steps.

"Uniform's final accuracy" is a fair bar only where uniform has stopped climbing. At lr 2e-4 (the
rate that meets the learning ceiling) uniform gains ~0.04 per 100 steps at step 600 and reaches its
plateau (0.96-0.99 over four seeds, DAPO's generation rounds at their cap of 8) by ~1,000 steps, so the selection
target is read at ``--steps 1200`` (bench/README.md has both horizons).

    python bench/data_efficiency.py            # the issue's size (600 steps per arm, eval 512 prompts)
    python bench/data_efficiency.py --quick    # a few steps per arm, eval 64 prompts
    python bench/data_efficiency.py --part selection --steps 300 --eval-every 30
    python bench/data_efficiency.py --part selection --seeds 0,1,2 --arms uniform,difficulty_targeted
    python bench/data_efficiency.py --part selection --steps 1200 --eval-size 2048 --seeds 0 \
        --arms uniform,likelihood_targeted --set algorithm.filter_groups.round_size=deficit \
        --set optimizer.lr=2e-4 --set trainer.mixed_precision=bf16      # the selection target's run

All arms run in this process one after another (never in parallel), with the same seed.

One run per arm decides little when runs of one arm differ as much as the arms do (uniform DAPO at
lr 2e-4 ended at 0.859 and 0.939 in two runs). ``--seeds`` runs every selection arm once per seed
(``trainer.seed``; the same seeds for every arm), a seed's arms one after another and their order
rotated from one seed to the next, so that a drift in the machine's load falls on every arm alike
and no arm always runs first. It prints each seed's figures as one run does, then per arm the
median and the range across seeds of the time to +20 points, the time to uniform's final accuracy
(the median of uniform's finals, one bar for every seed), the final accuracy and the generated
tokens, and the ratio of the medians to uniform's. A bar an arm never reaches counts as later than
any that it does. ``--arms`` picks the selection arms to run (uniform, the reference, always runs).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine_run import PresetRun, build_starter, run_preset  # noqa: E402

GAIN = 0.20
"""The issue's bar: +20 points of eval accuracy over the starting policy."""

SELECTION_ARMS: list[tuple[str, list[str]]] = [
    ("uniform", ["data.selection=uniform", "replay.ratio=0"]),
    ("difficulty_targeted", ["data.selection=difficulty_targeted", "replay.ratio=0"]),
    (
        "likelihood_targeted",
        [
            "data.selection=difficulty_targeted",
            "data.selection_options.predictor=answer_likelihood",
            "data.selection_options.pool=256",
            "replay.ratio=0",
        ],
    ),  # difficulty_targeted with the policy's answer likelihood as the predictor (engine/data/likelihood.py)
    (
        "difficulty_targeted + replay",
        ["data.selection=difficulty_targeted"],
    ),  # + replay.ratio from --replay-ratio
]
ARM_NAMES = [name for name, _ in SELECTION_ARMS]


def curve(run: PresetRun, key: str = "eval/accuracy") -> list[dict[str, float]]:
    """Per eval point: step, training seconds and generated tokens so far, and accuracy."""
    out, seconds, tokens = [], 0.0, 0.0
    for step in sorted(run.metrics):
        m = run.metrics[step]
        if step > 0:
            seconds += float(m.get("timing_s/step", 0.0))
            tokens += float(m.get("rollout/gen_tokens", 0.0))
        if key in m:
            out.append({"step": step, "seconds": seconds, "tokens": tokens, "accuracy": float(m[key])})
    return out


PLATEAU_KEYS = {
    "entropy": "actor/entropy",
    "zero-var": "selection/zero_var_frac",
    "gen rounds": "filter/gen_rounds",
    "train acc": "train/accuracy",
    "s/step": "timing_s/step",
    "gen s": "timing_s/gen",
    "update s": "timing_s/update",
    "scoring s": "selection/scoring_s",
}
"""What says why a curve flattens, averaged per eval window: the policy's entropy (exploration
left), the share of sampled groups with all-equal rewards (no GRPO signal: DAPO regenerates them,
``filter/gen_rounds``), the sampled completions' accuracy, the step time those rounds cost, and
where a step's time goes: generation, the update and (``predictor: answer_likelihood``) scoring the
candidates."""


def windows(run: PresetRun, every: int) -> list[dict[str, float]]:
    """``PLATEAU_KEYS`` averaged over each ``every``-step window (steps ``s - every + 1 .. s``)."""
    out = []
    last = max(run.metrics, default=0)
    for end in range(every, last + 1, every):
        row: dict[str, float] = {"step": end}
        for label, key in PLATEAU_KEYS.items():
            vals = [float(run.metrics[s][key]) for s in range(end - every + 1, end + 1)
                    if s in run.metrics and run.metrics[s].get(key) is not None]  # fmt: skip
            if vals:
                row[label] = sum(vals) / len(vals)
        out.append(row)
    return out


def first_reaching(points: list[dict[str, float]], bar: float) -> dict[str, float] | None:
    """The first eval point at or above ``bar`` (None: never reached)."""
    return next((p for p in points if p["accuracy"] >= bar - 1e-12), None)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def run_selection_arms(
    args: argparse.Namespace, common: list[str], seed: int, names: list[str]
) -> dict[str, Any]:
    """Run the selection arms ``names`` (in that order) with ``trainer.seed`` ``seed``: their overrides,
    wall time, eval curve and plateau windows, by arm in ``SELECTION_ARMS``' order."""
    runs: dict[str, dict[str, Any]] = {}
    for name in names:
        overrides = dict(SELECTION_ARMS)[name]
        extra = [f"replay.ratio={args.replay_ratio}"] if "replay" in name else []
        print(f"  running {name} ({args.steps} steps) ...", flush=True)
        run = run_preset(
            "dapo", args.steps, args.eval_every,
            [*common, f"trainer.seed={seed}", *overrides, *extra, *args.overrides],
        )  # fmt: skip
        if run.code != 0:
            raise SystemExit(f"{name} (seed {seed}): the run exited with code {run.code}")
        runs[name] = {
            "overrides": overrides + extra,
            "wall_s": run.wall_s,
            "points": curve(run),
            "windows": windows(run, args.eval_every),
        }
    return {name: runs[name] for name in ARM_NAMES if name in runs}


def score_selection(arms: dict[str, dict[str, Any]], uniform_final: float) -> None:
    """Add to each arm its start and final accuracy, totals, the eval points where it first reaches
    +20 points over its start and ``uniform_final``, and their time and token ratios to uniform's."""
    for arm in arms.values():
        pts = arm["points"]
        arm["start_accuracy"] = pts[0]["accuracy"]
        arm["final_accuracy"] = pts[-1]["accuracy"]
        arm["train_s"] = pts[-1]["seconds"]
        arm["tokens"] = pts[-1]["tokens"]
        arm["to_gain"] = first_reaching(pts, pts[0]["accuracy"] + GAIN)
        arm["to_uniform_final"] = first_reaching(pts, uniform_final)
    base = arms["uniform"]
    for arm in arms.values():
        for bar in ("to_gain", "to_uniform_final"):
            mine, ref = arm[bar], base[bar]
            arm[f"{bar}_time_ratio"] = (
                mine["seconds"] / ref["seconds"] if mine and ref and ref["seconds"] else None
            )
            arm[f"{bar}_tokens_ratio"] = (
                mine["tokens"] / ref["tokens"] if mine and ref and ref["tokens"] else None
            )


def print_selection(args: argparse.Namespace, arms: dict[str, dict[str, Any]], title: str) -> None:
    """One run per arm: the table of bars and ratios, the eval curves and the plateau windows."""
    start = arms["uniform"]["start_accuracy"]
    uniform_final = arms["uniform"]["final_accuracy"]
    print(f"\n{title}. DAPO, {args.steps} steps, eval every {args.eval_every} on {args.eval_size} prompts, "
          f"start {start:.3f}, uniform's final {uniform_final:.3f}")  # fmt: skip
    print("| arm | run wall s | train s | gen tokens | final acc | +20 pts: step / s / tokens | vs uniform (s, tokens) "
          "| uniform's final: step / s / tokens | vs uniform (s, tokens) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, a in arms.items():
        cells = []
        for bar in ("to_gain", "to_uniform_final"):
            p = a[bar]
            cells.append(
                "not reached" if p is None else f"{p['step']} / {p['seconds']:.1f} / {p['tokens']:,.0f}"
            )
            cells.append(f"{_times(a[f'{bar}_time_ratio'])}, {_times(a[f'{bar}_tokens_ratio'])}")
        print(f"| {name} | {a['wall_s']:.1f} | {a['train_s']:.1f} | {a['tokens']:,.0f} | {a['final_accuracy']:.3f} | "
              + " | ".join(cells) + " |")  # fmt: skip
    print("\neval accuracy by step (train s, gen tokens so far):")
    for name, a in arms.items():
        series = ", ".join(
            f"{p['step']}: {p['accuracy']:.3f} ({p['seconds']:.0f} s, {p['tokens']:,.0f})"
            for p in a["points"]
        )
        print(f"  {name}: {series}")
    print(f"\nwhy each curve flattens, per {args.eval_every}-step window (means):", ", ".join(PLATEAU_KEYS))
    for name, a in arms.items():
        print(f"  {name}:")
        for w in a["windows"]:
            cells = ", ".join(f"{k} {w[k]:.3g}" for k in PLATEAU_KEYS if k in w)
            print(f"    to step {w['step']}: {cells}")


def selection_part(args: argparse.Namespace, common: list[str]) -> dict[str, Any]:
    arms = run_selection_arms(args, common, args.seed, args.arms)
    start = arms["uniform"]["points"][0]["accuracy"]
    uniform_final = arms["uniform"]["points"][-1]["accuracy"]
    score_selection(arms, uniform_final)
    print_selection(args, arms, "Part 1: selection")
    return {"start_accuracy": start, "uniform_final_accuracy": uniform_final, "arms": arms}


SUMMARY_FIGURES: dict[str, tuple[str, Any]] = {
    "+20 pts: s": (".1f", lambda a: a["to_gain"] and a["to_gain"]["seconds"]),
    "uniform's final: s": (".1f", lambda a: a["to_median_final"] and a["to_median_final"]["seconds"]),
    "final acc": (".3f", lambda a: a["final_accuracy"]),
    "gen tokens": (",.0f", lambda a: a["tokens"]),
}
"""The seeds' summary per arm: its format and its value in one seed's scored arm (None: the bar is
never reached, which sorts after every time that is)."""
SUMMARY_RATIOS = ("+20 pts: s", "uniform's final: s", "gen tokens")


def _order(values: list[float | None]) -> list[float]:
    return sorted(math.inf if v is None else v for v in values)


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else value


def _reached(value: float | None, spec: str) -> str:
    return "not reached" if value is None else format(value, spec)


def selection_seeds_part(args: argparse.Namespace, common: list[str]) -> dict[str, Any]:
    """Every selection arm once per seed of ``args.seeds`` (order rotated per seed), each seed's
    figures as ``selection_part``'s, then the median and range across seeds per arm."""
    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    for i, seed in enumerate(args.seeds):
        print(f"  seed {seed}:", flush=True)
        shift = i % len(args.arms)
        arms = run_selection_arms(args, common, seed, args.arms[shift:] + args.arms[:shift])
        score_selection(arms, arms["uniform"]["points"][-1]["accuracy"])
        print_selection(args, arms, f"Part 1: selection, seed {seed}")
        per_seed[seed] = arms
    median_final = statistics.median(arms["uniform"]["final_accuracy"] for arms in per_seed.values())
    for arms in per_seed.values():
        for arm in arms.values():
            arm["to_median_final"] = first_reaching(arm["points"], median_final)

    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for name in per_seed[args.seeds[0]]:
        summary[name] = {}
        for label, (_, figure) in SUMMARY_FIGURES.items():
            values = [figure(arms[name]) for arms in per_seed.values()]
            ordered = _order(values)
            summary[name][label] = {
                "values": values,
                "median": _finite(statistics.median(ordered)),
                "min": _finite(ordered[0]),
                "max": _finite(ordered[-1]),
            }
    for row in summary.values():
        for label in SUMMARY_RATIOS:
            mine, ref = row[label]["median"], summary["uniform"][label]["median"]
            row[label]["ratio"] = mine / ref if mine is not None and ref else None

    print(f"\nPart 1: selection over seeds {', '.join(map(str, args.seeds))}: median [min - max] across seeds; "
          f"uniform's final is the median of uniform's final accuracies, {median_final:.3f}, for every seed")  # fmt: skip
    header = [f"{label} | vs uniform" if label in SUMMARY_RATIOS else label for label in SUMMARY_FIGURES]
    print("| arm | " + " | ".join(header) + " |")
    print("| --- " * (1 + len(SUMMARY_FIGURES) + len(SUMMARY_RATIOS)) + "|")
    for name, row in summary.items():
        cells = []
        for label, (spec, _) in SUMMARY_FIGURES.items():
            fig = row[label]
            med, low, high = (_reached(fig[k], spec) for k in ("median", "min", "max"))
            cells.append(f"{med} [{low} - {high}]")
            if label in SUMMARY_RATIOS:
                cells.append(_times(fig["ratio"]))
        print(f"| {name} | " + " | ".join(cells) + " |")
    return {
        "seeds": args.seeds,
        "uniform_final_median": median_final,
        "per_seed": {str(seed): arms for seed, arms in per_seed.items()},
        "summary": summary,
    }


def continual_starter(stages: str, steps: int) -> str:
    """Build (or find cached) the starter the continual runs (``stages``, their ``data.stages``
    override, ``steps`` in all) resolve ``model.path: starter`` to, outside the RL time; a line saying what it is and
    its accuracy per task."""
    from engine.config import load_config
    from engine.models.starter import read_starter_info, starter_for, starter_tasks

    pairs = starter_tasks(load_config("dapo", [stages, f"trainer.total_steps={steps}"]).data)
    t0 = time.perf_counter()
    info = read_starter_info(starter_for(pairs))
    if "tasks" not in info:
        return f"continual runs start from the {info['task']} starter, ready in {time.perf_counter() - t0:.1f} s"
    per_task = ", ".join(
        f"{t['task']}-d{t['difficulty']} {t['eval_accuracy']:.3f} (target {t['target_accuracy']})"
        for t in info["tasks"]
    )
    return (
        f"continual runs start from the mixture starter ({info['steps']} SFT steps; greedy eval accuracy "
        f"{per_task}), ready in {time.perf_counter() - t0:.1f} s"
    )


def continual_stages(args: argparse.Namespace) -> tuple[str, str]:
    """The second stage's name and the ``data.stages`` override of the continual runs."""
    task, _, difficulty = args.second_stage.partition(":")
    second = task if task != "arithmetic" else f"arithmetic-d{difficulty or 1}"
    stages = (
        f"data.stages=[{{name: arithmetic, steps: {args.stage_steps}, task: arithmetic, difficulty: 1}}, "
        f"{{name: {second}, steps: {args.stage_steps}, task: {task}, difficulty: {difficulty or 1}}}]"
    )
    return second, stages


def continual_part(args: argparse.Namespace, common: list[str]) -> dict[str, Any]:
    second, stages = continual_stages(args)
    arms: dict[str, dict[str, Any]] = {}
    for name, share in (("without replay", 0.0), ("replay.previous_stages", args.previous_stages)):
        print(f"  running continual {name} (2 x {args.stage_steps} steps) ...", flush=True)
        run = run_preset(
            "dapo", 2 * args.stage_steps, args.eval_every,
            [*common, f"trainer.seed={args.seed}", stages, f"replay.previous_stages={share}", *args.overrides],
        )  # fmt: skip
        if run.code != 0:
            raise SystemExit(f"continual {name}: the run exited with code {run.code}")
        first = curve(run, "eval/arithmetic/accuracy")
        by_step = {p["step"]: p for p in first}
        end1 = by_step.get(args.stage_steps)
        if end1 is None:
            raise SystemExit(
                f"continual {name}: no arithmetic eval at the end of stage 1 (step {args.stage_steps})"
            )
        newer = curve(run, f"eval/{second}/accuracy")
        # Stage-2 steps DAPO's group filter left empty (every group's accuracy equal: no gradient, no update).
        stage2 = [m for s, m in run.metrics.items() if s > args.stage_steps]
        empty = sum(1 for m in stage2 if not m.get("filter/kept_groups"))
        last = first[-1]
        arms[name] = {
            "previous_stages": share,
            "wall_s": run.wall_s,
            "train_s": last["seconds"],
            "tokens": last["tokens"],
            "arithmetic_start": first[0]["accuracy"],
            "arithmetic_end_stage1": end1["accuracy"],
            "arithmetic_end": last["accuracy"],
            "forgetting": end1["accuracy"] - last["accuracy"],
            "second_task": second,
            "second_start": newer[0]["accuracy"] if newer else None,
            "second_end": newer[-1]["accuracy"] if newer else None,
            "arithmetic_points": first,
            "second_points": newer,
            "stage2_steps_without_update": empty,
        }
    plain, guarded = arms["without replay"], arms["replay.previous_stages"]
    forgetting_ratio = guarded["forgetting"] / plain["forgetting"] if plain["forgetting"] > 0 else None
    second_ratio = (
        guarded["second_end"] / plain["second_end"]
        if plain["second_end"] and guarded["second_end"] is not None
        else None
    )
    print(f"\nPart 2: continual. DAPO, arithmetic {args.stage_steps} steps then {second} {args.stage_steps} steps, "
          f"eval every {args.eval_every} on {args.eval_size} prompts per stage; replay.previous_stages "
          f"{args.previous_stages}")  # fmt: skip
    print(f"| arm | run wall s | train s | gen tokens | arithmetic: start / end of stage 1 / end | forgetting "
          f"| {second}: first eval (step) / end | stage-2 steps without update |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, a in arms.items():
        print(f"| {name} | {a['wall_s']:.1f} | {a['train_s']:.1f} | {a['tokens']:,.0f} | {a['arithmetic_start']:.3f} / "
              f"{a['arithmetic_end_stage1']:.3f} / {a['arithmetic_end']:.3f} | {a['forgetting']:+.3f} | "
              f"{_fmt(a['second_start'], '.3f')} ({a['second_points'][0]['step'] if a['second_points'] else '-'}) / "
              f"{_fmt(a['second_end'], '.3f')} | {a['stage2_steps_without_update']} of {args.stage_steps} |")  # fmt: skip
    print(f"forgetting with / without replay: {_fmt(forgetting_ratio, '.2f')} (target <= 0.50); {second} final "
          f"accuracy with / without replay: {_fmt(second_ratio, '.2f')} (target >= 0.90)")  # fmt: skip
    for name, a in arms.items():
        for label, pts in (("arithmetic", a["arithmetic_points"]), (second, a["second_points"])):
            print(f"  {name}, {label}: " + ", ".join(f"{p['step']}: {p['accuracy']:.3f}" for p in pts))
    return {"arms": arms, "forgetting_ratio": forgetting_ratio, "second_final_ratio": second_ratio}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="short version: 10 steps per arm (5+5 continual), eval 64"
    )
    ap.add_argument("--part", choices=["selection", "continual", "both"], default="both")
    ap.add_argument("--steps", type=int, help="steps per selection arm (default 600; quick 10)")
    ap.add_argument("--stage-steps", type=int, help="steps per continual stage (default 300; quick 5)")
    ap.add_argument("--eval-every", type=int, help="eval interval in steps (default 50; quick 5)")
    ap.add_argument("--eval-size", type=int, help="held-out prompts per eval (default 512; quick 64)")
    ap.add_argument("--seed", type=int, default=0, help="trainer.seed of every arm")
    ap.add_argument(
        "--seeds",
        type=lambda text: [int(seed) for seed in text.split(",")],
        help="selection part: every arm once per seed (e.g. 0,1,2) and the median and range across seeds",
    )
    ap.add_argument(
        "--arms",
        type=lambda text: [name.strip() for name in text.split(",")],
        default=ARM_NAMES,
        help=f"selection arms to run, comma-separated, of: {', '.join(ARM_NAMES)} (uniform always runs)",
    )
    ap.add_argument("--replay-ratio", type=float, default=0.25, help="replay.ratio of the replay arm")
    ap.add_argument(
        "--previous-stages", type=float, default=0.25, help="replay.previous_stages of the guarded arm"
    )
    ap.add_argument(
        "--second-stage", default="countdown:1", help="TASK:DIFFICULTY of the continual run's second stage"
    )
    ap.add_argument(
        "--set", dest="overrides", action="append", default=[], help="more --set items for every arm"
    )
    ap.add_argument(
        "--json", type=Path, help="where the figures go (default .cache/bench/data_efficiency[-quick].json)"
    )
    args = ap.parse_args()
    args.steps = args.steps or (10 if args.quick else 600)
    args.stage_steps = args.stage_steps or (5 if args.quick else 300)
    args.eval_every = args.eval_every or (5 if args.quick else 50)
    args.eval_size = args.eval_size or (64 if args.quick else 512)
    unknown = set(args.arms) - set(ARM_NAMES)
    if unknown:
        raise SystemExit(f"--arms: unknown {', '.join(sorted(unknown))} (of: {', '.join(ARM_NAMES)})")
    args.arms = [name for name in ARM_NAMES if name == "uniform" or name in args.arms]
    if args.stage_steps % args.eval_every:
        raise SystemExit(
            f"--stage-steps {args.stage_steps} must be a multiple of --eval-every {args.eval_every}"
        )
    out = args.json or ROOT / ".cache" / "bench" / f"data_efficiency{'-quick' if args.quick else ''}.json"

    build_s = build_starter("arithmetic", 1)
    seeds = ", ".join(map(str, args.seeds)) if args.seeds and args.part != "continual" else args.seed
    print(f"starter policy ready in {build_s:.1f} s (cached after the first build); seed {seeds}")
    if args.part in ("continual", "both"):
        print(continual_starter(continual_stages(args)[1], 2 * args.stage_steps), flush=True)
    common = [f"data.eval_size={args.eval_size}", "trainer.eval_pass_k=0"]
    t0 = time.perf_counter()
    figures: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    }
    if args.part in ("selection", "both"):
        part = selection_seeds_part if args.seeds else selection_part
        figures["selection"] = part(args, common)
    if args.part in ("continual", "both"):
        figures["continual"] = continual_part(args, common)
    figures["total_s"] = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1))
    print(f"\nfigures written to {out} ({figures['total_s'] / 60:.1f} min in all)")


if __name__ == "__main__":
    main()
