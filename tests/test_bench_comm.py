"""`rackserve bench comm` end to end on 2 gloo ranks: every (op, size) is timed, and a tiny
Llama's TP=2 decode step makes exactly the collective calls tensor parallelism implies (2 per
layer, the embedding's, the logits' all-gather and the step's broadcast), every rank spending part
of its step inside them; a tiny Qwen3-MoE's expert-parallel step adds the three all-to-alls of
each MoE layer; a DEP step (DP=2 with EP) makes only those all-to-alls and the broadcast, and
`--profile` splits each rank's step by layer kind with its communication apart.
"""
from __future__ import annotations

import json

import pytest

from rackserve.serve.cli import main


def test_bench_comm_times_collectives_and_counts_a_steps_calls(tiny_llama_dir, tmp_path):
    out = tmp_path / "comm.json"
    assert main(["bench", "comm", "--iters", "3", "--sizes", "256,4K", "--model", tiny_llama_dir,
                 "--steps", "2", "--batch-sizes", "1", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    timed = [(r["op"], r["bytes"]) for r in rows if "bytes" in r]
    assert timed == [(op, size) for op in ("all_reduce", "all_gather", "all_to_all", "broadcast_object")
                     for size in (256, 4096)]
    assert all(r["median_us"] > 0 for r in rows if "bytes" in r)
    steps = [r for r in rows if "step_ms" in r]
    assert sorted(r["rank"] for r in steps) == [0, 1]
    layers = 3   # tests/tiny_models.py
    assert all(r["collective_calls"] == 2 * layers + 3 for r in steps)
    assert all(0 < r["in_collectives_ms"] < r["step_ms"] for r in steps)


def test_bench_comm_counts_an_expert_parallel_steps_all_to_alls(tiny_qwen3_moe_dir, tmp_path):
    out = tmp_path / "comm.json"
    assert main(["bench", "comm", "--iters", "3", "--ops", "all_to_all", "--sizes", "256", "--model",
                 tiny_qwen3_moe_dir, "--enable-expert-parallel", "--steps", "2", "--batch-sizes", "3",
                 "--output", str(out)]) == 0
    steps = [r for r in json.loads(out.read_text())["rows"] if "step_ms" in r]
    # 3 layers, each with attention's all-reduce; layer 1's dense MLP one all-reduce; layers 0 and
    # 2 sparse: counts, tokens and results all-to-all, then the all-reduce over TP.
    per_layer = [1 + 4, 1 + 1, 1 + 4]
    assert all(r["collective_calls"] == sum(per_layer) + 3 for r in steps)


def test_bench_comm_runs_dep_steps_and_profiles_each_rank(tiny_qwen3_moe_dir, tmp_path):
    out = tmp_path / "comm.json"
    assert main(["bench", "comm", "--iters", "3", "--ops", "all_to_all", "--sizes", "256", "--model",
                 tiny_qwen3_moe_dir, "--enable-expert-parallel", "--data-parallel-size", "2", "--profile",
                 "--steps", "2", "--batch-sizes", "1,3", "--output", str(out)]) == 0
    steps = [r for r in json.loads(out.read_text())["rows"] if "step_ms" in r]
    assert sorted((r["batch_size"], r["rank"], r["dp_rank"]) for r in steps) == [(1, 0, 0), (1, 1, 1), (3, 0, 0),
                                                                                (3, 1, 1)]
    # TP=1 in each DP rank: no all-reduce, no all-gather; 2 sparse layers x 3 all-to-alls, the broadcast.
    assert all(r["collective_calls"] == 2 * 3 + 1 for r in steps)
    for r in steps:
        profile = r["profile"]
        assert sum(profile.values()) == pytest.approx(1.0)
        assert profile["communication"] > 0 and profile["mlp/moe"] > 0 and profile["other"] >= 0
        # One request over 2 DP ranks: DP rank 1 runs its layers on no token and samples nothing.
        idle = r["batch_size"] == 1 and r["dp_rank"] == 1
        assert (profile["lm_head+sampling"] == 0) == idle


def test_bench_comm_runs_a_model_with_kv_cache_groups(tmp_path):
    """DeepSeek-V4 keeps one block table per cache group (window, csa, hca): the steps bench comm
    builds carry a table per group, as bench forward's do."""
    from tests.tiny_models import build_tiny_deepseek_v4
    model = build_tiny_deepseek_v4(tmp_path / "dsv4")
    out = tmp_path / "comm.json"
    assert main(["bench", "comm", "--iters", "2", "--ops", "all_reduce", "--sizes", "256", "--model", model,
                 "--steps", "2", "--batch-sizes", "2", "--output", str(out)]) == 0
    steps = [r for r in json.loads(out.read_text())["rows"] if "step_ms" in r]
    assert sorted(r["rank"] for r in steps) == [0, 1] and all(r["collective_calls"] > 0 for r in steps)
