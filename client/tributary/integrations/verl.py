"""Reading verl's own output: pure functions on bytes, for ``follow`` and the web app's import.

Two outputs of a verl (0.9) run, written with no change to its code:

- **Metrics**, from its ``file`` logger (``trainer.logger=[console,file]``,
  ``verl.utils.tracking.FileLogger``): one JSON object per line, ``{"step": N, "data": {name:
  value}}``, at ``$VERL_FILE_LOGGER_PATH`` or ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``
  (``trainer.project_name``, ``trainer.experiment_name``). The logger opens the file with ``"wb"``:
  a restarted verl run rewrites it from its first step.
- **Rollouts**, from ``trainer.rollout_data_dir`` (``RayPPOTrainer._dump_generations``): one
  ``<step>.jsonl`` per step, one line per completion with ``input``, ``output``, ``gts``,
  ``score``, ``step`` and the reward function's extra fields (``acc``, ...). A background thread
  writes the files one at a time, in step order.

Nothing here touches files, the network or the clock, so the web app can import the same code.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tributary.integrations.names import verl_values

MAX_STEP = 2**31 - 1
MAX_NAME = 200
# Fields of a rollout line that are not reward components.
ROLLOUT_TEXT_FIELDS = ("input", "output", "gts", "score", "step")
ROLLOUT_FILE = re.compile(r"^(\d{1,10})\.jsonl$")


@dataclass
class Skipped:
    """What could not be taken from verl's files, counted (a follow prints these at its end)."""

    bad_lines: int = 0  # not a JSON object of the expected shape
    non_numeric: int = 0  # metric values that are not numbers (text, lists, booleans)
    non_finite: int = 0  # NaN / inf (verl's orjson writes them as null)
    bad_names: int = 0  # metric names that are not 1-200 characters
    examples: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(what)

    def total(self) -> int:
        return self.bad_lines + self.non_numeric + self.non_finite + self.bad_names

    def add(self, other: Skipped) -> None:
        self.bad_lines += other.bad_lines
        self.non_numeric += other.non_numeric
        self.non_finite += other.non_finite
        self.bad_names += other.bad_names
        for example in other.examples:
            self.note(example)

    def words(self) -> str:
        parts = [
            f"{n} {what}"
            for n, what in (
                (self.bad_lines, "unreadable lines"),
                (self.non_numeric, "non-numeric metric values"),
                (self.non_finite, "non-finite metric values (NaN/inf)"),
                (self.bad_names, "metric names that are not 1-200 characters"),
            )
            if n
        ]
        text = ", ".join(parts) or "nothing"
        return text + (f" (e.g. {'; '.join(self.examples)})" if self.examples else "")


def complete_lines(buffer: bytes) -> tuple[list[bytes], int]:
    """The whole lines of ``buffer`` and how many bytes they span: a torn last line (a writer
    mid-line) waits for its newline."""
    end = buffer.rfind(b"\n") + 1
    return buffer[:end].splitlines(), end


def _is_step(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_STEP


def metrics_line(raw: bytes, skipped: Skipped) -> tuple[int, dict[str, float]] | None:
    """One line of verl's file logger: ``(step, values)``, or None (counted in ``skipped``).

    Values that are not finite numbers are left out and counted; verl's reward statistics are
    also given the engine's names (``tributary.integrations.names``)."""
    if not raw.strip():
        return None
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        skipped.bad_lines += 1
        skipped.note(f"not JSON: {raw[:60]!r}")
        return None
    if (
        not isinstance(record, dict)
        or not _is_step(record.get("step"))
        or not isinstance(record.get("data"), dict)
    ):
        skipped.bad_lines += 1
        skipped.note(f'not {{"step": N, "data": {{...}}}}: {raw[:60]!r}')
        return None
    values: dict[str, float] = {}
    for name, value in record["data"].items():
        if not 0 < len(name) <= MAX_NAME:
            skipped.bad_names += 1
            continue
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            skipped.non_finite += 1
            skipped.note(f"{name} at step {record['step']} is not finite")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value) if abs(value) < 1e308 else math.inf
            if math.isfinite(number):
                values[name] = number
            else:
                skipped.non_finite += 1
        else:
            skipped.non_numeric += 1
            skipped.note(f"{name} at step {record['step']} is {type(value).__name__}")
    return record["step"], verl_values(values)


