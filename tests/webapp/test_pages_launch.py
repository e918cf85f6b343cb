"""The new-run page: a form generated from the engine's schema, its YAML view, launching.

The tests read the rendered form the way a browser submits it (``form_data``): every named
input, select and textarea, checkboxes only when checked.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from html.parser import HTMLParser
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from engine.config import PRESETS, load_yaml
from webapp.runs.choices import ParentKind
from webapp.runs.models import Run
from webapp.runs.services import validate_run_config
from webapp.teams.models import Project


class _FormReader(HTMLParser):
    """Named controls inside ``<form id=launch-form>`` as a browser would submit them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.in_form = False
        self.fields: list[tuple[str, str]] = []
        self.attrs_by_id: dict[str, dict[str, str]] = {}
        self._select: str | None = None
        self._select_first: str | None = None
        self._select_chosen = False
        self._option: dict[str, str] | None = None
        self._textarea: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs_list: list[tuple[str, str | None]]) -> None:
        attrs = {k: v or "" for k, v in attrs_list}
        if "id" in attrs:
            self.attrs_by_id[attrs["id"]] = attrs
        if tag == "form" and attrs.get("id") == "launch-form":
            self.in_form = True
        if not self.in_form:
            return
        name = attrs.get("name")
        if tag == "input" and name:
            kind = attrs.get("type", "text")
            if kind in ("checkbox", "radio"):
                if "checked" in attrs:
                    self.fields.append((name, attrs.get("value", "on")))
            elif kind not in ("submit", "button", "file"):
                self.fields.append((name, attrs.get("value", "")))
        elif tag == "select" and name:
            self._select, self._select_first, self._select_chosen = name, None, False
        elif tag == "option" and self._select:
            if self._select_first is None:
                self._select_first = attrs.get("value", "")
            if "selected" in attrs:
                self.fields.append((self._select, attrs.get("value", "")))
                self._select_chosen = True
        elif tag == "textarea" and name:
            self._textarea, self._text = name, []

    def handle_endtag(self, tag: str) -> None:
        if tag == "form" and self.in_form:
            self.in_form = False
        elif tag == "select" and self._select:
            if not self._select_chosen:
                self.fields.append((self._select, self._select_first or ""))
            self._select = None
        elif tag == "textarea" and self._textarea:
            text = "".join(self._text)
            self.fields.append((self._textarea, text[1:] if text.startswith("\n") else text))
            self._textarea = None

    def handle_data(self, data: str) -> None:
        if self._textarea:
            self._text.append(data)


def read_form(html: str) -> _FormReader:
    reader = _FormReader()
    reader.feed(html)
    return reader


def form_data(html: str, **changes: str) -> dict[str, Any]:
    """What the browser posts for this page, with ``changes`` typed in (dotted names)."""
    data: dict[str, Any] = {}
    for name, value in read_form(html).fields:
        data.setdefault(name, value)
    data.update(changes)
    return data


def editor_html(html: str) -> str:
    """A page's editor partial wrapped in the form, as the page holds it after an htmx swap."""
    return f'<form id="launch-form">{html}</form>'


@pytest.fixture
def member_client(member: Any, client_for: Callable[..., Client]) -> Client:
    return client_for(member)


def new_url(project: Project) -> str:
    return f"/projects/{project.pk}/new/"


def editor_url(project: Project) -> str:
    return f"/projects/{project.pk}/new/editor/"


# --- who may launch -------------------------------------------------------------------------


def test_members_and_admins_see_the_form_viewers_403_outsiders_404(
    project: Project, member: Any, admin: Any, viewer: Any, outsider: Any
) -> None:
    for user, status in ((member, 200), (admin, 200), (viewer, 403), (outsider, 404)):
        client = Client()
        client.force_login(user)
        assert client.get(new_url(project)).status_code == status, user.username
        post = client.post(new_url(project), {"_mode": "yaml", "config_yaml": "name: x"})
        assert post.status_code == (302 if status == 200 else status), user.username
    assert Client().get(new_url(project)).status_code == 302  # to the sign-in page
    assert Client().get("/projects/999999/new/").status_code == 302


