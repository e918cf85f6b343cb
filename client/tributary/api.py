"""The two calls of the web app's external-runs API that the client makes (standard library HTTP).

- ``POST /api/runs/external`` creates the run of a script, idempotently: the script's
  ``client_id`` (a uuid chosen once, kept in ``run.json``) makes a retry after a lost response,
  or a restarted script, get the same run back (200 instead of 201).
- ``POST /api/runs/{id}/ingest-token`` gives a fresh ingest token for that run (a resumed script,
  ``python -m tributary sync``, or a token that expired while the server was out of reach).

Both carry the script's ``claim``, host and pid when the caller gives them: while another script
holds the run (the same ``client_id`` from a copy of the script's directory), the web app answers
409 with ``held_by`` and no token; ``ApiError.held_by`` says so (``tributary.protocol``).

Both authenticate with a personal API token (``Authorization: Bearer``), made on the web app's
account page. ``ApiError.retriable`` separates what waiting can fix (no answer, 5xx, 408, 429)
from what it cannot (a bad token, an unknown project): the caller retries only the former.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# A response body larger than this is not the API's: refuse it rather than hold it in memory.
MAX_RESPONSE_BYTES = 1024 * 1024
RETRIABLE_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


class ApiError(RuntimeError):
    """An API call that failed; ``status`` is None when no HTTP answer came at all."""

    def __init__(
        self, message: str, *, status: int | None = None, retriable: bool = False, held_by: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retriable = retriable
        self.held_by = held_by  # another script holds the run: the host it reports from (a 409)


@dataclass(frozen=True)
class ServerRun:
    """Where an external run lives on the server, and a token to ship its events."""

    id: int
    url: str
    ingest_token: str


def check_url(url: str) -> str:
    """``url`` without a trailing slash, or a ``ValueError`` that says how to give a usable one."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"the Tributary URL {url!r} is not an http(s):// URL: set TRIBUTARY_URL (or pass url=/--url) "
            "to the web app's address, e.g. http://localhost:8000"
        )
    return url.strip().rstrip("/")


class Api:
    """The web app at ``url`` (its base address), called with the personal API ``token``."""

    def __init__(self, url: str, token: str, *, timeout: float = 30.0) -> None:
        self.url = check_url(url)
        if not token:
            raise ValueError(
                "no API token: set TRIBUTARY_TOKEN (or pass token=/--token) to a personal API token "
                "from the web app's account page"
            )
        self.token = token
        self.timeout = timeout

    def create_run(
        self,
        *,
        project: str,
        name: str,
        config: dict[str, Any],
        tags: list[str],
        client_id: str,
        script: dict[str, Any] | None = None,
    ) -> ServerRun:
        """``script``: ``{"claim", "host", "pid"}`` of a script that holds its run (module docstring)."""
        body = {"project": project, "name": name, "config": config, "tags": tags, "client_id": client_id}
        answer = self._post("/api/runs/external", {**body, **(script or {})})
        return ServerRun(
            id=_field(answer, "id", int),
            url=_field(answer, "url", str),
            ingest_token=_field(answer, "ingest_token", str),
        )

    def ingest_token(
        self, run_id: int, page_url: str = "", script: dict[str, Any] | None = None
    ) -> ServerRun:
        """A fresh ingest token for run ``run_id`` (whose page is ``page_url``), for ``script``
        (as in ``create_run``)."""
        answer = self._post(f"/api/runs/{int(run_id)}/ingest-token", dict(script or {}))
        return ServerRun(id=run_id, url=page_url, ingest_token=_field(answer, "ingest_token", str))

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path,
            method="POST",
            data=json.dumps(body, allow_nan=False).encode(),
            headers={
                "Authorization": f"Bearer {self.token}",
                "Content-Type": "application/json",
                "Accept": "application/json",
            },
        )
        try:
            with _OPENER.open(request, timeout=self.timeout) as response:
                raw = response.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as exc:
            if exc.code in _REDIRECTS:
                raise ApiError(
                    f"POST {path}: the web app redirects to {exc.headers.get('Location')!r}: set TRIBUTARY_URL "
                    "(or url=/--url) to the address it redirects to",
                    status=exc.code,
                ) from None
            detail, body = _detail(exc)
            held_by = body.get("held_by") if exc.code == 409 else None
            hint = {
                401: " (check TRIBUTARY_TOKEN: a personal API token from the account page)",
                403: " (the token's user may not launch runs in this project)",
                404: " (check the project's slug, and that TRIBUTARY_URL is the web app's address)",
            }.get(exc.code, "")
            raise ApiError(
                f"POST {path}: HTTP {exc.code}: {detail}{hint}",
                status=exc.code,
                retriable=exc.code in RETRIABLE_STATUSES,
                held_by=held_by if isinstance(held_by, str) else None,
            ) from None
        except (OSError, ValueError) as exc:  # URLError, refused, reset, timeouts, a bad status line
            raise ApiError(f"POST {path}: no answer from {self.url}: {exc}", retriable=True) from None
        if len(raw) > MAX_RESPONSE_BYTES:
            raise ApiError(
                f"POST {path}: the answer is larger than {MAX_RESPONSE_BYTES} bytes", retriable=True
            )
        try:
            answer = json.loads(raw)
        except ValueError:
            raise ApiError(f"POST {path}: the answer is not JSON: {raw[:200]!r}", retriable=True) from None
        if not isinstance(answer, dict):
            raise ApiError(f"POST {path}: the answer is not a JSON object: {raw[:200]!r}", retriable=True)
        return answer


_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects are errors: urllib would turn the POST into a GET and send the personal token
    (the Authorization header) on to wherever the answer points, http included."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _detail(exc: urllib.error.HTTPError) -> tuple[str, dict[str, Any]]:
    """The error's words, and its JSON body (``{}`` when it has none)."""
    try:
        raw = exc.read(4096)
        body = json.loads(raw)
    except (OSError, ValueError):
        return (exc.reason if isinstance(exc.reason, str) else str(exc)), {}
    if isinstance(body, dict) and "detail" in body:
        detail = body["detail"]
        return (detail if isinstance(detail, str) else json.dumps(detail)[:1000]), body
    return raw[:1000].decode("utf-8", "replace"), body if isinstance(body, dict) else {}


def _field(answer: dict[str, Any], name: str, kind: type) -> Any:
    value = answer.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ApiError(f"the web app's answer has no usable {name!r}: {answer!r:.300}", retriable=False)
    return value
