"""Engine events as the protocol defines them, for the ingest and live tests."""

from __future__ import annotations

from typing import Any

T0 = 1_760_000_000.0


def status(seq: int, state: str, message: str = "") -> dict[str, Any]:
    return {"run": "r", "seq": seq, "type": "status", "state": state, "message": message}


def metrics(seq: int, step: int, **values: float | None) -> dict[str, Any]:
    return {"run": "r", "seq": seq, "type": "metrics", "step": step, "time": T0 + step, "values": values}


def sample_item(text: str, reward: float = 1.0) -> dict[str, Any]:
    return {
        "prompt": f"What is {text}?",
        "completion": f"The answer is {text}.",
        "reward": reward,
        "advantage": 0.5,
        "length": 7,
        "finish_reason": "stop",
        "extra": {"group": 0},
    }


def samples(seq: int, step: int, *texts: str) -> dict[str, Any]:
    return {"run": "r", "seq": seq, "type": "samples", "step": step, "items": [sample_item(t) for t in texts]}


def a_run_of(n_steps: int) -> list[dict[str, Any]]:
    """status starting, running, then per step: metrics and samples; then a checkpoint, a log."""
    events = [status(1, "starting"), status(2, "running")]
    for step in range(1, n_steps + 1):
        events.append(
            metrics(len(events) + 1, step, **{"reward/mean": step / 10, "actor/entropy": 1.0 / step})
        )
        events.append(samples(len(events) + 1, step, f"{step}+{step}", f"{step}*{step}"))
    events.append(
        {
            "run": "r",
            "seq": len(events) + 1,
            "type": "checkpoint",
            "step": n_steps,
            "path": "ckpt/3",
            "bytes": 1234,
        }
    )
    events.append({"run": "r", "seq": len(events) + 1, "type": "log", "level": "info", "message": "saved"})
    events.append({"run": "r", "seq": len(events) + 1, "type": "heartbeat", "time": T0})
    return events
