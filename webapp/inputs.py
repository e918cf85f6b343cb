"""What user input may hold before it reaches the database: one place for the checks that the
request middleware (``webapp.middleware``), the API schemas (``webapp.api.schemas``) and the
pages' own parsing share.

PostgreSQL refuses three kinds of input that Python and JSON accept, and each used to surface
as a 500: a NUL character in text (``A string literal cannot contain NUL (0x00) characters``,
also in ``jsonb`` as ``\\u0000``), a lone UTF-16 surrogate such as ``"\\ud800"`` (valid JSON,
but not encodable as UTF-8, so psycopg cannot send it), and an integer beyond the column's
range (``bigint out of range``). ``str.isdigit`` is no guard for ids either: it is true for
``"²"``, which ``int()`` then refuses.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

BIGINT_MAX = 2**63 - 1  # PostgreSQL bigint: ids (BigAutoField), seq, offsets
INT_MAX = 2**31 - 1  # PostgreSQL integer: steps, lengths, indexes

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_ASCII_ID = re.compile(r"[0-9]{1,19}")


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored as text (a NUL, a lone surrogate), or None if it can."""
    bad = _UNSTORABLE.search(value)
    if bad is None:
        return None
    char = bad.group()
    if char == "\x00":
        return f"contains a NUL character (\\x00) at position {bad.start()}: remove it"
    return (
        f"contains a lone UTF-16 surrogate (\\u{ord(char):04x}) at position {bad.start()}, "
        "which is not valid Unicode text: send the character itself, or its full surrogate pair"
    )


def json_problem(value: Any, path: str = "") -> str | None:
    """The first thing in a JSON value (keys, strings, numbers, at any depth) that cannot be
    stored in a JSON column, named by its dotted path, or None. Non-finite numbers count:
    Python's ``json`` reads ``NaN``/``Infinity`` but ``jsonb`` refuses them."""
    where = f" at {path}" if path else ""
    if isinstance(value, str):
        problem = text_problem(value)
        return f"text{where} {problem}" if problem else None
    if isinstance(value, float) and not math.isfinite(value):
        return f"number{where} must be finite, got {value!r}"
    if isinstance(value, dict):
        for key, item in value.items():
            key_text = str(key)
            problem = text_problem(key_text)
            if problem:
                return f"key {key_text!r}{where} {problem}"
            found = json_problem(item, f"{path}.{key_text}" if path else key_text)
            if found:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = json_problem(item, f"{path}[{i}]")
            if found:
                return found
    return None


def parse_id(text: str | None, maximum: int = BIGINT_MAX) -> int | None:
    """``text`` as a non-negative id if it is 1-19 ASCII digits within ``maximum``, else None.

    Only ``[0-9]``, as Django's ``int:`` path converter takes: ``"²"`` and ``"٣"`` are not ids."""
    if text is None:
        return None
    text = text.strip()
    if not _ASCII_ID.fullmatch(text):
        return None
    value = int(text)
    return value if value <= maximum else None


def parse_ids(values: Iterable[str]) -> tuple[list[int], list[str]]:
    """The ids in comma-separated ``values``, distinct and in order, and the parts that are not ids
    (``["3, 1,x", "3,,-2"]`` -> ``([3, 1], ["x", "-2"])``); empty parts are skipped."""
    ids: list[int] = []
    bad: list[str] = []
    for raw in values:
        for part in raw.split(","):
            part = part.strip()
            if not part:
                continue
            value = parse_id(part)
            if value is None:
                bad.append(part)
            elif value not in ids:
                ids.append(value)
    return ids, bad
