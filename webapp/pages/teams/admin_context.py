"""What the team page shows its admins only: the rename form, the invite form, the pending
invites, and a new invite's link.

A new link crosses one redirect in the server-side session (only its hash is stored, so this is
the one time it can be shown) and is removed from the session by the page that shows it: a
reload shows it no more. The team page is never cached.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.urls import reverse

from webapp.pages.teams.forms import InviteForm, TeamNameForm
from webapp.teams import invites
from webapp.teams.models import Invite, Team

NEW_INVITE_KEY = "teams:new-invite"


def remember_new_link(request: HttpRequest, invite: Invite, token: str) -> None:
    request.session[NEW_INVITE_KEY] = {"team": invite.team_id, "invite": invite.pk, "token": token}


def _new_link(request: HttpRequest, team: Team) -> dict[str, Any] | None:
    held = request.session.get(NEW_INVITE_KEY)
    if not isinstance(held, dict) or held.get("team") != team.pk:
        return None
    del request.session[NEW_INVITE_KEY]
    invite = invites.pending_invites(team).filter(pk=held.get("invite")).first()
    if invite is None:  # revoked or used in the meantime: no link worth showing
        return None
    return {"invite": invite, "url": request.build_absolute_uri(reverse("invite", args=[held["token"]]))}


def admin_context(
    request: HttpRequest,
    team: Team,
    invite_form: InviteForm | None = None,
    name_form: TeamNameForm | None = None,
    **_: Any,
) -> dict[str, Any]:
    return {
        "invite_form": invite_form or InviteForm(),
        "name_form": name_form or TeamNameForm(initial={"name": team.name}),
        "pending_invites": list(invites.pending_invites(team)),
        "new_invite": _new_link(request, team),
    }
