"""Parity of ``engine.algorithms`` with verl 0.9.1's ``core_algos`` on random inputs (to 1e-6).

Runs only where verl is importable (a scratch environment, never the project's): verl is not a
dependency of the project. To run it::

    python3 -m venv /tmp/verlenv && /tmp/verlenv/bin/pip install torch==2.13.0
    /tmp/verlenv/bin/pip install --no-deps verl==0.9.1
    /tmp/verlenv/bin/pip install packaging ray tensordict omegaconf "transformers==5.19.0" \
        codetiming orjson numpy pytest hypothesis pydantic pyyaml
    cd /work/main && /tmp/verlenv/bin/python -m pytest tests/engine/test_algorithms_verl_parity.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl.trainer.ppo.core_algos")

from verl.trainer.config import AlgoConfig as VerlAlgoConfig  # noqa: E402
from verl.trainer.config import KLControlConfig as VerlKLControlConfig  # noqa: E402
from verl.utils import torch_functional as verl_F  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from engine import algorithms as ours  # noqa: E402
from engine.config import KLRewardControllerConfig  # noqa: E402

TOL = dict(rtol=1e-6, atol=1e-6)
SEEDS = range(6)


# ----------------------------------------------------------------------------- random inputs


def _mask(gen: torch.Generator, bs: int, length: int, holes: bool = False) -> torch.Tensor:
    """Right-padded response masks (each row at least 2 tokens); ``holes`` adds interior zeros."""
    lengths = torch.randint(2, length + 1, (bs,), generator=gen)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float()
    if holes:
        mask = mask * (torch.rand(bs, length, generator=gen) > 0.2).float()
        mask[:, 0] = 1.0
    return mask


def _outcome_batch(seed: int, binary: bool = False):
    """Groups of mixed sizes (incl. singletons), outcome reward on the last response token."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [4, 4, 1, 3, 5, 2, 1, 4]
    index = np.array([f"uid-{g}" for g, n in enumerate(sizes) for _ in range(n)], dtype=object)
    perm = torch.randperm(len(index), generator=gen).numpy()
    index = index[perm]
    bs, length = len(index), 7
    mask = _mask(gen, bs, length)
    if binary:
        scores = torch.randint(0, 2, (bs,), generator=gen).float()
    else:
        scores = torch.randn(bs, generator=gen) * 2.0 + 0.5
    rewards = torch.zeros(bs, length)
    last = mask.sum(-1).long() - 1
    rewards[torch.arange(bs), last] = scores
    return rewards, mask, index


def _dense_batch(seed: int, holes: bool = False):
    gen = torch.Generator().manual_seed(seed)
    bs, length = 6, 9
    mask = _mask(gen, bs, length, holes=holes)
    rewards = torch.randn(bs, length, generator=gen) * mask
    values = torch.randn(bs, length, generator=gen)
    return rewards, values, mask


def _logprob_batch(seed: int, spread: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    bs, length = 5, 8
    mask = _mask(gen, bs, length)
    old = -torch.rand(bs, length, generator=gen) * 3.0 - 0.05
    new = (old + torch.randn(bs, length, generator=gen) * spread).clamp(max=-1e-3)
    adv = torch.randn(bs, length, generator=gen)
    weights = torch.rand(bs, length, generator=gen) + 0.5
    return old, new, adv, mask, weights


def _actor_config(**overrides) -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2, **overrides)


def _our_config(actor: ActorConfig) -> ours.PolicyLossConfig:
    return ours.PolicyLossConfig(
        clip_ratio=actor.clip_ratio,
        clip_ratio_low=actor.clip_ratio_low,
        clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c,
        loss_agg_mode=actor.loss_agg_mode,
        tau_pos=actor.tau_pos,
        tau_neg=actor.tau_neg,
        global_batch_info=dict(actor.global_batch_info),
    )


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, **TOL)


# ----------------------------------------------------------------------------- masked helpers


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_helpers_match(seed):
    _, values, mask = _dense_batch(seed, holes=True)
    _close(ours.masked_mean(values, mask), verl_F.masked_mean(values, mask))
    _close(ours.masked_mean(values, mask, axis=-1), verl_F.masked_mean(values, mask, axis=-1))
    _close(ours.masked_var(values, mask), verl_F.masked_var(values, mask))
    _close(ours.masked_var(values, mask, unbiased=False), verl_F.masked_var(values, mask, unbiased=False))
    _close(ours.masked_whiten(values, mask), verl_F.masked_whiten(values, mask))
    _close(
        ours.masked_whiten(values, mask, shift_mean=False),
        verl_F.masked_whiten(values, mask, shift_mean=False),
    )


# ----------------------------------------------------------------------------- advantage estimators

