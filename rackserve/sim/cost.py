"""The per-step cost model: FLOPs and bytes of one engine step for the exact batch the scheduler
produced (each sequence's new tokens and the context before them), split by operation class
(dense linears, attention, routed experts, communication), and the step time on a device.

time(class) = max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)) (their sum on a
device whose compute and memory traffic do not overlap: the CPU); the attention class is three
kernels timed so apiece (the attention, the lightning indexer's scoring, its top-k: counted per
layer kind by attention_work.py) plus the floors of the kernels compressed layers add. A step is
the sum of its classes plus the device's fixed overheads (per step, per layer, per scheduled
sequence) and, where
the serving path shares the cores with the step (a CPU), its cost per step and per streamed
sequence.
Parallel shapes: tensor parallelism
splits linears and heads (two all-reduces per layer); expert parallelism spreads the routed
experts over all ranks of the instance (all-to-all dispatch and combine per MoE layer), each
rank's expert work counted from a simulated token-to-expert draw (a Zipf skew parameter), the
busiest rank setting the pace; data-parallel ranks step in lockstep, so a step lasts as long as
the slowest rank. This file owns that arithmetic; it must never schedule nor read a clock.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from rackserve.sim.attention_work import KindWork, extra_kernels, extra_kernels_per_step, kind_label, kind_work
from rackserve.sim.cpu_attention import decode_attention_imbalance
from rackserve.sim.efficiency import efficiency
from rackserve.sim.hardware import Hardware
from rackserve.sim.model_spec import PRECISION_BYTES, ModelSpec

PREFIX_CLASS = "prefix_attn_flops"   # a prompt chunk's attention over its cached prefix (a cpu calibration's)
ACT_BYTES = 2.0                 # bf16 activations on the wire (combine); dispatch is sent in fp8
DISPATCH_BYTES = 1.0


def packed_class(kernel: str | None) -> str:
    """The efficiency class of a packed-weight kernel's multiplies ("vnni_gemm_flops"): each kernel
    reaches its own fraction of the matmul peak, which a `cpu` calibration measures."""
    return f"{kernel or 'packed'}_gemm_flops"


class SeqWork(NamedTuple):
    """One scheduled sequence: `new_tokens` computed after `context` cached ones."""
    new_tokens: int
    context: int
    samples: bool = True        # whether it samples a token this step (its prompt is done)
    drafts: int = 0             # draft tokens among new_tokens, verified: each row samples too


@dataclass(frozen=True)
class ParallelShape:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    expert_skew: float = 0.0    # Zipf exponent of expert popularity (0: uniform routing)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


@dataclass
class OpCost:
    flops: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0


@dataclass
class RankCost:
    """One DP rank's (one TP group's, per device) share of a step."""
    dense: OpCost = field(default_factory=OpCost)
    attention: OpCost = field(default_factory=OpCost)
    moe: OpCost = field(default_factory=OpCost)
    comm_seconds: float = 0.0

    @property
    def busy_seconds(self) -> float:
        return self.dense.seconds + self.attention.seconds + self.moe.seconds


class StepCost(NamedTuple):
    seconds: float              # the step, as every DP rank sees it (lockstep)
    ranks: list[RankCost]


class CostModel:
    def __init__(self, spec: ModelSpec, hardware: Hardware, shape: ParallelShape = ParallelShape(), seed: int = 0):
        self.spec, self.hw, self.shape = spec, hardware, shape
        self.rng = np.random.default_rng(seed)
        e = spec.num_experts
        weights = np.arange(1, e + 1, dtype=float) ** -shape.expert_skew if e else np.zeros(0)
        self.expert_p = weights / weights.sum() if e else weights
        self.rng.shuffle(self.expert_p)   # popular experts land on any rank

    # -- op classes ---------------------------------------------------------------------------------
    def _time(self, op: OpCost, flops_class: str, precision: str, mem_class: str = "mem_bw") -> OpCost:
        eff = self.hw.efficiency
        compute = op.flops / self.hw.peak_flops(precision) / efficiency(flops_class, eff)
        memory = op.bytes / (self.hw.mem_bw * efficiency(mem_class, eff))
        op.seconds = max(compute, memory) if self.hw.overlap else compute + memory
        return op

    def _dense(self, batch: list[SeqWork]) -> OpCost:
        s, tp = self.spec, self.shape.tensor_parallel_size
        tokens = sum(w.new_tokens for w in batch)
        sampled = sum(1 + w.drafts for w in batch if w.samples)     # the LM head's rows
        wbytes = s.weight_bytes
        params = s.dense_params_per_token + (s.lm_head_params if sampled else 0)
        flops = 2 * s.dense_params_per_token * tokens + 2 * s.lm_head_params * sampled
        nbytes = params * wbytes
        flops_class = "gemm_flops"
        if s.dequantize_above_tokens is not None and tokens > s.dequantize_above_tokens:
            # Each packed linear is unpacked into a dense copy (written), which the GEMM then reads.
            nbytes += 2 * s.dense_params_per_token * PRECISION_BYTES[s.weight_precision]
        elif s.dequantize_above_tokens is not None and packed_class(s.packed_kernel) in self.hw.efficiency:
            # Up to the threshold the packed kernel the engine chose multiplies, at its own rate per
            # FLOP (calibrate.py measures it per kernel: vnni's int8 dot products, torch's int4).
            flops_class = packed_class(s.packed_kernel)
        return self._time(OpCost(flops / tp, nbytes / tp), flops_class, s.weight_precision)

    def _attention(self, batch: list[SeqWork]) -> OpCost:
        """The attention class: the attention, the indexer's scoring and its top-k, each a kernel
        with its own roofline (vLLM launches them apart), plus the floors of the kernels compressed
        layers add (attention_work.py)."""
        s = self.spec
        math_flops = kv_read = index_flops = index_read = topk_bytes = 0.0
        decodes = [w.context for w in batch if w.new_tokens == 1]
        longest_decode = max(decodes) if self.hw.pads_decodes and len(decodes) > 1 else 0
        # A CPU's native decode attention: its busiest thread sets the decodes' pace.
        imbalance = (decode_attention_imbalance([c + 1 for c in decodes], s.num_kv_heads, self.hw.decode_attn_threads,
                                                 isa=self.hw.decode_attn_isa)
                     if self.hw.decode_attn_threads and decodes else 1.0)
        # A prompt chunk's queries over its cached prefix, where a calibration measured their own rate
        # (a CPU's chunk after a long context runs below the causal part's: calibrate.py fits it).
        prefix = (efficiency("attn_flops", self.hw.efficiency) / self.hw.efficiency[PREFIX_CLASS]
                  if PREFIX_CLASS in self.hw.efficiency else 1.0)
        for w in batch:
            if w.new_tokens == 1 and longest_decode:   # padded to the longest decode, then masked
                w = SeqWork(1, longest_decode, w.samples)
            weight = imbalance if w.new_tokens == 1 else 1.0
            for kind in s.attention:
                work = kind_work(s, kind, w.new_tokens, w.context)
                math_flops += weight * work.math_flops
                if prefix != 1.0 and w.new_tokens > 1 and w.context:   # in attn_flops' units
                    math_flops += (prefix - 1.0) * (work.math_flops - kind_work(s, kind, w.new_tokens, 0).math_flops)
                kv_read += weight * work.kv_read
                index_flops += work.index_flops
                index_read += weight * work.index_read
                topk_bytes += work.topk_bytes
        longest = max(1, max((w.context for w in batch), default=1))
        kv_read += sum(w.new_tokens for w in batch) * s.kv_bytes_per_token(longest)   # KV written
        kernels = self._attention_kernels(KindWork(math_flops, kv_read, index_flops, index_read, topk_bytes))
        floors = self.hw.kernel_overhead * extra_kernels_per_step(s)
        return OpCost(sum(k.flops for k in kernels), sum(k.bytes for k in kernels),
                      sum(k.seconds for k in kernels) + floors)

    def _attention_kernels(self, t: KindWork) -> tuple[OpCost, OpCost, OpCost]:
        """The attention, the indexer's scoring and its top-k of `t`, each timed as a kernel of its own."""
        tp = self.shape.tensor_parallel_size
        kv_split = min(tp, self.spec.num_kv_heads)   # a single latent (MLA) is read whole by every TP rank
        # The lightning indexer scores in FP8 (DeepSeek-V3.2 paper, and vLLM's deepseek_v4 indexer).
        return (self._time(OpCost(t.math_flops / tp, t.kv_read / kv_split), "attn_flops", "bf16", "attn_mem_bw"),
                self._time(OpCost(t.index_flops / tp, t.index_read / kv_split), "attn_flops", "fp8", "attn_mem_bw"),
                self._time(OpCost(0.0, t.topk_bytes / tp), "attn_flops", "bf16", "attn_mem_bw"))

    def attention_by_kind(self, batch: list[SeqWork]) -> dict[str, dict[str, OpCost]]:
        """The attention class of one rank's batch split by layer kind and kernel, each part timed
        alone (a report's view: the step times each kernel over all kinds at once; paged decodes)."""
        s = self.spec
        parts = {}
        for kind in s.attention:
            works = [kind_work(s, kind, w.new_tokens, w.context) for w in batch]
            t = KindWork(*(sum(v) for v in zip(*works))) if works else KindWork(0.0, 0.0, 0.0, 0.0, 0.0)
            attention, scoring, topk = self._attention_kernels(t)
            parts[kind_label(kind)] = {
                "attention": attention, "indexer scoring": scoring, "indexer top-k": topk,
                "kernel floors": OpCost(seconds=kind.count * extra_kernels(kind) * self.hw.kernel_overhead)}
        return parts

    def _expert_loads(self, tokens: int) -> np.ndarray:
        """Tokens routed to each expert in one MoE layer, for `tokens` tokens (top-k distinct each,
        approximated by k independent draws)."""
        s = self.spec
        return self.rng.multinomial(tokens * s.experts_per_token, self.expert_p)

    def _moe(self, loads: np.ndarray, experts: slice, tp_split: int) -> OpCost:
        mine = loads[experts]
        return self._moe_of(int(mine.sum()), int((mine > 0).sum()), tp_split)

    def _moe_of(self, tokens: int, active: int, tp_split: int) -> OpCost:
        """The MoE class of `tokens` expert-token pairs on `active` experts holding any."""
        s = self.spec
        flops = 2 * s.expert_params * tokens * s.num_moe_layers
        read = s.expert_params * active * PRECISION_BYTES[s.expert_precision] * s.num_moe_layers
        return self._time(OpCost(flops / tp_split, read / tp_split), "moe_flops", s.expert_precision)

    @staticmethod
    def _per_device(loads: np.ndarray, devices: int, per_device: int) -> tuple[list[int], list[int]]:
        """Each device's expert-token pairs and experts with any, for `per_device` consecutive
        experts a device (the last ones may hold fewer): _moe's sums for all devices at once."""
        padded = np.zeros(devices * per_device, dtype=loads.dtype)
        padded[:len(loads)] = loads
        grid = padded.reshape(devices, per_device)
        return grid.sum(axis=1).tolist(), (grid > 0).sum(axis=1).tolist()

    # -- communication ------------------------------------------------------------------------------
    def _link(self, group: int) -> float:
        bw = self.hw.scale_up_bw if group <= self.hw.domain_size else self.hw.scale_out_bw
        return bw * efficiency("link_bw", self.hw.efficiency)

    def _all_reduce(self, tokens: int) -> float:
        tp = self.shape.tensor_parallel_size
        if tp == 1 or tokens == 0:
            return 0.0
        nbytes = tokens * self.spec.hidden_size * ACT_BYTES
        # Ring bandwidth term; latency of a tree / one-shot all-reduce (what NCCL and vLLM's custom
        # all-reduce use for the small messages of decode): log2(tp) rounds.
        per = 2 * (tp - 1) / tp * nbytes / self._link(tp) + math.ceil(math.log2(tp)) * self.hw.link_latency
        return 2 * self.spec.num_layers * per

    def _all_to_all(self, tokens: int) -> float:
        world = self.shape.world_size
        if world == 1 or not self.spec.num_experts or not self.shape.enable_expert_parallel:
            return 0.0
        remote = (world - 1) / world * tokens * self.spec.experts_per_token * self.spec.hidden_size
        per = remote * (DISPATCH_BYTES + ACT_BYTES) / self._link(world) + 2 * self.hw.link_latency
        return self.spec.num_moe_layers * per

    # -- a step -------------------------------------------------------------------------------------
    def step(self, batches: list[list[SeqWork]]) -> StepCost:
        """The step of every DP rank (batches[d] is DP rank d's batch; empty when idle)."""
        shape, s = self.shape, self.spec
        assert len(batches) == shape.data_parallel_size, "one batch per DP rank"
        tp = shape.tensor_parallel_size
        ranks = []
        tokens = [sum(w.new_tokens for w in b) for b in batches]
        for batch, n in zip(batches, tokens):
            rank = RankCost(self._dense(batch), self._attention(batch)) if batch else RankCost()
            rank.comm_seconds = self._all_reduce(n)
            ranks.append(rank)
        if s.num_experts and shape.enable_expert_parallel:
            # Experts over every device of the instance; each DP rank's devices hold tp of them.
            loads = self._expert_loads(sum(tokens))
            per_device = -(-s.num_experts // shape.world_size)
            a2a = self._all_to_all(max(tokens))
            pairs, active = self._per_device(loads, shape.world_size, per_device)
            for d, rank in enumerate(ranks):
                devices = [self._moe_of(pairs[r], active[r], 1) for r in range(d * tp, (d + 1) * tp)]
                rank.moe = max(devices, key=lambda c: c.seconds)
                rank.comm_seconds += a2a
        elif s.num_experts:
            for rank, n in zip(ranks, tokens):
                if n:
                    rank.moe = self._moe(self._expert_loads(n), slice(None), tp)
        if not any(tokens):
            return StepCost(0.0, ranks)
        # Lockstep: under EP every MoE layer waits for the slowest rank's attention and the
        # busiest rank's experts; without it the DP ranks still step together.
        if s.num_experts and shape.enable_expert_parallel:
            seconds = (max(r.dense.seconds + r.attention.seconds for r in ranks) + max(r.moe.seconds for r in ranks)
                       + max(r.comm_seconds for r in ranks))
        else:
            seconds = max(r.busy_seconds + r.comm_seconds for r in ranks)
        sequences = max(len(b) for b in batches)
        streamed = max(sum(1 for w in b if w.samples) for b in batches)
        fixed = self.hw.step_overhead + s.num_layers * self.hw.layer_overhead
        serving = self.hw.serve_step_overhead + streamed * self.hw.serve_seq_overhead
        decodes = all(w.new_tokens == 1 for b in batches for w in b)
        slowdown = (self.hw.serve_decode_slowdown * self.hw.decode_scale
                    if decodes and self.hw.serve_decode_slowdown is not None
                    else self.hw.serve_slowdown * (self.hw.decode_scale if decodes else 1.0))
        model = (seconds + fixed + sequences * self.hw.seq_overhead) * slowdown
        return StepCost(model + serving, ranks)
