"""bench/sim_dp_idle.py's split of lockstep idle by the kind of step, on hand-made steps: each step's
idle (the slowest rank's busy time minus each rank's) lands in the kind its ranks' work makes it."""
from __future__ import annotations

import pytest

from bench.sim_dp_idle import rank_kind, split
from rackserve.sim.cost import SeqWork


def test_rank_kind_tells_prompt_chunks_from_decodes_and_verifies():
    assert rank_kind([]) == "empty"
    assert rank_kind([SeqWork(1, 100)]) == "decode"
    assert rank_kind([SeqWork(4, 100, drafts=3)]) == "decode"                 # an MTP verify of 3 drafts
    assert rank_kind([SeqWork(4, 100, drafts=3), SeqWork(5, 0)]) == "prefill"  # a 5-token prompt
    assert rank_kind([SeqWork(1, 0, samples=False)]) == "prefill"             # a chunk that samples nothing


def _step(busy, kinds, decodes):
    return {"start": 0.0, "tokens": [1] * len(busy), "context": [0] * len(busy), "dense": [0.0] * len(busy),
            "attention": list(busy), "moe": [0.0] * len(busy), "kinds": kinds, "decodes": decodes}


def test_split_puts_each_steps_idle_under_its_kind():
    steps = [_step([3.0, 0.0], ["prefill", "empty"], [1, 0]),          # idle 3
             _step([5.0, 1.0], ["prefill", "decode"], [1, 4]),         # idle 4
             _step([2.0, 1.5], ["prefill", "prefill"], [2, 2]),        # idle 0.5
             _step([1.0, 0.75], ["decode", "decode"], [8, 6]),         # idle 0.25
             _step([1.0, 1.0], ["decode", "decode"], [7, 7])]          # idle 0
    out = split(steps, budget=16)
    assert out["idle"] == pytest.approx(7.75)
    assert out["idle_by_step_kind"] == pytest.approx({
        "a_rank_empty": 3.0, "prefill_on_some_ranks": 4.0, "prefill_on_every_rank": 0.5,
        "decode_only_counts_differ": 0.25, "decode_only_same_count": 0.0})
    assert out["steps_by_kind"]["decode_only_same_count"] == 1
    assert sum(out["step_kind_of_idle"].values()) == pytest.approx(1.0)
    assert out["idle_attention_of_idle"] == pytest.approx(1.0)
