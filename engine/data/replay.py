"""The rollout replay buffer (RR): recent scored groups kept for reuse in later steps.

Rollout replay (Sun et al. 2025, arXiv:2506.05316, section 4) keeps the groups that were trained on
in a FIFO buffer and fills a fraction of each later batch from it, so every generated token is
trained on more than once. Samples replayed this way come from an older policy: each carries its
behaviour log-probs (``Completion.logprobs``, the rollout's sampling-time ``rollout_log_probs``) and
the policy version that generated it, and the learner corrects for the gap with the decoupled
objective (behaviour = the stored log-probs, proximal = the trainer's recomputation;
engine/algorithms/off_policy.py).

A group is stored whole (prompt, completions, rewards and reward components), and its advantages
are recomputed when it is used rather than stored. RR reuses a group with its advantages, and
for the outcome-reward estimators here (GRPO, RLOO, ... over one group) the advantage is a function
of the group's own rewards only, so recomputing it from the stored rewards gives exactly the
stored value; recomputing also keeps one code path for fresh and replayed rows (a KL penalty in
the reward is then taken against the current reference pass, as for fresh rows).

Eviction: a group older than ``max_age`` policy versions (``replay.max_age``) is dropped when the
buffer is sampled, and beyond ``capacity`` groups the oldest goes first. Sampling is uniform without
replacement among the groups still young enough, with a generator seeded by the step, so a resumed
run replays exactly what an uninterrupted run would (the buffer is saved with each checkpoint).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.batch import Rollout
from engine.data.prompts import Prompt
from engine.pipeline.partial import pack_array, prompt_checksum, saved_prompt, unpack_array
from engine.rollout import Completion

BUFFER_FORMAT = 1


@dataclass(frozen=True)
class StoredGroup:
    """One trained group: its rollouts (rewards included) and the oldest policy version among them."""

    rows: tuple[Rollout, ...]
    version: int


def pack_rollout(row: Rollout) -> dict[str, Any]:
    """A scored rollout as checkpoint JSON (its prompt stored by the caller): token ids and
    log-probs packed exactly (int64, float64), reward, components and group."""
    c = row.completion
    return {
        "token_ids": pack_array(c.token_ids, "<i8"),
        "logprobs": pack_array(c.logprobs, "<f8"),
        "text": c.text,
        "finish_reason": c.finish_reason,
        "policy_version": c.policy_version,
        "segments": [[v, n] for v, n in c.segments],
        "reward": row.reward,
        "components": row.components,
        "group": row.group,
    }


def unpack_rollout(saved: dict[str, Any], prompt: Prompt, what: str) -> Rollout:
    """:func:`pack_rollout`'s row back, of ``prompt`` (checked by the caller, ``saved_prompt``);
    ``what`` names the store in the error for a corrupt row."""
    completion = Completion(
        token_ids=unpack_array(saved["token_ids"], "<i8"),
        logprobs=unpack_array(saved["logprobs"], "<f8"),
        text=saved["text"],
        finish_reason=saved["finish_reason"],
        policy_version=int(saved["policy_version"]),
        segments=[(int(v), int(n)) for v, n in saved["segments"]],
    )
    if len(completion.token_ids) != len(completion.logprobs):
        raise ValueError(f"{what} for prompt {prompt.uid!r} is corrupt in the checkpoint")
    return Rollout(
        prompt=prompt,
        prompt_ids=list(prompt.token_ids),  # what it was generated from (saved_prompt checked it)
        completion=completion,
        reward=float(saved["reward"]),
        components={k: float(v) for k, v in saved["components"].items()},
        group=saved["group"],
    )


class ReplayBuffer:
    def __init__(self, capacity: int, max_age: int) -> None:
        self.capacity = capacity
        self.max_age = max_age
        self.groups: deque[StoredGroup] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, rows: Sequence[Rollout]) -> int:
        """Store the groups of ``rows`` (rows with one ``group`` id form a group, kept in order);
        the oldest leave once the buffer is full. Returns the number of groups added."""
        by_group: dict[str, list[Rollout]] = {}
        for row in rows:
            by_group.setdefault(row.group, []).append(row)
        for group in by_group.values():
            self.groups.append(StoredGroup(tuple(group), min(r.completion.policy_version for r in group)))
        return len(by_group)

    def evict(self, version: int) -> int:
        """Drop every group more than ``max_age`` versions behind ``version``; the number dropped."""
        before = len(self.groups)
        self.groups = deque(
            (g for g in self.groups if version - g.version <= self.max_age), maxlen=self.capacity
        )
        return before - len(self.groups)

    def sample(self, count: int, version: int, seed: int) -> list[StoredGroup]:
        """Up to ``count`` distinct groups at most ``max_age`` versions behind ``version``, drawn
        uniformly with a generator seeded by ``seed``; fewer when fewer are stored. Each returned
        group's rows are copies (the step writes its advantages on them)."""
        self.evict(version)
        count = min(count, len(self.groups))
        if count <= 0:
            return []
        picked = np.random.default_rng(seed).choice(len(self.groups), size=count, replace=False)
        chosen = [self.groups[int(i)] for i in sorted(picked)]
        return [
            StoredGroup(tuple(dataclasses.replace(r, advantage=None) for r in g.rows), g.version)
            for g in chosen
        ]

    # -- checkpoint --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The buffer as JSON. A prompt is stored by its uid and a checksum of its token ids (as the
        partial rollouts in flight are, engine/pipeline/partial.py); log-probs exactly, as float64."""
        return {
            "format": BUFFER_FORMAT,
            "groups": [
                {
                    "version": g.version,
                    "rows": [
                        {
                            "prompt_uid": r.prompt.uid,
                            "prompt_check": prompt_checksum(r.prompt),
                            **pack_rollout(r),
                        }
                        for r in g.rows
                    ],
                }
                for g in self.groups
            ],
        }

    def load_state_dict(self, state: dict[str, Any], prompts: Iterable[Prompt]) -> None:
        """Restore :meth:`state_dict`'s groups, their prompts looked up by uid among ``prompts``."""
        if not state:
            self.groups.clear()
            return
        if state.get("format") != BUFFER_FORMAT:
            raise ValueError(f"replay buffer: unknown checkpoint format {state.get('format')!r}")
        by_uid = {p.uid: p for p in prompts}
        groups = []
        for saved in state["groups"]:
            rows = []
            for r in saved["rows"]:
                prompt = saved_prompt(by_uid, r, "a replay buffer group")
                rows.append(unpack_rollout(r, prompt, "a replay buffer group"))
            groups.append(StoredGroup(tuple(rows), int(saved["version"])))
        self.groups = deque(groups[-self.capacity :], maxlen=self.capacity)
