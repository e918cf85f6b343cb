"""Checkpoints whose files the engine deleted (``checkpoint.keep_last``, or a rewind's left branch)
stay listed but are no longer offered: the engine's ``checkpoint`` event names the paths its save
deleted (``engine.checkpoint.save_checkpoint``), ingest marks those stored before it
(``deleted_at_seq``), and the API, the run page and ``resume_run`` take them out of what a resume
may start from. Before this, the API offered a pruned checkpoint and the resume failed in the
engine ("no checkpoint there")."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from tests.webapp.event_builders import metrics, status
from webapp.live.replay import stored_events
from webapp.runs.choices import RunStatus
from webapp.runs.housekeeping import holdings
from webapp.runs.ingest import store_events
from webapp.runs.models import Checkpoint, Run
from webapp.runs.services import CannotResume, resume_run

JSON = "application/json"


def checkpoint(seq: int, step: int, *deleted_steps: int) -> dict[str, Any]:
    """A checkpoint event as the engine writes it, its save having deleted ``deleted_steps``."""
    return {
        "run": "r",
        "seq": seq,
        "type": "checkpoint",
        "step": step,
        "path": path(step),
        "bytes": 100 + step,
        "deleted": [path(s) for s in deleted_steps],
    }


def path(step: int) -> str:
    return f"/runs/7/checkpoints/step_{step:06d}"


def offered(run: Run) -> list[int]:
    return sorted(run.checkpoints.filter(Checkpoint.offered()).values_list("step", flat=True))


@pytest.fixture
def pruned(run: Run) -> tuple[Run, list[dict[str, Any]]]:
    """A cancelled run that checkpointed steps 2, 4, 6 and 8 with keep_last 2: the saves of 6 and 8
    deleted 2 and 4. Shipped in two batches, so a deletion meets rows of its own batch and of an
    earlier one."""
    run.start(worker_host="cpu-1")
    events = [status(1, "starting"), status(2, "running")]
    for step, deleted in ((2, ()), (4, ()), (6, (2,)), (8, (4,))):
        events += [
            metrics(len(events) + 1, step, loss=1.0 / step),
            checkpoint(len(events) + 2, step, *deleted),
        ]
    events.append(status(len(events) + 1, "cancelled", "cancelled at step 8"))
    first = store_events(run.pk, events[:6])  # through the checkpoint of step 4
    second = store_events(run.pk, events[6:])
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    return run, [*first.events, *second.events]


def test_ingest_marks_what_a_save_deleted_and_pages_hear_it_by_seq(pruned) -> None:
    run, announced = pruned
    rows = run.checkpoints.order_by("seq").values_list("step", "seq", "deleted_at_seq")
    assert list(rows) == [(2, 4, 8), (4, 6, 10), (6, 8, None), (8, 10, None)]
    assert offered(run) == [6, 8]
    # What the run's pages heard live: the seqs, not the paths (a page knows its rows by seq).
    live = [e for e in announced if e["type"] == "checkpoint"]
    assert [(e["step"], e["deleted_seqs"]) for e in live] == [(2, []), (4, []), (6, [4]), (8, [6])]
    assert all("deleted" not in e for e in live)
    # A page catching up from the database hears exactly what was sent live.
    replayed = [
        e for chunk in stored_events(run.pk, 0, run.last_seq) for e in chunk if e["type"] == "checkpoint"
    ]
    assert replayed == [{k: e[k] for k in replayed[0]} for e in live] and set(replayed[0]) == set(live[0]) - {
        "run"
    }


def test_a_deletion_marks_only_rows_stored_before_it(run: Run) -> None:
    """A rewound branch saves the same step again at the same path: a deletion announced before that
    save leaves the new checkpoint offered, and an event that names a path twice or one never
    stored changes nothing else."""
    run.start(worker_host="cpu-1")
    store_events(run.pk, [status(1, "starting"), checkpoint(2, 4), checkpoint(3, 2, 4, 4, 99)])
    store_events(run.pk, [checkpoint(4, 4)])  # the new branch's step 4, at the old one's path
    rows = run.checkpoints.order_by("seq").values_list("step", "seq", "deleted_at_seq")
    assert list(rows) == [(4, 2, 3), (2, 3, None), (4, 4, None)]
    store_events(run.pk, [checkpoint(5, 6, 2, 4)])
    rows = run.checkpoints.order_by("seq").values_list("seq", "deleted_at_seq")
    assert list(rows) == [(2, 3), (3, 5), (4, 5), (5, None)]  # the first deletion of seq 2 is kept


def test_an_event_without_deleted_is_taken_as_deleting_nothing(run: Run) -> None:
    """A client or an older engine may leave the field out."""
    run.start(worker_host="cpu-1")
    event = checkpoint(1, 2)
    del event["deleted"]
    stored = store_events(run.pk, [event])
    assert stored.events[0]["deleted_seqs"] == [] and offered(run) == [2]


def test_resume_never_starts_from_a_deleted_checkpoint(pruned, member: Any) -> None:
    run, _ = pruned
    gone = run.checkpoints.get(step=4)
    with pytest.raises(CannotResume, match=r"\(step 4\) was deleted on the worker .*checkpoint.keep_last"):
        resume_run(run, member, gone)
    run.refresh_from_db()
    assert (run.status, run.attempt_number) == (RunStatus.CANCELLED, 1)
    resumed = resume_run(run, member)  # the default: the newest one still there
    assert (resumed.status, resumed.resume_from.step) == (RunStatus.QUEUED, 8)


def test_a_run_whose_checkpoints_are_all_deleted_says_so(run: Run, member: Any) -> None:
    run.start(worker_host="cpu-1")
    store_events(run.pk, [status(1, "starting"), checkpoint(2, 2)])
    # A later save whose own event never arrived would not delete it; here the engine said it did.
    Checkpoint.objects.filter(run=run).update(deleted_at_seq=3)
    store_events(run.pk, [status(3, "failed", "out of memory")])
    with pytest.raises(CannotResume, match="has no checkpoint to resume from; fork it"):
        resume_run(Run.objects.get(pk=run.pk), member)


def test_the_api_lists_them_deleted_and_refuses_a_resume_from_one(
    pruned, client_for: Callable[..., Client], member: Any
) -> None:
    run, _ = pruned
    client = client_for(member)
    listed = client.get(f"/api/runs/{run.pk}/checkpoints").json()
    listed = listed["items"] if isinstance(listed, dict) else listed
    assert sorted((c["step"], c["deleted"], c["superseded"]) for c in listed) == [
        (2, True, False), (4, True, False), (6, False, False), (8, False, False)
    ]  # fmt: skip
    assert client.get(f"/api/runs/{run.pk}").json()["checkpoint_count"] == 2
    gone = run.checkpoints.get(step=2)
    refused = client.post(f"/api/runs/{run.pk}/resume", {"checkpoint_id": gone.pk}, content_type=JSON)
    assert refused.status_code == 409 and "was deleted on the worker" in refused.content.decode()
    ok = client.post(
        f"/api/runs/{run.pk}/resume", {"checkpoint_id": run.checkpoints.get(step=6).pk}, content_type=JSON
    )
    assert ok.status_code == 200 and ok.json()["status"] == "queued"


def test_the_run_page_lists_them_deleted_and_does_not_offer_them(
    pruned, client_for: Callable[..., Client], member: Any
) -> None:
    run, _ = pruned
    page = client_for(member).get(f"/runs/{run.pk}/").content.decode()
    rows = re.findall(
        r'<tr data-seq="(\d+)"( class="deleted")?[^>]*><td>(\d+)( <span class="muted">\(deleted\)</span>)?',
        page,
    )
    assert [(int(seq), step, bool(cls), bool(note)) for seq, cls, step, note in rows] == [
        (4, "2", True, True), (6, "4", True, True), (8, "6", False, False), (10, "8", False, False)
    ]  # fmt: skip
    assert re.findall(r'<option value="\d+">step (\d+) ', page) == ["8", "6"]
    assert 'data-deleted-title="Its files were deleted on the worker' in page


def test_deleting_the_run_counts_only_the_checkpoints_still_on_disk(pruned) -> None:
    run, _ = pruned
    held = holdings(run)
    assert (held.checkpoints, held.checkpoint_bytes) == (2, 106 + 108)
