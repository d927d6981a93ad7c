"""`rackserve bench prefix-replay`: for a model with KV cache groups (DeepSeek-V4), the prefill of a
prompt whose prefix is in the cache (its compressed entries hit by hash, a bounded span before the
hit replayed to rebuild the window: core/kv_cache_groups.py) against a prompt of the same length
computed whole, in the same engine, alternating, at several prefix lengths. Also the KV bytes per
token of the model's groups against DeepSeek-V3's layout (MLA: kv_lora_rank + rope values a token
and layer) at the same hidden size and depth, and what a request holds at each context length.

Prefill throughput counts every prompt token, cached or not (DESIGN.md's rule). This file owns the
command and its JSON; it must never reach into the scheduler or the runner.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

from rackserve.config import EngineArgs
from rackserve.serve.cli import register_subcommand

LONG_CONTEXT = 131072   # a context length the bytes table adds (the seeds' decode configuration)


def _add_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--prefix-lens", default="1024,2048,4096", help="cached prefix lengths, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=128, help="prompt tokens after the prefix")
    parser.add_argument("--repeats", type=int, default=3, help="timed prefills of each kind per prefix length")
    parser.add_argument("--output", help="write the results as JSON here")


def _median_run(runs: list[tuple[float, int]], prompt_tokens: int) -> dict:
    seconds = statistics.median(t for t, _ in runs)
    return {"median_s": seconds, "runs_s": [t for t, _ in runs], "tokens_per_s": prompt_tokens / seconds,
            "computed_tokens": prompt_tokens - runs[0][1], "cached_tokens": runs[0][1]}


def kv_bytes_table(model_config: dict, dtype, context_lens: list[int]) -> dict:
    """Bytes per token of each group and of DeepSeek-V3's layout at the same hidden size and depth,
    and what one request holds at each context length (the window group: only its last tokens)."""
    import transformers

    from rackserve.model.dsv4_cache import DSV4CacheGroups
    from rackserve.model.loader import ModelInfo
    info = ModelInfo.from_config(model_config, dtype)
    v3 = transformers.DeepseekV3Config(hidden_size=model_config["hidden_size"],
                                       num_hidden_layers=model_config["num_hidden_layers"]).to_dict()
    v3_per_token = ModelInfo.from_config({**v3, "architectures": ["DeepseekV3ForCausalLM"]}, dtype).kv_cache_bytes_per_token
    groups = dict(info.kv_cache_bytes_by_group)
    keep = DSV4CacheGroups(model_config, 1).groups[0].sliding_window + 1   # with the token being computed
    held = {c: {"v4": round(groups["window"] * min(c, keep) + info.kv_cache_bytes_per_token * c),
                "v3": v3_per_token * c} for c in context_lens}
    return {"dtype": str(dtype).removeprefix("torch."), "v4_bytes_per_token_by_group": groups,
            "v4_window_tokens_kept": keep, "v4_bytes_per_token_long_context": info.kv_cache_bytes_per_token,
            "v3_bytes_per_token": v3_per_token,
            "v3_over_v4_long_context": v3_per_token / info.kv_cache_bytes_per_token, "held_per_request": held}


@register_subcommand("bench prefix-replay", "prefill with a cached prefix (bounded replay) against the whole "
                     "prompt, same engine, several prefix lengths; KV bytes per token against DeepSeek-V3",
                     _add_args)
def run_prefix_replay(args: argparse.Namespace) -> int:
    import torch

    from rackserve import LLM, SamplingParams
    from rackserve.bench.limits import processor_name
    from rackserve.model.loader import read_hf_config
    prefix_lens = [int(x) for x in args.prefix_lens.split(",")]
    engine_args = EngineArgs.from_cli_args(args)
    with LLM(**vars(engine_args)) as llm:
        kv_config = llm.engine.core.executor.kv_cache_config
        if kv_config is None:
            print("rackserve bench prefix-replay: the model has one KV cache group (no bounded replay)", file=sys.stderr)
            return 2
        vocab = llm.engine.core.executor.vocab_size
        rng = random.Random(engine_args.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(min(256, vocab - 1), vocab) for _ in range(n)]

        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def prefill(prompt: list[int]) -> tuple[float, int]:
            start = time.perf_counter()
            [out] = llm.generate({"prompt_token_ids": prompt}, params)
            return time.perf_counter() - start, out.num_cached_tokens

        load = [os.getloadavg()[0]]
        rows = []
        for prefix_len in prefix_lens:
            prefix, n = tokens(prefix_len), args.new_tokens
            prefill(prefix + tokens(n))          # puts the prefix in the cache (and warms up)
            hit, full = [], []
            for _ in range(args.repeats):        # alternating, so drift in the machine's load hits both
                hit.append(prefill(prefix + tokens(n)))
                full.append(prefill(tokens(prefix_len + n)))
            row = {"prefix_len": prefix_len, "prompt_tokens": prefix_len + n,
                   "bounded_replay": _median_run(hit, prefix_len + n), "full_recompute": _median_run(full, prefix_len + n)}
            # No hit when the prefix is within the replay's depth (a replay from token 0 saves nothing).
            cached = row["bounded_replay"]["cached_tokens"]
            row["replayed_tokens"] = prefix_len - cached if cached else 0
            row["speedup"] = row["full_recompute"]["median_s"] / row["bounded_replay"]["median_s"]
            rows.append(row)
            what = f"{row['replayed_tokens']} of them replayed" if cached else "no hit: the prefix is within the replay depth"
            print(f"prefix {prefix_len:6d} + {n} new: bounded replay {row['bounded_replay']['median_s'] * 1e3:8.1f} ms "
                  f"({row['bounded_replay']['computed_tokens']} computed, {what}), "
                  f"full {row['full_recompute']['median_s'] * 1e3:8.1f} ms ({row['full_recompute']['computed_tokens']} "
                  f"computed): {row['speedup']:.2f}x prefill throughput", flush=True)
        load.append(os.getloadavg()[0])
        dtype = getattr(torch, llm.engine.config.cache.cache_dtype or llm.engine.config.model.dtype)
        table = kv_bytes_table(read_hf_config(args.model), dtype, prefix_lens + [LONG_CONTEXT])
        llm_device = llm.engine.config.model.device
    print(f"KV bytes per token ({table['dtype']}): {table['v4_bytes_per_token_by_group']} (window: last "
          f"{table['v4_window_tokens_kept']} tokens only); DeepSeek-V3 layout {table['v3_bytes_per_token']}: "
          f"{table['v3_over_v4_long_context']:.1f}x V4's at long context")
    print(f"1-minute load average {load[0]:.1f} before, {load[1]:.1f} after, on {os.cpu_count()} CPUs")
    result = {"bench": "prefix-replay", "model": args.model, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "replay": {"window": kv_config.window, "num_layers": kv_config.num_layers,
                         "groups": [{"name": g.name, "block_size": g.block_size, "num_blocks": g.num_blocks,
                                     "bytes_per_token": g.bytes_per_token, "sliding_window": g.sliding_window}
                                    for g in kv_config.groups]},
              "rows": rows, "kv_bytes": table, "load_average": load,
              "command": "rackserve " + " ".join(sys.argv[1:]), "machine": processor_name(llm_device)}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.output}")
    return 0
