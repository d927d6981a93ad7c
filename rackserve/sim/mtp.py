"""The MTP drafter's time: after each decode step, DeepSeek's multi-token prediction drafts k tokens
by running an MTP block once per draft, one token a sequence, one pass after the other (each draft
feeds the next). A block is one sliding-window layer (DeepSeek-V4's compress_ratios list its ratio,
0, after the last layer's) with its routed and shared experts, e_proj and h_proj, and the shared LM
head for every sequence. cost.py prices the target step that verifies the drafts; this file prices
the k passes after it, each a step of its own (its launch and its layer's kernel floors included).
It must never schedule nor read a clock.
"""
from __future__ import annotations

import dataclasses

from rackserve.sim.cost import CostModel, SeqWork
from rackserve.sim.model_spec import AttentionKind, ModelSpec


def mtp_block(spec: ModelSpec) -> ModelSpec:
    """The model one draft pass runs: one layer, with the model's experts and LM head."""
    if not spec.mtp_dense_params:
        raise ValueError(f"{spec.name} has no MTP block")
    window = spec.attention[0].window if spec.attention else None
    return dataclasses.replace(spec, name=spec.name + "-mtp", num_layers=1,
                               num_moe_layers=1 if spec.num_experts else 0,
                               dense_params_per_token=spec.mtp_dense_params,
                               attention=(AttentionKind(1, window),), mtp_dense_params=0)


def draft_seconds(model: CostModel, batches: list[list[SeqWork]], passes: int, block: CostModel | None = None) -> float:
    """Seconds of `passes` draft passes after a step of `batches` (one per DP rank) on `model`'s
    device and shape; 0 without drafts or without an MTP block. `block`: the MTP block's cost model
    on that device and shape, when the caller keeps one from step to step."""
    if passes <= 0 or not model.spec.mtp_dense_params:
        return 0.0
    block = block or CostModel(mtp_block(model.spec), model.hw, model.shape)
    drafts = [[SeqWork(1, w.context + w.new_tokens) for w in batch] for batch in batches]
    return passes * block.step(drafts).seconds
