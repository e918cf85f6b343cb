"""Routes of this area of the pages: a team (members, projects, invites), a new team, an invite
link, and a project's runs table and settings."""

from django.urls import path

from webapp.pages.teams import join, manage, views

urlpatterns = [
    path("teams/create/", manage.team_new, name="team-new"),
    path("teams/<int:team_id>/", views.team_page, name="team"),
    path("teams/<int:team_id>/rename/", manage.team_rename, name="team-rename"),
    path("teams/<int:team_id>/members/", views.member_add, name="team-member-add"),
    path("teams/<int:team_id>/members/<int:user_id>/role/", views.member_role, name="team-member-role"),
    path("teams/<int:team_id>/members/<int:user_id>/remove/", views.member_remove, name="team-member-remove"),
    path("teams/<int:team_id>/projects/", views.project_create, name="team-project-create"),
    path("teams/<int:team_id>/projects/archived/", manage.archived_projects, name="team-archived-projects"),
    path("teams/<int:team_id>/invites/", manage.invite_create, name="team-invite-create"),
    path(
        "teams/<int:team_id>/invites/<int:invite_id>/revoke/", manage.invite_revoke, name="team-invite-revoke"
    ),
    path("invites/<str:token>/", join.invite_page, name="invite"),
    path("projects/<int:project_id>/", views.project_page, name="project"),
    path("projects/<int:project_id>/rename/", manage.project_rename, name="project-rename"),
    path("projects/<int:project_id>/archive/", manage.project_archive, name="project-archive"),
    path("projects/<int:project_id>/restore/", manage.project_restore, name="project-restore"),
    path("projects/<int:project_id>/cancel/", views.runs_cancel, name="project-runs-cancel"),
    path("projects/<int:project_id>/compare/", views.runs_compare, name="project-runs-compare"),
]
