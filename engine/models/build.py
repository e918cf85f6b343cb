"""Build a small causal LM and its tokenizer locally (nothing is downloaded).

``make_model(out_dir, arch=..., size=...)`` trains a byte-level BPE tokenizer (single digits
kept as separate tokens, ChatML special tokens, a Qwen-style chat template) on a corpus
generated locally, initialises a Qwen2 or Llama model of the requested size with a fixed
seed, and saves both with ``save_pretrained`` so that ``AutoTokenizer`` /
``AutoModelForCausalLM`` (and vLLM) load the directory like any hub checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

Arch = Literal["qwen2", "llama"]
Size = Literal["tiny", "small", "base"]

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)

# ChatML, as Qwen2 uses it, without Qwen's default system prompt (short prompts for tiny models).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEFAULT_VOCAB_SIZE = 512


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 512
    rope_theta: float = 10_000.0


SIZES: dict[str, ModelSpec] = {
    # Head sizes are 32 or 64: vLLM's CPU attention kernels support head sizes 32, 64, 80, ...
    # ~0.1M parameters: for tests (builds and runs in milliseconds).
    "tiny": ModelSpec(64, 128, 2, 2, 1, True),
    # ~1M parameters: the starter policy; learns the built-in tasks on one CPU core in minutes.
    "small": ModelSpec(192, 384, 3, 6, 2, True),
    # ~10M parameters.
    "base": ModelSpec(384, 1024, 6, 6, 2, False, 1024),
}


class MakeModelError(ValueError):
    """Bad arguments to ``make_model`` (unknown arch/size, output directory not empty)."""


# ----------------------------------------------------------------------------- corpus


_WORD_TEXT = (
    "the a an of to and in is it that for on with as was be by this are or from at which but not have "
    "has had were can will one all there their what so if about more when up out into than them only "
    "number numbers answer question result target make use each once sum difference product total "
    "add subtract multiply divide plus minus times equals equal value step first then next finally "
    "model policy reward train eval prompt completion token sample group batch learning rate loss "
    "user assistant system you your please think solve problem expression correct wrong because "
    "small large tiny base world hello yes no true false zero one two three four five six seven "
    "eight nine ten hundred thousand count down left right write read show give find check"
)
_WORDS = tuple(_WORD_TEXT.split())


def general_corpus(n: int = 400, seed: int = 0) -> list[str]:
    """``n`` short English-like lines built from a fixed word list (deterministic)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        line = " ".join(words)
        line = line[0].upper() + line[1:] + rng.choice(".?!:,")
        lines.append(line)
    return lines


def default_corpus() -> list[str]:
    """Task prompts and solutions (every difficulty) plus general text, rendered as chats too."""
    from engine.data.tasks import TASKS, generate_eval

    lines = general_corpus()
    for name in TASKS:
        for difficulty in range(1, 6):
            for item in generate_eval(name, difficulty, 60):
                lines.append(item.prompt + item.solution)
                lines.append(
                    f"{IM_START}user\n{item.prompt}{IM_END}\n{IM_START}assistant\n{item.solution}{IM_END}\n"
                )
    return lines


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(
    corpus: Iterable[str] | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE, *, chat_template: bool = True
):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``corpus`` (default: ``default_corpus()``).

    Digits are split into single-digit tokens before the byte-level step, so no merge ever
    joins two digits. ``<|endoftext|>`` is eos and pad; ``<|im_start|>``/``<|im_end|>`` are
    the chat tokens; the chat template is ChatML (none when ``chat_template`` is False: prompts
    are then fed as raw text).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(default_corpus() if corpus is None else corpus)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=max(s.max_position_embeddings for s in SIZES.values()),
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


# ----------------------------------------------------------------------------- model


