"""Checkpoints of a run resumed from an earlier step (a rewind, issue 15): the later checkpoints in
its directory belong to the branch it left, so saving the new branch's first checkpoint removes
them; otherwise "the latest checkpoint" (``--resume <run dir>``) would take the left branch's, and
``keep_last`` would prune the new branch's own instead."""

from __future__ import annotations

from pathlib import Path

from engine.checkpoint import CheckpointState, list_checkpoints, resolve_checkpoint, save_checkpoint


def save(run_dir: Path, step: int, keep_last: int) -> Path:
    state = CheckpointState(
        step=step, last_seq=step * 10, sampler={}, trainer={}, rng={}, extra={}, config={}
    )
    path, nbytes, _ = save_checkpoint(
        run_dir, state, lambda d: (d / "weights.bin").write_bytes(b"w" * step), keep_last=keep_last
    )
    assert nbytes > 0
    return path


def steps(run_dir: Path) -> list[str]:
    return [p.name for p in list_checkpoints(run_dir)]


def test_a_rewound_branch_replaces_the_checkpoints_it_left(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        save(tmp_path, step, keep_last=3)
    assert steps(tmp_path) == ["step_000004", "step_000006", "step_000008"]
    # Resumed from step 4: its next checkpoint, at 5, is the newest; 6 and 8 are the left branch's.
    save(tmp_path, 5, keep_last=3)
    assert steps(tmp_path) == ["step_000004", "step_000005"]
    assert resolve_checkpoint(tmp_path).name == "step_000005"
    # keep_last=1 keeps the new branch's own checkpoint, not an older step of the left one.
    save(tmp_path, 6, keep_last=1)
    assert steps(tmp_path) == ["step_000006"]
    assert (tmp_path / "checkpoints" / "step_000006" / "weights.bin").read_bytes() == b"w" * 6


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    save(tmp_path, 3, keep_last=2)
    save(tmp_path, 3, keep_last=2)
    assert steps(tmp_path) == ["step_000003"]


def test_a_save_announces_what_it_deletes_before_deleting_it(tmp_path: Path) -> None:
    """The web app stops offering a checkpoint when it hears of its deletion, so it must hear of it
    no later than it happens: ``announce`` runs with the new checkpoint in place and the old ones
    still on disk."""
    heard: list[tuple[str, list[str], list[bool]]] = []

    def announce(saved: Path, nbytes: int, doomed: list[Path]) -> None:
        assert (saved / "weights.bin").is_file() and nbytes > 0
        heard.append((saved.name, [p.name for p in doomed], [p.is_dir() for p in doomed]))

    state = CheckpointState(step=0, last_seq=0, sampler={}, trainer={}, rng={}, extra={}, config={})
    for step in (2, 4, 6, 3):  # 3: a rewound branch, which also removes 4 and 6
        state.step = step
        _, _, deleted = save_checkpoint(
            tmp_path, state, lambda d: (d / "weights.bin").write_bytes(b"w"), keep_last=2, announce=announce
        )
        assert [p.name for p in deleted] == heard[-1][1] and not any(p.exists() for p in deleted)
    assert heard == [
        ("step_000002", [], []),
        ("step_000004", [], []),
        ("step_000006", ["step_000002"], [True]),
        ("step_000003", ["step_000004", "step_000006"], [True, True]),
    ]
    assert steps(tmp_path) == ["step_000003"]
