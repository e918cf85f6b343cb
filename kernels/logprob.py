"""Per-token log-probabilities and entropy of an LM head, without materialising the full logits.

In RL post-training the trainer needs, for every response token ``n`` with label ``y_n``::

    z_n      = (h_n @ W.T + b) / T                    # logits of token n, shape [V]
    lse_n    = logsumexp(z_n)
    logp_n   = z_n[y_n] - lse_n                       # log p(y_n)
    H_n      = -sum_j p_nj log p_nj,  p_n = softmax(z_n)

The naive computation builds the logits for all ``N`` tokens at once, an ``[N, V]`` float32 tensor,
and autograd keeps several more of them alive (log-softmax output, softmax, gradients). At
``V = 151_936`` (Qwen) and ``N = 4096`` each one is 2.5 GB, so they dominate peak memory.

:func:`fused_logprobs_entropy` walks over the tokens in chunks of ``chunk_size`` rows. Only a
``[chunk_size, V]`` block of logits exists at any time, so the extra memory is ``O(chunk_size * V)``
instead of ``O(N * V)``. The forward pass keeps only ``hidden``, ``weight``, ``labels`` and two
float32 numbers per token (``lse`` and ``H``); the backward pass recomputes each block of logits and
accumulates the gradients. That costs one extra ``[N, H] x [H, V]`` matmul (four instead of three),
which is paid back by never touching ``N * V``-sized tensors in memory.

Memory discipline (what the peak of a forward+backward holds, float32): ``weight.grad`` (``V H``) and
``hidden.grad`` (``N H``), which any implementation must return, plus one ``[chunk, V]`` logits block
(the matmul's output, then overwritten in place by ``log p`` and ``g_z``) and one ``[chunk / 4, V]`` block
for ``exp``; ``grad_weight`` is accumulated in place (``addmm_``), never summed from
per-chunk copies. The chunk defaults to a fixed byte budget (:func:`auto_chunk_size`), so the
block does not grow with the vocabulary. Nothing ``V``-sized is saved for backward.

Gradients, per token (rows of the chunk), with ``g_logp`` and ``g_H`` the upstream gradients::

    d logp_n / d z_nj = 1[j = y_n] - p_nj
    d H_n    / d z_nj = -p_nj (log p_nj + H_n)
    g_z  = g_logp * (onehot(y) - p) - g_H * p * (log p + H)
    g_z' = g_z / T                                    # chain rule through the temperature
    grad_hidden = g_z' @ W,   grad_weight = g_z'.T @ hidden,   grad_bias = g_z'.sum(0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

__all__ = [
    "CHUNK_BYTES",
    "IMPLEMENTATIONS",
    "LogprobsEntropyFunction",
    "auto_chunk_size",
    "check_inputs",
    "fused_logprobs_entropy",
    "logprobs_from_hidden",
    "naive_logprobs_entropy",
    "resolve_impl",
    "sub_block_rows",
]

# Bytes of the one ``[chunk, V]`` logits block a chunk holds (see auto_chunk_size). With the input
# gradients it sets the fused step's peak: at 4096 tokens, hidden 896, float32, weight.grad + hidden.grad
# are 123 MiB (V = 32k) and 533 MiB (V = 151,936), and 64 MiB of logits adds half of that floor at 32k
# (at 151k MIN_CHUNK_TOKENS sets the block: 297 MiB).
CHUNK_BYTES = 64 * 1024 * 1024

# Fewest tokens per chunk, whatever CHUNK_BYTES says: every chunk reads and writes all of the
# [V, H] float32 grad_weight once (addmm_), 8 V H bytes for 2 chunk V H flops, i.e. chunk / 4 flops
# per byte; at small chunks that traffic, not the arithmetic, sets the backward's time on a CPU (and
# the forward's matmul reads all of W per chunk, chunk / 2 flops per byte). Measured at V = 151,936
# (bench/logprob_kernel.py, 2 loaded cores): 256 tokens took 1.39x naive, 1024 tokens 1.18x.
MIN_CHUNK_TOKENS = 512

# The element-wise passes (exp, products, sums) need a second buffer next to the logits block (for
# exp(z - m) in forward, p in backward); they walk the chunk in this many row sub-blocks so that the
# buffer is a quarter of the logits block. More, smaller sub-blocks would save memory but cost one
# torch call (an OpenMP region) per pass per sub-block: on a loaded 2-core machine each region waits
# for its threads to be scheduled, and 1 MiB sub-blocks (8 rows at 32k) made the step 2.2x naive.
SUB_BLOCKS_PER_CHUNK = 4

# "auto": the Triton kernels on CUDA tensors when triton imports, else "fused" (see resolve_impl).
IMPLEMENTATIONS = ("auto", "fused", "naive", "triton")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the logits and statistics: float32, or float64 when the inputs are float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def auto_chunk_size(vocab: int, dtype: torch.dtype = torch.float32) -> int:
    """Tokens per chunk such that one ``[chunk, V]`` block of ``dtype`` logits is about
    :data:`CHUNK_BYTES`, and at least :data:`MIN_CHUNK_TOKENS`.

    The logits block is the only large ``V``-sized buffer of a chunk, so this fixes its bytes whatever
    the vocabulary, down to :data:`MIN_CHUNK_TOKENS`: 524 tokens (64 MiB) at ``V = 32_000`` and 512
    (297 MiB) at ``V = 151_936`` in float32. A fixed token count would let the block grow with ``V``
    (1024 tokens: 125 MiB at 32k, 594 MiB at 151k).
    """
    itemsize = torch.empty((), dtype=_compute_dtype(dtype)).element_size()
    return max(MIN_CHUNK_TOKENS, CHUNK_BYTES // (max(vocab, 1) * itemsize))


def sub_block_rows(rows: int) -> int:
    """Rows per sub-block of the element-wise passes over a ``rows``-token chunk (see
    :data:`SUB_BLOCKS_PER_CHUNK`)."""
    return max(1, -(-rows // SUB_BLOCKS_PER_CHUNK))


def _chunk_logits(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float, out: Tensor
) -> Tensor:
    """Write ``(hidden @ weight.T + bias) / temperature`` into ``out`` (float32/float64) and return it.

    The matmul runs in the input dtype (for bf16 the fast path); the result is cast to float32
    before the softmax, which is where low precision would hurt.
    """
    if hidden.dtype == out.dtype:
        torch.mm(hidden, weight.T, out=out)
    else:
        out.copy_(hidden @ weight.T)
    if bias is not None:
        out += bias
    if temperature != 1.0:
        out /= temperature
    return out


def check_inputs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    temperature: float,
    chunk_size: int | None,
) -> None:
    """Refuse bad shapes, dtypes, temperature or chunk size with a message naming them; every
    implementation (fused, naive, Triton) checks with this, so each refuses the same input the same way."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"expected labels [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"expected bias [{weight.shape[0]}], got {tuple(bias.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share a dtype, got {hidden.dtype} and {weight.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (or None: sized from the vocabulary), got {chunk_size}")


