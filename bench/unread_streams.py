"""What clients that open streams and never read them cost a real `rackserve serve`: its memory,
whether the engine goes on, and one reading stream's inter-chunk gaps beside them.

A tiny random Llama (tests/tiny_models.py) with its test tokenizer is served on a free port.
Phase "alone": one reading stream (greedy, ignore_eos) and its chunk gaps. Phase "unread": K raw
sockets (receive buffer 4 KiB) each send a streaming request with logprobs and never read, while
the same reading stream runs; the server's resident memory is sampled until every unread request
has finished in the engine (nothing running or waiting), then the sockets close. Phase "after": the
reading stream again. It changes nothing it measures.

  python bench/unread_streams.py --clients 40 --output bench/results/unread-streams-h4.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rackserve.cpu_dtype import cpu_identity  # noqa: E402
from tests.server_utils import metric_totals, start_server  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402
from tests.tokenizer_utils import save_test_tokenizer  # noqa: E402

MAX_MODEL_LEN = 1024


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _reading_stream(url: str, max_tokens: int) -> dict:
    """One greedy stream read as it comes: its chunk gaps (ms)."""
    body = {"prompt": "Hello there", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    gaps = sorted((b - a) * 1000 for a, b in zip(times, times[1:]))
    return {"chunks": len(times), "gap_p50_ms": round(statistics.median(gaps), 3),
            "gap_p99_ms": round(gaps[int(0.99 * (len(gaps) - 1))], 3), "gap_max_ms": round(gaps[-1], 3)}


def _open_unread(host: str, port: int, body: dict) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=40)
    parser.add_argument("--n", type=int, default=4, help="samples per unread request")
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--reader-tokens", type=int, default=400)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="unread-streams-"))
    model = build_tiny_model("LlamaForCausalLM", root / "model", vocab_size=512,
                             max_position_embeddings=MAX_MODEL_LEN)
    save_test_tokenizer(str(root / "tokenizer"), 512)
    proc, url = start_server(["--model", model, "--tokenizer", str(root / "tokenizer"), "--device", "cpu",
                              "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "8000"],
                             root / "server.log")
    host, port = url.removeprefix("http://").split(":")
    result: dict = {"command": " ".join(sys.argv), "cpu": cpu_identity(),
                    "loadavg_before": os.getloadavg(), "clients": args.clients, "n": args.n,
                    "logprobs": args.logprobs}
    try:
        _reading_stream(url, 16)   # warm-up
        result["rss_mb_idle"] = round(_rss_mb(proc.pid), 1)
        result["alone"] = _reading_stream(url, args.reader_tokens)
        body = {"prompt": "Tell me", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True, "stream": True,
                "n": args.n, "logprobs": args.logprobs}
        socks = [_open_unread(host, int(port), body) for _ in range(args.clients)]
        start = time.perf_counter()
        result["unread"] = _reading_stream(url, args.reader_tokens)
        samples = []
        while True:
            m = metric_totals(url)
            busy = m.get("rackserve:num_requests_running", 0) + m.get("rackserve:num_requests_waiting", 0)
            samples.append((round(time.perf_counter() - start, 2), round(_rss_mb(proc.pid), 1), busy))
            if busy == 0 or time.perf_counter() - start > 300:
                break
            time.sleep(1)
        result["unread_rss_mb_samples"] = samples   # (s, MB, sequences running or waiting)
        result["unread_rss_mb_peak"] = max(s[1] for s in samples)
        result["unread_all_finished_s"] = samples[-1][0] if samples[-1][2] == 0 else None
        for s in socks:
            s.close()
        time.sleep(2)
        result["rss_mb_after_close"] = round(_rss_mb(proc.pid), 1)
        result["after"] = _reading_stream(url, args.reader_tokens)
        result["health_after"] = httpx.get(f"{url}/health").status_code
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    result["loadavg_after"] = os.getloadavg()
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "unread_rss_mb_samples"}, indent=1))



if __name__ == "__main__":
    main()
