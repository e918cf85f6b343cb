from __future__ import annotations

from django.conf import settings
from django.db import models
from django.urls import reverse

from webapp.teams.choices import Role


class Team(models.Model):
    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=100, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, through="Membership", related_name="teams")
    allow_user_code = models.BooleanField(
        default=False,
        help_text=(
            "Admins of this team may name their own reward code (package.module:function) in runs; "
            "it runs on the workers, confined. Members never can. Only site administrators set this."
        ),
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        return reverse("team", kwargs={"team_id": self.pk})

    def role_of(self, user: object) -> Role | None:
        """The user's role in this team, or None for an outsider (and for anonymous users)."""
        if not getattr(user, "is_authenticated", False):
            return None
        role = self.memberships.filter(user=user).values_list("role", flat=True).first()
        return Role(role) if role else None

    def allows(self, user: object, role: Role | str) -> bool:
        """True when the user holds ``role`` or a higher one in this team."""
        held = self.role_of(user)
        return held is not None and held.at_least(role)


class Membership(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "team"], name="membership_one_per_user_team")]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"


class Project(models.Model):
    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="projects")
    name = models.CharField(max_length=100)
    slug = models.SlugField(max_length=100)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    archived_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="Set: hidden from the lists (restorable from the team's Archived view); its runs keep their URLs.",
    )

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["team", "slug"], name="project_slug_unique_per_team")]

    def __str__(self) -> str:
        return f"{self.team.slug}/{self.slug}"

    def get_absolute_url(self) -> str:
        return reverse("project", kwargs={"project_id": self.pk})


class Invite(models.Model):
    """A link that lets whoever opens it join ``team`` with ``role``, once, before ``expires_at``.

    Only the SHA-256 of the link's token is stored (``webapp.teams.invites`` makes and checks
    them): the database never holds a working link, so the admin sees it once, when made.
    A used, revoked or expired invite keeps its row (who invited whom, when)."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="invites")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    note = models.CharField(max_length=200, blank=True, help_text="Who it is for (an email address, a name).")
    token_hash = models.CharField(max_length=64, unique=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)
    used_at = models.DateTimeField(null=True, blank=True)
    used_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["team", "used_at", "revoked_at"], name="invite_team_pending")]

    def __str__(self) -> str:
        return f"invite to {self.team} as {self.role}"
