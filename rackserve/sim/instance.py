"""SimSetup: one simulated deployment (model, hardware, parallel shape, engine limits, instances
and routing) built from `rackserve sim`'s flags, and one run of it at one concurrency level:
fresh instances, bench's Replay through a SimClient, all on a virtual-time loop.

This file owns the EngineConfig of a simulated instance (no checkpoint, no torch: the config.json
is the model) and the run's "sim" record. It must never compute a metric nor price a step.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from dataclasses import dataclass
from hashlib import blake2b
from typing import Callable

from rackserve.config import (CacheConfig, EngineConfig, KVEventsConfig, ModelConfig, ParallelConfig,
                              SchedulerConfig, SpeculativeConfig)
from rackserve.engine.core import EngineCore
from rackserve.sim.chat_template import TemplateTokens, marker_ids, template_for
from rackserve.sim.cost import CostModel, ParallelShape
from rackserve.sim.executor import SimExecutor, kv_blocks_for
from rackserve.sim.hardware import GIB, Hardware
from rackserve.sim.kv_pool import KVPool
from rackserve.sim.model_spec import ModelSpec, load_model_spec
from rackserve.sim.kv_store import SimMultiTransfer, SimStore, SimStoreTransfer, with_store
from rackserve.sim.transfer import SimFabric, SimTransfer, pd_instance
from rackserve.sim.virtual_loop import run_virtual


def run_id(seed: int, concurrency: int) -> str:
    """The run's name in every play marker, shaped as bench serve's (8 hex digits, then c and the
    level: serve_bench.py's nonce is random, this one follows the seed), so markers are as long."""
    return f"{blake2b(f'sim{seed}'.encode(), digest_size=4).hexdigest()}c{concurrency}"


@dataclass
class SimSetup:
    spec: ModelSpec
    hardware: Hardware
    config: EngineConfig
    shape: ParallelShape
    instances: int
    router_policy: str
    acceptance_rate: float = 0.0
    prefill: "SimSetup | None" = None    # P/D: the prefill pool; this setup is then the decode pool
    pd_role: str | None = None           # P/D: kv_producer (the prefill pool) or kv_consumer (the decode pool)
    dp_placement: str = "router"         # the router's pick, the engine's least_load, or least_uncached
    kv_pool_gib: float = 0.0             # a KV pool shared by all instances (0: none)
    kv_pool_bandwidth: float = 0.0       # bytes/s an instance loads from it
    # Builds each instance's executor (setup, seed, pool) in place of the priced one: a step trace
    # (bench/step_trace.py) runs the real model with the virtual clock driven by its step times.
    executor_factory: "Callable[[SimSetup, int], SimExecutor] | None" = None
    template: TemplateTokens = TemplateTokens()     # the chat template's tokens around each prompt's words
    tokenizer: str | None = None                    # whose tokens bench's play marker takes (marker_ids)

    @classmethod
    def from_args(cls, args: argparse.Namespace, hardware: Hardware, as_measured: dict | None = None) -> "SimSetup":
        """`as_measured`: a `cpu` calibration's record of how the model ran (its precision and packed
        weights; --quantization chose the calibration then)."""
        spec = load_model_spec(args.model)
        if as_measured is not None or hardware.name == "cpu":
            from rackserve.sim.calibrate import calibrated_spec
            spec = calibrated_spec(spec, as_measured or {}).with_precision(kv=args.kv_cache_dtype)
        else:
            spec = spec.with_precision(args.quantization, args.kv_cache_dtype)
        tp, dp = args.tensor_parallel_size, args.data_parallel_size
        if tp < 1 or dp < 1:
            raise ValueError("parallel sizes must be >= 1")
        max_len = args.max_model_len or spec.max_model_len
        if max_len > spec.max_model_len:
            raise ValueError(f"max_model_len={max_len} exceeds the model's {spec.max_model_len}")
        spec = dataclasses.replace(spec, max_model_len=max_len)
        config = EngineConfig(
            ModelConfig(model=args.model, served_model_name=args.model, tokenizer=args.model, dtype="bfloat16",
                        device="sim", max_model_len=max_len, seed=args.seed),
            CacheConfig(args.block_size, args.kv_cache_memory, args.enable_prefix_caching,
                        args.num_gpu_blocks_override),
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, args.long_prefill_token_threshold,
                            args.max_waiting_tokens),
            ParallelConfig(tp, data_parallel_size=dp, enable_expert_parallel=args.enable_expert_parallel))
        if args.num_speculative_tokens < 0 or not 0 <= args.acceptance_rate <= 1:
            raise ValueError("--num-speculative-tokens must be >= 0 and --acceptance-rate within [0, 1]")
        if args.num_speculative_tokens:   # the executor drafts, as MTP does (sim/executor.py)
            config = dataclasses.replace(config, speculative=SpeculativeConfig(
                method="mtp", num_speculative_tokens=args.num_speculative_tokens))
        shape = ParallelShape(tp, dp, args.enable_expert_parallel, args.expert_skew)
        from rackserve.sim.routing import make_router
        if make_router(args.router_policy, args.block_size).uses_kv_events:   # an unknown name fails here
            # The router's index follows the instances' KV events, as with --kv-events-config.
            config = dataclasses.replace(config, kv_events=KVEventsConfig(enable_kv_cache_events=True))
        from rackserve.sim.routing import DP_PLACEMENT_NAMES
        if args.dp_placement not in DP_PLACEMENT_NAMES:
            raise ValueError(f"unknown DP placement {args.dp_placement!r}; choose one of {DP_PLACEMENT_NAMES}")
        setup = cls(spec, hardware, config, shape, args.instances, args.router_policy,
                    args.acceptance_rate, dp_placement=args.dp_placement,
                    template=template_for(args.model if args.tokenizer is None else args.tokenizer),
                    tokenizer=args.model if args.tokenizer is None else args.tokenizer,
                    kv_pool_gib=args.kv_pool_memory,
                    kv_pool_bandwidth=(args.kv_pool_bandwidth * 1e9 if args.kv_pool_bandwidth
                                       else hardware.scale_out_bw))
        if setup.kv_pool_gib < 0 or setup.kv_pool_bandwidth <= 0:
            raise ValueError("--kv-pool-memory must be >= 0 and --kv-pool-bandwidth > 0")
        if args.prefill or args.decode:
            setup = setup.disaggregated(args)
        setup.check_memory()
        return setup

    def disaggregated(self, args: argparse.Namespace) -> "SimSetup":
        """`--prefill P --decode D`: P prefill instances (their own DP/TP shape and token budget)
        and D decode instances of this shape, each with the engine's MooncakeConnector of its role."""
        if args.prefill < 1 or args.decode < 1:
            raise ValueError("P/D needs --prefill P and --decode D, both >= 1")
        tp = args.prefill_tensor_parallel_size or self.shape.tensor_parallel_size
        dp = args.prefill_data_parallel_size or self.shape.data_parallel_size
        budget = args.prefill_max_num_batched_tokens or self.config.scheduler.max_num_batched_tokens
        prefill = dataclasses.replace(
            self, instances=args.prefill, shape=dataclasses.replace(self.shape, tensor_parallel_size=tp,
                                                                    data_parallel_size=dp),
            config=dataclasses.replace(self.config,
                                       scheduler=dataclasses.replace(self.config.scheduler,
                                                                     max_num_batched_tokens=budget),
                                       parallel=dataclasses.replace(self.config.parallel, tensor_parallel_size=tp,
                                                                    data_parallel_size=dp),
                                       speculative=None),
            pd_role="kv_producer")
        prefill.check_memory()
        return dataclasses.replace(self, instances=args.decode, prefill=prefill, pd_role="kv_consumer")

    @property
    def transfer_bandwidth(self) -> float:
        """Bytes/s of KV from a prefill to a decode instance over one device's link (scale-up
        inside one NVLink domain, scale-out across domains)."""
        from rackserve.sim.efficiency import efficiency
        inside = self.all_devices <= self.hardware.domain_size
        bw = self.hardware.scale_up_bw if inside else self.hardware.scale_out_bw
        return bw * efficiency("link_bw", self.hardware.efficiency)

    @property
    def num_speculative_tokens(self) -> int:
        """MTP drafts a step (config.speculative; 0: none, as on a P/D prefill pool)."""
        return self.config.speculative.num_speculative_tokens if self.config.speculative else 0

    @property
    def devices(self) -> int:
        """This pool's devices (the decode pool's under P/D)."""
        return self.instances * self.shape.world_size

    @property
    def all_devices(self) -> int:
        return self.devices + (self.prefill.devices if self.prefill else 0)

    @property
    def max_model_len(self) -> int:
        return self.spec.max_model_len

    def engine(self, seed: int, store: SimStore | None = None, index: int = 0,
               fabric: SimFabric | None = None, clock: Callable[[], float] | None = None) -> EngineCore:
        """Instance `index`: under P/D its MooncakeConnector's pulls go over `fabric`; with a KV
        pool (`store`) its store connector loads and stores there; both on `clock`."""
        from rackserve.engine.data_parallel import least_load
        from rackserve.sim.routing import DP_PLACEMENTS
        config, transfer = self.config, None
        if self.pd_role is not None:
            config, addresses = pd_instance(self.config, self.pd_role, index)
            transfer = SimTransfer(fabric, self.spec.kv_bytes, self.transfer_bandwidth, self.hardware.link_latency,
                                   config.cache.block_size, addresses, clock)
        if store is not None:
            pool = SimStoreTransfer(store, self.spec.kv_bytes, self.shape.data_parallel_size, clock, fabric.pool_record)
            config = with_store(config, store)
            transfer = pool if transfer is None else SimMultiTransfer([transfer, pool])
        # An empty step waiting on transfers must not sleep the wall clock: the executor's step
        # lasts until the next transfer event in virtual time.
        return EngineCore(config, self.executor(seed, transfer), DP_PLACEMENTS.get(self.dp_placement, least_load),
                          sleep=lambda seconds: None)

    def executor(self, seed: int, transfer: "SimTransfer | SimStoreTransfer | SimMultiTransfer | None" = None
                 ) -> SimExecutor:
        if self.executor_factory is not None:
            return self.executor_factory(self, seed)
        return SimExecutor(self.config, CostModel(self.spec, self.hardware, self.shape, seed), self.spec,
                           self.acceptance_rate, transfer)

    def kv_pool(self) -> SimStore | None:
        """A fresh pool for one run, sized in tokens of this model's KV; None without one."""
        if not self.kv_pool_gib:
            return None
        per_token = self.spec.kv_bytes_per_token(min(self.max_model_len, 1 << 17))
        return SimStore(KVPool(int(self.kv_pool_gib * GIB / per_token), self.kv_pool_bandwidth,
                               self.config.cache.block_size))

    def check_memory(self) -> None:
        """Weights + KV cache must fit a device: a deployment that cannot load is refused."""
        if self.hardware.name == "cpu":
            return
        s = self.shape
        weights = self.executor(0).weight_bytes_per_device(s.tensor_parallel_size, s.world_size,
                                                           s.enable_expert_parallel)
        need = weights + self.config.cache.kv_cache_memory_gib * GIB
        if need > self.hardware.mem_capacity:
            raise ValueError(f"{self.spec.name} needs {weights / 1e9:.0f} GB of weights + "
                             f"{self.config.cache.kv_cache_memory_gib:.0f} GiB KV per device, more than "
                             f"{self.hardware.name}'s {self.hardware.mem_capacity / 1e9:.0f} GB: add ranks or "
                             "lower --kv-cache-memory")

    def describe(self) -> dict:
        return {"hardware": self.hardware.to_json(), "shape": dataclasses.asdict(self.shape),
                "prefill": self.prefill.describe() if self.prefill else None, "devices": self.all_devices,
                "instances": self.instances, "router_policy": self.router_policy, "dp_placement": self.dp_placement,
                "model_spec": {k: v for k, v in dataclasses.asdict(self.spec).items() if k != "attention"},
                "kv_blocks_per_dp_rank": kv_blocks_for(self.spec, self.config),
                "num_speculative_tokens": self.num_speculative_tokens, "acceptance_rate": self.acceptance_rate,
                "kv_pool_gib": self.kv_pool_gib, "kv_pool_bandwidth": self.kv_pool_bandwidth,
                "chat_template_tokens": dataclasses.asdict(self.template), "marker_tokenizer": self.tokenizer if marker_ids(self.tokenizer) else None}

    def run_level(self, workload, renderer, concurrency: int, duration: float, think_time_cap: float,
                  seed: int) -> dict:
        """One concurrency level on fresh instances: bench serve's run record, plus "sim"."""
        from rackserve.bench.metrics import summarize
        from rackserve.bench.replay import Replay, ReplayConfig
        from rackserve.sim.cluster import SimClient, SimInstance
        from rackserve.sim.routing import make_router

        async def play() -> tuple[list, list[SimInstance], list[SimInstance], float]:
            loop = asyncio.get_running_loop()
            start = loop.time()

            def clock() -> float:
                return loop.time() - start

            pool = self.kv_pool()
            computes = self.prefill is None   # under P/D the prefill pool computes prompts and uses the KV pool
            block_size = self.config.cache.block_size
            pin = self.dp_placement == "router"
            router = make_router(self.router_policy, block_size, seed, pin, clock, decode_pool=not computes)
            fabric = fabrics[0]
            instances = [SimInstance(i, self.engine(seed + i, pool if computes else None, i, fabric, clock), clock,
                                     router.observe) for i in range(self.instances)]
            prefill_router = make_router(self.router_policy, block_size, seed + 1000, pin, clock)
            prefill = [] if self.prefill is None else [
                SimInstance(i, self.prefill.engine(seed + 1000 + i, pool, i, fabric, clock), clock,
                            prefill_router.observe) for i in range(self.prefill.instances)]
            pools.append(pool)
            tasks = [asyncio.ensure_future(i.run()) for i in instances + prefill]
            client = SimClient(instances, router, clock, self.spec.vocab_size, self.template,
                               (self.hardware.serve_request_overhead, self.hardware.serve_prompt_token_overhead),
                               marker_ids(self.tokenizer))
            if prefill:
                client.disaggregate(prefill, prefill_router)
            config = ReplayConfig(concurrency, duration, think_time_cap, seed, run_id(seed, concurrency))
            try:
                records = await Replay(workload, renderer, client, config).run()
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if pool is not None:
                    pool.close()
            return records, instances + prefill, prefill or instances, clock()

        pools: list[SimStore | None] = []
        fabrics = [SimFabric()]
        wall = time.perf_counter()
        records, instances, computing, virtual = run_virtual(play())
        wall = time.perf_counter() - wall
        # Under P/D the hit rate is the prefill pool's: where a hit saves compute.
        hits = (sum(i.stats.prefix_hits for i in computing), sum(i.stats.prefix_queries for i in computing))
        summary = summarize(records, concurrency, self.all_devices, hits)
        idle = sum(x for i in instances for _, x, _ in i.stats.dp_steps)
        busy = sum(y for i in instances for _, _, y in i.stats.dp_steps)
        steps = [s for i in instances for s in i.stats.step_seconds]
        # Steady state: the steps that started while the lanes were starting measured requests (not
        # the first warm-ups, nor the drain after the deadline, where ranks run out of work unevenly).
        starts = [r.start for r in records if r.measured] or [0.0]
        lo, hi = min(starts), max(starts)
        window = [(x, y) for i in instances for t, x, y in i.stats.dp_steps if lo <= t <= hi]
        w_idle, w_busy = sum(x for x, _ in window), sum(y for _, y in window)
        drafts, draft_tokens, accepted = (sum(getattr(i.stats, f) for i in instances)
                                          for f in ("drafts", "draft_tokens", "accepted_tokens"))
        return {"concurrency": concurrency, "summary": summary.to_json(),
                "requests": [r.to_json() for r in records],
                "sim": {"virtual_seconds": virtual, "wall_seconds": wall, "speedup": virtual / wall if wall else 0.0,
                        "steps": len(steps), "mean_step_seconds": sum(steps) / len(steps) if steps else 0.0,
                        "preemptions": sum(i.stats.preemptions for i in instances),
                        # vLLM's spec-decode counters; mean_acceptance_length: tokens a verifying step kept
                        "spec_decode": {"drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
                                        "mean_acceptance_length": 1 + accepted / drafts} if drafts else None,
                        "dp_idle_share": idle / (idle + busy) if idle + busy else 0.0,
                        "dp_idle_share_steady": w_idle / (w_idle + w_busy) if w_idle + w_busy else 0.0,
                        "kv_pool_hit_tokens": pools[0].pool.hit_tokens if pools and pools[0] else None,
                        "kv_pool": fabrics[0].pool_record.to_json() if pools and pools[0] else None,
                        "kv_transfer": fabrics[0].record.to_json() if self.prefill else None}}
