"""A project's housekeeping by its team's admins: rename, archive, restore.

An archived project leaves the lists (the team page, the landing page and its lists of runs)
but nothing is deleted: its page and its runs keep their URLs, and the team page's Archived
view restores it. A project with queued or running runs is not archived: a run that
still trains should stay where its team looks for it.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from webapp.runs.choices import ACTIVE_STATUSES
from webapp.runs.models import Run
from webapp.teams.models import Project, Team
from webapp.teams.services import clean_name


class ProjectRefused(Exception):
    """The change was refused; the message names the field or the reason and the fix."""


def listed(team: Team) -> QuerySet[Project]:
    """The team's projects the lists show (not archived)."""
    return team.projects.filter(archived_at=None)


def archived(team: Team) -> QuerySet[Project]:
    return team.projects.exclude(archived_at=None).order_by("-archived_at", "name")


def rename_project(project: Project, name: str) -> Project:
    """A new display name; the slug (in links and API clients) stays."""
    try:
        project.name = clean_name(name, "project")
    except ValueError as exc:
        raise ProjectRefused(f"name: {exc}") from None
    project.save(update_fields=["name"])
    return project


def archive_project(project: Project) -> Project:
    with transaction.atomic():
        active = Run.objects.filter(project=project, status__in=ACTIVE_STATUSES).count()
        if active:
            raise ProjectRefused(
                f"{project.name} has {active} queued or running run{'s' if active != 1 else ''}: "
                "cancel them or wait until they end, then archive the project."
            )
        Project.objects.filter(pk=project.pk, archived_at=None).update(archived_at=timezone.now())
    project.refresh_from_db(fields=["archived_at"])
    return project


def restore_project(project: Project) -> Project:
    Project.objects.filter(pk=project.pk).update(archived_at=None)
    project.archived_at = None
    return project
