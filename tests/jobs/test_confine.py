"""What an engine run may see on a worker (jobs/confine.py, jobs/launcher.py), with real processes:
the launcher confines itself, then starts a probe that tries what a malicious reward could."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jobs.confine import ConfinementPlan, engine_environment, landlock_abi, readable_roots


def test_the_kernel_has_landlock() -> None:
    """Not a skip: the product runs unconfined (with a warning) where the kernel lacks Landlock,
    but the machine these tests run on has it, and these tests are what shows confinement works."""
    assert landlock_abi() >= 1, "this kernel has no Landlock (Linux >= 5.13 with landlock among its LSMs)"

PROBE = textwrap.dedent(
    """
    import json, os, sys
    def can(action):
        try:
            action()
            return True
        except OSError:
            return False
    paths = json.loads(sys.argv[1])
    out = {
        "read " + name: can(lambda p=path: open(p, "rb").read(1)) for name, path in paths["read"].items()
    }
    out.update({
        "write " + name: can(lambda p=path: open(p, "w").write("x")) for name, path in paths["write"].items()
    })
    out["list data dir"] = can(lambda: os.listdir(paths["list"]))
    with open("/proc/self/status") as fh:
        out["capabilities"] = [l.split()[1] for l in fh if l.startswith("CapEff")][0]
    print(json.dumps(out))
    """
)


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """A worker's files: the web app's data directory (secret key, database), the runs
    directory with this run and another team's run, a model directory elsewhere."""
    data = tmp_path / "data"
    runs = data / "runs"
    (runs / "7").mkdir(parents=True)
    (runs / "8" / "checkpoints" / "step_000004").mkdir(parents=True)
    (data / "secret_key").write_text("s3cret")
    (data / "tributary.sqlite3").write_text("db")
    (runs / "8" / "events.jsonl").write_text("{}")
    (runs / "8" / "checkpoints" / "step_000004" / "state.pt").write_text("ckpt")
    (runs / "9").mkdir()
    (runs / "9" / "events.jsonl").write_text("{}")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".netrc").write_text("machine x password y")
    os.symlink(data / "secret_key", tmp_path / "model" / "link-to-secret")
    return {"root": tmp_path, "data": data, "runs": runs, "workdir": runs / "7", "home": tmp_path / "home"}


def _launch(plan: ConfinementPlan, paths: dict, env: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "jobs.launcher", str(os.getpid()), "5", plan.to_json(), "--",
         sys.executable, "-c", PROBE, json.dumps(paths)],
        cwd=plan.workdir, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "launcher: confined" in done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_confined_run_reads_only_what_is_not_hidden_and_writes_only_its_own_directory(layout) -> None:
    data, runs, workdir, root = layout["data"], layout["runs"], layout["workdir"], layout["root"]
    environ = {"HOME": str(layout["home"]), "PATH": os.environ["PATH"]}
    plan = ConfinementPlan.for_run(
        workdir, data_dir=data, runs_dir=runs, readable=[runs / "8" / "checkpoints" / "step_000004"], environ=environ
    )
    paths = {
        "read": {
            "secret key": str(data / "secret_key"),
            "database": str(data / "tributary.sqlite3"),
            "another run": str(runs / "9" / "events.jsonl"),
            "parent's log": str(runs / "8" / "events.jsonl"),
            "resumed checkpoint": str(runs / "8" / "checkpoints" / "step_000004" / "state.pt"),
            "model": str(root / "model" / "config.json"),
            "link to the secret": str(root / "model" / "link-to-secret"),
            "credentials": str(layout["home"] / ".netrc"),
            "python": sys.executable,
        },
        "write": {
            "own directory": str(workdir / "out.txt"),
            "starter cache": str(data / "starter" / "x"),
            "beside the model": str(root / "model" / "planted.py"),
            "another run": str(runs / "9" / "planted"),
        },
        "list": str(data),
    }
    env = engine_environment(environ, workdir)
    got = _launch(plan, paths, env)
    assert got == {
        "read secret key": False,
        "read database": False,
        "read another run": False,
        "read parent's log": False,
        "read resumed checkpoint": True,
        "read model": True,
        "read link to the secret": False,
        "read credentials": False,
        "read python": True,
        "write own directory": True,
        "write starter cache": True,
        "write beside the model": False,
        "write another run": False,
        "list data dir": True,  # names only: the tree stays listable
        "capabilities": "0000000000000000" if os.geteuid() == 0 else got["capabilities"],
    }
    # The same probe unconfined reads and writes everything: the refusals above are the confinement's.
    free = subprocess.run([sys.executable, "-c", PROBE, json.dumps(paths)], capture_output=True, text=True, check=True)
    assert all(v for k, v in json.loads(free.stdout).items() if k != "capabilities")