def _chunked_forward(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    temperature: float,
    compute_entropy: bool,
    chunk_size: int | None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Return ``(logprobs, lse, entropy or None)``, each ``[N]``, one ``[chunk, V]`` block at a time.

    Per row, with ``m = max_j z_j``, ``e_j = exp(z_j - m)`` and ``s = sum_j e_j``::

        lse = m + log s,   logp_y = z_y - lse,   H = log s - sum_j e_j (z_j - m) / s

    Buffers: one ``[chunk, V]`` block for the logits (the matmul's output, shifted in place) and one
    ``[sub, V]`` block (:func:`sub_block_rows`) for ``e`` and ``e (z - m)``, reused by every chunk.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    dtype = _compute_dtype(hidden.dtype)
    chunk_size = chunk_size or auto_chunk_size(vocab, hidden.dtype)
    logprobs = torch.empty(n, dtype=dtype, device=hidden.device)
    lse = torch.empty(n, dtype=dtype, device=hidden.device)
    entropy = torch.empty(n, dtype=dtype, device=hidden.device) if compute_entropy else None
    if n == 0:
        return logprobs, lse, entropy
    rows = min(chunk_size, n)
    sub = sub_block_rows(rows)
    logits_buf = torch.empty((rows, vocab), dtype=dtype, device=hidden.device)
    exp_buf = torch.empty((sub, vocab), dtype=dtype, device=hidden.device)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        logits = _chunk_logits(hidden[start:end], weight, bias, temperature, out=logits_buf[: end - start])
        label_logits = logits.gather(1, labels[start:end, None]).squeeze(1)
        for lo in range(0, end - start, sub):
            hi = min(lo + sub, end - start)
            shifted = logits[lo:hi]
            row_max = shifted.amax(dim=-1)
            shifted -= row_max[:, None]
            exp_shifted = torch.exp(shifted, out=exp_buf[: hi - lo])
            sum_exp = exp_shifted.sum(dim=-1)
            log_sum = sum_exp.log()
            lse[start + lo : start + hi] = row_max + log_sum
            if entropy is not None:
                # sum_j e_j (z_j - m), the product formed in place in exp_buf
                entropy[start + lo : start + hi] = log_sum - exp_shifted.mul_(shifted).sum(dim=-1) / sum_exp
        logprobs[start:end] = label_logits - lse[start:end]
    return logprobs, lse, entropy


class LogprobsEntropyFunction(torch.autograd.Function):
    """The autograd Function shared by the memory-lean implementations (torch chunks, Triton tiles).

    They differ in how they compute the statistics and the gradients, not in what they keep between
    the two: forward saves the inputs and two numbers per token (``lse`` and ``H``) and no logits,
    which backward recomputes. A subclass is one implementation; it defines two staticmethods:

    * ``statistics(hidden, weight, labels, bias, temperature, compute_entropy, tiling)`` ->
      ``(logprobs, lse, entropy or None)``, each ``[N]``;
    * ``gradients(ctx, saved, grad_logprobs, grad_entropy)`` -> ``(grad_hidden, grad_weight,
      grad_bias)``, each None where ``ctx.needs_input_grad`` says it is not needed; ``saved`` is
      ``(hidden, weight, labels, bias, lse, entropy)``, ``grad_entropy`` is None when the entropy
      was not computed, and ``ctx.temperature`` and ``ctx.tiling`` (the implementation's chunk size
      or tile sizes) are set.

    Callers go through :meth:`run`.
    """

    statistics: Callable[..., tuple[Tensor, Tensor, Tensor | None]]
    gradients: Callable[..., tuple[Tensor | None, Tensor | None, Tensor | None]]

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        bias: Tensor | None,
        temperature: float,
        compute_entropy: bool,
        tiling: Any,
        implementation: type[LogprobsEntropyFunction],
    ) -> tuple[Tensor, Tensor]:
        logprobs, lse, entropy = implementation.statistics(
            hidden, weight, labels, bias, temperature, compute_entropy, tiling
        )
        if entropy is None:
            # autograd.Function outputs must be tensors; run turns this into None.
            entropy = logprobs.new_empty(0)
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(hidden, weight, labels, bias, lse, entropy)
        ctx.temperature = temperature
        ctx.compute_entropy = compute_entropy
        ctx.tiling = tiling
        ctx.implementation = implementation
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None and costs nothing
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx: FunctionCtx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        if not ctx.compute_entropy:
            grad_entropy = None
        if grad_logprobs is None and grad_entropy is None:
            return (None,) * 8
        grad_hidden, grad_weight, grad_bias = ctx.implementation.gradients(
            ctx, ctx.saved_tensors, grad_logprobs, grad_entropy
        )
        return grad_hidden, grad_weight, None, grad_bias, None, None, None, None

    @classmethod
    def run(
        cls,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        bias: Tensor | None,
        temperature: float,
        compute_entropy: bool,
        tiling: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """``(logprobs, entropy or None)``; if nothing requires a gradient (or grad mode is off)
        only ``statistics`` runs, with no autograd bookkeeping."""
        differentiable = [hidden, weight] + ([bias] if bias is not None else [])
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in differentiable)):
            logprobs, _, entropy = cls.statistics(
                hidden, weight, labels, bias, temperature, compute_entropy, tiling
            )
            return logprobs, entropy
        logprobs, entropy = cls.apply(hidden, weight, labels, bias, temperature, compute_entropy, tiling, cls)
        return logprobs, (entropy if compute_entropy else None)


