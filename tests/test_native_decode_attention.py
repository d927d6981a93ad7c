"""Paged decode attention of the native library (csrc/paged_decode_attention.cpp) at long contexts,
against softmax(q k^T) v in torch on the tokens gathered by hand: a context split over threads
into parts of whole blocks and merged, keys scored a vector's width at a time, the ragged last
block and head sizes the vector path does not take; over a float32 cache, a float16 one and a
bfloat16 one (their own entry points: the avx2 build widens each block once, the avx512 build converts
its K/V vectors as it loads them), the reference computed in
float64 from the very values the cache holds. Runs on both builds (avx512, avx2).
"""
from __future__ import annotations

import pytest
import torch

from rackserve.model import native_ops
from rackserve.model.native import ISAS, unavailable_reason


@pytest.fixture(params=[pytest.param(isa, marks=pytest.mark.skipif(
    (why := unavailable_reason(isa=isa)) is not None, reason=str(why))) for isa in ISAS])
def lib(request):
    return native_ops.load(request.param)


# The cache dtypes each entry point reads: the 8-bit floats' codes are widened through float16's bits.
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


def _attend(lib, q, k_cache, v_cache, tables, lens, scale, threads):
    rows, heads, hd = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    out = torch.empty(rows, heads * hd)
    table, lens = torch.tensor(sum(tables, [])), torch.tensor(lens)      # alive through the call
    fn = {torch.float32: lib.rs_paged_decode_attention, torch.float16: lib.rs_paged_decode_attention_f16,
          torch.bfloat16: lib.rs_paged_decode_attention_bf16, torch.float8_e4m3fn: lib.rs_paged_decode_attention_fp8e4m3,
          torch.float8_e5m2: lib.rs_paged_decode_attention_fp8e5m2}[k_cache.dtype]
    assert fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                         table.data_ptr(), len(tables[0]), lens.data_ptr(), rows, heads,
                                         kv_heads, hd, bs, scale, out.data_ptr(), threads) == 0
    return out


def _paged_cache(g: torch.Generator, blocks: int, kv_heads: int, hd: int, dtype: torch.dtype, bs: int = 16):
    """Random K and V caches of `blocks` blocks of `bs` tokens, and the block ids in shuffled order."""
    k_cache = torch.randn(blocks, bs, kv_heads, hd, generator=g).to(dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, hd, generator=g).to(dtype)
    return k_cache, v_cache, torch.randperm(blocks, generator=g).tolist()


def _reference(q, k_cache, v_cache, tables, lens, scale):
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    rows = []
    for r, (table, n) in enumerate(zip(tables, lens)):
        k = k_cache[table].flatten(0, 1)[:n].double().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[table].flatten(0, 1)[:n].double().repeat_interleave(heads // kv_heads, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[r].double(), k) * scale).softmax(-1)
        rows.append(torch.einsum("hn,nhd->hd", p, v).flatten().float())
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (4, 4)])
# 24: the plain loop on avx512, the vector path on avx2; 20: the plain loop on both.
@pytest.mark.parametrize("hd", [64, 128, 24, 20])
def test_a_long_context_split_over_threads_matches_torch(lib, hd, heads, kv_heads, dtype):
    # SmolLM2's GQA (9 query heads on 3 KV heads) and others, blocks of 16 in shuffled order. Row
    # 0: 3001 tokens (each thread's parts span many blocks; the last block holds 9 tokens); row 1:
    # 5 tokens (fewer than a vector's keys); row 2: 700 (two parts a head at 2 threads when alone).
    g = torch.Generator().manual_seed(12)
    k_cache, v_cache, order = _paged_cache(g, 240, kv_heads, hd, dtype)
    tables = [order[:188], order[188:189] + [0] * 187, order[189:233] + [0] * 144]
    lens = [3001, 5, 700]
    q = torch.randn(3, heads, hd, generator=g) * 2       # scores spread wide: a peaked softmax
    for rows in ([0], [2], [0, 1, 2]):
        sub = ([tables[r] for r in rows], [lens[r] for r in rows])
        expected = _reference(q[rows], k_cache, v_cache, *sub, hd ** -0.5)
        for threads in (1, 2, 5):
            out = _attend(lib, q[rows].contiguous(), k_cache, v_cache, *sub, hd ** -0.5, threads)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
# On avx2 a KV head's group of 2-4 query heads is scored and accumulated against each K/V row
# loaded once (register-blocked); groups 3 and 4 take tiles of 4 and 3 keys, so a block of 16
# leaves a 1-key tail at group 4; head_dim 16 and 32: 2 and 4 vectors (the value chunk of 2 and 4);
# 6 heads on 1 KV head and group 8: the head-by-head loop. A head mapped to the wrong KV head or
# score row, or a missed tail key, fails against the reference.
@pytest.mark.parametrize("heads,kv_heads,hd", [(12, 3, 64), (12, 3, 16), (6, 2, 32), (6, 1, 64), (16, 2, 32)])
def test_grouped_heads_match_torch(lib, heads, kv_heads, hd, dtype):
    g = torch.Generator().manual_seed(15)
    k_cache, v_cache, order = _paged_cache(g, 80, kv_heads, hd, dtype)
    tables = [order[:50], order[50:80] + [0] * 20]
    lens = [797, 471]          # ragged last blocks of 13 and 7 tokens
    q = torch.randn(2, heads, hd, generator=g) * 2
    expected = _reference(q, k_cache, v_cache, tables, lens, hd ** -0.5)
    for threads in (1, 2):
        out = _attend(lib, q.contiguous(), k_cache, v_cache, tables, lens, hd ** -0.5, threads)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


def test_the_startup_banner_says_what_reads_a_narrower_cache(tiny_llama_dir):
    from rackserve.config import EngineArgs
    from rackserve.model.native import choose_isa
    from rackserve.serve.launch import kv_cache_line

    def line(kv_dtype):
        return kv_cache_line(EngineArgs(model=tiny_llama_dir, device="cpu", dtype="float32",
                                        kv_cache_dtype=kv_dtype).create_engine_config())
    assert line("auto") == line("float32") == ""
    native = choose_isa().isa != "none"
    assert ("native attention kernels read it" if native else "gathers it and runs SDPA") in line("float16")
    assert ("native decode attention reads it" if native else "gathers it and runs SDPA") in line("bfloat16")
    assert ("native attention kernels read it" if native else "gathers it and runs SDPA") in line("fp8")
    assert line("fp8_e5m2").startswith("  KV cache float8_e5m2 (given by --kv-cache-dtype): ")
    # The default model's auto cache says why (float16 under a packed vnni or avx2 kernel).
    from rackserve.config import smollm2_gguf_path
    config = EngineArgs(model=smollm2_gguf_path(), device="cpu").create_engine_config()
    if config.cache.cache_dtype is not None:
        assert kv_cache_line(config).startswith(f"  KV cache float16 (auto: the GGUF's linears stay packed for the "
                                                f"{config.model.quant_kernel} int8 kernel")
