"""How long one large request body stalls a real `rackserve serve`'s event loop for the other
clients' streams: the longest gap between chunks of a reading stream while each body is sent.

A tiny random Llama (tests/tiny_models.py), or with --default-model the built-in SmolLM2, is
served on a free port; one greedy stream reads chunks in a thread, and each body kind (~14 MB: a
text prompt, token ids, floats where ids go, many messages, a huge logit_bias, ...; and smaller
ones that cost the tokenizer most: the longest run of digits the character bound lets through)
is posted in turn, a second apart. The reading stream's gaps while a post was in flight, against
its median gap, are the stall (the engine's and the event loop's; /health, polled every 20 ms,
gives the event loop's alone); the post's status, seconds and the server's resident memory after
it are recorded too. It changes nothing it measures.

  python bench/body_stall.py --output bench/results/body-stall-h4.json
  python bench/body_stall.py --default-model --output bench/results/body-stall-h5-smollm2.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.unread_streams import _rss_mb  # noqa: E402
from rackserve.cpu_dtype import cpu_identity  # noqa: E402
from tests.server_utils import start_server  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402
from tests.tokenizer_utils import save_test_tokenizer  # noqa: E402

SIZE = 14_000_000
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMP = {"prompt": "Hi", "max_tokens": 4}


def _fill(item: str, sep: str = ", ") -> str:
    return sep.join([item] * (SIZE // (len(item) + len(sep))))


BODIES = {   # name: (endpoint, raw JSON text of ~14 MB)
    "text_prompt": ("completions", json.dumps({**COMP, "prompt": "word " * (SIZE // 5)})),
    "token_ids": ("completions", json.dumps(COMP)[:-1] + ', "prompt": [' + _fill("123") + "]}"),
    "token_id_lists": ("completions", json.dumps(COMP)[:-1] + ', "prompt": [' + _fill("[1, 2, 3]") + "]}"),
    "floats_for_ids": ("completions", json.dumps(COMP)[:-1] + ', "prompt": [' + _fill("1.5") + "]}"),
    "strings_in_ids": ("completions", json.dumps(COMP)[:-1] + ', "prompt": [[1, ' + _fill('"a"') + "]]}"),
    "empty_messages": ("chat/completions", json.dumps(CHAT)[:-1] + ', "messages": ['
                       + _fill('{"role": "user", "content": ""}') + "]}"),
    "logit_bias": ("completions", json.dumps(COMP)[:-1] + ', "logit_bias": {'
                   + ", ".join(f'"{i}": 1' for i in range(SIZE // 12)) + "}}"),
    "stop_token_ids": ("completions", json.dumps(COMP)[:-1] + ', "stop_token_ids": [' + _fill("7") + "]}"),
    "ignored_field": ("completions", json.dumps({**COMP, "user": "x" * SIZE})),
    "tokenize_empty_messages": ("/tokenize", '{"messages": [' + _fill('{"role": "user", "content": ""}') + "]}"),
    "detokenize_ids": ("/detokenize", '{"tokens": [' + _fill("1") + "]}"),
}


def _tokenizer_bodies(tokenizer_path: str, max_len: int) -> dict[str, tuple[str, str]]:
    """Bodies sized by the served tokenizer: the most characters check_fits lets through (its
    longest vocabulary entry x max_len) as digits, each a token of its own, in one prompt and in as
    many prompts as SIZE holds; and a conversation of max_len messages whose texts pass the same
    bound but whose rendering does not."""
    from rackserve.engine.tokenizer import load_tokenizer
    chars = max_len * load_tokenizer(tokenizer_path).max_token_chars
    per_message = "x" * (chars // max_len - 1)
    return {"digits_prompt": ("completions", json.dumps({**COMP, "prompt": "1" * chars})),
            "digit_prompts_batch": ("completions", json.dumps({**COMP, "prompt": ["1" * chars] * (SIZE // chars)})),
            "tokenize_digits": ("/tokenize", json.dumps({"prompt": "1" * chars, "return_token_strs": True})),
            "rendered_past_bound": ("chat/completions", json.dumps(
                {**CHAT, "messages": [{"role": "user", "content": per_message}] * max_len}))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--only", default=None, help="comma-separated body kinds")
    parser.add_argument("--default-model", action="store_true",
                        help="serve the built-in default model (SmolLM2-135M-Instruct) instead of a tiny one")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="body-stall-"))
    if args.default_model:
        from rackserve.config import smollm2_gguf_path
        tokenizer, flags = smollm2_gguf_path(), []
    else:
        model = build_tiny_model("LlamaForCausalLM", root / "model", vocab_size=512, max_position_embeddings=4096)
        tokenizer = str(root / "tokenizer")
        save_test_tokenizer(tokenizer, 512)
        flags = ["--model", model, "--tokenizer", tokenizer, "--device", "cpu", "--max-model-len", "4096",
                 "--num-gpu-blocks-override", "600"]
    proc, url = start_server(flags, root / "server.log")
    max_len = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
    bodies = {**BODIES, **_tokenizer_bodies(tokenizer, max_len)}
    kinds = args.only.split(",") if args.only else list(bodies)
    result: dict = {"command": " ".join(sys.argv), "cpu": cpu_identity(), "loadavg_before": os.getloadavg(),
                    "body_bytes": SIZE, "max_model_len": max_len, "kinds": {}}
    streams: list[list[float]] = []   # chunk times of each reading stream in turn
    stop = threading.Event()

    def read() -> None:
        body = {"prompt": "Hello", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
        while not stop.is_set():
            streams.append([])
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        streams[-1].append(time.perf_counter())
                    if stop.is_set():
                        return

    probes: list[tuple[float, float]] = []   # (latency, end) of /health calls: the event loop alone

    def probe() -> None:
        with httpx.Client(timeout=600) as client:
            while not stop.is_set():
                t = time.perf_counter()
                client.get(f"{url}/health")
                probes.append((time.perf_counter() - t, time.perf_counter()))
                time.sleep(0.02)

    try:
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        threading.Thread(target=probe, daemon=True).start()
        time.sleep(2)
        with httpx.Client(timeout=60) as client:
            for name in kinds:
                endpoint, text = bodies[name]
                path = endpoint if endpoint.startswith("/") else f"/v1/{endpoint}"
                time.sleep(1)
                print(name, flush=True)
                t0 = time.perf_counter()
                try:
                    resp = client.post(f"{url}{path}", content=text.encode(),
                                       headers={"Content-Type": "application/json"})
                    status, message = resp.status_code, resp.text[:200]
                except httpx.HTTPError as e:   # no answer within the client's timeout
                    status, message = None, repr(e)
                t1 = time.perf_counter()
                result["kinds"][name] = {"status": status, "post_s": round(t1 - t0, 3),
                                         "bytes": len(text), "message": message,
                                         "window": (t0, t1), "rss_mb_after": round(_rss_mb(proc.pid), 1)}
                print(result["kinds"][name], flush=True)
        time.sleep(1)
        stop.set()
        gaps = [(b - a, b) for times in streams for a, b in zip(times, times[1:])]
        result["reader_chunks"] = sum(map(len, streams))
        result["reader_gap_p50_ms"] = round(statistics.median(g for g, _ in gaps) * 1000, 2)
        result["health_p50_ms"] = round(statistics.median(p for p, _ in probes) * 1000, 2)
        for name, kind in result["kinds"].items():
            t0, t1 = kind.pop("window")
            inside = [g for g, end in gaps if t0 <= end <= t1 + 0.5]
            kind["reader_max_gap_ms"] = round(max(inside, default=0) * 1000, 1)
            # A stall that is shorter but lasts longer: how many chunks came, and their median gap.
            kind["reader_chunks"] = len(inside)
            kind["reader_gap_p50_ms_inside"] = round(statistics.median(inside) * 1000, 2) if inside else None
            kind["health_max_ms"] = round(max((p for p, end in probes if t0 <= end <= t1 + 0.5), default=0) * 1000, 1)
        result["health_after"] = httpx.get(f"{url}/health").status_code
    finally:
        stop.set()
        proc.terminate()
        proc.wait(timeout=60)
    result["loadavg_after"] = os.getloadavg()
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
