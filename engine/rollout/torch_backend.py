"""The ``torch`` rollout backend: batched, KV-cached sampling on any transformers causal LM.

How a call runs (``TorchRolloutBackend.generate``):

1. The ``len(prompts) * n`` sequences are numbered prompt-major (sequence ``s`` belongs to prompt
   ``s // n``) and cut into chunks of at most ``max_batch_size`` sequences.
2. Prefill: the distinct prompts of a chunk are left-padded and run through the model once; their
   keys/values are then copied ``n`` times (one row per sequence) into a preallocated cache, so a group
   of ``n`` completions pays for its prompt once.
3. Decode: one token per step for every unfinished row. A row that finishes (EOS, stop string,
   ``max_new_tokens``) leaves the batch at once: the last live rows are moved into the freed slots, so
   the live rows stay a contiguous prefix of the buffers and no step is spent on finished sequences.

Fast path (models whose attention goes through transformers' ``AttentionInterface``, e.g. Qwen2/3,
Llama, Mistral): keys/values live in a preallocated ``[rows, kv_heads, length, head_dim]`` buffer per
layer that is written in place (``DynamicCache`` concatenates, i.e. copies the whole cache, at every
step), the 4-D boolean attention masks are built here, and attention runs through
:func:`_rollout_attention` (SDPA without materialising repeated KV heads). During a call the model's
``config._attn_implementation`` points at that function; it is restored afterwards. Other models take
the generic path: ``DynamicCache`` and 2-D masks, same sampling and bookkeeping.

Reproducibility (``SamplingParams.seed`` set): sequence ``s`` (prompt ``s // n``, sample ``s % n``) draws
its uniforms from its own ``torch.Generator`` seeded by a hash of ``(seed, s)`` and picks each token by
inverse-CDF lookup in the filtered distribution. So neither ``max_batch_size`` nor the order rows end up in
after compaction changes which random number a sequence uses at a step: the same prompts (in the same
order), params and weights give the same completions. Bitwise for the same ``max_batch_size``; across
different ``max_batch_size`` the logits can differ in the last float bits (other matmul shapes), which moves
logprobs by ~1e-7 and could change a token only if a uniform fell within that distance of a CDF boundary.
Without a seed, a private generator (seeded from the OS) picks one per call. The process-wide RNG is
never touched.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from engine.models.loading import sliding_window
from engine.rollout.base import (
    Completion,
    FinishReason,
    PromptCompletions,
    SamplingParams,
    checked_continuations,
    checked_inputs,
    native_bf16,
)
from engine.rollout.sampling import eos_token_ids, sequence_seed

__all__ = ["TorchRolloutBackend"]

ATTENTION_NAME = "tributary_rollout"
"""Name under which :func:`_rollout_attention` is registered in transformers' ``AttentionInterface``."""

# KV buffers start this many generated tokens long and double when full (up to prompt + max_new_tokens),
# so a large max_new_tokens does not reserve memory that early-stopping sequences never use.
_INITIAL_GEN_CAPACITY = 256


