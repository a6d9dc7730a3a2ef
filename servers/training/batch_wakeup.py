"""When the train loop looks at the pool again (`BatchWakeup`), apart from the loop itself.

The engine's lifecycle, the rollout pool and the episode recorder cause the events that wake the train loop
(`servers.training.loop`), and the train loop drives them: the rule lives here, below all four, so that none of them
imports the loop to wake it.
"""

from __future__ import annotations

import asyncio

__all__ = ["BatchWakeup"]


class BatchWakeup:
    """When the train loop looks at the pool again: the one rule, written once.

    The loop has two moves: ROLLING → ROLLING_POST once the pool holds a full batch, and ROLLING_POST → a training
    step once no lease is open. Only these events can make one of them possible, and whoever causes one calls `wake`:
    - an episode entered the pool: ended, or a prepared one committed (by its client, or at its deadline);
    - a lease closed: ended, prepared, aborted or expired (the last one lets a ROLLING_POST drain finish);
    - the engine became ROLLING: booted, or a step finished (the pool may hold the next batch already).
    Nothing else wakes the loop. Wake-ups before the loop looks coalesce into one look.
    """

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def wake(self) -> None:
        """One of the events above happened."""
        self._event.set()

    async def wait(self) -> None:
        """Until the next `wake` (at once if one came since the last look)."""
        await self._event.wait()
        self._event.clear()
