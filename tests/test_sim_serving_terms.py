"""The CPU serving terms of `rackserve sim`: the front path a request spends before the engine sees it
(bench/front_path.py's measurement) lengthens each simulated TTFT by exactly its seconds."""
from __future__ import annotations

import json

import pytest

from rackserve.serve.cli import main
from rackserve.sim.calibrate import CPU_CALIBRATION


def test_the_front_path_delays_each_request_before_the_engine(tmp_path):
    with open(CPU_CALIBRATION) as f:
        device = json.load(f)
    ttfts = []
    for request_s, token_s in ((0.0, 0.0), (0.25, 1e-4)):
        hw = tmp_path / f"cpu-{request_s}.json"
        hw.write_text(json.dumps({**device, "serve_request_overhead": request_s, "serve_prompt_token_overhead": token_s}))
        out = tmp_path / f"sim-{request_s}.json"
        assert main(["sim", "--hardware", str(hw), "--workload", "random", "--random-input-len", "100",
                     "--random-output-len", "4", "--concurrency", "1", "--duration", "3", "--max-model-len", "2048",
                     "--tokenizer", "none",
                     "--output", str(out)]) == 0
        requests = [r for r in json.loads(out.read_text())["runs"][0]["requests"] if r["kind"] != "warmup"]
        ttfts.append([(r["first_chunk"] - r["start"], r["prompt_tokens"]) for r in requests])
    assert len(ttfts[0]) >= 3
    for (plain, tokens), (fronted, _) in zip(ttfts[0], ttfts[1]):
        assert fronted - plain == pytest.approx(0.25 + 1e-4 * tokens, abs=1e-6)
