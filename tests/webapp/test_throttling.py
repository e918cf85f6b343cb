"""Throttling of failed sign-ins (django-axes) and failed API token checks, through the real
views, middleware and cache (local memory on SQLite, Redis in the PostgreSQL+Redis pass).

Each test sends from its own documentation address (192.0.2.0/24, via REMOTE_ADDR) with its own
usernames, so counts never leak between tests or into the rest of the suite (which signs in
from 127.0.0.1). Limits and windows are set small per test; unlocking is waited for with a
generous timeout, never timed.
"""

from __future__ import annotations

import io
import itertools
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from axes.handlers.proxy import AxesProxyHandler
from django.core.management import call_command
from django.test import Client

from webapp.api.auth import failed_token_checks
from webapp.api.models import ApiToken

PASSWORD = "correct horse battery staple"
_addresses = itertools.count(1)


@pytest.fixture(autouse=True)
def _throttle_settings(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast, test-only
    settings.AXES_ENABLED = True
    settings.AXES_FAILURE_LIMIT = 3
    settings.LOGIN_LOCKOUT = 600
    settings.API_TOKEN_FAILURE_LIMIT = 3
    settings.API_TOKEN_LOCKOUT = 600


@pytest.fixture
def address() -> Callable[[], str]:
    """A fresh client address (and its counts cleared) per call."""

    def make() -> str:
        ip = f"192.0.2.{next(_addresses) % 250 + 1}"
        AxesProxyHandler.reset_attempts(ip_address=ip)
        failed_token_checks.reset(ip)
        return ip

    return make


@pytest.fixture
def user_named(django_user_model: Any) -> Callable[[], Any]:
    def make() -> Any:
        name = f"u-{uuid.uuid4().hex[:10]}"
        AxesProxyHandler.reset_attempts(username=name)
        return django_user_model.objects.create_user(username=name, password=PASSWORD)

    return make


def sign_in(ip: str, username: str, password: str, path: str = "/login/") -> Any:
    return Client(REMOTE_ADDR=ip).post(path, {"username": username, "password": password, "next": "/"})


def signed_in(response: Any) -> bool:
    return response.status_code == 302 and "_auth_user_id" in response.client.session


def assert_locked_out(response: Any, lockout_s: int) -> None:
    assert response.status_code == 429, response.status_code
    body = response.content.decode()
    assert "Too many failed sign-ins for this account or from your address" in body
    assert "Try again in" in body
    assert response["Retry-After"] == str(lockout_s)
    assert "_auth_user_id" not in response.client.session


def test_wrong_passwords_lock_the_account_even_from_another_address(address, user_named, settings) -> None:
    user, attacker, owner = user_named(), address(), address()
    for attempt in range(1, settings.AXES_FAILURE_LIMIT):
        response = sign_in(attacker, user.username, f"guess-{attempt}")
        assert response.status_code == 200 and "Please enter a correct username" in response.content.decode()
    # The failure that reaches the limit is answered with the lockout page itself.
    assert_locked_out(sign_in(attacker, user.username, "guess-last"), settings.LOGIN_LOCKOUT)
    # The right password, from another address, is refused too: the account is locked.
    response = sign_in(owner, user.username, PASSWORD)
    assert_locked_out(response, settings.LOGIN_LOCKOUT)
    assert f'value="{user.username}"' in response.content.decode()  # the form keeps the username
    # The admin's login goes through the same authenticate(): locked as well.
    assert sign_in(owner, user.username, PASSWORD, "/admin/login/").status_code == 429
    # Another account from the owner's address is not affected.
    assert signed_in(sign_in(owner, user_named().username, PASSWORD))
    # An operator lifts the lockout early (README: manage.py axes_reset_username).
    call_command("axes_reset_username", user.username, stdout=io.StringIO())
    assert signed_in(sign_in(owner, user.username, PASSWORD))


def test_wrong_passwords_from_one_address_lock_the_address(address, user_named, settings) -> None:
    spraying, elsewhere = address(), address()
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        assert sign_in(spraying, user_named().username, "spray").status_code == 200  # one try per account
    assert_locked_out(sign_in(spraying, user_named().username, "spray"), settings.LOGIN_LOCKOUT)
    # A fresh account with its right password: refused from that address, fine from another.
    fresh = user_named()
    assert_locked_out(sign_in(spraying, fresh.username, PASSWORD), settings.LOGIN_LOCKOUT)
    assert signed_in(sign_in(elsewhere, fresh.username, PASSWORD))


def test_a_lockout_ends_after_the_window(address, user_named, settings) -> None:
    settings.LOGIN_LOCKOUT = 2
    user, ip = user_named(), address()
    for attempt in range(settings.AXES_FAILURE_LIMIT - 1):
        sign_in(ip, user.username, f"guess-{attempt}")
    assert_locked_out(sign_in(ip, user.username, "guess-last"), 2)
    # Sign-ins while locked out do not extend the lockout: retrying eventually succeeds.
    deadline = time.monotonic() + 120
    while True:
        response = sign_in(ip, user.username, PASSWORD)
        if response.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert signed_in(response), response.status_code


def test_normal_sign_ins_are_never_throttled(address, user_named, settings) -> None:
    """A typo now and then, followed by the right password, never adds up to a lockout: a
    successful sign-in clears the account's and the address's counts."""
    user, ip = user_named(), address()
    for _ in range(3 * settings.AXES_FAILURE_LIMIT):
        for typo in range(settings.AXES_FAILURE_LIMIT - 1):
            assert sign_in(ip, user.username, f"typo-{typo}").status_code == 200
        assert signed_in(sign_in(ip, user.username, PASSWORD))


# --- API tokens ----------------------------------------------------------------------------


def api_get(ip: str, token: str, path: str = "/api/me") -> Any:
    return Client(REMOTE_ADDR=ip).get(path, HTTP_AUTHORIZATION=f"Bearer {token}")


def test_wrong_api_tokens_throttle_the_address(address, member, settings) -> None:
    token = ApiToken.issue(member, "throttle test")[1]
    guessing, elsewhere = address(), address()
    for guess in range(settings.API_TOKEN_FAILURE_LIMIT):
        assert api_get(guessing, f"trb_guess-{guess}").status_code == 401
    # Over the limit: every token check from that address is refused, the valid one too.
    for attempt in (f"trb_guess-{guess + 1}", token):
        response = api_get(guessing, attempt)
        assert response.status_code == 429, response.content
        detail = response.json()["detail"]
        assert "too many failed API token checks from your address" in detail and "try again in" in detail
        assert 1 <= int(response["Retry-After"]) <= settings.API_TOKEN_LOCKOUT
    # Another address with the valid token is served.
    assert api_get(elsewhere, token).json()["username"] == member.username


def test_api_token_throttling_ends_after_the_window(address, member, settings) -> None:
    settings.API_TOKEN_LOCKOUT = 2
    token = ApiToken.issue(member, "throttle test")[1]
    ip = address()
    for guess in range(settings.API_TOKEN_FAILURE_LIMIT):
        assert api_get(ip, f"trb_guess-{guess}").status_code == 401
    assert api_get(ip, token).status_code == 429
    deadline = time.monotonic() + 120
    while (response := api_get(ip, token)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert response.status_code == 200, response.content


def test_a_valid_token_is_never_throttled(address, member, settings, api_run) -> None:
    token = ApiToken.issue(member, "busy client")[1]
    ip = address()
    for _ in range(10 * settings.API_TOKEN_FAILURE_LIMIT):
        assert api_get(ip, token, f"/api/runs/{api_run.pk}").status_code == 200


def test_throttling_can_be_turned_off(address, user_named, member, settings) -> None:
    settings.AXES_ENABLED = False
    settings.API_TOKEN_FAILURE_LIMIT = 0
    user, ip = user_named(), address()
    for attempt in range(2 * settings.AXES_FAILURE_LIMIT):
        assert sign_in(ip, user.username, f"guess-{attempt}").status_code == 200
    assert signed_in(sign_in(ip, user.username, PASSWORD))
    for guess in range(2 * 3):
        assert api_get(ip, f"trb_guess-{guess}").status_code == 401
