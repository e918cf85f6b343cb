"""What every rollout backend does the same way, so a prompt samples alike whichever backend runs it:
the tokens that end a completion, and the seed of each sequence's private random stream."""

from __future__ import annotations


def eos_token_ids(model: object, tokenizer: object) -> list[int]:
    """The token ids that end a completion: the tokenizer's EOS and the model's generation config's
    (``eos_token_id`` may be one id or a list; instruct models often stop on several)."""
    ids: list[int] = []
    candidates: list[object] = [getattr(tokenizer, "eos_token_id", None)]
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        candidates.append(generation_config.eos_token_id)
    for c in candidates:
        for i in c if isinstance(c, (list, tuple)) else [c]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sequence_seed(seed: int, seq_id: int) -> int:
    """Seed of sequence ``seq_id``'s private generator: a hash (splitmix64) of the call seed and the
    sequence number, below 2**63 as torch requires, so a sequence's randomness depends on
    ``(seed, seq_id)`` alone, not on how the backend batches it."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ seq_id) >> 1
