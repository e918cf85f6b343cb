"""Routes of this area of the pages: the new-run page and its editor partial."""

from django.urls import path

from webapp.pages.launch import views

urlpatterns: list = [
    path("projects/<int:project_id>/new/", views.new_run, name="launch-new"),
    path("projects/<int:project_id>/new/editor/", views.editor, name="launch-editor"),
]