GROUP_ESTIMATORS = [
    "grpo",
    "grpo_vectorized",
    "rloo",
    "rloo_vectorized",
    "opo",
    "gpg",
    "reinforce_plus_plus_baseline",
]


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_group_estimators_match(name, seed, binary):
    rewards, mask, index = _outcome_batch(seed, binary=binary)
    kwargs = dict(token_level_rewards=rewards, response_mask=mask, index=index)
    want_adv, want_ret = verl.get_adv_estimator_fn(name)(**kwargs, config=VerlAlgoConfig())
    got_adv, got_ret = ours.get_adv_estimator_fn(name)(**kwargs, config=ours.AlgoConfig())
    _close(got_adv, want_adv)
    _close(got_ret, want_ret)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["grpo", "grpo_vectorized"])
def test_grpo_norm_flag_matches(name, seed, norm):
    rewards, mask, index = _outcome_batch(seed)
    kwargs = dict(
        token_level_rewards=rewards,
        response_mask=mask,
        index=index,
        norm_adv_by_std_in_grpo=norm,
        epsilon=1e-4,
    )
    _close(ours.get_adv_estimator_fn(name)(**kwargs)[0], verl.get_adv_estimator_fn(name)(**kwargs)[0])


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_passk_matches(seed, norm):
    rewards, mask, index = _outcome_batch(seed)
    keep = np.array([sum(index == k) >= 2 for k in index])  # pass@k needs groups of >= 2
    rewards, mask, index = rewards[torch.from_numpy(keep)], mask[torch.from_numpy(keep)], index[keep]
    kwargs = dict(token_level_rewards=rewards, response_mask=mask, index=index)
    want = verl.compute_grpo_passk_outcome_advantage(**kwargs, config=VerlAlgoConfig(norm_adv_by_std_in_grpo=norm))
    got = ours.compute_grpo_passk_outcome_advantage(**kwargs, config=ours.AlgoConfig(norm_adv_by_std_in_grpo=norm))
    _close(got[0], want[0])
    _close(got[1], want[1])


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_matches(seed, holes, gamma):
    rewards, _, mask = _dense_batch(seed, holes=holes)
    config = VerlAlgoConfig(gamma=gamma)
    want = verl.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=config)
    got = ours.compute_reinforce_plus_plus_outcome_advantage(
        rewards, mask, config=ours.AlgoConfig(gamma=gamma)
    )
    _close(got[0], want[0])
    _close(got[1], want[1])


def test_every_verl_estimator_we_register_is_checked():
    checked = set(GROUP_ESTIMATORS) | {"grpo_passk", "reinforce_plus_plus"}
    ours_only = {"grpo_median", "mc_grpo"}
    assert set(ours.ADV_ESTIMATOR_REGISTRY) - ours_only == checked
    assert checked <= set(verl.ADV_ESTIMATOR_REGISTRY)


# ----------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ours.LOSS_AGG_MODES)
def test_agg_loss_matches(mode, seed):
    _, loss_mat, mask = _dense_batch(seed, holes=True)
    mask[1] = 0.0  # a fully masked row
    _close(ours.agg_loss(loss_mat, mask, mode), verl.agg_loss(loss_mat, mask, mode))
    extra = dict(dp_size=2, batch_num_tokens=40, global_batch_size=9, loss_scale_factor=16)
    _close(ours.agg_loss(loss_mat, mask, mode, **extra), verl.agg_loss(loss_mat, mask, mode, **extra))


# ----------------------------------------------------------------------------- policy losses

