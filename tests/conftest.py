"""Shared pytest fixtures.

- ``TRIBUTARY_DATA_DIR`` points at ``<repo>/.cache/test-data`` for the whole session (unless
  already set), so the starter policy is built once and reused by later test runs.
- ``tiny_model_dir``: a tiny Qwen2 model + tokenizer built locally by ``make_model``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Set at import time (before any test module is collected) so that everything, including
# subprocesses started by tests, sees the same data directory.
os.environ.setdefault("TRIBUTARY_DATA_DIR", str(REPO_ROOT / ".cache" / "test-data"))


@pytest.fixture(scope="session")
def tributary_data_dir() -> Path:
    """The engine data directory used by this test session (starter policies are cached here)."""
    path = Path(os.environ["TRIBUTARY_DATA_DIR"])
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny (~0.1M-parameter) Qwen2 causal LM + tokenizer directory, random weights (seed 0)."""
    from engine.models import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", arch="qwen2", size="tiny", seed=0)
