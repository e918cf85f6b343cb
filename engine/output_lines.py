"""The engine's raw output (``engine.log``: stderr and stdout of every rank and child process) as
lines a page can show, each with a level.

Output is bytes from anywhere (native libraries, progress bars, a crashing process), so nothing
here fails on them: invalid UTF-8 becomes U+FFFD, terminal escapes (colours, cursor moves) are
dropped, other control characters too (a tab becomes spaces), a progress bar's ``\\r`` redraws
show their last state, NUL and lone surrogates cannot survive (``tributary.events.clean_text``), and
a line longer than ``MAX_LINE_CHARS`` is cut with a mark (the full file keeps it whole). Lines
that mirror the engine's log events (``engine.log_bridge``) are left out: they are shown as events.

Nobody gave these lines a level, so ``guess_level`` reads one from words that mean error or warning.
Standard library only: the web app uses it without loading torch.
"""

from __future__ import annotations

import re

from engine.log_bridge import is_mirrored
from tributary.events import clean_text

MAX_LINE_CHARS = 4000

_ESCAPES = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_ERROR = re.compile(
    r"\b(?:ERROR|CRITICAL|FATAL|Traceback \(most recent call last\)|[A-Za-z]*Error:|[A-Za-z]*Exception:"
    r"|Segmentation fault|Killed)"
)
_WARNING = re.compile(r"\b(?:WARNING|WARN|[A-Za-z]*Warning:)")
_DEBUG = re.compile(r"^\W*DEBUG\b")


def guess_level(text: str) -> str:
    """error, warning, debug or info, from what the line says."""
    if _ERROR.search(text):
        return "error"
    if _WARNING.search(text):
        return "warning"
    if _DEBUG.search(text):
        return "debug"
    return "info"


def clean_line(raw: bytes) -> str:
    """One line of output (without its newline) as text a page can show; "" when nothing is left."""
    text = raw.decode("utf-8", errors="replace").rstrip("\r").rsplit("\r", 1)[-1]
    text = _CONTROLS.sub("", _ESCAPES.sub("", text).replace("\t", "    ")).rstrip()
    if len(text) > MAX_LINE_CHARS:
        text = f"{text[:MAX_LINE_CHARS]}… [{len(text) - MAX_LINE_CHARS} more characters in the full log]"
    return clean_text(text)


def split_lines(data: bytes, start: int = 0) -> list[tuple[int, str, str]]:
    """``(offset, level, text)`` of each line of ``data`` worth showing, ``start`` being where
    ``data`` begins in the file: blank lines and the engine's mirrored log records left out."""
    out: list[tuple[int, str, str]] = []
    position = start
    for raw in data.split(b"\n"):
        here, position = position, position + len(raw) + 1
        text = clean_line(raw)
        if text.strip() and not is_mirrored(text):
            out.append((here, guess_level(text), text))
    return out
