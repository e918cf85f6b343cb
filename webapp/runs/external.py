"""External runs: a run whose training happens in the user's own script (issue 17).

The script (the client library, verl's ``follow``, TRL's callback) creates the run through the
API (``POST /api/runs/external``), gets an ingest URL and token, and ships its events over the
same ingest socket a worker's supervisor uses (``tributary.protocol``). Nothing here queues it,
places it, re-sends it, resumes it or marks it lost: it has no worker
(``placement``, ``reconcile``, ``sweeper`` leave ``Run.origin == external`` alone).

Its life, in the state machine of ``webapp.runs.choices``:

- created ``queued``, its status line ``placement.EXTERNAL_WAITING`` (waiting for its script);
- the script's ``attach`` moves it to ``starting``, its status line where it reports from
  (``services.claim_run``); its own status events move it on as an engine's do;
- Cancel records the request and tells the connected script (``cancel`` on the socket,
  ``hello.cancel`` on a reconnect); the run ends with the script's final status.

Idempotent creation: the script names the run with a ``client_id`` (a UUID it keeps, e.g. in its
offline log): the same id in the same project returns the same run with a fresh token, so a
restarted script or a retried request never makes two runs.

One script at a time (``hold_run``). Two scripts with one ``client_id`` (a run directory copied to
a second host, or to a second path, and both started) would share the run, and the ingest store
keeps the first event of each seq, so the second's events, numbered over the first's, would be
dropped while its user believes them stored. A script that gives a ``claim`` (the client library
does: ``tributary.protocol.script_claim``) therefore holds the run: the claim is ``<lineage>.<place>``,
the lineage kept in the run directory (copied with it), the place a digest of the host and the
directory's path (one process at a time there: the client locks the directory). The same claim
keeps the run (a reconnect, a restart in the same directory: the lock says the earlier process
ended); the same lineage from another place takes it over only when the run is final or its
holder went silent for ``HOLDER_SILENT_S`` (a crashed script restarted elsewhere from a copy of
its directory); anything else is refused (``ScriptHeld``, a 409 naming the run, where it reports
from and the fix) before the script gets a token, so nothing of it is stored. Old clients give
no claim and attach as before; the first claim then takes the run.

The config is the script's own, free-form: never validated against the engine's schema and never
executed, only bounded (``MAX_CONFIG_BYTES`` of JSON, ``MAX_CONFIG_DEPTH`` levels, storable text).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from tributary.events import MAX_DEPTH
from tributary.protocol import PING_INTERVAL_S
from tributary.shipper import nesting
from webapp.live import announce
from webapp.runs.choices import RunOrigin, RunStatus
from webapp.runs.models import Run
from webapp.runs.placement import EXTERNAL_WAITING, reporting_from, taken_by
from webapp.runs.services import RunConfigInvalid, check_project_open
from webapp.runs.tokens import ingest_token
from webapp.teams.models import Project

MAX_CONFIG_BYTES = 256 * 1024
"""A script's config as compact JSON: hyperparameters and paths, not data (the engine's own
configs are a few KiB; W&B's run config is similar in practice)."""
MAX_CONFIG_DEPTH = MAX_DEPTH
"""Nesting levels, as an engine event may hold (``tributary.events.MAX_DEPTH``)."""
QUEUE = "external"
"""What ``Run.queue`` holds for an external run: no worker queue (none is ever sent to it)."""
HOLDER_SILENT_S = 3 * PING_INTERVAL_S
"""How long the script holding a run must have been silent (no event stored, no ping, no
connection: ``Run.heartbeat_at``, ``Run.worker_seen_at``) before a copy of its directory elsewhere
may take the run over. A live script pings every ``PING_INTERVAL_S`` when it has nothing to send
(the socket writes that down at most every 5 s): three pings missed is a script gone, or cut off."""


class ExternalRefused(ValueError):
    """The external run cannot be created or given a token as asked (a 409: the project's or
    the run's state forbids it); the message says why and what to do."""


class ScriptHeld(ExternalRefused):
    """Another script holds the run (``hold_run``): the 409 says which run, where that script
    reports from (``held_by``), and to start this one as a new run."""

    def __init__(self, message: str, held_by: str) -> None:
        super().__init__(message)
        self.held_by = held_by


