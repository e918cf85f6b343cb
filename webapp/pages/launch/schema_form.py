"""The launch form, generated from the engine's JSON Schema: field specs out, a config back in.

``build_form(schema, values, errors)`` turns the schema (``engine.config.json_schema()``) and a
config mapping into template-friendly specs: one section per top-level object (its fieldset),
each with fields (label = schema title, help = description, input kind by schema type,
bounds, enum options, the current value) and nested groups for nested objects. Top-level
scalars go in a first "Run" section.

``parse_form(schema, data)`` reads the posted form data back into the nested config mapping.
It never rejects a value: what it cannot parse it passes on as typed, so the engine's own
validation names the field (and ``attach_errors`` puts its message at that field).

Input names are dotted paths (``rollout.n``, ``reward.functions.0.weight``), ids are
``f-`` plus the path with dots as dashes.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any

import yaml

from engine.config import load_yaml

EXTRA_FIELD = "_extra"  # hidden input: config keys the form has no input for (kept, not lost)
LINE_QUOTE = '"'


# ----------------------------------------------------------------------------- schema walking


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref:
        target = schema["$defs"][ref.rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return merged
    return node


def _nullable(node: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The non-null branch of ``anyOf [X, null]`` (merged with the outer keys) and whether null is allowed."""
    options = node.get("anyOf")
    if not options:
        return node, False
    non_null = [o for o in options if o.get("type") != "null"]
    nullable = len(non_null) < len(options)
    inner = non_null[0] if len(non_null) == 1 else {"type": "string"}
    outer = {k: v for k, v in node.items() if k != "anyOf"}
    return {**inner, **outer}, nullable


def _is_object(schema: dict[str, Any], node: dict[str, Any]) -> bool:
    node = _resolve(schema, node)
    return node.get("type") == "object" and "properties" in node


def field_id(path: str) -> str:
    return "f-" + re.sub(r"[^a-zA-Z0-9_-]", "-", path)


# ----------------------------------------------------------------------------- values -> strings


def _number_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value)  # "1.0", "5e-05": read back as exactly this float
    return str(value)


def _line_text(item: Any) -> str:
    text = item if isinstance(item, str) else json.dumps(item)
    if (
        not isinstance(item, str)
        or text != text.strip()
        or "\n" in text
        or "\r" in text
        or text.startswith(LINE_QUOTE)
    ):
        return json.dumps(item, ensure_ascii=False)
    return text


def _lines_text(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, list):
        return _line_text(value)
    return "\n".join(_line_text(item) for item in value)


def _mapping_text(value: Any) -> str:
    if value is None or value == {}:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


# ----------------------------------------------------------------------------- specs


