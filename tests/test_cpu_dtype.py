"""`--dtype auto` on CPU from the flags the CPU reports, `--quantization` resolved from the file, and
what `--kv-cache-dtype auto` and `--packed-activations auto` pick under each packed kernel."""
from __future__ import annotations

import pytest

from rackserve.config import (EngineArgs, resolve_dtype, resolve_kv_cache_dtype, resolve_packed_activations,
                              resolve_quantization)
from rackserve.cpu_dtype import choose_cpu_dtype, choose_cpu_kv_cache_dtype, cpu_flags

XEON_SAPPHIRE_RAPIDS = {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
XEON_ICE_LAKE = {"avx2", "avx512f", "avx512_vnni"}         # AVX-512 without bf16 (this project's CI)
ZEN3 = {"avx2", "fma", "sse4_2"}
ZEN4 = {"avx2", "avx512f", "avx512_bf16"}


@pytest.mark.parametrize("flags,dtype", [(XEON_SAPPHIRE_RAPIDS, "bfloat16"), (ZEN4, "bfloat16"),
                                         (XEON_ICE_LAKE, "float32"), (ZEN3, "float32"), (set(), "float32")])
def test_auto_dtype_follows_native_bf16(flags, dtype):
    choice = choose_cpu_dtype(flags)
    assert choice.dtype == dtype
    if dtype == "bfloat16":
        assert any(f in choice.reason for f in ("amx_bf16", "avx512_bf16"))


@pytest.mark.parametrize("flags", [XEON_SAPPHIRE_RAPIDS, ZEN4, XEON_ICE_LAKE, ZEN3])
@pytest.mark.parametrize("kernel,native_bf16_dtype", [("vnni", "float32"), ("avx2", "float32"), ("int4", "bfloat16"),
                                                      (None, "bfloat16")])
def test_a_gguf_packed_for_a_native_int8_kernel_stays_float32(flags, kernel, native_bf16_dtype):
    """The vnni and avx2 kernels multiply float32 activations (and the native decode step is float32):
    bf16 there was 2.6x slower per decode step on a Zen 5 with avx512_bf16. Torch's int4 kernel and
    dequantized weights keep the bf16 rule."""
    choice = choose_cpu_dtype(flags, kernel)
    native = bool({"amx_bf16", "avx512_bf16"} & flags)
    assert choice.dtype == (native_bf16_dtype if native else "float32")
    if native and kernel in ("vnni", "avx2"):
        assert kernel in choice.reason


def test_engine_config_resolves_the_kernel_before_the_dtype(tmp_path):
    from rackserve.config import smollm2_gguf_path
    config = EngineArgs(model=smollm2_gguf_path(), device="cpu").create_engine_config().model
    packed = config.quant_kernel if config.quantization == "gguf" else None
    assert (config.dtype, config.dtype_reason) == resolve_dtype("auto", "cpu", packed)
    assert config.dtype == choose_cpu_dtype(cpu_flags(), packed).dtype


def test_cpu_flags_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(str(info)) == {"fpu", "avx512f", "amx_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_given_dtype_is_kept_and_auto_is_explained():
    assert resolve_dtype("float32", "cpu") == ("float32", "given by --dtype")
    dtype, why = resolve_dtype("auto", "cpu")
    assert dtype == choose_cpu_dtype(cpu_flags()).dtype and why.startswith("auto: ")


def test_quantization_defaults_to_what_the_file_has(tmp_path):
    assert resolve_quantization("auto", "/m/model.gguf") == "gguf"
    assert resolve_quantization("auto", "/m/hf_dir") == "none"
    assert resolve_quantization("none", "/m/model.gguf") == "none"
    with pytest.raises(ValueError, match="needs a .gguf"):
        resolve_quantization("gguf", "/m/hf_dir")
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(model=str(tmp_path), quantization="awq").create_engine_config()


@pytest.mark.parametrize("kernel,kv", [("vnni", "float16"), ("avx2", "float16"), ("int4", None), (None, None)])
def test_auto_kv_cache_is_float16_under_a_float32_packed_kernel(kernel, kv):
    """A GGUF kept packed for the vnni or avx2 kernel runs float32 activations over a float16 cache
    (llama.cpp's); torch's int4 kernel, dequantized weights, a CUDA device and a bf16 model keep the
    model's dtype (vLLM's auto); a given --kv-cache-dtype is kept, its 8-bit names as torch's."""
    choice = choose_cpu_kv_cache_dtype(kernel)
    assert (choice.dtype if choice else None) == kv
    dtype, why = resolve_kv_cache_dtype("auto", "cpu", "float32", kernel)
    assert dtype == kv and why.startswith("auto")
    if kv:
        assert kernel in why and "llama.cpp" in why
    assert resolve_kv_cache_dtype("auto", "cuda", "float32", kernel)[0] is None
    assert resolve_kv_cache_dtype("auto", "cpu", "bfloat16", kernel)[0] is None
    assert resolve_kv_cache_dtype("float32", "cpu", "float32", kernel) == ("float32", "given by --kv-cache-dtype")
    assert resolve_kv_cache_dtype("fp8", "cpu", "float32", kernel)[0] == "float8_e4m3fn"


@pytest.mark.parametrize("kernel,mode", [("vnni", "adaptive"), ("avx2", "two-part"), ("int4", "two-part"),
                                         (None, "two-part")])
def test_auto_packed_activations_are_adaptive_on_the_vnni_kernel_only(kernel, mode):
    assert resolve_packed_activations("auto", kernel)[0] == mode
    assert resolve_packed_activations("one-part", kernel) == ("one-part", "given by --packed-activations")


def test_engine_config_resolves_the_cache_and_activations_from_the_kernel(tiny_llama_dir):
    """The default model's engine config carries what auto chose and why (the startup banner's
    lines); a dense checkpoint keeps its dtype's cache and two parts, and a given flag wins."""
    from rackserve.config import smollm2_gguf_path
    config = EngineArgs(model=smollm2_gguf_path(), device="cpu").create_engine_config()
    packed = config.model.quant_kernel if config.model.quantization == "gguf" else None
    assert (config.cache.cache_dtype, config.cache.cache_dtype_reason) == \
        resolve_kv_cache_dtype("auto", "cpu", config.model.dtype, packed)
    assert (config.model.packed_activations, config.model.packed_activations_reason) == \
        resolve_packed_activations("auto", packed)
    dense = EngineArgs(model=tiny_llama_dir, device="cpu", dtype="float32").create_engine_config()
    assert dense.cache.cache_dtype is None and dense.model.packed_activations == "two-part"
    given = EngineArgs(model=smollm2_gguf_path(), device="cpu", kv_cache_dtype="float32",
                       packed_activations="two-part").create_engine_config()
    assert given.cache.cache_dtype == "float32" and given.model.packed_activations == "two-part"
