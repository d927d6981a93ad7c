"""ModelRunner driven by hand-built SchedulerOutputs (no scheduler): chunked prefill, batches that
mix prefill chunks with decodes, prefix hits, preemption and resume, over block tables that are
never contiguous. Greedy tokens must equal transformers' generate(do_sample=False).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from rackserve.core.outputs import (EMPTY_MODEL_RUNNER_OUTPUT, CachedRequestData, ModelRunnerOutput, NewRequestData,
                                    SchedulerOutput)
from rackserve.executor.base import create_executor
from rackserve.executor.model_runner import ModelRunner
from rackserve.sampling_params import SamplingParams
from tests.tiny_models import load_hf

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def engine_config(model_dir: str, num_blocks: int | None = 96, kv_gib: float = 0.01) -> EngineConfig:
    return EngineConfig(ModelConfig(model_dir, "tiny", model_dir, "float32", "cpu", None, 0),
                        CacheConfig(BLOCK_SIZE, kv_gib, True, num_blocks), SchedulerConfig(8, 64))


@dataclass
class HandRequest:
    prompt: list[int]
    params: SamplingParams
    blocks: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    num_computed: int = 0
    known: bool = False                 # whether the runner holds its state


class HandScheduler:
    """Builds SchedulerOutputs by hand; blocks come from a shuffled pool so no table is contiguous."""

    def __init__(self, runner: ModelRunner, seed: int = 0):
        self.runner = runner
        self.free = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free)
        self.reqs: dict[str, HandRequest] = {}

    def add(self, req_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> HandRequest:
        self.reqs[req_id] = HandRequest(list(prompt), params)
        return self.reqs[req_id]

    def step(self, plan: dict[str, int], finished: set[str] = frozenset()) -> ModelRunnerOutput:
        new, cached = [], []
        for req_id, n in plan.items():
            r = self.reqs[req_id]
            need = -(-(r.num_computed + n) // BLOCK_SIZE) - len(r.blocks)
            new_blocks = [self.free.pop() for _ in range(max(need, 0))]
            r.blocks += new_blocks
            if r.known:
                cached.append(CachedRequestData(req_id, new_blocks, r.num_computed))
            else:
                new.append(NewRequestData(req_id, r.prompt, list(r.outputs), r.params, list(r.blocks), r.num_computed))
                r.known = True
        out = self.runner.execute_model(SchedulerOutput(new, cached, dict(plan), sum(plan.values()), set(finished)))
        for req_id, n in plan.items():
            self.reqs[req_id].num_computed += n
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids):
            self.reqs[req_id].outputs += tokens
        return out

    def decode(self, req_ids: list[str], steps: int) -> None:
        for _ in range(steps):
            out = self.step({r: 1 for r in req_ids})
            assert out.req_ids == req_ids

    def preempt(self, req_id: str) -> None:
        """Drop the runner's state and the request's blocks; it comes back as new, recomputed."""
        r = self.reqs[req_id]
        self.free += r.blocks
        r.blocks, r.num_computed, r.known = [], 0, False


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])   # an explicit mask: prompt tokens equal to the pad id stay in
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, eos_token_id=None)
    assert out.shape[1] == len(prompt) + n, "generate stopped early"
    return out[0, len(prompt):].tolist()


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return ModelRunner(engine_config(tiny_llama_dir)), load_hf(tiny_llama_dir)


def test_chunked_prefill_then_decode(llama):
    runner, hf = llama
    s = HandScheduler(runner)
    a = s.add("a", prompt(23, 0))
    assert s.step({"a": 10}).req_ids == []                  # mid-prompt: nothing sampled
    assert s.step({"a": 13}).req_ids == ["a"]
    s.decode(["a"], 9)
    assert a.outputs == hf_greedy(hf, a.prompt, 10)
    s.step({}, finished={"a"})
    assert "a" not in runner.requests


def test_mixed_step_of_prefill_chunks_and_decodes(llama):
    runner, hf = llama
    s = HandScheduler(runner, seed=1)
    for i, n in enumerate([5, 12, 17]):
        s.add(f"d{i}", prompt(n, 10 + i))
    s.step({"d0": 5, "d1": 12, "d2": 17})
    s.add("late", prompt(30, 20))
    # The prefill chunk sits between decodes, so decode rows are not contiguous in the batch.
    out = s.step({"d0": 1, "late": 11, "d1": 1, "d2": 1})
    assert out.req_ids == ["d0", "d1", "d2"]
    out = s.step({"d2": 1, "late": 19, "d0": 1})
    assert out.req_ids == ["d2", "late", "d0"]
    s.decode(["d0", "d1", "d2", "late"], 6)
    for req_id, r in s.reqs.items():
        assert r.outputs == hf_greedy(hf, r.prompt, len(r.outputs)), req_id
    s.step({}, finished=set(s.reqs))


def test_prefix_hit_shares_blocks_of_another_request(llama):
    runner, hf = llama
    s = HandScheduler(runner, seed=2)
    base = s.add("base", prompt(26, 30))
    s.step({"base": 26})
    hit = s.add("hit", base.prompt[:16] + prompt(9, 31))
    hit.blocks, hit.num_computed = base.blocks[:4], 16     # 4 full blocks found in the prefix cache
    assert s.step({"hit": 9, "base": 1}).req_ids == ["hit", "base"]
    s.decode(["hit", "base"], 5)
    assert hit.outputs == hf_greedy(hf, hit.prompt, 6)
    assert base.outputs == hf_greedy(hf, base.prompt, 7)
    s.step({}, finished=set(s.reqs))


def test_preempted_request_resumes_with_its_outputs(llama):
    runner, hf = llama
    s = HandScheduler(runner, seed=3)
    r = s.add("r", prompt(14, 40))
    s.step({"r": 14})
    s.decode(["r"], 4)
    s.preempt("r")
    s.step({}, finished={"r"})
    assert "r" not in runner.requests
    total = len(r.prompt) + len(r.outputs)
    s.step({"r": 8})                                        # recompute prompt + outputs in two chunks
    s.step({"r": total - 8})
    s.decode(["r"], 3)
    assert r.outputs == hf_greedy(hf, r.prompt, 9)
    s.step({}, finished={"r"})


def test_empty_step_is_cheap_and_drops_finished(llama):
    runner, _ = llama
    s = HandScheduler(runner, seed=4)
    s.add("x", prompt(6, 50))
    s.step({"x": 6})
    assert s.step({}, finished={"x"}) is EMPTY_MODEL_RUNNER_OUTPUT
    assert "x" not in runner.requests


def test_seeded_requests_repeat_and_do_not_depend_on_the_batch(llama):
    runner, _ = llama
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=None)

    def sample(req_id: str, others: int) -> list[int]:
        s = HandScheduler(runner, seed=5)
        s.add(req_id, prompt(9, 60), params)
        for i in range(others):
            s.add(f"{req_id}-o{i}", prompt(5, 61 + i), SamplingParams(temperature=1.0, max_tokens=None))
        s.step({r: len(s.reqs[r].prompt) for r in s.reqs})
        s.decode(list(s.reqs), 6)
        s.step({}, finished=set(s.reqs))
        return s.reqs[req_id].outputs

    first = sample("s1", 0)
    assert sample("s2", 0) == first
    assert sample("s3", 3) == first


def test_logprobs_are_returned_for_requests_that_ask(llama):
    runner, hf = llama
    s = HandScheduler(runner, seed=6)
    r = s.add("lp", prompt(11, 70), SamplingParams(temperature=0.0, logprobs=3, max_tokens=None))
    out = s.step({"lp": 11})
    [lp] = out.logprobs[0]      # one entry per sampled token
    ref = hf(torch.tensor([r.prompt])).logits[0, -1].log_softmax(-1)
    assert lp.sampled_rank == 1 and lp.top_token_ids[0] == out.sampled_token_ids[0][0]
    assert lp.top_token_ids == ref.topk(3).indices.tolist()
    assert lp.sampled_logprob == pytest.approx(ref.max().item(), abs=1e-4)
    s.step({}, finished={"lp"})


def test_kv_blocks_sized_from_memory(tiny_llama_dir):
    runner = ModelRunner(engine_config(tiny_llama_dir, num_blocks=None, kv_gib=0.001))
    info = runner.model_info
    block_bytes = 2 * info.num_layers * info.num_kv_heads * info.head_dim * 4 * BLOCK_SIZE
    assert runner.num_kv_blocks == int(0.001 * 2**30) // block_bytes
    assert runner.kv_cache.numel() * 4 == runner.num_kv_blocks * block_bytes


def test_uniproc_executor_reports_blocks_and_length(tiny_qwen3_dir):
    executor = create_executor(engine_config(tiny_qwen3_dir, num_blocks=32), "uniproc")
    assert executor.num_kv_blocks == 32 and executor.model_max_len == 1024
    tokens = prompt(7, 80)
    out = executor.execute(SchedulerOutput([NewRequestData("q", tokens, [], GREEDY, [5, 2], 0)], [], {"q": 7}, 7))
    assert out.sampled_token_ids == [hf_greedy(load_hf(tiny_qwen3_dir), tokens, 1)]
    executor.shutdown()
    executor.shutdown()