def _field(
    schema: dict[str, Any], name: str, node: dict[str, Any], path: str, values: dict[str, Any], extras: list
) -> dict[str, Any]:
    node = _resolve(schema, node)
    node, nullable = _nullable(node)
    kind_type = node.get("type")
    has_value = name in values
    value = values[name] if has_value else node.get("default")
    spec: dict[str, Any] = {
        "type": "field",
        "name": path,
        "path": path,
        "id": field_id(path),
        "label": node.get("title") or name.replace("_", " ").capitalize(),
        "help": node.get("description", ""),
        "nullable": nullable,
        "default": node.get("default"),
        "errors": [],
    }
    if "enum" in node:
        options = [str(o) for o in node["enum"]]
        current = "" if value is None else str(value)
        if nullable:
            options = ["", *options]
        if current not in options:
            options.append(current)  # an out-of-range value from YAML stays visible, the engine names it
        spec.update(
            kind="select", value=current, options=[{"value": o, "label": o or "(none)"} for o in options]
        )
    elif kind_type == "boolean":
        if value is not None and not isinstance(value, bool):
            extras.append([path.split("."), value])  # not a checkbox value: keep it for validation
        spec.update(kind="checkbox", checked=bool(value) if isinstance(value, bool) else False)
    elif kind_type in ("integer", "number"):
        spec.update(
            kind="number",
            value=_number_text(value),
            min=node.get("minimum", node.get("exclusiveMinimum")),
            max=node.get("maximum", node.get("exclusiveMaximum")),
            step="1" if kind_type == "integer" else "any",
            numeric=kind_type,
        )
    elif kind_type == "array" and "prefixItems" in node:
        items = value if isinstance(value, list) else []
        if value is not None and not isinstance(value, list):
            extras.append([path.split("."), value])
        parts = []
        for i, item_node in enumerate(node["prefixItems"]):
            parts.append(
                {
                    "name": f"{path}.{i}",
                    "id": field_id(f"{path}.{i}"),
                    "value": _number_text(items[i]) if i < len(items) else "",
                    "label": f"{spec['label']} {i + 1}",
                    "step": "1" if item_node.get("type") == "integer" else "any",
                }
            )
        spec.update(kind="tuple", parts=parts, id=parts[0]["id"] if parts else spec["id"])
    elif kind_type == "array" and _is_object(schema, node.get("items", {})):
        item_node = _resolve(schema, node["items"])
        rows = []
        items = value if isinstance(value, list) else []
        if value is not None and not isinstance(value, list):
            extras.append([path.split("."), value])
        for i, item in enumerate(items):
            row_path = f"{path}.{i}"
            if not isinstance(item, dict):
                extras.append([row_path.split("."), item])
                item = {}
            rows.append(
                {
                    "index": i,
                    "path": row_path,
                    "id": field_id(row_path),
                    "fields": _object_fields(schema, item_node, row_path, item, extras),
                }
            )
        spec.update(
            kind="rows",
            rows=rows,
            item_title=item_node.get("title", "item"),
            min_items=node.get("minItems", 0),
        )
    elif kind_type == "array":
        hint = 'One per line; write special ones as JSON strings, e.g. "\\n\\n".'
        spec.update(kind="lines", value=_lines_text(value), help=f"{spec['help']} {hint}".strip())
    elif kind_type == "object":
        hint = 'As JSON or YAML, e.g. {"buffer_len": 8}.'
        spec.update(kind="mapping", value=_mapping_text(value), help=f"{spec['help']} {hint}".strip())
    else:
        text = "" if value is None else str(value) if not isinstance(value, str) else value
        if value is not None and not isinstance(value, str):
            extras.append([path.split("."), value])
        spec.update(kind="textarea" if "\n" in text else "text", value=text)
    return spec


def _object_fields(
    schema: dict[str, Any], node: dict[str, Any], prefix: str, values: dict[str, Any], extras: list
) -> list[dict[str, Any]]:
    node = _resolve(schema, node)
    props = node.get("properties", {})
    out: list[dict[str, Any]] = []
    for name, child in props.items():
        path = f"{prefix}.{name}" if prefix else name
        if _is_object(schema, child):
            sub = values.get(name)
            if sub is not None and not isinstance(sub, dict):
                extras.append([path.split("."), sub])
                sub = None
            child_node = _resolve(schema, child)
            out.append(
                {
                    "type": "group",
                    "path": path,
                    "id": field_id(path),
                    "title": child.get("title") or child_node.get("title") or name,
                    "help": child.get("description") or "",
                    "fields": _object_fields(schema, child_node, path, sub or {}, extras),
                    "errors": [],
                }
            )
        else:
            spec = _field(schema, name, child, path, values, extras)
            spec["required"] = name in node.get("required", [])
            out.append(spec)
    for name, value in values.items():
        if name not in props:
            extras.append([[*prefix.split("."), name] if prefix else [name], value])
    return out


