"""How many int8 parts a packed linear's activations need, measured on SmolLM2's own activations.

The vnni kernel (csrc/vnni_gemv.cpp) quantizes each 32-value block of a linear's input into two
int8 parts (q at max|x| / 127, the residual at a 256th of that), so that its products equal
float32's to ~1e-5; each weight byte then costs two dot products, and a prompt chunk runs at the
integer unit's peak. One part (llama.cpp's Q8 activations) halves that work, and the eighteenth
round measured what it costs: logits up to 16 off, 91.5% top-1 agreement. This script asks
whether the second part is needed everywhere or only in the blocks that hold one of the model's
large activations: transformers runs the GGUF in float32 with every projection's input rounded
as a kernel would round it (one part, two parts, or two parts only where a block's max|x| exceeds
tau times its row's RMS, decided per row or per tile of 12 rows as the kernel walks them), and
the logits over one prompt are compared with the unrounded float32 run's (and transformers'
bfloat16 run's, for scale). Then the engine itself, the packed GGUF through the real vnni kernel,
once per --packed-activations mode (rs_vnni_gemv_parts: the "per row" rule at
vnni_linear.ACTIVATION_PARTS's threshold). Prints, per variant, the share of blocks given two
parts, max |logit diff|, mean KL and top-1 agreement, and writes them as JSON.

    python bench/activation_parts_numerics.py --taus 2,3,4,6,8 --output bench/results/activation-parts-smollm2.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rackserve.bench.record import machine_state  # noqa: E402
from rackserve.config import smollm2_gguf_path  # noqa: E402
from tests.test_model_parity import prefill_logits  # noqa: E402  (one prefill through a paged cache)

BLOCK, TILE_ROWS = 32, 12


def rounded(x: torch.Tensor, mode: str, tau: float, counts: list[int]) -> torch.Tensor:
    """x [rows, k] as the kernel would see it: per 32-value block, q * dx (one part) or
    q * dx + r * dx / 256 (two parts), two parts where `mode` says."""
    rows, k = x.shape
    b = x.reshape(rows, k // BLOCK, BLOCK)
    dx = b.abs().amax(-1, keepdim=True) / 127
    safe = torch.where(dx > 0, dx, torch.ones_like(dx))
    q = torch.round(b / safe).clamp(-127, 127)
    one = q * dx
    dr = dx / 256
    r = torch.round((b - one) / torch.where(dr > 0, dr, torch.ones_like(dr))).clamp(-127, 127)
    two = one + r * dr
    if mode == "two":
        need = torch.ones(rows, k // BLOCK, 1, dtype=torch.bool)
    elif mode == "one":
        need = torch.zeros(rows, k // BLOCK, 1, dtype=torch.bool)
    else:
        rms = b.pow(2).mean((-1, -2), keepdim=True).sqrt()
        need = b.abs().amax(-1, keepdim=True) > tau * rms
        if mode == "tile":   # one decision per (tile of 12 rows, block), as a 12-row tile call would make it
            pad = (-rows) % TILE_ROWS
            n = torch.nn.functional.pad(need.squeeze(-1).float(), (0, 0, 0, pad))
            n = n.reshape(-1, TILE_ROWS, k // BLOCK).amax(1, keepdim=True).expand(-1, TILE_ROWS, -1)
            need = n.reshape(-1, k // BLOCK)[:rows].bool().unsqueeze(-1)
    counts[0] += int(need.sum())
    counts[1] += need.numel()
    return torch.where(need, two, one).reshape(rows, k)


def logits_with(model, ids: torch.Tensor, mode: str | None, tau: float = 0.0,
                lm_head: bool = False) -> tuple[torch.Tensor, float]:
    counts = [0, 0]
    hooks = []
    if mode is not None:
        def pre(_module, args):
            (x,) = args
            shape = x.shape
            return (rounded(x.reshape(-1, shape[-1]).float(), mode, tau, counts).reshape(shape).to(x.dtype),)
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and (lm_head or "lm_head" not in name):
                hooks.append(module.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            out = model(ids).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    return out, counts[0] / counts[1] if counts[1] else float("nan")


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    lp_ref, lp = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    return {"max_abs_logit_diff": float((ref - got).abs().max()), "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()), "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).float().mean())}


def prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt's and the results file's options."""
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--prompt-file", default="README.md", help="text whose first --prompt-tokens tokens are the prompt")
    parser.add_argument("--output")


