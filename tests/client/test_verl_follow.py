"""``python -m tributary follow`` on files written by verl's own code (``fixtures/verl/``, made by
``fixtures/make_verl_fixtures.py``), into a real web app: what it stores equals the files, files
growing while followed arrive, and neither a killed ``follow`` nor a killed web app loses or
doubles anything."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.client.fixtures.server import (
    PROJECT,
    client_events,
    run_status,
    server,  # noqa: F401 - the fixture
    server_id,
    stored_metrics,
    stored_samples,
)
from tests.conftest import REPO_ROOT
from tests.e2e.harness import Deployment, assert_stored_matches, wait_until
from tributary.integrations.follow import CURSOR_FILE, Follower, FollowError, verl_metrics_path
from tributary.integrations.names import VERL_ALIASES
from tributary.run import Run

FIXTURES = Path(__file__).parent / "fixtures" / "verl"
METRICS = FIXTURES / "metrics" / "tributary" / "fixture.jsonl"
ROLLOUTS = FIXTURES / "rollouts"
WAIT = 120.0


# ---------------------------------------------------------------------- what the files say


def expected_metrics(lines: list[bytes]) -> dict[tuple[str, int], float]:
    """(name, step) -> value: every finite number of verl's lines, plus the engine's names of
    verl's reward statistics."""
    out: dict[tuple[str, int], float] = {}
    for raw in lines:
        record = json.loads(raw)
        data = {k: float(v) for k, v in record["data"].items() if _number(v)}
        for source, target in VERL_ALIASES.items():
            if source in data and target not in data:
                data[target] = data[source]
        out.update({(name, record["step"]): value for name, value in data.items()})
    return out


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def expected_samples(rollouts: Path) -> Counter:
    """The multiset of (step, prompt, completion, reward, components) of verl's rollout files."""
    out: Counter = Counter()
    for path in rollouts.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            components = tuple(sorted((k, float(v)) for k, v in row.items() if k in ("acc", "format")))
            out[(row["step"], row["input"], row["output"], row["score"], components)] += 1
    return out


def as_stored(samples: list[dict[str, Any]]) -> Counter:
    return Counter(
        (
            s["step"],
            s["prompt"],
            s["completion"],
            s["reward"],
            tuple(sorted(s["extra"]["components"].items())),
        )
        for s in samples
    )


def assert_grouped(samples: list[dict[str, Any]]) -> None:
    """Each group is one step's completions of one prompt, and each prompt of a step is one group."""
    by_group: dict[str, set] = {}
    by_prompt: dict[tuple[int, str], set] = {}
    for s in samples:
        by_group.setdefault(s["extra"]["group"], set()).add((s["step"], s["prompt"]))
        by_prompt.setdefault((s["step"], s["prompt"]), set()).add(s["extra"]["group"])
    assert all(len(v) == 1 for v in by_group.values()), by_group
    assert all(len(v) == 1 for v in by_prompt.values()), by_prompt


def assert_nothing_doubled(run_dir: Path) -> None:
    """In the client's log: each verl metrics line once, each rollout line once."""
    events = client_events(run_dir)
    steps = Counter(e["step"] for e in events if e["type"] == "metrics")
    assert all(n == 1 for n in steps.values()), steps
    items = Counter()
    for e in events:
        if e["type"] == "samples":
            items[e["step"]] += len(e["items"])
    want = {int(p.stem): len(p.read_text().splitlines()) for p in ROLLOUTS.glob("*.jsonl")}
    assert dict(items) == {s: n for s, n in want.items() if s in items}, (items, want)


# ---------------------------------------------------------------------- driving follow


class Verl:
    """verl's output directories, filled from the fixtures piece by piece as verl would."""

    def __init__(self, root: Path) -> None:
        self.metrics = root / "metrics.jsonl"
        self.rollouts = root / "rollouts"
        self.rollouts.mkdir(parents=True)
        self.metrics.touch()
        self.lines = METRICS.read_bytes().splitlines(keepends=True)

    def metrics_line(self, step: int, *, torn_at: int | None = None) -> None:
        data = self.lines[step - 1]
        with self.metrics.open("ab") as fh:
            fh.write(data if torn_at is None else data[:torn_at])

    def finish_line(self, step: int, torn_at: int) -> None:
        with self.metrics.open("ab") as fh:
            fh.write(self.lines[step - 1][torn_at:])

    def rollout_file(self, step: int) -> None:
        shutil.copyfile(ROLLOUTS / f"{step}.jsonl", self.rollouts / f"{step}.jsonl")

    def step(self, step: int) -> None:
        self.rollout_file(step)
        self.metrics_line(step)


@contextlib.contextmanager
def following(d: Deployment, verl: Verl, run_dir: Path, *extra: str) -> Iterator[subprocess.Popen[str]]:
    """``follow`` running; killed at the end if still running, its output printed (shown by
    pytest when the test failed)."""
    follow = start_follow(d, verl, run_dir, *extra)
    try:
        yield follow
    finally:
        if follow.poll() is None:
            follow.kill()
            print(follow.communicate(timeout=WAIT)[0])


