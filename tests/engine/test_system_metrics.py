"""System metrics: the real process tree read with psutil, phases, and nvidia-smi's output.

No GPU here: the GPU path is tested against nvidia-smi's CSV in the documented query format
(``--format=csv,noheader,nounits``), through a stand-in executable that prints it, so the
command line, the parsing and the attribution of GPU memory to our own processes are exercised.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from engine.system_metrics import (
    ActivePhases,
    GpuReading,
    NvidiaSmi,
    ProcessTree,
    Sample,
    SystemSampler,
    parse_apps_csv,
    parse_gpu_csv,
    summarize,
)

# Four GPUs as nvidia-smi prints them; GPU 3 does not report its power draw.
GPU_CSV = "0, 87, 312.45, 40213\n1, 0, 61.20, 3\n2, 100, 398.00, 79870\n3, 45, [N/A], 1024\n"
APPS_CSV = "4242, 38000\n5151, 2000\n777, 79000\n"


def busy_child(megabytes: int) -> subprocess.Popen[str]:
    """A child that holds ``megabytes`` of touched memory and spins, until its stdin closes."""
    code = textwrap.dedent(
        f"""
        import sys, threading
        block = bytearray({megabytes} * 1024 * 1024)
        for i in range(0, len(block), 4096):
            block[i] = 1
        done = threading.Event()
        threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
        print("ready", flush=True)
        while not done.is_set():
            pass
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "ready"
    return child


def test_the_tree_counts_a_childs_memory_and_cpu() -> None:
    tree = ProcessTree()
    _, alone_gb, alone_pids = tree.read()
    child = busy_child(300)
    try:
        tree.read()  # a baseline for the child's CPU counter
        # Wait for CPU the child has used, not for wall time: however loaded the machine, the
        # reading then covers at least 0.2 s of the child's CPU.
        spent = psutil.Process(child.pid).cpu_times
        start = sum(spent()[:2])
        deadline = time.monotonic() + 60
        while sum(spent()[:2]) - start < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        cpu, rss_gb, pids = tree.read()
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert child.pid in pids and os.getpid() in pids and len(pids) == len(alone_pids) + 1
    # 300 MiB touched is 0.29 GB; the interpreter adds its own ~10 MB.
    assert rss_gb - alone_gb > 0.28
    assert cpu > 0  # the child's 0.2 s of CPU since the baseline is counted


def test_samples_are_tagged_with_the_phases_running_when_taken() -> None:
    phases = ActivePhases()
    sampler = SystemSampler(interval=60, phases=phases, gpus=lambda pids: ([], 0.0))
    with phases("generate"):
        sampler.sample()
        with phases("train"):  # asynchronous: generation beside training
            sampler.sample()
    sampler.sample()
    metrics = sampler.step_metrics()
    assert {"system/rss_gb/generate", "system/rss_gb/train"} <= set(metrics)
    assert "system/rss_gb/score" not in metrics and "system/gpu_mem_gb" not in metrics
    assert metrics["system/processes"] >= 1 and metrics["system/rss_gb"] > 0
    assert phases.since(phases.since(Counter())[1])[0] == ()  # none running now


def test_a_phase_between_two_samples_is_read_at_the_next_and_a_missed_one_at_the_steps_end() -> None:
    phases = ActivePhases()
    with phases("score"):
        pass  # before the sampler: not its own
    sampler = SystemSampler(interval=60, phases=phases, gpus=lambda pids: ([], 0.0))
    other = SystemSampler(interval=60, phases=phases, gpus=lambda pids: ([], 0.0))
    sampler.sample()
    with phases("generate"):
        pass  # shorter than the interval: no sample inside it
    assert sampler.sample().phases == ("generate",) and sampler.sample().phases == ()
    with phases("train"):
        pass
    metrics = sampler.step_metrics()  # three samples, none saw "train": a fourth is taken now
    assert {k for k in metrics if k.startswith("system/rss_gb/")} == {"system/rss_gb/generate", "system/rss_gb/train"}
    assert sampler.step_metrics().keys().isdisjoint({"system/rss_gb/train", "system/rss_gb/generate"})
    assert other.sample().phases == ("generate", "train")  # each sampler keeps its own account


def test_a_sample_in_flight_when_the_step_ends_counts_for_that_step() -> None:
    """The sampler's thread reads the tree while the loop ends a step: that reading, and the phases
    it took, belong to the step that ends, not the next. Before, the step's end could file the
    samples while the reading had already taken the "train" entry but not yet filed its sample: the
    step then had no sample with "train" (an async run in CI). The end waits for the reading now.
    The 0.2 s pause lets the end reach its wait first; under load it may not, and the test then
    passes without testing the race (it cannot fail because of load)."""
    phases = ActivePhases()
    reading, release = threading.Event(), threading.Event()

    def gpus(pids: set[int]) -> tuple[list, float]:
        if threading.current_thread().name == "reader":
            reading.set()
            release.wait(10)
        return [], 0.0

    sampler = SystemSampler(interval=60, phases=phases, gpus=gpus)
    with phases("train"):
        pass
    reader = threading.Thread(target=sampler.sample, name="reader")
    reader.start()
    assert reading.wait(10)
    ended: dict[str, float] = {}
    ender = threading.Thread(target=lambda: ended.update(sampler.step_metrics()))
    ender.start()
    time.sleep(0.2)
    release.set()
    reader.join(10)
    ender.join(10)
    assert "system/rss_gb/train" in ended
    assert "system/rss_gb/train" not in sampler.step_metrics()


