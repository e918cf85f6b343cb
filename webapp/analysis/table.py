"""The runs table's chosen columns, filters and grouping, as database expressions (issue 18).

A column is a spec string, the same in the URL, in the saved view (``TableView``) and in the page:

- ``config:<dotted path>`` — a value of the run's config (``config:algorithm.clip_ratio_high``),
  read by the database through JSON key transforms (``->`` on PostgreSQL, ``json_extract`` on
  SQLite), so sorting and filtering happen in the query;
- ``last:<metric>``, ``min:<metric>``, ``max:<metric>`` — a field of the run's ``MetricSummary``
  for that metric, joined once per metric name (``FilteredRelation``: a LEFT JOIN on the
  summaries' unique index (run, name)), never computed from the points per request.

A filter (``where``) is ``<spec>|<op>|<value>``: numeric comparisons (``lt le gt ge eq``) on metric
columns; ``eq`` (the JSON value, or the text), ``contains`` (the value's text, case-insensitive)
and ``missing`` on config columns. Everything the user sends is parsed into these shapes and
reaches the database only as bound parameters of expressions Django builds: a path segment is
checked against ``SEGMENT`` (no ``__``, which Django would read as a lookup), a metric name is
any 1-200 characters without control characters or ``|``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db.models import (
    Avg,
    Count,
    Exists,
    F,
    FilteredRelation,
    Max,
    Min,
    Q,
    QuerySet,
    Subquery,
)
from django.db.models.fields.json import HasKey, KeyTextTransform, KeyTransform

from webapp.analysis.models import MetricSummary, TableView

CONFIG = "config"
STATS = ("last", "min", "max")
KINDS = (CONFIG, *STATS)
SEGMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
MAX_SEGMENTS = 8
MAX_METRIC = 200
MAX_COLUMNS = 16
MAX_GROUP_BY = 3
MAX_WHERE = 8
MAX_WHERE_VALUE = 200
METRIC_OPS = {"lt": "lt", "le": "lte", "gt": "gt", "ge": "gte", "eq": "exact"}
CONFIG_OPS = ("eq", "contains", "missing")
OP_LABELS = {
    "lt": "<",
    "le": "≤",
    "gt": ">",
    "ge": "≥",
    "eq": "=",
    "contains": "contains",
    "missing": "is not set",
}
CATALOG_RUNS = 100
"""The pickers list the config keys and metric names of the project's latest runs, this many:
what a picker offers is read per page load, and a project's runs share their keys."""


class TableSpecError(ValueError):
    """A column, group or filter the table cannot use; the message names the parameter and the fix."""


@dataclass(frozen=True)
class Column:
    kind: str
    key: str

    @property
    def spec(self) -> str:
        return f"{self.kind}:{self.key}"

    @property
    def is_metric(self) -> bool:
        return self.kind in STATS

    @property
    def label(self) -> str:
        return self.key if self.kind == CONFIG else f"{self.key} ({self.kind})"


@dataclass(frozen=True)
class Where:
    column: Column
    op: str
    value: str

    @property
    def text(self) -> str:
        return f"{self.column.spec}|{self.op}|{self.value}"

    @property
    def label(self) -> str:
        shown = "" if self.op == "missing" else f" {self.value}"
        return f"{self.column.label} {OP_LABELS[self.op]}{shown}"


@dataclass
class TableState:
    """What the table shows beyond its fixed columns: chosen columns, grouping, filters."""

    columns: list[Column] = field(default_factory=list)
    group_by: list[str] = field(default_factory=list)
    wheres: list[Where] = field(default_factory=list)

    def specs(self) -> list[str]:
        return [c.spec for c in self.columns]

    def alias(self, column: Column) -> str:
        """The annotation holding ``column``'s value (``col0``...): by position, never user text."""
        return f"col{self.columns.index(column)}"


# --- parsing -------------------------------------------------------------------------------


def parse_path(path: str, param: str = "col") -> tuple[str, ...]:
    path = path.strip()
    segments = tuple(path.split("."))
    if not path or len(segments) > MAX_SEGMENTS or not all(SEGMENT.fullmatch(s) for s in segments):
        raise TableSpecError(
            f"{param}: {_shown(path)} is not a config key path: dotted names of letters, digits, '_' "
            f"and '-' (each starting with a letter or '_', at most {MAX_SEGMENTS} parts), "
            "like algorithm.clip_ratio_high or rollout.n"
        )
    if any("__" in s for s in segments):
        raise TableSpecError(f"{param}: {_shown(path)} has '__' in a key, which the table cannot look up")
    return segments


def parse_metric(name: str, param: str = "col") -> str:
    if not name or len(name) > MAX_METRIC or "|" in name or any(ord(ch) < 32 for ch in name):
        raise TableSpecError(
            f"{param}: {_shown(name)} is not a metric name (1-{MAX_METRIC} characters, no '|' or "
            "control characters), like reward/mean"
        )
    return name


