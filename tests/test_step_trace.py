"""A step trace runs `rackserve sim`'s closed loop with the real model executing each step and the
virtual clock advanced by the measured step times: every step is recorded as the scheduler formed
it, and calibrate.py fits to those steps."""
from __future__ import annotations

import json

import pytest

from rackserve.bench.step_trace import main
from rackserve.sim.calibrate import FIRST_STEPS, TRACE_POINTS, trace_points
from rackserve.sim.cost import SeqWork
from tests.tiny_models import TINY_KV_CACHE_GIB


def test_trace_records_the_real_steps_and_drives_the_clock_by_them(tiny_llama_dir, tmp_path):
    out = tmp_path / "trace.json"
    assert main(["--model", tiny_llama_dir, "--hardware", "H100", "--workload", "random", "--random-input-len", "100",
                 "--random-output-len", "6", "--max-num-batched-tokens", "64", "--concurrency", "2",
                 "--duration", "0.5", "--kv-cache-memory", str(TINY_KV_CACHE_GIB), "--output", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    steps = run["steps"]
    done = [r for r in run["requests"] if r["error"] is None]
    assert done and all(r["output_tokens"] == r["max_tokens"] == 6 for r in done)
    # Prompts of ~100 tokens under a 64-token budget: chunked; the first step is the first chunk.
    assert steps[0]["batches"][0][0][:2] == [64, 0]
    every = [w for s in steps for w in s["batches"][0]]
    # Every token computed once, but for prefix hits (prompts of two plays share the template and the
    # marker's first tokens: a block of 16 once they reach its end).
    assert sum(w[0] for w in every) == sum(r["prompt_tokens"] - r["cached_tokens"] + r["output_tokens"] - 1
                                           for r in run["requests"])
    assert all(s["measured_s"] > 0 and s["modelled_s"] > 0 for s in steps)
    # The requests' times are the measured steps' (no think time in the random workload).
    assert run["sim"]["virtual_seconds"] == pytest.approx(sum(s["measured_s"] for s in steps), rel=0.05, abs=0.01)
    points = trace_points({"runs": [run]})
    assert len(points) == min(TRACE_POINTS, len(steps) - FIRST_STEPS)     # at most TRACE_POINTS, spread
    assert all(isinstance(w, SeqWork) for batch, _ in points for w in batch)
