"""Triton logprob/entropy kernels against the torch reference (under Triton's CPU interpreter) and the
selection of ``trainer.logprob_impl``.

Triton picks interpreted or compiled mode when it decorates a function, and it decorates its standard
library (``tl.sum``, ``tl.zeros``...) on ``import triton.language``: ``TRITON_INTERPRET=1`` only works
if it is set before the process imports triton. So the ``test_interpreted_*`` tests run in a fresh
``pytest`` subprocess started by :func:`test_kernels_in_an_interpreted_process` with the variable set;
in the parent process they are deselected (tests/conftest.py) and nothing here changes its environment, so no other test of
the session sees the variable. The remaining tests run in the parent, where the interpreter is off.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
import triton

from engine.config import TrainerConfig
from engine.models import load_model
from engine.trainer.actor import LogprobSettings, response_logprobs
from kernels import IMPLEMENTATIONS, fused_logprobs_entropy, logprobs_from_hidden, resolve_impl
from kernels.logprob import naive_logprobs_entropy
from kernels.triton_logprob import TritonBlocks, interpreter_enabled, triton_logprobs_entropy
from tests.engine.batches import random_batch
from tests.engine.logprob_agreement import assert_same_logprobs_and_grads
from tests.kernels.lm_head import make_inputs, upstream_grads, values_and_grads

INTERPRETED = interpreter_enabled()
# Collected only in the TRITON_INTERPRET=1 subprocess of test_kernels_in_an_interpreted_process.
interpreted = pytest.mark.child_only("TRITON_INTERPRET")
# 16 is the smallest tile tl.dot accepts; with N=37, H=24, V=50 every tile dimension has a ragged edge.
SMALL = TritonBlocks(16, 16, 16, 16, 16, 16)


def reference(inputs: dict, upstream: tuple, temperature: float) -> list[torch.Tensor]:
    """The naive full-logits computation in float64, so that only the kernel's rounding is measured."""
    as_f64 = {k: (t.double() if t is not None and t.is_floating_point() else t) for k, t in inputs.items()}
    return values_and_grads(
        naive_logprobs_entropy, as_f64, tuple(u.double() for u in upstream), temperature=temperature
    )


# ---- kernels, in the interpreted subprocess -------------------------------------------------------


@interpreted
@pytest.mark.parametrize(
    ("n", "h", "v", "blocks"),
    [
        (37, 24, 50, SMALL),  # ragged in N, H and V
        (37, 24, 50, TritonBlocks(16, 16, 16, 16, 16, 16, forward_splits=3)),  # vocabulary splits merged
        (16, 32, 64, TritonBlocks(16, 32, 16, 16, 32, 32, forward_splits=2)),  # exact multiples
        (5, 20, 130, TritonBlocks(16, 64, 32, 16, 64, 32, forward_splits=4)),  # one ragged block of tokens
    ],
    ids=["ragged", "ragged-3-splits", "exact-2-splits", "few-tokens-4-splits"],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_interpreted_matches_reference(
    n: int, h: int, v: int, blocks: TritonBlocks, temperature: float, with_bias: bool
) -> None:
    inputs = make_inputs(n, h, v, bias=with_bias, seed=n + v)
    upstream = upstream_grads(n)
    got = values_and_grads(triton_logprobs_entropy, inputs, upstream, temperature=temperature, blocks=blocks)
    ref = reference(inputs, upstream, temperature)
    names = ["logprobs", "entropy", "grad_hidden", "grad_weight", "grad_bias"]
    assert len(got) == len(ref) == (5 if with_bias else 4)
    for name, g, r in zip(names, got, ref):
        assert g.dtype == torch.float32, name
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-5, msg=name)


@interpreted
def test_interpreted_agrees_with_the_torch_fused_version() -> None:
    """Same inputs, both float32: the two memory-lean implementations agree to rounding."""
    inputs = make_inputs(37, 24, 50, seed=5)
    upstream = upstream_grads(37)
    got = values_and_grads(triton_logprobs_entropy, inputs, upstream, temperature=1.3, blocks=SMALL)
    ref = values_and_grads(fused_logprobs_entropy, inputs, upstream, temperature=1.3, chunk_size=8)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("use", ["logprobs", "entropy"])
