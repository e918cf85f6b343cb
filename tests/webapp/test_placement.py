"""Placing runs on queues by what workers have, why a queued run waits, and the workers page/API.

The registry is the real one the settings name (files beside the embedded broker, or Redis when
REDIS_URL is set, as in the PostgreSQL pass); entries are published as workers publish them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.test import Client

from jobs.capabilities import Capabilities, Gpu
from jobs.registry import WorkerEntry, registry_from_env
from webapp.runs import placement
from webapp.runs.models import Run
from webapp.runs.services import create_run


def worker(name: str, queues: list[str], *, gpus: int = 0, backends=("torch",), running=()) -> WorkerEntry:
    caps = Capabilities(
        name=name, host=name.split("@")[-1], queues=queues, concurrency=max(1, gpus), cpus=16, memory_gb=128.0,
        gpus=[Gpu(i, "NVIDIA A100-SXM4-80GB", 79.2) for i in range(gpus)], backends={b: "1" for b in backends},
        platform="Linux x86_64",
    )  # fmt: skip
    now = time.time()
    return WorkerEntry(caps, [str(r) for r in running], list(range(len(running))), now, now)


@pytest.fixture
def online() -> Iterator[Callable[..., None]]:
    """Put workers in the deployment's registry (and take them out after the test)."""
    registry = registry_from_env()
    names: list[str] = []

    def publish(*entries: WorkerEntry) -> None:
        for entry in entries:
            registry.publish(entry, ttl=60)
            names.append(entry.capabilities.name)

    for entry in registry.workers():
        registry.remove(entry.capabilities.name)
    yield publish
    for name in names:
        registry.remove(name)


GPU_CONFIG = {
    "trainer": {"device": "cuda", "num_ranks": 2, "backend": "deepspeed"},
    "rollout": {"backend": "vllm"},
}


def test_why_a_run_waits() -> None:
    cpu = worker("cpu@a", ["cpu"])
    small_gpu = worker("gpu@b", ["gpu"], gpus=1, backends=("torch", "vllm", "deepspeed"))
    assert placement.waiting_reason({}, "cpu", []).startswith("Waiting for a worker: none is online.")
    # Words for a page: where to look, not a shell command (the Workers page has that).
    assert "queue 'gpu' connects (the Workers page says how to start one)" in placement.waiting_reason({}, "gpu", [])
    assert "python -m" not in placement.waiting_reason({}, "gpu", [])
    assert placement.waiting_reason({}, "pool-a", [cpu, small_gpu]) == (
        "Waiting for a worker: no online worker serves queue 'pool-a' (served: cpu, gpu). "
        "Start one for 'pool-a' (the Workers page says how), or launch the run on another queue."
    )
    assert placement.waiting_reason(GPU_CONFIG, "gpu", [cpu, small_gpu]) == (
        "Waiting for a worker: no worker on queue 'gpu' has what the run needs "
        "(2 GPUs and backends deepspeed, vllm): gpu@b: needs 2 GPUs, has 1."
    )
    assert placement.waiting_reason({}, "cpu", [cpu, small_gpu]) == ""
    big = worker("gpu@c", ["gpu", "cpu"], gpus=8, backends=("torch", "vllm", "deepspeed"))
    assert placement.waiting_reason(GPU_CONFIG, "gpu", [cpu, small_gpu, big]) == ""


def test_auto_picks_the_queue_of_a_worker_that_can_run_it() -> None:
    cpu = worker("cpu@a", ["cpu"], running=[1])
    idle_cpu = worker("cpu@z", ["pool-z"])
    big = worker("gpu@c", ["cpu", "gpu"], gpus=8, backends=("torch", "vllm", "deepspeed"))
    assert placement.resolve_queue("auto", GPU_CONFIG, [cpu, big]) == "gpu"
    assert placement.resolve_queue("auto", {}, [cpu, idle_cpu]) == "pool-z"  # the least busy one
    assert placement.resolve_queue("auto", GPU_CONFIG, [cpu]) == "gpu"  # nobody can: where GPUs will be
    assert placement.resolve_queue("auto", {}, []) == "cpu"
    assert placement.resolve_queue("cpu", GPU_CONFIG, [big]) == "cpu"  # named: as asked


