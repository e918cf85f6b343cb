from django.contrib import admin
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.urls import include, path

from webapp.api.api import api


def health(request: HttpRequest) -> JsonResponse:
    """Liveness for load balancers and the run command: the database answers a query."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"status": "ok", "database": connection.vendor})


urlpatterns = [
    path("admin/", admin.site.urls),
    path("health/", health, name="health"),
    path("api/", api.urls),
    path("", include("webapp.pages.urls")),
]
