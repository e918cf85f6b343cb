"""Prompts: the Prompt type, templating, loading splits from a DataConfig, and the sampler.

``Prompt.text`` is exactly the string the rollout feeds to the tokenizer and
``Prompt.token_ids`` its tokens (``encode_prompt``): ``data.prompt_template`` is applied to
the raw prompt, then the tokenizer's chat template (``add_generation_prompt=True``, with
``data.system_prompt`` as a system message) when it has one and ``data.chat_template`` is
``'auto'``. Special tokens (e.g. a BOS) are added by the tokenizer only when no chat
template was applied (a chat template writes its own).
"""

from __future__ import annotations

import random
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.config import DataConfig
from engine.data.errors import DataError


@dataclass
class Prompt:
    """One prompt, ready for the rollout.

    ``uid``: stable across runs ("arithmetic-d1-train-000123", or a hash of a file row).
    ``text``: the exact string fed to the tokenizer. ``raw``: the prompt before templating.
    ``answer``: the reference answer (None if the data has none). ``metadata``: what reward
    functions need (built-in tasks: ``{"task": name, "difficulty": d, ...}``).
    ``token_ids``: ``text`` tokenised the way the rollout must tokenise it (empty when the
    prompt was built without a tokenizer).
    """

    uid: str
    text: str
    raw: str
    answer: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)


@dataclass
class PromptSplits:
    """Train and eval prompts of a run, and what was left out."""

    train: list[Prompt]
    eval: list[Prompt]
    skipped_too_long: int = 0
    """Prompts (train + eval) dropped for having more than ``data.max_prompt_length`` tokens."""
    skipped_too_long_eval: int = 0
    """Of ``skipped_too_long``, how many were eval prompts."""
    dropped_overlap: int = 0
    """Train rows dropped because the same row is in the eval set."""


# ----------------------------------------------------------------------------- templating


def _template_fields(template: str) -> list[str]:
    try:
        return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise DataError(
            f"data.prompt_template {template!r} is not a valid format string ({exc}); "
            "use {prompt} for the prompt and double braces {{ }} for literal braces"
        ) from None


def apply_prompt_template(template: str, raw: str, extra: Mapping[str, Any] | None = None) -> str:
    """``template.format(prompt=raw, **extra)`` with an error naming the unknown placeholder."""
    values = {**(extra or {}), "prompt": raw}
    for name in _template_fields(template):
        base = name.split(".", 1)[0].split("[", 1)[0]
        if base == "":
            raise DataError(f"data.prompt_template {template!r} has a positional field {{}}; use {{prompt}}")
        if base not in values:
            raise DataError(
                f"data.prompt_template uses {{{base}}}, which is not available; use {{prompt}}"
                + (
                    f" or one of the metadata fields {sorted(set(values) - {'prompt'})}"
                    if len(values) > 1
                    else ""
                )
            )
    try:
        return template.format_map(values)
    except (IndexError, KeyError, AttributeError, ValueError) as exc:
        raise DataError(f"data.prompt_template {template!r} cannot be applied: {exc}") from None


def uses_chat_template(cfg: DataConfig, tokenizer: Any) -> bool:
    """True when prompts go through the tokenizer's chat template."""
    return (
        cfg.chat_template == "auto"
        and tokenizer is not None
        and bool(getattr(tokenizer, "chat_template", None))
    )


def format_prompt(raw: str, cfg: DataConfig, tokenizer: Any, extra: Mapping[str, Any] | None = None) -> str:
    """The exact text fed to the tokenizer for the raw prompt ``raw`` under ``cfg``.

    Without a chat template, ``system_prompt`` (if set) is put before the prompt on its own line.
    """
    body = apply_prompt_template(cfg.prompt_template, raw, extra)
    if uses_chat_template(cfg, tokenizer):
        messages = []
        if cfg.system_prompt:
            messages.append({"role": "system", "content": cfg.system_prompt})
        messages.append({"role": "user", "content": body})
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja errors, templates that reject system messages, ...
            raise DataError(
                f"the tokenizer's chat template failed on a prompt ({exc}); set data.chat_template to 'none' "
                "or remove data.system_prompt if the template does not support system messages"
            ) from None
        return str(text)
    if cfg.system_prompt:
        return f"{cfg.system_prompt}\n{body}"
    return body


