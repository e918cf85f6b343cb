"""Which workers are online and what they have: a registry kept next to the broker.

Workers never hold database credentials, but web app and workers always share the broker, so
the registry lives there: Redis keys with a time to live in a team deployment
(``tributary:worker:<name>``), JSON files in the broker folder in embedded mode. Each worker
rewrites its entry every ``HEARTBEAT_S`` seconds (capabilities, the runs it holds); an entry
not refreshed within ``TTL_S`` seconds is gone (Redis expires it; the file reader skips it),
so a killed worker disappears from the list on its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from jobs.app import broker_folder
from jobs.capabilities import Capabilities

log = logging.getLogger(__name__)

HEARTBEAT_S = 10.0
TTL_S = 35.0
REDIS_PREFIX = "tributary:worker:"


@dataclass
class WorkerEntry:
    capabilities: Capabilities
    running: list[str]  # run ids
    gpus_busy: list[int]
    started_at: float
    seen_at: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "capabilities": self.capabilities.as_dict(),
            "running": self.running,
            "gpus_busy": self.gpus_busy,
            "started_at": self.started_at,
            "seen_at": self.seen_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerEntry:
        return cls(
            capabilities=Capabilities.from_dict(data["capabilities"]),
            running=[str(r) for r in data.get("running", [])],
            gpus_busy=[int(g) for g in data.get("gpus_busy", [])],
            started_at=float(data.get("started_at", 0.0)),
            seen_at=float(data.get("seen_at", 0.0)),
        )

    @property
    def gpus_free(self) -> int:
        return len([g for g in self.capabilities.gpus if g.index not in self.gpus_busy])


class Registry(Protocol):
    def publish(self, entry: WorkerEntry, ttl: float = TTL_S) -> None: ...
    def remove(self, name: str) -> None: ...
    def workers(self) -> list[WorkerEntry]: ...


class RedisRegistry:
    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)

    def publish(self, entry: WorkerEntry, ttl: float = TTL_S) -> None:
        key = REDIS_PREFIX + entry.capabilities.name
        self.client.set(key, json.dumps(entry.as_dict()), px=int(ttl * 1000))

    def remove(self, name: str) -> None:
        self.client.delete(REDIS_PREFIX + name)

    def workers(self) -> list[WorkerEntry]:
        keys = sorted(self.client.scan_iter(match=REDIS_PREFIX + "*", count=500))
        out = []
        for raw in self.client.mget(keys) if keys else []:
            if raw is not None:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    out.append(WorkerEntry.from_dict(json.loads(raw)))
        return sorted(out, key=lambda e: e.capabilities.name)


class FileRegistry:
    """One JSON file per worker (written atomically); an entry past its ``expires_at`` is ignored."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_.@" else "_" for c in name)
        return self.folder / f"{safe}.json"

    def publish(self, entry: WorkerEntry, ttl: float = TTL_S) -> None:
        path = self._path(entry.capabilities.name)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({**entry.as_dict(), "expires_at": time.time() + ttl}), encoding="utf-8")
        tmp.replace(path)

    def remove(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def workers(self) -> list[WorkerEntry]:
        now, out = time.time(), []
        for path in sorted(self.folder.glob("*.json")):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                data = json.loads(path.read_text(encoding="utf-8"))
                if float(data.get("expires_at", 0)) >= now:
                    out.append(WorkerEntry.from_dict(data))
        return sorted(out, key=lambda e: e.capabilities.name)


def registry_from_env(environ: dict[str, str] | os._Environ[str] | None = None) -> Registry:
    """The registry beside the broker the environment names (see ``jobs.app.broker_settings``)."""
    env = os.environ if environ is None else environ
    url = env.get("REDIS_URL", "").strip()
    return RedisRegistry(url) if url else FileRegistry(broker_folder(env) / "workers")


class RegistryHeartbeat:
    """Publishes a worker's entry now and every ``interval`` seconds until ``stop()``.

    ``state()`` returns ``(running run ids, busy GPU indices)`` at each beat; ``beat()`` may be
    called at any time (a run started or ended) to publish at once.
    """

    def __init__(
        self,
        registry: Registry,
        capabilities: Capabilities,
        state: Callable[[], tuple[list[str], list[int]]] = lambda: ([], []),
        *,
        interval: float = HEARTBEAT_S,
        ttl: float = TTL_S,
    ) -> None:
        self.registry, self.capabilities, self.state = registry, capabilities, state
        self.interval, self.ttl = interval, ttl
        self.started_at = time.time()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="worker-heartbeat", daemon=True)

    def start(self) -> RegistryHeartbeat:
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        running, busy = self.state()
        entry = WorkerEntry(self.capabilities, running, busy, self.started_at, time.time())
        with self._lock:
            try:
                self.registry.publish(entry, self.ttl)
            except Exception as exc:  # the broker is down: the next beat tries again
                log.warning("worker registry: could not publish %s: %s", self.capabilities.name, exc)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock, contextlib.suppress(Exception):
            self.registry.remove(self.capabilities.name)
