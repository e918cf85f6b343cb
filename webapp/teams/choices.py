from django.db import models


class Role(models.TextChoices):
    """A member's role in a team. Each role can do everything the ones before it can."""

    VIEWER = "viewer", "Viewer"  # sees the team's projects and runs
    MEMBER = "member", "Member"  # also launches, cancels, forks, resumes, renames and archives runs
    ADMIN = "admin", "Admin"  # also manages members, invites, the team's name, projects; deletes runs

    @property
    def rank(self) -> int:
        return _RANK[self]

    def at_least(self, other: "Role | str") -> bool:
        return self.rank >= Role(other).rank


_RANK = {Role.VIEWER: 0, Role.MEMBER: 1, Role.ADMIN: 2}
