"""`rackserve bench forward` on a tiny random Llama: the timed steps do exactly the work asked
(tokens timed = tokens scheduled in the SchedulerOutputs executed, the context already in the KV
cache as the attention sees it, every repetition alike), A/B sides alternate, the profile splits
a step by layer kind, the cost model counts by hand, a DP executor runs each DP rank's share of
the batch, and the command writes its JSON.

The executors are real; RecordingExecutor forwards every step to one and writes it down.
"""
from __future__ import annotations

import json

import pytest
import torch

from rackserve.bench.forward import parse_compare
from rackserve.bench.forward_steps import KINDS, ForwardPoint, RepeatedStep, Side, dp_shares, model_cost, time_point
from rackserve.config import EngineArgs, EngineConfig
from rackserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from rackserve.executor.base import Executor, create_executor
from rackserve.serve import cli


class RecordingExecutor(Executor):
    def __init__(self, inner: Executor, log: list, label: str = "A"):
        self.inner, self.log, self.label = inner, log, label
        self.num_kv_blocks, self.model_max_len = inner.num_kv_blocks, inner.model_max_len
        self.vocab_size = inner.vocab_size

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = self.inner.execute(scheduler_output)
        self.log.append((self.label, scheduler_output, out))
        return out


def tiny_config(model_dir: str, **overrides) -> EngineConfig:
    return EngineArgs(model=model_dir, device="cpu", num_gpu_blocks_override=64, **overrides).create_engine_config()


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    config = tiny_config(tiny_llama_dir)
    executor = create_executor(config)
    yield config, executor
    executor.shutdown()


@pytest.mark.parametrize("mode,new_tokens", [("decode", 1), ("prefill", 16)])
@pytest.mark.parametrize("context_len", [0, 40])
def test_timed_tokens_are_the_scheduled_tokens_over_the_cached_context(tiny, mode, new_tokens, context_len,
                                                                      monkeypatch):
    config, executor = tiny
    log: list = []
    seen = []   # the attention metadata of every step, as the first layer receives it
    # The modules, so that the hook sees decode steps too (the native decode step skips them).
    monkeypatch.setattr(executor.runner, "native_decoder", None)
    hook = executor.model.model.layers[0].self_attn.attn.register_forward_pre_hook(
        lambda module, args: seen.append(args[3]))
    point = ForwardPoint(mode, 3, context_len, new_tokens)
    try:
        (timing,) = time_point([Side(RecordingExecutor(executor, log), config)], point, 0.05, 2, seed=0)
    finally:
        hook.remove()
    steps = len(timing.step_s)
    assert steps >= 3 and timing.tokens_timed == steps * 3 * new_tokens
    assert timing.tokens_sampled == steps * 3
    ran = [so for _, so, _ in log if not so.is_empty]
    assert len(ran) == 2 + steps
    assert sum(so.total_num_scheduled_tokens for so in ran[2:]) == timing.tokens_timed
    for so, (_, _, out) in zip(ran, log):
        assert list(so.num_scheduled_tokens.values()) == [new_tokens] * 3
        assert [r.num_computed_tokens for r in so.scheduled_new_reqs] == [context_len] * 3
        assert out.req_ids == list(so.num_scheduled_tokens)
    # Every step, warm-up and timed, attends over the same context: nothing grows between repetitions.
    assert len(seen) == len(ran)
    for meta in seen:
        if mode == "decode":
            assert not meta.prefills and meta.decode_kv_len == context_len + 1 and meta.num_tokens == 3
        else:
            assert meta.decode_rows is None
            assert [p.kv_len for p in meta.prefills] == [context_len + new_tokens] * 3
            assert all((p.block_ids is None) == (context_len == 0) for p in meta.prefills)
    # The closing step only retires the last batch, and the runner holds no request after it.
    closing = log[-1][1]
    assert closing.is_empty and closing.finished_req_ids == set(ran[-1].num_scheduled_tokens)
    assert executor.runner.requests == {}


