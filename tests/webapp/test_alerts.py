"""Health alerts: each rule on a recorded run (silent on the healthy one, firing on its own case),
the rules' state through ingest, the settings' validation, and the webhook's address checks.

The recorded run is a real engine run (``recorded/dapo_async_k2.metrics.jsonl``: DAPO from the
starter policy, asynchronous with ``async.max_staleness=2``, 60 steps, eval every 10, on a
2-core CPU; its metrics events only). Each failure case is that run with one series changed the
way the failure changes it, so a rule is shown to fire on its cause and on nothing else.
"""

from __future__ import annotations

import copy
import json
import queue
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.webapp.event_builders import metrics
from webapp.alerts import webhooks
from webapp.alerts.models import Alert, ProjectAlertSettings
from webapp.alerts.rules import RULES, Observation, SettingsError, effective, evaluate, validate_settings
from webapp.runs.ingest import store_events
from webapp.runs.models import Run

RECORDED = Path(__file__).parent / "recorded" / "dapo_async_k2.metrics.jsonl"
BOUND = {"max_staleness": 2, "eval_size": 128}  # the recorded run's settings


def as_recorded() -> list[dict[str, Any]]:
    return [json.loads(line) for line in RECORDED.read_text().splitlines() if line.strip()]


def recorded_events() -> list[dict[str, Any]]:
    """The recording with its throughput made steady at its early median: the machine it was
    recorded on was loaded by other jobs from step 16 on, which the throughput rule rightly
    reports (``test_the_recorded_load_is_reported_as_a_throughput_drop``); every other case
    starts from a run without that drop."""
    events = as_recorded()
    for e in events:
        if "perf/throughput" in e["values"]:
            e["values"]["perf/throughput"] = 4591.0  # the median of steps 3-7, the rule's own baseline
    return events


def observations(events: list[dict[str, Any]]) -> list[Observation]:
    return [
        Observation(
            e["step"],
            e["seq"],
            {k: v for k, v in e["values"].items() if v is not None},
            tuple(k for k, v in e["values"].items() if v is None),
        )
        for e in events
    ]


def fired(events: list[dict[str, Any]], settings: dict | None = None, run: dict | None = None) -> list[tuple]:
    found = evaluate({}, observations(events), effective(settings or {}), run or BOUND)
    return [(f.rule, f.step) for f in found]


def changed(
    at: Callable[[int], bool], add: bool = False, **series: Callable[[float | None], float | None]
) -> list[dict[str, Any]]:
    """The recorded run with ``series[name](value)`` applied at the training steps where ``at(step)``
    (to the events that carry the metric, or with ``add`` to every training step's event)."""
    events = copy.deepcopy(recorded_events())
    for e in events:
        if at(e["step"]) and "actor/entropy" in e["values"]:
            for name, change in series.items():
                if name in e["values"] or add:
                    e["values"][name] = change(e["values"].get(name))
    return events


# --------------------------------------------------------------------------- the rules


def test_the_recording_is_the_run_it_claims_to_be() -> None:
    events = as_recorded()
    steps = [e["step"] for e in events]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == 60
    train = [e for e in events if "actor/entropy" in e["values"]]
    assert len(train) == 60 and all("async/staleness_max" in e["values"] for e in train)
    assert [e["step"] for e in events if "eval/accuracy" in e["values"]] == list(range(0, 61, 10))


def test_a_healthy_run_raises_nothing() -> None:
    assert fired(recorded_events()) == []


def test_the_recorded_load_is_reported_as_a_throughput_drop() -> None:
    """The recording ran while other jobs came and went on the 2 cores: throughput fell under half
    its early median (4,591 tokens/s) three steps in a row four times (from steps 20, 30, 46 and
    54; as low as 170 tokens/s). That is the rule's "slow node" case, one alert per episode;
    nothing else fires on the run as recorded."""
    assert fired(as_recorded()) == [
        ("throughput_drop", 22),
        ("throughput_drop", 32),
        ("throughput_drop", 48),
        ("throughput_drop", 56),
    ]


def test_entropy_collapse_fires_once_when_entropy_falls_under_a_tenth_of_its_early_value() -> None:
    events = changed(lambda s: s >= 30, **{"actor/entropy": lambda v: v * 0.05})
    assert fired(events) == [("entropy_collapse", 30)]
    # At 20% of the early value it is low, not collapsed; a project may set a stricter line.
    events = changed(lambda s: s >= 30, **{"actor/entropy": lambda v: v * 0.2})
    assert fired(events) == []
    assert fired(events, {"entropy_collapse": {"fraction": 0.3}}) == [("entropy_collapse", 30)]


