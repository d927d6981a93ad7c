"""The HF peer's single-stream decode rate in float32 against bfloat16 on this CPU, interleaved over
the same prompts: which dtype is its best here (rackserve/bench/hf_peer.best_cpu_dtype's rule).
`python bench/hf_peer_dtype.py OUT.json`"""
import json, statistics, sys, torch
from rackserve.bench.hf_peer import hf_stream_timing, load_hf_model
from rackserve.bench.record import machine_state
torch.manual_seed(0)
models = {d: load_hf_model("smollm2-135m-instruct", getattr(torch, d)) for d in ("float32", "bfloat16")}
prompts = [torch.randint(100, 40000, (32,)).tolist() for _ in range(6)]
for m in models.values():
    hf_stream_timing(m, prompts[0], 8)
rates = {d: [] for d in models}
for p in prompts:
    for d, m in models.items():
        rates[d].append(hf_stream_timing(m, p, 64)[1])
out = {d: statistics.median(r) for d, r in rates.items()}
print(out, "bf16/fp32", out["bfloat16"] / out["float32"])
json.dump({"command": " ".join(["python", *sys.argv]), "decode_tok_s_median": out, "runs": rates,
           "machine": machine_state()}, open(sys.argv[1], "w"), indent=1)
