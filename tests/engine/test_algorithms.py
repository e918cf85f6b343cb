"""engine.algorithms: hand-computed values, invariants (hypothesis) and clipping/KL properties.

No verl here; parity with verl 0.9.1 lives in test_algorithms_verl_parity.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import algorithms as alg
from engine.config import KLRewardControllerConfig

EPS = 1e-6
FAST = settings(deadline=None, max_examples=60)


def outcome(scores, length=3, lengths=None):
    """Outcome rewards ``[bs, length]``: each score on the row's last response token, and the mask."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    bs = scores.shape[0]
    lengths = torch.as_tensor(lengths if lengths is not None else [length] * bs)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float()
    rewards = torch.zeros(bs, length)
    rewards[torch.arange(bs), lengths - 1] = scores
    return rewards, mask


def per_row(adv, mask):
    """The scalar advantage of each row (they are broadcast over the mask)."""
    return (adv * mask).sum(-1) / mask.sum(-1)


# ============================================================================= advantage estimators


def test_grpo_hand_computed():
    # group a: scores 1, 2, 3 -> mean 2, unbiased std 1 -> (-1, 0, 1) / (1 + eps)
    # group b: scores 0, 4    -> mean 2, std sqrt((4 + 4) / 1) = 2*sqrt(2) -> -+2 / 2.828 = -+0.7071
    # group c: one score 5    -> mean 0, std 1 -> 5 / (1 + eps)
    rewards, mask = outcome([1, 0, 2, 4, 3, 5], lengths=[3, 2, 3, 1, 2, 3])
    index = np.array(["a", "b", "a", "b", "a", "c"], dtype=object)
    adv, ret = alg.compute_grpo_outcome_advantage(rewards, mask, index)
    expected = torch.tensor(
        [-1 / (1 + EPS), -1 / math.sqrt(2), 0.0, 1 / math.sqrt(2), 1 / (1 + EPS), 5 / (1 + EPS)]
    )
    torch.testing.assert_close(per_row(adv, mask), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(adv, expected.unsqueeze(-1) * mask, rtol=1e-5, atol=1e-6)
    assert ret is adv
    assert torch.all(adv[mask == 0] == 0)


def test_dr_grpo_hand_computed():
    # norm_adv_by_std_in_grpo=False (Dr. GRPO): plain centring. a: (-1, 0, 1); b: (-2, 2); c: 5
    rewards, mask = outcome([1, 0, 2, 4, 3, 5])
    index = ["a", "b", "a", "b", "a", "c"]
    adv, _ = alg.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(per_row(adv, mask), torch.tensor([-1.0, -2.0, 0.0, 2.0, 1.0, 5.0]))


def test_grpo_flag_falls_back_to_config_only_when_keyword_is_none():
    rewards, mask = outcome([0, 4])
    dr = alg.AlgoConfig(norm_adv_by_std_in_grpo=False)
    from_config, _ = alg.compute_grpo_outcome_advantage(
        rewards, mask, [0, 0], norm_adv_by_std_in_grpo=None, config=dr
    )
    keyword, _ = alg.compute_grpo_outcome_advantage(
        rewards, mask, [0, 0], config=dr
    )  # keyword default True wins
    torch.testing.assert_close(per_row(from_config, mask), torch.tensor([-2.0, 2.0]))
    torch.testing.assert_close(per_row(keyword, mask), torch.tensor([-1 / math.sqrt(2), 1 / math.sqrt(2)]))


def test_grpo_vectorized_equals_grpo():
    rewards, mask = outcome([1, 0, 2, 4, 3, 5, 7])
    index = [9, 8, 9, 8, 9, 7, 6]
    for norm in (True, False):
        a, _ = alg.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
        b, _ = alg.compute_grpo_vectorized_outcome_advantage(
            rewards, mask, index, norm_adv_by_std_in_grpo=norm
        )
        torch.testing.assert_close(a, b)


def test_rloo_hand_computed():
    # group a: 1, 2, 3 -> A_i = s_i - mean(others): 1 - 2.5, 2 - 2, 3 - 1.5 = -1.5, 0, 1.5
    # group b: one score 5 -> no "others": verl's rloo keeps 5, rloo_vectorized gives 0
    rewards, mask = outcome([1, 2, 5, 3])
    index = np.array([0, 0, 1, 0])
    adv, ret = alg.compute_rloo_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(per_row(adv, mask), torch.tensor([-1.5, 0.0, 5.0, 1.5]))
    assert ret is adv
    vec, _ = alg.compute_rloo_vectorized_outcome_advantage(rewards, mask, index)
    torch.testing.assert_close(per_row(vec, mask), torch.tensor([-1.5, 0.0, 0.0, 1.5]))


def test_reinforce_plus_plus_hand_computed():
    # gamma = 0.5. row 0: rewards (0, 0, 1) -> returns (0.25, 0.5, 1)
    #              row 1: rewards (0, 2, .) mask (1, 1, 0) -> returns (1, 2, 0)
    # whitening over the 5 response tokens 0.25, 0.5, 1, 1, 2: mean 0.95,
    # squared deviations .49 + .2025 + .0025 + .0025 + 1.1025 = 1.8 -> unbiased var 1.8 / 4 = 0.45
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = alg.compute_reinforce_plus_plus_outcome_advantage(
        rewards, mask, config=alg.AlgoConfig(gamma=0.5)
    )
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))
    expected = (torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.95]]) - 0.95) / math.sqrt(0.45 + 1e-8) * mask
    torch.testing.assert_close(adv, expected)


