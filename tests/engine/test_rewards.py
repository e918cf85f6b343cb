"""Reward functions, the registry and the RewardManager (real worker processes, real math-verify)."""

from __future__ import annotations

import math
import random

import pytest

from engine.config import RewardConfig, RewardFunctionConfig
from engine.rewards import (
    RewardInput,
    RewardManager,
    RewardResult,
    extract_prediction,
    get_reward_fn,
    register_reward,
    registered_rewards,
    validate_reward_functions,
)
from engine.rewards.builtin import exact_match, format_reward, length_reward, math_reward, overlong_penalty
from tests.engine import reward_fixtures

FIXTURES = reward_fixtures.__name__


def fn(name: str, weight: float = 1.0, **params: object) -> RewardFunctionConfig:
    return RewardFunctionConfig(name=name, weight=weight, params=params)


def user(function: str, weight: float = 1.0, **params: object) -> RewardFunctionConfig:
    return fn(f"{FIXTURES}:{function}", weight, **params)


def item(completion: str, answer: str | None = None, **fields: object) -> RewardInput:
    return RewardInput(completion, answer, **fields)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- math


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("\\boxed{1/2}", "0.5"),
        ("So the result is \\boxed{\\frac{1}{2}}.", "1/2"),
        ("The answer is 0.5", "\\frac{1}{2}"),
        ("$\\frac{3}{4}$", "0.75"),
        ("12 + 30 = 42", "42"),
        ("42", "42"),
        ("-7", "-7"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("The total is 1,000 apples", "1000"),
        ("\\boxed{x^2 + 1}", "1 + x^2"),
        ("we get \\(\\pi\\)", "\\pi"),
        ("First \\boxed{3}, then correcting: \\boxed{7}", "7"),
        ("\\boxed{\\frac{1}{2}}", "$0.5$"),
    ],
)
def test_math_accepts_equivalent_answers(completion: str, answer: str) -> None:
    assert math_reward(completion, answer=answer) == 1.0


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("\\boxed{1/3}", "0.5"),
        ("The answer is 41", "42"),
        ("garbage !!! no answer here", "3"),
        ("", "3"),
        ("\\boxed{7}, no wait, my final answer is \\boxed{3}", "7"),
        ("\\boxed{x^2 - 1}", "x^2 + 1"),
        ("\\boxed{unbalanced", "3"),
    ],
)
def test_math_rejects_wrong_or_missing_answers(completion: str, answer: str) -> None:
    assert math_reward(completion, answer=answer) == 0.0


def test_math_extracts_the_last_boxed_answer_first() -> None:
    assert [str(x) for x in extract_prediction("\\boxed{3} and later \\boxed{7}")][-1] == "7"
    assert extract_prediction("nothing numeric") == []


def test_math_needs_a_parseable_reference_answer() -> None:
    with pytest.raises(ValueError, match=r"data\.fields\.answer"):
        math_reward("\\boxed{1}", answer=None)
    with pytest.raises(ValueError, match="cannot parse the reference answer"):
        math_reward("\\boxed{1}", answer="no math in here")


@pytest.fixture(scope="module")
def math_manager():
    with RewardManager([fn("math")], timeout_s=5.0, workers=2) as rm:
        yield rm


def test_math_runs_in_the_pool(math_manager: RewardManager) -> None:
    items = [item(c, "0.5") for c in ["\\boxed{1/2}", "0.5", "1/3", "zzz", "$\\frac{1}{2}$"] * 10]
    result = math_manager.score(items)
    assert result.components["math"] == [1.0, 1.0, 0.0, 0.0, 1.0] * 10
    assert result.total == result.components["math"]
    assert (result.errors, result.timeouts) == (0, 0)
    assert len(math_manager.worker_pids) == 2


# ----------------------------------------------------------------------------- strings


def test_exact_match_normalises_whitespace_and_optionally_case_and_lines() -> None:
    assert exact_match("  Paris \n", answer="Paris") == 1.0
    assert exact_match("New   York", answer=" New York") == 1.0
    assert exact_match("paris", answer="Paris") == 0.0
    assert exact_match("paris", answer="Paris", ignore_case=True) == 1.0
    assert exact_match("Paris\nbecause it is the capital", answer="Paris") == 0.0
    assert exact_match("\nParis\nbecause it is the capital", answer="Paris", first_line=True) == 1.0
    with pytest.raises(ValueError, match="reference answer"):
        exact_match("Paris", answer=None)


