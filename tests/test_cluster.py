"""`rackserve cluster`: two instances and the router behind one URL, answering the openai
client; an instance that dies stops the whole cluster (exit 1, no child left behind), and
SIGINT stops it cleanly (exit 0, no child left behind); a 1P+1D cluster with the KV pool
disaggregates a long prompt and stops as cleanly."""
from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import openai
import pytest

from tests.server_utils import scrape_metrics, start_command
from tests.tiny_models import build_tiny_model
from tests.tokenizer_utils import save_test_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str]:
    """(model dir, tokenizer dir): one tiny Llama for every cluster here."""
    root = tmp_path_factory.mktemp("cluster")
    model = build_tiny_model("LlamaForCausalLM", root / "model", vocab_size=512, max_position_embeddings=512)
    save_test_tokenizer(str(root / "tok"), 512)
    return model, str(root / "tok")


def child_pids(log: str) -> list[int]:
    """The pids `rackserve cluster` printed for the processes it started."""
    return [int(p) for p in re.findall(r"\(pid (\d+)", log)]


def start_cluster(model: str, tokenizer: str, log: Path) -> tuple[subprocess.Popen, str]:
    return start_command(["cluster", "--instances", "2", "--model", model, "--tokenizer", tokenizer,
                          "--served-model-name", "tiny", "--device", "cpu", "--max-model-len", "512",
                          "--num-gpu-blocks-override", "64", "--threads", "2", "--health-interval", "0.3"], log)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie is gone for our purpose (reaped by its parent's exit)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_cluster_serves_one_url_and_stops_when_an_instance_dies(tiny, tmp_path):
    model, tokenizer = tiny
    proc, url = start_cluster(model, tokenizer, tmp_path / "cluster.log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        pids = child_pids((tmp_path / "cluster.log").read_text())
        assert len(pids) == 2
        os.kill(pids[0], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        assert not alive(pids[1])
        assert "instance 0 exited" in (tmp_path / "cluster.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigint_stops_the_cluster_and_every_instance(tiny, tmp_path):
    model, tokenizer = tiny
    proc, url = start_cluster(model, tokenizer, tmp_path / "cluster.log")
    try:
        pids = child_pids((tmp_path / "cluster.log").read_text())
        proc.send_signal(signal.SIGINT)   # Ctrl-C reaches the cluster alone here (no terminal)
        assert proc.wait(timeout=60) == 0
        assert not any(alive(pid) for pid in pids)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_prefill_decode_cluster_with_the_kv_pool_answers_and_stops_clean(tiny, tmp_path):
    model, tokenizer = tiny
    proc, url = start_command(["cluster", "--prefill", "1", "--decode", "1", "--kv-pool", "--kv-pool-segment-bytes",
                               str(16 << 20), "--pd-threshold-tokens", "16", "--model", model, "--tokenizer",
                               tokenizer, "--served-model-name", "tiny", "--device", "cpu",
                               "--max-model-len", "512", "--num-gpu-blocks-override", "128", "--block-size", "4",
                               "--threads", "2", "--health-interval", "0.3"], tmp_path / "cluster.log")
    try:
        log = (tmp_path / "cluster.log").read_text()
        assert "prefill instance 0" in log and "decode instance 1" in log and "KV pool master" in log
        pids = child_pids(log)
        assert len(pids) == 3
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="tiny", prompt="a prompt long enough to prefill elsewhere " * 4,
                                        max_tokens=4, temperature=0.0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4 and out.usage.prompt_tokens > 16
        assert scrape_metrics(url)['rackserve_router:pd_decisions_total{decision="remote_prefill"}'] == 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert not any(alive(pid) for pid in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
