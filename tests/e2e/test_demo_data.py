"""The demo data ``manage.py serve`` creates: once, idempotently, never resetting a password.

Runs in a rolled-back transaction (pytest-django's ``db``), so the demo run's task, sent on
commit, is never queued here; ``test_serve.py`` covers the queueing end to end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from webapp import demo
from webapp.runs.models import Run
from webapp.teams.choices import Role

pytestmark = pytest.mark.django_db


def test_first_start_creates_everything_and_a_rerun_reuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(demo.STEPS_ENV, "7")
    first = demo.ensure_demo(data_dir=tmp_path)
    login = first.login
    assert login.username == "admin" and login.password and login.path == tmp_path / "demo_login"
    assert login.path.stat().st_mode & 0o777 == 0o600
    assert first.run_created and first.run is not None
    assert first.run.name == "demo-dapo" and first.run.queue == "cpu" and first.run.status == "queued"
    assert first.run.config["trainer"]["total_steps"] == 7
    assert first.run.config["data"]["task"] == "arithmetic" and first.run.config["model"]["path"] == "starter"
    user = first.run.created_by
    assert user.is_superuser and user.check_password(login.password)
    assert first.team.role_of(user) == Role.ADMIN
    assert (first.team.name, first.project.name) == ("Demo", "Arithmetic")

    again = demo.ensure_demo(data_dir=tmp_path)
    assert again.login == login
    assert not again.run_created and again.run == first.run
    assert (again.team, again.project) == (first.team, first.project)
    assert Run.objects.count() == 1


def test_a_password_changed_or_unknown_is_never_reset(tmp_path: Path, django_user_model: Any) -> None:
    first = demo.ensure_demo(data_dir=tmp_path)
    user = django_user_model.objects.get(username="admin")
    user.set_password("chosen-by-the-team")
    user.save()
    changed = demo.ensure_demo(data_dir=tmp_path).login
    assert changed.password is None and "changed" in changed.note

    first.login.path.unlink()
    unknown = demo.ensure_demo(data_dir=tmp_path).login
    assert unknown.password is None and "changepassword" in unknown.note
    user.refresh_from_db()
    assert user.check_password("chosen-by-the-team")
    assert not first.login.path.exists()


def test_a_bad_step_count_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(demo.STEPS_ENV, "many")
    with pytest.raises(ImproperlyConfigured, match="TRIBUTARY_DEMO_STEPS='many' is not an integer"):
        demo.demo_steps()
    monkeypatch.setenv(demo.STEPS_ENV, "0")
    with pytest.raises(ImproperlyConfigured, match="at least 1"):
        demo.demo_steps()
