from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction

from webapp.teams.choices import Role
from webapp.teams.models import Membership, Project, Team
from webapp.teams.services import create_team, set_role


def test_it_gives_each_persona_its_role(team, admin, member, viewer, outsider) -> None:
    assert team.role_of(admin) == Role.ADMIN
    assert team.role_of(member) == Role.MEMBER
    assert team.role_of(viewer) == Role.VIEWER
    assert team.role_of(outsider) is None


def test_it_ranks_roles_so_higher_ones_include_lower_ones(team, admin, member, viewer, outsider) -> None:
    assert team.allows(admin, Role.MEMBER) and team.allows(admin, Role.ADMIN)
    assert team.allows(member, Role.MEMBER) and not team.allows(member, Role.ADMIN)
    assert team.allows(viewer, Role.VIEWER) and not team.allows(viewer, Role.MEMBER)
    assert not team.allows(outsider, Role.VIEWER)


def test_it_treats_anonymous_users_as_outsiders(team) -> None:
    from django.contrib.auth.models import AnonymousUser

    assert team.role_of(AnonymousUser()) is None


def test_it_refuses_a_second_membership_for_the_same_user_and_team(team, member) -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        Membership.objects.create(user=member, team=team, role=Role.ADMIN)


def test_it_changes_a_role_instead_of_adding_a_membership(team, member) -> None:
    set_role(team, member, Role.ADMIN)
    assert team.role_of(member) == Role.ADMIN
    assert Membership.objects.filter(team=team, user=member).count() == 1


def test_it_makes_the_creator_of_a_team_its_admin(django_user_model) -> None:
    owner = django_user_model.objects.create_user(username="owner")
    team = create_team("RL Research", owner)
    assert team.slug == "rl-research"
    assert team.role_of(owner) == Role.ADMIN


def test_it_refuses_two_projects_with_one_slug_in_a_team(team, other_team, project) -> None:
    Project.objects.create(team=other_team, name="GSM8K", slug=project.slug)  # another team: fine
    with pytest.raises(IntegrityError), transaction.atomic():
        Project.objects.create(team=team, name="GSM8K again", slug=project.slug)


def test_it_refuses_two_teams_with_one_slug(team) -> None:
    with pytest.raises(IntegrityError), transaction.atomic():
        Team.objects.create(name="Copy", slug=team.slug)
