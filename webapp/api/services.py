"""Personal API tokens made and revoked for their owner: the one path both ``POST/DELETE
/api/tokens`` and the settings page take, so a token is checked and stored the same way
whichever one made it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.db.models import QuerySet
from django.utils import timezone

from webapp.api.models import ApiToken

NAME_MAX = ApiToken._meta.get_field("name").max_length


class TokenRefused(ValueError):
    """A token that cannot be made as asked; the message names the field and the fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def tokens_of(user: Any) -> QuerySet[ApiToken]:
    """The user's tokens, active, expired and revoked, newest first."""
    return ApiToken.objects.filter(user=user)


def create_token(user: Any, name: str, expires_at: datetime | None = None) -> tuple[ApiToken, str]:
    """A new token of ``user`` named ``name`` (trimmed), working until ``expires_at`` (None:
    until revoked; without a time zone, UTC). Returns the row and the plaintext, which is shown
    once and never stored."""
    name = name.strip()
    if not name:
        raise TokenRefused("name", "The name must not be blank: say what the token is for.")
    if len(name) > NAME_MAX:
        raise TokenRefused("name", f"The name is {len(name)} characters long: keep it to {NAME_MAX}.")
    if expires_at is not None:
        try:  # stored in UTC: a time near the calendar's ends may have no UTC equivalent
            expires_at = (
                expires_at.replace(tzinfo=UTC) if timezone.is_naive(expires_at) else expires_at
            ).astimezone(UTC)
        except OverflowError:
            raise TokenRefused(
                "expires_at", "The expiry is out of range: pick a time before the year 9999."
            ) from None
        if expires_at <= timezone.now():
            raise TokenRefused("expires_at", "The expiry is in the past: pick a later time or none.")
    return ApiToken.issue(user, name, expires_at)


def revoke_token(user: Any, token_id: int) -> ApiToken:
    """Revoke one of ``user``'s tokens; it stops working at once and stays listed. Another
    user's token, or none, raises ``ApiToken.DoesNotExist`` (a 404 for both callers)."""
    token = tokens_of(user).get(pk=token_id)
    token.revoke()
    return token
