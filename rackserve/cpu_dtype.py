"""`--dtype auto` on CPU: bfloat16 where the CPU computes it natively, float32 elsewhere.

Native bf16 means AMX (amx_bf16) or AVX512-BF16 (avx512_bf16): there a bf16 matmul runs several
times faster than fp32 and reads half the bytes. Without them (AMD Zen 2/3, Intel before Cooper
Lake) bf16 is emulated by conversions and runs slower than fp32, so fp32 is the choice. The choice
is a pure function of the flags the CPU reports, so it is tested from given flags. This file owns
that rule and reading what the CPU says of itself (its flags, its model name, for every results
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


def choose_cpu_dtype(flags: frozenset[str] | set[str]) -> DtypeChoice:
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if native:
        return DtypeChoice("bfloat16", f"the CPU computes bf16 natively ({', '.join(native)})")
    return DtypeChoice("float32", f"the CPU reports none of {', '.join(NATIVE_BF16_FLAGS)}, so bf16 "
                                  "would be emulated and slower than fp32")
