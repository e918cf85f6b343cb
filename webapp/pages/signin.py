"""Sign-in throttling glue for django-axes (configured in ``webapp.settings``).

Axes counts failed sign-ins per account and per client address and refuses a locked-out
sign-in before the password is hashed. These two hooks decide which address a request comes
from and what a locked-out person sees: the sign-in page again, with the username kept, a
message that says how long to wait, status 429 and ``Retry-After``.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.forms import AuthenticationForm
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render


def client_address(request: HttpRequest) -> str:
    """The address the ASGI server reports. Behind a proxy, uvicorn's ``--proxy-headers``
    sets it from ``X-Forwarded-For`` only for the proxies in ``FORWARDED_ALLOW_IPS``; a header
    read here could be set by anyone."""
    return request.META.get("REMOTE_ADDR") or "unknown"


def cool_off(request: HttpRequest | None = None) -> timedelta:
    """``AXES_COOLOFF_TIME``: ``LOGIN_LOCKOUT`` read when needed, so the lockout and the
    message that names it always agree."""
    return timedelta(seconds=settings.LOGIN_LOCKOUT)


def wait_text(seconds: float) -> str:
    seconds = max(1, math.ceil(seconds))
    if seconds < 120:
        return f"{seconds} seconds"
    minutes = math.ceil(seconds / 60)
    return f"{minutes} minutes"


def lockout_message() -> str:
    return (
        "Too many failed sign-ins for this account or from your address. "
        f"Try again in {wait_text(settings.LOGIN_LOCKOUT)}."
    )


def lockout_response(request: HttpRequest, *args: Any) -> HttpResponse:
    """``AXES_LOCKOUT_CALLABLE``: axes calls it as ``(request, response, credentials)`` (or
    ``(request, credentials)`` from its async path); neither is needed here."""
    form = AuthenticationForm(request, initial={"username": request.POST.get("username", "")})
    response = render(
        request,
        "registration/login.html",
        {"form": form, "lockout": lockout_message(), "next": request.POST.get("next", "")},
        status=429,
    )
    response["Retry-After"] = str(settings.LOGIN_LOCKOUT)
    return response