POLICY_LOSSES = ["vanilla", "gspo", "cispo", "sapo", "gpg", "geo_mean", "dppo_tv", "dppo_kl"]
ACTOR_VARIANTS = [
    {},
    {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28},
    {"clip_ratio": 0.1, "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 2.0},
    {"clip_ratio_low": 0.0003, "clip_ratio_high": 0.0004, "tau_pos": 1.5, "tau_neg": 2.0},
]


def _run_loss(module, name, old, new, adv, mask, mode, config, weights):
    log_prob = new.clone().requires_grad_(True)
    loss, metrics = module.get_policy_loss_fn(name)(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=mode,
        config=config,
        rollout_is_weights=weights,
    )
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


@pytest.mark.parametrize("use_weights", [False, True])
@pytest.mark.parametrize("variant", range(len(ACTOR_VARIANTS)))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_policy_losses_match(name, mode, variant, use_weights):
    actor = _actor_config(**ACTOR_VARIANTS[variant])
    for seed in SEEDS:
        old, new, adv, mask, weights = _logprob_batch(seed, spread=0.05 if variant == 3 else 0.3)
        weights = weights if use_weights else None
        want = _run_loss(verl, name, old, new, adv, mask, mode, actor, weights)
        got = _run_loss(ours, name, old, new, adv, mask, mode, _our_config(actor), weights)
        _close(got[0], want[0])
        _close(got[1], want[1])
        assert got[2].keys() == want[2].keys()
        for key in want[2]:
            assert got[2][key] == pytest.approx(want[2][key], rel=1e-6, abs=1e-6), key


def test_policy_losses_match_with_global_batch_info():
    actor = _actor_config(clip_ratio_high=0.28)
    actor.global_batch_info.update(dp_size=2, batch_num_tokens=50, global_batch_size=12, loss_scale_factor=10)
    old, new, adv, mask, _ = _logprob_batch(0)
    for name in POLICY_LOSSES:
        for mode in ours.LOSS_AGG_MODES:
            want = _run_loss(verl, name, old, new, adv, mask, mode, actor, None)
            got = _run_loss(ours, name, old, new, adv, mask, mode, _our_config(actor), None)
            _close(got[0], want[0])
            _close(got[1], want[1])


def test_every_verl_loss_we_register_is_checked():
    assert set(ours.POLICY_LOSS_REGISTRY) == set(POLICY_LOSSES)
    assert set(POLICY_LOSSES) <= set(verl.POLICY_LOSS_REGISTRY)


# ----------------------------------------------------------------------------- KL, entropy, value


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", [*ours.KL_PENALTY_MODES, *(m + "+" for m in ours.KL_PENALTY_MODES)])
def test_kl_penalty_matches(name, seed):
    gen = torch.Generator().manual_seed(seed)
    ref = -torch.rand(4, 6, generator=gen) * 4
    logp = ref + torch.randn(4, 6, generator=gen) * (3.0 if seed % 2 else 0.5)
    logp[0, 0] = ref[0, 0] + 30.0  # exercises the k3 clamps
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    got = ours.kl_penalty(a, ref, name)
    want = verl.kl_penalty(b, ref, name)
    _close(got.detach(), want.detach())
    got.sum().backward()
    want.sum().backward()
    _close(a.grad, b.grad)


def _verl_apply_kl_penalty():
    """verl's own ``ray_trainer.apply_kl_penalty`` (DataProto in, DataProto out), or ``None`` when
    ray_trainer's heavier imports are missing; then its steps are re-stated from verl's primitives."""
    try:
        from verl import DataProto
        from verl.trainer.ppo.ray_trainer import apply_kl_penalty
    except ImportError:
        return None

    def run(scores, old, ref, mask, ctrl, kl_penalty):
        data = DataProto.from_dict(
            tensors={
                "response_mask": mask,
                "token_level_scores": scores,
                "old_log_probs": old,
                "ref_log_prob": ref,
            }
        )
        data, metrics = apply_kl_penalty(data, ctrl, kl_penalty=kl_penalty)
        return data.batch["token_level_rewards"], metrics

    return run


def _restated_apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty):
    kld = verl.kl_penalty(old, ref, kl_penalty=kl_penalty) * mask
    beta = ctrl.value
    current = torch.mean(verl_F.masked_mean(kld, mask=mask, axis=-1), dim=0).item()
    ctrl.update(current_kl=current, n_steps=scores.shape[0])
    return scores - beta * kld, {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta}


@pytest.mark.parametrize("kl_name", ["kl", "low_var_kl"])
@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_kl_controllers_and_apply_kl_penalty_match(kind, kl_name):
    verl_apply = _verl_apply_kl_penalty() or _restated_apply_kl_penalty
    verl_cfg = VerlKLControlConfig(type=kind, kl_coef=0.05, horizon=100, target_kl=0.02)
    our_cfg = KLRewardControllerConfig(type=kind, kl_coef=0.05, horizon=100, target_kl=0.02)
    want_ctrl, got_ctrl = verl.get_kl_controller(verl_cfg), ours.get_kl_controller(our_cfg)
    assert type(got_ctrl).__name__ == type(want_ctrl).__name__
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        scores = torch.randn(6, 7, generator=gen)
        old = -torch.rand(6, 7, generator=gen) * 2
        ref = old + torch.randn(6, 7, generator=gen) * 0.3 * (step + 1)
        mask = _mask(gen, 6, 7)
        want_rewards, want_metrics = verl_apply(scores, old, ref, mask, want_ctrl, kl_name)
        got_rewards, got_metrics = ours.apply_kl_penalty(scores, old, ref, mask, got_ctrl, kl_penalty=kl_name)
        _close(got_rewards, want_rewards)
        assert got_metrics.keys() == want_metrics.keys()
        for key in want_metrics:
            assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-6, abs=1e-9)
        assert got_ctrl.value == pytest.approx(want_ctrl.value, rel=1e-9)
