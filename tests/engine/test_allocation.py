"""Adaptive group size (``rollout.n_schedule: frontier``, engine/data/allocation.py): the allocation's
budget and bounds, groups of different sizes through every advantage estimator and the filter, and
tiny runs (sync, async, partial rollouts) that allocate, train and report ``rollout/n_*``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.algorithms import get_adv_estimator_fn
from engine.algorithms.masked_ops import masked_whiten
from engine.batch import Rollout, collate
from engine.config import ConfigError, build_config
from engine.contracts import ADV_ESTIMATORS, EXIT_SUCCEEDED
from engine.data import Prompt, PromptSelector, load_prompts
from engine.data.allocation import allocate, frontier_weights, round_to_budget, water_fill
from engine.models import load_model, load_tokenizer
from engine.pipeline.learner import Learner
from engine.pipeline.producer import RolloutProducer, StepTally, groups_of
from engine.rewards import RewardManager, RewardResult
from engine.rollout import Completion, make_rollout_backend
from engine.run import execute
from engine.trainer import make_trainer
from tests.engine.test_run import metrics_by_step, read_events, small_config

# ----------------------------------------------------------------------------- the allocation


def test_the_allocation_spends_the_budget_exactly_within_the_bounds() -> None:
    rng = np.random.default_rng(0)
    for trial in range(300):
        k = int(rng.integers(1, 40))
        n_min = int(rng.integers(2, 5))
        n = int(rng.integers(n_min, 12))
        n_max = int(rng.integers(n, 25))
        p = rng.uniform(0.001, 0.999, size=k)
        if trial % 3 == 0:  # ties and extremes
            p = rng.choice([0.01, 0.5, 0.99], size=k)
        measured = rng.random(k) < 0.8
        sizes = allocate(p.tolist(), measured.tolist(), n=n, n_min=n_min, n_max=n_max).sizes
        assert sum(sizes) == k * n, (trial, sizes)
        assert all(n_min <= s <= n_max for s in sizes), (trial, sizes)
        assert all(s == n for s, m in zip(sizes, measured, strict=True) if not m)  # unmeasured keep n


def test_frontier_prompts_get_more_and_solved_or_hopeless_ones_fewer() -> None:
    p = [0.5, 0.02, 0.98, 0.3, 0.5]
    a = allocate(p, [True] * 5, n=8, n_min=2, n_max=16)
    s = a.sizes
    assert sum(s) == 40
    # sigma = sqrt(p(1-p)): 0.5, 0.14, 0.14, 0.458, 0.5 (sum 1.738); 40 / 1.738 x sigma = 11.50, 3.22,
    # 3.22, 10.54, 11.50: floors 38, the 2 left go to the largest remainders (.54, then the first .50).
    assert s == [12, 3, 3, 11, 11]
    m = a.metrics()
    assert m["rollout/n_mean"] == 8.0 and m["rollout/n_min"] == s[1] and m["rollout/n_max"] == s[0]
    assert (m["rollout/n_groups_more"], m["rollout/n_groups_fewer"]) == (3.0, 2.0)
    # Proportional where no bound binds: the real sizes are lambda x sigma exactly.
    real = water_fill(frontier_weights(np.array(p)), 40, 2, 16)
    assert real.sum() == pytest.approx(40) and real[0] / real[3] == pytest.approx(0.5 / np.sqrt(0.21))


def test_bounds_bind_and_equal_estimates_keep_n() -> None:
    assert allocate([0.5, 0.001, 0.001, 0.001], [True] * 4, n=4, n_min=2, n_max=10).sizes == [10, 2, 2, 2]
    assert allocate([0.4] * 6, [True] * 6, n=5, n_min=2, n_max=9).sizes == [5] * 6
    # Largest remainder: 3 equal prompts, 10 completions -> 4, 3, 3 (ties to the earlier prompt).
    assert round_to_budget(np.array([10 / 3] * 3), 10, 2, 8) == [4, 3, 3]
    with pytest.raises(ValueError, match="n_min <= n <= n_max"):
        allocate([0.5], [True], n=1, n_min=2, n_max=4)


def test_the_config_names_the_field_and_the_fix(tiny_model_dir: Path, tmp_path: Path) -> None:
    raw = small_config(tiny_model_dir, tmp_path)
    assert build_config(raw).rollout.n_schedule == "fixed"
    for rollout, message in [
        ({"n_schedule": "frontier", "n": 4, "n_min": 5, "n_max": 8}, "rollout.n_min: 5 is above rollout.n 4"),
        ({"n_schedule": "frontier", "n": 4, "n_min": 2, "n_max": 3}, "rollout.n_max: 3 is below rollout.n 4"),
        ({"n_schedule": "frontier", "n_min": 1}, "n_min"),
        ({"n_schedule": "sometimes"}, "n_schedule"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build_config(raw | {"rollout": raw["rollout"] | rollout})


# ----------------------------------------------------------------------------- groups of any size


def uneven_batch(sizes: list[int], seed: int = 0):
    """Groups of ``sizes`` rows with random 0/1/partial rewards and response lengths, rows shuffled."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for g, size in enumerate(sizes):
        prompt = Prompt(uid=f"p{g}", text="", raw="", token_ids=[5, 6, 7])
        for _ in range(size):
            r_len = int(torch.randint(1, 6, (1,), generator=gen))
            reward = float(torch.randint(0, 3, (1,), generator=gen)) / 2
            completion = Completion([9] * r_len, [-1.0] * r_len, "", "stop", 0)
            rows.append(Rollout(prompt, [5, 6, 7], completion, reward, {}, group=f"g{g}"))
    order = torch.randperm(len(rows), generator=gen).tolist()
    return collate([rows[i] for i in order], pad_id=0, policy_version=0)


