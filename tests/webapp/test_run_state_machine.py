from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction

from webapp.runs.choices import TRANSITIONS, ParentKind, RunStatus
from webapp.runs.models import InvalidTransition, Run, TransitionConflict

LEGAL = [(frm, to) for frm, targets in TRANSITIONS.items() for to in sorted(targets)]
ILLEGAL = [(frm, to) for frm in RunStatus for to in RunStatus if to not in TRANSITIONS[frm]]


def test_it_lists_the_documented_transitions() -> None:
    assert set(LEGAL) == {
        ("queued", "starting"), ("queued", "cancelled"),
        ("starting", "running"), ("starting", "failed"), ("starting", "cancelled"), ("starting", "lost"),
        ("running", "succeeded"), ("running", "failed"), ("running", "cancelled"), ("running", "lost"),
        # a resume: the same run queued again as its next attempt (webapp.runs.services.resume_run)
        ("succeeded", "queued"), ("failed", "queued"), ("cancelled", "queued"), ("lost", "queued"),
    }  # fmt: skip


@pytest.mark.parametrize(("frm", "to"), LEGAL, ids=[f"{a}->{b}" for a, b in LEGAL])
def test_it_allows_each_legal_transition(make_run, frm, to) -> None:
    run = make_run(status=frm)
    run.transition(to, message="why")
    stored = Run.objects.get(pk=run.pk)
    assert stored.status == to == run.status
    assert stored.status_message == "why"


@pytest.mark.parametrize(("frm", "to"), ILLEGAL, ids=[f"{a}->{b}" for a, b in ILLEGAL])
def test_it_refuses_each_illegal_transition_and_writes_nothing(make_run, frm, to) -> None:
    run = make_run(status=frm, status_message="before")
    before = Run.objects.filter(pk=run.pk).values().get()
    with pytest.raises(InvalidTransition) as caught:
        run.transition(to, message="after", worker_host="w9")
    assert f"cannot go from {frm.value!r} to {to.value!r}" in str(caught.value)
    assert not isinstance(caught.value, TransitionConflict)
    assert Run.objects.filter(pk=run.pk).values().get() == before
    assert run.status == frm


def test_it_names_the_allowed_targets_in_the_error(run) -> None:
    with pytest.raises(InvalidTransition, match="from 'queued' it can go to cancelled, starting"):
        run.transition(RunStatus.SUCCEEDED)


def test_it_says_a_final_status_leads_only_to_a_resume(make_run) -> None:
    with pytest.raises(InvalidTransition, match="'succeeded' is final: only a resume queues it again"):
        make_run(status=RunStatus.SUCCEEDED).transition(RunStatus.RUNNING)


def test_it_lets_only_one_of_two_workers_claim_a_run(run) -> None:
    first, second = Run.objects.get(pk=run.pk), Run.objects.get(pk=run.pk)
    first.start(worker_host="gpu-1")
    with pytest.raises(TransitionConflict, match="no longer 'queued' but 'starting'"):
        second.start(worker_host="gpu-2")
    stored = Run.objects.get(pk=run.pk)
    assert (stored.status, stored.worker_host) == (RunStatus.STARTING, "gpu-1")
    assert second.status == RunStatus.QUEUED  # the loser's instance is untouched


def test_it_refuses_a_transition_when_the_row_changed_underneath(run) -> None:
    Run.objects.filter(pk=run.pk).update(status=RunStatus.CANCELLED)  # e.g. the user cancelled
    with pytest.raises(TransitionConflict, match="another worker or request got there first"):
        run.start(worker_host="cpu-1")
    stored = Run.objects.get(pk=run.pk)
    assert (stored.status, stored.worker_host, stored.started_at) == (RunStatus.CANCELLED, "", None)


def test_it_stamps_start_and_finish_times(run) -> None:
    assert run.started_at is None and run.finished_at is None
    run.start(worker_host="cpu-1")
    assert run.started_at is not None and run.heartbeat_at is not None and run.finished_at is None
    run.transition(RunStatus.RUNNING)
    run.transition(RunStatus.SUCCEEDED)
    stored = Run.objects.get(pk=run.pk)
    assert stored.finished_at is not None and stored.finished_at >= stored.started_at
    assert stored.worker_host == "cpu-1"


def test_it_keeps_a_lost_run_lost_until_a_resume_queues_it(run) -> None:
    """Nothing the engine reports revives a lost run; a resume queues it again, unfinished."""
    run.start(worker_host="cpu-1")
    run.mark_lost()
    assert Run.objects.get(pk=run.pk).status_message == "the worker went silent"
    for state in (RunStatus.STARTING, RunStatus.RUNNING, RunStatus.CANCELLED):
        with pytest.raises(InvalidTransition, match="'lost' is final: only a resume"):
            run.transition(state)
    run.transition(RunStatus.QUEUED)
    assert Run.objects.get(pk=run.pk).finished_at is None


def test_it_cancels_a_queued_run(run) -> None:
    run.cancel()
    assert Run.objects.get(pk=run.pk).status == RunStatus.CANCELLED


@pytest.mark.parametrize("status", list(RunStatus))
def test_it_gives_every_status_a_badge_colour(make_run, status) -> None:
    assert make_run(status=status).status_badge in {
        "secondary",
        "info",
        "primary",
        "success",
        "danger",
        "dark",
        "warning",
    }


def test_it_starts_a_run_queued_on_the_cpu_queue(run) -> None:
    assert (run.status, run.queue, run.last_seq, run.last_step, run.summary, run.tags) == (
        RunStatus.QUEUED, "cpu", 0, 0, {}, []
    )  # fmt: skip


def test_it_records_forks_and_resumes_with_their_kind(make_run, run) -> None:
    fork = make_run(name="fork", parent=run, parent_kind=ParentKind.FORK)
    assert list(run.children.all()) == [fork]
    with pytest.raises(IntegrityError), transaction.atomic():
        make_run(name="orphan kind", parent_kind=ParentKind.RESUME)
    with pytest.raises(IntegrityError), transaction.atomic():
        make_run(name="no kind", parent=run)
