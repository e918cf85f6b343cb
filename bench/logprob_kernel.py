"""Peak memory and time of forward+backward: fused chunked logprobs/entropy vs the naive full-logits version.

Usage::

    python bench/logprob_kernel.py            # 4096 tokens, hidden 896 (Qwen2-0.5B), vocab 32k and 151k
    python bench/logprob_kernel.py --quick    # 1024 tokens, hidden 256, vocab 8k and 32k

One step = ``logprobs, entropy = impl(hidden, weight, labels)`` then backward with random upstream
gradients for both outputs, producing grads for ``hidden`` and ``weight`` (float32, CPU).

**Peak memory** -- each (vocab, impl) case runs in a fresh Python subprocess, so no allocator cache
or earlier case can hide or inflate anything. After the inputs are allocated (and their pages
touched) the worker reads its current RSS from ``/proc/self/statm`` as the baseline, runs one step,
and reads the lifetime peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``). The figure is
``peak - baseline``: everything the step brought into memory, including freed temporaries and the
input gradients (``weight.grad`` alone is ``V x H`` floats, in both implementations). This is sound
because the baseline is also the high-water mark up to that point (checked, flagged with ``(!)``
otherwise) and torch's CPU tensors live in process memory and are written, hence resident.

**Time** -- the machine is shared, so a separate process per implementation would compare two
different load conditions. Instead one subprocess per vocab builds the inputs once, runs a warm-up
step of each implementation, then ``--repeats`` rounds that time one step of each, alternating the
order (ABBA...), and reports each implementation's median wall time.

Ratios: ``memory naive/fused`` (higher is better), ``time fused/naive`` (lower is better).
Targets (issue 19): >= 8x less peak memory at <= 1.2x the time, at both vocabularies.

The floor: ``weight.grad`` + ``hidden.grad`` are ``(V + N) H`` floats in both implementations (123 MiB
at V = 32k, 533 MiB at 151k with the default shapes), so the ratio cannot exceed naive / floor.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
IMPLS = ("naive", "fused")


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _make_steps(args: argparse.Namespace, vocab: int) -> dict[str, Callable[[], None]]:
    """Allocate the inputs and return one forward+backward step per implementation."""
    sys.path.insert(0, str(REPO_ROOT))
    import torch

    from kernels.logprob import fused_logprobs_entropy, naive_logprobs_entropy

    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, requires_grad=True)
    weight = torch.randn(vocab, args.hidden).mul_(args.hidden**-0.5).requires_grad_(True)  # no temporary
    labels = torch.randint(0, vocab, (args.tokens,))
    upstream = [torch.randn(args.tokens), torch.randn(args.tokens)]  # d loss / d logprobs, d loss / d entropy

    def step(impl: str) -> None:
        hidden.grad = weight.grad = None
        if impl == "fused":
            outputs = fused_logprobs_entropy(hidden, weight, labels, chunk_size=args.chunk_size)
        else:
            outputs = naive_logprobs_entropy(hidden, weight, labels)
        torch.autograd.backward(list(outputs), upstream)

    return {impl: (lambda impl=impl: step(impl)) for impl in IMPLS}


def worker_memory(args: argparse.Namespace, impl: str, vocab: int) -> dict:
    step = _make_steps(args, vocab)[impl]
    baseline = _current_rss_bytes()
    baseline_is_high_water = _peak_rss_bytes() <= baseline + 16 * MIB
    step()
    return {
        "peak_mib": (_peak_rss_bytes() - baseline) / MIB,
        "baseline_is_high_water": baseline_is_high_water,
    }


def worker_time(args: argparse.Namespace, vocab: int) -> dict:
    steps = _make_steps(args, vocab)
    impls = [impl for impl in IMPLS if impl in args.impls]
    for impl in impls:  # warm-up
        steps[impl]()
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for round_ in range(args.repeats):
        for impl in impls if round_ % 2 == 0 else impls[::-1]:
            start = time.perf_counter()
            steps[impl]()
            times[impl].append(time.perf_counter() - start)
    return {impl: {"median_s": statistics.median(t), "times_s": t} for impl, t in times.items()}


def _run_worker(args: argparse.Namespace, *worker_args: str) -> dict:
    """Run this script as a worker in a fresh interpreter and return its JSON result."""
    cmd = [
        sys.executable, __file__, *worker_args,
        "--tokens", str(args.tokens), "--hidden", str(args.hidden),
        *(["--chunk-size", str(args.chunk_size)] if args.chunk_size else []), "--repeats", str(args.repeats), "--impls", *args.impls,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {worker_args} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_args() -> argparse.Namespace:
    sys.path.insert(0, str(REPO_ROOT))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="small shapes: 1024 tokens, hidden 256, vocab 8k/32k"
    )
    parser.add_argument("--tokens", type=int, default=None, help="default 4096 (1024 with --quick)")
    parser.add_argument("--hidden", type=int, default=None, help="default 896 (256 with --quick)")
    parser.add_argument("--vocab", type=int, nargs="+", default=None, help="default 32000 151936")
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="tokens per fused chunk; default: sized from the vocabulary (kernels.logprob.auto_chunk_size)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed steps per implementation (median reported)"
    )
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--verbose", action="store_true", help="also print every individual timing")
    parser.add_argument("--worker-memory", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--worker-time", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tokens is None:
        args.tokens = 1024 if args.quick else 4096
    if args.hidden is None:
        args.hidden = 256 if args.quick else 896
    if args.vocab is None:
        args.vocab = [8192, 32_000] if args.quick else [32_000, 151_936]
    return args


def main() -> None:
    args = parse_args()
    if args.worker_memory is not None:
        print(json.dumps(worker_memory(args, args.worker_memory, args.vocab[0])))
        return
    if args.worker_time:
        print(json.dumps(worker_time(args, args.vocab[0])))
        return

    print(
        f"forward+backward of logprobs+entropy, float32 on CPU ({os.cpu_count()} cores), {args.tokens} tokens, "
        f"hidden {args.hidden}, fused chunk_size {args.chunk_size or 'auto'}, time = median of {args.repeats}"
    )
    header = f"{'vocab':>8} {'impl':>6} {'peak MiB':>10} {'time s':>8} {'mem naive/fused':>16} {'time fused/naive':>17}"
    print(header)
    print("-" * len(header))
    for vocab in args.vocab:
        memory = {
            impl: _run_worker(args, "--worker-memory", impl, "--vocab", str(vocab)) for impl in args.impls
        }
        timing = _run_worker(args, "--worker-time", "--vocab", str(vocab))
        for impl in args.impls:
            mem, sec = memory[impl], timing[impl]["median_s"]
            ratios = ""
            if impl == "fused" and "naive" in args.impls:
                mem_ratio = memory["naive"]["peak_mib"] / mem["peak_mib"]
                ratios = f"{mem_ratio:>15.2f}x {sec / timing['naive']['median_s']:>16.2f}x"
            flag = "" if mem["baseline_is_high_water"] else "  (!) baseline below an earlier high-water mark"
            print(f"{vocab:>8} {impl:>6} {mem['peak_mib']:>10.0f} {sec:>8.2f} {ratios}{flag}", flush=True)
        if args.verbose:
            print(f"{'':>8} all times (s): {json.dumps({k: v['times_s'] for k, v in timing.items()})}")


if __name__ == "__main__":
    main()
