"""The caller and their personal API tokens."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from django.shortcuts import get_object_or_404
from ninja import Router, Status

from webapp.api import serializers
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
    """Active and revoked tokens, newest first. The tokens themselves are never shown again."""
    return [token_out(t) for t in ApiToken.objects.filter(user=request.auth)]


@router.post("/tokens", response={201: TokenCreatedOut, **WRITE}, summary="Create an API token")
def create_token(request: HttpRequest, payload: TokenIn) -> Status[dict[str, Any]]:
    """The response holds the token itself, this once: send it as ``Authorization: Bearer <token>``."""
    token, plaintext = ApiToken.issue(request.auth, payload.name)
    return Status(201, {**token_out(token), "token": plaintext})


@router.delete("/tokens/{token_id}", response={204: None, **READ}, summary="Revoke an API token")
def revoke_token(request: HttpRequest, token_id: Id) -> Status[None]:
    """The token stops working at once; it stays listed as revoked."""
    token = get_object_or_404(ApiToken, pk=token_id, user=request.auth)
    token.revoke()
    return Status(204, None)
