"""Where `rackserve bench throughput`'s time goes (issue 12, the thirteenth round): the same requests
(seed, lengths) run once through LLM.generate with the model runner's parts timed per step:
each step's shape (decode rows, prompt tokens), its forward (the native decode step or the
modules), the lm_head, the sampler and the rest of execute_model; the quantized linears' calls by
rows; and what the engine spends outside execute_model (scheduler, outputs). Prints the totals by
step kind and by decode batch size; no peer, no limits.

    PYTHONPATH=. python bench/offline_step_split.py --num-prompts 16 --output bench/results/x.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time

from rackserve.bench.limits import processor_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len-range", default="64,512")
    parser.add_argument("--output-len-range", default="16,128")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    args, engine_flags = parser.parse_known_args()

    import torch
    from rackserve import LLM, SamplingParams
    from rackserve.bench.offline import _random_prompt
    from rackserve.model.quant.quantized_linear import QuantizedLinear

    llm = LLM(model=args.model, seed=args.seed, **_flags(engine_flags))
    runner = llm.engine.core.executor.runner
    rng = random.Random(args.seed)      # bench throughput's requests for the same seed and ranges
    lo_in, hi_in = map(int, args.input_len_range.split(","))
    lo_out, hi_out = map(int, args.output_len_range.split(","))
    vocab = llm.engine.core.executor.vocab_size
    requests = [(_random_prompt(rng, vocab, rng.randint(lo_in, hi_in)), rng.randint(lo_out, hi_out))
                for _ in range(args.num_prompts)]
    llm.generate([{"prompt_token_ids": requests[0][0][:16]}], SamplingParams(max_tokens=4))

    clock = time.perf_counter
    part = collections.Counter()          # seconds of the current step by part
    linears = collections.Counter()       # (rows bucket, out x in) -> seconds
    linear_calls = collections.Counter()

    def timed(name, fn):
        def wrapper(*a, **k):
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                part[name] += clock() - t
        return wrapper

    if runner.native_decoder is not None:
        runner.native_decoder.forward = timed("native_decode", runner.native_decoder.forward)
    runner.model.forward = timed("modules_forward", runner.model.forward)
    runner.model.compute_logits = timed("lm_head", runner.model.compute_logits)
    import rackserve.executor.model_runner as mr
    sample = mr.sample_isolating_failures
    mr.sample_isolating_failures = timed("sampler", sample)
    prepare = runner._prepare_inputs
    runner._prepare_inputs = timed("prepare_inputs", prepare)
    kernel = QuantizedLinear.forward

    def linear_forward(self, x, exact_top=0):
        t = clock()
        y = kernel(self, x, exact_top)
        key = (x.shape[0], self.out_features, self.in_features)
        linears[key] += clock() - t
        linear_calls[key] += 1
        return y
    QuantizedLinear.forward = linear_forward

    steps = []
    execute = runner.execute_model

    def execute_model(so):
        part.clear()
        t = clock()
        out = execute(so)
        total = clock() - t
        n = so.num_scheduled_tokens.values()
        steps.append({"decodes": sum(1 for v in n if v == 1), "prompt_tokens": sum(v for v in n if v > 1),
                      "seconds": total, "parts": dict(part)})
        return out
    runner.execute_model = execute_model

    load = os.getloadavg()
    t0 = clock()
    llm.generate([{"prompt_token_ids": p} for p, _ in requests],
                 [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in requests])
    wall = clock() - t0
    llm.shutdown()
    QuantizedLinear.forward = kernel

    in_steps = sum(s["seconds"] for s in steps)
    print(f"{processor_name()}, {torch.get_num_threads()} threads, load {load[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"wall {wall:.2f} s, {len(steps)} steps, execute_model {in_steps:.2f} s, outside it {wall - in_steps:.2f} s")
    kinds = collections.defaultdict(lambda: collections.Counter())
    for s in steps:
        kind = f"decode x{s['decodes']:2d}" if not s["prompt_tokens"] else "with prompt"
        kinds[kind]["steps"] += 1
        kinds[kind]["seconds"] += s["seconds"]
        kinds[kind]["tokens"] += s["decodes"] + s["prompt_tokens"]
        for k, v in s["parts"].items():
            kinds[kind][k] += v
    order = ["with prompt"] + sorted(k for k in kinds if k != "with prompt")
    for k in order:
        c = kinds[k]
        if not c["steps"]:
            continue
        parts = ", ".join(f"{p} {c[p]:.2f}" for p in ("native_decode", "modules_forward", "lm_head", "sampler",
                                                        "prepare_inputs") if c[p])
        print(f"  {k:12s} {c['steps']:4d} steps {c['seconds']:7.2f} s ({c['seconds'] / in_steps:4.0%}) "
              f"{c['seconds'] / c['steps'] * 1e3:7.1f} ms a step, {c['tokens']:5d} tokens: {parts}")
    print("quantized linears called from the modules (the native decode step's are inside it):")
    by_rows = collections.Counter()
    for (rows, out, k), sec in linears.items():
        by_rows[("prefill" if rows > 16 else f"{rows} rows", out, k)] += sec
    for (rows, out, k), sec in sorted(by_rows.items(), key=lambda kv: -kv[1])[:16]:
        print(f"  {rows:8s} {out:6d}x{k:<5d} {sec:6.2f} s")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(sys.argv), "cpu": processor_name(), "load_before": load,
                       "load_after": os.getloadavg(), "wall_s": wall, "steps": steps,
                       "linears": [{"rows": r, "out": o, "in": k, "seconds": s, "calls": linear_calls[(r, o, k)]}
                                   for (r, o, k), s in sorted(linears.items())]}, f, indent=1)


def _flags(flags: list[str]) -> dict:
    """--name value pairs after the script's own flags, as LLM keyword arguments."""
    out = {}
    for name, value in zip(flags[::2], flags[1::2]):
        out[name.lstrip("-").replace("-", "_")] = int(value) if value.lstrip("-").isdigit() else value
    return out


if __name__ == "__main__":
    main()
