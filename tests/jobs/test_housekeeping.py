"""The worker's side of deleting a run: only ``runs_dir()/<run id>`` is ever removed, whatever the
message says, and a link in its place is removed without following it."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.housekeeping import remove_run_directory, run_directory


@pytest.mark.parametrize("bad", [0, -3, True, "7", "../7", 7.0, None])
def test_only_a_positive_integer_id_names_a_directory(tmp_path: Path, bad: object) -> None:
    (tmp_path / "7").mkdir()
    assert run_directory(bad, tmp_path) is None
    with pytest.raises(ValueError, match="not a positive integer"):
        remove_run_directory(bad, tmp_path)
    assert (tmp_path / "7").is_dir()


def test_the_run_directory_goes_and_nothing_else(tmp_path: Path) -> None:
    for run_id in (7, 70):
        (tmp_path / str(run_id) / "checkpoints").mkdir(parents=True)
        (tmp_path / str(run_id) / "events.jsonl").write_text("{}\n")
    assert remove_run_directory(7, tmp_path) is True
    assert not (tmp_path / "7").exists() and (tmp_path / "70" / "events.jsonl").exists()
    assert remove_run_directory(7, tmp_path) is False  # already gone: nothing to do


def test_a_link_is_unlinked_not_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "runs", tmp_path / "home"
    root.mkdir()
    outside.mkdir()
    (outside / "notes.txt").write_text("mine")
    (root / "5").symlink_to(outside, target_is_directory=True)
    assert remove_run_directory(5, root) is True
    assert not (root / "5").exists() and (outside / "notes.txt").read_text() == "mine"


def test_a_runs_directory_reached_through_a_link_works(tmp_path: Path) -> None:
    real = tmp_path / "disk" / "runs"
    (real / "9").mkdir(parents=True)
    (tmp_path / "runs").symlink_to(real, target_is_directory=True)
    assert remove_run_directory(9, tmp_path / "runs") is True and not (real / "9").exists()
