"""Control and Train: log-probs, KL, advantages and the policy update for a produced batch."""

from __future__ import annotations

import time

import torch

from engine.algorithms import AlgoConfig, apply_kl_penalty, get_adv_estimator_fn, get_kl_controller
from engine.algorithms.off_policy import importance_weights
from engine.batch import RolloutBatch
from engine.config import RunConfig
from engine.system_metrics import PHASE
from engine.trainer import TrainerBackend
from engine.trainer.actor import logprob_mismatch


def _masked_stats(prefix: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    sel = values[mask.bool()]
    if sel.numel() == 0:
        return {}
    return {f"{prefix}/mean": float(sel.mean()), f"{prefix}/max": float(sel.max()), f"{prefix}/min": float(sel.min())}


def needs_reference(cfg: RunConfig) -> bool:
    """A frozen reference policy is kept only for a KL term (in the loss or in the reward)."""
    return cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward


class Learner:
    """Runs verl's ``fit`` step order on a batch: old log-probs, reference log-probs, KL
    penalty in the reward (optional), advantages, then the policy update."""

    def __init__(self, cfg: RunConfig, trainer: TrainerBackend) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.kl_ctrl = get_kl_controller(cfg.algorithm.kl_ctrl) if cfg.algorithm.use_kl_in_reward else None
        self.algo_config = AlgoConfig(
            gamma=cfg.algorithm.gamma, norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo
        )

    @property
    def recomputes_old_log_probs(self) -> bool:
        """Whether the old policy's log-probs need their own forward pass.

        With one epoch and one mini-batch, strictly on-policy, the policy being updated *is*
        the old policy, so the actor uses its own detached log-probs (ratio exactly 1; verl
        and TRL skip the pass too). KL in the reward needs them before the update, so it
        keeps the pass, and so does rollout replay (and success replay): its replayed rows need the
        proximal policy.
        """
        t = self.cfg.trainer
        single_update = t.ppo_epochs == 1 and (t.ppo_mini_batch_size or t.prompts_per_step) == t.prompts_per_step
        r = self.cfg.replay
        on_policy = self.cfg.async_.max_staleness == 0 and not (r.enabled or r.successes)
        return not (single_update and on_policy and not self.cfg.algorithm.use_kl_in_reward)


    @property
    def corrects_off_policy(self) -> bool:
        """The decoupled objective (engine/algorithms/off_policy.py) for asynchronous runs: behaviour =
        the rollout's log-probs, proximal = the trainer's recomputation. A synchronous run (k = 0) trains
        exactly as before, except for the rows rollout replay adds (``_replay_weights``)."""
        a = self.cfg.async_
        return a.max_staleness > 0 and (a.importance_cap > 0 or a.mask_sequences_above > 0)

    def _replay_weights(self, batch: RolloutBatch, replayed: torch.Tensor) -> dict[str, float]:
        """The decoupled correction for the rows rollout replay took from its buffer (RR,
        arXiv:2506.05316): behaviour = their stored sampling log-probs, proximal = the trainer's
        recomputation, truncated and masked as ``async`` says. An asynchronous run has already
        weighted the whole batch this way; a synchronous one weights the replayed rows here and
        leaves its fresh, on-policy rows at exactly 1. Their statistics are ``replay/*``."""
        a = self.cfg.async_
        assert batch.old_log_probs is not None
        idx = replayed.nonzero().squeeze(-1)
        weights, stats = importance_weights(
            batch.old_log_probs[idx],
            batch.rollout_log_probs[idx],
            batch.response_mask[idx],
            cap=a.importance_cap,
            mask_threshold=a.mask_sequences_above,
        )
        if not self.corrects_off_policy and (a.importance_cap > 0 or a.mask_sequences_above > 0):
            batch.is_weights = batch.response_mask.clone()
            batch.is_weights[idx] = weights
        return {f"replay/{name.removeprefix('offpolicy/')}": value for name, value in stats.items()}

    def log_probs(self, batch: RolloutBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The (old, reference) log-probs ``prepare`` would compute for ``batch`` (None where it needs none)."""
        old = self.trainer.compute_log_probs(batch) if self.recomputes_old_log_probs else None
        ref = self.trainer.compute_log_probs(batch, reference=True) if needs_reference(self.cfg) else None
        return old, ref

    def prepare(self, batch: RolloutBatch) -> dict[str, float]:
        """Fill ``old_log_probs``, ``ref_log_probs``, ``token_level_rewards`` and ``advantages``."""
        with PHASE("train"):  # the trainer's forward passes: its memory, for the system metrics
            return self._prepare(batch)

    def _prepare(self, batch: RolloutBatch) -> dict[str, float]:
        a = self.cfg.algorithm
        metrics: dict[str, float] = {}
        mask = batch.response_mask
        if self.recomputes_old_log_probs:
            if batch.old_log_probs is None:  # the periodic mode computes them while the batch generates
                t0 = time.perf_counter()
                batch.old_log_probs = self.trainer.compute_log_probs(batch)
                metrics["timing_s/old_logprob"] = time.perf_counter() - t0
            replayed = batch.extra.get("replayed")  # rollout replay's rows: their gap is the policy's change
            fresh = mask if replayed is None else mask * (~replayed).unsqueeze(-1)
            metrics.update(logprob_mismatch(batch.old_log_probs, batch.rollout_log_probs, fresh))
            if self.corrects_off_policy:
                batch.is_weights, is_metrics = importance_weights(
                    batch.old_log_probs,
                    batch.rollout_log_probs,
                    mask,
                    cap=self.cfg.async_.importance_cap,
                    mask_threshold=self.cfg.async_.mask_sequences_above,
                )
                metrics.update(is_metrics)
                if self.cfg.async_.scale_lr_by_ess and "offpolicy/ess" in is_metrics:
                    batch.extra["lr_scale"] = is_metrics["offpolicy/ess"]
            if replayed is not None and bool(replayed.any()):
                metrics.update(self._replay_weights(batch, replayed))
        if needs_reference(self.cfg) and batch.ref_log_probs is None:
            t0 = time.perf_counter()
            batch.ref_log_probs = self.trainer.compute_log_probs(batch, reference=True)
            metrics["timing_s/ref"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.kl_ctrl is not None:
            assert batch.ref_log_probs is not None
            batch.token_level_rewards, kl_metrics = apply_kl_penalty(
                batch.token_level_scores,
                batch.old_log_probs,
                batch.ref_log_probs,
                mask,
                kl_ctrl=self.kl_ctrl,
                kl_penalty=a.kl_penalty,
            )
            metrics.update(kl_metrics)
        else:
            batch.token_level_rewards = batch.token_level_scores
        estimator = get_adv_estimator_fn(a.adv_estimator)
        kwargs = {"token_level_rewards": batch.token_level_rewards, "response_mask": mask, "index": batch.index, "config": self.algo_config}
        if a.adv_estimator.startswith("grpo"):
            kwargs["norm_adv_by_std_in_grpo"] = a.norm_adv_by_std_in_grpo
        batch.advantages, batch.returns = estimator(**kwargs)
        metrics["timing_s/adv"] = time.perf_counter() - t0
        metrics.update(_masked_stats("critic/advantages", batch.advantages, mask))
        metrics.update(_masked_stats("critic/rewards", batch.token_level_rewards.sum(-1), torch.ones(len(batch))))
        return metrics

    def train(self, batch: RolloutBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        with PHASE("train"):
            metrics = self.trainer.update_policy(batch)
        metrics["timing_s/update"] = time.perf_counter() - t0
        return metrics
