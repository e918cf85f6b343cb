from django.contrib import admin

from webapp.runs.models import Checkpoint, LogLine, Run, RunAttempt


class CheckpointInline(admin.TabularInline):
    model = Checkpoint
    extra = 0
    readonly_fields = ["seq", "step", "path", "bytes", "created_at", "attempt", "superseded"]
    can_delete = False


class AttemptInline(admin.TabularInline):
    """The run's launch and resumes, as recorded (the services write them, never this page)."""

    model = RunAttempt
    fk_name = "run"
    extra = 0
    fields = readonly_fields = [
        "number", "queued_at", "started_at", "ended_at", "worker_host", "from_step", "first_step", "status",
        "first_seq", "last_seq",
    ]  # fmt: skip
    can_delete = False

    def has_add_permission(self, request: object, obj: object = None) -> bool:
        return False


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ["id", "name", "project", "status", "queue", "last_step", "created_at", "worker_host"]
    list_filter = ["status", "queue", "project__team"]
    search_fields = ["name", "notes"]
    list_select_related = ["project", "project__team"]
    raw_id_fields = ["parent", "created_by"]
    # Status changes go through the state machine (services), never a free edit here.
    readonly_fields = [
        "status",
        "status_message",
        "created_at",
        "started_at",
        "finished_at",
        "heartbeat_at",
        "last_step",
        "last_seq",
        "summary",
        "attempt_number",
    ]
    inlines = [AttemptInline, CheckpointInline]


@admin.register(LogLine)
class LogLineAdmin(admin.ModelAdmin):
    list_display = ["run", "seq", "level", "time", "message"]
    list_filter = ["level"]
    raw_id_fields = ["run"]
