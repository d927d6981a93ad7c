"""The native decode step of a dense Llama-style model: a step whose every row is a single-token
query (a batch of decodes) runs all the layers in one call of the native library
(csrc/decode_loop.cpp) instead of ~30 Python dispatches and ~10 native calls per layer.

`NativeDecoder` lays out, once per model, the pointers that call needs (each layer's norms,
weights and their GEMV, and KV cache), so a step only passes its own tensors: the embedded tokens,
cos/sin, the slot mapping and the attention metadata's block tables and lengths. It runs where
every op of the layer has a native form: a float32 or bfloat16 model on CPU (the KV cache float32,
float16, bfloat16 or an 8-bit float), weights kept packed by a native GEMV kernel (quant/vnni_linear.py) or dense
float32 or bfloat16 ones (an HF checkpoint: csrc/dense_gemv.cpp's rs_dense_gemv), no biases, no
tensor parallelism, the "torch" attention backend's metadata; `supports` says why not elsewhere, and
everything else (prefill chunks, mixed steps, other models, dtypes and devices, torch.compile) runs
the modules, which compute the same values (tests/test_native_decode.py). Activations are float32
inside the call whatever the model's dtype: a bfloat16 model's decode steps compute at float32
precision on its bf16 weights (its norm weights and RoPE tables widened exactly), where its
modules round every activation to bf16, so they agree as a bf16 run agrees with a float32 one.
This file must never change what a module computes.
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
                                          "block_size", "wide", "kv_dtype")]
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
    if not all(m.bias is None and (isinstance(m.quant, VnniLinear) or m.quant is None and _dense(m.weight))
               for m in linears):
        return ("its linears are neither kept packed for a native GEMV kernel (--quantization gguf, --quant-kernel "
                "vnni or avx2) nor dense float32 or bfloat16 CPU weights, or have biases")
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
    tensors += [body.norm.weight, body.embed_tokens.weight, body.rotary_emb.cos]
    if not all(t.dtype == tensors[0].dtype and _dense(t) for t in tensors):
        return "its norms, embedding and RoPE tables are not float32 or bfloat16 CPU tensors of one dtype"
    caches = [t for l in body.layers for t in l.self_attn.attn.kv_cache]
    if not all(t.dtype == caches[0].dtype and t.device.type == "cpu" and t.is_contiguous() for t in caches) \
            or caches[0].dtype not in KV_DTYPES:
        return "its KV cache is not float32, float16, bfloat16 or 8-bit float CPU tensors of one dtype"
    return None


# decode_loop.cpp's RsKvDtype by dtype.
KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}


def _dense(weight: torch.Tensor) -> bool:
    return weight.dtype in native_ops.DENSE_KINDS and weight.device.type == "cpu" and weight.is_contiguous()


def _linear(module: nn.Module) -> _Linear:
    if module.quant is None:        # a dense weight: rs_dense_gemv, a row a "tile"
        gemv = ctypes.cast(native_ops.library().rs_dense_gemv, ctypes.c_void_p).value
        return _Linear(gemv, module.weight.data_ptr(), module.output_size, module.output_size,
                       native_ops.DENSE_KINDS[module.weight.dtype])
    gemv, tile = module.quant.native_gemv()
    tiles = module.quant.packed.shape[0]
    return _Linear(gemv, module.quant.packed.data_ptr(), tiles, tiles * tile, module.quant.kind)


class NativeDecoder:
    """One model's native decode step. Holds the model's body: its tensors must outlive the pointers."""

    def __init__(self, model: nn.Module):
        self.body = body = model.model
        attn = body.layers[0].self_attn
        # A bfloat16 model's norm weights widened once (exactly); the activations stay float32.
        self.dtype = body.norm.weight.dtype
        self._norms = [t.float().contiguous() for l in body.layers
                       for t in (l.input_layernorm.weight, l.post_attention_layernorm.weight)] + [body.norm.weight.float()]
        layers = [_Layer(self._norms[2 * i].data_ptr(), self._norms[2 * i + 1].data_ptr(),
                         _linear(l.self_attn.qkv_proj), _linear(l.self_attn.o_proj), _linear(l.mlp.gate_up_proj),
                         _linear(l.mlp.down_proj), l.self_attn.attn.kv_cache[0].data_ptr(),
                         l.self_attn.attn.kv_cache[1].data_ptr())
                  for i, l in enumerate(body.layers)]
        self._layers = (_Layer * len(layers))(*layers)
        inter, hidden = body.layers[0].mlp.down_proj.input_size, body.norm.weight.shape[0]
        wide = max(2 * inter, *(l.qkv.width for l in layers))
        self.kv_dtype = attn.attn.kv_cache[0].dtype
        self.decoder = _Decoder(len(layers), hidden, attn.num_heads, attn.num_kv_heads, attn.head_dim, inter,
                                attn.attn.kv_cache[0].shape[1], wide, KV_DTYPES[self.kv_dtype],
                                body.layers[0].input_layernorm.eps, attn.attn.impl.scale, self._layers,
                                self._norms[-1].data_ptr())
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
        residual = self.body.embed_tokens(input_ids).float()
        cos, sin = (t.float().contiguous() for t in self.body.rotary_emb(positions))
        tables, lens, slots = metadata.decode_block_tables, metadata.decode_lens, metadata.slot_mapping
        assert tables.dtype == lens.dtype == slots.dtype == torch.int64 and tables.is_contiguous()
        scratch = torch.empty(rows * self.scratch_per_row)
        out = torch.empty(rows, self.decoder.hidden)
        rc = self.lib.rs_decode_layers(ctypes.byref(self.decoder), rows, residual.data_ptr(), cos.data_ptr(),
                                       sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[0] // rows,
                                       lens.data_ptr(), scratch.data_ptr(), out.data_ptr(), torch.get_num_threads(),
                                       None if self.seconds is None else ctypes.addressof(self.seconds))
        assert rc == 0, "rs_decode_layers: a GEMV refused its arguments"
        return out.to(self.dtype)


def native_decoder(model: nn.Module) -> NativeDecoder | None:
    """The model's NativeDecoder, or None (the reason logged) where its decode steps cannot run natively."""
    why_not = supports(model)
    if why_not is not None:
        logger.info("native decode step off: %s", why_not)
        return None
    decoder = NativeDecoder(model)
    narrow = decoder.kv_dtype != torch.float32
    logger.info("native decode step on: a step of decodes runs every layer in one native call (%s weights, "
                "float32 activations; KV cache %s%s)", str(decoder.dtype).removeprefix("torch."),
                str(decoder.kv_dtype).removeprefix("torch."),
                ", written rounded to nearest even, read widened to float32" if narrow else "")
    return decoder
