"""Rollout backends: generated tokens/s of vLLM against the torch backend, and weight-sync time by model size.

Usage::

    python bench/rollout_backends.py              # small and base: 32 prompts x n=8, 64 new tokens, 5 rounds
    python bench/rollout_backends.py --quick      # 32 new tokens, 2 rounds
    python bench/rollout_backends.py --threads 1  # one torch thread for both (steadier on a shared machine)

Throughput: both backends sample at temperature 1 (no top-k/top-p) from the same 32 prompts, ``n`` each,
up to ``--new-tokens`` new tokens, on make_model's ``small`` and ``base`` models (random weights, seed 0,
built locally). A random model rarely says EOS, so nearly every sequence runs to the limit: this is decoding
speed. After a warm-up call of each, ``--repeats`` rounds time one call of each in alternating order
(ABBA...) on fresh prompts (the same for both), and the median tokens/s is reported with the ratio vLLM/torch (higher is better). Both run
in this process with the same torch thread count (the vLLM backend keeps it; see its module docstring).

Weight sync: ``update_weights`` with the model's full state dict (what the orchestrator sends after every
optimiser step and times as ``timing_s/weight_sync``), median of ``--sync-repeats`` calls, for
``tiny``/``small``/``base``. Reference in the same run: the torch backend's update from a separate copy of
the weights (an in-place ``copy_`` of every tensor, the least any backend holding its own weights does).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.rollout_torch import (  # noqa: E402
    add_workload_arguments,
    make_prompts,
    print_rows,
    print_workload,
    resolve_workload,
    start_workload,
)
from engine.models import load_model, load_tokenizer, make_model  # noqa: E402
from engine.models.build import count_parameters  # noqa: E402
from engine.rollout import SamplingParams, make_rollout_backend  # noqa: E402


@dataclass
class Throughput:
    model: str
    params: int
    torch_tps: float
    vllm_tps: float
    torch_tokens: int
    vllm_tokens: int


@dataclass
class Sync:
    model: str
    params: int
    torch_s: float
    vllm_s: float


def generated_tokens(backend, prompts, params) -> int:
    return sum(len(c.token_ids) for g in backend.generate(prompts, params) for c in g.completions)


def bench_model(size: str, path: Path, args: argparse.Namespace) -> tuple[Throughput | None, Sync]:
    model, tokenizer = load_model(path), load_tokenizer(path)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    backends = {
        "torch": make_rollout_backend("torch", model, tokenizer, max_batch_size=512),
        "vllm": make_rollout_backend("vllm", None, tokenizer, model_dir=path, max_batch_size=512),
    }
    throughput = None
    try:
        if size in args.models:
            # Fresh prompts every round (same for both backends): vLLM's prefix cache must not carry prefills
            # across rounds, as it cannot across RL steps (a weight sync resets it).
            pool = make_prompts(tokenizer, args.prompts * (args.repeats + 1))
            rounds = [pool[i * args.prompts : (i + 1) * args.prompts] for i in range(args.repeats + 1)]
            params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens)
            rates: dict[str, list[float]] = {"torch": [], "vllm": []}
            counts: dict[str, list[int]] = {"torch": [], "vllm": []}
            for backend in backends.values():  # warm-up
                generated_tokens(backend, rounds[-1], replace(params, seed=12345))
            for r in range(args.repeats):
                for name in ("torch", "vllm") if r % 2 == 0 else ("vllm", "torch"):
                    start = time.perf_counter()
                    count = generated_tokens(backends[name], rounds[r], replace(params, seed=r))
                    seconds = time.perf_counter() - start
                    rates[name].append(count / seconds)
                    counts[name].append(count)
                    if args.verbose:
                        print(f"  {size} {name} round {r}: {count} tokens in {seconds:.3f}s", flush=True)
            throughput = Throughput(
                size,
                count_parameters(model),
                statistics.median(rates["torch"]),
                statistics.median(rates["vllm"]),
                round(statistics.mean(counts["torch"])),
                round(statistics.mean(counts["vllm"])),
            )
        times: dict[str, list[float]] = {"torch": [], "vllm": []}
        for r in range(args.sync_repeats + 1):  # the first call of each is a warm-up
            for name in ("torch", "vllm") if r % 2 == 0 else ("vllm", "torch"):
                start = time.perf_counter()
                backends[name].update_weights(weights, r + 1)
                if r:
                    times[name].append(time.perf_counter() - start)
        sync = Sync(
            size, count_parameters(model), statistics.median(times["torch"]), statistics.median(times["vllm"])
        )
    finally:
        for backend in backends.values():
            backend.close()
    return throughput, sync


def print_tables(rows: list[Throughput], syncs: list[Sync], args: argparse.Namespace) -> None:
    print_workload(args)
    print_rows(
        f"{'model':<7}{'params':>9}  {'tokens (torch/vllm)':>20}{'torch tok/s':>13}{'vLLM tok/s':>12}{'ratio':>8}",
        (
            f"{c.model:<7}{c.params / 1e6:>8.2f}M  {f'{c.torch_tokens}/{c.vllm_tokens}':>20}"
            f"{c.torch_tps:>13,.0f}{c.vllm_tps:>12,.0f}{c.vllm_tps / c.torch_tps:>7.2f}x"
            for c in rows
        ),
    )
    print(f"\nweight sync (update_weights, full state dict), median of {args.sync_repeats} calls")
    print_rows(
        f"{'model':<7}{'params':>9}  {'MB (fp32)':>10}{'torch copy_ ms':>16}{'vLLM reload ms':>16}{'ratio':>8}",
        (
            f"{s.model:<7}{s.params / 1e6:>8.2f}M  {s.params * 4 / 1e6:>10.1f}{s.torch_s * 1e3:>16.2f}"
            f"{s.vllm_s * 1e3:>16.2f}{s.vllm_s / s.torch_s:>7.1f}x"
            for s in syncs
        ),
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 new tokens, 2 rounds, 3 sync calls")
    parser.add_argument(
        "--models", nargs="+", default=["small", "base"], choices=("tiny", "small", "base"), help="throughput"
    )
    parser.add_argument(
        "--sync-models", nargs="+", default=["tiny", "small", "base"], choices=("tiny", "small", "base")
    )
    add_workload_arguments(parser)
    parser.add_argument(
        "--sync-repeats", type=int, default=None, help="timed syncs (default 10, 3 with --quick)"
    )
    args = parser.parse_args()
    resolve_workload(args)
    args.sync_repeats = args.sync_repeats or (3 if args.quick else 10)
    return args


def main() -> None:
    args = parse_args()
    start_workload(args)
    rows, syncs = [], []
    with tempfile.TemporaryDirectory(prefix="bench-rollout-backends-") as tmp:
        for size in ("tiny", "small", "base"):
            if size not in args.models and size not in args.sync_models:
                continue
            throughput, sync = bench_model(
                size, make_model(Path(tmp) / size, arch="qwen2", size=size, seed=0), args
            )
            if throughput is not None:
                rows.append(throughput)
            if size in args.sync_models:
                syncs.append(sync)
    print_tables(rows, syncs, args)


if __name__ == "__main__":
    main()