def test_interpreted_gradient_from_one_output_only(use: str) -> None:
    """The unused output's gradient arrives as None; the kernel must drop its term, not read garbage."""
    inputs = make_inputs(21, 16, 40, seed=2)
    grads = []
    for fn, kwargs in ((naive_logprobs_entropy, {}), (triton_logprobs_entropy, {"blocks": SMALL})):
        hidden = inputs["hidden"].clone().requires_grad_(True)
        weight = inputs["weight"].clone().requires_grad_(True)
        logprobs, entropy = fn(
            hidden, weight, inputs["labels"], bias=inputs["bias"], temperature=0.8, **kwargs
        )
        (logprobs if use == "logprobs" else entropy).sum().backward()
        grads.append((hidden.grad, weight.grad))
    for g, r in zip(grads[1], grads[0]):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@interpreted
def test_interpreted_compute_entropy_false_and_frozen_inputs() -> None:
    """No entropy output; only ``hidden`` requires grad (frozen LM head): the other grads stay None."""
    inputs = make_inputs(19, 24, 33, seed=3)
    hidden = inputs["hidden"].clone().requires_grad_(True)
    logprobs, entropy = triton_logprobs_entropy(
        hidden, inputs["weight"], inputs["labels"], bias=inputs["bias"], compute_entropy=False, blocks=SMALL
    )
    assert entropy is None
    (logprobs * torch.linspace(-1, 1, 19)).sum().backward()
    ref_hidden = inputs["hidden"].clone().requires_grad_(True)
    ref_lp, _ = naive_logprobs_entropy(ref_hidden, inputs["weight"], inputs["labels"], bias=inputs["bias"])
    (ref_lp * torch.linspace(-1, 1, 19)).sum().backward()
    torch.testing.assert_close(logprobs, ref_lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, atol=1e-5, rtol=1e-5)
    assert inputs["weight"].grad is None and inputs["bias"].grad is None


@interpreted
def test_interpreted_non_contiguous_hidden_and_no_grad() -> None:
    """Strided hidden (a column slice) is read through its strides; without grad no graph is built."""
    inputs = make_inputs(17, 24, 29, seed=4)
    wide = torch.randn(17, 40, generator=torch.Generator().manual_seed(9)).requires_grad_(True)
    hidden = wide[:, 7:31]
    assert not hidden.is_contiguous()
    logprobs, entropy = triton_logprobs_entropy(hidden, inputs["weight"], inputs["labels"], blocks=SMALL)
    (logprobs + 0.3 * entropy).sum().backward()
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    ref_lp, ref_ent = naive_logprobs_entropy(ref_hidden, inputs["weight"], inputs["labels"])
    (ref_lp + 0.3 * ref_ent).sum().backward()
    torch.testing.assert_close(logprobs.detach(), ref_lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wide.grad[:, 7:31], ref_hidden.grad, atol=1e-5, rtol=1e-5)
    assert wide.grad[:, :7].abs().sum() == 0 and wide.grad[:, 31:].abs().sum() == 0
    with torch.no_grad():
        no_grad = triton_logprobs_entropy(hidden, inputs["weight"], inputs["labels"], blocks=SMALL)
    assert no_grad[0].grad_fn is None
    torch.testing.assert_close(no_grad[0], logprobs.detach(), atol=0, rtol=0)
    torch.testing.assert_close(no_grad[1], entropy.detach(), atol=0, rtol=0)


@interpreted
def test_interpreted_empty_input() -> None:
    weight = torch.randn(9, 16, requires_grad=True)
    hidden = torch.randn(0, 16, requires_grad=True)
    logprobs, entropy = triton_logprobs_entropy(
        hidden, weight, torch.zeros(0, dtype=torch.long), blocks=SMALL
    )
    assert logprobs.shape == entropy.shape == (0,)
    (logprobs.sum() + entropy.sum()).backward()
    assert hidden.grad.shape == (0, 16)
    assert torch.equal(weight.grad, torch.zeros(9, 16))


