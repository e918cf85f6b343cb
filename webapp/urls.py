from django.contrib import admin
from django.db import connection
from django.http import HttpRequest, HttpResponseRedirect, JsonResponse
from django.templatetags.static import static
from django.urls import include, path

from webapp.api.api import api


def health(request: HttpRequest) -> JsonResponse:
    """Liveness for load balancers and the run command: the database answers a query."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"status": "ok", "database": connection.vendor})


def favicon(request: HttpRequest) -> HttpResponseRedirect:
    """Browsers ask for ``/favicon.ico`` on pages that name no icon (the admin's, a JSON
    response opened in a tab): the site's SVG icon, so that request does not end in a 404."""
    return HttpResponseRedirect(static("tributary/favicon.svg"))


urlpatterns = [
    path("admin/", admin.site.urls),
    path("health/", health, name="health"),
    path("favicon.ico", favicon, name="favicon"),
    path("api/", api.urls),
    path("", include("webapp.pages.urls")),
]

# Error pages in the site's layout; JSON under /api/ (webapp.pages.errors).
handler400 = "webapp.pages.errors.bad_request"
handler403 = "webapp.pages.errors.permission_denied"
handler404 = "webapp.pages.errors.page_not_found"
handler500 = "webapp.pages.errors.server_error"
