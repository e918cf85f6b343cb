"""Config validation, presets, overrides and the CLI's validate/schema commands."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.config import (
    PRESETS,
    ConfigError,
    RunConfig,
    apply_overrides,
    build_config,
    json_schema,
    load_config,
)


def problems_of(data: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        build_config(data)
    return dict(info.value.problems)


def test_defaults_validate() -> None:
    cfg = RunConfig()
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.rollout.n >= 2


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_validates(name: str) -> None:
    cfg = load_config(name)
    assert cfg.preset == name
    for key, value in PRESETS[name]["algorithm"].items():
        got = getattr(cfg.algorithm, key)
        if hasattr(got, "model_dump"):  # a section: the fields the preset sets (the rest keep defaults)
            got = {k: v for k, v in got.model_dump().items() if k in value}
        assert got == value


def test_dapo_preset_has_its_four_techniques() -> None:
    cfg = load_config("dapo")
    assert cfg.algorithm.clip_ratio_high > cfg.algorithm.clip_ratio_low  # clip-higher
    assert cfg.algorithm.filter_groups.enable  # dynamic sampling
    assert cfg.algorithm.loss_agg_mode == "token-mean"
    assert "overlong" in [f.name for f in cfg.reward.functions]  # overlong shaping


def test_every_bad_field_is_listed_with_its_path() -> None:
    problems = problems_of(
        {
            "rollout": {"n": 0, "temperature": -1},
            "algorithm": {"clip_ratio_hgh": 0.3, "loss_agg_mode": "mean", "adv_estimator": "nope"},
            "optimizer": {"lr": "fast"},
        }
    )
    assert set(problems) == {
        "rollout.n",
        "rollout.temperature",
        "algorithm.clip_ratio_hgh",
        "algorithm.loss_agg_mode",
        "algorithm.adv_estimator",
        "optimizer.lr",
    }
    assert "did you mean 'clip_ratio_high'" in problems["algorithm.clip_ratio_hgh"]
    assert "grpo" in problems["algorithm.adv_estimator"]  # lists the known estimators
    assert "greater than or equal to 1" in problems["rollout.n"] and "got 0" in problems["rollout.n"]
    assert "token-mean" in problems["algorithm.loss_agg_mode"]


def test_cross_field_errors_name_the_fields() -> None:
    problems = problems_of({"trainer": {"prompts_per_step": 32, "ppo_mini_batch_size": 5}})
    assert "must divide" in problems["trainer.ppo_mini_batch_size"]
    assert "required" in problems_of({"data": {"source": "jsonl"}})["data.path"]
    problems = problems_of({"reward": {"functions": [{"name": "task"}, {"name": "format", "params": {"regexp": "x"}}]}})
    assert "did you mean 'regex'" in problems["reward.functions[1].params.regexp"]
    problems = problems_of({"data": {"source": "jsonl", "path": "x.jsonl"}, "model": {"path": "m"}})
    assert "use math, exact_match" in problems["reward.functions"]


def test_unknown_preset_and_override_syntax() -> None:
    with pytest.raises(ConfigError, match="unknown preset 'gpro'"):
        build_config({"preset": "gpro"})
    with pytest.raises(ConfigError, match="file not found"):
        load_config("no-such-file.yaml")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        apply_overrides({}, ["trainer.total_steps"])


def test_overrides_parse_yaml_values_and_nest() -> None:
    data = apply_overrides({"trainer": {"seed": 1}}, ["trainer.total_steps=20", 'rollout.stop=["\\n"]', "model.path=x"])
    assert data == {"trainer": {"seed": 1, "total_steps": 20}, "rollout": {"stop": ["\n"]}, "model": {"path": "x"}}


def test_yaml_and_json_files_with_preset_and_overrides(tmp_path) -> None:
    y = tmp_path / "run.yaml"
    y.write_text("preset: dr_grpo\nname: mine\ntrainer:\n  total_steps: 7\n")
    cfg = load_config(str(y), ["rollout.n=4"])
    assert (cfg.name, cfg.trainer.total_steps, cfg.rollout.n) == ("mine", 7, 4)
    assert cfg.algorithm.norm_adv_by_std_in_grpo is False
    j = tmp_path / "run.json"
    j.write_text(json.dumps({"algorithm": {"policy_loss": "gspo"}}))
    assert load_config(str(j)).algorithm.policy_loss == "gspo"
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


def test_schema_has_titles_descriptions_and_bounds() -> None:
    schema = json_schema()
    rollout = schema["$defs"]["RolloutConfig"]["properties"]
    assert rollout["n"]["title"] == "Group size" and rollout["n"]["minimum"] == 1
    assert rollout["temperature"]["description"]
    assert set(schema["x-presets"]) == set(PRESETS)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=120)


def test_cli_validate_exits_nonzero_listing_fields(tmp_path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("rollout:\n  n: 0\noptimizer:\n  lr: -1\n")
    out = run_cli("validate", str(f))
    assert out.returncode == 2
    assert "rollout.n" in out.stderr and "optimizer.lr" in out.stderr
    assert "Traceback" not in out.stderr
    ok = run_cli("validate", "dapo", "--set", "trainer.total_steps=3")
    assert ok.returncode == 0, ok.stderr


def test_cli_schema_is_json() -> None:
    out = run_cli("schema")
    assert out.returncode == 0
    assert json.loads(out.stdout)["title"] == "Tributary run"
