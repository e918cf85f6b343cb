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


@pytest.mark.django_db(transaction=True)
def test_stored_samples_get_their_prompt_hash_and_runs_their_kept_log_length() -> None:
    """0014 fills ``Sample.prompt_hash`` (in batches, one statement each) and 0015 takes a run's kept
    full-log length to be all it received (no cap existed before)."""
    from webapp.runs.models import prompt_hash

    before = [("runs", "0013_run_external"), ("teams", "0003_invites_archive")]
    after = [("runs", "0015_run_output_kept_bytes"), ("teams", "0003_invites_archive")]
    old = _migrate(before)
    team = old.get_model("teams", "Team").objects.create(name="T", slug="t")
    project = old.get_model("teams", "Project").objects.create(team=team, name="P", slug="p")
    run = old.get_model("runs", "Run").objects.create(
        name="r", project=project, config={}, output_file_bytes=1234
    )
    Sample = old.get_model("runs", "Sample")
    prompts = ["What is 2+2?", "é ∑ odd", "What is 2+2?"]
    for i, prompt in enumerate(prompts):
        Sample.objects.create(run=run, step=1, seq=1, index=i, prompt=prompt, completion="c")

    new = _migrate(after)
    hashes = list(
        new.get_model("runs", "Sample").objects.order_by("index").values_list("prompt_hash", flat=True)
    )
    assert hashes == [prompt_hash(p) for p in prompts] and hashes[0] == hashes[2]
    assert new.get_model("runs", "Run").objects.get(pk=run.pk).output_kept_bytes == 1234


@pytest.fixture(autouse=True)
def _back_to_the_latest_schema():
    """The later tests expect every migration applied."""
    yield
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
