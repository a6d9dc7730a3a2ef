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
"""

from __future__ import annotations

import gc
import logging
import time

__all__ = ["own_process", "settle"]

log = logging.getLogger("marl.server")

_owned = False  # set once by `marl serve`'s process: the collector is a process-wide thing


def own_process() -> None:
    """This process is the server's alone: from now on every engine boot freezes what is alive (`settle`)."""
    global _owned
    _owned = True


def settle() -> None:
    """After an engine booted: collect once, then freeze every object alive (a no-op unless `own_process()`)."""
    if not _owned:
        return
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("froze %d boot-time objects out of the garbage collector's walks (%.0f ms)", gc.get_freeze_count(),
             (time.perf_counter() - started) * 1000)
