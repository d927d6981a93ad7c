"""What one sampling step costs a batch of random rows with top_k/top_p, in process (CPU): the
shape of one request with n=128 (or 128 requests) decoding. Two samplers, alternated in one run so
that load drift falls on both:
  before: rackserve/model/sampler.py at --before (a27d31a: a top-k of 256 (or the largest top_k)
          for the whole batch, then a sort of every row's whole vocabulary when any row's set
          reached past it);
  after:  this tree's (cutoffs among each row's 1,024 largest logits by numpy partition, a whole-
          row sort only for the rows left undecided, the mask in place).
Timed: apply_top_k_top_p alone, and the whole Sampler call (temperature, filters, softmax, the
exponential race). The kept sets of both are compared (rows that differ are counted: ties past the
256-wide window, a bug of `before`, and float32 rounding at the top_p boundary). It serves nothing.

  python bench/sampler_step.py --output bench/results/sampler-step-h9.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rackserve.cpu_dtype import cpu_identity  # noqa: E402
from rackserve.model import sampler as after  # noqa: E402
from rackserve.sampling_params import SamplingParams  # noqa: E402


def load_before(rev: str):
    """rackserve/model/sampler.py as it was at `rev`, as a module of its own."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:rackserve/model/sampler.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampler_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sampler_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sampler_before"] = module     # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_case(before, vocab: int, batch: int, scale: float, params: SamplingParams, steps: int) -> dict:
    rows_after = [after.SamplingRow(params, None) for _ in range(batch)]
    rows_before = [before.SamplingRow(params, None) for _ in range(batch)]
    samplers = {"before": before.Sampler(0, torch.device("cpu")), "after": after.Sampler(0, torch.device("cpu"))}
    filters = {"before": before.apply_top_k_top_p, "after": after.apply_top_k_top_p}
    k, p = [params.top_k] * batch, [params.top_p] * batch
    times: dict[str, list[float]] = {f"{way}_{what}": [] for way in samplers for what in ("filter", "step")}
    differing = kept_after = 0
    for step in range(steps):
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(step)) * scale
        ways = ("before", "after") if step % 2 == 0 else ("after", "before")
        kept = {}
        for way in ways:
            t0 = time.perf_counter()
            out = filters[way](logits, k, p)
            times[f"{way}_filter"].append(time.perf_counter() - t0)
            kept[way] = torch.isfinite(out)
            t0 = time.perf_counter()
            samplers[way](logits, rows_before if way == "before" else rows_after)
            times[f"{way}_step"].append(time.perf_counter() - t0)
        differing += int((kept["before"] != kept["after"]).any(dim=-1).sum())
        kept_after += int(kept["after"].sum())
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"vocab": vocab, "batch": batch, "logit_scale": scale, "top_k": params.top_k, "top_p": params.top_p,
            "steps": steps, "mean_kept_tokens": round(kept_after / steps / batch, 1),
            "rows_kept_differently": differing,
            **{f"{name}_ms_median": round(v, 1) for name, v in med.items()},
            "filter_speedup": round(med["before_filter"] / med["after_filter"], 2),
            "step_speedup": round(med["before_step"] / med["after_step"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="a27d31a", help="the git revision to compare against")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    before = load_before(args.before)
    result = {"command": " ".join(sys.argv), "cpu": cpu_identity(),
              "torch_threads": torch.get_num_threads(), "loadavg_before": os.getloadavg(), "runs": []}
    # Logits scale 3: top_p 0.9 keeps a few hundred to a few thousand tokens a row (past the old
    # 256 window); scale 6: a few dozen, within it.
    # Scale 0.5: flat, as a tiny random model's (bench/penalties_served.py): every row sorts whole.
    cases = [(49152, 3.0, SamplingParams(top_p=0.9)), (49152, 6.0, SamplingParams(top_p=0.9)),
             (49152, 0.5, SamplingParams(top_p=0.9)),
             (49152, 3.0, SamplingParams(top_k=50)), (49152, 3.0, SamplingParams(top_k=50, top_p=0.9)),
             (129280, 3.0, SamplingParams(top_p=0.9)), (129280, 6.0, SamplingParams(top_p=0.9))]
    for vocab, scale, params in cases:
        run = run_case(before, vocab, args.batch, scale, params, args.steps)
        result["runs"].append(run)
        print(run, flush=True)
    result["loadavg_after"] = os.getloadavg()
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
