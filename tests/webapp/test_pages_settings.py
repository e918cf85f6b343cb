"""The settings page: personal API tokens (made, shown once, listed with their last use,
revoked) and the password change, as a signed-in user does it with plain forms."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime, time, timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from webapp.api.models import ApiToken

PASSWORD = "an old pass phrase"
NEW_PASSWORD = "a brand new pass phrase 42"
JSON = "application/json"
SECRET = re.compile(r'id="new-token-secret" value="(trb_[^"]+)"')


@pytest.fixture(autouse=True)
def _fast_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast, test-only


def bearer(token: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


def make_token(client: Client, name: str, expires_on: str = "") -> str:
    """Create a token through the form; the secret the page it redirects to shows."""
    response = client.post("/settings/tokens/", {"name": name, "expires_on": expires_on})
    assert response.status_code == 302 and response["Location"] == "/settings/", response.content[:500]
    found = SECRET.search(client.get("/settings/").content.decode())
    assert found, "the page after creating a token shows no secret"
    return found.group(1)


def row(html: str, token: ApiToken) -> str:
    start = html.index(f'<tr data-token-id="{token.pk}"')
    return html[start : html.index("</tr>", start)]


def test_the_settings_page_needs_a_sign_in_and_the_topbar_links_to_it(
    client: Client, client_for: Callable[..., Client], member: Any
) -> None:
    assert client.get("/settings/")["Location"].startswith("/login/")
    assert client.post("/settings/tokens/", {"name": "x"})["Location"].startswith("/login/")
    assert not ApiToken.objects.exists()
    response = client_for(member).get("/settings/")
    assert response.status_code == 200
    assert '<a href="/settings/"' in response.content.decode()
    assert "no-store" in response["Cache-Control"]  # it may show a secret: never cached


def test_a_new_token_is_shown_once_and_authenticates_the_api(
    client_for: Callable[..., Client], member: Any
) -> None:
    client = client_for(member)
    secret = make_token(client, "  laptop script  ")
    again = client.get("/settings/").content.decode()
    assert secret not in again and 'id="new-token"' not in again  # a reload shows it no more

    token = ApiToken.objects.get(user=member)
    assert token.name == "laptop script" and token.expires_at is None and secret.startswith(token.prefix)
    me = client_for(None).get("/api/me", **bearer(secret))
    assert me.status_code == 200 and me.json()["username"] == member.username


def test_the_list_shows_expiry_and_last_use(client_for: Callable[..., Client], member: Any) -> None:
    client = client_for(member)
    day = timezone.localdate() + timedelta(days=30)
    secret = make_token(client, "ci", expires_on=day.isoformat())
    token = ApiToken.objects.get(user=member)
    assert token.expires_at == timezone.make_aware(datetime.combine(day + timedelta(days=1), time.min))
    html = client.get("/settings/").content.decode()
    assert f"{(day + timedelta(days=1)).isoformat()} 00:00" in row(html, token)
    assert '<td class="token-last-used"><span class="muted">never</span>' in row(html, token)

    assert client_for(None).get("/api/me", **bearer(secret)).status_code == 200
    token.refresh_from_db()
    assert token.last_used_at is not None
    shown = timezone.localtime(token.last_used_at).strftime("%Y-%m-%d %H:%M")
    assert '<td class="token-last-used"><time datetime=' in row(
        client.get("/settings/").content.decode(), token
    )
    assert shown in row(client.get("/settings/").content.decode(), token)


def test_an_expired_token_stops_working_and_is_listed_as_expired(
    client_for: Callable[..., Client], member: Any
) -> None:
    client = client_for(member)
    secret = make_token(client, "short-lived", expires_on=timezone.localdate().isoformat())
    token = ApiToken.objects.get(user=member)
    assert client_for(None).get("/api/me", **bearer(secret)).status_code == 200
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert client_for(None).get("/api/me", **bearer(secret)).status_code == 401
    assert 'data-state="expired"' in row(client.get("/settings/").content.decode(), token)


def test_the_form_names_a_bad_name_or_a_past_day(client_for: Callable[..., Client], member: Any) -> None:
    client = client_for(member)
    blank = client.post("/settings/tokens/", {"name": "   ", "expires_on": ""})
    assert blank.status_code == 400 and 'id="error-token-name"' in blank.content.decode()
    past = (timezone.localdate() - timedelta(days=1)).isoformat()
    late = client.post("/settings/tokens/", {"name": "old", "expires_on": past})
    assert late.status_code == 400 and "This day has passed" in late.content.decode()
    assert not ApiToken.objects.exists()


def test_revoking_stops_the_token_and_keeps_it_listed(client_for: Callable[..., Client], member: Any) -> None:
    client = client_for(member)
    secret = make_token(client, "to revoke")
    token = ApiToken.objects.get(user=member)
    response = client.post(f"/settings/tokens/{token.pk}/revoke/")
    assert response.status_code == 302 and response["Location"] == "/settings/"
    assert client_for(None).get("/api/me", **bearer(secret)).status_code == 401
    html = client.get("/settings/").content.decode()
    assert 'data-state="revoked"' in row(html, token) and "Revoked the token" in html


def test_another_users_token_is_a_404_and_stays_working(
    client_for: Callable[..., Client], member: Any, outsider: Any, token_for: Callable[[Any], str]
) -> None:
    secret = token_for(member)
    token = ApiToken.objects.get(user=member)
    other = client_for(outsider)
    assert other.post(f"/settings/tokens/{token.pk}/revoke/").status_code == 404
    assert other.post("/settings/tokens/999999/revoke/").status_code == 404
    assert 'data-token-id="' not in other.get("/settings/").content.decode()  # not even listed
    assert client_for(None).get("/api/me", **bearer(secret)).status_code == 200


def test_the_forms_need_the_csrf_token(member: Any) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(member)
    assert client.post("/settings/tokens/", {"name": "x"}).status_code == 403
    assert not ApiToken.objects.exists()


def test_a_wrong_old_password_is_named_and_changes_nothing(
    client_for: Callable[..., Client], member: Any
) -> None:
    member.set_password(PASSWORD)
    member.save()
    response = client_for(member).post(
        "/settings/password/",
        {"old_password": "not it", "new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD},
    )
    assert response.status_code == 400
    assert 'id="error-password-old_password"' in response.content.decode()
    assert 'id="token-create-form"' in response.content.decode()  # in the settings page
    member.refresh_from_db()
    assert member.check_password(PASSWORD)


def test_a_weak_new_password_is_refused_by_the_validators(
    client_for: Callable[..., Client], member: Any
) -> None:
    member.set_password(PASSWORD)
    member.save()
    response = client_for(member).post(
        "/settings/password/", {"old_password": PASSWORD, "new_password1": "123", "new_password2": "123"}
    )
    assert response.status_code == 400 and 'id="error-password-new_password2"' in response.content.decode()


def test_a_password_change_keeps_the_session_and_the_new_password_signs_in(
    client: Client, member: Any
) -> None:
    member.set_password(PASSWORD)
    member.save()
    assert client.post("/login/", {"username": member.username, "password": PASSWORD}).status_code == 302
    response = client.post(
        "/settings/password/",
        {"old_password": PASSWORD, "new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD},
    )
    assert response.status_code == 302 and response["Location"] == "/settings/"
    page = client.get("/settings/")  # still signed in
    assert page.status_code == 200 and "Your password was changed" in page.content.decode()

    fresh = Client()
    assert fresh.post("/login/", {"username": member.username, "password": PASSWORD}).status_code == 200
    assert fresh.post("/login/", {"username": member.username, "password": NEW_PASSWORD}).status_code == 302
    assert fresh.get("/settings/").status_code == 200


def test_the_api_takes_an_expiry_through_the_same_service(
    client_for: Callable[..., Client], member: Any
) -> None:
    client = client_for(member)
    later = (timezone.now() + timedelta(days=2)).replace(microsecond=0)
    created = client.post("/api/tokens", {"name": "api", "expires_at": later.isoformat()}, content_type=JSON)
    assert created.status_code == 201 and created.json()["expires_at"] is not None
    assert ApiToken.objects.get(pk=created.json()["id"]).expires_at == later
    past = client.post(
        "/api/tokens",
        {"name": "api", "expires_at": (timezone.now() - timedelta(hours=1)).isoformat()},
        content_type=JSON,
    )
    assert past.status_code == 422 and past.json()["detail"][0]["loc"] == ["body", "payload", "expires_at"]
    naive = client.post(
        "/api/tokens", {"name": "api", "expires_at": "2999-01-01T00:00:00"}, content_type=JSON
    )
    assert ApiToken.objects.get(pk=naive.json()["id"]).expires_at.isoformat() == "2999-01-01T00:00:00+00:00"
    edge = client.post(
        "/api/tokens", {"name": "api", "expires_at": "9999-12-31T23:59:59-14:00"}, content_type=JSON
    )
    assert edge.status_code == 422 and "out of range" in edge.json()["detail"][0]["msg"]
