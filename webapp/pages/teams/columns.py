"""The runs table's chosen columns and grouping as the project page renders them.

The queries are ``webapp.analysis.table``'s; here the state becomes header cells (sort and drop
links), row cells and group rows. A column is dropped, a group key added, a filter added by plain
GET forms and links (``add_key``, ``drop``, ...): the page applies the action, saves the view and
redirects to the canonical URL, so everything works without JavaScript.
"""

from __future__ import annotations

from collections.abc import Callable
from html import escape
from typing import Any

from django.utils.safestring import SafeString, mark_safe

from webapp.analysis import table
from webapp.analysis.table import TableState

EMPTY_CELL = '<span class="muted">—</span>'


def headers(state: TableState, query: Callable[..., str], sort: str) -> list[dict[str, Any]]:
    """Each chosen column's header: label, sort link (htmx) and state, drop link."""
    out = []
    for column in state.columns:
        if sort == column.spec:
            aria, next_sort = "ascending", f"-{column.spec}"
        elif sort == f"-{column.spec}":
            aria, next_sort = "descending", column.spec
        else:
            # Metrics highest first (reward, accuracy); config values in reading order.
            aria, next_sort = "none", f"-{column.spec}" if column.is_metric else column.spec
        out.append(
            {
                "spec": column.spec,
                "label": column.key,
                "kind": column.kind,
                "metric": column.is_metric,
                "aria": aria,
                "sort_url": query(sort=next_sort, page=None),
                # Dropping the column sorted by falls back to the default order.
                "drop_url": query(page=None, drop=column.spec, sort=None if aria != "none" else sort),
            }
        )
    return out


def _number(value: Any) -> str:
    return "" if value is None else f"{value:.4g}"


def run_cells(
    state: TableState, run: Any, values: dict[tuple[Any, ...], tuple[Any, ...]]
) -> list[dict[str, Any]]:
    """A run's chosen cells, from ``values`` (``table.cell_values`` of the page)."""
    cells = []
    for column in state.columns:
        if column.is_metric:
            (value,) = values.get((run.pk, column.kind, column.key), (None,))
            cell = {"text": _number(value), "title": "" if value is None else repr(value), "num": True}
        else:
            kind, text = values.get((run.pk, column.key), (None, ""))
            shown = table.shown(kind, text)
            cell = {"text": shown, "title": text if shown != text else "", "num": kind == "num"}
        cells.append({**cell, "label": column.label})
    return cells


def cells_html(cells: list[dict[str, Any]]) -> SafeString:
    """A run's chosen cells as its table row shows them: built here in one pass rather than by the
    template's tags cell by cell (a page of 50 runs and 10 columns has 500 cells, and the
    template's per-cell tags were a noticeable part of its time). Text escaped as the template's
    (``html.escape``, which Django's ``escape`` is; called directly, as ``format_html`` per cell
    cost as much again as the rest of the row)."""
    parts = []
    for cell in cells:
        css = "chosen-col num" if cell["num"] else "chosen-col"
        title = f' title="{escape(str(cell["title"]))}"' if cell["title"] else ""
        text = escape(str(cell["text"])) if cell["text"] else EMPTY_CELL
        parts.append(f'<td class="{css}"{title}>{text}</td>')
    return mark_safe("".join(parts))  # every text escaped above


def group_rows(
    state: TableState, rows: list[dict[str, Any]], query: Callable[..., str]
) -> list[dict[str, Any]]:
    """Each group: its key values, run count, per metric column the mean (min-max in the title),
    the link to its runs (no JavaScript) and the URL of its expanded list (htmx)."""
    out = []
    for row in rows:
        wheres = table.group_filters(state, row)
        cells = []
        for i, column in enumerate(state.columns):
            if not column.is_metric:
                cells.append({"text": "", "title": "", "num": False})
                continue
            mean, lo, hi = row[f"col{i}_mean"], row[f"col{i}_min"], row[f"col{i}_max"]
            cells.append(
                {
                    "text": _number(mean),
                    "range": f"{_number(lo)}–{_number(hi)}" if mean is not None else "",
                    "title": f"mean over the group's runs; min {lo!r}, max {hi!r}"
                    if mean is not None
                    else "",
                    "num": True,
                }
            )
        here_where = [w.text for w in state.wheres]
        out.append(
            {
                "keys": [
                    {
                        "path": path,
                        "text": table.group_shown(row, i),
                    }
                    for i, path in enumerate(state.group_by)
                ],
                "n": row["n"],
                "cells": cells,
                "runs_url": query(page=None, group=[], where=[*here_where, *wheres], sort=None),
                "expand_url": query(page=None, where=[*here_where, *wheres], fragment="group"),
            }
        )
    return out


def where_choices(state: TableState) -> dict[str, Any]:
    """The filter form's choices: the chosen columns and the operators for each kind."""
    return {
        "columns": [{"spec": c.spec, "label": c.label, "metric": c.is_metric} for c in state.columns],
        "metric_ops": [(op, table.OP_LABELS[op]) for op in table.METRIC_OPS],
        "config_ops": [(op, table.OP_LABELS[op]) for op in table.CONFIG_OPS],
    }
