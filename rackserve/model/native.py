"""The native CPU library: csrc/*.cpp (the quantized GEMV and the fused decode ops), built once per
machine and ISA, loaded through ctypes by native_ops.py.

Two builds of the same sources, and `choose_isa` picks the widest one the CPU reports and that
builds: "avx512" (AVX-512 F/BW/VL/DQ + VNNI, F16C, FMA; its GEMV is vnni_gemv.cpp's "vnni" kernel)
and "avx2" (AVX2, FMA, F16C: AMD Zen 2/3 and Intel before Ice Lake; its GEMV is avx2_gemv.cpp's).
Every other source (the fused ops) goes into both, vectorised by the compiler for each ISA. Each is
built with the flags below (never -march=native: a VM can report ISA extensions it does not grant)
into ~/.cache/rackserve/kernels/ under a name that hashes the sources, the flags and the compiler's
version, so every process and every later run loads the same file; a build takes about a second.
This file must never import torch: config.py asks it before any model exists.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import os
import shutil
import subprocess
from typing import NamedTuple

from rackserve.cpu_dtype import cpu_flags


class Isa(NamedTuple):
    cpu_flags: tuple[str, ...]      # what the CPU must report
    cxx_flags: tuple[str, ...]      # what the compiler may use
    gemv: str                       # its quantized GEMV (csrc/), built into this ISA's library alone


class IsaChoice(NamedTuple):
    isa: str            # an ISAS name, or "none": the torch forms of every op
    reason: str         # one line for the startup log


ISAS = {
    "avx512": Isa(("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma"),
                  ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c", "-mfma"),
                  "vnni_gemv.cpp"),
    "avx2": Isa(("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"), "avx2_gemv.cpp"),
}
ALL_SOURCES = tuple(sorted(glob.glob(os.path.join(os.path.dirname(__file__), "csrc", "*.cpp"))))
# Headers the sources include: hashed into every build's name, never compiled on their own.
HEADERS = tuple(sorted(glob.glob(os.path.join(os.path.dirname(__file__), "csrc", "*.h"))))
CXX_FLAGS = ("-O3", "-std=c++17", "-fopenmp", "-shared", "-fPIC")
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "rackserve", "kernels")


def sources(isa: str) -> tuple[str, ...]:
    """The csrc files of `isa`'s library: its own GEMV and every file no ISA owns."""
    others = {i.gemv for name, i in ISAS.items() if name != isa}
    return tuple(s for s in ALL_SOURCES if os.path.basename(s) not in others)


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


def missing_cpu_flags(flags: frozenset[str] | set[str] | None = None, isa: str = "avx512") -> list[str]:
    """The flags `isa`'s library is compiled for that the CPU (default: this one) does not report."""
    flags = cpu_flags() if flags is None else flags
    return [f for f in ISAS[isa].cpu_flags if f not in flags]


@functools.cache
def library_digest(isa: str) -> str:
    """What names `isa`'s library: a hash of its sources, its flags and the compiler's version, so it
    changes whenever the code that would be built does (the simulator keys CPU calibrations by it)."""
    cxx = compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout if cxx else ""
    digest = hashlib.sha256(repr(((*CXX_FLAGS, *ISAS[isa].cxx_flags), version)).encode())
    for source in (*sources(isa), *HEADERS):
        with open(source, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


@functools.cache
def build_library(isa: str = "avx512", cache_dir: str = CACHE_DIR) -> str:
    """The path of `isa`'s compiled library, built on first use; raises RuntimeError with the
    compiler's message when it fails."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    flags = (*CXX_FLAGS, *ISAS[isa].cxx_flags)
    path = os.path.join(cache_dir, f"rackserve-native-{isa}-{library_digest(isa)}.so")
    if os.path.exists(path):
        return path
    tmp = f"{path}.{os.getpid()}.tmp"       # processes building at once each rename a whole file
    try:
        os.makedirs(cache_dir, exist_ok=True)
        done = subprocess.run([cxx, *flags, *sources(isa), "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed to build {', '.join(sources(isa))}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    except OSError as e:                    # an unwritable cache directory, a compiler that cannot run
        raise RuntimeError(f"building the native library in {cache_dir} failed: {e}") from e
    return path


def unavailable_reason(flags: frozenset[str] | set[str] | None = None, build=build_library,
                       isa: str = "avx512") -> str | None:
    """None when `isa`'s library runs here; else why not (for the startup log). `build(isa)`
    builds it (tests pass a stand-in)."""
    missing = missing_cpu_flags(flags, isa)
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    try:
        build(isa)
    except RuntimeError as e:
        return f"the {isa} native library did not build ({e})"
    return None


def choose_isa(flags: frozenset[str] | set[str] | None = None, build=build_library) -> IsaChoice:
    """The widest ISA whose library runs on the CPU (default: this one), else "none"; the reason
    names what ruled out each wider one."""
    why_not = []
    for isa in ISAS:
        why = unavailable_reason(flags, build, isa)
        if why is None:
            return IsaChoice(isa, "; ".join([*why_not, f"{isa}: the CPU has {', '.join(ISAS[isa].cpu_flags)} "
                                                       "and the library built"]))
        why_not.append(f"not {isa}: {why}")
    return IsaChoice("none", "; ".join(why_not) + ": the torch forms of the native ops")


def resolve_native_isa(native_isa: str, device: str) -> IsaChoice:
    """--native-isa resolved. A given ISA is kept (native_ops.use_isa fails clearly where it cannot run)."""
    if device != "cpu":
        return IsaChoice("none", f"the native library is for CPU tensors, not {device}")
    if native_isa != "auto":
        return IsaChoice(native_isa, "given by --native-isa")
    return choose_isa()
