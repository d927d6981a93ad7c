"""The native library's fused decode ops (model/native_ops.py) against the torch forms they
replace, on float32 CPU rows: residual add + RMSNorm (and its residual updated in place), SiLU-and-
mul, neox RoPE in place on a fused qkv row, a dense weight's GEMV for a decode step's rows, and the
native decode step's rounding of K/V into an 8-bit float cache; and the torch forms where the library does not run
(bf16, --native-isa none). Each test runs on both builds (avx512 and avx2: an AVX-512 machine runs
both), skipped where a build cannot build or run (its reason is the skip reason).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rackserve.model import native_ops
from rackserve.model.native import ISAS, unavailable_reason
from rackserve.model.rotary import RotaryEmbedding, apply_rope


@pytest.fixture(autouse=True, params=[pytest.param(isa, marks=pytest.mark.skipif(
    (why := unavailable_reason(isa=isa)) is not None, reason=str(why))) for isa in ISAS])
def isa(request):
    native_ops.use_isa(request.param)
    assert native_ops.library() is native_ops.load(request.param) is not None
    yield request.param
    native_ops.use_isa("auto")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * x.pow(2).mean(-1, keepdim=True).add(eps).rsqrt() * w


@pytest.mark.parametrize("rows", [1, 5, 70])        # 70: the rows split over threads
def test_add_rms_norm_matches_torch_and_updates_the_residual(rows):
    g = torch.Generator().manual_seed(rows)
    h, residual, w = torch.randn(rows, 96, generator=g), torch.randn(rows, 96, generator=g), torch.rand(96, generator=g)
    expected_sum = h + residual
    out, new_residual = native_ops.add_rms_norm(h, residual, w, 1e-6)
    assert new_residual.data_ptr() == residual.data_ptr()       # in place, as vLLM's fused_add_rms_norm
    torch.testing.assert_close(new_residual, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(out, _rms(expected_sum, w, 1e-6), rtol=1e-5, atol=1e-6)
    first, same = native_ops.add_rms_norm(h, None, w, 1e-6)
    assert same is h
    torch.testing.assert_close(first, _rms(h, w, 1e-6), rtol=1e-5, atol=1e-6)
    # bf16 takes the torch form: normalised in float32, cast back before the weight.
    hb = h.bfloat16()
    out_b, _ = native_ops.add_rms_norm(hb, None, w.bfloat16(), 1e-6)
    assert out_b.dtype == torch.bfloat16
    torch.testing.assert_close(out_b.float(), _rms(h, w, 1e-6), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [0, 1, 3, 5, 16])
@pytest.mark.parametrize("n,k", [(130, 67), (7, 33), (1536, 576)])      # tails of 4 outputs and of a vector
def test_dense_linear_matches_f_linear_for_a_decode_steps_rows(rows, n, k):
    torch.manual_seed(rows + n)
    x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    ref = (x.double() @ w.double().T + b.double()).float()
    y = native_ops.linear(x, w, b)
    assert y.shape == (rows, n) and torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    # A wrong row, column or stride would be off by whole products; the weight's rows in another
    # order give other outputs, so each output is its own row's dot product.
    assert torch.allclose(native_ops.linear(x, w.flip(0)), ref.sub(b).flip(1), rtol=1e-5, atol=1e-5 * k ** 0.5)
    # A bf16 weight under float32 rows (loader.keep_bf16_linears): its values widened exactly.
    wb = w.bfloat16()
    want = (x.double() @ wb.double().T + b.double()).float()
    assert torch.allclose(native_ops.linear(x, wb, b), want, rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("rows", [1, 5, 16])       # 5: a block of 4 rows (2 on avx2) and a row on its own
@pytest.mark.parametrize("n,k", [(130, 67), (1536, 576)])
def test_dense_gemv_of_a_bfloat16_weight_is_the_float32_product_of_its_values(rows, n, k):
    # Kind 1 (a bf16 model's weights in the native decode step): each weight widened exactly,
    # multiplied by float32 rows in float32.
    torch.manual_seed(n + rows)
    x, w = torch.randn(rows, k), torch.randn(n, k).bfloat16()
    y = torch.empty(rows, n)
    lib = native_ops.library()
    assert lib.rs_dense_gemv(x.data_ptr(), rows, k, w.data_ptr(), n, 1, y.data_ptr(), 2) == 0
    ref = (x.double() @ w.double().T).float()
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    assert lib.rs_dense_gemv(x.data_ptr(), rows, k, w.data_ptr(), n, 2, y.data_ptr(), 2) == -1     # no kind 2


def test_dense_linear_leaves_more_rows_and_other_dtypes_to_torch(monkeypatch):
    calls = []
    lib = native_ops.library()
    monkeypatch.setattr(native_ops, "library", lambda: type("L", (), {"rs_dense_gemv": lambda *a: calls.append(a) or 0})())
    w = torch.randn(8, 16)
    native_ops.linear(torch.randn(native_ops.DENSE_GEMV_ROWS + 1, 16), w)
    native_ops.linear(torch.randn(2, 16).bfloat16(), w.bfloat16())      # a bf16 model's rows: torch's
    native_ops.linear(torch.randn(2, 16), w.half())                       # no float16 weight kind
    native_ops.linear(torch.randn(16, 2).T, w)        # x not contiguous
    assert calls == [] and lib is not None
    native_ops.linear(torch.randn(2, 16), w)
    assert len(calls) == 1


def test_silu_and_mul_matches_torch():
    x = torch.randn(3, 2 * 80, generator=torch.Generator().manual_seed(0)) * 4
    torch.testing.assert_close(native_ops.silu_and_mul(x), F.silu(x[:, :80]) * x[:, 80:], rtol=1e-5, atol=1e-6)


def test_rope_in_place_matches_apply_rope_on_the_q_and_k_heads_only():
    heads, kv_heads, hd, t = 4, 2, 32, 6
    rope = RotaryEmbedding(hd, 64, {"rope_theta": 10000.0, "rope_type": "default"})
    cos, sin = rope(torch.tensor([0, 3, 7, 8, 20, 63]))
    qkv = torch.randn(t, (heads + 2 * kv_heads) * hd, generator=torch.Generator().manual_seed(1))
    qk = qkv[:, :(heads + kv_heads) * hd].reshape(t, heads + kv_heads, hd)
    expected, v = apply_rope(qk, cos, sin), qkv[:, (heads + kv_heads) * hd:].clone()
    assert native_ops.rope_neox_(qkv, heads + kv_heads, hd, cos, sin)
    torch.testing.assert_close(qkv[:, :(heads + kv_heads) * hd].view(t, -1, hd), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * hd:], v)      # v untouched
    assert not native_ops.rope_neox_(qkv.bfloat16(), heads + kv_heads, hd, cos, sin)
    native_ops.use_isa("none")                  # --native-isa none: the torch forms everywhere
    assert native_ops.library() is None and not native_ops.rope_neox_(qkv, heads + kv_heads, hd, cos, sin)


def test_paged_decode_attention_reads_scattered_blocks_in_place():
    # 3 decode rows of different lengths over non-consecutive blocks, GQA (6 query heads on 2 KV
    # heads): against softmax(q k^T) v on the tokens gathered by hand.
    heads, kv_heads, hd, bs = 6, 2, 16, 4
    g = torch.Generator().manual_seed(2)
    k_cache, v_cache = torch.randn(12, bs, kv_heads, hd, generator=g), torch.randn(12, bs, kv_heads, hd, generator=g)
    tables, lens = [[7, 2, 9], [0, 11, 0], [5, 0, 0]], [10, 6, 1]
    q = torch.randn(3, heads, hd, generator=g)
    out = native_ops.paged_decode_attention(q, k_cache, v_cache, torch.tensor(sum(tables, [])), torch.tensor(lens), 0.25)
    for r, (table, n) in enumerate(zip(tables, lens)):
        k = k_cache[table].flatten(0, 1)[:n].repeat_interleave(heads // kv_heads, dim=1)   # [n, heads, hd]
        v = v_cache[table].flatten(0, 1)[:n].repeat_interleave(heads // kv_heads, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[r], k) * 0.25).softmax(-1)
        torch.testing.assert_close(out[r].view(heads, hd), torch.einsum("hn,nhd->hd", p, v), rtol=1e-5, atol=1e-5)
    # A bfloat16 cache (a bf16 model's), under a float32 or a bfloat16 query: read natively, each
    # value widened exactly, the output in the query's dtype; a float16 query is torch's.
    def attend(q, k, v):
        return native_ops.paged_decode_attention(q, k, v, torch.tensor(sum(tables, [])), torch.tensor(lens), 0.25)
    kb, vb = k_cache.bfloat16(), v_cache.bfloat16()
    torch.testing.assert_close(attend(q, kb, vb), attend(q, kb.float(), vb.float()), rtol=1e-6, atol=1e-6)
    out_b = attend(q.bfloat16(), kb, vb)
    assert out_b.dtype == torch.bfloat16
    assert torch.equal(out_b, attend(q.bfloat16().float(), kb.float(), vb.float()).bfloat16())
    assert attend(q.half(), k_cache.half(), v_cache.half()) is None


def test_each_build_holds_its_own_isa_and_none_wider(isa):
    # An AVX-512 machine runs the avx2 build either way; on a Zen a single zmm, mask-register or
    # xmm16+ instruction in it would be SIGILL. The disassembly is what a Zen would execute.
    import re
    import shutil
    import subprocess

    from rackserve.model.native import build_library
    if shutil.which("objdump") is None:
        pytest.skip("needs objdump (binutils)")
    code = subprocess.run(["objdump", "-d", build_library(isa)], capture_output=True, text=True, check=True).stdout
    assert {"avx512": "vpdpbusd", "avx2": "vpmaddubsw"}[isa] in code
    assert isa == "avx512" or not re.search(r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b", code)


def test_paged_decode_attention_softmax_over_a_long_spread_context():
    # 300 tokens over 38 blocks of 8 in reverse order, scores spread over ~100: the softmax's exp
    # runs over its whole range (its smallest terms underflow to 0, as torch's do, with denormals
    # flushed inside the kernel and the caller's floating-point mode left as it was).
    heads, kv_heads, hd, bs, n = 4, 1, 32, 8, 300
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(40, bs, kv_heads, hd, generator=g), torch.randn(40, bs, kv_heads, hd, generator=g)
    table = list(range(39, 1, -1))
    q = torch.randn(1, heads, hd, generator=g) * 3
    out = native_ops.paged_decode_attention(q, k_cache, v_cache, torch.tensor(table), torch.tensor([n]), 1.0)
    k, v = k_cache[table].flatten(0, 1)[:n, 0], v_cache[table].flatten(0, 1)[:n, 0]
    scores = q[0] @ k.T
    assert float(scores.max() - scores.min()) > 60
    torch.testing.assert_close(out.view(heads, hd), scores.softmax(-1) @ v, rtol=1e-5, atol=1e-5)
    assert float(torch.tensor(1e-39) * 1.0) > 0


@pytest.mark.parametrize("dtype,code", [(torch.float8_e4m3fn, 3), (torch.float8_e5m2, 4)])
def test_kv_rounding_to_an_8_bit_float_is_torchs_saturating_cast_bit_for_bit(dtype, code):
    # decode_loop.cpp's rs_store_kv against attention.write_cache's clamp and cast: values across
    # both formats' subnormals, normals and beyond their largest (448, 57344: saturated, where
    # torch's e5m2 cast alone gives inf), exact ties of both grids, signed zeros, infinities, NaN.
    import ctypes
    g = torch.Generator().manual_seed(code)
    x = torch.cat([torch.randn(20000, generator=g) * 10.0 ** e for e in range(-6, 6)] +
                  [torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 448.0, 464.0, 480.0,
                                 57344.0, 61440.0, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -17, 3 * 2.0 ** -17,
                                 1.0625, 1.1875, 1.125 + 2.0 ** -4])])
    out = torch.empty(x.numel(), dtype=torch.uint8)
    assert native_ops.library().rs_store_kv(out.data_ptr(), x.data_ptr(), x.numel(), code) == 0
    limit = torch.finfo(dtype).max
    torch.testing.assert_close(out, x.clamp(-limit, limit).to(dtype).view(torch.uint8), rtol=0, atol=0)
    assert native_ops.library().rs_store_kv(out.data_ptr(), x.data_ptr(), x.numel(), 9) == -1