@interpreted
def test_interpreted_half_precision_inputs() -> None:
    """fp16 inputs: float32 outputs, gradients in fp16 close to the float32 reference.

    The bf16 path is the same code with another dtype, but the interpreter cannot check it: its
    ``tl.dot`` on bfloat16 operands returns garbage (numpy has no bfloat16; fp16 and fp32 are exact).
    """
    inputs = make_inputs(23, 32, 70, dtype=torch.float16, seed=6)
    upstream = upstream_grads(23)
    got = values_and_grads(triton_logprobs_entropy, inputs, upstream, temperature=0.9, blocks=SMALL)
    ref = reference(inputs, upstream, 0.9)
    assert got[0].dtype == got[1].dtype == torch.float32
    torch.testing.assert_close(got[0].double(), ref[0], atol=1e-4, rtol=1e-4)  # fp16 inputs are exact in fp32
    torch.testing.assert_close(got[1].double(), ref[1], atol=1e-4, rtol=1e-4)
    for g, r in zip(got[2:], ref[2:], strict=True):
        assert g.dtype == torch.float16
        assert (g.double() - r).norm() <= 2e-3 * r.norm()  # g_z is rounded to fp16 before the matmuls


@interpreted
def test_interpreted_selection_runs_triton_through_the_trainer(tiny_model_dir) -> None:
    """``trainer.logprob_impl='triton'`` through the trainer's entry point (response_logprobs):
    the same log-probs, entropies and parameter gradients as 'naive' on a tiny model."""
    cpu = torch.zeros(1)
    assert resolve_impl("triton", cpu) == "triton"
    assert resolve_impl("auto", cpu) == "fused"  # auto never picks the (slow) interpreter
    with pytest.raises(ValueError, match=r"trainer\.logprob_impl='triton'.*float64"):
        resolve_impl("triton", cpu.double())
    model = load_model(tiny_model_dir)
    batch = random_batch(model.config.vocab_size)
    assert_same_logprobs_and_grads(
        model,
        batch,
        LogprobSettings(temperature=0.7, impl="naive"),
        LogprobSettings(temperature=0.7, impl="triton"),
    )


@pytest.mark.parent_only("TRITON_INTERPRET")
def test_kernels_in_an_interpreted_process() -> None:
    """Run every ``test_interpreted_*`` test above in a fresh process with TRITON_INTERPRET=1."""
    here = Path(__file__).resolve()
    node_ids = [f"{here}::{name}" for name in globals() if name.startswith("test_interpreted_")]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *node_ids],
        cwd=here.parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, tail  # the kernels really ran


# ---- selection, in this (compiled-mode, CPU-only) process -----------------------------------------


def test_config_field_and_dispatch_know_the_same_implementations() -> None:
    field = TrainerConfig.model_fields["logprob_impl"]
    assert (
        set(typing.get_args(field.annotation)) == set(IMPLEMENTATIONS) == {"auto", "fused", "naive", "triton"}
    )
    assert TrainerConfig().logprob_impl == "auto"
    assert TrainerConfig(logprob_impl="triton").logprob_impl == "triton"  # validating needs no GPU


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_triton_without_cuda_or_interpreter_names_the_field() -> None:
    inputs = make_inputs(4, 16, 5)
    with pytest.raises(
        ValueError, match=r"trainer\.logprob_impl='triton' cannot run: .*cpu.*TRITON_INTERPRET"
    ):
        logprobs_from_hidden(
            inputs["hidden"].view(1, 4, 16), inputs["weight"], inputs["labels"].view(1, 4), impl="triton"
        )
    with pytest.raises(ValueError, match="cannot run the Triton logprob kernel"):
        triton_logprobs_entropy(inputs["hidden"], inputs["weight"], inputs["labels"])


