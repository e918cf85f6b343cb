"""Asynchronous RL: the staleness bound, k = 0 equivalence, the off-policy correction, resume.

The bound is checked twice: a property test drives the producer/trainer gate with real threads
and random durations, and real runs report every batch's staleness (the orchestrator also
refuses any batch over the bound, so a run that ends ``succeeded`` never trained on one).
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.run
from engine.algorithms.off_policy import importance_weights
from engine.config import ConfigError, build_config, load_config
from engine.contracts import EXIT_SUCCEEDED
from engine.pipeline.async_loop import AsyncOrchestrator, GateClosed, StalenessGate
from engine.run import execute
from tests.engine.test_run import cancel_then_resume, metrics_by_step, read_events, small_config

# ----------------------------------------------------------------------------- the gate


@settings(max_examples=25, deadline=None)
@given(
    k=st.integers(0, 4),
    steps=st.integers(1, 25),
    seed=st.integers(0, 2**16),
)
def test_staleness_never_exceeds_k_whatever_the_durations(k: int, steps: int, seed: int) -> None:
    """A producer thread and a trainer with random generate/train times (0-3 ms each): the
    version each batch was generated with never lags the trainer's by more than k, and with a
    slow trainer the producer does run ahead (the bound is reached, not just respected)."""
    rng = random.Random(seed)
    gen_s = [rng.random() * 0.003 for _ in range(steps + 1)]
    train_s = [rng.random() * 0.003 for _ in range(steps + 1)]
    gate = StalenessGate(k, trained_step=0, trained_version=0)
    version = 0  # the trainer's policy version; one update per step
    handed: list[tuple[int, int]] = []
    cond = threading.Condition()

    def produce() -> None:
        for step in range(1, steps + 1):
            gate.wait(step)
            generated_with = version  # the newest weights when generation starts
            time.sleep(gen_s[step])
            with cond:
                handed.append((step, generated_with))
                cond.notify_all()

    thread = threading.Thread(target=produce)
    thread.start()
    lags = []
    for step in range(1, steps + 1):
        with cond:
            while len(handed) < step:
                cond.wait()
            got, generated_with = handed[step - 1]
        assert got == step
        lags.append(version - generated_with)
        time.sleep(train_s[step])
        version += 1
        gate.trained(step, version)
    thread.join()
    assert max(lags) <= k, lags


def test_a_slow_trainer_lets_the_producer_run_exactly_k_ahead() -> None:
    gate = StalenessGate(2, trained_step=0, trained_version=0)
    assert [gate.may_generate(s) for s in (1, 2, 3, 4)] == [True, True, True, False]
    gate.trained(1, 1)
    assert gate.may_generate(4) and not gate.may_generate(5)
    outcome: list[str] = []

    def wait_for_step_9() -> None:
        try:
            gate.wait(9)
            outcome.append("passed")
        except GateClosed:
            outcome.append("closed")

    waiting = threading.Thread(target=wait_for_step_9)
    waiting.start()
    gate.close()
    waiting.join(timeout=10)
    assert outcome == ["closed"]


# ----------------------------------------------------------------------------- the correction


def test_importance_weights_are_one_when_behaviour_and_proximal_coincide() -> None:
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 7, generator=gen) * 3
    mask = (torch.arange(7) < torch.tensor([[7], [3], [5], [1]])).float()
    weights, m = importance_weights(lp, lp.clone(), mask, cap=2.0, mask_threshold=2.0)
    assert torch.equal(weights, mask)
    assert m["offpolicy/ess"] == pytest.approx(1.0)
    assert m["offpolicy/is_weight_mean"] == m["offpolicy/is_weight_max"] == 1.0
    assert m["offpolicy/is_truncated_frac"] == m["offpolicy/masked_seq_frac"] == 0.0


def test_importance_weights_truncate_mask_and_measure() -> None:
    behaviour = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    proximal = torch.log(torch.tensor([[0.5, 0.25, 1.0], [1.0, 1.0, 1.0], [0.5, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # Raw weights: row 0 = 1, 0.5, 2; row 1 = 2, 2 (pad ignored); row 2 = 1.
    weights, m = importance_weights(proximal, behaviour, mask, cap=1.5)
    assert torch.allclose(weights, torch.tensor([[1.0, 0.5, 1.5], [1.5, 1.5, 0.0], [1.0, 0.0, 0.0]]))
    assert m["offpolicy/is_weight_max"] == pytest.approx(2.0)
    assert m["offpolicy/is_weight_mean"] == pytest.approx((1 + 0.5 + 2 + 2 + 2 + 1) / 6)
    assert m["offpolicy/is_truncated_frac"] == pytest.approx(3 / 6)
    w = torch.tensor([1.0, 0.5, 1.5, 1.5, 1.5, 1.0])
    assert m["offpolicy/ess"] == pytest.approx(float(w.sum() ** 2 / (6 * (w * w).sum())))
    # Row 1's geometric-mean weight is 2: outside [1/1.9, 1.9], so the whole sequence goes.
    weights, m = importance_weights(proximal, behaviour, mask, cap=1.5, mask_threshold=1.9)
    assert torch.equal(weights[1], torch.zeros(3)) and weights[0, 0] == 1.0
    assert m["offpolicy/masked_seq_frac"] == pytest.approx(1 / 3)


def test_async_config_errors_and_the_moved_field() -> None:
    with pytest.raises(ConfigError, match=r"async.mask_sequences_above: 0.5 would mask every sequence"):
        load_config("grpo", ["async.mask_sequences_above=0.5"])
    with pytest.raises(ConfigError, match=r"async.max_staleness"):
        load_config("grpo", ["async.max_staleness=-1"])
    # trainer.max_staleness (before the async section existed) is refused with where it went.
    with pytest.raises(ConfigError) as info:
        build_config({"trainer": {"max_staleness": 0}})
    assert info.value.problems == [("trainer.max_staleness", "moved to async.max_staleness: set it there instead")]


# ----------------------------------------------------------------------------- whole runs

NONDETERMINISTIC = ("timing_s/", "perf/", "async/", "system/")


def deterministic(metrics: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    return {s: {k: v for k, v in m.items() if not k.startswith(NONDETERMINISTIC)} for s, m in metrics.items()}


# How far a metric the model computes may move when only the order of fp32 additions changes.
#
# On CPU the async loop gives the trainer and the producer n // 2 of torch's n intra-op threads each
# (AsyncOrchestrator.run), the synchronous loop all n; a reduction split across another number of
# threads adds in another order. (At equal thread counts the two runs are bit-identical: checked with
# both at 1 thread.) Regrouping a sum of m fp32 terms moves it by at most 2*gamma_m ~ 2*m*u*sum|terms|,
# and by about sqrt(m)*u*sum|terms| when the rounding errors are independent (u = 2**-24; Higham,
# "Accuracy and Stability of Numerical Algorithms", 2002, sections 2.8 and 4.2). Here:
# * a log-prob l = z_y - logsumexp(z) over V = 512 logits: the sum of exp(z) moves by sqrt(512)*u
#   ~ 1.4e-6 relative, so l by ~1.4e-6 absolute, plus the final rounding u*|l| ~ 5e-7 (|l| < 8); the
#   layers' sums (64 and 128 terms, logits |z| < 2) add less. Training does not amplify it: Adam's
#   step lr*m/sqrt(v) is invariant to the gradient's scale, so a relative change d in a gradient
#   moves a weight by ~lr*d = 5e-5*d per update. LOGPROB_TOL = 1e-5 is 5x the estimate. Measured
#   with 2, 3, 4 and 8 threads against n // 2: entropy within 1.8e-7, the differences below within
#   2.5e-8, grad_norm within 1.1e-7 relative; rollout/logprob_diff_max, the same effect between the
#   sampler's and the trainer's passes inside one run, is 9.5e-7 (2 ulps of l).
# * Means of differences of log-probs (ppo_kl; logprob_diff; kl_loss and mismatch_kl, k3 estimators
#   of slope e^x - 1 with |x| < 1) move by at most 2 * LOGPROB_TOL, absolute: their values are
#   themselves rounding-sized (mismatch_kl ~ 1e-14), so no relative bound holds. pg_loss moves by
#   |A| * ratio times that, with |A| <= (n - 1) / sqrt(n) = 1.5 for GRPO's standardised advantages in
#   groups of n = 4 and ratio <= 1.2; entropy (two sums over V) by 2 * LOGPROB_TOL.
# * grad_norm is a norm: relative, 10 * LOGPROB_TOL (its sums are as long as the forward's, through
#   the backward's twice the depth).
# Everything else is decided by tokens and rewards (lengths, token counts, rewards, advantages,
# accuracy, the learning rate, clip fractions: no ratio comes near 1 +- 0.2 at lr 5e-5 here) and
# must match exactly. A different sum could change a sampled token only if its uniform fell within
# the logits' change of a boundary of the inverse CDF (engine/rollout/torch_backend.py): ~1e-6 per
# token, ~1e-3 for the ~700 tokens a run draws; it would show in the exact checks, on every run on
# that machine (it is deterministic), not as a flake.
LOGPROB_TOL = 1e-5
MODEL_FLOAT_ATOL = {
    "actor/ppo_kl": 2 * LOGPROB_TOL,
    "actor/kl_loss": 2 * LOGPROB_TOL,
    "rollout/logprob_diff_mean": 2 * LOGPROB_TOL,
    "rollout/logprob_diff_max": 2 * LOGPROB_TOL,
    "rollout/mismatch_kl": 2 * LOGPROB_TOL,
    "actor/pg_loss": 1.5 * 1.2 * 2 * LOGPROB_TOL,
    "actor/entropy": 2 * LOGPROB_TOL,
}
MODEL_FLOAT_RTOL = {"actor/grad_norm": 10 * LOGPROB_TOL}


def assert_same_up_to_summation_order(
    got: dict[int, dict[str, float]], want: dict[int, dict[str, float]]
) -> None:
    """The same steps and metric names; the model's floats within the bounds above, the rest exactly."""
    assert sorted(got) == sorted(want)
    for step, metrics in want.items():
        assert sorted(got[step]) == sorted(metrics), step
        for name, expected in metrics.items():
            value = got[step][name]
            if name in MODEL_FLOAT_ATOL:
                assert abs(value - expected) <= MODEL_FLOAT_ATOL[name], (step, name, value, expected)
            elif name in MODEL_FLOAT_RTOL:
                bound = MODEL_FLOAT_RTOL[name] * abs(expected)
                assert abs(value - expected) <= bound, (step, name, value, expected)
            else:
                assert value == expected, (step, name, value, expected)


