"""How well the never-sampled-prompt estimate of ``data.selection`` predicts real pass rates.

Measures the arithmetic starter policy's pass rate on ``--prompts`` training prompts (``--n``
sampled completions each, the rollout backend and reward of a real run), gives the first half to a
:class:`~engine.data.PromptSelector` as measured prompts, and predicts the second half from their
text alone (``engine/data/similarity.py``). Prints, per bandwidth and reference-set size: the
correlation and mean absolute error of the predictions against the measured pass rates (and the
error of predicting the measured mean for all), and the chance of a zero-variance group (all n
completions equal) for the quarter of prompts predicted nearest 1/2 against all of them: what
``difficulty_targeted`` gains on prompts it has never sampled.

Then the calibration of the predicted chance of a zero-variance group (``selection/zero_var_expected``)
on the held-out half, over ``--splits`` random halves (default options): the held-out predictions
pooled and cut into deciles of the prediction, each decile's mean prediction against how often its
prompts' measured n completions were all equal, and the overall means; before (the point estimate
plugged into p^n + (1 - p)^n) and after (the calibrated Beta predictive's beta-binomial chance,
``engine/data/similarity.py``). A calibrated prediction tracks the measured frequency in every
decile; the point estimate ignores how uncertain p is and sits far below it.

    python bench/selection_predictor.py                    # 800 prompts, 8 completions each
    python bench/selection_predictor.py --prompts 400 --n 4

``--draw-cost`` measures instead what a draw costs (no model): the DAPO preset's 50,000 arithmetic
prompts, ``--steps`` simulated steps of rounds as ``round_size=deficit`` draws them (outcomes from a
fixed pass rate per prompt, Beta(0.6, 0.4)), then ``next_batch(32)`` timed from that state again and
again (the same candidates and references), with the references changed since the last draw (a fit
of rho: every round of a run) and unchanged.

    taskset -c 0 python bench/selection_predictor.py --draw-cost
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from engine.config import SelectionOptions, build_config
from engine.data import PromptSelector, load_prompts
from engine.data.selection import beta_binomial_zero_variance, zero_variance_probability
from engine.models import load_model, load_tokenizer
from engine.models.starter import starter_policy
from engine.pipeline.producer import RolloutProducer
from engine.rewards import RewardManager
from engine.run import build_rollout_backend


def measure(n_prompts: int, n: int) -> tuple[list, np.ndarray]:
    """The training prompts and their measured pass rates under the starter policy."""
    path = starter_policy("arithmetic", 1)
    cfg = build_config(
        {
            "model": {"path": str(path)},
            "data": {"source": "builtin", "task": "arithmetic", "train_size": n_prompts, "eval_size": 0},
            "rollout": {"n": n},
        }
    )
    torch.manual_seed(0)
    model, tokenizer = load_model(path), load_tokenizer(path)
    prompts = load_prompts(cfg.data, tokenizer).train
    backend = build_rollout_backend(cfg, model, tokenizer, path, torch.device("cpu"))
    rates: list[float] = []
    with RewardManager.from_config(cfg.reward) as rewards:
        producer = RolloutProducer(
            cfg,
            sampler=PromptSelector.from_config(cfg, prompts),
            backend=backend,
            rewards=rewards,
            pad_id=tokenizer.pad_token_id,
        )
        for start in range(0, n_prompts, 100):
            params = producer.sampling_params(n=n, seed=start)
            rows, _, _, _ = producer.generate_and_score(prompts[start : start + 100], params, 0)
            rates += np.array([r.components["task"] for r in rows]).reshape(-1, n).mean(axis=1).tolist()
    backend.close()
    return prompts, np.array(rates)


def given_as_measured(selector: PromptSelector, prompts: list, rates: np.ndarray, n: int) -> None:
    """Record each prompt's measured pass rate as one scored group of n completions."""
    for prompt, rate in zip(prompts, rates):
        wins = round(rate * n)
        selector.observe(prompt.uid, [1.0] * wins + [0.0] * (n - wins), step=1)


