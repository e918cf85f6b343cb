"""One script per external run (``webapp.runs.external.hold_run``): two scripts with one
``client_id`` would send the same seqs and the ingest store keeps only the first's, so a script's
claim holds the run, and a second script is refused before it gets a token (409 with ``held_by``).

The claim is ``<lineage>.<place>`` (``tributary.protocol.script_claim``): the same claim keeps the
run; the same lineage from another place (a copy of the run directory) takes it over only once
the run is final or its holder has been silent ``HOLDER_SILENT_S``; another lineage never. No
claim: as before claims (old clients)."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from tributary.protocol import script_claim
from webapp.runs.choices import RunStatus
from webapp.runs.external import HOLDER_SILENT_S, attach_script
from webapp.runs.models import Run
from webapp.runs.tokens import check_ingest_token
from webapp.teams.models import Project

LINEAGE = uuid.uuid4().hex
HERE = script_claim(LINEAGE, "gpu-7", "/runs/a")
COPY_ELSEWHERE = script_claim(LINEAGE, "gpu-8", "/runs/a")  # the same directory, copied to another host
COPY_HERE = script_claim(LINEAGE, "gpu-7", "/runs/a-copy")  # ... or to another path of the same host
OTHER_LINEAGE = script_claim(uuid.uuid4().hex, "gpu-9", "/runs/b")


def _post(token: str, path: str, body: dict[str, Any] | None) -> Any:
    headers = {"Authorization": f"Bearer {token}"}
    if body is None:  # a client of before claims renewing its token: no body at all
        return Client().post(path, headers=headers)
    return Client().post(path, json.dumps(body), content_type="application/json", headers=headers)


def _create(token: str, client_id: str, **script: Any) -> Any:
    body = {"project": "gsm8k", "name": "my-trl-run", "config": {"lr": 1e-6}, "client_id": client_id}
    return _post(token, "/api/runs/external", {**body, **script})


@pytest.fixture
def script(member: Any, project: Project, token_for: Any) -> Any:
    """``script(claim, host, pid)``: the answer to a script of one client_id asking for its run."""
    token, client_id = token_for(member), str(uuid.uuid4())

    def ask(claim: str | None, host: str = "gpu-7", pid: int = 100) -> Any:
        return _create(token, client_id, claim=claim, host=host, pid=pid)

    ask.token = token
    return ask


def _silence(run_id: int, seconds: float) -> None:
    """The holder last heard ``seconds`` ago (no event stored, no ping since)."""
    then = timezone.now() - timedelta(seconds=seconds)
    Run.objects.filter(pk=run_id).update(worker_seen_at=then, heartbeat_at=then)


def test_a_second_script_with_the_same_client_id_gets_no_token(script: Any) -> None:
    first = script(HERE)
    assert first.status_code == 201, first.content
    run_id = first.json()["id"]
    run = Run.objects.get(pk=run_id)
    assert (run.claim, run.worker_host, run.client_pid) == (HERE, "gpu-7", 100)
    for claim, host in ((COPY_ELSEWHERE, "gpu-8"), (COPY_HERE, "gpu-7"), (OTHER_LINEAGE, "gpu-9")):
        refused = script(claim, host=host, pid=200)
        assert refused.status_code == 409, refused.content
        body = refused.json()
        assert "ingest_token" not in body and body["held_by"] == "gpu-7"
        assert f"run {run_id} ('my-trl-run')" in body["detail"] and "gpu-7 (pid 100)" in body["detail"]
        assert "new run" in body["detail"] and "client_id" in body["detail"]
        # Renewing a token is refused as well: a refused script never ships.
        renew = _post(script.token, f"/api/runs/{run_id}/ingest-token", {"claim": claim, "host": host})
        assert renew.status_code == 409 and renew.json()["held_by"] == "gpu-7"
    assert Run.objects.get(pk=run_id).claim == HERE  # nothing of the refused ones was recorded
    # The holder itself, asking again (a retry, a restart in its own directory, a new pid): 200.
    again = script(HERE, pid=101)
    assert again.status_code == 200 and check_ingest_token(again.json()["ingest_token"], run_id) == 1


def test_a_copy_takes_over_once_its_holder_is_silent_or_the_run_is_final(script: Any) -> None:
    run_id = script(HERE).json()["id"]
    _silence(run_id, HOLDER_SILENT_S - 5)
    refused = script(COPY_ELSEWHERE, host="gpu-8")
    assert refused.status_code == 409 and f"after {HOLDER_SILENT_S:.0f} s" in refused.json()["detail"]
    # The script crashed: after HOLDER_SILENT_S without word from it, its copy goes on with the run.
    _silence(run_id, HOLDER_SILENT_S + 1)
    taken = script(COPY_ELSEWHERE, host="gpu-8", pid=300)
    assert taken.status_code == 200 and taken.json()["id"] == run_id
    run = Run.objects.get(pk=run_id)
    assert (run.claim, run.worker_host, run.client_pid) == (COPY_ELSEWHERE, "gpu-8", 300)
    # ... and now holds it: the first place is the other copy (heard from just now).
    assert script(HERE).status_code == 409
    # Another lineage is refused even when the holder is silent: it is another script's run.
    _silence(run_id, HOLDER_SILENT_S * 10)
    assert script(OTHER_LINEAGE, host="gpu-9").status_code == 409
    # A final run: a restart of its lineage may drain its tail (as before claims), another lineage not.
    Run.objects.filter(pk=run_id).update(status=RunStatus.SUCCEEDED, worker_seen_at=timezone.now())
    assert script(HERE).status_code == 200
    assert script(OTHER_LINEAGE, host="gpu-9").status_code == 409


def test_scripts_without_a_claim_work_as_before(script: Any) -> None:
    old = script(None)
    assert old.status_code == 201
    run_id = old.json()["id"]
    assert script(None, host="elsewhere").status_code == 200  # no claim: no check, as before
    assert _post(script.token, f"/api/runs/{run_id}/ingest-token", None).status_code == 200
    assert _post(script.token, f"/api/runs/{run_id}/ingest-token", {}).status_code == 200
    # The first script with a claim takes a run only clients of before attached.
    assert script(HERE).status_code == 200 and Run.objects.get(pk=run_id).claim == HERE
    assert script(None, host="elsewhere").status_code == 200  # an old client is not checked
    assert script(COPY_HERE).status_code == 409


def test_a_bad_claim_names_the_field(script: Any) -> None:
    for bad in ("", "x" * 65, "has space", "a/b"):
        answer = script(bad)
        assert answer.status_code == 422, (bad, answer.content)
        assert any(e["loc"][-1] == "claim" for e in answer.json()["detail"])


def test_the_sockets_attach_answers_with_the_same_rule(script: Any) -> None:
    """``attach_script`` with a claim (what the ingest socket's ``attach`` carries): the holder
    wins and the run starts; another copy loses, changing nothing; no claim: None, as before."""
    run_id = script(HERE).json()["id"]
    assert attach_script(run_id, "gpu-7", 100, HERE) == (True, "")
    run = Run.objects.get(pk=run_id)
    assert (
        run.status == RunStatus.STARTING
        and run.status_message == "its script is reporting from gpu-7 (pid 100)"
    )
    won, why = attach_script(run_id, "gpu-8", 200, COPY_ELSEWHERE)
    assert not won and f"run {run_id}" in why and "gpu-7 (pid 100)" in why
    after = Run.objects.get(pk=run_id)
    assert (after.claim, after.worker_host, after.client_pid) == (HERE, "gpu-7", 100)
    assert attach_script(run_id, "gpu-8", 200) is None  # a client of before claims: not checked
    assert attach_script(run_id + 1000, "gpu-7", 100, HERE) == (False, f"run {run_id + 1000} does not exist")
