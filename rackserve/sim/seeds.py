"""The seeds' step-level figures (reference/published-figures.md) beside the cost model's, with the
error of each, and a sensitivity table: which hardware or engine parameter moves a projection
(decode and prefill throughput per GPU) most.

DeepSeek-V4.1-Flash as the seeds describe it (sim/configs/deepseek-v4.1-flash.json), decoding with
MTP: nextn=3 drafts verified each step (4 tokens per sequence) at an assumed per-draft acceptance
of 0.8 (the seeds give none), so a step yields 1 + 0.8 + 0.64 + 0.51 = 2.95 tokens per sequence;
one user's rate also pays the three draft passes of the MTP block (mtp.py). `step_terms` splits
each step-level scenario term by term.
`python -m rackserve.sim.seeds [--output FILE]`. Closed-loop figures (AgentX curves, prefill
DEP2 vs DEP4, routing A/B) come from `rackserve sim` runs instead (docs/simulator.md).

This file owns those scenarios; it must never change the cost model to fit them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence

from rackserve.sim.cost import CostModel, ParallelShape, SeqWork
from rackserve.sim.hardware import HARDWARE, Hardware
from rackserve.sim.model_spec import ModelSpec, load_model_spec
from rackserve.sim.mtp import draft_seconds

MODEL = "deepseek-v4.1-flash"
NEXTN, ACCEPTANCE = 3, 0.8
TOKENS_PER_STEP = sum(ACCEPTANCE ** i for i in range(NEXTN + 1))


def _model(spec: ModelSpec, hw: Hardware, tp: int, dp: int) -> CostModel:
    """DEP: experts over every rank (EP); the low-latency TP path shards every expert over its
    ranks instead (the seeds: "each rank holds 288 expert columns and 8 attention heads")."""
    return CostModel(spec, hw, ParallelShape(tp, dp, dp > 1), seed=0)


def _step(spec: ModelSpec, hw: Hardware, tp: int, dp: int, batches: list[list[SeqWork]]):
    return _model(spec, hw, tp, dp).step(batches)


def single_user_rate(spec: ModelSpec, hw: Hardware, context: int = 131072) -> float:
    """Tokens a second of one sequence on TP8: the target step verifying NEXTN drafts, then the
    NEXTN draft passes of the MTP block (mtp.py)."""
    model, batches = _model(spec, hw, 8, 1), decode_batches(1, 1, context)
    return TOKENS_PER_STEP / (model.step(batches).seconds + draft_seconds(model, batches, NEXTN))


def decode_batches(dp: int, per_rank: int, context: int) -> list[list[SeqWork]]:
    return [[SeqWork(NEXTN + 1, context, True, NEXTN)] * per_rank for _ in range(dp)]


def prefill_batches(dp: int, new: int, context: int) -> list[list[SeqWork]]:
    """One prompt chunk on DP rank 0; the other ranks idle but in the MoE's all-to-all."""
    return [[SeqWork(new, context)]] + [[] for _ in range(dp - 1)]


