"""The OpenAI-compatible server end to end: `rackserve serve` in a subprocess on a tiny random
Llama with a freshly trained test tokenizer, driven by the official `openai` client (and httpx
where the client cannot send what we need: malformed bodies, a client that hangs up).
"""
from __future__ import annotations

import os
import time
from typing import NamedTuple

import httpx
import openai
import pytest

from tests.server_utils import metric_totals, start_server
from tests.tiny_models import build_tiny_model
from tests.tokenizer_utils import save_test_tokenizer

MODEL = "tiny"
MAX_MODEL_LEN = 4096
VOCAB = 512
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


class Server(NamedTuple):
    url: str
    tokenizer_dir: str


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A running server; its log is printed if it fails to come up."""
    root = tmp_path_factory.mktemp("server")
    model_dir = build_tiny_model("LlamaForCausalLM", root / "model", vocab_size=VOCAB,
                                 max_position_embeddings=MAX_MODEL_LEN)
    save_test_tokenizer(str(root / "tokenizer"), VOCAB)
    proc, url = start_server(
        ["--model", model_dir, "--tokenizer", str(root / "tokenizer"), "--served-model-name", MODEL,
         "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "320"],
        root / "server.log")
    yield Server(url, str(root / "tokenizer"))
    proc.terminate()  # SIGTERM: a clean shutdown, which must end the process promptly
    try:
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_health_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_chat_completion(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                          max_tokens=8, **GREEDY)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8


def test_chat_content_parts_equal_string(client):
    def reply(content):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                              max_tokens=6, **GREEDY).choices[0].message.content
    assert reply([{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]) == reply("one\ntwo")


def test_completion_prompts_as_text_ids_and_batch(server, client):
    from tokenizers import Tokenizer
    text = "The quick brown fox"
    ids = Tokenizer.from_file(os.path.join(server.tokenizer_dir, "tokenizer.json")).encode(text).ids
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY)
    assert by_text.object == "text_completion" and by_text.choices[0].finish_reason == "length"
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model=MODEL, prompt=[text, "def add(a, b):"], max_tokens=6,
                                      **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.completion_tokens == 12


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_concatenates_to_the_non_streaming_text(client, chat):
    def create(**kw):
        if chat:
            return client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Count with me"}], max_tokens=24,
                **GREEDY, **kw)
        return client.completions.create(model=MODEL, prompt="Count with me", max_tokens=24, **GREEDY, **kw)

    whole = create()
    chunks = list(create(stream=True, stream_options={"include_usage": True}))
    usage_chunk, chunks = chunks[-1], chunks[:-1]
    if chat:
        assert chunks[0].choices[0].delta.role == "assistant"
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
        expected = whole.choices[0].message.content
    else:
        streamed = "".join(c.choices[0].text for c in chunks)
        expected = whole.choices[0].text
    assert streamed == expected
    assert [c.choices[0].finish_reason for c in chunks].count("length") == 1
    assert chunks[-1].choices[0].finish_reason == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 24
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_cached_tokens_reported_for_a_repeated_prompt(client):
    prompt = "Caches keep the keys and values of earlier tokens; " * 8
    first = client.completions.create(model=MODEL, prompt=prompt + "first", max_tokens=2, **GREEDY)
    second = client.completions.create(model=MODEL, prompt=prompt + "second", max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens > 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Whole 16-token blocks of the shared prefix are hits.
    assert second.usage.prompt_tokens_details.cached_tokens >= 48


def test_n_samples_are_indexed_and_reproducible_with_a_seed(client):
    def sample(**kw):
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2,
                                         temperature=1.0, seed=7, extra_body={"ignore_eos": True}, **kw)
    first, again = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 16
    streamed: dict[int, str] = {0: "", 1: ""}
    for chunk in sample(stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == [c.text for c in first.choices]


def assert_tokens_spell(text: str, tokens: list[str]) -> None:
    """Tokens holding part of a character's bytes read as U+FFFD alone (as in vLLM); the rest
    must spell the text."""
    if "\ufffd" not in "".join(tokens):
        assert "".join(tokens) == text
    else:
        assert all(c in text for t in tokens for c in t if c != "\ufffd")


def test_completion_logprobs_legacy_format(client):
    resp = client.completions.create(model=MODEL, prompt="Paged attention", max_tokens=5, logprobs=3,
                                     **GREEDY)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert_tokens_spell(resp.choices[0].text, lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        # Greedy: the sampled token is the likeliest of the top 3 (fewer keys when tokens decode alike).
        assert 1 <= len(top) <= 3
        assert sampled == pytest.approx(max(top.values())) and sampled <= 0


def test_chat_logprobs_format(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    assert_tokens_spell(resp.choices[0].message.content, [t.token for t in content])
    for token in content:
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs),
                                                                 reverse=True)
        assert len(token.top_logprobs) == 2 and token.top_logprobs[0].token == token.token
        assert token.bytes == list(token.token.encode())


def test_stop_strings_end_the_text(client):
    base = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=30, **GREEDY)
    text = base.choices[0].text
    assert len(text) > 13
    stop = text[10:13]
    cut = text.index(stop)
    for stops in (stop, [stop, "never-appears"]):
        resp = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=30, stop=stops,
                                         **GREEDY)
        assert resp.choices[0].text == text[:cut]
        assert resp.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=30, stop=stop,
                                     temperature=0.0,
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:cut] + stop


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
BAD_REQUESTS = {   # name: (endpoint, body (a dict, or raw text), status, param)
    "malformed_json": ("completions", '{"prompt": "Hi",', 400, None),
    "body_not_an_object": ("completions", "[1, 2]", 400, None),
    "missing_prompt": ("completions", {"model": MODEL}, 400, "prompt"),
    "missing_messages": ("chat/completions", {"model": MODEL}, 400, "messages"),
    "mistyped_temperature": ("completions", {**COMPLETION, "temperature": "hot"}, 400, "temperature"),
    "mistyped_max_tokens": ("completions", {**COMPLETION, "max_tokens": "ten"}, 400, "max_tokens"),
    "messages_not_a_list": ("chat/completions", {**CHAT, "messages": "Hi"}, 400, "messages"),
    "image_content_part": ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages"),
    "empty_messages": ("chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    "empty_prompt": ("completions", {**COMPLETION, "prompt": ""}, 400, None),
    "prompt_too_long": ("completions", {**COMPLETION, "prompt": [5] * (MAX_MODEL_LEN + 10)}, 400, None),
    "token_id_outside_vocab": ("completions", {**COMPLETION, "prompt": [5, VOCAB + 7]}, 400, None),
    "max_tokens_zero": ("completions", {**COMPLETION, "max_tokens": 0}, 400, None),
    "max_tokens_negative": ("chat/completions", {**CHAT, "max_tokens": -3}, 400, None),
    "max_completion_tokens_zero": ("chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, None),
    "max_tokens_past_context": ("completions", {**COMPLETION, "max_tokens": MAX_MODEL_LEN}, 400, None),
    "negative_temperature": ("chat/completions", {**CHAT, "temperature": -0.5}, 400, None),
    "top_p_zero": ("completions", {**COMPLETION, "top_p": 0.0}, 400, None),
    "top_p_above_one": ("chat/completions", {**CHAT, "top_p": 1.5}, 400, None),
    "n_zero": ("completions", {**COMPLETION, "n": 0}, 400, None),
    "logprobs_above_5": ("completions", {**COMPLETION, "logprobs": 6}, 400, "logprobs"),
    "top_logprobs_above_20": ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400,
                              "top_logprobs"),
    "top_logprobs_without_logprobs": ("chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    "too_many_stop_strings": ("completions", {**COMPLETION, "stop": [f"s{i}" for i in range(17)]}, 400, None),
    "unknown_model": ("completions", {**COMPLETION, "model": "gpt-9"}, 404, "model"),
    # A streamed request is refused before its stream begins.
    "stream_prompt_too_long": ("completions", {**COMPLETION, "stream": True,
                                               "prompt": [5] * (MAX_MODEL_LEN + 10)}, 400, None),
    "stream_max_tokens_past_context": ("chat/completions", {**CHAT, "stream": True,
                                                            "max_tokens": MAX_MODEL_LEN}, 400, None),
    "stream_options_without_stream": ("completions", {**COMPLETION, "stream_options": {
        "include_usage": True}}, 400, "stream_options"),
    "logit_bias_outside_vocab": ("chat/completions", {**CHAT, "logit_bias": {str(VOCAB + 3): 10.0}}, 400, None),
    "logit_bias_key_not_an_id": ("chat/completions", {**CHAT, "logit_bias": {"hello": 10.0}}, 400, None),
    "echo": ("completions", {**COMPLETION, "echo": True}, 400, "echo"),
    # vLLM's chat template controls: before, ignored as unknown fields (another prompt answered).
    "chat_echo_with_logprobs": ("chat/completions", {**CHAT, "echo": True, "logprobs": True}, 400, "echo"),
    "chat_continue_final_message": ("chat/completions", {**CHAT, "continue_final_message": True}, 400,
                                    "continue_final_message"),
    "chat_without_generation_prompt": ("chat/completions", {**CHAT, "add_generation_prompt": False}, 400,
                                       "add_generation_prompt"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_gets_an_openai_error_and_the_server_keeps_serving(server, name):
    endpoint, body, status, param = BAD_REQUESTS[name]
    url = f"{server.url}/v1/{endpoint}"
    if isinstance(body, str):
        resp = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
    else:
        resp = httpx.post(url, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and len(error["message"]) > 10
    if param is not None:
        assert error["param"] == param
    after = httpx.post(f"{server.url}/v1/completions", json=COMPLETION)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] >= 1


def test_openai_client_raises_with_the_servers_message(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="Hi", temperature=-1.0)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=MAX_MODEL_LEN)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "Hi"}])


def _wait_until_idle(server: Server, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metric_totals(server.url)
        if m["rackserve:num_requests_running"] == 0 and m["rackserve:kv_cache_usage_perc"] == 0:
            return m
        assert time.monotonic() < deadline, f"the engine did not go idle: {m}"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non_stream"])
def test_client_disconnect_aborts_the_request(server, stream):
    body = {**COMPLETION, "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "stream": stream}
    before = _wait_until_idle(server)["rackserve:generation_tokens_total"]
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for _ in range(3):
                assert next(line for line in lines if line).startswith("data: ")
            busy = metric_totals(server.url)
            assert busy["rackserve:num_requests_running"] == 1 and busy["rackserve:kv_cache_usage_perc"] > 0
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.3))
    generated = _wait_until_idle(server)["rackserve:generation_tokens_total"] - before
    # Run to the end, the request would have generated MAX_MODEL_LEN - 8 tokens.
    assert 0 < generated < (MAX_MODEL_LEN - 8) / 2


def test_metrics_names(server, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, **GREEDY)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
                 "generation_tokens_total", "num_preemptions_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_success_total"]:
        assert f'rackserve:{name}{{' in text, name
    assert f'model_name="{MODEL}"' in text and 'finished_reason="length"' in text


def test_vllm_extra_sampling_fields_reach_the_engine(client):
    def complete(**kw):
        extra = {"ignore_eos": True, **kw.pop("extra", {})}
        return client.completions.create(model=MODEL, prompt="Prices: 12.50", max_tokens=12,
                                         extra_body=extra, **kw).choices[0]
    greedy = complete(temperature=0.0).text
    # top_k=1 and min_p=1 each leave only the likeliest token to sample at temperature 1.
    assert complete(temperature=1.0, seed=3, extra={"top_k": 1}).text == greedy
    assert complete(temperature=1.0, seed=3, extra={"min_p": 1.0}).text == greedy
    # With every id a stop token, the first token ends the request.
    stopped = complete(temperature=0.0, extra={"stop_token_ids": list(range(VOCAB))})
    assert stopped.finish_reason == "stop" and stopped.model_extra["stop_reason"] in range(VOCAB)


def test_the_front_path_probe_measures_what_the_client_waits_beyond_the_engine(server):
    """bench/front_path.py, one request at a time: the client's TTFT less the server's own (its
    time_to_first_token histogram, from the engine's arrival) is the front path (HTTP, template,
    tokenizer, the first chunk back): positive and below the client's TTFT; fitted as a + b x tokens."""
    import asyncio

    from rackserve.bench.front_path import fit, probe
    points = asyncio.run(probe(server.url, MODEL, ["alpha", "beta", "gamma"], lengths=(8, 200), repeats=2))
    assert len(points) == 4 and all(0 < p["server_ttft_s"] < p["client_ttft_s"] for p in points)
    assert all(p["front_s"] == pytest.approx(p["client_ttft_s"] - p["server_ttft_s"]) for p in points)
    assert points[1]["prompt_tokens"] > points[0]["prompt_tokens"] >= 8 and [p["words"] for p in points] == [8, 200] * 2
    a, b = fit(points)
    assert a >= 0 and b >= 0 and a + b * points[1]["prompt_tokens"] < max(p["client_ttft_s"] for p in points)


def test_the_front_path_probe_times_an_answer_of_special_tokens(server):
    """Under ignore_eos a model may answer EOS (<|im_end|>, a special token) for both of a probe's
    tokens, which streams no text by default: the probe once crashed on the missing first chunk
    (SmolLM2 on the Zen 1, session 12). Forced here with a logit bias: it still times the first token."""
    import asyncio

    from rackserve.bench.front_path import probe
    from rackserve.bench.token_text import load_server_tokenizer
    eos = sorted(load_server_tokenizer(server.tokenizer_dir).eos_token_ids)
    points = asyncio.run(probe(server.url, MODEL, ["alpha", "beta"], lengths=(8, 64), repeats=1,
                               fields={"logit_bias": {str(i): 100.0 for i in eos}}))
    assert len(points) == 2 and all(0 < p["server_ttft_s"] < p["client_ttft_s"] for p in points)
