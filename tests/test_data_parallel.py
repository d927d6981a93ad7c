"""Data parallelism: DP=2 in real worker processes (one scheduler and KV cache per DP rank, the ranks
stepping in lockstep) gives one process's greedy tokens on the tiny Llama, across mixed batches and
preemption; new requests spread over the DP ranks by load, a request's n samples share one rank,
an abort on either rank ends only its request; each DP rank's idle time reaches the Prometheus
metrics; DP rank 1 on a second "node" (loopback) changes no token; DP=2 with expert parallelism
(DEP) on the tiny MoE models gives one process's tokens, including steps where one DP rank is
idle. The placement policy and the merged stats are checked in-process.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from rackserve import LLM, SamplingParams
from rackserve.config import CacheConfig, EngineArgs, EngineConfig, ModelConfig, SchedulerConfig
from rackserve.core.request import Request
from rackserve.core.scheduler import Scheduler
from rackserve.distributed.parallel_state import free_port
from rackserve.engine.data_parallel import least_load, merge_dp_stats
from rackserve.core.stats import SchedulerStats
from rackserve.serve.metrics import PrometheusStatLogger
from tests.test_engine_parity import NUM_TOKENS, SETTINGS, prompts_for

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
# Small KV caches: each worker zeroes its cache at start, and the default 2 GiB would cost seconds.
ENGINE = dict(dtype="float32", device="cpu", num_gpu_blocks_override=128)
HAS_EP = "enable_expert_parallel" in {f.name for f in dataclasses.fields(EngineArgs)}


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    llm.engine.core.check_integrity()
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0].token_ids for o in outs]


# -- in-process: placement and stats ----------------------------------------------------------
def _scheduler(num_blocks: int = 64) -> Scheduler:
    config = EngineConfig(ModelConfig("m", "m", "m", "float32", "cpu", 64, 0), CacheConfig(4, 1.0, True, None),
                          SchedulerConfig(8, 32))
    return Scheduler(config, num_blocks)


def test_least_load_counts_running_and_waiting_requests():
    schedulers = [_scheduler(), _scheduler()]
    placed = []
    for i in range(3):
        request = Request(str(i), [1, 2, 3], SamplingParams(max_tokens=4))
        placed.append(least_load(schedulers, request))
        schedulers[placed[-1]].add_request(request)
    assert placed == [0, 1, 0]
    schedulers[0].schedule()   # request 0 and 2 run on rank 0: still two requests of load
    assert least_load(schedulers, Request("x", [1], SamplingParams())) == 1


def test_merged_stats_sum_the_ranks_and_measure_idle_against_the_slowest():
    per_rank = [SchedulerStats(2, 1, 0.5, 10, 4, 1), SchedulerStats(1, 0, 0.25, 6, 0, 0)]
    merged = merge_dp_stats(per_rank, [100, 300], [0.030, 0.010])
    assert (merged.num_running_reqs, merged.num_waiting_reqs) == (3, 1)
    assert merged.kv_cache_usage == pytest.approx((50 + 75) / 400)   # over all blocks, not a mean of shares
    assert (merged.prefix_cache_queries, merged.prefix_cache_hits, merged.num_preemptions) == (16, 4, 1)
    assert [r.idle_seconds for r in merged.dp_ranks] == pytest.approx([0.0, 0.020])
    assert [r.num_running_reqs for r in merged.dp_ranks] == [2, 1]
    unmeasured = merge_dp_stats(per_rank, [100, 300], [0.030, None])
    assert [r.idle_seconds for r in unmeasured.dp_ranks] == [0.0, 0.0]


def test_world_size_is_dp_times_tp():
    parallel = EngineArgs(tensor_parallel_size=2, data_parallel_size=3)._parallel_config("cpu")
    assert parallel.world_size == 6 and [parallel.dp_rank_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="data_parallel_size must be > 0"):
        EngineArgs(data_parallel_size=0)._parallel_config("cpu")
    with pytest.raises(ValueError, match="the 3 ranks must split evenly over nnodes=2"):
        EngineArgs(data_parallel_size=3, nnodes=2, master_port=1)._parallel_config("cpu")


# -- real worker processes --------------------------------------------------------------------
@pytest.mark.parametrize("setting", ["mixed", "preempt"])
def test_dp2_greedy_tokens_match_one_process(tiny_llama_dir, setting):
    options = {**ENGINE, **SETTINGS[setting]}
    with LLM(tiny_llama_dir, **options) as llm:
        prompts = prompts_for(llm.engine.core.executor.vocab_size)
        expected = run(llm, prompts)
    preemptions = []

    class CountPreemptions:
        def record(self, scheduler_stats, iteration_stats):
            preemptions.append(scheduler_stats.num_preemptions)

    with LLM(tiny_llama_dir, data_parallel_size=2, **options) as llm:
        core = llm.engine.core
        pids = [w.process.pid for w in core.executor.workers]
        assert len(core.schedulers) == 2 and len(pids) == 2
        assert [s.kv.num_blocks for s in core.schedulers] == core.executor.dp_num_kv_blocks
        llm.engine.stat_loggers.append(CountPreemptions())
        assert run(llm, prompts) == expected
        # A second pass hits each rank's own prefix cache.
        assert run(llm, prompts) == expected
    assert not any(_alive(pid) for pid in pids), "leaving `with LLM(...)` must stop the workers"
    if setting == "preempt":
        assert sum(preemptions) > 0, "each rank's small KV cache must force preemption"


def test_placement_samples_aborts_and_idle_time(tiny_llama_dir):
    prompts = prompts_for(512)
    with LLM(tiny_llama_dir, **ENGINE) as llm:
        alone = run(llm, prompts[:1])[0]
    metrics = PrometheusStatLogger("tiny")
    with LLM(tiny_llama_dir, data_parallel_size=2, **ENGINE) as llm:
        engine, core = llm.engine, llm.engine.core
        engine.stat_loggers.append(metrics)

        def load() -> list[int]:
            return [len(s.running) + len(s.waiting) for s in core.schedulers]

        for i, prompt in enumerate(prompts[:4]):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, GREEDY)
        assert load() == [2, 2], "requests spread over both ranks"
        engine.add_request("pair", {"prompt_token_ids": prompts[4]}, dataclasses.replace(GREEDY, n=2))
        assert load() == [4, 2] and {"0_pair", "1_pair"} <= set(core.schedulers[0].requests)
        engine.add_request("r4", {"prompt_token_ids": prompts[5]}, GREEDY)
        assert load() == [4, 3]

        finished: dict[str, str] = {}
        for _ in range(3):
            finished.update((o.request_id, o.outputs[0].finish_reason) for o in engine.step() if o.finished)
        assert {"r0", "r1"} <= set(core.schedulers[0].requests) | set(core.schedulers[1].requests)
        rank_of = {rid: r for r, s in enumerate(core.schedulers) for rid in ("r0", "r1") if rid in s.requests}
        assert sorted(rank_of.values()) == [0, 1], "one abort on each rank"
        engine.abort_request("r0")
        engine.abort_request("r1")
        assert load() == [3, 2]
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o.outputs[0].finish_reason) for o in engine.step() if o.finished)
        assert finished == {rid: "length" for rid in ("r2", "r3", "pair", "r4")}
        core.check_integrity()

        # One request alone: rank 0 computes, rank 1 runs empty steps and waits for it.
        before = _idle_seconds(metrics)
        assert run(llm, prompts[:1]) == [alone]
        after = _idle_seconds(metrics)
        gained = {key: after[key] - before[key] for key in after}
        assert gained[("busy", "0")] > gained[("busy", "1")] and gained[("idle", "1")] > gained[("idle", "0")]
        text = metrics.exposition().decode()
        assert 'rackserve:dp_rank_num_requests_running{dp_rank="1",model_name="tiny"} 0.0' in text
        share = float(text.split("rackserve:dp_idle_share{model_name=\"tiny\"} ")[1].split()[0])
        assert 0 < share < 1

        # One prompt twice, unseeded: one copy per rank, and the ranks draw different random streams.
        random = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
        twice = llm.generate([{"prompt_token_ids": prompts[0]}] * 2, random)
        assert twice[0].outputs[0].token_ids != twice[1].outputs[0].token_ids


def test_dp2_over_two_nodes_matches_one_process(tiny_llama_dir, tmp_path):
    """DP rank 1 lives wholly on node 1: its steps and outputs pass through rank 0's collectives."""
    with LLM(tiny_llama_dir, **ENGINE) as llm:
        prompts = prompts_for(llm.engine.core.executor.vocab_size)
        expected = run(llm, prompts)
    port = free_port()
    nodes = dict(data_parallel_size=2, nnodes=2, master_port=port, **ENGINE)
    log = tmp_path / "node1.log"
    node1 = subprocess.Popen([sys.executable, "-m", "rackserve.serve.cli", "worker", f"--model={tiny_llama_dir}",
                              "--node-rank=1", *[f"--{k.replace('_', '-')}={v}" for k, v in nodes.items()]],
                             stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        with LLM(tiny_llama_dir, node_rank=0, **nodes) as llm:
            assert [w.rank for w in llm.engine.core.executor.workers] == [0]
            assert run(llm, prompts) == expected
        assert node1.wait(timeout=30) == 0, log.read_text()
    finally:
        node1.kill()


def _idle_seconds(metrics: PrometheusStatLogger) -> dict[tuple[str, str], float]:
    """(busy | idle, dp_rank) -> seconds so far, read back from the exposition."""
    out = {}
    for line in metrics.exposition().decode().splitlines():
        for kind in ("busy", "idle"):
            prefix = f"rackserve:dp_rank_{kind}_seconds_total{{"
            if line.startswith(prefix):
                rank = line.split('dp_rank="')[1].split('"')[0]
                out[(kind, rank)] = float(line.split()[-1])
    return out


@pytest.mark.skipif(not HAS_EP, reason="needs --enable-expert-parallel")
@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe_dir", "tiny_deepseek_v3_dir"])
def test_dep2_greedy_tokens_match_one_process(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    options = {**ENGINE, **SETTINGS["mixed"]}
    with LLM(model_dir, **options) as llm:
        prompts = prompts_for(llm.engine.core.executor.vocab_size)
        expected = run(llm, prompts)
    with LLM(model_dir, data_parallel_size=2, enable_expert_parallel=True, **options) as llm:
        assert run(llm, prompts) == expected
        # Alone on rank 0: rank 1 runs zero-token forwards through the experts' all-to-alls.
        assert run(llm, prompts[:1]) == expected[:1]
