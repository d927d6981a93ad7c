"""SimExecutor: the executor registered as "sim". It obeys the step contract exactly as the real
ones do (SchedulerOutput in, ModelRunnerOutput out, one per DP rank in lockstep) but runs no model:
it keeps each request's progress from the SchedulerOutputs, prices the step with a cost model, and
samples stand-in tokens (a hash of the request and position: distinct requests never share output
blocks). With speculative method "mtp" it is the drafter too: each request that samples gets k
draft tokens for its next step (ModelRunnerOutput.draft_token_ids), and a step that verifies drafts
keeps each while the ones before it were kept, with the acceptance rate (a hash of request and
position decides), then one token of its own, as vLLM's rejection sampler keeps them.
`last_step_seconds` is the virtual time the step took: its cost, times the device's measured
spread of served steps (a CPU's: a draw each step from `serve_step_spread`, times one every
`serve_slow_seconds` of steps from `serve_slow_spread`; hashed from the step's number and the time
stepped, so reruns agree); whoever drives the engine advances its clock by it.

It sizes the KV cache from --kv-cache-memory and the model's KV bytes per token, as a GPU worker
would. It must never sleep, read a clock nor import torch.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from hashlib import blake2b
from typing import Protocol

from rackserve.config import EngineConfig
from rackserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from rackserve.executor.base import Executor, register_executor
from rackserve.sim.cost import CostModel, ParallelShape, SeqWork, StepCost
from rackserve.sim.hardware import GIB, load_hardware
from rackserve.sim.model_spec import PRECISION_BYTES, ModelSpec, load_model_spec
from rackserve.sim.mtp import draft_seconds, mtp_block
from rackserve.sim.kv_store import SimStoreTransfer
from rackserve.sim.transfer import SimTransfer


class StepPricer(Protocol):
    def step(self, batches: list[list[SeqWork]]) -> StepCost: ...


@dataclass
class _ReqState:
    num_tokens: int             # prompt + outputs known so far
    num_computed: int


def kv_blocks_for(spec: ModelSpec, config: EngineConfig) -> int:
    """KV blocks one DP rank's devices hold in --kv-cache-memory GiB each."""
    if config.cache.num_gpu_blocks_override is not None:
        return config.cache.num_gpu_blocks_override
    tp = config.parallel.tensor_parallel_size
    context = min(spec.max_model_len, 1 << 17)    # windows and compression amortised at long context
    per_token = spec.kv_bytes_per_token(context) / min(tp, spec.num_kv_heads)
    return max(1, int(config.cache.kv_cache_memory_gib * GIB / (per_token * config.cache.block_size)))