def test_reward_up_eval_down_fires_when_accuracy_falls_significantly_while_the_reward_rises() -> None:
    events = recorded_events()
    best = max(e["values"]["eval/accuracy"] for e in events if "eval/accuracy" in e["values"] and e["step"] <= 30)

    def run_with(fall: float, reward_shift: float) -> list[dict[str, Any]]:
        out = changed(lambda s: s >= 40, **{"eval/accuracy": lambda v: best - fall})
        for e in out:
            if e["step"] >= 31 and "reward/mean" in e["values"]:
                e["values"]["reward/mean"] += reward_shift
        return out

    assert fired(run_with(0.2, +0.5)) == [("reward_up_eval_down", 40)]
    # A fall of 0.1 over 128 prompts is 1.6 standard errors: sampling noise. Over 1,000 prompts
    # even the recorded fall from 0.586 (step 10) to 0.523 (step 30) would be 2.8: real.
    assert fired(run_with(0.1, +0.5)) == []
    assert fired(run_with(0.1, +0.5), run={**BOUND, "eval_size": 1000}) == [("reward_up_eval_down", 30)]
    # The same fall with the training reward falling too is a bad run, not a hacked reward.
    assert fired(run_with(0.2, -0.5)) == []


def test_mismatch_fires_on_each_excursion_over_the_line() -> None:
    events = changed(lambda s: True, add=True, **{"rollout/mismatch_kl": lambda v: 0.002})
    assert fired(events) == []
    events = changed(lambda s: 20 <= s <= 22 or s == 40, add=True, **{"rollout/mismatch_kl": lambda v: 0.2})
    assert fired(events) == [("mismatch_kl", 20), ("mismatch_kl", 40)]


def test_staleness_fires_over_the_runs_own_bound_only() -> None:
    events = changed(lambda s: s == 15, **{"async/staleness_max": lambda v: 3.0})
    assert fired(events) == [("staleness", 15)]
    assert fired(events, run={"max_staleness": 3}) == []


def test_a_nan_loss_fires_and_a_finite_one_clears_it() -> None:
    events = changed(lambda s: s in (25, 26, 50), **{"actor/pg_loss": lambda v: None})
    assert fired(events) == [("non_finite", 25), ("non_finite", 50)]


def test_only_a_name_holding_a_watched_word_clears_a_nan_alert() -> None:
    """``NonFinite`` searches the names joined (issue 19): a watched word split across two names
    ("lo", "ss") is in no name, so that step says nothing and the alert stays raised."""
    nan = [Observation(1, 1, {}, ("actor/pg_loss",))]
    split = [Observation(2, 2, {"lo": 1.0, "ss": 2.0, "grad_": 3.0, "norm": 4.0}, ())]
    named = [Observation(3, 3, {"eval/acc": 0.5, "train/grad_norm": 1.0}, ())]
    params = effective()
    state: dict = {}
    assert [f.step for f in evaluate(state, nan + split, params, BOUND)] == [1]
    assert state["non_finite"] == {"active": True}
    evaluate(state, named, params, BOUND)
    assert state["non_finite"] == {"active": False}
    assert [f.step for f in evaluate(state, nan, params, BOUND)] == [1]  # fires again once cleared


def test_groups_without_signal_fire_after_five_steps_in_a_row() -> None:
    events = changed(lambda s: 10 <= s <= 20, frac_reward_zero_std=lambda v: 1.0)
    assert fired(events) == [("zero_std_groups", 14)]
    events = changed(lambda s: 10 <= s <= 13, frac_reward_zero_std=lambda v: 1.0)
    assert fired(events) == []


def test_a_throughput_drop_fires_after_three_slow_steps() -> None:
    events = changed(lambda s: s >= 40, **{"perf/throughput": lambda v: v * 0.3})
    assert fired(events) == [("throughput_drop", 42)]


def test_a_disabled_rule_stays_silent() -> None:
    events = changed(lambda s: s == 15, **{"async/staleness_max": lambda v: 3.0})
    assert fired(events, {"staleness": {"enabled": False}}) == []


def test_the_rules_give_the_same_answer_batch_by_batch_as_all_at_once() -> None:
    events = changed(lambda s: s >= 30, **{"actor/entropy": lambda v: v * 0.05, "perf/throughput": lambda v: v * 0.3})
    params = effective()
    whole_state: dict = {}
    whole = evaluate(whole_state, observations(events), params, BOUND)
    piece_state: dict = {}
    pieces = []
    for e in events:
        piece_state = json.loads(json.dumps(piece_state))  # as stored between batches
        pieces += evaluate(piece_state, observations([e]), params, BOUND)
    assert pieces == whole and piece_state == whole_state and len(whole) == 2


