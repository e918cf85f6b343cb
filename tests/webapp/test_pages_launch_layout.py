"""The new-run form's layout (issue 15): essentials first, the other sections folded with a count
of values changed from the baseline, per-field marks and resets, and the review step's diff
against the preset or the cloned run, which is what a launch stores.

The pages are read as a browser gets them (``test_pages_launch.form_data``); ``_Layout`` reads
which section each field sits in, which sections are open and what their summaries say.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from engine.config import json_schema
from webapp.pages.launch import layout, review, schema_form
from webapp.runs.models import Run
from webapp.runs.services import validate_run_config
from webapp.teams.models import Project

from .test_pages_launch import editor_html, editor_url, form_data, new_url

ROW_FIELD = re.compile(r"\.\d+\.")  # reward.functions.0.name: a field of a list row
CASES = Path(__file__).resolve().parents[1] / "js" / "launch_diff_cases.json"


class _Layout(HTMLParser):
    """Top-level sections (id -> tag, open, the text of its summary or legend) in order, and each
    field's section, marks and baseline state."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []
        self.fields: dict[str, dict[str, Any]] = {}
        self._section: str | None = None
        self._depth = 0  # how deep the current section's own tag (details or fieldset) is nested
        self._tag = ""
        self._summary: list[str] | None = None

    def handle_starttag(self, tag: str, attrs_list: list[tuple[str, str | None]]) -> None:
        attrs = {k: v or "" for k, v in attrs_list}
        classes = attrs.get("class", "").split()
        if self._section is None and "config-section" in classes and "data-section" in attrs:
            self._section, self._tag, self._depth = attrs["id"], tag, 1
            self.sections[attrs["id"]] = {
                "tag": tag,
                "open": tag == "fieldset" or "open" in attrs,
                "summary": None,
            }
            self.order.append(attrs["id"])
            return
        if self._section is None:
            return
        if tag == self._tag:
            self._depth += 1
        if tag in ("summary", "legend") and self.sections[self._section]["summary"] is None:
            self._summary = []
        if tag == "div" and "field" in classes and "data-kind" in attrs:
            self.fields[attrs["data-path"]] = {
                "section": self._section,
                "changed": "changed" in classes,
                "invalid": "invalid" in classes,
                "baseline": attrs.get("data-baseline"),
            }

    def handle_endtag(self, tag: str) -> None:
        if self._summary is not None and tag in ("summary", "legend"):
            self.sections[self._section]["summary"] = re.sub(r"\s+", " ", "".join(self._summary)).strip()
            self._summary = None
        if self._section is not None and tag == self._tag:
            self._depth -= 1
            if self._depth == 0:
                self._section = None

    def handle_data(self, data: str) -> None:
        if self._summary is not None:
            self._summary.append(data)


def read_layout(html: str) -> _Layout:
    reader = _Layout()
    reader.feed(html)
    return reader


@pytest.fixture
def member_client(member: Any, client_for: Callable[..., Client]) -> Client:
    return client_for(member)


def _all_field_paths() -> list[str]:
    """Every field of the schema's form, leaving out the fields inside list rows."""
    form = schema_form.build_form(json_schema(), validate_run_config({}))
    return [
        spec["path"] for spec in layout.walk_fields(form["sections"]) if not ROW_FIELD.search(spec["path"])
    ]


# --- the layout at first view -----------------------------------------------------------------


