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
        hw.write_text(json.dumps({**device, "serve_request_overhead": request_s,
                                  "serve_prompt_token_overhead": token_s}))
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


def test_steps_of_decodes_run_natively_get_their_own_fitted_factor():
    """An engine that runs steps of decodes in one native call (another code path than its prompt
    chunks): the fit finds that path's factor apart, and the cost model applies it to steps of
    decodes alone, never to a step with a prompt chunk."""
    import dataclasses

    from rackserve.sim.calibrate import _cpu, fit
    from rackserve.sim.cost import CostModel, SeqWork
    from rackserve.sim.model_spec import load_model_spec
    spec = load_model_spec("smollm2-135m-instruct").with_precision("fp32", "fp32")
    truth = _cpu(300e9, 25e9, {"gemm_flops": 0.6, "attn_flops": 0.4, "mem_bw": 0.9, "attn_mem_bw": 0.5},
                 (0.008, 0.002), "synthetic", pads_decodes=False, decode_scale=0.6)
    plain = dataclasses.replace(truth, decode_scale=1.0)
    decodes, mixed = [SeqWork(1, 500)] * 4, [SeqWork(1, 500)] * 3 + [SeqWork(64, 0, False)]
    assert CostModel(spec, truth).step([decodes]).seconds == pytest.approx(
        0.6 * CostModel(spec, plain).step([decodes]).seconds)
    assert CostModel(spec, truth).step([mixed]).seconds == CostModel(spec, plain).step([mixed]).seconds
    model = CostModel(spec, truth)
    batches = [[SeqWork(1, c)] * b for b in (1, 8, 32) for c in (256, 2048)] + [[SeqWork(256, 0)] * b for b in (1, 4)]
    points = [(b, model.step([b]).seconds) for b in batches]
    fitted = fit(spec, points, 300e9, 25e9, pads_decodes=False, native_decode_step=True)
    assert fitted.decode_scale != 1.0
    for batch, seconds in points:
        assert CostModel(spec, fitted).step([batch]).seconds == pytest.approx(seconds, rel=0.05)
