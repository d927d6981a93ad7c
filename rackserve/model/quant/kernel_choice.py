"""`--quant-kernel auto`: which kernel multiplies a GGUF's packed weights. "vnni" (int8 dot
products, model/csrc/vnni_gemv.cpp) where the native library runs (model/native.py: the CPU flags
it is compiled for and a compiler), else "int4" (torch's own kernel); the reason is what the
startup log prints. This file must never import torch: config.py resolves the choice before any
model exists.
"""
from __future__ import annotations

from typing import NamedTuple

from rackserve.model.native import build_library, unavailable_reason


class KernelChoice(NamedTuple):
    name: str           # a QUANT_KERNELS name: "vnni" | "int4"
    reason: str         # one line for the startup log


def choose_quant_kernel(flags: frozenset[str] | set[str] | None = None, build=build_library) -> KernelChoice:
    """"vnni" where the CPU (default: this one) has every flag the native library is compiled for
    and it builds, else "int4"."""
    why_not = unavailable_reason(flags, build)
    if why_not:
        return KernelChoice("int4", f"torch's int4 kernel: no vnni kernel here, {why_not}")
    return KernelChoice("vnni", "the CPU has AVX-512 VNNI and the native library built: int8 dot products on "
                                "the GGUF blocks, as llama.cpp, reading the file's bytes and fp32-exact to ~1e-5")


def resolve_quant_kernel(quant_kernel: str, quantization: str, device: str) -> KernelChoice:
    """--quant-kernel resolved. Given names are kept (the loader fails clearly if "vnni" cannot run)."""
    if quant_kernel != "auto":
        return KernelChoice(quant_kernel, "given by --quant-kernel")
    if quantization != "gguf" or device != "cpu":
        return KernelChoice("int4", "torch's int4 kernel (not a packed GGUF on CPU)")
    return choose_quant_kernel()
