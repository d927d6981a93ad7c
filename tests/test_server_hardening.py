"""No single request can take the server down: hostile inputs against a real `rackserve serve`
(every answer a 4xx in OpenAI's error format, the server healthy after each), schema fuzzing of
the whole API with schemathesis from the server's own OpenAPI document, a flood of streaming and
non-streaming requests of which a third are cancelled mid-stream (nothing left running, no KV
block leaked, every completed request with its exact token count, the finish counters adding up
to what was sent), and back-pressure (429 with Retry-After past --max-waiting-requests).
"""
from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from tests.server_utils import metric_totals, scrape_metrics, start_server
from tests.tiny_models import build_tiny_model
from tests.tokenizer_utils import save_test_tokenizer

MODEL = "tiny"
MAX_MODEL_LEN = 256
VOCAB = 512


class Server(NamedTuple):
    url: str
    proc: subprocess.Popen


def _serve(root, *flags: str) -> Server:
    model_dir = build_tiny_model("LlamaForCausalLM", root / "model", vocab_size=VOCAB,
                                 max_position_embeddings=MAX_MODEL_LEN)
    save_test_tokenizer(str(root / "tokenizer"), VOCAB)
    proc, url = start_server(
        ["--model", model_dir, "--tokenizer", str(root / "tokenizer"), "--served-model-name", MODEL,
         "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "400",
         *flags], root / "server.log")
    return Server(url, proc)


def _stop(server: Server) -> None:
    server.proc.terminate()
    try:
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = _serve(tmp_path_factory.mktemp("hardening"))
    yield s
    _stop(s)


def metric(url: str, name: str) -> float:
    """A rackserve metric, summed over its label sets."""
    return metric_totals(url).get(f"rackserve:{name}", 0.0)


def wait_idle(url: str, timeout: float = 60) -> None:
    """Until nothing runs or waits and no KV block is held (aborts land a step later)."""
    deadline = time.monotonic() + timeout
    while True:
        busy = [metric(url, n) for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        if busy == [0, 0, 0]:
            return
        assert time.monotonic() < deadline, f"still busy (running, waiting, kv usage): {busy}"
        time.sleep(0.2)


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMP = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}


def raw(body: dict, **values_as_text: str) -> str:
    """A JSON body with some values written as given (NaN, Infinity: not standard JSON, but
    accepted by many parsers, ours included)."""
    text = json.dumps({**body, **{k: f"@{k}@" for k in values_as_text}})
    for key, value in values_as_text.items():
        text = text.replace(f'"@{key}@"', value)
    return text


