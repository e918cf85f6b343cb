from django.contrib import admin

from webapp.teams.models import Invite, Membership, Project, Team


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["name", "slug", "allow_user_code", "created_at"]
    list_filter = ["allow_user_code"]
    search_fields = ["name", "slug"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [MembershipInline]


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ["name", "team", "slug", "created_at", "archived_at"]
    list_filter = ["team"]
    search_fields = ["name", "slug"]
    prepopulated_fields = {"slug": ["name"]}


@admin.register(Invite)
class InviteAdmin(admin.ModelAdmin):
    """Invites are made on the team page (the link is shown once there); here they are only read."""

    list_display = ["team", "role", "note", "created_by", "created_at", "expires_at", "used_by", "revoked_at"]
    list_filter = ["team", "role"]
    search_fields = ["note", "team__name"]
    readonly_fields = [f.name for f in Invite._meta.fields]

    def has_add_permission(self, request: object) -> bool:
        return False
