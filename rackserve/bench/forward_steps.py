"""The machinery of `rackserve bench forward`: exact steps (ForwardPoint, RepeatedStep), what a
step must at least move and compute (ModelCost), the timing loop that alternates the sides of an
A/B (time_point), and the per-layer-kind profiler of an in-process model.

A step is a SchedulerOutput built here, not by a scheduler: its requests already hold
`context_len` computed tokens, their block tables cover context + new tokens, and the KV content
is whatever the cache holds (zeros), since attention costs the same for any values. Under data
parallelism the point's batch is the total, split over the DP ranks, each running its share
through `execute_dp` as the engine's DP ranks do. This file must never reach into a runner's
state (a step is repeated through the step contract alone; only the profiler hooks the
in-process model, and removes its hooks), and never imports torch at module level (the
`rackserve` command imports it before parsing).
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from rackserve.config import EngineConfig, ModelConfig
from rackserve.core.outputs import NewRequestData, SchedulerOutput
from rackserve.executor.base import Executor
from rackserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rackserve.distributed.parallel_state import CollectiveTimer

MIN_STEPS = 3           # timed steps per setting and point, however long a step takes
PROFILE_STEPS = 3       # extra steps with hooks, after (never among) the timed ones
KINDS = ("embedding", "attention", "mlp/moe", "norm", "lm_head+sampling", "other")
COMMUNICATION = "communication"     # a profile's extra kind when a CollectiveTimer is given


@dataclass(frozen=True)
class ForwardPoint:
    mode: str               # "prefill" | "decode"
    batch_size: int
    context_len: int        # tokens of each request already in the KV cache
    new_tokens: int         # tokens each request computes in the step (1 in decode mode)

    @property
    def kv_len(self) -> int:
        return self.context_len + self.new_tokens

    def num_blocks(self, block_size: int) -> int:
        return self.batch_size * -(-self.kv_len // block_size)


def dp_shares(batch_size: int, dp_size: int) -> list[range]:
    """The requests of each DP rank: contiguous and as even as they go (9 over 2: 5 and 4)."""
    sizes = [batch_size // dp_size + (r < batch_size % dp_size) for r in range(dp_size)]
    starts = [sum(sizes[:r]) for r in range(dp_size)]
    return [range(start, start + n) for start, n in zip(starts, sizes)]


class RepeatedStep:
    """One exact batch, sent as often as needed. Two copies of the step under two sets of request
    ids alternate, each retiring the other's requests through `finished_req_ids`, so every step
    starts from the same worker state and does the same work (a request re-sent as "cached"
    would have grown by its sampled token). Each request's prompt is context + new tokens and it
    samples one token, greedily, at its end: the step a decode (or a prefill ending a prompt) is.

    `shard=(dp_rank, dp_size)`: only that DP rank's share of the batch (`dp_shares`), with the
    very prompts the whole batch has, in block ids of its own cache; an empty step when the
    share is empty (that DP rank idles, as the engine's do)."""

    def __init__(self, point: ForwardPoint, block_size: int, vocab_size: int, seed: int,
                 shard: tuple[int, int] = (0, 1), group_block_sizes: tuple[int, ...] = ()):
        """`group_block_sizes`: tokens per block of each KV cache group of a model with several
        (each request then gets a table per group, whole: a bench step gives no block back)."""
        rng = random.Random(seed)
        # Low ids are where tokenizers keep their special tokens.
        prompts = [[rng.randrange(min(256, vocab_size - 1), vocab_size) for _ in range(point.kv_len)]
                   for _ in range(point.batch_size)]
        mine = dp_shares(point.batch_size, shard[1])[shard[0]]
        params = SamplingParams(temperature=0.0, max_tokens=1)
        tag = f"fwd-{point.mode}-b{point.batch_size}-c{point.context_len}-n{point.new_tokens}"
        self.copies: list[SchedulerOutput] = []
        for copy in range(2):
            ids = [f"{tag}-{copy}-{i}" for i in mine]
            other = {f"{tag}-{1 - copy}-{i}" for i in mine}
            reqs = [NewRequestData(rid, prompts[i], [], params, _tables(j, point.kv_len, block_size, group_block_sizes),
                                   point.context_len)
                    for j, (i, rid) in enumerate(zip(mine, ids))]
            self.copies.append(SchedulerOutput(reqs, [], {rid: point.new_tokens for rid in ids},
                                               len(mine) * point.new_tokens, finished_req_ids=other))
        self.sent = 0

    def next(self) -> SchedulerOutput:
        self.sent += 1
        return self.copies[(self.sent - 1) % 2]

    def retire(self) -> SchedulerOutput:
        """The empty step that drops the last copy's requests, as a finished batch would be."""
        last = self.copies[(self.sent - 1) % 2]
        return SchedulerOutput([], [], {}, 0, finished_req_ids=set(last.num_scheduled_tokens))


def group_block_sizes(kv_cache_config: Any) -> tuple[int, ...]:
    """Tokens per block of each KV cache group of a model with several; () for one."""
    return tuple(g.block_size for g in kv_cache_config.groups) if kv_cache_config else ()


def _tables(j: int, kv_len: int, block_size: int, group_block_sizes: tuple[int, ...]) -> list[int] | tuple[list[int], ...]:
    """Request j's block table(s): the j-th run of as many blocks as kv_len tokens fill, per group."""
    sizes = group_block_sizes or (block_size,)
    tables = tuple(list(range(j * -(-kv_len // s), (j + 1) * -(-kv_len // s))) for s in sizes)
    return tables if group_block_sizes else tables[0]


@dataclass(frozen=True)
class ModelCost:
    """What one step must at least move and compute, counted on a meta-device copy of the model
    (no memory, any executor). Routed experts are assumed chosen uniformly: a step of T tokens
    reads the expected share 1 - (1 - k/E)^T of them and computes k of E per token."""
    weight_bytes: int           # weights every step reads, routed experts aside (an untied embedding is only gathered)
    expert_bytes: int           # all routed experts of all layers
    linear_params: int          # dense Linear parameters: 2 FLOPs each per token
    expert_params: int          # routed experts: 2 FLOPs each per token, times k/E
    num_experts: int            # E (0: a dense model)
    experts_per_token: int      # k
    lm_head_params: int         # 2 FLOPs each per sampled row
    attn_flops_per_pair: int    # one query and one cached key, over every layer: q.k and p.v
    kv_bytes_per_token: int     # what every layer caches for one token

    def step_bytes(self, p: ForwardPoint) -> int:
        tokens = p.batch_size * p.new_tokens
        touched = 1 - (1 - self.experts_per_token / self.num_experts) ** tokens if self.num_experts else 0.0
        return round(self.weight_bytes + touched * self.expert_bytes + p.batch_size * p.kv_len * self.kv_bytes_per_token)

    def step_flops(self, p: ForwardPoint) -> int:
        tokens = p.batch_size * p.new_tokens
        active = self.expert_params * self.experts_per_token // self.num_experts if self.num_experts else 0
        # The causal span: the query at position x sees x + 1 keys.
        pairs = p.batch_size * (p.new_tokens * p.context_len + p.new_tokens * (p.new_tokens + 1) // 2)
        return (2 * (self.linear_params + active) * tokens + 2 * self.lm_head_params * p.batch_size
                + self.attn_flops_per_pair * pairs)


def model_cost(model_config: ModelConfig, kv_cache_dtype: str | None = None) -> ModelCost:
    """kv_cache_dtype: the cache's dtype name when it is not the model's."""
    import torch

    from rackserve.distributed.parallel_state import ParallelGroups
    from rackserve.model.layers import Linear, LMHead, VocabEmbedding
    from rackserve.model.loader import ModelInfo, read_hf_config
    from rackserve.model.models import get_model_class
    from rackserve.model.moe import FusedMoE
    if model_config.model.endswith(".gguf"):
        from rackserve.model.gguf_loader import gguf_config, open_gguf
        config = gguf_config(open_gguf(model_config.model))
    else:
        config = read_hf_config(model_config.model)
    dtype = getattr(torch, model_config.dtype)
    kv_dtype = getattr(torch, kv_cache_dtype or model_config.dtype)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)      # as the loader builds it: layers that insist on float32 keep it
    try:
        with torch.device("meta"):
            model = get_model_class(config["architectures"][0])(config, "torch", 1, ParallelGroups.single())
    finally:
        torch.set_default_dtype(default)

    def nbytes(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    heads = [m for m in model.modules() if isinstance(m, LMHead)]
    head_weights = {id(m.weight) for m in heads}
    gathered = [m.weight for m in model.modules() if isinstance(m, VocabEmbedding) and id(m.weight) not in head_weights]
    experts = [p for m in model.modules() if isinstance(m, FusedMoE) for p in m.parameters(recurse=False)]
    moe = next((m for m in model.modules() if isinstance(m, FusedMoE)), None)
    heads_n, layers = config["num_attention_heads"], config["num_hidden_layers"]
    if config.get("kv_lora_rank"):      # MLA, counted unabsorbed: q.k over nope + rope dims, p.v over v
        qk, v = config["qk_nope_head_dim"] + config["qk_rope_head_dim"], config["v_head_dim"]
    else:
        qk = v = config.get("head_dim") or config["hidden_size"] // heads_n
    return ModelCost(
        weight_bytes=nbytes(model.parameters()) - nbytes(gathered) - nbytes(experts)
        - _packed_savings(model_config, dtype.itemsize) - _bf16_savings(model_config, model, dtype),
        expert_bytes=nbytes(experts),
        linear_params=sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear)),
        expert_params=sum(p.numel() for p in experts),
        num_experts=moe.placement.num_experts if moe is not None else 0,
        experts_per_token=config.get("num_experts_per_tok", 0) if moe is not None else 0,
        lm_head_params=sum(m.weight.numel() for m in heads),
        attn_flops_per_pair=2 * layers * heads_n * (qk + v),
        kv_bytes_per_token=ModelInfo.from_config(config, kv_dtype).kv_cache_bytes_per_token)


def _packed_savings(model_config: ModelConfig, dense_itemsize: int) -> int:
    """Bytes a step does not read because --quantization gguf keeps weights packed: each packed
    tensor's dense size less its packed size (the lm_head reads a tied embedding's packed copy)."""
    if model_config.quantization != "gguf":
        return 0
    from rackserve.model.gguf_loader import hf_name, open_gguf
    from rackserve.model.quant.gguf_blocks import SUPPORTED, packed_nbytes
    from rackserve.model.quant.kernel_choice import resolve_quant_kernel
    kernel = resolve_quant_kernel(model_config.quant_kernel, "gguf", model_config.device, model_config.native_isa).name
    tensors = open_gguf(model_config.model).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    saved = 0
    for t in tensors:
        if t.name == "token_embd.weight" and not tied:
            continue            # an untied embedding is only gathered, and stays dense
        if t.tensor_type.name in SUPPORTED and len(t.shape) == 2 and hf_name(t.name) is not None:
            n = int(t.n_elements)
            saved += n * dense_itemsize - packed_nbytes(t.tensor_type.name, n, kernel)
    return saved


def _bf16_savings(model_config: ModelConfig, model, dtype) -> int:
    """Bytes a step does not read because a float32 model on CPU keeps a bf16 checkpoint's linear
    weights in bf16 (loader.keep_bf16_linears, over loader.bf16_candidates): 2 a weight, where the
    checkpoint holds bf16 tensors only (its headers say)."""
    import torch

    from rackserve.model.loader import bf16_candidates, safetensors_dtypes
    if model_config.device != "cpu" or dtype != torch.float32 or model_config.model.endswith(".gguf"):
        return 0
    if safetensors_dtypes(model_config.model) != {"BF16"}:
        return 0
    return 2 * sum(linear.weight.numel() for linear in bf16_candidates(model))


def _layer_kind(leaf: str, module) -> str | None:
    """A module's kind by its type (the shared layers) or its attribute name in the decoder layer."""
    from rackserve.model.layers import LMHead, RMSNorm, VocabEmbedding
    if isinstance(module, LMHead):
        return "lm_head+sampling"
    if isinstance(module, VocabEmbedding):
        return "embedding"
    if isinstance(module, RMSNorm):
        return "norm"
    if leaf in ("self_attn", "attn"):
        # Models with several attention kinds (DeepSeek-V4's sliding, CSA, HCA) name each one.
        kind = getattr(module, "kind", None)
        return f"attention[{kind}]" if isinstance(kind, str) else "attention"
    if leaf in ("mlp", "moe", "block_sparse_moe", "ffn"):
        return "mlp/moe"
    return None


class LayerKindProfiler:
    """Forward hooks on an in-process model that add up the wall time of each layer kind. The
    lm_head's time runs from its start to the end of the step, so it includes sampling; "other"
    is the rest (input preparation, attention metadata, rotary, residual adds). On CUDA every
    hook synchronizes, which slows the profiled steps: they are never the timed ones.

    With a `timer` (a rank's CollectiveTimer) the time inside collectives, waits for peers
    included, leaves the kind it happened in (attention's o_proj all-reduce, the MoE layer's
    all-to-alls, ...) for a kind of its own, "communication", as does the step's broadcast.

    With a `native` decoder (model/native_decode.py: a step of decodes in one native call, which
    no hook sees inside) its own per-op seconds go to the kinds (qkv_proj to o_proj: attention;
    gate_up_proj to down_proj: mlp/moe), and `native_seconds` keeps them per op."""

    def __init__(self, model, device: str, timer: CollectiveTimer | None = None, native: Any = None):
        import torch
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.timer = timer
        self.seconds = dict.fromkeys(KINDS + (COMMUNICATION,) * (timer is not None), 0.0)
        self._start = 0.0
        self._waited = 0.0      # the timer's seconds when the current kind started
        self.lm_head_start: float | None = None
        self._lm_head_waited = 0.0
        self.handles = []
        claimed: list[str] = []
        for name, module in model.named_modules():
            if any(name.startswith(c + ".") for c in claimed):
                continue    # inside a module already timed (a q/k norm inside attention)
            kind = _layer_kind(name.rsplit(".", 1)[-1], module)
            if kind is not None:
                claimed.append(name)
                self.seconds.setdefault(kind, 0.0)
                self.handles += [module.register_forward_pre_hook(self._pre(kind)),
                                 module.register_forward_hook(self._post(kind))]
        self.native = native
        if native is not None:
            from rackserve.model.native_decode import OPS
            native.profile(True)
            self.native_seconds = dict.fromkeys(OPS, 0.0)

    def _waited_now(self) -> float:
        return self.timer.seconds if self.timer is not None else 0.0

    def _pre(self, kind: str):
        def hook(module, args):
            self.sync()
            # Kinds never nest (see __init__), so one start time at a time is enough.
            self._start, self._waited = time.perf_counter(), self._waited_now()
            if kind == "lm_head+sampling":
                self.lm_head_start, self._lm_head_waited = self._start, self._waited
        return hook

    def _post(self, kind: str):
        def hook(module, args, output):
            if kind != "lm_head+sampling":
                self.sync()
                self.seconds[kind] += time.perf_counter() - self._start - (self._waited_now() - self._waited)
        return hook

    def step(self, execute, scheduler_output) -> None:
        """Run `execute(scheduler_output)` once, hooked. A step without logits (an idle DP rank's
        forward of zero tokens) has no lm_head time."""
        before = sum(self.seconds.values())
        self.lm_head_start = None
        waited, t0 = self._waited_now(), time.perf_counter()
        execute(scheduler_output)
        t1 = time.perf_counter()
        if self.native is not None:
            for op, seconds in zip(self.native_seconds, self.native.seconds):
                self.seconds[_NATIVE_KINDS[op]] += seconds - self.native_seconds[op]
                self.native_seconds[op] = seconds
        if self.lm_head_start is not None:
            self.seconds["lm_head+sampling"] += t1 - self.lm_head_start - (self._waited_now() - self._lm_head_waited)
        if self.timer is not None:
            self.seconds[COMMUNICATION] += self._waited_now() - waited
        self.seconds["other"] += (t1 - t0) - (sum(self.seconds.values()) - before)

    def shares(self) -> dict[str, float]:
        total = sum(self.seconds.values())
        return {k: v / total for k, v in self.seconds.items()}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        if self.native is not None:
            self.native.profile(False)


# The kind of each op of the native decode step (model/native_decode.OPS), as the hooks count it.
_NATIVE_KINDS = {"norm": "norm", "qkv_proj": "attention", "rope+kv_write": "attention", "attention": "attention",
                 "o_proj": "attention", "gate_up_proj": "mlp/moe", "silu_and_mul": "mlp/moe", "down_proj": "mlp/moe"}


class Side(NamedTuple):
    """One executor under test and the config it was built from."""
    executor: Executor
    config: EngineConfig


@dataclass
class Timing:
    warmup_steps: int
    step_s: list[float] = field(default_factory=list)
    tokens_timed: int = 0       # total_num_scheduled_tokens summed over the timed SchedulerOutputs
    tokens_sampled: int = 0     # tokens the timed steps returned
    profile: dict[str, float] | None = None
    native_profile: dict[str, float] | None = None      # shares of the step per native op, where one ran

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def tok_s(self) -> float:
        return self.tokens_timed / len(self.step_s) / self.median_s

    def summary(self) -> dict:
        deciles = statistics.quantiles(self.step_s, n=10, method="inclusive")
        return {"steps": len(self.step_s), "warmup_steps": self.warmup_steps, "tokens_timed": self.tokens_timed,
                "tokens_sampled": self.tokens_sampled, "median_s": self.median_s, "p10_s": deciles[0],
                "p90_s": deciles[-1], "min_s": min(self.step_s), "max_s": max(self.step_s), "tok_s": self.tok_s,
                "profile": self.profile, "native_profile": self.native_profile, "step_s": self.step_s}


def _in_process_model(executor):
    from rackserve.executor.uniproc import UniProcExecutor
    return executor.model if isinstance(executor, UniProcExecutor) else None


def _use_native_build(side: Side) -> None:
    """In-process sides share one process-wide build of the native ops (native_ops.use_isa): each
    side's steps run on its own --native-isa."""
    if side.config.model.device == "cpu" and _in_process_model(side.executor) is not None:
        from rackserve.model import native_ops
        native_ops.use_isa(side.config.model.native_isa)


def _in_process_native_decoder(executor):
    from rackserve.executor.uniproc import UniProcExecutor
    return executor.runner.native_decoder if isinstance(executor, UniProcExecutor) else None


def time_point(sides: list[Side], point: ForwardPoint, seconds: float, warmup_steps: int,
               seed: int, profile: bool = False) -> list[Timing]:
    """Warm-up, then the settings' steps alternate (A, B, A, B, ...) until each has run
    `seconds` and at least MIN_STEPS times, so drift hits all of them alike. With `profile`,
    PROFILE_STEPS more steps per setting run with hooks (None where the runner is elsewhere)."""
    # One RepeatedStep per DP rank of each side: the point's batch is the total over them.
    steps = [[RepeatedStep(point, s.config.cache.block_size, s.executor.vocab_size, seed, (r, dp),
                           group_block_sizes(s.executor.kv_cache_config))
              for r in range(dp)] for s in sides for dp in [len(s.executor.dp_num_kv_blocks)]]
    timings = [Timing(warmup_steps) for _ in sides]
    for _ in range(warmup_steps):
        for s, ranks in zip(sides, steps):
            _use_native_build(s)
            s.executor.execute_dp([rs.next() for rs in ranks])
    while len(timings[0].step_s) < MIN_STEPS or min(sum(t.step_s) for t in timings) < seconds:
        for s, ranks, t in zip(sides, steps, timings):
            sos = [rs.next() for rs in ranks]
            _use_native_build(s)
            t0 = time.perf_counter()
            outs = s.executor.execute_dp(sos)
            t.step_s.append(time.perf_counter() - t0)
            for so, out in zip(sos, outs, strict=True):
                assert out.req_ids == list(so.num_scheduled_tokens), "every request ends its prompt and samples once"
                t.tokens_timed += so.total_num_scheduled_tokens
                t.tokens_sampled += sum(len(tokens) for tokens in out.sampled_token_ids)
    if profile:
        for s, ranks, t in zip(sides, steps, timings):
            model = _in_process_model(s.executor)
            if model is None:
                continue
            profiler = LayerKindProfiler(model, s.config.model.device, native=_in_process_native_decoder(s.executor))
            _use_native_build(s)
            try:
                for _ in range(PROFILE_STEPS):
                    profiler.step(s.executor.execute, ranks[0].next())
            finally:
                profiler.remove()
            t.profile = profiler.shares()
            if profiler.native is not None and any(profiler.native_seconds.values()):
                total = sum(profiler.seconds.values())
                t.native_profile = {op: v / total for op, v in profiler.native_seconds.items()}
    for s, ranks in zip(sides, steps):
        s.executor.execute_dp([rs.retire() for rs in ranks])
    return timings
