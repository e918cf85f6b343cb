"""Keeping ``ConfigValue`` rows: a run's config flattened into one row per key path.

``Run.save`` sends ``post_save``; ``on_run_saved`` (connected by ``AnalysisConfig.ready``) writes
the rows of a new run and rewrites them when a save names ``config`` (or names no fields). That
covers every way a run is created: the launch and a fork (``runs.services.create_run``), external
runs and the verl import (``runs.external.create_external_run``), the admin and tests. What skips
``save`` must call ``write`` itself: ``bulk_create`` (the benchmarks use ``write_many``) and
``QuerySet.update(config=...)``; a data migration that rewrites configs rewrites the rows with
``rows_for`` (migration ``analysis.0002`` backfills the runs stored before this table).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import transaction

from webapp.analysis.config_keys import nodes, typed

BATCH = 500


def rows_for(run_id: int, project_id: int, config: Any, model: Any = None) -> list[Any]:
    """The rows of one run's config (``model``: the class, or a migration's historical one)."""
    if model is None:
        from webapp.analysis.models import ConfigValue as model
    rows = []
    for path, value, leaf in nodes(config):
        t = typed(value)
        rows.append(
            model(
                run_id=run_id,
                project_id=project_id,
                key=path,
                leaf=leaf,
                kind=t.kind,
                text=t.text,
                number=t.number,
                digest=t.digest,
            )
        )
    return rows


def write(run: Any, *, created: bool = False) -> None:
    """Store ``run``'s config as rows, replacing its old ones (none to replace when ``created``)."""
    write_many([run], created=created)


def write_many(runs: Iterable[Any], *, created: bool = False) -> None:
    from webapp.analysis.models import ConfigValue

    runs = list(runs)
    rows = [row for r in runs for row in rows_for(r.pk, r.project_id, r.config)]
    with transaction.atomic():  # a run never shows no values between the delete and the insert
        if not created:
            ConfigValue.objects.filter(run_id__in=[r.pk for r in runs]).delete()
        ConfigValue.objects.bulk_create(rows, batch_size=BATCH)


def on_run_saved(sender: Any, instance: Any, created: bool, update_fields: Any = None, **kwargs: Any) -> None:
    """``post_save`` of ``Run``: a new run's rows, or a changed config's."""
    if created or update_fields is None or "config" in update_fields:
        write(instance, created=created)
