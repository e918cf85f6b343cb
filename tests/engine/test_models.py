"""engine.models: building small models locally, loading them back, and load errors."""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models import (
    SIZES,
    MakeModelError,
    ModelLoadError,
    load_model,
    load_tokenizer,
    make_model,
    make_model_cli,
    make_model_info,
)
from engine.models.build import CHAT_TEMPLATE, EOS_TOKEN, IM_END, IM_START

# Head sizes vLLM's CPU attention kernels accept (so every size also serves in vLLM).
VLLM_CPU_HEAD_SIZES = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}

PARAM_RANGES = {"tiny": (50_000, 150_000), "small": (800_000, 2_500_000), "base": (8_000_000, 12_000_000)}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("size", ["tiny", "small", "base"])
def test_make_model_sizes_param_counts_and_round_trip(tmp_path: Path, arch: str, size: str) -> None:
    made = make_model_info(tmp_path / "m", arch=arch, size=size)
    low, high = PARAM_RANGES[size]
    assert low <= made.num_parameters <= high
    model = load_model(made.path)
    assert model.config.model_type == arch
    assert sum(p.numel() for p in model.parameters()) == made.num_parameters
    assert model.config.hidden_size // model.config.num_attention_heads in VLLM_CPU_HEAD_SIZES
    assert json.loads((made.path / "tributary.json").read_text())["num_parameters"] == made.num_parameters
    tok = load_tokenizer(made.path)
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id
    ids = torch.tensor([tok.encode("12+34=")])
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_sizes_table_is_what_the_docs_say() -> None:
    assert list(SIZES) == ["tiny", "small", "base"]


def test_tiny_model_fixture_loads_with_plain_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    assert model.config.model_type == "qwen2"
    assert 50_000 <= sum(p.numel() for p in model.parameters()) <= 150_000
    assert tok.eos_token == EOS_TOKEN
    assert model.generation_config.eos_token_id == tok.eos_token_id
    out = model.generate(
        input_ids=torch.tensor([tok.encode("1+1=")]),
        max_new_tokens=3,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
    )
    assert out.shape[1] <= 4 + 3


def test_make_model_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = load_model(make_model(tmp_path / "a", seed=3)).state_dict()
    b = load_model(make_model(tmp_path / "b", seed=3)).state_dict()
    c = load_model(make_model(tmp_path / "c", seed=4)).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()


def test_make_model_refuses_bad_arguments_and_non_empty_dirs(tmp_path: Path) -> None:
    with pytest.raises(MakeModelError, match="unknown size 'huge'"):
        make_model(tmp_path / "x", size="huge")  # type: ignore[arg-type]
    with pytest.raises(MakeModelError, match="unknown arch 'gpt2'"):
        make_model(tmp_path / "x", arch="gpt2")  # type: ignore[arg-type]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(MakeModelError, match="not empty"):
        make_model(tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert make_model(tmp_path / "full", overwrite=True) == tmp_path / "full"
    assert not (tmp_path / "full" / "keep.txt").exists()
    # an existing empty directory is fine, and no temporary directories are left behind
    (tmp_path / "empty").mkdir()
    make_model(tmp_path / "empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "full"]


def test_make_model_cli_prints_the_parameter_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    made = make_model_cli(tmp_path / "cli", arch="llama", size="tiny")
    out = capsys.readouterr().out
    assert f"{made.num_parameters:,} parameters" in out
    assert "llama tiny" in out and str(tmp_path / "cli") in out


# ----------------------------------------------------------------------------- tokenizer


def test_digits_are_single_tokens(tokenizer) -> None:
    tokens = tokenizer.tokenize("12345+678=9001")
    assert tokens == list("12345+678=9001")
    for text in ("x 2024 y", "count 99 down", "1000000"):
        digit_tokens = [t for t in tokenizer.tokenize(text) if any(ch.isdigit() for ch in t)]
        assert all(len(t) == 1 for t in digit_tokens), digit_tokens


def test_special_tokens(tokenizer) -> None:
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.pad_token == EOS_TOKEN and tokenizer.pad_token_id == tokenizer.eos_token_id
    for tok in (IM_START, IM_END):
        ids = tokenizer.encode(tok, add_special_tokens=False)
        assert len(ids) == 1
        assert tokenizer.decode(ids) == tok
    # the tokenizer adds no BOS/EOS of its own
    assert tokenizer.encode("12+34=") == tokenizer.encode("12+34=", add_special_tokens=False)


def test_chat_template_is_chatml(tokenizer) -> None:
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+34="}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
    )
    no_gen = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert no_gen == "<|im_start|>user\nhi<|im_end|>\n"


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_tokenizer_round_trips_any_text(tokenizer, text: str) -> None:
    # Qwen2's tokenizer class normalises to NFC (U+F900 becomes U+8C48): identity up to that.
    expected = unicodedata.normalize("NFC", text)
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == expected


def test_tokenizer_without_chat_template(tmp_path: Path) -> None:
    path = make_model(tmp_path / "raw", chat_template=False)
    tok = load_tokenizer(path)
    assert not tok.chat_template
    assert tok.tokenize("12+3=") == list("12+3=")


def test_load_tokenizer_sets_a_missing_pad_token_to_eos(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = tmp_path / "nopad"
    tok = load_tokenizer(tiny_model_dir)
    tok.pad_token = None
    tok.save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert config.get("pad_token") in (None, "")
    reloaded = load_tokenizer(path)
    assert reloaded.pad_token == EOS_TOKEN
    assert reloaded.pad_token_id == reloaded.eos_token_id


# ----------------------------------------------------------------------------- load errors


def _assert_refused(load: Callable[[Path], object], path: Path, match: str) -> None:
    """``load(path)`` raises ModelLoadError matching ``match`` that names the path and the fix."""
    with pytest.raises(ModelLoadError, match=match) as exc:
        load(path)
    message = str(exc.value)
    assert str(path) in message
    assert "make-model" in message


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    _assert_refused(load_model, missing, "does not exist")
    _assert_refused(load_tokenizer, missing, "does not exist")
    assert issubclass(ModelLoadError, ValueError)


def test_file_instead_of_directory(tmp_path: Path) -> None:
    f = tmp_path / "model.bin"
    f.write_bytes(b"\0" * 16)
    _assert_refused(load_model, f, "not a directory")


def test_directory_that_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    _assert_refused(load_model, tmp_path, "not a model directory")
    _assert_refused(load_tokenizer, tmp_path, "no loadable tokenizer")


def test_unreadable_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    _assert_refused(load_model, tmp_path, r"config\.json")


def test_model_that_is_not_a_causal_lm(tmp_path: Path) -> None:
    from transformers import T5Config

    T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=100).save_pretrained(tmp_path)
    _assert_refused(load_model, tmp_path, "'t5' model, which is not a causal LM")


def test_model_without_weights(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m")
    (path / "model.safetensors").unlink()
    _assert_refused(load_model, path, "cannot load the model weights")


def test_dtype_and_device_arguments(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, dtype="bfloat16", device="cpu")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert not model.training
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model(tiny_model_dir, dtype="float8")


def test_built_directories_get_normal_permissions(tmp_path: Path) -> None:
    import os

    umask = os.umask(0)
    os.umask(umask)
    path = make_model(tmp_path / "perm")
    assert path.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
