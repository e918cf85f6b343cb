"""Step metrics computed from rollouts, under the names users already read (verl's, TRL's)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import numpy as np

from engine.batch import Rollout
from engine.pipeline.token_view import token_fields


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


TOKEN_BYTES_PER_STEP = 2 * 1024 * 1024
"""Most bytes of JSON the tokens of one step's samples may take, whatever the caps: a 4 MiB ingest
message must still hold the event with its texts (the caps' defaults took 0.09 MiB for 3,028 tokens,
~23 bytes a token: bench/token_view_bytes.py)."""


def sample_items(
    rows: list[Rollout],
    limit: int,
    *,
    token_texts: Callable[[Sequence[int]], list[str]] | None = None,
    token_samples: int = 0,
    tokens_per_sample: int = 0,
) -> list[dict]:
    """Up to ``limit`` rollouts for the samples event, whole groups first so the browser can
    show a prompt's completions side by side.

    The first ``token_samples`` of them also carry ``extra.tokens`` (engine/pipeline/token_view.py):
    their first ``tokens_per_sample`` tokens' texts (``token_texts``), sampling log-probs and
    entropies, while the step's tokens stay under ``TOKEN_BYTES_PER_STEP``."""
    items = []
    token_bytes = 0
    for i, r in enumerate(rows[:limit]):
        extra: dict = {
            "components": r.components,
            "prompt_uid": r.prompt.uid,
            "group": r.group,
            "answer": r.prompt.answer,
            "policy_version": r.completion.policy_version,
        }
        if r.replayed:  # a stored success that joined this group (success replay), not generated for it
            extra["replayed"] = "success"
        if token_texts is not None and i < token_samples and token_bytes < TOKEN_BYTES_PER_STEP:
            c = r.completion
            ids = c.token_ids[:tokens_per_sample]
            tokens = token_fields(token_texts(ids), c.logprobs, c.entropies, len(c.token_ids))
            size = len(json.dumps(tokens, ensure_ascii=False).encode())
            if token_bytes + size <= TOKEN_BYTES_PER_STEP:
                extra["tokens"] = tokens
            token_bytes += size
        items.append(
            {
                "prompt": r.prompt.raw,
                "completion": r.completion.text,
                "reward": r.reward,
                "advantage": r.advantage,
                "length": len(r.completion.token_ids),
                "finish_reason": r.completion.finish_reason,
                "extra": extra,
            }
        )
    return items
