"""Tensor parallelism: TP=2 in real worker processes gives the same greedy tokens as one process,
on GQA heads split evenly (tiny Llama), tied embeddings and q/k norms (tiny Qwen3), KV groups that
do not split evenly with biases and a padded vocabulary (Llama, 6 heads / 3 KV heads / vocab 509),
and a KV head replicated on both ranks (Qwen2 with one KV head); leaving `with LLM(...)` or calling
shutdown() leaves no worker process behind. The slicing rules themselves are checked in-process.
"""
from __future__ import annotations

import os

import pytest

from rackserve import LLM
from rackserve.model.layers import head_partition, split_evenly
from tests.test_engine_parity import SETTINGS, prompts_for, run
from tests.tiny_models import build_tiny_model
from tests.tokenizer_utils import save_test_tokenizer


@pytest.mark.parametrize("total,parts", [(9, 2), (8, 2), (3, 2), (1536, 3), (2, 4)])
def test_split_evenly_covers_everything_once(total, parts):
    pieces = [split_evenly(total, parts, i) for i in range(parts)]
    assert [start for start, _ in pieces] == [sum(n for _, n in pieces[:i]) for i in range(parts)]
    assert sum(n for _, n in pieces) == total
    assert max(n for _, n in pieces) - min(n for _, n in pieces) <= 1


@pytest.mark.parametrize("heads,kv_heads,tp", [(4, 2, 2), (9, 3, 2), (6, 3, 2), (4, 1, 2), (8, 2, 4), (32, 8, 8)])
def test_head_partition_keeps_each_query_head_with_its_kv_head(heads, kv_heads, tp):
    per_group = heads // kv_heads
    owners: list[int] = []
    for rank in range(tp):
        p = head_partition(heads, kv_heads, tp, rank)
        owners += range(p.q_start, p.q_start + p.num_heads)
        assert p.num_heads % p.num_kv_heads == 0
        for q in range(p.q_start, p.q_start + p.num_heads):
            kv = q // per_group
            assert p.kv_start <= kv < p.kv_start + p.num_kv_heads, f"rank {rank}: q head {q} without its KV head"
            # Query head j of the rank's slice reads local KV head j // (local group size).
            assert kv - p.kv_start == (q - p.q_start) // (p.num_heads // p.num_kv_heads)
    assert owners == list(range(heads)), "every query head on exactly one rank"


def test_head_partition_refuses_what_cannot_be_split():
    with pytest.raises(ValueError, match="multiple of them"):
        head_partition(9, 3, 4, 0)


def _tiny(tmp_path_factory, name: str, arch: str, **overrides) -> str:
    path = build_tiny_model(arch, tmp_path_factory.mktemp(name), **overrides)
    save_test_tokenizer(path, overrides.get("vocab_size", 512))
    return path


@pytest.fixture(scope="module")
def tiny_llama_uneven_dir(tmp_path_factory) -> str:
    """3 KV groups over 2 ranks (2 + 1), biases on every projection, a vocabulary TP=2 pads."""
    return _tiny(tmp_path_factory, "tiny_llama_uneven", "LlamaForCausalLM", seed=4, hidden_size=96,
                 num_attention_heads=6, num_key_value_heads=3, vocab_size=509, attention_bias=True, mlp_bias=True)


@pytest.fixture(scope="module")
def tiny_qwen2_mqa_dir(tmp_path_factory) -> str:
    """One KV head: TP=2 replicates it and splits the 4 query heads."""
    return _tiny(tmp_path_factory, "tiny_qwen2_mqa", "Qwen2ForCausalLM", seed=5, num_key_value_heads=1)


# Small KV caches: each rank zeroes its cache at start, and the default 2 GiB would cost seconds.
# Every case sees prefix hits (prompts_for shares a prefix between two prompts).
CASES = {
    "llama_gqa_preempt": ("tiny_llama_dir", SETTINGS["preempt"]),
    "qwen3_tied_chunked": ("tiny_qwen3_dir", dict(max_num_batched_tokens=16, max_num_seqs=4,
                                                  num_gpu_blocks_override=128)),
    "llama_uneven_mixed": ("tiny_llama_uneven_dir", dict(SETTINGS["mixed"], num_gpu_blocks_override=128)),
    "qwen2_replicated_kv": ("tiny_qwen2_mqa_dir", dict(SETTINGS["mixed"], num_gpu_blocks_override=128)),
}


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_greedy_tokens_match_one_process(request, case):
    fixture, settings = CASES[case]
    model_dir = request.getfixturevalue(fixture)
    options = dict(dtype="float32", device="cpu", **settings)
    with LLM(model_dir, **options) as llm:
        prompts = prompts_for(llm.engine.core.executor.vocab_size)
        expected = run(llm, prompts)
    with LLM(model_dir, tensor_parallel_size=2, **options) as llm:
        pids = [w.process.pid for w in llm.engine.core.executor.workers]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        assert run(llm, prompts) == expected
    assert not any(_alive(pid) for pid in pids), "leaving `with LLM(...)` must stop the workers"


def test_shutdown_stops_the_workers(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", device="cpu", tensor_parallel_size=2, num_gpu_blocks_override=64)
    pids = [w.process.pid for w in llm.engine.core.executor.workers]
    llm.shutdown()
    assert not any(_alive(pid) for pid in pids)
    llm.shutdown()   # a second call is harmless
