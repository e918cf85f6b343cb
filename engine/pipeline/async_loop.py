"""Asynchronous RL: rollout generation in a producer thread, overlapped with training.

What the modes promise, and the settings that pick them, are the config's ``async.*`` fields
(``async.max_staleness``, ``async.stale_samples``, ``async.partial_rollouts``, ``async.periodic``).
This module is how :class:`AsyncOrchestrator` keeps those promises (AReaL, Fu et al. 2025,
arXiv:2505.24298; verl's fully-async mode; ROLL Flash):

* **the gate** (:class:`StalenessGate`): the producer may start generating the batch of step
  ``s`` only once the trainer has finished step ``s - 1 - k``, so a batch is at most ``k``
  versions old when trained, by construction (the orchestrator still checks every batch it
  takes, ``Orchestrator._checked``);
* **weights** go from the trainer to the rollout backend as snapshots: after each update the
  main thread publishes a copy, and the producer loads the newest one into the backend's own
  copy of the policy just before it generates, so no batch is sampled from weights the trainer
  is changing;
* **partial rollouts** come from the pool of groups in ``engine/pipeline/partial.py``; the gate's
  :meth:`StalenessGate.version_bound` tells the pool which groups it can still carry over, and the
  pool is checkpointed as it was before the next step's round (with the sampler's position);
* **periodic** (k = 0): the producer generates the step's batch in slices and hands each over as
  it is scored; the trainer computes their old/reference log-probs while the next slice generates,
  then updates on the whole batch, and the producer takes the new weights;
* the off-policy correction for the lag is the learner's (``engine/algorithms/off_policy.py``).

Everything the run writes (events, checkpoints) stays on the main thread; the producer only
touches the rollout backend, the prompt sampler and the reward workers. Evaluation shares the
rollout backend with the producer, so it takes the same lock and the newest weights first.
On CPU the two threads share the cores (:meth:`AsyncOrchestrator.run` gives the trainer half of
torch's threads); on GPU machines the rollout backend and the trainer sit on different devices.
"""
from __future__ import annotations

import functools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.batch import Rollout, RolloutBatch, collate
from engine.data import Prompt
from engine.data.success_replay import SuccessBank
from engine.pipeline.orchestrator import Orchestrator, RunOutcome
from engine.pipeline.partial import PartialGroup, PartialRolloutProducer, pool_state
from engine.pipeline.producer import ProducedBatch
from engine.system_metrics import PHASE


class GateClosed(Exception):
    """The run is stopping: the producer leaves its loop."""


class StalenessGate:
    """Lets the producer start step ``s`` once the trainer has finished step ``s - 1 - k``.

    ``wait(s)`` blocks the producer and returns the seconds it waited; ``trained(s, version)`` is
    the trainer's report (with the policy version it holds after step ``s``); ``close()`` releases
    a waiting producer for good (``GateClosed``). ``version_bound(s)`` bounds the version the
    trainer will hold when it trains step ``s``, for the producer to judge how old a sample will
    be there.
    """

    def __init__(self, max_staleness: int, trained_step: int, trained_version: int) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.k = max_staleness
        self._trained = trained_step
        self._version = trained_version
        self._closed = False
        self._cond = threading.Condition()

    def may_generate(self, step: int) -> bool:
        return self._trained >= step - 1 - self.k

    def wait(self, step: int) -> float:
        t0 = time.perf_counter()
        with self._cond:
            while not (self._closed or self.may_generate(step)):
                self._cond.wait()
            if self._closed:
                raise GateClosed
        return time.perf_counter() - t0

    def trained(self, step: int, version: int) -> None:
        """The trainer finished ``step`` holding policy ``version``."""
        with self._cond:
            self._trained = max(self._trained, step)
            self._version = max(self._version, version)
            self._cond.notify_all()

    def version_bound(self, step: int) -> int:
        """The highest policy version the trainer can hold when it trains step ``step``: the version
        after the last step it reported, plus one for each step before ``step`` still to train (a
        step updates the policy at most once; one whose batch was all filtered out does not)."""
        with self._cond:
            return self._version + max(0, step - 1 - self._trained)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def drop_stale(batch: RolloutBatch | None, trainer_version: int, k: int) -> tuple[RolloutBatch | None, int]:
    """``batch`` without the groups holding a sample more than ``k`` versions behind
    ``trainer_version`` (None if none is left), and the number of samples left out. A whole group
    goes: its advantages are relative to its other samples."""
    if batch is None:
        return None, 0
    oldest_allowed = trainer_version - k
    # A success replay row is old by design (replay.success_max_age bounds it), not stale.
    stale = {
        r.group for r in batch.rows if not r.replayed and r.completion.policy_version < oldest_allowed
    }
    if not stale:
        return batch, 0
    keep = [i for i, r in enumerate(batch.rows) if r.group not in stale]
    return (batch.select(keep) if keep else None), len(batch.rows) - len(keep)


