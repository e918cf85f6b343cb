"""The client's two API calls against a plain HTTP server (what it sends where; the web app's own
answers are tests/client/test_run_server.py's): a redirect is an error that names the address,
never a POST turned into a GET that carries the personal token elsewhere; a run directory made
against another web app gets a run created here rather than a token for an unrelated id."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tributary.api import Api, ApiError
from tributary.run import read_meta, server_run, write_meta


class Recorder(BaseHTTPRequestHandler):
    calls: ClassVar[list[tuple[str, str, str]]] = []
    redirect_to = ""

    def do_POST(self) -> None:
        self.calls.append(("POST", self.path, self.headers.get("Authorization", "")))
        if self.redirect_to:
            self.send_response(302)
            self.send_header("Location", self.redirect_to)
            self.end_headers()
            return
        body = {"id": 41, "url": "http://here/runs/41/", "ingest_token": "fresh"}
        data = json.dumps(body).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.calls.append(("GET", self.path, self.headers.get("Authorization", "")))
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    Recorder.calls = []
    Recorder.redirect_to = ""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_redirect_is_an_error_that_names_the_address(server: str) -> None:
    Recorder.redirect_to = f"{server}/elsewhere"
    with pytest.raises(ApiError, match=r"redirects to .*/elsewhere.*set TRIBUTARY_URL"):
        Api(server, "trb_secret").create_run(project="p", name="n", config={}, tags=[], client_id="c")
    assert Recorder.calls == [("POST", "/api/runs/external", "Bearer trb_secret")]  # no GET, no token sent on


def test_a_directory_made_against_another_web_app_creates_its_run_here(server: str, tmp_path: Path) -> None:
    meta = {"project": "p", "name": "n", "client_id": "c-1", "url": "http://other:8000", "server_id": 7}
    write_meta(tmp_path, meta)
    made = server_run(Api(server, "t"), tmp_path, meta)
    assert made.id == 41 and [c[1] for c in Recorder.calls] == ["/api/runs/external"]
    kept = read_meta(tmp_path)
    assert (kept["server_id"], kept["url"]) == (41, server)
    server_run(Api(server, "t"), tmp_path, kept)  # now its own: a fresh token for the same run
    assert [c[1] for c in Recorder.calls] == ["/api/runs/external", "/api/runs/41/ingest-token"]
