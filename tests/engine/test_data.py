"""engine.data: built-in tasks and verifiers, file sources, templating, and the sampler."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import DataConfig, FieldMapping
from engine.data import (
    DataError,
    Prompt,
    PromptSampler,
    encode_prompt,
    format_prompt,
    get_task,
    load_prompts,
)
from engine.data.tasks import TASKS, generate_eval, generate_splits, generate_train
from engine.models import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


# ----------------------------------------------------------------------------- built-in tasks


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("difficulty", [1, 2, 3, 4, 5])
def test_generation_is_deterministic_disjoint_and_self_consistent(task: str, difficulty: int) -> None:
    train, evals = generate_splits(task, difficulty, 3000, 200)
    again_train, again_evals = generate_splits(task, difficulty, 3000, 200)
    assert [i.prompt for i in train] == [i.prompt for i in again_train]
    assert [i.prompt for i in evals] == [i.prompt for i in again_evals]
    eval_keys = {i.prompt for i in evals}
    assert len(eval_keys) == len(evals)  # eval items are distinct
    assert eval_keys.isdisjoint(i.prompt for i in train)
    t = get_task(task)
    for item in train[:300] + evals:
        assert item.metadata["task"] == task
        assert t.score(item.solution, item.answer, item.metadata) == 1.0


def test_eval_is_a_stable_prefix_and_train_excludes_any_given_items() -> None:
    small, big = generate_eval("arithmetic", 1, 10), generate_eval("arithmetic", 1, 50)
    assert [i.prompt for i in small] == [i.prompt for i in big[:10]]
    everything_but_a_few = {i.prompt for i in generate_train("arithmetic", 1, 2000, set())}
    train = generate_train("arithmetic", 1, 500, everything_but_a_few)
    assert everything_but_a_few.isdisjoint(i.prompt for i in train)


def test_difficulties_differ() -> None:
    d1 = [i.prompt for i in generate_eval("arithmetic", 1, 20)]
    d5 = [i.prompt for i in generate_eval("arithmetic", 5, 20)]
    assert d1 != d5
    assert all(p.count("+") == 1 and len(p) == 6 for p in d1)  # 2-digit + 2-digit


def test_too_many_eval_prompts_for_a_small_problem_space() -> None:
    with pytest.raises(ValueError, match=r"lower data\.eval_size"):
        generate_eval("arithmetic", 1, 9000)  # only 90 * 90 distinct problems


def test_get_task_api() -> None:
    for name in ("arithmetic", "countdown"):
        task = get_task(name)
        assert task.name == name
    with pytest.raises(ValueError, match="unknown built-in task 'chess'"):
        get_task("chess")


ARITH = {"task": "arithmetic", "difficulty": 1}


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("46", 1.0),
        ("46<|endoftext|>", 1.0),
        (" 46", 1.0),
        ("46\n12+34=47", 1.0),
        ("46 is the answer", 1.0),
        ("46.", 1.0),
        ("47", 0.0),
        ("461", 0.0),
        ("4 6", 0.0),
        ("46.5", 0.0),
        ("-46", 0.0),
        ("", 0.0),
        ("abc", 0.0),
        ("The answer is 46", 0.0),
        ("\n46", 1.0),
    ],
)
def test_arithmetic_verifier(completion: str, score: float) -> None:
    assert get_task("arithmetic").score(completion, "46", ARITH) == score


def test_arithmetic_verifier_negative_answers_and_bad_references() -> None:
    task = get_task("arithmetic")
    assert task.score("-12", "-12", ARITH) == 1.0
    assert task.score("12", "-12", ARITH) == 0.0
    with pytest.raises(ValueError, match="integer"):
        task.score("12", "twelve", ARITH)
    with pytest.raises(ValueError, match="integer"):
        task.score("12", None, ARITH)


CD = {"task": "countdown", "difficulty": 1, "numbers": [3, 5, 7], "target": 22}


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("3*5+7", 1.0),
        ("7+3*5", 1.0),
        ("(3*5)+7", 1.0),
        (" 3 * 5 + 7 ", 1.0),
        ("3*5+7 = 22", 1.0),
        ("3*5+7\nsome more text", 1.0),
        ("3*5+7<|endoftext|>", 1.0),
        ("3*5+5", 0.0),  # wrong value and 5 reused
        ("3*7+1", 0.0),  # 1 is not given
        ("3*5", 0.0),  # wrong value
        ("7*3+5-3", 0.0),  # 3 used twice
        ("22", 0.0),  # the target is not a given number
        ("7/(5-5)", 0.0),  # division by zero (and a reused 5)
        ("3**5", 0.0),  # power is not allowed
        ("-3+25", 0.0),
        ("__import__('os').system('true')", 0.0),
        ("", 0.0),
        ("(((", 0.0),
        ("3*5+7" + "+0" * 200, 0.0),  # too long
    ],
)
def test_countdown_verifier(completion: str, score: float) -> None:
    assert get_task("countdown").score(completion, "22", CD) == score


def test_countdown_division_repeats_and_zero() -> None:
    task = get_task("countdown")
    meta = {"task": "countdown", "numbers": [6, 3, 4, 4], "target": 8}
    assert task.score("6/3*4", "8", meta) == 1.0  # exact rational arithmetic
    assert task.score("4+4", "8", meta) == 1.0  # 4 appears twice, so it may be used twice
    assert task.score("4+4+4-4", "8", meta) == 0.0  # but not four times
    zero = {"task": "countdown", "numbers": [2, 2, 8], "target": 4}
    assert task.score("8/(2-2)", "4", zero) == 0.0
    assert task.score("8/2", "4", zero) == 1.0
    with pytest.raises(ValueError, match="numbers"):
        task.score("1+1", "2", {"task": "countdown"})


# ----------------------------------------------------------------------------- load_prompts: built-in


def test_builtin_prompts(tokenizer) -> None:
    cfg = DataConfig(task="arithmetic", train_size=500, eval_size=64)
    splits = load_prompts(cfg, tokenizer, seed=0)
    assert len(splits.train) == 500 and len(splits.eval) == 64
    assert splits.skipped_too_long == 0
    first = splits.train[0]
    assert first.uid == "arithmetic-d1-train-000000"
    assert splits.eval[3].uid == "arithmetic-d1-eval-000003"
    assert first.metadata["task"] == "arithmetic"
    assert first.text == f"<|im_start|>user\n{first.raw}<|im_end|>\n<|im_start|>assistant\n"
    assert first.token_ids == encode_prompt(tokenizer, first.text, chat_template_applied=True)
    assert get_task("arithmetic").score(first.answer, first.answer, first.metadata) == 1.0
    assert {p.raw for p in splits.train}.isdisjoint(p.raw for p in splits.eval)
    # the run seed does not change the data (every run evaluates on the same prompts)
    other = load_prompts(cfg, tokenizer, seed=123)
    assert [p.uid for p in other.train] == [p.uid for p in splits.train]
    assert [p.text for p in other.eval] == [p.text for p in splits.eval]


def test_builtin_countdown_metadata(tokenizer) -> None:
    splits = load_prompts(
        DataConfig(task="countdown", difficulty=3, train_size=50, eval_size=8), tokenizer, seed=0
    )
    p = splits.eval[0]
    assert p.metadata["task"] == "countdown" and p.metadata["difficulty"] == 3
    assert set(p.metadata) >= {"numbers", "target"}
    assert p.answer == str(p.metadata["target"])
    json.dumps(p.metadata)  # shippable in events


def test_prompts_over_the_length_limit_are_skipped_and_counted(tokenizer) -> None:
    cfg = DataConfig(task="arithmetic", difficulty=5, train_size=400, eval_size=40, max_prompt_length=16)
    splits = load_prompts(cfg, tokenizer, seed=0)
    # difficulty 5 mixes 2x2-digit products (14 tokens with the chat template) and 4-digit sums (18)
    assert 0 < splits.skipped_too_long < 440
    assert len(splits.train) + len(splits.eval) + splits.skipped_too_long == 440
    assert all(len(p.token_ids) <= 16 for p in splits.train + splits.eval)
    assert splits.skipped_too_long_eval == 40 - len(splits.eval)
    with pytest.raises(DataError, match=r"raise data\.max_prompt_length"):
        load_prompts(cfg.model_copy(update={"max_prompt_length": 3}), tokenizer, seed=0)


# ----------------------------------------------------------------------------- templating


def test_templating_with_a_chat_template(tokenizer) -> None:
    cfg = DataConfig(prompt_template="Q: {prompt}", system_prompt="Answer with a number.")
    text = format_prompt("2+2=", cfg, tokenizer)
    assert text == (
        "<|im_start|>system\nAnswer with a number.<|im_end|>\n"
        "<|im_start|>user\nQ: 2+2=<|im_end|>\n<|im_start|>assistant\n"
    )
    # chat_template 'none' uses the raw text even when the tokenizer has a template
    none = cfg.model_copy(update={"chat_template": "none"})
    assert format_prompt("2+2=", none, tokenizer) == "Answer with a number.\nQ: 2+2="


def test_templating_without_a_chat_template(tmp_path: Path) -> None:
    from engine.models import make_model

    tok = load_tokenizer(make_model(tmp_path / "raw", chat_template=False))
    cfg = DataConfig(prompt_template="{prompt}", chat_template="auto")
    assert format_prompt("12+34=", cfg, tok) == "12+34="
    splits = load_prompts(cfg.model_copy(update={"train_size": 20, "eval_size": 4}), tok, seed=0)
    assert splits.train[0].text == splits.train[0].raw
    assert splits.train[0].token_ids == tok.encode(splits.train[0].raw)
    assert format_prompt("x", DataConfig(), None) == "x"  # no tokenizer: no template


def test_template_errors_name_the_placeholder() -> None:
    with pytest.raises(DataError, match=r"uses \{question\}"):
        format_prompt("x", DataConfig(prompt_template="{question}"), None)
    with pytest.raises(DataError, match="positional"):
        format_prompt("x", DataConfig(prompt_template="{}"), None)
    with pytest.raises(DataError, match="not a valid format string"):
        format_prompt("x", DataConfig(prompt_template="{prompt"), None)
    assert format_prompt("x", DataConfig(prompt_template="{{literal}} {prompt}"), None) == "{literal} x"


# ----------------------------------------------------------------------------- files


ROWS = [{"q": f"What is {i} + {i}?", "a": 2 * i, "src": f"s{i % 3}", "extra": i} for i in range(40)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _file_cfg(source: str, path: Path, **kw) -> DataConfig:
    fields = FieldMapping(prompt="q", answer="a", metadata=["src"])
    return DataConfig(source=source, path=str(path), fields=fields, eval_size=8, **kw)


def _check_file_splits(splits) -> None:
    assert len(splits.eval) == 8 and len(splits.train) == 32
    by_raw = {r["q"]: r for r in ROWS}
    for p in splits.train + splits.eval:
        row = by_raw[p.raw]
        assert p.answer == str(row["a"])
        assert p.metadata == {"src": row["src"]}
        assert p.uid.startswith("row-")
    assert {p.raw for p in splits.train}.isdisjoint(p.raw for p in splits.eval)
    assert len({p.uid for p in splits.train + splits.eval}) == 40


def test_jsonl(tmp_path: Path, tokenizer) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    splits = load_prompts(_file_cfg("jsonl", path), tokenizer, seed=0)
    _check_file_splits(splits)
    assert splits.train[0].text.startswith("<|im_start|>user\nWhat is")
    # the hold-out depends on the rows, not on their order or on the run seed
    shuffled = ROWS[:]
    random.Random(1).shuffle(shuffled)
    again = load_prompts(_file_cfg("jsonl", _jsonl(tmp_path / "s.jsonl", shuffled)), tokenizer, seed=7)
    assert sorted(p.uid for p in again.eval) == sorted(p.uid for p in splits.eval)


def test_parquet(tmp_path: Path, tokenizer) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    splits = load_prompts(_file_cfg("parquet", path), tokenizer, seed=0)
    _check_file_splits(splits)
    jsonl = load_prompts(_file_cfg("jsonl", _jsonl(tmp_path / "d.jsonl", ROWS)), tokenizer, seed=0)
    assert [p.uid for p in splits.eval] == [p.uid for p in jsonl.eval]


def test_saved_dataset_and_dataset_dict(tmp_path: Path, tokenizer) -> None:
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "ds"))
    _check_file_splits(load_prompts(_file_cfg("disk", tmp_path / "ds"), tokenizer, seed=0))

    dd = datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_list(ROWS[:5])})
    dd.save_to_disk(str(tmp_path / "dd"))
    _check_file_splits(load_prompts(_file_cfg("disk", tmp_path / "dd", split="train"), tokenizer, seed=0))
    with pytest.raises(DataError, match=r"splits \['train', 'test'\]; set data.split"):
        load_prompts(_file_cfg("disk", tmp_path / "dd"), tokenizer, seed=0)
    with pytest.raises(DataError, match="no split 'validation'"):
        load_prompts(_file_cfg("disk", tmp_path / "dd", split="validation"), tokenizer, seed=0)
    # a DatasetDict with one split needs no data.split
    datasets.DatasetDict({"only": ds}).save_to_disk(str(tmp_path / "one"))
    _check_file_splits(load_prompts(_file_cfg("disk", tmp_path / "one"), tokenizer, seed=0))
    with pytest.raises(DataError, match="load_from_disk"):
        (tmp_path / "junk").mkdir()
        load_prompts(_file_cfg("disk", tmp_path / "junk"), tokenizer, seed=0)


def test_eval_path_and_overlap_removal(tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "train.jsonl", ROWS)
    evals = _jsonl(tmp_path / "eval.jsonl", [*ROWS[:3], {"q": "new?", "a": 1, "src": "x"}])
    splits = load_prompts(_file_cfg("jsonl", train, eval_path=str(evals)), None, seed=0)
    assert [p.raw for p in splits.eval] == [r["q"] for r in ROWS[:3]] + ["new?"]
    assert len(splits.train) == 37 and splits.dropped_overlap == 3
    capped = load_prompts(
        _file_cfg("jsonl", train, eval_path=str(evals)).model_copy(update={"eval_size": 2}), None, seed=0
    )
    assert len(capped.eval) == 2
    no_eval = load_prompts(_file_cfg("jsonl", train).model_copy(update={"eval_size": 0}), None, seed=0)
    assert len(no_eval.train) == 40 and no_eval.eval == []


def test_duplicate_rows_get_distinct_uids_and_stay_on_one_side(tmp_path: Path) -> None:
    rows = ROWS[:10] * 3
    splits = load_prompts(
        _file_cfg("jsonl", _jsonl(tmp_path / "dup.jsonl", rows)).model_copy(update={"eval_size": 3}),
        None,
        seed=0,
    )
    uids = [p.uid for p in splits.train + splits.eval]
    assert len(set(uids)) == len(uids)
    assert {p.raw for p in splits.train}.isdisjoint(p.raw for p in splits.eval)


def test_answer_field_may_be_unmapped(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}"} for i in range(5)])
    cfg = DataConfig(source="jsonl", path=str(path), fields=FieldMapping(answer=None), eval_size=1)
    splits = load_prompts(cfg, None, seed=0)
    assert all(p.answer is None and p.metadata == {} for p in splits.train)


# -- file errors


def test_missing_file(tmp_path: Path) -> None:
    for source in ("jsonl", "parquet", "disk"):
        with pytest.raises(DataError, match="not found") as exc:
            load_prompts(_file_cfg(source, tmp_path / "nope"), None, seed=0)
        assert str(tmp_path / "nope") in str(exc.value)


def test_malformed_jsonl_reports_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"q": "x", "a": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: not valid JSON"):
        load_prompts(_file_cfg("jsonl", path), None, seed=0)
    path.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected a JSON object, got list"):
        load_prompts(_file_cfg("jsonl", path), None, seed=0)
    path.write_bytes(json.dumps(ROWS[0]).encode() + b"\n\xff\xfe\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not UTF-8"):
        load_prompts(_file_cfg("jsonl", path), None, seed=0)


def test_unreadable_parquet(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    path.write_text("this is not parquet")
    with pytest.raises(DataError, match="cannot read as Parquet") as exc:
        load_prompts(_file_cfg("parquet", path), None, seed=0)
    assert str(path) in str(exc.value)


def test_missing_field_in_a_jsonl_row(tmp_path: Path) -> None:
    rows = [*ROWS[:5], {"question": "?", "a": 1, "src": "s"}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=r"d.jsonl, line 6: no field 'q' \(data.fields.prompt\)"):
        load_prompts(_file_cfg("jsonl", path), None, seed=0)
    rows = [*ROWS[:5], {"q": "?", "src": "s"}]
    with pytest.raises(DataError, match=r"line 6: no field 'a' \(data.fields.answer\)"):
        load_prompts(_file_cfg("jsonl", _jsonl(path, rows)), None, seed=0)
    rows = [*ROWS[:5], {"q": "?", "a": 1}]
    with pytest.raises(DataError, match=r"line 6: no field 'src' \(listed in data.fields.metadata\)"):
        load_prompts(_file_cfg("jsonl", _jsonl(path, rows)), None, seed=0)
    rows = [*ROWS[:5], {"q": 17, "a": 1, "src": "s"}]
    with pytest.raises(DataError, match=r"line 6: field 'q' must be a non-empty string"):
        load_prompts(_file_cfg("jsonl", _jsonl(path, rows)), None, seed=0)


def test_missing_mapped_column(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if k != "a"} for r in ROWS]), path)
    with pytest.raises(DataError, match=r"no column 'a' \(from data.fields.answer\).*set data.fields.answer"):
        load_prompts(_file_cfg("parquet", path), None, seed=0)
    cfg = _file_cfg("parquet", path).model_copy(
        update={"fields": FieldMapping(prompt="question", answer=None)}
    )
    with pytest.raises(DataError, match=r"no column 'question' \(from data.fields.prompt\)"):
        load_prompts(cfg, None, seed=0)


def test_empty_dataset(tmp_path: Path) -> None:
    import datasets

    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: the dataset is empty"):
        load_prompts(_file_cfg("jsonl", path), None, seed=0)
    datasets.Dataset.from_dict({"q": [], "a": [], "src": []}).save_to_disk(str(tmp_path / "empty_ds"))
    with pytest.raises(DataError, match="the dataset is empty"):
        load_prompts(_file_cfg("disk", tmp_path / "empty_ds"), None, seed=0)


def test_eval_size_too_large_for_the_file(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ROWS[:5])
    with pytest.raises(DataError, match=r"has 5 rows.*lower data\.eval_size or set data\.eval_path"):
        load_prompts(_file_cfg("jsonl", path), None, seed=0)


# ----------------------------------------------------------------------------- sampler


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(uid=f"p{i}", text=f"t{i}", raw=f"r{i}") for i in range(n)]


def test_sampler_epochs_are_permutations_and_deterministic() -> None:
    prompts = _prompts(10)
    a = PromptSampler(prompts, shuffle=True, seed=5)
    epochs = [[p.uid for p in a.next_batch(10)] for _ in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(p.uid for p in prompts)
    assert epochs[0] != epochs[1]  # a new order every epoch
    b = PromptSampler(prompts, shuffle=True, seed=5)
    assert [p.uid for p in b.next_batch(30)] == [uid for epoch in epochs for uid in epoch]
    assert [p.uid for p in PromptSampler(prompts, shuffle=False).next_batch(12)] == [
        *(f"p{i}" for i in range(10)),
        "p0",
        "p1",
    ]
    assert [p.uid for p in PromptSampler(prompts, shuffle=True, seed=6).next_batch(10)] != epochs[0]


def test_sampler_batches_wrap_into_the_next_epoch() -> None:
    s = PromptSampler(_prompts(7), shuffle=True, seed=0)
    s.next_batch(5)
    batch = s.next_batch(5)  # 2 from epoch 0, 3 from epoch 1
    assert len(batch) == 5
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["position"] == 3
    big = s.next_batch(20)  # larger than the dataset: spans several epochs
    assert len(big) == 20


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 13),
    seed=st.integers(0, 2**31),
    shuffle=st.booleans(),
    before=st.lists(st.integers(1, 9), max_size=6),
    after=st.lists(st.integers(1, 9), min_size=1, max_size=6),
)
def test_sampler_resumes_exactly(
    n: int, seed: int, shuffle: bool, before: list[int], after: list[int]
) -> None:
    prompts = _prompts(n)
    straight = PromptSampler(prompts, shuffle=shuffle, seed=seed)
    for k in before:
        straight.next_batch(k)
    expected = [[p.uid for p in straight.next_batch(k)] for k in after]

    first = PromptSampler(prompts, shuffle=shuffle, seed=seed)
    for k in before:
        first.next_batch(k)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = PromptSampler(prompts, shuffle=shuffle, seed=seed)
    resumed.load_state_dict(state)
    assert [[p.uid for p in resumed.next_batch(k)] for k in after] == expected


def test_sampler_errors() -> None:
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptSampler([], shuffle=True, seed=0)
    s = PromptSampler(_prompts(3), shuffle=True, seed=0)
    with pytest.raises(ValueError, match="at least 1"):
        s.next_batch(0)
    state = PromptSampler(_prompts(4), shuffle=True, seed=0).state_dict()
    with pytest.raises(ValueError, match="saved over 4 prompts but this sampler has 3"):
        s.load_state_dict(state)


def test_lone_surrogates_and_nul_in_a_row_are_read_not_fatal(tmp_path: Path) -> None:
    """Valid JSON may carry a lone surrogate (untokenizable: it becomes U+FFFD) or a NUL (kept:
    the model may see it; the event log makes it storable)."""
    from engine.data.files import read_rows

    path = tmp_path / "odd.jsonl"
    path.write_text('{"prompt": "2+2\\ud800", "answer": "4\\u0000"}\n{"prompt": "x", "answer": "\\udc00"}\n')
    rows = read_rows(path, DataConfig(source="jsonl", path=str(path)))
    assert [(r[1], r[2]) for r in rows] == [("2+2\ufffd", "4\x00"), ("x", "\ufffd")]