def rollout_file_step(name: str) -> int | None:
    """The step of a rollout dump's file name (``<step>.jsonl``), else None."""
    match = ROLLOUT_FILE.match(name)
    step = int(match.group(1)) if match else None
    return step if step is not None and step <= MAX_STEP else None


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(float(value)):
        return float(value)
    return None


def rollout_samples(
    lines: Iterable[bytes], step: int, skipped: Skipped, first_group: int = 0
) -> list[dict[str, Any]]:
    """Rollout lines of one step as samples in the engine's shape, grouped.

    verl writes the ``n`` completions of a prompt one after the other, but ``trainer.balance_batch``
    reorders a batch by length, so a group is every line with the same ``input``; groups keep the
    order of their first line and are numbered ``<step>:<k>`` from ``first_group`` (a file read in
    several parts goes on numbering). Numeric extra fields are the reward's components; ``gts``
    is the answer; other extra fields go to ``extra`` as they are."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for raw in lines:
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except (ValueError, RecursionError):
            row = None
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("input"), str)
            or not isinstance(row.get("output"), str)
        ):
            skipped.bad_lines += 1
            skipped.note(f'rollout line without "input"/"output" text at step {step}: {raw[:60]!r}')
            continue
        components: dict[str, float] = {}
        extra: dict[str, Any] = {}
        for key, value in row.items():
            if key in ROLLOUT_TEXT_FIELDS:
                continue
            number = _number(value)
            if number is not None:
                components[key] = number
            else:
                extra[key] = value
        if row.get("gts") is not None:
            extra["answer"] = row["gts"]
        extra["components"] = components
        groups.setdefault(row["input"], []).append(
            {
                "prompt": row["input"],
                "completion": row["output"],
                "reward": _number(row.get("score")),
                "extra": extra,
            }
        )
    out: list[dict[str, Any]] = []
    for k, members in enumerate(groups.values(), start=first_group):
        for item in members:
            item["extra"]["group"] = f"{step}:{k}"
            out.append(item)
    return out


def group_count(samples: list[dict[str, Any]]) -> int:
    """How many groups ``rollout_samples`` made."""
    return len({item["extra"]["group"] for item in samples})


def run_events(
    metrics: bytes | None, rollouts: dict[int, bytes], *, time: float, chunk: int = 256
) -> tuple[list[dict[str, Any]], Skipped]:
    """A finished verl run's files as the protocol's ``metrics`` and ``samples`` events (without
    ``run`` and ``seq``), step by step: each step's metrics, then its rollouts in events of at
    most ``chunk`` samples. ``time`` stamps the metrics (verl's file logger records none). A
    torn last line (a run cut mid-write) is left out and counted."""
    skipped = Skipped()
    by_step: dict[int, list[dict[str, Any]]] = {}
    if metrics:
        lines, used = complete_lines(metrics)
        if used < len(metrics.rstrip(b"\n")):
            skipped.bad_lines += 1
            skipped.note("the metrics file's last line has no end (cut mid-write)")
        for raw in lines:
            parsed = metrics_line(raw, skipped)
            if parsed is not None and parsed[1]:
                by_step.setdefault(parsed[0], []).append(
                    {"type": "metrics", "step": parsed[0], "time": time, "values": parsed[1]}
                )
    for step, data in rollouts.items():
        lines, used = complete_lines(data)
        if used < len(data):
            skipped.bad_lines += 1
            skipped.note(f"rollout file {step}.jsonl's last line has no end (cut mid-write)")
        samples = rollout_samples(lines, step, skipped)
        for start in range(0, len(samples), chunk):
            by_step.setdefault(step, []).append(
                {"type": "samples", "step": step, "items": samples[start : start + chunk]}
            )
    return [event for step in sorted(by_step) for event in by_step[step]], skipped
