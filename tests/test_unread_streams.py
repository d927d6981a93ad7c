"""A client that reads its stream slower than the engine writes it, or not at all with its
connection open, costs the server what the same answer held whole costs and no more: the outputs
it has not taken fold into one per prompt (vLLM's RequestOutputCollector), and past
--max-logprob-entries unread the request is aborted and its stream ends with an error event.

Before: every step's output waited in a queue as objects of its own (one RequestOutput and one
CompletionOutput per token, ~0.7 KB; n=128 over an 8k context is ~700 MB for one request), and a
stream with logprobs held every entry it generated: the bound a non-streaming response has did
not apply to a stream nobody read. Against a real AsyncEngine (in-process: no socket buffer to
fill first) and a real server with a client that never reads its socket.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from rackserve.config import EngineArgs
from rackserve.engine.async_engine import AsyncEngine
from rackserve.sampling_params import SamplingParams
from rackserve.serve.request_streams import RequestStreams, UnreadStreamError
from tests.server_utils import metric_totals, scrape_metrics, start_server, stop_server
from tests.tiny_models import build_tiny_model
from tests.tokenizer_utils import save_test_tokenizer

PROMPTS = [[1, 5, 9, 13], [1, 7]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("unread") / "m")
    # float32: a test compares two runs' greedy tokens, and in bf16 (auto on a native-bf16 CPU) a
    # decode-only step computes natively in float32 where a mixed one rounds to bf16 in the modules,
    # so how the two runs' steps were batched can flip a near-tie of the tiny random model.
    engine = AsyncEngine(EngineArgs(model=path, device="cpu", dtype="float32", num_gpu_blocks_override=64,
                                    max_model_len=256, skip_tokenizer_init=True))
    yield engine
    engine.shutdown()


async def _read(streams: RequestStreams) -> tuple[int, dict[tuple[int, int], list[int]]]:
    """(items taken, token ids per (prompt, sample))."""
    items, tokens = 0, {}
    async for p, out in streams:
        items += 1
        for c in out.outputs:
            tokens.setdefault((p, c.index), []).extend(c.token_ids)
    return items, tokens


def test_outputs_a_reader_has_not_taken_fold_into_one_per_prompt(engine):
    params = SamplingParams(n=2, max_tokens=40, temperature=0.0, ignore_eos=True)

    async def run():
        promptly = RequestStreams(engine, PROMPTS, params, "prompt")
        await promptly.start()
        read_tokens = (await _read(promptly))[1]
        late = RequestStreams(engine, PROMPTS, params, "late")
        await late.start()           # each prompt's first output is taken here
        await asyncio.wait(late._tasks)   # the engine finished both; nothing read since
        return read_tokens, await _read(late)

    read_tokens, (late_items, late_tokens) = asyncio.run(run())
    assert late_items <= 2 * 2       # the first of each prompt, then the other 39 steps' folded into one
    assert late_tokens == read_tokens and all(len(t) == 40 for t in late_tokens.values())


def test_unread_logprobs_past_the_bound_abort_the_request_and_end_the_stream_with_an_error(engine):
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True, logprobs=3)

    async def run():
        streams = RequestStreams(engine, PROMPTS[:1], params, "cut", max_unread_entries=120)
        await streams.start()
        await asyncio.wait(streams._tasks)
        tokens = []
        with pytest.raises(UnreadStreamError, match="--max-logprob-entries"):
            async for _, out in streams:
                tokens += out.outputs[0].token_ids
        return tokens

    tokens = asyncio.run(run())
    # The first output, then what was folded (3-4 entries a token) until 120 were passed.
    assert 1 < len(tokens) < 50


def _open_unread_stream(url: str, body: dict) -> socket.socket:
    """A client that sends its request and never reads: its receive buffer is 4 KiB, so the
    server's writes block once the kernel's buffers are full (~3 MB on loopback: the server's
    send buffer grows to 4 MiB), ~1,900 chunks of 20 top logprobs."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


def test_a_client_that_never_reads_its_stream_is_cut_at_the_bound_and_its_request_aborted(tmp_path):
    model = build_tiny_model("LlamaForCausalLM", tmp_path / "model", vocab_size=512, max_position_embeddings=256)
    save_test_tokenizer(str(tmp_path / "tokenizer"), 512)
    proc, url = start_server(["--model", model, "--tokenizer", str(tmp_path / "tokenizer"), "--device", "cpu",
                              "--max-model-len", "256", "--num-gpu-blocks-override", "600",
                              "--max-logprob-entries", "500"], tmp_path / "server.log")
    try:
        n, max_tokens = 16, 230
        s = _open_unread_stream(url, {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "n": n,
                                      "max_tokens": max_tokens, "ignore_eos": True, "logprobs": True,
                                      "top_logprobs": 20})
        deadline = time.monotonic() + 60
        while metric_totals(url).get("rackserve:request_success_total", 0) < 1:   # ended in the engine
            assert time.monotonic() < deadline
            time.sleep(0.2)
        totals = metric_totals(url)
        s.settimeout(30)
        received = b""
        while not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
            chunk = s.recv(1 << 20)
            assert chunk, received[-500:]
            received += chunk
        s.close()
        events = [line.removeprefix(b"data: ") for line in received.split(b"\n") if line.startswith(b"data: {")]
        error = json.loads(events[-1])["error"]
        assert error["code"] == "stream_not_read" and "--max-logprob-entries" in error["message"]
        # Aborted, not run to its end for nobody: the engine made fewer tokens than asked.
        assert totals["rackserve:generation_tokens_total"] < n * max_tokens
        aborted = sum(v for k, v in scrape_metrics(url).items()
                      if k.startswith("rackserve:request_success_total{") and 'finished_reason="abort"' in k)
        assert aborted == n
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        stop_server(proc)
