"""``python -m tributary follow``: a live verl run in Tributary, with no change to verl.

    python -m tributary follow --verl-metrics $VERL_FILE_LOGGER_ROOT --verl-rollouts ROLLOUT_DIR \\
        --project my-project --name my-experiment [--until-idle 600]

Tails what verl writes (``tributary.integrations.verl``: its ``file`` logger's JSONL and its
``trainer.rollout_data_dir`` dumps) into a client ``Run`` (``tributary.init``), which writes the
event log and ships it at least once. It ends on Ctrl-C (or SIGTERM), after ``--until-idle``
seconds with nothing new, or on Cancel from the run's page; it then ships what is complete and
finishes the run.

Nothing lost, nothing doubled across a restart of ``follow`` (killed at any point, even with
SIGKILL): the run directory (``--dir``) holds the client's log and ``follow.json``, the cursor
of what was taken from verl's files (byte offsets, the last step, each rollout file's items).
The cursor is a write-ahead record: before logging a batch it names the byte ranges the batch
comes from (``pending``); after ``Run.flush`` has put the batch's events in the client's log it
commits the new offsets. A restart that finds a batch pending counts what of it reached the
client's log (the log is the source of truth: metrics by step, samples by count per step) and
logs only the rest. The client then continues the same run (``resume``), its seqs after the
log's, and the web app's acknowledgement makes the shipping itself idempotent.

Files that are still being written wait: a torn last line until its newline, a rollout file
until it is *sealed*, i.e. a later step's file exists (verl writes them one at a time, in
order), it has not changed for ``--settle`` seconds, or ``follow`` is ending. A restarted verl
run rewrites its metrics file from the start (``FileLogger`` opens it with ``"wb"``): steps
already taken are not taken again, and the run's Logs tab says so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tributary.cli import Command, add_server_arguments
from tributary.events import scan_log
from tributary.integrations.verl import (
    Skipped,
    complete_lines,
    group_count,
    metrics_line,
    rollout_file_step,
    rollout_samples,
)

CURSOR_FILE = "follow.json"
CURSOR_VERSION = 1
BATCH_BYTES = 8 * 1024 * 1024  # what one batch reads from a file (whole lines; at least one)
MAX_BATCHES_PER_POLL = 16
FLUSH_WAIT_S = 60.0  # per wait for the client's writer; a stalled disk is waited for, never skipped
MAX_LINE_BYTES = 256 * 1024 * 1024  # one rollout line (a completion) at most
MAX_LINES = 2000  # metrics lines per batch: the client's queue holds 10,000 events
HEAD_BYTES = 4096  # the metrics file's first bytes identify it: a rewrite (verl restarted) changes them


class FollowError(Exception):
    """A problem ``follow`` cannot go on with (the message says what to do)."""


class Follower:
    """Takes what is new in verl's files and logs it to ``run``; see the module docstring.

    ``run`` is a ``tributary.Run`` (anything with ``log``, ``log_samples``, ``log_text``,
    ``flush`` and ``events_path``). ``clock`` is injectable for the settle time only."""

    def __init__(
        self,
        run: Any,
        metrics: Path | None,
        rollouts: Path | None,
        cursor_path: Path,
        *,
        settle_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run = run
        self.metrics = metrics
        self.rollouts = rollouts
        self.cursor_path = cursor_path
        self.settle_s = settle_s
        self.clock = clock
        self.cursor = self._load_cursor()
        self.skipped = Skipped(**self.cursor.get("skipped", {}))
        self.shipped_metrics = 0
        self.shipped_samples = 0
        self._seen: dict[str, tuple[int, int, float]] = {}  # file -> (size, mtime_ns, since)
        self._changed = False
        self._recover()

    # ------------------------------------------------------------------ the cursor

    def _load_cursor(self) -> dict[str, Any]:
        fresh = {
            "version": CURSOR_VERSION,
            "metrics": {"offset": 0, "head": "", "head_len": 0, "last_step": -1, "skip_through": -1},
            "rollouts": {},
            "pending": None,
            "skipped": {},
            "files": self._files(),
        }
        if not self.cursor_path.exists():
            return fresh
        try:
            cursor = json.loads(self.cursor_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise FollowError(
                f"{self.cursor_path} cannot be read ({exc}); it records what was already taken from verl's "
                "files, so follow will not guess: restore it, or follow into a new --dir"
            ) from None
        if not isinstance(cursor, dict) or cursor.get("version") != CURSOR_VERSION:
            raise FollowError(f"{self.cursor_path} is not a follow cursor of version {CURSOR_VERSION}")
        if cursor.get("files") != self._files():
            raise FollowError(
                f"{self.cursor_path.parent} follows {cursor.get('files')}, not {self._files()}: give the same "
                "--verl-metrics/--verl-rollouts to go on, or another --dir for other files"
            )
        return cursor

    def _files(self) -> dict[str, str | None]:
        """The files followed, as the cursor records them (its offsets are theirs)."""
        return {
            "metrics": str(self.metrics.resolve()) if self.metrics else None,
            "rollouts": str(self.rollouts.resolve()) if self.rollouts else None,
        }

    def _save_cursor(self) -> None:
        self.cursor["skipped"] = {k: v for k, v in asdict(self.skipped).items()}
        temporary = self.cursor_path.with_suffix(".json.tmp")
        with temporary.open("w", encoding="utf-8") as fh:
            json.dump(self.cursor, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(temporary, self.cursor_path)

    def _recover(self) -> None:
        """Finish a batch a killed ``follow`` left pending: what of it is in the client's log
        was logged; the rest will be (the next ``poll`` reads the same ranges again)."""
        pending = self.cursor.get("pending")
        if not pending:
            return
        held = self.run.resumed_from or scan_log(Path(self.run.events_path))
        logged_step, logged_items = held.metrics_step, held.samples_per_step
        if pending.get("metrics"):
            state = self.cursor["metrics"]
            state["skip_through"] = max(state["skip_through"], logged_step)
            state["last_step"] = max(state["last_step"], logged_step)
        for key, part in pending.get("rollouts", {}).items():
            state = self.cursor["rollouts"].setdefault(key, {"offset": 0, "items": 0, "groups": 0})
            state["redo"] = {
                "to": part["to"],
                "skip": max(0, logged_items.get(int(key), 0) - state["items"]),
            }
        self.cursor["pending"] = None
        self._save_cursor()

    # ------------------------------------------------------------------ one poll

    def poll(self, *, final: bool = False) -> tuple[bool, int]:
        """Log what is new (``final``: also rollout files not sealed yet): whether any of verl's
        files changed, and how many batches were logged."""
        self._changed = False
        batches = 0
        for _ in range(MAX_BATCHES_PER_POLL):
            metrics = self._metrics_batch()
            rollouts = self._rollout_batches(final)
            if metrics is None and not rollouts:
                break
            self._ship(metrics, rollouts)
            batches += 1
        return self._changed or batches > 0, batches

    def _metrics_batch(self) -> tuple[int, bytes] | None:
        """(offset, whole lines) new in the metrics file, after a rewrite check."""
        if self.metrics is None:
            return None
        state = self.cursor["metrics"]
        try:
            with self.metrics.open("rb") as fh:
                self._notice(str(self.metrics), os.fstat(fh.fileno()))
                size = os.fstat(fh.fileno()).st_size
                head = hashlib.sha256(fh.read(state["head_len"])).hexdigest() if state["head_len"] else ""
                if state["offset"] and (size < state["offset"] or head != state["head"]):
                    self._rewritten(state)
                if size <= state["offset"]:
                    return None
                fh.seek(state["offset"])
                buffer = fh.read(BATCH_BYTES)
        except FileNotFoundError:
            return None
        _, used = complete_lines(buffer)
        if used == 0:
            if len(buffer) < BATCH_BYTES:
                return None  # a torn line: verl is writing it
            used = len(buffer)  # one line longer than a batch: not verl's; counted as unreadable
        cut = -1
        for _ in range(MAX_LINES):
            cut = buffer.find(b"\n", cut + 1, used)
            if cut < 0:
                break
        else:
            used = cut + 1
        return state["offset"], buffer[:used]

    def _rewritten(self, state: dict[str, Any]) -> None:
        said = (
            f"verl's metrics file {self.metrics} was rewritten (verl restarted); its steps up to "
            f"{state['last_step']} were taken before and are not taken again"
        )
        self.run.log_text(said, "warning")
        print(f"follow: {said}", file=sys.stderr, flush=True)
        state.update(
            offset=0, head="", head_len=0, skip_through=max(state["skip_through"], state["last_step"])
        )

    def _rollout_batches(self, final: bool) -> list[tuple[int, int, bytes, int, bool]]:
        """(step, offset, whole lines, items to skip, whether the file is then taken whole and
        sealed) of sealed rollout files with something new."""
        if self.rollouts is None:
            return []
        try:
            entries = [(rollout_file_step(e.name), e) for e in os.scandir(self.rollouts) if e.is_file()]
        except FileNotFoundError:
            return []
        # Files taken whole and sealed are not looked at again (nor kept in the cursor), so a poll
        # costs the files still open, not every step of the run.
        done = self.cursor.get("rollouts_done_through", -1)
        files = sorted((step, entry) for step, entry in entries if step is not None and step > done)
        out: list[tuple[int, int, bytes, int, bool]] = []
        budget = BATCH_BYTES
        for i, (step, entry) in enumerate(files):
            state = self.cursor["rollouts"].get(str(step), {"offset": 0, "items": 0, "groups": 0})
            stat = entry.stat()
            later = i + 1 < len(files)
            redo = state.get("redo")
            if stat.st_size <= state["offset"] and not redo:
                continue
            self._notice(entry.path, stat)
            if not (final or later or redo or self._settled(entry.path, stat)):
                continue
            with open(entry.path, "rb") as fh:
                fh.seek(state["offset"])
                want = (redo["to"] - state["offset"]) if redo else max(budget, 1)
                buffer = fh.read(want)
                _, used = complete_lines(buffer)
                if not redo and used == 0 and len(buffer) == want == BATCH_BYTES:
                    buffer += fh.readline(MAX_LINE_BYTES)  # one line longer than a batch
                    _, used = complete_lines(buffer)
            if redo:
                used = len(buffer)
            elif used == 0:
                continue  # no whole line yet
            whole = sealed = False
            if not redo:
                whole = state["offset"] + used == stat.st_size
                sealed = final or later or self._settled(entry.path, stat)
            out.append((step, state["offset"], buffer[:used], redo["skip"] if redo else 0, whole and sealed))
            budget -= used
            if budget <= 0:
                break
        return out

    def _notice(self, path: str, stat: os.stat_result) -> None:
        """Remember when a file last changed (size or mtime), for the settle time and idleness."""
        key = (stat.st_size, stat.st_mtime_ns)
        seen = self._seen.get(path)
        if seen is None or seen[:2] != key:
            self._seen[path] = (*key, self.clock())
            self._changed = True

    def _settled(self, path: str, stat: os.stat_result) -> bool:
        seen = self._seen.get(path)
        if seen is None or self.clock() - seen[2] < self.settle_s:
            return False
        with open(path, "rb") as fh:  # ends with a whole line
            fh.seek(max(0, stat.st_size - 1))
            return fh.read(1) == b"\n"

    def _ship(
        self, metrics: tuple[int, bytes] | None, rollouts: list[tuple[int, int, bytes, int, bool]]
    ) -> None:
        # 1. Say what is about to be logged (write-ahead), 2. log it, 3. wait until it is in the
        # client's log, 4. commit the offsets.
        self.cursor["pending"] = {
            "metrics": {"from": metrics[0], "to": metrics[0] + len(metrics[1])} if metrics else None,
            "rollouts": {str(step): {"from": at, "to": at + len(data)} for step, at, data, _, _ in rollouts},
        }
        self._save_cursor()
        if metrics is not None:
            state = self.cursor["metrics"]
            lines, _ = complete_lines(metrics[1] if metrics[1].endswith(b"\n") else metrics[1] + b"\n")
            for raw in lines:
                parsed = metrics_line(raw, self.skipped)
                if parsed is None:
                    continue
                step, values = parsed
                if step <= state["skip_through"] or not values:
                    continue
                self.run.log(values, step=step)
                self.shipped_metrics += 1
                state["last_step"] = max(state["last_step"], step)
            state["offset"] = metrics[0] + len(metrics[1])
            if state["head_len"] < HEAD_BYTES and self.metrics is not None:
                with self.metrics.open("rb") as fh:  # the file's first whole lines, to notice a rewrite
                    state["head_len"] = min(HEAD_BYTES, state["offset"])
                    state["head"] = hashlib.sha256(fh.read(state["head_len"])).hexdigest()
        for step, at, data, skip, finished in rollouts:
            state = self.cursor["rollouts"].setdefault(str(step), {"offset": 0, "items": 0, "groups": 0})
            lines, _ = complete_lines(data if data.endswith(b"\n") else data + b"\n")
            samples = rollout_samples(lines, step, self.skipped, first_group=state["groups"])
            if samples[skip:]:
                self.run.log_samples(samples[skip:], step=step)
            self.shipped_samples += len(samples) - skip
            state.update(
                offset=at + len(data),
                items=state["items"] + len(samples),
                groups=state["groups"] + group_count(samples),
            )
            state.pop("redo", None)
            if finished:
                state["done"] = True
        if not self.run.flush(FLUSH_WAIT_S):
            raise FollowError(
                f"the client could not write its log {self.run.events_path} within {FLUSH_WAIT_S:g} s (a full or "
                "stalled disk?); start follow again when it can: it goes on from its cursor"
            )
        if getattr(self.run, "dropped_events", 0):
            raise FollowError(
                f"the client dropped {self.run.dropped_events} events (its queue was full); "
                "follow stops rather than leave a gap. Start it again: it goes on from its cursor"
            )
        self.cursor["pending"] = None
        self._forget_done_files()
        self._save_cursor()

    def _forget_done_files(self) -> None:
        """Move ``rollouts_done_through`` past the files taken whole, in step order, and drop
        their entries: the cursor stays the size of the files still being written."""
        entries = self.cursor["rollouts"]
        done = self.cursor.get("rollouts_done_through", -1)
        for step in sorted(int(key) for key in entries):
            if not entries[str(step)].get("done"):
                break
            done = step
            del entries[str(step)]
        self.cursor["rollouts_done_through"] = done


# ---------------------------------------------------------------------- the command


def verl_metrics_path(given: str | None, project: str, experiment: str) -> Path | None:
    """The file verl's ``file`` logger writes: ``given`` (a file, or the logger's root
    directory), else verl's own ``VERL_FILE_LOGGER_PATH`` / ``VERL_FILE_LOGGER_ROOT``."""
    if given is None:
        if os.environ.get("VERL_FILE_LOGGER_PATH"):
            return Path(os.environ["VERL_FILE_LOGGER_PATH"])
        if os.environ.get("VERL_FILE_LOGGER_ROOT"):
            given = os.environ["VERL_FILE_LOGGER_ROOT"]
        else:
            return None
    path = Path(given).expanduser()
    if path.is_dir() or (not path.exists() and path.suffix != ".jsonl"):
        # A root (verl may not have made it yet: follow can start first); a file ends in .jsonl.
        return path / project / f"{experiment}.jsonl"
    return path


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:80] or "run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verl-metrics",
        metavar="PATH_OR_ROOT",
        help="verl's file logger output: the .jsonl file, or VERL_FILE_LOGGER_ROOT (then "
        "<root>/<verl project>/<experiment>.jsonl); default: $VERL_FILE_LOGGER_PATH or $VERL_FILE_LOGGER_ROOT",
    )
    parser.add_argument(
        "--verl-rollouts", metavar="DIR", help="verl's trainer.rollout_data_dir (<step>.jsonl files)"
    )
    parser.add_argument("--verl-project", help="verl's trainer.project_name (default: --project)")
    parser.add_argument("--verl-experiment", help="verl's trainer.experiment_name (default: --name)")
    parser.add_argument("--project", required=True, help="the Tributary project's slug")
    parser.add_argument("--name", help="the run's name (default: verl's experiment name)")
    parser.add_argument(
        "--dir", type=Path, help="the run directory: the client's log and follow's cursor "
        "(default: tributary-runs/follow-<project>-<name>); the same --dir continues after a restart",
    )  # fmt: skip
    parser.add_argument("--until-idle", type=float, metavar="S", help="end after S seconds with nothing new")
    parser.add_argument("--settle", type=float, default=10.0, metavar="S", help="a rollout file unchanged "
                        "this long is complete even before the next step's file appears (default 10)")  # fmt: skip
    parser.add_argument(
        "--poll", type=float, default=0.5, metavar="S", help="seconds between looks (default 0.5)"
    )
    add_server_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import tributary
    from tributary.run import RUN_FILE, RunRefused, read_meta

    if (
        args.verl_metrics is None
        and args.verl_rollouts is None
        and not (os.environ.get("VERL_FILE_LOGGER_PATH") or os.environ.get("VERL_FILE_LOGGER_ROOT"))
    ):
        raise SystemExit("tributary follow: give --verl-metrics and/or --verl-rollouts (what verl writes)")
    for option in ("until_idle", "settle", "poll"):
        value = getattr(args, option)
        if value is not None and not 0 <= value <= 7 * 24 * 3600:
            raise SystemExit(
                f"tributary follow: --{option.replace('_', '-')} {value}: give seconds in [0, 604800]"
            )
    experiment = args.verl_experiment or args.name
    metrics = verl_metrics_path(args.verl_metrics, args.verl_project or args.project, experiment or "")
    if metrics is not None and metrics.name == ".jsonl":
        raise SystemExit(
            "tributary follow: --verl-metrics is a directory: also give --name or --verl-experiment"
        )
    name = args.name or (metrics.stem if metrics is not None else None)
    if not name:
        raise SystemExit("tributary follow: give --name (the run's name)")
    rollouts = Path(args.verl_rollouts).expanduser() if args.verl_rollouts else None
    directory = args.dir or Path("tributary-runs") / f"follow-{_slug(args.project)}-{_slug(name)}"
    try:
        if (directory / RUN_FILE).exists():
            meta = read_meta(directory)
            if (meta["project"], meta["name"]) != (args.project, name):
                raise SystemExit(
                    f"tributary follow: {directory} follows run {meta['name']!r} of project {meta['project']!r}, "
                    f"not {name!r} of {args.project!r}: pass another --dir"
                )
            the_run = tributary.init(project=args.project, url=args.url, token=args.token, resume=directory)
        else:
            config = {
                "source": "verl",
                "verl_metrics": str(metrics or ""),
                "verl_rollouts": str(rollouts or ""),
            }
            the_run = tributary.init(
                project=args.project,
                name=name,
                config=config,
                tags=["verl"],
                url=args.url,
                token=args.token,
                dir=directory,
            )
    except (ValueError, RunRefused) as exc:  # RunRefused: another follow holds the run (a copy of --dir)
        raise SystemExit(f"tributary follow: {exc}") from None
    try:
        follower = Follower(the_run, metrics, rollouts, directory / CURSOR_FILE, settle_s=args.settle)
    except FollowError as exc:
        the_run.close()  # not ended: fixed, the same --dir goes on with it
        raise SystemExit(f"tributary follow: {exc}") from None
    print(f"follow: {metrics or '-'} and {rollouts or '-'} into {directory}", flush=True)
    try:
        status, message = _follow(the_run, follower, args)
    except FollowError as exc:
        the_run.close()  # not ended: its message says what to fix; the same --dir goes on
        raise SystemExit(f"tributary follow: {exc}") from None
    except RunRefused as exc:  # heard once the web app was reachable: nothing of this follow is stored
        the_run.close()
        raise SystemExit(f"tributary follow: {exc}") from None
    if follower.skipped.total():
        the_run.log_text(f"follow skipped {follower.skipped.words()}", "warning")
    print(
        f"follow: {follower.shipped_metrics} metrics lines and {follower.shipped_samples} samples taken this time; "
        f"skipped {follower.skipped.words()}",
        flush=True,
    )
    shipped = the_run.finish(status, message)
    return 0 if shipped or the_run.id is None else 1


