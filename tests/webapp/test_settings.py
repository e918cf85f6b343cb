from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from webapp.config import database_from_url, env_bool, env_list, secret_key_from

REPO = Path(__file__).resolve().parents[2]


def test_it_generates_a_secret_key_once_into_the_data_directory(tmp_path) -> None:
    data = tmp_path / "data"
    key = secret_key_from(data)
    path = data / "secret_key"
    assert len(key) >= 50
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert secret_key_from(data) == key  # a restart keeps sessions and signed tokens valid


def test_it_prefers_a_secret_key_from_the_environment(tmp_path) -> None:
    assert secret_key_from(tmp_path, "from-env") == "from-env"
    assert not (tmp_path / "secret_key").exists()


def test_it_uses_sqlite_in_the_data_directory_without_a_database_url(tmp_path) -> None:
    db = database_from_url("", tmp_path)
    assert db["ENGINE"] == "django.db.backends.sqlite3"
    assert db["NAME"] == str(tmp_path / "tributary.sqlite3")


def test_it_reads_postgres_settings_from_a_database_url(tmp_path) -> None:
    db = database_from_url(
        "postgresql://tri%40bot:p%2Fss@db.internal:6543/runs%20db?sslmode=require", tmp_path
    )
    assert db["ENGINE"] == "django.db.backends.postgresql"
    assert (db["USER"], db["PASSWORD"], db["HOST"], db["PORT"], db["NAME"]) == (
        "tri@bot", "p/ss", "db.internal", "6543", "runs db"
    )  # fmt: skip
    assert db["OPTIONS"] == {"sslmode": "require"}
    assert database_from_url("postgres://postgres@127.0.0.1/test", tmp_path)["PORT"] == ""


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://root@localhost/x", "scheme 'mysql' is not supported"),
        ("postgres://u:secret@localhost", r"names no database: add /<name>"),
        ("postgres://u@localhost:notaport/x", "has a bad port"),
    ],
)
def test_it_refuses_a_bad_database_url_without_leaking_the_password(tmp_path, url, message) -> None:
    with pytest.raises(ImproperlyConfigured, match=message) as caught:
        database_from_url(url, tmp_path)
    assert "secret" not in str(caught.value)


def test_it_reads_booleans_and_lists_strictly(monkeypatch) -> None:
    monkeypatch.setenv("TRIBUTARY_FLAG", "Yes")
    assert env_bool("TRIBUTARY_FLAG") is True
    monkeypatch.setenv("TRIBUTARY_FLAG", "maybe")
    with pytest.raises(ImproperlyConfigured, match="TRIBUTARY_FLAG='maybe' is not a boolean"):
        env_bool("TRIBUTARY_FLAG")
    monkeypatch.setenv("TRIBUTARY_HOSTS", " a.example, ,.b.example ")
    assert env_list("TRIBUTARY_HOSTS") == ["a.example", ".b.example"]
    assert env_list("TRIBUTARY_UNSET_LIST", ["x"]) == ["x"]


def test_it_runs_these_tests_on_the_database_database_url_names() -> None:
    expected = "postgresql" if os.environ.get("DATABASE_URL") else "sqlite"
    assert connection.vendor == expected
    assert settings.DEBUG is False


def _settings_in_a_fresh_process(env: dict[str, str]) -> dict:
    code = (
        "import json; from django.conf import settings as s; "
        "print(json.dumps({'engine': s.DATABASES['default']['ENGINE'], 'name': s.DATABASES['default']['NAME'], "
        "'key': s.SECRET_KEY, 'debug': s.DEBUG, 'hosts': s.ALLOWED_HOSTS}))"
    )
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "SECRET_KEY", "DEBUG", "ALLOWED_HOSTS"}
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "DJANGO_SETTINGS_MODULE": "webapp.settings", **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_it_switches_the_settings_on_environment_variables(tmp_path) -> None:
    data = tmp_path / "embedded"
    embedded = _settings_in_a_fresh_process({"TRIBUTARY_DATA_DIR": str(data)})
    assert embedded["engine"].endswith("sqlite3") and embedded["name"] == str(data / "tributary.sqlite3")
    assert embedded["key"] == (data / "secret_key").read_text().strip()
    assert embedded["debug"] is False and "localhost" in embedded["hosts"]

    team = _settings_in_a_fresh_process(
        {
            "TRIBUTARY_DATA_DIR": str(tmp_path / "team"),
            "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/tributary",
            "SECRET_KEY": "k" * 50,
            "DEBUG": "true",
            "ALLOWED_HOSTS": "tributary.example.org",
        }
    )
    assert (team["engine"], team["name"], team["key"]) == (
        "django.db.backends.postgresql",
        "tributary",
        "k" * 50,
    )
    assert team["debug"] is True and team["hosts"] == ["tributary.example.org"]
    assert not (tmp_path / "team").exists()  # nothing written when every setting is given
