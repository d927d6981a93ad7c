"""What one step's penalties cost the whole batch, in process: a batch of rows with long prompts
(the shape of one request with n=128 and an 8,000-token prompt) and some outputs each, penalised.
Two ways, alternated in one run so that load drift falls on both:
  lists: what main did before hunt7 (copied below): every step, Python lists of every row's prompt
         + output tokens turned into (row, token) index pairs;
  rows:  what the runner does now (model/penalties.py): each row built once when its request first
         samples (timed apart, as `build`), then a step is tensor work over each row's distinct
         seen tokens, plus the sampled tokens appended.
Both sides' logits are checked equal (to float32 rounding). It serves nothing.

  python bench/penalties_step.py --output bench/results/penalties-step-h7.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rackserve.cpu_dtype import cpu_identity  # noqa: E402
from rackserve.model.penalties import PenaltyRows  # noqa: E402
from rackserve.sampling_params import SamplingParams  # noqa: E402


def _positions(token_lists: dict[int, list[int]], vocab: int, unique: bool) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(ids) for ids in token_lists.values()])
    row = torch.repeat_interleave(torch.tensor(list(token_lists), dtype=torch.long), lengths)
    col = torch.tensor([t for ids in token_lists.values() for t in ids], dtype=torch.long)
    if unique:
        key = torch.unique(row * vocab + col)
        row, col = key // vocab, key % vocab
    return row, col


def lists_way(logits: torch.Tensor, rows: list[tuple[SamplingParams, list[int], list[int]]]) -> torch.Tensor:
    """rackserve's apply_penalties at 2fdde1c (CPU only), rows as (params, prompt, output)."""
    logits = logits.clone()
    vocab = logits.shape[1]
    seen = {i: prompt + output for i, (p, prompt, output) in enumerate(rows) if p.repetition_penalty != 1.0}
    if seen:
        row, col = _positions(seen, vocab, unique=True)
        penalty = torch.tensor([p.repetition_penalty for p, _, _ in rows])[row]
        values = logits[row, col]
        logits[row, col] = torch.where(values > 0, values / penalty, values * penalty)
    output = {i: out for i, (p, _, out) in enumerate(rows) if out and (p.presence_penalty or p.frequency_penalty)}
    if output:
        frequency = torch.tensor([p.frequency_penalty for p, _, _ in rows])
        presence = torch.tensor([p.presence_penalty for p, _, _ in rows])
        row, col = _positions(output, vocab, unique=False)
        logits.index_put_((row, col), -frequency[row], accumulate=True)
        row, col = _positions(output, vocab, unique=True)
        logits.index_put_((row, col), -presence[row], accumulate=True)
    return logits


def run_case(vocab: int, batch: int, penalised: int, prompt_len: int, outputs: int, params: SamplingParams,
             steps: int) -> dict:
    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]        # one request's n samples share it
    outs = [[rng.randrange(vocab) for _ in range(outputs)] for _ in range(penalised)]
    plain = SamplingParams()
    lists = [(params, prompt, list(o)) for o in outs] + [(plain, prompt, []) for _ in range(batch - penalised)]
    pool = PenaltyRows(torch.device("cpu"))
    t0 = time.perf_counter()
    pool.reserve(penalised, vocab)
    rows = [pool.add(prompt, o, vocab) for o in outs]
    build = time.perf_counter() - t0
    times: dict[str, list[float]] = {"lists": [], "rows": []}
    worst = 0.0
    for step in range(steps):
        logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(step)) * 3
        tokens = [rng.randrange(vocab) for _ in range(penalised)]
        t0 = time.perf_counter()
        want = lists_way(logits, lists)
        times["lists"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = pool.apply(logits, list(range(penalised)), rows, [params] * penalised)
        pool.append(rows, tokens)
        times["rows"].append(time.perf_counter() - t0)
        worst = max(worst, float((got - want).abs().max()))
        for (_, _, out), t in zip(lists, tokens):
            out.append(t)
    assert worst < 1e-4, f"the two ways disagree by {worst}"
    return {"vocab": vocab, "batch": batch, "penalised_rows": penalised, "prompt_tokens": prompt_len,
            "outputs_at_start": outputs, "params": {k: getattr(params, k) for k in
                                                    ("repetition_penalty", "presence_penalty", "frequency_penalty")},
            "steps": steps, "build_ms": round(build * 1e3, 1),
            "pool_mib": round(pool.capacity * vocab * 5 / 2**20, 1), "max_abs_diff": worst,
            **{f"{way}_ms_median": round(statistics.median(t) * 1e3, 2) for way, t in times.items()},
            **{f"{way}_ms_max": round(max(t) * 1e3, 2) for way, t in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    result = {"command": " ".join(sys.argv), "cpu": cpu_identity(), "torch_threads": torch.get_num_threads(),
              "loadavg_before": os.getloadavg(), "runs": []}
    repetition = SamplingParams(repetition_penalty=1.1)
    all_three = SamplingParams(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
    cases = [(49152, 128, 128, 8000, 64, repetition), (49152, 128, 128, 8000, 64, all_three),
             (49152, 128, 1, 8000, 64, all_three), (129280, 128, 128, 8000, 64, repetition)]
    for vocab, batch, penalised, prompt_len, outputs, params in cases:
        run = run_case(vocab, batch, penalised, prompt_len, outputs, params, args.steps)
        result["runs"].append(run)
        print(run, flush=True)
    result["loadavg_after"] = os.getloadavg()
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