def parse_column(spec: str, param: str = "col") -> Column:
    kind, sep, key = spec.partition(":")
    if not sep or kind not in KINDS:
        raise TableSpecError(
            f"{param}: {_shown(spec)} is not a column: use config:<key path> (config:rollout.n) or "
            "last:, min:, max: and a metric name (last:reward/mean)"
        )
    if kind == CONFIG:
        return Column(CONFIG, ".".join(parse_path(key, param)))
    return Column(kind, parse_metric(key, param))


def parse_where(text: str) -> Where:
    spec, _, rest = text.partition("|")
    op, sep, value = rest.partition("|")
    column = parse_column(spec, "where")
    if not sep and op != "missing":
        raise TableSpecError(
            f"where: {_shown(text)} is not a filter: write <column>|<op>|<value>, like last:reward/mean|gt|0.5"
        )
    if len(value) > MAX_WHERE_VALUE:
        raise TableSpecError(f"where: the value has {len(value)} characters; at most {MAX_WHERE_VALUE}")
    if column.is_metric:
        if op not in METRIC_OPS:
            raise TableSpecError(
                f"where: {_shown(op)} does not compare a metric: use one of {', '.join(METRIC_OPS)}"
            )
        number = _number(value)
        if number is None:
            raise TableSpecError(f"where: {column.label} compares with a number, not {_shown(value)}")
        value = repr(number)
    elif op not in CONFIG_OPS:
        raise TableSpecError(
            f"where: {_shown(op)} does not apply to a config value: use one of {', '.join(CONFIG_OPS)}"
        )
    return Where(column, op, "" if op == "missing" else value)


def _number(text: str) -> float | None:
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _shown(value: str) -> str:
    return repr(value if len(value) <= 60 else value[:57] + "...")


def _unique(items: Iterable[Any]) -> list[Any]:
    return list(dict.fromkeys(items))


def state_from_query(query: Mapping[str, Any], saved: TableView | None) -> tuple[TableState, bool]:
    """The table's state from the query string (``col``, ``group``, ``where``; a key present
    names the state even when empty) or else the saved view, with the query's actions applied
    (``add_kind``+``add_key``, ``drop``, ``add_group``, ``drop_group``, ``where_col``+``where_op``+
    ``where_val``, ``drop_where``). Returns the state and whether the URL or an action chose it
    (then it is saved as the user's view). Raises ``TableSpecError``."""
    getlist = query.getlist  # type: ignore[attr-defined]
    stated = "col" in query or "group" in query
    if stated:
        specs = [s for s in getlist("col") if s]
        groups = [g for g in getlist("group") if g]
    else:
        specs = list(saved.columns) if saved else []
        groups = list(saved.group_by) if saved else []
    if not isinstance(specs, list) or not isinstance(groups, list):
        specs, groups = [], []
    acted = False
    if query.get("add_key", "").strip():
        kind = query.get("add_kind", CONFIG)
        specs.append(parse_column(f"{kind}:{query['add_key'].strip()}", "add_key").spec)
        acted = True
    dropped = query.get("drop", "")
    if dropped:
        specs = [s for s in specs if s != dropped]
        acted = True
    if query.get("add_group", "").strip():
        groups.append(query["add_group"].strip())
        acted = True
    if query.get("drop_group"):
        groups = [g for g in groups if g != query["drop_group"]]
        acted = True
    columns = _unique(parse_column(str(s)) for s in specs)
    if len(columns) > MAX_COLUMNS:
        raise TableSpecError(f"col: {len(columns)} columns; the table shows at most {MAX_COLUMNS}: drop some")
    group_by = _unique(".".join(parse_path(str(g), "group")) for g in groups)
    if len(group_by) > MAX_GROUP_BY:
        raise TableSpecError(f"group: at most {MAX_GROUP_BY} config keys to group by, got {len(group_by)}")
    wheres_text = [w for w in getlist("where") if w]
    if query.get("where_col"):
        wheres_text.append(f"{query['where_col']}|{query.get('where_op', '')}|{query.get('where_val', '')}")
    if query.get("drop_where"):
        wheres_text = [w for w in wheres_text if w != query["drop_where"]]
    wheres = _unique(w for w in (parse_where(t) for t in wheres_text) if w.column.spec != dropped)
    if len(wheres) > MAX_WHERE:
        raise TableSpecError(f"where: at most {MAX_WHERE} filters, got {len(wheres)}")
    # A filter's column is shown: it explains which runs are left.
    columns = _unique([*columns, *(w.column for w in wheres)])
    if len(columns) > MAX_COLUMNS:
        raise TableSpecError(f"col: {len(columns)} columns; the table shows at most {MAX_COLUMNS}: drop some")
    return TableState(columns, group_by, wheres), stated or acted


