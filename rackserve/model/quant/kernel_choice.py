"""`--quant-kernel auto`: which kernel multiplies a GGUF's packed weights. The native library's
build for the CPU (model/native.py's choose_isa, or --native-isa) decides: "vnni" (int8 dot
products with AVX-512 VNNI, csrc/vnni_gemv.cpp) on the avx512 build, "avx2" (the same method with
AVX2, csrc/avx2_gemv.cpp) on the avx2 build, else "int4" (torch's own kernel); the reason is what
the startup log prints. This file must never import torch: config.py resolves the choice before
any model exists.
"""
from __future__ import annotations

from typing import NamedTuple

from rackserve.model.native import IsaChoice, build_library, choose_isa

KERNEL_OF_ISA = {"avx512": "vnni", "avx2": "avx2", "none": "int4"}


class KernelChoice(NamedTuple):
    name: str           # a QUANT_KERNELS name: "vnni" | "avx2" | "int4"
    reason: str         # one line for the startup log


def _kernel_of(isa: IsaChoice) -> KernelChoice:
    if isa.isa == "avx512":
        return KernelChoice("vnni", f"int8 dot products with AVX-512 VNNI on the GGUF blocks, as llama.cpp, "
                                    f"reading the file's bytes and fp32-exact to ~1e-5 ({isa.reason})")
    if isa.isa == "avx2":
        return KernelChoice("avx2", f"int8 dot products with AVX2 on the GGUF blocks, as llama.cpp, reading "
                                    f"the file's bytes and fp32-exact to ~1e-5 ({isa.reason})")
    return KernelChoice("int4", f"torch's int4 kernel: no native kernel here ({isa.reason})")


def choose_quant_kernel(flags: frozenset[str] | set[str] | None = None, build=build_library) -> KernelChoice:
    """vnni > avx2 > int4: the kernel of the widest native build that the CPU (default: this one)
    runs and that builds."""
    return _kernel_of(choose_isa(flags, build))


def resolve_quant_kernel(quant_kernel: str, quantization: str, device: str, native_isa: str = "auto") -> KernelChoice:
    """--quant-kernel resolved: `auto` follows the resolved --native-isa ("auto": this CPU's widest).
    Given names are kept (the loader fails clearly if a native one cannot run)."""
    if quant_kernel != "auto":
        return KernelChoice(quant_kernel, "given by --quant-kernel")
    if quantization != "gguf" or device != "cpu":
        return KernelChoice("int4", "torch's int4 kernel (not a packed GGUF on CPU)")
    if native_isa == "auto":
        return choose_quant_kernel()
    return _kernel_of(IsaChoice(native_isa, f"--native-isa {native_isa}"))
