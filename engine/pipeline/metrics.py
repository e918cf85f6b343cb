"""Step metrics computed from rollouts, under the names users already read (verl's, TRL's)."""

from __future__ import annotations

import numpy as np

from engine.batch import Rollout


def _stats(prefix: str, values: list[float], *, std: bool = False) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64)
    out = {f"{prefix}/mean": float(arr.mean()), f"{prefix}/max": float(arr.max()), f"{prefix}/min": float(arr.min())}
    if std:
        out[f"{prefix}/std"] = float(arr.std())
    return out


def rollout_metrics(rows: list[Rollout], accuracy_component: str | None) -> dict[str, float]:
    """Reward, accuracy and length statistics of all rollouts generated this step."""
    if not rows:
        return {}
    out = _stats("reward", [r.reward for r in rows], std=True)
    for name in rows[0].components:
        out[f"reward/{name}/mean"] = float(np.mean([r.components[name] for r in rows]))
    if accuracy_component is not None:
        out["train/accuracy"] = float(np.mean([r.components[accuracy_component] > 0.5 for r in rows]))
    lengths = [len(r.completion.token_ids) for r in rows]
    out.update(_stats("response_length", lengths))
    # Truncated = stopped by max_new_tokens (a stop string or EOS is a normal end).
    out["response_length/clip_ratio"] = float(np.mean([r.completion.finish_reason == "length" for r in rows]))
    out.update(_stats("prompt_length", [len(r.prompt_ids) for r in rows]))
    return out


def sample_items(rows: list[Rollout], limit: int) -> list[dict]:
    """Up to ``limit`` rollouts for the samples event, whole groups first so the browser can
    show a prompt's completions side by side."""
    items = []
    for r in rows[:limit]:
        items.append(
            {
                "prompt": r.prompt.raw,
                "completion": r.completion.text,
                "reward": r.reward,
                "advantage": r.advantage,
                "length": len(r.completion.token_ids),
                "finish_reason": r.completion.finish_reason,
                "extra": {
                    "components": r.components,
                    "prompt_uid": r.prompt.uid,
                    "group": r.group,
                    "answer": r.prompt.answer,
                    "policy_version": r.completion.policy_version,
                },
            }
        )
    return items
