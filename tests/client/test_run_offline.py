"""A client run with no server: the local log (``events.jsonl``), the checks on the caller's
thread, the bounded queue, the context manager, the interpreter's exit, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import tributary
from tests.conftest import REPO_ROOT
from tributary.run import MAX_METRICS_PER_CALL, MAX_NAME, MAX_TEXT, Run


def read_log(directory: Path) -> list[dict[str, Any]]:
    lines = (directory / "events.jsonl").read_text(encoding="utf-8").splitlines()
    events = [json.loads(line) for line in lines]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1)), (
        "seqs must be 1, 2, 3, ... with no gap"
    )
    return events


def offline(directory: Path, **options: Any) -> Run:
    return tributary.init(project="p", name="offline", dir=directory, url="", token="", **options)


class Scalar:
    """What a 0-d tensor or a numpy scalar offers: ``__float__``."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __float__(self) -> float:
        return self.value


def test_log_never_raises_on_garbage_and_counts_what_it_skips(tmp_path: Path) -> None:
    run = offline(tmp_path / "r")
    huge = {f"m{i}": float(i) for i in range(MAX_METRICS_PER_CALL + 7)}
    run.log({"ok": 1, "nan": float("nan"), "inf": float("-inf"), "tensor": Scalar(2.5), "flag": True}, step=3)
    run.log(
        {7: 1.0, None: 2.0, "": 3.0, "x" * (MAX_NAME + 1): 4.0, "text": "abc", "list": [1], "big": 10**400}
    )
    run.log(huge)
    run.log({"a": 1.0}, step=-1)  # a bad step: the whole call is skipped
    run.log({"a": 1.0}, step=2**31)
    run.log({"a": 1.0}, step=1.5)  # type: ignore[arg-type]
    run.log(None)  # type: ignore[arg-type]
    run.log_samples(
        [
            {
                "prompt": "q",
                "completion": "a",
                "reward": float("nan"),
                "advantage": "?",
                "length": -3,
                "group": 1,
            },
            "not a sample",
            {
                "prompt": b"bytes",
                "completion": "x" * (MAX_TEXT + 5),
                "components": {"acc": 1.0},
                "finish_reason": "s" * 99,
            },
        ]
    )
    run.log_samples(None)  # type: ignore[arg-type]
    run.log_text(object(), level="shout")  # type: ignore[arg-type]
    run.log_text("\x00nul and \ud800 surrogate")
    run.finish()

    events = read_log(tmp_path / "r")
    assert [e["type"] for e in events] == [
        "status",
        "metrics",
        "metrics",
        "metrics",
        "samples",
        "log",
        "log",
        "status",
    ]
    assert events[1]["step"] == 3
    assert events[1]["values"] == {"ok": 1.0, "nan": None, "inf": None, "tensor": 2.5, "flag": 1.0}
    assert events[2]["step"] == 4 and events[2]["values"] == {"big": None}  # beyond any float: inf
    assert events[3]["step"] == 5 and len(events[3]["values"]) == MAX_METRICS_PER_CALL
    first, bytes_sample = events[4]["items"]
    assert first["reward"] is None and first["advantage"] is None and first["length"] == 0
    assert first["extra"] == {"group": 1}
    assert bytes_sample["prompt"] == "b'bytes'" and len(bytes_sample["completion"]) == MAX_TEXT
    assert bytes_sample["extra"] == {"components": {"acc": 1.0}} and len(bytes_sample["finish_reason"]) == 32
    assert events[5]["level"] == "info" and events[6]["message"] == "\ufffdnul and \ufffd surrogate"
    # Skipped: 6 bad names or values; 7 metrics past the per-call limit; 3 bad steps; the
    # advantage "?" and the length -3; the sample that is not a dict.
    assert run.skipped_values == 6 + 7 + 3 + 2 + 1
    # log(None) and log_samples(None) are client errors: logged once, counted, never raised.
    assert run.errors == 2 and run.dropped_events == 0


def test_a_full_queue_drops_and_counts_without_blocking(tmp_path: Path) -> None:
    directory = tmp_path / "r"
    directory.mkdir()
    # The writer thread opens events.jsonl for writing; a FIFO with no reader yet holds that open
    # (the kernel blocks it), so the writer is stalled as by a hung disk until the test reads.
    os.mkfifo(directory / "events.jsonl")
    run = offline(directory, max_queue_events=8)
    calls = 1000
    for step in range(calls):
        run.log({"loss": float(step)}, step=step)  # returns although nothing can be written
    # Queued: at most 8 waiting, and the one batch the writer took before it blocked (<= 8 too).
    assert run.dropped_events >= calls - 2 * 8
    queued = calls - run.dropped_events

    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append((directory / "events.jsonl").read_bytes()))
    reader.start()
    run.finish()
    reader.join(60)
    events = [json.loads(line) for line in received[0].splitlines()]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    metrics = [e for e in events if e["type"] == "metrics"]
    assert len(metrics) == queued and [e["type"] for e in events].count("status") == 2
    # A full queue drops the newest: what is kept starts at the first call, in call order.
    steps = [e["step"] for e in metrics]
    assert steps[0] == 0 and steps == sorted(set(steps))


