"""The caller and their personal API tokens."""

from __future__ import annotations

from typing import Any

from django.http import Http404, HttpRequest
from ninja import Router, Status
from ninja.errors import ValidationError

from webapp.api import serializers, services
from webapp.api.models import ApiToken
from webapp.api.routers import AUTHED, READ, WRITE, Id
from webapp.api.schemas import MeOut, TokenCreatedOut, TokenIn, TokenOut

router = Router(tags=["account"])


def token_out(token: ApiToken) -> dict[str, Any]:
    return {
        "id": token.pk,
        "name": token.name,
        "prefix": token.prefix,
        "created_at": token.created_at,
        "last_used_at": token.last_used_at,
        "expires_at": token.expires_at,
        "revoked_at": token.revoked_at,
        "active": token.is_active,
    }


@router.get("/me", response={200: MeOut, **AUTHED}, summary="The caller and their teams")
def me(request: HttpRequest) -> dict[str, Any]:
    user = request.auth
    return {
        "id": user.pk,
        "username": user.get_username(),
        "email": user.email,
        "first_name": user.first_name,
        "last_name": user.last_name,
        "teams": serializers.teams_out(user),
    }


@router.get("/tokens", response={200: list[TokenOut], **AUTHED}, summary="The caller's API tokens")
def list_tokens(request: HttpRequest) -> list[dict[str, Any]]:
    """Active, expired and revoked tokens, newest first. The tokens themselves are never shown
    again."""
    return [token_out(t) for t in services.tokens_of(request.auth)]


@router.post("/tokens", response={201: TokenCreatedOut, **WRITE}, summary="Create an API token")
def create_token(request: HttpRequest, payload: TokenIn) -> Status[dict[str, Any]]:
    """The response holds the token itself, this once: send it as ``Authorization: Bearer <token>``.
    ``expires_at`` without a time zone is UTC; one in the past is a 422."""
    try:
        token, plaintext = services.create_token(request.auth, payload.name, payload.expires_at)
    except services.TokenRefused as exc:
        loc = ["body", "payload", exc.field]
        raise ValidationError([{"type": "value_error", "loc": loc, "msg": str(exc)}]) from None
    return Status(201, {**token_out(token), "token": plaintext})


@router.delete("/tokens/{token_id}", response={204: None, **READ}, summary="Revoke an API token")
def revoke_token(request: HttpRequest, token_id: Id) -> Status[None]:
    """The token stops working at once; it stays listed as revoked."""
    try:
        services.revoke_token(request.auth, token_id)
    except ApiToken.DoesNotExist:
        raise Http404("no API token of yours has this id") from None
    return Status(204, None)