def test_essentials_come_first_and_every_other_section_is_folded(
    member_client: Client, project: Project
) -> None:
    page = member_client.get(new_url(project)).content.decode()
    seen = read_layout(page)
    assert seen.order[0] == "f-essentials"
    assert (
        seen.sections["f-essentials"]["tag"] == "fieldset"
        and seen.sections["f-essentials"]["summary"] == "Essentials"
    )
    essentials = [
        p for p, f in seen.fields.items() if f["section"] == "f-essentials" and not ROW_FIELD.search(p)
    ]
    assert essentials == list(layout.ESSENTIALS)
    # Every other section of the schema, and only those, folded, with its title alone (nothing changed).
    rest = seen.order[1:]
    assert rest == ["f-run", "f-model", "f-data", "f-rollout", "f-reward", "f-algorithm", "f-optimizer",
                    "f-trainer", "f-checkpoint", "f-logging", "f-async", "f-replay"]  # fmt: skip
    for section_id in rest:
        assert seen.sections[section_id]["tag"] == "details" and not seen.sections[section_id]["open"], (
            section_id
        )
    assert seen.sections["f-rollout"]["summary"] == "Rollout"
    assert seen.sections["f-async"]["summary"] == "Asynchronous RL"
    # Every field of the schema is on the page once, none marked as changed from the preset.
    assert sorted(p for p in seen.fields if not ROW_FIELD.search(p)) == sorted(_all_field_paths())
    assert not [p for p, f in seen.fields.items() if f["changed"]]
    assert seen.fields["rollout.n"]["section"] == "f-essentials"
    assert seen.fields["rollout.temperature"]["section"] == "f-rollout"
    assert seen.fields["rollout.n"]["baseline"] == "8"
    assert "Values that differ from preset GRPO are marked" in page


def test_changed_values_are_marked_and_counted_per_section(member_client: Client, project: Project) -> None:
    page = member_client.get(new_url(project)).content.decode()
    data = form_data(
        page,
        **{
            "rollout.temperature": "0.7",
            "rollout.top_k": "5",
            "rollout.n": "8.0",  # the same number, spelled otherwise: not a change
            "optimizer.lr": "0.0001",
            "algorithm.kl_loss_coef": "1e-3",  # the preset's 0.001
        },
    )
    del data["algorithm.use_kl_loss"]  # an unticked checkbox is not posted
    html = member_client.post(editor_url(project), {**data, "_action": "none"}).content.decode()
    seen = read_layout(editor_html(html))
    changed = sorted(p for p, f in seen.fields.items() if f["changed"])
    assert changed == ["algorithm.use_kl_loss", "optimizer.lr", "rollout.temperature", "rollout.top_k"]
    assert seen.sections["f-rollout"]["summary"] == "Rollout · 2 changed"
    assert seen.sections["f-algorithm"]["summary"] == "Algorithm · 1 changed"
    assert seen.sections["f-essentials"]["summary"] == "Essentials · 1 changed"
    assert seen.sections["f-optimizer"]["summary"] == "Optimizer"
    # The mark says what the preset had, with a reset of that one field.
    assert re.search(r'from <code class="baseline-value">1\.0</code>\s*<button type="button" class="secondary reset-field" '
                     r'data-reset="rollout.temperature"', html)  # fmt: skip
    assert "Reset Temperature to preset GRPO's value" in html


def test_a_field_resets_to_the_preset_value(member_client: Client, project: Project) -> None:
    page = member_client.get(new_url(project) + "?preset=dapo").content.decode()
    data = form_data(page, **{"rollout.temperature": "0.5", "trainer.total_steps": "7"})
    # The page's script resets a value in place; the server's reset (the editor action a list's reset
    # posts, and the page's own action) puts the baseline's value back too.
    reset = member_client.post(
        new_url(project), {**data, "_action": "reset:rollout.temperature"}
    ).content.decode()
    after = form_data(reset)
    assert after["rollout.temperature"] == "1.0" and after["trainer.total_steps"] == "7"
    seen = read_layout(reset)
    assert sorted(p for p, f in seen.fields.items() if f["changed"]) == ["trainer.total_steps"]
    # A removed reward row comes back with the list's reset.
    removed = member_client.post(editor_url(project), {**data, "_action": "remove:reward.functions.1"})
    seen = read_layout(editor_html(removed.content.decode()))
    assert (
        seen.fields["reward.functions"]["changed"]
        and seen.sections["f-essentials"]["summary"] == "Essentials · 2 changed"
    )
    back = member_client.post(
        editor_url(project),
        {
            **form_data(editor_html(removed.content.decode())),
            "_preset": "dapo",
            "_action": "reset:reward.functions",
        },
    ).content.decode()
    restored = form_data(editor_html(back))
    assert (
        restored["reward.functions.1.name"] == "overlong"
        and restored["reward.functions.1.params"] == '{"buffer_len": 8}'
    )
    assert not read_layout(editor_html(back)).fields["reward.functions"]["changed"]


