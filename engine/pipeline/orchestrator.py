"""The orchestrator: rollout production and training as producer and consumer.

Each step consumes one produced batch. ``async.max_staleness`` bounds how many policy
versions the weights that generated a batch may lag the trainer's; 0 is strictly
on-policy: the producer generates step ``s`` only after the weights of step ``s - 1`` were
synced to the rollout backend, which is what this loop does. The asynchronous loop
(``engine/pipeline/async_loop.py``) runs the producer ahead in a thread of its own and
replaces four seams: ``_next_batch`` (a batch from the producer's queue), ``_sync_weights``
(publish the new weights for the producer to take), ``_sampler_state`` (the data position
of the next batch still to generate) and ``_in_flight_state`` with ``restore_in_flight`` (the
partial rollouts in flight, saved with a checkpoint and taken back on resume).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.batch import RolloutBatch
from engine.checkpoint import CheckpointState, capture_rng, save_checkpoint
from engine.config import RunConfig
from engine.data import Prompt
from engine.data.replay import ReplayBuffer
from engine.pipeline.evaluate import evaluate
from engine.pipeline.learner import Learner
from engine.pipeline.metrics import rollout_metrics, sample_items
from engine.pipeline.producer import (
    ProducedBatch,
    RolloutProducer,
    collate_trainable,
    replayed_groups,
    seed_for,
)
from engine.pipeline.stages import StageEvaluator
from engine.ranks import LAUNCHED_ENV
from engine.rollout import RolloutBackend
from engine.system_metrics import PHASE, ProcessTree, SystemSampler
from engine.trainer import TrainerBackend
from tributary.events import EventSink


class StalenessError(RuntimeError):
    pass


@dataclass
class RunOutcome:
    state: str  # succeeded | cancelled
    step: int
    metrics: dict[str, float]


class Orchestrator:
    def __init__(
        self,
        cfg: RunConfig,
        *,
        producer: RolloutProducer,
        learner: Learner,
        trainer: TrainerBackend,
        backend: RolloutBackend,
        sink: EventSink,
        eval_prompts: list[Prompt],
        run_dir: Path,
        checkpoint_extra: Callable[[], dict[str, Any]] = dict,
        progress: Any = None,
        token_texts: Callable[[Sequence[int]], list[str]] | None = None,
        stages: StageEvaluator | None = None,
    ) -> None:
        self.cfg = cfg
        self.producer = producer
        self.learner = learner
        self.trainer = trainer
        self.backend = backend
        self.sink = sink
        self.eval_prompts = eval_prompts
        self.run_dir = run_dir
        self.checkpoint_extra = checkpoint_extra
        self.progress = progress
        self.token_texts = token_texts  # token ids -> each token's text, for the samples' token view
        self.stages = stages  # data.stages: eval per stage seen, forgetting (engine/pipeline/stages.py)
        self.stop_requested = False
        self.stop_signal = ""  # the signal that asked for the stop, logged by the run loop
        self.history: list[dict[str, float]] = []
        r = cfg.replay
        self.replay = ReplayBuffer(r.capacity, r.max_age) if r.enabled else None

    # -- signals -------------------------------------------------------------------------

    @contextmanager
    def _cancel_on_signals(self):
        """SIGTERM/SIGINT ask for a clean stop: finish the step, checkpoint, exit cancelled.

        The handler only sets flags. Python runs it between bytecodes of the main thread, which
        may be inside ``EventSink.emit`` writing ``events.jsonl``: logging from the handler would
        re-enter that buffered writer (``RuntimeError: reentrant call``) and turn a clean cancel
        into a crash. The run loop logs the signal once it has left the step.
        """

        def handler(signum: int, _frame: object) -> None:
            if self.stop_requested:  # a second signal: stop now
                raise KeyboardInterrupt
            self.stop_signal = signal.Signals(signum).name
            self.stop_requested = True

        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    # -- the loop ------------------------------------------------------------------------

    def _next_batch(self, step: int) -> ProducedBatch:
        return self._checked(step, self.producer.produce(step))

    def _checked(self, step: int, produced: ProducedBatch) -> ProducedBatch:
        """The bound itself: no sample more than ``async.max_staleness`` versions behind the trainer."""
        if produced.batch is not None:
            k = self.cfg.async_.max_staleness
            # A success replay row is old by design: replay.success_max_age bounds it, not k.
            oldest = min(
                (r.completion.policy_version for r in produced.batch.rows if not r.replayed),
                default=self.trainer.policy_version,
            )
            if self.trainer.policy_version - oldest > k:
                raise StalenessError(
                    f"step {step}: a sample generated by policy version {oldest}, trainer at "
                    f"{self.trainer.policy_version} (async.max_staleness {k})"
                )
        return produced

    def _sync_weights(self) -> dict[str, float]:
        """Send the updated weights to the rollout backend before the next batch is generated."""
        t0 = time.perf_counter()
        with PHASE("weight_sync"):
            self.backend.update_weights(self.trainer.rollout_weights(), self.trainer.policy_version)
        return {"timing_s/weight_sync": time.perf_counter() - t0}

    def _sampler_state(self, step: int) -> dict[str, Any]:
        """The prompt sampler's position after step ``step``'s batch (where a resume starts drawing)."""
        return self.producer.sampler.state_dict()

    def _in_flight_state(self, step: int) -> dict[str, Any]:
        """Rollouts in flight after step ``step`` (partial rollouts only): none here."""
        return {}

    def restore_in_flight(self, state: dict[str, Any], prompts: Sequence[Prompt]) -> None:
        """Take back the rollouts in flight a checkpoint holds (``_in_flight_state``); ``prompts``
        are the training prompts they were drawn from. This loop has none: a checkpoint of a run
        with partial rollouts resumed without them loses those groups, and says so."""
        if state.get("groups"):
            self.sink.log(
                "warning",
                f"the checkpoint holds {len(state['groups'])} partial rollout groups in flight; this run does "
                "not use partial rollouts, so they are not continued (their prompts are skipped)",
            )

    def _success_state(self, step: int) -> dict[str, Any]:
        """The success replay bank after step ``step``'s batch (engine/data/success_replay.py)."""
        bank = self.producer.successes
        return bank.state_dict() if bank is not None else {}

    def restore_successes(self, state: dict[str, Any], prompts: Sequence[Prompt]) -> None:
        """Take back the success replay bank a checkpoint holds; ``prompts`` are the training prompts."""
        if self.producer.successes is not None:
            self.producer.successes.load_state_dict(state, prompts)
        elif state.get("prompts"):
            self.sink.log(
                "warning",
                f"the checkpoint holds stored successes of {len(state['prompts'])} prompts; this run has "
                "replay.successes off, so they are not replayed",
            )

    def restore_replay(self, state: dict[str, Any], prompts: Sequence[Prompt]) -> None:
        """Take back the rollout replay buffer a checkpoint holds; ``prompts`` are the training prompts."""
        if self.replay is not None:
            self.replay.load_state_dict(state, prompts)
        elif state.get("groups"):
            self.sink.log(
                "warning",
                f"the checkpoint holds {len(state['groups'])} rollout replay groups; this run has replay.ratio 0, "
                "so they are not replayed",
            )

    def _mix_replay(self, step: int, batch: RolloutBatch | None) -> tuple[RolloutBatch | None, dict[str, float]]:
        """Step ``step``'s batch with its replayed groups (rollout replay, engine/data/replay.py) after
        the fresh ones, marked in ``extra["replayed"]`` ([B] bool) for the learner's off-policy
        correction. The replayed groups pass no staleness check: ``replay.max_age`` bounds their age."""
        assert self.replay is not None
        version = self.trainer.policy_version
        wanted = replayed_groups(self.cfg, step)
        groups = self.replay.sample(wanted, version, seed_for(self.cfg.trainer.seed, step) ^ 0x5EED)
        fresh = batch.rows if batch is not None else []
        n_fresh = len({r.group for r in fresh})
        ages = [version - g.version for g in groups]
        metrics = {
            "replay/fraction": len(groups) / max(1, len(groups) + n_fresh),
            "replay/buffer_groups": float(len(self.replay)),
            "replay/age_mean": sum(ages) / len(ages) if ages else 0.0,
            "replay/age_max": float(max(ages, default=0)),
            "replay/missing_groups": float(wanted - len(groups)),  # the batch is this much smaller
        }
        if not groups:
            return batch, metrics
        replayed = [r for g in groups for r in g.rows]
        mixed = collate_trainable(
            self.cfg,
            fresh + replayed,
            self.producer.pad_id,
            batch.policy_version if batch is not None else min(g.version for g in groups),
        )
        if batch is not None:
            mixed.extra = dict(batch.extra)
        mixed.extra["replayed"] = torch.tensor([r.replayed for r in fresh] + [True] * len(replayed))
        return mixed, metrics

    def _eval(self, step: int = 0) -> dict[str, float]:
        if self.stages is not None:
            return self.stages.evaluate(
                self.producer, step, pass_k=self.cfg.trainer.eval_pass_k, seed=self.cfg.trainer.seed
            )
        return evaluate(self.producer, self.eval_prompts, pass_k=self.cfg.trainer.eval_pass_k, seed=self.cfg.trainer.seed)

    def _system_sampler(self) -> SystemSampler:
        """The sampler of the run's process tree (``logging.system_metrics_s``; 0: none). Under
        the ranks launcher (``engine/ranks.py``) the tree is the launcher's: every rank in it."""
        interval = self.cfg.logging.system_metrics_s
        if interval <= 0:
            return SystemSampler.off()
        root = os.getppid() if os.environ.get(LAUNCHED_ENV) else os.getpid()
        return SystemSampler(interval, tree=ProcessTree(root))

    def _due(self, step: int, every: int) -> bool:
        return every > 0 and step % every == 0

    def run(self, start_step: int) -> RunOutcome:
        cfg = self.cfg
        total = cfg.trainer.total_steps
        last_metrics: dict[str, float] = {}
        system = self._system_sampler()
        with self._cancel_on_signals(), system:
            if start_step == 0 and (self.eval_prompts or self.stages is not None):
                m = self._eval(0)
                self.sink.metrics(0, m)
                last_metrics.update(m)
            step = start_step
            saved_at = start_step
            while step < total and not self.stop_requested:
                step += 1
                metrics = self.train_step(step)
                stage_end = self.stages is not None and self.stages.is_boundary(step)
                if self._due(step, cfg.trainer.eval_every) or step == total or stage_end:
                    metrics.update(self._eval(step))
                metrics.update(system.step_metrics())
                self.sink.metrics(step, metrics)
                last_metrics = metrics
                self.history.append(metrics)
                if self.progress is not None:
                    self.progress(step, total, metrics)
                if self._due(step, cfg.checkpoint.every_steps) and step < total:
                    self.save(step)
                    saved_at = step
            if self.stop_signal:
                self.sink.log("warning", f"received {self.stop_signal}: checkpointing and stopping")
            if saved_at != step and (self.stop_requested or cfg.checkpoint.save_final):
                self.save(step)
        return RunOutcome("cancelled" if self.stop_requested else "succeeded", step, last_metrics)

    def train_step(self, step: int) -> dict[str, float]:
        t_step = time.perf_counter()
        if self.stages is not None:
            self.stages.before_step(step)  # data.stage_reference: the KL reference at a stage's first step
        produced = self._next_batch(step)
        metrics = dict(produced.metrics)
        metrics.update(rollout_metrics(produced.generated, produced.accuracy_component))
        batch = produced.batch
        if self.replay is not None:
            batch, replay_metrics = self._mix_replay(step, batch)
            metrics.update(replay_metrics)
        if batch is None:
            self.sink.log("warning", f"step {step}: every group was filtered out; no update this step")
        else:
            metrics.update(self.learner.prepare(batch))
            metrics.update(self.learner.train(batch))
            row_adv = (batch.advantages * batch.response_mask).sum(-1) / batch.response_mask.sum(-1).clamp(min=1)
            for row, adv in zip(batch.rows, row_adv.tolist(), strict=True):
                row.advantage = adv
            metrics.update(self._sync_weights())
            if self.replay is not None and produced.batch is not None:
                self.replay.add(produced.batch.rows)  # the fresh groups just trained on
            for message in sorted(set(batch.extra.get("reward_messages", [])))[:5]:
                self.sink.log("warning", f"step {step}: reward function failed: {message}")
        elapsed = time.perf_counter() - t_step
        metrics["timing_s/step"] = elapsed
        tokens = sum(len(r.prompt_ids) + len(r.completion.token_ids) for r in produced.generated)
        metrics["perf/throughput"] = tokens / elapsed if elapsed > 0 else 0.0
        metrics["rollout/policy_version"] = float(self.backend.policy_version)
        if torch.cuda.is_available():
            metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        if self.cfg.logging.samples_per_step:
            log = self.cfg.logging
            items = sample_items(
                produced.shown,
                log.samples_per_step,
                token_texts=self.token_texts,
                token_samples=log.token_samples_per_step,
                tokens_per_sample=log.tokens_per_sample,
            )
            self.sink.samples(step, items)
        return metrics

    def save(self, step: int) -> Path:
        with self.sink.hold():
            state = CheckpointState(
                step=step,
                last_seq=self.sink.seq + 1,  # the checkpoint event written right after this
                sampler=self._sampler_state(step),
                in_flight=self._in_flight_state(step),
                replay=self.replay.state_dict() if self.replay is not None else {},
                success_replay=self._success_state(step),
                trainer=self.trainer.state(),
                rng=capture_rng(),
                extra=self.checkpoint_extra(),
                config=self.cfg.model_dump(mode="json"),
            )
            write = self.trainer.save if self.stages is None else self.stages.write_model(self.trainer.save)
            path, _, _ = save_checkpoint(
                self.run_dir,
                state,
                write,
                keep_last=self.cfg.checkpoint.keep_last,
                announce=lambda saved, nbytes, doomed: self.sink.checkpoint(
                    step, str(saved.resolve()), nbytes, deleted=[str(p.resolve()) for p in doomed]
                ),
            )
        return path
