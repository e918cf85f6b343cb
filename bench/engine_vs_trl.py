"""GRPO throughput and learning per step: this engine against TRL's ``GRPOTrainer``, in one run.

Usage::

    python bench/engine_vs_trl.py                  # 32 prompts x 8 per step, 20 steps (2 warm-up), ~2 min
    python bench/engine_vs_trl.py --quick          # 16 prompts x 8 per step, 8 steps (2 warm-up), ~1 min
    python bench/engine_vs_trl.py --steps 40 --prompts 16 --rounds 3   # alternate the two 3 times (medians)
    python bench/engine_vs_trl.py --profile 6      # also cProfile 6 engine steps and print the top functions

Threads: ``--threads 1`` (the default) in both. On a 2-core machine shared with other work, two
OpenMP threads per process thrash (steps vary from 0.4 s to 24 s); on an idle machine pass
``--threads 2``. ``--rounds`` alternates engine and TRL runs to even out load drift.

TRL is a ``bench`` extra only (``pip install -e '.[bench]'``), never an engine dependency.

What runs: each framework trains in its own fresh Python subprocess (same thread count, one after
the other, so neither sees the other's allocator or caches):

* **engine**: ``engine.run.execute(cfg, events=<tmp file>)``, i.e. the engine's real entry point (the
  one ``python -m engine run`` calls: orchestrator, rollout producer with the torch KV-cached rollout
  backend, reward manager, learner, torch trainer, weight sync, event sink). Step time is the
  engine's own ``timing_s/step``, generated tokens are ``rollout/gen_tokens``, reward and accuracy are
  ``reward/mean`` and ``train/accuracy``, all read back from the event log.
* **TRL**: ``trl.GRPOTrainer.train()`` with ``use_cpu=True`` and vLLM off (plain ``model.generate``).
  Step time is the wall time between consecutive ``on_step_end`` callbacks (generation, scoring,
  forward/backward, optimiser step and TRL's logging); generated tokens, reward and accuracy are
  counted inside the reward function from the ``completion_ids`` and scores TRL hands it.

What is matched:

* **model weights**: the same local directory (the arithmetic starter policy, ~2M parameters, or
  ``--model``), loaded with ``engine.models.load_model`` in float32 for both;
* **prompts**: arithmetic difficulty 1 from ``engine.data.load_prompts``; TRL's dataset is the exact
  sequence of batches the engine's ``PromptSampler`` draws (TRL's shuffling is off), checked per step,
  and TRL's tokenisation of each prompt is checked to give the engine's token ids;
* **group size** (``--group``, 8), **prompts per step** (``--prompts``), **max new tokens** (16),
  **temperature** 1.0, top-p 1, top-k off, same EOS;
* **optimisation**: one optimiser step per rollout batch (TRL: ``per_device_train_batch_size`` =
  prompts x group, ``gradient_accumulation_steps`` = 1, ``num_iterations`` = 1; engine: one
  mini-batch, ``micro_batch_size`` = prompts x group so both do one forward/backward per step), the
  same number of steps, AdamW with the same lr / betas (0.9, 0.99) / eps / no weight decay, constant
  schedule, no warm-up, grad-norm clip 1.0 (TRL's default fused AdamW kernel, the engine's
  ``torch.optim.AdamW``: the same update);
* **loss**: GRPO advantages normalised by the group std (TRL ``scale_rewards="group"``), PPO clip
  0.2 both sides, token-level loss averaged over all tokens of the batch (engine ``token-mean`` =
  TRL ``loss_type="dapo"``), no KL (``beta=0`` in TRL, ``use_kl_loss=False`` in the engine, so
  neither loads a reference model), no entropy bonus;
* **reward**: the task verifier ``engine.data.get_task("arithmetic").score(completion, answer,
  metadata)`` in both (the engine's ``task`` reward calls exactly that);
* **timing**: the first ``--warmup`` steps of each are trained but not timed; evaluation is not in
  either's step time.

Neither runs an old-log-prob forward here: with one epoch and one mini-batch, strictly on-policy,
the policy being updated is the old one (engine: ``Learner.recomputes_old_log_probs``; TRL:
``num_iterations=1`` with generation and update aligned). Not the same by design (each framework's
own implementation): TRL samples the ``group`` completions of a prompt as separate rows and runs
every prompt + completion whole in its update, where the engine prefills each prompt once, runs each
group's prompt once in its update with the responses on top, and leaves out the last response
column (it predicts no token); it also leaves out of its update the rows whose advantages are all
zero (groups whose completions all scored the same: they add nothing to the loss or its gradient,
``trainer.skip_zero_advantage``, ``tests/engine/test_zero_advantage_skip.py``), where TRL runs every
row. Sampling noise differs (different RNG streams), so reward curves agree only in trend.

Learning is compared per step (reward and accuracy of the sampled completions) and by the engine's
evaluator (greedy accuracy and pass@4 on the 256 held-out prompts, ``engine.pipeline.evaluate``)
applied to both final policies. Target (issue 19): engine throughput >= 3x TRL's on the median round and
>= 2x on the worst, with learning at least as good.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


# ----------------------------------------------------------------------------- shared setup


def engine_config(spec: dict[str, Any], out_dir: str):
    """The engine RunConfig of the comparison (also the config of the shared evaluator)."""
    from engine.config import build_config

    return build_config(
        {
            "name": "bench-engine-vs-trl",
            "output_dir": out_dir,
            "model": {"path": spec["model"], "dtype": "float32"},
            "data": {"source": "builtin", "task": "arithmetic", "difficulty": 1},
            "rollout": {
                "n": spec["group"],
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
                "max_new_tokens": spec["max_new_tokens"],
                "batch_size": max(512, spec["prompts"] * spec["group"]),
            },
            "reward": {"functions": [{"name": "task", "weight": 1.0}]},
            "algorithm": {
                "adv_estimator": "grpo",
                "norm_adv_by_std_in_grpo": True,
                "policy_loss": "vanilla",
                "clip_ratio": 0.2,
                "clip_ratio_low": 0.2,
                "clip_ratio_high": 0.2,
                "loss_agg_mode": "token-mean",
                "entropy_coeff": 0.0,
                "use_kl_loss": False,
                "use_kl_in_reward": False,
            },
            "optimizer": {
                "lr": spec["lr"],
                "betas": [0.9, 0.99],
                "eps": 1e-8,
                "weight_decay": 0.0,
                "grad_clip": 1.0,
                "warmup_steps": 0,
                "schedule": "constant",
            },
            "trainer": {
                "device": "cpu",
                "total_steps": spec["steps"],
                "prompts_per_step": spec["prompts"],
                "ppo_epochs": 1,
                "micro_batch_size": spec["prompts"] * spec["group"],
                "seed": spec["seed"],
                "eval_every": 0,  # evaluate at the start and the end only (not inside any step's timing)
                "eval_pass_k": 4,
            },
            "checkpoint": {"every_steps": 0, "save_final": False},
            "logging": {"samples_per_step": 0, "progress": "off"},
        }
    )


def prompt_schedule(cfg, tokenizer) -> tuple[Any, list[list[Any]]]:
    """The prompt splits and the batches the engine's sampler draws, step by step."""
    from engine.data import PromptSampler, load_prompts

    splits = load_prompts(cfg.data, tokenizer, seed=cfg.trainer.seed)
    sampler = PromptSampler(splits.train, shuffle=cfg.data.shuffle, seed=cfg.trainer.seed)
    return splits, [sampler.next_batch(cfg.trainer.prompts_per_step) for _ in range(cfg.trainer.total_steps)]


