"""The native decode step of a dense Llama-style model: a step whose every row is a single-token
query (a batch of decodes) runs all the layers in one call of the native library
(csrc/decode_loop.cpp) instead of ~30 Python dispatches and ~10 native calls per layer.

`NativeDecoder` lays out, once per model, the pointers that call needs (each layer's norms,
weights and their GEMV, and KV cache), so a step only passes its own tensors: the embedded tokens,
cos/sin, the slot mapping and the attention metadata's block tables and lengths. It runs where
every op of the layer has a native form: float32 on CPU (the KV cache float32 or float16),
weights kept packed by a native GEMV kernel (quant/vnni_linear.py) or dense float32 ones (an
HF checkpoint run in float32: csrc/dense_gemv.cpp's rs_dense_gemv), no biases, no tensor
parallelism, the "torch" attention backend's metadata; `supports` says why not elsewhere, and
everything else (prefill chunks, mixed steps, other models, dtypes and devices, torch.compile) runs
the modules, which compute the same values (tests/test_native_decode.py). This file must never change what a layer computes.
"""
from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from rackserve.model import native_ops
from rackserve.model.torch_attention import TorchAttentionBackend, TorchAttentionMetadata

logger = logging.getLogger(__name__)

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# decode_loop.cpp's RsOp: what a profiled step's seconds are split into, in its order.
OPS = ("norm", "qkv_proj", "rope+kv_write", "attention", "o_proj", "gate_up_proj", "silu_and_mul", "down_proj")


class _Linear(ctypes.Structure):
    _fields_ = [("gemv", _P), ("packed", _P), ("tiles", _I64), ("width", _I64), ("kind", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("k_cache", _P), ("v_cache", _P)]


class _Decoder(ctypes.Structure):
    _fields_ = [(name, _I64) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                          "block_size", "wide", "kv_half")]
    _fields_ += [("eps", _F), ("scale", _F), ("layers", ctypes.POINTER(_Layer)), ("final_norm", _P)]


def supports(model: nn.Module) -> str | None:
    """None when `model`'s decode steps can run natively here (its KV cache bound); else why not."""
    from rackserve.model.models.llama import DecoderLayer, DecoderModel, LlamaAttention, LlamaMLP
    from rackserve.model.quant.vnni_linear import VnniLinear
    lib = native_ops.library()
    body = getattr(model, "model", None)
    if lib is None:
        return "the native library does not run here"
    if type(body) is not DecoderModel or not all(type(l) is DecoderLayer and type(l.self_attn) is LlamaAttention
                                                  and type(l.mlp) is LlamaMLP for l in body.layers):
        return "only the dense Llama decoder (no biases, q/k norms or MoE) has a native decode step"
    linears = [m for l in body.layers for m in (l.self_attn.qkv_proj, l.self_attn.o_proj, l.mlp.gate_up_proj,
                                                l.mlp.down_proj)]
    if not all(m.bias is None and (isinstance(m.quant, VnniLinear) or m.quant is None and _dense_float32(m.weight))
               for m in linears):
        return ("its linears are neither kept packed for a native GEMV kernel (--quantization gguf, --quant-kernel "
                "vnni or avx2) nor dense float32 CPU weights, or have biases")
    # Only qkv's output may be padded to whole tiles: the loop reads it with its row stride.
    if any(_linear(m).width != m.output_size for l in body.layers for m in (l.self_attn.o_proj, l.mlp.gate_up_proj,
                                                                             l.mlp.down_proj)):
        return "an o_proj, gate_up or down output is not a whole number of the kernel's tiles"
    if any(m.tp.world_size > 1 for m in linears) or body.embed_tokens.tp.world_size > 1:
        return "tensor-parallel layers communicate between the ops"
    attn = body.layers[0].self_attn
    if any(l.self_attn.attn.kv_cache is None for l in body.layers):
        return "no KV cache is bound"
    if type(attn.attn.impl) is not TorchAttentionBackend or body.rotary_emb.cos.shape[-1] != attn.head_dim:
        return "it needs the torch attention backend and RoPE over whole heads"
    tensors = [t for l in body.layers for t in (l.input_layernorm.weight, l.post_attention_layernorm.weight)]
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
               for t in [*tensors, body.norm.weight, body.embed_tokens.weight, body.rotary_emb.cos]):
        return "its weights are not float32 CPU tensors"
    caches = [t for l in body.layers for t in l.self_attn.attn.kv_cache]
    if not all(t.dtype == caches[0].dtype and t.device.type == "cpu" and t.is_contiguous() for t in caches) \
            or caches[0].dtype not in (torch.float32, torch.float16):
        return "its KV cache is not float32 or float16 CPU tensors of one dtype"
    return None


