"""Graceful shutdown of a real `python -m rackserve serve` subprocess: on SIGTERM new requests
(and /health) get 503, requests in flight finish within --shutdown-timeout, what outlives it is
aborted with an error event and [DONE], and the process exits 0.
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


def test_sigterm_drains_what_fits_in_the_timeout_and_exits_0(tmp_path):
    drain = 4.0
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
            sent = time.monotonic()
            deadline = sent + drain / 2
            while httpx.get(f"{url}/health").status_code != 503:   # draining: routing must stop
                assert time.monotonic() < deadline
                time.sleep(0.05)
            refused = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2, "stream": False})
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
            # In flight when the signal came, the short requests finish whole; the endless one
            # is aborted once the timeout is up, with an error event and [DONE].
            ids, reasons, error = read_stream(short_lines)
            assert len(ids) == 100 and reasons == ["length"] and not error
            assert whole.result().status_code == 200 and whole.result().json()["usage"]["completion_tokens"] == 100
            ids, reasons, error = read_stream(endless_lines)
            assert error and reasons == [] and len(ids) < 60000
            assert time.monotonic() - sent < drain + 10
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
