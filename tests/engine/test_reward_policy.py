"""Which reward functions a run may name (engine/rewards/policy.py) and what a scoring process
may do (engine/rewards/sandbox.py)."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, RewardFunctionConfig, build_config
from engine.rewards import RewardInput, RewardManager, get_reward_fn
from engine.rewards.policy import RewardPolicy, parse_modules
from engine.rewards.sandbox import WorkerLimits
from tests.engine import reward_fixtures

FIXTURES = reward_fixtures.__name__
DENY = RewardPolicy(allow_any=False)

# The reproduction from the hardening issue: timeit runs its 'setup' string.
TIMEIT = {"name": "timeit:timeit", "params": {"setup": "import os; os.system('id')", "number": 1}}


def _config(*functions: dict) -> dict:
    return {"preset": "grpo", "reward": {"functions": list(functions)}}


def test_the_timeit_reproduction_is_refused_naming_the_field_and_the_fix() -> None:
    with pytest.raises(ConfigError) as caught:
        build_config(_config(TIMEIT), reward_policy=DENY)
    ((path, message),) = caught.value.problems
    assert path == "reward.functions[0].name"
    assert "'timeit:timeit' is not a registered reward function" in message
    assert "TRIBUTARY_REWARD_MODULES" in message


def test_built_ins_are_always_allowed() -> None:
    cfg = build_config(_config({"name": "math"}, {"name": "overlong"}), reward_policy=DENY)
    assert [f.name for f in cfg.reward.functions] == ["math", "overlong"]


def test_the_deployments_modules_may_be_named_but_not_their_private_names() -> None:
    policy = RewardPolicy(modules=frozenset({FIXTURES}), allow_any=False)
    build_config(_config({"name": f"{FIXTURES}:contains_answer"}), reward_policy=policy)
    with pytest.raises(ConfigError, match="is private"):
        build_config(_config({"name": f"{FIXTURES}:_hidden"}), reward_policy=policy)
    with pytest.raises(ConfigError, match="not a registered reward function"):
        build_config(_config({"name": f"{FIXTURES}.other:fn"}), reward_policy=policy)  # not a submodule grant


def test_a_name_the_listed_module_only_imported_is_refused_when_loaded() -> None:
    # reward_fixtures does `import os`: os.getcwd is reachable through it but not defined there.
    policy = RewardPolicy(modules=frozenset({FIXTURES}), allow_any=False)
    with pytest.raises(ValueError, match=r"defined in (posix|os), not in tests\.engine\.reward_fixtures"):
        get_reward_fn(f"{FIXTURES}:os.getcwd", policy)
    assert get_reward_fn(f"{FIXTURES}:contains_answer", policy) is reward_fixtures.contains_answer


def test_a_refused_module_is_never_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.delitem(sys.modules, "tests.engine.never_imported", raising=False)
    with pytest.raises(ValueError, match="not a registered reward function"):
        get_reward_fn("tests.engine.never_imported:fn", DENY)
    assert "tests.engine.never_imported" not in sys.modules


def test_the_environment_gives_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRIBUTARY_USER_REWARDS", raising=False)
    monkeypatch.delenv("TRIBUTARY_REWARD_MODULES", raising=False)
    assert RewardPolicy.from_env() == RewardPolicy()  # the CLI: the user's own machine, own code
    build_config(_config(TIMEIT))
    monkeypatch.setenv("TRIBUTARY_USER_REWARDS", "deny")
    monkeypatch.setenv("TRIBUTARY_REWARD_MODULES", f" {FIXTURES} , mypkg.rewards ")
    policy = RewardPolicy.from_env()
    assert policy == RewardPolicy(modules=frozenset({FIXTURES, "mypkg.rewards"}), allow_any=False)
    assert RewardPolicy.from_env(policy.as_env()) == policy
    with pytest.raises(ConfigError, match=r"this deployment's reward modules are mypkg\.rewards, tests"):
        build_config(_config(TIMEIT))
    with pytest.raises(ValueError, match="deny"):
        RewardPolicy.from_env({"TRIBUTARY_USER_REWARDS": "sometimes"})
    with pytest.raises(ValueError, match="not a module name"):
        parse_modules("good.name, bad-name")


def test_the_manager_checks_the_policy_before_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIBUTARY_USER_REWARDS", "deny")
    monkeypatch.delenv("TRIBUTARY_REWARD_MODULES", raising=False)
    with pytest.raises(ValueError, match=r"reward\.functions\[0\]\.name: 'timeit:timeit'"):
        RewardManager([RewardFunctionConfig(**TIMEIT)])


def test_a_scoring_process_cannot_fork_exec_or_write_but_can_use_threads(tmp_path, monkeypatch) -> None:
    """Bits of sandbox_probe's score: what it managed (fork 1, exec 2, write 4, thread 8, memory
    16, $TMPDIR 32). Without limits it manages everything, which shows the probe can see them."""
    outside = str(tmp_path / "written-by-a-reward")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # as the supervisor sets it: the run's own tmp
    limits = WorkerLimits(memory_mb=1024)
    with RewardManager([RewardFunctionConfig(name=f"{FIXTURES}:sandbox_probe")], timeout_s=60, limits=limits) as m:
        result = m.score([RewardInput(completion=outside, answer=None, prompt="")])
    assert result.errors == 0, result.error_messages
    assert int(result.total[0]) == 8 | 32
    assert not (tmp_path / "written-by-a-reward").exists()
    assert int(reward_fixtures.sandbox_probe(outside)) == 1 | 2 | 4 | 8 | 16 | 32


def test_a_process_past_its_cpu_time_is_replaced_and_the_call_is_an_error() -> None:
    functions = [RewardFunctionConfig(name=f"{FIXTURES}:burns_cpu"), RewardFunctionConfig(name=f"{FIXTURES}:contains_answer")]
    # The wall-clock timeout is far above the CPU limit: only the kernel's limit can end the call.
    with RewardManager(functions, timeout_s=300, limits=WorkerLimits(cpu_s=2)) as m:
        result = m.score([RewardInput(completion="42", answer="42", prompt="")])
        assert result.components["burns_cpu"] == [0.0] and result.errors == 1
        assert "died" in result.error_messages[0]
        # the replacement scores the next call
        again = m.score([RewardInput(completion="42", answer="42", prompt="")])
        assert again.components["contains_answer"] == [1.0]


def test_a_config_names_own_code_only_outside_the_registry_and_the_modules() -> None:
    policy = RewardPolicy(modules=frozenset({FIXTURES}))  # allow_any does not matter here
    assert not policy.names_own_code(["math", f"{FIXTURES}:contains_answer"])
    assert policy.names_own_code(["math", "timeit:timeit"])
    assert policy.names_own_code([f"{FIXTURES}:_hidden"])  # refused anyway unless own code is allowed
    assert RewardPolicy.of_deployment(allow_any=True, environ={"TRIBUTARY_REWARD_MODULES": FIXTURES}) == RewardPolicy(
        modules=frozenset({FIXTURES}), allow_any=True
    )
