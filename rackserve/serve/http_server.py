"""The HTTP layer under every rackserve server (`serve`, `router`, `proxy`, and so `cluster`):
uvicorn on h11, with a request head that must arrive whole within --header-timeout seconds.

uvicorn bounds only the idle time between keep-alive requests: a connection that trickles its
request head, or opens and sends nothing (slowloris), held its socket and its slot forever. Here
a head's clock starts when the connection opens, or at the first byte of the next request on a
kept-alive one; a head not complete in time gets `408 Request Timeout` (an OpenAI error body) and
the connection is closed. The body is bounded where it is read (request_body.read_within: within
as long again, 408 past it); a connection whose answer went out before its body was read whole
(413, 408, 401) is closed, not kept reading what is left of the body. This file never routes and
never reads a body.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 30.0


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:   # NaN too
        raise argparse.ArgumentTypeError(f"must be above 0 seconds, got {text}")
    return value


def add_header_timeout_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--header-timeout", type=_seconds, default=HEADER_TIMEOUT_S, metavar="SECONDS",
                        help="a request's head must arrive whole within this many seconds of its connection "
                             "(or of its first byte, on a kept-alive one), its body within as long again; "
                             "past it: 408 and the connection closes (slowloris)")


def server_config(app: Any, host: str, port: int, log_level: str, header_timeout: float = HEADER_TIMEOUT_S,
                  **options: Any) -> uvicorn.Config:
    """uvicorn's Config for `app`, with the head deadline; `options` go to uvicorn as they are."""
    if not header_timeout > 0:
        raise ValueError(f"--header-timeout must be above 0 seconds, got {header_timeout}")
    protocol = functools.partial(HeadTimeoutProtocol, header_timeout=header_timeout)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol, **options)


def _timeout_answer(seconds: float) -> bytes:
    body = json.dumps({"error": {
        "message": f"the request head did not arrive within {seconds:g} s (--header-timeout)",
        "type": "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n" % len(body)) + body


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, plus the head deadline: armed while h11 waits for a request head
    (their_state IDLE) on a new connection or once a kept-alive one receives bytes again, disarmed
    as soon as a head is complete."""

    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            if self.head_timer is None:
                self._arm()
        else:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.transport.close()   # what is sent now goes nowhere: no reading it for ever

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self.head_timer = self.loop.call_later(self.header_timeout, self._head_late)

    def _disarm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_late(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.logger.info("%s: no whole request head within %g s: 408", self.client, self.header_timeout)
        self.transport.write(_timeout_answer(self.header_timeout))
        self.transport.close()