# name: (endpoint, body: a dict, raw text or raw bytes, the status expected)
HOSTILE = {
    # The two that killed the engine, and their kin: values that leave no token to sample.
    "temperature_nan_top_p": ("chat/completions", raw({**CHAT, "top_p": 0.5}, temperature="NaN"), 400),
    "temperature_nan": ("chat/completions", raw(CHAT, temperature="NaN"), 400),
    "temperature_infinity": ("completions", raw(COMP, temperature="Infinity"), 400),
    "top_p_nan": ("completions", raw(COMP, top_p="NaN"), 400),
    "min_p_nan": ("completions", raw(COMP, min_p="NaN"), 400),
    "presence_penalty_minus_infinity": ("completions", raw(COMP, presence_penalty="-Infinity"), 400),
    "frequency_penalty_nan": ("chat/completions", raw(CHAT, frequency_penalty="NaN"), 400),
    "repetition_penalty_tiny": ("chat/completions", {**CHAT, "repetition_penalty": 1e-40, "top_p": 0.5}, 400),
    "repetition_penalty_huge": ("completions", {**COMP, "repetition_penalty": 1e30}, 400),
    "logit_bias_nan": ("completions", raw({**COMP, "logit_bias": {"5": 0}}).replace('"5": 0', '"5": NaN'), 400),
    "logit_bias_too_large": ("completions", {**COMP, "logit_bias": {"5": 1e300}}, 400),
    "logit_bias_negative_id": ("completions", {**COMP, "logit_bias": {"-5": 1.0}}, 400),
    "logit_bias_too_many": ("completions", {**COMP, "logit_bias": {str(i): 1.0 for i in range(2000)}}, 400),
    # Counts that would hold the server's memory or time.
    "n_2_pow_64": ("completions", {**COMP, "n": 2**64}, 400),
    "n_100000": ("chat/completions", {**CHAT, "n": 100000}, 400),
    "best_of_huge": ("completions", {**COMP, "best_of": 10**6}, 400),
    "prompts_5000": ("completions", {**COMP, "prompt": ["Hi"] * 5000}, 400),
    "token_prompts_5000": ("completions", {**COMP, "prompt": [[1, 2]] * 5000}, 400),
    "max_tokens_2_pow_70": ("completions", {**COMP, "max_tokens": 2**70}, 400),
    "seed_2_pow_64": ("completions", {**COMP, "seed": 2**64}, 400),
    "stop_string_too_long": ("completions", {**COMP, "stop": "x" * 5000}, 400),
    "stop_token_ids_too_many": ("completions", {**COMP, "stop_token_ids": list(range(5000))}, 400),
    "top_logprobs_21": ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400),
    # 8 prompts x n 128 x 200 tokens x 6 logprobs: 1.2M entries held whole, past --max-logprob-entries.
    "logprob_entries_past_the_bound": ("completions", {**COMP, "prompt": [[1, 2]] * 8, "n": 128,
                                                       "max_tokens": 200, "logprobs": 5}, 400),
    "prompt_token_negative": ("completions", {**COMP, "prompt": [1, -4, 2]}, 400),
    "prompt_token_huge": ("completions", {**COMP, "prompt": [1, 2**63]}, 400),
    # Sizes: refused before they are tokenized whole (10 MB) or read whole (past the body limit).
    "prompt_10_mb": ("completions", {**COMP, "prompt": "word " * 2_000_000}, 400),
    "message_10_mb": ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a" * 10_000_000}]}, 400),
    "body_20_mb": ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a" * 20_000_000}]}, 413),
    # Wrong types, nested junk, bad encodings, unknown roles, fields we do not support.
    "prompt_an_object": ("completions", {**COMP, "prompt": {"text": "Hi"}}, 400),
    "prompt_mixed_list": ("completions", {**COMP, "prompt": ["Hi", 3, [1]]}, 400),
    "prompt_nested_junk": ("completions", {**COMP, "prompt": [[[[1]]]]}, 400),
    "messages_nested_junk": ("chat/completions", {**CHAT, "messages": [[[{"role": "user"}]]]}, 400),
    "content_a_number": ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400),
    "unknown_role": ("chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "Hi"}]}, 400),
    "role_missing": ("chat/completions", {**CHAT, "messages": [{"content": "Hi"}]}, 400),
    "n_a_float": ("completions", {**COMP, "n": 1.5}, 400),
    "n_a_string": ("completions", {**COMP, "n": "2"}, 400),
    "temperature_a_list": ("completions", {**COMP, "temperature": [1]}, 400),
    "stream_a_string": ("completions", {**COMP, "stream": "yes"}, 400),
    "tools": ("chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    # Before: ignored as unknown fields, so a client that required a call got free text.
    "tool_choice_required": ("chat/completions", {**CHAT, "tool_choice": "required"}, 400),
    "tool_choice_named": ("chat/completions", {**CHAT, "tool_choice": {"type": "function",
                                                                        "function": {"name": "f"}}}, 400),
    "tool_choice_nonsense": ("chat/completions", {**CHAT, "tool_choice": {"x": [1, 2]}}, 400),
    "functions": ("chat/completions", {**CHAT, "functions": [{"name": "f", "parameters": {}}]}, 400),
    "function_call_named": ("chat/completions", {**CHAT, "function_call": {"name": "f"}}, 400),
    # Before: ignored as unknown fields, so a client asking for JSON got free text.
    "response_format_json": ("chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 400),
    "min_tokens": ("completions", {**COMP, "min_tokens": 3}, 400),
    "body_null": ("completions", "null", 400),
    "body_deeply_nested": ("completions", "[" * 100_000 + "]" * 100_000, 400),
    "body_invalid_utf8": ("completions", b'{"model": "tiny", "prompt": "\xff\xfe\xfa", "max_tokens": 2}', 400),
    "body_empty": ("chat/completions", "", 400),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_input_gets_an_openai_4xx_and_the_server_stays_healthy(server, name):
    endpoint, body, status = HOSTILE[name]
    url = f"{server.url}/v1/{endpoint}"
    if isinstance(body, (str, bytes)):
        resp = httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    else:
        resp = httpx.post(url, json=body, timeout=60)
    assert resp.status_code == status, resp.text[:500]
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and len(error["message"]) > 10
    assert httpx.get(f"{server.url}/health").status_code == 200
    ok = httpx.post(f"{server.url}/v1/completions", json=COMP, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_a_tool_choice_that_asks_for_no_call_is_answered(server, choice):
    """With no tools, "none" and "auto" both mean a plain answer (only "required", a named function
    or junk are refused above)."""
    resp = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "tool_choice": choice, "function_call": choice},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("extra", [
    {"top_k": VOCAB, "top_p": 1.0},             # a top_k of the whole vocabulary filters nothing
    {"top_k": 10 * VOCAB, "top_p": 0.9},
    {"top_p": 1e-300},                          # rounds to 0 in float32: the top token stays
    {"top_p": 1e-300, "top_k": 3, "min_p": 1.0},
    {"repetition_penalty": 0.01, "temperature": 2.0},
    {"logit_bias": {"7": -100, "8": 100}, "temperature": 1.5},
], ids=str)
def test_edge_sampling_values_sample_normally(server, extra):
    resp = httpx.post(f"{server.url}/v1/completions", json={**COMP, "max_tokens": 8, "ignore_eos": True, **extra},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 8


def test_schema_fuzzing_finds_no_server_error(server, tmp_path):
    """schemathesis generates requests from /openapi.json (valid and invalid); none may get a 5xx.
    A fixed seed and no --max-time: every run sends the same cases (the whole coverage phase and 15
    fuzzed examples an operation); a time budget would make fuzzing repeat until it is spent."""
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    assert st is not None, "schemathesis is a test dependency (pip install -e '.[test]')"
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert "CompletionRequest" in spec["components"]["schemas"]
    run = subprocess.run(
        [st, "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error", "--max-examples", "15",
         "--seed", "7", "--workers", "1", "--request-timeout", "60",
         "--phases", "examples,coverage,fuzzing", "--suppress-health-check", "all", "--no-color"],
        capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert httpx.get(f"{server.url}/health").status_code == 200
    wait_idle(server.url)


async def _one(client: httpx.AsyncClient, url: str, rng: random.Random) -> dict:
    """One request of the flood; returns what was sent and what came back."""
    n = rng.choice([1, 1, 1, 2, 3])
    max_tokens = rng.randint(1, 24)
    stream = rng.random() < 0.6
    cancel_after = rng.randint(1, 6) if stream and rng.random() < 0.5 else None   # chunks, then leave
    chat = rng.random() < 0.5
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(rng.randint(1, 12)))
    body = {"model": MODEL, "max_tokens": max_tokens, "n": n, "ignore_eos": True, "stream": stream,
            "temperature": rng.choice([0.0, 0.8])}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    endpoint = f"{url}/v1/{'chat/completions' if chat else 'completions'}"
    result = {"n": n, "max_tokens": max_tokens, "cancelled": False, "usage": None, "status": None}
    if not stream:
        resp = await client.post(endpoint, json=body)
        result["status"], result["body"] = resp.status_code, resp.text[:300]
        result["usage"] = resp.json().get("usage")
        return result
    async with client.stream("POST", endpoint, json=body) as resp:
        result["status"] = resp.status_code
        chunks = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            event = json.loads(line[6:])
            if event.get("usage"):
                result["usage"] = event["usage"]
            if cancel_after is not None and chunks >= cancel_after:
                result["cancelled"] = True
                break   # leaving the block closes the connection mid-stream
    return result


def test_flood_with_cancellations_leaves_nothing_behind(server):
    url, total = server.url, 240
    sent_before = metric(url, "request_success_total")
    rng = random.Random(1234)

    async def flood() -> list[dict]:
        limits = httpx.Limits(max_connections=total, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*[_one(client, url, random.Random(rng.random())) for _ in range(total)])

    results = asyncio.run(flood())
    assert all(r["status"] == 200 for r in results), [r for r in results if r["status"] != 200][:3]
    completed = [r for r in results if not r["cancelled"]]
    for r in completed:   # ignore_eos: every sample runs to exactly max_tokens
        assert r["usage"]["completion_tokens"] == r["n"] * r["max_tokens"], r
    assert sum(r["cancelled"] for r in results) > total // 10
    wait_idle(url)
    samples_sent = sum(r["n"] for r in results)
    by_reason = {k: v for k, v in scrape_metrics(url).items() if k.startswith("rackserve:request_success_total")}
    assert metric(url, "request_success_total") - sent_before == samples_sent, by_reason
    assert not any('"error"' in k and v > 0 for k, v in by_reason.items()), by_reason
    assert sum(v for k, v in by_reason.items() if '"abort"' in k) > 0, by_reason   # some left mid-generation
    print(f"flood: {total} requests, {samples_sent} samples, {sum(r['cancelled'] for r in results)} left "
          f"mid-stream; finished by reason: {by_reason}")
    assert httpx.get(f"{url}/health").status_code == 200


def test_full_waiting_queue_answers_429_with_retry_after(tmp_path):
    server = _serve(tmp_path, "--max-waiting-requests", "4", "--max-num-seqs", "2")
    try:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=300) as client:
                body = {**COMP, "max_tokens": 40, "ignore_eos": True}
                return await asyncio.gather(*[client.post(f"{server.url}/v1/completions", json=body)
                                              for _ in range(24)])

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429} and codes.count(200) >= 4 and 429 in codes, codes
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        wait_idle(server.url)
        assert httpx.post(f"{server.url}/v1/completions", json=COMP, timeout=60).status_code == 200
    finally:
        _stop(server)


def test_bench_overload_reports_rates(server, tmp_path):
    out = tmp_path / "overload.json"
    run = subprocess.run([sys.executable, "-m", "rackserve.serve.cli", "bench", "overload", "--url", server.url,
                          "--rates", "5,10", "--duration", "1", "--output", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert [r["sent"] for r in result["rates"]] == [5, 10]
    assert all(r["ok"] == r["sent"] and r["refused_429"] == 0 for r in result["rates"])
    assert result["sustained_rps"] > 0 and result["processor"]


def test_logprob_entries_past_the_bound_get_a_400_naming_it_with_the_openai_client(server):
    """A non-streaming response is held whole: prompts x n x max_tokens x (logprobs + 1) entries
    past --max-logprob-entries (2**20) are refused up front, naming the bound; one under it runs."""
    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=[[1, 2]] * 8, n=128, max_tokens=200, logprobs=5)
    error = refused.value.body
    assert error["param"] == "logprobs" and "--max-logprob-entries" in error["message"]
    assert "1228800 logprob entries" in error["message"]        # 8 x 128 x 200 x 6
    ok = client.completions.create(model=MODEL, prompt=[1, 2], n=2, max_tokens=3, logprobs=5,
                                   extra_body={"ignore_eos": True})
    assert [len(c.logprobs.tokens) for c in ok.choices] == [3, 3]


def test_text_offset_advances_by_each_token_text_as_vllm(server):
    """vLLM's rule (serving_completion._create_completion_logprobs): each offset is the previous
    plus the previous token's text, special tokens' included, even where skip_special_tokens
    leaves that text out of `text`; a stream's chunk starts at the text sent so far."""
    eos = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "<|im_end|>",
                                                     "add_special_tokens": False}).json()["tokens"]
    assert len(eos) == 1
    body = {**COMP, "max_tokens": 3, "ignore_eos": True, "logprobs": 1, "logit_bias": {str(eos[0]): 100}}
    choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["text"] == "" and choice["logprobs"]["tokens"] == ["<|im_end|>"] * 3
    assert choice["logprobs"]["text_offset"] == [0, 10, 20]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    # A chunk may carry several tokens (deltas a reader has not taken yet are folded, as vLLM's
    # RequestOutputCollector does): within a chunk the offsets still advance by each token's text.
    offsets = [e["choices"][0]["logprobs"]["text_offset"] for e in events]
    assert sum(len(o) for o in offsets) == 3 and all(o == [10 * i for i in range(len(o))] for o in offsets)


def test_a_conversation_or_ids_past_the_context_are_refused_before_any_work(server):
    """Before: a chat of many empty messages passed the character bound (its texts are empty), so
    the template rendered it and the tokenizer held the GIL over the result: 300k messages (14 MB)
    stalled every other stream 10 s before the engine's 400. /tokenize rendered it too, and
    /detokenize decoded any number of ids. More messages than the context has tokens, or more ids,
    are now refused at once, naming the count."""
    import openai
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    empty = [{"role": "user", "content": ""}] * 100_000
    # Posted as JSON by httpx: the openai client spends ~50 s of its own Python turning 100k messages
    # into a body (measured on a Zen 1) before the server sees a byte.
    resp = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": empty, "max_tokens": 2},
                      timeout=60)
    error = resp.json()["error"]
    assert resp.status_code == 400 and error["type"] == "invalid_request_error", resp.text[:300]
    assert error["param"] == "messages" and "of 100000 messages" in error["message"], error
    resp = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": empty}, timeout=60)
    assert resp.status_code == 400 and "of 100000 messages" in resp.json()["error"]["message"], resp.text[:300]
    resp = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": [5] * (MAX_MODEL_LEN + 1)})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tokens", resp.text[:300]
    ok = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": [5] * MAX_MODEL_LEN})
    assert ok.status_code == 200
    assert client.chat.completions.create(model=MODEL, messages=empty[:3], max_tokens=2).choices


