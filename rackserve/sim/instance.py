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
import uuid
from dataclasses import dataclass

from rackserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from rackserve.engine.core import EngineCore
from rackserve.sim.cost import CostModel, ParallelShape
from rackserve.sim.executor import SimExecutor
from rackserve.sim.hardware import GIB, Hardware
from rackserve.sim.model_spec import ModelSpec, load_model_spec
from rackserve.sim.virtual_loop import run_virtual


@dataclass
class SimSetup:
    spec: ModelSpec
    hardware: Hardware
    config: EngineConfig
    shape: ParallelShape
    instances: int
    router_policy: str
    num_speculative_tokens: int = 0
    acceptance_rate: float = 0.0

    @classmethod
    def from_args(cls, args: argparse.Namespace, hardware: Hardware) -> "SimSetup":
        spec = load_model_spec(args.model).with_precision(args.quantization, args.kv_cache_dtype)
        if hardware.name == "cpu" and args.kv_cache_dtype is None:
            spec = spec.with_precision("fp32", "fp32")   # rackserve on CPU runs float32 weights and KV
        tp, dp = args.tensor_parallel_size, args.data_parallel_size
        if tp < 1 or dp < 1:
            raise ValueError("parallel sizes must be >= 1")
        max_len = args.max_model_len or spec.max_model_len
        if max_len > spec.max_model_len:
            raise ValueError(f"max_model_len={max_len} exceeds the model's {spec.max_model_len}")
        spec = dataclasses.replace(spec, max_model_len=max_len)
        config = EngineConfig(
            ModelConfig(args.model, args.model, args.model, "bfloat16", "sim", max_len, args.seed),
            CacheConfig(args.block_size, args.kv_cache_memory, args.enable_prefix_caching, args.num_gpu_blocks_override),
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens),
            ParallelConfig(tp, data_parallel_size=dp, enable_expert_parallel=args.enable_expert_parallel))
        shape = ParallelShape(tp, dp, args.enable_expert_parallel, args.expert_skew)
        setup = cls(spec, hardware, config, shape, args.instances, args.router_policy,
                    args.num_speculative_tokens, args.acceptance_rate)
        setup.check_memory()
        return setup

    @property
    def devices(self) -> int:
        return self.instances * self.shape.world_size

    @property
    def max_model_len(self) -> int:
        return self.spec.max_model_len

    def executor(self, seed: int) -> SimExecutor:
        return SimExecutor(self.config, CostModel(self.spec, self.hardware, self.shape, seed), self.spec,
                           self.num_speculative_tokens, self.acceptance_rate)

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
                "instances": self.instances, "router_policy": self.router_policy,
                "model_spec": {k: v for k, v in dataclasses.asdict(self.spec).items() if k != "attention"},
                "kv_blocks_per_dp_rank": self.executor(0).num_kv_blocks,
                "num_speculative_tokens": self.num_speculative_tokens, "acceptance_rate": self.acceptance_rate}

    def run_level(self, workload, renderer, concurrency: int, duration: float, think_time_cap: float,
                  seed: int) -> dict:
        """One concurrency level on fresh instances: bench serve's run record, plus "sim"."""
        from rackserve.bench.metrics import summarize
        from rackserve.bench.replay import Replay, ReplayConfig
        from rackserve.sim.cluster import SimClient, SimInstance
        from rackserve.sim.routing import make_policy

        async def play() -> tuple[list, list[SimInstance], float]:
            loop = asyncio.get_running_loop()
            start = loop.time()

            def clock() -> float:
                return loop.time() - start

            instances = [SimInstance(i, EngineCore(self.config, self.executor(seed + i)), clock)
                         for i in range(self.instances)]
            tasks = [asyncio.ensure_future(i.run()) for i in instances]
            client = SimClient(instances, make_policy(self.router_policy), clock)
            config = ReplayConfig(concurrency, duration, think_time_cap, seed, f"{uuid.uuid4().hex[:8]}c{concurrency}")
            try:
                records = await Replay(workload, renderer, client, config).run()
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            return records, instances, clock()

        wall = time.perf_counter()
        records, instances, virtual = run_virtual(play())
        wall = time.perf_counter() - wall
        hits = (sum(i.stats.prefix_hits for i in instances), sum(i.stats.prefix_queries for i in instances))
        summary = summarize(records, concurrency, self.devices, hits)
        busy = sum(i.stats.dp_busy_seconds for i in instances)
        idle = sum(i.stats.dp_idle_seconds for i in instances)
        steps = [s for i in instances for s in i.stats.step_seconds]
        return {"concurrency": concurrency, "summary": summary.to_json(),
                "requests": [r.to_json() for r in records],
                "sim": {"virtual_seconds": virtual, "wall_seconds": wall, "speedup": virtual / wall if wall else 0.0,
                        "steps": len(steps), "mean_step_seconds": sum(steps) / len(steps) if steps else 0.0,
                        "preemptions": sum(i.stats.preemptions for i in instances),
                        "dp_idle_share": idle / (idle + busy) if idle + busy else 0.0}}