def test_an_archived_projects_form_says_so_and_launches_nothing(
    member_client: Client, project: Project
) -> None:
    from webapp.teams.projects import archive_project

    archive_project(project)
    page = member_client.get(new_url(project)).content.decode()
    assert 'id="project-archived"' in page and "is archived: restore it" in page
    assert 'id="review-submit" disabled' in page
    body = {"_action": "launch", "name": "late", "config_yaml": "preset: grpo", "mode": "yaml"}
    response = member_client.post(new_url(project), body)
    assert response.status_code == 409 and "is archived" in response.content.decode()
    assert not Run.objects.filter(project=project).exists()


def test_viewer_cannot_post_and_nothing_is_created(project: Project, viewer: Any) -> None:
    client = Client()
    client.force_login(viewer)
    assert client.post(new_url(project), {"_mode": "yaml", "config_yaml": "name: x"}).status_code == 403
    assert client.post(editor_url(project), {"_action": "to_form", "_mode": "yaml"}).status_code == 403
    assert not Run.objects.exists()


# --- the generated form ----------------------------------------------------------------------


def test_the_form_is_generated_from_the_schema(member_client: Client, project: Project) -> None:
    page = member_client.get(new_url(project)).content.decode()
    reader = read_form(page)
    # One folded section per schema section, with the schema's titles (tests/webapp/test_pages_launch_layout.py
    # has the essentials, the folding and the change marks).
    for section, title in (
        ("rollout", "Rollout"),
        ("algorithm", "Algorithm"),
        ("checkpoint", "Checkpointing"),
    ):
        assert re.search(
            rf'<details class="config-section card" id="f-{section}"[^>]*>\s*<summary><span class="section-title">{title}</span>',
            page,
        )
    # Labels tied to inputs, help text from the description, bounds and types from the schema.
    assert '<label for="f-rollout-n">Group size</label>' in page
    n = reader.attrs_by_id["f-rollout-n"]
    assert n["type"] == "number" and n["min"] == "1" and n["max"] == "1024" and n["step"] == "1"
    assert n["aria-describedby"] == "f-rollout-n-help"
    assert 'id="f-rollout-n-help">Completions sampled per prompt (G in GRPO).' in page
    assert reader.attrs_by_id["f-optimizer-lr"]["step"] == "any"
    assert reader.attrs_by_id["f-model-gradient_checkpointing"]["type"] == "checkbox"
    assert '<select id="f-algorithm-loss_agg_mode" name="algorithm.loss_agg_mode"' in page
    assert '<option value="seq-mean-token-sum-norm">' in page
    # Nested objects are nested fieldsets; reward functions are repeatable rows.
    assert 'id="f-algorithm-filter_groups"' in page and "<legend>Dynamic sampling</legend>" in page
    assert 'name="reward.functions.0.name" value="task"' in page
    assert 'id="f-reward-functions-add"' in page
    # Defaults are shown (the grpo preset is the default start).
    data = form_data(page)
    assert data["rollout.n"] == "8" and data["algorithm.loss_agg_mode"] == "seq-mean-token-mean"
    assert data["queue"] == "auto" and data["_mode"] == "form"


def test_a_preset_re_renders_with_its_values(member_client: Client, project: Project) -> None:
    page = member_client.get(new_url(project) + "?preset=dapo").content.decode()
    data = form_data(page)
    assert data["algorithm.clip_ratio_high"] == "0.28"
    assert data["algorithm.filter_groups.enable"] == "true"
    assert data["reward.functions.1.name"] == "overlong"
    assert data["reward.functions.1.params"] == '{"buffer_len": 8}'
    assert 'data-preset="dapo" aria-current="true"' in page
    assert member_client.get(new_url(project) + "?preset=nope").status_code == 404


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_submits_unchanged_into_a_valid_run(
    member_client: Client, project: Project, preset: str
) -> None:
    page = member_client.get(new_url(project) + f"?preset={preset}").content.decode()
    response = member_client.post(new_url(project), form_data(page, _action="launch"))
    assert response.status_code == 302, response.content.decode()[:2000]
    run = Run.objects.get()
    assert response["Location"] == f"/runs/{run.pk}/"
    expected = validate_run_config({"preset": preset, "name": preset.replace("_", "-")})
    assert run.config == expected
    assert run.queue == "cpu" and run.project == project and run.name == preset.replace("_", "-")


