"""MooncakeStoreConnector over a real pool (`rackserve kv-pool`, Mooncake's master): a prefix
computed on instance A is a hit on instance B with identical tokens, never on an instance of
another model; MultiConnector runs P2P prefill/decode and the pool together; with the master
killed, requests still complete with the right tokens."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from rackserve import LLM, SamplingParams
from rackserve.distributed.parallel_state import free_port

PROMPT = [3 + (i * 7) % 500 for i in range(23)]   # 5 full blocks of 4 and a partial one
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SEGMENT = 16 << 20


@pytest.fixture(scope="module")
def pool():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rackserve.serve.cli", "kv-pool", "--port", str(port),
                             "--metrics-port", str(free_port())], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    config = json.loads(proc.stdout.readline())
    time.sleep(1.0)   # the master binds its port
    yield proc, config["kv_connector_extra_config"]["master_server_address"]
    proc.terminate()
    try:
        proc.wait(timeout=20)
    finally:
        proc.kill()


def _store(address: str) -> dict:
    return {"kv_connector": "MooncakeStoreConnector",
            "kv_connector_extra_config": {"master_server_address": address, "global_segment_size": SEGMENT}}


def _llm(path: str, kv_transfer_config: dict | None) -> LLM:
    return LLM(path, dtype="float32", device="cpu", max_model_len=128, num_gpu_blocks_override=64, block_size=4,
               kv_transfer_config=kv_transfer_config)


def _flush(llm: LLM) -> None:
    """Wait for the background puts and let the scheduler hear of them."""
    runner = llm.engine.core.executor.runner
    workers = getattr(runner.kv_connector, "children", [runner.kv_connector])
    for worker in workers:
        if hasattr(worker, "wait_for_stores"):
            worker.wait_for_stores()
    llm.engine.step()


@pytest.fixture(scope="module")
def want(tiny_llama_dir) -> list[int]:
    with _llm(tiny_llama_dir, None) as plain:
        return plain.generate({"prompt_token_ids": PROMPT}, GREEDY)[0].outputs[0].token_ids


def test_a_prefix_computed_on_one_instance_is_a_hit_on_another(pool, tiny_llama_dir, tiny_deepseek_v3_dir, want):
    _, address = pool
    with _llm(tiny_llama_dir, _store(address)) as a:
        [out] = a.generate({"prompt_token_ids": PROMPT}, GREEDY)
        assert out.outputs[0].token_ids == want and out.num_cached_tokens == 0
        _flush(a)
        with _llm(tiny_llama_dir, _store(address)) as b:
            [out] = b.generate({"prompt_token_ids": PROMPT}, GREEDY)
            assert out.outputs[0].token_ids == want
            assert out.num_cached_tokens == 20   # 5 full blocks from the pool; the last token computed
            b.engine.core.check_integrity()
        with _llm(tiny_deepseek_v3_dir, _store(address)) as other:   # another model: another fingerprint
            [out] = other.generate({"prompt_token_ids": PROMPT}, GREEDY)
            assert out.num_cached_tokens == 0


def test_a_deepseek_v4_prefix_from_one_instance_is_a_hit_on_another(pool, tiny_deepseek_v4_kv_dir):
    """Every cache group's blocks go to the pool; instance B loads the 32 tokens that fill whole
    blocks of every group (HCA's are 16) and computes the rest, with A's tokens."""
    _, address = pool
    prompt = [3 + (i * 7) % 500 for i in range(45)]
    with _llm(tiny_deepseek_v4_kv_dir, None) as plain:
        [want] = plain.generate({"prompt_token_ids": prompt}, GREEDY)
    with _llm(tiny_deepseek_v4_kv_dir, _store(address)) as a:
        [out] = a.generate({"prompt_token_ids": prompt}, GREEDY)
        assert out.outputs[0].token_ids == want.outputs[0].token_ids and out.num_cached_tokens == 0
        _flush(a)
        with _llm(tiny_deepseek_v4_kv_dir, _store(address)) as b:
            [out] = b.generate({"prompt_token_ids": prompt}, GREEDY)
            assert out.outputs[0].token_ids == want.outputs[0].token_ids
            assert out.num_cached_tokens == 32
            b.engine.core.check_integrity()
        a.engine.core.check_integrity()


def test_multi_connector_disaggregates_and_pools_at_once(pool, tiny_llama_dir, want):
    _, address = pool
    prompt = [9 + (i * 11) % 400 for i in range(19)]

    def multi(role: str) -> dict:
        return {"kv_connector": "MultiConnector", "kv_role": role, "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "MooncakeConnector"}, _store(address)]}}

    with _llm(tiny_llama_dir, None) as plain:
        [ref] = plain.generate({"prompt_token_ids": prompt}, GREEDY)
    with _llm(tiny_llama_dir, multi("kv_producer")) as pre, _llm(tiny_llama_dir, multi("kv_consumer")) as dec:
        [first] = pre.generate({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        [out] = dec.generate({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0.0, max_tokens=4, ignore_eos=True, kv_transfer_params=first.kv_transfer_params))
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.num_cached_tokens == 18
        _flush(pre)
        with _llm(tiny_llama_dir, _store(address)) as third:   # the prefiller's blocks are in the pool
            [again] = third.generate({"prompt_token_ids": prompt}, GREEDY)
            assert again.outputs[0].token_ids == ref.outputs[0].token_ids and again.num_cached_tokens == 16
        while pre.engine.core.has_kv_transfers():
            pre.engine.step()
        pre.engine.core.check_integrity()
        dec.engine.core.check_integrity()


def _wait_closed(address: str, timeout: float = 15.0) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            return
        assert time.monotonic() < deadline, "the pool master is still listening"
        time.sleep(0.1)


def test_a_dead_pool_master_costs_hits_not_answers(pool, tiny_llama_dir, want):
    proc, address = pool
    with _llm(tiny_llama_dir, _store(address)) as llm:
        proc.kill()   # SIGKILL `rackserve kv-pool`: its master dies with it
        proc.wait(timeout=10)
        _wait_closed(address)
        [out] = llm.generate({"prompt_token_ids": PROMPT}, GREEDY)
        assert out.outputs[0].token_ids == want
        llm.engine.core.check_integrity()

