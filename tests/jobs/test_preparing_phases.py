"""A run says what it is doing from the moment its worker takes it to its first step (issue 15):
the supervisor, then the engine, write one ``starting`` status event per preparing phase, in order.

A real supervisor starts a real engine (tiny model) against the jobs tests' ingest server; the
starter policy's build reports its progress through the same events (a real build, with a recipe
small enough for a test: the recipe is a parameter of ``build_starter``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.models.starter import StarterRecipe, build_starter
from engine.phases import Phases, human_bytes, model_files
from jobs.supervisor import ENGINE_STARTING, RUNS_DIR_ENV, RunSupervisor
from tests.tiny_runs import tiny_config
from tributary.events import EventSink

from .conftest import read_log


def test_a_run_reports_its_preparing_phases_in_order(
    fake_ingest, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RUNS_DIR_ENV, str(tmp_path / "runs"))
    fake = fake_ingest(21)
    sup = RunSupervisor(
        21, tiny_config(tiny_model_dir, total_steps=2), fake.valid_token, web_url=fake.url,
        drain_timeout=60, connect_timeout=60, shipper_options={"backoff_base": 0.05, "backoff_cap": 0.5},
    )  # fmt: skip
    result = sup.run()
    assert (result.state, result.drained) == ("succeeded", True)
    statuses = [(e["state"], e["message"]) for e in read_log(sup.events_path) if e["type"] == "status"]
    assert fake.events() == read_log(sup.events_path)  # every phase reached the web side
    files = model_files(tiny_model_dir)
    assert re.fullmatch(r"1 file, \d+\.\d (kB|MB)", files), files
    assert statuses == [
        ("starting", ENGINE_STARTING),  # the supervisor, before the engine process exists
        ("starting", "preparing the run"),  # the engine's first word
        ("starting", f"loading the model ({files}) on cpu"),
        ("starting", "loading the data (built-in task arithmetic)"),
        ("starting", "preparing the torch trainer (64 training prompts loaded)"),
        ("running", "training on cpu"),
        ("succeeded", "finished 2 steps"),
    ]


def test_a_starter_build_reports_steps_and_accuracy_without_flooding(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    sink = EventSink("s", events)
    now = [0.0]
    phases = Phases(sink, every=2.0, clock=lambda: now[0])

    def tick(*args: object) -> None:  # each step of the build takes 0.5 s of the phases' clock
        now[0] += 0.5
        report(*args)

    report = phases.starter("arithmetic", 1, 0.4)
    recipe = StarterRecipe(size="tiny", max_steps=8, eval_every=4, val_size=16, target_accuracy=1.1)
    build_starter(tmp_path / "s", "arithmetic", 1, recipe=recipe, progress=tick)
    sink.close()
    messages = [json.loads(line)["message"] for line in events.read_text().splitlines()]
    what = "building the starter policy for arithmetic (difficulty 1, first use)"
    assert messages[0] == f"{what}: preparing"
    # At most one progress message per 2 s of the clock (steps 1, 5), and always the last step;
    # the accuracy once the build has measured it (at step 4), with the target it stops at.
    assert [re.sub(r"\d+% accuracy", "N% accuracy", m) for m in messages[1:]] == [
        f"{what}: 1/8 steps",
        f"{what}: 5/8 steps, N% accuracy (done at 40%)",
        f"{what}: 8/8 steps, N% accuracy (done at 40%)",
    ]


def test_sizes_in_words() -> None:
    assert [human_bytes(n) for n in (0, 999, 1000, 4_100_000, 14_200_000_000)] == [
        "0 bytes", "999 bytes", "1.0 kB", "4.1 MB", "14.2 GB",
    ]  # fmt: skip
