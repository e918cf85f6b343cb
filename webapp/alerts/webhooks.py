"""Calling a project's alert webhook: one JSON POST per batch of alerts, off the ingest path.

The URL is user input, and the request leaves from inside the deployment, so it is a server-side
request forgery vector: a URL naming ``localhost:6379`` or a cloud metadata address would make the
web app talk to them. Hence:

- only ``http``/``https`` URLs without credentials (``check_url``, also run when the setting is
  saved, so the form names the problem);
- the host is resolved once, every address must be public (``ipaddress``: not private, loopback,
  link-local, multicast, reserved or unspecified), and the connection goes to the address that
  was checked (no second lookup a DNS rebinding could answer differently). TLS still verifies the
  certificate against the host name;
- a short timeout, no redirects followed, the response body not read beyond its status;
- requests run on a small thread pool, so a slow receiver delays nothing but other webhooks.

``TRIBUTARY_WEBHOOKS_ALLOW_PRIVATE`` (setting) admits private addresses, for a receiver inside
the team's own network (and the tests' local receiver).
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import logging
import socket
import ssl
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0
_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="alert-webhook")


class WebhookRefused(ValueError):
    """The URL may not be called; the message says why."""


def check_url(url: str) -> tuple[str, str, int, str]:
    """``(scheme, host, port, path)`` of a URL we may call, else ``WebhookRefused`` saying why."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise WebhookRefused("the webhook URL must start with http:// or https://")
    if parts.username or parts.password:
        raise WebhookRefused(
            "the webhook URL must not carry a user name or password; put a token in its path"
        )
    if not parts.hostname:
        raise WebhookRefused("the webhook URL has no host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise WebhookRefused(f"the webhook URL's port is not a number: {exc}") from None
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return parts.scheme, parts.hostname, port, path


def check_setting(url: str) -> None:
    """What can be known of a URL when it is saved, without a DNS lookup (the request that saves
    it must not wait on a resolver): its form, and an address given literally (or ``localhost``)
    must be allowed. Names are resolved and checked at each delivery."""
    _, host, _, _ = check_url(url)
    literal = "127.0.0.1" if host.lower() in ("localhost", "localhost.") else host
    try:
        ipaddress.ip_address(literal)
    except ValueError:
        return
    _allowed(host, literal)


def _allowed(host: str, address: str) -> None:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if not ip.is_global and not getattr(settings, "TRIBUTARY_WEBHOOKS_ALLOW_PRIVATE", False):
        raise WebhookRefused(
            f"the webhook host {host!r} resolves to {address}, which is not a public address "
            "(set TRIBUTARY_WEBHOOKS_ALLOW_PRIVATE=true to call receivers inside your network)"
        )
    if ip.is_multicast or ip.is_unspecified:
        raise WebhookRefused(f"the webhook host {host!r} resolves to {address}, which cannot be called")


def public_address(host: str, port: int) -> str:
    """The address to connect to: the first of the host's, once all of them are allowed."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise WebhookRefused(f"the webhook host {host!r} does not resolve: {exc}") from None
    addresses = [info[4][0] for info in infos]
    for address in addresses:
        _allowed(host, address)
    return addresses[0]


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to a checked address, with SNI and certificate verification against the host name."""

    def __init__(self, address: str, host: str, port: int, timeout: float) -> None:
        super().__init__(address, port, timeout=timeout, context=ssl.create_default_context())
        self._server_name = host

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self._server_name)  # type: ignore[attr-defined]


def deliver(url: str, body: dict[str, Any]) -> int:
    """POST ``body`` as JSON to ``url``; the response status. Raises ``WebhookRefused`` or ``OSError``."""
    scheme, host, port, path = check_url(url)
    address = public_address(host, port)
    if scheme == "https":
        conn: http.client.HTTPConnection = _PinnedHTTPSConnection(address, host, port, TIMEOUT_S)
    else:
        conn = http.client.HTTPConnection(address, port, timeout=TIMEOUT_S)
    data = json.dumps(body).encode()
    try:
        conn.request(
            "POST",
            path,
            body=data,
            headers={
                "Host": host if port in (80, 443) else f"{host}:{port}",
                "Content-Type": "application/json",
                "User-Agent": "tributary-alerts",
            },
        )
        return conn.getresponse().status
    finally:
        conn.close()


def _deliver_logged(url: str, body: dict[str, Any]) -> int | None:
    try:
        status = deliver(url, body)
    except (WebhookRefused, OSError, http.client.HTTPException) as exc:
        log.warning("alert webhook of run %s not delivered: %s", body.get("run", {}).get("id"), exc)
        return None
    if status >= 300:
        log.warning("alert webhook of run %s answered %s", body.get("run", {}).get("id"), status)
    return status


def post_later(url: str, body: dict[str, Any]) -> Future:
    """Deliver on the pool; failures are logged, never raised into the caller."""
    return _pool.submit(_deliver_logged, url, body)


def payload(run: Any, alerts: list[dict[str, Any]]) -> dict[str, Any]:
    """What the receiver gets: the run (id, name, project, team, page path) and its new alerts."""
    return {
        "run": {
            "id": run.pk,
            "name": run.name,
            "project": run.project.name,
            "team": run.project.team.name,
            "url": run.get_absolute_url(),
        },
        "alerts": alerts,
    }
