"""How a front process (`rackserve proxy`, `rackserve router`) ends on SIGINT/SIGTERM: uvicorn
takes both signals while it serves, shuts down, then re-raises the one it caught to the handler it
replaced; left at the default, SIGTERM then kills the process mid-cleanup with rc 143.

This file owns that one rule (exit 0 after a requested stop, as `rackserve serve` does). It must
never decide what a server does while it drains (uvicorn does).
"""
from __future__ import annotations

import contextlib
import signal
from typing import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop(*_) -> None:
    raise SystemExit(0)


@contextlib.contextmanager
def stop_quietly() -> Iterator[None]:
    """Within: a stop signal outside uvicorn's serving (its re-raise after shutdown, or one that
    comes before it serves) ends the process with exit code 0 through the callers' `finally`s."""
    previous = {sig: signal.signal(sig, _stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
