"""Routes of this area of the pages: the rollout browser partial, for members and share links."""

from django.urls import path

from webapp.pages.rollouts import views

urlpatterns: list = [
    path("runs/<int:run_id>/rollouts/", views.run_rollouts, name="run-rollouts"),
    path("share/<str:token>/rollouts/", views.shared_rollouts, name="shared-rollouts"),
]