def test_the_async_machinery_at_k0_reproduces_the_synchronous_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The producer thread, the gate, the weight snapshots and the rollout backend's own copy of
    the policy, at k = 0, give the synchronous loop's tokens, rewards and counts exactly, step for
    step, and its model-computed floats up to the order of the fp32 sums, which depends on how many
    threads each loop gives torch (see LOGPROB_TOL)."""
    sync_cfg = build_config(small_config(tiny_model_dir, tmp_path / "sync", total_steps=4))
    assert execute(sync_cfg) == EXIT_SUCCEEDED
    monkeypatch.setattr(engine.run, "orchestrator_class", lambda cfg: AsyncOrchestrator)
    threaded = build_config(small_config(tiny_model_dir, tmp_path / "threaded", total_steps=4))
    threads = torch.get_num_threads()
    assert execute(threaded) == EXIT_SUCCEEDED
    assert torch.get_num_threads() == threads  # the loop halves them on CPU while it runs, then gives them back
    sync = metrics_by_step(read_events(tmp_path / "sync" / "events.jsonl"))
    run = metrics_by_step(read_events(tmp_path / "threaded" / "events.jsonl"))
    # The rollout backend's version at the end of a step: the synchronous loop loads the new
    # weights right after the update, the producer just before it generates the next batch.
    for s in range(1, 5):
        assert (sync[s].pop("rollout/policy_version"), run[s].pop("rollout/policy_version")) == (s, s - 1)
    assert_same_up_to_summation_order(deterministic(run), deterministic(sync))
    assert all(run[s]["async/staleness_max"] == 0 for s in range(1, 5))


@pytest.mark.parametrize("k", [1, 3])
def test_an_async_run_keeps_its_bound_and_corrects(k: int, tiny_model_dir: Path, tmp_path: Path) -> None:
    raw = small_config(tiny_model_dir, tmp_path / "run", total_steps=8)
    raw["async"] = {"max_staleness": k, "mask_sequences_above": 4.0, "scale_lr_by_ess": True}
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    events = read_events(tmp_path / "run" / "events.jsonl")
    metrics = metrics_by_step(events)
    states = [e["state"] for e in events if e["type"] == "status"]
    # "starting" once per preparing phase (engine/phases.py), then training, then the end.
    assert states == ["starting"] * (len(states) - 2) + ["running", "succeeded"] and len(states) > 3
    for step in range(1, 9):
        m = metrics[step]
        assert 0 <= m["async/staleness_max"] <= k
        assert sum(m[f"async/staleness_hist/{lag}"] for lag in range(k + 1)) == pytest.approx(1.0)
        for name in ("offpolicy/ess", "offpolicy/is_weight_max", "rollout/mismatch_kl", "async/overlap"):
            assert name in m, (step, name)
        assert 0.0 < m["offpolicy/ess"] <= 1.0 + 1e-9
        assert m["actor/lr_scale"] == m["offpolicy/ess"]
        assert 0.0 <= m["async/trainer_idle_ratio"] <= 1.0 and 0.0 <= m["async/producer_idle_ratio"] <= 1.0
    # The first k + 1 batches come from the starting weights: batch s lags s - 1 versions.
    assert [metrics[s]["async/staleness_max"] for s in range(1, k + 2)] == list(range(k + 1))


def test_cancel_checkpoints_and_resume_continues(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(tiny_model_dir, tmp_path / "run", total_steps=500)
    cfg["async"] = {"max_staleness": 2}
    ckpt = cancel_then_resume(cfg, tmp_path, after_step=3, more_steps=3)
    state = json.loads((Path(ckpt["path"]) / "state.json").read_text())
    # The data position is that of the next batch to train, not of the ones generated ahead.
    assert state["sampler"]["position"] == ckpt["step"] * cfg["trainer"]["prompts_per_step"], state["sampler"]


def test_scale_lr_by_ess_scales_each_update_and_never_compounds(tiny_model_dir: Path, tmp_path: Path) -> None:
    """AdamW's first step moves every weight by lr * (its normalised gradient + decay): a step at
    half the rate moves each weight exactly half as far; the schedule itself is untouched."""
    from engine.models import load_model
    from engine.trainer import TorchTrainer
    from tests.engine.test_trainer_deepspeed import make_batch, run_config

    cfg = run_config(tiny_model_dir, tmp_path, "torch", 0)
    cfg.trainer.ppo_epochs, cfg.trainer.ppo_mini_batch_size = 1, None  # one optimiser step
    moved, lrs = {}, {}
    for scale in (1.0, 0.5):
        torch.manual_seed(0)
        model = load_model(tiny_model_dir)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = TorchTrainer(model, cfg, device=torch.device("cpu"), need_reference=True)
        batch = make_batch(model.config.vocab_size, 1)
        batch.old_log_probs = trainer.compute_log_probs(batch)
        batch.ref_log_probs = trainer.compute_log_probs(batch, reference=True)
        batch.extra["lr_scale"] = scale
        metrics = trainer.update_policy(batch)
        assert metrics["actor/lr_scale"] == scale
        lrs[scale] = metrics["actor/lr"]
        moved[scale] = {k: v - before[k] for k, v in model.state_dict().items()}
    assert lrs[0.5] == lrs[1.0]
    for name, delta in moved[1.0].items():
        torch.testing.assert_close(moved[0.5][name], delta * 0.5, rtol=1e-4, atol=1e-7, msg=name)


def test_periodic_stays_on_policy_and_prefills_the_log_probs(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Periodic mode: slices are handed over while the batch generates and their old and reference
    log-probs computed then. They line up with the final batch row for row: the trainer's log-probs
    equal the sampler's (fp32, same weights), which a misaligned row or a stale weight would break."""
    with pytest.raises(ConfigError, match=r"async.periodic: the on-policy overlap needs async.max_staleness 0"):
        load_config("grpo", ["async.periodic=true", "async.max_staleness=1"])
    raw = small_config(tiny_model_dir, tmp_path / "run", total_steps=4)  # 2 epochs x 2 mini-batches, KL loss
    raw["async"] = {"periodic": True, "periodic_slices": 3}
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    metrics = metrics_by_step(read_events(tmp_path / "run" / "events.jsonl"))
    for step in range(1, 5):
        m = metrics[step]
        assert m["async/staleness_max"] == 0 and m["async/prefilled_frac"] == 1.0
        assert "timing_s/old_logprob" not in m and "timing_s/ref" not in m  # done during generation
        assert m["rollout/logprob_diff_max"] < 1e-4 and m["rollout/mismatch_kl"] < 1e-6
        assert "offpolicy/ess" not in m  # on-policy: no correction


