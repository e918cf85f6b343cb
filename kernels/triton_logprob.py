"""Triton kernels for per-token log-probabilities and entropy of an LM head (forward and backward).

Same computation and contract as :func:`kernels.logprob.fused_logprobs_entropy` (formulas in that
module's docstring), for CUDA GPUs: the ``[N, V]`` logits never exist in global memory, not even a
``[chunk, V]`` block of them. Each program computes a ``[BLOCK_N, BLOCK_V]`` tile of logits in
registers/shared memory with ``tl.dot`` over ``BLOCK_H`` slices of the hidden size, uses it, and drops
it. This is the design of Cut Cross-Entropy (Wijmans et al., "Cut Your Losses in Large-Vocabulary
Language Models", ICLR 2025, https://arxiv.org/abs/2411.09009), extended with the entropy:

- Forward, grid ``(cdiv(N, BLOCK_N), splits)``: program ``(i, s)`` walks the vocabulary tiles of
  split ``s`` for token block ``i`` and keeps, per token, an online logsumexp (running max ``m`` and
  ``s = sum_j exp(z_j - m)``, rescaled when ``m`` grows, as in FlashAttention), the entropy's running
  ``a = sum_j exp(z_j - m) (z_j - m)`` (rescaled as ``exp(m - m') (a + (m - m') s)``) and the
  label's logit. Splitting the vocabulary over a second grid axis keeps the GPU busy when ``N`` is
  small (an RL micro-batch may hold a few hundred response tokens: ``N / BLOCK_N`` programs alone
  would leave most SMs idle); the few ``[splits, N]`` partial statistics are merged in torch, which
  costs ``O(splits * N)``. Unsloth's cross-entropy kernel merges vocabulary chunks the same way
  (a logsumexp of per-chunk logsumexps), on materialised logits.
- Backward, grid ``(cdiv(N, BLOCK_N), cdiv(V, BLOCK_V))``: every program recomputes its logits tile
  from ``hidden``, ``weight`` and the saved ``lse``, forms ``g_z`` (the same formula as the torch
  version), then contracts it over ``BLOCK_H`` slices into ``grad_hidden`` (``g_z @ W``) and
  ``grad_weight`` (``g_z.T @ hidden``), and ``grad_bias`` (``g_z.sum(0)``).

**Atomics, not a separate reduction, for grad_weight (and grad_hidden, grad_bias).** A weight tile
receives contributions from every token block and a hidden tile from every vocabulary tile. The
alternatives are (a) two owner-computes kernels, one over token blocks for ``grad_hidden`` and one
over vocabulary tiles for ``grad_weight``, which recomputes every logits tile twice (backward = 4
matmul-equivalents instead of 3) and leaves only ``N / BLOCK_N`` or ``V / BLOCK_V`` programs, or
(b) Liger-Kernel's fused linear cross-entropy (https://github.com/linkedin/Liger-Kernel,
``ops/fused_linear_cross_entropy.py``), which materialises a ``[chunk, V]`` logits block per chunk of
tokens with cuBLAS, writes ``g_z`` into it with a Triton kernel, and reduces with two more cuBLAS
matmuls (``addmm`` into ``grad_weight``): deterministic and fast, but it is the chunked scheme the
torch version already implements, with ``O(chunk * V)`` extra memory. CCE instead accumulates both
gradients with float32 ``atomic_add``: one recomputation, ``N / BLOCK_N * V / BLOCK_V`` independent
programs, no ``[*, V]`` buffer. The costs: the accumulation order, hence the last bits of the
gradients, varies from run to run (not bitwise reproducible), and the atomics' traffic into L2.
``sem="relaxed"`` is enough because nothing reads the accumulators before the kernel ends. CCE also
skips tiles whose ``|g_z|`` is below the bf16 resolution ("gradient filtering"); that is not done
here, because it would break the float32 agreement with the torch version that the tests check.

Precision: logits, statistics and ``g_z`` are float32 (``tl.dot`` accumulates in float32; for bf16
inputs the logits are even slightly more exact than the torch version's, which rounds the bf16
matmul output before casting). ``g_z`` is cast to the input dtype before the gradient matmuls, as
the torch version does, and the float32 accumulators are cast to the input dtype at the end. For
float32 inputs ``tl.dot`` uses TF32 only if ``torch.backends.cuda.matmul.allow_tf32`` is set, so the
result follows the same switch as the torch matmuls. float64 is not supported (``tl.dot`` in fp64 is
slow or missing on most GPUs): use the torch implementation for it.

Interpreter: ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors, correctly and very slowly
(small shapes only). Triton reads the variable when it decorates a function, and it decorates its
own standard library (``tl.sum``, ``tl.max``, ``tl.zeros``, ...) when ``triton.language`` is first
imported; kernels of one mode cannot call library functions of the other. So the variable must be
set before the process imports triton (the tests start a fresh process for the kernel checks), and
this module decorates its kernels in the mode the standard library was built in, whatever the
variable says later.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import FunctionCtx
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from kernels.logprob import LogprobsEntropyFunction, check_inputs

__all__ = [
    "SUPPORTED_DTYPES",
    "TritonBlocks",
    "default_blocks",
    "interpreter_enabled",
    "triton_logprobs_entropy",
    "unavailable_reason",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TritonBlocks:
    """Tile sizes (``tl.dot`` needs each dimension >= 16) and launch parameters.

    ``forward_splits=None`` picks enough vocabulary splits for about four programs per SM; the tests
    set it to exercise the merge on the CPU interpreter. See :func:`default_blocks` for the defaults.
    """

    forward_n: int
    forward_v: int
    forward_h: int
    backward_n: int
    backward_v: int
    backward_h: int
    num_warps: int = 4
    num_stages: int = 2
    forward_splits: int | None = None


# Chosen by compiling both kernels ahead of time for sm_80 and sm_90 (Triton 3.9, ptxas -v, no GPU
# needed) and keeping the largest tiles without register spills; not timed on hardware, which is
# the next step (triton.autotune over a few of these). bf16/fp16 operands go through tensor cores
# (mma); float32 with input_precision "ieee" runs on FMA units and needs smaller tiles to fit the
# registers (64 x 128 float32 tiles spilled ~0.9 KB per thread).
_BLOCKS_16BIT = TritonBlocks(64, 128, 32, 64, 64, 64, num_warps=8, num_stages=3)
_BLOCKS_FP32 = TritonBlocks(32, 64, 16, 32, 64, 16, num_warps=4, num_stages=2)


def default_blocks(dtype: torch.dtype) -> TritonBlocks:
    """Spill-free tiles for ``dtype`` on A100/H100-class GPUs (see above)."""
    return _BLOCKS_FP32 if dtype == torch.float32 else _BLOCKS_16BIT


def interpreter_enabled() -> bool:
    """Whether Triton runs in its interpreter: fixed when ``triton.language`` was imported (see above)."""
    return isinstance(tl.zeros, InterpretedFunction)


def _jit(fn: Callable) -> InterpretedFunction | JITFunction:
    """``triton.jit`` in the mode of Triton's standard library, not of today's ``TRITON_INTERPRET``."""
    return InterpretedFunction(fn) if interpreter_enabled() else JITFunction(fn)


def unavailable_reason(tensor: Tensor) -> str | None:
    """Why the kernels cannot run on ``tensor``'s device and dtype right now, or None if they can."""
    if tensor.dtype not in SUPPORTED_DTYPES:
        return f"the Triton kernel takes float32, bfloat16 or float16 inputs, got {tensor.dtype}"
    if tensor.is_cuda or interpreter_enabled():
        return None
    return (
        f"the tensors are on {tensor.device} (Triton kernels need CUDA tensors) and the process did not "
        "import triton with TRITON_INTERPRET=1"
    )


