"""Ops of the native CPU library (csrc/, built by native.py) for float32 CPU tensors, each with the
plain-torch form it replaces, which runs wherever the library does not (another dtype or device,
a CPU without AVX2, no compiler): the quantized GEMVs of quant/vnni_linear.py and avx2_linear.py,
the GEMV of a dense float32 weight for a decode step's few rows, and the fused decode ops that
turn a layer's ~30 small torch ops around its matmuls into 4 calls
(residual add + RMSNorm as vLLM's fused_add_rms_norm, SiLU-and-mul, RoPE in place, and decode
attention reading the paged KV cache, float32, float16 or bfloat16, in place), each a Python dispatch less that a batch-1
decode step pays per op. The ops call the build `use_isa` names (--native-isa; default: the
CPU's widest, native.choose_isa), one per process as torch's thread count is. This file must never
decide what a layer computes: both forms give the same values up to float rounding.
"""
from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from rackserve.model.native import build_library, choose_isa, unavailable_reason

_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "rs_vnni_gemv": [_P, _I64, _I64, _P, _I64, _I, _P, _I],        # the avx512 build's GEMV
    "rs_vnni_gemv_parts": [_P, _I64, _I64, _P, _I64, _I, _P, _I, _F],   # the same, one part where it may
    "rs_avx2_gemv": [_P, _I64, _I64, _P, _I64, _I, _P, _I],        # the avx2 build's
    "rs_dense_gemv": [_P, _I64, _I64, _P, _I64, _I, _P, _I],       # both builds' GEMV of a float32 or bf16 weight
    "rs_avx2_set_many_rows": [_I64],                                # its few/many-rows crossover (tests)
    "rs_prefill_attention": [_P, _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _F, _P, _I],
    "rs_prefill_attention_f16": [_P, _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _F, _P, _I],
    "rs_prefill_attention_fp8e4m3": [_P, _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _F, _P, _I],
    "rs_prefill_attention_fp8e5m2": [_P, _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _F, _P, _I],
    "rs_add_rms_norm": [_P, _P, _P, _F, _I64, _I64, _P],
    "rs_silu_and_mul": [_P, _I64, _I64, _P],
    "rs_rope_neox": [_P, _I64, _I64, _I64, _I64, _P, _P],
    "rs_paged_decode_attention": [_P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F, _P, _I],
    "rs_paged_decode_attention_f16": [_P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F, _P, _I],
    "rs_paged_decode_attention_bf16": [_P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F, _P, _I],
    "rs_paged_decode_attention_fp8e4m3": [_P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F, _P, _I],
    "rs_paged_decode_attention_fp8e5m2": [_P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F, _P, _I],
    "rs_store_kv": [_P, _P, _I64, _I64],                           # decode_loop.cpp's K/V rounding (tests)
}


_isa = "auto"       # use_isa's choice


