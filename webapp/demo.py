"""The demo data that ``manage.py serve`` creates on a fresh data directory.

- a superuser ``admin`` whose password is generated once and kept in ``<data dir>/demo_login``
  (mode 0600), so every later ``serve`` prints the same login;
- a team "Demo" (``admin`` is its admin) with a project "Arithmetic";
- one demo run, queued only when the project is created (the first time): DAPO on the built-in
  arithmetic task from the starter policy, ``TRIBUTARY_DEMO_STEPS`` steps (default 300).

Everything is idempotent: a rerun finds what exists and changes nothing (a password changed
since in the admin is kept; the login printed then says so).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from webapp.runs.models import Run
from webapp.runs.services import create_run
from webapp.teams.choices import Role
from webapp.teams.models import Project, Team
from webapp.teams.services import create_team, set_role

USERNAME = "admin"
TEAM_NAME, TEAM_SLUG = "Demo", "demo"
PROJECT_NAME, PROJECT_SLUG = "Arithmetic", "arithmetic"
RUN_NAME = "demo-dapo"
DEMO_PRESET = "dapo"
STEPS_ENV = "TRIBUTARY_DEMO_STEPS"
DEFAULT_STEPS = 300
LOGIN_FILE = "demo_login"


@dataclass(frozen=True)
class DemoLogin:
    username: str
    password: str | None  # None: not known here (see ``note``)
    path: Path
    note: str = ""


@dataclass(frozen=True)
class Demo:
    login: DemoLogin
    team: Team
    project: Project
    run: Run | None  # the demo run (the latest one of that name), None if it was deleted
    run_created: bool  # queued by this call


def demo_steps() -> int:
    """``TRIBUTARY_DEMO_STEPS`` (the demo run's ``trainer.total_steps``), default 300."""
    raw = os.environ.get(STEPS_ENV, "").strip()
    if not raw:
        return DEFAULT_STEPS
    try:
        steps = int(raw)
    except ValueError:
        raise ImproperlyConfigured(
            f"{STEPS_ENV}={raw!r} is not an integer: use a step count like 300"
        ) from None
    if steps < 1:
        raise ImproperlyConfigured(f"{STEPS_ENV}={steps} is too small: use at least 1")
    return steps


def demo_config(steps: int) -> dict[str, Any]:
    """The demo run's config: like ``engine run dapo --set trainer.total_steps=<steps>``."""
    return {"preset": DEMO_PRESET, "name": RUN_NAME, "trainer": {"total_steps": steps}}


def _read_login(path: Path) -> tuple[str, str] | None:
    if not path.is_file():
        return None
    fields = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    if fields.get("username") and fields.get("password"):
        return fields["username"], fields["password"]
    return None


def _write_login(path: Path, username: str, password: str) -> None:
    """Write the login file with mode 0600, atomically (a half-written file never exists)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(f"username: {username}\npassword: {password}\n")
    os.replace(tmp, path)


def ensure_login(data_dir: Path | None = None) -> tuple[Any, DemoLogin]:
    """The demo superuser, created on first use with the password stored in ``demo_login``."""
    path = Path(data_dir or settings.DATA_DIR) / LOGIN_FILE
    User = get_user_model()
    stored = _read_login(path)
    user = User.objects.filter(username=USERNAME).first()
    if user is None:
        # The file first: if creating the user fails, the next start creates it with the same password.
        if stored is None or stored[0] != USERNAME:
            stored = (USERNAME, secrets.token_urlsafe(12))
            _write_login(path, *stored)
        user = User.objects.create_superuser(username=USERNAME, email="", password=stored[1])
        return user, DemoLogin(USERNAME, stored[1], path)
    if stored is None or stored[0] != USERNAME:
        # The user exists (a shared database, or the file was removed): never reset its password.
        note = (
            f"the password of {USERNAME!r} is not in {path}: set one with "
            f"`python manage.py changepassword {USERNAME}`"
        )
        return user, DemoLogin(USERNAME, None, path, note)
    if not user.check_password(stored[1]):
        note = f"the password of {USERNAME!r} was changed since it was stored in {path}: use the new one"
        return user, DemoLogin(USERNAME, None, path, note)
    return user, DemoLogin(USERNAME, stored[1], path)


def ensure_demo(*, queue: str = "cpu", data_dir: Path | None = None) -> Demo:
    """The demo user, team, project and run; the run is queued only when the project is new."""
    with transaction.atomic():
        user, login = ensure_login(data_dir)
        team = Team.objects.filter(slug=TEAM_SLUG).first()
        if team is None:
            team = create_team(TEAM_NAME, user, slug=TEAM_SLUG)
        elif team.role_of(user) != Role.ADMIN:
            set_role(team, user, Role.ADMIN)
        project, created = Project.objects.get_or_create(
            team=team, slug=PROJECT_SLUG, defaults={"name": PROJECT_NAME}
        )
        if created:
            # Validated by the engine; sent to the queue once this transaction commits.
            run = create_run(project, user, demo_config(demo_steps()), name=RUN_NAME, queue=queue)
        else:
            run = Run.objects.filter(project=project, name=RUN_NAME).order_by("-created_at", "-id").first()
    return Demo(login=login, team=team, project=project, run=run, run_created=created)