ACTION_KEYS = (
    "add_kind",
    "add_key",
    "drop",
    "add_group",
    "drop_group",
    "where_col",
    "where_op",
    "where_val",
    "drop_where",
)


def has_actions(query: Mapping[str, Any]) -> bool:
    """Whether the query asks for a change (the page then redirects to the canonical URL)."""
    return any(query.get(k) for k in ACTION_KEYS if k not in ("add_kind", "where_op", "where_val"))


def save(user: Any, project_id: int, state: TableState, saved: TableView | None) -> None:
    """Keep the state as the user's view of the project (a write only when it changed)."""
    specs = state.specs()
    if saved is not None and saved.columns == specs and saved.group_by == state.group_by:
        return
    TableView.objects.update_or_create(
        user=user, project_id=project_id, defaults={"columns": specs, "group_by": state.group_by}
    )


# --- expressions ----------------------------------------------------------------------------


def config_value(path: str) -> KeyTransform:
    """The JSON value at ``path`` of a run's config (SQL NULL where a run lacks it)."""
    expr: Any = "config"
    for segment in path.split("."):
        expr = KeyTransform(segment, expr)
    return expr


def config_text(path: str) -> KeyTextTransform:
    *parents, last = path.split(".")
    expr: Any = "config"
    for segment in parents:
        expr = KeyTransform(segment, expr)
    return KeyTextTransform(last, expr)


def _has_config_key(path: str) -> HasKey:
    *parents, last = path.split(".")
    expr: Any = F("config")
    for segment in parents:
        expr = KeyTransform(segment, expr)
    return HasKey(expr, last)


def unknown(runs: QuerySet[Any], state: TableState) -> dict[tuple[str, str], str]:
    """The config key paths and metric names of the state that no run of ``runs`` has, each
    ``("config" | "metric", key)`` with the reason, in one query (an EXISTS each)."""
    checks: dict[str, Any] = {}
    reasons: dict[str, tuple[tuple[str, str], str]] = {}
    paths = _unique([c.key for c in state.columns if c.kind == CONFIG] + state.group_by)
    metrics = _unique(c.key for c in state.columns if c.is_metric)
    for i, path in enumerate(paths):
        checks[f"k{i}"] = Exists(runs.filter(_has_config_key(path)))
        reasons[f"k{i}"] = ((CONFIG, path), f"no run here has the config key {path!r}")
    ids = runs.values("pk")
    for i, name in enumerate(metrics):
        checks[f"m{i}"] = Exists(MetricSummary.objects.filter(name=name, run_id__in=ids))
        reasons[f"m{i}"] = (("metric", name), f"no run here has logged the metric {name!r}")
    if not checks:
        return {}
    found = next(iter(runs.model.objects.annotate(**checks).values(*checks)[:1]), None)
    # No row at all: a database without runs, where every chosen key is unknown.
    return dict(reasons[k] for k in checks if found is None or not found[k])


def without(state: TableState, missing: dict[tuple[str, str], str]) -> TableState:
    """``state`` without the columns, filters and group keys ``unknown`` found missing."""

    def known(column: Column) -> bool:
        return ("metric" if column.is_metric else CONFIG, column.key) not in missing

    return TableState(
        [c for c in state.columns if known(c)],
        [g for g in state.group_by if (CONFIG, g) not in missing],
        [w for w in state.wheres if known(w.column)],
    )


def annotate(runs: QuerySet[Any], state: TableState) -> QuerySet[Any]:
    """``runs`` with each chosen column named (``col0``...; a metric's value selected, a config
    value only aliased), filtered by the state's filters. One LEFT JOIN on the summaries per metric
    name, whatever the stats shown of it."""
    joins: dict[str, str] = {}
    for i, column in enumerate(state.columns):
        alias = f"col{i}"
        if column.kind == CONFIG:
            # Only named, not selected: a filter, the sort or a group reads it in the database;
            # a row's cell is read from the page's own configs (``config_of``), so the database
            # decompresses a large config once per shown run, not once per column and filtered run.
            runs = runs.alias(**{alias: config_value(column.key)})
            continue
        join = joins.get(column.key)
        if join is None:
            join = joins[column.key] = f"summary{len(joins)}"
            condition = Q(metric_summaries__name=column.key)
            runs = runs.annotate(**{join: FilteredRelation("metric_summaries", condition=condition)})
        runs = runs.annotate(**{alias: F(f"{join}__{column.kind}")})
    for where in state.wheres:
        if where.op == "contains":
            text = f"{state.alias(where.column)}_text"
            runs = runs.annotate(**{text: config_text(where.column.key)}).filter(
                **{f"{text}__icontains": where.value}
            )
        else:
            runs = runs.filter(_condition(state, where))
    return runs