@_jit
def _forward_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    labels_ptr,
    max_ptr,  # [splits, N] float32 partial statistics, one row per vocabulary split
    sum_exp_ptr,
    ent_acc_ptr,
    label_logit_ptr,
    n_rows,
    vocab,
    dim,
    temperature,
    stride_hn,
    stride_hh,
    stride_wv,
    stride_wh,
    tiles_per_split,
    HAS_BIAS: tl.constexpr,
    COMPUTE_ENTROPY: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=0)
    # checked only in debug builds (TRITON_DEBUG=1); the torch version raises in gather instead
    tl.device_assert((labels >= 0) & (labels < vocab), "label outside [0, vocab)")
    offs_h = tl.arange(0, BLOCK_H)

    run_max = tl.full([BLOCK_N], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_N], tl.float32)
    run_ent = tl.zeros([BLOCK_N], tl.float32)  # sum_j exp(z_j - m) (z_j - m)
    label_logit = tl.zeros([BLOCK_N], tl.float32)

    v_begin = split * tiles_per_split * BLOCK_V
    v_end = tl.minimum(v_begin + tiles_per_split * BLOCK_V, vocab)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < vocab
        logits = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
        for h0 in range(0, dim, BLOCK_H):
            hcols = h0 + offs_h
            h_ok = hcols < dim
            x = tl.load(
                hidden_ptr + rows[:, None].to(tl.int64) * stride_hn + hcols[None, :] * stride_hh,
                mask=row_ok[:, None] & h_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                weight_ptr + cols[:, None].to(tl.int64) * stride_wv + hcols[None, :] * stride_wh,
                mask=col_ok[:, None] & h_ok[None, :],
                other=0.0,
            )
            logits = tl.dot(x, tl.trans(w), logits, input_precision=INPUT_PRECISION)
        if HAS_BIAS:
            logits += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        logits = logits / temperature
        logits = tl.where(col_ok[None, :], logits, float("-inf"))

        new_max = tl.maximum(run_max, tl.max(logits, axis=1))
        scale = tl.exp(run_max - new_max)  # 0 on the first tile (run_max = -inf)
        shifted = tl.where(col_ok[None, :], logits - new_max[:, None], 0.0)
        exp_shifted = tl.where(col_ok[None, :], tl.exp(shifted), 0.0)
        if COMPUTE_ENTROPY:
            # re-centre sum e_j (z_j - m) on the new max: exp(m - m') (a + (m - m') s); the where()
            # avoids -inf * 0 before the first tile
            recentre = tl.where(run_sum > 0, run_max - new_max, 0.0)
            run_ent = scale * (run_ent + recentre * run_sum) + tl.sum(exp_shifted * shifted, axis=1)
        run_sum = scale * run_sum + tl.sum(exp_shifted, axis=1)
        run_max = new_max
        label_logit += tl.sum(tl.where(cols[None, :] == labels[:, None], logits, 0.0), axis=1)

    out = split * n_rows + rows
    tl.store(max_ptr + out, run_max, mask=row_ok)
    tl.store(sum_exp_ptr + out, run_sum, mask=row_ok)
    tl.store(label_logit_ptr + out, label_logit, mask=row_ok)
    if COMPUTE_ENTROPY:
        tl.store(ent_acc_ptr + out, run_ent, mask=row_ok)