def test_launch_fields_name_queue_tags_notes(member_client: Client, project: Project, member: Any) -> None:
    page = member_client.get(new_url(project)).content.decode()
    data = form_data(page, name="my-run", queue="gpu", tags="baseline, ablation, baseline", notes="first try")
    response = member_client.post(new_url(project), data)
    assert response.status_code == 302
    run = Run.objects.get()
    assert (run.name, run.queue, run.tags, run.notes) == (
        "my-run",
        "gpu",
        ["baseline", "ablation"],
        "first try",
    )
    assert run.created_by == member and run.config["name"] == "my-run"


# --- errors at their field -------------------------------------------------------------------


def test_bad_values_are_shown_at_their_fields_and_nothing_is_queued(
    member_client: Client, project: Project
) -> None:
    page = member_client.get(new_url(project)).content.decode()
    data = form_data(
        page,
        **{
            "rollout.n": "0",
            "optimizer.lr": "",
            "reward.functions.0.name": "no_such_reward",
            "trainer.ppo_mini_batch_size": "5",
            "queue": "bad queue!",
        },
    )
    response = member_client.post(new_url(project), data)
    assert response.status_code == 422
    assert not Run.objects.exists()
    html = response.content.decode()
    reader = read_form(html)
    for field_id in (
        "f-rollout-n",
        "f-optimizer-lr",
        "f-reward-functions-0-name",
        "f-trainer-ppo_mini_batch_size",
    ):
        attrs = reader.attrs_by_id[field_id]
        assert attrs.get("aria-invalid") == "true", field_id
        assert f"{field_id}-error" in attrs["aria-describedby"].split(), field_id
        assert f'id="{field_id}-error"' in html
    error = re.search(r'id="f-rollout-n-error">([^<]*)<', html)
    assert error and "greater than or equal to 1" in error.group(1)
    assert re.search(r'id="f-trainer-ppo_mini_batch_size-error">[^<]*must divide', html)
    assert re.search(r'id="f-reward-functions-0-name-error">[^<]*no_such_reward', html)
    assert reader.attrs_by_id["f-queue"].get("aria-invalid") == "true"
    assert 'id="error-summary"' in html and 'href="#f-rollout-n"' in html
    # What the user typed is kept.
    kept = form_data(html)
    assert kept["rollout.n"] == "0" and kept["reward.functions.0.name"] == "no_such_reward"


def test_problems_without_a_field_are_shown_at_the_top(member_client: Client, project: Project) -> None:
    yaml_text = "name: x\nrollout:\n  n: 4\n  typo_field: 3\n"
    response = member_client.post(new_url(project), {"_mode": "yaml", "config_yaml": yaml_text})
    assert response.status_code == 422 and not Run.objects.exists()
    html = response.content.decode()
    assert 'class="general-error" data-path="rollout.typo_field"' in html
    assert "did you mean" in html or "unknown field" in html
    # The same config in the form: the unknown key is kept (not silently dropped) and reported at the top.
    form = member_client.post(
        editor_url(project), {"_action": "to_form", "_mode": "yaml", "config_yaml": yaml_text}
    )
    data = form_data(editor_html(form.content.decode()), _action="launch")
    assert data["rollout.n"] == "4"
    again = member_client.post(new_url(project), data)
    assert again.status_code == 422 and "rollout.typo_field" in again.content.decode()
    assert not Run.objects.exists()


def test_cross_field_problem_is_shown_at_the_field_it_names(member_client: Client, project: Project) -> None:
    page = member_client.get(new_url(project)).content.decode()
    data = form_data(page, **{"data.source": "jsonl", "data.path": "/data/train.jsonl"})
    html = member_client.post(new_url(project), data).content.decode()
    assert re.search(r'id="f-model-path-error">[^<]*set a model directory', html)
    assert not Run.objects.exists()


