from django.contrib import admin

from webapp.teams.models import Membership, Project, Team


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
    list_display = ["name", "team", "slug", "created_at"]
    list_filter = ["team"]
    search_fields = ["name", "slug"]
    prepopulated_fields = {"slug": ["name"]}
