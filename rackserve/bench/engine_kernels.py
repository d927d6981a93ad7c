"""Which kernels an engine of a given ModelConfig runs on this machine, read from the engine's own
choices at run time, so that what a measurement ran is recorded beside its step times and the
simulator's cpu cost model prices the kernel that really ran (sim/calibrate.py):

- the packed linears' kernel (ModelConfig.quant_kernel, `auto` resolved as the loader resolves it)
  and its `dense_above_rows`, the step size above which it dequantizes and runs a dense GEMM;
- whether decode attention is the native paged kernel, which reads each sequence's own blocks in
  place (model/native_ops.paged_decode_attention: float32 or bfloat16 queries over a float32,
  float16 or bfloat16 KV cache on a CPU where the native library runs, in the "torch" backend of
  Llama-like models), or SDPA over the step's decodes
  gathered and padded to the longest one (model/torch_attention.py's fallback).

This file must never time anything nor choose a kernel (config.py and quant/kernel_choice.py do).
"""
from __future__ import annotations

from rackserve.config import KV_CACHE_DTYPE_NAMES, ModelConfig


def _own_attention_backend(model_config: ModelConfig) -> bool:
    """Whether the model's attention has a backend of its own (MLA, DeepSeek-V4), without the
    native decode kernel. A GGUF holds one of gguf_loader's Llama-like architectures (and its
    metadata takes seconds to read): never."""
    if model_config.model.endswith(".gguf"):
        return False
    from rackserve.model.loader import read_hf_config
    config = read_hf_config(model_config.model)
    return bool(config.get("kv_lora_rank")) or "DeepseekV4" in (config.get("architectures") or [""])[0]


def engine_kernels(model_config: ModelConfig, kv_cache_dtype: str | None = None) -> dict:
    """{"quant_kernel": name or None (weights not packed), "dense_above_rows": int or None,
    "native_decode_attention": bool} for this model config (`kv_cache_dtype`: the cache's dtype
    name when it is not the model's)."""
    from rackserve.model.native import resolve_native_isa, unavailable_reason
    kernel = dense_above = None
    if model_config.quantization == "gguf":
        from rackserve.model.quant.kernel_choice import resolve_quant_kernel
        from rackserve.model.quant.quantized_linear import QUANT_KERNELS
        kernel = resolve_quant_kernel(model_config.quant_kernel, "gguf", model_config.device).name
        dense_above = QUANT_KERNELS.get(kernel).dense_above_rows
    # The build the engine's fused ops call (loader.py: native_ops.use_isa), avx2 on a Zen: not
    # only the avx512 one.
    isa = resolve_native_isa(model_config.native_isa, model_config.device).isa
    native = (model_config.device == "cpu" and model_config.dtype in ("float32", "bfloat16")
              and (kv_cache_dtype or model_config.dtype) in ("float32", "float16", "bfloat16",
                                                             *KV_CACHE_DTYPE_NAMES.values())
              and isa != "none" and unavailable_reason(isa=isa) is None
              and not _own_attention_backend(model_config))
    return {"quant_kernel": kernel, "dense_above_rows": dense_above, "native_decode_attention": native}
