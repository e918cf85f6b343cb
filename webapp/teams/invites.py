"""Invite links: a team admin makes one (role, a note saying who it is for, an expiry), whoever
opens it joins the team with that role, once.

The link carries 32 random bytes (``secrets.token_urlsafe``); the database keeps only their
SHA-256, so a copy of the database (a backup, a leak) holds no working link, and the admin sees
the link once, when it is made. A token is found by its hash through the unique index and the
stored hash is compared again in constant time. Using an invite is one conditional UPDATE
(still unused, not revoked, not expired), so of two people opening the same link at once only
one joins, on SQLite and PostgreSQL alike; a refusal says which of the three it was.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from webapp.teams.choices import Role
from webapp.teams.models import Invite, Membership, Team

DEFAULT_DAYS = 7
MAX_DAYS = 90
NOTE_MAX = 200
TOKEN_BYTES = 32
TOKEN_MAX_CHARS = 100
"""A link's token is 43 characters; anything much longer is refused before it is hashed."""


class InviteRefused(Exception):
    """The invite cannot be used (``reason``: ``unknown``, ``used``, ``revoked``, ``expired``,
    ``member``); the message says so in words a visitor understands."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def create_invite(
    team: Team, by: Any, role: Role | str, note: str = "", days: int = DEFAULT_DAYS
) -> tuple[Invite, str]:
    """A new invite and its token (shown once: only its hash is stored)."""
    if not 1 <= days <= MAX_DAYS:
        raise ValueError(f"expires in: between 1 and {MAX_DAYS} days")
    token = secrets.token_urlsafe(TOKEN_BYTES)
    invite = Invite.objects.create(
        team=team,
        role=Role(role),
        note=note.strip()[:NOTE_MAX],
        token_hash=token_hash(token),
        created_by=by if getattr(by, "is_authenticated", False) else None,
        expires_at=timezone.now() + timedelta(days=days),
    )
    return invite, token


def pending_invites(team: Team, now: datetime | None = None) -> QuerySet[Invite]:
    """The team's invites that still work (unused, not revoked, not expired), newest first."""
    now = now or timezone.now()
    return team.invites.filter(used_at=None, revoked_at=None, expires_at__gt=now).select_related("created_by")


def revoke_invite(team: Team, invite_id: int) -> Invite | None:
    """Stop a pending invite of ``team`` working; None when it has no such pending invite."""
    invite = pending_invites(team).filter(pk=invite_id).first()
    if invite is None:
        return None
    now = timezone.now()
    Invite.objects.filter(pk=invite.pk, revoked_at=None, used_at=None).update(revoked_at=now)
    invite.revoked_at = now
    return invite


def find(token: str) -> Invite | None:
    """The invite whose link carries ``token`` (in any state), or None."""
    if not token or len(token) > TOKEN_MAX_CHARS:
        return None
    digest = token_hash(token)
    invite = Invite.objects.select_related("team", "created_by").filter(token_hash=digest).first()
    if invite is None or not hmac.compare_digest(invite.token_hash, digest):
        return None
    return invite


@dataclass(frozen=True)
class InviteState:
    """What opening the link shows: whether it works, and if not, why."""

    ok: bool
    reason: str = ""
    message: str = ""


def state_of(invite: Invite | None, now: datetime | None = None) -> InviteState:
    now = now or timezone.now()
    if invite is None:
        return InviteState(False, "unknown", "This invite link is not valid: check that it was copied whole, "
                           "or ask a team admin for a new one.")  # fmt: skip
    if invite.used_at is not None:
        return InviteState(False, "used", "This invite link was already used: each link lets one person join. "
                           "Ask a team admin for a new one.")  # fmt: skip
    if invite.revoked_at is not None:
        return InviteState(
            False, "revoked", "This invite link was revoked by a team admin: ask them for a new one."
        )
    if invite.expires_at <= now:
        when = timezone.localtime(invite.expires_at).strftime("%Y-%m-%d %H:%M %Z")
        return InviteState(
            False, "expired", f"This invite link expired on {when}: ask a team admin for a new one."
        )
    return InviteState(True)


def accept(invite: Invite, user: Any) -> Membership:
    """``user`` joins the invite's team with its role, and the invite is used up.

    Raises ``InviteRefused`` when the invite no longer works (another request may have used it
    a moment ago: the conditional UPDATE decides) or when ``user`` is already in the team, in
    which case the invite stays unused and their role is left as it is. Call it inside the
    transaction that creates ``user`` for a sign-up, so a refused invite creates no account."""
    with transaction.atomic():
        held = Membership.objects.filter(team=invite.team, user=user).values_list("role", flat=True).first()
        if held is not None:
            raise InviteRefused(
                "member",
                f"You are already in {invite.team.name} (as {held}); the invite was left for someone else.",
            )
        now = timezone.now()
        used = Invite.objects.filter(pk=invite.pk, used_at=None, revoked_at=None, expires_at__gt=now).update(
            used_at=now, used_by=user
        )
        if not used:
            invite.refresh_from_db()
            refused = state_of(invite, now)
            raise InviteRefused(refused.reason, refused.message)
        return Membership.objects.create(team=invite.team, user=user, role=Role(invite.role))
