"""Slow and greedy peers must not take the front doors down: a client that trickles its request
head (slowloris) or its body, more concurrent streams than an HTTP client pool's default, and
instances whose answers are too large or of the wrong JSON shape. Each test runs real processes
(`rackserve serve`, `router`, `proxy`) against raw sockets, httpx, and an instance that speaks
the instances' HTTP contract from this process (StubInstance: it counts what reaches it and holds
streams open until the test lets them go, which a real instance cannot be made to do on cue).
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from aiohttp import web

from rackserve.distributed.parallel_state import free_port
from tests.server_utils import start_command, start_server, stop_all
from tests.tiny_models import build_tiny_model
from tests.tokenizer_utils import save_test_tokenizer

VOCAB = 512
HEADER_TIMEOUT = 1.0
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there, how are you today?"}], "max_tokens": 2}


class StubInstance:
    """An instance's HTTP face on a free port, served from a thread of this process. A POST is
    counted in `arrived`; a stream sends its first event, then waits for `release`. `answer`
    (bytes) replaces a whole answer's body; `kv_events` its GET /kv_events body."""

    def __init__(self, tokenizer: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.arrived: list[dict] = []
        self.answer: bytes | None = None
        self.stream_usage: object = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        self.kv_events = json.dumps({"enable_kv_cache_events": False, "tokenizer": tokenizer, "block_size": 4,
                                     "data_parallel_size": 1, "max_model_len": 256, "served_model_name": "tiny",
                                     "endpoints": [], "replay_endpoints": [], "topic": None}).encode()
        self.loop = asyncio.new_event_loop()
        self.release = asyncio.Event()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        async def health(_):
            return web.Response()

        async def kv_events(_):
            return web.Response(body=self.kv_events, content_type="application/json")

        async def models(_):
            return web.json_response({"object": "list", "data": []})
        app.router.add_get("/health", health)
        app.router.add_get("/kv_events", kv_events)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", self._post)
        app.router.add_post("/v1/chat/completions", self._post)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port, backlog=1024).start())
        started.set()
        self.loop.run_forever()

    async def _post(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.arrived.append(body)
        if not body.get("stream"):
            answer = self.answer or json.dumps(
                {"id": "x", "object": "chat.completion", "choices": [],
                 "kv_transfer_params": {"remote_block_ids": [1]} if body.get("kv_transfer_params") else None,
                 "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()
            return web.Response(body=answer, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id": "x", "choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n')
        await self.release.wait()
        await resp.write(b"data: " + json.dumps({"id": "x", "choices": [], "usage": self.stream_usage}).encode()
                         + b"\n\ndata: [DONE]\n\n")
        return resp

    def let_go(self) -> None:
        self.loop.call_soon_threadsafe(self.release.set)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer")
    save_test_tokenizer(path, VOCAB)
    return path


def _start_front(kind: str, root, stubs: list[StubInstance], *flags: str):
    if kind == "router":
        args = ["router", "--worker", stubs[0].url, "--health-interval", "0.3", "--health-timeout", "2"]
    else:
        args = ["proxy", "--prefill", stubs[0].url, "--decode", stubs[-1].url, "--uvicorn-log-level", "warning"]
    return start_command([*args, *flags], root / f"{kind}.log", timeout=60)


def _openai_error(resp: httpx.Response) -> dict:
    assert resp.headers["content-type"] == "application/json", resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ---- the request head and body, on time ---------------------------------------------------


def _trickled_head_answer(url: str, deadline_s: float) -> tuple[bytes, float]:
    """Opens a connection and trickles a request head, a header line every 0.2 s, as slowloris
    does; (what the server sent before closing, seconds until it closed), or what came by
    `deadline_s` (the connection still open)."""
    host, port = url.rsplit("/", 1)[1].split(":")
    sock = socket.create_connection((host, int(port)))
    start = time.monotonic()
    got = b""
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        sock.settimeout(0.2)
        line = 0
        while time.monotonic() - start < deadline_s:
            try:
                chunk = sock.recv(65536)
                if not chunk:
                    return got, time.monotonic() - start
                got += chunk
            except socket.timeout:
                pass
            except ConnectionResetError:
                return got, time.monotonic() - start
            try:
                sock.sendall(b"X-Slow-%d: 1\r\n" % line)
                line += 1
            except (BrokenPipeError, ConnectionResetError):
                pass
        return got, float("inf")
    finally:
        sock.close()


def _check_head_timeout(url: str) -> None:
    # Another connection is served while one trickles its head (before: this one stayed open for
    # as long as it trickled, 15 s here, and for ever if it went on).
    box: dict = {}
    slow = threading.Thread(target=lambda: box.update(answer=_trickled_head_answer(url, 15.0)))
    slow.start()
    try:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        slow.join()
    answer, closed_after = box["answer"]
    assert closed_after < 10, f"the trickling connection was still open after 15 s; it got {answer[:200]!r}"
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_timeout" and "--header-timeout" in error["message"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def _check_body_timeout(url: str) -> None:
    """A head on time, then a body that never finishes: 408 once it is late (as long again)."""
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port))) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{\"messages\": ")
        sock.settimeout(15)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    assert time.monotonic() - start < 10
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


@pytest.mark.parametrize("kind", ["router", "proxy"])
def test_a_front_closes_a_connection_whose_head_or_body_is_late(kind, tokenizer, tmp_path):
    stub = StubInstance(tokenizer)
    front, url = _start_front(kind, tmp_path, [stub], "--header-timeout", str(HEADER_TIMEOUT),
                              *(["--tokenizer", tokenizer] if kind == "router" else []))
    try:
        _check_head_timeout(url)
        _check_body_timeout(url)
        assert front.poll() is None
    finally:
        stop_all([front])
        stub.stop()


def test_serve_closes_a_connection_whose_head_or_body_is_late(tokenizer, tmp_path):
    model = build_tiny_model("LlamaForCausalLM", tmp_path / "model", vocab_size=VOCAB, max_position_embeddings=256)
    proc, url = start_server(["--model", model, "--tokenizer", tokenizer, "--served-model-name", "tiny",
                              "--device", "cpu", "--max-model-len", "256", "--num-gpu-blocks-override", "64",
                              "--header-timeout", str(HEADER_TIMEOUT)], tmp_path / "server.log")
    try:
        _check_head_timeout(url)
        _check_body_timeout(url)
        resp = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60)
        assert resp.status_code == 200, resp.text
    finally:
        stop_all([proc])


