"""Typed readers for the environment variables that configure the web app.

Settings are environment variables with safe defaults (ARCHITECTURE.md): embedded mode needs none,
a team deployment sets ``DATABASE_URL`` (and later ``REDIS_URL``). Every bad value raises
``ImproperlyConfigured`` naming the variable, the value and the fix.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

from engine.paths import data_dir  # one data directory for the engine, the worker and the web app

__all__ = [
    "data_dir",
    "database_from_url",
    "database_pool_from_env",
    "env_bool",
    "env_float",
    "env_int",
    "env_list",
    "env_str",
    "secret_key_from",
]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default).strip()


def env_bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean: use one of 1/0, true/false, yes/no, on/off")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value} is too small: use at least {minimum}")
    return value


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ImproperlyConfigured(f"{name}={raw!r} is not a finite number")
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(f"{name}={value:g} is too small: use at least {minimum:g}")
    return value


def env_list(name: str, default: list[str] | None = None) -> list[str]:
    """A comma-separated list (``ALLOWED_HOSTS=example.org,.example.com``); blanks dropped."""
    raw = os.environ.get(name)
    if raw is None:
        return list(default or [])
    return [item.strip() for item in raw.split(",") if item.strip()]


def secret_key_from(data_dir: Path, env_value: str = "") -> str:
    """``SECRET_KEY`` from the environment, else the key stored in ``data_dir/secret_key``,
    generated on first use with mode 0600 so a restart keeps sessions and signed tokens valid."""
    if env_value:
        return env_value
    path = data_dir / "secret_key"
    if path.exists():
        key = path.read_text(encoding="utf-8").strip()
        if key:
            return key
    data_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(50)
    # O_EXCL: when two processes start together, one creates the file and the other reads it.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text(encoding="utf-8").strip()
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(key + "\n")
    return key


def database_pool_from_env() -> dict[str, Any] | None:
    """The options of psycopg's connection pool for PostgreSQL (Django's ``OPTIONS["pool"]``),
    sized by the deployment; None when ``DATABASE_POOL_MAX=0`` turns the pool off.

    Why a pool: under ASGI each request runs its database code in a thread of its own, and with
    persistent connections (``CONN_MAX_AGE``) every such thread kept a connection open after
    its request: 200 simultaneous requests asked PostgreSQL for ~200 connections and got
    ``too many clients already`` (500s). With the pool a web process holds at most
    ``DATABASE_POOL_MAX`` connections; a request waits up to ``DATABASE_POOL_TIMEOUT`` seconds
    for a free one, then gets a 503 (``webapp.dbpool``), never a 500.

    - ``DATABASE_POOL_MAX`` (10): connections per web process. Size it so that
      web processes x this + the other clients stay under PostgreSQL's ``max_connections``.
      0: no pool (e.g. behind PgBouncer): each request opens a connection and closes it.
    - ``DATABASE_POOL_MIN`` (2): kept open while idle. Above it, psycopg_pool closes one
      connection every ``DATABASE_POOL_MAX_IDLE`` seconds (60) while some stayed idle that long,
      so after a burst the pool shrinks back to the minimum in (max - min) x that.
    - ``DATABASE_POOL_TIMEOUT`` (30 s, psycopg_pool's own default): how long a request waits for a
      connection. Under a burst the pool queues requests instead of failing them; past this
      wait the server is overloaded, and a 503 says so before a client or proxy gives up.
    """
    max_size = env_int("DATABASE_POOL_MAX", 10, minimum=0)
    if max_size == 0:
        return None
    min_size = env_int("DATABASE_POOL_MIN", min(2, max_size), minimum=0)
    if min_size > max_size:
        raise ImproperlyConfigured(
            f"DATABASE_POOL_MIN={min_size} is larger than DATABASE_POOL_MAX={max_size}: "
            "use a minimum at most the maximum"
        )
    return {
        "min_size": min_size,
        "max_size": max_size,
        "timeout": env_float("DATABASE_POOL_TIMEOUT", 30.0, minimum=0.1),
        "max_idle": env_float("DATABASE_POOL_MAX_IDLE", 60.0, minimum=1.0),
        "name": "tributary-web",
    }


def database_from_url(url: str, data_dir: Path, pool: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``default`` database: SQLite in ``data_dir`` when ``url`` is empty, PostgreSQL
    (psycopg 3) for ``postgres://user:password@host:port/name?sslmode=...``, through a
    connection pool with the options ``pool`` (``database_pool_from_env``) when given.

    No persistent connections either way (``CONN_MAX_AGE`` 0, which Django's pool requires):
    a connection goes back to the pool, or is closed, when its request or task ends."""
    if not url:
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(data_dir / "tributary.sqlite3"),
            # Writers wait for each other instead of failing with "database is locked".
            "OPTIONS": {
                "timeout": 20,
                "transaction_mode": "IMMEDIATE",
                # WAL: the web process reads while it writes an ingest batch.
                "init_command": "PRAGMA journal_mode=WAL;",
            },
            # A file, not Django's default in-memory test database: the web process, the
            # ingest path and the tests use several connections at once, as in production.
            "TEST": {"NAME": str(data_dir / "test_tributary.sqlite3")},
        }
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql"}:
        raise ImproperlyConfigured(
            f"DATABASE_URL scheme {parts.scheme!r} is not supported: use postgres://user:password@host:5432/name, "
            "or leave DATABASE_URL unset for SQLite in the data directory"
        )
    name = unquote(parts.path.lstrip("/"))
    if not name:
        raise ImproperlyConfigured(
            f"DATABASE_URL {_redacted(url)!r} names no database: add /<name> after the host"
        )
    try:
        port = parts.port
    except ValueError as exc:
        raise ImproperlyConfigured(f"DATABASE_URL {_redacted(url)!r} has a bad port: {exc}") from None
    options: dict[str, Any] = dict(parse_qsl(parts.query))
    if pool:
        options["pool"] = dict(pool)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": unquote(parts.hostname or ""),
        "PORT": str(port or ""),
        "OPTIONS": options,
        "CONN_MAX_AGE": 0,
        # With the pool: psycopg checks a connection as it leaves the pool; without: Django
        # checks it before reusing it within a request.
        "CONN_HEALTH_CHECKS": True,
    }


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)
