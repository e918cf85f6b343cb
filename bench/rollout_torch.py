"""Generated tokens/s: the torch rollout backend vs transformers ``generate`` on the same model and prompts.

Usage::

    python bench/rollout_torch.py              # 2m, 6m, base (~10M): 32 prompts x n=8, 64 new tokens
    python bench/rollout_torch.py --quick      # 2m and 6m, 32 new tokens, 2 rounds
    python bench/rollout_torch.py --threads 1  # one torch thread (steadier on a shared machine)

Both sample at temperature 1 without top-k/top-p (``generate(do_sample=True, top_k=0, top_p=1)``) from
the same 32 prompts, each repeated ``n`` times (256 sequences), up to ``--new-tokens`` new tokens, under
``torch.inference_mode``. Tokens counted are the real completion tokens (up to and including EOS): the
rows ``generate`` keeps decoding after they finished do not count for it.

Two scenarios per model:

- ``natural``: the model's own EOS; a randomly initialised model rarely says it, so nearly every
  sequence runs to the limit (pure decoding speed).
- ``early-stop``: 16 extra EOS ids (about 1 sampled token in 32) in the generation config of both,
  so completion lengths spread out (mean ~25 of 64) as in RL, where most of a batch is done long
  before its longest sequence (the backend drops finished rows, ``generate`` keeps computing them).

The machine is shared: after a warm-up call of each, ``--repeats`` rounds time one call of each,
alternating the order (ABBA...), and the median tokens/s of each is reported with the ratio
backend/generate (higher is better). Models are built locally by ``engine.models`` (random weights,
seed 0): make_model's ``base`` and, with its tokenizer, Qwen2 models of ~2M and ~6M parameters
(``SPECS``). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from engine.models import load_model, load_tokenizer, make_model  # noqa: E402
from engine.models.build import ModelSpec, build_config, build_tokenizer, count_parameters  # noqa: E402
from engine.rollout import SamplingParams  # noqa: E402
from engine.rollout.torch_backend import TorchRolloutBackend  # noqa: E402

# Own specs (make_model's sizes may change): ~2M and ~6M parameters, Qwen2, tied embeddings.
SPECS = {
    "2m": ModelSpec(256, 384, 4, 4, 2, True),
    "6m": ModelSpec(320, 768, 6, 5, 1, True),
}
EXTRA_EOS = list(range(200, 216))
PROMPT_TEMPLATES = (
    "What is {a} plus {b}?",
    "Add {a} and {b}, then multiply the result by {c}. Answer:",
    "Count down from {a}:",
    "<|im_start|>user\nCompute {a} * {b} - {c}.<|im_end|>\n<|im_start|>assistant\n",
)


@dataclass
class Case:
    model: str
    params: int
    scenario: str
    hf_tps: float
    backend_tps: float
    hf_tokens: int
    backend_tokens: int


def build_model(size: str, out: Path) -> Path:
    """make_model's ``tiny``/``small``/``base``, or one of ``SPECS`` with make_model's tokenizer."""
    if size not in SPECS:
        return make_model(out / size, arch="qwen2", size=size, seed=0)
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = build_tokenizer()
    eos = tokenizer.eos_token_id
    config = build_config("qwen2", SPECS[size], len(tokenizer), eos, tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos, do_sample=False)
    path = out / size
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        text = PROMPT_TEMPLATES[i % len(PROMPT_TEMPLATES)].format(a=3 * i + 1, b=7 * i % 50, c=i % 9 + 2)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def hf_generate_tokens(model, tokenizer, batch, mask, eos_ids: set[int], new_tokens: int, seed: int) -> int:
    torch.manual_seed(max(seed, 0))  # generate samples with the global RNG
    with torch.inference_mode():
        out = model.generate(
            input_ids=batch,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    generated = out[:, batch.shape[1] :].tolist()
    total = 0
    for row in generated:
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        total += end
    return total


def run_model(size: str, path: Path, args: argparse.Namespace) -> list[Case]:
    model, tokenizer = load_model(path), load_tokenizer(path)
    prompts = make_prompts(tokenizer, args.prompts)
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    batch = torch.tensor([[pad] * (width - len(p)) + p for p in prompts]).repeat_interleave(args.n, 0)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]).repeat_interleave(args.n, 0)
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens)
    base_eos = model.generation_config.eos_token_id
    cases = []
    for scenario in args.scenarios:
        eos = [base_eos, *EXTRA_EOS] if scenario == "early-stop" else [base_eos]
        model.generation_config.eos_token_id = eos
        backend = TorchRolloutBackend(model, tokenizer, max_batch_size=args.max_batch_size)
        timings: dict[str, list[float]] = {"hf": [], "backend": []}
        tokens: dict[str, list[int]] = {"hf": [], "backend": []}
        calls = {
            "hf": lambda seed, eos=eos: hf_generate_tokens(
                model, tokenizer, batch, mask, set(eos), args.new_tokens, seed
            ),
            "backend": lambda seed, backend=backend: sum(
                len(c.token_ids)
                for g in backend.generate(prompts, replace(params, seed=seed))
                for c in g.completions
            ),
        }
        for which in ("hf", "backend"):  # warm-up
            calls[which](-1)
        for r in range(args.repeats):
            for which in ("hf", "backend") if r % 2 == 0 else ("backend", "hf"):
                start = time.perf_counter()
                count = calls[which](r)
                seconds = time.perf_counter() - start
                timings[which].append(count / seconds)
                tokens[which].append(count)
                if args.verbose:
                    print(
                        f"  {size} {scenario} {which} round {r}: {count} tokens in {seconds:.3f}s", flush=True
                    )
        cases.append(
            Case(
                model=size,
                params=count_parameters(model),
                scenario=scenario,
                hf_tps=statistics.median(timings["hf"]),
                backend_tps=statistics.median(timings["backend"]),
                hf_tokens=round(statistics.mean(tokens["hf"])),
                backend_tokens=round(statistics.mean(tokens["backend"])),
            )
        )
        model.generation_config.eos_token_id = base_eos
    return cases


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload options of both rollout benches (this one and rollout_backends.py)."""
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 64 (32 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5, 2 with --quick)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--verbose", action="store_true", help="print every timed call")


