"""The actor's math, shared by every trainer backend: log-probs from a causal LM and the loss.

Backends (plain torch, DeepSpeed) differ in how they hold parameters and step the
optimiser; what a micro-batch computes is the same and lives here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.cache_utils import DynamicCache

from engine.algorithms import PolicyLossConfig, agg_loss, get_policy_loss_fn, kl_penalty
from engine.algorithms.policy_losses import ROW_MEAN_LOSSES
from engine.batch import RolloutBatch
from engine.config import AlgorithmConfig, RunConfig
from engine.models.loading import sliding_window
from kernels import logprobs_from_hidden


@dataclass(frozen=True)
class LogprobSettings:
    temperature: float
    impl: str = "auto"  # kernels.resolve_impl: Triton on CUDA tensors, else the torch fused kernel
    chunk_size: int = 1024
    shared_prompt: bool = True
    bf16_autocast: bool = False  # trainer.mixed_precision 'bf16': the trunk under autocast, the kernel float32


def logprob_settings(cfg: RunConfig, *, shared_prompt: bool = True) -> LogprobSettings:
    """The run's :class:`LogprobSettings`, as every trainer backend computes log-probs with them;
    ``shared_prompt=False`` lets a backend refuse the shared-prompt forward whatever the config says."""
    t = cfg.trainer
    return LogprobSettings(
        temperature=cfg.rollout.temperature or 1.0,
        impl=t.logprob_impl,
        chunk_size=t.logprob_chunk_size,
        shared_prompt=t.shared_prompt and shared_prompt,
        bf16_autocast=t.mixed_precision == "bf16",
    )


@contextlib.contextmanager
def trunk_precision(settings: LogprobSettings, device: torch.device) -> Iterator[None]:
    """The context the decoder trunk runs in: bf16 autocast for ``trainer.mixed_precision: bf16``
    (mixed-precision training as in Micikevicius et al. 2018, "Mixed Precision Training",
    arXiv:1710.03740, with bfloat16's float32 range, so no loss scaling: the matmuls of the forward
    and, through autograd, of the backward in bfloat16, the weights and their gradients float32), else
    nothing. The LM head and the log-softmax stay outside it, in float32: the policy ratio and the
    clipping compare log-probs to ~1e-3, which bf16's 8-bit mantissa would blur."""
    if not settings.bf16_autocast:
        yield
        return
    math_attention = sdpa_kernel(SDPBackend.MATH) if device.type == "cpu" else contextlib.nullcontext()
    with torch.autocast(device.type, dtype=torch.bfloat16), math_attention:
        yield


def split_model(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder trunk returning hidden states, LM head) of a transformers causal LM."""
    head = model.get_output_embeddings()
    trunk = getattr(model, model.base_model_prefix, None)
    if head is None or trunk is None:
        raise ValueError(
            f"{type(model).__name__} has no separate decoder and LM head; cannot use it as a policy"
        )
    return trunk, head


def response_logprobs(
    model: nn.Module, batch: RolloutBatch, settings: LogprobSettings, *, compute_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(response token) and entropy, both ``[B, R]`` (zero where masked).

    Only the hidden states of positions that predict a real response token reach the LM
    head, and the fused kernel never materialises their full ``[tokens x vocab]`` logits.
    Logits are divided by the sampling temperature, as the rollout sampled from them.
    """
    trunk, head = split_model(model)
    pred_hidden = None
    with trunk_precision(settings, batch.input_ids.device):
        if settings.shared_prompt:
            pred_hidden = _packed_hidden(trunk, batch)
            if pred_hidden is None:
                pred_hidden = _shared_prompt_hidden(trunk, batch)
        if pred_hidden is None:
            pred_hidden = _full_hidden(trunk, batch)
    mask = batch.response_mask.bool()
    sel_hidden = pred_hidden[mask].to(head.weight.dtype)  # [N, H]; float32 after a bf16 autocast trunk
    labels = batch.response_ids[mask]
    lp, ent = logprobs_from_hidden(
        sel_hidden.unsqueeze(0),
        head.weight,
        labels.unsqueeze(0),
        temperature=settings.temperature,
        chunk_size=settings.chunk_size,
        compute_entropy=compute_entropy,
        impl=settings.impl,
        bias=getattr(head, "bias", None),
    )
    logprobs = torch.zeros(mask.shape, dtype=lp.dtype, device=lp.device)  # the kernel's: float32, float64 for float64
    logprobs = logprobs.masked_scatter(mask, lp.squeeze(0))
    entropy = None
    if ent is not None:
        entropy = torch.zeros(mask.shape, dtype=ent.dtype, device=ent.device).masked_scatter(
            mask, ent.squeeze(0)
        )
    return logprobs, entropy


