"""`rackserve bench gate`: the pruned gate (MegaGate) against the plain gate on random many-expert
routers: how many experts it scores exactly per token, how tight its bound is, whether it chose
the same experts, and its time against the plain gate's, per batch size (medians of interleaved
repeats, in one process).

Routers are random (gate rows N(0, 0.02), inputs N(0, 1) as after RMSNorm, DeepSeek-style bias
N(0, 0.05)): a stand-in for trained routers, whose logits may be better or worse separated. This
file owns the presets and the report; it never asserts a speed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from rackserve.serve.cli import register_subcommand


@dataclass(frozen=True)
class Preset:
    name: str
    hidden_size: int
    num_experts: int
    top_k: int
    scoring: str
    num_groups: int = 1
    topk_groups: int = 1


PRESETS = {p.name: p for p in [
    Preset("megagate-384x6", 7168, 384, 6, "sigmoid"),    # the seeds' V4.1-Flash routing; hidden size assumed
    Preset("deepseek-v3-256x8", 7168, 256, 8, "sigmoid", 8, 4),
    Preset("deepseek-v4-flash-256x6", 4096, 256, 6, "sigmoid"),
    Preset("qwen3-235b-128x8", 4096, 128, 8, "softmax"),
    Preset("tiny-64x4", 64, 64, 4, "sigmoid"),
]}


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--presets", default=",".join(PRESETS), help=f"comma-separated, of {list(PRESETS)}")
    parser.add_argument("--batch-sizes", default="1,8,64,512", help="tokens per call, comma-separated")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per gate and batch size")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="write the results as JSON here")


def _median_ms(fns: list, repeats: int) -> list[float]:
    """Median wall time of each function, called in turn `repeats` times after one warm-up each,
    so that a change in the machine's load hits all of them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
    return [1e3 * statistics.median(ts) for ts in times]


def bench_preset(preset: Preset, batch_sizes: list[int], repeats: int, seed: int) -> dict:
    import torch

    from rackserve.model.gate import MoEGate, RoutingConfig, choice_scores

    cfg = RoutingConfig(preset.num_experts, preset.top_k, preset.scoring, True, preset.num_groups,
                        preset.topk_groups, use_correction_bias=preset.scoring == "sigmoid")
    g = torch.Generator().manual_seed(seed)
    plain, pruned = MoEGate(preset.hidden_size, cfg, "plain"), MoEGate(preset.hidden_size, cfg, "pruned")
    plain.weight.data.copy_(torch.randn(cfg.num_experts, preset.hidden_size, generator=g) * 0.02)
    if cfg.use_correction_bias:
        plain.e_score_correction_bias.data.copy_(torch.randn(cfg.num_experts, generator=g) * 0.05)
    pruned.load_state_dict(plain.state_dict())
    for router in (plain, pruned):
        router.process_weights_after_loading()
    weight, bias = plain.weight, plain.e_score_correction_bias
    points = []
    for t in batch_sizes:
        x = torch.randn(t, preset.hidden_size, generator=g)
        with torch.inference_mode():
            want = plain(x)
            got, num_scored = pruned.gate.route(x, weight, bias)
            lo, hi = pruned.gate.score_bounds(x, bias)
            scores = choice_scores(cfg, torch.nn.functional.linear(x, weight), bias).double()
            plain_ms, pruned_ms, bound_ms = _median_ms(
                [lambda: plain(x), lambda: pruned(x), lambda: pruned.gate.score_bounds(x, bias)], repeats)
        same = (want.topk_ids.sort(-1).values == got.topk_ids.sort(-1).values).all(-1)
        counts = num_scored.float()
        points.append({
            "batch_size": t,
            "scored_per_token_mean": round(counts.mean().item(), 2),
            "scored_per_token_p50": counts.median().item(),
            "scored_per_token_max": int(counts.max()),
            "tokens_with_other_experts": int((~same).sum()),
            # Half the bracket over the spread of the scores: how wide the worst-case bound is; and the
            # largest share of it the actual rounding used (never above 1): how loose it is.
            "bound_halfwidth_over_score_std": round(((hi - lo) / 2).mean().item() / scores.std().item(), 4),
            "max_error_over_halfwidth": round((2 * (scores - (lo + hi) / 2).abs() / (hi - lo)).max().item(), 4),
            "plain_ms": round(plain_ms, 4),
            "pruned_ms": round(pruned_ms, 4),
            "bound_only_ms": round(bound_ms, 4),
            "pruned_over_plain": round(pruned_ms / plain_ms, 3),
        })
    return {"preset": asdict(preset), "points": points}


@register_subcommand("bench gate", "pruned gate (MegaGate) vs plain gate on random many-expert routers: "
                     "experts scored exactly per token and time", _add_args)
def run_gate(args: argparse.Namespace) -> None:
    import torch

    from rackserve.bench.limits import processor_name
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n for n in args.presets.split(",") if n]
    unknown = sorted(set(names) - set(PRESETS))
    if unknown:
        raise SystemExit(f"unknown preset(s) {unknown}; choose from {list(PRESETS)}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    result = {"bench": "gate", "command": "rackserve " + " ".join(sys.argv[1:]), "processor": processor_name(),
              "threads": torch.get_num_threads(), "repeats": args.repeats, "presets": []}
    print(f"{'preset':<26}{'tokens':>7}{'scored/tok':>11}{'max':>5}{'differ':>7}{'bound/std':>10}{'err/bound':>10}"
          f"{'plain ms':>10}{'pruned ms':>10}{'bound ms':>10}{'ratio':>7}")
    for name in names:
        entry = bench_preset(PRESETS[name], batch_sizes, args.repeats, args.seed)
        result["presets"].append(entry)
        for p in entry["points"]:
            print(f"{name:<26}{p['batch_size']:>7}{p['scored_per_token_mean']:>11.2f}{p['scored_per_token_max']:>5}"
                  f"{p['tokens_with_other_experts']:>7}{p['bound_halfwidth_over_score_std']:>10.4f}"
                  f"{p['max_error_over_halfwidth']:>10.3f}"
                  f"{p['plain_ms']:>10.3f}{p['pruned_ms']:>10.3f}{p['bound_only_ms']:>10.3f}"
                  f"{p['pruned_over_plain']:>7.2f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.output}")
