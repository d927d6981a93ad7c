"""The side channel between a KV producer and its consumers: one JSON object a line over TCP, one
reply per request. It carries only small control messages (handshake, pin, done); KV bytes go over
the transfer engine. A consumer keeps its connections to each producer open and reuses them across
pulls (SideChannelPool): a pull costs its round trips, not a TCP connection's setup and teardown.

This file owns the wire format, the threaded server and the consumer's connection pool. It must
never touch KV tensors or decide what a message means (the connector's handler does).
"""
from __future__ import annotations

import contextlib
import json
import select
import socket
import socketserver
import threading
from collections.abc import Iterator
from typing import Any, Callable

Handler = Callable[[dict], dict]
# A request is an op and a request id; a reply at most a pinned request's block ids, per cache group.
# A line past its bound is not ours: refused before it is buffered whole (a peer that sends no
# newline would otherwise grow the reader's memory without end).
MAX_REQUEST_BYTES, MAX_REPLY_BYTES = 1 << 16, 1 << 26


class SideChannelServer:
    """Serves `handler(message) -> reply` on host:port (port 0: a free one) from a daemon thread."""

    def __init__(self, host: str, port: int, handler: Handler):
        open_conns: set[socket.socket] = set()
        self._conns, self._conns_lock = open_conns, threading.Lock()
        lock = self._conns_lock

        class _Conn(socketserver.StreamRequestHandler):
            def setup(self) -> None:
                super().setup()
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with lock:
                    open_conns.add(self.connection)

            def finish(self) -> None:
                with lock:
                    open_conns.discard(self.connection)
                super().finish()

            def handle(self) -> None:
                while line := self.rfile.readline(MAX_REQUEST_BYTES + 1):
                    if len(line) > MAX_REQUEST_BYTES:   # the connection is out of step from here: ended
                        self.wfile.write(json.dumps({"error": f"a message over {MAX_REQUEST_BYTES} bytes"}).encode()
                                         + b"\n")
                        return
                    try:
                        reply = handler(json.loads(line))
                    except Exception as e:   # noqa: BLE001 - a bad message must not kill the server
                        reply = {"error": repr(e)}
                    self.wfile.write(json.dumps(reply).encode() + b"\n")
                    self.wfile.flush()

        class _Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            # socketserver's default backlog of 5 drops connections that arrive together (each
            # accept starts a thread): their SYNs are retried after 1 s, 3 s, 7 s, so a burst of
            # peers, or one peer opening many, delayed every new pull's connection by seconds.
            request_queue_size = socket.SOMAXCONN

        self._server = _Server((host, port), _Conn)
        self._server.daemon_threads = True
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kv-side-channel", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._server.server_close()
        # Consumers hold connections open: end them, so they hear this producer is gone (EOF)
        # instead of asking a handler whose connector has shut down.
        with self._conns_lock:
            for conn in list(self._conns):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)


class SideChannelClient:
    """One connection to a producer's side channel; not thread-safe (one thread uses it at a
    time). `peer` caches the producer's handshake reply for the connection's life."""

    def __init__(self, host: str, port: int, timeout: float):
        self._sock = socket.create_connection((host, port), timeout=timeout)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._file = self._sock.makefile("rwb")
        self.peer: dict[str, Any] | None = None

    def is_stale(self) -> bool:
        """The producer closed the connection while it sat idle (restarted, shut down): readable
        with nothing asked means EOF (or a stray byte; either way it is not to be reused)."""
        try:
            return bool(select.select([self._sock], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def call(self, message: dict) -> dict:
        self._file.write(json.dumps(message).encode() + b"\n")
        self._file.flush()
        line = self._file.readline(MAX_REPLY_BYTES + 1)
        if not line:
            raise ConnectionError("the KV producer closed the side channel")
        if len(line) > MAX_REPLY_BYTES:
            raise ConnectionError(f"the KV producer's reply ran past {MAX_REPLY_BYTES} bytes")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the KV producer refused {message.get('op')!r}: {reply['error']}")
        return reply

    def close(self) -> None:
        self._file.close()
        self._sock.close()


class SideChannelPool:
    """A consumer's idle connections, per producer address, reused across pulls; thread-safe.
    A connection that failed during a pull is closed, never returned (its stream may be out of
    step); one the producer closed while idle is dropped when next taken."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._idle: dict[tuple[str, int], list[SideChannelClient]] = {}
        self._lock = threading.Lock()
        self.opened = 0   # connections made so far (tests and benchmarks read it)

    @contextlib.contextmanager
    def connection(self, host: str, port: int) -> Iterator[SideChannelClient]:
        client = self._take((host, port))
        try:
            yield client
        except BaseException:
            client.close()
            raise
        with self._lock:
            self._idle.setdefault((host, port), []).append(client)

    def _take(self, address: tuple[str, int]) -> SideChannelClient:
        while True:
            with self._lock:
                idle = self._idle.get(address)
                client = idle.pop() if idle else None
                self.opened += client is None
            if client is None:
                return SideChannelClient(*address, self.timeout)
            if not client.is_stale():
                return client
            client.close()

    def close(self) -> None:
        with self._lock:
            clients = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for client in clients:
            client.close()
