"""`rackserve bench pd-itl` end to end at a tiny size: it starts a prefiller and a decoder bound to
CPUs of their own, the long prompts behind `rackserve proxy`, runs the decode-only and the mixed
phase, stops everything, and records ITLs, the decoder's load, the ratio the goal is about and the
binding (the colocated setup is the same code path with one instance; left out to keep the test
short). Pins that the benchmark runs and reports, and that the decode lanes reach the decoder
without the prefiller (no KV moves in the decode-only phase) while the long prompts' KV is pulled,
never its figures."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

from rackserve.executor.cpu_bind import format_cpu_list
from tests.tiny_models import TINY_KV_CACHE_GIB


def test_bench_pd_itl_runs_disaggregated_and_records_the_goal(tiny_llama_dir, tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    prefill, decode = str(cpus[0]), str(cpus[-1])
    out = tmp_path / "pd-itl.json"
    # Its own session: a bench that fails or times out takes the instances it started with it.
    bench = subprocess.Popen([sys.executable, "-m", "rackserve", "bench", "pd-itl", "--model", tiny_llama_dir,
                              "--max-model-len", "256", "--setups", "pd",
                              "--engine-args", f"--dtype float32 --device cpu --kv-cache-memory {TINY_KV_CACHE_GIB}",
                              "--prefill-cpus", prefill, "--decode-cpus", decode, "--duration", "2",
                              "--decode-tokens", "8", "--long-prompt-tokens", "96", "--long-output-tokens", "2",
                              "--long-interval", "0.5", "--max-token-id", "500", "--output", str(out)],
                             start_new_session=True)
    try:
        assert bench.wait(timeout=300) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bench.pid, signal.SIGKILL)
    result = json.loads(out.read_text())
    rows = {(r["setup"], r["phase"]): r for r in result["rows"]}
    assert set(rows) == {("pd", "decode-only"), ("pd", "mixed")}
    for (setup, phase), row in rows.items():
        assert row["itl_count"] > 1 and 0 < row["itl_p50_ms"] <= row["itl_p90_ms"] <= row["itl_p99_ms"] <= row["itl_max_ms"]
        assert (row["long_prompts"] > 0) == (phase == "mixed")
        assert row["lane_streams"] > 0 and 0 < row["lane_concurrency"] <= 2   # the default two lanes
        assert 0 <= row["decoder_running_mean"] <= row["decoder_running_max"] and row["decoder_generation_tokens"] > 0
        assert (row["decoder_kv_transfer_blocks"] > 0) == (row["decoder_external_prefix_cache_hits"] > 0) \
            == (phase == "mixed")
    ratio = rows[("pd", "mixed")]["itl_p90_ms"] / rows[("pd", "decode-only")]["itl_p90_ms"]
    assert abs(result["p90_itl_mixed_over_decode_only"]["pd"] - ratio) < 1e-9
    assert result["goal_met"]["pd"] == (ratio <= result["goal"])
    both = format_cpu_list(tuple(sorted({cpus[0], cpus[-1]})))
    assert result["binding"] == {"prefill": prefill, "decode": decode, "colocated": both, "threads": 1}
    assert "--prefill-cpus" in result["command"]