# --- YAML view -------------------------------------------------------------------------------


def test_form_to_yaml_and_back_round_trips_the_config(member_client: Client, project: Project) -> None:
    page = member_client.get(new_url(project) + "?preset=dapo").content.decode()
    data = form_data(
        page, **{"rollout.stop": '</answer>\n"\\n\\n"', "data.system_prompt": "Think.\nThen answer."}
    )
    as_yaml = member_client.post(editor_url(project), {**data, "_action": "to_yaml"})
    assert as_yaml.status_code == 200
    reader = read_form(editor_html(as_yaml.content.decode()))
    fields = dict(reader.fields)
    assert fields["_mode"] == "yaml"
    config = load_yaml(fields["config_yaml"])
    expected = validate_run_config({"preset": "dapo", "name": "dapo"})
    expected["rollout"]["stop"] = ["</answer>", "\n\n"]
    expected["data"]["system_prompt"] = "Think.\nThen answer."
    assert config == expected
    # ... and back to the form, which posts the same config again.
    back = member_client.post(editor_url(project), {**fields, "_action": "to_form"})
    form = form_data(editor_html(back.content.decode()))
    assert form["_mode"] == "form" and form["rollout.stop"] == '</answer>\n"\\n\\n"'
    again = member_client.post(editor_url(project), {**form, "_action": "to_yaml"})
    assert load_yaml(dict(read_form(editor_html(again.content.decode())).fields)["config_yaml"]) == expected


def test_partial_yaml_fills_the_form_with_its_preset_and_defaults(
    member_client: Client, project: Project
) -> None:
    text = "preset: gspo\nname: short\nrollout:\n  n: 4\n"
    back = member_client.post(
        editor_url(project), {"_mode": "yaml", "config_yaml": text, "_action": "to_form"}
    )
    data = form_data(editor_html(back.content.decode()))
    assert data["algorithm.policy_loss"] == "gspo" and data["algorithm.clip_ratio_high"] == "0.0004"
    assert data["rollout.n"] == "4" and data["trainer.total_steps"] == "200"


def test_yaml_syntax_error_is_shown_with_its_line(member_client: Client, project: Project) -> None:
    text = "name: x\nrollout:\n  n: 4\n   top_p: [1\n"
    response = member_client.post(
        editor_url(project), {"_mode": "yaml", "config_yaml": text, "_action": "to_form"}
    )
    html = response.content.decode()
    assert response.status_code == 200 and 'data-mode="yaml"' in html
    message = re.search(r'id="yaml-error"[^>]*>([^<]*)<', html)
    assert message and "YAML syntax error at line 4" in message.group(1)
    assert 'aria-invalid="true" aria-describedby="yaml-error"' in html
    assert "   top_p: [1" in html  # the text is kept for fixing
    launch = member_client.post(new_url(project), {"_mode": "yaml", "config_yaml": text})
    assert launch.status_code == 422 and "YAML syntax error at line 4" in launch.content.decode()
    assert not Run.objects.exists()
    not_mapping = member_client.post(
        editor_url(project), {"_mode": "yaml", "config_yaml": "- 1\n", "_action": "to_form"}
    )
    assert "top level must be a mapping" in not_mapping.content.decode()


def test_yaml_mode_launches(member_client: Client, project: Project) -> None:
    text = "preset: rloo\nname: from-yaml\ntrainer:\n  total_steps: 7\n"
    response = member_client.post(new_url(project), {"_mode": "yaml", "config_yaml": text, "queue": "cpu"})
    assert response.status_code == 302
    run = Run.objects.get()
    assert run.name == "from-yaml" and run.config["trainer"]["total_steps"] == 7
    assert run.config["algorithm"]["adv_estimator"] == "rloo"


