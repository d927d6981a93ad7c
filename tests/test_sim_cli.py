"""`rackserve sim`: bench serve's workloads and JSON in virtual time, readable by `bench plot`; data
parallel instances behind a router; deployments that cannot fit are refused with a reason."""
from __future__ import annotations

import dataclasses
import json

import pytest

from rackserve.bench.metrics import RunSummary
from rackserve.bench.plot import plot_results, points
from rackserve.serve.cli import main
from rackserve.sim.calibrate import CPU_CALIBRATION
from rackserve.sim.hardware import HARDWARE
from rackserve.sim.model_spec import load_model_spec


def test_sim_writes_bench_serve_json_that_bench_plot_draws(tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = main(["sim", "--hardware", CPU_CALIBRATION, "--concurrency", "1,4", "--duration", "20",
               "--max-model-len", "8192",
               "--output", str(out), "--plot", str(png)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [r["concurrency"] for r in result["runs"]] == [1, 4]
    fields = {f.name for f in dataclasses.fields(RunSummary)}
    for run in result["runs"]:
        s = run["summary"]
        assert set(s) == fields and s["valid"] and s["completed"] > 0
        assert s["throughput_per_device"] > 0 and s["interactivity_p90"] > 0
        assert 0 < s["hit_rate"] < 1 and s["hit_rate_source"] == "usage.cached_tokens" and 0 < s["server_hit_rate"] < 1
        assert run["sim"]["virtual_seconds"] >= 20 and run["sim"]["speedup"] > 0
        assert all(r["kind"] in ("main", "subagent", "warmup") for r in run["requests"])
    # More lanes: more throughput, less interactivity (the curve's two ends).
    low, high = (r["summary"] for r in result["runs"])
    assert high["throughput_per_device"] > low["throughput_per_device"]
    assert high["interactivity_p90"] < low["interactivity_p90"]
    assert len(points(result)) == 2 and png.stat().st_size > 0
    plot_results([result, result], str(tmp_path / "two.png"))


def test_data_parallel_instances_behind_a_router(tmp_path):
    out = tmp_path / "dep.json"
    rc = main(["sim", "--model", "qwen3-30b-a3b", "--hardware", "H100", "--data-parallel-size", "2",
               "--enable-expert-parallel", "--expert-skew", "0.8", "--instances", "2", "--router-policy", "round_robin",
               "--workload", "random", "--random-input-len", "2000", "--random-output-len", "50",
               "--kv-cache-memory", "20", "--concurrency", "8", "--duration", "5", "--output", str(out),
               "--summary-only"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["devices"] == 4 and result["sim"]["shape"]["data_parallel_size"] == 2
    run = result["runs"][0]
    assert "requests" not in run
    assert run["summary"]["devices"] == 4 and run["summary"]["valid"]
    assert 0 < run["sim"]["dp_idle_share"] < 1     # lockstep: the less busy DP rank waits


def test_a_deployment_that_does_not_fit_is_refused(capsys):
    rc = main(["sim", "--model", "deepseek-v3", "--hardware", "H100", "--concurrency", "1", "--duration", "1"])
    assert rc == 2
    assert "more than H100's 80 GB" in capsys.readouterr().err
    rc = main(["sim", "--model", "no-such-model", "--concurrency", "1"])
    assert rc == 2


def test_prefill_decode_disaggregation(tmp_path):
    """P/D: the first token comes from the prefill pool, the rest from the decode pool after the KV
    crossed the link; devices count both pools; the hit rate is the prefill pool's."""
    out = tmp_path / "pd.json"
    rc = main(["sim", "--model", "qwen3-30b-a3b", "--hardware", "H100", "--prefill", "1", "--decode", "1",
               "--data-parallel-size", "2", "--enable-expert-parallel", "--prefill-data-parallel-size", "1",
               "--prefill-max-num-batched-tokens", "8192", "--kv-cache-memory", "10", "--scale", "0.05",
               "--max-model-len", "32768", "--concurrency", "4", "--duration", "10", "--output", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["devices"] == 3 and result["sim"]["prefill"]["shape"]["data_parallel_size"] == 1
    run = result["runs"][0]
    assert run["summary"]["valid"] and run["summary"]["devices"] == 3
    measured = [r for r in run["requests"] if r["kind"] != "warmup"]
    assert all(r["output_tokens"] == r["max_tokens"] and len(r["chunk_times"]) >= r["max_tokens"] - 1
               for r in measured)


def test_pd_decode_pool_is_picked_by_load_whatever_the_policy(tmp_path):
    """As the router's P/D (router/disagg.py): `--router-policy` picks the prefill worker and the
    decode pool's worker is picked by load (DecodeLoadPolicy). With one prefill worker the policy
    then has nothing to pick, so the runs of three policies are the same run; kv_prefill once
    routed decodes by uncached work too and left a decode rank idle more often."""
    runs = {}
    for policy in ("least_load", "kv_prefill", "kv"):
        out = tmp_path / f"{policy}.json"
        assert main(["sim", "--model", "qwen3-30b-a3b", "--hardware", "H100", "--prefill", "1", "--decode", "1",
                     "--data-parallel-size", "2", "--enable-expert-parallel", "--prefill-data-parallel-size", "1",
                     "--prefill-max-num-batched-tokens", "8192", "--kv-cache-memory", "10", "--scale", "0.05",
                     "--max-model-len", "32768", "--concurrency", "8", "--duration", "10", "--router-policy", policy,
                     "--output", str(out), "--summary-only"]) == 0
        run = json.loads(out.read_text())["runs"][0]
        runs[policy] = (run["summary"]["completed"], run["summary"]["throughput_per_device"], run["sim"]["dp_idle_share"])
    assert runs["least_load"][0] > 0 and runs["least_load"] == runs["kv_prefill"] == runs["kv"]


def test_least_uncached_placement_keeps_sessions_on_their_cache(tmp_path):
    """Placing a request on the DP rank with the least uncached work (its prefix hits counted) finds
    more of the cache than the engine's least-load placement, which ignores where prefixes live."""
    rates = {}
    for placement in ("least_load", "least_uncached"):
        out = tmp_path / f"{placement}.json"
        rc = main(["sim", "--model", "qwen3-30b-a3b", "--hardware", "H100", "--data-parallel-size", "4",
                   "--enable-expert-parallel", "--kv-cache-memory", "20", "--scale", "0.02", "--max-model-len", "32768",
                   "--concurrency", "8", "--duration", "10", "--dp-placement", placement, "--output", str(out)])
        assert rc == 0
        rates[placement] = json.loads(out.read_text())["runs"][0]["summary"]["hit_rate"]
    assert rates["least_uncached"] > rates["least_load"] + 0.05


def test_a_kv_pool_serves_prefixes_another_instance_computed(tmp_path):
    """Round-robin sends a session's turns to instances that never saw it; a shared KV pool loads
    their prefixes at link bandwidth instead of computing them, so the same run goes faster. The
    loads are the engine's store connector's orders (sim/kv_store.py): whole blocks, each load
    its KV bytes over the pool's bandwidth."""
    results = {}
    for pool in ("0", "200"):
        out = tmp_path / f"pool{pool}.json"
        rc = main(["sim", "--model", "qwen3-30b-a3b", "--hardware", "H100", "--instances", "3",
                   "--router-policy", "round_robin", "--kv-cache-memory", "4", "--scale", "0.05",
                   "--max-model-len", "32768", "--concurrency", "8", "--duration", "5", "--kv-pool-memory", pool,
                   "--output", str(out), "--summary-only"])
        assert rc == 0
        results[pool] = json.loads(out.read_text())["runs"][0]
    assert results["0"]["sim"]["kv_pool_hit_tokens"] is None
    assert results["200"]["sim"]["kv_pool_hit_tokens"] > 0
    loads = results["200"]["sim"]["kv_pool"]
    spec = load_model_spec("qwen3-30b-a3b")
    assert loads["loads"] > 0 and loads["blocks"] * 16 == results["200"]["sim"]["kv_pool_hit_tokens"]
    assert loads["bytes"] == pytest.approx(loads["blocks"] * 16 * spec.kv_bytes_per_token())
    assert loads["seconds"] == pytest.approx(loads["bytes"] / HARDWARE["H100"].scale_out_bw)
    assert results["200"]["summary"]["ttft"]["p50"] < results["0"]["summary"]["ttft"]["p50"]


def test_kv_pool_keeps_the_most_recent_blocks():
    from rackserve.core.hashing import block_hashes
    from rackserve.sim.kv_pool import KVPool
    pool = KVPool(capacity_tokens=4 * 16, bandwidth=1e9, block_size=16)
    first, second = block_hashes(list(range(64)), 16), block_hashes(list(range(100, 164)), 16)
    pool.offer(first)
    assert pool.prefix_tokens(first, 64) == 64
    pool.offer(second[:2])          # evicts the two oldest blocks: the first prompt's prefix
    assert pool.prefix_tokens(first, 64) == 0 and pool.prefix_tokens(second, 64) == 32
    assert pool.prefix_tokens(second, 20) == 16      # never past the limit, in whole blocks


def test_cpu_is_calibrated_at_run_time_then_reused(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """No saved calibration matches a new model: `--hardware cpu` measures one with bench forward,
    saves it keyed by this machine and the model's serve defaults, and the next run reuses it."""
    from rackserve.sim import cpu_device
    monkeypatch.setattr(cpu_device, "FORWARD_SECONDS", 0.2)
    args = ["sim", "--model", tiny_llama_dir, "--hardware", "cpu", "--calibration-dir", str(tmp_path / "cal"),
            "--workload", "random", "--random-input-len", "200", "--random-output-len", "20", "--concurrency", "2",
            "--duration", "5", "--summary-only"]
    results = []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        assert main([*args, "--output", str(out)]) == 0
        results.append(json.loads(out.read_text()))
    err = capsys.readouterr().err
    assert err.count("measuring one with bench forward") == 1     # the second run found the first's
    saved = list((tmp_path / "cal").glob("*.json"))
    assert len(saved) == 1 and results[0]["sim"]["calibration"] == results[1]["sim"]["calibration"] == str(saved[0])
    calibration = json.loads(saved[0].read_text())
    assert calibration["key"] == cpu_device.serve_key(tiny_llama_dir)
    assert calibration["key"]["kv_cache_dtype"] == calibration["key"]["dtype"]     # serve's auto: the model's
    precision = {"float32": "fp32", "bfloat16": "bf16"}[calibration["key"]["dtype"]]   # bf16 on a native-bf16 CPU
    assert calibration["key"]["quantization"] == "none" and calibration["spec"]["weight_precision"] == precision
    # What the engine ran, as bench forward recorded it: no packed kernel; decodes padded unless native.
    assert calibration["spec"]["quant_kernel"] is None and calibration["spec"]["dequantize_above_tokens"] is None
    assert calibration["pads_decodes"] is not calibration["spec"]["native_decode_attention"]
    native = calibration["key"]["native_isa"] != "none"
    assert calibration["spec"]["native_decode_attention"] is native     # float32 or bf16 queries and caches
    # The code that ran, read from the engine: its native build, its step path's files; the native
    # decode step for dense float32 or bf16 weights where the library runs.
    code = calibration["engine_code"]
    assert code["native_decode_step"] is native and "rackserve/executor/model_runner.py" in code["files"]
    assert (code["native_library"] is None) is (calibration["key"]["native_isa"] == "none")
    assert {(m["batch_size"], m["new_tokens"]) for m in calibration["measured"]} == {
        (1, 1), (4, 1), (16, 1), (1, 256), (4, 256), (1, 64), (2, 64)}
    assert all(m["measured_s"] > 0 and m["simulated_s"] > 0 for m in calibration["measured"])
    assert results[0]["runs"][0]["summary"]["throughput_per_device"] == results[1]["runs"][0]["summary"][
        "throughput_per_device"]


def test_a_router_policy_change_shows_in_the_projection(tmp_path):
    """The cluster router's policies route the simulated instances from the KV events of their own
    block pools: kv routing keeps a session's turns where its prefix is cached, round robin
    scatters them, so kv finds more of the cache."""
    rates = {}
    for policy in ("round_robin", "kv"):
        out = tmp_path / f"{policy}.json"
        rc = main(["sim", "--model", "qwen3-30b-a3b", "--hardware", "H100", "--instances", "3",
                   "--router-policy", policy, "--kv-cache-memory", "4", "--scale", "0.05", "--max-model-len", "32768",
                   "--concurrency", "8", "--duration", "10", "--output", str(out), "--summary-only"])
        assert rc == 0
        rates[policy] = json.loads(out.read_text())["runs"][0]["summary"]["hit_rate"]
    assert rates["kv"] > rates["round_robin"] + 0.1


def test_mtp_drafts_in_a_closed_loop_run(tmp_path):
    """`--num-speculative-tokens 3 --acceptance-rate 0.8` under P/D: the decode pool's steps verify
    drafts (2.95 tokens kept a verifying step: 1 + 0.8 + 0.8^2 + 0.8^3), the prefill pool drafts
    none, and every request still gets exactly its output tokens; a rate outside [0, 1] is refused."""
    args = ["sim", "--model", "deepseek-v4.1-flash", "--hardware", "GB300", "--enable-expert-parallel",
            "--prefill", "1", "--decode", "1", "--data-parallel-size", "2", "--block-size", "64",
            "--kv-cache-memory", "1", "--max-model-len", "32768", "--max-num-batched-tokens", "4096",
            "--scale", "0.05", "--concurrency", "8", "--duration", "5"]
    out = tmp_path / "mtp.json"
    assert main([*args, "--num-speculative-tokens", "3", "--acceptance-rate", "0.8", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    run = result["runs"][0]
    spec = run["sim"]["spec_decode"]
    assert spec["draft_tokens"] <= 3 * spec["drafts"] and spec["mean_acceptance_length"] == pytest.approx(2.95, abs=0.2)
    assert result["sim"]["num_speculative_tokens"] == 3 and result["sim"]["prefill"]["num_speculative_tokens"] == 0
    measured = [r for r in run["requests"] if r["kind"] != "warmup"]
    assert measured and all(r["output_tokens"] == r["max_tokens"] for r in measured)
    assert main([*args, "--output", str(tmp_path / "plain.json")]) == 0
    assert json.loads((tmp_path / "plain.json").read_text())["runs"][0]["sim"]["spec_decode"] is None
    assert main([*args, "--num-speculative-tokens", "3", "--acceptance-rate", "1.5"]) == 2
