"""Memory-lean kernels for RL training of language models."""

from kernels.logprob import (
    DEFAULT_CHUNK_SIZE,
    IMPLEMENTATIONS,
    fused_logprobs_entropy,
    logprobs_from_hidden,
    naive_logprobs_entropy,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "IMPLEMENTATIONS",
    "fused_logprobs_entropy",
    "logprobs_from_hidden",
    "naive_logprobs_entropy",
]
