"""load_model: a checkpoint (a .gguf file, or an HF directory of safetensors with config.json) to
a model on its device and dtype, plus ModelInfo, the facts the KV cache and the engine size
themselves by.

This file owns checkpoint formats and the HF config; it must never allocate the KV cache or
know about requests.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rackserve.config import ModelConfig
from rackserve.distributed.parallel_state import ParallelGroups
from rackserve.model import native_ops
from rackserve.model.attention import KVCacheSpec
from rackserve.model.models import get_model_class

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int        # the checkpoint's own context length
    eos_token_ids: tuple[int, ...]      # from the config (and generation_config.json when present)
    dtype: torch.dtype
    kv_cache_spec: KVCacheSpec          # one layer's cache in one process (a TP rank's layers hold a share)
    # A model with several KV cache groups (DeepSeek-V4): (group, bytes per token, all layers) each;
    # the first, the sliding group, for the tokens it keeps only.
    kv_cache_bytes_by_group: tuple[tuple[str, float], ...] = ()

    @property
    def kv_cache_bytes_per_token(self) -> int:
        """What every layer caches for one token: K and V, or the MLA latent; with cache groups,
        what a token costs at long context (the compressed groups; the window is bounded)."""
        if self.kv_cache_bytes_by_group:
            return round(sum(b for _, b in self.kv_cache_bytes_by_group[1:]))
        return self.num_layers * self.kv_cache_spec.bytes_per_token(self.dtype)

    @classmethod
    def from_config(cls, config: dict[str, Any], dtype: torch.dtype, extra_eos: Sequence[int] = ()) -> "ModelInfo":
        heads = config["num_attention_heads"]
        num_kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        by_group: tuple[tuple[str, float], ...] = ()
        if config.get("kv_lora_rank"):
            # Multi-head latent attention (DeepSeek-V2/V3), recognised as vLLM does: every layer
            # caches the compressed KV and the roped shared key, whatever the head count.
            spec = KVCacheSpec(1, config["kv_lora_rank"] + config["qk_rope_head_dim"], use_mla=True)
        elif config["architectures"][0] == "DeepseekV4ForCausalLM":
            from rackserve.model.dsv4_cache import DSV4CacheGroups
            spec = KVCacheSpec(1, config["head_dim"], family="dsv4")
            by_group = tuple(DSV4CacheGroups(config, 1).bytes_per_token(dtype.itemsize).items())
        else:
            spec = KVCacheSpec(num_kv_heads, head_dim)
        eos = config.get("eos_token_id")
        eos_ids = ([] if eos is None else [eos] if isinstance(eos, int) else list(eos)) + list(extra_eos)
        return cls(
            architecture=config["architectures"][0],
            num_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hidden_size=config["hidden_size"],
            vocab_size=config["vocab_size"],
            max_position_embeddings=config["max_position_embeddings"],
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            dtype=dtype,
            kv_cache_spec=spec,
            kv_cache_bytes_by_group=by_group,
        )


def load_model(model_config: ModelConfig, attn_backend: str = "torch",
               groups: ParallelGroups | None = None) -> tuple[nn.Module, ModelInfo]:
    """The model of this rank of `groups` (its slice of every split weight), on its device."""
    path, dtype = model_config.model, getattr(torch, model_config.dtype)
    if path.endswith(".gguf"):
        from rackserve.model.gguf_loader import gguf_config, gguf_weights, open_gguf
        reader = open_gguf(path)
        config = gguf_config(reader)
        info = ModelInfo.from_config(config, dtype)
        weights = gguf_weights(reader, config, keep_quantized=model_config.quantization == "gguf")
    else:
        config = read_hf_config(path)
        info = ModelInfo.from_config(config, dtype, _generation_eos(path))
        weights = safetensors_weights(path)
    model_cls = get_model_class(info.architecture)
    max_position = model_config.max_model_len or info.max_position_embeddings
    with torch.device(model_config.device), _default_dtype(dtype):
        model = model_cls(config, attn_backend, max_position, groups or ParallelGroups.single())
    if model_config.device == "cpu":
        native_ops.use_isa(model_config.native_isa)     # the build this process's fused ops call
    if model_config.quantization == "gguf":
        from rackserve.model.quant.kernel_choice import resolve_quant_kernel
        from rackserve.model.quant.quantized_weight import QuantizedWeight
        kernel = resolve_quant_kernel(model_config.quant_kernel, "gguf", model_config.device,
                                      model_config.native_isa).name
        for module in model.modules():
            if isinstance(module, QuantizedWeight):
                module.quant_kernel = kernel
    model.load_weights(weights)
    for module in list(model.modules()):
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    if model_config.packed_activations != "two-part":
        for module in model.modules():
            if getattr(module, "quant", None) is not None:
                module.quant.use_activation_parts(model_config.packed_activations)
    if model_config.device == "cpu" and dtype == torch.float32:
        keep_bf16_linears(model)
    return model.eval(), info


def bf16_candidates(model: nn.Module) -> list[nn.Module]:
    """The linears keep_bf16_linears may keep in bfloat16: the dense ones of Llama-style attention
    and MLP layers (bench forward's model_cost counts the same ones)."""
    from rackserve.model.models.llama import LlamaAttention, LlamaMLP
    return [linear for module in model.modules() if isinstance(module, (LlamaAttention, LlamaMLP))
            for linear in module.children()
            if getattr(linear, "quant", True) is None and getattr(linear, "weight", None) is not None]


def keep_bf16_linears(model: nn.Module) -> int:
    """A float32 model on CPU keeps the dense weights of its Llama-style attention and MLP linears in
    bfloat16 wherever every value is one (a bf16 checkpoint's, as a GGUF's blocks stay packed): a
    decode step reads half the bytes, and the products are the same, since the native GEMV and
    F.linear widen them exactly (native_ops.linear). Returns how many weights it narrowed."""
    kept = 0
    for linear in bf16_candidates(model):
        weight = linear.weight
        if weight.dtype != torch.float32:
            continue
        narrow = weight.data.to(torch.bfloat16)
        if torch.equal(narrow.float(), weight.data):
            weight.data, kept = narrow, kept + 1
    if kept:
        logger.info("kept %d linear weights in bfloat16, as the checkpoint holds them (computed in float32)", kept)
    return kept


def read_hf_config(folder: str) -> dict[str, Any]:
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{folder} has no config.json (is it an HF model directory?)")
    with open(config_path) as f:
        config = json.load(f)
    if not config.get("architectures"):
        raise ValueError(f"{config_path} names no architectures")
    return config


def _generation_eos(folder: str) -> list[int]:
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _safetensors_files(folder: str) -> list[str]:
    """The files of a one-file or sharded (index json) safetensors checkpoint."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    return [os.path.join(folder, f) for f in files]


def safetensors_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a one-file or sharded (index json) safetensors checkpoint."""
    from safetensors import safe_open
    for file in _safetensors_files(folder):
        with safe_open(file, framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def safetensors_dtypes(folder: str) -> set[str]:
    """The dtypes ("BF16", "F32", ...) of a safetensors checkpoint's tensors, read from the headers."""
    from safetensors import safe_open
    dtypes = set()
    for file in _safetensors_files(folder):
        with safe_open(file, framework="pt") as st:
            dtypes.update(st.get_slice(name).get_dtype() for name in st.keys())
    return dtypes


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are created directly in the target dtype: no full-size float32 copy first.
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
