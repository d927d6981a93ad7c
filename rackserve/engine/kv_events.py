"""KV events on the wire: vLLM's msgspec schema (vllm/distributed/kv_events.py), so that Dynamo's
and llm-d's consumers, and our router, can read what a rackserve instance publishes.

A batch is sent as three ZMQ frames: topic, an 8-byte big-endian sequence number, and a msgpack
`EventBatch` (array-like: ts, events, data_parallel_rank) whose events are tagged array-like
structs (the tag is the class name). This file owns the schema, the codec between it and
core/kv_events.py's containers, and endpoint naming per DP rank; it never opens a socket.
"""
from __future__ import annotations

import re
from typing import Any

import msgspec

from rackserve.core import kv_events as core

END_SEQ = (-1).to_bytes(8, "big", signed=True)   # the replay socket's "that was all"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    # vLLM's later fields, in its order (a consumer that knows fewer skips the trailing ones:
    # msgspec's array_like rule). group_idx names a multi-group model's cache group; the others
    # are sent empty, as vLLM sends what it does not use.
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)


def to_wire(event: core.KVCacheEvent) -> KVCacheEvent:
    if isinstance(event, core.BlockStored):
        return BlockStored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                           event.lora_id, event.medium, group_idx=event.group_idx)
    if isinstance(event, core.BlockRemoved):
        return BlockRemoved(event.block_hashes, event.medium, event.group_idx)
    assert isinstance(event, core.AllBlocksCleared), event
    return AllBlocksCleared()


def encode_batch(ts: float, events: list[core.KVCacheEvent], dp_rank: int | None) -> bytes:
    return _encoder.encode(KVEventBatch(ts, [to_wire(e) for e in events], dp_rank))


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError (a ValueError) on a payload that is not a KVEventBatch."""
    return _decoder.decode(payload)


def dp_endpoint(endpoint: str, dp_rank: int) -> str:
    """DP rank k's endpoint, as vLLM names it: a TCP port moves up by k, an ipc/inproc name gets
    a `_dp{k}` suffix. Port 0 stays 0: each rank binds a port the OS picks (reported at /kv_events)."""
    if dp_rank == 0:
        return endpoint
    match = re.fullmatch(r"(tcp://.*):(\d+)", endpoint)
    if match and int(match.group(2)) == 0:
        return endpoint
    if match:
        return f"{match.group(1)}:{int(match.group(2)) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"


def connectable(endpoint: str, host: str) -> str:
    """A bound wildcard endpoint (tcp://*:5557) as a client on another host must dial it."""
    return re.sub(r"^tcp://(\*|0\.0\.0\.0|\[::\])(?=:)", f"tcp://{host}", endpoint)