def test_a_section_with_a_problem_opens_and_opened_sections_stay_open(
    member_client: Client, project: Project
) -> None:
    page = member_client.get(new_url(project)).content.decode()
    # _open is echoed into the page: only section ids are kept.
    opened = 'f-logging "><b>injected</b>'
    data = form_data(page, **{"checkpoint.keep_last": "-1", "_open": opened, "_action": "review"})
    response = member_client.post(new_url(project), data)
    assert response.status_code == 422
    html = response.content.decode()
    seen = read_layout(html)
    assert (
        seen.sections["f-checkpoint"]["open"]
        and seen.sections["f-checkpoint"]["summary"] == "Checkpointing · 1 changed · 1 problem"
    )
    assert seen.sections["f-logging"]["open"]  # the user had opened it
    assert "injected" not in html and 'name="_open" id="open-sections" value="f-logging"' in html
    assert not seen.sections["f-rollout"]["open"]
    assert seen.fields["checkpoint.keep_last"]["invalid"]
    assert '<a href="#f-checkpoint-keep_last">Keep last</a>' in html
    assert 'id="review"' not in html and not Run.objects.exists()


# --- the review step --------------------------------------------------------------------------


def test_review_shows_the_stored_values_against_the_preset_then_launches_them(
    member_client: Client, project: Project
) -> None:
    page = member_client.get(new_url(project)).content.decode()
    data = form_data(
        page, **{"name": "wider", "rollout.n": "4", "optimizer.lr": "2e-4", "data.train_size": "300"}
    )
    response = member_client.post(new_url(project), {**data, "_action": "review"})
    assert response.status_code == 200 and not Run.objects.exists()
    html = response.content.decode()
    rows = re.findall(
        r'<tr data-path="([^"]+)"><th scope="row"><code>[^<]+</code></th><td class="before"[^>]*>([^<]*)</td>'
        r'<td class="after"[^>]*>([^<]*)</td>',
        html,
    )
    assert rows == [
        ("name", "grpo", "wider"),
        ("data.train_size", "50000", "300"),
        ("rollout.n", "8", "4"),
        ("optimizer.lr", "5e-05", "0.0002"),
    ]
    assert "4 values differ from preset GRPO" in html and '<th scope="col">Preset GRPO</th>' in html
    digest = re.search(r'name="_reviewed" value="([0-9a-f]{64})"', html).group(1)
    launched = member_client.post(new_url(project), {**form_data(html), "_action": "launch"})
    assert launched.status_code == 302, launched.content.decode()[:1000]
    run = Run.objects.get()
    assert form_data(html)["_reviewed"] == digest
    baseline = validate_run_config({"preset": "grpo", "name": "grpo"})
    # What was stored is what was reviewed (PostgreSQL's jsonb keeps its own key order).
    stored = review.config_diff(run.config, baseline)
    assert sorted((r["path"], r["before"], r["after"]) for r in stored) == sorted(rows)


def test_a_launch_with_values_edited_after_the_review_is_reviewed_again(
    member_client: Client, project: Project
) -> None:
    page = member_client.get(new_url(project)).content.decode()
    reviewed = member_client.post(new_url(project), form_data(page, _action="review", **{"rollout.n": "4"}))
    data = form_data(reviewed.content.decode(), _action="launch", **{"rollout.n": "6"})
    again = member_client.post(new_url(project), data)
    assert again.status_code == 409 and not Run.objects.exists()
    html = again.content.decode()
    assert "The values changed after the last review" in html
    assert re.search(r'<tr data-path="rollout.n">.*?<td class="after"[^>]*>6</td>', html)
    assert member_client.post(new_url(project), form_data(html, _action="launch")).status_code == 302
    assert Run.objects.get().config["rollout"]["n"] == 6