def test_two_sides_alternate_step_by_step(tiny_llama_dir):
    configs = [tiny_config(tiny_llama_dir), tiny_config(tiny_llama_dir, dtype="bfloat16")]
    executors = [create_executor(c) for c in configs]
    log: list = []
    try:
        sides = [Side(RecordingExecutor(e, log, label), c) for e, c, label in zip(executors, configs, "AB")]
        a, b = time_point(sides, ForwardPoint("decode", 2, 8, 1), 0.05, 1, seed=0)
    finally:
        for e in executors:
            e.shutdown()
    assert len(a.step_s) == len(b.step_s) and a.tokens_timed == b.tokens_timed
    labels = [label for label, so, _ in log if not so.is_empty]
    assert labels == ["A", "B"] * (1 + len(a.step_s))


def test_each_in_process_side_steps_on_its_own_native_build(tiny_llama_dir):
    # --compare native_isa=avx2: the build of the fused ops is one a process, so each side's steps
    # must switch to its own, or both would time the last-loaded side's.
    from rackserve.model import native_ops
    from rackserve.model.native import unavailable_reason
    if unavailable_reason(isa="avx512") or unavailable_reason(isa="avx2"):
        pytest.skip("needs both native builds (an AVX-512 VNNI CPU and g++)")
    configs = [tiny_config(tiny_llama_dir, native_isa=isa) for isa in ("avx512", "avx2")]
    executors = [create_executor(c) for c in configs]
    seen: list = []
    try:
        for e in executors:
            e.execute_dp = lambda sos, run=e.execute_dp: (seen.append(native_ops.library()), run(sos))[1]
        time_point([Side(e, c) for e, c in zip(executors, configs)], ForwardPoint("decode", 1, 8, 1), 0.01, 1, 0)
    finally:
        for e in executors:
            e.shutdown()
        native_ops.use_isa("auto")
    assert seen[:4] == [native_ops.load("avx512"), native_ops.load("avx2")] * 2


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_qwen3_moe_dir",
                                           "tiny_deepseek_v3_dir"])
def test_profile_splits_the_step_by_layer_kind(request, model_fixture):
    config = tiny_config(request.getfixturevalue(model_fixture))
    executor = create_executor(config)
    try:
        point = ForwardPoint("prefill", 2, 16, 8)
        (in_process,) = time_point([Side(executor, config)], point, 0.0, 1, seed=0, profile=True)
        (elsewhere,) = time_point([Side(RecordingExecutor(executor, []), config)], point, 0.0, 1, seed=0, profile=True)
    finally:
        executor.shutdown()
    shares = in_process.profile
    assert list(shares) == list(KINDS)
    assert sum(shares.values()) == pytest.approx(1.0)
    # Norms inside attention (Qwen3's q/k norms, MLA's latent norms) count as attention once, never
    # twice: "other", the remainder, stays positive.
    assert all(v > 0 for v in shares.values()), shares
    assert elsewhere.profile is None


def test_model_cost_counts_the_tiny_llama_by_hand(tiny_llama_dir):
    # hidden 64, intermediate 128, 3 layers, 4 heads and 2 KV heads of 16, vocab 512, untied, fp32
    # (given: auto would be bf16 on a CPU with native bf16).
    cost = model_cost(tiny_config(tiny_llama_dir, dtype="float32").model)
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 256 + 128 * 64
    assert cost.linear_params == 3 * per_layer
    assert cost.lm_head_params == 512 * 64
    norms = 3 * 2 * 64 + 64
    assert cost.weight_bytes == 4 * (3 * per_layer + 512 * 64 + norms)   # the untied embedding is only gathered
    assert cost.kv_bytes_per_token == 3 * 2 * 2 * 16 * 4
    point = ForwardPoint("prefill", 2, 10, 3)   # queries at positions 10, 11, 12 see 11 + 12 + 13 keys
    assert cost.step_flops(point) == 2 * 3 * per_layer * 6 + 2 * 512 * 64 * 2 + 4 * 3 * 64 * 2 * 36
    assert cost.step_bytes(point) == cost.weight_bytes + 2 * 13 * cost.kv_bytes_per_token


