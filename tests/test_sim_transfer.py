"""P/D in the simulator runs the engine's own KV connector path: the decode instances'
MooncakeConnector scheduler halves order the pulls, sim/transfer.py carries them out on the
virtual link (time = the blocks' KV bytes / link bandwidth + latency, loads on one link queued),
and the prefill instances free their held blocks once the read ended; nothing sleeps the wall clock."""
from __future__ import annotations

import json
import math
import time

import pytest

from rackserve.kv_transfer.base import KVConnectorOutput
from rackserve.kv_transfer.mooncake_connector import LoadOrder, MooncakeConnectorMetadata, MooncakeConnectorScheduler
from rackserve.serve.cli import main
from rackserve.sim import transfer as sim_transfer
from rackserve.sim.hardware import load_hardware
from rackserve.sim.model_spec import load_model_spec

BLOCK = 16


def _order(req: str, blocks: int, remote: str = "p0") -> MooncakeConnectorMetadata:
    return MooncakeConnectorMetadata(loads=[LoadOrder(req, [list(range(blocks))], [list(range(blocks))],
                                                      "127.0.0.1", 10000, remote)])


def test_transfer_time_is_the_blocks_bytes_over_the_link():
    spec = load_model_spec("llama-3-8b")
    now = [0.0]
    times = {}
    for bandwidth in (50e9, 100e9):
        fabric = sim_transfer.SimFabric()
        link = sim_transfer.SimTransfer(fabric, spec.kv_bytes, bandwidth, 1e-5, BLOCK, [("127.0.0.1", 20000)],
                                        lambda: now[0])
        producer = sim_transfer.SimTransfer(fabric, spec.kv_bytes, bandwidth, 1e-5, BLOCK, [("127.0.0.1", 10000)],
                                            lambda: now[0])
        link.start(0, _order("a", 40))
        link.start(0, _order("b", 40, "p1"))     # the same link: queued behind "a"
        (end_a, _), (end_b, _) = link.loading[0]
        assert end_a == pytest.approx(spec.kv_bytes(40 * BLOCK) / bandwidth + 1e-5)
        assert end_b == pytest.approx(2 * end_a)
        assert fabric.record.blocks == 80 and fabric.record.bytes == pytest.approx(2 * spec.kv_bytes(40 * BLOCK))
        # Reported after the step during which each ends, on both sides.
        assert link.finished(0, end_a / 2) == KVConnectorOutput()
        assert producer.finished(0, end_a / 2).finished_sending == set()
        assert link.finished(0, end_a).finished_recving == {"a"}
        assert producer.finished(0, end_b).finished_sending == {"p0", "p1"}
        assert link.next_event(end_a) == pytest.approx(end_b - end_a)
        times[bandwidth] = end_a - 1e-5
    assert times[50e9] == pytest.approx(2 * times[100e9])   # twice the bandwidth, half the time


def test_pd_run_moves_the_blocks_the_decode_scheduler_ordered(tmp_path, monkeypatch):
    ordered = []
    original = MooncakeConnectorScheduler.update_state_after_alloc

    def spy(self, request, block_ids, num_local_blocks, num_external_tokens):
        ordered.append((request.num_prompt_tokens, num_local_blocks,
                        -(-(request.num_computed_tokens + num_external_tokens) // BLOCK) - num_local_blocks))
        return original(self, request, block_ids, num_local_blocks, num_external_tokens)

    def no_wall_sleep(seconds):
        raise AssertionError("the simulation slept the wall clock")

    monkeypatch.setattr(MooncakeConnectorScheduler, "update_state_after_alloc", spy)
    monkeypatch.setattr(time, "sleep", no_wall_sleep)
    out = tmp_path / "pd.json"
    rc = main(["sim", "--model", "llama-3-8b", "--hardware", "H100", "--prefill", "1", "--decode", "1",
               "--workload", "random", "--random-input-len", "300", "--random-output-len", "8",
               "--no-enable-prefix-caching", "--max-model-len", "4096", "--concurrency", "4", "--duration", "5",
               "--output", str(out)])
    assert rc == 0
    run = json.loads(out.read_text())["runs"][0]
    moved = run["sim"]["kv_transfer"]
    # Without a prefix cache the decoder holds nothing: it pulls every block up to the last prompt
    # token (which it computes itself), and exactly what its scheduler ordered crossed the link.
    assert ordered and all(local == 0 and blocks == math.ceil((prompt - 1) / BLOCK) for prompt, local, blocks in ordered)
    assert moved["loads"] == len(ordered) and moved["blocks"] == sum(b for _, _, b in ordered)
    spec, hw = load_model_spec("llama-3-8b"), load_hardware("H100")
    link = hw.scale_up_bw * hw.efficiency.get("link_bw", 0.70)
    assert moved["seconds"] == pytest.approx(sum(spec.kv_bytes(b * BLOCK) / link + hw.link_latency
                                                 for _, _, b in ordered))
    done = [r for r in run["requests"] if r["error"] is None]
    assert done and all(r["output_tokens"] == r["max_tokens"] for r in done)
