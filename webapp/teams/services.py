"""Team logic that spans models: creating a team with its first admin, adding and removing members."""

from __future__ import annotations

from django.db import transaction
from django.utils.text import slugify

from webapp.live import announce
from webapp.live.groups import user_group
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


def remove_member(membership: Membership) -> None:
    """Remove a member from the team. The user's browser sockets already open (a run page, a
    runs table of the team) close once the removal commits, not only new connections."""
    user_id = membership.user_id
    membership.delete()
    announce.access_changed(user_group(user_id), "you were removed from the team")
