"""How the policy is optimised and its progress kept: ``optimizer``, ``trainer``, ``checkpoint``, ``logging``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from engine.config.section import Section


class OptimizerConfig(Section):
    lr: float = Field(5e-5, gt=0.0, le=1.0, title="Learning rate")
    betas: tuple[float, float] = Field((0.9, 0.99), title="Adam betas")
    eps: float = Field(1e-8, gt=0.0, title="Adam epsilon")
    weight_decay: float = Field(0.0, ge=0.0, title="Weight decay")
    grad_clip: float = Field(
        1.0, ge=0.0, title="Gradient clip", description="Max global grad norm (0 = off)."
    )
    warmup_steps: int = Field(
        0, ge=0, title="Warm-up steps", description="Linear warm-up in optimiser steps."
    )
    schedule: Literal["constant", "cosine"] = Field("constant", title="LR schedule")
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, title="Min LR ratio", description="Cosine floor as lr fraction."
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"both betas must be in [0, 1), got {list(v)}")
        return v


class TrainerConfig(Section):
    backend: Literal["torch", "deepspeed"] = Field(
        "torch",
        title="Trainer backend",
        description="'torch': one device. 'deepspeed': DeepSpeed ZeRO, data parallel over trainer.num_ranks "
        "processes (GPUs, or CPU processes with gloo).",
    )
    zero_stage: int = Field(
        2,
        ge=0,
        le=3,
        title="ZeRO stage",
        description="DeepSpeed only. 1 shards optimizer state, 2 also gradients, 3 also parameters (0 = plain DDP).",
    )
    offload_optimizer: Literal["none", "cpu"] = Field(
        "none",
        title="Offload optimizer",
        description="DeepSpeed only (ZeRO 1-3): keep optimizer state and the step on the CPU (ZeRO-Offload).",
    )
    offload_param: Literal["none", "cpu"] = Field(
        "none",
        title="Offload parameters",
        description="DeepSpeed ZeRO-3 only: keep parameter partitions in CPU memory between uses (ZeRO-Infinity).",
    )
    num_ranks: int = Field(
        1,
        ge=1,
        le=64,
        title="Ranks",
        description="DeepSpeed only: data-parallel training processes on this machine (one per GPU).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", title="Device", description="'auto' picks CUDA if present."
    )
    total_steps: int = Field(200, ge=1, title="Steps", description="RL steps (one rollout batch each).")
    prompts_per_step: int = Field(
        32, ge=1, title="Prompts per step", description="Prompts in a rollout batch."
    )
    ppo_mini_batch_size: int | None = Field(
        None,
        ge=1,
        title="Mini-batch (prompts)",
        description="Prompts per optimiser step; None = the whole batch (one update per epoch).",
    )
    ppo_epochs: int = Field(1, ge=1, le=64, title="PPO epochs", description="Passes over each rollout batch.")
    mixed_precision: Literal["no", "bf16"] = Field(
        "no",
        title="Mixed precision",
        description="'bf16': the update's forward and backward run their matmuls in bfloat16 (torch.autocast), while "
        "the weights, gradients, optimizer state, log-probs and loss stay float32 (HF Trainer's bf16=True). Faster "
        "where the device multiplies bf16 natively (CUDA GPUs with bf16, CPUs with AVX512-BF16 or AMX: about half "
        "the update's time on the starter), slower where it is emulated. Needs model.dtype float32.",
    )
    micro_batch_size: int = Field(
        128,
        ge=1,
        title="Micro-batch (sequences)",
        description="Sequences per forward/backward (grad accumulation).",
    )
    seed: int = Field(0, ge=0, title="Seed")
    deterministic: bool = Field(
        False, title="Deterministic", description="Use deterministic torch algorithms (slower; exact resume)."
    )
    logprob_impl: Literal["auto", "fused", "naive", "triton"] = Field(
        "auto",
        title="Logprob kernel",
        description="'fused' (torch, chunked) and 'triton' (GPU kernels) never hold the full [tokens x vocab] "
        "logits; 'auto' uses 'triton' on CUDA when triton is installed, else 'fused'; 'naive' is the reference.",
    )
    logprob_chunk_size: int | None = Field(
        None,
        ge=1,
        title="Kernel chunk (tokens)",
        description="Tokens per chunk of the 'fused' and 'triton' kernels; empty = sized from the vocabulary "
        "(about 64 MiB of logits per chunk, at least 512 tokens: kernels/logprob.py auto_chunk_size), so the "
        "peak does not grow with the vocabulary.",
    )
    shared_prompt: bool = Field(
        True,
        title="Shared-prompt forward",
        description="Run each group's prompt once and its n responses on top (P + nR tokens, not n(P + R)).",
    )
    skip_zero_advantage: bool = Field(
        True,
        title="Skip zero-advantage rows",
        description="Leave rows whose advantages are all zero (groups whose completions all scored the same) "
        "out of the update: they add nothing to the loss or its gradient. Off, or with an entropy bonus or "
        "a KL loss, every row is run; on, the entropy and clip-fraction metrics cover the rows trained on.",
    )
    eval_every: int = Field(
        10, ge=0, title="Eval every (steps)", description="0 = only at the start and end."
    )
    eval_pass_k: int = Field(
        4, ge=0, le=64, title="pass@k", description="Samples per eval prompt for pass@k (0 = greedy only)."
    )

    @model_validator(mode="after")
    def _mini_batch_divides(self) -> TrainerConfig:
        mb = self.ppo_mini_batch_size
        if mb is not None and (mb > self.prompts_per_step or self.prompts_per_step % mb):
            raise ValueError(
                f"trainer.ppo_mini_batch_size: {mb} must divide trainer.prompts_per_step ({self.prompts_per_step})"
            )
        if self.backend == "torch":
            for name, value, default in (
                ("num_ranks", self.num_ranks, 1),
                ("offload_optimizer", self.offload_optimizer, "none"),
                ("offload_param", self.offload_param, "none"),
            ):
                if value != default:
                    raise ValueError(
                        f"trainer.{name}: {value!r} needs trainer.backend 'deepspeed'; "
                        f"set backend: deepspeed or {name}: {default!r}"
                    )
        if self.offload_param != "none" and self.zero_stage != 3:
            raise ValueError(
                f"trainer.offload_param: '{self.offload_param}' needs trainer.zero_stage 3 (only ZeRO-3 "
                f"partitions parameters; it is {self.zero_stage}); set zero_stage: 3 or offload_param: none"
            )
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ValueError(
                "trainer.offload_optimizer: ZeRO-Offload needs trainer.zero_stage 1, 2 or 3; "
                "set zero_stage: 2 or offload_optimizer: none"
            )
        return self


class CheckpointConfig(Section):
    every_steps: int = Field(50, ge=0, title="Checkpoint every (steps)", description="0 = only at the end.")
    keep_last: int = Field(2, ge=1, title="Keep last", description="Older checkpoints are deleted.")
    save_final: bool = Field(True, title="Save at the end")


MAX_TOKENS_PER_STEP = 32768
"""Most tokens a step's samples event carries for the token view (logging.token_samples_per_step x
logging.tokens_per_sample)."""


class LoggingConfig(Section):
    samples_per_step: int = Field(
        16, ge=0, le=4096, title="Samples per step", description="Rollouts sent as events each step."
    )
    token_samples_per_step: int = Field(
        8,
        ge=0,
        le=64,
        title="Samples with tokens per step",
        description="How many of the samples sent each step carry their tokens with the log-probability "
        "and entropy each was sampled with (the rollout browser's token view); 0 = none.",
    )
    tokens_per_sample: int = Field(
        512,
        ge=1,
        le=4096,
        title="Tokens per sample",
        description="The first this many tokens of such a sample are sent; the rest is marked as cut.",
    )
    token_entropy_top_k: int = Field(
        0,
        ge=0,
        le=20,
        title="Entropy from top-k (vLLM)",
        description="rollout.backend vllm only (torch always sends the exact entropy): estimate each "
        "token's entropy from the k most likely tokens' log-probs (a lower bound); 0 = no entropies. "
        "Costs vLLM k log-probs per generated token; at most 20 (vLLM's max_logprobs).",
    )
    heartbeat_s: float = Field(10.0, gt=0, title="Heartbeat (s)")
    system_metrics_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        title="System metrics every (s)",
        description="CPU, memory and GPUs of the run's processes, by phase (system/*); 0 = off.",
    )
    progress: Literal["auto", "on", "off"] = Field(
        "auto", title="Progress bar", description="'auto' shows it when stderr is a terminal."
    )

    @model_validator(mode="after")
    def _bounded_tokens(self) -> LoggingConfig:
        # ~20 bytes of JSON a token (text, logprob, entropy): 32,768 tokens keep a step's samples event
        # well inside the 4 MiB an ingest message may hold (engine/pipeline/metrics.py caps the bytes too).
        tokens = self.token_samples_per_step * self.tokens_per_sample
        if tokens > MAX_TOKENS_PER_STEP:
            raise ValueError(
                f"logging.token_samples_per_step x logging.tokens_per_sample is {tokens} tokens a step; "
                f"the limit is {MAX_TOKENS_PER_STEP}: lower either"
            )
        return self
