"""Every page hands the shared contracts (engine/contracts.py) to its scripts as JSON."""

from __future__ import annotations

import json
import re
from typing import Any

from django.test import Client

from engine.contracts import CLOSE_NOT_FOUND, page_contracts
from webapp.runs.choices import FINAL_STATUSES, RunStatus


def contracts_in(html: str) -> dict[str, Any]:
    found = re.findall(r'<script id="tributary-contracts" type="application/json">(.*?)</script>', html, re.DOTALL)
    assert len(found) == 1, "a page must carry the contracts exactly once"
    return json.loads(found[0])


def test_pages_carry_the_contracts_for_their_scripts(client: Client, member: Any) -> None:
    login = contracts_in(client.get("/login/").content.decode())  # signed out, too
    client.force_login(member)
    home = contracts_in(client.get("/").content.decode())
    assert home == login == page_contracts()
    assert home["close_codes"]["not_found"] == CLOSE_NOT_FOUND
    assert home["run_states"] == list(RunStatus.values)
    assert set(home["terminal_states"]) == {str(s) for s in FINAL_STATUSES}
