"""The router end to end: two real `rackserve serve` instances publishing KV events, a real
`rackserve router` in front, driven by the official `openai` client. A session's later turns
land where its prefix lives, load spreads when no prefix is cached, a router that starts late
rebuilds its index by replay, errors pass through, and a dead instance is routed around
without losing a request. (The last test kills an instance: it runs last.)"""
from __future__ import annotations

import json
import signal
import socket
import struct
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import openai
import pytest

from tests.server_utils import metric_totals, scrape_metrics, serve_args, start_command, start_commands
from tests.tiny_models import build_tiny_model
from tests.tokenizer_utils import save_test_tokenizer

MODEL, VOCAB, MAX_MODEL_LEN, BS = "tiny", 512, 1024, 16
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


class Cluster(NamedTuple):
    instances: list[tuple[subprocess.Popen, str]]
    router: subprocess.Popen
    url: str
    tokenizer: str


def start_router(workers: list[str], log_path: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    return start_command(["router", "--health-interval", "0.3", "--health-timeout", "1", *flags,
                          *[a for w in workers for a in ("--worker", w)]], log_path, timeout=60)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("router")
    model = build_tiny_model("LlamaForCausalLM", root / "model", vocab_size=VOCAB, max_position_embeddings=MAX_MODEL_LEN)
    save_test_tokenizer(str(root / "tok"), VOCAB)
    instances = []
    try:
        commands = []
        for i in range(2):
            events = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:0",
                                 "replay_endpoint": "tcp://*:0", "topic": "kv"})
            commands.append((serve_args(
                ["--model", model, "--tokenizer", str(root / "tok"), "--served-model-name", MODEL, "--device", "cpu",
                 "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "256", "--block-size", str(BS),
                 "--kv-events-config", events]), root / f"instance{i}.log"))
        instances += start_commands(commands)
        router, url = start_router([u for _, u in instances], root / "router.log")
        yield Cluster(instances, router, url, str(root / "tok"))
        router.terminate()
        router.wait(timeout=30)
    finally:
        for proc, _ in instances:
            proc.terminate()
        for proc, _ in instances:
            proc.wait(timeout=30)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def routed(url: str) -> dict[str, float]:
    """rackserve_router:requests_total by instance URL."""
    counts: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("rackserve_router:requests_total{"):
            instance = line.split('instance="')[1].split('"')[0]
            counts[instance] = counts.get(instance, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def test_instance_reports_its_kv_events(cluster):
    info = httpx.get(f"{cluster.instances[0][1]}/kv_events").json()
    assert info["enable_kv_cache_events"] and info["block_size"] == BS and info["data_parallel_size"] == 1
    assert info["endpoints"][0].startswith("tcp://*:") and info["replay_endpoints"][0].startswith("tcp://*:")
    assert info["topic"] == "kv" and info["tokenizer"] == cluster.tokenizer


def test_session_turns_land_where_their_prefix_lives(cluster):
    c = client(cluster.url)
    for session in range(3):
        messages = [{"role": "system", "content": f"Session {session}: " + "the quick brown fox " * 30}]
        before = routed(cluster.url)
        cached = []
        for turn in range(3):
            messages.append({"role": "user", "content": f"turn {turn} of session {session}, please go on"})
            reply = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            time.sleep(0.2)   # the finished turn's KV events reach the router
        went = delta(before, routed(cluster.url))
        assert len(went) == 1 and sum(went.values()) == 3, went   # every turn on one instance
        assert metric_totals(cluster.url).get("rackserve_router:moved_off_cache_total", 0.0) == 0
        assert cached[0] < cached[1] < cached[2], cached


def test_load_spreads_when_no_prefix_is_cached(cluster):
    before = routed(cluster.url)
    c = client(cluster.url)
    prompts = [f"{i} " + "Caches keep the keys and values of earlier tokens " * 6 for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: c.completions.create(model=MODEL, prompt=p, max_tokens=24, **GREEDY), prompts))
    went = delta(before, routed(cluster.url))
    assert len(went) == 2 and min(went.values()) >= 2, went


