"""A run's status message in words for the browser and the API, not for a terminal.

The engine writes its status messages for whoever ran ``python -m engine run`` in a shell:
"stopped at step 31; resume with --resume /data/runs/1" tells that person the flag and the
directory to pass. Stored as a run's ``status_message`` and shown as is, the same words put a
path on the worker's disk and a CLI flag on a web page, where the action is a Resume button and
the directory means nothing. The engine keeps its words (the CLI needs them; the stored message
and the event log keep the original); what leaves the web app goes through ``status_words``: the
API's run (which the run page renders and refetches), the sockets' status messages and the
engine's status events on their way to a browser.

Each rule below names the message it rewrites and where it is written; a message no rule knows
passes unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable

# A checkpoint directory is <run_dir>/checkpoints/step_000031 (engine/checkpoint.py).
_STEP_DIR = re.compile(r"step_0*(\d+)\b")


def _checkpoint(path: str) -> str:
    """A checkpoint directory in words: "the checkpoint of step 31" when the path names its step."""
    found = _STEP_DIR.findall(path)
    return f"the checkpoint of step {found[-1]}" if found else "the checkpoint"


# (pattern, replacement), tried in order; every match in the message is rewritten.
_RULES: list[tuple[re.Pattern[str], Callable[[re.Match[str]], str]]] = [
    # engine/run.py, a cancelled run that saved a checkpoint.
    (
        re.compile(r"stopped at step (\d+); resume with --resume .+$"),
        lambda m: f"stopped at step {m[1]} and saved a checkpoint: resume the run to continue from it",
    ),
    # engine/run.py before it wrote "training on cpu": a step that was true once, then stale for
    # the whole run (the live step is the metrics'); runs stored by such an engine still carry it.
    (
        re.compile(r"^step (\d+) of \d+ on (\S+)$"),
        lambda m: f"resumed at step {m[1]}, training on {m[2]}" if m[1] != "0" else f"training on {m[2]}",
    ),
    # engine/run.py, the starting status of a resumed run.
    (re.compile(r"^resuming from (/.+)$"), lambda m: f"resuming from {_checkpoint(m[1])}"),
]

# engine/checkpoint.py and engine/trainer/deepspeed_backend.py: "--resume PATH: no checkpoint
# there (...)", a resume that found no checkpoint. Found by the literal marker and read
# backwards, not by a pattern with a lazy path: ``--resume (.+?): no ...`` tries every
# "--resume " to the end of the message, quadratic in a long message (29 s for 180 kB).
_UNREADABLE = (
    (": no checkpoint there (", "could not be read on this worker"),
    (": no DeepSpeed checkpoint there (", "holds no DeepSpeed state"),
)
_RESUME_FLAG = "--resume "


def _unreadable_resume(message: str) -> str:
    for marker, words in _UNREADABLE:
        end = message.find(marker)
        start = message.rfind(_RESUME_FLAG, 0, end) if end >= 0 else -1
        close = message.find(")", end + len(marker)) if start >= 0 else -1
        if close >= 0:
            path = message[start + len(_RESUME_FLAG) : end]
            message = f"{message[:start]}{_checkpoint(path)} to resume from {words}{message[close + 1 :]}"
    return message


def status_words(message: str) -> str:
    """``message`` (a run's status message, as the engine, the worker or the web app wrote it)
    with what only a terminal user can act on put in words for a page (see the module's
    docstring)."""
    for pattern, words in _RULES:
        message = pattern.sub(words, message)
    return _unreadable_resume(message)
