"""Team logic that spans models: creating a team with its first admin, renaming it, adding and
removing members. (Invite links: ``webapp.teams.invites``; projects: ``webapp.teams.projects``.)"""

from __future__ import annotations

from django.db import transaction
from django.utils.text import slugify

from webapp.live import announce
from webapp.live.groups import user_group
from webapp.teams.choices import Role
from webapp.teams.models import Membership, Team

NAME_MAX = 100


def clean_name(raw: object, what: str = "team") -> str:
    """A team's or project's name from a form: trimmed, 1..100 characters, no control characters.
    ``ValueError`` names the fix."""
    name = " ".join(str(raw or "").split())
    if not name:
        raise ValueError(f"Give the {what} a name.")
    if len(name) > NAME_MAX:
        raise ValueError(f"At most {NAME_MAX} characters (this one has {len(name)}): shorten it.")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ValueError("Use letters, digits, spaces and punctuation only (no control characters).")
    return name


def unique_slug(name: str) -> str:
    """A slug for a new team: from its name, with -2, -3, ... when the name's slug is taken (a
    team's slug is unique across the site, and its name is the creator's to choose)."""
    base = (slugify(name) or "team")[:90]
    taken = set(Team.objects.filter(slug__startswith=base).values_list("slug", flat=True))
    slug, n = base, 2
    while slug in taken:
        slug, n = f"{base}-{n}", n + 1
    return slug


@transaction.atomic
def create_team(name: str, owner: object, slug: str = "") -> Team:
    """A new team whose creator is its first admin."""
    team = Team.objects.create(name=name, slug=slug or unique_slug(name))
    Membership.objects.create(team=team, user=owner, role=Role.ADMIN)
    return team


def rename_team(team: Team, name: str) -> Team:
    """A new display name; the slug (in links and API clients) stays."""
    team.name = clean_name(name)
    team.save(update_fields=["name"])
    return team


def set_role(team: Team, user: object, role: Role | str) -> Membership:
    """Add ``user`` to ``team`` with ``role``, or change the role of an existing member."""
    membership, _ = Membership.objects.update_or_create(team=team, user=user, defaults={"role": Role(role)})
    return membership


def remove_member(membership: Membership) -> None:
    """Remove a member from the team. The user's browser sockets already open (a run page, a
    runs table of the team) close once the removal commits, not only new connections."""
    user_id = membership.user_id
    membership.delete()
    announce.access_changed(user_group(user_id), "you were removed from the team")
