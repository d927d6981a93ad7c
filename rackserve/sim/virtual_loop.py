"""An asyncio event loop on virtual time: `loop.time()` is a number that jumps to the next timer
whenever nothing is ready, so `asyncio.sleep(30)` costs no wall time and coroutines written for
real time (bench's closed-loop lanes, think times, deadlines) run unchanged, in order, as fast as
the CPU allows.

It owns the virtual clock only; nothing in it may read the wall clock. Sockets still work (the
selector is polled without blocking), but a loop that waits on real I/O would spin: the simulator
has none.
"""
from __future__ import annotations

import asyncio
import gc
import selectors

# A simulation allocates like a server under load with none of its idle time: millions of short-lived
# lists and tuples a simulated second, beside a heap of long-lived ones (the workload's traces, the
# prompts' block ids, the caches' blocks). Collecting the young generation every 700 allocations
# rescans the survivors; freezing the heap built before the run (as the engine does after start-up,
# engine/async_engine.py) and collecting the young every 50,000 took 6% off the CPU time of a
# 60-second, 256-lane P/D rack run in a paired run, the same figures out (docs/simulator.md, "Speed").
YOUNG_GC_THRESHOLD = 50_000


class _VirtualSelector(selectors.DefaultSelector):
    """Polls without blocking; a wait for a timer becomes a jump of the clock."""

    def __init__(self, loop_clock: list[float]):
        super().__init__()
        self._clock = loop_clock

    def select(self, timeout: float | None = None):
        events = super().select(0)
        if not events and timeout is not None and timeout > 0:
            self._clock[0] += timeout
        elif not events and timeout is None:
            raise RuntimeError("the simulation deadlocked: nothing is ready and no timer is pending")
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._now = [0.0]
        super().__init__(_VirtualSelector(self._now))
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._now[0]


def run_virtual(coro):
    """asyncio.run on virtual time; returns the coroutine's result. The collector's thresholds are
    raised for the run and the heap built before it frozen; both are put back after."""
    loop = VirtualTimeLoop()
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *thresholds[1:])
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
        gc.set_threshold(*thresholds)
        if not frozen:      # a heap frozen before (an engine in this process) stays frozen
            gc.unfreeze()
