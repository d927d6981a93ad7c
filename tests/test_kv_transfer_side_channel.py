"""The side channel's consumer pool: one connection per producer, reused across calls; a producer
that shut down is noticed on the idle connection (never asked through it), and one that comes
back on the same port gets a fresh connection. What a peer can send is bounded: a line past
MAX_REQUEST_BYTES is refused before it is buffered whole, and a burst of connections is queued
by the kernel, not dropped."""
from __future__ import annotations

import shutil
import socket
import subprocess
from collections import deque

import pytest

from rackserve.kv_transfer.side_channel import MAX_REQUEST_BYTES, SideChannelPool, SideChannelServer


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


def test_a_line_past_the_bound_is_refused_and_others_are_still_answered():
    server = SideChannelServer("127.0.0.1", 0, lambda msg: {"ok": True})
    pool = SideChannelPool(timeout=5.0)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"x" * (MAX_REQUEST_BYTES + 1))   # no newline: it would be read until one came
            answer = sock.makefile("rb")
            assert b"a message over" in answer.readline()
            assert answer.readline() == b""   # the connection is ended: its stream is out of step
        with pool.connection("127.0.0.1", server.port) as client:
            assert client.call({}) == {"ok": True}
    finally:
        server.shutdown()
        pool.close()


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read the listen backlog")
def test_the_listen_backlog_takes_a_burst_of_connections():
    """socketserver's default backlog is 5: 64 consumers connecting at once waited 1.2-1.8 s
    (median) for SYN retries on a Zen 1, up to 14 s, one never answered (bench/side_channel_burst.py)."""
    server = SideChannelServer("127.0.0.1", 0, lambda msg: {"ok": True})
    try:
        line = subprocess.run(["ss", "-ltnH", f"sport = :{server.port}"], capture_output=True, text=True,
                              check=True).stdout.split()
        assert int(line[2]) >= 128   # a listening socket's Send-Q is its backlog
    finally:
        server.shutdown()


def test_a_default_side_channel_port_starts_a_free_run_for_every_rank(tiny_llama_dir, monkeypatch):
    """Rank i serves on the port + i: the default port starts a run of world_size ports that all
    bind, from below Linux's ephemeral range (where the instance's own connections take ports while
    it starts), a run with a taken port is never chosen, and a process never hands a port out twice
    (two draws made before the first is bound, as a test's events, replay and HTTP ports, could be
    the same one)."""
    from rackserve import config as config_module
    from rackserve.config import EngineArgs, free_port_run
    lo, hi = config_module.SIDE_CHANNEL_PORTS
    assert hi <= 32768
    engine = EngineArgs(model=tiny_llama_dir, device="cpu", data_parallel_size=2, tensor_parallel_size=2,
                        kv_transfer_config={"kv_connector": "MooncakeConnector", "kv_role": "kv_both"},
                        ).create_engine_config()
    base = engine.kv_transfer.kv_connector_extra_config["side_channel_port"]
    assert lo <= base and base + 4 <= hi
    for port in range(base, base + 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    held = socket.socket()
    try:
        taken = free_port_run("127.0.0.1", 3) + 1     # its neighbours free too
        held.bind(("127.0.0.1", taken))
        monkeypatch.setattr(config_module, "SIDE_CHANNEL_PORTS", (taken - 1, taken + 2))
        monkeypatch.setattr(config_module, "_HANDED_OUT", deque(maxlen=4096))
        assert {free_port_run("127.0.0.1", 1) for _ in range(2)} == {taken - 1, taken + 1}
        with pytest.raises(OSError, match="set side_channel_port"):
            free_port_run("127.0.0.1", 1, attempts=40)   # both free ones already handed out
        config_module._HANDED_OUT.clear()
        with pytest.raises(OSError, match="set side_channel_port"):
            free_port_run("127.0.0.1", 2, attempts=20)   # both runs of 2 hold the taken port
    finally:
        held.close()
