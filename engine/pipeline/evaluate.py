"""Evaluation on the held-out split: greedy accuracy and pass@k.

pass@k is estimated without bias from ``n = k`` samples per prompt as the fraction of
prompts with at least one correct sample (Chen et al. 2021, arXiv:2107.03374, with n = k).
"""

from __future__ import annotations

import time

import numpy as np

from engine.batch import Rollout
from engine.data import Prompt
from engine.pipeline.producer import RolloutProducer, correctness_component, seed_for


def _correct(rows: list[Rollout], acc_name: str | None) -> list[bool]:
    """Correctness by the accuracy component, or a positive reward when there is none."""
    return [r.components[acc_name] > 0.5 if acc_name else r.reward > 0 for r in rows]


def evaluate(producer: RolloutProducer, prompts: list[Prompt], *, pass_k: int, seed: int) -> dict[str, float]:
    if not prompts:
        return {}
    t0 = time.perf_counter()
    greedy, result, _, _ = producer.generate_and_score(
        prompts, producer.sampling_params(n=1, temperature=0.0, token_view=False), -1
    )
    acc_name = correctness_component(result.components)
    correct = _correct(greedy, acc_name)
    out = {
        "eval/accuracy": float(np.mean(correct)),
        "eval/reward": float(np.mean([r.reward for r in greedy])),
        "eval/response_length": float(np.mean([len(r.completion.token_ids) for r in greedy])),
    }
    if pass_k > 0:
        params = producer.sampling_params(n=pass_k, seed=seed_for(seed, -1), token_view=False)
        sampled, result, _, _ = producer.generate_and_score(prompts, params, -1)
        hits = np.array(_correct(sampled, acc_name), dtype=bool).reshape(len(prompts), pass_k)
        out[f"eval/pass@{pass_k}"] = float(hits.any(axis=1).mean())
        out[f"eval/mean@{pass_k}"] = float(hits.mean())
    out["timing_s/eval"] = time.perf_counter() - t0
    return out
