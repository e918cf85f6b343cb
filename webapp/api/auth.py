"""Who is calling: a personal API token (``Authorization: Bearer trb_...``) or the browser's
Django session. Both are accepted on every authenticated endpoint.

- A request that carries an ``Authorization`` header is judged by it alone: an unknown,
  revoked or malformed token is a 401 even when a session cookie is present too.
- A session request passes Django's CSRF check on unsafe methods (POST, PATCH, DELETE), as
  ninja's own session auth does; token requests need no CSRF token (no cookie is involved).
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja.errors import AuthenticationError, HttpError
from ninja.security import APIKeyCookie, HttpBearer
from ninja.utils import check_csrf

from webapp.api.models import ApiToken


class TokenAuth(HttpBearer):
    """``Authorization: Bearer <token>`` with a personal API token (create one at POST /api/tokens)."""

    def __call__(self, request: HttpRequest) -> Any | None:
        header = request.headers.get(self.header)
        if header is None:
            return None  # not a token request: let the session decide
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != self.openapi_scheme or not token.strip():
            raise AuthenticationError(message="the Authorization header must be 'Bearer <API token>'")
        return self.authenticate(request, token.strip())

    def authenticate(self, request: HttpRequest, token: str) -> Any | None:
        user = ApiToken.user_for(token)
        if user is None:
            raise AuthenticationError(message="the API token is unknown or revoked: create a new one")
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