def test_header_timeout_must_be_positive(tmp_path):
    from rackserve.serve.http_server import server_config
    with pytest.raises(ValueError, match="--header-timeout"):
        server_config(None, "127.0.0.1", 0, "warning", header_timeout=0)


# ---- more concurrent streams than a client pool's default ----------------------------------


@pytest.mark.parametrize("kind", ["router", "proxy"])
def test_150_concurrent_streams_all_reach_the_instance_and_health_answers(kind, tokenizer, tmp_path):
    """Before: aiohttp's and httpx's pools hold 100 connections, so streams past the 100th waited
    inside the front, and so did the router's health checks (the instance then left the pool)
    and the proxy's /health (a 503 once its pool wait timed out)."""
    stub = StubInstance(tokenizer)
    front, url = _start_front(kind, tmp_path, [stub], *(["--tokenizer", tokenizer] if kind == "router" else []))
    n = 150

    async def streams() -> list[bytes]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as client:
            async def one() -> bytes:
                async with client.stream("POST", f"{url}/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                    assert r.status_code == 200
                    return b"".join([chunk async for chunk in r.aiter_bytes()])
            tasks = [asyncio.ensure_future(one()) for _ in range(n)]
            deadline = time.monotonic() + 60
            while sum(1 for b in stub.arrived if b.get("stream")) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            held = sum(1 for b in stub.arrived if b.get("stream"))
            await asyncio.sleep(3 * 0.3 + 2)   # router: past a few health checks, each with its timeout
            health = (await client.get(f"{url}/health", timeout=10)).status_code
            stub.let_go()
            results = await asyncio.gather(*tasks)
            assert held == n, f"{held} of {n} streams reached the instance"
            assert health == 200
            return results

    try:
        bodies = asyncio.run(streams())
        assert all(b.endswith(b"data: [DONE]\n\n") and b"error" not in b for b in bodies)
    finally:
        stop_all([front])
        stub.stop()


# ---- instances' answers: too large, or of the wrong shape -----------------------------------


def test_proxy_caps_what_it_reads_of_an_answer_and_refuses_a_prefill_answer_not_an_object(tokenizer, tmp_path):
    """Before: the proxy read a prefill (or decode) answer whole, however large, and a prefill
    answer that was JSON but not an object raised AttributeError out of the handler (a text 500)."""
    stub = StubInstance(tokenizer)
    front, url = _start_front("proxy", tmp_path, [stub], "--max-answer-bytes", "1000")
    try:
        for stream in (False, True):
            stub.answer = json.dumps({"kv_transfer_params": None, "pad": "x" * 5000}).encode()
            resp = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30)
            assert resp.status_code == 502 and "--max-answer-bytes 1000" in _openai_error(resp)["message"]
            for answer in (b"[1, 2]", b'"kv"', b"3"):
                stub.answer = answer
                resp = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30)
                assert resp.status_code == 502 and "not a JSON object" in _openai_error(resp)["message"]
        stub.answer = None
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    finally:
        stop_all([front])
        stub.stop()


