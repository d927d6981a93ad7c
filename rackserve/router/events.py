"""KVEventSubscriber: follows one DP rank's KV event stream into the router's index.

It subscribes to the rank's PUB socket, then asks its replay socket for everything from seq 0
(a router that starts late or reconnects rebuilds its part of the index), and applies batches
in sequence order: one already applied is skipped, and a gap (batches the PUB socket dropped)
is counted and filled from the replay socket when the instance has one. Runs as an asyncio task
on the router's loop, so the index is only ever touched from that loop. This file never picks
a worker.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from rackserve.engine.kv_events import decode_batch
from rackserve.router.index import KVIndex, WorkerKey

logger = logging.getLogger(__name__)
REPLAY_TIMEOUT_S = 5.0


class KVEventSubscriber:
    def __init__(self, worker: WorkerKey, endpoint: str, replay_endpoint: str | None, topic: str,
                 index: KVIndex, on_batch: Callable[[int, int], None] = lambda received, dropped: None) -> None:
        self.worker, self.endpoint, self.replay_endpoint = worker, endpoint, replay_endpoint
        self.topic, self.index, self.on_batch = topic, index, on_batch
        self.next_seq = 0
        self.ctx = zmq.asyncio.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except (asyncio.CancelledError, Exception):   # noqa: BLE001 - it is going away either way
            pass
        self.sub.close()

    async def _run(self) -> None:
        await self._replay()
        while True:
            frames = await self.sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:   # not (topic, seq, batch): nothing to apply
                logger.warning("kv events of %s: a message of %d frames dropped", self.worker, len(frames))
                self.on_batch(0, 1)
                continue
            _, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq:
                logger.warning("kv events of %s: batches %d..%d missed", self.worker, self.next_seq, seq - 1)
                if self.replay_endpoint:
                    await self._replay()
                if seq > self.next_seq:   # no replay, or the buffer had moved on: skip ahead
                    self.on_batch(0, seq - self.next_seq)
                    self.next_seq = seq
            self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return   # already applied (replayed, then heard live)
        try:
            for event in decode_batch(payload).events:
                self.index.apply(self.worker, event)
        except ValueError as e:   # undecodable (msgspec.DecodeError), or an event the index cannot hold
            logger.warning("kv events of %s: batch %d dropped (from the bad event on): %s", self.worker, seq, e)
            self.on_batch(0, 1)
        else:
            self.on_batch(1, 0)
        self.next_seq = seq + 1

    async def _replay(self) -> None:
        """Every buffered batch from next_seq on, then END_SEQ; a silent replay socket is logged
        and left (live batches keep coming)."""
        if not self.replay_endpoint:
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart([b"", self.next_seq.to_bytes(8, "big")])
            while True:
                if not await sock.poll(REPLAY_TIMEOUT_S * 1000):
                    logger.warning("kv events of %s: replay socket did not answer", self.worker)
                    return
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    logger.warning("kv events of %s: a replay answer of %d frames: replay left", self.worker,
                                   len(frames))
                    return
                _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0:
                    return
                if seq > self.next_seq:
                    self.on_batch(0, seq - self.next_seq)   # older than the buffer holds
                    self.next_seq = seq
                self._apply(seq, payload)
        finally:
            sock.close()
