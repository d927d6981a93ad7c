"""torch.compile (inductor) of a dense decoder's layers around attention, for small steps.

A decoder layer is cut at its attention op: the part before (residual add, RMSNorm, fused qkv
projection, RoPE) and the part after (o_proj, residual add, RMSNorm, MLP) are each compiled once
and shared by every layer (dynamo lifts the layer's weights as graph inputs), while the paged
attention in between stays eager: it reads a per-step metadata object and the KV cache, which a
static graph cannot hold. This is vLLM's piecewise compilation, without CUDA graphs.

Graphs are static: one set per size in `compile_sizes` (vLLM's name), and a step of T tokens runs
padded to the smallest size >= T (padded rows are zeros and never reach attention or the
output); larger steps run eagerly, where the matmuls dominate anyway. The sizes compile on a
background thread (or before the first step with warmup="startup"), so a server starts at eager
speed and switches a size over once its graphs exist. Inductor keeps compiled graphs on disk,
so a restart recompiles in seconds.

This file must never change what a layer computes: compiled and eager steps give the same tokens.
"""
from __future__ import annotations

import logging
import threading
import time
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rackserve.config import CompilationConfig

logger = logging.getLogger(__name__)


def _before_attention(layer: nn.Module, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    residual = h if residual is None else h + residual
    attn = layer.self_attn
    q, k, v = attn.project(layer.input_layernorm(residual), cos, sin)
    return q, k, v, residual


def _after_attention(layer: nn.Module, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    residual = layer.self_attn.o_proj(o) + residual
    return layer.mlp(layer.post_attention_layernorm(residual)), residual


def supports(model: nn.Module) -> str | None:
    """None when the model's layers can be compiled here; else why not (for the log)."""
    from rackserve.model.models.llama import DecoderLayer, LlamaAttention, LlamaMLP
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None or not all(isinstance(l, DecoderLayer) for l in layers):
        return "its layers are not the dense DecoderLayer"
    if not all(isinstance(l.self_attn, LlamaAttention) and isinstance(l.mlp, LlamaMLP) for l in layers):
        return "only Llama-style attention with a dense MLP is compiled (MoE and MLA layers run eagerly)"
    if any(getattr(l.self_attn.o_proj, "tp", None) is not None and l.self_attn.o_proj.tp.world_size > 1
           for l in layers):
        return "tensor-parallel layers communicate inside the MLP and run eagerly"
    return None


class CompiledDecoder:
    """Runs a dense model's body (DecoderModel) with compiled layer pieces for steps of at most
    max(compile_sizes) tokens whose size has finished compiling; `forward` returns None otherwise
    and the caller runs the model eagerly."""

    def __init__(self, model: nn.Module, config: CompilationConfig, device: torch.device):
        self.body = model.model
        self.sizes = sorted(config.compile_sizes)
        self.device = device
        self.ready: set[int] = set()
        # One compiled function per size and piece, each with a code object of its own: dynamo keeps
        # its graphs per code object, so shared code would check every size's guards on each
        # call, and past 8 graphs (config.recompile_limit) would silently run eagerly.
        def compiled(fn, tag: str):
            code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
            return torch.compile(types.FunctionType(code, fn.__globals__), dynamic=False, backend=config.backend)
        self._fns = {n: (compiled(_before_attention, f"first_{n}"), compiled(_before_attention, str(n)),
                         compiled(_after_attention, str(n))) for n in self.sizes}
        self.compile_seconds: dict[int, float] = {}
        self.steps = 0                  # steps run compiled
        self._thread: threading.Thread | None = None
        if config.warmup == "background":
            self._thread = threading.Thread(target=self.warm_up, name="rackserve-compile", daemon=True)
            self._thread.start()
        else:
            self.warm_up()

    def warm_up(self) -> None:
        """Compile every size on zero inputs, smallest first (a single stream needs size 1)."""
        try:
            for n in self.sizes:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    self._run_layer(self.body.layers[0], n)
                self.compile_seconds[n] = time.perf_counter() - t0
                self.ready.add(n)
                logger.info("compiled the decoder layers for steps of %d token(s) in %.1f s", n, self.compile_seconds[n])
        except Exception:   # noqa: BLE001 - a failed compile leaves the eager path, which always works
            logger.exception("torch.compile failed; steps run eagerly")

    def _run_layer(self, layer: nn.Module, n: int) -> None:
        hidden = self.body.norm.weight.shape[0]
        dtype = self.body.norm.weight.dtype
        h = torch.zeros(n, hidden, dtype=dtype, device=self.device)
        cos, sin = self.body.rotary_emb(torch.zeros(n, dtype=torch.long, device=self.device))
        first, rest, after = self._fns[n]
        q, _, _, residual = first(layer, h, None, cos, sin)
        rest(layer, h, residual, cos, sin)
        after(layer, q.new_zeros(n, q.shape[1] * q.shape[2]), residual)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any) -> torch.Tensor | None:
        t = input_ids.shape[0]
        n = next((s for s in self.sizes if s >= t), None)
        if n is None or n not in self.ready:
            return None
        self.steps += 1
        pad = n - t
        h = self.body.embed_tokens(F.pad(input_ids, (0, pad)))
        cos, sin = self.body.rotary_emb(F.pad(positions, (0, pad)))
        first, rest, after = self._fns[n]
        residual = None
        for layer in self.body.layers:
            q, k, v, residual = (first if residual is None else rest)(layer, h, residual, cos, sin)
            o = layer.self_attn.attn(q[:t], k[:t], v[:t], attn_metadata)
            h, residual = after(layer, F.pad(o, (0, 0, 0, pad)) if pad else o, residual)
        return self.body.norm(h[:t] + residual[:t])


def compile_decoder(model: nn.Module, config: CompilationConfig, device: torch.device) -> CompiledDecoder | None:
    """The compiled body for `model` under `config`, or None (mode 0, or a model not compiled here)."""
    if config.mode == 0:
        return None
    why_not = supports(model)
    if why_not is not None:
        logger.info("torch.compile skipped: %s", why_not)
        return None
    return CompiledDecoder(model, config, device)
