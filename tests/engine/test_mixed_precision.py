"""``trainer.mixed_precision: bf16``: the decoder trunk's matmuls run in bfloat16, forward and backward,
while the weights, their gradients, the LM head's log-probs and the loss stay float32.

The dtypes are read from the ops themselves (a ``TorchDispatchMode`` sees every op below autocast and
autograd, with the dtypes autocast gave it), so these tests fail if autocast is not entered, if it also
covers the LM head, or if the backward runs in float32. They run on any CPU: where bf16 is emulated it is
only slower (the option's description says so; the update's speed-up is measured in bench/README.md).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import engine.run
from engine.config import build_config
from engine.models import load_model
from engine.trainer import TorchTrainer, actor
from engine.trainer.actor import LogprobSettings, logprob_settings, response_logprobs
from tests.engine.batches import random_batch
from tests.engine.rollout_contract import randomized

LINEAR = frozenset({"mm", "addmm"})
"""The ops of ``nn.Linear`` and its backward (attention's ``bmm`` is the math kernel's, which computes
bf16 inputs in float32 on a CPU)."""


class OpDtypes(TorchDispatchMode):
    """Records every op's name and the dtypes of its floating-point tensor arguments and shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[torch.dtype, ...], tuple[tuple[int, ...], ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        self.ops.append(
            (func.overloadpacket.__name__, tuple(t.dtype for t in tensors), tuple(tuple(t.shape) for t in tensors))
        )
        return func(*args, **(kwargs or {}))

    def matmuls(self, *, vocab: int, head: bool) -> list[tuple[torch.dtype, ...]]:
        """The dtypes of the weight matmuls that involve the vocabulary (the LM head's) or, with
        ``head=False``, do not (the trunk's linear layers)."""
        return [
            dtypes
            for name, dtypes, shapes in self.ops
            if name in LINEAR and any(vocab in s for s in shapes) == head
        ]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return randomized(load_model(tiny_model_dir), seed=1).train()


@pytest.mark.parametrize("path", ["full", "two-pass", "packed"])
def test_the_trunk_computes_in_bf16_and_the_head_in_float32(model, monkeypatch, path: str) -> None:
    vocab = model.config.vocab_size
    batch = random_batch(vocab, groups=4, n=3, seed=5)
    if path == "two-pass":
        monkeypatch.setattr(actor, "PACKED_MAX_TOKENS", 0)
    weights = torch.randn(batch.response_ids.shape, generator=torch.Generator().manual_seed(1))
    results = {}
    for mixed in (False, True):
        settings = LogprobSettings(temperature=0.8, shared_prompt=path != "full", bf16_autocast=mixed)
        model.zero_grad()
        forward, backward = OpDtypes(), OpDtypes()
        with forward:
            lp, ent = response_logprobs(model, batch, settings, compute_entropy=True)
        with backward:
            ((lp * weights * batch.response_mask).sum() + ent.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[mixed] = lp.detach(), grads, forward, backward

    full_lp, full_grads, *_ = results[False]
    lp, grads, forward, backward = results[True]
    half = torch.bfloat16
    for ops in (forward, backward):
        trunk = ops.matmuls(vocab=vocab, head=False)
        assert trunk and all(set(dtypes) == {half} for dtypes in trunk), trunk
        head = ops.matmuls(vocab=vocab, head=True)
        assert head and all(set(dtypes) == {torch.float32} for dtypes in head), head
    # On a CPU the attention takes the math kernel in bf16: the flash kernel's bf16 backward took 8x its
    # float32 time at these shapes (53 ms against 7 in one update of the starter).
    assert not any("flash" in name for name, *_ in forward.ops + backward.ops)
    assert lp.dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in grads.values())
    # bf16 keeps 8 bits of mantissa: each matmul's output is off by up to 2^-9 of its size, and a
    # logit of this model (|z| up to ~5) by ~1e-2 after two layers, hence its log-prob by about as much.
    # Measured: at most 0.017. A misplaced token or a missing layer moves log-probs by O(1).
    diff = (lp - full_lp).abs()
    assert 0 < float(diff.max()) < 0.1
    flat = torch.cat([g.flatten() for g in grads.values()])
    full_flat = torch.cat([g.flatten() for g in full_grads.values()])
    assert torch.nn.functional.cosine_similarity(flat, full_flat, dim=0) > 0.99


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_old_log_probs_and_the_update_compute_alike(tiny_model_dir, precision: str) -> None:
    """``compute_log_probs`` (the old and reference log-probs) runs under the update's precision, or the
    first mini-batch's ratio would start off 1 by bf16's error (~1e-2) and clip on noise; the weights and
    Adam's moments stay float32 and the update moves them."""
    cfg = build_config(
        {"trainer": {"device": "cpu", "mixed_precision": precision}, "optimizer": {"lr": 1e-3}}
    )
    trainer = TorchTrainer(
        randomized(load_model(tiny_model_dir)), cfg, device=torch.device("cpu"), need_reference=False
    )
    assert trainer.settings.bf16_autocast is (precision == "bf16")
    batch = random_batch(trainer.model.config.vocab_size, groups=4, n=3, seed=7)
    old = trainer.compute_log_probs(batch)
    trainer.model.train()
    with torch.no_grad():
        update_lp, _ = response_logprobs(trainer.model, batch, trainer.settings, compute_entropy=False)
        fp32_lp, _ = response_logprobs(trainer.model, batch, LogprobSettings(temperature=1.0), compute_entropy=False)
    assert torch.equal(old, update_lp)
    assert (float((old - fp32_lp).abs().max()) > 1e-3) is (precision == "bf16")

    batch.advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(2))
    batch.advantages *= batch.response_mask
    batch.old_log_probs = old
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.update_policy(batch)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    state = trainer.optimizer.state_dict()["state"]
    assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_every_backend_reads_the_option_from_the_config() -> None:
    cfg = build_config({"trainer": {"mixed_precision": "bf16"}})
    assert logprob_settings(cfg).bf16_autocast
    assert logprob_settings(cfg, shared_prompt=False) == LogprobSettings(
        temperature=cfg.rollout.temperature, chunk_size=None, shared_prompt=False, bf16_autocast=True
    )
    assert not logprob_settings(build_config({})).bf16_autocast


def test_a_run_in_bf16_warns_only_where_the_device_emulates_it(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    mixed = build_config({"trainer": {"mixed_precision": "bf16"}})
    for native in (True, False):
        monkeypatch.setattr(engine.run, "native_bf16", lambda device, native=native: native)
        assert engine.run.emulated_bf16(build_config({}), cpu) is None  # float32: nothing to say
        warning = engine.run.emulated_bf16(mixed, cpu)
        assert (warning is None) is native
    assert "trainer.mixed_precision: bf16" in warning and "set trainer.mixed_precision no" in warning


def test_bf16_weights_refuse_mixed_precision() -> None:
    with pytest.raises(ValueError, match=r"trainer\.mixed_precision.*model\.dtype"):
        build_config({"trainer": {"mixed_precision": "bf16"}, "model": {"dtype": "bfloat16"}})