def _dense_float32(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()


def _linear(module: nn.Module) -> _Linear:
    if module.quant is None:        # a dense float32 weight: rs_dense_gemv, a row a "tile"
        gemv = ctypes.cast(native_ops.library().rs_dense_gemv, ctypes.c_void_p).value
        return _Linear(gemv, module.weight.data_ptr(), module.output_size, module.output_size, 0)
    gemv, tile = module.quant.native_gemv()
    tiles = module.quant.packed.shape[0]
    return _Linear(gemv, module.quant.packed.data_ptr(), tiles, tiles * tile, module.quant.kind)


class NativeDecoder:
    """One model's native decode step. Holds the model's body: its tensors must outlive the pointers."""

    def __init__(self, model: nn.Module):
        self.body = body = model.model
        attn = body.layers[0].self_attn
        layers = [_Layer(l.input_layernorm.weight.data_ptr(), l.post_attention_layernorm.weight.data_ptr(),
                         _linear(l.self_attn.qkv_proj), _linear(l.self_attn.o_proj), _linear(l.mlp.gate_up_proj),
                         _linear(l.mlp.down_proj), l.self_attn.attn.kv_cache[0].data_ptr(),
                         l.self_attn.attn.kv_cache[1].data_ptr())
                  for l in body.layers]
        self._layers = (_Layer * len(layers))(*layers)
        inter, hidden = body.layers[0].mlp.down_proj.input_size, body.norm.weight.shape[0]
        wide = max(2 * inter, *(l.qkv.width for l in layers))
        self.kv_dtype = attn.attn.kv_cache[0].dtype
        self.decoder = _Decoder(len(layers), hidden, attn.num_heads, attn.num_kv_heads, attn.head_dim, inter,
                                attn.attn.kv_cache[0].shape[1], wide, int(self.kv_dtype == torch.float16),
                                body.layers[0].input_layernorm.eps,
                                attn.attn.impl.scale, self._layers, body.norm.weight.data_ptr())
        self.scratch_per_row = 2 * hidden + wide + attn.num_heads * attn.head_dim + inter
        self.lib = native_ops.library()
        fn = self.lib.rs_decode_layers
        fn.argtypes = [ctypes.POINTER(_Decoder), _I64, _P, _P, _P, _P, _P, _I64, _P, _P, _P, ctypes.c_int, _P]
        fn.restype = ctypes.c_int
        self.seconds: ctypes.Array | None = None     # per OPS entry, added to by profiled steps

    def profile(self, on: bool) -> None:
        """Start (zeroed) or stop adding each op's time of every step to `seconds`."""
        self.seconds = (ctypes.c_double * len(OPS))() if on else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: object) -> torch.Tensor | None:
        """The final hidden states [T, hidden] of a step of T decodes; None for any other step."""
        rows = input_ids.shape[0]
        if (not isinstance(metadata, TorchAttentionMetadata) or metadata.prefills or rows == 0
                or not isinstance(metadata.decode_rows, slice) or metadata.decode_rows != slice(0, rows)):
            return None
        residual = self.body.embed_tokens(input_ids)
        cos, sin = self.body.rotary_emb(positions)
        tables, lens, slots = metadata.decode_block_tables, metadata.decode_lens, metadata.slot_mapping
        assert tables.dtype == lens.dtype == slots.dtype == torch.int64 and tables.is_contiguous()
        scratch = torch.empty(rows * self.scratch_per_row)
        out = torch.empty(rows, self.decoder.hidden)
        rc = self.lib.rs_decode_layers(ctypes.byref(self.decoder), rows, residual.data_ptr(), cos.data_ptr(),
                                       sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[0] // rows,
                                       lens.data_ptr(), scratch.data_ptr(), out.data_ptr(), torch.get_num_threads(),
                                       None if self.seconds is None else ctypes.addressof(self.seconds))
        assert rc == 0, "rs_decode_layers: a GEMV refused its arguments"
        return out


def native_decoder(model: nn.Module) -> NativeDecoder | None:
    """The model's NativeDecoder, or None (the reason logged) where its decode steps cannot run natively."""
    why_not = supports(model)
    if why_not is not None:
        logger.info("native decode step off: %s", why_not)
        return None
    decoder = NativeDecoder(model)
    half = decoder.kv_dtype == torch.float16
    logger.info("native decode step on: a step of decodes runs every layer in one native call (KV cache %s%s)",
                str(decoder.kv_dtype).removeprefix("torch."),
                ", written rounded to nearest even, read widened to float32" if half else "")
    return decoder
