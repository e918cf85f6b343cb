"""Routes of this area of the pages: a team (members, projects) and a project's runs table."""

from django.urls import path

from webapp.pages.teams import views

urlpatterns = [
    path("teams/<int:team_id>/", views.team_page, name="team"),
    path("teams/<int:team_id>/members/", views.member_add, name="team-member-add"),
    path("teams/<int:team_id>/members/<int:user_id>/role/", views.member_role, name="team-member-role"),
    path("teams/<int:team_id>/members/<int:user_id>/remove/", views.member_remove, name="team-member-remove"),
    path("teams/<int:team_id>/projects/", views.project_create, name="team-project-create"),
    path("projects/<int:project_id>/", views.project_page, name="project"),
    path("projects/<int:project_id>/cancel/", views.runs_cancel, name="project-runs-cancel"),
    path("projects/<int:project_id>/compare/", views.runs_compare, name="project-runs-compare"),
]
