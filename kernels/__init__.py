"""Memory-lean kernels for RL training of language models.

The Triton kernels (:mod:`kernels.triton_logprob`) are imported on demand by
:func:`resolve_impl`, so ``import kernels`` works without ``triton`` installed.
"""

from kernels.logprob import (
    CHUNK_BYTES,
    IMPLEMENTATIONS,
    auto_chunk_size,
    fused_logprobs_entropy,
    logprobs_from_hidden,
    naive_logprobs_entropy,
    resolve_impl,
)

__all__ = [
    "CHUNK_BYTES",
    "IMPLEMENTATIONS",
    "auto_chunk_size",
    "fused_logprobs_entropy",
    "logprobs_from_hidden",
    "naive_logprobs_entropy",
    "resolve_impl",
]