def figures(spec: ModelSpec) -> list[dict]:
    gb, vr = HARDWARE["GB300"], HARDWARE["VR200"]
    rows = []

    def row(name: str, published: float, simulated: float, unit: str, note: str = "") -> None:
        rows.append({"figure": name, "published": published, "simulated": simulated, "unit": unit,
                     "error": simulated / published - 1, "note": note})

    dep4 = _step(spec, gb, 1, 4, decode_batches(4, 64, 131072))
    rank = max(dep4.ranks, key=lambda r: r.busy_seconds)
    row("GB300 DEP4 decode 128K, 64 req/rank: MoE share of step", 0.62, rank.moe.seconds / dep4.seconds, "share")
    row("GB300 DEP4 decode 128K, 64 req/rank: attention+indexer share", 0.13,
        rank.attention.seconds / dep4.seconds, "share")
    d128 = _step(spec, gb, 1, 32, decode_batches(32, 64, 131072)).seconds
    d855 = _step(spec, gb, 1, 32, decode_batches(32, 64, 855000)).seconds
    row("GB300 DEP32 decode step at 128K (64 req/rank assumed)", 8.93e-3, d128, "s")
    row("GB300 DEP32 decode step at 855K (64 req/rank assumed)", 9.53e-3, d855, "s")
    row("GB300 DEP32 decode: 855K over 128K", 9.53 / 8.93, d855 / d128, "ratio")
    p0 = _step(spec, gb, 1, 2, prefill_batches(2, 8192, 0)).seconds
    p512 = _step(spec, gb, 1, 2, prefill_batches(2, 8192, 524288)).seconds
    row("GB300 x2 prefill of 8K new tokens, no context", 87.9e-3, p0, "s")
    row("GB300 x2 prefill of 8K new tokens after 512K cached", 189.4e-3, p512, "s")
    for hw, published, name in ((gb, 826.0, "GB300 single-user decode (TP8 assumed)"),
                                (vr, 1810.0, "VR200 batch 1 TP8 decode, P90")):
        row(name + ", 128K context", published, single_user_rate(spec, hw), "tok/s")
    vr_prefill = _step(spec, vr, 1, 2, prefill_batches(2, 8192, 0)).seconds
    row("VR200 vs GB300 DEP2 prefill step (28% faster)", 0.72, vr_prefill / p0, "ratio")
    vr_dep4 = _step(spec, vr, 1, 4, decode_batches(4, 64, 131072)).seconds
    row("VR200 vs GB300 DEP decode step (25% faster)", 0.75, vr_dep4 / dep4.seconds, "ratio")
    return rows


def step_terms(spec: ModelSpec) -> list[dict]:
    """The seeds' step-level scenarios term by term, in ms (the busiest rank's): dense linears, each
    attention kind's kernels (FLOPs, bytes and time of each alone), MoE, communication, fixed floors,
    and MTP's draft passes where a figure is tokens a second of one user."""
    gb, vr = HARDWARE["GB300"], HARDWARE["VR200"]
    scenarios = [("GB300 DEP4 decode 128K, 64 req/rank", gb, 1, 4, decode_batches(4, 64, 131072), False),
                 ("GB300 DEP32 decode 128K, 64 req/rank", gb, 1, 32, decode_batches(32, 64, 131072), False),
                 ("GB300 DEP32 decode 855K, 64 req/rank", gb, 1, 32, decode_batches(32, 64, 855000), False),
                 ("GB300 TP8 batch 1 decode 128K", gb, 8, 1, decode_batches(1, 1, 131072), True),
                 ("VR200 TP8 batch 1 decode 128K", vr, 8, 1, decode_batches(1, 1, 131072), True)]
    out = []
    for name, hw, tp, dp, batches, drafts in scenarios:
        model = _model(spec, hw, tp, dp)
        step = model.step(batches)
        d = max(range(dp), key=lambda i: step.ranks[i].busy_seconds)
        rank, tokens = step.ranks[d], [sum(w.new_tokens for w in b) for b in batches]
        ms = 1e3
        kinds = {label: {kernel: {"ms": op.seconds * ms, "gflop": op.flops / 1e9, "mb": op.bytes / 1e6}
                         for kernel, op in parts.items()}
                 for label, parts in model.attention_by_kind(batches[d]).items()}
        terms = {"dense linears": rank.dense.seconds * ms, "attention (all kinds, as the step times it)":
                 rank.attention.seconds * ms, "MoE (busiest device)": rank.moe.seconds * ms,
                 "TP all-reduce": model._all_reduce(tokens[d]) * ms,
                 "EP all-to-all": model._all_to_all(max(tokens)) * ms,
                 "fixed: step + layer floors": (hw.step_overhead + spec.num_layers * hw.layer_overhead) * ms}
        if drafts:
            terms["MTP drafts (3 passes)"] = draft_seconds(model, batches, NEXTN) * ms
        out.append({"scenario": name, "step_ms": step.seconds * ms, "terms_ms": terms, "attention_by_kind": kinds})
    return out


