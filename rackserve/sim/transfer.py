"""The worker half of the KV connector on virtual time, for prefill/decode disaggregation: the
engine's own MooncakeConnector scheduler halves (kv_transfer/mooncake_connector.py, torch-free)
decide which blocks a decode instance pulls from which prefill instance, exactly as in a served
P/D pair; this file carries their orders out on the simulated link.

A decoder's LoadOrder (its blocks beyond its own prefix hit, up to the prompt's last token) moves
len(local_block_ids) x block_size tokens of KV; each DP rank's link (one device's: TP ranks move
their shards in parallel) serves its loads one after another at the link's bandwidth, so
concurrent pulls share it. A load is reported in `finished_recving` after the step during which it
ends; the producer (found by the side channel address the order names, as the real worker finds
it) reports `finished_sending` after its first step once the read ended, and frees its held blocks.

It owns the transfers in flight and their record; it must never schedule, price compute, sleep
nor read any clock but the virtual one it is handed.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from rackserve.config import EngineConfig, KVTransferConfig
from rackserve.kv_transfer.base import KVConnectorOutput
from rackserve.kv_transfer.mooncake_connector import side_channel_address

POLL_SECONDS = 0.005     # an idle step waiting on a peer whose read has not started yet
# Prefill instance i's DP rank d "serves" its side channel on 10000 + i x world size + d x TP
# (decode instances from 40000: they hold nothing, but their address must not be a producer's).
SIDE_CHANNEL_PORTS = {"kv_producer": 10000, "kv_consumer": 40000}


def split_landed(loading: list[tuple[float, str]], step_end: float) -> tuple[set[str], list[tuple[float, str]]]:
    """The requests whose (end, request) load ended by `step_end`, and the loads still running."""
    return ({req_id for end, req_id in loading if end <= step_end},
            [(end, req_id) for end, req_id in loading if end > step_end])


def pd_instance(config: EngineConfig, role: str, index: int) -> tuple[EngineConfig, list[tuple[str, int]]]:
    """Instance `index` of a P/D pool: its config with the MooncakeConnector of its role (its own
    engine id and side channel ports: the address a decoder's pull names; nothing listens), and
    each DP rank's address."""
    port = SIDE_CHANNEL_PORTS[role] + index * config.parallel.world_size
    config = dataclasses.replace(config, kv_transfer=KVTransferConfig(
        "MooncakeConnector", role, {"side_channel_port": port}, engine_id=f"{role}-{index}"))
    return config, [side_channel_address(config, d) for d in range(config.parallel.data_parallel_size)]


@dataclass
class TransferRecord:
    loads: int = 0
    blocks: int = 0
    bytes: float = 0.0
    seconds: float = 0.0           # link time, queueing excluded

    def to_json(self) -> dict:
        return {"loads": self.loads, "blocks": self.blocks, "bytes": self.bytes, "seconds": self.seconds}


@dataclass
class SimFabric:
    """What the instances' transfer halves share: per producer address, the requests whose blocks
    a decoder has read (and when the read ends), and the run's record."""
    reads: dict[tuple[str, int], list[tuple[float, str]]] = field(default_factory=dict)
    record: TransferRecord = field(default_factory=TransferRecord)
    pool_record: TransferRecord = field(default_factory=TransferRecord)   # loads from a KV pool (kv_store.py)


class SimTransfer:
    """One instance's connector workers (one link a DP rank). `kv_bytes(tokens)`: the KV of that
    many tokens (the model's, all layers); a load of it takes kv_bytes / `bandwidth` + `latency`.
    `addresses[d]` is DP rank d's side channel address, where decoders tell it they are done."""

    def __init__(self, fabric: SimFabric, kv_bytes: Callable[[int], float], bandwidth: float, latency: float,
                 block_size: int, addresses: list[tuple[str, int]], clock: Callable[[], float]):
        self.fabric, self.kv_bytes, self.bandwidth, self.latency = fabric, kv_bytes, bandwidth, latency
        self.block_size, self.addresses, self.clock = block_size, addresses, clock
        self.link_free = [0.0] * len(addresses)
        self.loading: list[list[tuple[float, str]]] = [[] for _ in addresses]   # (end, request) per DP rank

    def start(self, dp_rank: int, metadata) -> None:
        """This step's orders for DP rank `dp_rank` (MooncakeConnectorMetadata; holds need nothing)."""
        if metadata is None:
            return
        now = self.clock()
        for order in metadata.loads:
            # One cache group (the simulator's models have one): its blocks are the prompt's tokens;
            # none for an order that only releases the producer's hold.
            assert len(order.local_block_ids) <= 1, "a simulated instance has one KV cache group"
            blocks = len(order.local_block_ids[0]) if order.local_block_ids else 0
            tokens = blocks * self.block_size
            nbytes = self.kv_bytes(tokens) if tokens else 0.0
            begin = max(now, self.link_free[dp_rank])
            end = begin + (nbytes / self.bandwidth + self.latency if tokens else 0.0)
            self.link_free[dp_rank] = end
            self.loading[dp_rank].append((end, order.req_id))
            self.fabric.reads.setdefault((order.remote_host, order.remote_port), []).append(
                (end, order.remote_request_id))
            if tokens:
                r = self.fabric.record
                r.loads, r.blocks = r.loads + 1, r.blocks + blocks
                r.bytes += nbytes
                r.seconds += end - begin

    def finished(self, dp_rank: int, step_end: float) -> KVConnectorOutput:
        """Transfers that ended by the end of this step, as the worker half reports them."""
        out = KVConnectorOutput()
        out.finished_recving, self.loading[dp_rank] = split_landed(self.loading[dp_rank], step_end)
        reads = self.fabric.reads.get(self.addresses[dp_rank], [])
        done = [(end, req_id) for end, req_id in reads if end <= step_end]
        if done:
            out.finished_sending.update(req_id for _, req_id in done)
            self.fabric.reads[self.addresses[dp_rank]] = [x for x in reads if x[1] not in out.finished_sending]
        return out

    def next_event(self, now: float) -> float:
        """Seconds an idle step lasts: to the next load or read ending here, else a poll."""
        ends = [end for rank in self.loading for end, _ in rank]
        ends += [end for address in self.addresses for end, _ in self.fabric.reads.get(address, [])]
        ahead = [end - now for end in ends if end > now]
        return min(ahead) if ahead else POLL_SECONDS
