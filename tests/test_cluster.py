"""`rackserve cluster`: two instances and the router behind one URL, answering the openai
client; an instance SIGKILLed mid-run is routed around (its streams end with an OpenAI error
event, the other instance's run on, new requests are served) and started again, and SIGTERM then
stops everything (exit 0, no child left behind); a 1P+1D cluster with the KV pool disaggregates a
long prompt and SIGINT (Ctrl-C) stops it as cleanly: both signals take cluster.py's one stop path."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_utils import metric_totals, scrape_metrics, start_command
from tests.tiny_models import build_tiny_model
from tests.tokenizer_utils import save_test_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str]:
    """(model dir, tokenizer dir): one tiny Llama for every cluster here."""
    root = tmp_path_factory.mktemp("cluster")
    model = build_tiny_model("LlamaForCausalLM", root / "model", vocab_size=512, max_position_embeddings=2048)
    save_test_tokenizer(str(root / "tok"), 512)
    return model, str(root / "tok")


def child_pids(log: str) -> list[int]:
    """The pids `rackserve cluster` printed for the processes it started."""
    return [int(p) for p in re.findall(r"\(pid (\d+)", log)]


def start_cluster(model: str, tokenizer: str, log: Path) -> tuple[subprocess.Popen, str]:
    return start_command(["cluster", "--instances", "2", "--model", model, "--tokenizer", tokenizer,
                          "--served-model-name", "tiny", "--device", "cpu", "--max-model-len", "2048",
                          "--num-gpu-blocks-override", "512", "--threads", "2", "--health-interval", "0.3"], log)


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


STREAM_TOKENS = 1900   # ~4 s of a tiny model's steps here: room for a test process the CI machine starves


def _stream(url: str, prompt: str) -> list[str]:
    """A completions stream's data lines, through [DONE] (the test fails if it is cut off)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert resp.status_code == 200 and lines[-1] == "data: [DONE]", lines[-2:]
    return lines


def _active(url: str) -> list[int]:
    return [i["workers"][0]["active_requests"] if i["healthy"] else -1 for i in httpx.get(f"{url}/router").json()["instances"]]


def test_an_instance_killed_mid_run_is_routed_around_and_started_again(tiny, tmp_path):
    """Before: one instance SIGKILLed stopped the whole cluster (exit 1), cutting the other
    instance's streams without an error event."""
    model, tokenizer = tiny
    proc, url = start_cluster(model, tokenizer, tmp_path / "cluster.log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        pids = child_pids((tmp_path / "cluster.log").read_text())
        assert len(pids) == 2
        first = httpx.get(f"{url}/router").json()["instances"][0]["url"]
        generated = metric_totals(first).get("rackserve:generation_tokens_total", 0.0)
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(_stream, url, f"stream {i} " * 4) for i in range(4)]
            deadline = time.monotonic() + 30
            while True:   # both instances streaming, and instance 0's requests still far from done
                assert time.monotonic() < deadline, _active(url)
                totals = metric_totals(first)
                running = totals.get("rackserve:num_requests_running", 0.0)
                # The least advanced of the running requests there has made at most the tokens made
                # since the streams began over their number; with 100 or more still to make it needs
                # more steps than the moment before the SIGSTOP can hold.
                made = totals.get("rackserve:generation_tokens_total", 0.0) - generated
                far = made <= (STREAM_TOKENS - 100) * max(running, 1.0)
                if min(_active(url)) >= 1 and running >= 1 and far:
                    break
                assert far, "instance 0 ran its streams too far before the test saw them; nothing to cut"
                time.sleep(0.01)
            # Stopped first, so its streams cannot end before the kill however fast the machine
            # (the router may still be relaying what the instance had sent, not the rest).
            os.kill(pids[0], signal.SIGSTOP)
            os.kill(pids[0], signal.SIGKILL)
            ends = [f.result()[-2] for f in streams]
        errors = [e for e in ends if '"error"' in e]
        assert errors and all(json.loads(e[6:])["error"]["type"] == "server_error" for e in errors)
        assert any('"finish_reason":"length"' in e for e in ends)   # the other instance's ran on
        out = client.completions.create(model="tiny", prompt="hello again", max_tokens=3)
        assert out.usage.completion_tokens == 3
        deadline = time.monotonic() + 120
        while _active(url)[0] < 0:   # instance 0 is started again and rejoins the pool
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "cluster.log").read_text()
            time.sleep(0.2)
        log = (tmp_path / "cluster.log").read_text()
        exits = re.findall(r"instance (\d+) exited with code (-?\d+)", log)
        assert exits[:1] == [("0", "-9")] and all(i == "0" for i, _ in exits), log   # instance 1 ran on
        # One start per exit, the last one up: a start that could not come up (a log line says why)
        # is started again after its backoff, never twice at once.
        restarted = child_pids(log)[2:]
        assert len(restarted) == len(exits) and alive(restarted[-1]), log
        assert not any(alive(pid) for pid in restarted[:-1]), log
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert not any(alive(pid) for pid in pids + restarted)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_restarts_back_off_while_an_instance_cannot_stay_up():
    """At once after a run of a minute or more; after a shorter one, 1 s, then twice the last wait."""
    from rackserve.router.restarts import Restarts
    r = Restarts(2, now=0.0)
    assert not r.due(0, -9, 10.0) and r.due(0, -9, 11.0)      # lived 10 s: waits 1 s
    assert not r.due(0, -9, 12.0) and not r.due(0, -9, 13.9) and r.due(0, -9, 14.0)   # lived 1 s: 2 s
    assert r.due(0, 1, 100.0)                                  # lived 86 s: at once
    assert r.due(1, -9, 61.0)                                  # the other instance has its own count


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
