"""Tensor and expert parallelism for the MoE models, in real processes: TP=2 and TP=2 with expert
parallelism give one process's greedy tokens and per-expert token counts on the tiny Qwen3-MoE
and DeepSeek-V3 (MLA with q_lora_rank; and MLA through q_proj with 3 heads split 2 + 1, two shared
experts), across mixed batches, preemption and chunked prefill. The all-to-all dispatcher alone,
in two processes, matches a one-process layer when the ranks hold different numbers of tokens
(as DP ranks do, one of them none) and when they hold the same tokens (a TP group). Expert counts
reach /metrics; experts that do not split evenly over the EP group are refused with a clear error.
"""
from __future__ import annotations

import dataclasses
import os
import re
import traceback
from multiprocessing.connection import Connection

import pytest
import torch

from rackserve import LLM, SamplingParams
from rackserve.config import ParallelConfig
from rackserve.distributed.parallel_state import GroupCoordinator, ParallelGroups, free_port, init_distributed
from rackserve.core.stats import sum_expert_token_counts
from rackserve.engine.stats import StatLogger
from rackserve.executor.worker import WorkerError
from rackserve.model.moe import FusedMoE
from rackserve.model.moe_dispatch import ExpertPlacement
from rackserve.model.gate import Routing
from rackserve.serve.metrics import PrometheusStatLogger
from tests.test_engine_parity import NUM_TOKENS, SETTINGS, prompts_for, run
from tests.tiny_models import DEEPSEEK_V3, QWEN3_MOE, TINY_KV_CACHE_GIB, build_tiny_model
from tests.tokenizer_utils import save_test_tokenizer

ENGINE = dict(dtype="float32", device="cpu")
NUM_EXPERTS, HIDDEN, INTER, TOP_K = 8, 16, 12, 2


class ExpertCounts(StatLogger):
    """Adds up the expert counts of every step."""

    def __init__(self) -> None:
        self.total: list[int] | None = None

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.total = sum_expert_token_counts([self.total, scheduler_stats.expert_token_counts])


def test_experts_split_in_equal_contiguous_ranges():
    parts = [ExpertPlacement.for_rank(8, 4, r) for r in range(4)]
    assert [(p.first, p.num_local) for p in parts] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    with pytest.raises(ValueError, match="6 routed experts to split evenly over the 4 ranks"):
        ExpertPlacement.for_rank(6, 4, 0)


# -- the dispatcher alone, two processes -------------------------------------------------------------

def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return 0.3 * torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=g), \
        0.3 * torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=g)


