"""A GGUF file's metadata and tensors, read in one pass over its header.

gguf-py's GGUFReader builds a numpy view for every part of every metadata value: SmolLM2's
49,152 tokens and 48,900 merges cost it 7-8 s a file on a 2-vCPU Zen 1, paid twice per engine start
(the tokenizer and the weights). Here the header is parsed with struct from the memory map and the
tensors' data stay views of it (the same shapes GGUFReader gives: [.., bytes per row] of uint8 for
block-quantized types), so opening a file costs what decoding its strings costs. gguf-py's enums and
block sizes are still the names and sizes used (gguf.GGMLQuantizationType, GGML_QUANT_SIZES), and
its dequantize() reads these tensors' data as it reads its own.

Little-endian files of GGUF versions 2 and 3 (what llama.cpp writes); anything else is refused with
the reason. This file must never import torch (the tokenizer, and the router through it, read
GGUF metadata without a model).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types (gguf.GGUFValueType) -> struct format of one scalar.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain numpy items rather than blocks.
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64,
          "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any                    # gguf.GGMLQuantizationType
    shape: tuple[int, ...]              # ne[0], ne[1], ...: the innermost dimension first, as GGUF stores it
    n_elements: int
    data: np.ndarray                    # a view of the file: numpy items, or [..., bytes per row] uint8


class GGUFFile:
    """`metadata`: every key's value as Python (str, int, float, bool, or a list of them);
    `tensors`: in file order."""

    def __init__(self, path: str):
        self.path = path
        self._map = np.memmap(path, mode="r")
        self._buf = memoryview(self._map)
        self._off = 0
        if bytes(self._buf[:4]) != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic {bytes(self._buf[:4])!r})")
        self._off = 4
        version = self._scalar("I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are; a big-endian "
                             "file reads as a huge version)")
        self.metadata: dict[str, Any] = {}
        try:
            infos = self._header()
        except (struct.error, UnicodeDecodeError) as e:     # numbers or text past the end, or not text
            raise ValueError(f"{path}: the GGUF header is cut short or corrupt near byte {self._off}: {e}") from e
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._off // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError(f"{path}: a tensor name appears twice")
        del self._buf

    def _header(self) -> list[tuple[str, tuple[int, ...], int, int]]:
        """Reads the metadata into self.metadata; the tensors' (name, dims, type, offset)."""
        n_tensors, n_kv = self._scalar("Q"), self._scalar("Q")
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = struct.unpack_from(f"<{self._scalar('I')}Q", self._buf, self._off)
            self._off += 8 * len(dims)
            infos.append((name, dims, self._scalar("I"), self._scalar("Q")))
        return infos

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self._buf, self._off)
        self._off += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("Q")
        if self._off + n > len(self._buf):
            raise struct.error(f"a string of {n} bytes runs past the end")
        text = bytes(self._buf[self._off:self._off + n]).decode("utf-8")
        self._off += n
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._scalar("I"), self._scalar("Q")
            if item == _STRING:
                return [self._string() for _ in range(count)]
            if item in _SCALARS:
                fmt = "<" + _SCALARS[item]
                if self._off + count * struct.calcsize(fmt) > len(self._buf):
                    raise struct.error(f"an array of {count} items runs past the end")
                values = np.frombuffer(self._buf, np.dtype(fmt), count, self._off).tolist()
                self._off += count * struct.calcsize(fmt)
                return values
            if item == _ARRAY:      # each element an array of its own (type, count, items)
                return [self._value(_ARRAY) for _ in range(count)]
            return self._bad(item)
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        return self._bad(kind)

    def _bad(self, kind: int):
        raise ValueError(f"{self.path}: unknown GGUF metadata type {kind} at byte {self._off}")

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        kind = GGMLQuantizationType(raw_type)
        n = int(np.prod(dims, dtype=np.int64))
        rows = tuple(reversed(dims))
        block, size = GGML_QUANT_SIZES[kind]
        plain = _PLAIN.get(kind.name)
        if plain is not None:
            shape, dtype = rows, np.dtype(plain)
        else:   # blocks (and bf16, which gguf-py reads as raw bytes too): each row's bytes
            if dims[0] % block:
                raise ValueError(f"{self.path}: tensor {name!r} rows of {dims[0]} are not whole {kind.name} blocks")
            shape, dtype = (*rows[:-1], dims[0] // block * size), np.dtype(np.uint8)
        if start + offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize > len(self._map):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
        data = np.ndarray(shape, dtype, self._map, start + offset)
        return GGUFTensor(name, kind, tuple(dims), n, data)
