"""`rackserve bench kv-transfer`: how long moving N KV blocks takes, by block count, through the
real connectors' worker halves (MooncakeConnector's whole pull: side-channel handshake, pin,
batched read, done; MooncakeStoreConnector's put and get against a pool master started here),
against a plain TCP socket copy of the same bytes measured in the same run, and the machine's
memory bandwidth measured on the spot.

Blocks have the geometry of a real model's KV cache (SmolLM2-135M by default: 30 layers, K and V,
3 KV heads of 64, 16 tokens a block, fp32). This file measures only; it never serves requests.
"""
from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import tempfile
import threading
import time

from rackserve.bench.record import write_record
from rackserve.serve.cli import register_subcommand


def _config(tmp: str, connector: str, extra: dict, block_size: int):
    from rackserve.config import (CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                                  SchedulerConfig)
    model = ModelConfig(tmp, "bench", tmp, "float32", "cpu", 1024, 0)
    kv = KVTransferConfig(connector, "kv_both", extra).resolved()
    return EngineConfig(model, CacheConfig(block_size, 1.0, True, None), SchedulerConfig(1, 1), ParallelConfig(), kv)


def _median_ms(fn, repeats: int) -> float:
    fn()   # connections and registrations warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


class _SocketPeer:
    """A sender thread streaming `nbytes` on request over one persistent loopback connection."""

    def __init__(self, payload: bytes):
        self.payload = memoryview(payload)
        self.server = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._serve, daemon=True).start()
        self.client = socket.create_connection(self.server.getsockname())
        self.client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while header := conn.recv(8):
            conn.sendall(self.payload[:int.from_bytes(header, "little")])

    def copy(self, into: bytearray, nbytes: int) -> None:
        self.client.sendall(nbytes.to_bytes(8, "little"))
        view, got = memoryview(into), 0
        while got < nbytes:
            got += self.client.recv_into(view[got:nbytes])


