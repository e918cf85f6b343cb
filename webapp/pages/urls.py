"""The pages. Each area keeps its routes in its own module."""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.urls import include, path

from webapp.pages import home, imports, settings, workers

urlpatterns = [
    path("", home.home, name="home"),
    path("home/runs/", home.home_runs, name="home-runs"),
    path("login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("workers/", workers.workers, name="workers"),
    path("settings/", settings.settings_page, name="settings"),
    path("settings/tokens/", settings.token_create, name="settings-token-create"),
    path("settings/tokens/<int:token_id>/revoke/", settings.token_revoke, name="settings-token-revoke"),
    path("settings/password/", settings.PasswordChange.as_view(), name="settings-password"),
    path("projects/<int:project_id>/import/verl/", imports.import_verl, name="project-import-verl"),
    path("", include("webapp.pages.teams.urls")),
    path("", include("webapp.pages.runs.urls")),
    path("", include("webapp.pages.launch.urls")),
    path("", include("webapp.pages.rollouts.urls")),
]
