"""Models: load a causal LM + tokenizer from a local directory; build small ones locally.

Public API::

    load_model(path, *, dtype=torch.float32, device="cpu") -> PreTrainedModel
    load_tokenizer(path) -> PreTrainedTokenizerBase      # always has a pad token
    make_model(out_dir, *, arch="qwen2", size="tiny", seed=0, ...) -> Path
    make_model_cli(out_dir, *, arch="qwen2", size="small", seed=0, overwrite=False) -> MadeModel
    starter_policy(task, difficulty, *, progress=None) -> Path
    resolve_model_path(model_cfg, data_cfg, *, progress=None) -> Path   # handles "starter"
    ModelLoadError (ValueError)
"""

from engine.models.build import SIZES, MadeModel, MakeModelError, make_model, make_model_cli, make_model_info
from engine.models.loading import (
    ModelLoadError,
    load_model,
    load_model_config,
    load_tokenizer,
    sliding_window,
)
from engine.models.starter import (
    greedy_accuracy,
    read_starter_info,
    resolve_model_path,
    starter_path,
    starter_policy,
)

__all__ = [
    "SIZES",
    "MadeModel",
    "MakeModelError",
    "ModelLoadError",
    "greedy_accuracy",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "make_model",
    "make_model_cli",
    "make_model_info",
    "read_starter_info",
    "resolve_model_path",
    "sliding_window",
    "starter_path",
    "starter_policy",
]