def _full_hidden(trunk: nn.Module, batch: RolloutBatch) -> torch.Tensor:
    """Hidden states ``[B, R, H]`` predicting each response token, from one pass over prompt + response.

    The last response column is not run: position ``t`` predicts token ``t + 1`` and attention is
    causal, so that column's hidden states predict nothing and no other position reads its keys or
    values. Leaving it out is exact and saves ``1 / (P + R)`` of the pass.
    """
    attn = batch.attention_mask[:, :-1]
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    hidden = trunk(
        input_ids=batch.input_ids[:, :-1], attention_mask=attn, position_ids=position_ids
    ).last_hidden_state
    return hidden[:, batch.prompt_ids.shape[1] - 1 :]  # position t predicts token t + 1


PACKED_MAX_TOKENS = 256
"""Longest packed row :func:`_packed_hidden` builds; longer groups take the two-pass
:func:`_shared_prompt_hidden`, whose attention does not grow with the square of a group's tokens."""


def _packed_hidden(trunk: nn.Module, batch: RolloutBatch) -> torch.Tensor | None:
    """The same hidden states as :func:`_full_hidden`, in one pass over one packed row per group.

    A group's prompt is laid out once, followed by each of its responses (the tokens that predict a
    trained token: all but the last, and none after the last trained one); a block mask lets each
    response token attend to the prompt and to its own response's earlier tokens only, with the
    positions each token has in its own sequence (the shared-prefix packing of Prefix Grouper: Liu
    et al. 2025, "Prefix Grouper: Efficient GRPO Training through Shared-Prefix Forward",
    arXiv:2506.05433). The hidden state predicting a response's first token is the prompt's last one,
    computed once for the group. Exact: the same keys, values, positions and visible tokens as the
    unpacked sequence.

    Against the two-pass :func:`_shared_prompt_hidden` it runs the trunk once instead of twice and
    gathers no keys and values, which is most of the update's cost when responses are a few tokens
    long (``bench/engine_vs_trl.py``: arithmetic answers of 3-4 tokens, update 108 -> 90 ms); its
    attention, though, spans the whole packed row, masked entries included, so rows longer than
    ``PACKED_MAX_TOKENS`` take the two-pass path.

    Returns None (the caller takes another path) when the attention is not SDPA (the 4-D boolean mask
    is passed through as is, which transformers' SDPA path reads and the eager one would not), a
    sliding window could cut a sequence, rows of a group do not share their prompt, or a row would be
    too long."""
    if getattr(trunk.config, "_attn_implementation", None) != "sdpa":
        return None
    device = batch.prompt_ids.device
    rows, p_width = batch.prompt_ids.shape
    r_width = batch.response_ids.shape[1]
    window = sliding_window(trunk.config)
    if rows == 0 or (window is not None and p_width + r_width > window):
        return None
    _, first, group = np.unique(batch.index, return_index=True, return_inverse=True)
    first_t = torch.as_tensor(first, dtype=torch.long, device=device)
    group_t = torch.as_tensor(group.reshape(-1), dtype=torch.long, device=device)
    prompt_ids = batch.prompt_ids[first_t]  # [G, P]
    if not torch.equal(prompt_ids[group_t], batch.prompt_ids):
        return None
    prompt_len = batch.prompt_mask[first_t].sum(-1)  # [G] real prompt tokens (left-padded)
    if bool((prompt_len == 0).any()):
        return None
    # Response tokens each row runs: t < last trained position (it predicts tokens 1..last).
    columns = torch.arange(1, r_width + 1, device=device)
    runs = ((batch.response_mask > 0).long() * columns).amax(-1).sub(1).clamp(min=0)  # [B]
    # Each row's place in its group's packed row: after the prompt and the rows before it.
    order = torch.argsort(group_t, stable=True)
    before = torch.cumsum(runs[order], 0) - runs[order]
    group_base = torch.zeros(len(first), dtype=torch.long, device=device).scatter_reduce(
        0, group_t[order], before, reduce="amin", include_self=False
    )
    offset = torch.empty_like(runs)
    offset[order] = before - group_base[group_t[order]]
    start = prompt_len[group_t] + offset  # [B]
    totals = prompt_len + torch.zeros_like(prompt_len).index_add_(0, group_t, runs)
    length = int(totals.max())
    if length > PACKED_MAX_TOKENS:
        return None
    col = torch.arange(length, device=device)
    in_prompt = col[None] < prompt_len[:, None]  # [G, L]
    source = (p_width - prompt_len[:, None] + col[None]).clamp(max=p_width - 1)
    ids = torch.where(in_prompt, prompt_ids.gather(1, source), 0)
    positions = torch.where(in_prompt, col[None], 0)
    segment = torch.where(in_prompt, -1, -2)  # -1 prompt, r >= 0 row r's response, -2 padding
    row, t = torch.nonzero(torch.arange(r_width, device=device)[None] < runs[:, None], as_tuple=True)
    dest = group_t[row] * length + start[row] + t
    ids.view(-1)[dest] = batch.response_ids[row, t]
    positions.view(-1)[dest] = prompt_len[group_t[row]] + t
    segment.view(-1)[dest] = row
    query, key = segment[:, :, None], segment[:, None, :]
    causal = torch.ones((length, length), dtype=torch.bool, device=device).tril_()
    visible = causal & ((key == -1) | (key == query)) & (key != -2)
    visible |= torch.eye(length, dtype=torch.bool, device=device)  # a padding query sees itself (no NaN)
    hidden = trunk(input_ids=ids, attention_mask=visible[:, None], position_ids=positions).last_hidden_state
    # The state predicting token t of row r: the prompt's last for t = 0, else the row's token t - 1
    # (positions past a row's last run token are never read: the caller keeps trained ones only).
    local = (start[:, None] + torch.arange(-1, r_width - 1, device=device)[None]).clamp(max=length - 1)
    local[:, 0] = prompt_len[group_t] - 1
    flat = group_t[:, None] * length + local
    return hidden.reshape(-1, hidden.shape[-1])[flat]


