"""The garbage collector of a `marl serve` process: what lives as long as the process leaves the collector's view.

CPython's full (oldest-generation) collection walks every tracked object. Once torch, transformers and an engine are
loaded that is a few hundred thousand objects (about 400,000 with the simulated engine: modules, functions, classes,
configs) that live until the process exits, and the walk holds the event loop: 330-380 ms, every ~12 s, collecting
nothing, at 1,024 leases (`bench/scale.py --leases 1024`: the server's own p99 was these pauses). `settle()` runs
after an engine boots: one collection, then `gc.freeze()` moves every object alive into the permanent generation,
which collections skip, so a full collection walks only what the server made since (leases, calls, samples).

The price of freezing: an object alive at the freeze that later becomes garbage in a reference cycle is never freed.
A `marl serve` process is the server's alone and its boot-time objects live as long as it does, so `marl serve`
calls `own_process()` and every boot freezes; a process that also hosts other work (the tests, a notebook running a
server in-process) never freezes unless it says so.

What a server makes while it serves is the other half. Every call in flight holds about 190 tracked objects for as
long as its generation runs (the ASGI and FastAPI coroutine chain, its request, its messages): seconds, so they
survive the young collections and reach the oldest generation, and CPython's rule (a full collection once that
generation grew by a quarter) then walked them all every ~3 s at 1,024 leases: 150-250 ms with the loop held,
collecting nothing. `settle()` therefore also sets `SERVING_THRESHOLDS`, for short pauses rather than few:
- a young collection every 100 allocations instead of 700, the middle generation every 3 young ones instead of 10.
  A collection walks what is young and still alive, and at load most of it is alive (calls in flight), so a pause
  grows with the threshold while the work per second does not: at 1,024 leases (700, 2) paused the loop for 2.3-2.8
  ms at the median and 6.2-6.6 ms at p90 in its middle collections, 10 times a second; (100, 3) for 0.15-0.17 and
  0.38-0.41 ms, 64-71 times a second, and spent 3% of the wall time collecting instead of 5-6%;
- a full collection only after 40,000 middle ones (about every 10 minutes at 1,024 leases; an idle server makes
  none: nothing to collect). Objects in a reference cycle that die old wait for it; the bench's memory phase
  (`bench/scale.py`) checks that resident memory stays flat.
Figures: docs/scale.md.
"""

from __future__ import annotations

import gc
import logging
import time

__all__ = ["SERVING_THRESHOLDS", "own_process", "settle"]

log = logging.getLogger("marl.server")

#: `gc.set_threshold` while serving: a young collection per 100 allocations, a middle one every 3 young ones, a full
#: one every 40,000 middle ones (module docstring).
SERVING_THRESHOLDS = (100, 3, 40000)

_owned = False  # set once by `marl serve`'s process: the collector is a process-wide thing


def own_process() -> None:
    """This process is the server's alone: from now on every engine boot freezes what is alive (`settle`)."""
    global _owned
    _owned = True


def settle() -> None:
    """After an engine booted: collect once, freeze every object alive, and collect as a server should from now on
    (`SERVING_THRESHOLDS`). A no-op unless `own_process()`."""
    if not _owned:
        return
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_THRESHOLDS)
    log.info("froze %d boot-time objects out of the garbage collector's walks (%.0f ms); collector thresholds %s",
             gc.get_freeze_count(), (time.perf_counter() - started) * 1000, SERVING_THRESHOLDS)