def estimate(name: str, batch, **kwargs):
    fn = get_adv_estimator_fn(name)
    adv, _ = fn(
        token_level_rewards=batch.token_level_scores,
        response_mask=batch.response_mask,
        index=batch.index,
        **kwargs,
    )
    return adv


GROUP_LOCAL = [
    e for e in ADV_ESTIMATORS if e not in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg")
]
"""Estimators whose advantage of a row depends on its own group only (GPG's alpha and REINFORCE++'s
whitening are batch-wide; they are checked by formula below)."""


@pytest.mark.parametrize("name", GROUP_LOCAL)
def test_groups_of_different_sizes_get_their_own_advantages(name: str) -> None:
    """Each group of an uneven batch gets exactly what the estimator gives that group alone."""
    batch = uneven_batch([2, 5, 3, 7, 2])
    together = estimate(name, batch)
    for gid in sorted(set(batch.index)):
        rows = [i for i, g in enumerate(batch.index) if g == gid]
        alone = estimate(name, batch.select(rows))
        assert torch.allclose(together[rows], alone, atol=1e-6), (name, gid)


def test_group_estimators_match_their_formulas_on_uneven_groups() -> None:
    batch = uneven_batch([2, 6, 3, 9], seed=1)
    scores = batch.token_level_scores.sum(-1)
    mask = batch.response_mask
    grpo, dr_grpo = estimate("grpo", batch), estimate("grpo", batch, norm_adv_by_std_in_grpo=False)
    rloo, rpp_base = estimate("rloo", batch), estimate("reinforce_plus_plus_baseline", batch)
    centred = torch.empty_like(scores)
    for gid in set(batch.index):
        rows = [i for i, g in enumerate(batch.index) if g == gid]
        s = scores[rows]
        n = len(rows)
        mean, std = s.mean(), s.std()  # unbiased, over this group's n rows
        centred[rows] = s - mean
        for j, i in enumerate(rows):
            by_hand = {
                "grpo": (s[j] - mean) / (std + 1e-6),  # GRPO, arXiv:2402.03300
                "dr": s[j] - mean,  # Dr. GRPO, arXiv:2503.20783
                "rloo": (n * s[j] - s.sum()) / (n - 1),  # RLOO, arXiv:2402.14740
            }
            valid = mask[i].bool()
            assert torch.allclose(grpo[i][valid], by_hand["grpo"].expand(int(valid.sum())), atol=1e-5)
            assert torch.allclose(dr_grpo[i][valid], by_hand["dr"].expand(int(valid.sum())), atol=1e-6)
            assert torch.allclose(rloo[i][valid], by_hand["rloo"].expand(int(valid.sum())), atol=1e-5)
    # REINFORCE++-baseline: group-mean baseline of each uneven group, then whitening over the batch's tokens.
    expected = masked_whiten(centred.unsqueeze(-1) * mask, mask) * mask
    assert torch.allclose(rpp_base, expected, atol=1e-5)