def build_form(schema: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """Sections (fieldsets) of field specs for ``values``, plus the keys the form cannot show."""
    extras: list = []
    items = _object_fields(schema, schema, "", values if isinstance(values, dict) else {}, extras)
    run_fields = [f for f in items if f["type"] == "field"]
    sections = []
    if run_fields:
        sections.append(
            {
                "type": "group",
                "path": "",
                "id": "f-run",
                "title": "Run",
                "help": "",
                "fields": run_fields,
                "errors": [],
            }
        )
    sections += [g for g in items if g["type"] == "group"]
    return {"sections": sections, "extra": json.dumps(extras) if extras else ""}


# ----------------------------------------------------------------------------- form data -> config


def _parse_number(text: str, numeric: str, nullable: bool) -> Any:
    text = text.strip()
    if text == "":
        return None if nullable else ""  # the engine reports the missing number at its field
    try:
        if numeric == "integer":
            return int(text)
        return float(text)
    except ValueError:
        try:
            as_float = float(text)
        except ValueError:
            return text
        return int(as_float) if numeric == "integer" and as_float.is_integer() else as_float


def _parse_lines(text: str) -> list[Any]:
    out: list[Any] = []
    for line in text.replace("\r\n", "\n").split("\n"):
        if line.strip() == "":
            continue
        if line.startswith(LINE_QUOTE):
            try:
                out.append(json.loads(line))
                continue
            except json.JSONDecodeError:
                pass
        out.append(line)
    return out


def _parse_mapping(text: str, path: str, problems: list[tuple[str, str]]) -> Any:
    if text.strip() == "":
        return {}
    try:
        value = load_yaml(text)
    except yaml.YAMLError as exc:
        problems.append((path, f"not valid YAML/JSON: {yaml_error_text(exc)}"))
        return text
    return value


def _collect(
    schema: dict[str, Any], node: dict[str, Any], prefix: str, data: Any, problems: list[tuple[str, str]]
) -> dict[str, Any]:
    node = _resolve(schema, node)
    out: dict[str, Any] = {}
    for name, child in node.get("properties", {}).items():
        path = f"{prefix}.{name}" if prefix else name
        if _is_object(schema, child):
            out[name] = _collect(schema, child, path, data, problems)
            continue
        child = _resolve(schema, child)
        child, nullable = _nullable(child)
        kind = child.get("type")
        if "enum" in child:
            raw = data.get(path)
            if raw is None:
                continue
            out[name] = None if (raw == "" and nullable) else _enum_value(raw, child["enum"])
        elif kind == "boolean":
            out[name] = path in data and data.get(path) not in ("", "false", "0", "off")
        elif kind in ("integer", "number"):
            if path in data:
                out[name] = _parse_number(data.get(path), kind, nullable)
        elif kind == "array" and "prefixItems" in child:
            parts = []
            for i, item in enumerate(child["prefixItems"]):
                if f"{path}.{i}" in data:
                    parts.append(_parse_number(data.get(f"{path}.{i}"), item.get("type", "number"), False))
            if parts:
                out[name] = parts
        elif kind == "array" and _is_object(schema, child.get("items", {})):
            indices = sorted(
                {
                    int(m.group(1))
                    for key in data
                    for m in [re.match(re.escape(path) + r"\.(\d+)\.", key)]
                    if m
                }
            )
            out[name] = [_collect(schema, child["items"], f"{path}.{i}", data, problems) for i in indices]
        elif kind == "array":
            if path in data:
                out[name] = _parse_lines(data.get(path))
        elif kind == "object":
            if path in data:
                out[name] = _parse_mapping(data.get(path), path, problems)
        else:
            if path in data:
                raw = data.get(path).replace("\r\n", "\n")
                out[name] = None if (raw == "" and nullable) else raw
    return out


def _enum_value(raw: str, enum: list[Any]) -> Any:
    for option in enum:
        if str(option) == raw:
            return option
    return raw


def _set_path(config: dict[str, Any], parts: list[Any], value: Any) -> None:
    node: Any = config
    for part in parts[:-1]:
        if not isinstance(node, dict | list):
            return
        if isinstance(node, list):  # a row index; a path that is not one (posted by hand) sets nothing
            if not str(part).isdecimal() or int(part) >= len(node):
                return
            node = node[int(part)]
            continue
        child = node.get(part)
        if not isinstance(child, dict | list):
            child = {}
            node[part] = child
        node = child
    last = parts[-1]
    if not isinstance(node, dict | list):
        return
    if isinstance(node, list):
        try:
            idx = int(last)
        except ValueError:
            return
        if idx < len(node):
            node[idx] = value
        else:
            node.append(value)
    else:
        node[last] = value


def parse_form(schema: dict[str, Any], data: Any) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The nested config posted by the form, and problems the form itself found (path, message)."""
    problems: list[tuple[str, str]] = []
    config = _collect(schema, schema, "", data, problems)
    raw_extra = data.get(EXTRA_FIELD) or ""
    if raw_extra:
        try:
            extras = json.loads(raw_extra)
        except json.JSONDecodeError:
            extras = []
        for parts, value in extras if isinstance(extras, list) else []:
            if isinstance(parts, list) and parts:
                _set_path(config, [str(p) for p in parts], value)
    return config, problems


# ----------------------------------------------------------------------------- rows


def add_row(config: dict[str, Any], path: str, template: dict[str, Any]) -> None:
    node = _get(config, path)
    if isinstance(node, list):
        node.append(dict(template))
    else:
        _set_path(config, path.split("."), [dict(template)])


def remove_row(config: dict[str, Any], path: str) -> None:
    list_path, _, index = path.rpartition(".")
    node = _get(config, list_path)
    if isinstance(node, list) and index.isdecimal() and int(index) < len(node):
        del node[int(index)]


def reset_value(config: dict[str, Any], baseline: dict[str, Any], path: str) -> None:
    """Set the value at ``path`` back to the baseline's (a field's "reset to the preset value")."""
    _set_path(config, path.split("."), copy.deepcopy(_get(baseline, path)))


def _get(config: Any, path: str) -> Any:
    node = config
    for part in path.split("."):
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdecimal() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def row_template(schema: dict[str, Any], path: str) -> dict[str, Any]:
    """A new row of the list at ``path``: each item field's default (required strings empty)."""
    node: dict[str, Any] = schema
    for part in path.split("."):
        node = _resolve(schema, node)
        node = node.get("properties", {}).get(part, {})
    node = _resolve(schema, node)
    item = _resolve(schema, node.get("items", {}))
    out: dict[str, Any] = {}
    for name, child in item.get("properties", {}).items():
        child = _resolve(schema, child)
        if "default" in child:
            out[name] = child["default"]
        elif child.get("type") == "string":
            out[name] = ""
    return out


