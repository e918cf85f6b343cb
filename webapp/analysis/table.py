"""The runs table's chosen columns, filters and grouping, as database expressions (issue 18).

A column is a spec string, the same in the URL, in the saved view (``TableView``) and in the page:

- ``config:<dotted path>`` — a value of the run's config (``config:algorithm.clip_ratio_high``),
  read from the run's ``ConfigValue`` rows (one LEFT JOIN on their unique index (run, key) per
  path a filter, the sort or a group reads), never from the config JSON, so sorting, filtering and
  grouping happen in the query on indexed rows;
- ``last:<metric>``, ``min:<metric>``, ``max:<metric>`` — a field of the run's ``MetricSummary``
  for that metric, joined once per metric name (``FilteredRelation``: a LEFT JOIN on the
  summaries' unique index (run, name)), never computed from the points per request.

A filter (``where``) is ``<spec>|<op>|<value>``: numeric comparisons (``lt le gt ge eq``) on metric
columns; ``eq`` (the text, or the JSON value it reads as: ``8`` finds 8 and "8"), ``is`` (exactly
one JSON value: ``"8"``, ``[1,2]``, ``null``; or ``#`` and a value's digest, for a value longer
than a filter's 200 characters: what a group's link uses), ``contains`` (the value's text,
case-insensitive) and ``missing`` on config columns. Everything the user sends is parsed into these
shapes and reaches the database only as bound parameters of expressions Django builds: a key path
is checked by ``config_keys.path_problem``, a metric name is any 1-200 characters without control
characters or ``|``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import connection
from django.db.models import Avg, Count, Exists, F, FilteredRelation, Max, Min, Q, QuerySet, Subquery

from webapp.analysis import config_keys
from webapp.analysis.models import ConfigValue, MetricSummary, TableView

CONFIG = "config"
STATS = ("last", "min", "max")
KINDS = (CONFIG, *STATS)
MAX_METRIC = 200
MAX_COLUMNS = 16
MAX_GROUP_BY = 3
MAX_WHERE = 8
MAX_WHERE_VALUE = 200
METRIC_OPS = {"lt": "lt", "le": "lte", "gt": "gt", "ge": "gte", "eq": "exact"}
CONFIG_OPS = ("eq", "contains", "missing")  # the filter form's; ``is`` is a group's link's
EXACT = "is"
OP_LABELS = {
    "lt": "<",
    "le": "≤",
    "gt": ">",
    "ge": "≥",
    "eq": "=",
    "is": "=",
    "contains": "contains",
    "missing": "is not set",
}
CATALOG_RUNS = 100
"""The metric picker lists the metric names of the project's latest runs, this many (the config
key picker lists every key of the project's runs, a probe per key: ``catalog``)."""


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
        if self.op == "missing":
            shown = ""
        elif self.op == EXACT and config_keys.is_digest(self.value):
            shown = f" the group's value ({self.value[:9]})"
        else:
            shown = f" {self.value}"
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
    problem = config_keys.path_problem(path)
    if problem:
        raise TableSpecError(f"{param}: {_shown(path)} {problem}")
    return tuple(path.split("."))


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
    elif op == EXACT:
        if not config_keys.is_digest(value):
            try:
                json.loads(value)
            except ValueError:
                raise TableSpecError(
                    f"where: {_shown(value)} is not a JSON value: write the value as JSON "
                    '("grpo", 8, true, null, [1,2]), or use eq to match the text'
                ) from None
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


def _config_join(path: str) -> FilteredRelation:
    """The run's ``ConfigValue`` row at ``path`` (a LEFT JOIN on the unique index (run, key), made
    only where a filter, the sort or a group reads it)."""
    return FilteredRelation("config_values", condition=Q(config_values__key=path))


def unknown(project_id: int, runs: QuerySet[Any], state: TableState) -> dict[tuple[str, str], str]:
    """The config key paths and metric names of the state that no run of ``runs`` (the project's)
    has, each ``("config" | "metric", key)`` with the reason, in one query (an EXISTS each)."""
    checks: dict[str, Any] = {}
    reasons: dict[str, tuple[tuple[str, str], str]] = {}
    paths = _unique([c.key for c in state.columns if c.kind == CONFIG] + state.group_by)
    metrics = _unique(c.key for c in state.columns if c.is_metric)
    for i, path in enumerate(paths):
        checks[f"k{i}"] = Exists(ConfigValue.objects.filter(key=path, project_id=project_id))
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


