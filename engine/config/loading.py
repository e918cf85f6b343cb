"""From text to a validated RunConfig: YAML/JSON files, presets, ``--set`` overrides and errors that
name the field and the fix; and the JSON Schema that drives the browser form."""

from __future__ import annotations

import copy
import difflib
import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from engine.config.presets import PRESETS
from engine.config.run import RunConfig


class _Yaml12Loader(yaml.SafeLoader):
    """YAML with YAML 1.2 booleans: only true/false, so ``progress: off`` stays the string 'off'."""


_Yaml12Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Yaml12Loader)


class ConfigError(ValueError):
    """A config that does not validate; ``problems`` lists ``(path, message)`` pairs."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "config") -> None:
        self.problems = problems
        self.source = source
        lines = "\n".join(f"  {path}: {msg}" for path, msg in problems)
        super().__init__(f"{source} has {len(problems)} problem(s):\n{lines}")


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Merge ``override`` into a copy of ``base``; nested dicts merge, everything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"a.b=3"`` -> (["a", "b"], 3); the value is parsed as YAML (numbers, bools, lists)."""
    if "=" not in item:
        raise ConfigError([("--set", f"'{item}' is not KEY=VALUE (e.g. trainer.total_steps=20)")])
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError([("--set", f"'{item}' has an empty key")])
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = copy.deepcopy(data)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[path[-1]] = value
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON mapping; errors name the file and the problem."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            [(str(p), "file not found (give a YAML/JSON file or a preset name: " + ", ".join(PRESETS) + ")")]
        )
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else load_yaml(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            [(str(p), f"not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}")]
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([(str(p), f"top level must be a mapping, got {type(data).__name__}")])
    return data


def resolve_preset(data: dict[str, Any]) -> dict[str, Any]:
    """Apply ``data["preset"]`` (if any) underneath the given values."""
    preset = data.get("preset")
    if preset is None:
        return data
    if preset not in PRESETS:
        raise ConfigError([("preset", f"unknown preset '{preset}'; use one of {', '.join(PRESETS)}")])
    return deep_merge(PRESETS[preset], data)


def build_config(data: dict[str, Any], source: str = "config", *, reward_policy: Any = None) -> RunConfig:
    """Validate a raw mapping (after presets and overrides) into a RunConfig or raise ConfigError.

    ``reward_policy`` (an ``engine.rewards.policy.RewardPolicy``) decides which ``module:function``
    rewards may be named; None takes this process's (the environment's)."""
    data = resolve_preset(data)
    try:
        return RunConfig.model_validate(data, context={"reward_policy": reward_policy})
    except ValidationError as exc:
        raise ConfigError(describe_errors(exc, data), source) from None


def load_config(source: str, overrides: list[str] | None = None) -> RunConfig:
    """Load a preset name or a YAML/JSON file, apply ``--set`` overrides, validate."""
    if source in PRESETS:
        data: dict[str, Any] = {"preset": source, "name": source}
    else:
        data = read_config_file(source)
    data = apply_overrides(data, overrides or [])
    return build_config(data, source)


# Fields that live elsewhere now: a config that still has one is told where it went.
MOVED_FIELDS = {"trainer.max_staleness": "async.max_staleness"}

FIELD_PREFIX = re.compile(r"^([a-z_]+(?:\.[a-z_]+|\[\d+\])+): (.*)$", re.DOTALL)


def describe_errors(exc: ValidationError, data: dict[str, Any]) -> list[tuple[str, str]]:
    """Turn pydantic errors into ``(dotted.path, message with the fix)`` pairs."""
    problems = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        path = ".".join(loc) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        own = FIELD_PREFIX.match(msg)
        if own and own.group(1).startswith(path if loc else ""):
            # A validator that knows the exact field (reward.functions[1].params.x) names it first.
            path, msg = own.group(1), own.group(2)
        elif err["type"] == "extra_forbidden" and path in MOVED_FIELDS:
            msg = f"moved to {MOVED_FIELDS[path]}: set it there instead"
        elif err["type"] == "extra_forbidden":
            msg = "unknown field" + _did_you_mean(loc)
        elif err["type"] != "missing" and not isinstance(err.get("input"), dict | list):
            msg += f" (got {err['input']!r})"
        problems.append((path, msg))
    return problems


def _did_you_mean(loc: list[str]) -> str:
    model: Any = RunConfig
    for part in loc[:-1]:
        field = (
            model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        )
        if field is None:
            return "; remove it"
        model = field.annotation
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return "; remove it"
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; known fields: {', '.join(model.model_fields)}"


def json_schema() -> dict[str, Any]:
    """The JSON Schema of RunConfig, with the preset names, for the browser form."""
    schema = RunConfig.model_json_schema()
    schema["x-presets"] = {name: deep_merge({}, values) for name, values in PRESETS.items()}
    return schema