def test_the_context_manager_finishes_failed_on_an_exception(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="boom"), offline(tmp_path / "r") as run:
        run.log({"x": 1.0})
        raise ValueError("boom")
    assert read_log(tmp_path / "r")[-1] == {
        "run": run.client_id,
        "seq": 3,
        "type": "status",
        "state": "failed",
        "message": "ValueError: boom",
    }
    run.log({"late": 1.0})  # after finish: dropped and counted, not raised
    assert run.dropped_events == 1 and len(read_log(tmp_path / "r")) == 3


EXIT_SCRIPT = """
import os, sys, time
import tributary
run = tributary.init(project="p", dir=sys.argv[1], url="", token="")
run.log({"x": 1.0}, step=0)
if sys.argv[2] == "raise":
    raise RuntimeError("the loss exploded")
if sys.argv[2] == "crash":
    while run.written_seq < 2:  # on disk: what a crash loses is only what was still queued
        time.sleep(0.01)
    os._exit(9)  # killed: no exit hook runs
"""


@pytest.mark.parametrize(("how", "state", "message"), [
    ("return", "succeeded", "the script exited without finish()"),
    ("raise", "failed", "RuntimeError: the loss exploded"),
])  # fmt: skip
def test_the_interpreters_exit_finishes_an_unfinished_run(
    tmp_path: Path, how: str, state: str, message: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(tmp_path / "r"), how],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == (0 if how == "return" else 1), done.stderr[-2000:]
    last = read_log(tmp_path / "r")[-1]
    assert (last["type"], last["state"], last["message"]) == ("status", state, message)
    assert "python -m tributary sync" in done.stderr


def test_resume_continues_the_log_of_a_killed_script(tmp_path: Path) -> None:
    directory = tmp_path / "r"
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(directory), "crash"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 9
    before = read_log(directory)
    assert [e["type"] for e in before] == ["status", "metrics"]
    with pytest.raises(ValueError, match="already holds a run"):
        offline(directory)
    run = tributary.init(project="ignored", resume=directory, url="", token="")
    assert run.client_id == before[0]["run"]
    run.log({"x": 2.0})  # no step given: the one after the killed script's last
    run.finish()
    events = read_log(directory)
    assert [e["type"] for e in events] == ["status", "metrics", "status", "metrics", "status"]
    assert events[3]["step"] == before[1]["step"] + 1
    assert events[2]["message"].startswith("resumed")
    with pytest.raises(ValueError, match=r"already ended \(succeeded\)"):
        tributary.init(project="p", resume=directory, url="", token="")


def test_bad_arguments_at_init_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="TRIBUTARY_URL"):
        tributary.init(project="p", dir=tmp_path / "a", url="ftp://x", token="t")
    with pytest.raises(ValueError, match="TRIBUTARY_TOKEN"):
        tributary.init(project="p", dir=tmp_path / "b", url="http://localhost:1", token="")
    with pytest.raises(ValueError, match="tags"):
        offline(tmp_path / "c", tags=["x" * 51])
    with pytest.raises(ValueError, match=r"config is .* bytes"):
        offline(tmp_path / "d", config={"data": "x" * 300_000})
    with pytest.raises(ValueError, match="TRIBUTARY_DRAIN_S"):
        os.environ["TRIBUTARY_DRAIN_S"] = "soon"
        try:
            offline(tmp_path / "e")
        finally:
            del os.environ["TRIBUTARY_DRAIN_S"]


def test_one_writer_per_run_directory_and_close_leaves_the_run_resumable(tmp_path: Path) -> None:
    """Two processes appending to one log would take the same seqs and the web app would keep
    only the first event of each: a second writer is refused while the first holds the
    directory. ``close`` drains without a final status, so a resume goes on with the run."""
    directory = tmp_path / "r"
    first = offline(directory)
    first.log({"x": 1.0}, step=4)
    with pytest.raises(ValueError, match="being written by another process"):
        tributary.init(project="p", resume=directory, url="", token="")
    first.close()
    again = tributary.init(project="p", resume=directory, url="", token="")
    again.log({"x": 2.0})
    again.finish()
    events = read_log(directory)  # seqs 1, 2, ... with no gap or repeat
    assert [e["type"] for e in events] == ["status", "metrics", "status", "metrics", "status"]
    assert events[3]["step"] == 5 and events[-1]["state"] == "succeeded"


def test_a_metrics_root_verl_has_not_made_yet_is_taken_as_a_root(tmp_path: Path) -> None:
    from tributary.integrations.follow import verl_metrics_path

    root = tmp_path / "verl-logs"  # follow started before verl: nothing there yet
    assert verl_metrics_path(str(root), "proj", "exp") == root / "proj" / "exp.jsonl"
    assert verl_metrics_path(str(tmp_path / "m.jsonl"), "proj", "exp") == tmp_path / "m.jsonl"
