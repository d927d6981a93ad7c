"""ModelSpec: what one token costs a model, read from a config.json (an HF directory, a file, or
an alias shipped under sim/configs/), with no weights and no torch.

Per layer it counts the parameters of the dense linears (every token multiplies them), of one
routed expert (top-k of E per token), the KV cache a token leaves behind, and the attention work
of one query against its keys. Four architecture families are read: Llama-like dense GQA models,
Qwen3-MoE, DeepSeek-V3 (MLA, counted absorbed as it is decoded) and DeepSeek-V4 (sliding window +
compressed sparse / heavily compressed attention). This file owns those counts; it must never
time anything (hardware.py and cost.py do) nor import torch.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
# Bytes per element of the precisions the flags take.
PRECISION_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 0.5625}  # fp4: + a scale per 16
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def model_aliases() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


@dataclass(frozen=True)
class AttentionKind:
    """One kind of attention layer. Keys a query attends at context c: min(c, window) (all of them
    without a window) plus, for compressed layers, min(c / compress, topk) compressed entries."""
    count: int                      # layers of this kind
    window: int | None              # sliding window in tokens; None: full attention
    compress: int = 0               # tokens per compressed entry (0: none)
    topk: int | None = None         # compressed entries kept per query (None: all)
    index_flops_per_entry: int = 0  # indexer scoring of one (query, compressed entry) pair
    index_bytes_per_entry: float = 0.0
    index_candidates: int | None = None   # most entries the indexer scores per query (None: all)

    def keys(self, context: int) -> float:
        window = context if self.window is None else min(context, self.window)
        if not self.compress:
            return window
        entries = context / self.compress
        return window + (entries if self.topk is None else min(entries, self.topk))

    def stored_entries(self, context: int) -> float:
        """Entries a sequence of `context` tokens keeps in one layer (a window keeps its last ones)."""
        window = context if self.window is None else min(context, self.window)
        return window + (context / self.compress if self.compress else 0.0)

    def index_entries(self, context: int) -> float:
        """Indexer keys one query scores in one layer: every compressed entry, or at most the
        candidates a bounded indexer keeps (DeepSeek-V4.1-Flash: 16K, the seeds say)."""
        entries = self.index_stored(context)
        return entries if self.index_candidates is None else min(entries, self.index_candidates)

    def index_stored(self, context: int) -> float:
        """Indexer keys a sequence of `context` tokens keeps in one layer (one per compressed entry)."""
        return context / self.compress if self.index_flops_per_entry else 0.0


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    dense_params_per_token: int     # every linear a token multiplies, shared experts included, all layers
    lm_head_params: int             # per sampled token
    num_experts: int                # routed experts per MoE layer (0: dense)
    experts_per_token: int
    expert_params: int              # one routed expert of one layer
    num_moe_layers: int
    kv_entry_elems: int             # elements of one cached token entry in one layer
    num_kv_heads: int               # KV heads: tensor parallelism splits the cache over at most this many
    attn_flops_per_key: int         # one query against one key in one layer: q.k and p.v
    attention: tuple[AttentionKind, ...]
    weight_precision: str = "bf16"
    expert_precision: str = "bf16"
    kv_precision: str = "bf16"
    kv_entry_bytes: float | None = None     # overrides kv_entry_elems x the KV precision
    mtp_dense_params: int = 0               # one MTP block's linears, its experts apart (0: no MTP; sim/mtp.py)
    # Bytes per dense and LM head parameter when not the weight precision's: a GGUF whose linears
    # stay packed (Q4_1 and a Q8_0 embedding), as a `cpu` calibration measured them.
    dense_weight_bytes: float | None = None
    # Packed weights (a GGUF's) are dequantized to the compute dtype for a step of more tokens than
    # this, then multiplied densely: the engine's kernel's `dense_above_rows`, as a `cpu` calibration
    # recorded it (bench/engine_kernels.py); None: never.
    dequantize_above_tokens: int | None = None
    packed_kernel: str | None = None        # that kernel's name (--quant-kernel): its own efficiency class

    @property
    def total_params(self) -> int:
        experts = self.num_moe_layers * self.num_experts * self.expert_params
        return self.dense_params_per_token + self.lm_head_params + experts

    @property
    def active_params_per_token(self) -> int:
        return self.dense_params_per_token + self.num_moe_layers * self.experts_per_token * self.expert_params

    @property
    def weight_bytes(self) -> float:
        """Bytes one dense (or LM head) parameter takes in memory."""
        if self.dense_weight_bytes is not None:
            return self.dense_weight_bytes
        return PRECISION_BYTES[self.weight_precision]

    @property
    def entry_bytes(self) -> float:
        """Bytes of one cached entry (a token, or a compressed group of tokens) in one layer."""
        if self.kv_entry_bytes is not None:
            return self.kv_entry_bytes
        return self.kv_entry_elems * PRECISION_BYTES[self.kv_precision]

    def kv_bytes_per_token(self, context: int = 1 << 20) -> float:
        """KV bytes per token of a sequence `context` tokens long, all layers (windows amortised)."""
        return self.kv_bytes(context) / context

    def kv_bytes(self, context: int) -> float:
        """KV bytes a sequence of `context` tokens keeps, all layers."""
        return sum(k.count * (k.stored_entries(context) * self.entry_bytes
                              + k.index_stored(context) * k.index_bytes_per_entry) for k in self.attention)

    def with_precision(self, weights: str | None = None, kv: str | None = None) -> "ModelSpec":
        """--quantization / --kv-cache-dtype overrides (bf16, fp8, fp4)."""
        for p in (weights, kv):
            if p is not None and p not in PRECISION_BYTES:
                raise ValueError(f"unknown precision {p!r}; choose one of {sorted(PRECISION_BYTES)}")
        spec = self
        if weights:
            spec = replace(spec, weight_precision=weights, expert_precision=weights, dense_weight_bytes=None,
                           dequantize_above_tokens=None, packed_kernel=None)
        if kv:
            scale = PRECISION_BYTES[kv] / PRECISION_BYTES[spec.kv_precision]
            spec = replace(spec, kv_precision=kv,
                           kv_entry_bytes=None if spec.kv_entry_bytes is None else spec.kv_entry_bytes * scale)
        return spec


def load_config(model: str) -> dict:
    """A config.json as a dict: `model` is an alias, a config file, or an HF directory."""
    if model in model_aliases():
        model = os.path.join(CONFIG_DIR, model + ".json")
    elif os.path.isdir(model):
        model = os.path.join(model, "config.json")
    if not os.path.isfile(model):
        raise FileNotFoundError(f"model {model!r} is neither a config.json, an HF directory with one, nor an "
                                f"alias ({', '.join(model_aliases())})")
    with open(model) as f:
        return json.load(f)


def load_model_spec(model: str) -> ModelSpec:
    c = load_config(model)
    name = os.path.basename(model).removesuffix(".json")
    arch = (c.get("architectures") or [""])[0]
    if "DeepseekV4" in arch:
        return _deepseek_v4(name, c)
    if c.get("kv_lora_rank"):
        return _deepseek_v3(name, c)
    return _llama_like(name, c)


def _precisions(c: dict) -> dict:
    dtype = _DTYPE_NAMES.get(c.get("torch_dtype") or c.get("dtype") or "bfloat16", "bf16")
    quant = (c.get("quantization_config") or {}).get("quant_method")
    weights = "fp8" if quant == "fp8" else dtype
    return dict(weight_precision=weights, expert_precision=c.get("expert_dtype", weights),
                kv_precision=c.get("kv_cache_dtype", dtype))


def _common(name: str, c: dict) -> dict:
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    return dict(name=name, num_layers=c["num_hidden_layers"], hidden_size=hidden, vocab_size=vocab,
                max_model_len=c.get("max_position_embeddings", 4096), lm_head_params=hidden * vocab, **_precisions(c))


def _moe_counts(c: dict, layers: int) -> tuple[int, int, int, int, int]:
    """(experts, k, params of one expert, MoE layers, dense MLP params of all layers incl. shared)."""
    hidden = c["hidden_size"]
    experts = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0
    if not experts:
        return 0, 0, 0, 0, layers * 3 * hidden * c["intermediate_size"]
    moe_inter = c["moe_intermediate_size"]
    dense_layers = c.get("first_k_dense_replace", 0) + len(c.get("mlp_only_layers", []))
    moe_layers = layers - dense_layers
    shared = c.get("n_shared_experts", 0) * 3 * hidden * moe_inter
    dense = dense_layers * 3 * hidden * c.get("intermediate_size", 0) + moe_layers * (shared + hidden * experts)
    return experts, c["num_experts_per_tok"], 3 * hidden * moe_inter, moe_layers, dense


def _llama_like(name: str, c: dict) -> ModelSpec:
    layers, hidden, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", heads)
    hd = c.get("head_dim") or hidden // heads
    attn = 2 * hidden * heads * hd + 2 * hidden * kv_heads * hd
    experts, k, expert, moe_layers, mlp = _moe_counts(c, layers)
    return ModelSpec(**_common(name, c), dense_params_per_token=layers * attn + mlp, num_experts=experts,
                     experts_per_token=k, expert_params=expert, num_moe_layers=moe_layers,
                     kv_entry_elems=2 * kv_heads * hd, num_kv_heads=kv_heads, attn_flops_per_key=4 * heads * hd,
                     attention=(AttentionKind(layers, c.get("sliding_window") if c.get("use_sliding_window", True)
                                              else None),))


def _deepseek_v3(name: str, c: dict) -> ModelSpec:
    layers, hidden, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
    lora, rope, nope, v = c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
    q_lora = c.get("q_lora_rank")
    q = hidden * q_lora + q_lora * heads * (nope + rope) if q_lora else hidden * heads * (nope + rope)
    attn = q + hidden * (lora + rope) + lora * heads * (nope + v) + heads * v * hidden
    experts, k, expert, moe_layers, mlp = _moe_counts(c, layers)
    # Absorbed MLA (how decode runs): every head scores the 576-wide latent and sums 512 of it.
    return ModelSpec(**_common(name, c), dense_params_per_token=layers * attn + mlp, num_experts=experts,
                     experts_per_token=k, expert_params=expert, num_moe_layers=moe_layers,
                     kv_entry_elems=lora + rope, num_kv_heads=1,
                     attn_flops_per_key=2 * heads * (lora + rope) + 2 * heads * lora,
                     attention=(AttentionKind(layers, None),))


def _deepseek_v4(name: str, c: dict) -> ModelSpec:
    layers, hidden, heads, hd = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    q_lora, groups, o_lora = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    rates = c.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    csa_m, hca_m = rates["compressed_sparse_attention"], rates["heavily_compressed_attention"]
    types = c.get("layer_types") or [{0: "sliding_attention", 4: "compressed_sparse_attention"}.get(
        r, "heavily_compressed_attention") for r in c.get("compress_ratios") or []]
    types = types[:layers]   # compress_ratios also lists the MTP block's (after the last layer)
    if not types:   # transformers' default schedule: two HCA layers, then HCA and CSA alternating
        types = ["heavily_compressed_attention"] * min(layers, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
            for i in range(max(layers - 2, 0))]
    csa, hca = types.count("compressed_sparse_attention"), types.count("heavily_compressed_attention")
    sliding = layers - csa - hca
    ih, idim = c["index_n_heads"], c["index_head_dim"]
    attn = (hidden * q_lora + q_lora * heads * hd + hidden * hd          # q_a, q_b, kv_proj
            + heads * hd * o_lora + groups * o_lora * hidden)            # grouped o_a, o_b
    compressors = csa * (hidden * 4 * hd + q_lora * ih * idim + hidden * ih + hidden * 4 * idim) + hca * hidden * 2 * hd
    experts, k, expert, moe_layers, mlp = _moe_counts(c, layers)
    # An MTP block: a sliding-window layer (its attention, shared expert, router) + e_proj and h_proj.
    shared = c.get("n_shared_experts", 0) * 3 * hidden * c["moe_intermediate_size"]
    mtp = attn + shared + hidden * experts + 2 * hidden * hidden if c.get("num_nextn_predict_layers") else 0
    window = c["sliding_window"]
    kinds = tuple(k for k in (AttentionKind(csa, window, csa_m, c["index_topk"], 2 * ih * idim, idim * 1.0,
                                            c.get("index_candidates")),
                              AttentionKind(hca, window, hca_m), AttentionKind(sliding, window)) if k.count)
    spec = ModelSpec(**_common(name, c), dense_params_per_token=layers * attn + compressors + mlp, num_experts=experts,
                     experts_per_token=k, expert_params=expert, num_moe_layers=moe_layers, kv_entry_elems=hd,
                     num_kv_heads=1,
                     attn_flops_per_key=4 * heads * hd, attention=kinds, kv_entry_bytes=c.get("kv_bytes_per_entry"),
                     mtp_dense_params=mtp)
    total = c.get("kv_bytes_per_token_total")
    if total:   # the seeds give the whole cache per token: scale the entry to match it
        spec = replace(spec, kv_entry_bytes=spec.entry_bytes * total / spec.kv_bytes_per_token())
    return spec
