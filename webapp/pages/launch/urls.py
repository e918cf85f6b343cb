"""Routes of this area of the pages."""

urlpatterns: list = []