@_jit
def _backward_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    labels_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logp_ptr,
    grad_ent_ptr,
    grad_hidden_ptr,  # [N, H] float32, contiguous, zero-initialised
    grad_weight_ptr,  # [V, H] float32, contiguous, zero-initialised
    grad_bias_ptr,  # [V] float32, zero-initialised
    n_rows,
    vocab,
    dim,
    temperature,
    stride_hn,
    stride_hh,
    stride_wv,
    stride_wh,
    HAS_BIAS: tl.constexpr,
    HAS_GRAD_LOGP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    NEED_HIDDEN: tl.constexpr,
    NEED_WEIGHT: tl.constexpr,
    NEED_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < vocab
    valid = row_ok[:, None] & col_ok[None, :]
    offs_h = tl.arange(0, BLOCK_H)

    # recompute the logits tile, exactly as the forward kernel did
    logits = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for h0 in range(0, dim, BLOCK_H):
        hcols = h0 + offs_h
        h_ok = hcols < dim
        x = tl.load(
            hidden_ptr + rows[:, None].to(tl.int64) * stride_hn + hcols[None, :] * stride_hh,
            mask=row_ok[:, None] & h_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            weight_ptr + cols[:, None].to(tl.int64) * stride_wv + hcols[None, :] * stride_wh,
            mask=col_ok[:, None] & h_ok[None, :],
            other=0.0,
        )
        logits = tl.dot(x, tl.trans(w), logits, input_precision=INPUT_PRECISION)
    if HAS_BIAS:
        logits += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    logits = logits / temperature

    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    log_p = tl.where(valid, logits - lse[:, None], 0.0)
    p = tl.where(valid, tl.exp(log_p), 0.0)

    # g_z = g_logp (onehot(y) - p) - g_H p (log p + H), with g_logp, g_H divided by T (z = raw / T)
    grad_z = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    if HAS_GRAD_ENTROPY:
        g_h = tl.load(grad_ent_ptr + rows, mask=row_ok, other=0.0) / temperature
        entropy = tl.load(entropy_ptr + rows, mask=row_ok, other=0.0)
        grad_z -= g_h[:, None] * p * (log_p + entropy[:, None])
    if HAS_GRAD_LOGP:
        g_logp = tl.load(grad_logp_ptr + rows, mask=row_ok, other=0.0) / temperature
        is_label = (cols[None, :] == tl.load(labels_ptr + rows, mask=row_ok, other=-1)[:, None]).to(
            tl.float32
        )
        grad_z += g_logp[:, None] * (is_label - p)
    grad_z = tl.where(valid, grad_z, 0.0)

    if NEED_BIAS:
        tl.atomic_add(grad_bias_ptr + cols, tl.sum(grad_z, axis=0), mask=col_ok, sem="relaxed")
    grad_z_in = grad_z.to(hidden_ptr.dtype.element_ty)  # the input dtype for the tensor cores, as torch does
    for h0 in range(0, dim, BLOCK_H):
        hcols = h0 + offs_h
        h_ok = hcols < dim
        if NEED_HIDDEN:
            w = tl.load(
                weight_ptr + cols[:, None].to(tl.int64) * stride_wv + hcols[None, :] * stride_wh,
                mask=col_ok[:, None] & h_ok[None, :],
                other=0.0,
            )
            tl.atomic_add(
                grad_hidden_ptr + rows[:, None].to(tl.int64) * dim + hcols[None, :],
                tl.dot(grad_z_in, w, input_precision=INPUT_PRECISION),
                mask=row_ok[:, None] & h_ok[None, :],
                sem="relaxed",
            )
        if NEED_WEIGHT:
            x = tl.load(
                hidden_ptr + rows[:, None].to(tl.int64) * stride_hn + hcols[None, :] * stride_hh,
                mask=row_ok[:, None] & h_ok[None, :],
                other=0.0,
            )
            tl.atomic_add(
                grad_weight_ptr + cols[:, None].to(tl.int64) * dim + hcols[None, :],
                tl.dot(tl.trans(grad_z_in), x, input_precision=INPUT_PRECISION),
                mask=col_ok[:, None] & h_ok[None, :],
                sem="relaxed",
            )


