"""Rollout batches built from random tokens, for the trainer and kernel tests that need a real
``RolloutBatch`` (ragged prompts and responses, shuffled groups) without sampling one."""

from __future__ import annotations

import torch

from engine.batch import Rollout, RolloutBatch, collate
from engine.data import Prompt
from engine.rollout import Completion


def random_batch(vocab: int, groups: int = 4, n: int = 3, seed: int = 0) -> RolloutBatch:
    """``groups`` prompts of 2-6 tokens with ``n`` responses of 1-5 tokens each, rows shuffled as
    mini-batches shuffle them; token ids avoid 0-2 (pad and special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for g in range(groups):
        p_len = int(torch.randint(2, 7, (1,), generator=gen))
        prompt_ids = torch.randint(3, vocab, (p_len,), generator=gen).tolist()
        prompt = Prompt(uid=f"p{g}", text="", raw="")
        for _ in range(n):
            r_len = int(torch.randint(1, 6, (1,), generator=gen))
            ids = torch.randint(3, vocab, (r_len,), generator=gen).tolist()
            completion = Completion(ids, [-1.0] * r_len, "", "stop", 0)
            rows.append(Rollout(prompt, prompt_ids, completion, 0.0, {}, group=f"g{g}"))
    order = torch.randperm(len(rows), generator=gen).tolist()
    return collate([rows[i] for i in order], pad_id=0, policy_version=0)
