"""Invite links: made and revoked by a team's admins only, shown once, stored hashed; opened by a
new visitor (who makes an account with Django's password validators) or by a signed-in user;
single use, and a used, revoked or expired link says which."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from webapp.teams import invites
from webapp.teams.choices import Role
from webapp.teams.models import Invite, Membership, Team

GOOD_PASSWORD = "river-delta-4417"


def _role(team: Team, user: Any) -> str | None:
    return Membership.objects.filter(team=team, user=user).values_list("role", flat=True).first()


def _make_link(client: Client, team: Team, **fields: Any) -> str:
    """An invite made through the team page; the link as the page shows it (once)."""
    data = {"role": "member", "note": "", "days": "7", **fields}
    response = client.post(f"/teams/{team.pk}/invites/", data)
    assert response.status_code == 302, response.content.decode()[-2000:]
    page = client.get(f"/teams/{team.pk}/").content.decode()
    match = re.search(r'id="new-invite-url" value="http://testserver(/invites/[^"]+/)"', page)
    assert match, page
    return match.group(1)


def test_an_admin_makes_a_link_shown_once_and_stored_hashed(
    client_for: Callable[..., Client], admin: Any, team: Team
) -> None:
    client = client_for(admin)
    link = _make_link(client, team, role="viewer", note="erin@example.com", days="3")
    token = link.split("/")[2]
    assert len(token) >= 43
    invite = Invite.objects.get()
    assert invite.token_hash == invites.token_hash(token) and token not in invite.token_hash
    assert invite.role == Role.VIEWER and invite.note == "erin@example.com" and invite.created_by == admin
    assert timedelta(days=2, hours=23) < invite.expires_at - timezone.now() <= timedelta(days=3)
    again = client.get(f"/teams/{team.pk}/")
    page = again.content.decode()
    assert token not in page and 'id="new-invite-url"' not in page  # shown once
    assert "erin@example.com" in page and f'data-invite-id="{invite.pk}"' in page
    assert "no-cache" in again["Cache-Control"] or "max-age=0" in again["Cache-Control"]


def test_the_default_expiry_is_seven_days(admin: Any, team: Team) -> None:
    invite, _token = invites.create_invite(team, admin, Role.MEMBER)
    left = invite.expires_at - timezone.now()
    assert timedelta(days=6, hours=23) < left <= timedelta(days=7)


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"days": "0"}, "days", "At least 1 day"),
        ({"days": "91"}, "days", "At most 90 days"),
        ({"days": "soon"}, "days", "A whole number of days"),
        ({"role": "owner"}, "role", "Select a valid choice"),
        ({"note": "x" * 201}, "note", "at most 200 characters"),
    ],
)
def test_a_bad_invite_form_names_the_field(
    client_for: Callable[..., Client], admin: Any, team: Team, fields: dict[str, str], field: str, words: str
) -> None:
    data = {"role": "member", "note": "", "days": "7", **fields}
    response = client_for(admin).post(f"/teams/{team.pk}/invites/", data)
    assert response.status_code == 400
    match = re.search(rf'id="error-invite-{field}">([^<]*)<', response.content.decode())
    assert match and words in match.group(1), match
    assert not Invite.objects.exists()


@pytest.mark.parametrize("persona", ["member", "viewer"])
def test_only_admins_make_or_revoke_invites(
    request: pytest.FixtureRequest, client_for: Callable[..., Client], admin: Any, persona: str, team: Team
) -> None:
    invite, _ = invites.create_invite(team, admin, Role.MEMBER)
    client = client_for(request.getfixturevalue(persona))
    assert client.post(f"/teams/{team.pk}/invites/", {"role": "admin", "days": "7"}).status_code == 403
    assert client.post(f"/teams/{team.pk}/invites/{invite.pk}/revoke/").status_code == 403
    page = client.get(f"/teams/{team.pk}/").content.decode()
    assert 'id="invite-form"' not in page and 'id="invites"' not in page
    assert Invite.objects.count() == 1 and Invite.objects.get().revoked_at is None


def test_an_outsider_gets_404(
    client_for: Callable[..., Client], admin: Any, outsider: Any, team: Team
) -> None:
    invite, _ = invites.create_invite(team, admin, Role.MEMBER)
    client = client_for(outsider)
    assert client.post(f"/teams/{team.pk}/invites/", {"role": "admin", "days": "7"}).status_code == 404
    assert client.post(f"/teams/{team.pk}/invites/{invite.pk}/revoke/").status_code == 404


def test_a_new_visitor_makes_an_account_and_joins(client: Client, admin: Any, team: Team) -> None:
    _invite, token = invites.create_invite(team, admin, Role.MEMBER, "newcomer")
    link = f"/invites/{token}/"
    page = client.get(link)
    # The token is in the URL: it never leaves the site in a Referer header, nor sits in a cache.
    assert page.status_code == 200 and page["Referrer-Policy"] == "same-origin"
    assert "no-cache" in page["Cache-Control"] or "max-age=0" in page["Cache-Control"]
    html = page.content.decode()
    assert "Join Alignment" in html and 'id="signup-form"' in html and f"/login/?next={link}" in html

    # Django's password validators speak, at the field.
    weak = client.post(link, {"username": "erin", "password1": "password", "password2": "password"})
    assert weak.status_code == 400 and "too common" in weak.content.decode()
    assert 'id="error-signup-password2"' in weak.content.decode()
    assert not get_user_model().objects.filter(username="erin").exists()

    done = client.post(link, {"username": "erin", "password1": GOOD_PASSWORD, "password2": GOOD_PASSWORD})
    assert done.status_code == 302 and done["Location"] == f"/teams/{team.pk}/"
    erin = get_user_model().objects.get(username="erin")
    assert erin.check_password(GOOD_PASSWORD) and _role(team, erin) == Role.MEMBER
    assert client.get(f"/teams/{team.pk}/").status_code == 200  # signed in as erin
    invite = Invite.objects.get()
    assert invite.used_by == erin and invite.used_at is not None


def test_a_link_works_once(
    client_for: Callable[..., Client], admin: Any, team: Team, django_user_model: Any
) -> None:
    _invite, token = invites.create_invite(team, admin, Role.VIEWER)
    link = f"/invites/{token}/"
    first = client_for()
    assert (
        first.post(
            link, {"username": "one", "password1": GOOD_PASSWORD, "password2": GOOD_PASSWORD}
        ).status_code
        == 302
    )
    second = client_for()
    again = second.post(link, {"username": "two", "password1": GOOD_PASSWORD, "password2": GOOD_PASSWORD})
    assert again.status_code == 410 and "already used" in again.content.decode()
    assert not django_user_model.objects.filter(username="two").exists()  # no account for a dead link
    someone = django_user_model.objects.create_user("three")
    refused = client_for(someone).post(link)
    assert refused.status_code == 410 and _role(team, someone) is None


def test_a_signed_in_user_accepts(
    client_for: Callable[..., Client], admin: Any, outsider: Any, team: Team
) -> None:
    _invite, token = invites.create_invite(team, admin, Role.ADMIN)
    client = client_for(outsider)
    html = client.get(f"/invites/{token}/").content.decode()
    assert 'id="invite-accept"' in html and 'id="signup-form"' not in html
    response = client.post(f"/invites/{token}/")
    assert response.status_code == 302 and _role(team, outsider) == Role.ADMIN


def test_a_member_leaves_the_link_unused(
    client_for: Callable[..., Client], admin: Any, member: Any, team: Team
) -> None:
    _invite, token = invites.create_invite(team, admin, Role.ADMIN)
    client = client_for(member)
    assert 'id="invite-already"' in client.get(f"/invites/{token}/").content.decode()
    response = client.post(f"/invites/{token}/")
    assert response.status_code == 409 and "already in Alignment" in response.content.decode()
    assert _role(team, member) == Role.MEMBER and Invite.objects.get().used_at is None


def test_expired_revoked_and_unknown_links_say_so(
    client_for: Callable[..., Client], admin: Any, outsider: Any, team: Team
) -> None:
    expired, expired_token = invites.create_invite(team, admin, Role.MEMBER)
    Invite.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(minutes=1))
    revoked, revoked_token = invites.create_invite(team, admin, Role.MEMBER, "for-revoke")
    admin_client = client_for(admin)
    assert admin_client.post(f"/teams/{team.pk}/invites/{revoked.pk}/revoke/").status_code == 302
    assert (
        admin_client.post(f"/teams/{team.pk}/invites/{revoked.pk}/revoke/").status_code == 404
    )  # not pending
    assert "for-revoke" not in admin_client.get(f"/teams/{team.pk}/").content.decode()

    for client in (client_for(), client_for(outsider)):
        page = client.get(f"/invites/{expired_token}/")
        assert page.status_code == 410 and "expired on" in page.content.decode()
        page = client.get(f"/invites/{revoked_token}/")
        assert page.status_code == 410 and "revoked by a team admin" in page.content.decode()
        page = client.get(f"/invites/{revoked_token[:-1]}x/")
        assert page.status_code == 404 and "not valid" in page.content.decode()
        page = client.get(f"/invites/{'a' * 500}/")
        assert page.status_code == 404
    assert client_for(outsider).post(f"/invites/{expired_token}/").status_code == 410
    assert _role(team, outsider) is None


def test_accept_refuses_a_link_used_meanwhile(admin: Any, team: Team, django_user_model: Any) -> None:
    """Two people holding the same loaded invite: the conditional UPDATE lets one in."""
    _invite, token = invites.create_invite(team, admin, Role.MEMBER)
    held_by_a, held_by_b = invites.find(token), invites.find(token)
    assert held_by_a is not None and held_by_b is not None
    a, b = django_user_model.objects.create_user("a"), django_user_model.objects.create_user("b")
    invites.accept(held_by_a, a)
    with pytest.raises(invites.InviteRefused, match="already used") as refused:
        invites.accept(held_by_b, b)
    assert refused.value.reason == "used"
    assert _role(team, a) == Role.MEMBER and _role(team, b) is None
    assert invites.find(token + "x") is None and invites.find("") is None
