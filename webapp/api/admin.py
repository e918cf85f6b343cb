from django.contrib import admin

from webapp.api.models import ApiToken


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Tokens are issued by their owners (POST /api/tokens); here an operator sees and revokes them."""

    list_display = ["prefix", "name", "user", "created_at", "last_used_at", "revoked_at"]
    list_filter = ["revoked_at"]
    search_fields = ["name", "prefix", "user__username"]
    list_select_related = ["user"]
    raw_id_fields = ["user"]
    readonly_fields = ["prefix", "key_hash", "created_at", "last_used_at"]

    def has_add_permission(self, request: object) -> bool:
        return False  # the plaintext must reach its owner: create tokens through the API
