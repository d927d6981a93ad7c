"""`rackserve bench latency` and `rackserve bench throughput`: offline engine benchmarks that print
ratios against HF transformers run on the same work in the same process, and against the
machine's limits measured on the spot (never asserted in tests).

latency: one stream, TTFT and decode tokens/s, against the weight-read limit (bandwidth / bytes a
decode step must read; the faster of two reads measured before and after the stream's runs).
throughput: N requests of mixed lengths at once, processed (prompt + output) tokens/s, against the
matmul limit (the workload's FLOPs at the measured matmul rate).
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time

from rackserve.config import EngineArgs
from rackserve.serve.cli import register_subcommand


def _engine_args(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs.from_cli_args(args)


def _add_common(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--peer", default="hf", type=_peers,
                        help="also time these on the same work, comma-separated: hf (HF transformers), "
                             "llama.cpp (bench latency only: llama-cpp-python on the same GGUF and "
                             "threads), or none")
    parser.add_argument("--output", help="write the results as JSON here")


def _peers(value: str) -> list[str]:
    peers = [p for p in value.split(",") if p and p != "none"]
    unknown = sorted(set(peers) - {"hf", "llama.cpp"})
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {unknown}; choose among hf, llama.cpp, none")
    return peers


def _random_prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    # Skip the low ids, where tokenizers keep their special tokens.
    return [rng.randrange(256, vocab) for _ in range(n)]


def _cost(llm):
    """What the model must read and compute, counted on a meta-device copy (any executor)."""
    from rackserve.bench.forward_steps import model_cost
    config = llm.engine.config
    return model_cost(config.model, config.cache.cache_dtype)


def _workload_flops(cost, requests: list[tuple[list[int], int]]) -> int:
    """FLOPs of serving the requests: each prompt's prefill, then each decode over its context."""
    from rackserve.bench.forward_steps import ForwardPoint
    total = 0
    for prompt, out in requests:
        total += cost.step_flops(ForwardPoint("prefill", 1, 0, len(prompt)))
        total += sum(cost.step_flops(ForwardPoint("decode", 1, len(prompt) + j, 1)) for j in range(out - 1))
    return total


def _write(path: str | None, result: dict) -> None:
    from rackserve.bench.record import machine_state
    result["command"] = "rackserve " + " ".join(sys.argv[1:])
    result["machine"] = machine_state()         # the load it ran under
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")


def _kernels(llm) -> dict[str, str | None]:
    """The native library build and the quantized-linear kernel a run used: its figures depend on them."""
    m = llm.engine.config.model
    return {"native_isa": m.native_isa, "quant_kernel": m.quant_kernel if m.quantization == "gguf" else None}


# ---- latency ------------------------------------------------------------------------------


def _add_latency_args(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)


def _stream_once(llm, prompt: list[int], output_len: int, request_id: str) -> tuple[float, float, float, int]:
    """(TTFT seconds, decode tokens/s after the first token, the median step's seconds, prompt
    tokens the prefix cache served)."""
    from rackserve.sampling_params import SamplingParams
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    times, cached = [], 0
    while engine.has_unfinished_requests():
        if outputs := engine.step():
            times.append(time.perf_counter())
            cached = max(cached, *(o.num_cached_tokens for o in outputs))
    return times[0] - t0, (len(times) - 1) / (times[-1] - times[0]), statistics.median(
        b - a for a, b in zip(times, times[1:])), cached


def _timed_each(fn, prompts: list[list[int]]) -> tuple[list[tuple], int | None]:
    """fn(prompt) for each prompt, and the preemptions our threads took meanwhile (limits.preemptions)."""
    from rackserve.bench.limits import preemptions
    before = preemptions()
    out = [fn(prompt) for prompt in prompts]
    after = preemptions()
    return out, None if before is None or after is None else after - before


@register_subcommand("bench latency", "single-stream TTFT and decode tokens/s, against HF and the "
                     "weight-read limit", _add_latency_args)
