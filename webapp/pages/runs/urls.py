"""Routes of this area of the pages: a run, its actions, share links, compare."""

from django.urls import path

from webapp.pages.runs import compare, logs, manage, views

urlpatterns = [
    path("runs/<int:run_id>/", views.run_page, name="run"),
    path("runs/<int:run_id>/header/", views.run_header, name="run-header"),
    path("runs/<int:run_id>/config.json", views.run_config_json, name="run-config-json"),
    path("runs/<int:run_id>/logs/engine.log", logs.full_log, name="run-full-log"),
    path("runs/<int:run_id>/logs/output.json", logs.output_json, name="run-output-json"),
    path("runs/<int:run_id>/cancel/", views.run_cancel, name="run-cancel"),
    path("runs/<int:run_id>/resume/", views.run_resume, name="run-resume"),
    path("runs/<int:run_id>/meta/", views.run_meta, name="run-meta"),
    path("runs/<int:run_id>/rename/", manage.run_rename, name="run-rename"),
    path("runs/<int:run_id>/archive/", manage.run_archive, name="run-archive"),
    path("runs/<int:run_id>/restore/", manage.run_restore, name="run-restore"),
    path("runs/<int:run_id>/delete/", manage.run_delete, name="run-delete"),
    path("runs/<int:run_id>/shares/", views.share_create, name="run-share-create"),
    path("runs/<int:run_id>/shares/<int:share_id>/revoke/", views.share_revoke, name="run-share-revoke"),
    path("share/<str:token>/", views.share_page, name="share"),
    path("share/<str:token>/header/", views.share_header, name="share-header"),
    path("share/<str:token>/config.json", views.share_config_json, name="share-config-json"),
    path("compare/", compare.compare_page, name="compare"),
    path("compare/parts/", compare.compare_parts, name="compare-parts"),
    path("compare/search.json", compare.compare_search, name="compare-search"),
]
