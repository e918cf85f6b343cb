"""The DeepSpeed ZeRO trainer backend: data parallel over N ranks, ZeRO stage 0-3, offload.

ZeRO (Rajbhandari et al. 2020, https://arxiv.org/abs/1910.02054) shards optimizer state
(stage 1), gradients (2) and parameters (3) across data-parallel ranks; ZeRO-Offload
(Ren et al. 2021) keeps optimizer state and the step on the CPU. DeepSpeed docs:
https://deepspeed.readthedocs.io/en/latest/zero3.html

How the ranks share a run: rank 0 is the *leader*. It runs the whole engine (rollouts,
rewards, events, checkpoint metadata) and calls this trainer like any other backend. Every
method that needs the ranks (log-probs, the update, gathering ZeRO-3 weights, checkpoints)
first broadcasts a command with its inputs over a gloo control group; the other ranks
(*followers*) sit in ``serve()`` and run the same method on the same inputs, so every
collective is entered by every rank in the same order. Work is data parallel: each
mini-batch's rows are split into one contiguous shard per rank, each rank runs its shard's
micro-batches and DeepSpeed averages the gradients across ranks.

Gradients equal the torch backend's exact accumulation: every micro-batch loss is
aggregated against the *whole* mini-batch's token and sequence counts (``global_batch_info``,
as in ``TorchTrainer``), so the micro-batch losses of all ranks add up to the mini-batch
loss; DeepSpeed divides the all-reduced gradient by the world size, so each rank's loss is
multiplied by it, and ``backward(scale_wrt_gas=False)`` keeps DeepSpeed from dividing by the
number of micro-batches. ZeRO-2/3 reduce gradients during every backward, so every rank
runs the same number of micro-batches: a rank whose shard is shorter runs a zero-weighted
micro-batch instead.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import shutil
import signal
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.batch import RolloutBatch
from engine.config import RunConfig
from engine.trainer.actor import (
    actor_loss,
    add_micro_batch_metrics,
    logprob_settings,
    mini_batches,
    response_logprobs,
    skips_zero_advantage_rows,
    split_model,
)
from engine.trainer.schedule import minis_per_epoch, optimizer_and_schedule
from engine.trainer.torch_backend import policy_loss_config, scale_lr

DEEPSPEED_DIR = "deepspeed"
"""Subdirectory of an engine checkpoint holding DeepSpeed's own checkpoint (tag ``TAG``)."""
TAG = "state"


def init_distributed(device_kind: str) -> None:
    """Join the job ``engine.ranks`` (or torchrun) started, reading RANK/WORLD_SIZE/MASTER_* from
    the environment; gloo on CPU (``DS_ACCELERATOR=cpu``, see MACHINE_NOTES), NCCL on GPUs, where
    each rank takes the visible GPU numbered by its ``LOCAL_RANK``.

    On CPU, collectives stay plain gloo: DeepSpeed would otherwise JIT-compile its shared-memory
    reduce op (``deepspeed_shm_comm``) in every rank's first run on a machine, 1.5-2.5 minutes of
    C++ build on 2 cores that needs a compiler on the worker, and its kernels pick AVX2 or AVX-512
    paths by the CPU, so a run's reductions would differ between machines. DeepSpeed keeps its op
    table in the module so that edits to it persist (``deepspeed.ops.__getattr__``); an op marked
    incompatible is not built, and ``TorchBackend`` falls back to ``torch.distributed``."""
    if device_kind == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, default in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
    ):
        os.environ.setdefault(key, default)
    if "MASTER_PORT" not in os.environ:
        from engine.ranks import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO lines go to stdout
    if device_kind == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if device_kind == "cuda":  # one GPU per rank: the launcher's LOCAL_RANK-th visible device
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(
            dist_backend="gloo" if device_kind == "cpu" else "nccl", auto_mpi_discovery=False, verbose=False
        )