def smollm2_prompt(prompt_file: str, prompt_tokens: int) -> tuple[str, torch.Tensor]:
    """The SmolLM2 GGUF's path and the first prompt_tokens token ids of prompt_file's text ([1, n])."""
    path = smollm2_gguf_path()
    folder, name = path.rsplit("/", 1)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return path, tok(open(prompt_file).read(), return_tensors="pt").input_ids[:, :prompt_tokens]


def transformers_model(path: str, dtype: torch.dtype):
    """transformers' model of the GGUF at path (dequantized), in dtype."""
    folder, name = path.rsplit("/", 1)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype).eval()


def write_results(output: str, bench: str, path: str, ids: torch.Tensor, prompt_file: str, load_before, rows) -> None:
    with open(output, "w") as f:
        json.dump({"command": "python " + " ".join(sys.argv), "bench": bench, "model": os.path.basename(path),
                   "prompt_tokens": int(ids.shape[1]), "prompt_file": prompt_file, "load_average_before": load_before,
                   **machine_state(), "variants": rows}, f, indent=1)
    print(f"wrote {output}")


def engine_variants(path: str, ids: list[int], ref: torch.Tensor) -> list[dict]:
    """The engine's own prefill logits (the packed GGUF in float32, the vnni kernel) per mode."""
    from rackserve.config import ModelConfig
    from rackserve.model.loader import load_model
    from rackserve.model.native import unavailable_reason
    if unavailable_reason(isa="avx512") is not None:
        print(f"engine rows skipped: {unavailable_reason(isa='avx512')}")
        return []
    rows = []
    for mode in ("two-part", "adaptive", "one-part"):
        config = ModelConfig(path, "smol", path, "float32", "cpu", None, 0, quantization="gguf", native_isa="avx512",
                             quant_kernel="vnni", packed_activations=mode)
        model, info = load_model(config)
        rows.append({"mode": f"engine {mode}", "tau": None, "two_part_share": None,
                     **compare(ref, prefill_logits(model, info, ids).float())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--taus", default="2,3,4,6,8", help="thresholds (max|x| of a block over its row's RMS)")
    prompt_arguments(parser)
    args = parser.parse_args()
    load_before = os.getloadavg()
    path, ids = smollm2_prompt(args.prompt_file, args.prompt_tokens)
    model = transformers_model(path, torch.float32)
    ref, _ = logits_with(model, ids, None)
    rows = []
    variants = [("two", 0.0, False), ("one", 0.0, False), ("one", 0.0, True)]
    variants += [(m, float(t), False) for t in args.taus.split(",") for m in ("row", "tile")]
    for mode, tau, lm_head in variants:
        start = time.perf_counter()
        got, share = logits_with(model, ids, mode, tau, lm_head)
        rows.append({"mode": mode + (" +lm_head" if lm_head else ""), "tau": tau, "two_part_share": share,
                     **compare(ref, got), "seconds": time.perf_counter() - start})
    rows += engine_variants(path, ids[0].tolist(), ref)
    bf16 = transformers_model(path, torch.bfloat16)
    with torch.no_grad():
        rows.append({"mode": "transformers bfloat16", "tau": None, "two_part_share": None,
                     **compare(ref, bf16(ids).logits[0].float())})
    print(f"{ids.shape[1]} prompt tokens of {args.prompt_file}; against transformers float32 on the dequantized GGUF")
    print(f"{'variant':>24} {'two-part share':>15} {'max|dlogit|':>12} {'KL mean':>10} {'top-1':>7}")
    for r in rows:
        label = r["mode"] if r["tau"] in (None, 0.0) else f"{r['mode']} tau={r['tau']:g}"
        share = "" if r["two_part_share"] is None else f"{100 * r['two_part_share']:.1f}%"
        print(f"{label:>24} {share:>15} {r['max_abs_logit_diff']:>12.3f} {r['kl_mean']:>10.2e} {100 * r['top1_agreement']:>6.1f}%")
    if args.output:
        write_results(args.output, "activation_parts_numerics", path, ids, args.prompt_file, load_before, rows)


if __name__ == "__main__":
    main()
