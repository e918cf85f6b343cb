"""The contracts between Tributary's parts, defined once: every side imports them from here.

- the event protocol (engine -> worker -> web app): event types and their fields;
- run states: the ones the engine reports in ``status`` events, and the web app's own;
- the engine's exit codes, which the worker maps to a run's final state;
- WebSocket close codes: the ingest socket (worker <-> web app) and the browser sockets;
- the algorithm names a run config accepts (``tests/engine/test_contracts.py`` checks them
  against the registries of ``engine.algorithms``).

Standard library only: the web process, the worker and the pages (through ``json_script``, see
``page_contracts``) read this module without loading torch, pydantic or Django.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

# ----------------------------------------------------------------------------- event protocol

EventType = Literal["status", "metrics", "samples", "checkpoint", "log", "heartbeat"]
EVENT_TYPES: tuple[str, ...] = get_args(EventType)

# Every event carries ``run``, ``seq`` (1, 2, 3, ... per run, never reused) and ``type``.
EVENT_ENVELOPE: tuple[str, ...] = ("run", "seq", "type")
# The fields each type adds to the envelope (ARCHITECTURE.md's protocol table).
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    "status": ("state", "message"),
    "metrics": ("step", "time", "values"),
    "samples": ("step", "items"),
    # ``deleted``: paths of earlier checkpoints its save removed (optional on ingest: a client may omit it).
    "checkpoint": ("step", "path", "bytes", "deleted"),
    "log": ("level", "message"),
    "heartbeat": ("time",),
}
# The fields of one item of a ``samples`` event.
SAMPLE_FIELDS: tuple[str, ...] = (
    "prompt", "completion", "reward", "advantage", "length", "finish_reason", "extra",
)

# ----------------------------------------------------------------------------- run states

# What the engine reports in a ``status`` event's ``state``.
EngineState = Literal["starting", "running", "succeeded", "failed", "cancelled"]
ENGINE_STATES: tuple[str, ...] = get_args(EngineState)
# The engine's last word on a run: after one of these it sends nothing more.
ENGINE_FINAL_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})

# Every state a run has in the web app: the engine's, plus ``queued`` (waiting for a worker)
# and ``lost`` (its worker stopped answering), which only the web app assigns.
RunState = Literal["queued", "starting", "running", "succeeded", "failed", "cancelled", "lost"]
RUN_STATES: tuple[str, ...] = get_args(RunState)
# No worker runs it any more; a resume is a new run.
FINAL_STATES: frozenset[str] = ENGINE_FINAL_STATES | {"lost"}
ACTIVE_STATES: frozenset[str] = frozenset(RUN_STATES) - FINAL_STATES

# ----------------------------------------------------------------------------- exit codes

EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_BAD_CONFIG = 2
EXIT_CANCELLED = 3
# What each exit code means, in words (the CLI's last line, the worker's messages).
EXIT_NAMES: dict[int, str] = {
    EXIT_SUCCEEDED: "succeeded",
    EXIT_FAILED: "failed",
    EXIT_BAD_CONFIG: "bad config",
    EXIT_CANCELLED: "cancelled",
}
# The run's final state for each exit code; any other code (a signal, a crash) means failed.
EXIT_STATES: dict[int, str] = {
    EXIT_SUCCEEDED: "succeeded",
    EXIT_FAILED: "failed",
    EXIT_BAD_CONFIG: "failed",
    EXIT_CANCELLED: "cancelled",
}

# ----------------------------------------------------------------------------- close codes

# 4000-4999 are the application's (RFC 6455 section 7.4.2).
# The ingest socket (worker <-> web app): its codes belong to the wire protocol, which the client
# library (client/tributary/protocol.py, no engine there) speaks too; re-exported here.
from tributary.protocol import (  # noqa: E402, F401 - re-exported
    CLOSE_BAD_EVENT,
    CLOSE_BAD_MESSAGE,
    CLOSE_BAD_TOKEN,
    CLOSE_CLAIM_LOST,
    CLOSE_NO_RUN,
    CLOSE_RUN_OVER,
    CLOSE_TOO_BIG,
    CLOSE_UNAVAILABLE,
    CLOSE_WRONG_RUN,
    FATAL_CLOSE_CODES,
)

# The browser sockets (live run pages, the runs table):
CLOSE_REVOKED = 4403  # the share link was revoked, or the user left the team
CLOSE_NOT_FOUND = 4404  # no such run/project, or not yours to see
# Codes after which a page stops reconnecting: the same request would be refused again.
BROWSER_FATAL_CLOSE_CODES: frozenset[int] = frozenset({CLOSE_BAD_MESSAGE, CLOSE_REVOKED, CLOSE_NOT_FOUND})

# ----------------------------------------------------------------------------- algorithm names

# The names a run config accepts (``algorithm.*``); each is the key of a registry in
# engine.algorithms, and tests/engine/test_contracts.py fails when the two differ.
ADV_ESTIMATORS: tuple[str, ...] = (
    "grpo",
    "grpo_vectorized",
    "grpo_passk",
    "grpo_median",
    "mc_grpo",
    "rloo",
    "rloo_vectorized",
    "opo",
    "gpg",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
)
POLICY_LOSSES: tuple[str, ...] = ("vanilla", "gspo", "cispo", "sapo", "gpg", "geo_mean", "dppo_tv", "dppo_kl")
# KL(policy || reference) estimators; each may carry a ``+`` suffix (straight-through k2 gradient).
KL_ESTIMATORS: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
KLControllerType = Literal["fixed", "adaptive"]
KL_CONTROLLER_TYPES: tuple[str, ...] = get_args(KLControllerType)


def page_contracts() -> dict[str, Any]:
    """The contracts the browser needs, as JSON data (the pages read them through ``json_script``)."""
    close_codes = {
        name.removeprefix("CLOSE_").lower(): value
        for name, value in globals().items()
        if name.startswith("CLOSE_") and isinstance(value, int)
    }
    return {
        "close_codes": close_codes,
        "browser_fatal_close_codes": sorted(BROWSER_FATAL_CLOSE_CODES),
        "run_states": list(RUN_STATES),
        "terminal_states": [s for s in RUN_STATES if s in FINAL_STATES],
        "active_states": [s for s in RUN_STATES if s in ACTIVE_STATES],
        "event_types": list(EVENT_TYPES),
    }