def test_format_search_and_fullmatch() -> None:
    think = r"<think>.*</think>\s*<answer>.*</answer>"
    good = "<think>\nlet me see\n</think>\n<answer>4</answer>\n"
    assert format_reward(good, regex=think, mode="fullmatch") == 1.0
    assert format_reward("preamble " + good, regex=think, mode="fullmatch") == 0.0
    assert format_reward("preamble " + good, regex=think) == 1.0
    assert format_reward(good, regex=think, mode="fullmatch", dotall=False) == 0.0
    assert format_reward("no tags", regex=think) == 0.0


# ----------------------------------------------------------------------------- length


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (0, 0.0),
        (15, 0.0),  # L_max - cache: last length without penalty
        (16, -0.2),  # (20 - 5 - 16) / 5
        (18, -0.6),
        (20, -1.0),  # L_max: the ramp reaches -1
        (21, -1.0),  # beyond L_max
        (100, -1.0),
    ],
)
def test_overlong_matches_dapo_eq13(length: int, expected: float) -> None:
    value = overlong_penalty("", response_length=length, max_response_length=20, buffer_len=5)
    assert value == pytest.approx(expected)


def test_overlong_penalty_factor_and_default_buffer() -> None:
    assert overlong_penalty(
        "", response_length=18, max_response_length=20, buffer_len=5, penalty_factor=0.5
    ) == pytest.approx(-0.3)
    # default buffer: L_max // 5 = 4 -> no penalty up to 16, then -1/4 per token
    assert overlong_penalty("", response_length=16, max_response_length=20) == 0.0
    assert overlong_penalty("", response_length=17, max_response_length=20) == pytest.approx(-0.25)
    with pytest.raises(ValueError, match="max_response_length > 0"):
        overlong_penalty("", response_length=1, max_response_length=0)


def test_length_is_linear_in_the_budget_fraction() -> None:
    assert length_reward("", response_length=6, max_response_length=24) == pytest.approx(-0.25)
    assert length_reward("", response_length=24, max_response_length=24, coef=0.5) == pytest.approx(0.5)


# ----------------------------------------------------------------------------- task


def test_task_scores_with_the_builtin_task_verifier() -> None:
    from engine.data import get_task

    task = get_task("arithmetic")
    rng = random.Random(0)
    problems = [task.sample(rng, 2) for _ in range(6)]
    items = [
        item(p.answer if i % 2 == 0 else p.answer + "1", p.answer, prompt=p.prompt, metadata=p.metadata)
        for i, p in enumerate(problems)
    ]
    with RewardManager([fn("task")], timeout_s=1.0) as rm:
        assert rm.worker_pids == []  # task runs inline: no pool is started
        result = rm.score(items)
    assert result.components["task"] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert (result.errors, result.timeouts) == (0, 0)


def test_task_without_a_builtin_task_is_a_clear_error() -> None:
    with RewardManager([fn("task")], timeout_s=1.0) as rm:
        result = rm.score([item("4", "4", metadata={}), item("4", "4")])
    assert result.components["task"] == [0.0, 0.0]
    assert result.errors == 2
    assert result.error_messages == [
        "task: ValueError: the 'task' reward needs a built-in task; use math or exact_match for file datasets"
    ]


def test_default_reward_config_is_the_task_reward() -> None:
    with RewardManager.from_config(RewardConfig()) as rm:
        assert rm.component_names == ["task"]
        assert rm.timeout_s == 5.0


# ----------------------------------------------------------------------------- user functions


@pytest.fixture(scope="module")
def user_manager():
    functions = [
        user("contains_answer"),
        user("scaled_length", weight=0.0, scale=0.5),
        user("keyword_only"),
        user("echo_everything"),
    ]
    with RewardManager(functions, timeout_s=5.0, workers=1) as rm:
        yield rm


