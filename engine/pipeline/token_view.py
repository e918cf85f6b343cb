"""A sample's tokens for the rollout browser's token view: each token's text as the tokenizer split
the completion, with the log-probability it was sampled with and the entropy of the distribution it
was drawn from (``Completion.logprobs`` / ``Completion.entropies``, recorded by the rollout backend).

Sent in the samples event as ``extra.tokens`` (engine/pipeline/metrics.py ``sample_items``), compactly:

    {"text": ["The", " answer", ...], "logprob": [-0.012, -1.5, ...], "entropy": [0.08, 2.1, ...],
     "count": 37}

``entropy`` is absent when the backend has none (vLLM without ``logging.token_entropy_top_k``);
``count`` is the completion's number of tokens, larger than ``len(text)`` when
``logging.tokens_per_sample`` cut it. Values are rounded to 3 decimals (a colour scale and a tooltip
need no more; it keeps a token near 20 bytes of JSON).

Token text: byte-level BPE tokenizers (GPT-2, Qwen, Llama 3, the built-in tiny one) spell a token in
a 256-character alphabet standing for bytes (``Ġ`` is a space); those bytes are decoded here with an
incremental UTF-8 decoder, so a character split across tokens is shown on the token that completes it
and the texts joined are exactly the completion's (special tokens, such as the EOS the model sampled,
appear as their names). SentencePiece tokenizers mark a space with ``▁`` and spell raw bytes ``<0x0A>``;
both become text the same way.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

ROUND = 3
_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's map of the 256 bytes to printable characters, inverted (Radford et al. 2019,
    ``bytes_to_unicode``): printable Latin-1 stands for itself, the rest is shifted past U+0100."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is not None:
        return "ByteLevel" in repr(decoder)
    return hasattr(tokenizer, "byte_decoder")  # a slow GPT-2 style tokenizer


def token_texts(tokenizer: Any) -> Callable[[Sequence[int]], list[str]]:
    """A function from a completion's token ids to each token's text (see the module docstring)."""
    byte_level = _is_byte_level(tokenizer)
    byte_decoder = _byte_decoder()
    specials = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}

    def piece_bytes(token_id: int, piece: str) -> bytes:
        if token_id in specials:
            return piece.encode()
        if byte_level and all(ch in byte_decoder for ch in piece):
            return bytes(byte_decoder[ch] for ch in piece)
        match = _SP_BYTE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def texts(ids: Sequence[int]) -> list[str]:
        ids = [int(i) for i in ids]
        pieces = tokenizer.convert_ids_to_tokens(ids)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        out = [decoder.decode(piece_bytes(i, p or "")) for i, p in zip(ids, pieces)]
        if out:
            out[-1] += decoder.decode(b"", final=True)  # an unfinished character at the end: U+FFFD
        return out

    return texts


def token_fields(
    texts: list[str], logprobs: Sequence[float], entropies: Sequence[float] | None, count: int
) -> dict[str, Any]:
    """``extra.tokens`` of one sample: ``texts`` are the first tokens' texts (already cut), the
    log-probs/entropies are cut to match."""
    n = len(texts)
    out: dict[str, Any] = {"text": texts, "logprob": [round(float(x), ROUND) for x in logprobs[:n]]}
    if entropies is not None:
        out["entropy"] = [round(float(x), ROUND) for x in entropies[:n]]
    out["count"] = count
    return out