def test_a_step_without_samples_takes_one_and_the_next_starts_fresh() -> None:
    sampler = SystemSampler(interval=60, gpus=lambda pids: ([], 0.0))
    first = sampler.step_metrics()
    assert set(first) == {"system/cpu_percent", "system/rss_gb", "system/processes"}
    sampler.sample()
    sampler.sample()
    assert sampler._samples and sampler.step_metrics() and not sampler._samples


def test_the_thread_samples_until_stopped() -> None:
    sampler = SystemSampler(interval=0.05, gpus=lambda pids: ([], 0.0)).start()
    deadline = time.monotonic() + 30
    while len(sampler._samples) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    sampler.stop()
    assert len(sampler._samples) >= 3 and not sampler._thread.is_alive()


def test_nvidia_smis_csv_is_read_per_gpu_with_missing_fields_left_out() -> None:
    gpus = parse_gpu_csv(GPU_CSV)
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert gpus[0].util_percent == 87 and gpus[0].power_w == pytest.approx(312.45)
    assert gpus[0].mem_gb == pytest.approx(40213 / 1024)
    assert gpus[3].power_w is None
    assert parse_gpu_csv("No devices were found\n") == []
    # Only the memory of our own processes counts as the run's.
    assert parse_apps_csv(APPS_CSV, {4242, 5151}) == pytest.approx(40000 / 1024)
    assert parse_apps_csv("", {1}) == 0.0


def test_the_nvidia_smi_command_is_queried_as_documented(tmp_path: Path) -> None:
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"  --query-gpu=index,utilization.gpu,power.draw,memory.used) printf '{GPU_CSV}' ;;\n"
        f"  --query-compute-apps=pid,used_memory) printf '{APPS_CSV}' ;;\n"
        "  *) echo unknown query >&2; exit 2 ;;\n"
        "esac\n"
    )
    fake.chmod(0o755)
    gpus, own = NvidiaSmi(str(fake)).read({4242})
    assert len(gpus) == 4 and own == pytest.approx(38000 / 1024)
    assert NvidiaSmi(str(tmp_path / "missing")).read({1}) == ([], 0.0)


def test_a_step_summary_with_gpus_by_phase() -> None:
    g = lambda util, mem: [GpuReading(0, util, 300.0, mem), GpuReading(1, None, None, 1.0)]  # noqa: E731
    samples = [
        Sample(("generate",), 150.0, 3.0, 4, g(90.0, 70.0), 60.0),
        Sample(("train",), 50.0, 5.0, 4, g(30.0, 40.0), 30.0),
        Sample(("train", "weight_sync"), 100.0, 4.0, 5, g(60.0, 45.0), 35.0),
    ]
    m = summarize(samples)
    assert m["system/cpu_percent"] == pytest.approx(100.0)
    assert m["system/rss_gb"] == 5.0 and m["system/processes"] == 5
    assert m["system/gpu0/util_percent"] == pytest.approx(60.0) and m["system/gpu0/mem_gb"] == 70.0
    assert "system/gpu1/util_percent" not in m and m["system/gpu1/mem_gb"] == 1.0
    assert m["system/gpu_mem_gb"] == 60.0
    assert (m["system/gpu_mem_gb/generate"], m["system/gpu_mem_gb/train"]) == (60.0, 35.0)
    assert m["system/gpu_mem_gb/weight_sync"] == 35.0 and "system/gpu_mem_gb/score" not in m


@pytest.mark.parametrize("staleness", [0, 1], ids=["sync", "async"])
def test_a_run_reports_its_system_metrics_by_phase(staleness: int, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Every step's metrics carry the tree's CPU and memory, and the memory of every phase the
    step ran, whatever the machine's timing (a phase no 20 ms sample fell in is read at the step's
    end): each step trains, and the run generates."""
    import json

    from engine.config import build_config
    from engine.contracts import EXIT_SUCCEEDED
    from engine.run import execute
    from tests.tiny_runs import tiny_config

    data = tiny_config(tiny_model_dir, 3)
    data["output_dir"] = str(tmp_path)
    data["logging"].update(progress="off", system_metrics_s=0.02)
    data["async"] = {"max_staleness": staleness}
    assert execute(build_config(data)) == EXIT_SUCCEEDED
    steps = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    metrics = [e["values"] for e in steps if e["type"] == "metrics" and e["step"] > 0]
    assert len(metrics) == 3
    for values in metrics:
        assert values["system/rss_gb"] > 0.1 and values["system/processes"] >= 1
        assert values["system/cpu_percent"] >= 0
    assert all("system/rss_gb/train" in values for values in metrics)
    seen = {name for values in metrics for name in values if name.startswith("system/rss_gb/")}
    assert {"system/rss_gb/generate", "system/rss_gb/train"} <= seen
    assert seen <= {f"system/rss_gb/{p}" for p in ("generate", "score", "train", "weight_sync")}, seen


def test_zero_turns_the_sampler_off(tiny_model_dir: Path, tmp_path: Path) -> None:
    import json

    from engine.config import build_config
    from engine.run import execute
    from tests.tiny_runs import tiny_config

    data = tiny_config(tiny_model_dir, 1)
    data["output_dir"] = str(tmp_path)
    data["logging"].update(progress="off", system_metrics_s=0)
    execute(build_config(data))
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert not any(k.startswith("system/") for e in events if e["type"] == "metrics" for k in e["values"])
