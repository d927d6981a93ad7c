"""The simulated executor obeys the step contract: driven on a virtual clock advanced by the real
engine's own step times, the real scheduler makes the same decisions (batches, prefix hits,
preemptions, drops) over the sim executor as over the real model, on a timed token workload."""
from __future__ import annotations

import dataclasses
import time

import pytest

from rackserve.config import EngineArgs, SpeculativeConfig
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


class _Priced:
    """A pricer that keeps every step's priced work."""

    def __init__(self):
        self.batches: list[list[list[SeqWork]]] = []

    def step(self, batches):
        self.batches.append(batches)
        return StepCost(1e-3, [])


@pytest.mark.parametrize("k,a", [(3, 0.8), (2, 0.5), (4, 0.9)])
def test_mtp_drafts_follow_the_engines_draft_contract(tiny_llama_dir, k, a):
    """Speculative method "mtp" on the simulator: every sampled token comes with k drafts, the
    scheduler schedules them at the request's next decode (1 + k rows, priced as such), the step
    keeps each with the acceptance rate plus one token of its own, and the rejected ones are taken
    back from both the scheduler's and the executor's computed tokens."""
    config = dataclasses.replace(EngineArgs(model=tiny_llama_dir, num_gpu_blocks_override=256).create_engine_config(),
                                 speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=k))
    pricer = _Priced()
    executor = SimExecutor(config, pricer=pricer, acceptance_rate=a)
    core = EngineCore(config, executor)
    core.add_requests([Request(f"r{i}", [1, 2, 3, 4 + i], SamplingParams(max_tokens=300, ignore_eos=True))
                       for i in range(4)])
    sent: dict[str, list[int]] = {}
    verify_tokens, drafted, accepted, outputs_per_req = [], 0, 0, {f"r{i}": 0 for i in range(4)}
    while core.has_unfinished_requests():
        so = core.scheduler.schedule()
        out = executor.execute_dp([so])[0]
        for req_id, n in so.num_scheduled_tokens.items():
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            if req_id in sent:     # a decode: the drafts sent with its last token, as many as may still be output
                assert drafts == sent[req_id][:len(drafts)]
                assert len(drafts) == min(k, 300 - outputs_per_req[req_id] - 1)
                assert n == 1 + len(drafts)
        assert [(w.new_tokens, w.drafts) for w in pricer.batches[-1][0]] == \
            [(n, len(so.scheduled_spec_decode_tokens.get(r, []))) for r, n in so.num_scheduled_tokens.items()]
        for req_id, tokens, drafts in zip(out.req_ids, out.sampled_token_ids, out.draft_token_ids):
            assert len(drafts) == k
            scheduled = so.scheduled_spec_decode_tokens.get(req_id, [])
            assert tokens[:-1] == scheduled[:len(tokens) - 1] and len(tokens) <= len(scheduled) + 1
            if scheduled:
                verify_tokens.append(len(tokens))
            sent[req_id] = drafts
            outputs_per_req[req_id] += len(tokens)
        core.scheduler.update_from_output(so, out)
        for req_id, state in executor._reqs[0].items():
            request = core.scheduler.requests.get(req_id)
            if request is not None:
                assert state.num_computed == request.num_computed_tokens
                assert state.num_tokens == request.num_tokens
    assert outputs_per_req == {f"r{i}": 300 for i in range(4)}
    mean = sum(verify_tokens) / len(verify_tokens)
    # The chain's mean (2.95 at k = 3, a = 0.8); the old crc32 draw of neighbouring keys gave 2.25 there.
    assert mean == pytest.approx(sum(a ** i for i in range(k + 1)), rel=0.05)
    stats = core.scheduler.make_stats()
    assert stats.num_drafts == len(verify_tokens)
    assert stats.num_accepted_tokens == sum(verify_tokens) - len(verify_tokens)
    core.check_integrity()


def test_mtp_drafts_under_preemption(tiny_llama_dir):
    """Few blocks: drafts take free blocks only while requests are preempted and recomputed; every
    request still gets exactly its tokens, the executor and the scheduler agree on every running
    request's progress after each step, and the block pool stays whole."""
    config = dataclasses.replace(
        EngineArgs(model=tiny_llama_dir, num_gpu_blocks_override=24, block_size=4, max_model_len=64,
                   max_num_batched_tokens=64).create_engine_config(),
        speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=3))
    executor = SimExecutor(config, pricer=_Priced(), acceptance_rate=0.7)
    core = EngineCore(config, executor)
    core.add_requests([Request(f"r{i}", list(range(1 + i, 9 + i)), SamplingParams(max_tokens=30, ignore_eos=True))
                       for i in range(6)])
    tokens = {f"r{i}": 0 for i in range(6)}
    preemptions = drafts = 0
    while core.has_unfinished_requests():
        outputs, stats = core.step()
        preemptions += stats.num_preemptions
        drafts += stats.num_draft_tokens
        for o in outputs:
            tokens[o.req_id] += len(o.new_token_ids)
        for req_id, state in executor._reqs[0].items():
            request = core.scheduler.requests.get(req_id)
            if request is not None and request.num_computed_tokens:
                assert state.num_computed == request.num_computed_tokens
        core.check_integrity()
    assert preemptions > 0 and drafts > 0, "the run must preempt and draft"
    assert tokens == {f"r{i}": 30 for i in range(6)}


def test_mtp_steps_without_room_for_drafts_compute_one_row(tiny_llama_dir):
    """Drafts only where the budget allows: a budget of one token a request (16 one-token prompts,
    admitted together, decoding together) leaves none, and the run then matches the one without
    MTP step for step."""
    def run(speculative):
        config = dataclasses.replace(EngineArgs(model=tiny_llama_dir, num_gpu_blocks_override=64,
                                                max_num_batched_tokens=16, max_num_seqs=16,
                                                ).create_engine_config(), speculative=speculative)
        executor = SimExecutor(config, pricer=_Priced(), acceptance_rate=1.0)
        core = EngineCore(config, executor)
        core.add_requests([Request(f"r{i}", [4 + i], SamplingParams(max_tokens=10, ignore_eos=True))
                           for i in range(16)])
        steps = 0
        while core.has_unfinished_requests():
            core.step()
            steps += 1
        return steps, [[[tuple(w) for w in b] for b in batches] for batches in executor.pricer.batches]

    plain = run(None)
    drafted = run(SpeculativeConfig(method="mtp", num_speculative_tokens=2))
    assert drafted == plain


def test_mtp_needs_an_executor_that_drafts(tiny_llama_dir):
    config = EngineArgs(model=tiny_llama_dir, num_gpu_blocks_override=64).create_engine_config()
    mtp = dataclasses.replace(config, speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=2))
    with pytest.raises(ValueError, match="needs an executor that drafts"):
        EngineCore(mtp)
    with pytest.raises(ValueError, match="rackserve sim --num-speculative-tokens"):
        SpeculativeConfig.from_json('{"method": "mtp", "num_speculative_tokens": 1}')
    with pytest.raises(ValueError, match="drafts as MTP does"):
        SimExecutor(dataclasses.replace(config, speculative=SpeculativeConfig(num_speculative_tokens=2)))