def _device_of(tensor: Tensor) -> contextlib.AbstractContextManager:
    """Launch on the tensors' GPU: Triton launches on torch's *current* device, which may be another."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _input_precision(dtype: torch.dtype, device: torch.device) -> str:
    """TF32 for float32 only when torch itself allows it for CUDA matmuls (the default is off)."""
    if dtype == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"  # full float32 products; bf16/fp16 operands are exact in the float32 accumulator anyway


def _forward_splits(n_blocks: int, v_tiles: int, device: torch.device, blocks: TritonBlocks) -> int:
    if blocks.forward_splits is not None:
        wanted = blocks.forward_splits
    elif device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        wanted = triton.cdiv(4 * sms, max(n_blocks, 1))
    else:
        wanted = 1
    return max(1, min(wanted, v_tiles))


def _triton_forward(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    temperature: float,
    compute_entropy: bool,
    blocks: TritonBlocks,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Return ``(logprobs, lse, entropy or None)``, each ``[N]`` float32."""
    n, dim = hidden.shape
    vocab = weight.shape[0]
    f32 = {"dtype": torch.float32, "device": hidden.device}
    if n == 0:
        empty = torch.empty(0, **f32)
        return empty, empty.clone(), (empty.clone() if compute_entropy else None)
    n_blocks = triton.cdiv(n, blocks.forward_n)
    v_tiles = triton.cdiv(vocab, blocks.forward_v)
    wanted = _forward_splits(n_blocks, v_tiles, hidden.device, blocks)
    tiles_per_split = triton.cdiv(v_tiles, wanted)
    splits = triton.cdiv(v_tiles, tiles_per_split)  # no empty split
    run_max, run_sum, run_ent, label_logit = torch.empty((4, splits, n), **f32)
    labels = labels.contiguous()
    with _device_of(hidden):
        _forward_kernel[(n_blocks, splits)](
            hidden,
            weight,
            bias if bias is not None else hidden,  # never read without HAS_BIAS
            labels,
            run_max,
            run_sum,
            run_ent,
            label_logit,
            n,
            vocab,
            dim,
            float(temperature),
            hidden.stride(0),
            hidden.stride(1),
            weight.stride(0),
            weight.stride(1),
            tiles_per_split,
            HAS_BIAS=bias is not None,
            COMPUTE_ENTROPY=compute_entropy,
            INPUT_PRECISION=_input_precision(hidden.dtype, hidden.device),
            BLOCK_N=blocks.forward_n,
            BLOCK_V=blocks.forward_v,
            BLOCK_H=blocks.forward_h,
            num_warps=blocks.num_warps,
            num_stages=blocks.num_stages,
        )
    # Merge the splits: lse = M + log S with S = sum_s s_s exp(m_s - M), and the entropy's
    # sum_j e_j (z_j - M) = sum_s exp(m_s - M) (a_s + (m_s - M) s_s); H = log S - that / S.
    top = run_max.amax(dim=0)
    scale = torch.exp(run_max - top)
    total = (run_sum * scale).sum(dim=0)
    log_total = total.log()
    lse = top + log_total
    logprobs = label_logit.sum(dim=0) - lse
    entropy = None
    if compute_entropy:
        centred = (scale * (run_ent + (run_max - top) * run_sum)).sum(dim=0)
        entropy = log_total - centred / total
    return logprobs, lse, entropy


