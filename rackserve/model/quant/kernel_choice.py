"""`--quant-kernel auto`: which kernel multiplies a GGUF's packed weights, and the one-time build of
the "vnni" kernel's shared library.

"vnni" (csrc/vnni_gemv.cpp, int8 dot products) needs the AVX-512 subsets it is compiled for and a
C++ compiler; it is built once per machine, with the flags below (never -march=native: a VM can
report ISA extensions it does not grant), into ~/.cache/rackserve/kernels/ under a name that hashes
the source, the flags and the compiler's version, so every process and every later run loads the
same file. Where it cannot run or build, "int4" (torch's own kernel) does, and the reason is what
the startup log prints. This file must never import torch: config.py resolves the choice before
any model exists.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from typing import NamedTuple

from rackserve.cpu_dtype import cpu_flags

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "vnni_gemv.cpp")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma")
CXX_FLAGS = ("-O3", "-std=c++17", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c",
             "-mfma", "-fopenmp", "-shared", "-fPIC")
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "rackserve", "kernels")


class KernelChoice(NamedTuple):
    name: str           # a QUANT_KERNELS name: "vnni" | "int4"
    reason: str         # one line for the startup log


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


@functools.cache
def build_library(cache_dir: str = CACHE_DIR) -> str:
    """The path of the compiled kernel, built on first use; raises RuntimeError with the compiler's
    message when it fails."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + repr((CXX_FLAGS, version)).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir, f"vnni_gemv-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"       # processes building at once each rename a whole file
    done = subprocess.run([cxx, *CXX_FLAGS, SOURCE, "-o", tmp], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{cxx} failed to build {SOURCE}: {done.stderr.strip()[-2000:]}")
    os.replace(tmp, path)
    return path


def choose_quant_kernel(flags: frozenset[str] | set[str], build=build_library) -> KernelChoice:
    """"vnni" where the CPU has every flag it is compiled for and it builds, else "int4"."""
    missing = [f for f in CPU_FLAGS if f not in flags]
    if missing:
        return KernelChoice("int4", f"torch's int4 kernel: the CPU lacks {', '.join(missing)} for the vnni kernel")
    try:
        build()
    except RuntimeError as e:
        return KernelChoice("int4", f"torch's int4 kernel: the vnni kernel did not build ({e})")
    return KernelChoice("vnni", "int8 dot products with AVX-512 VNNI on the GGUF blocks (llama.cpp's method), "
                                "measured ~3x torch's int4 kernel per decode GEMV on this kind of CPU")


def resolve_quant_kernel(quant_kernel: str, quantization: str, device: str) -> KernelChoice:
    """--quant-kernel resolved. Given names are kept (the loader fails clearly if "vnni" cannot run)."""
    if quant_kernel != "auto":
        return KernelChoice(quant_kernel, "given by --quant-kernel")
    if quantization != "gguf" or device != "cpu":
        return KernelChoice("int4", "torch's int4 kernel (not a packed GGUF on CPU)")
    return choose_quant_kernel(cpu_flags())
