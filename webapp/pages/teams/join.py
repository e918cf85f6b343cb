"""Opening an invite link (``/invites/<token>/``): a signed-out visitor makes an account and joins
the team in one step; a signed-in user accepts. A link that no longer works says why (used,
revoked, expired: 410; not a link at all: 404) and what to do.

The account and the team membership are made in one transaction with the invite's use
(``webapp.teams.invites.accept``), so a link that another visitor used a moment earlier makes no
account. The page carries the token in its URL: it is never cached, and the site's referrer
policy (``same-origin``, Django's default) keeps the URL from other sites. Not ``no-referrer``:
under it a browser sends ``Origin: null`` with the page's own form, which CSRF checks refuse.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.contrib.auth import login
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods

from webapp.pages.teams.forms import SignUpForm
from webapp.teams import invites
from webapp.teams.models import Invite

TEMPLATE = "pages/teams/invite.html"
SIGN_IN_BACKEND = "django.contrib.auth.backends.ModelBackend"


def _render(request: HttpRequest, context: dict[str, Any], status: int = 200) -> HttpResponse:
    return render(request, TEMPLATE, context, status=status)


def _refused(request: HttpRequest, invite: Invite | None, reason: str, message: str) -> HttpResponse:
    status = 404 if reason == "unknown" else 409 if reason == "member" else 410
    return _render(request, {"invite": invite, "refused": message, "reason": reason}, status=status)


@never_cache
@require_http_methods(["GET", "POST"])
def invite_page(request: HttpRequest, token: str) -> HttpResponse:
    invite = invites.find(token)
    state = invites.state_of(invite)
    if not state.ok or invite is None:
        return _refused(request, invite, state.reason, state.message)
    here = reverse("invite", args=[token])
    context: dict[str, Any] = {
        "invite": invite,
        "here": here,
        "sign_in_url": f"{reverse('login')}?next={here}",
    }
    user = request.user
    if user.is_authenticated:
        if request.method == "POST":
            try:
                invites.accept(invite, user)
            except invites.InviteRefused as exc:
                return _refused(request, invite, exc.reason, str(exc))
            messages.success(request, f"You joined {invite.team.name} as {invite.role}.")
            return redirect(invite.team)
        if invite.team.memberships.filter(user=user).exists():
            context["already"] = True
        return _render(request, context)
    form = SignUpForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            with transaction.atomic():
                new_user = form.save()
                invites.accept(invite, new_user)
        except invites.InviteRefused as exc:  # used up meanwhile: the account was not made
            return _refused(request, invite, exc.reason, str(exc))
        login(request, new_user, backend=SIGN_IN_BACKEND)
        messages.success(
            request, f"Welcome, {new_user.get_username()}: you joined {invite.team.name} as {invite.role}."
        )
        return redirect(invite.team)
    context["form"] = form
    return _render(request, context, status=400 if request.method == "POST" else 200)
