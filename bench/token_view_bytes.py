"""Bytes a step's samples event takes with the token view on (issue 18: a 4 MiB ingest message must
hold it), with the ``logging`` defaults.

The tiny model (random weights at std 0.2, so its completions run to ``max_new_tokens`` with varied
tokens) generates ``samples_per_step`` completions of ``--tokens`` tokens with the torch backend (exact
log-probs and entropies); ``engine.pipeline.metrics.sample_items`` builds the event's items as a run
does; printed: the event's JSON bytes without tokens (the reference), with them, and the bytes per token.

    .venv/bin/python bench/token_view_bytes.py      # defaults: 16 samples, 8 with up to 512 tokens

The largest caps the config accepts carry MAX_TOKENS_PER_STEP (32,768) tokens, ~0.7 MiB at the
bytes per token printed here; sample_items stops adding tokens at TOKEN_BYTES_PER_STEP (2 MiB) anyway.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.batch import Rollout  # noqa: E402
from engine.config.training import LoggingConfig  # noqa: E402
from engine.data import Prompt  # noqa: E402
from engine.models import load_model, load_tokenizer, make_model  # noqa: E402
from engine.pipeline.metrics import sample_items  # noqa: E402
from engine.pipeline.token_view import token_texts  # noqa: E402
from engine.rollout import SamplingParams  # noqa: E402
from engine.rollout.torch_backend import TorchRolloutBackend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="completion length (max_new_tokens)")
    args = parser.parse_args()
    log = LoggingConfig()
    samples, token_samples, per_sample = (
        log.samples_per_step,
        log.token_samples_per_step,
        log.tokens_per_sample,
    )
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "tiny", arch="qwen2", size="tiny", seed=0)
        tokenizer = load_tokenizer(model_dir)
        model = load_model(model_dir)
        with torch.no_grad():
            for weight in model.parameters():
                if weight.dim() >= 2:
                    weight.normal_(0, 0.2)
        backend = TorchRolloutBackend(model, tokenizer)
        text = "What is 12 plus 30? Think step by step."
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        params = SamplingParams(n=samples, temperature=1.0, max_new_tokens=args.tokens, seed=1)
        (group,) = backend.generate([ids], params)
        prompt = Prompt(uid="p", text=text, raw=text, answer="42", token_ids=ids)
        rows = [Rollout(prompt, ids, c, 1.0, {"math": 1.0}, "g0", 0.5) for c in group.completions]
        plain = sample_items(rows, samples)
        items = sample_items(
            rows,
            samples,
            token_texts=token_texts(tokenizer),
            token_samples=token_samples,
            tokens_per_sample=per_sample,
        )
    event = {"run": "1", "seq": 123456, "type": "samples", "step": 1000}
    without = len(json.dumps({**event, "items": plain}).encode())
    with_tokens = len(json.dumps({**event, "items": items}).encode())
    carried = sum(len(i["extra"]["tokens"]["text"]) for i in items if "tokens" in i["extra"])
    print(f"samples per step {samples}, with tokens {token_samples} x up to {per_sample} tokens")
    print(
        f"completion tokens generated: {sum(len(r.completion.token_ids) for r in rows)}; tokens carried: {carried}"
    )
    print(f"samples event without tokens: {without:,} bytes")
    print(
        f"samples event with tokens:    {with_tokens:,} bytes ({with_tokens / 2**20:.3f} MiB of the 4 MiB limit)"
    )
    print(f"bytes per carried token:      {(with_tokens - without) / max(carried, 1):.1f}")


if __name__ == "__main__":
    main()
