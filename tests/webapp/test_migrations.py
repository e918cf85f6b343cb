"""Data migrations, run forward from the state before them on a real database."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from engine.config import ConfigError, build_config

TEAMS = ("teams", "0002_team_allow_user_code")  # the state the historical Team below is built from
BEFORE = [("runs", "0005_claim_resume_path"), TEAMS]
AFTER = [("runs", "0006_move_trainer_max_staleness"), TEAMS]


def _migrate(targets):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


@pytest.mark.django_db(transaction=True)
def test_a_stored_trainer_max_staleness_moves_to_the_async_section() -> None:
    """A config stored before ``async`` existed resolves again after the migration (it is refused
    before it), keeping its value; a config that already has ``async`` keeps its own value."""
    old = _migrate(BEFORE)
    team = old.get_model("teams", "Team").objects.create(name="T", slug="t")
    project = old.get_model("teams", "Project").objects.create(team=team, name="P", slug="p")
    Run = old.get_model("runs", "Run")
    stored = {"preset": "grpo", "trainer": {"total_steps": 3, "max_staleness": 1}}
    both = {"preset": "grpo", "trainer": {"max_staleness": 1}, "async": {"max_staleness": 2}}
    legacy = Run.objects.create(name="legacy", project=project, config=stored)
    newer = Run.objects.create(name="both", project=project, config=both)
    with pytest.raises(ConfigError, match=r"async\.max_staleness"):
        build_config(stored)

    Run = _migrate(AFTER).get_model("runs", "Run")
    legacy, newer = Run.objects.get(pk=legacy.pk), Run.objects.get(pk=newer.pk)
    assert legacy.config == {"preset": "grpo", "trainer": {"total_steps": 3}, "async": {"max_staleness": 1}}
    assert build_config(legacy.config).async_.max_staleness == 1
    assert newer.config == {"preset": "grpo", "trainer": {}, "async": {"max_staleness": 2}}


@pytest.fixture(autouse=True)
def _back_to_the_latest_schema():
    """The later tests expect every migration applied."""
    yield
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
