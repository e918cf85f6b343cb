"""Rollout replay (``replay``): reuse recent scored groups in later steps' batches."""

from __future__ import annotations

from pydantic import Field

from engine.config.section import Section


class ReplayConfig(Section):
    """Rollout replay (RR; Sun et al. 2025, "Improving Data Efficiency for LLM RL Fine-tuning Through
    Difficulty-targeted Online Data Selection and Rollout Replay", arXiv:2506.05316): a FIFO buffer of
    recent scored groups (engine/data/replay.py) supplies part of each step's batch, corrected by the
    decoupled off-policy objective (engine/algorithms/off_policy.py).

    Success replay (``successes``): a stored successful completion of a prompt joins its group when
    the group has none (self-imitation: Oh et al. 2018, "Self-Imitation Learning", ICML; SPEAR,
    arXiv:2509.22601; ARPO), with the same correction (engine/data/success_replay.py)."""

    ratio: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        title="Replay ratio",
        description="Fraction of each step's training groups taken from the replay buffer (0 = off). The step "
        "generates only the rest; while the buffer holds fewer groups young enough (the first steps, "
        "after max_age evictions) the batch is that much smaller (replay/missing_groups counts them).",
    )
    max_age: int = Field(
        4,
        ge=1,
        le=1000,
        title="Max age (versions)",
        description="A stored group older than this many policy versions is evicted and never replayed.",
    )
    capacity: int = Field(
        256,
        ge=1,
        le=100_000,
        title="Capacity (groups)",
        description="Groups the buffer keeps; the oldest leaves first (FIFO).",
    )
    previous_stages: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        title="Replay of earlier stages",
        description="With data.stages: the share of each step's prompts drawn from the earlier stages' training "
        "prompts (round(share x prompts per step), spread evenly over the earlier stages; the step's further "
        "dynamic-sampling rounds draw from the current stage only), a guard against forgetting them (general replay: RECAP arXiv:2510.21978, GeRe arXiv:2508.04676). 0 = off; the first "
        "stage has nothing to replay.",
    )

    successes: bool = Field(
        False,
        title="Success replay",
        description="Keep each prompt's latest successful completions; when every completion of a prompt's "
        "group fails, one of them joins the group (marked replayed, corrected by the same off-policy "
        "objective as replayed groups), so a hard prompt's group has a success to learn from "
        "(self-imitation: SPEAR, arXiv:2509.22601). Success = the accuracy component (task, math, "
        "exact_match), or the reward without one, at least success_threshold.",
    )
    successes_per_step: int = Field(
        2,
        ge=1,
        le=4096,
        title="Successes replayed per step",
        description="At most this many stored successes join all-failed groups in one step.",
    )
    success_threshold: float = Field(
        1.0,
        allow_inf_nan=False,
        title="Success threshold",
        description="A completion is a success when its accuracy component (or, without one, its reward) is "
        "at least this (1 = right answers of the built-in verifiers).",
    )
    successes_per_prompt: int = Field(
        1, ge=1, le=16, title="Successes kept per prompt", description="The newest ones are kept."
    )
    success_prompts: int = Field(
        4096,
        ge=1,
        le=1_000_000,
        title="Prompts with stored successes",
        description="Prompts whose successes are kept; the one stored longest ago leaves first.",
    )
    success_max_age: int = Field(
        8,
        ge=1,
        le=1000,
        title="Success max age (versions)",
        description="A stored success more than this many policy versions older than the weights "
        "generating the group is dropped, never replayed.",
    )

    @property
    def enabled(self) -> bool:
        return self.ratio > 0