def test_readable_roots_cover_everything_but_the_hidden_paths(layout) -> None:
    data, root = layout["data"], layout["root"]
    roots = set(readable_roots([data / "runs", data / "secret_key"]))
    assert data / "tributary.sqlite3" in roots and root / "model" in roots
    assert not {data, data / "runs", data / "secret_key", root, Path("/")} & roots
    assert Path("/usr") in roots or Path("/usr").is_symlink()


def test_a_secret_holding_process_is_out_of_reach_of_a_confined_run(layout) -> None:
    """The worker and the web app make themselves non-dumpable; a run (even as root, with its
    capabilities dropped by the launcher) then cannot read their environment or memory."""
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from jobs.confine import make_undumpable; make_undumpable(); print('up', flush=True); time.sleep(120)"],
        env={**os.environ, "DATABASE_URL": "postgres://u:hunter2@db/x"}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "up"
        plan = ConfinementPlan.for_run(layout["workdir"], data_dir=layout["data"], runs_dir=layout["runs"])
        paths = {
            "read": {"environ": f"/proc/{holder.pid}/environ", "memory": f"/proc/{holder.pid}/mem"},
            "write": {},
            "list": "/proc",
        }
        got = _launch(plan, paths, engine_environment(os.environ, layout["workdir"]))
        assert (got["read environ"], got["read memory"]) == (False, False)
        with open(f"/proc/{holder.pid}/environ", "rb") as fh:  # the test itself, unconfined, can
            assert b"hunter2" in fh.read() or os.geteuid() != 0
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_the_engine_environment_carries_no_credentials(tmp_path: Path) -> None:
    environ = {
        "PATH": "/usr/bin", "HOME": "/home/w", "PYTHONPATH": "/opt/rewards", "LC_ALL": "C.UTF-8",
        "CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1",
        "DATABASE_URL": "postgres://u:p@h/d", "REDIS_URL": "redis://:p@h:6379/0", "SECRET_KEY": "k",
        "HF_TOKEN": "hf_x", "AWS_SECRET_ACCESS_KEY": "a", "NCCL_IB_AUTH_KEY": "n", "TRIBUTARY_WEB_URL": "http://w",
        "MY_SETTING": "1", "TRIBUTARY_ENGINE_ENV": "MY_SETTING",
    }  # fmt: skip
    env = engine_environment(environ, tmp_path / "run", TRIBUTARY_DATA_DIR="/d")
    assert env == {
        "PATH": "/usr/bin", "HOME": "/home/w", "PYTHONPATH": "/opt/rewards", "LC_ALL": "C.UTF-8",
        "CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1", "MY_SETTING": "1",
        "TMPDIR": str(tmp_path / "run" / "tmp"), "TRIBUTARY_DATA_DIR": "/d",
    }  # fmt: skip
    assert (tmp_path / "run" / "tmp").is_dir()


def test_a_required_plan_without_landlock_does_not_start_the_run(layout) -> None:
    """The launcher's refusal path, with Landlock made unavailable to it."""
    plan = ConfinementPlan.for_run(layout["workdir"], data_dir=layout["data"], runs_dir=layout["runs"], required=True)
    shim = layout["root"] / "shim"
    shim.mkdir()
    (shim / "landlockpy.py").write_text("def supported():\n    return False\n")
    marker = layout["workdir"] / "started"
    done = subprocess.run(
        [sys.executable, "-m", "jobs.launcher", str(os.getpid()), "5", plan.to_json(), "--",
         sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        cwd=plan.workdir, env={**os.environ, "PYTHONPATH": f"{shim}:{os.getcwd()}"}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and not marker.exists(), done.stderr
    assert "the run was not started: this run must be confined" in done.stderr


def test_a_resume_reads_only_another_runs_checkpoints(tmp_path: Path) -> None:
    from jobs.supervisor import resume_grant

    runs = tmp_path / "runs"
    (runs / "8" / "checkpoints" / "step_000004").mkdir(parents=True)
    assert resume_grant(runs / "8" / "checkpoints" / "step_000004", runs) == runs / "8" / "checkpoints"
    assert resume_grant(runs / "8" / "checkpoints", runs) == runs / "8" / "checkpoints"
    assert resume_grant(runs / "8", runs) is None  # a forged checkpoint path: the whole run directory
    assert resume_grant(runs / "8" / "events.jsonl", runs) is None
    assert resume_grant(tmp_path / "elsewhere", runs) == tmp_path / "elsewhere"  # not hidden anyway