def test_model_cost_counts_a_bf16_checkpoints_linears_at_two_bytes_in_float32(tiny_llama_dir, tmp_path):
    # The same tiny Llama saved in bf16 and run in float32: loader.keep_bf16_linears keeps its
    # linears in bf16, so a step reads 2 bytes a linear weight; norms and lm_head stay float32.
    from tests.tiny_models import load_hf
    load_hf(tiny_llama_dir).to(torch.bfloat16).save_pretrained(tmp_path)
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 256 + 128 * 64
    cost = model_cost(tiny_config(str(tmp_path), dtype="float32").model)
    assert cost.weight_bytes == 2 * 3 * per_layer + 4 * (512 * 64 + 3 * 2 * 64 + 64)


def test_model_cost_counts_routed_experts_by_their_share(tiny_qwen3_moe_dir):
    # 3 layers (layer 1 dense), 8 experts of intermediate 32, top-2, hidden 64, 4 heads and 2 KV heads of 32.
    cost = model_cost(tiny_config(tiny_qwen3_moe_dir, dtype="float32").model)
    per_expert = 2 * 32 * 64 + 64 * 32
    assert (cost.num_experts, cost.experts_per_token) == (8, 2)
    assert cost.expert_params == 2 * 8 * per_expert and cost.expert_bytes == 4 * cost.expert_params
    assert cost.linear_params == 3 * (64 * (4 * 32 + 2 * 2 * 32) + 4 * 32 * 64) + (64 * 256 + 128 * 64)
    one, four = ForwardPoint("decode", 1, 0, 1), ForwardPoint("decode", 4, 0, 1)
    kv = cost.kv_bytes_per_token
    assert cost.step_bytes(one) == cost.weight_bytes + round(cost.expert_bytes / 4) + kv
    assert cost.step_bytes(four) == cost.weight_bytes + round(cost.expert_bytes * (1 - 0.75 ** 4)) + 4 * kv
    assert cost.step_flops(one) == 2 * (cost.linear_params + cost.expert_params // 4) + 2 * 512 * 64 \
        + cost.attn_flops_per_pair


def test_parse_compare_builds_the_b_side():
    base = EngineArgs(model="m")
    assert parse_compare("dtype=bfloat16", base, "uniproc") == (EngineArgs(model="m", dtype="bfloat16"), "uniproc")
    assert parse_compare("--enable-prefix-caching=false", base, "uniproc")[0].enable_prefix_caching is False
    assert parse_compare("num_gpu_blocks_override=None", base, "uniproc")[0].num_gpu_blocks_override is None
    assert parse_compare("block-size=32", base, "uniproc")[0].block_size == 32
    assert parse_compare("executor=other", base, "uniproc") == (base, "other")
    dep = parse_compare("data_parallel_size=2,enable-expert-parallel=true", base, "uniproc")[0]
    assert (dep.data_parallel_size, dep.enable_expert_parallel) == (2, True)
    for bad in ("dtype", "colour=red", "enable_prefix_caching=maybe", "dtype=bfloat16,"):
        with pytest.raises(ValueError):
            parse_compare(bad, base, "uniproc")


def test_command_runs_an_ab_and_writes_json(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "forward.json"
    rc = cli.main(["bench", "forward", "--model", tiny_llama_dir, "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1,2",
                   "--context-lens", "0,20", "--seconds", "0.05", "--warmup-steps", "1",
                   "--compare", "dtype=bfloat16", "--compare", "dtype=bfloat16,block-size=32", "--output", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert printed.count("B/A: tok/s") == printed.count("C/A: tok/s") == 4 and "memory read" in printed
    result = json.loads(out.read_text())
    settings = result["settings"]
    assert [settings[side]["dtype"] for side in "ABC"] == ["float32", "bfloat16", "bfloat16"]
    assert [settings[side]["block_size"] for side in "ABC"] == [16, 16, 32]
    assert [(p["batch_size"], p["context_len"]) for p in result["points"]] == [(1, 0), (1, 20), (2, 0), (2, 20)]
    for p in result["points"]:
        for side in "ABC":
            assert p[side]["tokens_timed"] == p[side]["steps"] * p["batch_size"]
        # Three sides alternate step by step, so each ran as often as the others.
        assert p["A"]["steps"] == p["B"]["steps"] == p["C"]["steps"]
        for side in "BC":
            assert p[f"{side.lower()}_over_a"]["tok_s"] == pytest.approx(p[side]["tok_s"] / p["A"]["tok_s"])


def test_command_refuses_a_batch_the_kv_cache_cannot_hold(tiny_llama_dir, capsys):
    rc = cli.main(["bench", "forward", "--model", tiny_llama_dir, "--device", "cpu", "--num-gpu-blocks-override", "4",
                   "--batch-sizes", "2", "--context-lens", "40", "--seconds", "0"])
    assert rc == 2
    assert "needs 6 KV blocks, the cache has 4" in capsys.readouterr().err


def test_steps_run_through_the_multiprocess_executor(tiny_llama_dir):
    config = tiny_config(tiny_llama_dir, tensor_parallel_size=2)
    executor = create_executor(config)
    try:
        (timing,) = time_point([Side(executor, config)], ForwardPoint("decode", 2, 8, 1), 0.0, 1, seed=0,
                               profile=True)
    finally:
        executor.shutdown()
    assert timing.tokens_timed == timing.tokens_sampled == 2 * len(timing.step_s)
    assert timing.profile is None     # the model lives in the worker processes


def test_dp_shards_are_the_batch_split_with_its_own_prompts():
    point = ForwardPoint("prefill", 5, 8, 4)
    assert [list(r) for r in dp_shares(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in dp_shares(1, 2)] == [[0], []]
    whole = RepeatedStep(point, 4, 512, seed=7).next()
    shards = [RepeatedStep(point, 4, 512, seed=7, shard=(r, 2)).next() for r in range(2)]
    assert [len(so.scheduled_new_reqs) for so in shards] == [3, 2]
    assert sum(so.total_num_scheduled_tokens for so in shards) == whole.total_num_scheduled_tokens == 20
    assert [r.prompt_token_ids for so in shards for r in so.scheduled_new_reqs] == \
        [r.prompt_token_ids for r in whole.scheduled_new_reqs]
    # Each DP rank has a cache of its own: its requests' blocks start at 0 there (3 blocks each).
    assert [r.block_ids for r in shards[1].scheduled_new_reqs] == [([0, 1, 2],), ([3, 4, 5],)]
    idle = RepeatedStep(ForwardPoint("decode", 1, 8, 1), 4, 512, seed=7, shard=(1, 2))
    assert idle.next().is_empty and idle.retire().is_empty


class DPRecordingExecutor(RecordingExecutor):
    """Writes down every step of every DP rank: (SchedulerOutputs, ModelRunnerOutputs)."""

    @property
    def dp_num_kv_blocks(self) -> list[int]:
        return self.inner.dp_num_kv_blocks

    def execute_dp(self, scheduler_outputs: list[SchedulerOutput]) -> list[ModelRunnerOutput]:
        outs = self.inner.execute_dp(scheduler_outputs)
        self.log.append((scheduler_outputs, outs))
        return outs


def test_dep_steps_split_the_batch_over_the_dp_ranks(tiny_qwen3_moe_dir):
    config = tiny_config(tiny_qwen3_moe_dir, data_parallel_size=2, enable_expert_parallel=True)
    executor = create_executor(config)
    try:
        # 3 requests: 2 on DP rank 0, 1 on DP rank 1; 1 request: DP rank 1 runs its MoE layers on nothing.
        for batch, shares in ((3, [2, 1]), (1, [1, 0])):
            log: list = []
            (timing,) = time_point([Side(DPRecordingExecutor(executor, log), config)],
                                   ForwardPoint("decode", batch, 8, 1), 0.0, 1, seed=0)
            assert timing.tokens_timed == timing.tokens_sampled == batch * len(timing.step_s)
            ran = [(sos, outs) for sos, outs in log if any(not so.is_empty for so in sos)]
            assert len(ran) == 1 + len(timing.step_s)
            for sos, outs in ran:
                assert [so.total_num_scheduled_tokens for so in sos] == shares
                # Each DP rank sampled for its own requests: the split reached the workers.
                assert [out.req_ids for out in outs] == [list(so.num_scheduled_tokens) for so in sos]
    finally:
        executor.shutdown()
