"""The router with prefill and decode pools, end to end: two prefill servers and two decode
servers (real processes, MooncakeConnector over TCP, KV events on), a real `rackserve router
--prefill-worker ... --decode-worker ...` in front, the official `openai` client. Greedy tokens
equal one instance's, streamed or not; a prompt whose uncached part is under
--pd-threshold-tokens runs whole on a decoder (no prefiller sees it); a decode hop whose decoder
stops answering is retried on the other; a dead prefiller is routed around. (The last test kills
a prefiller: it runs last.)"""
from __future__ import annotations

import json
import signal
import time

import httpx

import openai
import pytest

from tests.server_utils import metric_totals, scrape_metrics, serve_args, start_command, start_commands, stop_all
from tests.tiny_models import build_tiny_model
from tests.tokenizer_utils import save_test_tokenizer

MODEL, VOCAB, BS, THRESHOLD = "tiny", 512, 4, 40
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


def _flags(role: str) -> list[str]:
    kv = {"kv_connector": "MooncakeConnector", "kv_role": role,
          "kv_connector_extra_config": {"lease_seconds": 10.0, "transfer_timeout": 5.0}}
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0",
              "replay_endpoint": "tcp://*:0", "topic": "kv"}
    return ["--kv-transfer-config", json.dumps(kv), "--kv-events-config", json.dumps(events)]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    root = tmp_path_factory.mktemp("router_pd")
    model = build_tiny_model("LlamaForCausalLM", root / "model", vocab_size=VOCAB, max_position_embeddings=512)
    save_test_tokenizer(str(root / "tok"), VOCAB)
    # float32: the answers are compared token for token with one instance's, and in bf16 a step's
    # path (a decode-only step natively in float32, a mixed one through the modules in bf16) can
    # flip a near-tie of the tiny random model (test_pd_disaggregation pins it for the same reason).
    base = ["--model", model, "--tokenizer", str(root / "tok"), "--served-model-name", MODEL, "--device", "cpu",
            "--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks-override", "256", "--block-size", str(BS)]
    roles = ["kv_producer", "kv_producer", "kv_consumer", "kv_consumer"]
    procs = []
    try:
        started = start_commands([(serve_args(base + _flags(role)), root / f"instance{i}.log")
                                  for i, role in enumerate(roles)])
        procs = [p for p, _ in started]
        (_, p0), (_, p1), (_, d0), (_, d1) = started
        router, url = start_command(["router", "--prefill-worker", p0, "--prefill-worker", p1, "--decode-worker", d0,
                                     "--decode-worker", d1, "--pd-threshold-tokens", str(THRESHOLD),
                                     "--health-interval", "0.3", "--health-timeout", "1"], root / "router.log",
                                    timeout=60)
        procs.append(router)
        yield {"prefill": [p0, p1], "decode": [d0, d1], "router": url, "procs": procs}
    finally:
        stop_all(procs)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _decisions(url: str) -> dict[str, float]:
    return {d: scrape_metrics(url).get(f'rackserve_router:pd_decisions_total{{decision="{d}"}}', 0.0)
            for d in ("local", "remote_prefill")}


def _served(url: str) -> float:
    return metric_totals(url).get("rackserve:request_success_total", 0.0)


LONG = "Disaggregation moves the prompt's keys and values from one instance to another " * 3


