"""Assemble a run from its config and drive it: the engine's one entry point for training.

``execute`` is what ``python -m engine run`` calls: it loads the model, data, rollout
backend, rewards and trainer, restores a checkpoint when resuming, runs the orchestrator,
and reports the outcome as status events and an exit code the job supervisor maps to the
run's final state.
"""

from __future__ import annotations

import copy
import random
import sys
import traceback
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.checkpoint import load_state, resolve_checkpoint, restore_rng
from engine.config import RunConfig
from engine.contracts import EXIT_CANCELLED, EXIT_SUCCEEDED
from engine.data import PromptSelector, load_prompts
from engine.data.likelihood import AnswerScorer
from engine.data.stages import StagedRewards, StagedSelector, combined_splits, load_stages
from engine.events import EventHeartbeat
from engine.log_bridge import LogBridge
from engine.models import load_model, load_tokenizer, resolve_model_path
from engine.models.starter import recipe_for, starter_for, starter_location, starter_tasks
from engine.phases import Phases, data_words, model_files
from engine.pipeline.async_loop import AsyncOrchestrator
from engine.pipeline.learner import Learner, needs_reference
from engine.pipeline.orchestrator import Orchestrator
from engine.pipeline.producer import RolloutProducer
from engine.pipeline.stages import StageEvaluator, StageReference
from engine.pipeline.token_view import token_texts
from engine.rewards import RewardManager
from engine.rollout import RolloutBackend, make_rollout_backend
from engine.rollout.base import native_bf16
from engine.rollout.process_backend import BackendSpec, ProcessRolloutBackend, visible_device_env
from engine.trainer import make_trainer
from tributary.events import EventSink


