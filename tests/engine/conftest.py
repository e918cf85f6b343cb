"""Fixtures of the rollout backend tests (the contract in rollout_contract.py names them).

The policy is the tiny model with larger random weights (``randomized``: varied, peaked outputs),
saved to a directory because vLLM, and a backend in a process of its own, load it from there.
"""

from __future__ import annotations

import pytest
import torch

from engine.models import load_model, load_tokenizer
from tests.engine.rollout_contract import randomized


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def policy_dir(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("rollout-policy")
    randomized(load_model(tiny_model_dir)).save_pretrained(path)
    load_tokenizer(tiny_model_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def policy_weights(policy_dir):
    return {k: v.clone() for k, v in load_model(policy_dir).state_dict().items()}


@pytest.fixture(scope="module")
def eos_weights(policy_weights, tokenizer):
    # Zero final-norm weight: every logit is exactly 0 and argmax picks id 0, EOS for make_model tokenizers.
    assert tokenizer.eos_token_id == 0
    weights = dict(policy_weights)
    weights["model.norm.weight"] = torch.zeros_like(weights["model.norm.weight"])
    return weights