class _FusedLogprobsEntropy(LogprobsEntropyFunction):
    """Chunked logprobs/entropy; recomputes the logits chunk by chunk in backward."""

    statistics = staticmethod(_chunked_forward)

    @staticmethod
    def gradients(
        ctx: FunctionCtx, saved: tuple[Tensor, ...], grad_logprobs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        hidden, weight, labels, bias, lse, entropy = saved
        need_hidden, need_weight, _, need_bias = ctx.needs_input_grad[:4]
        n, vocab, temperature = hidden.shape[0], weight.shape[0], ctx.temperature
        chunk_size = ctx.tiling or auto_chunk_size(vocab, hidden.dtype)
        dtype = lse.dtype  # float32, or float64 for float64 inputs

        grad_hidden = (
            torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
        )
        # Accumulated in place over the chunks (addmm_), in float32 even for bf16 weights; cast once
        # at the end. For float32 weights this buffer *is* the returned gradient: no per-chunk copy.
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(vocab, dtype=dtype, device=weight.device) if need_bias else None
        if n == 0:
            return grad_hidden, grad_weight, grad_bias
        rows = min(chunk_size, n)
        sub = sub_block_rows(rows)
        logits_buf = torch.empty((rows, vocab), dtype=dtype, device=hidden.device)
        p_buf = torch.empty((sub, vocab), dtype=dtype, device=hidden.device)
        # g_logp and g_H come pre-divided by T (z = raw / T); [N, 1] columns, O(N) memory.
        g_logp = grad_logprobs.to(dtype)[:, None] / temperature if grad_logprobs is not None else None
        g_h = grad_entropy.to(dtype)[:, None] / temperature if grad_entropy is not None else None
        if g_h is not None:
            # grad_z = g_logp * (onehot(y) - p) - g_H * p * (log p + H)
            #        = p * (-g_H * log p - (g_H * H + g_logp)) + g_logp * onehot(y)
            offset = g_h * entropy[:, None]
            if g_logp is not None:
                offset += g_logp
            neg_g_h = -g_h
        else:
            neg_g_logp = -g_logp

        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            hidden_chunk = hidden[start:end]
            grad_z = _chunk_logits(hidden_chunk, weight, bias, temperature, out=logits_buf[: end - start])
            # grad_z overwrites the logits block in place, one sub-block of rows at a time
            for lo in range(start, end, sub):
                hi = min(lo + sub, end)
                log_p = grad_z[lo - start : hi - start]
                log_p -= lse[lo:hi, None]
                p = torch.exp(log_p, out=p_buf[: hi - lo])
                if g_h is not None:
                    log_p.mul_(neg_g_h[lo:hi]).sub_(offset[lo:hi]).mul_(p)
                else:
                    torch.mul(p, neg_g_logp[lo:hi], out=log_p)
            if g_logp is not None:
                grad_z.scatter_add_(1, labels[start:end, None], g_logp[start:end])

            grad_z_lowp = grad_z.to(weight.dtype)  # no copy unless the inputs are bf16/fp16
            if grad_hidden is not None:
                torch.mm(grad_z_lowp, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                if weight.dtype == dtype:
                    grad_weight.addmm_(grad_z.T, hidden_chunk)
                else:
                    grad_weight += grad_z_lowp.T @ hidden_chunk
            if grad_bias is not None:
                grad_bias += grad_z.sum(dim=0)
            del grad_z_lowp

        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias


def fused_logprobs_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    compute_entropy: bool = True,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of ``labels`` and entropies under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Args:
        hidden: ``[N, H]`` last hidden states (may be a non-contiguous view), float32/bf16/fp16/float64.
        weight: ``[V, H]`` LM-head weight, same dtype as ``hidden``.
        labels: ``[N]`` int64 token ids. Every position is scored; mask ignored ones in the caller.
        temperature: sampling temperature the logits are divided by.
        chunk_size: tokens per block, or None (default) for :func:`auto_chunk_size` of ``V`` (a
            :data:`CHUNK_BYTES` logits block). Extra memory beyond the gradients is about
            ``1.25 * chunk_size * V * 4`` bytes (the logits block and a quarter-size sub-block buffer).
        compute_entropy: if False, skip the entropy (saves one pass over each block) and return None.
        bias: optional ``[V]`` LM-head bias.

    Returns:
        ``(logprobs [N], entropy [N] or None)`` in float32 (float64 if the inputs are float64).

    Peak memory is ``O(chunk_size * V)`` instead of the naive ``O(N * V)``: the logits are built one
    ``[chunk_size, V]`` block at a time, in forward and again in backward. If nothing requires a
    gradient (or grad mode is off) only the chunked forward runs, with no autograd bookkeeping.
    """
    check_inputs(hidden, weight, labels, bias, temperature, chunk_size)
    return _FusedLogprobsEntropy.run(hidden, weight, labels, bias, temperature, compute_entropy, chunk_size)


def naive_logprobs_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference implementation: full ``[N, V]`` logits, ``log_softmax``, gather, entropy.

    Same contract as :func:`fused_logprobs_entropy` (logits cast to float32 before the softmax),
    but every ``[N, V]`` intermediate is materialised and kept by autograd.
    """
    logits = torch.nn.functional.linear(hidden, weight, bias).to(_compute_dtype(hidden.dtype)) / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    logprobs = log_p.gather(1, labels[:, None]).squeeze(1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logprobs, entropy


def resolve_impl(impl: str, hidden: Tensor) -> str:
    """The implementation (``"fused"``, ``"naive"`` or ``"triton"``) that ``impl`` means for ``hidden``.

    ``"auto"`` picks the Triton kernels (:mod:`kernels.triton_logprob`) for CUDA tensors of a dtype
    they take when ``triton`` imports and the interpreter is off (``TRITON_INTERPRET=1`` runs them
    correctly but orders of magnitude slower), and the chunked torch version otherwise (CPU, float64,
    no triton). ``"triton"`` insists, and raises a ValueError naming ``trainer.logprob_impl`` when the
    kernels cannot run here, instead of failing inside Triton's launcher.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown impl {impl!r}; known: {', '.join(IMPLEMENTATIONS)}")
    if impl not in ("auto", "triton"):
        return impl
    try:
        from kernels import triton_logprob
    except ImportError as exc:
        if impl == "auto":
            return "fused"
        raise ValueError(
            f"trainer.logprob_impl='triton' needs the triton package ({exc}); "
            "install it or set trainer.logprob_impl to 'auto' or 'fused'"
        ) from exc
    reason = triton_logprob.unavailable_reason(hidden)
    if impl == "auto":
        return "triton" if reason is None and not triton_logprob.interpreter_enabled() else "fused"
    if reason is not None:
        raise ValueError(
            f"trainer.logprob_impl='triton' cannot run: {reason}; set trainer.logprob_impl to 'auto' "
            "(Triton on GPUs, the torch kernel elsewhere) or 'fused'"
        )
    return "triton"


def logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    compute_entropy: bool = True,
    impl: str = "auto",
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Batched entry point for the trainer: ``hidden [B, T, H]``, ``labels [B, T]`` -> ``[B, T]`` outputs.

    Flattens the leading dimensions, runs ``impl`` (one of :data:`IMPLEMENTATIONS`, resolved by
    :func:`resolve_impl`) and reshapes back. Any leading shape works as long as
    ``labels.shape == hidden.shape[:-1]``.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown impl {impl!r}; known: {', '.join(IMPLEMENTATIONS)}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels {tuple(labels.shape)} must match hidden {tuple(hidden.shape)} without its last dim"
        )
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    impl = resolve_impl(impl, flat_hidden)
    if impl in ("triton", "fused"):
        if impl == "triton":
            from kernels.triton_logprob import triton_logprobs_entropy as lean_logprobs_entropy
        else:
            lean_logprobs_entropy = fused_logprobs_entropy
        logprobs, entropy = lean_logprobs_entropy(
            flat_hidden,
            weight,
            flat_labels,
            temperature=temperature,
            chunk_size=chunk_size,
            compute_entropy=compute_entropy,
            bias=bias,
        )
    else:
        check_inputs(flat_hidden, weight, flat_labels, bias, temperature, chunk_size)
        logprobs, entropy = naive_logprobs_entropy(flat_hidden, weight, flat_labels, temperature, bias)
        if not compute_entropy:
            entropy = None
    out_shape = labels.shape
    return logprobs.view(out_shape), (entropy.view(out_shape) if entropy is not None else None)