def test_router_runs_a_request_whole_on_its_decoder_when_the_prefill_answer_is_not_an_object(tokenizer, tmp_path):
    """Before: json.loads(...).get on a prefill answer that was a JSON array raised out of the
    router's P/D flow: a 500 for a request its decoder could serve whole."""
    prefill, decode = StubInstance(tokenizer), StubInstance(tokenizer)
    front, url = start_command(["router", "--prefill-worker", prefill.url, "--decode-worker", decode.url,
                                "--pd-threshold-tokens", "1", "--tokenizer", tokenizer], tmp_path / "router.log",
                               timeout=120)
    decode.let_go()
    try:
        for answer in (b"[1, 2]", b'"kv"', b"{not json"):
            prefill.answer = answer
            for stream in (False, True):
                before = len(prefill.arrived)
                resp = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30)
                assert resp.status_code == 200, resp.text
                assert len(prefill.arrived) == before + 1   # it was disaggregated, and the prefill hop ran
                assert "kv_transfer_params" not in decode.arrived[-1] and decode.arrived[-1].get("stream") == stream
    finally:
        stop_all([front])
        prefill.stop()
        decode.stop()


BAD_USAGE = [[1], "many", {"prompt_tokens_details": "x"}, {"prompt_tokens_details": {"cached_tokens": "7"}},
             {"prompt_tokens_details": {"cached_tokens": -3}, "completion_tokens": "two"},
             {"prompt_tokens_details": [1], "completion_tokens": -1}]


def test_router_passes_answers_with_malformed_usage_through(tokenizer, tmp_path):
    """Before: a usage that was not an object (or whose details were not) raised inside the
    router: a 500 for a whole answer, a stream cut without [DONE]; a negative count raised in the
    metric."""
    stub = StubInstance(tokenizer)
    front, url = _start_front("router", tmp_path, [stub], "--tokenizer", tokenizer)
    stub.let_go()
    try:
        for usage in BAD_USAGE:
            stub.answer = json.dumps({"id": "x", "choices": [], "usage": usage}).encode()
            resp = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
            assert resp.status_code == 200 and resp.content == stub.answer
            stub.stream_usage = usage
            resp = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30)
            assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n") and "error" not in resp.text
        for answer in (b"[1]", b'"usage"', b"{]"):   # not even an object: passed on as it came
            stub.answer = answer
            resp = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
            assert resp.status_code == 200 and resp.content == answer
        assert front.poll() is None
    finally:
        stop_all([front])
        stub.stop()


def test_router_leaves_out_an_instance_whose_kv_events_answer_is_past_4_mib(tokenizer, tmp_path):
    """Before: GET /kv_events was read and parsed whole, however large (a description of 4096 DP
    ranks takes well under 1 MiB)."""
    good, big = StubInstance(tokenizer), StubInstance(tokenizer)
    info = json.loads(big.kv_events)
    big.kv_events = json.dumps({**info, "pad": "x" * (5 << 20)}).encode()
    front, url = start_command(["router", "--worker", good.url, "--worker", big.url, "--tokenizer", tokenizer,
                                "--health-interval", "0.3"], tmp_path / "router.log", timeout=120)
    try:
        time.sleep(1)   # a few health checks: it is asked again at each, and left out each time
        pool = {i["url"]: i["healthy"] for i in httpx.get(f"{url}/router").json()["instances"]}
        assert pool == {good.url: True, big.url: False}
        assert f"GET /kv_events answered more than {4 << 20} bytes" in (tmp_path / "router.log").read_text()
    finally:
        stop_all([front])
        good.stop()
        big.stop()
