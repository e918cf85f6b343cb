"""Peak memory and time of forward+backward: fused chunked logprobs/entropy vs the naive full-logits version.

Usage::

    python bench/logprob_kernel.py            # 4096 tokens, hidden 896 (Qwen2-0.5B), vocab 32k and 151k
    python bench/logprob_kernel.py --quick    # 1024 tokens, hidden 256, vocab 8k and 32k (seconds)

What is measured, per (vocab, implementation) case:

* One step = ``logprobs, entropy = impl(hidden, weight, labels)`` followed by backward with random
  upstream gradients for both outputs, producing grads for ``hidden`` and ``weight`` (float32, CPU).
* **Peak memory**: each case runs in a fresh Python subprocess, so no allocator cache or earlier
  case can hide or inflate anything. After the inputs are allocated (and their pages touched) the
  worker reads its current RSS from ``/proc/self/statm`` as the baseline, runs one step, and reads
  the lifetime peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``). The reported figure is
  ``peak - baseline``: everything the step itself brought into memory, including the gradients of
  the inputs (``weight.grad`` is ``V x H`` floats in both implementations) and freed temporaries.
  This is sound because the baseline is also the high-water mark up to that point (the worker
  checks it), and torch's CPU tensors all live in process memory and are written, hence resident.
* **Time**: the same worker then runs ``--repeats`` more steps (the first, measured step is the
  warm-up) and reports the median wall time, which is robust to other processes on the machine.

The table gives absolute figures and the ratios ``memory naive/fused`` (higher is better) and
``time fused/naive`` (lower is better). Targets: >= 4x less peak memory at <= 1.3x the time.
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
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_case(impl: str, tokens: int, hidden_size: int, vocab: int, chunk_size: int, repeats: int) -> dict:
    """Worker body (runs in its own process): one measured step for memory, then timed repeats."""
    sys.path.insert(0, str(REPO_ROOT))
    import torch

    from kernels.logprob import fused_logprobs_entropy, naive_logprobs_entropy

    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size).mul_(hidden_size**-0.5).requires_grad_(True)  # no temporary
    labels = torch.randint(0, vocab, (tokens,))
    grad_logprobs, grad_entropy = torch.randn(tokens), torch.randn(tokens)

    def step() -> None:
        hidden.grad = weight.grad = None
        if impl == "fused":
            logprobs, entropy = fused_logprobs_entropy(hidden, weight, labels, chunk_size=chunk_size)
        else:
            logprobs, entropy = naive_logprobs_entropy(hidden, weight, labels)
        torch.autograd.backward([logprobs, entropy], [grad_logprobs, grad_entropy])

    baseline = _current_rss_bytes()
    baseline_is_high_water = _peak_rss_bytes() <= baseline + 16 * MIB
    step()
    peak_delta = _peak_rss_bytes() - baseline

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {
        "peak_mib": peak_delta / MIB,
        "baseline_is_high_water": baseline_is_high_water,
        "time_s": statistics.median(times),
        "times_s": times,
    }


def measure(impl: str, args: argparse.Namespace, vocab: int) -> dict:
    """Run one case in a fresh interpreter and return its JSON result."""
    cmd = [
        sys.executable, __file__, "--worker", impl,
        "--tokens", str(args.tokens), "--hidden", str(args.hidden), "--vocab", str(vocab),
        "--chunk-size", str(args.chunk_size), "--repeats", str(args.repeats),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {impl} vocab={vocab} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    sys.path.insert(0, str(REPO_ROOT))
    from kernels.logprob import DEFAULT_CHUNK_SIZE

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (1024 tokens, hidden 256, vocab 8k/32k)")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--vocab", type=int, nargs="+", default=None)
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per case (median is reported)")
    parser.add_argument("--impls", nargs="+", default=["naive", "fused"], choices=["naive", "fused"])
    parser.add_argument("--worker", choices=["naive", "fused"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tokens is None:
        args.tokens = 1024 if args.quick else 4096
    if args.hidden is None:
        args.hidden = 256 if args.quick else 896
    if args.vocab is None:
        args.vocab = [8192, 32_000] if args.quick else [32_000, 151_936]

    if args.worker is not None:
        result = run_case(args.worker, args.tokens, args.hidden, args.vocab[0], args.chunk_size, args.repeats)
        print(json.dumps(result))
        return

    print(
        f"fwd+bwd of logprobs+entropy, float32 CPU, {args.tokens} tokens, hidden {args.hidden}, "
        f"chunk_size {args.chunk_size}, median of {args.repeats}, torch threads per process: default"
    )
    header = f"{'vocab':>8} {'impl':>6} {'peak MiB':>10} {'time s':>8} {'mem naive/fused':>16} {'time fused/naive':>17}"
    print(header)
    print("-" * len(header))
    for vocab in args.vocab:
        results = {impl: measure(impl, args, vocab) for impl in args.impls}
        for impl, res in results.items():
            ratios = ""
            if impl == "fused" and "naive" in results:
                naive = results["naive"]
                ratios = f"{naive['peak_mib'] / res['peak_mib']:>16.2f}x {res['time_s'] / naive['time_s']:>16.2f}x"
            flag = "" if res["baseline_is_high_water"] else "  (!) baseline below earlier high-water"
            print(f"{vocab:>8} {impl:>6} {res['peak_mib']:>10.0f} {res['time_s']:>8.2f} {ratios}{flag}", flush=True)


if __name__ == "__main__":
    main()
