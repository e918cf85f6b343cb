"""Malformed input never makes a 500: every page and API route, crawled from the URL patterns
with real ids, gets each kind of input that once did (issue 13, item 5).

- a NUL character in query parameters, path segments (share tokens) and form fields: 400 from
  ``webapp.middleware.RejectUnstorableInput``;
- percent-encoded bytes that are not UTF-8, among them the bytes of a lone surrogate: 400;
- Unicode digits (``²``, ``٣``) and integers beyond ``bigint`` where ids and numbers are
  expected: a 4xx (404 for a page, 422 naming the parameter for the API), never a 500;
- in JSON bodies, NUL and lone surrogates (``"\\ud800"``: valid JSON) in every text field, and
  integers beyond ``bigint``: a 422 whose ``loc`` names the field.

The routes come from the URL resolver and the API's own OpenAPI document, so a route added
later is crawled too. Runs on SQLite and on PostgreSQL (where NUL and out-of-range integers
used to raise).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from django.test import Client
from django.urls import URLResolver, get_resolver

from tests.webapp.world import World, build_world

# How each kind of bad input is written in a URL or a form body (percent-encoded by us, so
# that bytes which are not UTF-8 can be sent at all), and what it must get.
RAW: dict[str, str] = {
    "nul": "a%00b",
    "undecodable": "%FF%FE",
    "surrogate": "%ED%A0%80",  # U+D800 as UTF-8 would spell it: not valid UTF-8
    "unicode_digit": quote("²"),
    "arabic_digit": quote("٣"),
    "beyond_bigint": str(2**64),
}
REFUSED_BY_MIDDLEWARE = {"nul", "undecodable", "surrogate"}

# Every query parameter a page reads (found with: grep -rn "GET.get\|GET.getlist" webapp/pages).
PAGE_PARAMS = ["q", "sort", "page", "step", "at", "follow", "from", "preset", "runs", "status", "tag", "archived"]
# Every form field a page reads (POST), including a generated field of the launch form.
FORM_FIELDS = [
    "username", "role", "name", "slug", "description", "tags", "notes", "checkpoint", "runs",
    "return_query", "queue", "_mode", "_action", "_from", "_preset", "config_yaml", "config.name",
    "note", "days", "confirm", "password1", "password2",
]  # fmt: skip


def _page_routes() -> Iterator[str]:
    def walk(patterns: list[Any], prefix: str) -> Iterator[str]:
        for p in patterns:
            route = prefix + str(p.pattern)
            if isinstance(p, URLResolver):
                if not route.startswith(("admin/", "api/")):  # Django's admin; the API: below
                    yield from walk(p.url_patterns, route)
            elif not route.startswith("api/"):
                yield route

    return walk(get_resolver().url_patterns, "")


def _fill(route: str, values: dict[str, Any], raw: dict[str, str] | None = None) -> str:
    """``route`` with its ``<conv:name>`` / ``{name}`` parameters set from ``values`` (quoted),
    or, for the names in ``raw``, to that already percent-encoded text."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        return raw[name] if raw and name in raw else quote(str(values[name]), safe="")

    path = re.sub(r"<(?:\w+:)?(\w+)>", one, route)
    return "/" + re.sub(r"\{(\w+)\}", one, path).lstrip("/")


def _params(route: str) -> list[str]:
    return [a or b for a, b in re.findall(r"<(?:\w+:)?(\w+)>|\{(\w+)\}", route)]


@pytest.fixture
def world(django_user_model: Any) -> World:
    return build_world(django_user_model)


@pytest.fixture
def admin_client(world: World) -> Client:
    client = Client(HTTP_AUTHORIZATION=f"Bearer {world.token}")
    client.force_login(world.admin)
    return client


@pytest.fixture
def openapi(admin_client: Client) -> dict[str, Any]:
    response = admin_client.get("/api/openapi.json")
    assert response.status_code == 200
    return response.json()


def _request(client: Client, method: str, url: str, **kwargs: Any) -> Any:
    if method == "GET":
        kwargs.pop("data", None)
        kwargs.pop("content_type", None)
    return getattr(client, method.lower())(url, **kwargs)


def _check(failures: list[str], response: Any, method: str, url: str, expect: set[int] | None = None) -> None:
    ok = response.status_code < 500 if expect is None else response.status_code in expect
    if not ok:
        body = response.content[:300] if not getattr(response, "streaming", False) else b"<stream>"
        failures.append(f"{method} {url} -> {response.status_code} {body!r}")


@pytest.mark.parametrize("kind", sorted(RAW))
def test_pages_query_parameters(kind: str, world: World, admin_client: Client) -> None:
    """Each page, with each query parameter a page reads set to the bad value, one at a time."""
    failures: list[str] = []
    expect = {400} if kind in REFUSED_BY_MIDDLEWARE else None
    anonymous = Client()
    for route in _page_routes():
        path = _fill(route, world.ids())
        for param in PAGE_PARAMS:
            url = f"{path}?{param}={RAW[kind]}"
            _check(failures, admin_client.get(url), "GET", url, expect)
            if "share" in route:
                _check(failures, anonymous.get(url), "GET (anonymous)", url, expect)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("kind", sorted(RAW))
