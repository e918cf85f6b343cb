"""A real WebSocket server playing the web app's side of ``client/tributary/protocol.py`` (the ingest socket).

``FakeIngest`` runs a ``websockets`` asyncio server in a thread and behaves as the protocol
says the web app does: it checks the run id and token of each connection, greets with
``hello`` (the highest seq it stored, the run's status, a pending cancel, a fresh token),
stores ``events`` idempotently in a dict (its "database", which survives restarts), refuses
a batch that would leave a gap (4422) or is too big (4413), acks the highest stored seq,
and can send ``cancel``, close with any code, crash (no close frame) and restart on the same
port. Everything it saw is recorded for the tests to check.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from engine.contracts import CLOSE_BAD_EVENT, CLOSE_BAD_MESSAGE, CLOSE_BAD_TOKEN, CLOSE_NO_RUN, CLOSE_TOO_BIG
from tributary.events import EventSink
from tributary.protocol import MAX_BATCH_EVENTS, MAX_MESSAGE_BYTES

FINAL = {"succeeded", "failed", "cancelled", "lost"}


@dataclass
class Conn:
    """One accepted connection, as the fake web app saw it."""

    token: str
    hello: dict[str, Any] | None = None
    attach: list[dict[str, Any]] = field(default_factory=list)
    batches: list[list[int]] = field(default_factory=list)  # seqs of each events message
    sizes: list[int] = field(default_factory=list)  # bytes of each events message
    pings: int = 0
    close_code: int | None = None  # the code the server closed with, when it did


class FakeIngest:
    def __init__(self, run_id: int, *, token: str = "tok-0", status: str = "queued", last_seq: int = 0) -> None:
        self.run_id = run_id
        self.status = status
        self.cancel_pending = False
        self.last_seq = last_seq  # the "database" cursor: highest seq durably stored
        self.stored: dict[int, dict[str, Any]] = {}
        self.received: Counter[int] = Counter()  # every arrival of each seq (duplicates included)
        self.stored_count: Counter[int] = Counter()  # how many times each seq was written
        self.conns: list[Conn] = []
        self.refused: list[tuple[str, int]] = []  # (token, code) of connections refused at once
        self.tokens_issued: list[str] = [token]
        self.valid_token = token
        # Behaviours a test can set (all read in the server thread):
        self.rotate_tokens = False  # each hello and ack carries a new token; only the newest is valid
        self.refuse_with: int | None = None  # send error + close with this code on every connection
        self.close_after_batch: dict[int, int] = {}  # batch number (1-based, overall) -> close code, no ack
        self.crash_after_batch: dict[int, float] = {}  # batch number -> seconds down; stored, not acked
        self.cancel_when: Callable[[FakeIngest], bool] | None = None
        self.cancel_sent = False
        self.batches_total = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-ingest", daemon=True)
        self._server: Server | None = None
        self._live: set[ServerConnection] = set()
        self._restarts: set[asyncio.Task[None]] = set()
        self.changed = threading.Condition()

    # -- control from the test thread ---------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def connected(self) -> bool:
        """A worker is connected right now."""
        return bool(self._live)

    def start(self) -> FakeIngest:
        if not self._thread.is_alive():
            self._thread.start()
        self._call(self._listen())
        return self

    def stop(self) -> None:
        self._call(self._shutdown(abort=False))

    def crash(self) -> None:
        """Drop every connection without a close frame and stop listening."""
        self._call(self._shutdown(abort=True))

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._shutdown(abort=True))
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def wait_for(self, predicate: Callable[[FakeIngest], bool], timeout: float = 60.0) -> None:
        """Block until ``predicate(self)`` holds (checked on every change); fail after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"fake ingest: condition not met within {timeout} s; saw {self.summary()}")
                self.changed.wait(min(left, 0.5))

    def summary(self) -> str:
        return (
            f"last_seq={self.last_seq} status={self.status} conns={len(self.conns)} "
            f"refused={self.refused} batches={self.batches_total}"
        )

    def events(self) -> list[dict[str, Any]]:
        return [self.stored[s] for s in sorted(self.stored)]

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    def _notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    # -- the server ---------------------------------------------------------------------------

    async def _listen(self) -> None:
        if self._server is not None:
            return
        self._server = await serve(self._handler, "127.0.0.1", self.port, max_size=None)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self, *, abort: bool) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        if abort:
            for ws in list(self._live):
                ws.transport.abort()
        server.close(close_connections=not abort)
        await server.wait_closed()

    async def _restart_after(self, down_s: float) -> None:
        await self._shutdown(abort=True)
        await asyncio.sleep(down_s)
        await self._listen()
        self._notify()

    def _new_token(self) -> str:
        token = f"tok-{len(self.tokens_issued)}"
        self.tokens_issued.append(token)
        self.valid_token = token
        return token

    async def _refuse(self, ws: ServerConnection, token: str, code: int, message: str) -> None:
        self.refused.append((token, code))
        await ws.send(json.dumps({"type": "error", "code": code, "message": message}))
        await ws.close(code, message[:100])
        self._notify()

    async def _handler(self, ws: ServerConnection) -> None:
        parts = urlsplit(ws.request.path)
        auth = ws.request.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else ""
        if parts.path != f"/ws/ingest/{self.run_id}/":
            await self._refuse(ws, token, CLOSE_NO_RUN, f"no run at {parts.path}")
            return
        if self.refuse_with is not None:
            await self._refuse(ws, token, self.refuse_with, f"refused with {self.refuse_with} by the test")
            return
        if token != self.valid_token:
            await self._refuse(ws, token, CLOSE_BAD_TOKEN, f"token {token!r} is not valid (expected the newest)")
            return
        conn = Conn(token=token)
        hello: dict[str, Any] = {
            "type": "hello", "last_seq": self.last_seq, "status": self.status, "cancel": self.cancel_pending,
        }  # fmt: skip
        if self.rotate_tokens:
            hello["token"] = self._new_token()
        conn.hello = hello
        self.conns.append(conn)
        self._live.add(ws)
        self._notify()
        try:
            await ws.send(json.dumps(hello))
            async for data in ws:
                if await self._on_message(ws, conn, data):
                    return
                self._notify()
        except ConnectionClosed:
            pass
        finally:
            self._live.discard(ws)
            self._notify()

    async def _close(self, ws: ServerConnection, conn: Conn, code: int, message: str) -> bool:
        conn.close_code = code
        await ws.send(json.dumps({"type": "error", "code": code, "message": message}))
        await ws.close(code, message[:100])
        return True

    async def _on_message(self, ws: ServerConnection, conn: Conn, data: str | bytes) -> bool:
        """Handle one message; True when the connection is over."""
        if isinstance(data, bytes):
            return await self._close(ws, conn, CLOSE_BAD_MESSAGE, "binary frames are not part of the protocol")
        if len(data.encode()) >= MAX_MESSAGE_BYTES:
            return await self._close(ws, conn, CLOSE_TOO_BIG, "message too big")
        try:
            msg = json.loads(data)
        except ValueError:
            return await self._close(ws, conn, CLOSE_BAD_MESSAGE, "not JSON")
        kind = msg.get("type") if isinstance(msg, dict) else None
        if kind == "ping":
            conn.pings += 1
            return False
        if kind == "attach":
            conn.attach.append(msg)
            if self.status == "queued":
                self.status = "starting"
            return False
        if kind != "events":
            return await self._close(ws, conn, CLOSE_BAD_MESSAGE, f"unknown message type {kind!r}")
        events = msg.get("events")
        if not isinstance(events, list) or not events or len(events) > MAX_BATCH_EVENTS:
            return await self._close(ws, conn, CLOSE_BAD_EVENT, "events must be a list of 1..MAX_BATCH_EVENTS")
        seqs = [e.get("seq") if isinstance(e, dict) else None for e in events]
        if any(not isinstance(s, int) for s in seqs) or seqs != list(range(seqs[0], seqs[0] + len(seqs))):
            return await self._close(ws, conn, CLOSE_BAD_EVENT, f"seqs are not consecutive: {seqs[:5]}...")
        if seqs[0] > self.last_seq + 1:
            return await self._close(
                ws, conn, CLOSE_BAD_EVENT, f"gap: stored up to {self.last_seq}, batch starts at {seqs[0]}"
            )
        if any(str(e.get("run")) != str(self.run_id) for e in events):
            return await self._close(ws, conn, CLOSE_BAD_EVENT, "an event of another run")
        conn.batches.append(seqs)
        conn.sizes.append(len(data.encode()))
        self.batches_total += 1
        for event in events:
            seq = event["seq"]
            self.received[seq] += 1
            if seq <= self.last_seq:
                continue  # a duplicate: ignored
            self.stored[seq] = event
            self.stored_count[seq] += 1
            self.last_seq = seq
            if event.get("type") == "status" and self.status not in FINAL:
                self.status = event["state"]
        n = self.batches_total
        if n in self.crash_after_batch:  # stored, but the ack never leaves: a web app crash
            ws.transport.abort()
            self._restarts.add(asyncio.get_running_loop().create_task(self._restart_after(self.crash_after_batch[n])))
            return True
        if n in self.close_after_batch:
            return await self._close(ws, conn, self.close_after_batch[n], "closing by the test")
        ack: dict[str, Any] = {"type": "ack", "seq": self.last_seq}
        if self.rotate_tokens:
            ack["token"] = self._new_token()
        await ws.send(json.dumps(ack))
        if self.cancel_when is not None and not self.cancel_sent and self.cancel_when(self):
            self.cancel_sent = True
            self.cancel_pending = True
            await ws.send(json.dumps({"type": "cancel", "message": "cancelled by the test"}))
        return False


@pytest.fixture
def fake_ingest() -> Any:
    """``fake_ingest(run_id, **options)`` -> a started ``FakeIngest``; all are closed at the end."""
    made: list[FakeIngest] = []

    def make(run_id: int = 1, **options: Any) -> FakeIngest:
        fake = FakeIngest(run_id, **options).start()
        made.append(fake)
        return fake

    yield make
    for fake in made:
        fake.close()


def write_events(path: Path, run_id: int, count: int, *, start_seq: int = 0, payload: int = 50) -> list[int]:
    """Append ``count`` events to a JSONL log with the engine's own ``EventSink``; returns their seqs."""
    sink = EventSink(str(run_id), path, start_seq=start_seq)
    seqs = []
    try:
        for i in range(count):
            if i % 7 == 0:
                seqs.append(sink.samples(i, [{"prompt": "p" * payload, "completion": "é" * payload, "reward": 1.0}]))
            elif i % 3 == 0:
                seqs.append(sink.log("info", f"line {i}"))
            else:
                seqs.append(sink.metrics(i, {"reward/mean": i / 10, "actor/entropy": float("nan")}))
    finally:
        sink.close()
    return seqs


def read_log(path: Path) -> list[dict[str, Any]]:
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events