def test_long_prompts_disaggregate_and_answer_like_one_instance(pd):
    before, pulled = _decisions(pd["router"]), _pulled(pd["decode"])
    via, direct = _client(pd["router"]), _client(pd["prefill"][0])
    got = via.completions.create(model=MODEL, prompt=LONG, max_tokens=8, n=2, logprobs=1, **GREEDY)
    want = direct.completions.create(model=MODEL, prompt=LONG, max_tokens=8, n=2, logprobs=1, **GREEDY)
    assert [c.logprobs.tokens for c in got.choices] == [c.logprobs.tokens for c in want.choices]
    assert got.usage.prompt_tokens == want.usage.prompt_tokens > THRESHOLD   # usage: the whole request
    assert got.usage.completion_tokens == 16
    messages = [{"role": "user", "content": LONG + "Tell me more."}]
    chunks = list(via.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    want = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == want.usage.prompt_tokens
    after = _decisions(pd["router"])
    assert after["remote_prefill"] - before["remote_prefill"] == 2 and after["local"] == before["local"]
    # The decoders pulled the prompts' KV instead of computing it.
    assert _pulled(pd["decode"]) > pulled


def _pulled(urls: list[str]) -> float:
    return sum(metric_totals(u).get("rackserve:kv_transfer_blocks_total", 0.0) for u in urls)


def test_short_prompts_stay_on_the_decoder(pd):
    before, prefilled = _decisions(pd["router"]), [_served(u) for u in pd["prefill"]]
    for prompt in ("hi", "a short one"):
        got = _client(pd["router"]).completions.create(model=MODEL, prompt=prompt, max_tokens=6, **GREEDY)
        want = _client(pd["prefill"][0]).completions.create(model=MODEL, prompt=prompt, max_tokens=6, **GREEDY)
        assert got.choices[0].text == want.choices[0].text
        prefilled[0] += 1   # the reference call above
    after = _decisions(pd["router"])
    assert after["local"] - before["local"] == 2 and after["remote_prefill"] == before["remote_prefill"]
    assert [_served(u) for u in pd["prefill"]] == prefilled


def test_a_decode_hop_whose_decoder_stops_answering_is_retried_on_the_other(pd):
    """SIGSTOP the decoder the router picks: after the prefill hop, the decode hop waits on it
    until the health check gives up, then goes to the other decoder with the same
    kv_transfer_params (the prefiller holds the blocks for its lease), which pulls the KV."""
    (d0, d1), router = pd["decode"], pd["router"]
    prefix = "Decode hop retried: "
    # d0 caches the prompt's first blocks: between idle decoders the tie goes to it.
    _client(d0).completions.create(model=MODEL, prompt=prefix, max_tokens=1, **GREEDY)
    deadline = time.monotonic() + 10
    while not next(i for i in httpx.get(f"{router}/router").json()["instances"] if i["url"] == d0)["workers"][0][
            "index_blocks"]:
        assert time.monotonic() < deadline, "the router never saw d0's KV events"
        time.sleep(0.1)
    before, retries = _decisions(router), metric_totals(router).get("rackserve_router:retries_total", 0.0)
    decoded = [_served(d) for d in (d0, d1)]
    stopped = pd["procs"][2]
    stopped.send_signal(signal.SIGSTOP)
    try:
        got = _client(router).with_options(timeout=30).completions.create(
            model=MODEL, prompt=prefix + LONG, max_tokens=5, **GREEDY)
        assert metric_totals(router)["rackserve_router:retries_total"] == retries + 1
        assert _decisions(router)["remote_prefill"] == before["remote_prefill"] + 1
        assert _served(d1) == decoded[1] + 1
    finally:
        stopped.send_signal(signal.SIGCONT)
    want = _client(pd["prefill"][1]).completions.create(model=MODEL, prompt=prefix + LONG, max_tokens=5, **GREEDY)
    assert got.choices[0].text == want.choices[0].text
    deadline = time.monotonic() + 15
    while not all(i["healthy"] for i in httpx.get(f"{router}/router").json()["instances"]):
        assert time.monotonic() < deadline, "the stopped decoder never rejoined"
        time.sleep(0.2)


def test_a_dead_prefiller_is_routed_around(pd):
    pd["procs"][0].send_signal(signal.SIGKILL)
    pd["procs"][0].wait(timeout=30)
    before = _decisions(pd["router"])
    live = pd["prefill"][1]
    prompts = [f"{i}: " + LONG for i in range(4)]
    got = [_client(pd["router"]).completions.create(model=MODEL, prompt=p, max_tokens=5, **GREEDY).choices[0].text
           for p in prompts]
    want = [_client(live).completions.create(model=MODEL, prompt=p, max_tokens=5, **GREEDY).choices[0].text
            for p in prompts]
    assert got == want
    # Every one was still disaggregated, on the prefiller that is left.
    assert _decisions(pd["router"])["remote_prefill"] - before["remote_prefill"] == 4
