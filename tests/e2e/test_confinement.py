"""A member cannot run code on a worker; an admin's own code, where the deployment allows it,
runs confined: through the real web app, worker and engine (embedded mode, its generated secret
key and SQLite file in the data directory, as ``make demo`` has them)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import confinement_spy
from tests.e2e.harness import Deployment
from tests.tiny_runs import tiny_config

pytestmark = pytest.mark.slow  # the kernel's Landlock is checked by tests/jobs/test_confine.py


def _post(d: Deployment, token: str, path: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"{d.url}/api{path}", method="POST", data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def test_user_code_is_refused_to_members_and_runs_confined_for_trusted_admins(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    d = Deployment(tmp_path)
    d.env.pop("SECRET_KEY")  # embedded mode: the web app generates <data dir>/secret_key
    d.env["PYTHONPATH"] = str(Path(confinement_spy.__file__).parent)
    d.env["E2E_FAKE_PASSWORD"] = "hunter2"  # a credential in the worker's environment
    try:
        ids = d.setup()
        member_token = json.loads(
            d.manage(
                "shell", "-c",
                "import json\n"
                "from django.contrib.auth import get_user_model\n"
                "from webapp.api.models import ApiToken\n"
                "from webapp.teams.models import Team\n"
                "from webapp.teams.services import set_role\n"
                "team = Team.objects.get(name='E2E')\n"
                "member = get_user_model().objects.create_user('member')\n"
                "set_role(team, member, 'member')\n"
                "print(json.dumps(ApiToken.issue(member, 'm')[1]))\n",
            ).strip().splitlines()[-1]
        )  # fmt: skip
        d.start_web()
        d.start_worker()
        other = d.api("POST", f"/projects/{ids['project']}/runs", {"config": tiny_config(tiny_model_dir, 2, name="other")})
        d.wait_status(other["id"], "succeeded", "failed")

        data = d.data
        paths = {
            "secret_key": str(data / "secret_key"),
            "database": str(data / "tributary.sqlite3"),
            "other_run": str(data / "runs" / str(other["id"]) / "events.jsonl"),
            "worker_environ": f"/proc/{d.workers[0].pid}/environ",
        }
        spy = tiny_config(tiny_model_dir, 2, name="spy")
        spy["reward"] = {"functions": [{"name": "confinement_spy:probe", "params": {"paths": paths}}]}
        timeit = tiny_config(tiny_model_dir, 2, name="timeit")
        timeit["reward"] = {"functions": [{"name": "timeit:timeit", "params": {"setup": "import os", "number": 1}}]}

        # Nobody may name arbitrary code until a site administrator trusts the team with it.
        for token in (d.api_token, member_token):
            for config in (spy, timeit):
                status, body = _post(d, token, f"/projects/{ids['project']}/runs", {"config": config})
                assert status == 422, body
                (problem,) = body["detail"]
                assert problem["loc"][-5:] == ["config", "reward", "functions", 0, "name"], body
                assert "not a registered reward function" in problem["msg"], body

        d.manage("shell", "-c", "from webapp.teams.models import Team; Team.objects.filter(name='E2E').update(allow_user_code=True)")
        status, body = _post(d, member_token, f"/projects/{ids['project']}/runs", {"config": spy})
        assert status == 422, body  # a member still cannot
        status, run = _post(d, d.api_token, f"/projects/{ids['project']}/runs", {"config": spy})
        assert status == 201, run
        done = d.wait_status(run["id"], "succeeded", "failed")
        assert done["status"] == "succeeded", d.logs()

        # The probe ran in the scoring processes and reached nothing: 1000 exactly, every step.
        log = d.engine_log(run["id"])
        rewards = [e["values"]["reward/mean"] for e in log if e["type"] == "metrics" and "reward/mean" in e["values"]]
        assert rewards and set(rewards) == {1000.0}, rewards
        assert d.run(run["id"])["summary"]["reward/mean"] == 1000.0  # and the web app stored it
        assert any(e["type"] == "log" and e["message"].startswith("confined:") for e in log)
        # At import, in the engine's own process, it reached nothing either.
        (found,) = [json.loads(p.read_text()) for p in (data / "runs" / str(run["id"])).glob("spy-*.json")]
        assert found == {"secret_key": False, "database": False, "other_run": False,
                         "worker_environ": False, "credentials_in_env": False}  # fmt: skip
        # Unconfined (this test, as the same user) the same probe reaches the files: the targets are real.
        unconfined = confinement_spy.reach(paths)
        assert unconfined["secret_key"] and unconfined["database"] and unconfined["other_run"]
        assert os.geteuid() != 0 or unconfined["worker_environ"]
    finally:
        d.stop_all()
        print(d.logs())