def check_config(config: Any) -> dict[str, Any]:
    """The script's config as stored, or ``RunConfigInvalid`` naming ``config`` and the bound.

    An object, at most ``MAX_CONFIG_DEPTH`` levels deep and ``MAX_CONFIG_BYTES`` as JSON. That its
    text and numbers are storable is the API's ``JsonValue``'s check (``webapp.inputs.json_problem``);
    the web import's config is the web app's own."""
    if not isinstance(config, dict):
        raise RunConfigInvalid(
            [("config", f"must be an object of the script's settings, got {type(config).__name__}")]
        )
    depth = nesting(config, MAX_CONFIG_DEPTH)
    if depth > MAX_CONFIG_DEPTH:
        raise RunConfigInvalid(
            [("config", f"nests deeper than {MAX_CONFIG_DEPTH} levels: flatten it (e.g. 'optim.lr': 1e-5)")]
        )
    size = len(json.dumps(config, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    if size > MAX_CONFIG_BYTES:
        raise RunConfigInvalid(
            [
                (
                    "config",
                    f"is {size} bytes as JSON; the limit is {MAX_CONFIG_BYTES}: keep settings there and "
                    "log data (datasets, prompts) as samples or files",
                )
            ]
        )
    return config


def create_external_run(
    project: Project,
    user: Any,
    *,
    name: str,
    config: dict[str, Any],
    tags: list[str],
    client_id: uuid.UUID | None,
) -> tuple[Run, bool]:
    """The external run of ``client_id`` in ``project`` (created now, or the one made before with
    it) and whether it was created. Its attempt 1 comes with it (``Run.save``)."""
    config = check_config(config)
    if client_id is not None:
        found = Run.objects.filter(project=project, client_id=client_id).first()
        if found is not None:  # its script again (a restart, a retry): archived since or not
            return found, False
    check_project_open(project)
    try:
        with transaction.atomic():
            run = Run.objects.create(
                project=project,
                created_by=user if getattr(user, "is_authenticated", False) else None,
                name=name.strip()[:200],
                config=config,
                tags=list(tags),
                origin=RunOrigin.EXTERNAL,
                client_id=client_id,
                queue=QUEUE,
                attempt=1,
                status=RunStatus.QUEUED,
                status_message=EXTERNAL_WAITING,
            )
            announce.status_changed(run.pk, queue_moved=False)
    except IntegrityError:
        # Two requests with one client_id at once: the constraint let one in; this is the other.
        found = Run.objects.filter(project=project, client_id=client_id).first() if client_id else None
        if found is None:
            raise
        return found, False
    return run, True


def token_for(run: Run) -> str:
    """A fresh ingest token for the external run's script (its one attempt), or
    ``ExternalRefused`` for an engine run: only its worker ships its events."""
    if not run.is_external:
        raise ExternalRefused(
            f"run {run.pk} is an engine run: its worker ships its events with the token its queue "
            "message carries; ingest tokens are given out for external runs only"
        )
    return ingest_token(run.pk, run.attempt)


def split_claim(claim: str) -> tuple[str, str]:
    """A script's claim as (lineage, place); a claim of another client with no place is all lineage."""
    lineage, dot, place = claim.rpartition(".")
    return (lineage, place) if dot and lineage else (claim, "")


def held_elsewhere(run: Run, claim: str, now: Any) -> str:
    """Why ``claim`` may not hold the external run (another script does), or "" when it may.

    See the module docstring: the run's own claim (or none yet) holds; the same lineage from
    another place takes over a final run or one whose holder is silent; another lineage never."""
    held = run.claim
    if not held or held == claim:
        return ""
    where = reporting_from(run.worker_host, run.client_pid)
    which = f"run {run.pk} ({run.name!r})"
    fix = (
        "Start this script as a new run (a new directory, not resume= of a copy: a new client_id), "
        "or stop the other one"
    )
    if split_claim(held)[0] != split_claim(claim)[0]:
        return (
            f"{which} is reported by another script, from {where}, under the same client_id: the web app "
            f"keeps the first event of each seq, so this script's events would be dropped. {fix}."
        )
    if RunStatus(run.status).is_final:
        return ""  # nobody ships into it any more: a restart may drain its tail, as before claims
    heard = max((t for t in (run.worker_seen_at, run.heartbeat_at) if t is not None), default=None)
    silent = HOLDER_SILENT_S if heard is None else (now - heard).total_seconds()
    if silent >= HOLDER_SILENT_S:
        return ""  # its holder is gone (crashed): this copy of its directory goes on with the run
    return (
        f"{which} is being reported from {where} (heard {max(silent, 0.0):.0f} s ago) by another copy of this "
        f"script's run directory: both would send the same seqs, and the web app keeps only the first's. "
        f"{fix}; if that script has stopped, run this one again after {HOLDER_SILENT_S:.0f} s without word "
        "from it to go on with the run."
    )


def hold_run(run_id: int, claim: str, host: str, pid: int | None) -> Run | None:
    """The external run, held by the script of ``claim`` from ``host`` (pid ``pid``): its claim
    taken or kept, ``ScriptHeld`` when another script holds it (nothing recorded). Called
    before a token is given out (``webapp.api.routers.external``), so a refused script never
    ships. A script that takes the run over records where it reports from at once: a second
    copy asking a moment later is refused on its word. None when the run is gone."""
    with transaction.atomic():
        run = Run.objects.select_for_update().filter(pk=run_id).first()
        if run is None:
            return None
        now = timezone.now()
        why = held_elsewhere(run, claim, now)
        if why:
            raise ScriptHeld(why, run.worker_host)
        fields: dict[str, Any] = {"worker_seen_at": now}
        if run.claim != claim:
            fields.update(claim=claim, worker_host=host, client_pid=pid)
        Run.objects.filter(pk=run.pk).update(**fields)
        for name, value in fields.items():
            setattr(run, name, value)
    return run


def attach_script(run_id: int, host: str, pid: int | None, claim: str = "") -> tuple[bool, str] | None:
    """The external run's script attached to its ingest socket (``attach``: its host and pid).

    With a ``claim``: the answer ``(won, why not)`` of ``held_elsewhere``, under the same row
    lock as the attach, a refused script changing nothing. Without one (a client of before claims),
    the script holds its run with no claim to win (a restarted script, with a new process,
    carries on the same run; only the token says who may ship), and None.
    A queued run becomes starting, its status line where the script reports from; a started one
    notes the script's new host and pid (a restart) until the script's own status says more."""
    with transaction.atomic():
        run = Run.objects.select_for_update().filter(pk=run_id).first()
        if run is None:
            return (False, f"run {run_id} does not exist") if claim else None
        now = timezone.now()
        if claim:
            why = held_elsewhere(run, claim, now)
            if why:
                return False, why
        where = taken_by(host, external=True, pid=pid)
        fields: dict[str, Any] = {"worker_host": host, "client_pid": pid, "worker_seen_at": now}
        if claim:
            fields["claim"] = claim
        if run.status == RunStatus.QUEUED:
            run.transition(RunStatus.STARTING, message=where, **fields)
            announce.status_changed(run.pk, queue_moved=False)
        elif not RunStatus(run.status).is_final and (
            (run.worker_host, run.client_pid) != (host, pid) or (claim and run.claim != claim)
        ):
            if run.status == RunStatus.STARTING:  # still the words of an attach: the new ones
                fields["status_message"] = where
            Run.objects.filter(pk=run.pk).update(**fields)
            announce.status_changed(run.pk, queue_moved=False)
        else:
            Run.objects.filter(pk=run.pk).update(worker_seen_at=now)
    return (True, "") if claim else None


def banner(run: Run) -> str:
    """The run page's line for an external run: where its script reports from, or that the page
    waits for it (before its first ``attach``)."""
    final = RunStatus(run.status).is_final
    if not run.worker_host and run.client_pid is None:
        return "external run" if final else "external run · waiting for its script"
    verb = "reported" if final else "reporting"
    return f"external run · {verb} from {reporting_from(run.worker_host, run.client_pid)}"
