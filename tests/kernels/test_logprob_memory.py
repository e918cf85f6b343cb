"""Peak memory of one fused forward+backward stays under a bound computed from the shapes.

A regression that keeps a ``V``-sized tensor alive for backward (the ``[N, V]`` logits, softmax or
log-softmax, as the naive version does), or that allocates per-chunk gradient copies, raises the
step's peak by at least one ``[chunk, V]`` or ``[V, H]`` block; the bound below leaves less room
than that.

Measured like ``bench/logprob_kernel.py``: in a fresh interpreter (nothing cached by earlier tests),
peak RSS minus the RSS after the inputs exist (read as ``VmHWM`` after resetting it, see the worker). Two differences from the bench:
the worker runs one tiny step first, so that the one-time cost of faulting in library code
(MKL's kernels, autograd's engine: tens of MiB, the same for every implementation) is in the
baseline and not in the figure; and the shapes are chosen so that the ``V``-sized buffers dwarf the
margin (below).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.logprob import CHUNK_BYTES, MIN_CHUNK_TOKENS, auto_chunk_size, sub_block_rows

REPO_ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024

N, H, V, CHUNK = 2048, 64, 16_384, 256

_WORKER = """
import json, sys
import torch
sys.path.insert(0, {root!r})
from kernels.logprob import fused_logprobs_entropy
torch.set_num_threads(1)
n, h, v, chunk = {n}, {h}, {v}, {chunk}

def step(n, h, v, chunk):
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h).mul_(h ** -0.5).requires_grad_(True)
    labels = torch.randint(0, v, (n,))
    return hidden, weight, labels, [torch.randn(n), torch.randn(n)]

def run(hidden, weight, labels, upstream, chunk):
    outputs = fused_logprobs_entropy(hidden, weight, labels, chunk_size=chunk)
    torch.autograd.backward(list(outputs), upstream)

run(*step(16, h, 64, 4), 4)  # fault in library code before the baseline
inputs = step(n, h, v, chunk)

def status_bytes(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

# Reset the peak-RSS counter (VmHWM) to the current RSS (Linux >= 4.0). ru_maxrss cannot be used:
# Linux carries it over fork + exec, so this child would report pytest's own peak.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
baseline = status_bytes("VmRSS")
reset_ok = status_bytes("VmHWM") <= baseline + 64 * 1024
run(*inputs, chunk)
print(json.dumps({{"step_bytes": status_bytes("VmHWM") - baseline, "reset_ok": reset_ok}}))
"""


def _measure() -> dict:
    code = _WORKER.format(root=str(REPO_ROOT), n=N, h=H, v=V, chunk=CHUNK)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_fused_step_peak_memory_bound() -> None:
    # What must exist at the peak (float32, 4 bytes): weight.grad [V, H] and hidden.grad [N, H] (the
    # results), the [CHUNK, V] logits block and the [sub, V] exp block; O(N) vectors are noise.
    sub = sub_block_rows(CHUNK)
    needed = 4 * (V * H + N * H + CHUNK * V + sub * V)  # 4 + 0.5 + 16 + 4 = 24.5 MiB
    # Margin: allocator and page granularity (4 KiB pages; glibc keeps freed blocks below its mmap
    # threshold, at most 32 MiB, in the heap, so a few small temporaries may coexist), MKL's per-call
    # packing buffers and torch's [chunk] / [N, 1] temporaries: measured 0.3 MiB over `needed`. 8 MiB
    # is half the smallest regression this must catch, one more [CHUNK, V] block (16 MiB); keeping
    # the [N, V] logits for backward would add 128 MiB.
    margin = 8 * MIB
    result = _measure()
    assert result["reset_ok"], f"writing 5 to /proc/self/clear_refs did not reset VmHWM: {result}"
    assert result["step_bytes"] <= needed + margin, (
        f"fused step peak {result['step_bytes'] / MIB:.1f} MiB > bound {(needed + margin) / MIB:.1f} MiB "
        f"({needed / MIB:.1f} MiB needed + {margin / MIB:.0f} MiB margin): something V-sized is kept"
    )


def test_auto_chunk_size_is_a_byte_budget() -> None:
    # 64 MiB of logits: 524 float32 rows at V = 32k; at 151,936 the floor of MIN_CHUNK_TOKENS holds
    assert auto_chunk_size(32_000) == CHUNK_BYTES // (32_000 * 4) == 524
    assert auto_chunk_size(151_936) == MIN_CHUNK_TOKENS
    assert auto_chunk_size(1_000) * 1_000 * 4 <= CHUNK_BYTES
    import torch

    assert auto_chunk_size(16_000, torch.float64) == CHUNK_BYTES // (16_000 * 8) == 524
    assert sub_block_rows(524) == 131 and sub_block_rows(3) == 1
