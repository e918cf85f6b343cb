"""``RolloutBatch``: the tensors of one step's rollouts, laid out as verl lays them out.

Prompts are left-padded to the longest prompt ``P`` and responses right-padded to the longest
response ``R``, so every response token sits in a ``[B, R]`` grid aligned with
``response_mask``: advantages, log-probabilities and losses are all ``[B, R]`` tensors, and
the token that predicts response position ``j`` is input position ``P - 1 + j``.

The pipeline builds batches and the trainer backends train on them, so the types live below both.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from itertools import chain
from typing import Any

import numpy as np
import torch

from engine.data import Prompt
from engine.rollout import Completion, PromptCompletions


@dataclass
class Rollout:
    """One completion with everything known about it before training."""

    prompt: Prompt
    prompt_ids: list[int]
    completion: Completion
    reward: float
    components: dict[str, float]
    group: str  # rows with the same group id were sampled from the same prompt this step
    advantage: float | None = None  # mean over the response's tokens, once computed
    # A stored completion trained again, not generated for this group (success replay,
    # engine/data/success_replay.py): off-policy, corrected like rollout replay's rows.
    replayed: bool = False


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] long
    response_ids: torch.Tensor  # [B, R] long, right-padded
    response_mask: torch.Tensor  # [B, R] float (1 = trained on)
    rollout_log_probs: torch.Tensor  # [B, R] sampling-time logprobs
    token_level_scores: torch.Tensor  # [B, R] the reward on the last response token
    index: np.ndarray  # [B] group ids (object array of str)
    rows: list[Rollout]
    policy_version: int
    # Filled in by the learner:
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    token_level_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None  # [B, R] off-policy correction (asynchronous runs)
    extra: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        response_attn = (self.response_lengths.unsqueeze(1) > torch.arange(self.response_ids.shape[1])).long()
        return torch.cat([self.prompt_mask, response_attn], dim=1)

    @property
    def response_lengths(self) -> torch.Tensor:
        return torch.tensor([len(r.completion.token_ids) for r in self.rows], dtype=torch.long)

    def select(self, idx: list[int] | torch.Tensor) -> RolloutBatch:
        """The sub-batch of rows ``idx`` (tensors indexed, python lists sliced)."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        idx_list = idx_t.tolist()
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value[idx_t]
            elif isinstance(value, np.ndarray):
                out[f.name] = value[idx_list]
            elif f.name == "rows":
                out[f.name] = [value[i] for i in idx_list]
            else:
                out[f.name] = value
        return replace(self, **out)

    def to(self, device: torch.device | str) -> RolloutBatch:
        return replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )


def collate(rows: list[Rollout], pad_id: int, policy_version: int) -> RolloutBatch:
    """Pad a list of rollouts into a ``RolloutBatch`` (prompts left, responses right).

    Each tensor is filled in one vectorised assignment (the rows' tokens concatenated, scattered
    through the padding mask, which numpy fills in row-major order): a per-row ``torch.tensor``
    and slice assignment cost about 0.1 ms a row, tens of ms for a few hundred rows every step.
    """
    if not rows:
        raise ValueError("cannot build a batch from zero rollouts")
    b = len(rows)
    prompt_lens = np.fromiter((len(r.prompt_ids) for r in rows), dtype=np.int64, count=b)
    lengths = np.fromiter((len(r.completion.token_ids) for r in rows), dtype=np.int64, count=b)
    p = int(prompt_lens.max())
    r_len = max(1, int(lengths.max()))
    prompt_mask = np.arange(p) >= (p - prompt_lens)[:, None]  # left-padded
    response_mask = np.arange(r_len) < lengths[:, None]  # right-padded
    prompt_ids = np.full((b, p), pad_id, dtype=np.int64)
    prompt_ids[prompt_mask] = np.fromiter(
        chain.from_iterable(r.prompt_ids for r in rows), dtype=np.int64, count=int(prompt_lens.sum())
    )
    tokens = int(lengths.sum())
    response_ids = np.full((b, r_len), pad_id, dtype=np.int64)
    response_ids[response_mask] = np.fromiter(
        chain.from_iterable(r.completion.token_ids for r in rows), dtype=np.int64, count=tokens
    )
    rollout_lp = np.zeros((b, r_len), dtype=np.float32)
    rollout_lp[response_mask] = np.fromiter(
        chain.from_iterable(r.completion.logprobs for r in rows), dtype=np.float32, count=tokens
    )
    scores = np.zeros((b, r_len), dtype=np.float32)
    answered = np.flatnonzero(lengths)  # the reward sits on the last response token
    scores[answered, lengths[answered] - 1] = [rows[i].reward for i in answered]
    index = np.array([r.group for r in rows], dtype=object)
    return RolloutBatch(
        prompt_ids=torch.from_numpy(prompt_ids),
        prompt_mask=torch.from_numpy(prompt_mask.astype(np.int64)),
        response_ids=torch.from_numpy(response_ids),
        response_mask=torch.from_numpy(response_mask.astype(np.float32)),
        rollout_log_probs=torch.from_numpy(rollout_lp),
        token_level_scores=torch.from_numpy(scores),
        index=index,
        rows=rows,
        policy_version=policy_version,
    )


def rollouts_from_groups(
    prompts: list[Prompt],
    groups: list[PromptCompletions],
    rewards: list[float],
    components: dict[str, list[float]],
    step: int,
) -> list[Rollout]:
    """Flatten generated groups (prompt order, n each) with their rewards into rollouts."""
    out: list[Rollout] = []
    k = 0
    for gi, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
        gid = f"{step}:{gi}:{prompt.uid}"
        for completion in group.completions:
            out.append(
                Rollout(
                    prompt=prompt,
                    prompt_ids=list(group.prompt_ids),
                    completion=completion,
                    reward=rewards[k],
                    components={name: vals[k] for name, vals in components.items()},
                    group=gid,
                )
            )
            k += 1
    return out
