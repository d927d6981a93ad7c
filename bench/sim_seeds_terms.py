"""How each of the eighth round's cost-model terms moves the seeds' step-level figures: the figures
of `python -m rackserve.sim.seeds` with the terms added one at a time (cumulative), each earlier
state restored by switching a term off (DeepSeek-V4's default layer schedule instead of the
published one; no top-k score traffic; no kernel floors of the compressed layers; EP instead of
TP-sharded experts on the TP8 path; no MTP draft passes). The attention, the indexer's scoring and
its top-k are timed as separate kernels in every column. It changes nothing it measures.

  python bench/sim_seeds_terms.py --output bench/results/sim-seeds-terms-r8.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from rackserve.sim import attention_work, seeds
from rackserve.sim.hardware import HARDWARE
from rackserve.sim.model_spec import _deepseek_v4, load_config

STEPS = [("round 7 terms, default schedule", False, dict(floors=False, topk=False, drafts=False, tp_experts=False)),
         ("+ published layer schedule", True, dict(floors=False, topk=False, drafts=False, tp_experts=False)),
         ("+ top-k score traffic", True, dict(floors=False, topk=True, drafts=False, tp_experts=False)),
         ("+ compressed layers' kernel floors", True, dict(floors=True, topk=True, drafts=False, tp_experts=False)),
         ("+ TP-sharded experts on the TP8 path", True, dict(floors=True, topk=True, drafts=False, tp_experts=True)),
         ("+ MTP draft passes", True, dict(floors=True, topk=True, drafts=True, tp_experts=True))]


def figures(published_schedule: bool, floors: bool, topk: bool, drafts: bool, tp_experts: bool) -> list[dict]:
    config = load_config(seeds.MODEL)
    if not published_schedule:
        config = {k: v for k, v in config.items() if k != "compress_ratios"}
    spec = _deepseek_v4(seeds.MODEL, config)
    saved = seeds.HARDWARE, attention_work.SCORE_BYTES, seeds.draft_seconds, seeds._model
    try:
        if not floors:
            seeds.HARDWARE = {k: dataclasses.replace(v, kernel_overhead=0.0) for k, v in HARDWARE.items()}
        if not topk:
            attention_work.SCORE_BYTES = 0.0
        if not drafts:
            seeds.draft_seconds = lambda *a: 0.0
        if not tp_experts:
            seeds._model = lambda s, hw, tp, dp: seeds.CostModel(s, hw, seeds.ParallelShape(tp, dp, True), seed=0)
        return seeds.figures(spec)
    finally:
        seeds.HARDWARE, attention_work.SCORE_BYTES, seeds.draft_seconds, seeds._model = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    columns = [(name, figures(schedule, **kw)) for name, schedule, kw in STEPS]
    names = [r["figure"] for r in columns[0][1]]
    print("figure | " + " | ".join(name for name, _ in columns))
    for i, figure in enumerate(names):
        print(figure + " | " + " | ".join(f"{rows[i]['error']:+.0%}" for _, rows in columns))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"what": __doc__.splitlines()[0], "command": "python bench/sim_seeds_terms.py --output "
                       + args.output, "columns": [{"terms": name, "figures": rows} for name, rows in columns]},
                      f, indent=1)
        print("wrote", args.output)


if __name__ == "__main__":
    main()