def shared_eval(cfg, model, tokenizer, eval_prompts) -> dict[str, float]:
    """The engine's evaluator (greedy accuracy, pass@k on held-out prompts) on any policy."""
    from engine.pipeline.evaluate import evaluate
    from engine.pipeline.producer import RolloutProducer
    from engine.rewards import RewardManager
    from engine.rollout import make_rollout_backend

    backend = make_rollout_backend("torch", model, tokenizer, max_batch_size=cfg.rollout.batch_size)
    try:
        with RewardManager(cfg.reward.functions, timeout_s=cfg.reward.timeout_s, workers=1) as rewards:
            producer = RolloutProducer(
                cfg, sampler=None, backend=backend, rewards=rewards, pad_id=tokenizer.pad_token_id
            )
            return evaluate(producer, eval_prompts, pass_k=cfg.trainer.eval_pass_k, seed=cfg.trainer.seed)
    finally:
        backend.close()


# ----------------------------------------------------------------------------- workers


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from engine.run import execute

    torch.set_num_threads(spec["threads"])
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        cfg = engine_config(spec, tmp)
        events = Path(tmp) / "events.jsonl"
        t0 = time.perf_counter()
        code = execute(cfg, events=str(events), show_progress=False, run_id="bench")
        wall = time.perf_counter() - t0
        lines = [json.loads(line) for line in events.read_text().splitlines() if line.strip()]
    if code != 0:
        raise RuntimeError(
            f"engine run exited {code}: {[e for e in lines if e['type'] in ('status', 'log')]}"
        )
    metrics = {e["step"]: e["values"] for e in lines if e["type"] == "metrics"}
    steps = []
    for step in range(1, spec["steps"] + 1):
        m = metrics[step]
        steps.append(
            {
                "step": step,
                "time_s": m["timing_s/step"],
                "gen_s": m["timing_s/gen"],
                "gen_tokens": m["rollout/gen_tokens"],
                "reward": m["reward/mean"],
                "accuracy": m["train/accuracy"],
                "breakdown": {
                    k.removeprefix("timing_s/"): v for k, v in m.items() if k.startswith("timing_s/")
                },
            }
        )
    start_eval = {k: v for k, v in metrics[0].items() if k.startswith("eval/")}
    end_eval = {k: v for k, v in metrics[spec["steps"]].items() if k.startswith("eval/")}
    return {"steps": steps, "eval_start": start_eval, "eval_end": end_eval, "wall_s": wall}


