"""The signed-in user's settings: personal API tokens and the password.

Tokens are made and revoked by ``webapp.api.services``, the path ``/api/tokens`` takes too. A
new token's secret crosses one redirect in the server-side session and is removed from it by
the page that shows it, so it is shown once and a reload shows it no more; that page is never
cached. The password form is Django's own ``PasswordChangeView`` (the validators of
``AUTH_PASSWORD_VALIDATORS``; the session stays signed in). Every form is a plain POST and a
redirect, with CSRF protection; a token id that is not the user's is a 404.
"""

from __future__ import annotations

from datetime import date, datetime, time, timedelta
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.contrib.auth.forms import PasswordChangeForm
from django.contrib.messages.views import SuccessMessageMixin
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse_lazy
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET, require_POST

from webapp.api import services
from webapp.api.models import ApiToken

NEW_TOKEN_KEY = "settings:new-token"  # the session key the secret crosses the redirect under
TEMPLATE = "pages/settings/settings.html"


class TokenForm(forms.Form):
    name = forms.CharField(
        max_length=services.NAME_MAX,
        label="Name",
        help_text="What the token is for (a script, a machine).",
    )
    expires_on = forms.DateField(
        required=False,
        label="Expires on",
        help_text="Optional: the token works until the end of this day (UTC). Empty: until revoked.",
        widget=forms.DateInput(attrs={"type": "date"}, format="%Y-%m-%d"),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["expires_on"].widget.attrs["min"] = timezone.localdate().isoformat()

    def clean_expires_on(self) -> date | None:
        day = self.cleaned_data["expires_on"]
        if day is not None and day < timezone.localdate():
            raise forms.ValidationError("This day has passed: pick today or a later day, or leave it empty.")
        return day

    def expires_at(self) -> datetime | None:
        day = self.cleaned_data.get("expires_on")
        if day is None:
            return None
        return datetime.combine(day + timedelta(days=1), time.min, tzinfo=timezone.get_current_timezone())


class PasswordForm(PasswordChangeForm):
    """Django's form without its autofocus: on this page the first thing is the tokens, and
    the browser must not scroll away from a new token's secret to the password fields."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["old_password"].widget.attrs.pop("autofocus", None)


def _context(request: HttpRequest, **forms_: Any) -> dict[str, Any]:
    return {
        "tokens": list(services.tokens_of(request.user)),
        "token_form": forms_.get("token_form") or TokenForm(),
        "password_form": forms_.get("password_form") or PasswordForm(request.user),
    }


@never_cache
@login_required
@require_GET
def settings_page(request: HttpRequest) -> HttpResponse:
    """The tokens and the password form; right after a token was made, its secret, this once."""
    new_token = request.session.pop(NEW_TOKEN_KEY, None)
    return render(request, TEMPLATE, {**_context(request), "new_token": new_token})


@login_required
@require_POST
def token_create(request: HttpRequest) -> HttpResponse:
    form = TokenForm(request.POST)
    if form.is_valid():
        try:
            token, secret = services.create_token(request.user, form.cleaned_data["name"], form.expires_at())
        except services.TokenRefused as exc:
            form.add_error("expires_on" if exc.field == "expires_at" else exc.field, str(exc))
        else:
            request.session[NEW_TOKEN_KEY] = {"id": token.pk, "name": token.name, "secret": secret}
            return redirect("settings")
    return render(request, TEMPLATE, _context(request, token_form=form), status=400)


@login_required
@require_POST
def token_revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    try:
        token = services.revoke_token(request.user, token_id)
    except ApiToken.DoesNotExist:
        raise Http404(f"You have no API token {token_id}.") from None
    messages.success(request, f"Revoked the token {token.name!r} ({token.prefix}…): it no longer works.")
    return redirect("settings")


class PasswordChange(SuccessMessageMixin, auth_views.PasswordChangeView):
    """Django's view (signed-in only, CSRF, keeps the session), rendered in the settings page."""

    form_class = PasswordForm
    template_name = TEMPLATE
    success_url = reverse_lazy("settings")
    success_message = "Your password was changed; you stay signed in here."

    def get(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return redirect("settings")

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        return {**context, **_context(self.request, password_form=context["form"])}

    def form_invalid(self, form: PasswordForm) -> HttpResponse:
        response = super().form_invalid(form)
        response.status_code = 400
        return response