def _rollout_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """SDPA for ``query [B, H, q, D]``, ``key/value [B, KV, L, D]`` and a boolean mask ``[B, 1, q, L]`` (or None).

    With one query position (decoding) the ``H / KV`` query heads that share a KV head are attended as
    that many query rows of one head: a plain SDPA call on the cache view, without the ``repeat_kv`` copy
    of the whole cache that transformers' SDPA path makes whenever there is a mask.

    It is also a complete causal-LM attention (no mask: causal; dropout honoured), so that anything else
    calling the model while a generation has it switched to this function still computes correctly.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    dropout = dropout if module.training else 0.0
    if q_len == 1 and groups > 1 and dropout == 0.0:
        out = F.scaled_dot_product_attention(
            query.reshape(batch, kv_heads, groups, head_dim),
            key,
            value,
            attn_mask=attention_mask,
            scale=scaling,
        )
        return out.reshape(batch, 1, heads, head_dim), None
    causal = (
        attention_mask is None and q_len > 1 and (is_causal if is_causal is not None else module.is_causal)
    )
    if causal and key.shape[2] != q_len:
        raise ValueError("rollout attention: a causal call without a mask must not have cached keys")
    gqa = {}
    if groups > 1:
        if query.device.type == "cpu":
            gqa["enable_gqa"] = True
        else:  # CUDA SDPA falls back to its math kernel for GQA with a mask: expand the heads instead
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal, scale=scaling, **gqa
    )
    return out.transpose(1, 2).contiguous(), None


ALL_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, _rollout_attention)
# Calls that do not bring their own 4-D mask get transformers' SDPA-style boolean masks.
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


class _SlotLayer(DynamicLayer):
    """One layer's keys/values in preallocated ``[rows, kv_heads, capacity, head_dim]`` buffers.

    ``update`` writes the new positions in place and returns views of the filled part. The shared
    length lives on the owning :class:`_SlotCache` (every row has the same number of slots: prompts are
    left-padded and all live rows advance together).
    """

    def __init__(self, cache: _SlotCache) -> None:
        super().__init__()
        self._cache = cache
        self.key_buf: torch.Tensor | None = None
        self.value_buf: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self._cache
        rows, start = key_states.shape[0], cache.length
        end = start + key_states.shape[-2]
        if self.key_buf is None:
            shape = (cache.max_rows, key_states.shape[1], cache.capacity, key_states.shape[-1])
            self.key_buf = key_states.new_empty(shape)
            self.value_buf = value_states.new_empty((*shape[:3], value_states.shape[-1]))
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        elif end > self.key_buf.shape[2]:
            self._grow(max(end, min(2 * self.key_buf.shape[2], cache.max_length)))
        self.key_buf[:rows, :, start:end] = key_states
        self.value_buf[:rows, :, start:end] = value_states
        self.keys = self.key_buf[:rows, :, :end]
        self.values = self.value_buf[:rows, :, :end]
        return self.keys, self.values

    def _grow(self, capacity: int) -> None:
        for name in ("key_buf", "value_buf"):
            old = getattr(self, name)
            new = old.new_empty((old.shape[0], old.shape[1], capacity, old.shape[3]))
            new[:, :, : self._cache.length] = old[:, :, : self._cache.length]
            setattr(self, name, new)

    def get_seq_length(self) -> int:
        return self._cache.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.length + query_length, 0

    def copy_rows(self, dst: torch.Tensor | slice, src: torch.Tensor, length: int) -> None:
        if self.key_buf is not None:
            self.key_buf[dst, :, :length] = self.key_buf[src, :, :length]
            self.value_buf[dst, :, :length] = self.value_buf[src, :, :length]


class _SlotCache(Cache):
    """A transformers ``Cache`` over :class:`_SlotLayer` buffers; ``length`` is advanced by the caller."""

    def __init__(self, max_rows: int, capacity: int, max_length: int) -> None:
        super().__init__(layers=[])
        self.max_rows, self.capacity, self.max_length = max_rows, capacity, max_length
        self.length = 0

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.layers) <= layer_idx:
            self.layers.append(_SlotLayer(self))
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def copy_rows(self, dst: torch.Tensor | slice, src: torch.Tensor) -> None:
        for layer in self.layers:
            layer.copy_rows(dst, src, self.length)


@dataclass
class _Chunk:
    """A batch of sequences generated together. Rows are local sequence indices ``0..rows-1``."""

    prompts: list[list[int]]  # distinct prompts of the chunk
    prompt_of_row: list[int]  # index into ``prompts`` of every row
    seq_ids: list[int]  # global sequence number of every row (seeds its random stream)


@dataclass
class _RowResult:
    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float] | None  # None unless SamplingParams.entropies
    finish_reason: FinishReason
    text: str | None  # set when a stop string truncated it


class TorchRolloutBackend:
    """Rollout backend on a transformers causal LM in this process (CPU or one GPU).

    Args:
        model: a ``PreTrainedModel`` with a causal LM head. It may be the trainer's own model object: then
            :meth:`update_weights` with the model's own tensors only bumps the version. The model is put in
            eval mode during :meth:`generate` and its previous mode is restored afterwards.
        tokenizer: its tokenizer (``eos_token_id``, ``pad_token_id`` and ``decode`` are used).
        device: where to generate; defaults to the model's device (a different device moves the model).
        max_batch_size: most sequences decoded together (prompts x n are split into chunks of this size).
        policy_version: version of the initial weights.

    After each :meth:`generate`, ``last_stats`` holds ``gen_tokens`` (completion tokens produced),
    ``gen_seconds`` (wall time of the call), ``tokens_per_second``, ``sequences`` and ``chunks``.
    """

    name = "torch"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: object,
        *,
        device: str | torch.device | None = None,
        max_batch_size: int = 512,
        policy_version: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if device is not None:
            device = torch.device(device)
            if _model_device(model) != device:
                model.to(device)
        self.model = model
        self.tokenizer = tokenizer
        self.device = _model_device(model)
        self.max_batch_size = int(max_batch_size)
        self._version = int(policy_version)
        self.last_stats: dict[str, float] = {}
        self._closed = False

        self.eos_token_ids = eos_token_ids(model, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad)
        self._eos_tensor = torch.tensor(self.eos_token_ids or [-1], dtype=torch.long, device=self.device)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        # Whether continuation_logprobs(reduced_precision=True) runs under bf16 autocast: only a float32
        # model has time to gain, and only where the device multiplies bf16 natively. Probed once here.
        self.scores_in_bf16 = model.dtype == torch.float32 and native_bf16(self.device)

        config = model.config
        self._fast = bool(getattr(model, "_supports_attention_backend", False)) and not getattr(
            config, "sub_configs", None
        )
        self._sliding_window = sliding_window(config)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._token_texts: list[str] | None = None
        self._stop_masks: dict[tuple[str, ...], torch.Tensor] = {}
        # Seeds for calls without SamplingParams.seed: a private generator, never the global RNG.
        self._seed_source = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    # -- protocol -------------------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """Version of the weights currently used for sampling."""
        return self._version

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[PromptCompletions]:
        """Sample ``params.n`` completions of every prompt (prompt order, then sample order)."""
        self._check_open()
        prompt_lists = self._check_inputs(prompts, params)
        start = time.perf_counter()
        if params.seed is None:
            seed = int(torch.randint(0, 2**62, (), generator=self._seed_source))
        else:
            seed = int(params.seed)
        n = params.n
        total = len(prompt_lists) * n
        results: list[_RowResult | None] = [None] * total
        chunks = 0
        with self._generation_mode():
            for chunk_start in range(0, total, self.max_batch_size):
                seq_ids = list(range(chunk_start, min(chunk_start + self.max_batch_size, total)))
                first = seq_ids[0] // n
                distinct = list(range(first, seq_ids[-1] // n + 1))
                chunk = _Chunk(
                    prompts=[prompt_lists[p] for p in distinct],
                    prompt_of_row=[s // n - first for s in seq_ids],
                    seq_ids=seq_ids,
                )
                for seq_id, row in zip(seq_ids, self._generate_chunk(chunk, params, seed)):
                    results[seq_id] = row
                chunks += 1

        texts = self.tokenizer.batch_decode(
            [r.token_ids for r in results if r.text is None], skip_special_tokens=True
        )
        decoded = iter(texts)
        out: list[PromptCompletions] = []
        gen_tokens = 0
        for p, prompt in enumerate(prompt_lists):
            group = PromptCompletions(prompt_ids=list(prompt))
            for r in results[p * n : (p + 1) * n]:
                text = r.text if r.text is not None else next(decoded)
                group.completions.append(
                    Completion(
                        token_ids=r.token_ids,
                        logprobs=r.logprobs,
                        text=text,
                        finish_reason=r.finish_reason,
                        policy_version=self._version,
                        entropies=r.entropies,
                    )
                )
                gen_tokens += len(r.token_ids)
            out.append(group)
        seconds = time.perf_counter() - start
        self.last_stats = {
            "gen_tokens": gen_tokens,
            "gen_seconds": seconds,
            "tokens_per_second": gen_tokens / seconds if seconds > 0 else 0.0,
            "sequences": total,
            "chunks": chunks,
        }
        return out

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load ``state_dict`` (strict: every name known, shapes equal, nothing missing) and set ``version``.

        Tensors that already are the model's own (same storage: the trainer shares the model object)
        are not copied. Tied parameters (``lm_head.weight`` and ``model.embed_tokens.weight``) count as
        one: either name loads it.
        """
        self._check_open()
        own = self.model.state_dict(keep_vars=True)
        unknown = sorted(set(state_dict) - set(own))
        if unknown:
            raise KeyError(
                f"update_weights: unknown parameter names {unknown[:5]}{' ...' if len(unknown) > 5 else ''}; "
                f"the model has e.g. {sorted(own)[:3]}: pass the policy model's own state_dict names"
            )
        aliases: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
        for name, tensor in own.items():
            aliases.setdefault(_storage_key(tensor), []).append(name)
        missing = [names[0] for names in aliases.values() if not any(n in state_dict for n in names)]
        if missing:
            raise KeyError(
                f"update_weights: missing parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}: "
                "pass the full (unsharded) state dict"
            )
        for name, tensor in state_dict.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects "
                    f"{tuple(own[name].shape)}"
                )
        groups = []  # (target, source) per distinct parameter, all checked before anything is written
        for names in aliases.values():
            given = [n for n in names if n in state_dict]
            source = state_dict[given[0]]
            for other in given[1:]:
                same = _storage_key(state_dict[other]) == _storage_key(source)
                if not same and not torch.equal(state_dict[other].to(source.device), source):
                    raise ValueError(
                        f"update_weights: {given[0]!r} and {other!r} are tied in the model but differ"
                    )
            groups.append((own[names[0]], source))
        with torch.no_grad():
            for target, source in groups:
                if _storage_key(source) == _storage_key(target) and source.stride() == target.stride():
                    continue  # the trainer's own tensor: already in place
                target.copy_(source)
        self._version = int(version)

    def continuation_logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]],
        temperature: float = 1.0,
        *,
        reduced_precision: bool = False,
    ) -> list[float]:
        """log P(continuation | prompt) of each pair at ``temperature`` (see the protocol): one
        teacher-forced forward per ``max_batch_size`` pairs, left-padded so that every continuation
        ends at the last position and only its logits are computed (``logits_to_keep``).

        With ``reduced_precision``, where ``scores_in_bf16`` (a float32 model on a device that multiplies
        bfloat16 natively), the forward runs under bf16 autocast. The weights stay as they are (autocast casts them per op) and
        the log-softmax is float32. On the arithmetic starter (one core, AVX512-BF16) 128 prompts took
        20 ms against 43, and their chances q correlated 0.9999 with float32's (mean |d log q| 0.015)."""
        self._check_open()
        pairs = checked_continuations(prompts, continuations, temperature, self.vocab_size)
        out: list[float] = []
        model = self.model
        was_training = model.training
        model.eval()
        bf16 = reduced_precision and self.scores_in_bf16
        try:
            with (
                torch.inference_mode(),
                torch.autocast(self.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext(),
            ):
                for start in range(0, len(pairs), self.max_batch_size):
                    out.extend(self._score_chunk(pairs[start : start + self.max_batch_size], temperature))
        finally:
            model.train(was_training)
        return out

    def _score_chunk(self, pairs: Sequence[tuple[list[int], list[int]]], temperature: float) -> list[float]:
        length = max(len(p) + len(c) for p, c in pairs)
        longest = max(len(c) for _, c in pairs)
        ids = torch.full((len(pairs), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(pairs), length), dtype=torch.long)
        for i, (p, c) in enumerate(pairs):
            ids[i, length - len(p) - len(c) :] = torch.tensor(p + c)
            mask[i, length - len(p) - len(c) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        kwargs = {"logits_to_keep": longest + 1} if self._logits_to_keep else {}
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs).logits
        # The logit at position t predicts token t + 1: the last ``longest + 1`` positions but the final
        # one predict the last ``longest`` tokens, where every continuation (right-aligned) lies.
        logits = logits[:, -(longest + 1) : -1].float() / temperature
        targets = ids[:, -longest:]
        token = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        lengths = torch.tensor([len(c) for _, c in pairs], device=self.device)
        inside = torch.arange(longest, device=self.device) >= (longest - lengths)[:, None]
        return token.masked_fill(~inside, 0.0).sum(-1).tolist()

    def close(self) -> None:
        """Drop the references to the model and tokenizer; the backend cannot be used afterwards."""
        self._closed = True
        self.model = None  # type: ignore[assignment]
        self.tokenizer = None
        self._token_texts = None
        self._stop_masks.clear()

    # -- generation -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _generation_mode(self) -> Iterator[None]:
        model, config = self.model, self.model.config
        was_training = model.training
        previous_attention = getattr(config, "_attn_implementation_internal", None)
        model.eval()
        if self._fast:
            config._attn_implementation_internal = ATTENTION_NAME
        try:
            with torch.inference_mode():
                yield
        finally:
            if self._fast:
                config._attn_implementation_internal = previous_attention
            model.train(was_training)

    def _generate_chunk(self, chunk: _Chunk, params: SamplingParams, seed: int) -> list[_RowResult]:
        device, max_new = self.device, params.max_new_tokens
        rows = len(chunk.seq_ids)
        uniforms = None
        if params.temperature > 0:
            uniforms = _sequence_uniforms(chunk.seq_ids, seed, max_new).to(device)

        fast = self._fast and (
            self._sliding_window is None
            or max(len(p) for p in chunk.prompts) + max_new <= self._sliding_window
        )
        step = _FastDecoder(self, chunk, max_new) if fast else _GenericDecoder(self, chunk, max_new)
        logits = step.prefill()

        out_tokens = torch.zeros((rows, max_new), dtype=torch.long, device=device)
        out_logprobs = torch.zeros((rows, max_new), dtype=torch.float32, device=device)
        out_entropies = (
            torch.zeros((rows, max_new), dtype=torch.float32, device=device) if params.entropies else None
        )
        lengths = [max_new] * rows
        reasons: list[FinishReason] = ["length"] * rows
        texts: list[str | None] = [None] * rows
        row_seq = torch.arange(rows, device=device)  # live row -> local sequence index
        stop_mask = self._stop_mask(params.stop) if params.stop else None

        for t in range(max_new):
            live = row_seq.shape[0]
            u = uniforms[row_seq, t] if uniforms is not None else None
            tokens, logprobs, entropies = _sample(logits, params, u)
            out_tokens[row_seq, t] = tokens
            out_logprobs[row_seq, t] = logprobs
            if out_entropies is not None:
                out_entropies[row_seq, t] = entropies
            done = torch.isin(tokens, self._eos_tensor)
            if stop_mask is not None:
                candidates = (stop_mask[tokens] & ~done).nonzero().flatten().tolist()
                if candidates:
                    seqs = row_seq[candidates].tolist()
                    history = out_tokens[seqs, : t + 1].tolist()
                    for row, seq, ids in zip(candidates, seqs, history):
                        hit = self._find_stop(ids, params.stop)
                        if hit is not None:
                            lengths[seq], texts[seq] = hit
                            reasons[seq] = "stop"
                            done[row] = True
            finished = done.nonzero().flatten() if bool(done.any()) else None
            if finished is not None:
                for seq in row_seq[finished].tolist():
                    if reasons[seq] != "stop":
                        lengths[seq], reasons[seq] = t + 1, "stop"
            if t == max_new - 1:
                break
            if finished is not None:
                if finished.shape[0] == live:
                    break
                keep_rows = live - finished.shape[0]
                # Move the live rows from the tail into the freed slots below keep_rows.
                dst = finished[finished < keep_rows]
                src = (~done[keep_rows:]).nonzero().flatten() + keep_rows
                step.compact(dst, src, keep_rows)
                if dst.numel():
                    row_seq[dst] = row_seq[src]
                    tokens[dst] = tokens[src]
                row_seq = row_seq[:keep_rows]
                tokens = tokens[:keep_rows]
            logits = step.decode(tokens)

        all_tokens = out_tokens.tolist()
        all_logprobs = out_logprobs.tolist()
        all_entropies = out_entropies.tolist() if out_entropies is not None else None
        return [
            _RowResult(
                all_tokens[i][: lengths[i]],
                all_logprobs[i][: lengths[i]],
                all_entropies[i][: lengths[i]] if all_entropies is not None else None,
                reasons[i],
                texts[i],
            )
            for i in range(rows)
        ]

    # -- stop strings ---------------------------------------------------------------------------------

    def _stop_mask(self, stop: tuple[str, ...]) -> torch.Tensor:
        """Tokens after which a stop string may have just been completed (a superset: checked by decoding).

        A stop string ends inside the last token's text, so that text holds the stop string's last
        character, or is empty / a partial UTF-8 sequence (its characters are completed by this token).
        Tokenizers that drop a token's leading space when it is decoded alone hide a final space, so a stop
        string ending in a space makes every token a candidate.
        """
        cached = self._stop_masks.get(stop)
        if cached is not None:
            return cached
        if any(s[-1] == " " for s in stop):
            mask = torch.ones(self.vocab_size, dtype=torch.bool)
        else:
            if self._token_texts is None:
                known = min(self.vocab_size, len(self.tokenizer))
                self._token_texts = self.tokenizer.batch_decode(
                    [[i] for i in range(known)], skip_special_tokens=True
                )
            last_chars = {s[-1] for s in stop}
            flags = [
                not text or "\ufffd" in text or any(c in text for c in last_chars)
                for text in self._token_texts
            ]
            mask = torch.ones(self.vocab_size, dtype=torch.bool)
            mask[: len(flags)] = torch.tensor(flags, dtype=torch.bool)
        mask = mask.to(self.device)
        if len(self._stop_masks) >= 16:  # stop strings rarely change within a run; bound the cache anyway
            self._stop_masks.clear()
        self._stop_masks[stop] = mask
        return mask

    def _find_stop(self, ids: list[int], stop: tuple[str, ...]) -> tuple[int, str] | None:
        """``(tokens to keep, text up to the end of the stop string)`` if ``ids`` complete a stop string."""

        def first_end(text: str) -> int | None:
            ends = [i + len(s) for s in stop if (i := text.find(s)) >= 0]
            return min(ends) if ends else None

        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        end = first_end(text)
        if end is None:
            return None
        keep = len(ids)
        # Normally the last token completed it; walk back if an earlier token already did.
        while keep > 1:
            shorter = self.tokenizer.decode(ids[: keep - 1], skip_special_tokens=True)
            shorter_end = first_end(shorter)
            if shorter_end is None:
                break
            keep, text, end = keep - 1, shorter, shorter_end
        return keep, text[:end]

    # -- checks ---------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TorchRolloutBackend is closed")

    def _check_inputs(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        return checked_inputs(prompts, params, self.vocab_size)


class _FastDecoder:
    """Prefill and decode steps on a :class:`_SlotCache` with masks built here (fast path)."""

    def __init__(self, backend: TorchRolloutBackend, chunk: _Chunk, max_new: int) -> None:
        self.backend, self.chunk = backend, chunk
        self.model = backend.model
        device = backend.device
        self.rows = len(chunk.prompt_of_row)
        self.prompt_len = max(len(p) for p in chunk.prompts)
        max_length = self.prompt_len + max_new
        self.cache = _SlotCache(
            self.rows, min(max_length, self.prompt_len + _INITIAL_GEN_CAPACITY), max_length
        )
        # valid[r, j]: slot j of row r holds a real token (prompt padding is False; generated slots True)
        self.valid = torch.ones((self.rows, max_length), dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(self.rows, dtype=torch.long, device=device)

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kwargs = {"logits_to_keep": 1} if self.backend._logits_to_keep else {}
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -1].float()

    def prefill(self) -> torch.Tensor:
        device, prompts, length = self.backend.device, self.chunk.prompts, self.prompt_len
        distinct = len(prompts)
        ids = torch.full((distinct, length), self.backend.pad_token_id, dtype=torch.long)
        valid = torch.zeros((distinct, length), dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, length - len(p) :] = torch.tensor(p)
            valid[i, length - len(p) :] = True
        ids, valid = ids.to(device), valid.to(device)
        positions = (valid.long().cumsum(-1) - 1).clamp_(min=0)
        causal = torch.ones((length, length), dtype=torch.bool, device=device).tril_()
        eye = torch.eye(length, dtype=torch.bool, device=device)
        # A padding query sees only itself, so that no row is fully masked (SDPA would return NaN).
        mask = causal & (valid[:, None, None, :] | eye)
        logits = self._forward(ids, mask, positions)
        self.cache.length = length

        prompt_lens = valid.sum(-1)
        rep = torch.tensor(self.chunk.prompt_of_row, dtype=torch.long, device=device)
        if distinct != self.rows or not torch.equal(rep, torch.arange(self.rows, device=device)):
            self.cache.copy_rows(slice(0, self.rows), rep)
            logits = logits[rep]
        self.valid[:, :length] = valid[rep]
        self.next_pos.copy_(prompt_lens[rep])
        return logits

    def compact(self, dst: torch.Tensor, src: torch.Tensor, keep_rows: int) -> None:
        """Rows ``src`` move to ``dst``; afterwards rows ``0..keep_rows-1`` are the live ones."""
        if dst.numel():
            self.cache.copy_rows(dst, src)
            self.valid[dst] = self.valid[src]
            self.next_pos[dst] = self.next_pos[src]

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        live, length = tokens.shape[0], self.cache.length
        mask = self.valid[:live, : length + 1].view(live, 1, 1, length + 1)
        positions = self.next_pos[:live].view(live, 1)
        logits = self._forward(tokens.view(live, 1), mask, positions)
        self.cache.length = length + 1
        self.next_pos[:live] += 1
        return logits


class _GenericDecoder:
    """The same steps through ``DynamicCache`` and 2-D masks, for models without the attention interface."""

    def __init__(self, backend: TorchRolloutBackend, chunk: _Chunk, max_new: int) -> None:
        self.backend, self.chunk, self.model = backend, chunk, backend.model
        self.cache = DynamicCache(config=self.model.config)
        self.mask: torch.Tensor | None = None
        self.next_pos: torch.Tensor | None = None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kwargs = {"logits_to_keep": 1} if self.backend._logits_to_keep else {}
        out = self.model(
            input_ids=input_ids,
            attention_mask=self.mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -1].float()

    def prefill(self) -> torch.Tensor:
        device = self.backend.device
        rows = [self.chunk.prompts[i] for i in self.chunk.prompt_of_row]
        length = max(len(p) for p in rows)
        ids = torch.full((len(rows), length), self.backend.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, p in enumerate(rows):
            ids[i, length - len(p) :] = torch.tensor(p)
            mask[i, length - len(p) :] = 1
        self.mask = mask.to(device)
        positions = (self.mask.cumsum(-1) - 1).clamp_(min=0)
        logits = self._forward(ids.to(device), positions)
        self.next_pos = self.mask.sum(-1)
        return logits

    def compact(self, dst: torch.Tensor, src: torch.Tensor, keep_rows: int) -> None:
        keep = torch.arange(keep_rows, device=dst.device)
        keep[dst] = src
        self.cache.batch_select_indices(keep)
        self.mask = self.mask[keep]
        self.next_pos = self.next_pos[keep]

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        live = tokens.shape[0]
        self.mask = torch.cat([self.mask, self.mask.new_ones((live, 1))], dim=1)
        logits = self._forward(tokens.view(live, 1), self.next_pos.view(live, 1))
        self.next_pos = self.next_pos + 1
        return logits


def _entropy(probs: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each row's distribution ``probs = exp(logits - lse)``:
    ``H = -sum_v p_v (logits_v - lse) = lse - sum_v p_v logits_v`` (the probabilities sum to 1), a
    product and a sum where ``-sum p log p`` takes a logarithm a vocabulary entry (8x faster over
    256 x 512). ``nansum`` makes a token of probability 0 (a ``-inf`` logit, 0 * -inf) add 0; the
    rounding of the difference (~1e-7 of ``lse``) is clamped at 0."""
    return (lse.squeeze(-1) - (probs * logits).nansum(-1)).clamp_(min=0.0)


def _sample(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pick one token per row; return it, its log-probability before top-k/top-p truncation, and
    (``params.entropies``) the entropy of that same distribution (the rollout browser's token view).

    Greedy (``temperature == 0``): argmax, logprob of ``log_softmax(logits)``. Otherwise the token is the
    inverse-CDF lookup of the row's uniform in ``softmax(filtered logits / T)`` and its logprob is
    ``log_softmax(logits / T)``. top-k keeps the tokens scoring at least the k-th best; top-p then keeps
    the most likely tokens until their mass reaches ``top_p`` (the first always kept).
    """
    if params.temperature == 0 or uniforms is None:
        tokens = logits.argmax(-1)
        lse = torch.logsumexp(logits, -1, keepdim=True)
        logprobs = (logits.gather(-1, tokens[:, None]) - lse).squeeze(-1)
        return tokens, logprobs, _entropy(torch.exp(logits - lse), logits, lse) if params.entropies else None
    scaled = logits / params.temperature if params.temperature != 1 else logits
    lse = torch.logsumexp(scaled, -1, keepdim=True)
    vocab = scaled.shape[-1]
    filtered = scaled
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, _ = torch.sort(filtered, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        # the smallest kept logit: the last token whose preceding mass is below top_p
        kept = (mass_before < params.top_p).sum(-1, keepdim=True).clamp_(min=1)
        threshold = sorted_logits.gather(-1, kept - 1)
        filtered = filtered.masked_fill(filtered < threshold, float("-inf"))
    full = torch.exp(scaled - lse)
    probs = full if filtered is scaled else torch.softmax(filtered, dim=-1)
    cdf = probs.double().cumsum_(-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=vocab - 1)
    logprobs = (scaled.gather(-1, tokens[:, None]) - lse).squeeze(-1)
    return tokens, logprobs, _entropy(full, scaled, lse) if params.entropies else None


def _sequence_uniforms(seq_ids: Sequence[int], seed: int, steps: int) -> torch.Tensor:
    """``[len(seq_ids), steps]`` float64 uniforms in [0, 1): row i from sequence ``seq_ids[i]``'s own stream."""
    generator = torch.Generator()
    out = torch.empty((len(seq_ids), steps), dtype=torch.float64)
    for i, seq_id in enumerate(seq_ids):
        generator.manual_seed(sequence_seed(seed, seq_id))
        torch.rand(steps, generator=generator, dtype=torch.float64, out=out[i])
    return out


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _storage_key(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """Identity of the memory a tensor views (tied parameters share it)."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))


