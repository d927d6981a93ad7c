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
import selectors


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
    """asyncio.run on virtual time; returns the coroutine's result."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
