"""Forms of the team pages (members, projects, invites, a new team), the invite sign-up and the
runs table's filters."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import UserCreationForm
from django.utils.text import slugify

from webapp.runs.choices import RunStatus
from webapp.teams import invites, services
from webapp.teams.choices import Role
from webapp.teams.models import Project, Team

DEFAULT_SORT = "-created_at"
PAGE_SIZE = 50


class AddMemberForm(forms.Form):
    username = forms.CharField(max_length=150, label="Username")
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER, label="Role")

    def __init__(self, *args: Any, team: Team, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.team = team
        self.user: Any = None

    def clean_username(self) -> str:
        username = self.cleaned_data["username"].strip()
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise forms.ValidationError(
                f"No user is called {username!r}: check the spelling (usernames are exact)."
            )
        if self.team.memberships.filter(user=user).exists():
            raise forms.ValidationError(f"{username} is already in this team: change their role in the list.")
        self.user = user
        return username


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices, label="Role")


class ProjectForm(forms.Form):
    name = forms.CharField(max_length=100, label="Name")
    slug = forms.SlugField(
        max_length=100, required=False, label="Slug", help_text="Leave empty to make one from the name."
    )
    description = forms.CharField(
        required=False, widget=forms.Textarea(attrs={"rows": 2}), label="Description"
    )

    def __init__(self, *args: Any, team: Team, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.team = team

    def clean_name(self) -> str:
        name = self.cleaned_data["name"].strip()
        if not name:
            raise forms.ValidationError("Give the project a name.")
        return name

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if "name" not in data or self.has_error("slug"):
            return data
        slug = data.get("slug") or slugify(data["name"])[:100]
        if not slug:
            self.add_error("slug", "The name has no letters or digits to make a slug from: give one.")
        elif Project.objects.filter(team=self.team, slug=slug).exists():
            self.add_error("slug", f"The team already has a project {slug!r}: choose another slug.")
        data["slug"] = slug
        return data


# Far beyond any table (a million pages of runs), far below a 64-bit OFFSET at any page size.
MAX_PAGE = 1_000_000


class RunFilterForm(forms.Form):
    """The runs table's query string: ``status`` (repeatable), ``tag``, ``q``, ``sort``, ``page``,
    ``archived`` (the archived runs instead of the others). The chosen columns, grouping and
    column filters (``col``, ``group``, ``where``) are ``webapp.analysis.table``'s."""

    status = forms.MultipleChoiceField(choices=RunStatus.choices, required=False, label="Status")
    tag = forms.CharField(max_length=100, required=False, label="Tag")
    q = forms.CharField(max_length=200, required=False, label="Search")
    # A fixed column's key (``selectors.RUN_SORTS``) or a chosen column's spec, checked by the
    # view against the table's columns (``webapp.analysis.table.sort_fields``).
    sort = forms.CharField(max_length=220, required=False, label="Sort")
    page = forms.IntegerField(min_value=1, required=False)
    archived = forms.BooleanField(required=False, label="Archived runs only")

    def clean_sort(self) -> str:
        return self.cleaned_data.get("sort", "").strip() or DEFAULT_SORT

    def clean_page(self) -> int:
        """Past the last page is the last page (the view's ``_page_of``); bounded here first, so
        ``(page - 1) * PAGE_SIZE`` never overflows the database's 64-bit OFFSET (a 500 on
        PostgreSQL for ``page=10**30``)."""
        return min(self.cleaned_data.get("page") or 1, MAX_PAGE)


class TeamNameForm(forms.Form):
    """A new team's name, or a team's new name (``webapp.teams.services.clean_name`` decides)."""

    name = forms.CharField(
        max_length=200, label="Team name", strip=False, error_messages={"required": "Give the team a name."}
    )

    def clean_name(self) -> str:
        try:
            return services.clean_name(self.cleaned_data["name"])
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None


class ProjectNameForm(forms.Form):
    name = forms.CharField(
        max_length=200,
        label="Project name",
        strip=False,
        error_messages={"required": "Give the project a name."},
    )

    def clean_name(self) -> str:
        try:
            return services.clean_name(self.cleaned_data["name"], "project")
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None


class InviteForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER, label="Role")
    note = forms.CharField(
        max_length=invites.NOTE_MAX,
        required=False,
        label="For",
        help_text="Optional: who it is for (an email address, a name), to recognise it in the list.",
    )
    days = forms.IntegerField(
        min_value=1,
        max_value=invites.MAX_DAYS,
        initial=invites.DEFAULT_DAYS,
        label="Expires in (days)",
        error_messages={
            "min_value": "At least 1 day.",
            "max_value": f"At most {invites.MAX_DAYS} days: make a new link later if needed.",
            "invalid": "A whole number of days, e.g. 7.",
            "required": f"How many days the link works, 1 to {invites.MAX_DAYS}.",
        },
    )


class SignUpForm(UserCreationForm):
    """Django's own sign-up form: a free username, the password twice, checked by
    ``AUTH_PASSWORD_VALIDATORS``."""

    class Meta(UserCreationForm.Meta):
        model = get_user_model()
        fields = ("username",)
