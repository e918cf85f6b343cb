"""Whole runs through the CLI: events, resume equivalence, cancel on SIGTERM, one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import engine.run
from engine.config import PRESETS, ConfigError, build_config
from engine.contracts import EXIT_CANCELLED, EXIT_SUCCEEDED
from engine.run import execute

NONDETERMINISTIC = ("timing_s/", "perf/", "system/")  # wall-clock, throughput, the machine


def small_config(model_dir: Path, out: Path, **trainer: object) -> dict:
    return {
        "name": "t",
        "output_dir": str(out),
        "model": {"path": str(model_dir)},
        "data": {"source": "builtin", "task": "arithmetic", "train_size": 200, "eval_size": 8},
        "rollout": {"n": 4, "max_new_tokens": 6},
        "trainer": {
            "prompts_per_step": 4,
            "ppo_mini_batch_size": 2,
            "ppo_epochs": 2,
            "micro_batch_size": 3,
            "eval_every": 2,
            "eval_pass_k": 2,
            "deterministic": True,
            **trainer,
        },
        "algorithm": {"use_kl_loss": True, "entropy_coeff": 0.01},
        "checkpoint": {"every_steps": 2, "keep_last": 5},
        "logging": {"samples_per_step": 5, "progress": "off", "heartbeat_s": 0.2},
    }


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def metrics_by_step(events: list[dict]) -> dict[int, dict[str, float]]:
    return {
        e["step"]: {k: v for k, v in e["values"].items() if not k.startswith(NONDETERMINISTIC)}
        for e in events
        if e["type"] == "metrics"
    }


def test_run_writes_the_protocol_and_resume_is_exact(tiny_model_dir: Path, tmp_path: Path) -> None:
    straight = build_config(small_config(tiny_model_dir, tmp_path / "a", total_steps=4))
    assert execute(straight) == EXIT_SUCCEEDED
    events = read_events(tmp_path / "a" / "events.jsonl")
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(1, len(seqs) + 1))
    states = [e["state"] for e in events if e["type"] == "status"]
    # "starting" once per preparing phase (engine/phases.py), then training, then the end.
    assert states == ["starting"] * (len(states) - 2) + ["running", "succeeded"] and len(states) > 3
    # The running message stays true while the run trains: no step in it (the metrics count them).
    running = [e["message"] for e in events if e["type"] == "status" and e["state"] == "running"]
    assert running == ["training on cpu"]
    metrics = metrics_by_step(events)
    assert sorted(metrics) == [0, 1, 2, 3, 4]  # step 0 is the eval before training
    step = metrics[1]
    for name in (
        "reward/mean",
        "reward/std",
        "reward/task/mean",
        "train/accuracy",
        "response_length/mean",
        "response_length/clip_ratio",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/kl_loss",
        "actor/grad_norm",
        "actor/lr",
        "frac_reward_zero_std",
        "critic/advantages/mean",
    ):
        assert name in step, name
    assert "eval/accuracy" in metrics[2] and "eval/pass@2" in metrics[2]
    samples = [e for e in events if e["type"] == "samples"]
    assert len(samples) == 4 and len(samples[0]["items"]) == 5
    item = samples[0]["items"][0]
    assert set(item) >= {"prompt", "completion", "reward", "advantage", "length", "finish_reason", "extra"}
    checkpoints = [e for e in events if e["type"] == "checkpoint"]
    assert [c["step"] for c in checkpoints] == [2, 4] and all(c["bytes"] > 0 for c in checkpoints)

    # Resume from the step-2 checkpoint in a new place: steps 3-4 must equal the straight run's.
    resumed_cfg = build_config(small_config(tiny_model_dir, tmp_path / "b", total_steps=4))
    ckpt = Path(checkpoints[0]["path"])
    assert execute(resumed_cfg, resume=str(ckpt)) == EXIT_SUCCEEDED
    resumed = read_events(tmp_path / "b" / "events.jsonl")
    assert resumed[0]["seq"] > checkpoints[0]["seq"]  # seq continues after the checkpoint's
    assert "resumed at step 2, training on cpu" in [
        e.get("message") for e in resumed if e["type"] == "status"
    ]
    # A consumer states its own cursor: the web app's resumed run is a new run numbered from 1.
    assert execute(resumed_cfg, resume=str(ckpt), events=str(tmp_path / "c.jsonl"), start_seq=0) == 0
    assert read_events(tmp_path / "c.jsonl")[0]["seq"] == 1
    again = metrics_by_step(resumed)
    assert sorted(again) == [3, 4]
    for s in (3, 4):
        assert again[s] == pytest.approx(metrics[s], rel=1e-6, abs=1e-7), s


def test_checkpoint_events_name_the_checkpoints_their_save_deleted(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``checkpoint.keep_last`` prunes on disk; the event of the save that pruned says which, so the
    web app stops offering them to resume from (``webapp.runs.ingest._mark_deleted``)."""
    raw = small_config(tiny_model_dir, tmp_path / "a", total_steps=6, eval_every=0)
    raw["checkpoint"]["keep_last"] = 1
    assert execute(build_config(raw)) == EXIT_SUCCEEDED
    checkpoints = [e for e in read_events(tmp_path / "a" / "events.jsonl") if e["type"] == "checkpoint"]
    assert [(c["step"], len(c["deleted"])) for c in checkpoints] == [(2, 0), (4, 1), (6, 1)]
    assert [c["deleted"] for c in checkpoints[1:]] == [[checkpoints[0]["path"]], [checkpoints[1]["path"]]]
    assert [p for p in (tmp_path / "a" / "checkpoints").iterdir()] == [Path(checkpoints[2]["path"])]


