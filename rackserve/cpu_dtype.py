"""`--dtype auto` on CPU: bfloat16 where the CPU computes it natively and the weights are matmuls,
float32 elsewhere.

Native bf16 means AMX (amx_bf16) or AVX512-BF16 (avx512_bf16): there a bf16 matmul runs several
times faster than fp32 and reads half the bytes. Without them (AMD Zen 2/3, Intel before Cooper
Lake) bf16 is emulated by conversions and runs slower than fp32, so fp32 is the choice. A GGUF
whose linears stay packed for a native int8 kernel (--quant-kernel vnni or avx2) takes float32 on
every CPU: those kernels multiply float32 activations and the native decode step is float32, so
bf16 only adds conversions and loses that step (on a Zen 5 with avx512_bf16, SmolLM2's packed
decode steps ran 2.6x slower at batch 1 and 1.6x at batch 8 in bf16, its 512-token prefill 1.2x;
with dequantized weights bf16 was 1.9x faster at batch 1 and 2.6x in prefill: docs/benchmarks.md,
sixteenth round). Under those kernels `--kv-cache-dtype auto` keeps float16 K/V, as llama.cpp does
(choose_cpu_kv_cache_dtype). The choices are pure functions of the flags the CPU reports and that
kernel, so they are tested from given flags. This file owns
those rules and reading what the CPU says of itself (its flags, its model name, for every results
file and calibration key); it must never import torch or read anything but /proc/cpuinfo.
"""
from __future__ import annotations

import platform
from typing import NamedTuple

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


class DtypeChoice(NamedTuple):
    dtype: str          # "float32" | "bfloat16"
    reason: str         # one line for the startup log


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of the first CPU ("flags" on x86, "Features" on arm); empty when the file
    is missing (macOS, Windows), which makes auto choose float32."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_model_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name ("model name" in /proc/cpuinfo), else what `platform` reports."""
    name = platform.processor() or platform.machine()
    try:
        with open(cpuinfo) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        return name


def cpu_identity(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The model name with the x86 family and model numbers ("AMD EPYC family 23 model 1"): a cloud
    VM often names only the brand, and an AMD EPYC Zen 1 (family 23) and Zen 3 (family 25) differ
    2x in speed under the same name. The name alone where the file has no such numbers."""
    numbers = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("cpu family", "model") and key.strip() not in numbers:
                    numbers[key.strip()] = value.strip()
                if not line.strip():
                    break    # the first processor's block is enough
    except OSError:
        pass
    name = cpu_model_name(cpuinfo)
    if len(numbers) < 2:
        return name
    return f"{name} family {numbers['cpu family']} model {numbers['model']}"


# The --quant-kernel names whose packed GEMV/GEMM multiply float32 activations (model/csrc/).
FLOAT32_PACKED_KERNELS = ("vnni", "avx2")


def choose_cpu_dtype(flags: frozenset[str] | set[str], packed_kernel: str | None = None) -> DtypeChoice:
    """`packed_kernel`: the kernel that multiplies the model's packed GGUF weights, None for none."""
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if native and packed_kernel in FLOAT32_PACKED_KERNELS:
        return DtypeChoice("float32", f"the GGUF's linears stay packed for the {packed_kernel} int8 kernel, which "
                                      f"multiplies float32 activations, as the native decode step does (bf16, "
                                      f"though native here ({', '.join(native)}), would only add conversions)")
    if native:
        return DtypeChoice("bfloat16", f"the CPU computes bf16 natively ({', '.join(native)})")
    return DtypeChoice("float32", f"the CPU reports none of {', '.join(NATIVE_BF16_FLAGS)}, so bf16 "
                                  "would be emulated and slower than fp32")


def choose_cpu_kv_cache_dtype(packed_kernel: str | None) -> DtypeChoice | None:
    """`--kv-cache-dtype auto` on CPU: float16 under a GGUF kept packed for a float32-activation
    kernel (what llama.cpp keeps for the same file), None (the model's dtype, vLLM's auto) otherwise.
    Such an engine's decode steps read every row's K/V, which outweighs the packed weights at a few
    rows and a few hundred tokens; a float16 cache halves those bytes at logits within KL 1e-6 of a
    float32 cache's on SmolLM2 (bf16 weights and activations: 1.4e-3; docs/benchmarks.md, twentieth
    and twenty-fourth rounds). A GGUF holds a Llama-like model, whose native attention kernels read
    float16 K/V in place on every build that runs these kernels."""
    if packed_kernel not in FLOAT32_PACKED_KERNELS:
        return None
    return DtypeChoice("float16", f"auto: the GGUF's linears stay packed for the {packed_kernel} int8 kernel, so "
                                  "K/V in float16 as llama.cpp keeps them (half the bytes decode attention reads)")
