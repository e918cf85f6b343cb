"""Team logic that spans models: creating a team with its first admin, adding members."""

from __future__ import annotations

from django.db import transaction
from django.utils.text import slugify

from webapp.teams.choices import Role
from webapp.teams.models import Membership, Team


@transaction.atomic
def create_team(name: str, owner: object, slug: str = "") -> Team:
    """A new team whose creator is its first admin."""
    team = Team.objects.create(name=name, slug=slug or slugify(name))
    Membership.objects.create(team=team, user=owner, role=Role.ADMIN)
    return team


def set_role(team: Team, user: object, role: Role | str) -> Membership:
    """Add ``user`` to ``team`` with ``role``, or change the role of an existing member."""
    membership, _ = Membership.objects.update_or_create(team=team, user=user, defaults={"role": Role(role)})
    return membership
