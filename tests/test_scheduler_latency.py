"""Scheduling for latency: a long prompt never takes the tokens of the decodes already running
(decode first), --long-prefill-token-threshold caps one request's prefill chunk per step, and
--max-waiting-tokens lets prompt work wait a few steps while requests decode."""
from __future__ import annotations

import dataclasses

import pytest

from rackserve.config import EngineArgs
from rackserve.core.scheduler import Scheduler
from tests.test_core_scheduler import add, make_scheduler, run_step, run_to_completion


def with_threshold(threshold: int, **kw) -> Scheduler:
    sched = make_scheduler(**kw)
    sched.long_prefill_token_threshold = threshold
    return sched


def with_waiting(steps: int, **kw) -> Scheduler:
    sched = make_scheduler(**kw)
    sched.max_waiting_tokens = steps
    return sched


def steps_of(sched: Scheduler, arrivals: dict[int, tuple]) -> list[dict[str, int]]:
    """Tokens scheduled per request in each step until all finish; arrivals[k] = add()'s arguments
    of the requests that arrive before step k."""
    steps = []
    while sched.has_unfinished_requests() or len(steps) in arrivals:
        for args in arrivals.get(len(steps), ()):
            add(sched, *args)
        so, _ = run_step(sched)
        steps.append(dict(so.num_scheduled_tokens))
    return steps


def test_decodes_keep_their_tokens_beside_a_long_prefill():
    # The long prompt is first in the running queue and would take 7 of the 8 tokens every step.
    sched = with_threshold(7, budget=8, max_model_len=64)
    add(sched, "long", 40, max_tokens=2)
    add(sched, "a", 3, max_tokens=8, start=100)
    add(sched, "b", 3, max_tokens=8, start=200)
    overlapped = 0
    while sched.has_unfinished_requests():
        decoding = [r.request_id for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens]
        so, _ = run_step(sched)
        for req_id in decoding:
            assert so.num_scheduled_tokens.get(req_id) == 1, f"{req_id} stalled by a prefill"
        overlapped += "long" in so.num_scheduled_tokens and bool(decoding)
        assert so.total_num_scheduled_tokens <= 8
    assert overlapped >= 3          # the long prompt was prefilled beside decodes


def test_long_prefill_threshold_caps_each_chunk_and_changes_no_token():
    def run(threshold: int) -> tuple[dict, int]:
        sched = with_threshold(threshold, budget=32, max_model_len=64)
        for i, n in enumerate([30, 5, 17]):
            add(sched, f"r{i}", n, max_tokens=5, start=100 * i)
        so, outs = run_step(sched)
        results = run_to_completion(sched)
        for out in outs:
            results[out.req_id] = out.new_token_ids + results[out.req_id]
        return results, max(so.num_scheduled_tokens.values())
    capped, largest = run(4)
    uncapped, largest_uncapped = run(0)
    assert largest == 4 and largest_uncapped == 30
    assert capped == uncapped


@pytest.mark.parametrize("flag", ["long_prefill_token_threshold", "max_waiting_tokens"])
def test_flags_reach_the_scheduler(tmp_path, flag):
    args = EngineArgs(model=str(tmp_path), **{flag: 64})
    config = args.create_engine_config()
    assert getattr(config.scheduler, flag) == 64
    resolved = dataclasses.replace(config, model=dataclasses.replace(config.model, max_model_len=64))
    assert getattr(Scheduler(resolved, 64), flag) == 64
    with pytest.raises(ValueError, match=flag):
        dataclasses.replace(args, **{flag: -1}).create_engine_config()


def test_prompts_wait_while_requests_decode_then_go_together():
    # b arrives while a decodes: it waits 2 steps, then its whole prompt goes beside a's decode.
    sched = with_waiting(2, budget=16)
    assert steps_of(sched, {0: [("a", 4, 6)], 1: [("b", 10, 2, 100)]}) == [
        {"a": 4}, {"a": 1}, {"a": 1}, {"a": 1, "b": 10}, {"a": 1, "b": 1}, {"a": 1}]
    # Without the flag b goes at once; with it, b goes as soon as no request is decoding.
    assert steps_of(with_waiting(0, budget=16), {0: [("a", 4, 3)], 1: [("b", 10, 2, 100)]}) == [
        {"a": 4}, {"a": 1, "b": 10}, {"a": 1, "b": 1}]
    assert steps_of(with_waiting(8, budget=16), {0: [("a", 4, 3)], 1: [("b", 10, 2, 100)], 2: [("c", 3, 2, 200)]}) == [
        {"a": 4}, {"a": 1}, {"a": 1}, {"b": 10, "c": 3}, {"b": 1, "c": 1}]


def test_an_unfinished_prompt_waits_too_and_the_count_restarts():
    # b's prompt takes 7 tokens beside a's decode every second step; once a ends, b's rest goes at once.
    sched = with_waiting(1, budget=8)
    assert steps_of(sched, {0: [("a", 4, 5)], 1: [("b", 20, 2, 100)]}) == [
        {"a": 4}, {"a": 1}, {"a": 1, "b": 7}, {"a": 1}, {"a": 1, "b": 7}, {"b": 6}, {"b": 1}]


def test_waiting_prompts_change_no_token():
    def run(steps: int) -> dict:
        sched = with_waiting(steps, budget=12)
        results: dict[str, list[int]] = {}
        for i, n in enumerate([5, 17, 3, 9]):
            add(sched, f"r{i}", n, max_tokens=6, start=100 * i)
            _, outs = run_step(sched)
            for out in outs:
                results.setdefault(out.req_id, []).extend(out.new_token_ids)
        for req_id, tokens in run_to_completion(sched).items():
            results.setdefault(req_id, []).extend(tokens)
        return results
    assert run(3) == run(0) and len(run(0)) == 4
