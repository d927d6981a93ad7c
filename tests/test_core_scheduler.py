"""Scheduler: token budget, chunked prefill mixed with decodes, max_num_seqs, preemption by
recompute, abort, and the token-level stop rules. The model is replaced by a deterministic
function of each request's whole token history, so a recompute that lost or reordered a token
would change every later token."""
from __future__ import annotations

import zlib

import pytest

from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from rackserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from rackserve.core.request import Request, RequestStatus
from rackserve.core.scheduler import Scheduler
from rackserve.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=64,
                   caching=True) -> Scheduler:
    config = EngineConfig(ModelConfig("m", "m", "m", "float32", "cpu", max_model_len, 0),
                          CacheConfig(block_size, 1.0, caching, None),
                          SchedulerConfig(max_num_seqs, budget))
    return Scheduler(config, num_blocks)


def next_token(tokens: list[int]) -> int:
    return zlib.crc32(str(tokens).encode()) % 50


def run_step(sched: Scheduler) -> tuple[SchedulerOutput, list]:
    """One step with a model that samples next_token(history) for requests whose KV caught up."""
    so = sched.schedule()
    req_ids, tokens = [], []
    for req_id in so.num_scheduled_tokens:
        req = sched.requests[req_id]
        if req.num_computed_tokens == req.num_tokens:
            req_ids.append(req_id)
            tokens.append([next_token(req.all_token_ids)])
    outs = sched.update_from_output(so, ModelRunnerOutput(req_ids, tokens, [None] * len(req_ids)))
    sched.check_integrity()
    return so, outs


def run_to_completion(sched: Scheduler, max_steps=500) -> dict[str, list[int]]:
    results: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return results
        _, outs = run_step(sched)
        for out in outs:
            results.setdefault(out.req_id, []).extend(out.new_token_ids)
    raise AssertionError("did not finish")


def add(sched, req_id, prompt_len, max_tokens=4, start=0, **params) -> Request:
    req = Request(req_id, [start + i for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens, **params))
    sched.add_request(req)
    return req


def test_budget_chunks_prompts_and_mixes_decodes_with_prefill():
    sched = make_scheduler(budget=32)
    add(sched, "a", 20)
    add(sched, "b", 30, start=100)
    so, outs = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 20, "b": 12}
    assert [o.req_id for o in outs] == ["a"]          # b is mid-prompt: it samples nothing
    so, outs = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 18}   # a decode next to the rest of b's prompt
    assert [c.req_id for c in so.scheduled_cached_reqs] == ["a", "b"]
    assert {o.req_id for o in outs} == {"a", "b"}


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(3):
        add(sched, f"r{i}", 5, start=10 * i)
    so, _ = run_step(sched)
    assert list(so.num_scheduled_tokens) == ["r0", "r1"]
    assert len(sched.waiting) == 1


def test_preemption_by_recompute_gives_the_same_tokens_as_a_roomy_cache():
    def workload(sched):
        for i in range(4):
            add(sched, f"r{i}", 10, max_tokens=20, start=100 * i)
    roomy = make_scheduler(num_blocks=64)
    workload(roomy)
    expected = run_to_completion(roomy)
    tight = make_scheduler(num_blocks=16)            # 64 tokens for 4 requests of up to 30
    workload(tight)
    preemptions = 0
    results: dict[str, list[int]] = {}
    while tight.has_unfinished_requests():
        so, outs = run_step(tight)
        preemptions += tight.make_stats().num_preemptions
        for out in outs:
            results.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert preemptions > 0
    assert results == expected
    assert all(len(toks) == 20 for toks in results.values())


def test_preempted_requests_are_dropped_from_workers_then_resent_whole():
    sched = make_scheduler(num_blocks=8, budget=64, max_model_len=32)
    add(sched, "a", 12, max_tokens=16)
    add(sched, "b", 12, max_tokens=16, start=50)
    dropped, resent = set(), []
    while sched.has_unfinished_requests():
        so, _ = run_step(sched)
        dropped |= so.finished_req_ids
        resent += [r for r in so.scheduled_new_reqs if r.output_token_ids]
    assert "b" in dropped
    assert resent and resent[0].req_id == "b"
    assert resent[0].prompt_token_ids == list(range(50, 62))