def test_user_functions_receive_what_their_signature_accepts(user_manager: RewardManager) -> None:
    items = [
        item("the answer is 4", "4", response_length=6, max_response_length=24, metadata={"tag": "x"}),
        item("no", "4", response_length=2, finish_reason="length", metadata={"tag": "x"}),
    ]
    result = user_manager.score(items)
    assert user_manager.component_names == [
        "contains_answer",
        "scaled_length",
        "keyword_only",
        "echo_everything",
    ]
    assert result.components == {
        "contains_answer": [1.0, 0.0],
        "scaled_length": [3.0, 1.0],
        "keyword_only": [1.0, 0.0],
        "echo_everything": [1.0, 1.0],
    }
    assert result.total == [3.0, 1.0]  # scaled_length has weight 0
    assert result.errors == 0


def test_get_reward_fn_imports_module_function() -> None:
    assert get_reward_fn(f"{FIXTURES}:contains_answer") is reward_fixtures.contains_answer
    assert get_reward_fn("math") is math_reward


# ----------------------------------------------------------------------------- combination


def test_weighted_total_components_and_metrics() -> None:
    functions = [
        fn("exact_match"),
        fn("format", 0.5, regex=r"\d+", mode="fullmatch"),
        fn("overlong", 2.0, buffer_len=4),
        fn("format", -1.0, regex="x"),
    ]
    items = [
        item("42", "42", response_length=2, max_response_length=10),
        item("41", "42", response_length=8, max_response_length=10),  # overlong: (6 - 8) / 4 = -0.5
        item("x y", "42", response_length=10, max_response_length=10),  # overlong: -1
    ]
    with RewardManager(functions, timeout_s=1.0) as rm:
        result = rm.score(items)
    assert list(result.components) == ["exact_match", "format", "overlong", "format_2"]
    assert result.components["exact_match"] == [1.0, 0.0, 0.0]
    assert result.components["format"] == [1.0, 1.0, 0.0]
    assert result.components["overlong"] == [0.0, -0.5, -1.0]
    assert result.components["format_2"] == [0.0, 0.0, 1.0]
    assert result.total == pytest.approx([1.5, -0.5, -3.0])
    assert result.metrics() == pytest.approx(
        {
            "reward/exact_match/mean": 1 / 3,
            "reward/format/mean": 2 / 3,
            "reward/overlong/mean": -0.5,
            "reward/format_2/mean": 1 / 3,
            "reward/errors": 0.0,
            "reward/timeouts": 0.0,
        }
    )


def test_empty_batch() -> None:
    with RewardManager([fn("exact_match"), user("contains_answer")], timeout_s=1.0) as rm:
        result = rm.score([])
    assert result == RewardResult(total=[], components={"exact_match": [], "contains_answer": []})
    assert result.metrics()["reward/exact_match/mean"] == 0.0


# ----------------------------------------------------------------------------- failures


def test_a_raising_function_scores_zero_and_is_counted() -> None:
    with RewardManager([user("raises"), fn("exact_match", 2.0)], timeout_s=1.0) as rm:
        result = rm.score([item("a", "a"), item("b", "a")])
        again = rm.score([item("a", "a")])
    assert result.components["raises"] == [0.0, 0.0]
    assert result.total == [2.0, 0.0]
    assert (result.errors, result.timeouts) == (2, 0)
    assert result.error_messages == ["raises: RuntimeError: boom from user code"]
    assert result.metrics()["reward/errors"] == 2.0
    assert again.total == [2.0] and again.errors == 1


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("returns_string", "returns_string: TypeError: returned str '1.0', expected a float"),
        ("returns_nan", "returns_nan: ValueError: returned a non-finite value (nan)"),
        ("returns_none", "returns_none: TypeError: returned NoneType None, expected a float"),
    ],
)
def test_a_non_numeric_return_is_an_error(function: str, message: str) -> None:
    with RewardManager([user(function)], timeout_s=1.0) as rm:
        result = rm.score([item("a")])
    assert result.components[function] == [0.0]
    assert result.errors == 1
    assert result.error_messages == [message]


def test_bool_returns_count_as_numbers() -> None:
    with RewardManager([user("returns_bool")], timeout_s=1.0) as rm:
        assert rm.score([item("yes"), item("no")]).total == [1.0, 0.0]