def start_follow(d: Deployment, verl: Verl, run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIBUTARY_")}
    env["TRIBUTARY_DRAIN_S"] = "120"
    return subprocess.Popen(
        [sys.executable, "-m", "tributary", "follow", "--verl-metrics", str(verl.metrics),
         "--verl-rollouts", str(verl.rollouts), "--project", PROJECT, "--name", run_dir.name,
         "--dir", str(run_dir), "--url", d.url, "--token", d.api_token, "--poll", "0.05", "--settle", "1", *extra],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def wait_stored(d: Deployment, run_dir: Path, metrics_steps: int, samples: int) -> int:
    run_id = wait_until(lambda: server_id(run_dir), "the run to be created", WAIT)

    def there() -> bool:
        steps = {step for _, step in stored_metrics(d, run_id)}
        return len(steps) >= metrics_steps and len(stored_samples(d, run_id)) >= samples

    wait_until(there, f"{metrics_steps} steps and {samples} samples stored", WAIT)
    return run_id


def stop(follow: subprocess.Popen[str], sig: int = signal.SIGINT) -> str:
    follow.send_signal(sig)
    out, _ = follow.communicate(timeout=WAIT)
    return out


def assert_all_stored(d: Deployment, run_id: int, run_dir: Path) -> None:
    assert stored_metrics(d, run_id) == expected_metrics(METRICS.read_bytes().splitlines())
    samples = stored_samples(d, run_id)
    assert as_stored(samples) == expected_samples(ROLLOUTS)
    assert_grouped(samples)
    assert_nothing_doubled(run_dir)
    events = client_events(run_dir)
    assert_stored_matches(d.stored(run_id), events, events[-1]["seq"])


# ---------------------------------------------------------------------- the tests


def test_follow_ships_verl_files_live(server: Deployment, tmp_path: Path) -> None:  # noqa: F811
    verl = Verl(tmp_path / "verl")
    run_dir = tmp_path / "live"
    with following(server, verl, run_dir) as follow:
        verl.step(1)
        run_id = wait_stored(server, run_dir, 1, 0)
        # A torn metrics line waits for its newline; a rollout file waits until sealed.
        verl.metrics_line(2, torn_at=100)
        verl.rollout_file(2)  # seals step 1's file (if its settle time has not)
        wait_stored(server, run_dir, 1, 12)
        verl.finish_line(2, torn_at=100)
        verl.step(3)
        verl.step(4)
        # verl's lines that carry what the protocol cannot: counted, not shipped.
        with verl.metrics.open("ab") as fh:
            fh.write(b'{"step":5,"data":{"actor/entropy":null,"note":"text","actor/lr":[1,2]}}\nnot json\n')
        wait_stored(server, run_dir, 4, 48)  # step 4's file is sealed by its settle time
        out = stop(follow)
    assert follow.returncode == 0, out
    assert "skipped 1 unreadable lines, 2 non-numeric metric values, 1 non-finite" in out, out
    assert_all_stored(server, run_id, run_dir)
    wait_until(lambda: run_status(server, run_id) == "cancelled", "the run to end")


def test_follow_killed_and_restarted_loses_and_doubles_nothing(server: Deployment, tmp_path: Path) -> None:  # noqa: F811
    verl = Verl(tmp_path / "verl")
    run_dir = tmp_path / "killed"
    with following(server, verl, run_dir) as follow:
        verl.step(1)
        verl.step(2)
        wait_stored(server, run_dir, 2, 12)
        follow.kill()  # SIGKILL: no drain, no cursor written at the end
        follow.communicate(timeout=WAIT)
    verl.step(3)
    verl.metrics_line(4, torn_at=50)
    with following(server, verl, run_dir) as follow:
        run_id = wait_stored(server, run_dir, 3, 36)
        follow.kill()
        follow.communicate(timeout=WAIT)
    verl.finish_line(4, torn_at=50)
    verl.rollout_file(4)
    with following(server, verl, run_dir, "--until-idle", "2") as follow:
        out, _ = follow.communicate(timeout=WAIT)
    assert follow.returncode == 0, out
    assert_all_stored(server, run_id, run_dir)
    wait_until(lambda: run_status(server, run_id) == "succeeded", "the run to end")
    starts = [e for e in client_events(run_dir) if e["type"] == "status"]
    assert [e["message"].split(":")[0] for e in starts[:3]] == ["started", "resumed", "resumed"]


def test_web_app_killed_during_follow(server: Deployment, tmp_path: Path) -> None:  # noqa: F811
    verl = Verl(tmp_path / "verl")
    run_dir = tmp_path / "webdown"
    with following(server, verl, run_dir) as follow:
        verl.step(1)
        verl.step(2)
        run_id = wait_stored(server, run_dir, 2, 12)
        server.kill_web()
        verl.step(3)
        verl.step(4)
        wait_until(lambda: _items_logged(run_dir) == 48, "the client's log to have every sample")
        server.start_web()
        wait_stored(server, run_dir, 4, 48)
        out = stop(follow)
    assert follow.returncode == 0, out
    assert_all_stored(server, run_id, run_dir)


def _items_logged(run_dir: Path) -> int:
    return sum(len(e["items"]) for e in client_events(run_dir) if e["type"] == "samples")


# ---------------------------------------------------------------------- recovery, at the exact points


@pytest.mark.parametrize("reached_log", [True, False], ids=["after-logging", "before-logging"])
def test_a_batch_pending_at_a_kill_is_logged_once(tmp_path: Path, reached_log: bool) -> None:
    """follow killed between naming a batch in its cursor and committing it, once with the batch's
    events already in the client's log and once without: the restart logs each line once."""
    verl = Verl(tmp_path / "verl")
    run_dir = tmp_path / "run"
    cursor = run_dir / CURSOR_FILE
    run = Run(project=PROJECT, name="pending", dir=run_dir, url="", drain_s=10)
    follower = Follower(run, verl.metrics, verl.rollouts, cursor, settle_s=0)
    verl.step(1)
    verl.step(2)
    follower.poll()  # steps 1 and 2 (step 2's rollouts wait: not sealed)
    verl.step(3)
    verl.step(4)
    events = run.events_path
    before = events.read_bytes()
    at_kill: dict[str, bytes] = {}
    flush = run.flush

    def flush_then_remember(timeout: float = 30.0) -> bool:
        done = flush(timeout)
        at_kill.update(cursor=cursor.read_bytes(), log=events.read_bytes())  # the kill's moment
        return done

    run.flush = flush_then_remember  # type: ignore[method-assign]
    follower.poll(final=True)
    run.flush = flush  # type: ignore[method-assign]
    assert json.loads(at_kill["cursor"])["pending"], "the batch was named before it was logged"
    run.finish("succeeded")
    # The kill: the cursor as it was mid-batch; the client's log with or without the batch.
    cursor.write_bytes(at_kill["cursor"])
    events.write_bytes(at_kill["log"] if reached_log else before)

    resumed = Run(project=PROJECT, resume=run_dir, url="", drain_s=10)
    Follower(resumed, verl.metrics, verl.rollouts, cursor, settle_s=0).poll(final=True)
    resumed.finish("succeeded")
    assert_nothing_doubled(run_dir)
    logged = client_events(run_dir)
    assert {e["step"] for e in logged if e["type"] == "metrics"} == {1, 2, 3, 4}
    assert _items_logged(run_dir) == 48


def test_a_restarted_verl_rewrites_its_metrics_file(tmp_path: Path) -> None:
    """verl's FileLogger opens its file with "wb": a restarted verl run starts it again. Steps
    taken before are not taken again; later ones are, and the run's log says why."""
    verl = Verl(tmp_path / "verl")
    run_dir = tmp_path / "run"
    run = Run(project=PROJECT, name="rewrite", dir=run_dir, url="", drain_s=10)
    follower = Follower(run, verl.metrics, None, run_dir / CURSOR_FILE)
    for step in (1, 2, 3):
        verl.metrics_line(step)
    follower.poll()
    verl.metrics.write_bytes(b"")  # verl restarts from its step-2 checkpoint
    verl.metrics_line(3)
    verl.metrics_line(4)
    follower.poll()
    run.finish("succeeded")
    logged = client_events(run_dir)
    assert [e["step"] for e in logged if e["type"] == "metrics"] == [1, 2, 3, 4]
    assert any(e["type"] == "log" and "rewritten" in e["message"] for e in logged)


def test_a_cursor_is_for_the_files_it_followed(tmp_path: Path) -> None:
    """Offsets of one file mean nothing in another: the same --dir with other files is refused."""
    verl = Verl(tmp_path / "verl")
    run_dir = tmp_path / "run"
    run = Run(project=PROJECT, name="files", dir=run_dir, url="", drain_s=10)
    verl.step(1)
    Follower(run, verl.metrics, verl.rollouts, run_dir / CURSOR_FILE).poll()
    run.finish("succeeded")
    with pytest.raises(FollowError, match="another --dir for other files"):
        Follower(run, tmp_path / "other.jsonl", verl.rollouts, run_dir / CURSOR_FILE)


def test_the_metrics_file_is_where_verl_puts_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's FileLogger: $VERL_FILE_LOGGER_PATH, else <$VERL_FILE_LOGGER_ROOT>/<project>/<experiment>.jsonl."""
    root = FIXTURES / "metrics"
    assert verl_metrics_path(str(root), "tributary", "fixture") == METRICS
    assert verl_metrics_path(str(METRICS), "any", "any") == METRICS
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)
    monkeypatch.delenv("VERL_FILE_LOGGER_ROOT", raising=False)
    assert verl_metrics_path(None, "tributary", "fixture") is None
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(root))
    assert verl_metrics_path(None, "tributary", "fixture") == METRICS
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "m.jsonl"))
    assert verl_metrics_path(None, "tributary", "fixture") == tmp_path / "m.jsonl"
