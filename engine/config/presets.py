"""Named presets: the algorithm settings of each method (a config's ``preset`` applies one underneath it)."""

from __future__ import annotations

from typing import Any

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
