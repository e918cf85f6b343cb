"""Rollout replay (``replay``): reuse recent scored groups in later steps' batches."""

from __future__ import annotations

from pydantic import Field

from engine.config.section import Section


class ReplayConfig(Section):
    """Rollout replay (RR; Sun et al. 2025, "Improving Data Efficiency for LLM RL Fine-tuning Through
    Difficulty-targeted Online Data Selection and Rollout Replay", arXiv:2506.05316): a FIFO buffer of
    recent scored groups (engine/data/replay.py) supplies part of each step's batch, corrected by the
    decoupled off-policy objective (engine/algorithms/off_policy.py)."""

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

    @property
    def enabled(self) -> bool:
        return self.ratio > 0