@pytest.mark.skipif(INTERPRETED, reason="auto on CPU tensors, compiled mode")
def test_auto_on_cpu_is_the_torch_fused_version(tiny_model_dir) -> None:
    """'auto' (the config default) on CPU tensors takes the torch fused path: bitwise its output,
    also through the trainer's entry point with the default LogprobSettings of the config."""
    inputs = make_inputs(3 * 5, 16, 21, dtype=torch.float64)
    assert resolve_impl("auto", inputs["hidden"]) == "fused"
    auto = logprobs_from_hidden(
        inputs["hidden"].view(3, 5, 16),
        inputs["weight"],
        inputs["labels"].view(3, 5),
        chunk_size=4,
        bias=inputs["bias"],
    )
    fused = fused_logprobs_entropy(
        inputs["hidden"], inputs["weight"], inputs["labels"], chunk_size=4, bias=inputs["bias"]
    )
    for a, f in zip(auto, fused, strict=True):
        assert torch.equal(a.view(-1), f)

    model = load_model(tiny_model_dir)
    batch = random_batch(model.config.vocab_size)
    out = {}
    for impl in (TrainerConfig().logprob_impl, "fused"):
        out[impl] = response_logprobs(
            model, batch, LogprobSettings(temperature=0.7, impl=impl), compute_entropy=True
        )
    for a, f in zip(out["auto"], out["fused"], strict=True):
        assert torch.equal(a, f)


def _compile_for(kernel, constexprs: dict, dtype: str, arch: int):
    """Compile ``kernel`` ahead of time for an NVIDIA GPU (PTX and cubin through Triton's bundled
    ptxas); no GPU needed. Pointers to the input dtype, float32 or int64 as the launchers pass them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    inputs = {"hidden_ptr", "weight_ptr", "bias_ptr"}
    ints = {"n_rows", "vocab", "dim", "tiles_per_split"} | {
        n for n in kernel.arg_names if n.startswith("stride")
    }
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in inputs:
            signature[name] = f"*{dtype}"
        elif name == "labels_ptr":
            signature[name] = "*i64"
        elif name in ints:
            signature[name] = "i32"
        elif name == "temperature":
            signature[name] = "fp32"
        else:
            signature[name] = "*fp32"
    source = ASTSource(
        kernel, signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
    )
    return triton.compile(source, target=GPUTarget("cuda", arch, 32))


@pytest.mark.skipif(INTERPRETED, reason="needs the compiled-mode kernels")
@pytest.mark.parametrize("arch", [80, 90], ids=["sm80", "sm90"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernels_compile_for_nvidia_gpus(arch: int, dtype: torch.dtype) -> None:
    """The GPU path, which this machine cannot run, at least compiles with its default tiles: tensor
    cores (mma) for bf16, plain float32 FMA for float32 (no TF32 unless torch allows it), and the
    backward's gradient accumulation as global atomic reductions."""
    from kernels import triton_logprob as tk

    blocks = tk.default_blocks(dtype)
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    common = {"HAS_BIAS": True, "INPUT_PRECISION": "ieee"}
    forward = _compile_for(
        tk._forward_kernel,
        {
            **common,
            "COMPUTE_ENTROPY": True,
            "BLOCK_N": blocks.forward_n,
            "BLOCK_V": blocks.forward_v,
            "BLOCK_H": blocks.forward_h,
        },
        name,
        arch,
    )
    flags = ("HAS_GRAD_LOGP", "HAS_GRAD_ENTROPY", "NEED_HIDDEN", "NEED_WEIGHT", "NEED_BIAS")
    backward = _compile_for(
        tk._backward_kernel,
        {
            **common,
            **dict.fromkeys(flags, True),
            "BLOCK_N": blocks.backward_n,
            "BLOCK_V": blocks.backward_v,
            "BLOCK_H": blocks.backward_h,
        },
        name,
        arch,
    )
    for kernel in (forward, backward):
        assert kernel.asm["cubin"]
        assert ("mma" in kernel.asm["ptx"]) == (dtype == torch.bfloat16)
    atomic = re.compile(r"\s(red|atom)\.global\.\S*add\.f32")  # e.g. "@%p7 red.global.gpu.relaxed.add.f32"
    assert atomic.search(backward.asm["ptx"]) and not atomic.search(forward.asm["ptx"])


def test_unknown_impl_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'cuda'.*auto, fused, naive, triton"):
        resolve_impl("cuda", torch.zeros(1))