def cancel_then_resume(cfg: dict, tmp_path: Path, *, after_step: int = 1, more_steps: int = 1) -> dict:
    """Run ``cfg`` (output in ``tmp_path / "run"``) with ``python -m engine run``, send SIGTERM once
    step ``after_step`` is logged, check it checkpoints and exits cancelled, then ``--resume`` it
    for ``more_steps`` further steps and check the log continues; returns the last checkpoint event."""
    cfg["checkpoint"]["every_steps"] = 0
    total = cfg["trainer"]["total_steps"]
    cfg_path = tmp_path / "run.json"
    cfg_path.write_text(json.dumps(cfg))
    events_path = tmp_path / "run" / "events.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "run", str(cfg_path)], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if events_path.exists() and any(
            e["type"] == "metrics" and e["step"] >= after_step for e in read_events(events_path)
        ):
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == EXIT_CANCELLED, stderr
    events = read_events(events_path)
    assert events[-1]["type"] == "status" and events[-1]["state"] == "cancelled"
    said = [e["message"] for e in events if e["type"] == "log" and "received SIGTERM" in e["message"]]
    assert said == ["received SIGTERM: checkpointing and stopping"], said
    ckpt = [e for e in events if e["type"] == "checkpoint"][-1]
    stopped_at = ckpt["step"]
    assert after_step <= stopped_at < total

    cfg["trainer"]["total_steps"] = stopped_at + more_steps
    cfg_path.write_text(json.dumps(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "engine", "run", str(cfg_path), "--resume", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == EXIT_SUCCEEDED, out.stderr
    events = read_events(events_path)
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(set(seqs))  # strictly increasing across the resume
    assert events[-1]["state"] == "succeeded"
    resumed = [e["step"] for e in events if e["type"] == "metrics"][-more_steps:]
    assert resumed == list(range(stopped_at + 1, stopped_at + more_steps + 1))
    return ckpt


def test_sigterm_checkpoints_and_exits_cancelled_then_resumes(tiny_model_dir: Path, tmp_path: Path) -> None:
    cancel_then_resume(small_config(tiny_model_dir, tmp_path / "run", total_steps=200), tmp_path)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "grpo", "--set", "model.path=/no/such/model"], "/no/such/model"),
        (["run", "grpo", "--set", "rollout.n=0"], "rollout.n"),
        (["run", "missing.yaml"], "file not found"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(args: list[str], needle: str, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "engine", *args, "--set", f"output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert out.returncode != 0
    assert needle in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("precision", ["bf16 weights", "bf16 autocast"])
def test_bfloat16_run_trains_with_finite_metrics(
    precision: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways of training in bf16 run end to end; on a device that only emulates bf16 (the probe of
    the CPU's features answers no here, whatever this CPU has) the run warns that it is slower so."""
    monkeypatch.setattr(engine.run, "native_bf16", lambda device: False)
    data = small_config(tiny_model_dir, tmp_path, total_steps=2)
    if precision == "bf16 weights":
        data["model"]["dtype"] = "bfloat16"
        field = "model.dtype: bfloat16"
    else:  # float32 weights, the update's trunk under bf16 autocast
        data["trainer"]["mixed_precision"] = "bf16"
        field = "trainer.mixed_precision: bf16"
    data["trainer"]["eval_every"] = 0
    assert execute(build_config(data)) == EXIT_SUCCEEDED
    events = read_events(tmp_path / "events.jsonl")
    warnings = [e["message"] for e in events if e["type"] == "log" and e["level"] == "warning"]
    assert any(field in w and "only emulates" in w for w in warnings), warnings
    metrics = metrics_by_step(events)
    for step in (1, 2):
        assert all(v is not None for v in metrics[step].values()), metrics[step]
        assert metrics[step]["actor/grad_norm"] > 0


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_trains_end_to_end(preset: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    data = small_config(tiny_model_dir, tmp_path, total_steps=2)
    data["preset"] = preset
    # The preset's own algorithm, plus an entropy bonus: the random tiny model's rewards are
    # all equal, so without it there would be no gradient to check.
    data["algorithm"] = {"entropy_coeff": 0.01}
    data["trainer"].update(eval_every=0, ppo_epochs=1)
    if preset == "rloo":  # also cover KL as a reward penalty with the adaptive controller
        data["algorithm"].update(use_kl_in_reward=True, kl_ctrl={"type": "adaptive"})
    cfg = build_config(data)
    assert execute(cfg) == EXIT_SUCCEEDED
    events = read_events(tmp_path / "events.jsonl")
    metrics = metrics_by_step(events)
    for step in (1, 2):
        values = metrics[step]
        assert all(v is not None for v in values.values()), values
        if cfg.algorithm.filter_groups.enable:
            # Dynamic sampling drops the random model's all-equal groups and skips the update.
            assert values["filter/kept_groups"] == 0
            assert values["filter/gen_rounds"] == cfg.algorithm.filter_groups.max_num_gen_batches
            assert any(e["type"] == "log" and "filtered out" in e["message"] for e in events)
            continue
        assert values["actor/grad_norm"] > 0
        if cfg.algorithm.use_kl_loss:
            assert "actor/kl_loss" in values
        if cfg.algorithm.use_kl_in_reward:
            assert any("kl" in k and not k.startswith("actor/kl_loss") for k in values), sorted(values)


def test_a_signal_during_an_event_write_writes_nothing_inside_it(tmp_path: Path) -> None:
    """SIGTERM lands between bytecodes of the main thread, possibly inside ``EventSink.emit``.
    A handler that logged there re-entered the writer: into a real file that is ``RuntimeError:
    reentrant call inside BufferedWriter`` (a clean cancel became a crash, exit 1); here, where
    the stream raises the signal in the middle of a write, it would put an event inside another
    and out of seq order. The handler must only flag the stop; the run loop logs it."""
    import io

    from engine.pipeline.orchestrator import Orchestrator
    from tributary.events import EventSink

    class SignalMidWrite(io.StringIO):
        armed = True

        def write(self, text: str) -> int:
            if self.armed:
                self.armed = False
                signal.raise_signal(signal.SIGTERM)
            return super().write(text)

    stream = SignalMidWrite()
    loop = Orchestrator.__new__(Orchestrator)  # only the signal handling: no model is needed
    loop.sink, loop.stop_requested, loop.stop_signal = EventSink("r", stream), False, ""
    with loop._cancel_on_signals():
        loop.sink.heartbeat()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [e["type"] for e in lines] == ["heartbeat"]
    assert loop.stop_requested and loop.stop_signal == "SIGTERM"


def test_deficit_sized_rounds_sample_what_refills_the_batch() -> None:
    """DAPO's later rounds: ``full`` samples a whole batch each round; ``deficit`` the missing groups
    over the step's keep rate (at least 1/8), at least one prompt and at most a batch."""
    from engine.pipeline.producer import round_prompts

    assert [round_prompts(32, 0, 0, 0, size) for size in ("full", "deficit")] == [32, 32]  # first round
    assert round_prompts(32, 24, 32, 1, "full") == 32
    assert round_prompts(32, 24, 32, 1, "deficit") == 11  # 8 missing / 0.75 kept = 10.7
    assert round_prompts(32, 31, 33, 2, "deficit") == 2  # 1 / (31/33) = 1.06
    assert round_prompts(32, 2, 32, 1, "deficit") == 32  # keep rate 1/16 -> 1/8: 30 * 8, capped
    assert round_prompts(32, 0, 32, 1, "deficit") == 32  # nothing kept yet: a whole batch again


def test_deficit_rounds_are_refused_with_partial_rollouts(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = small_config(tiny_model_dir, tmp_path)
    data["algorithm"]["filter_groups"] = {"enable": True, "round_size": "deficit"}
    data["async"] = {"max_staleness": 2, "partial_rollouts": True}
    with pytest.raises(ConfigError, match="round_size"):
        build_config(data)


def test_a_dapo_run_with_deficit_rounds_reports_the_prompts_it_sampled(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The random tiny model's groups are all equal, all filtered: with nothing kept, a deficit round
    samples a whole batch, as a full one does, and the step counts every prompt it sampled."""
    data = small_config(tiny_model_dir, tmp_path, total_steps=1, eval_every=0)
    data["preset"] = "dapo"
    data["algorithm"] = {"filter_groups": {"round_size": "deficit", "max_num_gen_batches": 3}}
    assert execute(build_config(data)) == EXIT_SUCCEEDED
    values = metrics_by_step(read_events(tmp_path / "events.jsonl"))[1]
    assert values["filter/gen_rounds"] == 3 and values["filter/kept_groups"] == 0
    assert values["filter/gen_prompts"] == 3 * 4