def test_pages_path_parameters(kind: str, world: World, admin_client: Client) -> None:
    """Each page with every id or token in its path replaced by the bad value."""
    failures: list[str] = []
    anonymous = Client()
    for route in _page_routes():
        if "<" not in route:
            continue
        url = _fill(route, world.ids(), raw=dict.fromkeys(_params(route), RAW[kind]))
        for method in ("GET", "POST"):
            # A NUL is refused as such; the other values do not match an <int:> route (404).
            expect = {400} if kind == "nul" else None
            _check(failures, _request(admin_client, method, url), method, url, expect)
            if "share" in route:
                _check(failures, _request(anonymous, method, url), f"{method} (anonymous)", url, expect)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("kind", sorted(RAW))
def test_pages_form_fields(kind: str, world: World, admin_client: Client) -> None:
    """Every page posted a form whose fields all hold the bad value, urlencoded and multipart."""
    failures: list[str] = []
    expect = {400} if kind in REFUSED_BY_MIDDLEWARE else None
    body = "&".join(f"{field}={RAW[kind]}" for field in FORM_FIELDS)
    for route in _page_routes():
        url = _fill(route, world.ids())
        response = admin_client.post(url, data=body, content_type="application/x-www-form-urlencoded")
        _check(failures, response, "POST (urlencoded)", url, expect)
        if kind in ("nul", "unicode_digit", "beyond_bigint"):  # text the multipart parser keeps as is
            value = {"nul": "a\x00b", "unicode_digit": "²", "beyond_bigint": str(2**64)}[kind]
            response = admin_client.post(url, data=dict.fromkeys(FORM_FIELDS, value))
            _check(failures, response, "POST (multipart)", url, {400} if kind == "nul" else None)
    assert not failures, "\n".join(failures)


def _api_operations(openapi: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, methods in openapi["paths"].items():
        for method, operation in methods.items():
            yield method.upper(), path, operation


@pytest.mark.parametrize("kind", sorted(RAW))
def test_api_query_and_path_parameters(
    kind: str, world: World, admin_client: Client, openapi: dict[str, Any]
) -> None:
    """Every API operation with each of its query parameters, then each path parameter, bad."""
    failures: list[str] = []
    anonymous = Client()
    middleware = kind in REFUSED_BY_MIDDLEWARE
    for method, route, operation in _api_operations(openapi):
        documented = {int(code) for code in operation["responses"]}
        path = _fill(route, world.ids())
        clients = [admin_client, anonymous] if "/shared/" in route else [admin_client]
        for param in operation.get("parameters", []):
            if param["in"] == "query":
                url = f"{path}?{param['name']}={RAW[kind]}"
                expect = {400} if middleware else None
            elif param["in"] == "path":
                url = _fill(route, world.ids(), raw={param["name"]: RAW[kind]})
                # Django keeps bytes that are not UTF-8 percent-encoded in the path: a 404/422 then.
                expect = {400} if kind == "nul" else None
            else:
                continue
            for client in clients:
                response = _request(client, method, url, content_type="application/json", data="{}")
                _check(failures, response, method, url, expect)
                if response.status_code not in documented:
                    failures.append(f"{method} {url} -> {response.status_code}: not in the OpenAPI document")
    assert not failures, "\n".join(failures)


def _schema(openapi: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in schema:
        return openapi["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _field_kind(schema: dict[str, Any]) -> str:
    options = schema.get("anyOf", [schema])
    kinds = {o.get("type") for o in options}
    for kind in ("string", "integer", "array", "object"):
        if kind in kinds:
            return kind
    return "object"  # Any: free-form JSON


@pytest.mark.parametrize("kind", ["nul", "surrogate", "beyond_bigint", "not_finite"])
def test_api_json_bodies_name_the_field(
    kind: str, world: World, admin_client: Client, openapi: dict[str, Any]
) -> None:
    """Each field of each JSON body, alone, set to the bad value: a 422 whose loc names it."""
    failures: list[str] = []
    text = {"nul": "a\x00b", "surrogate": "\ud800"}.get(kind)
    tried = 0
    for method, route, operation in _api_operations(openapi):
        body_schema = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
        if not body_schema:
            continue
        url = _fill(route, world.ids())
        schema = _schema(openapi, body_schema["schema"])
        for field, spec in schema.get("properties", {}).items():
            value: Any
            shape = _field_kind(spec)
            if kind == "beyond_bigint":
                if shape != "integer":
                    continue
                value = 2**64
            elif kind == "not_finite":
                if shape != "object":
                    continue
                value = {"algorithm": {"clip_ratio_high": float("inf")}}
            elif shape == "string":
                value = text
            elif shape == "array":
                value = [text]
            elif shape == "object":
                value = {"name": text, f"key{text}": 1}
            else:
                continue
            tried += 1
            raw = json.dumps({field: value})  # \u0000 and \ud800 as JSON escapes, Infinity as such
            response = _request(admin_client, method, url, data=raw, content_type="application/json")
            locs = [e.get("loc") for e in response.json().get("detail", [])] if response.status_code == 422 else []
            if response.status_code != 422 or not any(field in (loc or []) for loc in locs):
                failures.append(f"{method} {url} {field}={raw[:80]} -> {response.status_code} {response.content[:300]!r}")
    assert tried, "no JSON body field was tried: the OpenAPI document changed shape"
    assert not failures, "\n".join(failures)