@contextmanager
def distributed(device_kind: str) -> Iterator[None]:
    """:func:`init_distributed`, and leave the process group on the way out, whatever happened: left
    to the interpreter's exit, gloo's threads can abort a rank ("terminate called without an active
    exception", exit code 134) after all its work is done."""
    init_distributed(device_kind)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def deepspeed_config(cfg: RunConfig, hidden_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON config of a run (https://www.deepspeed.ai/docs/config-json/).

    Communication buckets are sized by the model as transformers' DeepSpeed integration does for
    its "auto" values (hidden^2 elements; ZeRO-3 prefetch 0.9 hidden^2, parameters under 10 hidden
    elements stay whole). DeepSpeed's defaults (5e8 elements, 2 GB in fp32) suit 7B models; on a
    small one they allocate buffers far larger than the model, which ``trainer.deterministic``
    (torch fills fresh memory with NaN) turned into 6x slower steps on CPU.
    """
    t = cfg.trainer
    bucket = hidden_size * hidden_size
    zero: dict[str, Any] = {
        "stage": t.zero_stage,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    if t.zero_stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": int(0.9 * bucket),
            "stage3_param_persistence_threshold": 10 * hidden_size,
        }
    if t.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": t.offload_optimizer, "pin_memory": torch.cuda.is_available()}
    if t.offload_param != "none":
        zero["offload_param"] = {"device": t.offload_param, "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": 1,  # accumulation boundaries are set explicitly per mini-batch
        "gradient_clipping": cfg.optimizer.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        # The optimizer is a plain torch AdamW (DeepSpeed's fused ones JIT-build a kernel; on
        # GPUs torch's fused AdamW is as fast): allow it under ZeRO and with offload.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class PolicyForward(nn.Module):
    """The policy as DeepSpeed sees it: ``forward`` runs the shared actor code (actor.py).

    The loss reads the LM head's weight outside the head's own ``forward`` (the fused
    log-prob kernel takes the weight), so under ZeRO-3 it is registered as an external
    parameter of this module: DeepSpeed gathers it for this module's forward and backward.
    """

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def register_head(self) -> None:
        import deepspeed

        _, head = split_model(self.policy)
        for p in head.parameters(recurse=False):
            deepspeed.zero.register_external_parameter(self, p)

    def forward(self, batch: RolloutBatch, mode: str, *args: Any) -> Any:
        if mode == "loss":
            return actor_loss(self.policy, batch, *args)
        return response_logprobs(self.policy, batch, *args, compute_entropy=False)[0]


class DeepSpeedTrainer:
    """``TrainerBackend`` over a DeepSpeed engine; one instance per rank (see the module docstring)."""

    def __init__(
        self, model: nn.Module, cfg: RunConfig, *, device: torch.device, need_reference: bool
    ) -> None:
        import deepspeed

        self.cfg = cfg
        self.device = device
        self.dist = torch.distributed
        self.rank = self.dist.get_rank()
        self.world = self.dist.get_world_size()
        self.control = self.dist.new_group(backend="gloo")  # commands and python objects, on any device
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.reference: nn.Module | None = None
        if need_reference:  # a full frozen copy on every rank, each computing its shard's rows
            self.reference = copy.deepcopy(model).to(device).eval()
            self.reference.requires_grad_(False)
        self.wrapper = PolicyForward(model)
        if cfg.trainer.zero_stage == 3:
            self.wrapper.register_head()
        optimizer, factor = optimizer_and_schedule(model, cfg)
        self.minis_per_epoch = minis_per_epoch(cfg)
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.wrapper,
            optimizer=optimizer,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
            config=deepspeed_config(cfg, model.config.hidden_size),
        )
        # ZeRO-3 gathers each submodule's parameters collectively, so every rank must call the
        # trunk the same number of times; the shared-prompt forward calls it twice or once
        # depending on whether the rank's micro-batch shares a prompt (ranks deadlock otherwise).
        self.settings = logprob_settings(cfg, shared_prompt=cfg.trainer.zero_stage != 3)
        self.pl_config = policy_loss_config(cfg)
        self._version = 0
        self.skipped_updates = 0
        self._closed = False

    @property
    def policy(self) -> nn.Module:
        return self.wrapper.policy

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # -- the leader/follower protocol ----------------------------------------------------

    def _command(self, name: str, *args: Any) -> Any:
        """On the leader: have every rank run ``_<name>(*args)``; returns the leader's result."""
        assert self.is_leader, f"{name} is called on rank 0 only; the other ranks serve()"
        if self.world > 1:
            self.dist.broadcast_object_list([(name, args)], src=0, group=self.control)
        return getattr(self, f"_{name}")(*args)

    def serve(self) -> None:
        """On a follower: run the leader's commands until it says stop.

        Signals are ignored here: rank 0 decides when to stop (it checkpoints first, which
        needs every rank) and the launcher forwards a cancel to it.
        """
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        while True:
            box: list[Any] = [None]
            self.dist.broadcast_object_list(box, src=0, group=self.control)
            name, args = box[0]
            if name == "stop":
                return
            getattr(self, f"_{name}")(*args)

    def close(self) -> None:
        """Release the followers (the leader calls this once, when the run ends however it ends)."""
        if self.is_leader and not self._closed and self.world > 1:
            self.dist.broadcast_object_list([("stop", ())], src=0, group=self.control)
        self._closed = True

    # -- data parallel pieces ------------------------------------------------------------

    def _my_pieces(self, rows: np.ndarray) -> list[np.ndarray]:
        """This rank's micro-batches of ``rows``: the same number on every rank (some may be empty)."""
        shards = np.array_split(rows, self.world)
        longest = max(len(s) for s in shards)
        count = max(1, math.ceil(longest / self.cfg.trainer.micro_batch_size))
        return np.array_split(shards[self.rank], count)

    def _gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.control)
        return out

    # -- the protocol ----------------------------------------------------------------------

    def compute_log_probs(self, batch: RolloutBatch, *, reference: bool = False) -> torch.Tensor:
        return self._command("compute_log_probs", batch, reference)

    @torch.no_grad()
    def _compute_log_probs(self, batch: RolloutBatch, reference: bool) -> torch.Tensor:
        if reference:
            assert self.reference is not None, (
                "no reference model: set algorithm.use_kl_loss or use_kl_in_reward"
            )
        self.engine.eval()
        parts: list[torch.Tensor] = []
        for piece in self._my_pieces(np.arange(len(batch))):
            # An empty piece still runs a forward: ZeRO-3 gathers parameters collectively.
            micro = batch.select(piece.tolist() if len(piece) else [0]).to(self.device)
            if reference:
                lp = response_logprobs(self.reference, micro, self.settings, compute_entropy=False)[0]
            else:
                lp = self.engine(micro, "logprobs", self.settings)
            if len(piece):
                parts.append(lp.cpu())
        r = batch.response_ids.shape[1]
        mine = [torch.nn.functional.pad(p, (0, r - p.shape[1])) for p in parts]
        gathered = self._gather(mine)
        return torch.cat([p for rank_parts in gathered for p in rank_parts])

    def update_policy(self, batch: RolloutBatch) -> dict[str, float]:
        t = self.cfg.trainer
        gen = torch.Generator().manual_seed(t.seed * 1_000_003 + self._version)  # as TorchTrainer
        orders = [torch.randperm(len(batch), generator=gen).numpy() for _ in range(t.ppo_epochs)]
        return self._command("update_policy", batch, orders)

    def _update_policy(self, batch: RolloutBatch, orders: list[np.ndarray]) -> dict[str, float]:
        self.engine.train()
        lr_scale = float(batch.extra.get("lr_scale", 1.0))  # async.scale_lr_by_ess
        sums: dict[str, float] = defaultdict(float)
        maxima: dict[str, float] = {}
        updates = 0
        grad_norms = 0.0
        skip = skips_zero_advantage_rows(self.cfg.algorithm, self.cfg.trainer.skip_zero_advantage)
        skipped = 0
        for order in orders:
            for mini, pl_config, left_out in mini_batches(
                batch, order, self.minis_per_epoch, self.pl_config, skip_zero_advantage=skip
            ):
                skipped += left_out
                pieces = self._my_pieces(np.arange(len(mini)))
                for i, piece in enumerate(pieces):
                    self.engine.set_gradient_accumulation_boundary(i == len(pieces) - 1)
                    micro = mini.select(piece.tolist() if len(piece) else [0]).to(self.device)
                    loss, metrics = self.engine(micro, "loss", self.cfg.algorithm, self.settings, pl_config)
                    weight = float(self.world) if len(piece) else 0.0
                    self.engine.backward(loss * weight, scale_wrt_gas=False)
                    if not len(piece):
                        continue
                    add_micro_batch_metrics(sums, maxima, metrics, micro.response_mask, pl_config)
                scale_lr(self.engine.optimizer, lr_scale)
                self.engine.step()
                norm = self.engine.get_global_grad_norm()
                norm_f = float(norm) if norm is not None else float("nan")
                if not math.isfinite(norm_f):
                    self.skipped_updates += 1
                grad_norms += norm_f
                updates += 1
        self._version += 1  # one policy version per training step, however many optimiser steps
        self.engine.eval()
        gathered = self._gather((dict(sums), maxima))
        total: dict[str, float] = defaultdict(float)
        top: dict[str, float] = {}
        for s, m in gathered:
            for k, v in s.items():
                total[k] += v
            for k, v in m.items():
                top[k] = max(top.get(k, v), v)
        n = max(1, updates)
        out = {k: v / n for k, v in total.items()} | top
        out["actor/grad_norm"] = grad_norms / n
        out["actor/lr"] = self.engine.lr_scheduler.get_last_lr()[0]
        out["actor/lr_scale"] = lr_scale
        out["actor/skipped_updates"] = float(self.skipped_updates)
        out["actor/zero_adv_rows_skipped"] = skipped / (len(orders) * len(batch))
        return out

    def rollout_weights(self) -> Mapping[str, torch.Tensor]:
        if self.cfg.trainer.zero_stage == 3:
            return self._command("full_weights")
        return self.policy.state_dict()  # stages 0-2 keep full parameters on every rank

    def _gathered(self):
        """Under ZeRO-3, a context in which every parameter is whole on every rank."""
        if self.cfg.trainer.zero_stage != 3:
            return nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.policy.parameters()), modifier_rank=None)

    def _full_weights(self) -> dict[str, torch.Tensor]:
        with self._gathered():
            if not self.is_leader:
                return {}
            return {k: v.detach().clone() for k, v in self.policy.state_dict().items()}

    # -- checkpoints ---------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        """DeepSpeed's checkpoint (every rank's partitions) in ``<dir>/deepspeed``, and the full
        policy as a transformers directory (safetensors) beside it for resume-as-model and rollout."""
        self._command("save", str(directory))

    def _save(self, directory: str) -> None:
        d = Path(directory)
        self.engine.save_checkpoint(str(d / DEEPSPEED_DIR), tag=TAG, save_latest=False)
        with self._gathered():
            if self.is_leader:
                state = {k: v.detach().cpu() for k, v in self.policy.state_dict().items()}
                self.policy.save_pretrained(d, state_dict=state, safe_serialization=True)
        self.dist.barrier(group=self.control)  # every rank's files are written before rank 0 renames

    def load(self, directory: Path) -> None:
        self._command("load", str(directory))

    def _load(self, directory: str) -> None:
        d = Path(directory) / DEEPSPEED_DIR
        if not (d / TAG).is_dir():
            raise ValueError(
                f"--resume {directory}: no DeepSpeed checkpoint there ({d / TAG} is missing); a checkpoint of a "
                "trainer.backend 'torch' run resumes with backend torch, or start a new run with model.path "
                "set to that checkpoint"
            )
        load_path, _ = self.engine.load_checkpoint(
            str(d), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise ValueError(f"DeepSpeed could not load the checkpoint in {d}")

    def state(self) -> dict[str, Any]:
        return {"policy_version": self._version, "skipped_updates": self.skipped_updates}

    def load_state(self, state: dict[str, Any]) -> None:
        self._command("load_state", dict(state))

    def _load_state(self, state: dict[str, Any]) -> None:
        self._version = int(state["policy_version"])
        self.skipped_updates = int(state.get("skipped_updates", 0))


def export_checkpoint(checkpoint: Path, out_dir: Path) -> Path:
    """Write a DeepSpeed checkpoint's fp32 master weights as a transformers model directory.

    Runs in one process without ``torch.distributed``: the partitions of every rank are
    merged with DeepSpeed's ``zero_to_fp32`` (ZeRO 1-3) or read from the model states file
    (stage 0). The config comes from the checkpoint's ``config.json``; tokenizer files found
    in the checkpoint or in the run's ``model.path`` are copied along.
    """
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    ds_dir = checkpoint / DEEPSPEED_DIR
    if not (ds_dir / TAG).is_dir():
        raise FileNotFoundError(f"{checkpoint} holds no DeepSpeed checkpoint ({ds_dir / TAG} is missing)")
    state_json = checkpoint / "state.json"
    run_cfg = json.loads(state_json.read_text())["config"] if state_json.is_file() else {}
    stage = int(run_cfg.get("trainer", {}).get("zero_stage", 2))
    if stage == 0:
        states = torch.load(
            ds_dir / TAG / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False
        )
        weights = {k: v.float() for k, v in states["module"].items()}
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        weights = get_fp32_state_dict_from_zero_checkpoint(str(ds_dir), tag=TAG)
    prefix = "policy."  # PolicyForward's attribute
    weights = {k.removeprefix(prefix): v for k, v in weights.items()}
    config = AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {
        k for k in missing if k.endswith("lm_head.weight") and getattr(config, "tie_word_embeddings", False)
    }
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{checkpoint}: the DeepSpeed weights do not match config.json: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    sources = [checkpoint]
    model_path = run_cfg.get("model", {}).get("path")
    if model_path and Path(model_path).is_dir():
        sources.append(Path(model_path))
    for src in sources:
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "chat_template.jinja",
        ):
            if (src / name).is_file() and not (out_dir / name).exists():
                shutil.copy2(src / name, out_dir / name)
    return out_dir