def pick_device(name: str, field: str = "trainer.device") -> torch.device:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` as a device of this machine; a clear error naming
    ``field`` when the GPU it names is not there."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible == 0 or (device.index or 0) >= visible:
            raise ValueError(
                f"{field} is {name!r} but this machine shows {visible} CUDA device(s); use 'auto', 'cpu' "
                "or a GPU it has"
            )
    return device


def train_device(cfg: RunConfig) -> torch.device:
    """``trainer.device`` for this process: under DeepSpeed, a CUDA rank trains on its own GPU."""
    device = pick_device(cfg.trainer.device)
    if device.type == "cuda" and cfg.trainer.backend == "deepspeed":
        return torch.device("cuda", torch.cuda.current_device())  # set by init_distributed
    return device


def emulated_bf16(cfg: RunConfig, device: torch.device) -> str | None:
    """A warning when the run trains in bfloat16 (``model.dtype`` or ``trainer.mixed_precision``) on a device
    that only emulates it (:func:`native_bf16`): there it is slower than float32, not faster."""
    if cfg.model.dtype == "bfloat16":
        field, fix = "model.dtype: bfloat16", "model.dtype float32"
    elif cfg.trainer.mixed_precision == "bf16":
        field, fix = "trainer.mixed_precision: bf16", "trainer.mixed_precision no"
    else:
        return None
    if native_bf16(device):
        return None
    return (
        f"{field} computes in bfloat16, which this {device.type} device only emulates (no AVX512-BF16 or AMX "
        f"on a CPU, no bf16 on a GPU before Ampere): the update is slower than in float32; set {fix}"
    )


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


class Progress:
    """A terminal progress bar with step, reward, accuracy and ETA (tqdm on stderr)."""

    def __init__(self, total: int, initial: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)

    def __call__(self, step: int, total: int, metrics: dict[str, float]) -> None:
        post = {"reward": f"{metrics.get('reward/mean', float('nan')):.3f}"}
        for key, label in (("train/accuracy", "acc"), ("eval/accuracy", "eval")):
            if key in metrics:
                post[label] = f"{metrics[key]:.3f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def execute(
    cfg: RunConfig,
    *,
    events: str | None = None,
    resume: str | None = None,
    show_progress: bool | None = None,
    run_id: str | None = None,
    start_seq: int | None = None,
) -> int:
    """Run training to the end (or to a cancel signal); returns an ``EXIT_*`` code.

    Event numbering continues after ``start_seq`` when a consumer states its stored cursor
    (the web app's, for a run it tracks; a resume there is a new run with its own numbering),
    else after the checkpoint's last seq (a resume from the command line, appending to the
    same log); and always after the event file's last seq, so no log reuses a number.

    A DeepSpeed run's ranks all come here: rank 0 runs the engine, the others follow it
    (``_follow``); every rank leaves the process group before it exits (left to the interpreter's
    exit, gloo's threads can abort a rank: "terminate called without an active exception").
    """
    if cfg.trainer.backend != "deepspeed":
        return _execute(cfg, _open_run(cfg, events, resume, run_id, start_seq), show_progress)
    from engine.ranks import rank_info
    from engine.trainer.deepspeed_backend import distributed

    rank, world, _ = rank_info()
    opened = _open_run(cfg, events, resume, run_id, start_seq) if rank == 0 else None
    if opened is not None and world > 1:
        # Joining can take as long as the slowest rank's start: say so before waiting for them.
        opened.sink.status("starting", f"starting {world} ranks: waiting for each to join")
    with distributed(pick_device(cfg.trainer.device).type):  # NCCL/gloo; each rank's GPU
        return _execute(cfg, opened, show_progress) if opened is not None else _follow(cfg)


class _Opened:
    """A run's event sink and the checkpoint it resumes from (rank 0 alone opens them)."""

    def __init__(self, sink: EventSink, checkpoint: Path | None, state: Any) -> None:
        self.sink, self.checkpoint, self.state = sink, checkpoint, state


def _open_run(
    cfg: RunConfig, events: str | None, resume: str | None, run_id: str | None, start_seq: int | None
) -> _Opened:
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = resolve_checkpoint(resume) if resume else None
    state = load_state(checkpoint) if checkpoint else None
    sink = EventSink(
        run_id or (state.extra.get("run_id") if state else None) or uuid.uuid4().hex[:12],
        events if events is not None else cfg.run_dir / "events.jsonl",
        start_seq=start_seq if start_seq is not None else (state.last_seq if state else 0),
    )
    return _Opened(sink, checkpoint, state)


def _execute(cfg: RunConfig, opened: _Opened, show_progress: bool | None) -> int:
    run_dir = cfg.run_dir
    sink, checkpoint, state = opened.sink, opened.checkpoint, opened.state
    if show_progress is None:
        show_progress = cfg.logging.progress == "on" or (
            cfg.logging.progress == "auto" and sys.stderr.isatty()
        )
    sink.status("starting", f"resuming from {checkpoint}" if checkpoint else "preparing the run")
    try:
        with LogBridge(sink), EventHeartbeat(sink, cfg.logging.heartbeat_s):
            outcome_state, step = _train(cfg, sink, run_dir, checkpoint, state, show_progress)
    except KeyboardInterrupt:
        sink.status("cancelled", "interrupted before a checkpoint could be written")
        sink.close()
        return EXIT_CANCELLED
    except Exception as exc:  # the run fails, but the event log says why
        sink.log("error", traceback.format_exc()[-4000:])
        sink.status("failed", f"{type(exc).__name__}: {exc}")
        sink.close()
        raise
    if outcome_state == "cancelled":
        sink.status(
            "cancelled",
            f"stopped at step {step}; resume with --resume {run_dir}"
            if step > 0
            else "stopped before the first step: no checkpoint to resume from, start it again",
        )
        code = EXIT_CANCELLED
    else:
        sink.status("succeeded", f"finished {step} steps")
        code = EXIT_SUCCEEDED
    sink.close()
    return code


def _train(
    cfg: RunConfig, sink: EventSink, run_dir: Path, checkpoint: Path | None, state: Any, show_progress: bool
) -> tuple[str, int]:
    phase = Phases(sink)
    seed_everything(cfg.trainer.seed, cfg.trainer.deterministic)
    device = train_device(cfg)
    if slow := emulated_bf16(cfg, device):
        sink.log("warning", slow)
    path = _model_path(cfg, phase)
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    phase(f"loading the model ({model_files(path)}) on {device}")
    model = load_model(path, dtype=dtype, device=device)
    tokenizer = load_tokenizer(path)
    phase(f"loading the data ({data_words(cfg.data)})")
    stages = load_stages(cfg, tokenizer) if cfg.data.stages else None  # continual training: engine/data/stages.py
    splits = combined_splits(stages) if stages else load_prompts(cfg.data, tokenizer, seed=cfg.trainer.seed)
    if splits.skipped_too_long:
        sink.log(
            "warning", f"{splits.skipped_too_long} prompts longer than data.max_prompt_length were skipped"
        )
    sampler = StagedSelector(cfg, stages) if stages else PromptSelector.from_config(cfg, splits.train)
    if cfg.rollout.backend == "vllm":
        phase(f"starting vLLM for the rollouts ({len(splits.train)} training prompts loaded)")
    elif cfg.rollout.in_own_process:
        phase(f"starting the rollout process ({len(splits.train)} training prompts loaded)")
    backend = build_rollout_backend(cfg, model, tokenizer, path, device)
    if cfg.data.scores_answers:
        sampler.attach_scorer(AnswerScorer.for_run(backend, tokenizer, cfg))
    phase(f"preparing the {cfg.trainer.backend} trainer ({len(splits.train)} training prompts loaded)")
    trainer = make_trainer(cfg.trainer.backend, model, cfg, device=device, need_reference=needs_reference(cfg))
    learner = Learner(cfg, trainer)
    reference = StageReference(stages, trainer) if stages and cfg.data.stage_reference == "previous_stage" else None
    stage_eval = StageEvaluator(stages, reference) if stages else None
    start_step = 0
    if checkpoint is not None:
        phase(f"restoring the checkpoint of step {state.step}")
        trainer.load(checkpoint)
        trainer.load_state(state.trainer)
        sampler.load_state_dict(state.sampler)
        restore_rng(state.rng)
        if stage_eval is not None:
            stage_eval.load_state_dict(state.extra.get("stages", {}))
        if reference is not None:
            reference.restore(checkpoint, state.step)
        if learner.kl_ctrl is not None and "kl_coef" in state.extra:
            learner.kl_ctrl.value = state.extra["kl_coef"]
        backend.update_weights(trainer.rollout_weights(), trainer.policy_version)
        start_step = state.step
        sink.log("info", f"resumed from {checkpoint} at step {start_step}")

    def checkpoint_extra() -> dict[str, Any]:
        extra: dict[str, Any] = {"run_id": sink.run_id}
        if learner.kl_ctrl is not None:
            extra["kl_coef"] = float(learner.kl_ctrl.value)
        if stage_eval is not None:
            extra["stages"] = stage_eval.state_dict()
        return extra

    progress = Progress(cfg.trainer.total_steps, start_step) if show_progress else None
    with StagedRewards(cfg, stages) if stages else RewardManager.from_config(cfg.reward) as rewards:
        producer = RolloutProducer(
            cfg,
            sampler=sampler,
            backend=backend,
            rewards=rewards,
            pad_id=tokenizer.pad_token_id,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        )
        orchestrator = orchestrator_class(cfg)(
            cfg,
            producer=producer,
            learner=learner,
            trainer=trainer,
            backend=backend,
            sink=sink,
            eval_prompts=splits.eval,
            run_dir=run_dir,
            checkpoint_extra=checkpoint_extra,
            progress=progress,
            token_texts=token_texts(tokenizer),
            stages=stage_eval,
        )
        if state is not None:
            orchestrator.restore_in_flight(state.in_flight, splits.train)
            orchestrator.restore_replay(state.replay, splits.train)
            orchestrator.restore_successes(state.success_replay, splits.train)
        # Only words that stay true while it trains: the step is the metrics' to tell.
        sink.status(
            "running",
            f"resumed at step {start_step}, training on {device}" if start_step else f"training on {device}",
        )
        try:
            outcome = orchestrator.run(start_step)
        finally:
            if progress is not None:
                progress.close()
            backend.close()
            trainer.close()
    return outcome.state, outcome.step


def _model_path(cfg: RunConfig, phase: Phases) -> Path:
    """The run's model directory; a starter policy built on first use says how far its build is."""
    if cfg.model.path != "starter" or cfg.data.source != "builtin":
        return resolve_model_path(cfg.model, cfg.data)
    pairs = starter_tasks(cfg.data)  # several: a mixture starter (companions, or the stages' tasks)
    built = starter_location(pairs)
    if (built / "starter.json").is_file():
        return built
    target = min(recipe_for(task).target_accuracy for task, _ in pairs)  # the build reports its lowest task
    report = phase.starter(" + ".join(task for task, _ in pairs), max(d for _, d in pairs), target)
    return starter_for(pairs, progress=report)


def build_rollout_backend(
    cfg: RunConfig, model: torch.nn.Module, tokenizer: Any, path: Path, device: torch.device
) -> RolloutBackend:
    """The run's rollout backend: in this process, or in a child of its own (``rollout.own_process``).

    In this process the torch backend samples from the trainer's own module, except where that module
    does not hold whole, settled weights: ZeRO-3 partitions its parameters across ranks, and an
    asynchronous run generates while the trainer updates. There it gets a copy of its own, refreshed
    from the (gathered) weights after each step; so does a rollout device of its own (rollout.device).
    A child process loads the model from ``path`` itself and gets every update through shared memory.
    """
    asynchronous = issubclass(orchestrator_class(cfg), AsyncOrchestrator)
    rollout_device = device if cfg.rollout.device == "auto" else pick_device(cfg.rollout.device, "rollout.device")
    if cfg.rollout.in_own_process:
        threads = torch.get_num_threads()
        if asynchronous and rollout_device.type == "cpu":
            threads = max(1, threads // 2)  # the trainer keeps the other half (AsyncOrchestrator.run)
        env = visible_device_env(str(rollout_device))  # cuda:N: that GPU alone; cuda: this process's view
        spec = BackendSpec(
            name=cfg.rollout.backend,
            model_dir=str(path),
            dtype=cfg.model.dtype,
            device="cpu" if rollout_device.type == "cpu" else "cuda",
            threads=threads,
            run_config=cfg.model_dump(mode="json", by_alias=True),
            options={"max_batch_size": cfg.rollout.batch_size},
        )
        return ProcessRolloutBackend(spec, env=env)
    own_copy = (
        asynchronous
        or (cfg.trainer.backend == "deepspeed" and cfg.trainer.zero_stage == 3)
        or rollout_device != device
    )
    placement = {"device": rollout_device} if cfg.rollout.backend == "torch" else {}
    return make_rollout_backend(
        cfg.rollout.backend,
        copy.deepcopy(model) if own_copy else model,
        tokenizer,
        max_batch_size=cfg.rollout.batch_size,
        model_dir=path,
        run_config=cfg,
        **placement,
    )


def orchestrator_class(cfg: RunConfig) -> type[Orchestrator]:
    """The synchronous loop, or the producer thread: k > 0 steps ahead, or periodic (on-policy, within the step)."""
    return AsyncOrchestrator if cfg.async_.max_staleness > 0 or cfg.async_.periodic else Orchestrator


def _follow(cfg: RunConfig) -> int:
    """Ranks 1..N-1 of a DeepSpeed run: build the same trainer, then do what rank 0 says.

    Rank 0 runs the engine (rollouts, rewards, events, checkpoints) and broadcasts every trainer
    call to the others (``DeepSpeedTrainer.serve``), so a follower needs the same model and config
    and nothing else: no data, no rollout backend, no event log. Its exit code is 0 when rank 0
    releases it; the launcher reports rank 0's.
    """
    from engine.trainer.deepspeed_backend import DeepSpeedTrainer

    seed_everything(cfg.trainer.seed, cfg.trainer.deterministic)
    device = train_device(cfg)
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    model = load_model(resolve_model_path(cfg.model, cfg.data), dtype=dtype, device=device)
    DeepSpeedTrainer(model, cfg, device=device, need_reference=needs_reference(cfg)).serve()
    return EXIT_SUCCEEDED