def test_rollout_device_places_the_rollout_copy(tiny_model_dir: Path, tmp_path: Path) -> None:
    """rollout.device puts the generating copy of the policy on a device of its own (a second GPU
    beside the trainer's); here the CPU, the only device, and a GPU this machine lacks."""
    vllm_apart = load_config("grpo", ["rollout.backend=vllm", "rollout.device=cuda:1"])
    assert vllm_apart.rollout.in_own_process  # vLLM takes its process's first GPU: it gets a process
    assert not load_config("grpo", ["rollout.backend=vllm"]).rollout.in_own_process
    with pytest.raises(ConfigError, match=r"rollout.device"):
        load_config("grpo", ["rollout.device=gpu0"])
    raw = small_config(tiny_model_dir, tmp_path / "run", total_steps=2)
    raw["rollout"]["device"] = "cpu"
    raw["async"] = {"max_staleness": 1}
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    if not torch.cuda.is_available():
        raw = small_config(tiny_model_dir, tmp_path / "gpu", total_steps=2)
        raw["rollout"]["device"] = "cuda:1"
        with pytest.raises(ValueError, match=r"rollout.device is 'cuda:1' but this machine shows 0 CUDA device"):
            execute(build_config(raw))


# ----------------------------------------------------------------------------- stale samples


