"""Personal API tokens: what a script shows in ``Authorization: Bearer <token>``.

Only a SHA-256 hash of a token is stored, with a short visible prefix so its owner can tell
tokens apart; the plaintext is shown once, when the token is created. A revoked token keeps
its row (which tokens existed, when they were last used) and stops working at once; so does a
token past its optional expiry. Create and revoke them through ``webapp.api.services``.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone

TOKEN_MARK = "trb_"
PREFIX_CHARS = 8  # random characters kept visible after the mark
LAST_USED_EVERY = timedelta(minutes=1)  # at most one write per token per minute


def hash_token(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


class ApiToken(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100, help_text="What the token is for (a script, a machine).")
    prefix = models.CharField(max_length=16, help_text="The token's first characters, shown in lists.")
    key_hash = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the token (hex).")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(
        null=True, blank=True, help_text="When the token stops working by itself; empty: never."
    )

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.prefix}... ({self.name}) of {self.user}"

    @property
    def is_expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= timezone.now()

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None and not self.is_expired

    @classmethod
    def issue(cls, user: Any, name: str, expires_at: datetime | None = None) -> tuple[ApiToken, str]:
        """A new token for ``user``: the stored row and the plaintext (never stored)."""
        plaintext = TOKEN_MARK + secrets.token_urlsafe(32)
        token = cls.objects.create(
            user=user,
            name=name,
            expires_at=expires_at,
            prefix=plaintext[: len(TOKEN_MARK) + PREFIX_CHARS],
            key_hash=hash_token(plaintext),
        )
        return token, plaintext

    @classmethod
    def user_for(cls, plaintext: str) -> Any | None:
        """The active user a live token belongs to, else None; notes when the token was used."""
        if not plaintext or not plaintext.startswith(TOKEN_MARK) or len(plaintext) > 200:
            return None
        now = timezone.now()
        token = (
            cls.objects.select_related("user")
            .filter(key_hash=hash_token(plaintext), revoked_at=None)
            .filter(models.Q(expires_at=None) | models.Q(expires_at__gt=now))
            .first()
        )
        if token is None or not token.user.is_active:
            return None
        if token.last_used_at is None or now - token.last_used_at > LAST_USED_EVERY:
            cls.objects.filter(pk=token.pk).update(last_used_at=now)
        return token.user

    def revoke(self) -> None:
        if self.revoked_at is None:
            self.revoked_at = timezone.now()
            ApiToken.objects.filter(pk=self.pk, revoked_at=None).update(revoked_at=self.revoked_at)