def test_import_and_export_yaml(member_client: Client, project: Project) -> None:
    upload = SimpleUploadedFile(
        "mine.yaml", b"name: imported\nrollout:\n  n: 2\n", content_type="application/x-yaml"
    )
    response = member_client.post(
        editor_url(project), {"_mode": "form", "_action": "import", "config_file": upload}
    )
    fields = dict(read_form(editor_html(response.content.decode())).fields)
    assert fields["_mode"] == "yaml" and fields["config_yaml"] == "name: imported\nrollout:\n  n: 2\n"
    bad = SimpleUploadedFile("bad.yaml", b"name: [x\n")
    bad_response = member_client.post(
        editor_url(project), {"_mode": "yaml", "_action": "import", "config_file": bad}
    )
    assert "YAML syntax error at line 2" in bad_response.content.decode()
    missing = member_client.post(editor_url(project), {"_mode": "yaml", "_action": "import"})
    assert "Choose a YAML file" in missing.content.decode()

    page = member_client.get(new_url(project) + "?preset=cispo").content.decode()
    export = member_client.post(new_url(project), form_data(page, _action="export"))
    assert export.status_code == 200 and export["Content-Disposition"] == 'attachment; filename="cispo.yaml"'
    assert load_yaml(export.content.decode()) == validate_run_config({"preset": "cispo", "name": "cispo"})
    assert not Run.objects.exists()


def test_reward_rows_can_be_added_and_removed(member_client: Client, project: Project) -> None:
    page = member_client.get(new_url(project)).content.decode()
    added = member_client.post(editor_url(project), form_data(page, _action="add:reward.functions"))
    html = editor_html(added.content.decode())
    data = form_data(
        html,
        **{
            "reward.functions.1.name": "format",
            "reward.functions.1.weight": "0.5",
            "reward.functions.1.params": "regex: '[0-9]+'",
        },
    )
    assert data["reward.functions.1.weight"] == "0.5"
    removed = member_client.post(editor_url(project), {**data, "_action": "remove:reward.functions.0"})
    data = form_data(editor_html(removed.content.decode()), _action="launch")
    assert data["reward.functions.0.name"] == "format" and "reward.functions.1.name" not in data
    assert member_client.post(new_url(project), data).status_code == 302
    assert Run.objects.get().config["reward"]["functions"] == [
        {"name": "format", "weight": 0.5, "params": {"regex": "[0-9]+"}}
    ]


# --- clone ----------------------------------------------------------------------------------


def test_clone_prefills_the_runs_config_and_records_the_fork(
    member_client: Client, project: Project, make_run: Any
) -> None:
    config = validate_run_config(
        {"preset": "dr_grpo", "name": "source", "rollout": {"n": 3, "temperature": 0.7}}
    )
    source = make_run(name="source", config=config, tags=["baseline"], queue="gpu")
    page = member_client.get(new_url(project) + f"?from={source.pk}").content.decode()
    assert 'id="clone-source"' in page
    data = form_data(page)
    assert data["rollout.n"] == "3" and data["rollout.temperature"] == "0.7"
    assert data["name"] == "source-fork" and data["queue"] == "gpu" and data["tags"] == "baseline"
    response = member_client.post(new_url(project), data)
    assert response.status_code == 302
    child = Run.objects.exclude(pk=source.pk).get()
    assert child.config == {**config, "name": "source-fork"}
    assert child.parent == source and child.parent_kind == ParentKind.FORK


def test_clone_needs_a_run_the_user_can_see(
    member_client: Client, project: Project, other_team: Any, django_user_model: Any
) -> None:
    hidden_project = Project.objects.create(team=other_team, name="Secret", slug="secret")
    hidden = Run.objects.create(project=hidden_project, name="secret", config=validate_run_config({}))
    assert member_client.get(new_url(project) + f"?from={hidden.pk}").status_code == 404
    assert member_client.get(new_url(project) + "?from=abc").status_code == 404
    assert member_client.post(new_url(project), {"_from": str(hidden.pk), "_mode": "yaml"}).status_code == 404


def test_user_text_is_escaped(member_client: Client, project: Project) -> None:
    text = 'name: "<script>alert(1)</script>"\nnotes_typo: "<b>x</b>"\n'
    html = member_client.post(
        editor_url(project), {"_mode": "yaml", "config_yaml": text, "_action": "to_form"}
    ).content.decode()
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;" in html
    assert "<b>x</b>" not in html