def test_a_large_logprobs_answer_does_not_hold_other_clients(tmp_path):
    """Before: a non-streaming chat answer's logprobs were shaped on the event loop, a pydantic
    object per entry, then dumped in one call: at --max-logprob-entries' 2**20 that held every
    other client 19-60 s (bench/logprob_shaping.py). Now the answer's JSON is built in a thread, a
    step at a time. /health is polled beside the same request without and with logprobs (269k
    entries, which held the loop 3-40 s before): its longest wait must not grow by that much."""
    import openai
    server = _serve(tmp_path, "--num-gpu-blocks-override", "1200")   # 64 x 200 tokens at once
    body = {**CHAT, "n": 64, "max_tokens": 200, "ignore_eos": True, "temperature": 1.0}

    def longest_health_wait(extra: dict) -> tuple[float, httpx.Response]:
        waits, done = [0.0], threading.Event()

        def poll() -> None:
            with httpx.Client(timeout=300) as client:
                while not done.is_set():
                    begin = time.perf_counter()
                    assert client.get(f"{server.url}/health").status_code == 200
                    waits.append(time.perf_counter() - begin)
                    time.sleep(0.01)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            resp = httpx.post(f"{server.url}/v1/chat/completions", json={**body, **extra}, timeout=300)
        finally:
            done.set()
            poller.join()
        assert resp.status_code == 200, resp.text[:300]
        return max(waits), resp

    try:
        plain, _ = longest_health_wait({})
        held, resp = longest_health_wait({"logprobs": True, "top_logprobs": 20})
    finally:
        _stop(server)
    answer = openai.types.chat.ChatCompletion.model_validate(resp.json())   # as the client reads it
    assert len(answer.choices) == 64
    assert all(len(c.logprobs.content) == 200 and len(c.logprobs.content[-1].top_logprobs) == 20
               for c in answer.choices)
    assert held < 2 * plain + 1.0, f"/health waited {held:.2f} s beside logprobs, {plain:.2f} s without"
