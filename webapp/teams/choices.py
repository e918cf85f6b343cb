from django.db import models


class Role(models.TextChoices):
    """A member's role in a team. Each role can do everything the ones before it can."""

    VIEWER = "viewer", "Viewer"  # sees the team's projects and runs
    MEMBER = "member", "Member"  # also launches, cancels, forks and resumes runs
    ADMIN = "admin", "Admin"  # also manages members and projects

    @property
    def rank(self) -> int:
        return _RANK[self]

    def at_least(self, other: "Role | str") -> bool:
        return self.rank >= Role(other).rank


_RANK = {Role.VIEWER: 0, Role.MEMBER: 1, Role.ADMIN: 2}