def resolve_workload(args: argparse.Namespace) -> None:
    """Fill the defaults of :func:`add_workload_arguments` that depend on ``--quick``."""
    args.new_tokens = args.new_tokens or (32 if args.quick else 64)
    args.repeats = args.repeats or (2 if args.quick else 5)


def start_workload(args: argparse.Namespace) -> None:
    """Set the torch threads (before vLLM starts: it makes set_num_threads a no-op) and print the
    load average, which says how far the figures can be trusted."""
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    print(
        f"load average {load:.2f} on {os.cpu_count()} CPUs"
        + (" (busy: figures are noisy)" if load > 1 else "")
    )


def print_workload(args: argparse.Namespace) -> None:
    """The title of a rollout throughput table."""
    print(
        f"\nrollout: {args.prompts} prompts x n={args.n} = {args.prompts * args.n} sequences, "
        f"<= {args.new_tokens} new tokens, temperature 1, torch threads {torch.get_num_threads()}, "
        f"median of {args.repeats} rounds"
    )


def print_rows(header: str, lines: Iterable[str]) -> None:
    """A table: ``header``, a rule as wide, then ``lines``."""
    print(header)
    print("-" * len(header))
    for line in lines:
        print(line)


def print_table(cases: list[Case], args: argparse.Namespace) -> None:
    print_workload(args)
    header = (
        f"{'model':<7}{'params':>9}  {'scenario':<11}{'tokens (hf/ours)':>18}"
        f"{'HF generate tok/s':>19}{'torch backend tok/s':>21}{'ratio':>8}"
    )
    print_rows(
        header,
        (
            f"{c.model:<7}{c.params / 1e6:>8.2f}M  {c.scenario:<11}{f'{c.hf_tokens}/{c.backend_tokens}':>18}"
            f"{c.hf_tps:>19,.0f}{c.backend_tps:>21,.0f}{c.backend_tps / c.hf_tps:>7.2f}x"
            for c in cases
        ),
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="models 2m and 6m, 32 new tokens, 2 rounds")
    parser.add_argument(
        "--models",
        nargs="+",
        default=None,
        choices=("tiny", "small", *SPECS, "base"),
        help="make_model sizes tiny/small/base or the bench's own 2m/6m (default: 2m 6m base)",
    )
    add_workload_arguments(parser)
    parser.add_argument(
        "--scenarios", nargs="+", default=["natural", "early-stop"], choices=("natural", "early-stop")
    )
    parser.add_argument("--max-batch-size", type=int, default=512)
    args = parser.parse_args()
    args.models = args.models or (["2m", "6m"] if args.quick else ["2m", "6m", "base"])
    resolve_workload(args)
    return args


def main() -> None:
    args = parse_args()
    start_workload(args)
    cases = []
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        for size in args.models:
            cases += run_model(size, build_model(size, Path(tmp)), args)
    print_table(cases, args)


if __name__ == "__main__":
    main()