def sensitivity(spec: ModelSpec) -> list[dict]:
    """Each parameter changed alone: the change of decode throughput per GPU (GB300 DEP4, 128K
    context, 64 requests a rank, MTP) and of prefill throughput per GPU (GB300 DEP2, an 8K chunk)."""
    from rackserve.sim.efficiency import EFFICIENCY
    gb = HARDWARE["GB300"]

    def rates(s: ModelSpec, hw: Hardware, per_rank: int = 64, context: int = 131072, chunk: int = 8192,
              tokens_per_step: float = TOKENS_PER_STEP) -> tuple[float, float]:
        decode = _step(s, hw, 1, 4, decode_batches(4, per_rank, context)).seconds
        prefill = _step(s, hw, 1, 2, prefill_batches(2, chunk, 0)).seconds
        return per_rank * tokens_per_step / decode, chunk / prefill / 2

    base = rates(spec, gb)
    eff = dict(EFFICIENCY)
    variants = {
        "FLOP/s x2": (spec, dataclasses.replace(gb, flops={k: 2 * v for k, v in gb.flops.items()}), {}),
        "HBM bandwidth x2": (spec, dataclasses.replace(gb, mem_bw=2 * gb.mem_bw), {}),
        "NVLink bandwidth x2": (spec, dataclasses.replace(gb, scale_up_bw=2 * gb.scale_up_bw), {}),
        "fixed overheads x2": (spec, dataclasses.replace(gb, step_overhead=2 * gb.step_overhead,
                                                         layer_overhead=2 * gb.layer_overhead,
                                                         kernel_overhead=2 * gb.kernel_overhead), {}),
        "MoE GEMM efficiency x1.5": (spec, dataclasses.replace(
            gb, efficiency={**eff, "moe_flops": 1.5 * eff["moe_flops"]}), {}),
        "KV bytes per token x2": (dataclasses.replace(spec, kv_entry_bytes=2 * spec.entry_bytes), gb, {}),
        "expert weights fp8 (not fp4)": (dataclasses.replace(spec, expert_precision="fp8"), gb, {}),
        "experts per token x2": (dataclasses.replace(spec, experts_per_token=2 * spec.experts_per_token), gb, {}),
        "engine: requests per DP rank x2": (spec, gb, {"per_rank": 128}),
        "engine: prefill chunk x2 (16K)": (spec, gb, {"chunk": 16384}),
        "engine: MTP acceptance 0.8 -> 0.9": (spec, gb, {"tokens_per_step": sum(0.9 ** i for i in range(NEXTN + 1))}),
        "workload: context x2 (256K)": (spec, gb, {"context": 262144}),
    }
    rows = []
    for name, (s, hw, kw) in variants.items():
        decode, prefill = rates(s, hw, **kw)
        rows.append({"parameter": name, "decode": decode / base[0] - 1, "prefill": prefill / base[1] - 1})
    return sorted(rows, key=lambda r: -max(abs(r["decode"]), abs(r["prefill"])))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the seeds' step-level figures beside the cost model's")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    spec = load_model_spec(MODEL)
    rows, sens, terms = figures(spec), sensitivity(spec), step_terms(spec)
    for r in rows:
        print(f"{r['figure']:<62} published {r['published']:>10.4g} {r['unit']:<6} sim {r['simulated']:>10.4g}"
              f"  ({r['error']:+.0%})")
    for t in terms:
        print(f"\n{t['scenario']}: step {t['step_ms']:.3f} ms")
        for term, v in t["terms_ms"].items():
            print(f"  {term:<44} {v:8.3f} ms")
        for label, kernels in t["attention_by_kind"].items():
            print(f"  {label}: " + ", ".join(f"{k} {v['ms']:.3f} ms" for k, v in kernels.items() if v["ms"]))
    print("\nsensitivity (each alone):            decode tok/s/GPU   prefill tok/s/GPU")
    for r in sens:
        print(f"  {r['parameter']:<34} {r['decode']:>+10.1%} {r['prefill']:>+14.1%}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": MODEL, "nextn": NEXTN, "acceptance": ACCEPTANCE, "figures": rows,
                       "sensitivity": sens, "step_terms": terms,
                       "command": "python -m rackserve.sim.seeds --output " + args.output},
                      f, indent=1)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
