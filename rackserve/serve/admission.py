"""The door every HTTP request passes before it reaches a route: the API key (`--api-key`), the
request id (the client's `X-Request-Id`, or one made here, echoed on the response), and the drain
of a graceful shutdown (new requests get 503 while the ones in flight finish).

This file owns those door rules and the count of requests in flight. It must never read request
bodies (it answers before the body is read) nor touch the engine.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
import uuid
from typing import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rackserve.serve.serving_engine import OpenAIError

# Always open, with or without --api-key: what load balancers, Prometheus and humans poll.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
# While draining, these still answer (metrics show the drain; /health turns 503 so routing stops).
OPEN_WHILE_DRAINING = frozenset({"/metrics", "/version"})
MAX_REQUEST_ID_LEN = 256


class Admission:
    """The door's state, shared by the middleware and the server's shutdown."""

    def __init__(self, api_key: str | None = None) -> None:
        self._api_key = hashlib.sha256(f"Bearer {api_key}".encode()).digest() if api_key else None
        self.draining = False
        self.in_flight = 0                  # requests past the door that have not answered yet

    async def drain(self, timeout: float, give_up: Callable[[], bool]) -> int:
        """Refuse new requests from now on and wait up to `timeout` s (or until `give_up()`) for
        those in flight to finish; returns how many are still in flight."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline and not give_up():
            await asyncio.sleep(0.05)
        return self.in_flight

    def refusal(self, path: str, headers: Headers) -> OpenAIError | None:
        """Why a request may not pass, if it may not."""
        request_id = headers.get("x-request-id")
        if request_id is not None and not valid_request_id(request_id):
            return OpenAIError(f"X-Request-Id must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII "
                               "characters", param="X-Request-Id")
        if self._api_key is not None and path not in OPEN_PATHS:
            # Constant time over digests: neither how much of a guess matched nor the key's length
            # may show in how long the answer takes.
            sent = headers.get("authorization", "").encode("latin-1")   # the header's bytes again
            if not hmac.compare_digest(hashlib.sha256(sent).digest(), self._api_key):
                return OpenAIError("Incorrect or missing API key: send the header 'Authorization: "
                                   "Bearer <key>' with the key the server was started with (--api-key)",
                                   status=401, code="invalid_api_key")
        if self.draining and path not in OPEN_WHILE_DRAINING:
            return OpenAIError("the server is shutting down and takes no new requests; retry on "
                               "another instance", status=503, type="server_error")
        return None


def valid_request_id(request_id: str) -> bool:
    return 0 < len(request_id) <= MAX_REQUEST_ID_LEN and all(" " <= c <= "~" for c in request_id)


class AdmissionMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware), so streamed responses and client disconnects pass
    through untouched. A passed request finds its id stem in `request.state.request_id`."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        error = self.admission.refusal(scope["path"], headers)
        request_id = headers.get("x-request-id") if error is None else None
        request_id = request_id or uuid.uuid4().hex
        echo = [(b"x-request-id", request_id.encode())]
        if error is not None:
            extra = {"www-authenticate": "Bearer"} if error.status == 401 else {}
            if error.status == 503:
                extra["connection"] = "close"   # a kept-alive client must reconnect elsewhere
            response = JSONResponse(error.body(), status_code=error.status,
                                    headers={"x-request-id": request_id, **extra})
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *echo]}
            await send(message)

        counted = scope["path"] not in OPEN_PATHS
        self.admission.in_flight += counted
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.admission.in_flight -= counted
