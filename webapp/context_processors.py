"""Template context every page gets."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest

from engine.contracts import page_contracts

# Computed once: the contracts are constants of this build.
_PAGE_CONTRACTS = page_contracts()


def contracts(request: HttpRequest) -> dict[str, Any]:
    """``contracts``: run states, event types and close codes, which base.html hands to the page's
    JavaScript as ``<script id="tributary-contracts">`` (``json_script``), so no script spells them."""
    return {"contracts": _PAGE_CONTRACTS}
