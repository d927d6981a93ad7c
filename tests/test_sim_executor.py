"""The simulated executor obeys the step contract: driven on a virtual clock advanced by the real
engine's own step times, the real scheduler makes the same decisions (batches, prefix hits,
preemptions, drops) over the sim executor as over the real model, on a timed token workload."""
from __future__ import annotations

import dataclasses
import time

from rackserve.config import EngineArgs
from rackserve.core.outputs import SchedulerOutput
from rackserve.core.request import Request
from rackserve.engine.core import EngineCore
from rackserve.executor.base import create_executor
from rackserve.sampling_params import SamplingParams
from rackserve.sim.cost import SeqWork, StepCost
from rackserve.sim.executor import SimExecutor


class Recorder:
    """Wraps an executor's execute_dp: what each step was asked, and how long it took."""

    def __init__(self, core: EngineCore):
        self.inner = core.executor.execute_dp
        core.executor.execute_dp = self
        self.decisions: list[tuple] = []
        self.seconds: list[float] = []

    def __call__(self, outputs: list[SchedulerOutput]):
        start = time.perf_counter()
        result = self.inner(outputs)
        self.seconds.append(time.perf_counter() - start)
        self.decisions.append(tuple(
            (tuple(so.num_scheduled_tokens.items()),
             tuple((n.req_id, n.num_computed_tokens, len(n.output_token_ids)) for n in so.scheduled_new_reqs),
             tuple(sorted(so.finished_req_ids))) for so in outputs))
        return result


class Replayed:
    """A pricer that replays measured step times."""

    def __init__(self, seconds: list[float]):
        self.seconds = iter(seconds)

    def step(self, batches: list[list[SeqWork]]) -> StepCost:
        return StepCost(next(self.seconds), [])


def workload(vocab: int) -> list[tuple[float, list[int], int]]:
    """(arrival second, prompt, max_tokens): shared prefixes for hits, enough tokens to preempt."""
    shared = [(7 * i) % vocab for i in range(40)]
    out = []
    for i in range(10):
        own = [(13 * i + 5 * j + 3) % vocab for j in range(10 + 6 * i)]
        # Arrivals 0.1 ms apart, less than any real step takes: however fast the machine, requests
        # overlap enough to preempt (at 20 ms apart a fast machine never preempted), and arrivals
        # still interleave with the first steps.
        out.append((0.0001 * i, (shared if i % 2 else shared[:20]) + own, 12 + 3 * (i % 4)))
    return out


def drive(core: EngineCore, step_seconds, vocab: int) -> tuple[int, int]:
    """Arrivals on a virtual clock that each step advances by step_seconds(); returns
    (preemptions, prefix hit tokens) seen."""
    pending = workload(vocab)
    clock, preemptions, hits = 0.0, 0, 0
    index = 0
    while index < len(pending) or core.has_unfinished_requests():
        while index < len(pending) and pending[index][0] <= clock:
            _, prompt, max_tokens = pending[index]
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            core.add_requests([Request(f"r{index}", prompt, params, arrival_time=clock)])
            index += 1
        if not core.has_unfinished_requests():
            clock = pending[index][0]
            continue
        _, stats = core.step()
        preemptions += stats.num_preemptions
        hits += stats.prefix_cache_hits
        clock += step_seconds()
    return preemptions, hits


def test_same_scheduler_decisions_over_the_sim_executor_as_over_the_model(tiny_llama_dir):
    args = EngineArgs(model=tiny_llama_dir, max_num_batched_tokens=48, num_gpu_blocks_override=20, block_size=8,
                      max_model_len=160, max_num_seqs=6)
    config = args.create_engine_config()
    real = EngineCore(config)
    try:
        recorder = Recorder(real)
        real_events = drive(real, lambda: recorder.seconds[-1], real.executor.vocab_size)
    finally:
        real.shutdown()
    assert real_events[0] > 0 and real_events[1] > 0, "the workload must preempt and hit the prefix cache"

    sim_executor = SimExecutor(dataclasses.replace(config, model=dataclasses.replace(config.model, max_model_len=None)),
                               pricer=Replayed(recorder.seconds))
    sim = EngineCore(config, sim_executor)
    sim_recorder = Recorder(sim)
    sim_events = drive(sim, lambda: sim_executor.last_step_seconds, sim_executor.vocab_size)
    sim.check_integrity()
    assert sim_events == real_events
    assert sim_recorder.decisions == recorder.decisions

    # The decisions do depend on the clock: slower steps batch the arrivals differently.
    def decisions_at(seconds: float) -> list[tuple]:
        core = EngineCore(config, SimExecutor(config, pricer=Replayed([seconds] * 10_000)))
        recorder = Recorder(core)
        drive(core, lambda: seconds, sim_executor.vocab_size)
        return recorder.decisions

    assert decisions_at(1e-4) != decisions_at(0.05)


def test_sim_executor_comes_from_the_registry(tiny_llama_dir):
    config = EngineArgs(model=tiny_llama_dir, num_gpu_blocks_override=64).create_engine_config()
    executor = create_executor(config, "sim")
    assert isinstance(executor, SimExecutor)
    assert executor.num_kv_blocks == 64 and executor.vocab_size == 512 and executor.model_max_len == 1024
    core = EngineCore(config, executor)
    core.add_requests([Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=5, ignore_eos=True))])
    tokens = []
    while core.has_unfinished_requests():
        outputs, _ = core.step()
        assert executor.last_step_seconds > 0
        tokens += [t for o in outputs for t in o.new_token_ids]
    assert len(tokens) == 5 and all(0 <= t < 512 for t in tokens)


def test_speculative_tokens_arrive_several_per_step(tiny_llama_dir):
    config = EngineArgs(model=tiny_llama_dir, num_gpu_blocks_override=64).create_engine_config()
    executor = SimExecutor(config, num_speculative_tokens=3, acceptance_rate=0.8)
    core = EngineCore(config, executor)
    core.add_requests([Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=40, ignore_eos=True))])
    steps = tokens = 0
    while core.has_unfinished_requests():
        outputs, _ = core.step()
        steps += 1
        tokens += sum(len(o.new_token_ids) for o in outputs)
    assert tokens == 40 and steps < 30
