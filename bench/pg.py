"""A throwaway PostgreSQL database with the web app's schema, for the benchmarks that measure the
web app in-process (Django set up on it, migrated; Redis left out: the in-memory channel layer,
so a bench measures storing and serving, not the fan-out).

    from bench.pg import django_on_fresh_database, drop_database
    django_on_fresh_database("tributary_bench_x")   # before importing webapp models
    ...
    drop_database("tributary_bench_x")

``BENCH_PG`` names the server (``postgres://postgres@127.0.0.1:5432``, the machine's own).
"""

from __future__ import annotations

import os

PG_SERVER = os.environ.get("BENCH_PG", "postgres://postgres@127.0.0.1:5432")


def recreate_database(name: str) -> None:
    import psycopg

    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")


def django_on_fresh_database(name: str) -> None:
    """Create ``name`` afresh, point Django's settings at it, set Django up and migrate."""
    recreate_database(name)
    os.environ.update(DATABASE_URL=f"{PG_SERVER}/{name}", DJANGO_SETTINGS_MODULE="webapp.settings")
    os.environ.pop("REDIS_URL", None)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def drop_database(name: str) -> None:
    """Close this process's connections to ``name`` and drop it."""
    import psycopg
    from django.db import connections

    connections.close_all()
    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