def test_router_answers_like_the_instance_streaming_or_not(cluster):
    direct, via = client(cluster.instances[0][1]), client(cluster.url)
    prompt = "Paged attention splits the cache into blocks"
    want = direct.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY).choices[0].text
    assert via.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY).choices[0].text == want
    chunks = list(via.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == 12
    messages = [{"role": "user", "content": prompt}]
    want = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **GREEDY)
    got = via.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, **GREEDY)
    assert got.choices[0].message.content == want.choices[0].message.content
    chunks = list(via.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True, **GREEDY))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        via.completions.create(model=MODEL, prompt=prompt, max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        via.completions.create(model="other", prompt=prompt, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="data_parallel_rank"):   # the instance has one DP rank
        direct.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"data_parallel_rank": 1})


def _comparable(answer: Any) -> Any:
    """An answer without what differs between any two calls (id, created) or depends on which
    instance's cache it met: cached_tokens, and logprobs past 4 decimals (float32 sums of a
    prefix-cached prefill and a fresh one differ in the last bits)."""
    if isinstance(answer, float):
        return round(answer, 4)
    if isinstance(answer, list):
        return [_comparable(a) for a in answer]
    if not isinstance(answer, dict):
        return answer
    return {k: _comparable(v) for k, v in answer.items() if k not in ("id", "created", "prompt_tokens_details")}


def _fold(a, b, key: str = ""):
    """Two stream events as one: text and content concatenated, lists (tokens, logprobs, ids)
    extended, choices matched by index, any other field the later non-null one. A server may send
    a step's tokens in one chunk or several (it folds deltas a slow reader has not taken yet, as
    vLLM's RequestOutputCollector does), so two streams of one answer agree only once folded."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {**a, **{k: _fold(a[k], v, k) if k in a else v for k, v in b.items()}}
    if key == "choices":
        merged = {c["index"]: c for c in a}
        for c in b:
            merged[c["index"]] = _fold(merged[c["index"]], c) if c["index"] in merged else c
        return [merged[i] for i in sorted(merged)]
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    if key in ("text", "content") and isinstance(a, str) and isinstance(b, str):
        return a + b
    return a if b is None else b


def _answers(url: str, path: str, body: dict) -> list[dict]:
    reply = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    if not body.get("stream"):
        return [_comparable(reply.json())]
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    folded = events[0]
    for event in events[1:]:
        folded = _fold(folded, event)
    for choice in folded["choices"]:
        # A chunk's offsets start at the text sent so far, which a held-back partial character
        # makes depend on where the chunks fall (test_server_hardening pins the rule itself).
        (choice.get("logprobs") or {}).pop("text_offset", None)
    return [_comparable(folded)]


@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_forwarded_by_the_router_answer_exactly_as_the_instance_does(cluster, stream):
    """The router sends token ids (tokenize once); every field of the answer is the direct one's."""
    base = {"model": MODEL, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    completion = {**base, "prompt": "Paged attention splits the cache into blocks", "logprobs": 2,
                  "return_token_ids": True}
    chat = {**base, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}],
            "logprobs": True, "top_logprobs": 2}
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        want = _answers(cluster.instances[0][1], path, body)
        assert _answers(cluster.url, path, body) == want, path


def test_the_router_learns_each_instances_prices_from_its_streams(cluster):
    """Streamed answers with usage teach the kv policy what prefill and decode cost (TTFT against
    prefill ahead, ITL against active blocks); /router shows each worker's learned price."""
    c = client(cluster.url)

    def stream(i: int) -> None:
        for _ in c.completions.create(model=MODEL, prompt=f"{i} " + "prices are learned " * (2 + i), max_tokens=6,
                                      stream=True, stream_options={"include_usage": True}, **GREEDY):
            pass
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(stream, range(10)))
    workers = [w for i in httpx.get(f"{cluster.url}/router").json()["instances"] for w in i["workers"]]
    for worker in workers:
        price = worker["price"]
        assert price is not None and 6.0 <= price["output_tokens"] <= 12.0, worker   # this test's and earlier streams
        # Either part of a line may be 0 (pricing.LinearFit: a negative intercept is refitted
        # through the origin, as on a Zen 3 where the streams' ITL grew with the active blocks).
        assert price["first_token_s"] + price["prefill_s_per_block"] > 0, price
        assert price["step_s"] + price["step_s_per_block"] > 0, price


