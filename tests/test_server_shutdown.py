"""Graceful shutdown of a real `python -m rackserve serve` subprocess: on SIGTERM new requests
(and /health) get 503, requests in flight finish, what is left when the drain ends (a second
Ctrl-C here; --shutdown-timeout's end is the same cut) is aborted with an error event and [DONE],
and the process exits 0, also when a step is still computing when the engine stops (before: the
interpreter finalized under it and the process died of SIGABRT, rc -6).
"""
from __future__ import annotations

import itertools
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.server_utils import start_server
from tests.tiny_models import build_tiny_model

MODEL = "tiny"
IDS = [42, 71, 299, 330, 374, 17, 250, 99]


def read_stream(lines) -> tuple[list[int], list[str], bool]:
    """(token ids, finish reasons, whether an error event came) of a completions SSE stream up
    to [DONE]; the server must send [DONE] in every case."""
    ids, reasons, error = [], [], False
    for line in lines:
        if not line:
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return ids, reasons, error
        event = json.loads(data)
        if "error" in event:
            error = True
            continue
        for choice in event["choices"]:
            ids += choice["token_ids"]
            reasons += [choice["finish_reason"]] if choice["finish_reason"] else []
    raise AssertionError("the stream ended without [DONE]")


def running(url: str) -> float:
    """rackserve:num_requests_running, from /metrics."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("rackserve:num_requests_running{"))


def test_sigterm_drains_what_is_in_flight_a_second_ctrl_c_cuts_it_and_exits_0(tmp_path):
    """The drain's length pins nothing here (a loaded machine once ran past a 4 s one): it is
    longer than any run, and a second SIGINT (uvicorn's force exit) ends it once the requests
    that can finish have."""
    drain = 600.0
    # A long position range and KV room for 60000 tokens: a request that cannot finish in time.
    model = build_tiny_model("LlamaForCausalLM", tmp_path / "model", max_position_embeddings=1 << 16)
    proc, url = start_server(["--model", model, "--served-model-name", MODEL, "--device", "cpu",
                              "--skip-tokenizer-init", "--shutdown-timeout", str(drain),
                              "--num-gpu-blocks-override", "4200"], tmp_path / "server.log")
    try:
        body = {"model": MODEL, "prompt": IDS, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, ThreadPoolExecutor(1) as pool, \
                http.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 60000}) as endless, \
                http.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 100}) as short:
            whole = pool.submit(httpx.post, f"{url}/v1/completions", timeout=60,
                                json={**body, "max_tokens": 100, "stream": False})
            # All three requests are running when the signal comes (the streams sent their first
            # chunk; the whole one shows in the metrics, unless a loaded machine let a short one
            # end first: then the test only checks less).
            endless_lines, short_lines = endless.iter_lines(), short.iter_lines()
            endless_lines = itertools.chain([next(endless_lines)], endless_lines)
            short_lines = itertools.chain([next(short_lines)], short_lines)
            deadline = time.monotonic() + 10
            while running(url) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while httpx.get(f"{url}/health").status_code != 503:   # draining: routing must stop
                assert time.monotonic() < deadline
                time.sleep(0.05)
            refused = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2, "stream": False})
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
            # In flight when the signal came, the short requests finish whole; the endless one
            # is aborted once the drain is cut, with an error event and [DONE].
            ids, reasons, error = read_stream(short_lines)
            assert len(ids) == 100 and reasons == ["length"] and not error
            assert whole.result().status_code == 200 and whole.result().json()["usage"]["completion_tokens"] == 100
            proc.send_signal(signal.SIGINT)
            ids, reasons, error = read_stream(endless_lines)
            assert error and reasons == [] and len(ids) < 60000
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_a_step_still_computing_when_the_engine_stops_does_not_abort_the_process(tmp_path):
    """An 8,192-token prompt prefilled in two chunks of 4,096 by a model 768 wide, so the second
    chunk is a step of some 200 GFLOP (attention and linears; 256 wide was too quick on a quiet
    2-vCPU VM, well under a second, and so were chunks of 2,048 once the native prefill attention
    and GEMM got faster in the eighth round): SIGTERM comes once
    the first chunk's step is done (the request shows as running), so a later chunk's step is
    computing; with --shutdown-timeout 0.1 the request gets its 503, the step is not waited for,
    and the process exits 0. Before: the engine thread was joined for up to 60 s, then the
    interpreter finalized under a step still running, which aborts (rc -6, "terminate called
    without an active exception")."""
    tokens, chunk = 8192, 4096
    model = build_tiny_model("LlamaForCausalLM", tmp_path / "model", max_position_embeddings=tokens + 64,
                             hidden_size=768, num_attention_heads=12, intermediate_size=1536, num_hidden_layers=2)
    proc, url = start_server(["--model", model, "--served-model-name", MODEL, "--device", "cpu",
                              "--skip-tokenizer-init", "--shutdown-timeout", "0.1", "--max-model-len", str(tokens + 64),
                              "--max-num-batched-tokens", str(chunk), "--kv-cache-memory", "0.05"],
                             tmp_path / "server.log")
    try:
        body = {"model": MODEL, "prompt": [IDS[i % len(IDS)] for i in range(tokens)], "max_tokens": 4}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120)
            while running(url) < 1:
                assert not answer.done(), answer.result().text
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            assert answer.result().status_code == 503 and answer.result().json()["error"]["type"] == "server_error"
        assert proc.wait(timeout=60) == 0
        assert "did not end within 0.1 s of the stop" in (tmp_path / "server.log").read_text()
    finally:
        proc.kill()
