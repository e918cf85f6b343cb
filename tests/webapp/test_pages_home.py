"""Sign-in, the landing page and the static files the pages need (served by the web process)."""

from __future__ import annotations

from typing import Any

from django.test import Client

from webapp.teams.models import Project


def test_pages_need_a_sign_in(client: Client) -> None:
    response = client.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/login/?next=/")


def test_sign_in_with_a_password_then_out(client: Client, django_user_model: Any) -> None:
    django_user_model.objects.create_user("erin", password="a long pass phrase")
    bad = client.post("/login/", {"username": "erin", "password": "wrong"})
    assert bad.status_code == 200 and b"enter a correct username and password" in bad.content
    good = client.post("/login/", {"username": "erin", "password": "a long pass phrase"})
    assert good.status_code == 302 and good["Location"] == "/"
    assert client.get("/").status_code == 200
    assert client.post("/logout/").status_code == 302
    assert client.get("/").status_code == 302


def test_home_lists_only_the_callers_teams_and_projects(
    client: Client, member: Any, project: Project, other_team: Any
) -> None:
    Project.objects.create(team=other_team, name="Secret", slug="secret")
    client.force_login(member)
    page = client.get("/").content.decode()
    assert "Alignment" in page and "GSM8K" in page and "you are member" in page
    assert "Secret" not in page and "Other lab" not in page


def test_a_user_without_a_team_is_told_what_to_do(client: Client, django_user_model: Any) -> None:
    client.force_login(django_user_model.objects.create_user("lonely"))
    assert "ask a team admin to add you" in client.get("/").content.decode()


def test_front_end_libraries_come_from_npm_through_the_web_process(client: Client) -> None:
    for path in ("/static/vendor/uplot/uPlot.esm.js", "/static/vendor/htmx/htmx.min.js",
                 "/static/tributary/app.js", "/static/tributary/app.css"):  # fmt: skip
        response = client.get(path)
        assert response.status_code == 200, path
        b"".join(response.streaming_content if response.streaming else [response.content])
