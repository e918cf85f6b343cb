"""The worker's reader of the engine's output (``tributary.shipper.OutputLog``): chunks of whole lines
at any byte offset of the file, a partial line only when it must go, and the file's name for the
web app's cursor."""

from __future__ import annotations

from pathlib import Path

from tributary.shipper import OutputLog


def test_chunks_end_after_a_newline(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    path.write_bytes(b"an earlier attempt's output\n")
    base = path.stat().st_size
    log = OutputLog(path, base, chunk_bytes=16)
    assert log.base == base and log.read(base) == b""
    with path.open("ab") as fh:
        fh.write(b"one\ntwo\nthr")
    assert log.read(base) == b"one\ntwo\n"
    assert log.read(base + 8) == b""  # "thr": not a whole line yet
    assert log.read(base + 8, final=True) == b"thr"  # the run is over: the tail goes as it is
    with path.open("ab") as fh:
        fh.write(b"ee\n")
    assert log.read(base + 8) == b"three\n"  # the file grew: read again
    assert log.read(0) == b"an earlier attem"  # any offset reads again (the first 16 bytes: no newline)


def test_a_line_longer_than_a_chunk_is_split(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    path.write_bytes(b"x" * 40 + b"\n")
    log = OutputLog(path, chunk_bytes=16)
    assert [log.read(0), log.read(16), log.read(32)] == [b"x" * 16, b"x" * 16, b"x" * 8 + b"\n"]


def test_the_stream_names_the_file_not_its_contents(tmp_path: Path) -> None:
    path, other = tmp_path / "engine.log", tmp_path / "other.log"
    assert OutputLog(path).stream == ""  # no file yet
    path.write_bytes(b"a\n")
    other.write_bytes(b"a\n")
    named = OutputLog(path).stream
    with path.open("ab") as fh:
        fh.write(b"more\n")
    assert OutputLog(path).stream == named != OutputLog(other).stream


def test_no_file_yet_is_nothing_to_send(tmp_path: Path) -> None:
    assert OutputLog(tmp_path / "missing.log").read(0, final=True) == b""
