"""What a narrower KV cache costs in logits, on SmolLM2's own K and V.

The engine runs SmolLM2-135M-Instruct's GGUF (float32 activations, the packed weights) through one
prefill over a paged cache of each dtype (--kv-cache-dtype float32, float16, fp8 (e4m3), fp8_e5m2):
every position's attention reads its context's K and V rounded to the cache's dtype, as a decode
step would read them (the native prefill kernel reads the cache in place). Not bfloat16: its
prefill takes the torch path, which attends over a fresh prompt's own unrounded K and V. Each run's logits are compared with
transformers' float32 run on the dequantized GGUF (and transformers' bfloat16 run, for scale):
max |logit diff|, mean and max KL, top-1 agreement. These rows keep two activation parts; a last
engine row runs the engine's defaults on this machine (the cache and --packed-activations that
`auto` picks, from EngineArgs). Writes them as JSON.

    python bench/kv_cache_numerics.py --output bench/results/kv-cache-numerics-smollm2.json
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# max|diff|, KL, top-1 against a reference; the prompt, transformers' model and the results file as there
from activation_parts_numerics import (compare, prompt_arguments, smollm2_prompt, transformers_model,  # noqa: E402
                                       write_results)

from rackserve.config import KV_CACHE_DTYPE_NAMES, EngineArgs, ModelConfig  # noqa: E402
from rackserve.model.loader import load_model  # noqa: E402
from tests.test_model_parity import prefill_logits  # noqa: E402  (one prefill through a paged cache)

DTYPES = ("float32", "float16", "fp8", "fp8_e5m2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    prompt_arguments(parser)
    args = parser.parse_args()
    load_before = os.getloadavg()
    path, ids = smollm2_prompt(args.prompt_file, args.prompt_tokens)
    hf = transformers_model(path, torch.float32)
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
    model, info = load_model(ModelConfig(path, "smol", path, "float32", "cpu", None, 0, quantization="gguf"))
    rows = []
    for dtype in DTYPES:
        cache_dtype = getattr(torch, KV_CACHE_DTYPE_NAMES.get(dtype, dtype))
        rows.append({"kv_cache_dtype": dtype, **compare(ref, prefill_logits(model, info, ids[0].tolist(),
                                                                            cache_dtype).float())})
    config = EngineArgs(model=path, device="cpu").create_engine_config()
    model, info = load_model(config.model)
    cache_dtype = config.cache.cache_dtype or config.model.dtype
    rows.append({"kv_cache_dtype": f"{cache_dtype}, {config.model.packed_activations} activations (the defaults)",
                 **compare(ref, prefill_logits(model, info, ids[0].tolist(), getattr(torch, cache_dtype)).float())})
    bf16 = transformers_model(path, torch.bfloat16)
    with torch.no_grad():
        rows.append({"kv_cache_dtype": "transformers bfloat16 (all of it)", **compare(ref, bf16(ids).logits[0].float())})
    print(f"{ids.shape[1]} prompt tokens of {args.prompt_file}; against transformers float32 on the dequantized GGUF")
    print(f"{'KV cache':>34} {'max|dlogit|':>12} {'KL mean':>10} {'KL max':>10} {'top-1':>7}")
    for r in rows:
        print(f"{r['kv_cache_dtype']:>34} {r['max_abs_logit_diff']:>12.3f} {r['kl_mean']:>10.2e} {r['kl_max']:>10.2e} "
              f"{100 * r['top1_agreement']:>6.1f}%")
    if args.output:
        write_results(args.output, "kv_cache_numerics", path, ids, args.prompt_file, load_before, rows)


if __name__ == "__main__":
    main()