@pytest.mark.parametrize(
    ("settings", "field", "says"),
    [
        ([], "alerts", "must be an object"),
        ({"entropy": {}}, "alerts.entropy", "no such rule"),
        ({"entropy_collapse": {"fraction": 2}}, "alerts.entropy_collapse.fraction", "between 0 and 1"),
        ({"entropy_collapse": {"fraction": "0.1"}}, "alerts.entropy_collapse.fraction", "must be a number"),
        ({"entropy_collapse": {"fraction": float("nan")}}, "alerts.entropy_collapse.fraction", "must be a number"),
        ({"zero_std_groups": {"patience": 2.5}}, "alerts.zero_std_groups.patience", "whole number"),
        ({"staleness": {"enabled": "no"}}, "alerts.staleness.enabled", "true or false"),
        ({"staleness": {"threshold": 1}}, "alerts.staleness.threshold", "staleness takes enabled"),
    ],
)
def test_settings_are_checked_and_name_the_field(settings: Any, field: str, says: str) -> None:
    with pytest.raises(SettingsError) as caught:
        validate_settings(settings)
    assert caught.value.field == field and says in str(caught.value)


def test_valid_settings_are_normalised() -> None:
    assert validate_settings({"zero_std_groups": {"patience": 3.0, "enabled": False}}) == {
        "zero_std_groups": {"patience": 3, "enabled": False}
    }
    assert set(effective()) == set(RULES)


# --------------------------------------------------------------------------- at ingest


def nan_loss_run(first_seq: int = 1) -> list[dict[str, Any]]:
    return [
        metrics(first_seq, 1, **{"actor/pg_loss": 0.1, "actor/entropy": 0.5}),
        metrics(first_seq + 1, 2, **{"actor/pg_loss": None, "actor/entropy": 0.5}),
        metrics(first_seq + 2, 3, **{"actor/pg_loss": None, "actor/entropy": 0.5}),
    ]


def test_ingest_stores_an_alert_once_and_keeps_the_rules_state(run: Run, django_capture_on_commit_callbacks) -> None:
    events = nan_loss_run()
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        store_events(run.pk, events[:2])
        store_events(run.pk, events)  # sent again (a reconnect) and one more: nothing fires twice
    alerts = list(Alert.objects.filter(run=run))
    assert [(a.rule, a.step, a.seq, a.metric) for a in alerts] == [("non_finite", 2, 2, "actor/pg_loss")]
    assert "actor/pg_loss is NaN or infinite" in alerts[0].message
    run.refresh_from_db()
    assert run.alert_state["non_finite"] == {"active": True}
    assert len(callbacks) >= 1


def test_a_projects_settings_and_a_runs_overrides_apply_at_ingest(run: Run) -> None:
    ProjectAlertSettings.objects.create(project=run.project, rules={"non_finite": {"enabled": False}})
    store_events(run.pk, nan_loss_run()[:2])
    assert not Alert.objects.filter(run=run).exists()
    Run.objects.filter(pk=run.pk).update(alert_overrides={"non_finite": {"enabled": True}})
    store_events(run.pk, nan_loss_run(3)[:2])
    assert list(Alert.objects.filter(run=run).values_list("rule", "step")) == [("non_finite", 2)]


def test_the_null_loss_still_leaves_no_point_to_plot(run: Run) -> None:
    store_events(run.pk, nan_loss_run())
    assert sorted(run.metric_points.filter(name="actor/pg_loss").values_list("step", flat=True)) == [1]


# --------------------------------------------------------------------------- the webhook


class Receiver(BaseHTTPRequestHandler):
    got: queue.Queue

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.got.put((self.path, self.headers["Content-Type"], json.loads(body)))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[tuple[str, queue.Queue]]:
    got: queue.Queue = queue.Queue()
    handler = type("Handler", (Receiver,), {"got": got})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/hooks/t0k3n?x=1", got
    server.shutdown()
    server.server_close()