def test_reinforce_plus_plus_skips_masked_observation_tokens():
    # mask (1, 0, 1): the masked middle token neither adds its reward (7) nor counts as a step:
    # returns = (0 + 0.5 * 1, 0, 1)
    rewards = torch.tensor([[0.0, 7.0, 1.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    _, ret = alg.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=alg.AlgoConfig(gamma=0.5))
    torch.testing.assert_close(ret[0], torch.tensor([0.5, 0.0, 1.0]))


def test_reinforce_plus_plus_baseline_hand_computed():
    # groups (1, 3) and (2, 2, 5): centred (-1, 1) and (-1, -1, 2), each on 2 tokens
    # 10 token values: mean 0, unbiased var (8 * 1 + 2 * 4) / 9 = 16/9 -> std 4/3 -> values * 3/4
    rewards, mask = outcome([1, 2, 3, 2, 5], length=2)
    index = ["x", "y", "x", "y", "y"]
    adv, _ = alg.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index)
    expected = torch.tensor([-1.0, -1.0, 1.0, -1.0, 2.0]) / math.sqrt(16 / 9 + 1e-8)
    torch.testing.assert_close(per_row(adv, mask), expected)


def test_grpo_median_hand_computed():
    # G + 1 = 3 rollouts with scores 0, 1, 1: median 1.
    #   scale "std": unbiased std of (0, 1, 1) = sqrt(1/3) -> (-sqrt(3), 0, 0); GRPO would give
    #   (-1.155, 0.577, 0.577): the mean baseline makes the two correct answers share credit.
    #   scale "none": (-1, 0, 0)
    # scores 0, 1, 3: median 1, MAD = median(1, 0, 2) = 1 -> scale "mad": (-1, 0, 2)
    # even group 1, 2, 3, 10: torch.median takes the lower middle value 2 -> "none": (-1, 0, 1, 8)
    rewards, mask = outcome([0, 1, 1])
    adv, _ = alg.compute_grpo_median_outcome_advantage(rewards, mask, [0, 0, 0])
    torch.testing.assert_close(per_row(adv, mask), torch.tensor([-1 / (math.sqrt(1 / 3) + EPS), 0.0, 0.0]))
    adv, _ = alg.compute_grpo_median_outcome_advantage(
        rewards, mask, [0, 0, 0], norm_adv_by_std_in_grpo=False
    )
    torch.testing.assert_close(per_row(adv, mask), torch.tensor([-1.0, 0.0, 0.0]))

    rewards, mask = outcome([0, 1, 3])
    adv, _ = alg.compute_grpo_median_outcome_advantage(rewards, mask, [0, 0, 0], scale="mad")
    torch.testing.assert_close(per_row(adv, mask), torch.tensor([-1.0, 0.0, 2.0]) / (1 + EPS))

    rewards, mask = outcome([1, 2, 3, 10, 4])
    adv, _ = alg.get_adv_estimator_fn("mc_grpo")(rewards, mask, [0, 0, 0, 0, 1], scale="none")
    torch.testing.assert_close(per_row(adv, mask), torch.tensor([-1.0, 0.0, 1.0, 8.0, 4.0]))
    with pytest.raises(ValueError, match="scale"):
        alg.compute_grpo_median_outcome_advantage(rewards, mask, [0] * 5, scale="iqr")


def test_grpo_median_pivot_mask():
    rewards, _ = outcome([0, 1, 1, 5, 2, 9, 4])
    mask = alg.grpo_median_pivot_mask(rewards, ["a", "a", "a", "b", "b", "b", "c"])
    # a: median 1, first row with score 1 is row 1; b: (5, 2, 9) median 5 -> row 3; c: single, no pivot
    assert mask.tolist() == [False, True, False, True, False, False, False]


def test_opo_gpg_passk_hand_computed():
    # OPO: scores 1 (length 1) and 4 (length 3): baseline (1*1 + 3*4) / 4 = 3.25 -> (-2.25, 0.75)
    rewards, mask = outcome([1, 4], lengths=[1, 3])
    adv, _ = alg.compute_opo_outcome_advantage(rewards, mask, [0, 0])
    torch.testing.assert_close(per_row(adv, mask), torch.tensor([-2.25, 0.75]))
    # GPG: scores (0, 2, 0, 4) in one group, alpha = 4 / 2 nonzero = 2; mean 1.5 -> 2 * (s - 1.5)
    rewards, mask = outcome([0, 2, 0, 4])
    adv, _ = alg.compute_gpg_outcome_advantage(rewards, mask, [0] * 4, alpha=123.0)  # alpha is recomputed
    torch.testing.assert_close(per_row(adv, mask), torch.tensor([-3.0, 1.0, -3.0, 5.0]))
    # pass@k: only the best row gets r_max - r_second = 4 - 2 (not normalised)
    adv, _ = alg.compute_grpo_passk_outcome_advantage(rewards, mask, [0] * 4, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(per_row(adv, mask), torch.tensor([0.0, 0.0, 0.0, 2.0]))
    with pytest.raises(ValueError, match="at least 2"):
        alg.compute_grpo_passk_outcome_advantage(rewards, mask, [0, 0, 0, 1])


def test_index_may_be_list_array_or_tensor():
    rewards, mask = outcome([1, 2, 3, 4])
    want, _ = alg.compute_grpo_outcome_advantage(rewards, mask, ["p", "q", "p", "q"])
    for index in (np.array([0, 1, 0, 1]), torch.tensor([5, 6, 5, 6]), [0.0, 1.0, 0.0, 1.0]):
        torch.testing.assert_close(alg.compute_grpo_outcome_advantage(rewards, mask, index)[0], want)
    with pytest.raises(ValueError, match="group ids"):
        alg.compute_grpo_outcome_advantage(rewards, mask, [0, 0, 1])


# ----------------------------------------------------------------------------- estimator invariants

group_scores = st.lists(
    st.lists(st.integers(min_value=-5, max_value=5), min_size=2, max_size=6), min_size=1, max_size=4
)


def flatten(groups):
    scores = [s for g in groups for s in g]
    index = [i for i, g in enumerate(groups) for _ in g]
    return scores, index


@FAST
@given(group_scores, st.booleans())
def test_grpo_advantages_have_zero_mean_per_group(groups, norm):
    scores, index = flatten(groups)
    rewards, mask = outcome(scores)
    a = per_row(
        alg.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)[0], mask
    )
    for g in range(len(groups)):
        rows = [i for i, k in enumerate(index) if k == g]
        assert abs(a[rows].mean().item()) < 1e-5


# integer factors and powers of two keep zero-variance groups exactly zero-variance after scaling
scale_factors = st.one_of(st.integers(1, 50).map(float), st.sampled_from([0.5, 0.25, 0.125]))


@FAST
@given(group_scores, scale_factors)
def test_normalised_grpo_is_scale_invariant(groups, c):
    scores, index = flatten(groups)
    rewards, mask = outcome(scores)
    a, _ = alg.compute_grpo_outcome_advantage(rewards, mask, index)
    b, _ = alg.compute_grpo_outcome_advantage(rewards * c, mask, index)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # up to epsilon's weight in std + eps


@FAST
@given(group_scores, st.floats(min_value=-50.0, max_value=50.0), st.floats(min_value=0.1, max_value=20.0))
def test_dr_grpo_is_shift_invariant_and_scale_equivariant(groups, shift, c):
    scores, index = flatten(groups)
    rewards, mask = outcome(scores)
    a, _ = alg.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    shifted, _ = alg.compute_grpo_outcome_advantage(
        outcome([s + shift for s in scores])[0], mask, index, norm_adv_by_std_in_grpo=False
    )
    scaled, _ = alg.compute_grpo_outcome_advantage(rewards * c, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(a, shifted, rtol=0, atol=1e-4)
    torch.testing.assert_close(a * c, scaled, rtol=1e-5, atol=1e-4)


@FAST
@given(group_scores)
def test_rloo_baseline_is_the_mean_of_the_others(groups):
    scores, index = flatten(groups)
    rewards, mask = outcome(scores)
    a = per_row(alg.compute_rloo_outcome_advantage(rewards, mask, index)[0], mask)
    for i, s in enumerate(scores):
        others = [t for j, t in enumerate(scores) if index[j] == index[i] and j != i]
        assert a[i].item() == pytest.approx(s - sum(others) / len(others), abs=1e-4)


@FAST
@given(group_scores)
def test_grpo_median_centres_on_a_member_with_balanced_signs(groups):
    scores, index = flatten(groups)
    rewards, mask = outcome(scores)
    a = per_row(alg.compute_grpo_median_outcome_advantage(rewards, mask, index, scale="none")[0], mask)
    pivots = alg.grpo_median_pivot_mask(rewards, index)
    for g, members in enumerate(groups):
        rows = [i for i, k in enumerate(index) if k == g]
        assert pivots[rows].sum().item() == 1
        assert a[rows][pivots[rows]].item() == 0.0
        if len(members) % 2 == 1:  # odd group: at most half the rows on either side of the median
            assert (a[rows] > 0).sum().item() <= len(members) // 2
            assert (a[rows] < 0).sum().item() <= len(members) // 2


OUTCOME_ESTIMATORS = [
    "grpo",
    "grpo_vectorized",
    "grpo_median",
    "rloo",
    "rloo_vectorized",
    "opo",
    "gpg",
    "reinforce_plus_plus_baseline",
    "grpo_passk",
]


@FAST
@given(group_scores, st.data())
def test_masked_positions_are_zero_for_every_estimator(groups, data):
    scores, index = flatten(groups)
    lengths = data.draw(st.lists(st.integers(1, 4), min_size=len(scores), max_size=len(scores)))
    rewards, mask = outcome([float(s) + 0.5 for s in scores], length=4, lengths=lengths)
    for name in OUTCOME_ESTIMATORS:
        adv, _ = alg.get_adv_estimator_fn(name)(
            token_level_rewards=rewards, response_mask=mask, index=index, config=alg.AlgoConfig()
        )
        assert adv.shape == rewards.shape
        assert torch.all(adv[mask == 0] == 0), name
    adv, _ = alg.compute_reinforce_plus_plus_outcome_advantage(
        rewards, mask, config=alg.AlgoConfig(gamma=0.9)
    )
    assert torch.all(adv[mask == 0] == 0)


def test_outcome_estimators_do_not_track_gradients():
    rewards, mask = outcome([1.0, 2.0, 3.0])
    rewards.requires_grad_(True)
    for name in OUTCOME_ESTIMATORS:
        adv, ret = alg.get_adv_estimator_fn(name)(
            token_level_rewards=rewards, response_mask=mask, index=[0, 0, 0]
        )
        assert not adv.requires_grad and not ret.requires_grad


# ============================================================================= aggregation


def test_agg_loss_reference_example():
    loss = torch.arange(8, dtype=torch.float32).view(2, 4)
    mask = torch.ones(2, 4)
    # token-mean 28 / 8; seq-mean-token-sum (6 + 22) / 2; seq-mean-token-mean (1.5 + 5.5) / 2; sum-norm 14 / 4
    expected = {
        "token-mean": 3.5,
        "seq-mean-token-sum": 14.0,
        "seq-mean-token-mean": 3.5,
        "seq-mean-token-sum-norm": 3.5,
        "token-sum": 28.0,
    }
    for mode, value in expected.items():
        assert alg.agg_loss(loss, mask, mode).item() == pytest.approx(value)


def test_agg_loss_masks_and_options():
    loss = torch.arange(8, dtype=torch.float32).view(2, 4)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # kept: (0, 1) and (4, 5, 6, 7)
    assert alg.agg_loss(loss, mask, "token-mean").item() == pytest.approx(23 / 6)
    assert alg.agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((0.5 + 5.5) / 2)
    assert alg.agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((1 + 22) / 2)
    assert alg.agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(11.5 / 4)
    assert alg.agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=10).item() == pytest.approx(
        1.15
    )
    # a fully masked row does not count as a sequence
    empty = torch.tensor([[0.0] * 4, [1.0] * 4])
    assert alg.agg_loss(loss, empty, "seq-mean-token-mean").item() == pytest.approx(5.5)
    # global denominators with data parallelism: local sum / global count * dp_size
    assert alg.agg_loss(loss, mask, "token-mean", dp_size=2, batch_num_tokens=12).item() == pytest.approx(
        23 / 6
    )
    with pytest.raises(ValueError, match="batch_num_tokens"):
        alg.agg_loss(loss, mask, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        alg.agg_loss(loss, mask, "seq-mean-token-mean", dp_size=2)
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        alg.agg_loss(loss, mask, "sequence-mean")


# ============================================================================= policy losses


def run_loss(name, ratio, adv, config=None, mode="token-mean", old=None, weights=None):
    """Loss, gradient w.r.t. log_prob and metrics for given per-token ratios and advantages."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    if ratio.dim() == 1:
        ratio = ratio.unsqueeze(0)
    adv = torch.as_tensor(adv, dtype=torch.float64).reshape(ratio.shape)
    old = torch.full_like(ratio, -1.0) if old is None else old
    log_prob = (old + ratio.log()).requires_grad_(True)
    mask = torch.ones_like(ratio)
    loss, metrics = alg.get_policy_loss_fn(name)(
        old, log_prob, adv, mask, loss_agg_mode=mode, config=config, rollout_is_weights=weights
    )
    loss.backward()
    return loss.item(), log_prob.grad, metrics


def test_vanilla_ppo_clip_cases():
    # eps = 0.2, dual clip c = 3. One token per case (token-mean over 5 tokens).
    #   A=+1, r=1.5: past 1 + eps in the favoured direction -> clipped: -1.2, zero gradient
    #   A=+1, r=0.5: min(0.5, 0.8) keeps the unclipped term: -0.5, gradient -r*A/5 = -0.1
    #   A=-1, r=0.5: past 1 - eps in the favoured direction -> clipped: 0.8, zero gradient
    #   A=-1, r=1.5: unclipped (1.5 < 3): 1.5, gradient 1.5/5 = 0.3
    #   A=-1, r=5.0: dual clip caps the loss at c*|A| = 3, zero gradient
    ratios, advs = [1.5, 0.5, 0.5, 1.5, 5.0], [1.0, 1.0, -1.0, -1.0, -1.0]
    loss, grad, metrics = run_loss("vanilla", ratios, advs)
    assert loss == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5 + 3.0) / 5)
    torch.testing.assert_close(grad[0], torch.tensor([0.0, -0.1, 0.0, 0.3, 0.0], dtype=torch.float64))
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)  # cases 1 and 3 have L2 > L1
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 5)  # case 5
    assert metrics["actor/ppo_kl"] == pytest.approx(-float(np.mean(np.log(ratios))))


def test_vanilla_clip_higher_and_fallback():
    # DAPO clip-higher: r = 1.25 with A > 0 is clipped under eps_high = 0.2 but not under 0.28
    _, grad, _ = run_loss("vanilla", [1.25], [1.0])
    assert grad.item() == 0.0
    _, grad, _ = run_loss("vanilla", [1.25], [1.0], config=alg.PolicyLossConfig(clip_ratio_high=0.28))
    assert grad.item() == pytest.approx(-1.25)
    # clip_ratio is used only where clip_ratio_low/high are None
    wide = alg.PolicyLossConfig(clip_ratio=0.3, clip_ratio_low=None, clip_ratio_high=None)
    assert run_loss("vanilla", [1.25], [1.0], config=wide)[1].item() == pytest.approx(-1.25)
    ignored = alg.PolicyLossConfig(clip_ratio=0.3)  # low/high stay 0.2 (verl's defaults)
    assert run_loss("vanilla", [1.25], [1.0], config=ignored)[1].item() == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        run_loss("vanilla", [1.0], [1.0], config=alg.PolicyLossConfig(clip_ratio_c=1.0))


def test_vanilla_at_ratio_one_is_the_policy_gradient():
    adv = torch.tensor([[0.3, -1.2, 2.0]], dtype=torch.float64)
    loss, grad, metrics = run_loss("vanilla", [1.0, 1.0, 1.0], adv)
    assert loss == pytest.approx(-adv.mean().item())
    torch.testing.assert_close(grad, -adv / 3)
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/ppo_kl"] == 0.0


def test_rollout_is_weights_scale_each_token():
    w = torch.tensor([[2.0, 0.5]], dtype=torch.float64)
    for name in ("vanilla", "cispo", "gspo", "gpg"):
        plain, _, _ = run_loss(name, [1.0, 1.0], [1.0, 1.0])
        weighted, _, _ = run_loss(name, [1.0, 1.0], [1.0, 1.0], weights=w)
        if name in ("cispo", "gpg"):  # -A * log_prob with log_prob = -1 per token
            assert (plain, weighted) == pytest.approx((1.0, 1.25))
        else:  # -A * r with r = 1
            assert (plain, weighted) == pytest.approx((-1.0, -1.25))


def test_loss_scale_factor_and_frozen_config():
    scaled = alg.PolicyLossConfig(loss_scale_factor=8)
    loss, _, _ = run_loss("gpg", [1.0, 1.0], [1.0, 1.0], config=scaled, mode="seq-mean-token-sum-norm")
    assert loss == pytest.approx(2 / 8)  # sequence sum (1 + 1), one sequence, divided by 8 instead of T = 2
    with pytest.raises(AttributeError):
        alg.PolicyLossConfig().clip_ratio = 0.3  # frozen


def test_gspo_equals_vanilla_when_each_sequence_has_one_ratio():
    # If every token of a sequence has the same ratio r_i, the sequence ratio is r_i too, and GSPO's
    # per-token value and gradient (s_i * grad log_prob) coincide with PPO's when A >= 0
    # (no dual clip involved).
    ratios = torch.tensor([[1.1] * 4, [0.7] * 4, [1.5] * 4], dtype=torch.float64)
    adv = torch.tensor([[1.0] * 4, [0.5] * 4, [2.0] * 4], dtype=torch.float64)
    for mode in ("token-mean", "seq-mean-token-mean"):
        g_loss, g_grad, g_metrics = run_loss("gspo", ratios, adv, mode=mode)
        v_loss, v_grad, v_metrics = run_loss("vanilla", ratios, adv, mode=mode)
        assert g_loss == pytest.approx(v_loss)
        torch.testing.assert_close(g_grad, v_grad)
        assert g_metrics["actor/pg_clipfrac"] == pytest.approx(v_metrics["actor/pg_clipfrac"])


def test_gspo_weights_all_tokens_of_a_sequence_by_the_sequence_ratio():
    # Token ratios differ inside each sequence; the gradient on each token is -A * s_i / (T * B)
    # with s_i = geometric mean of the sequence's ratios (unclipped here: eps = 0.5).
    ratios = torch.tensor([[1.3, 0.8, 1.0], [0.9, 1.1, 1.05]], dtype=torch.float64)
    adv = torch.tensor([[1.0] * 3, [-2.0] * 3], dtype=torch.float64)
    config = alg.PolicyLossConfig(clip_ratio_low=0.5, clip_ratio_high=0.5)
    loss, grad, _ = run_loss("gspo", ratios, adv, config=config, mode="seq-mean-token-mean")
    s = ratios.log().mean(-1).exp()
    torch.testing.assert_close(grad, (-adv[:, :1] * s.unsqueeze(-1) / 6).expand(2, 3))
    assert loss == pytest.approx((-(adv[:, 0] * s)).mean().item())
    # whole-sequence clipping: s_0 = 1.04^(1/3) = 1.013 > 1 + 0.01 with A > 0 -> every token of row 0
    # is clipped, although token 2's own ratio (1.0) is inside the range; row 1 (A < 0) is not
    _, grad, metrics = run_loss("gspo", ratios, adv, config=alg.PolicyLossConfig(clip_ratio_high=0.01))
    assert torch.all(grad[0] == 0) and torch.all(grad[1] != 0)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


def test_cispo_keeps_gradients_of_clipped_tokens():
    # L = -sg[clip(r, 0.8, 1.2)] * A * log_prob; gradient -clip(r) * A / N, even where r is clipped
    ratios, advs = [1.5, 0.5, 1.0], [1.0, -1.0, 2.0]
    loss, grad, metrics = run_loss("cispo", ratios, advs)
    clipped = torch.tensor([1.2, 0.8, 1.0], dtype=torch.float64)
    adv = torch.tensor(advs, dtype=torch.float64)
    torch.testing.assert_close(grad[0], -clipped * adv / 3)
    log_prob = -1.0 + torch.log(torch.tensor(ratios, dtype=torch.float64))
    assert loss == pytest.approx((-clipped * adv * log_prob).mean().item())
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)
    # PPO would give zero gradient on token 0 (A > 0, r > 1 + eps) and token 1 (A < 0, r < 1 - eps)
    _, ppo_grad, _ = run_loss("vanilla", ratios, advs)
    assert ppo_grad[0, 0] == 0 and ppo_grad[0, 1] == 0


def test_other_losses_run_and_return_verl_metrics():
    ratios = torch.tensor([[1.1, 0.9, 1.0], [1.3, 0.6, 1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)
    for name in ("sapo", "geo_mean", "dppo_tv", "dppo_kl"):
        loss, grad, metrics = run_loss(name, ratios, adv)
        assert math.isfinite(loss) and torch.isfinite(grad).all()
        assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    assert run_loss("gpg", ratios, adv)[2] == {}
    # SAPO's gate has slope 1 at r = 1: same gradient as the policy gradient there
    _, grad, _ = run_loss("sapo", [[1.0, 1.0]], [[1.0, -1.0]])
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.5]], dtype=torch.float64))


# ============================================================================= KL


def test_kl_estimators_closed_forms():
    # logprob = log 0.5, ref = log 0.25: d = log 2
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    d = math.log(2)
    assert alg.kl_penalty(logp, ref, "k1").item() == pytest.approx(d)
    assert alg.kl_penalty(logp, ref, "kl").item() == pytest.approx(d)
    assert alg.kl_penalty(ref, logp, "abs").item() == pytest.approx(d)
    assert alg.kl_penalty(logp, ref, "k2").item() == pytest.approx(d * d / 2)
    assert alg.kl_penalty(logp, ref, "mse").item() == pytest.approx(d * d / 2)
    # k3 = r - 1 - log r with r = pi_ref / pi = 0.5
    assert alg.kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + d)
    assert alg.kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(0.5 - 1 + d)


def test_k1_and_k3_are_unbiased_on_a_discrete_distribution():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    kl = torch.sum(p * (p.log() - q.log()))
    for name in ("k1", "k3"):
        expectation = torch.sum(p * alg.kl_penalty(p.log(), q.log(), name))
        assert expectation.item() == pytest.approx(kl.item(), rel=1e-12)
    k3 = alg.kl_penalty(p.log(), q.log(), "k3")
    assert torch.all(k3 >= 0)  # k3 is non-negative per sample, k1 is not
    assert torch.any(alg.kl_penalty(p.log(), q.log(), "k1") < 0)


@pytest.mark.parametrize("name", ["k1", "kl", "abs", "k3", "low_var_kl", "k2", "mse"])
def test_plus_suffix_is_value_of_estimator_with_k2_gradient(name):
    ref = torch.tensor([-1.0, -2.0, -0.5])
    logp = torch.tensor([-1.5, -1.0, -0.5], requires_grad=True)
    value = alg.kl_penalty(logp, ref, name + "+")
    torch.testing.assert_close(value.detach(), alg.kl_penalty(logp.detach(), ref, name))
    value.sum().backward()
    torch.testing.assert_close(logp.grad, (logp - ref).detach())


def test_k3_is_clamped_and_errors():
    # far-apart log-probs: the value is capped at 10 and the gradient stays finite (zero)
    logp = torch.tensor([0.0, 0.0, -1.0], requires_grad=True)
    ref = torch.tensor([-500.0, 500.0, -1.5])
    out = alg.kl_penalty(logp, ref, "k3")
    assert out[:2].tolist() == [10.0, 10.0]
    assert out[2].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, rel=1e-6)
    out.sum().backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[:2].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="k3"):
        alg.kl_penalty(logp, ref, "k4")
    with pytest.raises(NotImplementedError):
        alg.kl_penalty(logp, ref, "full")


def test_kl_controllers():
    fixed = alg.get_kl_controller(KLRewardControllerConfig(kl_coef=0.1))
    fixed.update(current_kl=5.0, n_steps=100)
    assert isinstance(fixed, alg.FixedKLController) and fixed.value == 0.1
    adaptive = alg.get_kl_controller(
        KLRewardControllerConfig(type="adaptive", kl_coef=0.1, target_kl=0.05, horizon=1000)
    )
    adaptive.update(current_kl=1.0, n_steps=100)  # error clipped to +0.2 -> value * (1 + 0.2 * 100 / 1000)
    assert adaptive.value == pytest.approx(0.1 * 1.02)
    adaptive.update(current_kl=0.045, n_steps=100)  # error -0.1 -> * (1 - 0.01)
    assert adaptive.value == pytest.approx(0.1 * 1.02 * 0.99)
    # The config refuses both; a section built without validation still gets a clear error.
    with pytest.raises(ValueError, match="horizon > 0"):
        alg.get_kl_controller(KLRewardControllerConfig.model_construct(type="adaptive", horizon=0))
    with pytest.raises(ValueError, match="known: \\['fixed', 'adaptive'\\]"):
        alg.get_kl_controller(KLRewardControllerConfig.model_construct(type="pid"))


def test_apply_kl_penalty_hand_computed():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -0.5, -1.0], [-2.0, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ctrl = alg.AdaptiveKLController(init_kl_coef=0.5, target_kl=0.1, horizon=10)
    rewards, metrics = alg.apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty="kl")
    # k1 = old - ref = (0.5, -0.5, 0) and (1, 0, masked); rewards = scores - 0.5 * k1
    torch.testing.assert_close(rewards, torch.tensor([[-0.25, 0.25, 1.0], [-0.5, 2.0, 0.0]]))
    # current KL = mean over sequences of per-sequence masked means: (0 + 0.5) / 2
    assert metrics == {"actor/reward_kl_penalty": pytest.approx(0.25), "actor/reward_kl_penalty_coeff": 0.5}
    assert ctrl.value == pytest.approx(0.5 * (1 + 0.2 * 2 / 10))  # updated in place with n_steps = bs


# ============================================================================= masked ops


def test_masked_ops():
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 4.0, 5.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert alg.masked_sum(x, m).item() == 10.0  # NaN outside the mask does not leak
    assert alg.masked_mean(x, m).item() == pytest.approx(2.5)
    torch.testing.assert_close(alg.masked_mean(x, m, axis=-1), torch.tensor([1.5, 3.5]))
    assert alg.masked_var(x, m).item() == pytest.approx(5 / 3)  # unbiased var of 1, 2, 3, 4
    assert alg.masked_var(x, m, unbiased=False).item() == pytest.approx(1.25)
    w = alg.masked_whiten(x, m)
    assert alg.masked_mean(w, m).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError):
        alg.masked_var(x, torch.zeros_like(m))
    with pytest.raises(ValueError):
        alg.masked_var(x, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


# ============================================================================= registries


def test_unknown_names_raise_listing_known_ones():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*'grpo'.*'rloo'"):
        alg.get_adv_estimator_fn("ppo")
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo2'.*'cispo'.*'gspo'.*'vanilla'"):
        alg.get_policy_loss_fn("ppo2")


def test_required_names_are_registered():
    """Each name a preset or a paper uses resolves to the function that implements it (a getter that
    returned another estimator under a name, or a registration overwritten by a later one, fails here;
    an unknown name already raises, see above)."""
    estimators = {
        "grpo": alg.compute_grpo_outcome_advantage,
        "rloo": alg.compute_rloo_outcome_advantage,
        "reinforce_plus_plus": alg.compute_reinforce_plus_plus_outcome_advantage,
        "reinforce_plus_plus_baseline": alg.compute_reinforce_plus_plus_baseline_outcome_advantage,
        "grpo_median": alg.compute_grpo_median_outcome_advantage,
        "mc_grpo": alg.compute_grpo_median_outcome_advantage,  # MC-GRPO is the median-baseline estimator
    }
    for name, fn in estimators.items():
        assert alg.get_adv_estimator_fn(name) is fn, name
    losses = {
        "vanilla": alg.compute_policy_loss_vanilla,
        "gspo": alg.compute_policy_loss_gspo,
        "cispo": alg.compute_policy_loss_cispo,
    }
    for name, fn in losses.items():
        assert alg.get_policy_loss_fn(name) is fn, name


def test_custom_registration():
    @alg.register_adv_est("test_constant_one")
    def constant(token_level_rewards, response_mask, **kwargs):
        return response_mask.float(), response_mask.float()

    try:
        assert alg.get_adv_estimator_fn("test_constant_one") is constant
        alg.register_adv_est("test_constant_one")(constant)  # same function again: fine
        with pytest.raises(ValueError, match="already registered"):
            alg.register_adv_est("test_constant_one")(lambda **kw: None)
    finally:
        alg.ADV_ESTIMATOR_REGISTRY.pop("test_constant_one", None)

    @alg.register_policy_loss("test_zero")
    def zero(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, **kw
    ):
        return (log_prob * 0).sum(), {}

    try:
        assert alg.get_policy_loss_fn("test_zero") is zero
    finally:
        alg.POLICY_LOSS_REGISTRY.pop("test_zero", None)
