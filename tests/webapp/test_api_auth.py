"""API authentication: sessions (with CSRF), personal API tokens, the OpenAPI document."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client

from tests.webapp.api_endpoints import JSON, TEAM_ENDPOINTS, call, over_endpoints
from webapp.api.models import ApiToken
from webapp.runs.models import Checkpoint, Run
from webapp.teams.models import Project, Team


def bearer(token: str) -> dict[str, str]:
    return {"HTTP_AUTHORIZATION": f"Bearer {token}"}


# Every endpoint that needs a login: (method, path, body). Placeholders are filled from real objects.
AUTHENTICATED = [
    ("get", "/api/me", None),
    ("get", "/api/tokens", None),
    ("post", "/api/tokens", {"name": "ci"}),
    ("delete", "/api/tokens/{token}", None),
    ("get", "/api/teams", None),
    *TEAM_ENDPOINTS,
    ("get", "/api/presets", None),
    ("get", "/api/schema", None),
    ("get", "/api/workers", None),
]


@pytest.fixture
def ids(team: Team, project: Project, api_run: Run, member: Any) -> dict[str, int]:
    from webapp.runs.models import ShareLink

    token = ApiToken.issue(member, "x")[0]
    return {
        "team": team.pk,
        "project": project.pk,
        "run": api_run.pk,
        "checkpoint": Checkpoint.objects.create(run=api_run, seq=1, step=1, path="ckpt-1", bytes=1).pk,
        "share": ShareLink.create(api_run, member).pk,
        "token": token.pk,
    }


@over_endpoints(AUTHENTICATED)
def test_anonymous_gets_401_everywhere(
    method: str, path: str, body: Any, ids: dict[str, int], client_for: Callable[..., Client]
) -> None:
    response = call(client_for(None), method, path, body, ids)
    assert response.status_code == 401, response.content
    assert "authentication required" in response.json()["detail"]
    assert response["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "header",
    ["Bearer trb_unknown-token", "Bearer ", "Bearer nonsense", "Basic dXNlcjpwYXNz", "trb_no-scheme"],
)
def test_unknown_or_malformed_token_is_401_even_with_a_session(
    header: str, member: Any, client_for: Callable[..., Client]
) -> None:
    # A bad token is refused even when a valid session cookie rides along.
    response = client_for(member).get("/api/me", HTTP_AUTHORIZATION=header)
    assert response.status_code == 401
    assert "Bearer" in response.json()["detail"] or "token" in response.json()["detail"]


def test_token_authenticates_without_a_session(
    member: Any, api_run: Run, token_for: Callable[[Any], str], client_for: Callable[..., Client]
) -> None:
    token = token_for(member)
    client = client_for(None)
    me = client.get("/api/me", **bearer(token))
    assert me.status_code == 200
    assert me.json()["username"] == member.username
    assert me.json()["teams"] == [
        {
            "id": api_run.project.team_id,
            "name": "Alignment",
            "slug": "alignment",
            "role": "member",
            "created_at": me.json()["teams"][0]["created_at"],
        }
    ]
    # Unsafe methods work with a token and no CSRF token (no cookie is involved).
    strict = client_for(None, enforce_csrf_checks=True)
    response = strict.patch(
        f"/api/runs/{api_run.pk}", {"notes": "via token"}, content_type=JSON, **bearer(token)
    )
    assert response.status_code == 200, response.content
    assert response.json()["notes"] == "via token"
    assert ApiToken.objects.get(user=member).last_used_at is not None


def test_revoked_token_is_401(member: Any, client_for: Callable[..., Client]) -> None:
    client = client_for(member)
    created = client.post("/api/tokens", {"name": "laptop"}, content_type=JSON)
    assert created.status_code == 201
    token = created.json()["token"]
    assert client_for(None).get("/api/me", **bearer(token)).status_code == 200

    assert client.delete(f"/api/tokens/{created.json()['id']}").status_code == 204
    response = client_for(None).get("/api/me", **bearer(token))
    assert response.status_code == 401
    assert "revoked" in response.json()["detail"]


def test_inactive_user_token_is_401(
    member: Any, token_for: Callable[[Any], str], client_for: Callable[..., Client]
) -> None:
    token = token_for(member)
    member.is_active = False
    member.save(update_fields=["is_active"])
    assert client_for(None).get("/api/me", **bearer(token)).status_code == 401


def test_token_is_stored_only_as_a_hash_and_shown_once(
    member: Any, client_for: Callable[..., Client]
) -> None:
    client = client_for(member)
    created = client.post("/api/tokens", {"name": "  ci runner  "}, content_type=JSON).json()
    plaintext = created["token"]
    assert plaintext.startswith("trb_") and len(plaintext) > 40
    row = ApiToken.objects.get(pk=created["id"])
    assert row.name == "ci runner"
    assert row.key_hash == hashlib.sha256(plaintext.encode()).hexdigest()
    assert plaintext not in {row.name, row.prefix, row.key_hash}
    assert plaintext.startswith(row.prefix) and created["prefix"] == row.prefix
    listed = client.get("/api/tokens").json()
    assert [t["id"] for t in listed] == [row.pk]
    assert "token" not in listed[0]
    assert listed[0]["active"] is True


def test_tokens_are_private_to_their_owner(
    member: Any, viewer: Any, client_for: Callable[..., Client]
) -> None:
    mine = client_for(member).post("/api/tokens", {"name": "mine"}, content_type=JSON).json()
    other = client_for(viewer)
    assert other.get("/api/tokens").json() == []
    assert other.delete(f"/api/tokens/{mine['id']}").status_code == 404
    assert ApiToken.objects.get(pk=mine["id"]).revoked_at is None


@pytest.mark.parametrize("name", ["", "   ", "x" * 101])
def test_token_name_is_required(name: str, member: Any, client_for: Callable[..., Client]) -> None:
    response = client_for(member).post("/api/tokens", {"name": name}, content_type=JSON)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "payload", "name"]


def test_session_needs_csrf_for_unsafe_methods(
    api_run: Run, member: Any, client_for: Callable[..., Client]
) -> None:
    client = client_for(member, enforce_csrf_checks=True)
    assert client.get(f"/api/runs/{api_run.pk}").status_code == 200  # safe methods need none
    refused = client.patch(f"/api/runs/{api_run.pk}", {"notes": "x"}, content_type=JSON)
    assert refused.status_code == 403
    assert "CSRF" in refused.json()["detail"]

    # With the CSRF cookie and header, as the browser sends them, it passes.
    from django.middleware.csrf import _get_new_csrf_string, _mask_cipher_secret

    secret = _get_new_csrf_string()
    client.cookies["csrftoken"] = secret
    accepted = client.patch(
        f"/api/runs/{api_run.pk}",
        {"notes": "x"},
        content_type=JSON,
        HTTP_X_CSRFTOKEN=_mask_cipher_secret(secret),
    )
    assert accepted.status_code == 200, accepted.content


def test_anonymous_unsafe_request_is_401_not_a_csrf_error(
    api_run: Run, client_for: Callable[..., Client]
) -> None:
    client = client_for(None, enforce_csrf_checks=True)
    assert client.post(f"/api/runs/{api_run.pk}/cancel").status_code == 401


def test_openapi_document(client_for: Callable[..., Client]) -> None:
    client = client_for(None)
    doc = client.get("/api/openapi.json")
    assert doc.status_code == 200
    spec = doc.json()
    paths = spec["paths"]
    for path in [
        "/api/me",
        "/api/tokens",
        "/api/teams/{team_id}/projects",
        "/api/projects/{project_id}/runs",
        "/api/runs/{run_id}",
        "/api/runs/{run_id}/cancel",
        "/api/runs/{run_id}/resume",
        "/api/runs/{run_id}/fork",
        "/api/runs/{run_id}/metrics/series",
        "/api/runs/{run_id}/metrics.csv",
        "/api/runs/{run_id}/samples",
        "/api/runs/{run_id}/samples/steps",
        "/api/runs/{run_id}/shares/{share_id}",
        "/api/shared/{token}",
        "/api/presets",
        "/api/schema",
        "/api/workers",
    ]:
        assert path in paths, path
    # Every operation is summarised, and the launch documents its 422.
    for operations in paths.values():
        for operation in operations.values():
            assert operation.get("summary"), operation
    assert "422" in paths["/api/projects/{project_id}/runs"]["post"]["responses"]
    schemes = spec["components"]["securitySchemes"]
    assert {s["type"] for s in schemes.values()} == {"http", "apiKey"}
    # No interactive docs page: ninja's loads Swagger UI from a CDN, and nothing may be
    # fetched from a CDN at run time (the dashboard issue serves static files).
    assert client.get("/api/docs").status_code == 404


def test_unexpected_errors_never_leak_a_traceback(
    api_run: Run,
    member: Any,
    client_for: Callable[..., Client],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    settings: Any,
) -> None:
    from webapp.api import serializers

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret internals")

    settings.DEBUG = True  # even with DEBUG on, the response holds no traceback
    monkeypatch.setattr(serializers, "run_out", broken)
    with caplog.at_level(logging.ERROR, logger="webapp.api.api"):
        response = client_for(member).get(f"/api/runs/{api_run.pk}")
    assert response.status_code == 500
    assert response["Content-Type"].startswith("application/json")
    assert response.json() == {"detail": "internal error: the server log has the details"}
    assert b"secret internals" not in response.content and b"Traceback" not in response.content
    assert "secret internals" in caplog.text


def test_presets_and_schema(member: Any, client_for: Callable[..., Client]) -> None:
    from engine.config import PRESETS, json_schema

    client = client_for(member)
    assert client.get("/api/presets").json() == PRESETS
    schema = client.get("/api/schema").json()
    assert schema == json_schema()
    assert "x-presets" in schema and "algorithm" in schema["properties"]