def test_a_hanging_call_times_out_and_the_run_goes_on() -> None:
    with RewardManager([user("hangs"), fn("exact_match")], timeout_s=0.5, workers=1) as rm:
        pids = rm.worker_pids
        result = rm.score([item("ok", "ok"), item("hang", "ok"), item("ok", "ok")])
        assert result.components["hangs"] == [1.0, 0.0, 1.0]
        assert result.components["exact_match"] == [1.0, 0.0, 1.0]
        assert (result.errors, result.timeouts) == (0, 1)
        assert result.error_messages == ["hangs: timed out after 0.5 s"]
        assert result.metrics()["reward/timeouts"] == 1.0
        later = rm.score([item("ok", "ok")] * 3)
        assert later.total == [2.0] * 3 and later.timeouts == 0
        assert rm.worker_pids == pids  # interrupted by the worker's own alarm: no restart needed


def test_a_timeout_is_not_swallowed_by_except_exception() -> None:
    with RewardManager([user("swallows_everything")], timeout_s=0.5) as rm:
        result = rm.score([item("a")])
    assert (result.timeouts, result.total) == (1, [0.0])


def test_a_hard_hang_kills_and_replaces_the_worker() -> None:
    with RewardManager([user("hangs_hard")], timeout_s=0.5, workers=1) as rm:
        before = rm.worker_pids
        completions = ["ok", "ok", "hang", "ok", "ok"]
        result = rm.score([item(c) for c in completions])
        assert result.components["hangs_hard"] == [1.0, 1.0, 0.0, 1.0, 1.0]  # the rest of the chunk re-ran
        assert (result.errors, result.timeouts) == (0, 1)
        assert result.error_messages == ["hangs_hard: timed out after 0.5 s"]
        after = rm.worker_pids
        assert after != before
        later = rm.score([item("ok")] * 4)
        assert later.total == [1.0] * 4 and later.timeouts == 0
        assert rm.worker_pids == after


def test_a_crashing_worker_is_an_error_and_is_replaced() -> None:
    with RewardManager([user("crashes"), user("worker_pid", weight=0.0)], timeout_s=1.0, workers=1) as rm:
        before = rm.worker_pids
        result = rm.score([item("ok"), item("crash"), item("ok")])
        assert result.components["crashes"] == [1.0, 0.0, 1.0]
        assert result.errors == 1
        assert result.error_messages == ["crashes: reward worker process died (exit code 3)"]
        assert rm.worker_pids != before
        assert result.components["worker_pid"][0] == before[0]
        assert result.components["worker_pid"][2] == rm.worker_pids[0]
        assert rm.score([item("ok")]).total == [1.0]


def test_a_closed_pool_refuses_work() -> None:
    rm = RewardManager([user("contains_answer")], timeout_s=1.0)
    rm.close()
    rm.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        rm.score([item("a", "a")])


# ----------------------------------------------------------------------------- configuration errors


def test_unknown_names_list_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="unknown reward function 'maths'; did you mean 'math'") as exc:
        get_reward_fn("maths")
    for name in ("exact_match", "format", "length", "math", "overlong", "task"):
        assert name in str(exc.value)
    assert set(registered_rewards()) >= {"exact_match", "format", "length", "math", "overlong", "task"}
    with pytest.raises(ValueError, match=r"^reward.functions\[1\].name: unknown reward function 'nope'"):
        RewardManager([fn("task"), fn("nope")], timeout_s=1.0)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'.*PYTHONPATH"),
        (f"{FIXTURES}:missing", f"'{FIXTURES}' has no attribute 'missing'; define missing"),
        (f"{FIXTURES}:contains_answr", "did you mean 'contains_answer'"),
        (f"{FIXTURES}:NOT_CALLABLE", "is a int, not a function"),
        ("bad name:f", "not of the form 'package.module:function'"),
    ],
)
def test_user_function_import_errors_say_what_to_fix(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_reward_fn(name)
    with pytest.raises(ValueError, match=r"^reward.functions\[0\].name: "):
        RewardManager([fn(name)], timeout_s=1.0)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (fn("format", regexp="x"), r"params.regexp: unknown parameter; did you mean 'regex'\?"),
        (fn("format"), r"params.regex: required by 'format'"),
        (fn("format", regex="("), r"params.regex: not a valid regular expression"),
        (fn("format", regex="x", mode="match"), r"params.mode: must be one of search, fullmatch"),
        (fn("exact_match", ignore_case="yes"), r"params.ignore_case: must be true or false"),
        (fn("overlong", buffer_len=0), r"params.buffer_len: must be a whole number of tokens >= 1"),
        (fn("overlong", penalty_factor="big"), r"params.penalty_factor: must be a finite number"),
        (fn("length", coef=float("nan")), r"params.coef: must be a finite number"),
        (fn("math", strict=True), r"params.strict: unknown parameter; 'math' takes no parameters"),
        (fn("task", answer="4"), r"params.answer: 'answer' is supplied by the engine"),
        (user("contains_answer", scale=2), r"params.scale: unknown parameter; 'tests.*' takes no parameters"),
        (user("scaled_length"), r"params.scale: required by"),
        (user("scaled_length", scael=1.0), r"params.scael: unknown parameter; did you mean 'scale'\?"),
    ],
)
def test_bad_params_name_the_config_field(config: RewardFunctionConfig, message: str) -> None:
    with pytest.raises(ValueError, match=r"^reward.functions\[1\]." + message):
        RewardManager([fn("task"), config], timeout_s=1.0)