def _layer(groups: ParallelGroups | None) -> FusedMoE:
    """A layer of this rank's experts (every one without groups), loaded expert by expert."""
    w13, w2 = _weights()
    layer = FusedMoE(NUM_EXPERTS, HIDDEN, INTER, groups=groups)
    first = layer.placement.first
    for e in range(first, first + layer.placement.num_local):
        layer.weight_loader(layer.w13_weight, w13[e, :INTER], (e, "w1"))
        layer.weight_loader(layer.w13_weight, w13[e, INTER:], (e, "w3"))
        layer.weight_loader(layer.w2_weight, w2[e], (e, "w2"))
    return layer


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, Routing]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(n, TOP_K, dtype=torch.int64)
    for row in ids:
        row.copy_(torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K])
    ids[:n // 2, 0] = torch.where(ids[:n // 2, 1] == 1, 2, 1)   # a busy expert: the ranks get unequal rows
    return torch.randn(n, HIDDEN, generator=g), Routing(ids, torch.rand(n, TOP_K, generator=g))


def _check_dispatch(rank: int, port: int, conn: Connection) -> None:
    try:
        torch.set_num_threads(1)
        parallel = ParallelConfig(tensor_parallel_size=2, master_port=port, enable_expert_parallel=True)
        tp_group = init_distributed(parallel, rank)
        assert tp_group.ep.world_size == 2
        # The same two ranks as DP ranks (TP groups of one, each with its own tokens)...
        dp_group = dataclasses.replace(tp_group, tp=GroupCoordinator((rank,), 0))
        reference = _layer(None)
        for groups, token_counts in ((dp_group, [(13, 0), (0, 6), (5, 9), (1, 1)]),
                                     (tp_group, [(7, 7), (1, 1), (0, 0)])):     # ...or one TP group
            layer = _layer(groups)
            assert layer.placement.num_local == NUM_EXPERTS // 2
            want = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
            for step, counts in enumerate(token_counts):
                x, routing = _tokens(counts[rank], 10 * step + (rank if groups is dp_group else 0))
                torch.testing.assert_close(layer(x, routing), reference(x, routing), atol=1e-5, rtol=1e-5)
                want += torch.bincount(routing.topk_ids.flatten(), minlength=NUM_EXPERTS)
            assert torch.equal(layer.expert_token_counts, want), "each rank counts its own tokens' choices"
        conn.send(None)
    except BaseException:    # noqa: BLE001 - the parent reports it
        conn.send(traceback.format_exc())
    conn.close()
    os._exit(0)   # as workers do: no process-group teardown while the peer may still be in it


def test_all_to_all_dispatch_matches_one_process_with_equal_and_unequal_tokens_per_rank():
    ctx = torch.multiprocessing.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_check_dispatch, args=(r, port, pipes[r][1]), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for rank, (receive, send) in enumerate(pipes):
            send.close()
            assert receive.poll(120), f"rank {rank} did not answer"
            failure = receive.recv()
            assert failure is None, f"rank {rank}:\n{failure}"
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# -- whole models through the engine ----------------------------------------------------------------

def _tiny(tmp_path_factory, name: str, arch: str, **overrides) -> str:
    path = build_tiny_model(arch, tmp_path_factory.mktemp(name), **overrides)
    save_test_tokenizer(path, 512)
    return path


@pytest.fixture(scope="module")
def tiny_deepseek_v3_3heads_dir(tmp_path_factory) -> str:
    """MLA through q_proj (no q_lora_rank) with 3 heads (TP=2: 2 + 1), two shared experts."""
    overrides = {**DEEPSEEK_V3, "q_lora_rank": None, "n_group": 1, "topk_group": 1, "n_shared_experts": 2,
                 "num_attention_heads": 3, "num_key_value_heads": 3}
    return _tiny(tmp_path_factory, "tiny_deepseek_v3_3heads", "DeepseekV3ForCausalLM", seed=7, **overrides)


@pytest.fixture(scope="module")
def tiny_qwen3_moe_5experts_dir(tmp_path_factory) -> str:
    return _tiny(tmp_path_factory, "tiny_qwen3_moe_5experts", "Qwen3MoeForCausalLM", seed=8,
                 **{**QWEN3_MOE, "num_experts": 5})


# Each case runs one process, TP=2, and TP=2 with expert parallelism (EP group of 2, each rank
# dispatching half of the tokens). Small KV caches: every rank zeroes its cache at start.
CASES = {
    "qwen3_moe_mixed": ("tiny_qwen3_moe_dir", dict(SETTINGS["mixed"], num_gpu_blocks_override=128)),
    "deepseek_v3_preempt": ("tiny_deepseek_v3_dir", SETTINGS["preempt"]),
    "deepseek_v3_q_proj_3heads_chunked": ("tiny_deepseek_v3_3heads_dir",
                                          dict(max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks_override=128)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_and_ep2_give_one_process_tokens_and_expert_counts(request, case):
    fixture, settings = CASES[case]
    model_dir = request.getfixturevalue(fixture)
    options = dict(ENGINE, **settings)
    with LLM(model_dir, **options) as llm:
        prompts = prompts_for(llm.engine.core.executor.vocab_size)
        counts = ExpertCounts()
        llm.engine.stat_loggers.append(counts)
        expected = run(llm, prompts)
    assert counts.total is not None and len(counts.total) == 8
    for parallel in (dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, enable_expert_parallel=True)):
        with LLM(model_dir, **options, **parallel) as llm:
            parallel_counts = ExpertCounts()
            llm.engine.stat_loggers.append(parallel_counts)
            assert run(llm, prompts) == expected, parallel
        assert parallel_counts.total == counts.total, parallel


def test_expert_counts_reach_metrics(tiny_qwen3_moe_dir):
    # 2 sparse layers (layer 1 is dense), top-2: each token the forward computes adds 4 pairs.
    prometheus, counts = PrometheusStatLogger("tiny"), ExpertCounts()
    with LLM(tiny_qwen3_moe_dir, **ENGINE, max_num_batched_tokens=64, kv_cache_memory=TINY_KV_CACHE_GIB) as llm:
        llm.engine.stat_loggers += [prometheus, counts]
        prompts = prompts_for(512)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True))
    # No preemption here: each prompt's uncached tokens once, then one token per further output.
    forward_tokens = sum(len(p) - o.num_cached_tokens + NUM_TOKENS - 1 for p, o in zip(prompts, outs))
    assert any(o.num_cached_tokens for o in outs)
    assert counts.total is not None and sum(counts.total) == 2 * 2 * forward_tokens
    text = prometheus.exposition().decode()
    series = r'^rackserve:moe_expert_tokens_total\{expert="(\d+)",model_name="tiny"\} (\S+)$'
    exposed = {int(m[1]): float(m[2]) for m in re.finditer(series, text, re.M)}
    assert exposed == {e: float(n) for e, n in enumerate(counts.total) if n > 0}


def test_experts_not_divisible_by_the_ep_size_are_refused(tiny_qwen3_moe_5experts_dir):
    with pytest.raises(WorkerError, match="5 routed experts to split evenly over the 2 ranks"):
        LLM(tiny_qwen3_moe_5experts_dir, **ENGINE, tensor_parallel_size=2, enable_expert_parallel=True,
            num_gpu_blocks_override=16)
