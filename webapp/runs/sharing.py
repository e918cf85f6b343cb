"""Share links: the run a token opens, and revoking one (the token stops working, and sockets
already open with it close)."""

from __future__ import annotations

from django.http import Http404
from django.utils import timezone

from webapp.live import announce
from webapp.live.groups import share_group
from webapp.runs.models import Run, ShareLink


def shared_run_or_404(token: str) -> Run:
    """The run a live share token opens; 404 for an unknown or revoked token alike (a page must
    not tell which tokens once existed)."""
    run = ShareLink.run_for_token(token)
    if run is None:
        raise Http404("this share link does not exist or was revoked")
    return run


def revoke_share_link(run: Run, link_id: int) -> bool:
    """Revoke the run's link ``link_id`` (False: the run has no such link). Revoking twice is
    harmless. Sockets already open with it close once the revocation commits, not only new
    connections."""
    link = ShareLink.objects.filter(pk=link_id, run=run).first()
    if link is None:
        return False
    if ShareLink.objects.filter(pk=link.pk, revoked_at=None).update(revoked_at=timezone.now()):
        announce.access_changed(share_group(link.pk), "the share link was revoked")
    return True
