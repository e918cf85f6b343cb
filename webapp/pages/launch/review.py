"""The review step before a launch: the validated config against its baseline, value by value.

The diff is computed here, on the server, from the config exactly as ``create_run`` will store
it (``validate_run_config``'s output: presets applied, defaults filled, types coerced) and the
baseline as stored (a preset validated the same way, or the cloned run's stored config). The
page's script only marks fields as the user types; what the review lists is what the database
will hold. ``digest`` fingerprints the reviewed values so a launch after further edits is sent
back to the review instead of launching values the user has not seen.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

MISSING = object()


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaf values by dotted path; a list of mappings (reward functions) is flattened by index,
    any other list (stop strings, betas) and an empty mapping are one value."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, child in value.items():
            out.update(flatten(child, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        out = {}
        for i, item in enumerate(value):
            out.update(flatten(item, f"{prefix}.{i}"))
        return out
    return {prefix: value}


def display(value: Any) -> str:
    """A value as the review shows it: strings as typed, everything else as JSON."""
    if value is MISSING:
        return "(not set)"
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def config_diff(config: dict[str, Any], baseline: dict[str, Any]) -> list[dict[str, str]]:
    """Every leaf whose value differs, in the config's order, then leaves only the baseline has."""
    new, old = flatten(config), flatten(baseline)
    rows = []
    for path in [*new, *(p for p in old if p not in new)]:
        before, after = old.get(path, MISSING), new.get(path, MISSING)
        if before is MISSING or after is MISSING or before != after or type(before) is not type(after):
            rows.append({"path": path, "before": display(before), "after": display(after)})
    return rows


def digest(config: dict[str, Any], queue: str, tags: list[str], notes: str) -> str:
    """A fingerprint of everything the review showed (the config and the launch fields)."""
    text = json.dumps({"config": config, "queue": queue, "tags": tags, "notes": notes}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()
