"""Scheduling for latency: a long prompt never takes the tokens of the decodes already running
(decode first), and --long-prefill-token-threshold caps one request's prefill chunk per step."""
from __future__ import annotations

import dataclasses

from rackserve.config import EngineArgs
from rackserve.core.scheduler import Scheduler
from tests.test_core_scheduler import add, make_scheduler, run_step, run_to_completion


def with_threshold(threshold: int, **kw) -> Scheduler:
    sched = make_scheduler(**kw)
    sched.long_prefill_token_threshold = threshold
    return sched


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


def test_threshold_flag_reaches_the_scheduler(tmp_path):
    args = EngineArgs(model=str(tmp_path), long_prefill_token_threshold=64)
    assert args.create_engine_config().scheduler.long_prefill_token_threshold == 64
    bad = dataclasses.replace(args, long_prefill_token_threshold=-1)
    try:
        bad.create_engine_config()
    except ValueError as e:
        assert "long_prefill_token_threshold" in str(e)
    else:
        raise AssertionError("a negative threshold must be refused")