def test_the_webhook_receives_each_alert_once_the_batch_commits(
    run: Run, receiver, settings, django_capture_on_commit_callbacks
) -> None:
    settings.TRIBUTARY_WEBHOOKS_ALLOW_PRIVATE = True
    url, got = receiver
    ProjectAlertSettings.objects.create(project=run.project, webhook_url=url)
    with django_capture_on_commit_callbacks(execute=True):
        store_events(run.pk, nan_loss_run())
    path, content_type, body = got.get(timeout=10)
    assert path == "/hooks/t0k3n?x=1" and content_type == "application/json"
    assert body["run"] == {
        "id": run.pk,
        "name": run.name,
        "project": run.project.name,
        "team": run.project.team.name,
        "url": f"/runs/{run.pk}/",
    }
    assert [(a["rule"], a["step"]) for a in body["alerts"]] == [("non_finite", 2)]
    assert got.empty()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://example.org/x", "must start with http"),
        ("http://user:pw@example.org/x", "user name or password"),
        ("http:///x", "no host"),
        ("http://example.org:port/x", "port is not a number"),
        ("http://127.0.0.1:9/x", "not a public address"),
        ("http://localhost:6379/", "not a public address"),
        ("http://169.254.169.254/latest/meta-data/", "not a public address"),
        ("http://10.0.0.8/", "not a public address"),
        ("http://[::1]:8000/", "not a public address"),
        ("http://0.0.0.0/", "not a public address"),
    ],
)
def test_the_webhook_calls_only_public_addresses(url: str, says: str) -> None:
    with pytest.raises(webhooks.WebhookRefused, match=says):
        webhooks.deliver(url, {"alerts": []})


def test_a_failing_receiver_is_logged_never_raised(caplog) -> None:
    future = webhooks.post_later("http://127.0.0.1:9/", {"run": {"id": 7}, "alerts": []})
    assert future.result(timeout=10) is None
    assert "alert webhook of run 7 not delivered" in caplog.text


# --------------------------------------------------------------------------- the API


def put_json(client: Any, path: str, body: Any) -> Any:
    return client.put(path, data=json.dumps(body), content_type="application/json")


def test_the_api_lists_a_runs_alerts_to_its_team_only(run: Run, client_for, viewer, outsider) -> None:
    store_events(run.pk, nan_loss_run())
    body = client_for(viewer).get(f"/api/runs/{run.pk}/alerts").json()
    assert [(a["rule"], a["step"], a["metric"]) for a in body] == [("non_finite", 2, "actor/pg_loss")]
    assert client_for(outsider).get(f"/api/runs/{run.pk}/alerts").status_code == 404


def test_project_settings_are_the_admins_and_checked_field_by_field(run: Run, client_for, admin, member) -> None:
    path = f"/api/projects/{run.project_id}/alert-settings"
    good = {"rules": {"entropy_collapse": {"fraction": 0.2}}, "webhook_url": "https://hooks.example.org/t0k3n"}
    assert put_json(client_for(member), path, good).status_code == 403
    response = put_json(client_for(admin), path, good)
    assert response.status_code == 200, response.content
    assert response.json()["effective"]["entropy_collapse"] == {"enabled": True, "fraction": 0.2, "baseline_steps": 5}
    # The webhook URL may carry a secret: only admins read it back.
    assert client_for(member).get(path).json()["webhook_url"] is None
    assert client_for(admin).get(path).json()["webhook_url"] == "https://hooks.example.org/t0k3n"
    for body, loc, says in [
        ({"rules": {"entropy_collapse": {"fraction": 3}}}, ["rules", "entropy_collapse", "fraction"], "between"),
        ({"rules": {"nope": {}}}, ["rules", "nope"], "no such rule"),
        ({"webhook_url": "http://127.0.0.1:6379/"}, ["webhook_url"], "not a public address"),
        ({"webhook_url": "gopher://example.org/"}, ["webhook_url"], "http:// or https://"),
    ]:
        response = put_json(client_for(admin), path, body)
        assert response.status_code == 422, (body, response.content)
        (problem,) = response.json()["detail"]
        assert problem["loc"] == ["body", "payload", *loc] and says in problem["msg"], problem
    assert ProjectAlertSettings.objects.get(project=run.project).rules == {"entropy_collapse": {"fraction": 0.2}}


def test_a_member_overrides_a_runs_rules(run: Run, client_for, member, viewer) -> None:
    path = f"/api/runs/{run.pk}/alert-settings"
    body = {"rules": {"non_finite": {"enabled": False}}}
    assert put_json(client_for(viewer), path, body).status_code == 403
    assert put_json(client_for(member), path, body).json()["effective"]["non_finite"]["enabled"] is False
    store_events(run.pk, nan_loss_run())
    assert not Alert.objects.filter(run=run).exists()
    assert client_for(viewer).get(path).json()["rules"] == body["rules"]
