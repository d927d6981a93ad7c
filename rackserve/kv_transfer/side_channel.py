"""The side channel between a KV producer and its consumers: one JSON object a line over TCP, one
reply per request. It carries only small control messages (handshake, pin, done); KV bytes go over
the transfer engine.

This file owns the wire format and the threaded server. It must never touch KV tensors or decide
what a message means (the connector's handler does).
"""
from __future__ import annotations

import json
import socket
import socketserver
import threading
from typing import Callable

Handler = Callable[[dict], dict]


class SideChannelServer:
    """Serves `handler(message) -> reply` on host:port (port 0: a free one) from a daemon thread."""

    def __init__(self, host: str, port: int, handler: Handler):
        class _Conn(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for line in self.rfile:
                    try:
                        reply = handler(json.loads(line))
                    except Exception as e:   # noqa: BLE001 - a bad message must not kill the server
                        reply = {"error": repr(e)}
                    self.wfile.write(json.dumps(reply).encode() + b"\n")
                    self.wfile.flush()

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((host, port), _Conn)
        self._server.daemon_threads = True
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-side-channel", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._server.server_close()


class SideChannelClient:
    """One connection to a producer's side channel; not thread-safe (one per transfer thread)."""

    def __init__(self, host: str, port: int, timeout: float):
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._file = self._sock.makefile("rwb")

    def call(self, message: dict) -> dict:
        self._file.write(json.dumps(message).encode() + b"\n")
        self._file.flush()
        line = self._file.readline()
        if not line:
            raise ConnectionError("the KV producer closed the side channel")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the KV producer refused {message.get('op')!r}: {reply['error']}")
        return reply

    def close(self) -> None:
        self._file.close()
        self._sock.close()
