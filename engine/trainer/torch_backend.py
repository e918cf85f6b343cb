"""The plain torch trainer backend: one device, AdamW, exact gradient accumulation."""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from engine.algorithms import PolicyLossConfig
from engine.batch import RolloutBatch
from engine.config import RunConfig
from engine.trainer.actor import (
    actor_loss,
    add_micro_batch_metrics,
    logprob_settings,
    mini_batches,
    response_logprobs,
    skips_zero_advantage_rows,
)
from engine.trainer.schedule import minis_per_epoch, optimizer_and_schedule


def policy_loss_config(cfg: RunConfig) -> PolicyLossConfig:
    a = cfg.algorithm
    return PolicyLossConfig(
        clip_ratio=a.clip_ratio,
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode,
        # A constant divisor (not the padded length of each batch) keeps Dr. GRPO's scale fixed.
        loss_scale_factor=a.loss_scale_factor or cfg.rollout.max_new_tokens,
    )


def scale_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Multiply every parameter group's learning rate by ``factor`` for the coming step only: the LR
    scheduler computes the next rate from its base rate, so the scale never compounds."""
    if factor != 1.0:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor


class TorchTrainer:
    """Holds the policy (and optional frozen reference) on one device and trains it.

    ``update_policy`` runs ``ppo_epochs`` passes; each pass shuffles the rows (with a
    generator seeded by seed and policy version, so resumes replay the same order) into
    mini-batches, one optimiser step each, accumulated over micro-batches whose losses are
    weighted so the gradient equals the whole mini-batch's (``micro_batch_weight``).
    """

    def __init__(
        self, model: nn.Module, cfg: RunConfig, *, device: torch.device, need_reference: bool
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.model = model
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.reference: nn.Module | None = None
        if need_reference:
            self.reference = copy.deepcopy(model).eval()
            self.reference.requires_grad_(False)
        self.optimizer, factor = optimizer_and_schedule(model, cfg, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        self.minis_per_epoch = minis_per_epoch(cfg)
        self.settings = logprob_settings(cfg)
        self.pl_config = policy_loss_config(cfg)
        self._version = 0
        self.skipped_updates = 0

    @property
    def policy_version(self) -> int:
        return self._version

    def _micro_batches(self, batch: RolloutBatch) -> list[RolloutBatch]:
        size = self.cfg.trainer.micro_batch_size
        if size >= len(batch):  # one micro-batch: the batch itself, no copy of its tensors
            return [batch]
        return [batch.select(list(range(i, min(i + size, len(batch))))) for i in range(0, len(batch), size)]

    @torch.no_grad()
    def compute_log_probs(self, batch: RolloutBatch, *, reference: bool = False) -> torch.Tensor:
        model = self.reference if reference else self.model
        assert model is not None, "no reference model: set algorithm.use_kl_loss or use_kl_in_reward"
        was_training = model.training
        model.eval()
        try:
            parts = [
                response_logprobs(model, mb.to(self.device), self.settings, compute_entropy=False)[0]
                for mb in self._micro_batches(batch)
            ]
        finally:
            model.train(was_training)
        r = batch.response_ids.shape[1]
        return torch.cat([torch.nn.functional.pad(p, (0, r - p.shape[1])) for p in parts]).cpu()

    def update_policy(self, batch: RolloutBatch) -> dict[str, float]:
        t = self.cfg.trainer
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        maxima: dict[str, float] = {}
        gen = torch.Generator().manual_seed(t.seed * 1_000_003 + self._version)
        lr_scale = float(batch.extra.get("lr_scale", 1.0))  # async.scale_lr_by_ess (the learner sets it)
        skip = skips_zero_advantage_rows(self.cfg.algorithm, t.skip_zero_advantage)
        skipped = 0
        for _ in range(t.ppo_epochs):
            order = torch.randperm(len(batch), generator=gen)
            for mini, pl_config, left_out in mini_batches(
                batch, order.numpy(), self.minis_per_epoch, self.pl_config, skip_zero_advantage=skip
            ):
                skipped += left_out
                self.optimizer.zero_grad(set_to_none=True)
                for micro in self._micro_batches(mini):
                    micro = micro.to(self.device)
                    loss, metrics = actor_loss(
                        self.model, micro, self.cfg.algorithm, self.settings, pl_config
                    )
                    loss.backward()
                    add_micro_batch_metrics(sums, maxima, metrics, micro.response_mask, pl_config)
                grad_norm = self._clip_and_step(lr_scale)
                sums["actor/grad_norm"] += grad_norm
                sums["_updates"] += 1
        self._version += 1  # one policy version per training step, however many optimiser steps
        n = max(1.0, sums.pop("_updates"))
        out = {k: v / n for k, v in sums.items()} | maxima
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        out["actor/lr_scale"] = lr_scale
        out["actor/skipped_updates"] = float(self.skipped_updates)
        out["actor/zero_adv_rows_skipped"] = skipped / (t.ppo_epochs * len(batch))
        self.model.eval()
        return out

    def _clip_and_step(self, lr_scale: float = 1.0) -> float:
        """Clip, then one optimiser step at the scheduled learning rate times ``lr_scale`` (the
        scheduler sets the next step's rate from its schedule again)."""
        clip = self.cfg.optimizer.grad_clip
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=clip if clip > 0 else math.inf)
        norm_f = float(norm)
        if not math.isfinite(norm_f):
            # A non-finite gradient would poison the weights and Adam's moments: skip the step.
            self.skipped_updates += 1
            self.optimizer.zero_grad(set_to_none=True)
        else:
            scale_lr(self.optimizer, lr_scale)
            self.optimizer.step()
        self.scheduler.step()
        return norm_f

    def rollout_weights(self) -> Mapping[str, torch.Tensor]:
        return self.model.state_dict()

    # -- checkpoints ---------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        self.model.save_pretrained(directory, safe_serialization=True)
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
            directory / "optimizer.pt",
        )

    def load(self, directory: Path) -> None:
        weights = load_file(str(directory / "model.safetensors"), device=str(self.device))
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        loaded_ptrs = {p.data_ptr() for n, p in self.model.state_dict().items() if n in weights}
        untied_missing = [k for k in missing if self.model.state_dict()[k].data_ptr() not in loaded_ptrs]
        if untied_missing or unexpected:
            raise ValueError(
                f"checkpoint {directory} does not match the model: missing {untied_missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        state = torch.load(directory / "optimizer.pt", map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def state(self) -> dict[str, Any]:
        return {"policy_version": self._version, "skipped_updates": self.skipped_updates}

    def load_state(self, state: dict[str, Any]) -> None:
        self._version = int(state["policy_version"])
        self.skipped_updates = int(state.get("skipped_updates", 0))

    def close(self) -> None:
        """Nothing to release: one process holds everything."""