def annotate(runs: QuerySet[Any], state: TableState, *, sort: str | None = None) -> QuerySet[Any]:
    """``runs`` with each chosen column named (``col0``...: a metric's value selected; a config
    column's ``ConfigValue`` row as the relation ``col0``, joined only when read), filtered by the
    state's filters. One LEFT JOIN on the summaries per metric name, whatever the stats shown.

    With ``sort`` (a page of runs ordered by it, not groups), a metric is joined only when the
    sort or a filter reads it: the page's cells are read apart for its own runs (``cell_values``),
    not joined for every run the filters leave before the page is cut (a join per metric name
    and run: most of the 10-column table's query, and of its planning)."""
    # One ``annotate`` and one ``filter``: each call copies the query, and a copy per column and
    # filter was a noticeable part of a 10-column page's time. The relations come first in the
    # dict: Django adds them in order, before the values that read them.
    if sort is not None:
        read = {sort.removeprefix("-"), *(w.column.spec for w in state.wheres)}
    relations: dict[str, Any] = {}
    values: dict[str, Any] = {}
    joins: dict[str, str] = {}
    for i, column in enumerate(state.columns):
        alias = f"col{i}"
        if column.kind == CONFIG:
            # A row's cell is read with the page's other cells (``cell_values``): one query for
            # the page, whatever the number of runs filtered or sorted.
            relations[alias] = _config_join(column.key)
            continue
        if sort is not None and column.spec not in read:
            continue
        join = joins.get(column.key)
        if join is None:
            join = joins[column.key] = f"summary{len(joins)}"
            condition = Q(metric_summaries__name=column.key)
            relations[join] = FilteredRelation("metric_summaries", condition=condition)
        values[alias] = F(f"{join}__{column.kind}")
    if relations or values:
        runs = runs.annotate(**relations, **values)
    if state.wheres:
        runs = runs.filter(*(_condition(state, where) for where in state.wheres))
    return runs


def _condition(state: TableState, where: Where) -> Q:
    alias = state.alias(where.column)
    if where.column.is_metric:
        return Q(**{f"{alias}__{METRIC_OPS[where.op]}": float(where.value)})
    if where.op == "missing":
        return Q(**{f"{alias}__id__isnull": True})
    if where.op == "contains":
        return Q(**{f"{alias}__text__icontains": where.value})
    if where.op == EXACT:
        digest = where.value[1:] if config_keys.is_digest(where.value) else None
        if digest is None:
            digest = config_keys.typed(json.loads(where.value)).digest
        return Q(**{f"{alias}__digest": digest})
    # eq: the text, or the JSON value it reads as: one probe of the (key, digest) index.
    return Q(**{f"{alias}__digest__in": config_keys.loose_digests(where.value)})


def _value_order(relation: str, descending: bool) -> list[Any]:
    """A config value's order: numbers by value, then the rest by text; no value last."""
    fields = [F(f"{relation}__number"), F(f"{relation}__text")]
    return [f.desc(nulls_last=True) if descending else f.asc(nulls_last=True) for f in fields]


def sort_fields(state: TableState, sort: str) -> tuple[Any, ...] | None:
    """The ORDER BY of a sort by a chosen column (``[-]<spec>``), runs without a value last;
    None when ``sort`` is not a chosen column."""
    descending = sort.startswith("-")
    spec = sort[1:] if descending else sort
    for i, column in enumerate(state.columns):
        if column.spec == spec:
            if column.kind == CONFIG:
                return (*_value_order(f"col{i}", descending), "-id")
            expr = F(f"col{i}")
            first = expr.desc(nulls_last=True) if descending else expr.asc(nulls_last=True)
            return (first, "-id")
    return None


def grouped(runs: QuerySet[Any], state: TableState, sort: str) -> QuerySet[Any]:
    """One row per combination of the group keys' values: for key ``i`` its value's ``g{i}_kind``,
    ``g{i}_digest``, ``g{i}_text``, ``g{i}_number`` (all None where runs lack the key), ``n``
    (runs), and for each metric column its mean, min and max over the group (``col0_mean``...).

    A group is a value (kind and digest): ``8`` and ``8.0`` are one group, shown by one of their
    texts; ``"8"`` is another."""
    relations = {f"group{i}": _config_join(path) for i, path in enumerate(state.group_by)}
    keys: dict[str, Any] = {}
    spelled: dict[str, Any] = {}
    for i in range(len(state.group_by)):
        keys[f"g{i}_kind"] = F(f"group{i}__kind")
        keys[f"g{i}_digest"] = F(f"group{i}__digest")
        spelled[f"g{i}_text"] = Min(f"group{i}__text")
        spelled[f"g{i}_number"] = Min(f"group{i}__number")
    aggregates: dict[str, Any] = {"n": Count("id"), **spelled}
    for i, column in enumerate(state.columns):
        if column.is_metric:
            aggregates[f"col{i}_mean"] = Avg(f"col{i}")
            aggregates[f"col{i}_min"] = Min(f"col{i}")
            aggregates[f"col{i}_max"] = Max(f"col{i}")
    rows = runs.annotate(**relations).values(**keys).annotate(**aggregates)
    order: list[Any] = []
    descending = sort.startswith("-")
    spec = sort[1:] if descending else sort
    for i, column in enumerate(state.columns):
        if column.spec == spec and column.is_metric:
            mean = F(f"col{i}_mean")
            order.append(mean.desc(nulls_last=True) if descending else mean.asc(nulls_last=True))
    for i in range(len(state.group_by)):
        order.extend([F(f"g{i}_number").asc(nulls_last=True), F(f"g{i}_text").asc(nulls_last=True)])
    return rows.order_by(*order)


