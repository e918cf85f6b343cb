"""A small populated world for the fuzzing tests (``test_malformed_input``, ``test_schemathesis``):
a team whose admin holds an API token, a project, a run with metrics, samples, a checkpoint, a
log line and share links, so that requests with real ids reach the views' deeper paths."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from webapp.api.models import ApiToken
from webapp.runs.models import Checkpoint, LogLine, MetricPoint, Run, Sample, ShareLink
from webapp.runs.services import validate_run_config
from webapp.teams.choices import Role
from webapp.teams.invites import create_invite
from webapp.teams.models import Membership, Project, Team

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class World:
    team: Team
    admin: Any
    member: Any
    project: Project
    run: Run
    checkpoint: Checkpoint
    share: ShareLink  # live: its token is used in URLs
    spare_share: ShareLink  # its id is the one a crawl may revoke
    token: str  # the admin's API token (plaintext)
    spare_token_id: int  # another token of the admin's: the one a crawl may revoke
    invite_id: int  # a pending invite of the team: the one a crawl may revoke

    def ids(self) -> dict[str, Any]:
        """Values for the URL patterns' parameters, by name."""
        return {
            "team_id": self.team.pk,
            "project_id": self.project.pk,
            "run_id": self.run.pk,
            "user_id": self.member.pk,
            "share_id": self.spare_share.pk,
            "token_id": self.spare_token_id,
            "invite_id": self.invite_id,
            "token": self.share.token,
        }


def build_world(django_user_model: Any, *, steps: int = 6) -> World:
    team = Team.objects.create(name="Fuzz", slug="fuzz")
    admin = django_user_model.objects.create_user(username="fuzz-admin")
    member = django_user_model.objects.create_user(username="fuzz-member")
    Membership.objects.create(user=admin, team=team, role=Role.ADMIN)
    Membership.objects.create(user=member, team=team, role=Role.MEMBER)
    project = Project.objects.create(team=team, name="Fuzzed", slug="fuzzed")
    config = validate_run_config({"preset": "grpo", "name": "fuzzed-run", "trainer": {"total_steps": 50}})
    run = Run.objects.create(
        project=project, created_by=admin, name="fuzzed-run", config=config, tags=["base"]
    )
    seq = 0
    for step in range(1, steps + 1):
        seq += 1
        for name, value in (("reward/mean", step / 10), ("actor/entropy", 1 / step)):
            MetricPoint.objects.create(
                run=run, name=name, step=step, value=value, time=T0 + timedelta(seconds=step), seq=seq
            )
        seq += 1
        Sample.objects.bulk_create(
            Sample(run=run, step=step, seq=seq, index=i, prompt=f"What is {step}+{i}?",
                   completion=f"It is {step + i}.", reward=float(i), advantage=0.5, length=4 + i,
                   finish_reason="stop", extra={"group": 0})
            for i in range(3)
        )  # fmt: skip
    checkpoint = Checkpoint.objects.create(run=run, seq=seq + 1, step=steps, path="/tmp/ckpt", bytes=1)
    LogLine.objects.create(run=run, seq=seq + 2, level="info", message="hello", time=T0)
    Run.objects.filter(pk=run.pk).update(
        status="succeeded", last_step=steps, last_seq=seq + 2, summary={"reward/mean": steps / 10}
    )
    run.refresh_from_db()
    share = ShareLink.create(run, admin)
    spare_share = ShareLink.create(run, admin)
    _, token = ApiToken.issue(admin, "fuzz")
    spare, _ = ApiToken.issue(admin, "spare")
    invite, _ = create_invite(team, admin, Role.MEMBER, "fuzz")
    return World(
        team, admin, member, project, run, checkpoint, share, spare_share, token, spare.pk, invite.pk
    )
