"""A step trace: `rackserve sim`'s closed-loop run (bench's lanes, the real EngineCore and
Scheduler on the virtual clock) with the real model executing every step, the clock advanced by
each step's measured time instead of a priced one. It records every step as the scheduler formed
it (each sequence's new tokens, cached context, whether it samples: mixed prefill chunks and
decodes), its measured seconds and the cost model's, and the requests' timings without the
serving path (no HTTP, tokenizer or detokenizer), so a `bench serve` run of the same workload
splits into engine steps, queueing and the serving path, and calibrate.py can fit to the steps a
served workload really forms (`--steps`).

    python -m rackserve.bench.step_trace --workload agentx --concurrency 1,2,4,8 --duration 40 \
        --max-model-len 8192 --output bench/results/steps-agentx-smollm2-gguf.json

It takes `rackserve sim`'s flags (one instance, one rank) and runs the model `rackserve serve
--model MODEL` would (the same engine defaults). It owns the timed executor; it must never price a
step (cost.py does) nor compute a metric (bench/metrics.py does).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Sequence

from rackserve.bench.engine_code import engine_code, runner_native_decode
from rackserve.bench.engine_kernels import engine_kernels
from rackserve.config import EngineArgs, EngineConfig
from rackserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from rackserve.executor.base import Executor, create_executor
from rackserve.sim.cost import CostModel, SeqWork
from rackserve.sim.executor import SimExecutor


class TimedExecutor(SimExecutor):
    """The real executor on the step contract, its step time measured; the SimExecutor it extends
    keeps each request's progress, so every step is also priced and recorded as SeqWork."""

    def __init__(self, config: EngineConfig, real: Executor, pricer: CostModel, steps: list[dict]):
        super().__init__(config, pricer, pricer.spec)
        self.real, self.steps = real, steps
        self.num_kv_blocks, self.kv_cache_config = real.num_kv_blocks, real.kv_cache_config
        self._works: list[list[SeqWork]] = []

    def _batch(self, reqs: dict, so: SchedulerOutput) -> list[tuple[str, SeqWork, int]]:
        batch = super()._batch(reqs, so)
        self._works.append([w for _, w, _ in batch if w.new_tokens])
        return batch

    def execute_dp(self, scheduler_outputs: list[SchedulerOutput]) -> list[ModelRunnerOutput]:
        start = time.perf_counter()
        outputs = self.real.execute_dp(scheduler_outputs)
        seconds = time.perf_counter() - start
        self._works = []
        super().execute_dp(scheduler_outputs)     # the priced step; the real outputs go back
        if any(self._works):
            self.steps.append({"batches": [[list(w) for w in b] for b in self._works], "measured_s": seconds,
                               "modelled_s": self.last_cost.seconds})
        self.last_step_seconds = seconds
        return outputs

    def shutdown(self) -> None:
        self.real.shutdown()


def trace(args: argparse.Namespace, levels: list[int]) -> dict:
    """`rackserve sim`'s result for these flags, its steps run by the real model: each run gains
    "steps" (the trace) and its timings are the real steps'."""
    from rackserve.sim.cli import simulate
    if args.instances != 1 or args.prefill or args.decode or args.data_parallel_size != 1 \
            or args.tensor_parallel_size != 1 or args.kv_pool_memory or args.num_speculative_tokens:
        raise ValueError("a step trace runs one instance of one rank (no P/D, DP, TP, KV pool or MTP drafts)")
    engine_args = EngineArgs(model=args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                             kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
                             num_gpu_blocks_override=args.num_gpu_blocks_override, seed=args.seed,
                             quantization=args.quantization or "auto")
    real_config = engine_args.create_engine_config()
    executors: list[TimedExecutor] = []      # one a level: one instance each

    def timed(setup, seed: int) -> TimedExecutor:
        executors.append(TimedExecutor(setup.config, create_executor(real_config),
                                       CostModel(setup.spec, setup.hardware, setup.shape, seed), []))
        return executors[-1]

    result = simulate(args, levels, executor_factory=timed)
    native_decode = runner_native_decode(executors[0].real) if executors else None
    for executor, run in zip(executors, result["runs"], strict=True):
        executor.shutdown()
        run["steps"] = executor.steps
    result["label"] = args.label or f"step trace: {args.model} executed, virtual clock"
    result["step_trace"] = {"engine": dataclasses.asdict(engine_args),
                            "kernels": engine_kernels(real_config.model, real_config.cache.cache_dtype),
                            "engine_code": engine_code(real_config.model.native_isa, native_decode)}
    return result


def main(argv: Sequence[str] | None = None) -> int:
    from rackserve.bench.serve_bench import write_result
    from rackserve.sim.cli import add_args
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(parser)
    args = parser.parse_args(argv)
    try:
        result = trace(args, [int(c) for c in args.concurrency.split(",")])
    except (ValueError, FileNotFoundError) as e:
        print(f"step trace: {e}", file=sys.stderr)
        return 2
    for run in result["runs"]:
        s, steps = run["summary"], run["steps"]
        ratio = sum(x["modelled_s"] for x in steps) / max(1e-9, sum(x["measured_s"] for x in steps))
        print(f"concurrency {run['concurrency']}: {len(steps)} steps, modelled/measured step time {ratio:.2f}, "
              f"TTFT P50 {s['ttft']['p50']:.3f} s, ITL P50 {s['itl']['p50'] * 1e3:.1f} ms")
    if args.summary_only:
        for run in result["runs"]:
            run.pop("requests")
    return write_result(result, args.output, args.plot)


if __name__ == "__main__":
    raise SystemExit(main())
