"""Prompt sources: built-in verifiable tasks, JSONL/Parquet files, saved datasets; templating.

Public API::

    Prompt(uid, text, raw, answer=None, metadata={}, token_ids=[])
    PromptSplits(train, eval, skipped_too_long, skipped_too_long_eval, dropped_overlap)
    load_prompts(cfg: DataConfig, tokenizer, *, seed) -> PromptSplits
    PromptSampler(prompts, *, shuffle, seed): next_batch(k), state_dict(), load_state_dict(s)
    PromptSelector(prompts, *, selection, options, shuffle, seed, group_size) (data.selection):
        the sampler's API plus observe(uid, values, step), metrics() and the prompt statistics
    format_prompt(raw, cfg, tokenizer) -> str;  encode_prompt(tokenizer, text, *, chat_template_applied)
    get_task(name) -> task with .name and .score(completion, answer, metadata) -> float
    DataError (ValueError)
"""

from engine.data.errors import DataError
from engine.data.prompts import (
    Prompt,
    PromptSampler,
    PromptSplits,
    apply_prompt_template,
    encode_prompt,
    encode_texts,
    format_prompt,
    load_prompts,
    uses_chat_template,
)
from engine.data.selection import PromptSelector
from engine.data.tasks import TASKS, TaskItem, get_task

__all__ = [
    "TASKS",
    "DataError",
    "Prompt",
    "PromptSampler",
    "PromptSelector",
    "PromptSplits",
    "TaskItem",
    "apply_prompt_template",
    "encode_prompt",
    "encode_texts",
    "format_prompt",
    "get_task",
    "load_prompts",
    "uses_chat_template",
]
