"""The workers online and what they have (from the worker registry beside the broker)."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import Router

from webapp.api import serializers
from webapp.api.routers import AUTHED
from webapp.api.schemas import WorkerOut

router = Router(tags=["workers"])


@router.get("/workers", response={200: list[WorkerOut], **AUTHED}, summary="Workers online")
def list_workers(request: HttpRequest) -> list[dict[str, Any]]:
    """Each worker heard from in the last ``jobs.registry.TTL_S`` seconds: queues, CPUs, memory,
    GPUs (model, memory, lent to a run or free), installed backends, and the runs it holds (by
    count; by name only those of the caller's teams)."""
    return serializers.workers_out(request.auth)