def test_the_gate_bounds_the_version_the_trainer_will_train_with() -> None:
    """``version_bound(s)``: the version after the last reported step plus one per step still to
    train before s; a step that did not update (its batch all filtered out) tightens it."""
    gate = StalenessGate(1, trained_step=4, trained_version=4)
    assert [gate.version_bound(s) for s in (5, 6, 7)] == [4, 5, 6]
    gate.trained(5, 4)  # step 5 trained nothing
    assert [gate.version_bound(s) for s in (6, 7)] == [4, 5]
    gate.trained(6, 5)
    assert gate.version_bound(7) == 5 and gate.may_generate(8) and not gate.may_generate(9)


def test_stale_samples_defaults_to_wait_and_names_its_choices() -> None:
    assert load_config("grpo", []).async_.stale_samples == "wait"
    assert load_config("grpo", ["async.stale_samples=drop"]).async_.stale_samples == "drop"
    with pytest.raises(ConfigError, match=r"async.stale_samples"):
        load_config("grpo", ["async.stale_samples=later"])


@pytest.mark.parametrize("stale_samples", ["wait", "drop"])
def test_whole_rounds_never_drop_under_either_setting(
    stale_samples: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Without partial rollouts the gate alone keeps every batch within k: nothing to drop or force."""
    raw = small_config(tiny_model_dir, tmp_path / "run", total_steps=4)
    raw["async"] = {"max_staleness": 1, "stale_samples": stale_samples}
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    metrics = metrics_by_step(read_events(tmp_path / "run" / "events.jsonl"))
    for step in range(1, 5):
        assert metrics[step]["async/dropped_stale"] == 0 and metrics[step]["async/staleness_max"] <= 1
        assert "partial/forced_groups" not in metrics[step]
