"""The eighth round's per-step terms of the cost model, by hand: DeepSeek-V4-Flash's published
layer schedule, the lightning indexer's scoring and top-k as kernels of their own, the kernels a
compressed layer adds, and MTP's draft passes (docs/simulator.md, "Eighth round")."""
from __future__ import annotations

import pytest

from rackserve.sim.attention_work import extra_kernels_per_step, kind_work
from rackserve.sim.cost import CostModel, ParallelShape, SeqWork
from rackserve.sim.hardware import HARDWARE
from rackserve.sim.model_spec import load_model_spec
from rackserve.sim.mtp import draft_seconds

GB300 = HARDWARE["GB300"]


def _kinds(spec) -> dict[str, object]:
    return {("csa" if k.index_flops_per_entry else "hca" if k.compress else "window"): k for k in spec.attention}


@pytest.mark.parametrize("alias", ["deepseek-v4-flash", "deepseek-v4.1-flash"])
def test_v4_flash_runs_its_published_layer_schedule_and_mtp_block(alias):
    """compress_ratios [0, 0, (4, 128) x 20, 4, 0]: 2 sliding, 21 CSA, 20 HCA layers; the last 0 is
    the MTP block's. That block: q_a, q_b, kv, grouped o_a, o_b + the shared expert + the router +
    e_proj and h_proj."""
    spec = load_model_spec(alias)
    kinds = _kinds(spec)
    assert (kinds["window"].count, kinds["csa"].count, kinds["hca"].count) == (2, 21, 20)
    h, experts = 4096, spec.num_experts
    attn = h * 1024 + 1024 * 64 * 512 + h * 512 + 64 * 512 * 1024 + 8 * 1024 * h
    assert spec.mtp_dense_params == attn + 3 * h * 2048 + h * experts + 2 * h * h
    # 21 CSA layers of a compressor (3 kernels) and an indexer (7), 20 HCA layers of a compressor.
    assert extra_kernels_per_step(spec) == 21 * 10 + 20 * 3


def test_indexer_scoring_and_top_k_by_hand_and_only_where_an_indexer_is():
    """One decode after c tokens: the query scores min(c' / 4, 16K) CSA entries (c' = c + 1, its own
    position) with 64 heads x 128 in FP8 (2 FLOPs a multiply-add) and writes one fp32 score each,
    which the top-k reads back; HCA and sliding layers have none of it."""
    spec = load_model_spec("deepseek-v4.1-flash")
    kinds = _kinds(spec)
    for context, entries in ((4095, 1024), (131071, 16384), (854999, 16384)):
        work = kind_work(spec, kinds["csa"], 1, context)
        assert work.index_flops == 21 * entries * 2 * 64 * 128
        assert work.topk_bytes == 21 * entries * 2 * 4
        assert work.index_read == 21 * min((context + 1) / 4, 16384) * 128
        for other in ("hca", "window"):
            none = kind_work(spec, kinds[other], 1, context)
            assert none.index_flops == none.topk_bytes == none.index_read == 0
    # HCA attends every entry: its math grows with context; a CSA layer's stops at top-512.
    assert (kind_work(spec, kinds["hca"], 1, 855000).math_flops
            == pytest.approx(20 * (128 + 855001 / 128) * spec.attn_flops_per_key))
    assert kind_work(spec, kinds["csa"], 1, 855000).math_flops == 21 * (128 + 512) * spec.attn_flops_per_key


def test_attention_kernels_are_timed_apart_and_compressed_layers_add_their_kernels_floors():
    spec = load_model_spec("deepseek-v4.1-flash")
    model = CostModel(spec, GB300, ParallelShape(1, 4, True))
    batch = [SeqWork(4, 131072)] * 64
    att = model._attention(batch)
    parts = [p for kind in model.attention_by_kind(batch).values() for p in kind.values()]
    # Each kernel alone is at least its own roofline; the step's class is at least their sum's
    # max and includes 270 kernels' floors a step.
    assert att.flops == pytest.approx(sum(p.flops for p in parts))
    assert att.bytes == pytest.approx(sum(p.bytes for p in parts) + 64 * 4 * spec.kv_bytes_per_token(131072), rel=1e-9)
    floors = sum(p.seconds for p in parts if p.flops == p.bytes == 0)
    assert floors == pytest.approx(270 * 3e-6)
    # Scores cost more as the context grows, up to the indexer's 16K bound (64K tokens), then stay.
    topk = [next(k for label, k in model.attention_by_kind([SeqWork(4, c)] * 64).items() if label.startswith("CSA"))
            ["indexer top-k"].seconds for c in (16384, 65536, 131072, 855000)]
    assert topk[0] < topk[1] == topk[2] == topk[3]
    # A model without compressed layers: no floors, no indexer kernels, no top-k bytes.
    llama = load_model_spec("llama-3-8b")
    assert extra_kernels_per_step(llama) == 0
    one = CostModel(llama, GB300)._attention([SeqWork(1, 4096)])
    mem = one.bytes / (GB300.mem_bw * 0.8)
    assert one.seconds == pytest.approx(max(one.flops / (GB300.peak_flops("bf16") * 0.6), mem))


