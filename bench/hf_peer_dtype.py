"""The HF peer's single-stream decode rate in float32 against bfloat16 on this CPU, interleaved over
the same prompts: which dtype is its best here (rackserve/bench/hf_peer.best_cpu_dtype's rule).

    python bench/hf_peer_dtype.py --output bench/results/hf-peer-dtype-zen5.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

DTYPES = ("float32", "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=6, help="32-token random prompts, each timed on both")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    import torch

    from rackserve.bench.hf_peer import hf_stream_timing, load_hf_model
    from rackserve.bench.record import machine_state
    torch.manual_seed(0)
    models = {d: load_hf_model(args.model, getattr(torch, d)) for d in DTYPES}
    prompts = [torch.randint(100, 40000, (32,)).tolist() for _ in range(args.prompts)]
    for model in models.values():
        hf_stream_timing(model, prompts[0], 8)          # warm-up
    rates: dict[str, list[float]] = {d: [] for d in DTYPES}
    for prompt in prompts:                              # interleaved: the VM's drift hits both
        for d, model in models.items():
            rates[d].append(hf_stream_timing(model, prompt, args.output_len)[1])
    medians = {d: statistics.median(r) for d, r in rates.items()}
    print(f"HF decode tok/s (median of {args.prompts}): " + ", ".join(f"{d} {v:.1f}" for d, v in medians.items())
          + f"; bfloat16 / float32 {medians['bfloat16'] / medians['float32']:.2f}x")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(["python", *sys.argv]), "decode_tok_s_median": medians, "runs": rates,
                       "machine": machine_state()}, f, indent=1)


if __name__ == "__main__":
    main()