@functools.cache
def load(isa: str) -> ctypes.CDLL | None:
    """The library built for `isa` ("auto": the CPU's widest), or None where it cannot run."""
    isa = choose_isa().isa if isa == "auto" else isa
    if isa == "none" or unavailable_reason(isa=isa) is not None:
        return None
    lib = ctypes.CDLL(build_library(isa))
    for name, args in _SIGNATURES.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = _I
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The library the fused ops call (use_isa's), or None where it cannot run."""
    return load(_isa)


def use_isa(isa: str) -> None:
    """Makes the fused ops of this process call `isa`'s build: "auto", "avx512", "avx2", or "none"
    (their torch forms). Raises RuntimeError where a named build cannot run."""
    global _isa
    if isa not in ("auto", "none") and (why := unavailable_reason(isa=isa)) is not None:
        raise RuntimeError(f"--native-isa {isa} cannot run here: {why} (use --native-isa auto)")
    _isa = isa
    library.cache_clear()


def _native(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    lib = library()
    # Under torch.compile the torch forms are what inductor fuses; a ctypes call would break the graph.
    if lib is None or torch.compiler.is_compiling() or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    return lib


def add_rms_norm(h: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(h + residual) * weight, h + residual); without a residual, (RMSNorm(h), h). The
    native form adds into `residual` in place (vLLM's fused_add_rms_norm): the caller passes the
    residual it owns."""
    plain = h.dim() == 2 and h.is_contiguous() and (residual is None or residual.is_contiguous())
    lib = _native(h, weight) if plain else None
    if lib is None:
        residual = h if residual is None else h + residual
        xf = residual.float()
        # In float32 and cast back before the weight, as transformers does (bf16 matches it exactly);
        # written out because torch 2.13's F.rms_norm is ~10x slower on CPU for a prefill's 512 rows.
        return (xf * xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()).to(h.dtype).mul_(weight), residual
    out = torch.empty_like(h)
    if residual is None:
        residual = h
        lib.rs_add_rms_norm(None, residual.data_ptr(), weight.data_ptr(), eps, h.shape[0], h.shape[1], out.data_ptr())
    else:
        lib.rs_add_rms_norm(h.data_ptr(), residual.data_ptr(), weight.data_ptr(), eps, h.shape[0], h.shape[1],
                            out.data_ptr())
    return out, residual


# Rows up to which `linear` takes the native GEMV: at 1-16 rows rs_dense_gemv ran 1.1-6.6x torch's
# F.linear on SmolLM2's float32 weights (2 threads, a Zen 5 and its avx2 build; docs/benchmarks.md,
# seventeenth round); a prefill chunk's rows are torch's GEMM's.
DENSE_GEMV_ROWS = 16
# rs_dense_gemv's kind by the weight's dtype (its arithmetic is float32 either way).
DENSE_KINDS = {torch.float32: 0, torch.bfloat16: 1}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for a dense weight [n, k]: a decode step's few float32 rows on the native GEMV
    (bound by the weight's bytes), anything else F.linear. The weight may be bfloat16 under float32
    rows (a bf16 checkpoint's, kept so: loader.keep_bf16_linears): widened exactly either way."""
    plain = (x.dim() == 2 and x.shape[0] <= DENSE_GEMV_ROWS and x.shape[1] > 0 and x.is_contiguous()
             and weight.is_contiguous() and weight.dtype in DENSE_KINDS and weight.device.type == "cpu")
    lib = _native(x) if plain else None
    if lib is None:
        return F.linear(x, weight if weight.dtype == x.dtype else weight.to(x.dtype), bias)
    y = x.new_empty(x.shape[0], weight.shape[0])
    rc = lib.rs_dense_gemv(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0],
                           DENSE_KINDS[weight.dtype], y.data_ptr(), torch.get_num_threads())
    assert rc == 0, "rs_dense_gemv refused its arguments"
    return y if bias is None else y.add_(bias)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate_up = [gate | up] along the last axis."""
    lib = _native(gate_up) if gate_up.dim() == 2 and gate_up.is_contiguous() else None
    if lib is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, n)
    lib.rs_silu_and_mul(gate_up.data_ptr(), rows, n, out.data_ptr())
    return out


def rope_neox_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotates the first `heads` heads of each row of x [T, >= heads * head_dim] in place, neox
    style (rotary.apply_rope's rule; cos and sin [T, 1, head_dim], sin's first half negated).
    False where the native library cannot: the caller then applies the torch form."""
    plain = x.dim() == 2 and x.stride(1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    lib = _native(x, cos, sin) if plain else None
    if lib is None:
        return False
    lib.rs_rope_neox(x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr())
    return True


# The KV cache dtypes each attention reads natively, and its entry point for each.
_PREFILL_CACHE_DTYPES = {torch.float32: "rs_prefill_attention", torch.float16: "rs_prefill_attention_f16",
                         torch.float8_e4m3fn: "rs_prefill_attention_fp8e4m3",
                         torch.float8_e5m2: "rs_prefill_attention_fp8e5m2"}


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                      ctx: int, scale: float) -> torch.Tensor | None:
    """One request's chunk of queries (q [n, heads, head_dim], positions ctx .. ctx + n - 1) against
    its paged cache, which already holds the chunk's own K and V, causally; [n, heads * head_dim].
    `table`: the request's block ids (int64) covering ctx + n tokens. The caches are float32,
    float16 or an 8-bit float (e4m3fn, e5m2), q float32. None where the native library cannot (the caller runs its torch form)."""
    n, heads, head_dim = q.shape
    plain = (q.stride(2) == 1 and q.stride(1) == head_dim and head_dim % 16 == 0 and head_dim <= 256
             and table.dtype == torch.int64 and table.is_contiguous() and k_cache.dim() == 4
             and k_cache.dtype == v_cache.dtype and k_cache.dtype in _PREFILL_CACHE_DTYPES)
    lib = _native(q) if plain else None
    if (lib is None or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or k_cache.device.type != "cpu" or v_cache.device.type != "cpu"):
        return None
    _, block_size, kv_heads, _ = k_cache.shape
    out = q.new_empty(n, heads * head_dim)
    attend = getattr(lib, _PREFILL_CACHE_DTYPES[k_cache.dtype])
    rc = attend(q.data_ptr(), q.stride(0), n, ctx, k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), heads,
                kv_heads, head_dim, block_size, scale, out.data_ptr(), torch.get_num_threads())
    assert rc == 0, "rs_prefill_attention refused its arguments"
    return out


_DECODE_CACHE_DTYPES = {torch.float32: "rs_paged_decode_attention", torch.float16: "rs_paged_decode_attention_f16",
                        torch.bfloat16: "rs_paged_decode_attention_bf16",
                        torch.float8_e4m3fn: "rs_paged_decode_attention_fp8e4m3",
                        torch.float8_e5m2: "rs_paged_decode_attention_fp8e5m2"}


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                           lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Each row's one query (q [rows, heads, head_dim]) against its first lens[row] cached tokens,
    found through its row of `tables` ([rows * width] block ids); [rows, heads * head_dim] in q's
    dtype. The caches are float32, float16, bfloat16 or an 8-bit float (a narrower cache's values widened to float32 as
    the avx512 build's loops load them, a block at a time into a scratch in the avx2 build's); a
    bfloat16 q (a bf16 model's) is widened and
    the output rounded back, the arithmetic float32. None where the native library cannot (the
    caller gathers and runs SDPA)."""
    plain = (q.dim() == 3 and k_cache.dim() == 4 and q.stride(2) == 1 and q.stride(1) == q.shape[2]
             and tables.dtype == lens.dtype == torch.int64 and tables.is_contiguous() and lens.is_contiguous()
             and k_cache.dtype == v_cache.dtype and k_cache.dtype in _DECODE_CACHE_DTYPES)
    lib = _native() if plain and q.dtype in (torch.float32, torch.bfloat16) and q.device.type == "cpu" else None
    if (lib is None or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or k_cache.device.type != "cpu" or v_cache.device.type != "cpu"):
        return None
    qf = q.float()      # q itself when it is float32
    rows, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = qf.new_empty(rows, heads * head_dim)
    attend = getattr(lib, _DECODE_CACHE_DTYPES[k_cache.dtype])
    attend(qf.data_ptr(), qf.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
           tables.shape[0] // rows, lens.data_ptr(), rows, heads, kv_heads, head_dim, block_size, scale, out.data_ptr(),
           torch.get_num_threads())
    return out.to(q.dtype)
