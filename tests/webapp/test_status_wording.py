"""A run's status message on a page and in the API: words and the page's action, not the
worker's paths and the engine's CLI flags (webapp/runs/wording.py).

The engine's messages below are written as engine/run.py, engine/checkpoint.py and
engine/trainer/deepspeed_backend.py format them; the stored message keeps them as they are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from tests.webapp.event_builders import status
from webapp.live.announce import status_message
from webapp.runs.choices import RunStatus
from webapp.runs.ingest import store_events
from webapp.runs.models import Run
from webapp.runs.wording import status_words

RUN_DIR = "/var/lib/tributary/runs/17"
CHECKPOINT = f"{RUN_DIR}/checkpoints/step_000031"
STOPPED = f"stopped at step 31; resume with --resume {RUN_DIR}"
STOPPED_WORDS = "stopped at step 31 and saved a checkpoint: resume the run to continue from it"


@pytest.mark.parametrize(
    ("engine", "page"),
    [
        (STOPPED, STOPPED_WORDS),
        ("stopped at step 31; resume with --resume /data/my runs/17", STOPPED_WORDS),  # a space in the path
        (f"resuming from {CHECKPOINT}", "resuming from the checkpoint of step 31"),
        ("resuming from /elsewhere/latest", "resuming from the checkpoint"),
        (
            f"FileNotFoundError: --resume {CHECKPOINT}: no checkpoint there "
            "(expected a step_* directory with state.json)",
            "FileNotFoundError: the checkpoint of step 31 to resume from could not be read on this worker",
        ),
        (
            f"ValueError: --resume {CHECKPOINT}: no DeepSpeed checkpoint there ({CHECKPOINT}/deepspeed/tag is "
            "missing); a checkpoint of a trainer.backend 'torch' run resumes with backend torch, or start a "
            "new run with model.path set to that checkpoint",
            "ValueError: the checkpoint of step 31 to resume from holds no DeepSpeed state; a checkpoint of a "
            "trainer.backend 'torch' run resumes with backend torch, or start a new run with model.path set "
            "to that checkpoint",
        ),
    ],
)
def test_engine_messages_become_words_without_a_path_or_a_flag(engine: str, page: str) -> None:
    words = status_words(engine)
    assert words == page
    assert "--" not in words and "/" not in words
    assert status_words(words) == words  # what is already words stays as it is


@pytest.mark.parametrize(
    "message",
    [
        "",
        "loading model and data",
        "training on cpu",
        "resumed at step 31, training on cuda:0",
        "finished 12 steps",
        "stopped before the first step: no checkpoint to resume from, start it again",
        "cancelled by bob-member",
        "ValueError: reward.functions[1].weight must be finite",
    ],
)
def test_messages_that_are_words_already_pass_unchanged(message: str) -> None:
    assert status_words(message) == message


@pytest.mark.parametrize(
    ("stored", "words"),
    [("step 0 of 300 on cpu", "training on cpu"), ("step 31 of 300 on cuda:0", "resumed at step 31, training on cuda:0")],
)
def test_an_old_engines_step_count_becomes_what_stays_true(stored: str, words: str) -> None:
    assert status_words(stored) == words


# --- everywhere the message leaves the web app -----------------------------------------------------


@pytest.fixture
def stopped(make_run: Callable[..., Run], valid_config: dict[str, Any]) -> Run:
    run = make_run(config=valid_config)
    Run.objects.filter(pk=run.pk).update(status=RunStatus.CANCELLED, status_message=STOPPED, last_step=31)
    run.refresh_from_db()
    return run


def _no_terminal_words(text: str) -> None:
    assert "--resume" not in text and RUN_DIR not in text


def test_the_run_page_shows_words(client_for: Callable[..., Client], member: Any, stopped: Run) -> None:
    html = client_for(member).get(f"/runs/{stopped.pk}/").content.decode()
    _no_terminal_words(html)
    alert = re.search(r'<p id="run-alert"[^>]*>(.*?)</p>', html, re.S)
    assert alert and STOPPED_WORDS in alert.group(1)
    data = re.search(r'<script id="run-data" type="application/json">(.*?)</script>', html, re.S)
    assert data and json.loads(data.group(1))["run"]["message"] == STOPPED_WORDS


def test_the_api_and_the_runs_table_show_words(
    client_for: Callable[..., Client], member: Any, stopped: Run
) -> None:
    client = client_for(member)
    assert client.get(f"/api/runs/{stopped.pk}").json()["status_message"] == STOPPED_WORDS
    listed = client.get(f"/api/projects/{stopped.project_id}/runs").json()["items"]
    assert [r["status_message"] for r in listed] == [STOPPED_WORDS]
    table = client.get(f"/projects/{stopped.project_id}/").content.decode()
    _no_terminal_words(table)
    assert f'title="{STOPPED_WORDS}"' in table
    # Stored as the engine wrote it: the operator's admin and the event log keep the original.
    assert Run.objects.get(pk=stopped.pk).status_message == STOPPED


def test_the_sockets_status_message_shows_words(stopped: Run) -> None:
    assert status_message(stopped)["message"] == STOPPED_WORDS


def test_the_engines_status_event_reaches_the_browser_in_words(run: Run) -> None:
    run.start(worker_host="cpu-1")
    stored = store_events(
        run.pk, [status(1, "running", "step 0 of 40 on cpu"), status(2, "cancelled", STOPPED)]
    )
    # "step 0 of 40" is what engines before "training on cpu" wrote: stale after step 0.
    assert [e["message"] for e in stored.events] == ["training on cpu", STOPPED_WORDS]
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED and run.status_message == STOPPED


def test_a_path_is_read_back_to_its_own_flag() -> None:
    """Two "--resume" in one message (an earlier one quoted in the text): the path is the one just
    before the marker, and only that part is rewritten."""
    message = "tried --resume twice; --resume /r/1/checkpoints/step_000007: no checkpoint there (missing)"
    assert status_words(message) == (
        "tried --resume twice; the checkpoint of step 7 to resume from could not be read on this worker"
    )
