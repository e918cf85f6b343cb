"""The engine's config schema and presets, for the launch form."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest
from ninja import Router

from engine.config import PRESETS, json_schema
from webapp.api.routers import AUTHED

router = Router(tags=["engine"])


@router.get("/presets", response={200: dict[str, dict[str, Any]], **AUTHED}, summary="Config presets")
def presets(request: HttpRequest) -> dict[str, Any]:
    """Each named preset: the config values it sets underneath a run's own (``config.preset``)."""
    return PRESETS


@router.get("/schema", response={200: dict[str, Any], **AUTHED}, summary="The run config's JSON Schema")
def schema(request: HttpRequest) -> dict[str, Any]:
    """The engine's ``RunConfig`` JSON Schema (titles, descriptions, bounds) with ``x-presets``."""
    return json_schema()