def test_a_clone_is_compared_with_the_run_it_clones(
    member_client: Client, project: Project, make_run: Any
) -> None:
    config = validate_run_config(
        {"preset": "dr_grpo", "name": "source", "rollout": {"n": 3, "temperature": 0.7}}
    )
    source = make_run(name="source", config=config)
    page = member_client.get(new_url(project) + f"?from={source.pk}").content.decode()
    seen = read_layout(page)
    # Against the run, not the preset: only the new name differs at first.
    assert sorted(p for p, f in seen.fields.items() if f["changed"]) == ["name"]
    assert seen.fields["rollout.temperature"]["baseline"] == "0.7"
    assert "Values that differ from run source are marked" in page
    data = form_data(page, _action="review", **{"rollout.temperature": "0.9"})
    html = member_client.post(new_url(project), data).content.decode()
    rows = re.findall(r'<tr data-path="([^"]+)">', html)
    assert rows == ["name", "rollout.temperature"]
    assert '<th scope="col">Run source</th>' in html and "2 values differ from run source" in html
    assert member_client.post(new_url(project), form_data(html, _action="launch")).status_code == 302
    child = Run.objects.exclude(pk=source.pk).get()
    assert sorted(r["path"] for r in review.config_diff(child.config, source.config)) == sorted(rows)


def test_a_multi_line_text_is_compared_with_its_one_line_baseline(
    member_client: Client, project: Project
) -> None:
    page = member_client.get(new_url(project)).content.decode()
    data = form_data(page, **{"data.system_prompt": "Be brief.\nShow the answer."})
    html = member_client.post(editor_url(project), {**data, "_action": "none"}).content.decode()
    field = read_layout(editor_html(html)).fields["data.system_prompt"]
    assert field["changed"] and field["baseline"] == ""
    assert 'data-reset="data.system_prompt"' in html
    reset = member_client.post(
        new_url(project), {**data, "_action": "reset:data.system_prompt"}
    ).content.decode()
    assert (
        form_data(reset)["data.system_prompt"] == ""
        and not read_layout(reset).fields["data.system_prompt"]["changed"]
    )


def test_the_yaml_view_reviews_too(member_client: Client, project: Project) -> None:
    text = "preset: grpo\nname: from-yaml\ntrainer:\n  total_steps: 3\n"
    response = member_client.post(
        new_url(project), {"_mode": "yaml", "config_yaml": text, "_preset": "grpo", "_action": "review"}
    )
    html = response.content.decode()
    assert response.status_code == 200
    assert re.findall(r'<tr data-path="([^"]+)">', html) == ["name", "trainer.total_steps"]


# --- the rules behind the marks ---------------------------------------------------------------


def test_the_server_compares_input_states_as_the_page_script_does() -> None:
    cases = json.loads(CASES.read_text())["cases"]
    for case in cases:
        assert layout.same_state(case["kind"], case["current"], case["baseline"]) is case["same"], case


def test_config_diff_flattens_rows_and_names_missing_values() -> None:
    before = {"a": 1, "reward": {"functions": [{"name": "task", "weight": 1.0}]}, "stop": ["x"], "gone": 2}
    after = {"a": 1, "reward": {"functions": [{"name": "task", "weight": 2.0}, {"name": "len", "weight": 1.0}]},
             "stop": ["x", "y"], "new": {}}  # fmt: skip
    assert review.config_diff(after, before) == [
        {"path": "reward.functions.0.weight", "before": "1.0", "after": "2.0"},
        {"path": "reward.functions.1.name", "before": "(not set)", "after": "len"},
        {"path": "reward.functions.1.weight", "before": "(not set)", "after": "1.0"},
        {"path": "stop", "before": '["x"]', "after": '["x", "y"]'},
        {"path": "new", "before": "(not set)", "after": "{}"},
        {"path": "gone", "before": "2", "after": "(not set)"},
    ]


@pytest.mark.parametrize(
    "path",
    [
        "",
        "name.x",
        "reward.functions.abc.name",
        "reward.functions.0.name.x.y",
        "reward.functions.²",
        "nope.0",
    ],
)
def test_a_reset_of_a_path_the_form_never_posts_is_harmless(
    member_client: Client, project: Project, path: str
) -> None:
    page = member_client.get(new_url(project)).content.decode()
    response = member_client.post(editor_url(project), form_data(page, _action=f"reset:{path}"))
    assert response.status_code == 200