# ----------------------------------------------------------------------------- errors


def normalise_path(path: str) -> str:
    """``config.reward.functions[1].params.x`` -> ``reward.functions.1.params.x``."""
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    if path == "config":
        return ""
    return path.removeprefix("config.")


def _walk(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for item in items:
        yield item
        if item["type"] == "group":
            yield from _walk(item["fields"])
        elif item.get("kind") == "rows":
            for row in item["rows"]:
                yield from _walk(row["fields"])


def attach_errors(form: dict[str, Any], problems: list[tuple[str, str]]) -> list[dict[str, str]]:
    """Put each problem on the field its path names (longest matching field); return the rest.

    Every spec with errors gets ``error_id`` (for ``aria-describedby``)."""
    by_path: dict[str, dict[str, Any]] = {}
    for item in _walk(form["sections"]):
        if item["type"] == "field":
            by_path[item["path"]] = item
            for part in item.get("parts", []):
                by_path[part["name"]] = item
    general = []
    for raw_path, message in problems:
        path = normalise_path(raw_path)
        parts = path.split(".") if path else []
        target = None
        while parts:
            target = by_path.get(".".join(parts))
            if target is not None:
                break
            parts.pop()
        if target is None:
            general.append({"path": path or "config", "message": message})
            continue
        target["errors"].append(message)
        target["error_id"] = target["id"] + "-error"
    return general


def field_errors(form: dict[str, Any]) -> list[dict[str, str]]:
    """Every field with errors, for the summary at the top (links to the inputs)."""
    return [
        {"id": item["id"], "label": item["label"], "path": item["path"], "messages": item["errors"]}
        for item in _walk(form["sections"])
        if item["type"] == "field" and item["errors"]
    ]


# ----------------------------------------------------------------------------- YAML


def yaml_error_text(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return problem


def to_yaml(config: dict[str, Any]) -> str:
    return yaml.safe_dump(config, sort_keys=False, allow_unicode=True, default_flow_style=False, width=100)
