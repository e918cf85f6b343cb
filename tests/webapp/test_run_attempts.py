"""A resume continues the same run (issue 15): the run goes from its final status back to queued
as its next attempt, the new attempt's engine ships into the same run under a new token, and a
resume from an earlier checkpoint supersedes what earlier attempts logged from the new attempt's
first step on (kept, not charted), while every stored event keeps its seq."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from engine.contracts import CLOSE_BAD_TOKEN
from tests.webapp.event_builders import metrics, samples, status
from tests.webapp.test_ingest import analysis
from webapp.live.replay import stored_events
from webapp.runs import selectors
from webapp.runs.choices import RunStatus
from webapp.runs.ingest import IngestClosed, prepare, store_events, store_validated, validated
from webapp.runs.models import Checkpoint, InvalidTransition, LogLine, MetricPoint, Run, RunAttempt, Sample
from webapp.runs.services import CannotResume, claim_run, request_cancel, resume_run
from webapp.runs.tokens import TokenRejected, check_ingest_token, start_attempt
from webapp.teams.models import Project


def checkpoint(seq: int, step: int) -> dict[str, Any]:
    return {
        "run": "r",
        "seq": seq,
        "type": "checkpoint",
        "step": step,
        "path": f"runs/x/checkpoints/step_{step:06d}",
        "bytes": 10,
    }


def attempt_of(
    first_seq: int, steps: range, *, checkpoints: tuple[int, ...] = (), end: str = "cancelled"
) -> list[dict[str, Any]]:
    """An engine attempt as its log has it: starting, running, per step metrics (reward = step + 100 x
    the first seq, so each attempt's values differ) and samples, checkpoints, its final status."""
    seq = first_seq
    events = [status(seq, "starting"), status(seq + 1, "running")]
    seq += 2
    for step in steps:
        events.append(metrics(seq, step, reward=step + 100 * first_seq))
        events.append(samples(seq + 1, step, f"{step}"))
        seq += 2
        if step in checkpoints:
            events.append(checkpoint(seq, step))
            seq += 1
    events.append(status(seq, end, f"{end} at step {steps[-1]}"))
    return events


def ship(run: Run, events: list[dict[str, Any]], *, prepared: bool = False) -> None:
    """Ship ``events`` as the current attempt's worker does: claim, then store under its token;
    ``prepared``: built before the row lock, as the ingest socket stores a batch (``ingest.prepare``:
    its points copied before the lock on PostgreSQL)."""
    token = start_attempt(run.pk)
    attempt = check_ingest_token(token, run.pk)
    assert claim_run(run.pk, "worker-a", claim=f"claim-{attempt}", attempt=attempt) == (True, "")
    if prepared:
        run.refresh_from_db()
        batch = validated(events)
        store_validated(run.pk, batch, attempt=attempt, prepared=prepare(run.pk, run.attempt_number, batch))
    else:
        store_events(run.pk, events, attempt=attempt)
    run.refresh_from_db()


@pytest.fixture
def first_attempt(
    make_run: Callable[..., Run], valid_config: dict[str, Any]
) -> tuple[Run, list[dict[str, Any]]]:
    """A run whose attempt 1 logged steps 1..6 with checkpoints at 2 and 4, then was cancelled."""
    run = make_run(config=valid_config)
    events = attempt_of(1, range(1, 7), checkpoints=(2, 4))
    ship(run, events)
    assert run.status == RunStatus.CANCELLED
    return run, events


def test_a_launch_is_attempt_one_and_records_its_life(first_attempt) -> None:
    run, events = first_attempt
    (attempt,) = run.attempts.all()
    assert (attempt.number, attempt.worker_host, attempt.status) == (1, "worker-a", RunStatus.CANCELLED)
    assert attempt.started_at is not None and attempt.ended_at == run.finished_at
    assert (attempt.first_seq, attempt.last_seq, attempt.first_step) == (1, events[-1]["seq"], 1)
    assert attempt.message == "cancelled at step 6" and attempt.from_step is None


@pytest.mark.parametrize(
    "final", [RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.LOST]
)
def test_a_resume_takes_a_final_run_back_to_queued_keeping_its_history(
    make_run: Callable[..., Run], valid_config: dict[str, Any], member: Any, final: RunStatus
) -> None:
    run = make_run(
        config=valid_config, status=final, last_step=12, last_seq=40, final_seq=40, claim="old-claim",
        summary={"reward": 0.5}, worker_host="gpu-1",
    )  # fmt: skip
    Run.objects.filter(pk=run.pk).update(cancel_requested_at=run.created_at, finished_at=run.created_at)
    ckpt = Checkpoint.objects.create(run=run, seq=30, step=10, path="runs/1/checkpoints/step_000010", bytes=1)
    resumed = resume_run(run, member)
    stored = Run.objects.get(pk=run.pk)
    assert resumed.pk == run.pk and Run.objects.count() == 1
    assert (stored.status, stored.final_seq, stored.claim, stored.cancel_requested_at, stored.finished_at) == (
        RunStatus.QUEUED, None, "", None, None
    )  # fmt: skip
    assert (stored.last_step, stored.last_seq, stored.summary) == (12, 40, {"reward": 0.5})
    assert (stored.attempt_number, stored.resume_from, stored.worker_host, stored.started_at) == (
        2,
        ckpt,
        "",
        None,
    )
    assert "step 10 (attempt 2)" in stored.status_message
    second = stored.attempts.get(number=2)
    assert (second.from_checkpoint, second.from_step, second.status, second.created_by) == (
        ckpt,
        10,
        "",
        member,
    )
    # Still final for everything but a resume: the engine's states cannot revive it.
    other = make_run(status=final)
    for state in (RunStatus.STARTING, RunStatus.RUNNING, RunStatus.CANCELLED):
        with pytest.raises(InvalidTransition):
            other.transition(state)


def test_a_resume_is_refused_while_the_run_is_active_and_says_why(
    make_run: Callable[..., Run], member: Any
) -> None:
    run = make_run(status=RunStatus.RUNNING)
    Checkpoint.objects.create(run=run, seq=3, step=1, path="p/step_000001", bytes=1)
    with pytest.raises(CannotResume, match="cancel it first"):
        resume_run(run, member)
    assert run.attempts.count() == 1


def test_a_second_resume_of_a_resumed_run_is_refused(first_attempt, member: Any) -> None:
    run, _ = first_attempt
    stale = Run.objects.get(pk=run.pk)  # read while it was cancelled, as a second browser tab has it
    resume_run(run, member)
    with pytest.raises(CannotResume, match="is queued: cancel it first"):
        resume_run(stale, member)
    assert run.attempts.count() == 2


def test_the_next_attempt_ships_into_the_same_run_and_the_old_token_dies(first_attempt, member: Any) -> None:
    run, first = first_attempt
    old_token = start_attempt(run.pk)  # the token of the attempt that just ended (its worker drains)
    old = check_ingest_token(old_token, run.pk)
    late = [metrics(first[-1]["seq"] + 1, 7, reward=1.0)]
    with pytest.raises(IngestClosed):  # after the engine's final status: nothing
        store_events(run.pk, late, attempt=old)

    resume_run(run, member, run.checkpoints.get(step=4))
    second = attempt_of(first[-1]["seq"] + 1, range(5, 9), checkpoints=(8,), end="succeeded")
    ship(run, second)
    with pytest.raises(TokenRejected) as refused:  # the ended attempt's worker writes nothing now
        store_events(run.pk, late, attempt=old)
    assert refused.value.code == CLOSE_BAD_TOKEN

    assert (run.status, run.last_step, run.last_seq, run.attempt_number) == (
        RunStatus.SUCCEEDED, 8, second[-1]["seq"], 2
    )  # fmt: skip
    attempts = list(run.attempts.order_by("number"))
    assert [(a.number, a.status, a.from_step, a.first_step) for a in attempts] == [
        (1, RunStatus.CANCELLED, None, 1),
        (2, RunStatus.SUCCEEDED, 4, 5),
    ]
    assert (attempts[1].first_seq, attempts[1].last_seq) == (second[0]["seq"], second[-1]["seq"])
    # Every event of both engine logs is stored once, under its own seq (the fault tests' rule).
    assert stored_seqs(run) == row_backed(first + second)
    # One continuous history: steps 1..8 once each; step 5 and 6 from the second attempt.
    series = {
        s["name"]: s for s in selectors.metric_series(run, [], max_points=100, after_step=None, x="step")
    }
    assert series["reward"]["step"] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert series["reward"]["value"][4:6] == [5 + 100 * second[0]["seq"], 6 + 100 * second[0]["seq"]]


def test_a_rewind_supersedes_what_earlier_attempts_logged_from_its_first_step(
    first_attempt, member: Any
) -> None:
    run, first = first_attempt
    resume_run(run, member, run.checkpoints.get(step=2))
    second = attempt_of(first[-1]["seq"] + 1, range(3, 5))
    ship(run, second)

    current = MetricPoint.objects.filter(run=run, superseded=False)
    assert sorted(current.values_list("step", "attempt")) == [(1, 1), (2, 1), (3, 2), (4, 2)]
    hidden = MetricPoint.objects.filter(run=run, superseded=True)
    assert sorted(hidden.values_list("step", "attempt")) == [(3, 1), (4, 1), (5, 1), (6, 1)]
    assert sorted(Sample.objects.filter(run=run, superseded=True).values_list("step", flat=True)) == [
        3,
        4,
        5,
        6,
    ]
    assert list(run.checkpoints.filter(superseded=True).values_list("step", flat=True)) == [4]
    assert run.last_step == 4  # the history ends where the new attempt is, not at the old 6
    assert stored_seqs(run) == row_backed(first + second)  # nothing dropped or moved: flags only

    series = selectors.metric_series(run, ["reward"], max_points=100, after_step=None, x="step")[0]
    assert series["step"] == [1, 2, 3, 4] and series["value"][2] == 3 + 100 * second[0]["seq"]
    old = selectors.metric_series(
        run, ["reward"], max_points=100, after_step=None, x="step", superseded=True
    )[0]
    assert old["step"] == [3, 4, 5, 6] and old["value"][0] == 3 + 100
    assert [s.step for s in selectors.samples(run)] == [1, 2, 3, 4]
    assert list(selectors.resumable_checkpoints(run).values_list("step", flat=True)) == [2]
    assert selectors.has_superseded_points(run)

    # A replay says which attempt logged each point, so a page redoes the rewind as it replays.
    replayed = [
        e for chunk in stored_events(run.pk, 0, run.last_seq) for e in chunk if e["type"] == "metrics"
    ]
    assert [(e["step"], e["attempt"]) for e in replayed] == [(s, 1) for s in range(1, 7)] + [(3, 2), (4, 2)]

    # Rewinding again, to the same checkpoint: attempt 2's steps are superseded in turn, and two
    # superseded points may share a step (one per attempt).
    resume_run(run, member, run.checkpoints.get(step=2))
    third = attempt_of(second[-1]["seq"] + 1, range(3, 4), end="failed")
    ship(run, third)
    assert sorted(MetricPoint.objects.filter(run=run, superseded=True).values_list("step", "attempt")) == [
        (3, 1), (3, 2), (4, 1), (4, 2), (5, 1), (6, 1)
    ]  # fmt: skip
    assert sorted(MetricPoint.objects.filter(run=run, superseded=False).values_list("step", "attempt")) == [
        (1, 1), (2, 1), (3, 3)
    ]  # fmt: skip
    assert (run.status, run.last_step) == (RunStatus.FAILED, 3)
    assert stored_seqs(run) == row_backed(first + second + third)


def test_a_rewinding_batch_stores_the_same_prepared_or_not(
    make_run: Callable[..., Run], valid_config: dict[str, Any], member: Any
) -> None:
    """The first metrics of a resumed attempt rewind the run, which rebuilds its summaries and
    rollups from the stored points (``ingest._supersede``). A batch whose points were copied before
    the row lock is stored again without them then (``ingest._copied_all``): else the rebuild
    would count them, and the batch's own record again."""
    runs = []
    for prepared in (False, True):
        run = make_run(config=valid_config)
        first = attempt_of(1, range(1, 7), checkpoints=(2, 4))
        ship(run, first, prepared=prepared)
        resume_run(run, member, run.checkpoints.get(step=2))
        ship(run, attempt_of(first[-1]["seq"] + 1, range(3, 5)), prepared=prepared)
        runs.append(run)
    plain, prepared_run = runs
    points = [
        sorted(MetricPoint.objects.filter(run=r).values_list("name", "step", "value", "attempt", "superseded"))
        for r in runs
    ]
    assert points[0] == points[1] and len(points[0]) == 8
    assert analysis(prepared_run) == analysis(plain) and analysis(plain)["rollups"]


def test_a_resume_from_the_latest_checkpoint_supersedes_nothing(first_attempt, member: Any) -> None:
    run, first = first_attempt
    Checkpoint.objects.create(
        run=run, seq=first[-1]["seq"] + 100, step=6, path="runs/x/checkpoints/step_000006", bytes=1
    )
    resume_run(run, member)
    ship(run, attempt_of(first[-1]["seq"] + 1, range(7, 9)))
    assert not MetricPoint.objects.filter(run=run, superseded=True).exists()
    assert not selectors.has_superseded_points(run)
    assert run.last_step == 8


def test_the_default_resume_path_avoids_a_superseded_branch(first_attempt, member: Any) -> None:
    """The engine takes the newest checkpoint of a directory; after a rewind that directory may
    still hold the left branch's later checkpoints, so the web app names its own newest."""
    run, _ = first_attempt
    resume_run(run, member)
    assert Run.objects.get(pk=run.pk).resume_path == "runs/x/checkpoints"
    Run.objects.filter(pk=run.pk).update(status=RunStatus.CANCELLED)
    run.refresh_from_db()
    Checkpoint.objects.filter(run=run, step=4).update(superseded=True)
    resume_run(run, member)
    stored = Run.objects.get(pk=run.pk)
    assert (stored.resume_path, stored.resume_from.step) == ("", 2)


def test_cancelling_the_queued_resume_ends_that_attempt(first_attempt, member: Any) -> None:
    run, _ = first_attempt
    resume_run(run, member)
    request_cancel(run, "changed my mind")
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    second = run.attempts.get(number=2)
    assert (second.status, second.message, second.started_at) == (
        RunStatus.CANCELLED,
        "changed my mind",
        None,
    )


def test_runs_of_before_get_their_first_attempt_from_the_migration(make_run: Callable[..., Run]) -> None:
    """Migration 0007's data step, on a run stored before attempts existed (a child resumed the
    old way included: its attempt starts from its parent's checkpoint)."""
    from importlib import import_module

    from django.apps import apps

    parent = make_run(name="parent", status=RunStatus.LOST)
    ckpt = Checkpoint.objects.create(run=parent, seq=5, step=4, path="p/step_000004", bytes=1)
    child = make_run(
        name="child", status=RunStatus.FAILED, status_message="boom", last_seq=9, worker_host="gpu-2",
        parent=parent, parent_kind="resume", resume_from=ckpt,
    )  # fmt: skip
    Run.objects.filter(pk=child.pk).update(started_at=child.created_at, finished_at=child.created_at)
    RunAttempt.objects.all().delete()
    import_module("webapp.runs.migrations.0007_run_attempts").first_attempts(apps, None)
    assert RunAttempt.objects.count() == 2
    attempt = RunAttempt.objects.get(run=child)
    assert (attempt.number, attempt.status, attempt.message, attempt.worker_host) == (
        1,
        "failed",
        "boom",
        "gpu-2",
    )
    assert (attempt.first_seq, attempt.last_seq, attempt.from_checkpoint, attempt.from_step) == (
        1,
        9,
        ckpt,
        4,
    )
    assert attempt.ended_at == attempt.started_at == child.created_at


def stored_seqs(run: Run) -> dict[int, tuple[str, int]]:
    """seq -> (kind, rows) of every row-backed event stored for the run (as tests/e2e/harness.py)."""
    out: dict[int, tuple[str, int]] = {}
    for kind, model in (
        ("metrics", MetricPoint),
        ("samples", Sample),
        ("checkpoint", Checkpoint),
        ("log", LogLine),
    ):
        for seq in model.objects.filter(run=run).values_list("seq", flat=True):
            out[seq] = (kind, out.get(seq, (kind, 0))[1] + 1)
    return out


def row_backed(events: list[dict[str, Any]]) -> dict[int, tuple[str, int]]:
    out: dict[int, tuple[str, int]] = {}
    for e in events:
        if e["type"] == "metrics":
            out[e["seq"]] = ("metrics", len(e["values"]))
        elif e["type"] == "samples":
            out[e["seq"]] = ("samples", len(e["items"]))
        elif e["type"] in ("checkpoint", "log"):
            out[e["seq"]] = (e["type"], 1)
    return out


def test_the_admin_shows_a_runs_attempts_read_only(
    first_attempt, member: Any, django_user_model: Any
) -> None:
    from django.test import Client

    run, _ = first_attempt
    resume_run(run, member)
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", password="x"))
    page = client.get(f"/admin/runs/run/{run.pk}/change/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "Run attempts" in html and "worker-a" in html and 'name="attempts-0-number"' not in html


def test_a_resume_names_only_reward_code_its_user_may_run(
    make_run: Callable[..., Run],
    project: Any,
    admin: Any,
    member: Any,
    team: Any,
    valid_config: dict[str, Any],
) -> None:
    """As at a launch: a trusted team's admin ran the team's own reward code; a member may not
    resume that run (the config is checked again with the resumer's policy), the admin may."""
    from webapp.runs.queueing import reward_policy_for
    from webapp.runs.services import RunConfigInvalid, validate_run_config
    from webapp.teams.models import Team

    Team.objects.filter(pk=team.pk).update(allow_user_code=True)
    own = {**valid_config, "reward": {"functions": [{"name": "team_rewards.scoring:score"}]}}
    config = validate_run_config(own, reward_policy_for(Project.objects.get(pk=project.pk), admin))
    run = make_run(config=config, status=RunStatus.CANCELLED)
    Checkpoint.objects.create(run=run, seq=3, step=1, path="p/step_000001", bytes=1)
    with pytest.raises(
        RunConfigInvalid,
        match=r"config\.reward\.functions\[0\]\.name: .* is not a registered reward function",
    ):
        resume_run(run, member)
    assert Run.objects.get(pk=run.pk).status == RunStatus.CANCELLED
    assert resume_run(run, admin).status == RunStatus.QUEUED


def test_a_lost_engines_unshipped_tail_is_its_attempts_and_cannot_end_the_resume(
    make_run: Callable[..., Run], valid_config: dict[str, Any], member: Any
) -> None:
    """Attempt 1's worker died after the web app stored seq 12; its engine went on, checkpointed
    step 5 and wrote "cancelled" (seqs 13-15), in a directory the web app cannot read. The resume
    lands on the same machine: its supervisor attaches with ``engine_from`` 15 and ships 13-15
    first, then the new engine's seqs. The tail is stored as attempt 1's; its "cancelled" is words,
    not the run's status; attempt 2 runs on, and every seq is stored once."""
    run = make_run(config=valid_config)
    log = attempt_of(1, range(1, 6), checkpoints=(4, 5))  # seqs 1..15: starting, running, steps 1-5, the end
    shipped, tail = log[:12], log[12:]
    token = start_attempt(run.pk)
    first = check_ingest_token(token, run.pk)
    assert claim_run(run.pk, "worker-a", claim="claim-1", attempt=first) == (True, "")
    store_events(run.pk, shipped, attempt=first)
    run.refresh_from_db()
    run.mark_lost()
    resume_run(run, member)  # the engine takes the newest checkpoint in the directory: step 5, in the tail

    token = start_attempt(run.pk)
    second = check_ingest_token(token, run.pk)
    engine_from = tail[-1]["seq"]
    assert claim_run(run.pk, "worker-a", claim="claim-2", attempt=second, engine_from=engine_from) == (True, "")
    resumed = [
        status(engine_from + 1, "starting", "restoring the checkpoint of step 5"),
        status(engine_from + 2, "running"),
        metrics(engine_from + 3, 6, reward=6.0),
    ]
    store_events(run.pk, tail + resumed, attempt=second)
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING and run.final_seq is None and run.last_seq == engine_from + 3
    words = list(LogLine.objects.filter(run=run, seq=tail[-1]["seq"]).values_list("message", flat=True))
    assert words == ["attempt 1's engine reported 'cancelled': cancelled at step 5 (shipped after the resume; attempt 2 goes on)"]
    by_attempt = dict(MetricPoint.objects.filter(run=run).values_list("step", "attempt"))
    assert by_attempt == {1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 2}
    assert Checkpoint.objects.get(run=run, step=5).attempt == 1
    attempts = {a.number: (a.first_seq, a.last_seq, a.engine_from_seq) for a in run.attempts.all()}
    assert attempts == {1: (1, engine_from, None), 2: (engine_from + 1, engine_from + 3, engine_from)}
    # The stored events are the engine's log: every seq once, in order.
    replayed = [e["seq"] for chunk in stored_events(run.pk, 0, run.last_seq) for e in chunk]
    data = [e["seq"] for e in log + resumed if e["type"] not in ("status", "heartbeat")]
    assert [s for s in replayed if s in set(data)] == data


def test_without_engine_from_a_tails_final_status_ends_the_attempt_as_before(
    make_run: Callable[..., Run], valid_config: dict[str, Any]
) -> None:
    """A worker of before (no ``engine_from``) keeps the old behaviour: nothing is reinterpreted."""
    run = make_run(config=valid_config)
    ship(run, attempt_of(1, range(1, 3)))
    assert run.status == RunStatus.CANCELLED and run.final_seq == run.last_seq