def _condition(state: TableState, where: Where) -> Q:
    alias = state.alias(where.column)
    if where.column.is_metric:
        return Q(**{f"{alias}__{METRIC_OPS[where.op]}": float(where.value)})
    if where.op == "missing":
        return Q(**{f"{alias}__isnull": True})
    # eq: the JSON value the text reads as (0.28, true, 8) or the text itself ("grpo"), as one IN
    # (the value is read once from each run's config: reading it is what costs, not comparing).
    values: list[Any] = [where.value]
    try:
        parsed = json.loads(where.value)
    except ValueError:
        parsed = where.value
    if isinstance(parsed, (int, float, bool)) and parsed != where.value:
        values.append(parsed)
    return Q(**{f"{alias}__in": values})


def sort_fields(state: TableState, sort: str) -> tuple[Any, ...] | None:
    """The ORDER BY of a sort by a chosen column (``[-]<spec>``), runs without a value last;
    None when ``sort`` is not a chosen column."""
    descending = sort.startswith("-")
    spec = sort[1:] if descending else sort
    for i, column in enumerate(state.columns):
        if column.spec == spec:
            expr = F(f"col{i}")
            first = expr.desc(nulls_last=True) if descending else expr.asc(nulls_last=True)
            return (first, "-id")
    return None


def grouped(runs: QuerySet[Any], state: TableState, sort: str) -> QuerySet[Any]:
    """One row per combination of the group keys' values: ``g0``..., ``n`` (runs), and for each
    metric column its mean, min and max over the group (``col0_mean``...)."""
    keys = {f"g{i}": config_value(path) for i, path in enumerate(state.group_by)}
    aggregates: dict[str, Any] = {"n": Count("id")}
    for i, column in enumerate(state.columns):
        if column.is_metric:
            aggregates[f"col{i}_mean"] = Avg(f"col{i}")
            aggregates[f"col{i}_min"] = Min(f"col{i}")
            aggregates[f"col{i}_max"] = Max(f"col{i}")
    rows = runs.annotate(**keys).values(*keys).annotate(**aggregates)
    order: list[Any] = []
    descending = sort.startswith("-")
    spec = sort[1:] if descending else sort
    for i, column in enumerate(state.columns):
        if column.spec == spec and column.is_metric:
            mean = F(f"col{i}_mean")
            order.append(mean.desc(nulls_last=True) if descending else mean.asc(nulls_last=True))
    return rows.order_by(*order, *[F(k).asc(nulls_last=True) for k in keys])


def group_filters(state: TableState, row: Mapping[str, Any]) -> list[str]:
    """The ``where`` filters that select one group's runs (its link and its expanded list)."""
    out = []
    for i, path in enumerate(state.group_by):
        value = row.get(f"g{i}")
        if value is None:
            out.append(f"{CONFIG}:{path}|missing|")
        else:
            out.append(f"{CONFIG}:{path}|eq|{value if isinstance(value, str) else json.dumps(value)}")
    return out


def config_of(config: Any, path: str) -> Any:
    """The value at ``path`` of a config (None where it has none), as ``config_value`` reads it."""
    for segment in path.split("."):
        if not isinstance(config, Mapping):
            return None
        config = config.get(segment)
    return config


def shown(value: Any) -> str:
    """A config value as a cell shows it."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    text = json.dumps(value, separators=(",", ":"))
    return text if len(text) <= 80 else text[:77] + "..."


# --- the pickers ----------------------------------------------------------------------------


def _leaf_paths(value: Any, prefix: str, out: set[str], depth: int = 0) -> None:
    if isinstance(value, Mapping) and value and depth < MAX_SEGMENTS:
        for key, inner in value.items():
            if isinstance(key, str) and SEGMENT.fullmatch(key) and "__" not in key:
                _leaf_paths(inner, f"{prefix}.{key}" if prefix else key, out, depth + 1)
    elif prefix:
        out.add(prefix)


def catalog(runs: QuerySet[Any]) -> tuple[list[str], list[str]]:
    """The config key paths (leaves) and metric names of the latest ``CATALOG_RUNS`` runs: what
    the pickers list (two queries)."""
    latest = runs.order_by("-created_at", "-id")
    keys: set[str] = set()
    for config in latest.values_list("config", flat=True)[:CATALOG_RUNS]:
        _leaf_paths(config, "", keys)
    recent_ids = Subquery(latest.values("pk")[:CATALOG_RUNS])
    names = (
        MetricSummary.objects.filter(run_id__in=recent_ids)
        .values_list("name", flat=True)
        .distinct()
        .order_by("name")
    )
    return sorted(keys), list(names)