def group_value(row: Mapping[str, Any], i: int) -> Any:
    """Group key ``i``'s value of a ``grouped`` row, as Python (None: not set, or null)."""
    return config_keys.decoded(row.get(f"g{i}_kind"), row.get(f"g{i}_text"))


def group_shown(row: Mapping[str, Any], i: int) -> str:
    """Group key ``i``'s value as the group's row shows it."""
    kind = row.get(f"g{i}_kind")
    if kind is None:
        return "not set"
    return shown(kind, row[f"g{i}_text"])


def group_filters(state: TableState, row: Mapping[str, Any]) -> list[str]:
    """The ``where`` filters that select one group's runs (its link and its expanded list):
    ``missing`` where the runs lack the key, else ``is`` and the value's JSON text (a string
    stays a string, ``null`` is null, an object or list compares as JSON), or the value's
    ``#digest`` when its text is longer than a filter's value may be."""
    out = []
    for i, path in enumerate(state.group_by):
        kind = row.get(f"g{i}_kind")
        if kind is None:
            out.append(f"{CONFIG}:{path}|missing|")
            continue
        text = row[f"g{i}_text"]
        exact = config_keys.json_text(kind, text)
        if len(text) >= config_keys.TEXT_CHARS or len(exact) > MAX_WHERE_VALUE:
            exact = "#" + row[f"g{i}_digest"]
        out.append(f"{CONFIG}:{path}|{EXACT}|{exact}")
    return out


def cell_values(run_ids: list[int], state: TableState) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """The chosen columns' values of the page's runs: ``(run_id, path) -> (kind, text)`` for the
    config columns, ``(run_id, stat, metric) -> (value,)`` for the metric columns a run has
    logged. A query through the unique index (run, key) for the config values and one through
    (run, name) for the summaries, whatever the number of runs and columns."""
    paths = _unique(c.key for c in state.columns if c.kind == CONFIG)
    metrics = _unique(c.key for c in state.columns if c.is_metric)
    out: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    if not run_ids:
        return out
    if paths:
        rows = ConfigValue.objects.filter(run_id__in=run_ids, key__in=paths).values_list(
            "run_id", "key", "kind", "text"
        )
        out.update(((run_id, key), (kind, text)) for run_id, key, kind, text in rows)
    if metrics:
        summaries = MetricSummary.objects.filter(run_id__in=run_ids, name__in=metrics).values_list(
            "run_id", "name", *STATS
        )
        for run_id, name, *stats in summaries:
            out.update(((run_id, stat, name), (value,)) for stat, value in zip(STATS, stats, strict=True))
    return out


def shown(kind: str | None, text: str) -> str:
    """A stored config value as a cell shows it (``""`` for none)."""
    if kind is None:
        return ""
    if kind == config_keys.NUM:
        value = config_keys.decoded(kind, text)
        if isinstance(value, float):
            return f"{value:.6g}"
    return text if len(text) <= 80 else text[:77] + "..."


# --- the pickers ----------------------------------------------------------------------------


def config_key_list(project_id: int) -> list[str]:
    """The leaf key paths of the project's runs, sorted: one query that skips through the index
    on (project, key) of leaves, a probe per distinct key (a recursive CTE: PostgreSQL and
    SQLite have no skip scan of their own), so it costs the number of keys, not of runs."""
    table_name = connection.ops.quote_name(ConfigValue._meta.db_table)
    leaf = "leaf" if connection.vendor == "postgresql" else "leaf = 1"
    sql = (
        "WITH RECURSIVE keys(k) AS ("
        f" SELECT MIN(key) FROM {table_name} WHERE project_id = %s AND {leaf}"
        " UNION ALL"
        f" SELECT (SELECT MIN(key) FROM {table_name} WHERE project_id = %s AND {leaf} AND key > keys.k)"
        " FROM keys WHERE keys.k IS NOT NULL"
        ") SELECT k FROM keys WHERE k IS NOT NULL"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [project_id, project_id])
        return [row[0] for row in cursor.fetchall()]


def catalog(project_id: int, runs: QuerySet[Any]) -> tuple[list[str], list[str]]:
    """The config key paths (leaves) of the project's runs and the metric names of its latest
    ``CATALOG_RUNS`` runs: what the pickers list (two queries)."""
    latest = runs.order_by("-created_at", "-id")
    recent_ids = Subquery(latest.values("pk")[:CATALOG_RUNS])
    names = (
        MetricSummary.objects.filter(run_id__in=recent_ids)
        .values_list("name", flat=True)
        .distinct()
        .order_by("name")
    )
    return config_key_list(project_id), list(names)
