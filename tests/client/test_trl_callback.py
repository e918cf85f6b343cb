"""``TributaryCallback`` on a real TRL ``GRPOTrainer`` (the tests' tiny Qwen2 model, CPU) against a
real web app: the database holds what TRL logged, metrics under the engine's names and the
completions with their rewards, in their groups. TRL's own record to compare with: the logs
its trainer hands every callback, and the completions tables it writes (``log_completions``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from tests.client.fixtures.server import (
    PROJECT,
    run_status,
    server,  # noqa: F401 - the fixture
    stored_metrics,
    stored_samples,
)
from tests.e2e.harness import Deployment, wait_until
from tributary.integrations.names import trl_name
from tributary.integrations.trl import TributaryCallback

pytestmark = pytest.mark.slow  # importing TRL alone takes 20-80 s on a loaded 2-core machine

STEPS = 4
ITERATIONS = 2  # each generation batch trains twice, so TRL logs each batch's completions twice
GENERATIONS = 4
PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4=", "5+5=", "6+6="]


class Recorder(TrainerCallback):
    """What the trainer logged, as every callback receives it."""

    def __init__(self) -> None:
        self.logs: list[tuple[int, dict[str, Any]]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        self.logs.append((state.global_step, dict(logs or {})))


def digits(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def short(completions: list[str], **kwargs: Any) -> list[float]:
    return [-len(c) / 10.0 for c in completions]


def grpo(model_dir: Path, tmp_path: Path, reward_funcs: list[Any], **config: Any) -> Any:
    """A real GRPOTrainer on the tests' tiny model, on the CPU, logging every step."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, logging_steps=1, report_to=[], save_strategy="no",
        dataloader_num_workers=0, **config,
    )  # fmt: skip
    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )


def test_grpo_trainer_reports_metrics_and_samples(
    server: Deployment,  # noqa: F811
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRIBUTARY_DRAIN_S", "120")
    trainer = grpo(
        tiny_model_dir,
        tmp_path,
        [digits, short],
        max_steps=STEPS,
        num_iterations=ITERATIONS,
        per_device_train_batch_size=GENERATIONS,
        num_generations=GENERATIONS,
        max_completion_length=6,
        learning_rate=1e-4,
        beta=0.04,  # a reference model, so TRL logs its KL
        reward_weights=[1.0, 0.5],
        log_completions=True,  # TRL's own completions table: what the samples must equal
        num_completions_to_print=0,
        seed=0,
    )
    recorder = Recorder()
    trainer.add_callback(recorder)
    callback = TributaryCallback.attach(
        trainer, project=PROJECT, name="grpo", url=server.url, token=server.api_token, dir=tmp_path / "run"
    )
    trainer.train()

    run_id = callback.run.id
    assert run_id is not None
    wait_until(lambda: run_status(server, run_id) == "succeeded", "the run to finish")

    # Metrics: every finite number TRL logged, at its step, under the engine's name.
    want: dict[tuple[str, int], float] = {}
    for step, logs in recorder.logs:
        for name, value in logs.items():
            if isinstance(value, int | float) and math.isfinite(value):
                want[(trl_name(name), step)] = float(value)
    got = stored_metrics(server, run_id)
    assert got == pytest.approx(want, rel=1e-12)
    names = {name for name, _ in got}
    assert {"reward/mean", "reward/std", "actor/kl_loss", "actor/entropy", "response_length/mean"} <= names
    assert {
        "reward/digits/mean",
        "reward/short/mean",
        "response_length/clip_ratio",
        "actor/pg_clipfrac",
    } <= names

    # Samples: TRL's completions tables (one parquet per logged step), row for row. TRL keeps the
    # latest generation batch and writes it at every log: a batch is sent once, at its first step.
    samples = stored_samples(server, run_id)
    tables = [
        pd.read_parquet(t) for t in sorted((tmp_path / "out" / "completions").glob("completions_*.parquet"))
    ]
    assert len(tables) == STEPS
    firsts = tables[::ITERATIONS]
    for first, again in zip(firsts, tables[1::ITERATIONS]):
        assert again.drop(columns="step").equals(first.drop(columns="step"))  # the same batch, logged again
    expected = []
    for table in firsts:
        for row in table.to_dict("records"):
            components = {"digits": row["digits"], "short": row["short"]}
            expected.append(
                {
                    "step": int(row["step"]),
                    "prompt": row["prompt"],
                    "completion": row["completion"],
                    "reward": components["digits"] * 1.0 + components["short"] * 0.5,
                    "advantage": row["advantage"],
                    "components": components,
                }
            )
    assert len(samples) == len(expected) == STEPS // ITERATIONS * GENERATIONS
    for have, wanted in zip(samples, expected):
        assert {k: have[k] for k in ("step", "prompt", "completion")} == {
            k: wanted[k] for k in ("step", "prompt", "completion")
        }
        assert have["reward"] == pytest.approx(wanted["reward"], abs=1e-6)
        assert have["advantage"] == pytest.approx(wanted["advantage"], abs=1e-6)
        assert have["extra"]["components"] == pytest.approx(wanted["components"], abs=1e-6)
    # One generation batch: one prompt's GENERATIONS completions, one group.
    for step in range(1, STEPS + 1, ITERATIONS):
        groups = {s["extra"]["group"] for s in samples if s["step"] == step}
        prompts = {s["prompt"] for s in samples if s["step"] == step}
        assert groups == {f"{step}:0"} and len(prompts) == 1


def test_cancel_from_the_page_stops_training(
    server: Deployment,  # noqa: F811
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancel on the run (the API's cancel, as the page's button) sets should_training_stop."""
    monkeypatch.chdir(tmp_path)
    many = 1000
    trainer = grpo(
        tiny_model_dir,
        tmp_path,
        [digits],
        max_steps=many,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        beta=0.0,
    )
    callback = TributaryCallback.attach(
        trainer,
        project=PROJECT,
        name="cancel-me",
        url=server.url,
        token=server.api_token,
        dir=tmp_path / "run",
    )

    class CancelOnce(TrainerCallback):
        """Presses Cancel once the run exists on the server, from the training thread."""

        sent = False

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if not self.sent and callback.run is not None and callback.run.id is not None:
                server.api("POST", f"/runs/{callback.run.id}/cancel")
                self.sent = True

    trainer.add_callback(CancelOnce())
    trainer.train()
    assert trainer.state.global_step < many
    run_id = callback.run.id
    wait_until(lambda: run_status(server, run_id) == "cancelled", "the run to be cancelled")
