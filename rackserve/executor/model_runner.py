"""ModelRunner: turns one SchedulerOutput into one forward pass and one sampled token per request
whose KV has caught up with all its tokens.

Speculative decoding: a request scheduled with draft tokens (SchedulerOutput.scheduled_spec_decode_tokens)
computes its last token and the drafts as that many decode rows, and samples at each of their positions as
it would have one step at a time (each position's own seed); it keeps the drafts up to the first
one that differs from what it sampled there, plus the token sampled at that position (or after the
last draft). Its outputs are then those of decoding without drafts, in distribution and, seeded,
token for token, up to the logits' rounding between a chunk and single steps.

It owns the worker-side request state (tokens, block table, generator, penalty row), the KV cache
tensors and the step's input tensors and attention metadata, built once per step. It must never decide what
runs (the scheduler does) and never keeps a request the scheduler told it to drop.

Under tensor parallelism there is one runner per rank, each with its slice of the model and the
KV cache of its heads, all fed the same SchedulerOutput. All of them sample, and sample the same
tokens (the logits are all-gathered and the generators seeded alike), so no rank needs another's
tokens for its next step. Under data parallelism each DP rank's runners get their own DP rank's
SchedulerOutput; with experts shared across DP ranks an idle DP rank still runs a forward pass of
zero tokens, so that its peers' collectives match.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rackserve.config import EngineConfig
from rackserve.core.kv_cache_groups import KVCacheConfig
from rackserve.core.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, SchedulerOutput
from rackserve.distributed.parallel_state import ParallelGroups
from rackserve.executor.kv_groups import allocate_kv_cache_groups
from rackserve.kv_transfer.base import TPTransferReports, create_kv_connector_worker
from rackserve.model.attention import (CommonAttentionMetadata, Workspace, bind_kv_cache, get_attn_backend,
                                      model_kv_cache_spec)
from rackserve.model.compiled_layers import compile_decoder
from rackserve.model.loader import load_model
from rackserve.model.moe import FusedMoE, take_expert_token_counts
from rackserve.model.native_decode import native_decoder
from rackserve.model.penalties import PenaltyRows, has_penalties
from rackserve.model.sampler import Sampler, SamplingRow, sample_isolating_failures
from rackserve.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None   # the request's own, when it has a seed
    block_ids: list[list[int]]          # one block table per KV cache group
    num_computed_tokens: int
    num_hit_blocks: tuple[int, ...] = ()   # per group, leading blocks from the prefix cache (never written)
    penalty_row: int | None = None         # its row in the runner's PenaltyRows, once it samples with penalties

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs, without concatenating the two."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]


@dataclass
class StepInputs:
    input_ids: torch.Tensor             # [T]
    positions: torch.Tensor             # [T]
    attn_metadata: object               # the backend's own, built once per step
    logits_indices: torch.Tensor        # [R] batch rows whose logits are sampled
    sampling_states: list[CachedRequestState]
    drafts: list[list[int]]             # per sampling state, the draft tokens it computed (rows 1.. of its logits)


class ModelRunner:
    def __init__(self, config: EngineConfig, attn_backend: str = "torch", groups: ParallelGroups | None = None):
        """`groups`: this rank's process groups (a single process when None)."""
        self.config = config
        self.groups = groups or ParallelGroups.single()
        self.device = torch.device(config.model.device)
        self.block_size = config.cache.block_size
        self.model, self.model_info = load_model(config.model, attn_backend, self.groups)
        info = self.model_info
        # What each layer caches on this rank: its share of the KV heads, or MLA's whole latent.
        self.kv_cache_spec = spec = model_kv_cache_spec(self.model)
        self.attn_backend = get_attn_backend(attn_backend, use_mla=spec.use_mla, family=spec.family)
        self.workspace = Workspace()
        self.kv_cache_dtype = kv_cache_dtype(config)
        # A model with several kinds of cache (DeepSeek-V4) has groups, one tensor each (kv_groups.py).
        self.kv_cache_config: KVCacheConfig | None = None
        if hasattr(self.model, "kv_cache_groups"):
            self.kv_cache_config, self.kv_cache = allocate_kv_cache_groups(self.model, config, self.kv_cache_dtype,
                                                                           self.groups.tp)
            # What the scheduler's capacity check reads: the scarcest compressed group, in blocks.
            self.num_kv_blocks = min(g.num_blocks * g.block_size for g in self.kv_cache_config.groups[1:]) \
                // self.block_size
        else:
            # A DP rank's ranks must index the same blocks: the one with the least room sets the count
            # (other DP ranks have caches, and counts, of their own).
            self.num_kv_blocks = self.groups.tp.min(self._num_kv_blocks())
            # [layers, K and V (or the one latent), blocks, block_size, kv heads, head size]. Zeroed, not
            # empty: padded decode rows read stale slots under a mask, and 0 * NaN from uninitialised
            # memory would still poison the output.
            shape = (info.num_layers, spec.num_tensors, *spec.cache_shape(self.num_kv_blocks, self.block_size))
            self.kv_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
            bind_kv_cache(self.model, [tuple(layer_cache) for layer_cache in self.kv_cache])
        # The ranks of a DP rank sample alike; DP ranks must not draw one stream for their requests.
        self.sampler = Sampler(config.model.seed + self.groups.dp.rank_in_group, self.device)
        self.requests: dict[str, CachedRequestState] = {}
        # What penalties read of each penalised request's tokens, kept across steps (model/penalties.py);
        # filled when a request first samples (the logits give the vocabulary), so _unfilled.
        self.penalties = PenaltyRows(self.device)
        self._unfilled: set[str] = set()
        self.moe_layers = [m for m in self.model.modules() if isinstance(m, FusedMoE)]
        # A forward that meets ranks of other DP ranks in collectives (experts sharded across DP
        # ranks) must run even with no tokens, or the peers' collectives would never match.
        self.forward_when_idle = self.groups.ep.world_size > self.groups.tp.world_size
        # Moves this rank's KV shard to and from peers (kv_transfer/); None without --kv-transfer-config.
        self.kv_connector = create_kv_connector_worker(config, self.kv_cache, self.groups.tp.rank_in_group,
                                                       self.groups.dp.rank_in_group)
        self.transfer_reports = TPTransferReports(self.groups.tp.world_size)
        # Last, so that a background compile never races the KV cache's allocation.
        self.compiled = compile_decoder(self.model, config.compilation, self.device)
        # Steps of decodes in one native call (model/native_decode.py), unless compiled graphs run them.
        self.native_decoder = native_decoder(self.model) if self.compiled is None else None

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        info = self.model_info
        block_bytes = info.num_layers * self.kv_cache_spec.bytes_per_token(self.kv_cache_dtype) * self.block_size
        num_blocks = int(cache.kv_cache_memory_gib * 2**30) // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={cache.kv_cache_memory_gib} GiB holds no block of {block_bytes} bytes")
        return num_blocks

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.kv_connector is None:
            return self._execute_model(scheduler_output)
        # Loads run in the connector's threads, into blocks no scheduled request touches.
        self.kv_connector.start_load_kv(scheduler_output.kv_connector_metadata)
        output = self._execute_model(scheduler_output)
        self.kv_connector.save_kv(scheduler_output.kv_connector_metadata)
        transfers = self.kv_connector.get_finished()
        if self.groups.tp.world_size > 1:   # a transfer ends when every rank moved its shard
            parts = self.groups.tp.gather_object(transfers)
            if parts is None:
                return output   # not the first rank: the engine reads only the first rank's output
            transfers = self.transfer_reports.combine(parts)
        if transfers.is_empty:
            return output
        return dataclasses.replace(output, kv_connector_output=transfers)

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty and not self.forward_when_idle:
            return EMPTY_MODEL_RUNNER_OUTPUT
        inputs = self._prepare_inputs(scheduler_output)
        hidden = None if self.compiled is None else self.compiled.forward(inputs.input_ids, inputs.positions,
                                                                         inputs.attn_metadata)
        if hidden is None and self.native_decoder is not None:
            hidden = self.native_decoder.forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        if hidden is None:   # eager: no compile, a step too large, or its size still compiling
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        expert_counts = take_expert_token_counts(self.moe_layers)
        if not inputs.sampling_states:
            return ModelRunnerOutput([], [], [], expert_token_counts=expert_counts)
        logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()
        states, drafts = inputs.sampling_states, inputs.drafts
        unfilled = self._fill_penalty_rows(states, logits.shape[1]) if self._unfilled else {}
        firsts: list[int] = []      # each state's first row of logits; its drafts' rows follow it
        rows: list[SamplingRow] = []
        for state, spec in zip(states, drafts):
            firsts.append(len(rows))
            seed, position = state.sampling_params.seed, len(state.output_token_ids)
            if state.generator is not None:
                # Seeded per output position, so a request resumed after preemption (with a
                # fresh generator) draws exactly what it would have drawn.
                state.generator.manual_seed(_position_seed(seed, position))
            rows.append(SamplingRow(state.sampling_params, state.generator, state.penalty_row))
            for j in range(1, len(spec) + 1):   # never penalised (the scheduler drafts for none)
                rows.append(SamplingRow(state.sampling_params, None if seed is None else
                                        torch.Generator(self.device).manual_seed(_position_seed(seed, position + j))))
        sampled, failed_rows = sample_isolating_failures(self.sampler, logits, rows, self.penalties,
                                                         {firsts[i]: reason for i, reason in unfilled.items()})
        req_ids: list[str] = []
        token_ids: list[list[int]] = []
        logprobs: list[list | None] = []
        failed: dict[str, str] = {}
        penalty_rows: list[int] = []
        penalty_tokens: list[int] = []
        for state, first, spec in zip(states, firsts, drafts):
            reason = next((failed_rows[r] for r in range(first, first + len(spec) + 1) if r in failed_rows), None)
            if reason is not None:   # a failed request is ended by the scheduler, then dropped here
                failed[state.req_id] = reason
                continue
            kept = 0    # drafts equal to what was sampled at their positions
            while kept < len(spec) and sampled.token_ids[first + kept] == spec[kept]:
                kept += 1
            new = sampled.token_ids[first:first + kept + 1]
            state.output_token_ids += new
            if state.penalty_row is not None:
                penalty_rows.append(state.penalty_row)
                penalty_tokens += new
            req_ids.append(state.req_id)
            token_ids.append(new)
            logprobs.append(None if sampled.logprobs[first] is None else sampled.logprobs[first:first + kept + 1])
        self.penalties.append(penalty_rows, penalty_tokens)
        return ModelRunnerOutput(req_ids, token_ids, logprobs, expert_token_counts=expert_counts, failed=failed)

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self._drop(req_id)
        for new in so.scheduled_new_reqs:
            self._drop(new.req_id)   # resumed after preemption: rebuilt from what the scheduler sends
            params = new.sampling_params
            if has_penalties(params):
                self._unfilled.add(new.req_id)
            generator = None if params.seed is None else torch.Generator(self.device)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids), list(new.output_token_ids), params, generator,
                [list(ids) for ids in new.block_ids], new.num_computed_tokens, new.num_hit_blocks)
        for cached in so.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            for table, ids in zip(state.block_ids, cached.new_block_ids, strict=True):
                table.extend(ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _drop(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        self._unfilled.discard(req_id)
        if state is not None and state.penalty_row is not None:
            self.penalties.free(state.penalty_row)

    def _fill_penalty_rows(self, states: list[CachedRequestState], vocab: int) -> dict[int, str]:
        """Penalty rows for the penalised requests sampling for the first time (this is when their
        prompt is read, once); {index in states: reason} for those whose tokens cannot have one."""
        arriving = [i for i, s in enumerate(states) if s.req_id in self._unfilled]
        self.penalties.reserve(len(arriving), vocab)
        failed = {}
        for i in arriving:
            state = states[i]
            self._unfilled.discard(state.req_id)
            try:
                state.penalty_row = self.penalties.add(state.prompt_token_ids, state.output_token_ids, vocab)
            except ValueError as e:   # that request fails, not the step
                failed[i] = str(e)
        return failed

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        group_tables: list[tuple[list[int], ...]] = []
        hit_blocks: list[tuple[int, ...]] = []
        logits_indices: list[int] = []
        sampling_states: list[CachedRequestState] = []
        drafts: list[list[int]] = []
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            spec = so.scheduled_spec_decode_tokens.get(req_id, [])
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            assert n > 0 and end - len(spec) <= state.num_tokens, \
                f"{req_id}: scheduled [{start}, {end}) of {state.num_tokens} tokens + {len(spec)} drafts"
            assert not spec or end - len(spec) == state.num_tokens, f"{req_id}: drafts follow its last token"
            table = state.block_ids[0]
            assert len(table) * bs >= end, f"{req_id}: {len(table)} blocks cannot hold {end} tokens"
            input_ids += state.token_ids(start, end - len(spec))
            input_ids += spec
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if spec:
                # The last token and its drafts as decode rows, row j over the first start + j + 1
                # positions: a chunk's causal mask (every backend writes a step's KV before it
                # attends), and the step stays one the native decode step takes.
                query_lens += [1] * n
                context_lens += range(start, end)
                block_tables += [table] * n
            else:
                query_lens.append(n)
                context_lens.append(start)
                block_tables.append(table)
            if self.kv_cache_config is not None:
                group_tables.append(tuple(state.block_ids))
                hit_blocks.append(state.num_hit_blocks)
            if end - len(spec) == state.num_tokens:
                logits_indices += range(len(input_ids) - 1 - len(spec), len(input_ids))
                sampling_states.append(state)
                drafts.append(spec)
        assert len(input_ids) == so.total_num_scheduled_tokens, "total_num_scheduled_tokens disagrees with the dict"

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        common = CommonAttentionMetadata(query_lens, context_lens, block_tables, tensor(slots), bs, self.workspace)
        if self.kv_cache_config is not None:
            common.group_block_tables, common.num_hit_blocks = group_tables, hit_blocks
        return StepInputs(tensor(input_ids), tensor(positions), self.attn_backend.build_metadata(common, self.device),
                          tensor(logits_indices), sampling_states, drafts)


def kv_cache_dtype(config: EngineConfig) -> torch.dtype:
    """The KV cache's dtype: --kv-cache-dtype, or the model's."""
    return getattr(torch, config.cache.cache_dtype or config.model.dtype)


def _position_seed(seed: int, position: int) -> int:
    """A distinct 64-bit seed for each (request seed, output position)."""
    return (seed * 0x9E3779B97F4A7C15 + position) % 2**64