def build_config(arch: Arch, spec: ModelSpec, vocab_size: int, eos_id: int, pad_id: int):
    """A standard transformers config (only well-known fields, so vLLM reads it too)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        initializer_range=0.02,
        use_cache=True,
    )
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    raise MakeModelError(f"unknown arch '{arch}'; use qwen2 or llama")


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def _umask_mode(mode: int = 0o777) -> int:
    """``mode`` with the process umask applied (``mkdtemp`` makes 0700 directories)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def publish_dir(tmp: Path, final: Path) -> None:
    """Give a finished temporary build directory normal permissions and rename it into place."""
    os.chmod(tmp, _umask_mode())
    os.replace(tmp, final)


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Hide transformers' per-shard progress bar while saving (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


@dataclass(frozen=True)
class MadeModel:
    path: Path
    arch: str
    size: str
    num_parameters: int
    vocab_size: int


def make_model(
    out_dir: str | os.PathLike[str],
    *,
    arch: Arch = "qwen2",
    size: Size = "tiny",
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    chat_template: bool = True,
    overwrite: bool = False,
    verbose: bool = False,
) -> Path:
    """Build a randomly initialised causal LM + tokenizer into ``out_dir`` and return its path.

    ``size``: ``tiny`` (~0.1M params, tests), ``small`` (~2M), ``base`` (~10M). The same
    ``seed`` (and corpus) gives byte-identical weights. The directory is written atomically
    (built beside it, then renamed); an existing non-empty ``out_dir`` is an error unless
    ``overwrite``. The parameter count is recorded in ``tributary.json`` (and printed when
    ``verbose``); ``make_model_info`` returns it with the path. ``chat_template=False`` saves
    the tokenizer without a chat template (prompts are then used as raw text).
    """
    return make_model_info(
        out_dir,
        arch=arch,
        size=size,
        seed=seed,
        corpus=corpus,
        vocab_size=vocab_size,
        chat_template=chat_template,
        overwrite=overwrite,
        verbose=verbose,
    ).path


def make_model_info(
    out_dir: str | os.PathLike[str],
    *,
    arch: Arch = "qwen2",
    size: Size = "tiny",
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    chat_template: bool = True,
    overwrite: bool = False,
    verbose: bool = False,
) -> MadeModel:
    """``make_model`` that also returns the parameter count and vocabulary size."""
    if size not in SIZES:
        raise MakeModelError(f"unknown size '{size}'; use one of {', '.join(SIZES)}")
    if arch not in ("qwen2", "llama"):
        raise MakeModelError(f"unknown arch '{arch}'; use qwen2 or llama")
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise MakeModelError(
            f"{out} already exists and is not empty; choose a new directory or pass overwrite"
        )
    spec = SIZES[size]

    tokenizer = build_tokenizer(corpus, vocab_size=vocab_size, chat_template=chat_template)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = build_config(arch, spec, len(tokenizer), eos_id, tokenizer.pad_token_id)

    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    n_params = count_parameters(model)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        with quiet_progress():
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {
            "arch": arch,
            "size": size,
            "seed": seed,
            "num_parameters": n_params,
            "spec": asdict(spec),
            "chat_template": chat_template,
        }
        (tmp / "tributary.json").write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if verbose:
        print(f"{arch} {size}: {n_params:,} parameters, vocabulary {len(tokenizer)} -> {out}")
    return MadeModel(out, arch, size, n_params, len(tokenizer))


def make_model_cli(
    out_dir: str | os.PathLike[str],
    *,
    arch: str = "qwen2",
    size: str = "small",
    seed: int = 0,
    overwrite: bool = False,
) -> MadeModel:
    """``python -m engine make-model DIR [--arch qwen2|llama] [--size tiny|small|base]``.

    Builds the model, prints one summary line (architecture, size, parameter count, path)
    and returns the ``MadeModel``. Bad arguments raise ``MakeModelError`` (a ValueError)
    with the fix in the message.
    """
    made = make_model_info(out_dir, arch=arch, size=size, seed=seed, overwrite=overwrite)  # type: ignore[arg-type]
    print(
        f"{made.arch} {made.size}: {made.num_parameters:,} parameters, vocabulary {made.vocab_size} -> {made.path}"
    )
    return made
