"""bench latency / bench throughput end to end on a tiny model, HF peer included: they run, count
the tokens they claim, and write results with ratios and limits."""
import json

from rackserve.serve.cli import main
from tests.tiny_models import TINY_KV_CACHE_GIB

KV = ["--kv-cache-memory", str(TINY_KV_CACHE_GIB)]   # the default 2 GiB is 175k blocks of the tiny Llama


def test_latency_writes_rackserve_hf_and_limit(tiny_llama_dir, tmp_path):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", tiny_llama_dir, "--input-len", "40", "--output-len", "8",
                 "--runs", "2", "--output", str(out), *KV]) == 0
    result = json.loads(out.read_text())
    # Each run a prompt of its own: every TTFT a cold prefill (one prompt for all runs would have
    # had its two whole 16-token blocks served from the prefix cache after the warm-up).
    assert result["rackserve"]["cached_prompt_tokens"] == 0
    assert result["rackserve"]["decode_tok_s"] > 0 and result["hf"]["decode_tok_s"] > 0
    assert result["decode_ratio_vs_hf"] == result["rackserve"]["decode_tok_s"] / result["hf"]["decode_tok_s"]
    assert result["weight_read_limit_tok_s"] > 0 and result["limits"]["processor"]
    assert result["limits"]["mem_read_gbps"] == max(result["mem_read_gbps_before_after"])
    assert result["command"].startswith("rackserve ")
    # What the run shared the CPU with: the load, and the slices other tasks took from each system's threads.
    assert len(result["machine"]["load_average"]) == 3
    assert result["rackserve"]["decode_steps"] == 2 * 7 and result["rackserve"]["median_step_tok_s"] > 0
    assert all(isinstance(result[s]["preemptions"], int) for s in ("rackserve", "hf"))
    # What the figure ran on: this CPU's native build; a safetensors model has no packed kernel.
    from rackserve.model.native import choose_isa
    assert (result["native_isa"], result["quant_kernel"]) == (choose_isa().isa, None)


def test_throughput_serves_every_requested_token(tiny_llama_dir, tmp_path):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--model", tiny_llama_dir, "--num-prompts", "6",
                 "--input-len-range", "8,40", "--output-len-range", "2,9", "--peer-batch-size", "4",
                 "--output", str(out), *KV]) == 0
    result = json.loads(out.read_text())
    total = result["prompt_tokens"] + result["output_tokens"]
    assert abs(result["rackserve"]["processed_tok_s"] * result["rackserve"]["seconds"] - total) < 1e-6 * total
    assert result["ratio_vs_hf"] == result["hf"]["seconds"] / result["rackserve"]["seconds"]
    assert result["flops"] > 2 * total     # at least the two FLOPs per token of one parameter


def test_peers_are_a_checked_list():
    import argparse

    import pytest

    from rackserve.bench.offline import _peers
    assert _peers("hf,llama.cpp") == ["hf", "llama.cpp"] and _peers("none") == [] and _peers("hf") == ["hf"]
    with pytest.raises(argparse.ArgumentTypeError, match="vllm"):
        _peers("hf,vllm")


def test_the_llama_cpp_peer_refuses_a_checkpoint_that_is_not_gguf(tiny_llama_dir):
    import pytest

    from rackserve.bench.llama_cpp_peer import load_llama_cpp
    with pytest.raises(ValueError, match="GGUF files only"):
        load_llama_cpp(tiny_llama_dir, threads=1, n_ctx=64)
