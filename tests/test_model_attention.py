"""The torch paged-attention backend against plain dense causal attention (repeat K/V heads,
softmax, no cache): one flattened batch mixing fresh prefills, prefill chunks over cached context
and decodes of different lengths, with block tables that are neither sorted nor contiguous.
"""
from __future__ import annotations

import random

import pytest
import torch

from rackserve.model.attention import CommonAttentionMetadata, Workspace, get_attn_backend

H, KVH, HD, BS, NUM_BLOCKS = 6, 2, 8, 4, 128


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int) -> torch.Tensor:
    """q: [n, H, hd] at positions ctx..ctx+n-1; k, v: [ctx + n, KVH, hd]."""
    k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * HD ** -0.5
    allowed = torch.arange(k.shape[0])[None, :] <= torch.arange(ctx, ctx + q.shape[0])[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).reshape(q.shape[0], H * HD)


def run_batch(requests: list[tuple[int, int]], seed: int = 0, workspace: Workspace | None = None,
              cache_dtype: torch.dtype = torch.float32, consecutive: bool = False):
    """requests: (cached context, new tokens) per request, in batch order. A 16-bit cache is held
    to bf16's precision (K/V rounded to 8 significant bits, and decode queries with them).
    consecutive: blocks handed out in order (each table a run) instead of shuffled. Returns the
    backend's metadata."""
    g = torch.Generator().manual_seed(seed)
    backend = get_attn_backend("torch")(H, KVH, HD, HD ** -0.5)
    k_cache = torch.zeros(NUM_BLOCKS, BS, KVH, HD, dtype=cache_dtype)
    v_cache = torch.zeros(NUM_BLOCKS, BS, KVH, HD, dtype=cache_dtype)
    free = list(range(NUM_BLOCKS))[::-1] if consecutive else list(range(NUM_BLOCKS))
    if not consecutive:
        random.Random(seed).shuffle(free)
    tables, histories, slots = [], [], []
    for ctx, n in requests:
        table = [free.pop() for _ in range(-(-(ctx + n) // BS) + 1)]    # one spare block, as a scheduler may give
        hist_k, hist_v = torch.randn(ctx + n, KVH, HD, generator=g), torch.randn(ctx + n, KVH, HD, generator=g)
        for p in range(ctx):                                            # the cached context
            k_cache[table[p // BS], p % BS], v_cache[table[p // BS], p % BS] = hist_k[p], hist_v[p]
        slots += [table[p // BS] * BS + p % BS for p in range(ctx, ctx + n)]
        tables.append(table)
        histories.append((hist_k, hist_v))
    q = torch.randn(len(slots), H, HD, generator=g)
    k = torch.cat([hk[ctx:] for (hk, _), (ctx, _) in zip(histories, requests)])
    v = torch.cat([hv[ctx:] for (_, hv), (ctx, _) in zip(histories, requests)])
    common = CommonAttentionMetadata([n for _, n in requests], [c for c, _ in requests], tables,
                                     torch.tensor(slots), BS, workspace)
    metadata = backend.build_metadata(common, torch.device("cpu"))
    out = backend.forward(q, k, v, (k_cache, v_cache), metadata)

    start = 0
    for (ctx, n), (hist_k, hist_v), table in zip(requests, histories, tables):
        want = dense_attention(q[start:start + n], hist_k, hist_v, ctx)
        tol = 1e-5 if cache_dtype == torch.float32 else 3e-2
        assert out.dtype == q.dtype
        torch.testing.assert_close(out[start:start + n], want, atol=tol, rtol=tol)
        for p in range(ctx, ctx + n):                                    # new K/V landed in their slots
            assert torch.equal(k_cache[table[p // BS], p % BS], hist_k[p].to(cache_dtype))
            assert torch.equal(v_cache[table[p // BS], p % BS], hist_v[p].to(cache_dtype))
        start += n
    return metadata


@pytest.mark.parametrize("requests", [
    [(0, 9)],                                   # fresh prefill
    [(13, 6)],                                  # chunk over cached context (chunked prefill, prefix hit)
    [(20, 1)],                                  # one decode
    [(7, 1), (7, 1), (7, 1)],                   # decodes of equal length: no mask needed
    [(3, 1), (30, 1), (12, 1), (0, 1)],         # decodes of different lengths, one with no context
], ids=["prefill", "chunk", "decode", "decodes_equal", "decodes_ragged"])
def test_single_kind_batches_match_dense(requests):
    run_batch(requests)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_lone_decode_over_consecutive_blocks_is_read_in_place(cache_dtype):
    assert run_batch([(21, 1)], cache_dtype=cache_dtype, consecutive=True).decode_block_run == slice(0, 6)
    # Two decodes, or blocks out of order, are gathered as before.
    assert run_batch([(21, 1), (5, 1)], consecutive=True).decode_block_run is None
    assert run_batch([(21, 1)]).decode_block_run is None


def test_mixed_batch_matches_dense():
    # Decodes around and between prefill chunks: decode rows are scattered through the batch.
    run_batch([(5, 1), (0, 7), (17, 1), (9, 5), (0, 1), (33, 1), (2, 3)], seed=1)


def test_a_bfloat16_cache_under_float32_queries_matches_dense():
    # --kv-cache-dtype bfloat16 under float32 weights: the same mixed batch, to bf16's precision.
    run_batch([(5, 1), (0, 7), (17, 1), (9, 5), (0, 1), (33, 1), (2, 3)], seed=1, cache_dtype=torch.bfloat16)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attn_backend("no-such-backend")


def test_long_chunks_attend_in_query_blocks_on_cpu(monkeypatch):
    # With a tiny score budget, chunks of more than 64 queries go in several blocks.
    import rackserve.model.torch_attention as torch_attention
    monkeypatch.setattr(torch_attention, "_SCORES_BYTES", 1)
    run_batch([(0, 150), (40, 100), (30, 1)], seed=2)


def test_a_workspace_serves_batches_of_any_size_in_turn():
    # The runner's one workspace outlives steps: the gathered context of a large batch must not
    # leak into a smaller one after it, nor a small buffer cut a larger one short.
    workspace = Workspace()
    run_batch([(3, 1), (9, 1)], seed=3, workspace=workspace)
    run_batch([(40, 1), (25, 1), (31, 6)], seed=4, workspace=workspace)
    grown = workspace.take("k", (1,), torch.float32, torch.device("cpu")).data_ptr()
    run_batch([(5, 1), (0, 4), (11, 1)], seed=5, workspace=workspace)
    assert workspace.take("k", (1,), torch.float32, torch.device("cpu")).data_ptr() == grown, \
        "a smaller batch reuses the buffer"