def test_a_late_router_rebuilds_its_index_by_replay(cluster, tmp_path):
    """Prefixes cached before this router existed still draw their requests (replay socket)."""
    prompt = "Session late: " + "a prefix hit skips work already done " * 12
    before = routed(cluster.url)
    client(cluster.url).completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY)
    [holder] = delta(before, routed(cluster.url))
    time.sleep(0.2)
    proc, url = start_router([u for _, u in cluster.instances], tmp_path / "late.log")
    try:
        deadline = time.monotonic() + 10
        while True:   # the replay runs as the router starts; its index fills without any request
            state = httpx.get(f"{url}/router").json()
            blocks = {i["url"]: i["workers"][0]["index_blocks"] for i in state["instances"]}
            if blocks[holder] > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert blocks[holder] > 0, blocks
        for _ in range(3):
            reply = client(url).completions.create(model=MODEL, prompt=prompt + " more", max_tokens=2, **GREEDY)
            assert reply.usage.prompt_tokens_details.cached_tokens > 0, reply.usage
        assert routed(url) == {holder: 3}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _busy(url: str) -> float:
    totals = metric_totals(url)
    return totals["rackserve:num_requests_running"] + totals["rackserve:num_requests_waiting"]


def _aborted(url: str) -> float:
    return sum(v for k, v in scrape_metrics(url).items()
               if k.startswith("rackserve:request_success_total{") and 'finished_reason="abort"' in k)


def test_a_client_that_leaves_a_whole_answer_aborts_it_on_the_instance(cluster):
    """A non-streaming request whose client hangs up once the instance runs it: the instance
    aborts it (counted as an abort, nothing left running or waiting), and so does the router."""
    urls = [u for _, u in cluster.instances]
    aborted = sum(_aborted(u) for u in urls)
    left = metric_totals(cluster.url).get("rackserve_router:client_disconnects_total", 0.0)
    body = json.dumps({"model": MODEL, "prompt": "a long answer", "max_tokens": 1000, "ignore_eos": True}).encode()
    host, port = cluster.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 30
        while not sum(_busy(u) for u in urls):
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.02)
    deadline = time.monotonic() + 30
    while sum(_busy(u) for u in urls) or sum(_aborted(u) for u in urls) == aborted:
        assert time.monotonic() < deadline, "the instance still runs the request of a client that left"
        time.sleep(0.05)
    assert sum(_aborted(u) for u in urls) == aborted + 1
    assert metric_totals(cluster.url)["rackserve_router:client_disconnects_total"] == left + 1
    assert all(i["workers"][0]["active_requests"] == 0 for i in httpx.get(f"{cluster.url}/router").json()["instances"])


class ResetNextPost:
    """A TCP proxy in front of an instance that resets the connection carrying the next POST once
    armed: a real connection reset from a live instance (as a keep-alive connection the server
    closed just as the client reused it gives), everything else passed through."""

    def __init__(self, target: str) -> None:
        self.target = ("127.0.0.1", int(target.rsplit(":", 1)[1]))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.armed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client_side, _ = self.listener.accept()
            except OSError:
                return   # closed
            upstream = socket.create_connection(self.target)
            for src, dst, from_client in ((client_side, upstream, True), (upstream, client_side, False)):
                threading.Thread(target=self._pipe, args=(src, dst, from_client), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if from_client and data.startswith(b"POST ") and self.armed.is_set():
                    self.armed.clear()
                    src.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # RST
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            sock.close()

    def close(self) -> None:
        self.listener.close()


def test_one_failed_connection_does_not_take_a_live_instance_out(cluster, tmp_path):
    """The request is retried on the other instance; the instance whose connection was reset
    answers the health check the failure starts, so it keeps its place and its index."""
    (_, first), (_, second) = cluster.instances
    proxy = ResetNextPost(first)
    router, url = start_router([proxy.url, second], tmp_path / "router.log")
    try:
        prompt = "Reset once: " + "a connection may drop while the instance is fine " * 6
        client(first).completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY)   # cached there
        deadline = time.monotonic() + 10
        while not httpx.get(f"{url}/router").json()["instances"][0]["workers"][0]["index_blocks"]:
            assert time.monotonic() < deadline, "the router never saw the instance's KV events"
            time.sleep(0.1)
        time.sleep(0.3)   # the rest of that prompt's events
        proxy.armed.set()
        out = client(url).completions.create(model=MODEL, prompt=prompt + " again", max_tokens=3, **GREEDY)
        assert out.usage.completion_tokens == 3
        assert not proxy.armed.is_set()                       # kv sent it where its prefix lives: reset
        assert metric_totals(url)["rackserve_router:retries_total"] == 1
        time.sleep(1.0)   # the check the failure started, and a few periodic ones
        state = httpx.get(f"{url}/router").json()["instances"][0]
        assert state["healthy"] and state["workers"][0]["index_blocks"] > 0
        assert "leaves the pool" not in (tmp_path / "router.log").read_text()
    finally:
        router.terminate()
        router.wait(timeout=30)
        proxy.close()


