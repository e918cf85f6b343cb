"""Runs through the API: launch (with the engine's validation), list, read, edit, cancel,
resume, fork; checkpoints and logs; the Celery message a launch really sends."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from webapp.runs.choices import LogLevel, ParentKind, RunStatus
from webapp.runs.models import Checkpoint, LogLine, Run
from webapp.runs.tokens import check_ingest_token
from webapp.teams.models import Project

JSON = "application/json"


@pytest.fixture
def as_member(member: Any, client_for: Callable[..., Client]) -> Client:
    return client_for(member)


def launch(client: Client, project: Project, body: dict[str, Any]) -> Any:
    return client.post(f"/api/projects/{project.pk}/runs", body, content_type=JSON)


# --- launch ------------------------------------------------------------------------------


def test_launch_stores_the_validated_config(as_member: Client, project: Project, member: Any) -> None:
    response = launch(
        as_member,
        project,
        {
            "name": "dapo-try",
            "config": {"preset": "dapo", "trainer": {"total_steps": 20}},
            "queue": "GPU",
            "tags": ["dapo", " sweep ", "dapo"],
            "notes": "first try",
        },
    )
    assert response.status_code == 201, response.content
    body = response.json()
    run = Run.objects.get(pk=body["id"])
    assert (run.name, run.queue, run.tags, run.notes) == ("dapo-try", "gpu", ["dapo", "sweep"], "first try")
    assert run.created_by == member and run.status == RunStatus.QUEUED
    # The stored config is the engine's full validated one: the preset applied, defaults filled.
    assert run.config["trainer"]["total_steps"] == 20
    assert run.config["algorithm"]["clip_ratio_high"] == 0.28
    assert body["config"] == run.config
    assert body["status"] == "queued" and body["project"]["id"] == project.pk
    assert body["created_by"] == "bob-member" and body["parent"] is None


def test_launch_names_the_run_after_the_config(as_member: Client, project: Project) -> None:
    body = launch(as_member, project, {"config": {"name": "from-config"}}).json()
    assert body["name"] == "from-config"


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            {"algorithm": {"clip_ratio_low": -1}, "rollout": {"n": 0}},
            {
                ("body", "payload", "config", "algorithm", "clip_ratio_low"),
                ("body", "payload", "config", "rollout", "n"),
            },
        ),
        ({"algoritm": {}}, {("body", "payload", "config", "algoritm")}),
        ({"preset": "nope"}, {("body", "payload", "config", "preset")}),
        ({"trainer": {"total_steps": "many"}}, {("body", "payload", "config", "trainer", "total_steps")}),
        ({"trainer": "fast"}, {("body", "payload", "config", "trainer")}),
        (
            {"reward": {"functions": [{"name": "task"}, {"name": "task", "weight": "heavy"}]}},
            {("body", "payload", "config", "reward", "functions", 1, "weight")},
        ),
        ([1, 2], {("body", "payload", "config")}),
        ("grpo", {("body", "payload", "config")}),
        (None, {("body", "payload", "config")}),
        (42, {("body", "payload", "config")}),
    ],
)
def test_bad_config_is_a_422_naming_each_field(
    config: Any, expected: set[tuple[Any, ...]], as_member: Client, project: Project
) -> None:
    response = launch(as_member, project, {"config": config})
    assert response.status_code == 422, response.content
    detail = response.json()["detail"]
    assert {tuple(item["loc"]) for item in detail} == expected
    assert all(item["msg"] and item["type"] == "config_invalid" for item in detail)
    assert not Run.objects.exists()


def test_bad_config_messages_say_what_to_fix(as_member: Client, project: Project) -> None:
    detail = launch(as_member, project, {"config": {"algoritm": {}}}).json()["detail"]
    assert "did you mean 'algorithm'" in detail[0]["msg"]
    detail = launch(as_member, project, {"config": [1]}).json()["detail"]
    assert "must be an object" in detail[0]["msg"]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"config": {}, "queue": "no spaces allowed"},
        {"config": {}, "tags": "not-a-list"},
        {"config": {}, "tags": [""]},
        {"config": {}, "tags": ["x" * 51]},
        {"config": {}, "name": "x" * 201},
        {"config": {}, "notes": 5},
        {"config": {"rollout": {"n": 1e400}}},
        {"config": {"a" * 10_000: 1}},
        {"config": {"algorithm": {"clip_ratio_low": {"nested": [1, {"deeper": None}]}}}},
    ],
)
def test_bad_launch_requests_are_422_never_500(
    body: dict[str, Any], as_member: Client, project: Project
) -> None:
    response = launch(as_member, project, body)
    assert response.status_code == 422, response.content
    assert response.json()["detail"][0]["loc"][0] == "body"
    assert not Run.objects.exists()


def test_unparseable_body_is_400(as_member: Client, project: Project) -> None:
    response = as_member.post(f"/api/projects/{project.pk}/runs", "{not json", content_type=JSON)
    assert response.status_code == 400


def sent_task(queue: str) -> tuple[list[Any], dict[str, Any]]:
    """The one supervisor task waiting in ``queue``, taken off the broker."""
    from jobs.app import SUPERVISE_TASK, app

    with app.connection_for_read() as connection, connection.SimpleQueue(queue) as broker_queue:
        message = broker_queue.get(timeout=10)
        message.ack()
        with pytest.raises(broker_queue.Empty):  # exactly one task
            broker_queue.get(timeout=0.5)
    assert message.headers["task"] == SUPERVISE_TASK
    args, kwargs, _ = message.payload
    return args, kwargs


def test_launch_sends_the_supervisor_task_to_the_broker(
    as_member: Client, project: Project, django_capture_on_commit_callbacks: Any
) -> None:
    """Read back through kombu what the broker got: the filesystem transport on the SQLite
    pass, Redis on the PostgreSQL pass (``REDIS_URL``)."""
    queue = f"apitest-{timezone.now().timestamp():.0f}"
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        response = launch(as_member, project, {"config": {"trainer": {"total_steps": 7}}, "queue": queue})
    assert response.status_code == 201
    assert callbacks, "the task is sent once the transaction commits"
    args, kwargs = sent_task(queue)
    run = Run.objects.get(pk=response.json()["id"])
    assert args == []
    assert kwargs["run_id"] == run.pk
    assert kwargs["config"] == run.config and kwargs["config"]["trainer"]["total_steps"] == 7
    assert kwargs["start_seq"] == 0 and kwargs["resume_path"] is None
    check_ingest_token(kwargs["token"], run.pk)  # raises unless it is this run's live token


# --- list and read -----------------------------------------------------------------------


@pytest.fixture
def many_runs(make_run: Callable[..., Run], member: Any, admin: Any) -> list[Run]:
    base = timezone.now() - timedelta(hours=1)
    specs = [
        ("alpha", RunStatus.RUNNING, ["grpo"], "lr sweep", member, 30),
        ("beta", RunStatus.QUEUED, ["grpo", "sweep"], "", member, 0),
        ("gamma", RunStatus.FAILED, ["ppo"], "diverged at step 12", admin, 12),
        ("delta", RunStatus.SUCCEEDED, [], "", admin, 200),
        ("epsilon", RunStatus.CANCELLED, ["sweep"], "superseded by beta", member, 5),
    ]
    runs = []
    for i, (name, status, tags, notes, user, last_step) in enumerate(specs):
        run = make_run(name=name, status=status, tags=tags, notes=notes, last_step=last_step)
        Run.objects.filter(pk=run.pk).update(created_at=base + timedelta(minutes=i), created_by=user)
        run.refresh_from_db()
        runs.append(run)
    return runs


def names(client: Client, project: Project, query: str = "") -> list[str]:
    response = client.get(f"/api/projects/{project.pk}/runs{query}")
    assert response.status_code == 200, response.content
    return [item["name"] for item in response.json()["items"]]


def test_list_runs_filters_and_sorts(
    many_runs: list[Run], viewer: Any, client_for: Callable[..., Client], project: Project
) -> None:
    client = client_for(viewer)
    assert names(client, project) == ["epsilon", "delta", "gamma", "beta", "alpha"]
    assert names(client, project, "?sort=created_at") == ["alpha", "beta", "gamma", "delta", "epsilon"]
    assert names(client, project, "?sort=name") == ["alpha", "beta", "delta", "epsilon", "gamma"]
    assert names(client, project, "?sort=-last_step") == ["delta", "alpha", "gamma", "epsilon", "beta"]
    assert names(client, project, "?sort=status")[0] == "epsilon"  # cancelled sorts first
    assert names(client, project, "?status=running&status=queued") == ["beta", "alpha"]
    assert names(client, project, "?tag=sweep") == ["epsilon", "beta"]
    assert names(client, project, "?tag=sweep&tag=grpo") == ["beta"]
    assert names(client, project, "?tag=nope") == []
    assert names(client, project, "?q=BETA") == ["epsilon", "beta"]  # name or notes, any case
    assert names(client, project, "?q=diverged") == ["gamma"]
    assert names(client, project, "?created_by=alice-admin") == ["delta", "gamma"]
    assert names(client, project, f"?created_by={many_runs[0].created_by_id}") == ["epsilon", "beta", "alpha"]
    assert names(client, project, "?created_by=me") == []  # the viewer launched nothing
    assert names(client, project, "?created_by=nobody") == []


def test_list_runs_pages_with_a_total(
    many_runs: list[Run], viewer: Any, client_for: Callable[..., Client], project: Project
) -> None:
    body = client_for(viewer).get(f"/api/projects/{project.pk}/runs?limit=2&offset=2&sort=name").json()
    assert (body["total"], body["limit"], body["offset"]) == (5, 2, 2)
    assert [item["name"] for item in body["items"]] == ["delta", "epsilon"]
    item = body["items"][0]
    assert item["status"] == "succeeded" and item["status_badge"] == "success"
    assert "config" not in item  # the table does not need it


@pytest.mark.parametrize(
    "query", ["?status=exploded", "?sort=reward", "?limit=0", "?limit=100000", "?offset=-1"]
)
def test_list_runs_bad_query_is_422(
    query: str, viewer: Any, client_for: Callable[..., Client], project: Project
) -> None:
    response = client_for(viewer).get(f"/api/projects/{project.pk}/runs{query}")
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"][0] == "query"


def test_get_run_has_what_the_run_page_needs(
    make_run: Callable[..., Run], valid_config: dict[str, Any], viewer: Any, client_for: Callable[..., Client]
) -> None:
    parent = make_run(name="parent", config=valid_config, status=RunStatus.LOST, last_step=9, last_seq=50)
    ckpt = Checkpoint.objects.create(run=parent, seq=44, step=8, path="runs/parent/ckpt-8", bytes=99)
    started = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    child = make_run(
        name="child",
        config=valid_config,
        parent=parent,
        parent_kind=ParentKind.RESUME,
        resume_from=ckpt,
        status=RunStatus.RUNNING,
        worker_host="gpu-7",
        queue="gpu",
        started_at=started,
        heartbeat_at=started,
        last_step=20,
        last_seq=90,
        summary={"reward/mean": 0.5},
        notes="resumed after the node died",
    )
    body = client_for(viewer).get(f"/api/runs/{child.pk}").json()
    assert body["parent"] == {"id": parent.pk, "name": "parent", "status": "lost"}
    assert body["parent_kind"] == "resume"
    assert body["resume_from"]["id"] == ckpt.pk and body["resume_from"]["step"] == 8
    assert (body["worker_host"], body["queue"], body["last_step"], body["last_seq"]) == (
        "gpu-7",
        "gpu",
        20,
        90,
    )
    assert body["summary"] == {"reward/mean": 0.5} and body["notes"] == "resumed after the node died"
    assert datetime.fromisoformat(body["started_at"]) == started
    assert body["is_final"] is False and body["checkpoint_count"] == 0
    assert body["config"] == valid_config
    parent_body = client_for(viewer).get(f"/api/runs/{parent.pk}").json()
    assert parent_body["children"] == [
        {"id": child.pk, "name": "child", "status": "running", "kind": "resume"}
    ]
    assert parent_body["checkpoint_count"] == 1 and parent_body["is_final"] is True


def test_patch_run_changes_only_what_is_given(api_run: Run, as_member: Client) -> None:
    url = f"/api/runs/{api_run.pk}"
    body = as_member.patch(url, {"tags": ["best", "best", " keep "]}, content_type=JSON).json()
    assert body["tags"] == ["best", "keep"] and body["name"] == "grpo-baseline"
    body = as_member.patch(url, {"name": " renamed ", "notes": "looks good"}, content_type=JSON).json()
    assert (body["name"], body["notes"], body["tags"]) == ("renamed", "looks good", ["best", "keep"])
    assert as_member.patch(url, {"name": "  "}, content_type=JSON).status_code == 422
    assert (
        as_member.patch(url, {"tags": ["x"] * 2 + [str(i) for i in range(40)]}, content_type=JSON).status_code
        == 422
    )
    api_run.refresh_from_db()
    assert api_run.name == "renamed"


# --- cancel ----------------------------------------------------------------------------------


def test_cancel_a_queued_run_cancels_it(api_run: Run, as_member: Client) -> None:
    response = as_member.post(f"/api/runs/{api_run.pk}/cancel")
    assert response.status_code == 200, response.content
    assert response.json()["status"] == "cancelled"
    api_run.refresh_from_db()
    assert api_run.status == RunStatus.CANCELLED and api_run.finished_at is not None
    assert "bob-member" in api_run.status_message


@pytest.mark.parametrize("status", [RunStatus.STARTING, RunStatus.RUNNING])
def test_cancel_an_active_run_asks_its_worker(
    status: RunStatus, make_run: Callable[..., Run], as_member: Client
) -> None:
    run = make_run(status=status, worker_host="w1")
    response = as_member.post(f"/api/runs/{run.pk}/cancel")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == status.value  # the worker's engine reports cancelled when it has stopped
    assert body["cancel_requested_at"] is not None
    assert body["permissions"]["cancel"] is False
    run.refresh_from_db()
    assert run.status == status and run.cancel_requested_at is not None


@pytest.mark.parametrize(
    "status", [RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.LOST]
)
def test_cancel_a_final_run_is_409(
    status: RunStatus, make_run: Callable[..., Run], as_member: Client
) -> None:
    run = make_run(status=status)
    response = as_member.post(f"/api/runs/{run.pk}/cancel")
    assert response.status_code == 409
    assert "final" in response.json()["detail"]
    run.refresh_from_db()
    assert run.status == status and run.cancel_requested_at is None


# --- resume and fork -------------------------------------------------------------------------


@pytest.fixture
def crashed(make_run: Callable[..., Run], valid_config: dict[str, Any]) -> Run:
    run = make_run(
        name="crashed",
        config=valid_config,
        status=RunStatus.LOST,
        last_step=30,
        last_seq=120,
        tags=["long"],
        notes="node died",
        queue="gpu",
    )
    for seq, step in [(40, 10), (80, 20), (110, 28)]:
        Checkpoint.objects.create(run=run, seq=seq, step=step, path=f"runs/crashed/ckpt-{step}", bytes=1)
    return run


def test_an_archived_project_takes_no_launch_and_no_resume(
    crashed: Run, as_member: Client, project: Project
) -> None:
    """Archiving hides a project from the lists; a script or a saved link must not keep launching
    into it unseen: a 409 that says how to restore it, and nothing stored or queued."""
    from webapp.teams.projects import archive_project, restore_project

    archive_project(project)
    before = Run.objects.count()
    response = launch(as_member, project, {"config": {"preset": "grpo"}})
    assert response.status_code == 409 and "is archived: restore it" in response.json()["detail"]
    resumed = as_member.post(f"/api/runs/{crashed.pk}/resume", {}, content_type=JSON)
    assert resumed.status_code == 409 and "is archived" in resumed.json()["detail"]
    crashed.refresh_from_db()
    assert Run.objects.count() == before and crashed.status == RunStatus.LOST
    restore_project(project)
    assert launch(as_member, project, {"config": {"preset": "grpo"}}).status_code == 201


def test_resume_continues_the_same_run_from_the_latest_checkpoint(
    crashed: Run, as_member: Client, member: Any
) -> None:
    response = as_member.post(f"/api/runs/{crashed.pk}/resume", {}, content_type=JSON)
    assert response.status_code == 200, response.content
    body = response.json()
    latest = crashed.checkpoints.get(step=28)
    assert body["id"] == crashed.pk and not Run.objects.filter(parent=crashed).exists()  # no child
    run = Run.objects.get(pk=crashed.pk)
    assert run.resume_from == latest and body["resume_from"]["id"] == latest.pk
    # The history goes on: the cursor and the last step stay until the new attempt logs.
    assert (run.status, run.last_seq, run.last_step, run.attempt_number) == (RunStatus.QUEUED, 120, 30, 2)
    assert (run.queue, run.tags, run.name) == ("gpu", ["long"], "crashed")
    assert [(a["number"], a["from_step"], a["status"]) for a in body["attempts"]] == [
        (1, None, "lost"),
        (2, 28, ""),
    ]
    assert run.attempts.get(number=2).created_by == member


@pytest.mark.parametrize("chosen", [False, True])
def test_resume_tells_the_worker_where_to_resume_from(
    crashed: Run, as_member: Client, chosen: bool, django_capture_on_commit_callbacks: Any
) -> None:
    """Chosen: that checkpoint. Default: the run's checkpoint directory, where the engine
    takes the newest (possibly newer than any the web app heard of). Either way its events
    are numbered after the stored ones."""
    queue = f"resumetest-{int(chosen)}-{timezone.now().timestamp():.0f}"
    ckpt = crashed.checkpoints.get(step=10)
    body = {"queue": queue, **({"checkpoint_id": ckpt.pk} if chosen else {})}
    with django_capture_on_commit_callbacks(execute=True):
        response = as_member.post(f"/api/runs/{crashed.pk}/resume", body, content_type=JSON)
    assert response.status_code == 200, response.content
    _, kwargs = sent_task(queue)
    assert kwargs["resume_path"] == ("runs/crashed/ckpt-10" if chosen else "runs/crashed")
    assert kwargs["start_seq"] == 120 and kwargs["run_id"] == crashed.pk


def test_resume_from_a_chosen_checkpoint_on_another_queue(crashed: Run, as_member: Client) -> None:
    ckpt = crashed.checkpoints.get(step=10)
    body = as_member.post(
        f"/api/runs/{crashed.pk}/resume", {"checkpoint_id": ckpt.pk, "queue": "cpu"}, content_type=JSON
    ).json()
    run = Run.objects.get(pk=body["id"])
    assert (run.pk, run.resume_from, run.last_seq, run.queue) == (crashed.pk, ckpt, 120, "cpu")
    assert body["attempts"][-1]["from_step"] == 10


def test_resume_refusals(
    crashed: Run, make_run: Callable[..., Run], valid_config: dict[str, Any], as_member: Client
) -> None:
    other = make_run(name="other", config=valid_config, status=RunStatus.FAILED)
    foreign = Checkpoint.objects.create(run=make_run(name="third"), seq=1, step=1, path="x", bytes=1)
    response = as_member.post(
        f"/api/runs/{crashed.pk}/resume", {"checkpoint_id": foreign.pk}, content_type=JSON
    )
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "payload", "checkpoint_id"]
    # No checkpoint to resume from, or still running: 409 with the way out.
    response = as_member.post(f"/api/runs/{other.pk}/resume", {}, content_type=JSON)
    assert response.status_code == 409 and "fork it" in response.json()["detail"]
    running = make_run(name="busy", config=valid_config, status=RunStatus.RUNNING)
    response = as_member.post(f"/api/runs/{running.pk}/resume", {}, content_type=JSON)
    assert response.status_code == 409 and "cancel it first" in response.json()["detail"]
    # A checkpoint a rewind left behind is not one to resume from.
    left = crashed.checkpoints.get(step=28)
    Checkpoint.objects.filter(pk=left.pk).update(superseded=True)
    response = as_member.post(f"/api/runs/{crashed.pk}/resume", {"checkpoint_id": left.pk}, content_type=JSON)
    assert (
        response.status_code == 409
        and "pick one of the run's current checkpoints" in response.json()["detail"]
    )
    assert Run.objects.filter(parent__isnull=False).count() == 0
    assert crashed.attempts.count() == 1


def test_fork_merges_changes_into_the_parents_config(crashed: Run, as_member: Client) -> None:
    response = as_member.post(
        f"/api/runs/{crashed.pk}/fork",
        {"name": "higher-clip", "changes": {"algorithm": {"clip_ratio_high": 0.28}, "rollout": {"n": 4}}},
        content_type=JSON,
    )
    assert response.status_code == 201, response.content
    child = Run.objects.get(pk=response.json()["id"])
    assert child.name == "higher-clip" and child.parent == crashed and child.parent_kind == ParentKind.FORK
    assert child.config["algorithm"]["clip_ratio_high"] == 0.28 and child.config["rollout"]["n"] == 4
    # Everything else (nested siblings included) comes from the parent.
    assert child.config["algorithm"]["clip_ratio_low"] == crashed.config["algorithm"]["clip_ratio_low"]
    assert child.config["trainer"] == crashed.config["trainer"]
    assert (child.last_seq, child.last_step, child.resume_from) == (0, 0, None)
    default_name = as_member.post(f"/api/runs/{crashed.pk}/fork", {}, content_type=JSON).json()
    assert default_name["name"] == "crashed-fork" and default_name["queue"] == "gpu"


def test_fork_with_bad_changes_names_them(crashed: Run, as_member: Client) -> None:
    response = as_member.post(
        f"/api/runs/{crashed.pk}/fork",
        {"changes": {"algorithm": {"clip_ratio_low": -1}, "rollout": {"n": 0}}},
        content_type=JSON,
    )
    assert response.status_code == 422
    assert {tuple(item["loc"]) for item in response.json()["detail"]} == {
        ("body", "payload", "changes", "algorithm", "clip_ratio_low"),
        ("body", "payload", "changes", "rollout", "n"),
    }
    not_object = as_member.post(f"/api/runs/{crashed.pk}/fork", {"changes": [1]}, content_type=JSON)
    assert not_object.status_code == 422
    assert not_object.json()["detail"][0]["loc"] == ["body", "payload", "changes"]
    assert not Run.objects.filter(parent=crashed).exists()


# --- checkpoints and logs --------------------------------------------------------------------


def test_checkpoints_in_step_order(crashed: Run, viewer: Any, client_for: Callable[..., Client]) -> None:
    body = client_for(viewer).get(f"/api/runs/{crashed.pk}/checkpoints").json()
    assert [c["step"] for c in body] == [10, 20, 28]
    assert body[0]["path"] == "runs/crashed/ckpt-10" and body[0]["run_id"] == crashed.pk


def test_logs_page_after_a_seq_and_filter_by_level(
    api_run: Run, viewer: Any, client_for: Callable[..., Client]
) -> None:
    levels = [LogLevel.DEBUG, LogLevel.INFO, LogLevel.WARNING, LogLevel.ERROR]
    LogLine.objects.bulk_create(
        LogLine(run=api_run, seq=seq, level=levels[seq % 4], message=f"line {seq}", time=timezone.now())
        for seq in range(1, 21)
    )
    client = client_for(viewer)
    url = f"/api/runs/{api_run.pk}/logs"
    first = client.get(f"{url}?limit=8").json()
    assert [line["seq"] for line in first["items"]] == list(range(1, 9))
    assert first["has_more"] is True and first["next_after_seq"] == 8
    rest = client.get(f"{url}?after_seq={first['next_after_seq']}&limit=100").json()
    assert [line["seq"] for line in rest["items"]] == list(range(9, 21)) and rest["has_more"] is False
    warnings = client.get(f"{url}?level=warning").json()["items"]
    assert {line["level"] for line in warnings} == {"warning", "error"}
    assert [line["seq"] for line in warnings] == [s for s in range(1, 21) if s % 4 in (2, 3)]
    empty = client.get(f"{url}?after_seq=20").json()
    assert empty == {"items": [], "next_after_seq": 20, "has_more": False}
    assert client.get(f"{url}?level=loud").status_code == 422