class _TritonLogprobsEntropy(LogprobsEntropyFunction):
    """Triton forward; recomputes the logits tile by tile in backward (``ctx.tiling``: the blocks)."""

    statistics = staticmethod(_triton_forward)

    @staticmethod
    def gradients(
        ctx: FunctionCtx, saved: tuple[Tensor, ...], grad_logprobs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        hidden, weight, labels, bias, lse, entropy = saved
        need_hidden, need_weight, _, need_bias = ctx.needs_input_grad[:4]
        need_bias = need_bias and bias is not None
        n, dim = hidden.shape
        vocab = weight.shape[0]
        blocks: TritonBlocks = ctx.tiling
        f32 = {"dtype": torch.float32, "device": hidden.device}
        # atomics accumulate into zeroed float32 buffers; an unneeded one is a 1-element placeholder
        grad_hidden = torch.zeros((n, dim) if need_hidden else (1,), **f32)
        grad_weight = torch.zeros((vocab, dim) if need_weight else (1,), **f32)
        grad_bias = torch.zeros(vocab if need_bias else 1, **f32)
        if n > 0:
            # upstream gradients can be expanded views (stride 0): the kernel wants dense float32
            g_logp = grad_logprobs.to(torch.float32).contiguous() if grad_logprobs is not None else lse
            g_ent = grad_entropy.to(torch.float32).contiguous() if grad_entropy is not None else lse
            grid = (triton.cdiv(n, blocks.backward_n), triton.cdiv(vocab, blocks.backward_v))
            with _device_of(hidden):
                _backward_kernel[grid](
                    hidden,
                    weight,
                    bias if bias is not None else hidden,
                    labels.contiguous(),
                    lse,
                    entropy if grad_entropy is not None else lse,
                    g_logp,
                    g_ent,
                    grad_hidden,
                    grad_weight,
                    grad_bias,
                    n,
                    vocab,
                    dim,
                    float(ctx.temperature),
                    hidden.stride(0),
                    hidden.stride(1),
                    weight.stride(0),
                    weight.stride(1),
                    HAS_BIAS=bias is not None,
                    HAS_GRAD_LOGP=grad_logprobs is not None,
                    HAS_GRAD_ENTROPY=grad_entropy is not None,
                    NEED_HIDDEN=need_hidden,
                    NEED_WEIGHT=need_weight,
                    NEED_BIAS=need_bias,
                    INPUT_PRECISION=_input_precision(hidden.dtype, hidden.device),
                    BLOCK_N=blocks.backward_n,
                    BLOCK_V=blocks.backward_v,
                    BLOCK_H=blocks.backward_h,
                    num_warps=blocks.num_warps,
                    num_stages=blocks.num_stages,
                )
        return (
            grad_hidden.to(hidden.dtype) if need_hidden else None,
            grad_weight.to(weight.dtype) if need_weight else None,
            grad_bias.to(bias.dtype) if need_bias else None,
        )


def triton_logprobs_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    compute_entropy: bool = True,
    bias: Tensor | None = None,
    blocks: TritonBlocks | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Drop-in for :func:`kernels.logprob.fused_logprobs_entropy` computed by Triton kernels.

    Same arguments, outputs (float32 ``[N]`` logprobs and entropy or None) and gradients (in the
    inputs' dtypes). ``chunk_size`` is validated and otherwise unused: the kernels tile tokens and
    vocabulary with ``blocks`` (default: :func:`default_blocks` of the input dtype) and never hold
    more than a tile of logits, so there is no chunk to size. Extra memory: the float32 gradient
    accumulators (``[N, H]`` and ``[V, H]``) and ``O(splits * N)`` forward statistics. Labels must
    lie in ``[0, V)``: the kernel checks it only in Triton debug builds (``TRITON_DEBUG=1``), where
    the torch version's ``gather`` always raises. Raises ValueError if the kernels cannot run here
    (see :func:`unavailable_reason`).
    """
    check_inputs(hidden, weight, labels, bias, temperature, chunk_size)
    reason = unavailable_reason(hidden)
    if reason is not None:
        raise ValueError(f"cannot run the Triton logprob kernel: {reason}")
    if weight.device != hidden.device or labels.device != hidden.device:
        raise ValueError(
            f"hidden, weight and labels must be on one device, got {hidden.device}, {weight.device}, "
            f"{labels.device}"
        )
    blocks = blocks or default_blocks(hidden.dtype)
    return _TritonLogprobsEntropy.run(hidden, weight, labels, bias, temperature, compute_entropy, blocks)
