"""The runs table's rows as HTML, built in Python in one pass per row.

A page has 50 rows of about 20 values each (links, badges, dates, numbers): rendered by the
template's tags one value at a time (a variable lookup through ``row.run...``, a filter, an
escape each), they were the largest part of the page's time after the queries. The markup is
the one ``_runs_results.html`` had, byte for byte; each value is turned into text as a template
variable is (``_text``: local time, localized, then escaped unless safe) and the filters it used
are Django's own functions (``floatformat``, ``date``, ``pluralize``, ``urlencode``).
"""

from __future__ import annotations

from html import escape
from typing import Any

from django.conf import settings
from django.template.defaultfilters import date, floatformat, pluralize, urlencode
from django.utils.formats import localize
from django.utils.html import conditional_escape
from django.utils.safestring import SafeString, mark_safe
from django.utils.timezone import template_localtime

MUTED_DASH = '<span class="muted">—</span>'
CELL = "\n                "  # each cell on its own line, indented as the template had it


def _text(value: Any) -> str:
    """``value`` as ``{{ value }}`` renders it (``django.template.base.render_value_in_context``,
    autoescaping): a plain string is only escaped."""
    if type(value) is str:
        return escape(value)
    if isinstance(value, SafeString):  # what localize and conditional_escape return as it is
        return value
    if type(value) is int and not settings.USE_THOUSAND_SEPARATOR:  # as number_format writes it
        return str(value)
    value = localize(template_localtime(value))
    return conditional_escape(value if isinstance(value, str) else str(value))


def _tags(base: str, tags: Any) -> str:
    if not tags:
        return MUTED_DASH
    return "".join(
        f'<a class="tag" href="{_text(base)}?tag={_text(urlencode(tag, ""))}">{_text(tag)}</a>'
        for tag in tags
    )


def _started(started_at: Any) -> str:
    if not started_at:
        return '<span class="muted">not yet</span>'
    local = template_localtime(started_at)
    return f'<time datetime="{_text(date(local, "c"))}">{_text(date(local, "Y-m-d H:i"))} UTC</time>'


def _reward(row: dict[str, Any]) -> str:
    spark, reward = row["spark"], row["reward"]
    out = f'<span class="spark">{_text(spark)}</span>' if spark else ""
    if reward:
        out += f' <span class="num" title="{_text(reward[0])}">{_text(floatformat(reward[1], 3))}</span>'
    elif not spark:
        out += MUTED_DASH
    return out


def row_html(row: dict[str, Any], base: str) -> SafeString:
    """One run's ``<tr>`` of the table (``views.run_rows``' row: its run, status, alerts, trend,
    fixed metrics and ``cells_html``); ``base`` is the project's address (the tag links')."""
    run, status, alerts = row["run"], row["status"], row["alerts"]
    pk = _text(run.pk)
    message = row["message"]
    title = f' title="{_text(message)}"' if message else ""
    cancelling = (
        ' <span class="muted cancel-note">cancelling…</span>'
        if run.cancel_requested_at and row["active"]
        else ""
    )
    external = (
        ' <span class="badge info run-origin" title="Trained by the user\'s own script, which reports here">external</span>'
        if run.is_external
        else ""
    )
    creator = _text(run.created_by.get_username()) if run.created_by else MUTED_DASH
    accuracy, entropy = row["accuracy"], row["entropy"]
    cells = [
        '<td class="select-col"><input type="checkbox" name="runs" value="'
        f'{pk}" form="bulk-form" class="run-select" aria-label="Select {_text(run.name)}"></td>',
        f'<td class="run-name"><a href="{_text(run.get_absolute_url())}">{_text(run.name)}</a>{external}</td>',
        f'<td class="run-status"><span class="badge {_text(status.badge)}" data-role="status-badge"{title}>'
        f"{_text(status.label)}</span>{cancelling}"
        f'<span class="badge danger alert-count" data-role="alert-count" data-count="{_text(alerts)}" '
        f'title="Health alerts: see the run page"{"" if alerts else " hidden"}>'
        f"{_text(alerts)} alert{_text(pluralize(alerts))}</span></td>",
        f'<td class="hide-narrow">{creator}</td>',
        f'<td class="hide-narrow run-tags">{_tags(base, run.tags)}</td>',
        f'<td class="hide-narrow run-started">{_started(run.started_at)}</td>',
        f'<td class="run-duration" data-role="duration">{_text(row["duration"] or "—")}</td>',
        f'<td class="num run-step" data-role="last-step">{_text(run.last_step)}</td>',
        f'<td class="run-reward">{_reward(row)}</td>',
        '<td class="num run-accuracy">'
        + (
            f'<span title="{_text(accuracy[0])}">{_text(floatformat(accuracy[1], 3))}</span>'
            if accuracy
            else MUTED_DASH
        )
        + "</td>",
        '<td class="num hide-narrow run-entropy">'
        + (_text(floatformat(entropy[1], 3)) if entropy else MUTED_DASH)
        + "</td>",
        str(row["cells_html"]),
    ]
    return mark_safe(
        f'<tr id="run-row-{pk}" data-run-id="{pk}" data-status="{_text(status)}" '
        f'data-started-at="{_text(row["started_ts"])}" data-finished-at="{_text(row["finished_ts"])}">'
        + CELL
        + CELL.join(cells)
        + "\n              </tr>"
    )  # every value escaped by ``_text``; the rest is this module's markup
