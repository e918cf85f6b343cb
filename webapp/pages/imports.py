"""The project page's "Import a verl run": upload a finished verl run's files, get its run.

Its metrics file (verl's ``file`` logger JSONL) and its rollout files (``trainer.rollout_data_dir``:
``<step>.jsonl``, chosen together, or one .zip of them) become an external run
(``webapp.runs.imports``). A live verl run is followed with ``python -m tributary follow``
instead; that is also the way for runs larger than an upload takes.
"""

from __future__ import annotations

import io
import zipfile
from pathlib import PurePosixPath
from typing import Any

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.files.uploadedfile import UploadedFile
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from tributary.integrations.verl import rollout_file_step
from webapp.pages.teams.views import project_or_error
from webapp.runs.imports import import_verl_run
from webapp.runs.services import ProjectArchived
from webapp.teams.choices import Role

MAX_UPLOAD_BYTES = 64 * 1024 * 1024  # all files together, unpacked: larger runs use `follow`
MAX_ROLLOUT_FILES = 10_000


class VerlImportForm(forms.Form):
    name = forms.CharField(max_length=200, label="Run name")
    metrics = forms.FileField(required=False, label="Metrics (verl's file logger .jsonl)")


class UploadRefused(ValueError):
    """An upload that cannot be imported: (field, what to do)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


@login_required
def import_verl(request: HttpRequest, project_id: int) -> HttpResponse:
    project = project_or_error(request, project_id, Role.MEMBER)
    form = VerlImportForm(request.POST or None, request.FILES or None)
    if request.method == "POST" and form.is_valid():
        try:
            metrics, rollouts = _read_upload(
                form.cleaned_data.get("metrics"), request.FILES.getlist("rollouts")
            )
            run, skipped = import_verl_run(
                project, request.user, name=form.cleaned_data["name"], metrics=metrics, rollouts=rollouts
            )
        except UploadRefused as exc:
            form.add_error(exc.field if exc.field in form.fields else None, str(exc))
        except ProjectArchived as exc:
            form.add_error(None, str(exc))
        else:
            if skipped.total():
                messages.warning(
                    request, f"Imported; verl's files had what a run cannot hold: {skipped.words()}"
                )
            return redirect(run.get_absolute_url())
    context = {
        "project": project,
        "team": project.team,
        "form": form,
        "limit_mb": MAX_UPLOAD_BYTES // (1024 * 1024),
        "rollouts_error": form.errors.get("rollouts"),
    }
    return render(request, "pages/import_verl.html", context, status=400 if request.method == "POST" else 200)


def _read_upload(
    metrics: UploadedFile | None, files: list[UploadedFile]
) -> tuple[bytes | None, dict[int, bytes]]:
    """The metrics bytes and ``{step: bytes}`` of the rollout files (plain or in one .zip),
    within ``MAX_UPLOAD_BYTES`` unpacked; ``UploadRefused`` names the field and the fix."""
    budget = [MAX_UPLOAD_BYTES]

    def take(size: int, what: str, field: str) -> None:
        budget[0] -= size
        if budget[0] < 0:
            raise UploadRefused(
                field,
                f"{what} takes the upload past {MAX_UPLOAD_BYTES // (1024 * 1024)} MB: follow the run's files "
                "with `python -m tributary follow` instead (it ships any size)",
            )

    data = None
    if metrics is not None:
        take(metrics.size or 0, metrics.name or "the metrics file", "metrics")
        data = metrics.read()
    rollouts: dict[int, bytes] = {}
    for upload in files:
        name = PurePosixPath(upload.name or "").name
        if name.lower().endswith(".zip"):
            if (upload.size or 0) > MAX_UPLOAD_BYTES:
                take(upload.size or 0, name, "rollouts")
            rollouts.update(_unzip(upload, take))
            continue
        step = rollout_file_step(name)
        if step is None:
            raise UploadRefused("rollouts", f"{name!r} is not a rollout file: verl names them <step>.jsonl")
        take(upload.size or 0, name, "rollouts")
        rollouts[step] = upload.read()
    if len(rollouts) > MAX_ROLLOUT_FILES:
        raise UploadRefused("rollouts", f"{len(rollouts)} rollout files; the limit is {MAX_ROLLOUT_FILES}")
    if data is None and not rollouts:
        raise UploadRefused("metrics", "choose verl's metrics file, its rollout files, or both")
    return data, rollouts


def _unzip(upload: UploadedFile, take: Any) -> dict[int, bytes]:
    """The ``<step>.jsonl`` members of a .zip (folders ignored), sizes counted before reading
    (a member is read at most to its declared size, so a forged header cannot inflate it)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(upload.read()))
    except zipfile.BadZipFile:
        raise UploadRefused("rollouts", f"{upload.name!r} is not a readable .zip") from None
    out: dict[int, bytes] = {}
    with archive:
        for member in archive.infolist():
            step = rollout_file_step(PurePosixPath(member.filename).name)
            if member.is_dir() or step is None:
                continue
            take(member.file_size, f"{member.filename} in {upload.name}", "rollouts")
            with archive.open(member) as fh:
                out[step] = fh.read(member.file_size + 1)[: member.file_size]
    return out