@register_executor("sim")
class SimExecutor(Executor):
    def __init__(self, config: EngineConfig, pricer: StepPricer | None = None, spec: ModelSpec | None = None,
                 acceptance_rate: float = 0.0, transfer: "SimTransfer | SimStoreTransfer | None" = None):
        """Defaults (as the registry builds it): the model's config.json at config.model.model and
        this machine's `cpu` calibration. Speculative decoding (MTP: config.speculative with method
        "mtp" and k tokens) is an acceptance rate: the scheduler schedules the k drafts each request
        was sent (as far as its budget and blocks allow), the step prices them as rows of their
        own, and the k draft passes after a step (sim/mtp.py) are added to its time.
        `transfer`: the KV connector's worker half on virtual time, carrying out the orders of
        the engine's connector scheduler halves: P/D pulls over the link (sim/transfer.py), loads
        from and stores to a KV pool shared with other instances (sim/kv_store.py), or both."""
        p = config.parallel
        self.spec = spec or load_model_spec(config.model.model)
        self.pricer = pricer or CostModel(self.spec, load_hardware("cpu"),
                                          ParallelShape(p.tensor_parallel_size, p.data_parallel_size,
                                                        p.enable_expert_parallel), config.model.seed)
        spec_config = config.speculative
        if spec_config is not None and spec_config.method != "mtp":
            raise ValueError(f"the simulator drafts as MTP does, not with {spec_config.method!r}")
        self.num_speculative_tokens = spec_config.num_speculative_tokens if spec_config else 0
        self.drafts_tokens = self.num_speculative_tokens > 0
        self.acceptance_rate = acceptance_rate
        self.transfer = transfer
        self.model_max_len = self.spec.max_model_len
        self.vocab_size = self.spec.vocab_size
        self.num_kv_blocks = kv_blocks_for(self.spec, config)
        self._dp = p.data_parallel_size
        self._reqs: list[dict[str, _ReqState]] = [{} for _ in range(self._dp)]
        self.last_step_seconds = 0.0
        self.last_cost: StepCost | None = None
        hw = getattr(self.pricer, "hw", None)
        self._spread: tuple[float, ...] = tuple(getattr(hw, "serve_step_spread", ()))
        self._slow: tuple[float, ...] = tuple(getattr(hw, "serve_slow_spread", ()))
        self._slow_seconds: float = getattr(hw, "serve_slow_seconds", 0.0)
        self._stepped = 0.0      # virtual seconds of steps so far: the slow draw's clock
        self._steps, self._seed = 0, config.model.seed
        self._draft_block: CostModel | None = None      # the MTP block's cost model, built on first use

    @property
    def dp_num_kv_blocks(self) -> list[int]:
        return [self.num_kv_blocks] * self._dp

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self._dp == 1, "a data-parallel instance steps through execute_dp"
        return self.execute_dp([scheduler_output])[0]

    def execute_dp(self, scheduler_outputs: list[SchedulerOutput]) -> list[ModelRunnerOutput]:
        assert len(scheduler_outputs) == self._dp, "one SchedulerOutput per DP rank"
        batches = [self._batch(reqs, so) for reqs, so in zip(self._reqs, scheduler_outputs)]
        cost = self.pricer.step([[w for _, w, _ in batch if w.new_tokens] for batch in batches])
        self.last_cost, self.last_step_seconds = cost, (cost.seconds + self._drafts(batches)) * self._spread_draw()
        self._stepped += self.last_step_seconds
        connector = self._transfers(scheduler_outputs, batches)
        outputs = []
        for d, (reqs, batch, so) in enumerate(zip(self._reqs, batches, scheduler_outputs)):
            req_ids, sampled, drafts = [], [], []
            for req_id, work, n in batch:
                state = reqs[req_id]
                if work.samples:
                    tokens = self._verify(req_id, state.num_tokens, so.scheduled_spec_decode_tokens.get(req_id, []))
                    # The rejected drafts' KV is not the request's (the scheduler takes it back too).
                    state.num_computed += n - (work.drafts + 1 - len(tokens))
                    state.num_tokens += len(tokens)
                    req_ids.append(req_id)
                    sampled.append(tokens)
                    drafts.append([self._token(req_id, state.num_tokens + i)
                                   for i in range(self.num_speculative_tokens)])
                else:
                    state.num_computed += n
            busy = cost.ranks[d].busy_seconds if cost.ranks else None
            outputs.append(ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids), busy_seconds=busy,
                                             kv_connector_output=connector[d],
                                             draft_token_ids=drafts if self.drafts_tokens else None))
        return outputs

    def _drafts(self, batches: list) -> float:
        """The MTP draft passes after this step (sim/mtp.py): k passes over the sequences that sampled,
        on a cost model's device and shape; 0 without drafts, an MTP block or a cost model."""
        if not self.num_speculative_tokens or not isinstance(self.pricer, CostModel) \
                or not self.pricer.spec.mtp_dense_params:
            return 0.0
        if self._draft_block is None:
            self._draft_block = CostModel(mtp_block(self.pricer.spec), self.pricer.hw, self.pricer.shape)
        return draft_seconds(self.pricer, [[w for _, w, _ in batch if w.samples] for batch in batches],
                             self.num_speculative_tokens, self._draft_block)

    def _spread_draw(self) -> float:
        """This step's draw from each part of the spread, each quantile as likely (1 without one)."""
        self._steps += 1
        factor = 1.0
        if self._spread:
            factor *= self._spread[zlib.crc32(f"spread/{self._seed}/{self._steps}".encode()) % len(self._spread)]
        if self._slow and self._slow_seconds > 0:
            period = int(self._stepped // self._slow_seconds)
            factor *= self._slow[zlib.crc32(f"slow/{self._seed}/{period}".encode()) % len(self._slow)]
        return factor

    def _transfers(self, scheduler_outputs: list[SchedulerOutput], batches: list) -> list:
        """The connector workers' part of the step: start its orders, and report per DP rank what
        ended by the step's end (a step with nothing to compute lasts until the next transfer
        event, as the engine's empty steps poll while KV is on its way)."""
        if self.transfer is None:
            return [None] * self._dp
        now = self.transfer.clock()
        for d, so in enumerate(scheduler_outputs):
            self.transfer.start(d, so.kv_connector_metadata)
        if not any(w.new_tokens for batch in batches for _, w, _ in batch):
            self.last_step_seconds = self.transfer.next_event(now)
        return [self.transfer.finished(d, now + self.last_step_seconds) for d in range(self._dp)]

    def _batch(self, reqs: dict[str, _ReqState], so: SchedulerOutput) -> list[tuple[str, SeqWork, int]]:
        """(request, its priced work, tokens scheduled) for each scheduled request."""
        for req_id in so.finished_req_ids:
            reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            reqs[new.req_id] = _ReqState(len(new.prompt_token_ids) + len(new.output_token_ids),
                                         new.num_computed_tokens)
        for cached in so.scheduled_cached_reqs:
            reqs[cached.req_id].num_computed = cached.num_computed_tokens
        batch = []
        for req_id, n in so.num_scheduled_tokens.items():
            state = reqs[req_id]
            drafts = len(so.scheduled_spec_decode_tokens.get(req_id, ()))
            batch.append((req_id, SeqWork(n, state.num_computed, state.num_computed + n >= state.num_tokens,
                                          drafts), n))
        return batch

    def _verify(self, req_id: str, num_tokens: int, drafts: list[int]) -> list[int]:
        """The tokens a step keeps for a request that samples after `num_tokens` tokens: its drafts
        while each is accepted (with the acceptance rate, drawn from a hash of request and position,
        so reruns agree), then a token of its own (a rejected draft's position gets another token)."""
        kept = []
        for draft in drafts:
            key = f"accept/{self._seed}/{req_id}/{num_tokens + len(kept)}".encode()   # crc32's draws of
            u = int.from_bytes(blake2b(key, digest_size=8).digest(), "little") / 2**64  # neighbours correlate
            if u >= self.acceptance_rate:
                break
            kept.append(draft)
        token = self._token(req_id, num_tokens + len(kept))
        if len(kept) < len(drafts) and token == drafts[len(kept)]:
            token = (token + 1) % self.vocab_size
        return kept + [token]

    def _token(self, req_id: str, position: int) -> int:
        return zlib.crc32(f"{req_id}/{position}".encode()) % self.vocab_size

    def weight_bytes_per_device(self, tp: int, world: int, expert_parallel: bool) -> float:
        s = self.spec
        dense = (s.dense_params_per_token + 2 * s.lm_head_params) * s.weight_bytes / tp
        experts = s.num_moe_layers * s.num_experts * s.expert_params * PRECISION_BYTES[s.expert_precision]
        return dense + experts / (world if expert_parallel else tp)