def test_bad_weight_timeout_and_workers() -> None:
    with pytest.raises(ValueError, match=r"reward.functions\[0\].weight: must be a finite number"):
        RewardManager([fn("task", weight=math.inf)], timeout_s=1.0)
    with pytest.raises(ValueError, match=r"reward\.timeout_s"):
        RewardManager([fn("task")], timeout_s=0)
    with pytest.raises(ValueError, match=r"reward\.workers"):
        RewardManager([fn("task")], timeout_s=1.0, workers=0)
    with pytest.raises(ValueError, match="at least one"):
        RewardManager([], timeout_s=1.0)


def test_register_reward_refuses_a_second_function_under_a_taken_name() -> None:
    with pytest.raises(ValueError, match="already registered"):

        @register_reward("math")
        def other(completion: str, **_: object) -> float:
            return 0.0


def test_unpicklable_items_are_errors_not_crashes() -> None:
    items = [item("a", "a"), item("a", "a", metadata={"f": lambda: None}), item("b", "a")]
    with RewardManager([user("contains_answer"), fn("exact_match")], timeout_s=1.0) as rm:
        result = rm.score(items)
    assert result.components["contains_answer"] == [1.0, 0.0, 0.0]
    assert result.components["exact_match"] == [1.0, 1.0, 0.0]
    assert result.errors == 1
    assert result.error_messages[0].startswith("contains_answer: cannot send the item to a reward worker")


def test_a_function_the_worker_cannot_load_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Defined at run time in the parent only: the worker's fresh import does not have it.
    monkeypatch.setattr(reward_fixtures, "made_at_runtime", lambda completion: 1.0, raising=False)
    with RewardManager([user("made_at_runtime"), fn("exact_match")], timeout_s=1.0) as rm:
        result = rm.score([item("a", "a")] * 2)
    assert result.components == {"made_at_runtime": [0.0, 0.0], "exact_match": [1.0, 1.0]}
    assert result.errors == 2
    assert "cannot load" in result.error_messages[0] and "made_at_runtime" in result.error_messages[0]


def test_workers_that_die_while_starting_turn_calls_into_errors() -> None:
    with RewardManager([user("dies_on_load"), fn("exact_match")], timeout_s=1.0, workers=1) as rm:
        result = rm.score([item("a", "a")] * 3)
    assert result.components == {"dies_on_load": [0.0] * 3, "exact_match": [1.0] * 3}
    assert result.errors == 3
    assert result.error_messages == ["dies_on_load: reward worker processes die while starting (see stderr)"]


def test_validation_without_importing_user_code() -> None:
    validate_reward_functions([fn("task"), fn("not_imported.anywhere:f")], import_user=False)
    with pytest.raises(ValueError, match=r"reward.functions\[1\].name: .*not of the form"):
        validate_reward_functions([fn("task"), fn("no colon here:")], import_user=False)
    with pytest.raises(ValueError, match=r"reward.functions\[0\].params.regex: required"):
        validate_reward_functions([fn("format")], import_user=False)
    with pytest.raises(ValueError, match=r"reward.functions\[0\].name: .*cannot import module"):
        validate_reward_functions([fn("not_imported.anywhere:f")])
