"""What one penalised request with many samples does to another client's stream, served: a tiny
random Llama with a 49,152-token vocabulary (tests/tiny_models.py, token ids in and out) is served
from each source tree in turn; one greedy stream reads, and one completion with n samples of a long
prompt and repetition_penalty (greedy too, so that penalties are the sampler's work) is posted
beside it, then the same without the penalty (what the long contexts cost the step anyway). The
reading stream's longest and median gaps while each post was in flight are recorded for each tree,
the trees alternating `--rounds` times (a fresh server each time). `--sampling top_p`: the n samples
draw at temperature 1 with top_p 0.9 instead (the sampler's top_k/top_p, bench/sampler_step.py).

  python bench/penalties_served.py --trees /path/to/main,/path/to/branch \
      --output bench/results/penalties-served-h7.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rackserve.cpu_dtype import cpu_identity  # noqa: E402
from tests.server_utils import start_server  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

VOCAB = 49152


def one_round(tree: str, model: str, root: Path, args: argparse.Namespace) -> dict:
    os.environ["PYTHONPATH"] = tree
    os.chdir(root)   # `python -m rackserve` puts the working directory first on sys.path
    flags = ["--model", model, "--skip-tokenizer-init", "--device", "cpu", "--max-model-len", "8400",
             "--num-gpu-blocks-override", "1600", "--max-num-seqs", str(args.n + 8)]
    proc, url = start_server(flags, root / "server.log")
    chunks: list[float] = []
    stop = threading.Event()

    def read() -> None:
        body = {"prompt": [5, 6, 7], "max_tokens": 8000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(time.perf_counter())
                if stop.is_set():
                    return

    try:
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        time.sleep(3)
        rng = random.Random(0)
        prompt = [rng.randrange(3, VOCAB) for _ in range(args.prompt_tokens)]
        posts = []
        settings = ({"repetition_penalty_1.1": {"temperature": 0, "repetition_penalty": 1.1},
                     "repetition_penalty_1.0": {"temperature": 0, "repetition_penalty": 1.0}}
                    if args.sampling == "greedy" else {"top_p_0.9": {"temperature": 1.0, "top_p": 0.9}})
        for name, sampling in settings.items():
            body = {"prompt": prompt, "n": args.n, "max_tokens": args.max_tokens, "ignore_eos": True, **sampling}
            t0 = time.perf_counter()
            resp = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
            posts.append((name, resp.status_code, t0, time.perf_counter()))
            time.sleep(1)
        stop.set()
        gaps = [(b - a, b) for a, b in zip(chunks, chunks[1:])]
        run = {"tree": tree, "reader_gap_p50_ms_before": round(statistics.median(
            g for g, end in gaps if end < posts[0][2]) * 1e3, 2)}
        for name, status, t0, t1 in posts:
            inside = [g for g, end in gaps if t0 <= end <= t1]
            run[name] = {
                "status": status, "post_s": round(t1 - t0, 2),
                "reader_chunks": len(inside), "reader_gap_p50_ms": round(statistics.median(inside) * 1e3, 2),
                "reader_gap_p90_ms": round(sorted(inside)[int(0.9 * len(inside))] * 1e3, 1),
                "reader_gap_max_ms": round(max(inside) * 1e3, 1)}
        return run
    finally:
        stop.set()
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", required=True, help="comma-separated source trees to serve from, in turn")
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sampling", choices=("greedy", "top_p"), default="greedy",
                        help="top_p: the n samples at temperature 1, top_p 0.9, no penalty (the sampler's filters)")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    output = Path(args.output).resolve()
    root = Path(tempfile.mkdtemp(prefix="penalties-served-"))
    model = build_tiny_model("LlamaForCausalLM", root / "model", vocab_size=VOCAB, max_position_embeddings=8400)
    result = {"command": " ".join(sys.argv), "cpu": cpu_identity(),
              "loadavg_before": os.getloadavg(), "n": args.n, "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "sampling": args.sampling, "runs": []}
    for _ in range(args.rounds):
        for tree in args.trees.split(","):
            run = one_round(tree, model, root, args)
            result["runs"].append(run)
            print(run, flush=True)
    result["loadavg_after"] = os.getloadavg()
    output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
