"""Restarts: when `rackserve cluster` starts an instance that died again (a supervisor's backoff).

This file owns that timing rule and the line it prints; it never starts a process (cluster.py does).
"""
from __future__ import annotations

import sys


class Restarts:
    """When to start a dead instance again: at once after a run of at least STABLE_S seconds;
    after one shorter than that, twice the last wait (1 s first, at most MAX_WAIT_S), so an
    instance that cannot stay up is retried ever more rarely instead of in a tight loop."""
    STABLE_S, MAX_WAIT_S = 60.0, 60.0

    def __init__(self, n: int, now: float) -> None:
        self.started = [now] * n
        self.wait = [0.0] * n
        self.died: list[float | None] = [None] * n

    def due(self, i: int, returncode: int, now: float) -> bool:
        """Whether instance i, found exited with `returncode`, starts again now (then counted as started)."""
        if self.died[i] is None:
            self.died[i] = now
            lived = now - self.started[i]
            self.wait[i] = 0.0 if lived >= self.STABLE_S else min(max(2 * self.wait[i], 1.0), self.MAX_WAIT_S)
            print(f"rackserve cluster: instance {i} exited with code {returncode} after {lived:.0f} s; "
                  f"starting it again in {self.wait[i]:.0f} s", file=sys.stderr, flush=True)
        if now < self.died[i] + self.wait[i]:
            return False
        self.started[i], self.died[i] = now, None
        return True