def test_mtp_draft_passes_vanish_without_drafts_and_add_up_one_pass_at_a_time():
    spec = load_model_spec("deepseek-v4.1-flash")
    model = CostModel(spec, GB300, ParallelShape(8, 1, True))
    one_user = [[SeqWork(4, 131072)]]
    assert draft_seconds(model, one_user, 0) == 0.0
    assert draft_seconds(CostModel(load_model_spec("llama-3-8b"), GB300), one_user, 3) == 0.0
    one, three = draft_seconds(model, one_user, 1), draft_seconds(model, one_user, 3)
    assert three == pytest.approx(3 * one)
    # A pass is a step of its own: at least its launch and one layer's floor, and far short of the
    # 43-layer target step; more sequences draft longer.
    assert GB300.step_overhead + GB300.layer_overhead < one < model.step(one_user).seconds / 10
    assert draft_seconds(model, [[SeqWork(4, 131072)] * 64], 1) > one


def test_the_long_prefill_cap_reaches_both_pools_schedulers():
    """`rackserve sim --long-prefill-token-threshold` is vLLM's cap on one prompt's tokens a step:
    the simulated engine's scheduler takes it, a P/D prefill pool with its own budget keeps it (and
    `--max-waiting-tokens` likewise)."""
    import argparse
    from rackserve.sim.cli import add_args
    from rackserve.sim.instance import SimSetup
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--model", "qwen3-30b-a3b", "--hardware", "H100", "--prefill", "1", "--decode", "1",
                              "--max-num-batched-tokens", "8192", "--prefill-max-num-batched-tokens", "16384",
                              "--long-prefill-token-threshold", "4096", "--max-waiting-tokens", "20"])
    setup = SimSetup.from_args(args, HARDWARE["H100"])
    assert setup.config.scheduler.long_prefill_token_threshold == 4096
    assert setup.config.scheduler.max_waiting_tokens == setup.prefill.config.scheduler.max_waiting_tokens == 20
    prefill = setup.prefill.config.scheduler
    assert (prefill.max_num_batched_tokens, prefill.long_prefill_token_threshold) == (16384, 4096)
    assert SimSetup.from_args(parser.parse_args(["--model", "qwen3-30b-a3b", "--hardware", "H100"]),
                              HARDWARE["H100"]).config.scheduler.long_prefill_token_threshold == 0


def test_a_closed_loop_step_pays_its_mtp_draft_passes(tiny_llama_dir):
    """`rackserve sim --num-speculative-tokens k`: a decode verifies its drafts as rows of their own
    (the LM head on every row), and every step that samples is followed by k draft passes over its
    sampling sequences (sim/mtp.py), which the virtual clock pays."""
    from rackserve.config import EngineArgs, SpeculativeConfig
    from rackserve.core.request import Request
    from rackserve.engine.core import EngineCore
    from rackserve.sampling_params import SamplingParams
    from rackserve.sim.executor import SimExecutor
    import dataclasses
    spec = dataclasses.replace(load_model_spec("deepseek-v4.1-flash"), max_model_len=1024)
    k, max_tokens = 3, 8
    config = dataclasses.replace(EngineArgs(model=tiny_llama_dir, num_gpu_blocks_override=64).create_engine_config(),
                                 speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=k))
    executor = SimExecutor(config, CostModel(spec, GB300), spec, acceptance_rate=0.0)
    core = EngineCore(config, executor)
    core.add_requests([Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens, ignore_eos=True))])
    times = []
    while core.has_unfinished_requests():
        core.step()
        times.append(executor.last_step_seconds)
    assert len(times) == max_tokens      # nothing accepted: one token a step
    model = CostModel(spec, GB300)
    for i, seconds in enumerate(times):   # the prompt's step, then decodes with all the drafts that may be output
        drafts = min(k, max_tokens - i - 1) if i else 0
        work = SeqWork(4, 0, True) if i == 0 else SeqWork(1 + drafts, 3 + i, True, drafts)
        expected = model.step([[work]]).seconds + draft_seconds(model, [[work]], k)
        assert seconds == pytest.approx(expected, rel=1e-6)
    assert model.step([[SeqWork(4, 100, True, 3)]]).ranks[0].dense.flops - \
        model.step([[SeqWork(4, 100, True, 0)]]).ranks[0].dense.flops == pytest.approx(2 * spec.lm_head_params * 3)