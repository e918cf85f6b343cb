"""Per-run ingest tokens: what a worker shows to ship one run's events.

Signed with the web app's secret key (``django.core.signing``), scoped to one run id and one
*attempt* of it, and expiring after ``settings.INGEST_TOKEN_MAX_AGE`` seconds. A worker needs
no database credentials, only this token, sent in the ``Authorization: Bearer`` header (never
in the URL: URLs land in access logs).

A token dies with its attempt: ``start_attempt`` (called each time the run is queued) moves
``Run.attempt`` on, so the token of an earlier attempt (a worker still holding a lost queue
message, say) is refused. The web app renews the token over the open socket (``hello`` and
some ``ack`` messages carry a fresh one), so a run longer than the lifetime keeps working,
but never for a run in a final state: such a run's worker may only drain the tail of its
attempt (``webapp.runs.ingest`` refuses anything after the engine's final status).

An external run has one attempt, and one script holds it (``webapp.runs.external``): a copy of
the script's directory may take the run over once its holder has gone silent, so the token alone
does not say who ships. The socket remembers the claim its script attached with, and what it
sends is checked against the run's claim under the same row lock (``check_holder``).
"""

from __future__ import annotations

from django.conf import settings
from django.core import signing
from django.db import transaction
from django.db.models import F

from engine.contracts import CLOSE_BAD_TOKEN, CLOSE_CLAIM_LOST, CLOSE_WRONG_RUN
from webapp.runs.models import Run
from webapp.runs.placement import reporting_from

_SALT = "tributary.ingest"


class TokenRejected(Exception):
    """The token does not let its holder ship this run's events; ``code`` is the close code."""

    def __init__(self, code: int, reason: str) -> None:
        self.code = code
        super().__init__(reason)


def check_holder(run: Run, claim: str) -> None:
    """``TokenRejected`` (``CLOSE_CLAIM_LOST``) when the socket's script no longer holds the
    external run ``run`` (read under its row lock): ``claim`` is the one it attached with, "" for
    a client of before claims (never checked, as before). The script that lost the run stops
    (the client raises ``RunRefused``); its events stay in its directory."""
    if claim and run.claim and run.claim != claim:
        raise TokenRejected(
            CLOSE_CLAIM_LOST,
            f"run {run.pk} was taken over by another copy of this script's run directory, reporting from "
            f"{reporting_from(run.worker_host, run.client_pid)} (this script had gone silent): the web app "
            "takes no more of this script's events. Stop it, or start it as a new run (a new directory)",
        )


def ingest_token(run_id: int, attempt: int | None = None) -> str:
    """A token for ``run_id``'s ``attempt`` (default: the run's current attempt, 0 if none)."""
    if attempt is None:
        attempt = Run.objects.filter(pk=run_id).values_list("attempt", flat=True).first() or 0
    return signing.TimestampSigner(salt=_SALT).sign_object({"run": int(run_id), "attempt": int(attempt)})


def start_attempt(run_id: int) -> str:
    """Begin a new attempt of the run (queued again: every older token stops working) and
    return the token for it. The increment is one UPDATE, so two callers get two attempts."""
    with transaction.atomic():
        Run.objects.filter(pk=run_id).update(attempt=F("attempt") + 1)
        attempt = Run.objects.filter(pk=run_id).values_list("attempt", flat=True).get()
    return ingest_token(run_id, attempt)


def check_ingest_token(token: str, run_id: int) -> int:
    """The attempt ``token`` was signed for, or ``TokenRejected`` unless it is a live token
    for ``run_id``. Whether that attempt is still the run's is the caller's check (it needs
    the run row: ``webapp.runs.ingest.store_events`` and the ingest socket's ``connect``)."""
    if not token:
        raise TokenRejected(CLOSE_BAD_TOKEN, "no token: send the header Authorization: Bearer <the run's ingest token>")
    try:
        payload = signing.TimestampSigner(salt=_SALT).unsign_object(
            token, max_age=settings.INGEST_TOKEN_MAX_AGE
        )
    except signing.SignatureExpired:
        raise TokenRejected(
            CLOSE_BAD_TOKEN,
            f"the token expired (older than {settings.INGEST_TOKEN_MAX_AGE} s): resume the run to get a new one",
        ) from None
    except (signing.BadSignature, ValueError):
        raise TokenRejected(CLOSE_BAD_TOKEN, "the token is not one this web app signed") from None
    if not isinstance(payload, dict) or payload.get("run") != int(run_id):
        raise TokenRejected(CLOSE_WRONG_RUN, f"the token is for another run, not run {run_id}")
    attempt = payload.get("attempt", 0)  # tokens signed before attempts existed: attempt 0
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        raise TokenRejected(CLOSE_BAD_TOKEN, "the token names no valid attempt of the run")
    return attempt
