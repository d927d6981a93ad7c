"""Publishes an instance's KV events over ZMQ, vLLM's way: a PUB socket per DP rank sending
(topic, seq, EventBatch) and, when configured, a ROUTER replay socket that answers a start
sequence number with every buffered batch from there on, then END_SEQ.

The engine thread only hands batches over (the publisher is a StatLogger: the events ride up in
each step's SchedulerStats, per DP rank); one thread per DP rank owns its sockets, encodes and
sends, so a slow subscriber never slows a step. This file never reads or changes the KV cache.
"""
from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import deque

import zmq

from rackserve.config import KVEventsConfig
from rackserve.core.kv_events import KVCacheEvent
from rackserve.core.stats import SchedulerStats
from rackserve.engine.kv_events import END_SEQ, dp_endpoint, encode_batch
from rackserve.engine.stats import IterationStats, StatLogger

logger = logging.getLogger(__name__)


def _open(ctx: zmq.Context, kind: int, endpoint: str) -> tuple[zmq.Socket, str]:
    """Binds a wildcard address (tcp://*:port), connects to any other, as vLLM does. Returns the
    socket and its endpoint: a bound port 0 replaced by the port the OS picked, so nothing else can
    take it between a caller's choice and the bind (what a port found free beforehand risks)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if "*" in endpoint or "0.0.0.0" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
        if re.fullmatch(r"tcp://.*:0", endpoint):
            port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
            endpoint = f"{endpoint[:-1]}{port}"
    else:
        sock.connect(endpoint)
    return sock, endpoint


class ZmqEventPublisher:
    """One DP rank's publisher thread; `publish` is thread-safe and never blocks."""

    def __init__(self, config: KVEventsConfig, dp_rank: int) -> None:
        self.config, self.dp_rank = config, dp_rank
        self.endpoint = dp_endpoint(config.endpoint, dp_rank)
        self.replay_endpoint = dp_endpoint(config.replay_endpoint, dp_rank) if config.replay_endpoint else None
        self._queue: queue.SimpleQueue[tuple[float, list[KVCacheEvent]] | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ready = threading.Event()
        self._error: ValueError | None = None
        self._thread = threading.Thread(target=self._run, name=f"kv-events-dp{dp_rank}", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:   # e.g. the port is taken: say so at startup, not never
            raise self._error

    def publish(self, ts: float, events: list[KVCacheEvent]) -> None:
        self._queue.put((ts, events))

    def shutdown(self) -> None:
        """Sends what is queued, then closes the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        pub = replay = None
        opening = self.endpoint
        try:
            pub, self.endpoint = _open(ctx, zmq.PUB, opening)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            if self.replay_endpoint:
                opening = self.replay_endpoint
                replay, self.replay_endpoint = _open(ctx, zmq.ROUTER, opening)
        except zmq.ZMQError as e:
            if pub is not None:
                pub.close()
            self._error = ValueError(f"kv events: cannot open {opening}: {e}")
            self._ready.set()
            return
        self._ready.set()
        topic, seq = self.config.topic.encode(), 0
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.02)
                except queue.Empty:
                    item = ()   # nothing to send: look at the replay socket
                if item is None:
                    return
                if item:
                    payload = encode_batch(item[0], item[1], self.dp_rank)
                    seq_bytes = seq.to_bytes(8, "big")
                    pub.send_multipart((topic, seq_bytes, payload))
                    self._buffer.append((seq, payload))
                    seq += 1
                while replay is not None and replay.poll(0):
                    self._answer_replay(replay)
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _answer_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events: malformed replay request (%d frames) ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))


class KVEventPublisher(StatLogger):
    """The instance's publishers, one per DP rank, fed from each step's per-rank KV events."""

    def __init__(self, config: KVEventsConfig, data_parallel_size: int) -> None:
        assert config.enable_kv_cache_events
        self.config = config
        self.publishers: list[ZmqEventPublisher] = []
        try:
            for rank in range(data_parallel_size):
                self.publishers.append(ZmqEventPublisher(config, rank))
        except ValueError:
            self.shutdown()
            raise

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        ts = time.time()
        for rank, stats in enumerate(scheduler_stats.dp_ranks):
            if stats.kv_events:
                self.publishers[rank].publish(ts, stats.kv_events)

    def shutdown(self) -> None:
        for publisher in self.publishers:
            publisher.shutdown()