def test_an_instance_that_stops_answering_leaves_and_rejoins(cluster):
    """SIGSTOP: connections hang rather than fail. The request waiting on it is retried on the
    other instance once the health check gives up; after SIGCONT the instance rejoins."""
    prompt = "Frozen: " + "the scheduler allocates blocks as sequences grow " * 8
    before = routed(cluster.url)
    client(cluster.url).completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY)
    [stopped] = delta(before, routed(cluster.url))   # its prefix lives there: kv sends the next turn there
    stopped_proc = next(p for p, u in cluster.instances if u == stopped)
    time.sleep(0.3)
    retries = metric_totals(cluster.url).get("rackserve_router:retries_total", 0.0)
    stopped_proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        out = client(cluster.url).with_options(timeout=30).completions.create(
            model=MODEL, prompt=prompt + " again", max_tokens=4, **GREEDY)
        assert out.usage.completion_tokens == 4 and time.monotonic() - start < 20
        state = httpx.get(f"{cluster.url}/router").json()
        assert [i["healthy"] for i in state["instances"] if i["url"] == stopped] == [False]
        assert metric_totals(cluster.url).get("rackserve_router:retries_total", 0.0) == retries + 1
    finally:
        stopped_proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        state = httpx.get(f"{cluster.url}/router").json()
        if all(i["healthy"] for i in state["instances"]):
            break
        time.sleep(0.2)
    assert all(i["healthy"] for i in state["instances"]), state


def test_a_dead_instance_is_routed_around(cluster):
    c = client(cluster.url)
    # A stream that already started ends with an error event when its instance dies.
    stream = c.completions.create(model=MODEL, prompt="a long story", max_tokens=900, stream=True, **GREEDY)
    next(iter(stream))
    state = httpx.get(f"{cluster.url}/router").json()
    [busy] = [i["url"] for i in state["instances"] if i["workers"][0]["active_requests"]]
    dead_proc = next(p for p, u in cluster.instances if u == busy)
    dead_proc.kill()
    dead_proc.wait()
    with pytest.raises(openai.APIError, match="mid-stream"):
        for _ in stream:
            pass
    # No request is lost: one sent before the health check notices is retried on the live one.
    for i in range(4):
        out = c.completions.create(model=MODEL, prompt=f"{i} after the crash", max_tokens=4, **GREEDY)
        assert out.usage.completion_tokens == 4
        chunks = list(c.completions.create(model=MODEL, prompt=f"{i} streamed", max_tokens=4, stream=True, **GREEDY))
        assert sum(1 for ch in chunks if ch.choices and ch.choices[0].text) >= 1
    # The health check (every 0.3 s here) takes it out, if no request found it dead first: on a fast
    # machine the eight requests above all went to the live instance within one interval.
    deadline = time.monotonic() + 5
    while True:
        state = httpx.get(f"{cluster.url}/router").json()
        if [i["healthy"] for i in state["instances"] if i["url"] == busy] == [False] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert [i["healthy"] for i in state["instances"] if i["url"] == busy] == [False]
