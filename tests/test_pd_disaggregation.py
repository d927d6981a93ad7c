"""Prefill/decode disaggregation end to end: a prefill server and a decode server (real processes,
MooncakeConnector over TCP), `rackserve proxy` in front, the official `openai` client: greedy tokens
identical to one instance (the prefiller serving the request alone, after the disaggregated run,
so the pull saw none of it), streamed or not, n > 1, a one-token prompt and prompts of
several blocks plus a partial one; the prefiller's blocks are freed once pulled, or when the lease
runs out; a prefiller killed while or before the decoder pulls leaves requests that still complete.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_utils import (metric_totals, scrape_metrics, serve_args, start_command, start_commands, start_server,
                                stop_all)
from tests.tiny_models import build_tiny_model
from tests.tokenizer_utils import save_test_tokenizer

MODEL = "tiny"
VOCAB = 512
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
LEASE_S = 3.0


def _kv_config(role: str, **extra) -> str:
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role,
                       "kv_connector_extra_config": {"lease_seconds": LEASE_S, "transfer_timeout": 5.0, **extra}})


def _start_proxy(prefill: str, decode: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    return start_command(["proxy", "--prefill", prefill, "--decode", decode, "--uvicorn-log-level", "warning"],
                         log_path, timeout=60)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd")
    model_dir = build_tiny_model("LlamaForCausalLM", root / "model", vocab_size=VOCAB, max_position_embeddings=512)
    save_test_tokenizer(str(root / "tokenizer"), VOCAB)
    base = ["--model", model_dir, "--tokenizer", str(root / "tokenizer"), "--served-model-name", MODEL,
            "--device", "cpu", "--max-model-len", "512", "--num-gpu-blocks-override", "256", "--block-size", "4",
            # float32: the tokens must match across two instances' different batches, which bf16 (auto
            # on a CPU with native bf16) rounds differently enough to flip the tiny model's near-ties.
            "--dtype", "float32"]
    procs = []
    try:
        urls, pids = {}, {}
        roles = {"prefill": "kv_producer", "decode": "kv_consumer"}
        started = start_commands([(serve_args(base + ["--kv-transfer-config", _kv_config(role)]), root / f"{name}.log")
                                  for name, role in roles.items()])
        for name, (proc, url) in zip(roles, started):
            procs.append(proc)
            urls[name], pids[name] = url, proc.pid
        proc, urls["proxy"] = _start_proxy(urls["prefill"], urls["decode"], root / "proxy.log")
        procs.append(proc)
        yield {**urls, "base": base, "root": root, "pids": pids}
    finally:
        stop_all(procs)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _wait_kv_free(url: str, timeout: float) -> float:
    """Seconds until the instance holds no KV block."""
    start = time.monotonic()
    while metric_totals(url)["rackserve:kv_cache_usage_perc"] > 0:
        assert time.monotonic() - start < timeout, "KV blocks were never freed"
        time.sleep(0.05)
    return time.monotonic() - start


PROMPTS = [[7], list(range(10, 21)), "def fibonacci(n):\n    if n <"]


@pytest.mark.parametrize("prompt", PROMPTS, ids=["one_token", "blocks_plus_partial", "text"])
def test_completions_through_the_proxy_match_one_instance(cluster, prompt):
    got = _client(cluster["proxy"]).completions.create(model=MODEL, prompt=prompt, max_tokens=8, n=2,
                                                       logprobs=1, **GREEDY)
    want = _client(cluster["prefill"]).completions.create(model=MODEL, prompt=prompt, max_tokens=8, n=2,
                                                          logprobs=1, **GREEDY)
    assert [c.logprobs.tokens for c in got.choices] == [c.logprobs.tokens for c in want.choices]
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == want.usage.completion_tokens == 16


def test_streamed_chat_through_the_proxy_matches_one_instance(cluster):
    messages = [{"role": "user", "content": "Tell me about the sea and the ships upon it."}]
    stream = _client(cluster["proxy"]).chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                               stream=True, stream_options={"include_usage": True},
                                                               **GREEDY)
    chunks = list(stream)
    want = _client(cluster["prefill"]).chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **GREEDY)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == want.usage.prompt_tokens
    # The decoder loaded all but the last prompt token through the connector.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == want.usage.prompt_tokens - 1
    decoder = metric_totals(cluster["decode"])
    assert decoder["rackserve:external_prefix_cache_hits_total"] > 0
    assert decoder["rackserve:external_prefix_cache_queries_total"] >= decoder["rackserve:external_prefix_cache_hits_total"]
    assert decoder["rackserve:kv_transfer_blocks_total"] > 0 and decoder["rackserve:kv_transfer_bytes_total"] > 0
    assert decoder["rackserve:kv_transfer_load_seconds_count"] > 0
    # Pulled blocks are released at once, long before the lease would run out.
    assert _wait_kv_free(cluster["prefill"], LEASE_S) < LEASE_S


def test_a_decoder_that_never_comes_frees_the_blocks_at_lease_end(cluster):
    reply = httpx.post(f"{cluster['prefill']}/v1/completions", json={
        "model": MODEL, "prompt": list(range(30, 60)), "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = reply["kv_transfer_params"]
    assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == 8
    assert metric_totals(cluster["prefill"])["rackserve:kv_cache_usage_perc"] > 0
    assert _wait_kv_free(cluster["prefill"], LEASE_S + 5) > LEASE_S / 2
    # A decoder that comes too late recomputes: the request completes with the right tokens.
    want = _client(cluster["prefill"]).completions.create(model=MODEL, prompt=list(range(30, 60)), max_tokens=5,
                                                         **GREEDY)
    late = _client(cluster["decode"]).completions.create(
        model=MODEL, prompt=list(range(30, 60)), max_tokens=5, temperature=0.0,
        extra_body={"ignore_eos": True, "kv_transfer_params": params})
    assert late.choices[0].text == want.choices[0].text


def test_prefiller_killed_while_or_before_the_decoder_pulls_still_completes(cluster):
    """SIGKILL the prefiller just after the decoder starts pulling a 75-block prompt (the kill lands in
    the handshake, the pin or the read), then decode a second prompt it held: both recompute."""
    root = cluster["root"]
    proc, url = start_server(cluster["base"] + ["--kv-transfer-config", _kv_config("kv_producer")],
                             root / "doomed.log")
    prompts = {"during": [(7 * i) % 500 + 3 for i in range(300)], "before": list(range(100, 130))}

    def decode(name: str, params: dict) -> str:
        return _client(cluster["decode"]).completions.create(
            model=MODEL, prompt=prompts[name], max_tokens=5, temperature=0.0,
            extra_body={"ignore_eos": True, "kv_transfer_params": params}).choices[0].text

    try:
        params = {name: httpx.post(f"{url}/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
            for name, prompt in prompts.items()}
        with ThreadPoolExecutor(1) as pool:
            during = pool.submit(decode, "during", params["during"])
            time.sleep(0.05)
            proc.kill()   # SIGKILL: no goodbye on the side channel
            got = {"during": during.result(timeout=60)}
    finally:
        proc.kill()
        proc.wait(timeout=30)
    got["before"] = decode("before", params["before"])
    for name, prompt in prompts.items():
        want = _client(cluster["prefill"]).completions.create(model=MODEL, prompt=prompt, max_tokens=5, **GREEDY)
        assert got[name] == want.choices[0].text, name
    _wait_kv_free(cluster["decode"], 10)


def test_bad_kv_transfer_params_get_a_400(cluster):
    resp = httpx.post(f"{cluster['decode']}/v1/completions", json={
        "model": MODEL, "prompt": "hi", "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": True}})
    assert resp.status_code == 400 and "lacks" in resp.json()["error"]["message"]
    assert httpx.get(f"{cluster['decode']}/health").status_code == 200


def test_a_decoder_killed_mid_stream_ends_the_proxys_stream_with_an_error_event(cluster):
    """A decoder SIGKILLed mid-stream: the proxy ends the stream it relays with an OpenAI error
    event and [DONE] (before last round's fix the relay just broke), stays up (its /health 503 while
    the decoder is down, a 502 for the next request), and the prefiller holds no block."""
    root = cluster["root"]
    doomed, decoder = start_server(cluster["base"] + ["--kv-transfer-config", _kv_config("kv_consumer")],
                                   root / "doomed-decoder.log")
    procs = [doomed]
    try:
        proxy_proc, proxy = _start_proxy(cluster["prefill"], decoder, root / "doomed-proxy.log")
        procs.append(proxy_proc)
        body = {"model": MODEL, "prompt": list(range(10, 40)), "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{proxy}/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            doomed.kill()
            rest = [line for line in lines if line]
        assert resp.status_code == 200 and json.loads(first[6:])["choices"]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["type"] == "server_error" and "instance behind the proxy failed" in error["message"]
        assert proxy_proc.poll() is None and httpx.get(f"{proxy}/health").status_code == 503
        assert httpx.post(f"{proxy}/v1/completions", json={**body, "stream": False}).status_code == 502
        _wait_kv_free(cluster["prefill"], LEASE_S + 5)
    finally:
        stop_all(procs)


def _completed(url: str) -> float:
    """Requests the instance finished other than by an abort."""
    return sum(v for k, v in scrape_metrics(url).items()
               if k.startswith("rackserve:request_success_total{") and 'finished_reason="abort"' not in k)


def _wait_idle(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while any(metric_totals(url).get(f"rackserve:{name}", 0.0) for name in ("num_requests_running",
                                                                            "num_requests_waiting")):
        assert time.monotonic() < deadline, "the instance never went idle"
        time.sleep(0.05)


@pytest.mark.parametrize("hop,stream", [("prefill", True), ("decode", False)])
def test_a_client_that_leaves_during_a_hop_aborts_it_on_that_instance(cluster, hop, stream):
    """The client hangs up while the proxy waits on a hop (that instance is SIGSTOPped, so the hop
    is in flight whatever the machine's speed). Before: the proxy went on, so the prefiller
    prefilled and held the blocks for a decoder, and the decoder then generated, all for nobody.
    Now the proxy closes that hop's connection, so the instance drops the request (aborted, or
    never started if it read the hang-up first) and the next hop never starts: once a later
    request has gone through and both instances are idle, only that one completed there."""
    stopped = cluster["pids"][hop]
    before = {name: _completed(cluster[name]) for name in ("prefill", "decode")}
    body = {"model": MODEL, "prompt": list(range(60, 90)), "max_tokens": 50, "ignore_eos": True, "stream": stream}
    os.kill(stopped, signal.SIGSTOP)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{cluster['proxy']}/v1/completions", json=body, timeout=1.0)
        time.sleep(0.5)   # the proxy hears the hang-up
    finally:
        os.kill(stopped, signal.SIGCONT)
    later = httpx.post(f"{cluster['proxy']}/v1/completions", json={**body, "max_tokens": 2, "stream": False},
                       timeout=60)
    assert later.status_code == 200
    for name in ("prefill", "decode"):
        _wait_idle(cluster[name])
    # The prefiller finished the left request's prefill when the hang-up came during the decode hop,
    # and may have when it came during its own: the abort can land after the step that prefilled it
    # (seen once in a fresh-clone CI run on a Zen 3). Either way the decoder never started it.
    done = _completed(cluster["prefill"]) - before["prefill"]
    assert done == 2 if hop == "decode" else done in (1, 2)
    assert _completed(cluster["decode"]) - before["decode"] == 1
    _wait_kv_free(cluster[hop], LEASE_S)
