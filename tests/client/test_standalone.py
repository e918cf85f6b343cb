"""The client library alone: ``tributary`` and its shipper import, and a run works offline, with
only ``client/`` and site-packages (for ``websockets``) on the path: no Django, no torch, nothing
of the engine, the worker or the web app (issue 17: a script installs ``pip install ./client``)."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.conftest import REPO_ROOT

CLIENT = REPO_ROOT / "client"

# -I: no PYTHON* variables, no user site, no current directory; -S: no site-packages .pth files
# (the main project's editable install would put engine/ and webapp/ within reach).
SCRIPT = """
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import tributary, tributary.shipper, tributary.cli, tributary.sync
run = tributary.init(project="p", name="alone", config={"lr": 0.1}, dir=sys.argv[3], url="", token="")
run.log({"reward/mean": 0.5, "bad": float("nan")}, step=0)
run.log_samples([{"prompt": "1+1", "completion": "2", "reward": 1.0, "group": 0}])
run.finish()
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"django", "torch", "engine", "jobs", "webapp", "numpy"})
print(json.dumps({"heavy": heavy, "file": tributary.__file__}))
"""


def test_the_client_imports_and_runs_without_the_project(tmp_path: Path) -> None:
    site_packages = sysconfig.get_paths()["purelib"]
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", SCRIPT, str(CLIENT), site_packages, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["heavy"] == []
    assert Path(found["file"]).resolve() == (CLIENT / "tributary" / "__init__.py").resolve()
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [e["type"] for e in events] == ["status", "metrics", "samples", "status"]
    assert events[1]["values"] == {"reward/mean": 0.5, "bad": None}
    # The offline run says how to send it later.
    assert "python -m tributary sync" in done.stderr


def test_the_client_core_imports_only_the_standard_library_and_websockets() -> None:
    # Imports inside functions too (the AST walk), which the run above would not reach. The
    # integrations (tributary/integrations/) import their trainer's packages where they run.
    from tests.test_boundaries import imports

    allowed = set(sys.stdlib_module_names) | {"websockets", "tributary", "__future__"}
    core = [p for p in sorted((CLIENT / "tributary").rglob("*.py")) if "integrations" not in p.parts]
    assert len(core) >= 8
    found = [
        f"{path.relative_to(CLIENT)}:{line} imports {module}"
        for path in core
        for line, module, _ in imports(path)
        if module.split(".")[0] not in allowed
    ]
    assert found == []
