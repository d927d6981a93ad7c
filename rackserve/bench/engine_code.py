"""Which code computed an engine's steps in this process, recorded beside the step times it measured,
so that a measurement is reused only while that code is unchanged (the simulator's `cpu`
calibrations, sim/cpu_device.py):

- the native library the steps ran on: its ISA build and the digest that names it
  (model/native.library_digest: the sources built for that ISA, their flags, the compiler);
- the Python files of the step path's modules this process had loaded (rackserve.model.* and
  rackserve.executor.*: the layers, the loaders, the quantized kernels, the native decode step, the
  model runner), read from sys.modules after the engine ran, with a digest of their code (the
  syntax tree without docstrings: a comment or docstring edit keeps a calibration);
- whether the decode steps ran in one native call (model/native_decode.py), read from the runner.

Nothing here is a list of kernels kept by hand: an edit to the code of any of those files, or to a
native source that was built (comments included: the library's own digest), changes the record.
This file must never time anything nor import torch (the simulator checks a record without
loading a model).
"""
from __future__ import annotations

import ast
import hashlib
import os
import sys

STEP_PATH = ("rackserve.model", "rackserve.executor")      # the packages whose code computes a step
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout


def _code_of(name: str, source: bytes) -> bytes:
    """What a file contributes to the digest: a Python file's code as ast.unparse writes it back
    without docstrings (comments, docstrings and layout change no step), any other file's bytes."""
    if not name.endswith(".py"):
        return source
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree).encode()


def _files_digest(files: list[str]) -> str | None:
    """A hash of the files' paths and code (paths relative to the checkout); None when one is gone."""
    digest = hashlib.sha256()
    for name in files:
        try:
            with open(os.path.join(_ROOT, name), "rb") as f:
                digest.update(name.encode() + b"\0" + _code_of(name, f.read()))
        except (OSError, SyntaxError, ValueError):
            return None
    return digest.hexdigest()[:16]


def _library(native_isa: str) -> str | None:
    from rackserve.model.native import library_digest
    return None if native_isa == "none" else f"{native_isa}-{library_digest(native_isa)}"


def engine_code(native_isa: str, native_decode_step: bool | None) -> dict:
    """The record of this process's step code: {"native_library": "ISA-DIGEST" or None,
    "native_decode_step": bool or None (the runner ran elsewhere), "files": [...], "digest": ...}.
    Call it after the engine has run, so its modules are loaded."""
    files = sorted({os.path.relpath(os.path.abspath(m.__file__), _ROOT) for name, m in list(sys.modules.items())
                    if name.startswith(STEP_PATH) and getattr(m, "__file__", None)})
    return {"native_library": _library(native_isa), "native_decode_step": native_decode_step, "files": files,
            "digest": _files_digest(files)}


def unchanged(record: dict | None) -> bool:
    """Whether the code a record names is the code here now (same files' contents, same native build)."""
    if not record or not record.get("files") or record.get("digest") is None:
        return False
    library = record.get("native_library")
    return (_files_digest(record["files"]) == record["digest"]
            and (library is None or _library(library.split("-")[0]) == library))


def runner_native_decode(executor) -> bool | None:
    """Whether `executor`'s steps of decodes run in one native call; None when its runner is in
    another process."""
    runner = getattr(executor, "runner", None)
    return None if runner is None else getattr(runner, "native_decoder", None) is not None


def merged(records: list[dict | None]) -> dict:
    """One record for measurements made by several processes of the same engine (their files'
    union); raises ValueError when one is missing, they ran different builds or decode steps, or the
    code changed since."""
    if not records or any(not r for r in records):
        raise ValueError("a measurement without engine_code predates the record of the code that ran: re-run it")
    shapes = {(r["native_library"], r["native_decode_step"]) for r in records}
    if len(shapes) > 1:
        raise ValueError("the measurements ran different engines (native build, native decode step): "
                         f"{sorted(shapes, key=str)}")
    if not all(unchanged(r) for r in records):
        raise ValueError("the engine's code changed since these measurements: re-run them")
    files = sorted({f for r in records for f in r["files"]})
    return {**records[0], "files": files, "digest": _files_digest(files)}
