"""Config key paths and values, one home for the runs table, the compare page and the stored
``ConfigValue`` rows (issue 18).

A key path is dotted names (``algorithm.clip_ratio_high``): each segment ``SEGMENT`` (letters,
digits, ``_`` and ``-``, starting with a letter or ``_``, at most 64 characters), at most
``MAX_SEGMENTS`` of them, none with ``__`` (Django reads it as a lookup). ``path_problem`` says
what is wrong with a path a user typed; ``nodes`` walks a config into the paths and values the
database keeps per run; ``typed`` turns a value into the columns a row stores, and ``digest`` is
the equality of JSON values as a fixed-width index key: ``8`` and ``8.0`` are one value, the text
``"8"`` another, ``[1, 2]`` and ``{"a": 1}`` compare by their canonical JSON text (sorted keys), so
an object, a list or a long text is found through the (key, digest) index like a number.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

SEGMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
MAX_SEGMENTS = 8
MAX_KEY = 64 * MAX_SEGMENTS + MAX_SEGMENTS - 1  # characters of the longest valid path
MAX_NODES = 2000
"""Paths kept per run: a preset's config has about 200, an external run's free-form one (at most
256 KB) could have far more; past this many the rest are not kept (``nodes``)."""
TEXT_CHARS = 1000
"""Characters of a value's text kept (what ``contains`` searches and a group shows); equality
reads the digest of the whole value, so a longer value is still found and grouped exactly."""
DIGEST_CHARS = 32  # hex characters of SHA-256 kept: 128 bits, no collision among a database's values

STR, NUM, BOOL, NULL, LIST, DICT = "str", "num", "bool", "null", "list", "dict"
KINDS = (STR, NUM, BOOL, NULL, LIST, DICT)

PATH_HELP = (
    f"dotted names of letters, digits, '_' and '-' (each starting with a letter or '_', at most "
    f"{MAX_SEGMENTS} parts), like algorithm.clip_ratio_high or rollout.n"
)


def path_problem(path: str) -> str | None:
    """What makes ``path`` no config key path (None: it is one), worded to follow the path."""
    segments = path.split(".")
    if not path or len(segments) > MAX_SEGMENTS or not all(SEGMENT.fullmatch(s) for s in segments):
        return f"is not a config key path: {PATH_HELP}"
    if any("__" in s for s in segments):
        return "has '__' in a key, which the table cannot look up"
    return None


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys, every key as it is (a display of the whole config: the
    compare page's diff); lists and scalars are leaves, an empty dict is a leaf too."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def nodes(config: Any) -> Iterator[tuple[str, Any, bool]]:
    """Each ``(path, value, is_leaf)`` of ``config`` that a valid key path reaches, depth first:
    objects too (a column or group may name ``algorithm``), not the root. A key that is no
    ``SEGMENT`` hides its subtree (no path could name it); at most ``MAX_NODES``."""
    if not isinstance(config, Mapping):
        return
    stack: list[tuple[str, Any, int]] = [("", config, 0)]
    count = 0
    while stack:
        prefix, value, depth = stack.pop()
        if depth >= MAX_SEGMENTS:
            continue
        children = []
        for key, inner in value.items():
            if isinstance(key, str) and SEGMENT.fullmatch(key) and "__" not in key:
                children.append((f"{prefix}.{key}" if prefix else key, inner))
        for path, inner in children:
            nested = isinstance(inner, Mapping) and bool(inner)
            yield path, inner, not nested
            count += 1
            if count >= MAX_NODES:
                return
        for path, inner in reversed(children):
            if isinstance(inner, Mapping) and inner:
                stack.append((path, inner, depth + 1))


def leaf_paths(config: Any) -> list[str]:
    """The leaf key paths of ``config``, sorted (what the column picker offers)."""
    return sorted(path for path, _value, leaf in nodes(config) if leaf)


def value_at(config: Any, path: str) -> tuple[bool, Any]:
    """``(found, value)`` at ``path`` of ``config``."""
    for segment in path.split("."):
        if not isinstance(config, Mapping) or segment not in config:
            return False, None
        config = config[segment]
    return True, config


class Typed(NamedTuple):
    """A config value as a ``ConfigValue`` row stores it."""

    kind: str
    text: str  # the string itself, else the canonical JSON text; at most TEXT_CHARS
    number: float | None  # a finite number's value (what sorts)
    digest: str  # equality: the same for equal JSON values, whatever their spelling


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True)


def _hash(kind: str, canonical: str) -> str:
    return hashlib.sha256(f"{kind}:{canonical}".encode("utf-8", "surrogatepass")).hexdigest()[:DIGEST_CHARS]


def typed(value: Any) -> Typed:
    """``value``'s kind, text, number and digest. A bool is no number (JSON ``true`` is not ``1``);
    a number compares by its float value (``8`` = ``8.0``), one too large for a float or not
    finite by its text."""
    if isinstance(value, str):
        return Typed(STR, value[:TEXT_CHARS], None, _hash(STR, value))
    if isinstance(value, bool):
        text = "true" if value else "false"
        return Typed(BOOL, text, None, _hash(BOOL, text))
    if value is None:
        return Typed(NULL, "null", None, _hash(NULL, ""))
    if isinstance(value, int | float):
        text = _canonical(value)
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if math.isfinite(number):
            return Typed(NUM, text[:TEXT_CHARS], number, _hash(NUM, repr(number)))
        return Typed(NUM, text[:TEXT_CHARS], None, _hash(NUM, text))
    if isinstance(value, Mapping):
        text = _canonical(value)
        return Typed(DICT, text[:TEXT_CHARS], None, _hash(DICT, text))
    text = _canonical(list(value) if isinstance(value, list | tuple) else str(value))
    return Typed(LIST, text[:TEXT_CHARS], None, _hash(LIST, text))


def json_text(kind: str, text: str) -> str:
    """A stored value's JSON text (what ``is`` filters read back), from its kind and text."""
    return json.dumps(text, ensure_ascii=False) if kind == STR else text


def decoded(kind: str | None, text: str | None) -> Any:
    """A stored value as Python (None for no value or for null; a cut text as it is kept)."""
    if kind is None or text is None or kind == NULL:
        return None
    if kind == STR:
        return text
    try:
        return json.loads(text)
    except ValueError:  # a list or dict's text cut at TEXT_CHARS
        return text


def loose_digests(text: str) -> list[str]:
    """The digests a typed text equals: the text itself and, when it reads as JSON, that value
    (``8`` finds the number 8 and the text "8"; ``[1,2]`` the list; ``null`` the null)."""
    out = [typed(text).digest]
    try:
        parsed = json.loads(text)
    except ValueError:
        return out
    if parsed != text:
        out.append(typed(parsed).digest)
    return out


def is_digest(text: str) -> bool:
    return len(text) == DIGEST_CHARS + 1 and text[0] == "#" and all(c in "0123456789abcdef" for c in text[1:])