def encode_texts(tokenizer: Any, texts: Sequence[str], *, add_special_tokens: bool) -> list[list[int]]:
    """Token ids of many texts (the fast tokenizer's batch path when there is one)."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]]


def encode_prompt(tokenizer: Any, text: str, *, chat_template_applied: bool) -> list[int]:
    """Token ids of one prompt text: special tokens are added only when no chat template was applied."""
    return encode_texts(tokenizer, [text], add_special_tokens=not chat_template_applied)[0]


def build_prompts(
    rows: Sequence[tuple[str, str, str | None, dict[str, Any]]],
    cfg: DataConfig,
    tokenizer: Any,
) -> tuple[list[Prompt], int]:
    """Template and tokenise ``(uid, raw, answer, metadata)`` rows; drop those over the length limit.

    Returns the kept prompts and how many were too long.
    """
    chat = uses_chat_template(cfg, tokenizer)
    texts = [format_prompt(raw, cfg, tokenizer, meta) for _, raw, _, meta in rows]
    ids = (
        encode_texts(tokenizer, texts, add_special_tokens=not chat)
        if tokenizer is not None
        else [[]] * len(texts)
    )
    kept: list[Prompt] = []
    too_long = 0
    for (uid, raw, answer, meta), text, tok in zip(rows, texts, ids):
        if tokenizer is not None and len(tok) > cfg.max_prompt_length:
            too_long += 1
            continue
        kept.append(Prompt(uid=uid, text=text, raw=raw, answer=answer, metadata=meta, token_ids=list(tok)))
    return kept, too_long


# ----------------------------------------------------------------------------- loading


def builtin_rows(cfg: DataConfig) -> tuple[list[tuple[str, str, str | None, dict[str, Any]]], list[Any]]:
    """Train and eval rows ``(uid, raw, answer, metadata)`` of the configured built-in task."""
    from engine.data.tasks import generate_splits

    try:
        train_items, eval_items = generate_splits(cfg.task, cfg.difficulty, cfg.train_size, cfg.eval_size)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    prefix = f"{cfg.task}-d{cfg.difficulty}"
    train = [
        (f"{prefix}-train-{i:06d}", it.prompt, it.answer, dict(it.metadata))
        for i, it in enumerate(train_items)
    ]
    evals = [
        (f"{prefix}-eval-{i:06d}", it.prompt, it.answer, dict(it.metadata)) for i, it in enumerate(eval_items)
    ]
    return train, evals


def load_prompts(cfg: DataConfig, tokenizer: Any, *, seed: int = 0) -> PromptSplits:
    """Train and eval prompts for ``cfg`` (a built-in task, a JSONL/Parquet file or a saved dataset).

    Built-in tasks and the eval hold-out of files do not depend on ``seed`` (so every run
    of a config evaluates on the same prompts); ``seed`` is accepted for sources that will
    need one. ``tokenizer`` may be None (no chat template, no tokenisation, no length limit).
    Raises ``DataError`` naming the file, row and fix for bad data.
    """
    del seed  # generation and hold-out are seed-independent by design (comparable eval sets)
    dropped_overlap = 0
    if cfg.source == "builtin":
        train_rows, eval_rows = builtin_rows(cfg)
    else:
        from engine.data.files import file_rows

        train_rows, eval_rows, dropped_overlap = file_rows(cfg)
    train, skipped_train = build_prompts(train_rows, cfg, tokenizer)
    evals, skipped_eval = build_prompts(eval_rows, cfg, tokenizer)
    if not train:
        where = f"built-in task {cfg.task}" if cfg.source == "builtin" else str(cfg.path)
        raise DataError(
            f"no training prompts left from {where}: all {len(train_rows)} are longer than "
            f"data.max_prompt_length={cfg.max_prompt_length} tokens; raise data.max_prompt_length"
        )
    return PromptSplits(
        train=train,
        eval=evals,
        skipped_too_long=skipped_train + skipped_eval,
        skipped_too_long_eval=skipped_eval,
        dropped_overlap=dropped_overlap,
    )


# ----------------------------------------------------------------------------- sampler


class PromptSampler:
    """Endless batches of prompts, epoch by epoch, resumable exactly.

    Each epoch visits every prompt once, in an order fixed by ``(seed, epoch)`` when
    ``shuffle`` (else in the given order). A batch that runs past the end of an epoch
    continues with the next one. ``state_dict()`` holds the epoch and the position in it;
    ``load_state_dict()`` on a sampler over the same prompts continues exactly there.
    """

    def __init__(self, prompts: Sequence[Prompt], *, shuffle: bool = True, seed: int = 0) -> None:
        if len(prompts) == 0:
            raise ValueError("PromptSampler needs at least one prompt")
        self._prompts = list(prompts)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self._prompts)

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            order = list(range(len(self._prompts)))
            if self.shuffle:
                random.Random(f"tributary-sampler/{self.seed}/{self.epoch}").shuffle(order)
            self._order, self._order_epoch = order, self.epoch
        return self._order

    def next_batch(self, k: int) -> list[Prompt]:
        """The next ``k`` prompts (wrapping into the next epoch as needed)."""
        if k < 1:
            raise ValueError(f"batch size must be at least 1, got {k}")
        batch: list[Prompt] = []
        while len(batch) < k:
            order = self._epoch_order()
            take = min(k - len(batch), len(order) - self.position)
            batch.extend(self._prompts[i] for i in order[self.position : self.position + take])
            self.position += take
            if self.position == len(order):
                self.epoch += 1
                self.position = 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self._prompts),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        n = state.get("num_prompts", len(self._prompts))
        if n != len(self._prompts):
            raise ValueError(
                f"sampler state was saved over {n} prompts but this sampler has {len(self._prompts)}; "
                "resume with the same data config"
            )
        position = int(state["position"])
        if not 0 <= position < len(self._prompts):
            raise ValueError(
                f"sampler state position {position} is out of range for {len(self._prompts)} prompts"
            )
        self.epoch = int(state["epoch"])
        self.position = position
        self.seed = int(state.get("seed", self.seed))
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self._order_epoch = -1
