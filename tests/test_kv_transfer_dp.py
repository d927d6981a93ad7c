"""KV connectors on data-parallel and multi-node instances (real worker processes): each DP rank has
its own KV cache and moves its own blocks. A DP=2 prefiller's two ranks each serve their own side
channel; the kv_transfer_params name the DP rank that holds the prompt, and a DP=2 decoder's ranks
pull crosswise (decoder rank 1 from producer rank 0 and back) with one instance's greedy tokens.
A DP rank that lives on a second node (a `rackserve worker` process, loopback) serves its blocks
to a decoder as well, with node 0's side channel ports. The pooled store is shared by the DP ranks:
a prefix one rank computed is an external hit on the other.
"""
from __future__ import annotations

import subprocess
import sys
import time

from rackserve import LLM, SamplingParams
from rackserve.core.hashing import block_hashes
from rackserve.core.request import Request
from rackserve.distributed.parallel_state import free_port
from rackserve.executor.worker import WorkerError
from tests.test_kv_transfer_store import PROMPT, GREEDY, _store, pool, want  # noqa: F401 - fixtures

KW = dict(dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=64, block_size=4)
PROMPTS = [[3 + (i * 7) % 500 for i in range(23)], [11 + (i * 13) % 480 for i in range(17)]]


def _p2p(role: str) -> dict:
    return {"kv_connector": "MooncakeConnector", "kv_role": role,
            "kv_connector_extra_config": {"lease_seconds": 5.0, "transfer_timeout": 5.0}}


class _Done:
    """A finished request's whole answer (the engine's step outputs are deltas)."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict | None = None


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], ranks: list[int]) -> list[_Done]:
    """Generate with each prompt pinned to a DP rank (as a router pins one)."""
    engine = llm.engine
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for req_id, prompt, p, rank in zip(ids, prompts, params, ranks):
        engine.add_prepared(engine.prepare(req_id, {"prompt_token_ids": prompt}, p, data_parallel_rank=rank))
    done = {req_id: _Done() for req_id in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            d = done[out.request_id]
            d.token_ids += out.outputs[0].token_ids
            d.num_cached_tokens = out.num_cached_tokens or d.num_cached_tokens
            d.kv_transfer_params = out.kv_transfer_params or d.kv_transfer_params
    return [done[req_id] for req_id in ids]


def _drain(*llms: LLM, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    for llm in llms:
        while llm.engine.core.has_kv_transfers():
            assert time.monotonic() < deadline, "KV transfers never ended"
            llm.engine.step()
        llm.engine.core.check_integrity()
        assert all(s.kv.usage() == 0.0 for s in llm.engine.core.schedulers)


def _reference(path: str) -> list[list[int]]:
    with LLM(path, **KW) as single:
        outs = single.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0.0, max_tokens=6))
    return [o.outputs[0].token_ids for o in outs]


FIRST = SamplingParams(temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})


def test_dp2_prefiller_and_dp2_decoder_pull_crosswise(tiny_llama_dir):
    want_tokens = _reference(tiny_llama_dir)
    with LLM(tiny_llama_dir, data_parallel_size=2, kv_transfer_config=_p2p("kv_producer"), **KW) as pre, \
            LLM(tiny_llama_dir, data_parallel_size=2, kv_transfer_config=_p2p("kv_consumer"), **KW) as dec:
        firsts = _run(pre, PROMPTS, [FIRST, FIRST], [0, 1])
        params = [f.kv_transfer_params for f in firsts]
        assert [p["remote_dp_rank"] for p in params] == [0, 1]
        assert params[1]["remote_port"] == params[0]["remote_port"] + 1   # rank d serves on port + d (TP=1)
        got = _run(dec, PROMPTS, [SamplingParams(temperature=0.0, max_tokens=6, kv_transfer_params=p) for p in params],
                   [1, 0])
        assert [g.token_ids for g in got] == want_tokens
        assert [g.num_cached_tokens for g in got] == [len(p) - 1 for p in PROMPTS]
        _drain(pre, dec)


def test_a_dp_rank_on_a_second_node_serves_its_blocks(tiny_llama_dir, tmp_path):
    """Node 1 (`rackserve worker`) resolves its own side channel port from its flags; it serves on
    node 0's instead, so the params node 0's engine hands out lead to it."""
    want_tokens = _reference(tiny_llama_dir)
    import json
    nodes = dict(data_parallel_size=2, nnodes=2, master_port=free_port(), **KW)
    log = tmp_path / "node1.log"
    node1 = subprocess.Popen([sys.executable, "-m", "rackserve.serve.cli", "worker", f"--model={tiny_llama_dir}",
                              "--node-rank=1", f"--kv-transfer-config={json.dumps(_p2p('kv_producer'))}",
                              *[f"--{k.replace('_', '-')}={v}" for k, v in nodes.items()]],
                             stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        with LLM(tiny_llama_dir, node_rank=0, kv_transfer_config=_p2p("kv_producer"), **nodes) as pre, \
                LLM(tiny_llama_dir, kv_transfer_config=_p2p("kv_consumer"), **KW) as dec:
            firsts = _run(pre, PROMPTS, [FIRST, FIRST], [1, 0])
            got = _run(dec, PROMPTS, [SamplingParams(temperature=0.0, max_tokens=6, kv_transfer_params=f.kv_transfer_params)
                                      for f in firsts], [0, 0])
            assert [f.kv_transfer_params["remote_dp_rank"] for f in firsts] == [1, 0]
            assert [g.token_ids for g in got] == want_tokens
            assert [g.num_cached_tokens for g in got] == [len(p) - 1 for p in PROMPTS]
            _drain(pre, dec)
        assert node1.wait(timeout=30) == 0, log.read_text()
    except WorkerError as e:    # node 1's side of a failed start (once, under the whole suite: a gloo read reset)
        node1.kill()
        node1.wait()
        raise AssertionError(f"node 0 failed; node 1's log:\n{log.read_text()[-4000:]}") from e
    finally:
        node1.kill()


def test_the_store_is_shared_by_the_dp_ranks(pool, tiny_llama_dir, want):  # noqa: F811 - fixtures
    _, address = pool
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(tiny_llama_dir, data_parallel_size=2, kv_transfer_config=_store(address), **KW) as llm:
        [first] = _run(llm, [PROMPT], [greedy], [0])
        assert first.token_ids == want and first.num_cached_tokens == 0
        # Rank 0's worker puts in the background: wait until rank 1's scheduler finds all 5 blocks.
        probe = Request("probe", PROMPT, greedy)
        probe.block_hashes = block_hashes(PROMPT, 4)
        rank1 = llm.engine.core.schedulers[1].connector
        deadline = time.monotonic() + 20
        while rank1.get_num_new_matched_tokens(probe, 0) < 20:
            assert time.monotonic() < deadline, "rank 0's blocks never reached the pool"
            llm.engine.step()
            time.sleep(0.05)
        [second] = _run(llm, [PROMPT], [greedy], [1])
        assert second.token_ids == want
        assert second.num_cached_tokens == 20   # 5 full blocks from the pool, through DP rank 1's own KV cache
        _drain(llm)
