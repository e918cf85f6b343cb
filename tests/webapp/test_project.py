from __future__ import annotations

from django.core.management import call_command


def test_it_has_migrations_for_every_model_change() -> None:
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


def test_it_passes_the_django_system_checks() -> None:
    call_command("check", "--fail-level", "WARNING", verbosity=0)


def test_it_answers_the_health_check_from_the_database(client) -> None:
    response = client.get("/health/")
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


def test_it_serves_the_admin_login(client) -> None:
    assert client.get("/admin/login/").status_code == 200
