"""At most one message per key and time window to a channel group, the latest one winning.

A run stores a metrics point per step, up to many per second; a list of runs (the landing page's
active runs, ``webapp.live.announce.batch_stored``) needs the step to move, not every step. So the
first change is sent at once, changes within the next ``every`` seconds wait, and when the window
closes the latest of them is sent: a step is never held back for longer than the window, and a
run that stops moving still shows its last step (a send dropped at the end of a burst would show
a stale one until its next event).

Everything runs on the event loop of the caller (``async_to_sync`` from a sync thread of the web
process runs on the server's loop), so the state needs no lock; a caller on another loop (a
synchronous test, where each ``async_to_sync`` makes a loop of its own) starts fresh state, and a
timer of a loop that is gone is forgotten with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

MAX_KEYS = 10_000
"""Keys tracked at most. The oldest are forgotten: at worst a message goes out early, or one
waiting for its window is dropped and the key's next change is sent instead."""


@dataclass
class _Slot:
    loop: asyncio.AbstractEventLoop
    sent_at: float = -float("inf")
    sent: Any = None  # the value of the last message sent (an equal one is not sent again)
    # (value, group, message) due when the window closes
    waiting: tuple[Any, str, dict[str, Any]] | None = None
    timer: asyncio.TimerHandle | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


class Throttle:
    """Sends through ``send(group, message)`` at most once per key every ``every`` seconds."""

    def __init__(self, every: float, send: Callable[[str, dict[str, Any]], Awaitable[None]]) -> None:
        self.every = every
        self._send = send
        self._slots: dict[Hashable, _Slot] = {}

    async def offer(self, key: Hashable, value: Any, group: str, message: dict[str, Any]) -> None:
        """``message`` (carrying ``value``) for ``group``: sent now, or when ``key``'s window closes."""
        loop = asyncio.get_running_loop()
        slot = self._slots.get(key)
        if slot is None or slot.loop is not loop:
            slot = self._slots[key] = _Slot(loop)
            while len(self._slots) > MAX_KEYS:
                self._slots.pop(next(iter(self._slots)))
        if slot.timer is None and value == slot.sent:
            return
        slot.waiting = (value, group, message)
        if slot.timer is not None:
            return  # the pending send takes the latest message
        wait = slot.sent_at + self.every - loop.time()
        if wait <= 0:
            await self._flush(key, slot)
        else:
            slot.timer = loop.call_later(wait, self._fire, key, slot)

    def _fire(self, key: Hashable, slot: _Slot) -> None:
        task = slot.loop.create_task(self._flush(key, slot))
        slot.tasks.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(slot.tasks.discard)

    async def _flush(self, key: Hashable, slot: _Slot) -> None:
        slot.timer = None
        if slot.waiting is None or self._slots.get(key) is not slot:
            return
        value, group, message = slot.waiting
        slot.waiting = None
        slot.sent, slot.sent_at = value, slot.loop.time()
        await self._send(group, message)
