"""OffloadingConnector: blocks evicted from a tiny KV cache come back from host memory, or from
disk once host memory is full, as identical tokens; a restarted instance reuses the disk tier,
while one with another model (another fingerprint) never reads it."""
from __future__ import annotations

import pytest

from rackserve import LLM, SamplingParams

BLOCK = 4
PROMPT_A = [3 + (i * 7) % 500 for i in range(23)]          # 5 full blocks and a partial one
FILLERS = [[11 + (i * 13 + k * 101) % 480 for i in range(30)] for k in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TINY_BLOCK_BYTES = 3 * 2 * BLOCK * 2 * 16 * 4               # layers x K,V x tokens x KV heads x head size x f32


def _llm(path: str, **extra) -> LLM:
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return LLM(path, dtype="float32", device="cpu", max_model_len=64, num_gpu_blocks_override=20,
               block_size=BLOCK, kv_transfer_config=config if extra else None)


def _evict_then_rerun(llm: LLM) -> tuple[list[int], int]:
    llm.generate({"prompt_token_ids": PROMPT_A}, GREEDY)
    for filler in FILLERS:   # 4 x 8 blocks through a 20-block cache: A's blocks are evicted
        llm.generate({"prompt_token_ids": filler}, GREEDY)
    first = llm.engine.core.scheduler.kv
    assert first.pool.get_cached_block(first._update_hashes(_request(PROMPT_A))[0]) is None
    [out] = llm.generate({"prompt_token_ids": PROMPT_A}, GREEDY)
    llm.engine.core.check_integrity()
    return out.outputs[0].token_ids, out.num_cached_tokens


def _request(tokens: list[int]):
    from rackserve.core.request import Request
    return Request("probe", tokens, GREEDY)


@pytest.fixture(scope="module")
def want(tiny_llama_dir) -> list[int]:
    with _llm(tiny_llama_dir) as plain:
        return plain.generate({"prompt_token_ids": PROMPT_A}, GREEDY)[0].outputs[0].token_ids


def test_evicted_blocks_come_back_from_host_memory(tiny_llama_dir, want):
    with _llm(tiny_llama_dir, cpu_bytes=64 * TINY_BLOCK_BYTES) as llm:
        tokens, cached = _evict_then_rerun(llm)
        assert tokens == want
        assert cached == 20   # the 5 full blocks, loaded from host memory
        worker = llm.engine.core.executor.runner.kv_connector
        assert worker.usage()[0] > 0 and worker.usage()[1] == 0


def test_host_memory_spills_to_disk_and_a_restart_reuses_it(tiny_llama_dir, tiny_deepseek_v3_dir, want, tmp_path):
    tier = dict(cpu_bytes=2 * TINY_BLOCK_BYTES, disk_path=str(tmp_path), disk_bytes=200 * TINY_BLOCK_BYTES)
    with _llm(tiny_llama_dir, **tier) as llm:
        tokens, cached = _evict_then_rerun(llm)
        assert tokens == want and cached == 20
        assert llm.engine.core.executor.runner.kv_connector.usage()[1] > 0
    with _llm(tiny_llama_dir, **tier) as restarted:   # a fresh KV cache: the hit is all from disk
        [out] = restarted.generate({"prompt_token_ids": PROMPT_A}, GREEDY)
        assert out.outputs[0].token_ids == want and out.num_cached_tokens == 20
    with _llm(tiny_deepseek_v3_dir, **tier) as other:   # another model: another fingerprint, no hit
        [out] = other.generate({"prompt_token_ids": PROMPT_A}, GREEDY)
        assert out.num_cached_tokens == 0


def test_a_bounded_disk_forgets_its_oldest_blocks(tiny_llama_dir, tmp_path):
    with _llm(tiny_llama_dir, cpu_bytes=2 * TINY_BLOCK_BYTES, disk_path=str(tmp_path),
              disk_bytes=6 * TINY_BLOCK_BYTES) as llm:
        _evict_then_rerun(llm)
        worker = llm.engine.core.executor.runner.kv_connector
        assert worker.usage() == (2 * TINY_BLOCK_BYTES, 6 * TINY_BLOCK_BYTES)
        [rank_dir] = tmp_path.glob("*/tp0")   # <KV fingerprint>/<TP rank>
        assert len(list(rank_dir.iterdir())) == 6
        llm.engine.core.check_integrity()


def test_deepseek_v4_cache_groups_spill_to_disk_and_a_restart_reuses_them(tiny_deepseek_v4_kv_dir, tmp_path):
    """Every cache group's full blocks go to the tier (the window's too, before the window leaves
    them behind). Two host blocks per group, so the fillers push the prompt's blocks to disk; a
    restarted instance loads the 32 tokens that fill whole blocks of every group (HCA's are 16):
    each compressed block before them and the window blocks the next token reads."""
    prompt = [3 + (i * 7) % 500 for i in range(45)]
    fillers = [[11 + (i * 13 + k * 101) % 480 for i in range(40)] for k in range(2)]
    tier = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": dict(
        cpu_bytes=20_000, disk_path=str(tmp_path), disk_bytes=1 << 30)}   # a group's three blocks: 9728 bytes
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def v4(config: dict | None) -> LLM:
        return LLM(tiny_deepseek_v4_kv_dir, dtype="float32", device="cpu", max_model_len=64,
                   num_gpu_blocks_override=16, block_size=BLOCK, kv_transfer_config=config)
    with v4(None) as plain:
        [want] = plain.generate({"prompt_token_ids": prompt}, greedy)
    with v4(tier) as llm:
        for tokens in [prompt, *fillers]:
            llm.generate({"prompt_token_ids": tokens}, greedy)
        assert llm.engine.core.executor.runner.kv_connector.usage()[1] > 0
        llm.engine.core.check_integrity()
    with v4(tier) as restarted:
        [out] = restarted.generate({"prompt_token_ids": prompt}, greedy)
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert out.num_cached_tokens == 32
        restarted.engine.core.check_integrity()