@dataclass
class _Position:
    """Where a checkpoint's resume starts producing: the sampler's state and, with partial
    rollouts, the groups in flight."""

    sampler: dict[str, Any]
    pool: list[PartialGroup] | None
    successes: SuccessBank | None = None  # the success replay bank (replay.successes)


@dataclass
class _Slice:
    """Periodic mode: groups of the step's batch, handed over while the rest of it generates."""

    groups: list[list[Rollout]]


@dataclass
class _Handoff:
    """A produced batch with what the producer measured while making it."""

    step: int
    produced: ProducedBatch
    waited_s: float  # at the gate before generating
    busy: tuple[float, float]  # (start, end) of generation, perf_counter seconds
    sync_s: float  # loading the newest weights into the rollout backend


class AsyncOrchestrator(Orchestrator):
    """The orchestrator with a producer thread k steps ahead (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.k = self.cfg.async_.max_staleness
        self.periodic = self.cfg.async_.periodic
        self._ready: queue.Queue[_Slice | _Handoff | BaseException] = queue.Queue()
        self._backend_lock = threading.Lock()  # the producer's generation vs evaluation
        self._weights_lock = threading.Lock()
        self._published: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._sampler_lock = threading.Lock()
        self._before: dict[int, _Position] = {}  # step -> where data and pool stood before its batch
        self._busy: deque[tuple[float, float]] = deque(maxlen=4 * (self.k + 2))
        self._gate: StalenessGate | None = None
        self._thread: threading.Thread | None = None
        self._total = self.cfg.trainer.total_steps
        self._threads = 0  # torch intra-op threads of each side on CPU (0: left alone)
        # Where batches come from: whole rounds, rounds handed over in slices (periodic), or a pool
        # of partial rollouts carried across steps.
        self._produce: Callable[[int], ProducedBatch] = self.producer.produce
        self._partial: PartialRolloutProducer | None = None
        if self.cfg.async_.partial_rollouts:
            self._partial = PartialRolloutProducer(self.producer, version_bound=self._version_bound)
            self._produce = self._partial.produce
        elif self.periodic:
            self._produce = functools.partial(
                self.producer.produce,
                on_slice=lambda groups: self._ready.put(_Slice(groups)),
                slices=self.cfg.async_.periodic_slices,
            )

    # -- the producer thread ---------------------------------------------------------------

    def _produce_loop(self, start_step: int) -> None:
        assert self._gate is not None
        if self._threads:
            torch.set_num_threads(self._threads)  # the intra-op setting is per thread
        try:
            for step in range(start_step + 1, self._total + 1):
                waited = self._gate.wait(step)
                with self._backend_lock:
                    sync_s = self._load_newest_weights()
                    with self._sampler_lock:
                        self._before[step] = self._position()
                    t0 = time.perf_counter()
                    produced = self._produce(step)
                    t1 = time.perf_counter()
                self._busy.append((t0, t1))
                self._ready.put(_Handoff(step, produced, waited, (t0, t1), sync_s))
        except GateClosed:
            return
        except BaseException as exc:  # handed to the trainer, which raises it on its own thread
            self._ready.put(exc)

    def _load_newest_weights(self) -> float:
        """Load the newest published weights into the rollout backend (caller holds the backend lock)."""
        with self._weights_lock:
            published, self._published = self._published, None
        if published is None:
            return 0.0
        version, weights = published
        t0 = time.perf_counter()
        with PHASE("weight_sync"):
            self.backend.update_weights(weights, version)
        return time.perf_counter() - t0

    # -- the seams of Orchestrator -----------------------------------------------------------

    def _next_batch(self, step: int) -> ProducedBatch:
        waited = 0.0
        first_work: float | None = None  # periodic: the trainer starts on the first slice
        prefilled: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        while True:
            t0 = time.perf_counter()
            item = self._ready.get()
            waited += time.perf_counter() - t0
            if isinstance(item, BaseException):
                raise RuntimeError(f"the rollout producer failed at step {step}: {item}") from item
            if not isinstance(item, _Slice):
                break
            first_work = first_work or time.perf_counter()
            self._prefill(item, prefilled)
        if item.step != step:
            raise RuntimeError(f"the rollout producer handed over step {item.step} for step {step}")
        prefilled_frac = self._use_prefilled(item.produced, prefilled)
        # "drop": leave out (and count) what is too stale. Only partial rollouts carry such samples;
        # under "wait" nothing is stale by construction, and ``_checked`` raises if something is.
        dropped = 0
        if self.cfg.async_.stale_samples == "drop":
            item.produced.batch, dropped = drop_stale(item.produced.batch, self.trainer.policy_version, self.k)
        produced = self._checked(step, item.produced)
        produced.metrics["async/dropped_stale"] = float(dropped)
        produced.metrics.update(self._lag_metrics(produced))
        produced.metrics["timing_s/weight_sync"] = item.sync_s
        produced.metrics["async/trainer_wait_s"] = waited
        produced.metrics["async/producer_wait_s"] = item.waited_s
        if self.periodic:
            produced.metrics["async/prefilled_frac"] = prefilled_frac
        busy = item.busy[1] - item.busy[0]
        produced.metrics["async/producer_idle_ratio"] = item.waited_s / max(1e-9, item.waited_s + busy)
        self._train_started = first_work or time.perf_counter()
        return produced

    def _prefill(
        self, item: _Slice, prefilled: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]
    ) -> None:
        """Periodic mode: the log-probs of a slice's rows, computed while the producer generates the next."""
        rows = [r for g in item.groups for r in g]
        if not rows:
            return
        old, ref = self.learner.log_probs(
            collate(rows, self.producer.pad_id, rows[0].completion.policy_version)
        )
        for i, row in enumerate(rows):
            n = len(row.completion.token_ids)
            prefilled[id(row)] = (None if old is None else old[i, :n], None if ref is None else ref[i, :n])

    @staticmethod
    def _use_prefilled(
        produced: ProducedBatch, prefilled: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]
    ) -> float:
        """Fill the batch's old/reference log-probs from the slices (the learner then skips those passes);
        returns the share of rows that came prefilled (1.0 unless the batch is empty)."""
        batch = produced.batch
        if batch is None or not prefilled:
            return 0.0
        if not all(id(r) in prefilled for r in batch.rows):
            return 0.0  # cannot happen: every batch row was handed over in a slice; compute as usual
        width = batch.response_ids.shape[1]
        for index, field_name in ((0, "old_log_probs"), (1, "ref_log_probs")):
            parts = [prefilled[id(r)][index] for r in batch.rows]
            if parts[0] is not None:
                full = torch.zeros(len(parts), width)
                for i, part in enumerate(parts):
                    full[i, : part.shape[0]] = part
                setattr(batch, field_name, full)
        return 1.0

    def _lag_metrics(self, produced: ProducedBatch) -> dict[str, float]:
        """Staleness of every sample of the batch: trainer version - the version that generated it."""
        if produced.batch is None:
            return {}
        version = self.trainer.policy_version
        lags = [version - r.completion.policy_version for r in produced.batch.rows if not r.replayed]
        if not lags:
            return {}
        out = {
            "async/staleness_mean": sum(lags) / len(lags),
            "async/staleness_max": float(max(lags)),
        }
        for lag in range(self.k + 1):
            out[f"async/staleness_hist/{lag}"] = sum(1 for x in lags if x == lag) / len(lags)
        return out

    def _sync_weights(self) -> dict[str, float]:
        """Publish a copy of the new weights; the producer loads it before its next batch."""
        t0 = time.perf_counter()
        with PHASE("weight_sync"):
            snapshot = {name: t.detach().clone() for name, t in self.trainer.rollout_weights().items()}
        with self._weights_lock:
            self._published = (self.trainer.policy_version, snapshot)
        return {"timing_s/weight_snapshot": time.perf_counter() - t0}

    def _position(self) -> _Position:
        """Where the data and the pool of partial rollouts stand now (a copy later rounds leave alone)."""
        bank = self.producer.successes
        return _Position(
            self.producer.sampler.state_dict(),
            None if self._partial is None else self._partial.snapshot(),
            None if bank is None else bank.copy(),
        )

    def _position_before(self, step: int) -> _Position:
        """Where they stood before the producer's round for ``step`` (it may already have drawn and
        generated it: a resume does that round again, with the newer weights). Under the lock the
        capture takes: a producer that has not captured it yet has changed neither."""
        with self._sampler_lock:
            return self._before.get(step) or self._position()

    def _sampler_state(self, step: int) -> dict[str, Any]:
        return self._position_before(step + 1).sampler

    def _success_state(self, step: int) -> dict[str, Any]:
        bank = self._position_before(step + 1).successes
        return {} if bank is None else bank.state_dict()

    def _in_flight_state(self, step: int) -> dict[str, Any]:
        pool = self._position_before(step + 1).pool
        return {} if pool is None else pool_state(pool)

    def restore_in_flight(self, state: dict[str, Any], prompts: Sequence[Prompt]) -> None:
        if self._partial is None or not state:
            super().restore_in_flight(state, prompts)
            return
        restored, restarted = self._partial.load_state_dict(
            state, prompts, oldest_allowed=self.trainer.policy_version - self.k
        )
        self.sink.log("info", f"restored {restored} partial rollout groups in flight from the checkpoint")
        if restarted:
            self.sink.log(
                "warning",
                f"{restarted} of them were generated more than async.max_staleness = {self.k} versions ago "
                "(it was higher when the checkpoint was saved): they start their generation over",
            )

    def _version_bound(self, step: int) -> int:
        """The highest policy version the trainer can hold when it trains ``step`` (the gate's bound)."""
        assert self._gate is not None, "the producer runs only inside run()"
        return self._gate.version_bound(step)

    def _eval(self, step: int = 0) -> dict[str, float]:
        with self._backend_lock:
            self._load_newest_weights()
            return super()._eval(step)

    def train_step(self, step: int) -> dict[str, float]:
        self._train_started = time.perf_counter()
        metrics = super().train_step(step)
        end = time.perf_counter()
        assert self._gate is not None
        self._gate.trained(step, self.trainer.policy_version)
        with self._sampler_lock:
            for old in [s for s in self._before if s <= step]:
                del self._before[old]
        # Overlap: the share of this step's training time during which the producer was generating.
        start = self._train_started
        overlap = sum(max(0.0, min(end, b) - max(start, a)) for a, b in list(self._busy))
        metrics["async/overlap"] = overlap / max(1e-9, end - start)
        metrics["async/trainer_idle_ratio"] = metrics.get("async/trainer_wait_s", 0.0) / max(
            1e-9, metrics.get("timing_s/step", end - start)
        )
        return metrics

    # -- the loop ------------------------------------------------------------------------------

    def run(self, start_step: int) -> RunOutcome:
        # Partial rollouts spend one version of the budget: a completion continued into the next step
        # (or a finished group kept for it) is trained one step later than its round, so the producer
        # runs at most k - 1 batches ahead (k = 1: none, APRIL's own synchronous setting).
        self._gate = StalenessGate(
            self.k - 1 if self.cfg.async_.partial_rollouts else self.k,
            start_step,
            self.trainer.policy_version,
        )
        threads_before = torch.get_num_threads()
        if not torch.cuda.is_available():
            # On CPU both threads run torch ops at once: each with the whole intra-op pool
            # oversubscribes the cores (bench/async.py, 2 cores: 5,829 generated tokens/s at k = 2
            # with 2 threads each, 8,247 with 1 each). Split the cores between them.
            self._threads = max(1, threads_before // 2)
            torch.set_num_threads(self._threads)
        try:
            self._thread = threading.Thread(
                target=self._produce_loop, args=(start_step,), name="rollout-producer", daemon=True
            )
            self._thread.start()
            try:
                outcome = super().run(start_step)
            finally:
                self._gate.close()  # a producer waiting at the gate leaves; a failed run does not wait for it
            self._thread.join()  # a clean end lets the batch being generated finish
        finally:
            # The setting is the process's: whatever runs after this loop (the next run in a test
            # process, the final evaluation of a caller) gets all its threads back.
            torch.set_num_threads(threads_before)
        return outcome