def test_dynamic_sampling_filters_uneven_groups_by_their_own_rows(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """DAPO's filter (arXiv:2503.14476, 3.2) judges each group whatever its size: all-equal groups go."""
    raw = small_config(tiny_model_dir, tmp_path)
    raw["algorithm"]["filter_groups"] = {"enable": True, "metric": "acc"}
    raw["rollout"] |= {"n_schedule": "frontier", "n_min": 2, "n_max": 8}
    cfg = build_config(raw)
    rows = []
    pattern = {"a": [1, 1], "b": [0, 1, 0, 0, 0, 0, 0], "c": [0, 0, 0], "d": [1, 0, 1, 1, 1]}
    for uid, accs in pattern.items():
        prompt = Prompt(uid=uid, text="", raw="", token_ids=[5])
        for acc in accs:
            c = Completion([9], [-1.0], "", "stop", 0)
            rows.append(Rollout(prompt, [5], c, float(acc), {"task": float(acc)}, group=f"1:{uid}"))
    tally = StepTally(cfg, want=4)
    result = RewardResult(total=[r.reward for r in rows], components={"task": [r.reward for r in rows]})
    tally.add_scored(rows, result)
    assert [g[0].prompt.uid for g in tally.kept] == ["b", "d"]
    assert [len(g) for g in tally.kept] == [7, 5] and tally.zero_std_groups == 2
    assert [len(g) for g in groups_of(rows)] == [2, 7, 3, 5]


# ----------------------------------------------------------------------------- a real round


def test_a_real_round_generates_the_allocated_sizes_and_trains_on_them(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The tiny policy generates a frontier round from prompts measured beforehand (hopeless, solved,
    frontier, rare): each group holds exactly its allocated completions of its own prompt, and the
    learner's advantages (GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline) and a GSPO update run on them."""
    raw = frontier_config(tiny_model_dir, tmp_path)
    raw["data"]["train_size"] = 16
    raw["algorithm"] |= {"policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean", "use_kl_loss": False}
    cfg = build_config(raw)
    model, tokenizer = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    splits = load_prompts(cfg.data, tokenizer, seed=0)
    selector = PromptSelector.from_config(cfg, splits.train)
    patterns = [[0.0] * 6, [1.0] * 6, [1.0, 0.0] * 3, [1.0] + [0.0] * 5]
    for i, prompt in enumerate(splits.train):
        selector.observe(prompt.uid, patterns[i % 4], step=0)
    before = selector.stats.state_dict()  # the round records its groups: allocate from these
    backend = make_rollout_backend("torch", model, tokenizer, max_batch_size=64)
    with RewardManager(cfg.reward.functions, timeout_s=5, workers=1) as rewards:
        producer = RolloutProducer(
            cfg, sampler=selector, backend=backend, rewards=rewards, pad_id=tokenizer.pad_token_id
        )
        produced = producer.produce(1)
    batch = produced.batch
    assert batch is not None
    groups = groups_of(batch.rows)
    prompts = [g[0].prompt for g in groups]
    expected = allocate(
        [before[p.uid].mean for p in prompts], [True] * len(prompts), n=4, n_min=2, n_max=8
    ).sizes
    assert [len(g) for g in groups] == expected and sum(expected) == 16
    assert len(set(expected)) > 1  # the measured pass rates differ, so do the sizes
    assert all(len({r.prompt.uid for r in g}) == 1 for g in groups)
    assert produced.metrics["rollout/n_mean"] == 4.0
    trainer = make_trainer("torch", model, cfg, device=torch.device("cpu"), need_reference=False)
    for estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        for norm in (True, False):
            c = cfg.model_copy(deep=True)
            c.algorithm.adv_estimator = estimator
            c.algorithm.norm_adv_by_std_in_grpo = norm
            Learner(c, trainer).prepare(batch)
            assert batch.advantages is not None and bool(torch.isfinite(batch.advantages).all())
    metrics = Learner(cfg, trainer).train(batch)
    assert np.isfinite(metrics["actor/grad_norm"])


# ----------------------------------------------------------------------------- runs


def frontier_config(model_dir: Path, out: Path, **extra: object) -> dict:
    raw = small_config(model_dir, out, total_steps=4)
    raw["data"]["train_size"] = 8  # 4 prompts a step: every prompt is measured by step 3
    raw["rollout"] |= {"n_schedule": "frontier", "n": 4, "n_min": 2, "n_max": 8}
    raw["checkpoint"] = {"every_steps": 2, "keep_last": 5}
    raw["trainer"] |= {"ppo_epochs": 1, "eval_every": 0}  # seconds, not minutes, on a busy 2-core machine
    raw["algorithm"]["use_kl_loss"] = False
    # The random tiny policy never solves arithmetic; an "a" in the completion is a success it has
    # sometimes, so the prompts' pass rates differ and the allocation has something to tell apart (on
    # this machine steps 3 and 4 allocate 3 to 5 completions; not asserted: sampling is the CPU's).
    raw["reward"] = {"functions": [{"name": "format", "params": {"regex": "a"}}]}
    raw["rollout"]["temperature"] = 0.5
    return raw | extra


def check_frontier_metrics(metrics: dict[int, dict[str, float]]) -> None:
    for s in (1, 2, 3, 4):
        m = metrics[s]
        assert m["rollout/n_mean"] == 4.0, (s, m)  # the budget: prompts_per_step x rollout.n
        assert 2 <= m["rollout/n_min"] <= 4 <= m["rollout/n_max"] <= 8
        assert m["rollout/n_groups_more"] >= 0 and m["rollout/n_groups_fewer"] >= 0
    # Step 1 measures nothing yet: every prompt keeps n.
    assert (metrics[1]["rollout/n_min"], metrics[1]["rollout/n_max"]) == (4.0, 4.0)


def test_a_sync_frontier_run_allocates_and_resumes_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    raw = frontier_config(tiny_model_dir, tmp_path / "a")
    # GSPO (arXiv:2507.18071): sequence-level ratios over groups of any size.
    raw["algorithm"] |= {"policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean"}
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    events = read_events(tmp_path / "a" / "events.jsonl")
    metrics = metrics_by_step(events)
    check_frontier_metrics(metrics)
    checkpoints = [e for e in events if e["type"] == "checkpoint"]
    raw_b = frontier_config(tiny_model_dir, tmp_path / "b")
    raw_b["algorithm"] = raw["algorithm"]
    assert execute(build_config(raw_b), resume=checkpoints[0]["path"]) == EXIT_SUCCEEDED
    again = metrics_by_step(read_events(tmp_path / "b" / "events.jsonl"))
    for s in (3, 4):
        assert again[s] == pytest.approx(metrics[s], rel=1e-6, abs=1e-7), s


@pytest.mark.parametrize(
    "extra",
    [
        {"async": {"max_staleness": 1}},
        {"async": {"max_staleness": 2, "partial_rollouts": True, "partial_chunk_tokens": 3}},
        {"async": {"periodic": True, "periodic_slices": 2}},
        {"async": {}, "algorithm": {"filter_groups": {"enable": True, "max_num_gen_batches": 3}}},
    ],
    ids=["async", "partial", "periodic", "sync-dynamic-sampling"],
)
def test_frontier_runs_finish_in_every_mode(tiny_model_dir: Path, tmp_path: Path, extra: dict) -> None:
    raw = frontier_config(tiny_model_dir, tmp_path / "run", **extra)
    raw["algorithm"]["adv_estimator"] = "rloo"
    dynamic = raw["algorithm"].get("filter_groups", {}).get("enable", False)
    raw["trainer"]["eval_every"] = 0
    raw["checkpoint"] = {"every_steps": 0}
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    metrics = metrics_by_step(read_events(tmp_path / "run" / "events.jsonl"))
    assert sorted(metrics) == [0, 1, 2, 3, 4]  # 0: the evaluation before training
    # Partial rollouts allocate when they top the pool up, which a step may not need to do.
    allocated = [m for s, m in metrics.items() if s and "rollout/n_mean" in m]
    assert len(allocated) >= (2 if "partial_rollouts" in extra["async"] else 4)
    if dynamic:  # DAPO's extra rounds allocate too, each its own budget: the mean stays n
        assert all(m["filter/gen_rounds"] >= 1 for s, m in metrics.items() if s)
    for m in allocated:
        assert m["rollout/n_mean"] == 4.0
        assert 2 <= m["rollout/n_min"] <= 4 <= m["rollout/n_max"] <= 8
