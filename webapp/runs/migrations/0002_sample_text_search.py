"""Trigram GIN indexes on sample text, on PostgreSQL only (a no-op on SQLite).

The samples API searches with ``icontains`` (ILIKE '%word%'), which a B-tree cannot serve;
``gin_trgm_ops`` can. ``pg_trgm`` needs a role allowed to create extensions: when the
extension cannot be created, the indexes are skipped and search still works, by scanning.
"""

from django.db import migrations, transaction
from django.db.utils import DatabaseError

INDEXES = {
    "sample_prompt_trgm": "prompt",
    "sample_completion_trgm": "completion",
}


def create_trigram_indexes(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        try:
            with transaction.atomic(using=schema_editor.connection.alias):
                cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
        except DatabaseError:
            return
        for name, column in INDEXES.items():
            cursor.execute(
                f"CREATE INDEX IF NOT EXISTS {name} ON runs_sample USING gin ({column} gin_trgm_ops)"
            )


def drop_trigram_indexes(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        for name in INDEXES:
            cursor.execute(f"DROP INDEX IF EXISTS {name}")


class Migration(migrations.Migration):
    dependencies = [("runs", "0001_initial")]

    operations = [migrations.RunPython(create_trigram_indexes, drop_trigram_indexes)]
