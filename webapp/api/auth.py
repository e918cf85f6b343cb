"""Who is calling: a personal API token (``Authorization: Bearer trb_...``) or the browser's
Django session. Both are accepted on every authenticated endpoint.

- A request that carries an ``Authorization`` header is judged by it alone: an unknown,
  revoked or malformed token is a 401 even when a session cookie is present too.
- A session request passes Django's CSRF check on unsafe methods (POST, PATCH, DELETE), as
  ninja's own session auth does; token requests need no CSRF token (no cookie is involved).
- Failed token checks are counted per client address (``FailedTokenChecks``): past
  ``API_TOKEN_FAILURE_LIMIT`` of them, every token check from that address is refused with a 429
  and ``Retry-After`` until ``API_TOKEN_LOCKOUT`` seconds after the first failure. Only
  failures count, so a client that uses a valid token is never throttled, however busy.
  (Sign-in through the login form is throttled by django-axes, see ``webapp.settings``.)
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import time
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.http import HttpRequest
from ninja.errors import AuthenticationError, HttpError, Throttled
from ninja.security import APIKeyCookie, HttpBearer
from ninja.utils import check_csrf

from webapp.api.models import ApiToken


class TokenThrottled(Throttled):
    """A 429: too many failed token checks from the caller's address (``wait``: seconds left)."""

    def __init__(self, wait: int) -> None:
        super().__init__(wait)
        self.message = (
            f"too many failed API token checks from your address: try again in {_human(wait)} "
            "(Retry-After gives the seconds)"
        )


def _human(seconds: int) -> str:
    if seconds < 120:
        return f"{seconds} seconds"
    return f"{math.ceil(seconds / 60)} minutes"


class FailedTokenChecks:
    """Failed API token checks per client address, in Django's cache: Redis when ``REDIS_URL``
    is set, so web replicas share the count; one process's memory otherwise (embedded mode).

    A fixed window that opens at an address's first failure and lasts ``API_TOKEN_LOCKOUT``
    seconds; at ``API_TOKEN_FAILURE_LIMIT`` failures in it, the address is refused until it
    closes. The count is ``cache.add``/``cache.incr``, atomic on Redis. The address is the one
    the ASGI server reports (``REMOTE_ADDR``: behind a proxy, uvicorn's ``--proxy-headers`` with
    ``FORWARDED_ALLOW_IPS`` make it the client's); IPv6 clients count per /64, since one host
    usually holds a whole /64.
    """

    prefix = "tributary:api-token-failures:"

    @staticmethod
    def _address(request: HttpRequest) -> str:
        raw = request.META.get("REMOTE_ADDR") or "unknown"
        try:
            ip = ipaddress.ip_address(raw)
        except ValueError:
            return raw
        if ip.version == 6:
            return str(ipaddress.ip_network(f"{ip}/64", strict=False).network_address)
        return str(ip)

    def _keys(self, request: HttpRequest) -> tuple[str, str]:
        return self.keys_for(self._address(request))

    def keys_for(self, address: str) -> tuple[str, str]:
        digest = hashlib.sha256(address.encode()).hexdigest()[:32]
        return f"{self.prefix}{digest}:count", f"{self.prefix}{digest}:until"

    def reset(self, address: str) -> None:
        """Forget an address's failures (an operator unblocking it: ``manage.py shell``)."""
        cache.delete_many(self.keys_for(address))

    def retry_after(self, request: HttpRequest) -> int | None:
        """Seconds the caller's address must still wait, or None when it may try a token."""
        limit = settings.API_TOKEN_FAILURE_LIMIT
        if limit <= 0:
            return None
        count_key, until_key = self._keys(request)
        if (cache.get(count_key) or 0) < limit:
            return None
        until = cache.get(until_key)
        left = settings.API_TOKEN_LOCKOUT if until is None else until - time.time()
        return max(1, math.ceil(left))

    def failed(self, request: HttpRequest) -> None:
        if settings.API_TOKEN_FAILURE_LIMIT <= 0:
            return
        window = settings.API_TOKEN_LOCKOUT
        count_key, until_key = self._keys(request)
        if cache.add(count_key, 1, timeout=window):
            cache.set(until_key, time.time() + window, timeout=window)
            return
        try:
            cache.incr(count_key)
        except ValueError:  # the window closed between add and incr: this failure opens a new one
            if cache.add(count_key, 1, timeout=window):
                cache.set(until_key, time.time() + window, timeout=window)


failed_token_checks = FailedTokenChecks()


class TokenAuth(HttpBearer):
    """``Authorization: Bearer <token>`` with a personal API token (made on the settings page or
    with POST /api/tokens)."""

    def __call__(self, request: HttpRequest) -> Any | None:
        header = request.headers.get(self.header)
        if header is None:
            return None  # not a token request: let the session decide
        wait = failed_token_checks.retry_after(request)
        if wait is not None:
            raise TokenThrottled(wait)
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != self.openapi_scheme or not token.strip():
            raise AuthenticationError(message="the Authorization header must be 'Bearer <API token>'")
        return self.authenticate(request, token.strip())

    def authenticate(self, request: HttpRequest, token: str) -> Any | None:
        user = ApiToken.user_for(token)
        if user is None:
            failed_token_checks.failed(request)
            raise AuthenticationError(message="the API token is unknown, expired or revoked: create a new one")
        request.user = user
        return user


class SessionAuth(APIKeyCookie):
    """The browser's Django session (log in first); unsafe methods need the CSRF token."""

    def __init__(self, csrf: bool = True) -> None:
        from django.conf import settings

        self.param_name = settings.SESSION_COOKIE_NAME
        super().__init__(csrf=csrf)

    def _get_key(self, request: HttpRequest) -> str | None:
        return request.COOKIES.get(self.param_name)

    def authenticate(self, request: HttpRequest, key: str | None) -> Any | None:
        user = getattr(request, "user", None)
        if user is None or not user.is_authenticated:
            return None  # anonymous: a 401, not a CSRF complaint
        if self.csrf and not getattr(request, "_ninja_csrf_exempt", False) and check_csrf(request):
            raise HttpError(
                403, "CSRF check failed: send the csrftoken cookie's value in the X-CSRFToken header"
            )
        return user


token_auth = TokenAuth()
session_auth = SessionAuth()
API_AUTH = [token_auth, session_auth]