def run_latency(args: argparse.Namespace) -> None:
    from rackserve import LLM
    from rackserve.bench.limits import measure_limits
    engine_args = _engine_args(args)
    llm = LLM(**vars(engine_args))
    rng = random.Random(engine_args.seed)
    # A prompt of its own for the warm-up and for each run, the same ones for every system: each
    # TTFT is then a cold prefill (a repeated prompt is a prefix hit for rackserve and llama.cpp).
    prompts = [_random_prompt(rng, llm.engine.core.executor.vocab_size, args.input_len) for _ in range(args.runs + 1)]
    # The read rate is measured before and after rackserve's runs and the faster kept: the host's
    # other tenants move it from minute to minute, and a limit measured low would flatter the figure.
    limits_before = measure_limits(llm.engine.config.model.device)
    _stream_once(llm, prompts[0], 8, "warmup")
    ids = itertools.count(1)
    runs, preempted = _timed_each(lambda p: _stream_once(llm, p, args.output_len, f"run{next(ids)}"), prompts[1:])
    ttft = statistics.median(r[0] for r in runs)
    tps = statistics.median(r[1] for r in runs)
    # A step that lost a scheduler slice to another task is slower by the slice: the median step
    # says what the code does when nothing takes the CPU, the rate above what this run got.
    median_step_tps = 1 / statistics.median(r[2] for r in runs)
    from rackserve.bench.forward_steps import ForwardPoint
    step_bytes = _cost(llm).step_bytes(ForwardPoint("decode", 1, args.input_len + args.output_len // 2, 1))
    device, kernels = llm.engine.config.model.device, _kernels(llm)
    llm.shutdown()
    limits_after = measure_limits(device)
    limits = max(limits_before, limits_after, key=lambda lim: lim.mem_read_gbps)
    limit_tps = limits.mem_read_gbps * 1e9 / step_bytes
    result = {"bench": "latency", "model": engine_args.model, "input_len": args.input_len,
              "output_len": args.output_len, "runs": args.runs, "limits": vars(limits),
              "mem_read_gbps_before_after": [limits_before.mem_read_gbps, limits_after.mem_read_gbps],
              "decode_step_bytes": step_bytes, "weight_read_limit_tok_s": limit_tps, **kernels,
              "rackserve": {"ttft_s": ttft, "decode_tok_s": tps, "median_step_tok_s": median_step_tps,
                            "preemptions": preempted, "decode_steps": args.runs * (args.output_len - 1),
                            "cached_prompt_tokens": sum(r[3] for r in runs)}}
    print(f"machine: {limits.describe()}; native library {kernels['native_isa']}, "
          f"quantized-linear kernel {kernels['quant_kernel']}")
    print(f"rackserve  TTFT {ttft * 1e3:7.1f} ms   decode {tps:6.1f} tok/s "
          f"({tps / limit_tps:.0%} of the weight-read limit {limit_tps:.1f} tok/s)")
    print(f"           at its median step {median_step_tps:6.1f} tok/s ({median_step_tps / limit_tps:.0%}); "
          f"preempted {preempted} times in {args.runs * (args.output_len - 1)} steps")
    if "llama.cpp" in args.peer:
        import torch
        from rackserve.bench.llama_cpp_peer import llama_cpp_stream_timing, load_llama_cpp
        threads = torch.get_num_threads()
        peer_llm = load_llama_cpp(engine_args.model, threads, args.input_len + args.output_len + 16)
        llama_cpp_stream_timing(peer_llm, prompts[0], 8)
        peer, peer_preempted = _timed_each(lambda p: llama_cpp_stream_timing(peer_llm, p, args.output_len), prompts[1:])
        del peer_llm
        cpp_ttft = statistics.median(r[0] for r in peer)
        cpp_tps = statistics.median(r[1] for r in peer)
        result["llama_cpp"] = {"ttft_s": cpp_ttft, "decode_tok_s": cpp_tps, "threads": threads,
                               "preemptions": peer_preempted}
        result["decode_ratio_vs_llama_cpp"] = tps / cpp_tps
        print(f"llama.cpp  TTFT {cpp_ttft * 1e3:7.1f} ms   decode {cpp_tps:6.1f} tok/s ({threads} threads)")
        print(f"rackserve / llama.cpp decode: {tps / cpp_tps:.2f}x")
    if "hf" in args.peer:
        from rackserve.bench.hf_peer import hf_stream_timing, load_hf_model
        model = load_hf_model(engine_args.model)
        hf_stream_timing(model, prompts[0], 8)
        peer, peer_preempted = _timed_each(lambda p: hf_stream_timing(model, p, args.output_len), prompts[1:])
        hf_ttft = statistics.median(r[0] for r in peer)
        hf_tps = statistics.median(r[1] for r in peer)
        hf_dtype = str(model.dtype).removeprefix("torch.")
        result["hf"] = {"ttft_s": hf_ttft, "decode_tok_s": hf_tps, "preemptions": peer_preempted, "dtype": hf_dtype}
        result["decode_ratio_vs_hf"] = tps / hf_tps
        print(f"HF         TTFT {hf_ttft * 1e3:7.1f} ms   decode {hf_tps:6.1f} tok/s ({hf_dtype})")
        print(f"rackserve / HF decode: {tps / hf_tps:.2f}x")
    _write(args.output, result)


# ---- throughput ---------------------------------------------------------------------------


def _add_throughput_args(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len-range", default="64,512", help="min,max prompt tokens")
    parser.add_argument("--output-len-range", default="16,128", help="min,max output tokens")
    parser.add_argument("--peer-batch-size", type=int, default=8, help="HF generate() batch size")


@register_subcommand("bench throughput", "offline throughput of mixed-length requests, against HF "
                     "and the matmul limit", _add_throughput_args)
def run_throughput(args: argparse.Namespace) -> None:
    if "llama.cpp" in args.peer:
        raise SystemExit("bench throughput has no llama.cpp peer: use bench serve against llama-server")
    from rackserve import LLM, SamplingParams
    from rackserve.bench.limits import measure_limits
    engine_args = _engine_args(args)
    llm = LLM(**vars(engine_args))
    rng = random.Random(engine_args.seed)
    lo_in, hi_in = map(int, args.input_len_range.split(","))
    lo_out, hi_out = map(int, args.output_len_range.split(","))
    vocab = llm.engine.core.executor.vocab_size
    requests = [(_random_prompt(rng, vocab, rng.randint(lo_in, hi_in)), rng.randint(lo_out, hi_out))
                for _ in range(args.num_prompts)]
    total = sum(len(p) + o for p, o in requests)
    llm.generate([{"prompt_token_ids": requests[0][0][:16]}], SamplingParams(max_tokens=4))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests],
                        [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in requests])
    elapsed = time.perf_counter() - t0
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(o for _, o in requests)
    flops = _workload_flops(_cost(llm), requests)
    device, kernels = llm.engine.config.model.device, _kernels(llm)
    llm.shutdown()
    limits = measure_limits(device)
    # The processed-token rate at which the workload's FLOPs run at the measured matmul rate.
    limit_tps = total / (flops / (limits.matmul_gflops * 1e9))
    tps = total / elapsed
    result = {"bench": "throughput", "model": engine_args.model, "num_prompts": args.num_prompts,
              "prompt_tokens": sum(len(p) for p, _ in requests), "output_tokens": sum(o for _, o in requests),
              "limits": vars(limits), "flops": flops,
              "rackserve": {"seconds": elapsed, "processed_tok_s": tps}, "matmul_limit_tok_s": limit_tps, **kernels}
    print(f"machine: {limits.describe()}; native library {kernels['native_isa']}, "
          f"quantized-linear kernel {kernels['quant_kernel']}")
    print(f"{args.num_prompts} requests, {result['prompt_tokens']} prompt + {result['output_tokens']} "
          f"output tokens")
    print(f"rackserve  {elapsed:7.1f} s   {tps:6.1f} processed tok/s "
          f"({tps / limit_tps:.0%} of the matmul limit {limit_tps:.0f} tok/s)")
    if "hf" in args.peer:
        from rackserve.bench.hf_peer import hf_batched_generate_seconds, load_hf_model
        model = load_hf_model(engine_args.model)
        hf_s = hf_batched_generate_seconds(model, requests, args.peer_batch_size)
        hf_dtype = str(model.dtype).removeprefix("torch.")
        result["hf"] = {"seconds": hf_s, "processed_tok_s": total / hf_s, "batch_size": args.peer_batch_size,
                        "dtype": hf_dtype}
        result["ratio_vs_hf"] = hf_s / elapsed
        print(f"HF         {hf_s:7.1f} s   {total / hf_s:6.1f} processed tok/s "
              f"(generate, static batches of {args.peer_batch_size}, {hf_dtype})")
        print(f"rackserve / HF: {hf_s / elapsed:.2f}x")
    _write(args.output, result)
