"""Routes of this area of the pages: a run, its actions, share links, compare."""

from django.urls import path

from webapp.pages.runs import views

urlpatterns = [
    path("runs/<int:run_id>/", views.run_page, name="run"),
    path("runs/<int:run_id>/header/", views.run_header, name="run-header"),
    path("runs/<int:run_id>/config.json", views.run_config_json, name="run-config-json"),
    path("runs/<int:run_id>/cancel/", views.run_cancel, name="run-cancel"),
    path("runs/<int:run_id>/resume/", views.run_resume, name="run-resume"),
    path("runs/<int:run_id>/meta/", views.run_meta, name="run-meta"),
    path("runs/<int:run_id>/shares/", views.share_create, name="run-share-create"),
    path("runs/<int:run_id>/shares/<int:share_id>/revoke/", views.share_revoke, name="run-share-revoke"),
    path("share/<str:token>/", views.share_page, name="share"),
    path("share/<str:token>/header/", views.share_header, name="share-header"),
    path("share/<str:token>/config.json", views.share_config_json, name="share-config-json"),
    path("compare/", views.compare, name="compare"),
]
