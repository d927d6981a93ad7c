"""How a server process (`rackserve serve`, `proxy`, `router`) ends on SIGINT/SIGTERM: uvicorn
takes both signals while it serves, shuts down, then re-raises the one it caught to the handler it
replaced; left at the default, SIGTERM then kills the process mid-cleanup with rc 143.

This file owns that one rule (exit 0 after a requested stop; `serve` goes on to stop its engine). It must
never decide what a server does while it drains (uvicorn does).
"""
from __future__ import annotations

import contextlib
import signal
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop(*_) -> None:
    raise SystemExit(0)


@contextlib.contextmanager
def stop_signals_to(handler: Callable) -> Iterator[None]:
    """Within: SIGINT and SIGTERM go to `handler` outside uvicorn's serving (its re-raise after
    shutdown, or one that comes before it serves); the previous handlers come back after."""
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler_ in previous.items():
            signal.signal(sig, handler_)


def stop_quietly() -> contextlib.AbstractContextManager[None]:
    """Within: a stop signal outside uvicorn's serving ends the process with exit code 0 through
    the callers' `finally`s."""
    return stop_signals_to(_stop)