def _follow(the_run: Any, follower: Follower, args: argparse.Namespace) -> tuple[str, str]:
    """Poll until told to end; the run's final status and message. Ctrl-C and SIGTERM only set
    a flag, so a batch is never cut between its logging and its commit."""
    stop: list[str] = []
    handlers = {
        sig: signal.signal(sig, lambda *_, name=name: stop.append(name))
        for sig, name in ((signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM"))
    }
    idle_since = time.monotonic()
    try:
        while True:
            if follower.poll()[0]:
                idle_since = time.monotonic()
            if stop:
                return _end(follower, "cancelled", f"follow stopped ({stop[0]})")
            if the_run.should_stop():
                return _end(
                    follower, "cancelled", "cancelled from the web app (verl itself goes on: stop it there)"
                )
            if args.until_idle is not None and time.monotonic() - idle_since >= args.until_idle:
                return _end(follower, "succeeded", f"nothing new from verl for {args.until_idle:g} s")
            time.sleep(args.poll)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _end(follower: Follower, status: str, message: str) -> tuple[str, str]:
    """Take what is complete, rollout files not sealed yet too, then end with ``status``."""
    while follower.poll(final=True)[1]:
        pass
    return status, message


COMMAND = Command(
    name="follow",
    help="ship a live verl run (its file logger and rollout dumps) into a Tributary run",
    add_arguments=add_arguments,
    run=run,
)