def run(args: argparse.Namespace) -> dict:
    import torch

    from rackserve.bench.limits import measure_limits
    from rackserve.kv_transfer.mooncake_connector import LoadOrder, MooncakeConnectorMetadata
    from rackserve.kv_transfer.mooncake_worker import MooncakeConnectorWorker
    from rackserve.kv_transfer.mooncake_store_connector import MooncakeStoreConnectorWorker
    from rackserve.kv_transfer.offloading_connector import OffloadingMetadata
    from rackserve.kv_transfer.pool_cli import master_command
    from rackserve.distributed.parallel_state import free_port

    counts = [int(c) for c in args.block_counts.split(",")]
    num_blocks = 2 * max(counts) + 2
    shape = (args.num_layers, 2, num_blocks, args.block_size, args.num_kv_heads, args.head_size)
    source, target = torch.randn(shape), torch.zeros(shape)
    block_bytes = source[:, :, 0].numel() * source.element_size()
    limits = measure_limits("cpu")
    tmp = tempfile.mkdtemp(prefix="rackserve-kvbench-")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        f.write('{"bench": true}')
    master_port = free_port()
    master = subprocess.Popen(master_command(master_port, free_port(), 0.95), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    store_extra = {"master_server_address": f"127.0.0.1:{master_port}",
                   # Every put of every row stays in the pool (the warm-up's too), with room to
                   # spare: a pool near its eviction watermark would turn later gets into misses.
                   "global_segment_size": 2 * (args.repeats + 1) * sum(counts) * block_bytes + (64 << 20)}
    workers = []
    try:
        producer = MooncakeConnectorWorker(_config(tmp, "MooncakeConnector", {}, args.block_size), source)
        consumer = MooncakeConnectorWorker(_config(tmp, "MooncakeConnector", {}, args.block_size), target)
        writer = MooncakeStoreConnectorWorker(_config(tmp, "MooncakeStoreConnector", store_extra, args.block_size), source)
        reader = MooncakeStoreConnectorWorker(_config(tmp, "MooncakeStoreConnector", store_extra, args.block_size), target)
        workers = [producer, consumer, writer, reader]
        side_channel = _side_channel_costs(producer, args.repeats)
        peer = _SocketPeer(source.numpy().tobytes()[:max(counts) * block_bytes])
        sink = bytearray(max(counts) * block_bytes)
        rows = []
        for n in counts:
            remote, local = list(range(n)), list(range(num_blocks - n, num_blocks))
            ids = iter(range(1 << 30))

            def p2p() -> None:
                rid = f"bench-{next(ids)}"
                producer.start_load_kv(MooncakeConnectorMetadata(holds={rid: [remote]}))
                consumer._load(LoadOrder(rid, [local], [remote], producer.server.host, producer.server.port, rid))
                assert rid in consumer.get_finished().finished_recving, "the pull failed"
                producer.get_finished()

            p2p_ms = _median_ms(p2p, args.repeats)
            assert torch.equal(target[:, :, local], source[:, :, remote]), "P2P moved the wrong bytes"
            stored: list[list[tuple[int, int, int]]] = []

            def put() -> None:
                pairs = [(random.getrandbits(63), b, 0) for b in remote]
                writer.save_kv(OffloadingMetadata(stores=pairs))
                writer.wait_for_stores()
                stored.append(pairs)

            def get() -> None:
                pairs = stored.pop()
                reader._load("bench", [(h, lb, 0) for (h, _, _), lb in zip(pairs, local)])
                assert "bench" in reader.get_finished().finished_recving, "the store load failed"

            put_ms = _median_ms(put, args.repeats)
            get_ms = _median_ms(get, args.repeats)
            socket_ms = _median_ms(lambda: peer.copy(sink, n * block_bytes), args.repeats)
            nbytes = n * block_bytes
            rows.append({"blocks": n, "bytes": nbytes, "p2p_ms": p2p_ms, "p2p_gbps": nbytes / p2p_ms / 1e6,
                         "store_put_ms": put_ms, "store_get_ms": get_ms, "store_get_gbps": nbytes / get_ms / 1e6,
                         "socket_ms": socket_ms, "socket_gbps": nbytes / socket_ms / 1e6,
                         "p2p_vs_socket": p2p_ms / socket_ms})
    finally:
        for worker in workers:
            worker.shutdown()
        master.kill()
        master.wait()
    return {"block_bytes": block_bytes, "kv_cache_shape": list(shape), "limits": limits.__dict__,
            "side_channel": side_channel, "rows": rows}


def _side_channel_costs(producer, repeats: int) -> dict:
    """A pull's control messages alone: pin + done over a kept-open connection (what a pull pays
    now), against opening a connection and handshaking (what each pull paid when it opened its own)."""
    from rackserve.kv_transfer.mooncake_connector import MooncakeConnectorMetadata
    from rackserve.kv_transfer.side_channel import SideChannelClient
    host, port = producer.server.host, producer.server.port
    kept = SideChannelClient(host, port, 10.0)
    ids = iter(range(1 << 30))

    def pin_done() -> None:
        rid = f"sc-{next(ids)}"
        producer.start_load_kv(MooncakeConnectorMetadata(holds={rid: [[0]]}))
        assert kept.call({"op": "pin", "req_id": rid})["status"] == "pinned"
        kept.call({"op": "done", "req_id": rid})
        producer.get_finished()

    def connect_handshake() -> None:
        client = SideChannelClient(host, port, 10.0)
        client.call({"op": "handshake"})
        client.close()

    out = {"pin_done_kept_open_ms": _median_ms(pin_done, max(repeats, 20)),
           "connect_and_handshake_ms": _median_ms(connect_handshake, max(repeats, 20))}
    kept.close()
    return out


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-counts", default="1,4,16,64", help="blocks moved per transfer, comma-separated")
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", help="write the results as JSON here")


@register_subcommand("bench kv-transfer", "KV block transfer latency and bandwidth: Mooncake P2P and store "
                     "against a plain socket copy", _add_args)
def _bench_kv_transfer(args: argparse.Namespace) -> int:
    result = run(args)
    limits = result["limits"]
    print(f"{limits['processor']}: memory read {limits['mem_read_gbps']:.1f} GB/s; block {result['block_bytes']} B")
    print(f"{'blocks':>6} {'MB':>7} {'P2P ms':>8} {'GB/s':>6} {'put ms':>8} {'get ms':>8} {'socket ms':>9} "
          f"{'GB/s':>6} {'P2P/socket':>10}")
    sc = result["side_channel"]
    print(f"side channel: pin + done over a kept-open connection {sc['pin_done_kept_open_ms']:.2f} ms; "
          f"a new connection + handshake {sc['connect_and_handshake_ms']:.2f} ms")
    for r in result["rows"]:
        print(f"{r['blocks']:>6} {r['bytes'] / 1e6:>7.2f} {r['p2p_ms']:>8.2f} {r['p2p_gbps']:>6.2f} "
              f"{r['store_put_ms']:>8.2f} {r['store_get_ms']:>8.2f} {r['socket_ms']:>9.2f} {r['socket_gbps']:>6.2f} "
              f"{r['p2p_vs_socket']:>10.2f}")
    if args.output:
        write_record(args.output, result)
    return 0
