"""Per-run ingest tokens: what a worker shows to ship one run's events.

Signed with the web app's secret key (``django.core.signing``), scoped to one run id and
expiring after ``settings.INGEST_TOKEN_MAX_AGE`` seconds. A worker needs no database
credentials, only this token; the web app renews it over the open socket (``hello`` and
some ``ack`` messages carry a fresh one), so a run longer than the lifetime keeps working.
"""

from __future__ import annotations

from django.conf import settings
from django.core import signing

from jobs.protocol import CLOSE_BAD_TOKEN, CLOSE_WRONG_RUN

_SALT = "tributary.ingest"


class TokenRejected(Exception):
    """The token does not let its holder ship this run's events; ``code`` is the close code."""

    def __init__(self, code: int, reason: str) -> None:
        self.code = code
        super().__init__(reason)


def ingest_token(run_id: int) -> str:
    return signing.TimestampSigner(salt=_SALT).sign_object({"run": int(run_id)})


def check_ingest_token(token: str, run_id: int) -> None:
    """Raise ``TokenRejected`` unless ``token`` is a live token for ``run_id``."""
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
    except signing.BadSignature:
        raise TokenRejected(CLOSE_BAD_TOKEN, "the token is not one this web app signed") from None
    if not isinstance(payload, dict) or payload.get("run") != int(run_id):
        raise TokenRejected(CLOSE_WRONG_RUN, f"the token is for another run, not run {run_id}")
