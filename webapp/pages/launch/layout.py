"""How the generated form is laid out: the essentials first, every other section collapsed, and
each field marked when its value differs from the baseline (the preset, or the cloned run).

The schema-generated form (``schema_form.build_form``) is one long page of every setting; most
runs change a handful. ``arrange`` pulls the fields most runs set (``ESSENTIALS``) into a first,
always-open section and leaves the rest in their schema sections, which the template renders as
``<details>`` (collapsed unless the user opened them or they hold a problem).

"Changed" compares what the inputs show: each field's *input state* (the text of a text or
number input, the checked state of a checkbox, the parts of a tuple, the number of rows of a
list) against the same field of the form built from the baseline config. The page's script
(``static/tributary/launch_diff.js``) applies the same rule as the user types, from the
baseline state this module writes into ``data-baseline``; the review step then shows the exact
difference of the validated configs (``review.py``), which is what the server stores.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

# The fields most runs set, in the order the form shows them (dotted config paths).
ESSENTIALS = (
    "name",
    "preset",
    "model.path",
    "data.source",
    "data.task",
    "data.path",
    "reward.functions",
    "trainer.total_steps",
    "rollout.n",
    "optimizer.lr",
)
ESSENTIALS_ID = "f-essentials"
TEXT_KINDS = ("textarea", "lines", "mapping")  # multi-line inputs: line endings and outer blanks do not count


def walk_fields(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every field spec under ``items``: nested groups' fields and the fields of list rows too."""
    for item in items:
        if item["type"] == "group":
            yield from walk_fields(item["fields"])
            continue
        yield item
        for row in item.get("rows", ()):
            yield from walk_fields(row["fields"])


def input_state(spec: dict[str, Any]) -> str:
    """What a field's inputs show, as one string (a JSON list for a tuple, a count for rows)."""
    kind = spec["kind"]
    if kind == "checkbox":
        return "true" if spec["checked"] else "false"
    if kind == "tuple":
        return json.dumps([part["value"] for part in spec["parts"]])
    if kind == "rows":
        return str(len(spec["rows"]))
    return spec["value"]


def _number(text: str) -> float | None:
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _same_number(a: str, b: str) -> bool:
    x, y = _number(a), _number(b)
    if x is None or y is None:
        return a.strip() == b.strip()
    return x == y


def same_state(kind: str, current: str, baseline: str) -> bool:
    """Whether two input states mean the same value (``launch_diff.js`` ``sameState`` mirrors it)."""
    if kind == "number":
        return _same_number(current, baseline)
    if kind == "tuple":
        a, b = json.loads(current), json.loads(baseline)
        return len(a) == len(b) and all(_same_number(x, y) for x, y in zip(a, b, strict=True))
    if kind in TEXT_KINDS:
        return current.replace("\r\n", "\n").strip() == baseline.replace("\r\n", "\n").strip()
    return current == baseline


def _family(kind: str) -> str:
    """Kinds that hold the same value: a text becomes a textarea once its value has a line break."""
    return "text" if kind == "textarea" else kind


def _shown(spec: dict[str, Any]) -> str:
    """A baseline value as the "changed from" note shows it."""
    kind = spec["kind"]
    if kind == "checkbox":
        return "on" if spec["checked"] else "off"
    if kind == "tuple":
        return ", ".join(part["value"] for part in spec["parts"])
    if kind == "rows":
        return f"{len(spec['rows'])} row{'' if len(spec['rows']) == 1 else 's'}"
    return spec["value"] or "(empty)"


def mark_changes(form: dict[str, Any], baseline_form: dict[str, Any]) -> None:
    """Give every field spec ``baseline`` (its input state in the baseline form) and ``changed``.

    A field of a list row the baseline lacks has no baseline and is not marked itself: the list
    is (its row count differs), so adding a row counts as one change, as removing one does."""
    base = {spec["path"]: spec for spec in walk_fields(baseline_form["sections"])}
    for spec in walk_fields(form["sections"]):
        other = base.get(spec["path"])
        comparable = other is not None and _family(other["kind"]) == _family(spec["kind"])
        spec["baseline"] = input_state(other) if comparable else None
        spec["baseline_text"] = _shown(other) if comparable else ""
        spec["changed"] = comparable and not same_state(spec["kind"], input_state(spec), spec["baseline"])


def _counts(section: dict[str, Any]) -> dict[str, Any]:
    fields = list(walk_fields(section["fields"]))
    section["changed_count"] = sum(1 for f in fields if f["changed"])
    section["problem_count"] = sum(1 for f in fields if f["errors"])
    return section


def arrange(form: dict[str, Any], open_ids: set[str]) -> None:
    """Move the essential fields into a first section and say which sections show open.

    Call after ``mark_changes`` and ``attach_errors``: a section holding a problem opens itself.
    Sections left with no fields (every field essential) are dropped."""
    by_path: dict[str, dict[str, Any]] = {}
    rest = []
    for section in form["sections"]:
        kept = []
        for item in section["fields"]:
            if item["type"] == "field" and item["path"] in ESSENTIALS:
                by_path[item["path"]] = item
            else:
                kept.append(item)
        if kept:
            rest.append({**section, "fields": kept})
    essentials = {
        "type": "group",
        "path": "",
        "id": ESSENTIALS_ID,
        "title": "Essentials",
        "help": "",
        "fields": [by_path[p] for p in ESSENTIALS if p in by_path],
        "errors": [],
        "collapsible": False,
        "open": True,
    }
    for section in rest:
        section["collapsible"] = True
    form["sections"] = [_counts(essentials), *(_counts(s) for s in rest)]
    for section in form["sections"][1:]:
        section["open"] = section["problem_count"] > 0 or section["id"] in open_ids
