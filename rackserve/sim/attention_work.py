"""What one sequence's step asks of one kind of attention layer, kernel by kernel: the attention
math and the KV it reads, the lightning indexer's FP8 scoring and the index keys it reads, and the
indexer's top-k over those scores; and the kernels a compressed layer launches beyond every
layer's own.

DeepSeek-V4's structure (reference/deepseek-v4.md; transformers' modeling_deepseek_v4): a CSA layer
compresses 4 tokens into one entry, its indexer scores the entries in FP8 (64 heads x 128) and keeps
the top 512 for the attention; an HCA layer compresses 128 tokens into one entry and attends all of
them; every layer also attends a 128-token window. vLLM runs the indexer as kernels of its own
(DeepGEMM's fp8 MQA logits write one fp32 score per query and entry, a top-k kernel reads them
back, then the sparse attention gathers the kept entries), so cost.py times each as its own kernel.
This file owns those counts; it must never time anything (cost.py does) nor import torch.
"""
from __future__ import annotations

from typing import NamedTuple

from rackserve.sim.model_spec import AttentionKind, ModelSpec

SCORE_BYTES = 4.0   # one fp32 logit per (query token, scored entry): written by the scorer, read by the top-k
# Kernels a compressed layer launches in a step beyond the ~10 every layer does (hardware.py's
# layer_overhead), counted from the modules transformers' DeepseekV4 runs for it: a compressor is
# its kv and gate projections and the pooling (softmax over the window's slots, norm, RoPE and the
# cache write, fused) = 3; the lightning indexer is its query projection (wq_b), its head weights
# (weights_proj), a compressor of its own (3), the scoring and the top-k = 7.
COMPRESSOR_KERNELS = 3
INDEXER_KERNELS = 7


class KindWork(NamedTuple):
    """One sequence's step in all `count` layers of one kind (FLOPs and bytes)."""
    math_flops: float       # q.k and p.v over the keys each query sees (bf16)
    kv_read: float          # entries the attention reads: the window and the (kept) compressed ones
    index_flops: float      # the indexer's scoring, in FP8
    index_read: float       # the index keys it scores
    topk_bytes: float       # the scores written, then read by the top-k


def kind_work(spec: ModelSpec, kind: AttentionKind, new_tokens: int, context: int) -> KindWork:
    """`new_tokens` queries after `context` cached tokens. Causal: the queries see on average the
    keys at their middle position; the step reads what the last one sees once per sequence."""
    mid, end = context + (new_tokens + 1) / 2, context + new_tokens
    scored = kind.count * new_tokens * kind.index_entries(mid)
    return KindWork(kind.count * new_tokens * kind.keys(mid) * spec.attn_flops_per_key,
                    kind.count * kind.keys(end) * spec.entry_bytes,
                    scored * kind.index_flops_per_entry,
                    kind.count * kind.index_entries(end) * kind.index_bytes_per_entry,
                    scored * 2 * SCORE_BYTES)


def kind_label(kind: AttentionKind) -> str:
    if kind.index_flops_per_entry:
        return f"CSA ({kind.count} layers: 1 entry per {kind.compress} tokens, top-{kind.topk})"
    if kind.compress:
        return f"HCA ({kind.count} layers: 1 entry per {kind.compress} tokens, all)"
    return f"{'sliding' if kind.window else 'full'} ({kind.count} layers)"


def extra_kernels(kind: AttentionKind) -> int:
    """Kernels one layer of this kind launches beyond every layer's own."""
    return (COMPRESSOR_KERNELS if kind.compress else 0) + (INDEXER_KERNELS if kind.index_flops_per_entry else 0)


def extra_kernels_per_step(spec: ModelSpec) -> int:
    """Kernels all compressed layers of the model add to a step."""
    return sum(kind.count * extra_kernels(kind) for kind in spec.attention)
