"""engine.contracts names what the config accepts and what the parts exchange; these tests keep
those names equal to what the engine really implements and writes."""

from __future__ import annotations

import json

import pytest
import torch

from engine import algorithms, contracts
from engine.algorithms import aggregation, kl
from engine.config import ConfigError, build_config
from tributary.events import EventSink


def test_advantage_estimators_are_the_registry() -> None:
    # Registering an estimator without naming it in contracts.ADV_ESTIMATORS (or the reverse) fails here.
    assert sorted(contracts.ADV_ESTIMATORS) == sorted(algorithms.ADV_ESTIMATOR_REGISTRY)


def test_policy_losses_are_the_registry() -> None:
    assert sorted(contracts.POLICY_LOSSES) == sorted(algorithms.POLICY_LOSS_REGISTRY)


def test_loss_aggregation_modes_are_the_implemented_ones_but_token_sum() -> None:
    # token-sum is verl's and implemented, but a loss that grows with the batch size is not offered.
    assert set(contracts.LOSS_AGG_MODES) == set(aggregation.LOSS_AGG_MODES) - {"token-sum"}
    loss, mask = torch.ones(2, 3), torch.ones(2, 3)
    for mode in contracts.LOSS_AGG_MODES:
        assert torch.isfinite(algorithms.agg_loss(loss, mask, mode))


def test_every_kl_estimator_name_computes_and_no_other_does() -> None:
    logprob, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    for name in contracts.KL_ESTIMATORS:
        assert torch.isfinite(kl.kl_penalty(logprob, ref, name)).all()
        assert torch.isfinite(kl.kl_penalty(logprob, ref, name + "+")).all()
    with pytest.raises(ValueError, match="unknown kl_penalty"):
        kl.kl_penalty(logprob, ref, "k4")


def test_every_kl_controller_type_builds() -> None:
    for kind in contracts.KL_CONTROLLER_TYPES:
        cfg = build_config({"algorithm": {"kl_ctrl": {"type": kind}}}).algorithm.kl_ctrl
        assert algorithms.get_kl_controller(cfg).value == cfg.kl_coef


@pytest.mark.parametrize(
    ("field", "names"),
    [
        ("adv_estimator", contracts.ADV_ESTIMATORS),
        ("policy_loss", contracts.POLICY_LOSSES),
        ("loss_agg_mode", contracts.LOSS_AGG_MODES),
        ("kl_loss_type", contracts.KL_ESTIMATORS),
    ],
)
def test_the_config_accepts_exactly_the_contract_names(field: str, names: tuple[str, ...]) -> None:
    for name in names:
        assert getattr(build_config({"algorithm": {field: name}}).algorithm, field) == name
    with pytest.raises(ConfigError) as info:
        build_config({"algorithm": {field: "no-such-name"}})
    assert [path for path, _ in info.value.problems] == [f"algorithm.{field}"]


def test_the_sink_writes_each_type_with_its_contract_fields(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    sink = EventSink("r1", path)
    sink.status("running", "go")
    sink.metrics(1, {"reward/mean": 0.5})
    sink.samples(1, [dict.fromkeys(contracts.SAMPLE_FIELDS)])
    sink.checkpoint(1, "ckpt", 10)
    sink.log("info", "hello")
    sink.heartbeat()
    sink.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["type"] for e in events] == list(contracts.EVENT_TYPES)
    for event in events:
        assert tuple(event) == contracts.EVENT_ENVELOPE + contracts.EVENT_FIELDS[event["type"]]


def test_states_and_exit_codes_agree() -> None:
    assert set(contracts.ENGINE_STATES) <= set(contracts.RUN_STATES)
    assert contracts.ENGINE_FINAL_STATES <= contracts.FINAL_STATES
    assert set(contracts.RUN_STATES) == contracts.ACTIVE_STATES | contracts.FINAL_STATES
    assert set(contracts.EXIT_STATES.values()) <= contracts.ENGINE_FINAL_STATES
    assert set(contracts.EXIT_STATES) == set(contracts.EXIT_NAMES)


def test_page_contracts_are_json_with_plain_keys() -> None:
    page = json.loads(json.dumps(contracts.page_contracts()))
    assert page["close_codes"]["not_found"] == contracts.CLOSE_NOT_FOUND
    assert page["close_codes"]["revoked"] == contracts.CLOSE_REVOKED
    assert set(page["browser_fatal_close_codes"]) == contracts.BROWSER_FATAL_CLOSE_CODES
    assert page["run_states"] == list(contracts.RUN_STATES)
    assert set(page["terminal_states"]) == contracts.FINAL_STATES
    assert set(page["active_states"]) == contracts.ACTIVE_STATES
    assert page["event_types"] == list(contracts.EVENT_TYPES)