def _shared_prompt_hidden(trunk: nn.Module, batch: RolloutBatch) -> torch.Tensor | None:
    """The same hidden states, running each distinct prompt of the batch once.

    A group's ``n`` completions share their prompt, so the prompt's keys and values are
    computed once (with gradients) and gathered for every row before the responses run
    on top of them: ``P + n (R - 1)`` tokens instead of ``n (P + R - 1)`` (the shared-prompt
    idea of DualKV). Gradients from all ``n`` rows flow back through the gather into the one
    prompt pass, so the result equals ``_full_hidden``'s. Returns None when no prompt is
    shared or the model's cache is not a plain ``DynamicCache``.
    """
    keys = batch.index.tolist()
    first_row: dict[str, int] = {}
    for i, key in enumerate(keys):
        first_row.setdefault(key, i)
    if len(first_row) == len(keys):
        return None
    slot = {key: j for j, key in enumerate(first_row)}
    inverse = [slot[key] for key in keys]
    rows = torch.tensor(list(first_row.values()), dtype=torch.long)
    prompt_mask = batch.prompt_mask[rows]
    out = trunk(
        input_ids=batch.prompt_ids[rows],
        attention_mask=prompt_mask,
        position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
    )
    cache = out.past_key_values
    if not isinstance(cache, DynamicCache):
        return None
    gather = torch.tensor(inverse, dtype=torch.long, device=batch.prompt_ids.device)
    cache.batch_select_indices(gather)
    last_prompt = out.last_hidden_state[:, -1:][gather]  # predicts the first response token
    r = batch.response_ids.shape[1] - 1  # the last response column predicts nothing (_full_hidden)
    if r == 0:
        return last_prompt
    prompt_len = batch.prompt_mask.sum(-1, keepdim=True)
    response = trunk(
        input_ids=batch.response_ids[:, :r],
        attention_mask=batch.attention_mask[:, :-1],
        position_ids=prompt_len + torch.arange(r, device=prompt_len.device),
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state
    return torch.cat([last_prompt, response], dim=1)


ADDITIVE_METRICS = frozenset({"actor/pg_loss", "actor/entropy", "actor/kl_loss"})
"""Metrics that are micro-batch shares of a mini-batch aggregate: they sum across micro-batches."""
MAX_METRICS = frozenset({"rollout/logprob_diff_max"})
"""Metrics that combine by maximum. All others are per-micro-batch means, averaged by token share."""


def logprob_mismatch(
    trainer_lp: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Train/inference mismatch: the sampler's log-probs against the trainer's, over real tokens.

    ``rollout/logprob_diff_max`` / ``_mean``: ``|log p_trainer - log p_rollout|`` per token.
    ``rollout/mismatch_kl``: the k3 estimator (Schulman, "Approximating KL divergence", 2020) of
    KL(rollout || trainer) from the sampled tokens: with ``log r = log p_trainer - log p_rollout``,
    ``k3 = exp(log r) - log r - 1`` (>= 0, unbiased since the tokens were drawn from the rollout policy),
    averaged over response tokens, as prime-rl's ``mismatch_kl`` and verl's rollout-correction
    ``rollout_kl_k3`` report it. ``[batch, response_len]`` inputs; ``mask`` marks response tokens.
    """
    valid = mask.bool()
    log_ratio = (trainer_lp.detach().float() - rollout_lp.float())[valid]
    if log_ratio.numel() == 0:
        return {}
    diff = log_ratio.abs()
    k3 = torch.expm1(log_ratio) - log_ratio
    return {
        "rollout/logprob_diff_max": float(diff.max()),
        "rollout/logprob_diff_mean": float(diff.mean()),
        "rollout/mismatch_kl": float(k3.mean()),
    }


def global_batch_info(mini_mask: torch.Tensor, loss_scale_factor: float) -> dict[str, float]:
    """``agg_loss`` denominators of a whole mini-batch (verl's ``global_batch_info``).

    Aggregating each micro-batch against the mini-batch's token and sequence counts makes
    the micro-batch losses add up to exactly the mini-batch's loss, whatever the response
    lengths, so gradient accumulation does not change the objective.
    """
    return {
        "batch_num_tokens": float(mini_mask.sum()),
        "global_batch_size": float((mini_mask.sum(-1) > 0).sum()),
        "loss_scale_factor": loss_scale_factor,
    }


def skips_zero_advantage_rows(algo: AlgorithmConfig, enabled: bool) -> bool:
    """Whether an update may leave out the rows whose advantages are all zero (``trainer.skip_zero_advantage``).

    Every policy loss of ``engine/algorithms/policy_losses.py`` is the advantage times a factor
    (a clipped or gated ratio, a log-prob), aggregated against the mini-batch's token and sequence
    counts (:func:`global_batch_info`): a row whose advantages are all zero adds exactly nothing to the
    loss or its gradient, so running it is pure waste (``tests/engine/test_zero_advantage_skip.py``
    checks every registered loss). Not with an entropy bonus or a KL loss, whose terms do not vanish
    with the advantage, nor with a loss that averages over the rows it is given (``ROW_MEAN_LOSSES``:
    GMPO). In GRPO-family runs these rows are the groups whose completions all scored the
    same (a fifth of the arithmetic starter's groups, up to two thirds late in a run).
    """
    return (
        enabled
        and algo.entropy_coeff == 0
        and not algo.use_kl_loss
        and algo.policy_loss not in ROW_MEAN_LOSSES
    )


def mini_batches(
    batch: RolloutBatch,
    order: np.ndarray,
    count: int,
    pl_config: PolicyLossConfig,
    *,
    skip_zero_advantage: bool = False,
) -> Iterator[tuple[RolloutBatch, PolicyLossConfig, int]]:
    """One epoch: the rows of ``batch`` in ``order`` cut into ``count`` mini-batches (one optimiser
    step each; none empty), each with ``pl_config`` carrying its :func:`global_batch_info` and the
    number of rows left out of it.

    With ``skip_zero_advantage`` (see :func:`skips_zero_advantage_rows`), the rows whose advantages are
    all zero are left out after the mini-batch's denominators are taken, so the loss and gradient are
    those of the whole mini-batch. At least one row stays: an optimiser step must see the zero
    gradient (AdamW skips a parameter whose gradient is None, which would change its update).
    Metrics computed from the forward (entropy, clip fractions, the rollout mismatch) then cover the
    rows trained on."""
    for rows in np.array_split(order, count):
        if len(rows) == 0:
            continue
        index = torch.as_tensor(rows, dtype=torch.long)
        mask = batch.response_mask[index]
        info = global_batch_info(mask, pl_config.loss_scale_factor)
        skipped = 0
        if skip_zero_advantage and batch.advantages is not None:
            live = (batch.advantages[index] * mask).ne(0).any(-1).numpy()
            kept = rows[live] if live.any() else rows[:1]
            skipped, rows = len(rows) - len(kept), kept
        mini = batch.select(rows.tolist())  # the rows trained on, copied once
        yield mini, dataclasses.replace(pl_config, global_batch_info=info), skipped


def add_micro_batch_metrics(
    sums: dict[str, float],
    maxima: dict[str, float],
    metrics: dict[str, float],
    micro_mask: torch.Tensor,
    pl_config: PolicyLossConfig,
) -> None:
    """Fold one micro-batch's ``metrics`` into its mini-batch's ``sums`` (a defaultdict) and
    ``maxima``: :data:`MAX_METRICS` by maximum, :data:`ADDITIVE_METRICS` by sum, the others weighted
    by the micro-batch's share of the mini-batch's tokens (``pl_config`` from :func:`mini_batches`)."""
    share = float(micro_mask.sum()) / max(1.0, pl_config.global_batch_info["batch_num_tokens"])
    for k, v in metrics.items():
        if k in MAX_METRICS:
            maxima[k] = max(maxima.get(k, v), v)
        else:
            sums[k] += v if k in ADDITIVE_METRICS else v * share


def actor_loss(
    model: nn.Module,
    batch: RolloutBatch,
    algo: AlgorithmConfig,
    settings: LogprobSettings,
    policy_loss_config: PolicyLossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy-gradient loss of one micro-batch with entropy bonus and KL loss terms.

    loss = pg_loss - entropy_coeff * H + kl_loss_coef * KL(pi || ref), each aggregated
    with ``algo.loss_agg_mode`` against ``policy_loss_config.global_batch_info`` (verl's
    actor ``update_policy``).
    """
    assert batch.advantages is not None
    need_entropy = algo.entropy_coeff > 0
    log_prob, entropy = response_logprobs(model, batch, settings, compute_entropy=True)
    mask = batch.response_mask
    extra: dict[str, float] = {}
    old_log_prob = batch.old_log_probs
    if old_log_prob is None:  # strictly on-policy single update: this policy is the old one
        old_log_prob = log_prob.detach()
        extra = logprob_mismatch(log_prob, batch.rollout_log_probs, mask)
    policy_loss_fn = get_policy_loss_fn(algo.policy_loss)
    pg_loss, pg_metrics = policy_loss_fn(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=batch.advantages,
        response_mask=mask,
        loss_agg_mode=algo.loss_agg_mode,
        config=policy_loss_config,
        rollout_is_weights=batch.is_weights,
    )
    loss = pg_loss
    metrics = {"actor/pg_loss": float(pg_loss.detach()), **extra}
    metrics.update(
        {k if k.startswith("actor/") else f"actor/{k}": _as_float(v) for k, v in pg_metrics.items()}
    )
    assert entropy is not None
    agg = dict(policy_loss_config.global_batch_info)
    ent = agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode=algo.loss_agg_mode, **agg)
    metrics["actor/entropy"] = float(ent.detach())
    if need_entropy:
        loss = loss - algo.entropy_coeff * ent
    if algo.use_kl_loss:
        assert batch.ref_log_probs is not None
        kld = kl_penalty(logprob=log_prob, ref_logprob=batch.ref_log_probs, kl_penalty=algo.kl_loss_type)
        kl_loss = agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=algo.loss_agg_mode, **agg)
        loss = loss + algo.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = float(kl_loss.detach())
        metrics["actor/kl_coef"] = algo.kl_loss_coef
    return loss, metrics


def _as_float(v: object) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().mean())
    if isinstance(v, list | tuple):
        return float(sum(v) / max(1, len(v)))
    return float(v)  # type: ignore[arg-type]