def calibration(prompts: list, rates: np.ndarray, n: int, splits: int) -> None:
    """Predicted against measured chance of a zero-variance group on held-out halves (module docstring)."""
    before, after, means, happened = [], [], [], []
    for split in range(splits):
        order = np.random.default_rng(split).permutation(len(prompts))
        given, held = order[: len(prompts) // 2], [int(i) for i in order[len(prompts) // 2 :]]
        selector = PromptSelector(prompts, selection="difficulty_targeted", group_size=n)
        given_as_measured(selector, [prompts[i] for i in given], rates[given], n)
        a, b, _ = selector.predictive(held)
        means += (a / (a + b)).tolist()
        before += zero_variance_probability(a / (a + b), n).tolist()
        after += beta_binomial_zero_variance(a, b, n).tolist()
        happened += ((rates[held] == 0) | (rates[held] == 1)).tolist()
    zero = np.array(happened, dtype=float)
    print(
        f"calibration over {splits} random halves ({len(zero)} held-out predictions): deciles of the "
        "predicted chance of a zero-variance group, predicted / measured"
    )
    for name, predicted in (
        ("before (point estimate)", np.array(before)),
        ("after (Beta predictive)", np.array(after)),
    ):
        deciles = np.array_split(np.argsort(predicted, kind="stable"), 10)
        cells = " ".join(f"{predicted[d].mean():.3f}/{zero[d].mean():.3f}" for d in deciles)
        print(f"  {name}: overall {predicted.mean():.3f}/{zero.mean():.3f}; deciles {cells}")
    quarter = len(zero) // 4
    nearest = np.argsort(np.abs(np.array(means) - 0.5), kind="stable")[:quarter]
    lowest = np.argsort(np.array(after), kind="stable")[:quarter]
    print(
        f"  measured zero-variance chance of the quarter predicted nearest 1/2 {zero[nearest].mean():.3f}, "
        f"of the quarter with the lowest predicted chance {zero[lowest].mean():.3f}, of all {zero.mean():.3f}"
    )


def draw_cost(steps: int, repeats: int = 60) -> None:
    """Milliseconds of ``next_batch(32)`` per selection from a simulated state (module docstring)."""
    from engine.config import load_config

    cfg = load_config("dapo")
    prompts = load_prompts(cfg.data, None).train
    rates = np.random.default_rng(123).beta(0.6, 0.4, len(prompts))
    index = {p.uid: i for i, p in enumerate(prompts)}
    for selection in ("difficulty_targeted", "uniform"):
        cfg = load_config("dapo", [f"data.selection={selection}"])
        selector = PromptSelector.from_config(cfg, prompts)
        rng = np.random.default_rng(7)
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            kept = generated = 0
            while kept < 32 and generated < 8 * 32:  # DAPO's rounds, sized as round_size=deficit sizes them
                want = 32 if not generated else min(32, -(-(32 - kept) // max(0.1, kept / generated)))
                for p in selector.next_batch(int(want)):
                    values = (rng.random(8) < rates[index[p.uid]]).astype(float).tolist()
                    selector.observe(p.uid, values, step)
                    generated, kept = generated + 1, kept + (min(values) != max(values))
            selector.metrics()
        simulated = time.perf_counter() - t0
        state = selector.state_dict()
        cells = []
        for label, change in (("references changed (a fit)", True), ("unchanged", False)):
            times = []
            for _ in range(repeats):
                selector.draws = state["selection"]["draws"]
                selector.epochs.epoch, selector.epochs.position = state["epoch"], state["position"]
                if change:
                    selector.stats.revision += 1  # as a recorded group does
                t = time.perf_counter()
                selector.next_batch(32)
                times.append(time.perf_counter() - t)
            ms = np.array(times[5:]) * 1e3
            cells.append(f"{label}: median {np.median(ms):.2f} ms (min {ms.min():.2f})")
        print(f"{selection}, {len(selector.stats)} prompts measured in {steps} steps ({simulated:.1f} s): "
              f"next_batch(32) with the " + "; ".join(cells))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=800)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--splits", type=int, default=20, help="random halves for the calibration report")
    ap.add_argument("--draw-cost", action="store_true", help="time a draw instead (no model; module docstring)")
    ap.add_argument("--steps", type=int, default=300, help="--draw-cost: simulated steps before the timing")
    args = ap.parse_args()
    if args.draw_cost:
        draw_cost(args.steps)
        return
    t0 = time.perf_counter()
    prompts, rates = measure(args.prompts, args.n)
    n, half = args.n, args.prompts // 2
    print(f"measured {args.prompts} prompts x {n} completions in {time.perf_counter() - t0:.0f} s")
    counts = np.histogram(rates, bins=[0, 1e-9, 0.25, 0.5, 0.75, 1 - 1e-9, 1])[0].tolist()
    print(f"pass rates: {counts} prompts at 0, (0, .25), [.25, .5), [.5, .75), [.75, 1), 1")
    truth = rates[half:]
    nearest = len(truth) // 4
    all_zero_var = float((truth**n + (1 - truth) ** n).mean())
    for bandwidth in (0.05, 0.1, 0.2):
        for references in (256, half):
            options = SelectionOptions(bandwidth=bandwidth, references=references)
            selector = PromptSelector(prompts, selection="difficulty_targeted", options=options, group_size=n)
            given_as_measured(selector, prompts[:half], rates[:half], n)
            predicted, _ = selector.estimates(list(range(half, len(prompts))))
            chosen = truth[np.argsort(np.abs(predicted - 0.5), kind="stable")[:nearest]]
            print(
                f"bandwidth {bandwidth} references {references}: "
                f"correlation {np.corrcoef(predicted, truth)[0, 1]:.3f}, "
                f"MAE {np.abs(predicted - truth).mean():.3f} (measured mean for all: "
                f"{np.abs(rates[:half].mean() - truth).mean():.3f}); zero-variance chance of the quarter "
                f"predicted nearest 1/2 {(chosen**n + (1 - chosen) ** n).mean():.3f}, of all {all_zero_var:.3f}"
            )

    calibration(prompts, rates, n, args.splits)


if __name__ == "__main__":
    main()