def test_abort_frees_blocks_and_tells_workers():
    sched = make_scheduler()
    add(sched, "a", 10, max_tokens=50)
    add(sched, "w", 10, max_tokens=50, start=100)
    sched.max_num_seqs = 1
    run_step(sched)
    sched.finish_requests(["a", "w", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert sched.kv.usage() == 0.0
    so = sched.schedule()
    assert so.finished_req_ids == {"a"} and so.is_empty
    sched.check_integrity()


def test_stop_rules():
    sched = make_scheduler()
    prompt = list(range(8))
    first = next_token(prompt)
    sched.add_request(Request("eos", prompt, SamplingParams(max_tokens=10), eos_token_ids=frozenset([first])))
    sched.add_request(Request("ign", prompt, SamplingParams(max_tokens=3, ignore_eos=True),
                              eos_token_ids=frozenset([first])))
    sched.add_request(Request("stop_id", prompt, SamplingParams(max_tokens=10, stop_token_ids=[first])))
    add(sched, "len", 60, max_tokens=None)          # max_model_len 64 leaves 4 tokens
    results = run_to_completion(sched)
    assert results["eos"] == [first]
    assert len(results["ign"]) == 3
    assert results["stop_id"] == [first]
    assert len(results["len"]) == 4


def test_prompt_that_cannot_fit_is_rejected():
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        add(sched, "long", 16)
    with pytest.raises(ValueError, match="KV cache holds"):
        make_scheduler(num_blocks=2, max_model_len=16)


def test_prefix_cache_stats_and_cached_tokens():
    sched = make_scheduler()
    add(sched, "a", 13)
    run_to_completion(sched)
    sched.make_stats()
    b = add(sched, "b", 13)
    run_step(sched)
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (13, 12)
    assert b.num_cached_tokens == 12


def test_block_hashes_do_not_follow_the_sampling_seed():
    """Instances started with different --seed must name equal prefixes alike (KV events,
    router, KV pool): the hash namespace is not the sampling seed."""
    hashes = []
    for seed in (0, 1234):
        config = EngineConfig(ModelConfig("m", "m", "m", "float32", "cpu", 64, seed),
                              CacheConfig(4, 1.0, True, None), SchedulerConfig(8, 32))
        sched = Scheduler(config, 64)
        req = add(sched, "r", 12)
        run_step(sched)
        hashes.append(list(req.block_hashes))
    assert hashes[0] == hashes[1] and len(hashes[0]) == 3


def test_a_request_that_cannot_be_looked_up_fails_alone():
    """A token id past 32 bits (a bug upstream of the scheduler) breaks hashing its first block:
    that request ends with an error, is released, and the others run as if it had not been there."""
    sched = make_scheduler()
    add(sched, "before", 6)
    bad = Request("bad", [1, 2**40, 3, 4, 5, 6], SamplingParams(max_tokens=4))
    sched.add_request(bad)
    add(sched, "after", 9, start=100)
    so, outs = run_step(sched)
    assert set(so.num_scheduled_tokens) == {"before", "after"}
    [failed] = [o for o in outs if o.req_id == "bad"]
    assert failed.finish_reason == "error" and "scheduling failed: OverflowError" in failed.stop_reason
    assert "bad" not in sched.requests
    expected = run_to_completion(make_scheduler_with(("before", 6, 0), ("after", 9, 100)))
    got = {o.req_id: list(o.new_token_ids) for o in outs if o.req_id != "bad"}
    for req_id, tokens in run_to_completion(sched).items():
        got.setdefault(req_id, []).extend(tokens)
    assert got == expected


def make_scheduler_with(*requests: tuple[str, int, int]) -> Scheduler:
    sched = make_scheduler()
    for req_id, prompt_len, start in requests:
        add(sched, req_id, prompt_len, start=start)
    return sched
