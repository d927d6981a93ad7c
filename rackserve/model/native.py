"""The native CPU library: csrc/*.cpp (the "vnni" quantized GEMV and the fused decode ops), built
once per machine and loaded through ctypes by native_ops.py.

It needs the AVX-512 subsets it is compiled for and a C++ compiler. It is built with the flags below
(never -march=native: a VM can report ISA extensions it does not grant) into
~/.cache/rackserve/kernels/ under a name that hashes the sources, the flags and the compiler's
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

from rackserve.cpu_dtype import cpu_flags

SOURCES = tuple(sorted(glob.glob(os.path.join(os.path.dirname(__file__), "csrc", "*.cpp"))))
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma")
CXX_FLAGS = ("-O3", "-std=c++17", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c",
             "-mfma", "-fopenmp", "-shared", "-fPIC")
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "rackserve", "kernels")


def compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


def missing_cpu_flags(flags: frozenset[str] | set[str] | None = None) -> list[str]:
    """The flags the library is compiled for that the CPU (default: this one) does not report."""
    flags = cpu_flags() if flags is None else flags
    return [f for f in CPU_FLAGS if f not in flags]


@functools.cache
def build_library(cache_dir: str = CACHE_DIR) -> str:
    """The path of the compiled library, built on first use; raises RuntimeError with the
    compiler's message when it fails."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(repr((CXX_FLAGS, version)).encode())
    for source in SOURCES:
        with open(source, "rb") as f:
            digest.update(f.read())
    path = os.path.join(cache_dir, f"rackserve-native-{digest.hexdigest()[:16]}.so")
    if os.path.exists(path):
        return path
    tmp = f"{path}.{os.getpid()}.tmp"       # processes building at once each rename a whole file
    try:
        os.makedirs(cache_dir, exist_ok=True)
        done = subprocess.run([cxx, *CXX_FLAGS, *SOURCES, "-o", tmp], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed to build {', '.join(SOURCES)}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    except OSError as e:                    # an unwritable cache directory, a compiler that cannot run
        raise RuntimeError(f"building the native library in {cache_dir} failed: {e}") from e
    return path


def unavailable_reason(flags: frozenset[str] | set[str] | None = None, build=build_library) -> str | None:
    """None when the library runs here; else why not (for the startup log)."""
    missing = missing_cpu_flags(flags)
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    try:
        build()
    except RuntimeError as e:
        return f"the native library did not build ({e})"
    return None