def test_launch_with_auto_and_the_waiting_message(
    online: Callable[..., None], project: Any, member: Any, valid_config: dict[str, Any],
    django_capture_on_commit_callbacks: Any,
) -> None:  # fmt: skip
    online(worker("gpu@c", ["gpu"], gpus=2, backends=("torch", "vllm", "deepspeed")))
    with django_capture_on_commit_callbacks(execute=True):
        run = create_run(project, member, valid_config, queue="auto")
    run.refresh_from_db()
    # The only worker serves 'gpu' and can run a CPU config (device auto): it goes there.
    # Nothing waits ahead of it: its message says so, and which worker takes it.
    assert run.queue == "gpu" and run.status_message == "Waiting for a worker: next in queue 'gpu'; worker gpu@c is free."
    with django_capture_on_commit_callbacks(execute=True):
        stuck = create_run(project, member, valid_config, queue="pool-x")
    stuck.refresh_from_db()
    assert stuck.status == "queued" and stuck.status_message.startswith(
        "Waiting for a worker: no online worker serves queue 'pool-x'"
    )
    # A worker for it comes online: the next refresh says "No worker online" no more.
    online(worker("x@d", ["pool-x"]))
    assert placement.refresh_all_waiting() == 1
    stuck.refresh_from_db()
    assert stuck.status_message == "Waiting for a worker: next in queue 'pool-x'; worker x@d is free."
    # A message the web app did not write is left alone.
    Run.objects.filter(pk=stuck.pk).update(status_message="held by the admin")
    assert placement.refresh_waiting(Run.objects.get(pk=stuck.pk), []) is False


def test_a_stored_config_that_no_longer_validates_is_said_and_does_not_stop_the_others(
    project: Any, member: Any, valid_config: dict[str, Any], django_capture_on_commit_callbacks: Any,
) -> None:  # fmt: skip
    """Configs stored by an older version may fail today's validation: that run's message says so
    (naming the field), and the runs queued after it still get theirs."""
    with django_capture_on_commit_callbacks(execute=True):
        old = create_run(project, member, valid_config, queue="pool-x")
        later = create_run(project, member, valid_config, queue="pool-y")
    Run.objects.filter(pk=old.pk).update(config={**old.config, "rollout": {"n": "many"}}, status_message="")
    Run.objects.filter(pk=later.pk).update(status_message="")
    assert placement.refresh_all_waiting() == 2
    old.refresh_from_db()
    later.refresh_from_db()
    assert old.status_message.startswith("Waiting for a worker: none can run it: its config no longer validates")
    assert "rollout.n" in old.status_message
    assert later.status_message.startswith("Waiting for a worker: ")
    assert "no longer validates" not in later.status_message


def test_workers_api_and_page(
    online: Callable[..., None], make_run: Callable[..., Run], member: Any, outsider: Any,
    client_for: Callable[..., Client],
) -> None:  # fmt: skip
    mine = make_run(name="mine")
    online(
        worker("gpu@c", ["gpu", "cpu"], gpus=2, backends=("torch", "vllm"), running=[mine.pk, 99999]),
        worker("cpu@a", ["cpu"]),
    )
    body = client_for(member).get("/api/workers").json()
    assert [w["name"] for w in body] == ["cpu@a", "gpu@c"]
    gpu = body[1]
    assert gpu["queues"] == ["gpu", "cpu"] and gpu["backends"] == {"torch": "1", "vllm": "1"}
    assert [(g["index"], g["busy"]) for g in gpu["gpus"]] == [(0, True), (1, True)]
    assert gpu["running"] == 2 and gpu["runs"] == [{"id": mine.pk, "name": "mine", "status": "queued"}]
    # Someone of another team sees the worker and how busy it is, not our run.
    other = client_for(outsider).get("/api/workers").json()
    assert other[1]["running"] == 2 and other[1]["runs"] == []
    page = client_for(member).get("/workers/").content.decode()
    assert 'data-worker="gpu@c"' in page and f'href="/runs/{mine.pk}/">mine<' in page
    assert "NVIDIA A100-SXM4-80GB" in page and "in use" in page and "<code>vllm</code>" in page
    assert Client().get("/workers/").status_code == 302  # sign in first
    assert Client().get("/api/workers").status_code == 401


def test_workers_page_without_workers(
    online: Callable[..., None], member: Any, client_for: Callable[..., Client]
) -> None:
    page = client_for(member).get("/workers/").content.decode()
    assert 'id="workers-empty"' in page and "TRIBUTARY_QUEUES=cpu python -m jobs.worker" in page
