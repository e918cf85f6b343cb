"""The boundaries between the parts (ARCHITECTURE.md), checked on the source and in a web process.

- ``engine/`` and ``kernels/`` are libraries: no Django, Celery or Channels, nothing of ``webapp``
  or ``jobs`` (the engine runs alone: ``python -m engine run config.yaml``);
- ``jobs/`` (the worker) imports nothing of ``webapp``: a worker machine has no database;
- the web process validates a config without loading torch (the names come from
  ``engine.contracts``), so a launch does not pay torch's import and the web image needs no torch;
- no module imports another module's private (``_name``) names: what two modules share is public.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT_PACKAGES = ("engine", "kernels", "jobs", "webapp", "bench", "tests")


def python_files(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py") if "migrations" not in p.parts)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """``(line, imported module, names)`` for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            yield node.lineno, base, [alias.name for alias in node.names]


def offenders(packages: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in python_files(*packages):
        for line, module, _ in imports(path):
            if module.split(".")[0] in forbidden:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return found


def test_engine_and_kernels_import_no_web_or_worker_code() -> None:
    assert offenders(("engine", "kernels"), ("django", "celery", "channels", "webapp", "jobs")) == []


def test_jobs_imports_nothing_of_the_web_app() -> None:
    assert offenders(("jobs",), ("webapp",)) == []


def test_no_module_imports_private_names_of_another() -> None:
    found = []
    for path in python_files(*PROJECT_PACKAGES):
        for line, module, names in imports(path):
            if module.split(".")[0] not in PROJECT_PACKAGES or module == module_name(path):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {', '.join(private)} from {module}")
    assert found == []


def test_the_checks_see_what_they_look_for() -> None:
    # The AST walk must find imports inside functions too, or the tests above would pass vacuously.
    found = {module for _, module, _ in imports(ROOT / "engine" / "config" / "reward.py")}
    assert {"engine.rewards", "engine.config.section"} <= found  # the first is imported inside a validator
    assert offenders(("jobs",), ("engine",))  # the worker does import the engine's event sink


VALIDATE_IN_WEB_PROCESS = """
import importlib, json, pkgutil, sys
import django
django.setup()
import webapp
import webapp.asgi  # everything the web process loads: URLs, views, the API, the sockets
# ... and every other module of the web app (commands, the embedded supervisor): the web image
# installs no torch (docker/Dockerfile.web).
for module in pkgutil.walk_packages(webapp.__path__, "webapp."):
    if ".migrations" not in module.name:
        importlib.import_module(module.name)
from webapp.runs.services import validate_run_config
config = json.loads(sys.argv[1])
validated = validate_run_config(config)
assert validated["algorithm"]["adv_estimator"] == config["algorithm"]["adv_estimator"], validated
heavy = sorted(m for m in ("torch", "engine.algorithms", "transformers") if m in sys.modules)
print(json.dumps(heavy))
"""

FULL_CONFIG = {
    "name": "boundary",
    "preset": "dapo",
    "model": {"path": "starter"},
    "data": {"source": "builtin", "task": "countdown", "difficulty": 2},
    "rollout": {"n": 4, "max_new_tokens": 16},
    "reward": {"functions": [{"name": "task"}, {"name": "format", "weight": 0.5, "params": {"regex": r"\d+"}}]},
    "algorithm": {
        "adv_estimator": "rloo",
        "policy_loss": "gspo",
        "loss_agg_mode": "seq-mean-token-mean",
        "use_kl_loss": True,
        "kl_loss_type": "k3+",
        "use_kl_in_reward": True,
        "kl_penalty": "k2",
        "kl_ctrl": {"type": "adaptive"},
    },
    "trainer": {"total_steps": 2, "prompts_per_step": 4},
    "async": {"max_staleness": 1, "importance_cap": 2.0},
}


def test_the_web_process_validates_a_config_without_torch(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "webapp.settings",
        "TRIBUTARY_DATA_DIR": os.environ.get("TRIBUTARY_DATA_DIR", str(tmp_path)),
    }
    out = subprocess.run(
        [sys.executable, "-c", VALIDATE_IN_WEB_PROCESS, json.dumps(FULL_CONFIG)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
