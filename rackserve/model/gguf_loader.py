"""GGUF checkpoints: metadata to an HF-style config dict, and tensors dequantized and renamed to
HF names, so that GGUF and safetensors models load through the same `load_weights`.

llama.cpp stores the q/k rows of llama-architecture models interleaved for its own (GPT-J style)
RoPE; we undo that permutation so that neox-style rotate_half is right, as transformers' GGUF
loader does. Under --quantization gguf the Q4_0/Q4_1/Q8_0 linear weights are not dequantized but
decoded into int4 groups (model/quant/) that the layers keep packed. This file must never build a
model or know about devices.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from rackserve.gguf_file import GGUFFile
from rackserve.model.quant.gguf_blocks import SUPPORTED, Int4Groups, from_gguf

# GGUF general.architecture -> HF architecture name (a key of models.MODEL_REGISTRY).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Architectures whose converter permuted q/k rows (convert_hf_to_gguf.py's LlamaModel).
_PERMUTED_QK = {"llama"}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def open_gguf(path: str) -> GGUFFile:
    return GGUFFile(path)


def _field(reader: GGUFFile, key: str, default: Any = KeyError) -> Any:
    if key not in reader.metadata:
        if default is KeyError:
            raise KeyError(f"GGUF metadata lacks {key!r}")
        return default
    return reader.metadata[key]


def gguf_config(reader: GGUFFile) -> dict[str, Any]:
    """The HF config.json equivalent of the file's metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}")
    names = {t.name: t for t in reader.tensors}
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0))}
    if "rope_freqs.weight" in names:
        # Llama 3.x files carry their rope scaling as per-frequency divisors rather than parameters.
        rope["freq_factors"] = names["rope_freqs.weight"].data.astype(np.float32).tolist()
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        # ne[1] of the embedding is the vocabulary, whatever the metadata says.
        "vocab_size": int(names["token_embd.weight"].shape[1]),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
    }
    return config


def hf_name(gguf_name: str) -> str | None:
    """llama.cpp tensor name to HF name; None for tensors that are not weights (rope_freqs)."""
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    if base == "rope_freqs":
        return None
    raise KeyError(f"unknown GGUF tensor {gguf_name!r}")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp interleaves each head's two rotary halves row by row (GPT-J pairs): rows (i, half)
    # become (half, i) again.
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def gguf_weights(reader: GGUFFile, config: dict[str, Any], keep_quantized: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | Int4Groups]]:
    """Every weight under its HF name, dequantized to float32. With `keep_quantized`, linear weights
    (and the lm_head, also when it is tied to the embedding) of a type in gguf_blocks.SUPPORTED
    come instead as Int4Groups named `<module>.qweight`."""
    from gguf.quants import dequantize
    arch = _field(reader, "general.architecture")
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        heads = None
        if arch in _PERMUTED_QK and ".self_attn.q_proj." in name:
            heads = config["num_attention_heads"]
        elif arch in _PERMUTED_QK and ".self_attn.k_proj." in name:
            heads = config["num_key_value_heads"]
        qtype = t.tensor_type.name
        if keep_quantized and qtype in SUPPORTED and len(t.shape) == 2:
            q = from_gguf(qtype, t.data)
            if heads is not None:
                q = Int4Groups(qtype, *(torch.from_numpy(_unpermute(a.numpy(), heads))
                                        for a in (q.codes, q.scales, q.zeros)))
            if name == "model.embed_tokens.weight":
                if config["tie_word_embeddings"]:
                    yield "lm_head.qweight", q
            else:
                yield name.removesuffix(".weight") + ".qweight", q
                continue
        w = dequantize(t.data, t.tensor_type)
        if heads is not None:
            w = _unpermute(w, heads)
        # F32 tensors come back as read-only views of the memory-mapped file.
        yield name, torch.from_numpy(np.require(w, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))
