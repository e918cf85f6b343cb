"""Load a causal LM and its tokenizer from a local directory (transformers, never the hub)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

_FIX = "build one with `python -m engine make-model DIR` or set model.path to a local transformers model directory"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class ModelLoadError(ValueError):
    """A model or tokenizer directory that cannot be loaded; the message names the path and the fix."""


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype)]
    except KeyError:
        raise ModelLoadError(f"unknown dtype '{dtype}'; use one of {', '.join(_DTYPES)}") from None


def _check_dir(path: str | os.PathLike[str], what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(f"{what} directory {p} does not exist; {_FIX}")
    if not p.is_dir():
        raise ModelLoadError(f"{what} path {p} is a file, not a directory; {_FIX}")
    return p


def load_model_config(path: str | os.PathLike[str]) -> Any:
    """The transformers config of the model in ``path`` (checked to be a causal LM)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    p = _check_dir(path, "model")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"{p} is not a model directory (no config.json); {_FIX}")
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(
            f"{p}/config.json cannot be read as a transformers config ({exc}); {_FIX}"
        ) from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(
            f"{p} holds a '{config.model_type}' model, which is not a causal LM; "
            f"use a causal LM (e.g. qwen2, llama) or {_FIX}"
        )
    return config


def sliding_window(config: object) -> int | None:
    """The attention window of a transformers config if any layer uses one, else None: code that
    builds 4-D attention masks by hand (the rollout's fast path, the trainer's packed rows) does
    not apply it, so it runs only where the window cannot cut a sequence."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if window and ("sliding_attention" in layer_types or getattr(config, "use_sliding_window", False)):
        return int(window)
    return None


def load_model(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """A causal LM (``AutoModelForCausalLM``) from the local directory ``path``, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch_dtype = _as_dtype(dtype)
    config = load_model_config(path)
    p = Path(path).expanduser()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            p, config=config, dtype=torch_dtype, local_files_only=True
        )
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the model weights in {p}: {exc}; {_FIX}") from None
    model.to(device)
    model.eval()
    return model


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The tokenizer saved in ``path``; it always has a pad token (eos when it had none).

    Padding side is left to the caller.
    """
    from transformers import AutoTokenizer

    p = _check_dir(path, "tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{p} has no loadable tokenizer ({exc}); {_FIX}") from None
    if not getattr(tokenizer, "is_fast", False) and not hasattr(tokenizer, "apply_chat_template"):
        raise ModelLoadError(f"{p} has no usable tokenizer; {_FIX}")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(
                f"the tokenizer in {p} has neither a pad nor an eos token; add an eos_token to its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
