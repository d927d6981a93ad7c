"""The prefill path's native pieces against their torch forms: SiLU-and-mul over rows whose width
is no multiple of the vector (the scalar tail) and gates far into exp's clamped range, and the
torch backend's blocked causal attention (query blocks that read only the keys they see) against
SDPA on one chunk over cached context."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rackserve.model import native_ops
from rackserve.model.native import ISAS, unavailable_reason
from rackserve.model.torch_attention import TorchAttentionBackend

# The native tests run on both builds (an AVX-512 machine runs both), as tests/test_native_ops.py's.
BUILDS = [pytest.param(isa, marks=pytest.mark.skipif((why := unavailable_reason(isa=isa)) is not None,
                                                     reason=str(why))) for isa in ISAS]


@pytest.fixture
def build(request):
    native_ops.use_isa(request.param)
    yield request.param
    native_ops.use_isa("auto")


@pytest.mark.parametrize("build", BUILDS, indirect=True)
def test_silu_and_mul_matches_torch_on_tails_and_extremes(build):
    n = 203                                 # 25 vectors of 8 and a tail of 3
    x = torch.randn(5, 2 * n, generator=torch.Generator().manual_seed(1)) * 6
    x[0, :4] = torch.tensor([-200.0, -88.5, 87.0, 200.0])
    x[1, n - 3:n] = torch.tensor([-100.0, 0.0, 100.0])
    ref = F.silu(x[:, :n].double()) * x[:, n:].double()
    assert native_ops.library() is not None
    torch.testing.assert_close(native_ops.silu_and_mul(x).double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ctx,n", [(0, 300), (37, 129)])
def test_blocked_causal_attention_matches_sdpa(ctx, n):
    heads, kvh, hd = 6, 2, 16
    g = torch.Generator().manual_seed(ctx)
    q = torch.randn(heads, n, hd, generator=g)
    k, v = torch.randn(kvh, ctx + n, hd, generator=g), torch.randn(kvh, ctx + n, hd, generator=g)
    mask = torch.arange(ctx + n)[None, :] <= torch.arange(ctx, ctx + n)[:, None]
    backend = TorchAttentionBackend(heads, kvh, hd, hd ** -0.5)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(heads // kvh, 0), v.repeat_interleave(heads // kvh, 0),
                                         attn_mask=mask, scale=hd ** -0.5)
    torch.testing.assert_close(backend._attend_cpu(q, k, v, mask), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", BUILDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("ctx,n,block_size,heads,kvh,hd", [(0, 37, 16, 6, 2, 32), (45, 20, 8, 6, 2, 32),
                                                            (29, 21, 5, 10, 2, 80), (800, 9, 16, 4, 1, 16)])
def test_native_prefill_attention_reads_scattered_blocks_causally(ctx, n, block_size, heads, kvh, hd, dtype, build):
    """A chunk of n queries after ctx cached tokens, its blocks scattered in the cache, GQA (3 or 5
    query heads a KV head: a group the kernel splits into several sets of heads sharing each key),
    n not a multiple of the kernel's 16 rows, a head_dim of 2 or 5 vectors, a block size that is no
    power of two; and one item (9 rows, one KV head) after 800 cached tokens, which 2 threads split
    into 3 segments of keys whose softmax states the kernel merges: against SDPA on the gathered keys.
    A float16 or 8-bit float cache (its own entry point, widening each tile) against SDPA on the same
    values in float32."""
    g = torch.Generator().manual_seed(n)
    total = ctx + n
    blocks = max(16, -(-total // block_size) + 2)
    table = torch.randperm(blocks, generator=g)[:-(-total // block_size)]
    k_cache, v_cache = (torch.randn(blocks, block_size, kvh, hd, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(n, heads, hd, generator=g) * 3          # peaked softmaxes too
    k = k_cache[table].flatten(0, 1)[:total].float().transpose(0, 1).repeat_interleave(heads // kvh, 0)
    v = v_cache[table].flatten(0, 1)[:total].float().transpose(0, 1).repeat_interleave(heads // kvh, 0)
    mask = torch.arange(total)[None, :] <= torch.arange(ctx, total)[:, None]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=hd ** -0.5)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = native_ops.prefill_attention(q, k_cache, v_cache, table, ctx, hd ** -0.5)
    finally:
        torch.set_num_threads(threads)
    assert out is not None, "the native kernel declined a CPU chunk over a float32, float16 or 8-bit float cache"
    torch.testing.assert_close(out, ref.transpose(0, 1).reshape(n, heads * hd), rtol=1e-5, atol=1e-5)
