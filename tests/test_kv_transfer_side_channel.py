"""The side channel's consumer pool: one connection per producer, reused across calls; a producer
that shut down is noticed on the idle connection (never asked through it), and one that comes
back on the same port gets a fresh connection."""
from __future__ import annotations

import pytest

from rackserve.kv_transfer.side_channel import SideChannelPool, SideChannelServer


def test_connections_are_reused_and_a_restarted_producer_gets_a_new_one():
    server = SideChannelServer("127.0.0.1", 0, lambda msg: {"echo": msg["n"], "generation": 1})
    port = server.port
    pool = SideChannelPool(timeout=5.0)
    try:
        for n in range(5):
            with pool.connection("127.0.0.1", port) as client:
                assert client.call({"n": n}) == {"echo": n, "generation": 1}
        assert pool.opened == 1
        server.shutdown()
        with pytest.raises(ConnectionError):   # the idle connection is stale; nobody listens now
            with pool.connection("127.0.0.1", port) as client:
                client.call({"n": 0})
        server = SideChannelServer("127.0.0.1", port, lambda msg: {"echo": msg["n"], "generation": 2})
        with pool.connection("127.0.0.1", port) as client:
            assert client.call({"n": 7}) == {"echo": 7, "generation": 2}
        assert pool.opened == 3
    finally:
        server.shutdown()
        pool.close()


def test_a_connection_that_failed_mid_call_is_not_reused():
    server = SideChannelServer("127.0.0.1", 0, lambda msg: {"error": "no"} if msg.get("bad") else {"ok": True})
    pool = SideChannelPool(timeout=5.0)
    try:
        with pytest.raises(RuntimeError, match="refused"):
            with pool.connection("127.0.0.1", server.port) as client:
                client.call({"bad": True})
        with pool.connection("127.0.0.1", server.port) as client:
            assert client.call({}) == {"ok": True}
        assert pool.opened == 2
    finally:
        server.shutdown()
        pool.close()
