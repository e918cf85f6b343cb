"""The engine's own output reaches the run page (issue 15): Python log records and warnings become
``log`` events (rate-limited, what is held back counted), every record is mirrored into stderr for
the full log, and what never passes through Python logging (another rank's stderr, native prints)
becomes page lines from the output file, which leave the mirrored records out."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.log_bridge import LogBridge, TokenBucket, is_mirrored, mirror_lines
from engine.output_lines import MAX_LINE_CHARS, split_lines
from tributary.events import EventSink

REPO = Path(__file__).resolve().parents[2]


def events_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_warning_and_a_log_record_become_log_events_and_mirror_lines(tmp_path: Path) -> None:
    sink = EventSink("r1", tmp_path / "events.jsonl")
    mirror = io.StringIO()
    root_level = logging.getLogger().level
    with LogBridge(sink, mirror=mirror):
        logging.getLogger("transformers.modeling_utils").warning("weights %s not used", "lm_head")
        logging.getLogger("engine.data").info("loaded 12 prompts")
        logging.getLogger("noisy").debug("below the bridge's level: not sent")
        warnings.warn("this option is deprecated", FutureWarning, stacklevel=1)
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("engine.x").exception("it failed")
        sink.log("warning", "the engine's own words")
    sink.close()
    logs = [(e["level"], e["message"]) for e in events_of(tmp_path / "events.jsonl") if e["type"] == "log"]
    assert logs[0] == ("warning", "transformers.modeling_utils: weights lm_head not used")
    assert logs[1] == ("info", "engine.data: loaded 12 prompts")
    assert logs[2][0] == "warning" and logs[2][1].startswith("py.warnings: ")
    assert "FutureWarning: this option is deprecated" in logs[2][1]
    assert logs[3][0] == "error" and "it failed" in logs[3][1] and "RuntimeError: boom" in logs[3][1]
    assert logs[4] == ("warning", "the engine's own words")
    assert len(logs) == 5
    # Every record is in the mirror, each physical line with its header (the traceback's too).
    lines = mirror.getvalue().splitlines()
    assert lines and all(is_mirrored(line) for line in lines)
    assert any(" WARNING transformers.modeling_utils: weights lm_head not used" in line for line in lines)
    assert any(" ERROR engine.x: RuntimeError: boom" in line for line in lines)
    assert any(" WARNING engine: the engine's own words" in line for line in lines)
    # Uninstalled: the root logger and the sink are as they were.
    assert logging.getLogger().level == root_level and sink.on_log is None
    assert not any(isinstance(h, LogBridge) for h in logging.getLogger().handlers)


def test_a_library_that_prints_its_own_records_is_routed_through_the_bridge(tmp_path: Path) -> None:
    """A library that gives its logger a stderr handler and stops it propagating (transformers'
    ``_configure_library_root_logger`` does exactly this): while the bridge is installed its records
    become events (with their level) instead, and afterwards it prints again as before. The library
    is built here rather than taken from transformers, whose logger state is process-global and is
    changed by whatever else the process imported or configured first."""
    root = logging.getLogger("printing_library")
    printer = logging.StreamHandler(io.StringIO())
    root.addHandler(printer)
    root.propagate = False
    library = logging.getLogger("printing_library.modeling_utils")
    before = (root.propagate, list(root.handlers))
    sink = EventSink("r1", tmp_path / "events.jsonl")
    try:
        with LogBridge(sink, mirror=None):
            library.warning("Some weights of the model were not used")
        sink.close()
        assert (root.propagate, list(root.handlers)) == before
        logs = [(e["level"], e["message"]) for e in events_of(tmp_path / "events.jsonl")]
        assert logs == [
            ("warning", "printing_library.modeling_utils: Some weights of the model were not used")
        ]
        assert printer.stream.getvalue() == ""  # routed, not printed as well
        library.warning("printed again")
        assert printer.stream.getvalue() == "printed again\n"
    finally:
        root.removeHandler(printer)


def test_a_flood_is_held_back_counted_and_reported(tmp_path: Path) -> None:
    sink = EventSink("r1", tmp_path / "events.jsonl")
    mirror = io.StringIO()
    bridge = LogBridge(sink, mirror=mirror, burst=3, per_second=0.0)
    with bridge:
        for i in range(50):
            logging.getLogger("chatty").warning("line %d", i)
        logging.getLogger("other").warning("one more")
    sink.close()
    logs = [e["message"] for e in events_of(tmp_path / "events.jsonl") if e["type"] == "log"]
    assert logs[:3] == ["chatty: line 0", "chatty: line 1", "chatty: line 2"]
    assert len(logs) == 4  # the report, at the end
    assert logs[3].startswith("48 log records since ") and "chatty 47, other 1" in logs[3]
    assert "The full log (engine.log) has them" in logs[3]
    # The full log lost nothing.
    assert sum("chatty: line" in line for line in mirror.getvalue().splitlines()) == 50


def test_the_token_bucket_refills() -> None:
    now = [0.0]
    bucket = TokenBucket(2, 1.0, clock=lambda: now[0])
    assert [bucket.take() for _ in range(3)] == [True, True, False]
    now[0] = 1.5
    assert [bucket.take(), bucket.take()] == [True, False]


def test_a_record_logged_while_handling_one_does_not_loop(tmp_path: Path) -> None:
    class Loud:
        def __str__(self) -> str:
            logging.getLogger("inner").warning("logged from inside a record's formatting")
            return "loud"

    root = logging.getLogger()
    others = root.handlers[:]  # pytest's: they would format the record before the bridge does
    for handler in others:
        root.removeHandler(handler)
    sink = EventSink("r1", tmp_path / "events.jsonl")
    try:
        with LogBridge(sink, mirror=None):
            logging.getLogger("outer").warning("%s", Loud())
    finally:
        for handler in others:
            root.addHandler(handler)
    sink.close()
    assert [e["message"] for e in events_of(tmp_path / "events.jsonl")] == ["outer: loud"]


def test_output_lines_are_cleaned_and_leave_the_mirror_out() -> None:
    mirrored = mirror_lines(0.0, "warning", "x", "shown as an event").encode()
    huge = b"A" * (MAX_LINE_CHARS + 10)
    data = (
        b"plain line\n"
        + mirrored
        + b"\x1b[31mred\x1b[0m and \xff\xfe bad bytes\x00 and \x07bell\n"
        + b"progress 10%\rprogress 50%\rprogress 100%\n"
        + b"\n   \n"
        + b"Traceback (most recent call last):\n"
        + b"UserWarning: careful\n"
        + huge
        + b"\ntail without newline"
    )
    lines = split_lines(data, start=100)
    texts = [text for _, _, text in lines]
    assert texts[0] == "plain line" and lines[0][0] == 100
    assert "shown as an event" not in " ".join(texts)
    assert texts[1] == "red and \ufffd\ufffd bad bytes and bell"
    assert texts[2] == "progress 100%"
    assert [level for _, level, _ in lines[3:5]] == ["error", "warning"]
    assert texts[5].startswith("A" * MAX_LINE_CHARS) and texts[5].endswith(
        "[10 more characters in the full log]"
    )
    assert texts[6] == "tail without newline"
    # Offsets are where each line starts in the file.
    for offset, _, text in lines[:1] + lines[6:]:
        assert data[offset - 100 :].startswith(text.encode())


RANKS_SCRIPT = textwrap.dedent(
    """
    import logging, os, sys, warnings
    from tributary.events import EventSink
    from engine.log_bridge import LogBridge

    if os.environ["RANK"] == "0":
        sink = EventSink("r1", sys.argv[1])
        with LogBridge(sink):
            warnings.warn("rank 0 warns through Python", UserWarning, stacklevel=1)
            logging.getLogger("deepspeed.runtime").info("rank 0 logs a record")
        sink.close()
    else:
        print("rank 1 says this on stderr", file=sys.stderr, flush=True)
        os.write(2, b"rank 1 native write\\n")
    """
)


def test_a_second_ranks_stderr_and_rank_0s_records_become_log_lines(tmp_path: Path) -> None:
    """Two real rank processes started by the engine's own launcher (``engine.ranks``), their
    output captured as the worker's supervisor does (stdout and stderr into one file)."""
    events = tmp_path / "events.jsonl"
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    launcher = (
        "import sys\nfrom engine.ranks import launch_ranks\n"
        f"sys.exit(launch_ranks([sys.executable, {str(script)!r}, {str(events)!r}], 2))"
    )
    output = tmp_path / "engine.log"
    with output.open("wb") as out:
        done = subprocess.run(
            [sys.executable, "-c", launcher], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=120
        )
    assert done.returncode == 0, output.read_text()
    logs = [(e["level"], e["message"]) for e in events_of(events) if e["type"] == "log"]
    assert ("info", "deepspeed.runtime: rank 0 logs a record") in logs
    assert any(level == "warning" and "UserWarning: rank 0 warns through Python" in m for level, m in logs)
    raw = output.read_bytes()
    shown = [text for _, _, text in split_lines(raw)]
    assert "rank 1 says this on stderr" in shown and "rank 1 native write" in shown
    assert not any("rank 0" in text for text in shown), shown  # events already: not twice
    assert raw.count(b"rank 0 logs a record") == 1  # but the full log has them


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=6000), st.integers(min_value=0, max_value=2**40))
def test_any_bytes_split_into_storable_lines(data: bytes, start: int) -> None:
    """Whatever a process prints, its lines are text a database and a page take, each where the
    file says, never longer than the cut."""
    lines = split_lines(data, start)
    for offset, level, text in lines:
        assert start <= offset < start + len(data) + 1 and level in ("debug", "info", "warning", "error")
        assert text.strip() and "\x00" not in text and "\n" not in text and "\x1b" not in text
        assert not any(0xD800 <= ord(c) <= 0xDFFF for c in text)
        assert len(text) <= MAX_LINE_CHARS + 60
        text.encode("utf-8")  # a lone surrogate would raise here
    assert [o for o, _, _ in lines] == sorted({o for o, _, _ in lines})