def run_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import logging
    import warnings

    import torch
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from engine.data import get_task
    from engine.models import load_model, load_tokenizer

    torch.set_num_threads(spec["threads"])
    transformers.logging.set_verbosity_error()
    logging.getLogger("trl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    tmp = tempfile.mkdtemp(prefix="bench-trl-")
    cfg = engine_config(spec, tmp)
    model = load_model(spec["model"], dtype=torch.float32, device="cpu")
    tokenizer = load_tokenizer(spec["model"])
    splits, batches = prompt_schedule(cfg, tokenizer)

    # TRL tokenises a plain-text prompt with ``processing_class(text=prompts)``: check it gives the
    # engine's token ids, so both policies see exactly the same inputs.
    flat = [p for batch in batches for p in batch]
    trl_ids = tokenizer(text=[p.text for p in flat])["input_ids"]
    mismatched = sum(list(a) != list(p.token_ids) for a, p in zip(trl_ids, flat))
    if mismatched:
        raise RuntimeError(f"{mismatched} prompts tokenise differently in TRL than in the engine")
    dataset = Dataset.from_dict(
        {
            "prompt": [p.text for p in flat],
            "answer": [p.answer for p in flat],
            "metadata": [json.dumps(p.metadata) for p in flat],
        }
    )

    task = get_task("arithmetic")
    calls: list[dict[str, Any]] = []

    def arithmetic_reward(prompts, completions, completion_ids, answer, metadata, **_: Any) -> list[float]:
        scores = [
            task.score(c, a, json.loads(m)) for c, a, m in zip(completions, answer, metadata, strict=True)
        ]
        calls.append(
            {
                "prompts": list(dict.fromkeys(prompts)),
                "gen_tokens": sum(len(ids) for ids in completion_ids),
                "reward": sum(scores) / len(scores),
                "accuracy": sum(s > 0.5 for s in scores) / len(scores),
            }
        )
        return scores

    arithmetic_reward.__name__ = "task"
    batch = spec["prompts"] * spec["group"]
    args = GRPOConfig(
        output_dir=tmp,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=spec["seed"],
        max_steps=spec["steps"],
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=spec["group"],
        num_iterations=1,
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        beta=0.0,
        epsilon=0.2,
        scale_rewards="group",
        loss_type="dapo",
        learning_rate=spec["lr"],
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.begin = 0.0

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            self.begin = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.ends.append(time.perf_counter())

    clock = StepClock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[arithmetic_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    gen_times: list[float] = []
    inner_generate = trainer._generate_single_turn

    def timed_generate(*a: Any, **k: Any):
        t = time.perf_counter()
        out = inner_generate(*a, **k)
        gen_times.append(time.perf_counter() - t)
        return out

    trainer._generate_single_turn = timed_generate
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0

    if len(calls) != spec["steps"] or len(clock.ends) != spec["steps"]:
        raise RuntimeError(
            f"TRL ran {len(clock.ends)} steps and scored {len(calls)} batches, expected {spec['steps']}"
        )
    same_prompts = all(c["prompts"] == [p.text for p in b] for c, b in zip(calls, batches, strict=True))
    ends = [clock.begin, *clock.ends]
    steps = [
        {
            "step": i + 1,
            "time_s": ends[i + 1] - ends[i],
            "gen_s": gen_times[i] if i < len(gen_times) else float("nan"),
            "gen_tokens": c["gen_tokens"],
            "reward": c["reward"],
            "accuracy": c["accuracy"],
        }
        for i, c in enumerate(calls)
    ]
    model = trainer.model
    model.eval()
    end_eval = shared_eval(cfg, model, tokenizer, splits.eval)
    shutil.rmtree(tmp, ignore_errors=True)
    return {"steps": steps, "eval_end": end_eval, "wall_s": wall, "same_prompts": same_prompts}


def run_profile(spec: dict[str, Any]) -> dict[str, Any]:
    """cProfile the engine's training steps (``Orchestrator.train_step`` after the warm-up steps only:
    no model load, no eval) inside a real ``engine.run.execute`` run; return the top functions."""
    import cProfile
    import io
    import pstats

    import torch

    from engine.pipeline.orchestrator import Orchestrator
    from engine.run import execute

    torch.set_num_threads(spec["threads"])
    prof = cProfile.Profile()
    inner = Orchestrator.train_step
    seconds: list[float] = []

    def profiled_step(self: Any, step: int) -> dict[str, float]:
        if step <= spec["warmup"]:
            return inner(self, step)
        t = time.perf_counter()
        prof.enable()
        try:
            return inner(self, step)
        finally:
            prof.disable()
            seconds.append(time.perf_counter() - t)

    Orchestrator.train_step = profiled_step  # instrumentation in this worker process only
    with tempfile.TemporaryDirectory(prefix="bench-engine-prof-") as tmp:
        cfg = engine_config({**spec, "steps": spec["warmup"] + spec["profile_steps"]}, tmp)
        cfg.data.eval_size = 0
        code = execute(cfg, events=str(Path(tmp) / "events.jsonl"), show_progress=False, run_id="profile")
    if code != 0:
        raise RuntimeError(f"engine run exited {code}")
    out = {"steps": len(seconds), "seconds": sum(seconds)}
    for key, title in (("tottime", "self time"), ("cumulative", "cumulative time")):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(30)
        text = buf.getvalue()
        out[title] = (
            text[text.find("   ncalls") :]
            .rstrip()
            .replace(str(REPO_ROOT) + "/", "")
            .replace(str(Path(torch.__file__).parents[1]) + "/", "")
        )
    return out


WORKERS = {"engine": run_engine, "trl": run_trl, "profile": run_profile}


# ----------------------------------------------------------------------------- parent


def spawn(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-evt-") as tmp:
        out = Path(tmp) / "result.json"
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, str(spec_path), str(out)]
        threads = str(spec["threads"])
        env = {
            **os.environ,
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONWARNINGS": "ignore",
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
        }
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise SystemExit(f"{kind} worker failed (exit {proc.returncode})")
        return json.loads(out.read_text())


def throughput(result: dict[str, Any], warmup: int) -> dict[str, float]:
    """Timing figures of one run over its timed (post-warm-up) steps."""
    timed = result["steps"][warmup:]
    seconds = sum(s["time_s"] for s in timed)
    gen_s = sum(s["gen_s"] for s in timed)
    tokens = sum(s["gen_tokens"] for s in timed)
    median = statistics.median(s["time_s"] for s in timed)
    return {
        "steps_per_s": len(timed) / seconds,
        "median_steps_per_s": 1.0 / median,
        "tokens_per_s": tokens / seconds,
        "gen_only_tokens_per_s": tokens / gen_s if gen_s > 0 else float("nan"),
        "median_step_s": median,
        "gen_share": gen_s / seconds,
        "tokens_per_step": tokens / len(timed),
    }


def learning(result: dict[str, Any]) -> dict[str, float]:
    steps = result["steps"]
    quarter = max(1, len(steps) // 4)
    return {
        "reward_mean": statistics.mean(s["reward"] for s in steps),
        "reward_first": statistics.mean(s["reward"] for s in steps[:quarter]),
        "reward_last": statistics.mean(s["reward"] for s in steps[-quarter:]),
        "accuracy_mean": statistics.mean(s["accuracy"] for s in steps),
    }


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def print_report(spec: dict[str, Any], engs: list[dict[str, Any]], trls: list[dict[str, Any]]) -> float:
    w = spec["warmup"]
    eng, trl = engs[0], trls[0]
    te = [throughput(r, w) for r in engs]
    tt = [throughput(r, w) for r in trls]
    se = {**median_of(te), **learning(eng)}
    st = {**median_of(tt), **learning(trl)}
    rows = spec["prompts"] * spec["group"]
    rounds = len(engs)
    print(
        f"\nGRPO on arithmetic d1, model {Path(spec['model']).name}: {spec['prompts']} prompts x {spec['group']} "
        f"= {rows} completions/step, max_new_tokens {spec['max_new_tokens']}, T=1.0, lr {spec['lr']}, "
        f"{spec['steps']} steps ({w} warm-up not timed), {spec['threads']} torch thread(s), CPU, "
        f"{rounds} round(s) engine/TRL alternating"
    )
    print(f"same prompts each step in TRL as in the engine: {all(r['same_prompts'] for r in trls)}")
    if rounds > 1:
        same = all(
            [s["reward"] for s in r["steps"]] == [s["reward"] for s in runs[0]["steps"]]
            for runs in (engs, trls)
            for r in runs
        )
        print(f"rewards identical in every round (both are seeded): {same}; figures are medians over rounds")
    print(
        f"machine load average (1 min) before/after: {spec['load_before']:.1f} / {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} cores\n"
    )
    print(f"{'':30}{'engine':>10}{'TRL':>10}{'ours/TRL':>10}")

    # Ratios are medians of the per-round ratios (each round's two runs saw the same machine load).
    ratios = {k: statistics.median(a[k] / b[k] for a, b in zip(te, tt)) for k in te[0]}

    def line(label: str, key: str, fmt: str, ratio: bool = True) -> None:
        a, b = se[key], st[key]
        r = f"{ratios[key]:>9.2f}x" if ratio and b else ""
        print(f"{label:30}{a:>10{fmt}}{b:>10{fmt}}{r}")

    line("steps/s", "steps_per_s", ".3f")
    line("steps/s (from median step)", "median_steps_per_s", ".3f")
    line("generated tokens/s", "tokens_per_s", ".0f")
    line("gen-only tokens/s", "gen_only_tokens_per_s", ".0f")
    line("generation share of step", "gen_share", ".2f", ratio=False)
    line("generated tokens/step", "tokens_per_step", ".0f", ratio=False)
    line("reward/step, mean over run", "reward_mean", ".3f", ratio=False)
    line("reward/step, first quarter", "reward_first", ".3f", ratio=False)
    line("reward/step, last quarter", "reward_last", ".3f", ratio=False)
    line("train accuracy/step, mean", "accuracy_mean", ".3f", ratio=False)
    e0, e1, t1 = eng["eval_start"], eng["eval_end"], trl["eval_end"]
    for key, label in (("eval/accuracy", "eval greedy acc"), ("eval/pass@4", "eval pass@4")):
        print(f"{label + ' at start':30}{e0[key]:>10.3f}{e0[key]:>10.3f}")
        print(f"{label + ' at end':30}{e1[key]:>10.3f}{t1[key]:>10.3f}")
    per_round = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(te, tt, strict=True)]
    if rounds > 1:
        print(f"{'tokens/s ratio per round':30}{', '.join(f'{r:.2f}x' for r in per_round)}")

    print(
        f"\nper step (round 1)  {'engine: s':>10}{'tok':>6}{'reward':>8}{'acc':>7}"
        f"   {'TRL: s':>8}{'tok':>6}{'reward':>8}{'acc':>7}"
    )
    for a, b in zip(eng["steps"], trl["steps"], strict=True):
        mark = " (warm-up)" if a["step"] <= w else ""
        print(
            f"step {a['step']:>3}{'':11}{a['time_s']:>10.3f}{a['gen_tokens']:>6.0f}{a['reward']:>8.3f}"
            f"{a['accuracy']:>7.3f}   {b['time_s']:>8.3f}{b['gen_tokens']:>6.0f}{b['reward']:>8.3f}{b['accuracy']:>7.3f}{mark}"
        )
    parts: dict[str, float] = {}
    timed = [s for r in engs for s in r["steps"][w:]]
    for s in timed:
        for k, v in s["breakdown"].items():
            if k not in ("step", "eval"):
                parts[k] = parts.get(k, 0.0) + v
    n = max(1, len(timed))
    mean_step = sum(s["time_s"] for s in timed) / n
    print(
        "\nengine step breakdown (mean s over timed steps): "
        + ", ".join(f"{k} {v / n:.3f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
        + f"; whole step {mean_step:.3f}"
    )
    trl_timed = [s for r in trls for s in r["steps"][w:]]
    trl_step = sum(s["time_s"] for s in trl_timed) / len(trl_timed)
    trl_gen = sum(s["gen_s"] for s in trl_timed) / len(trl_timed)
    print(
        f"TRL step breakdown (mean s): generate {trl_gen:.3f}, rest (score, forward/backward, optimiser, log) "
        f"{trl_step - trl_gen:.3f}; whole step {trl_step:.3f}"
    )
    ratio = ratios["tokens_per_s"]
    steps_ratio = ratios["steps_per_s"]
    learn_ok = (
        se["reward_mean"] >= st["reward_mean"] - 0.03 and e1["eval/accuracy"] >= t1["eval/accuracy"] - 0.03
    )
    worst = min(per_round)
    met = ratio >= 3 and worst >= 2
    print(
        f"\nthroughput ours/TRL: {ratio:.2f}x generated tokens/s (worst round {worst:.2f}x), "
        f"{steps_ratio:.2f}x steps/s (target >= 3x median, >= 2x every round: {'met' if met else 'NOT met'}); "
        f"learning per step at least as good (reward and final eval accuracy within 0.03): "
        f"{'yes' if learn_ok else 'no'}"
    )
    return ratio


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        kind, spec_path, out_path = argv[1:4]
        result = WORKERS[kind](json.loads(Path(spec_path).read_text()))
        Path(out_path).write_text(json.dumps(result))
        return 0

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--steps", type=int, default=None, help="optimiser steps per framework (default 20, quick 8)"
    )
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default 32, quick 16)")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO group size)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=2, help="first steps trained but not timed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads in both (default 1: on a busy 2-core machine 2 threads per process thrash)",
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="alternate engine/TRL runs this many times (median)"
    )
    ap.add_argument("--model", default=None, help="local model dir (default: the arithmetic starter policy)")
    ap.add_argument("--quick", action="store_true", help="fewer, smaller steps (about a minute)")
    ap.add_argument(
        "--profile", type=int, default=0, metavar="STEPS", help="also cProfile this many engine steps"
    )
    ap.add_argument("--skip-trl", action="store_true", help="no comparison (use with --profile)")
    args = ap.parse_args(argv)

    steps = args.steps or (8 if args.quick else 20)
    prompts = args.prompts or (16 if args.quick else 32)
    if args.warmup >= steps:
        ap.error("--warmup must be smaller than --steps")
    if args.model is None:
        from engine.models.starter import starter_policy

        args.model = str(starter_policy("arithmetic", 1))
    spec = {
        "model": str(Path(args.model).resolve()),
        "steps": steps,
        "prompts": prompts,
        "group": args.group,
        "max_new_tokens": args.max_new_tokens,
        "lr": args.lr,
        "warmup": args.warmup,
        "seed": args.seed,
        "threads": args.threads,
        "load_before": os.getloadavg()[0],
    }
    if not args.skip_trl:
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit("TRL is not installed: pip install -e '.[bench]'") from None
        engs, trls = [], []
        for _ in range(max(1, args.rounds)):
            engs.append(spawn("engine", spec))
            trls.append(spawn("trl", spec))
        print_report(spec, engs, trls)
    if args.profile:
        prof = spawn("profile", {**spec, "profile_steps": args.profile})
        print(
            f"\nengine cProfile of {prof['steps']} training steps after {spec['warmup']} warm-up "
            f"({prof['seconds']:.1f} s profiled, Orchestrator.train_step only)"
        )
        for title in ("self time", "cumulative time"):
            print(f"\ntop by {title}:\n{prof[title]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
