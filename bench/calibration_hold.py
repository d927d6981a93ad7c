"""The measurements a shipped `cpu` calibration is fitted to, one step at a time on a quiet machine
(the procedure of docs/simulator.md's sixteenth, eighteenth and twentieth rounds): bench forward's
decode sweep, prompt chunks of 32-512 tokens, a batch of 4 chunks and chunks after long contexts, a
held-out long-context decode sweep; then a server's random fit run, its front path, and the AgentX
and random curves the fit is validated against. Each command and the load before and after it go to
bench/results/measure-load-NAME.json; the fit and validation commands are printed at the end.

    python bench/calibration_hold.py --name smollm2-fp8-zen5-s21q --kv-cache-dtype fp8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

from rackserve.cpu_dtype import cpu_identity

R = "bench/results/"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True, help="the files' suffix, e.g. smollm2-fp8-zen5-s21q")
    parser.add_argument("--kv-cache-dtype", default=None, help="passed to every bench forward and the server")
    parser.add_argument("--port", default="59421")
    parser.add_argument("--note", default="", help="what was measured, for the measure-load file")
    args = parser.parse_args()
    bin_dir = os.path.dirname(sys.executable)
    extra = ["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else []
    n, steps = args.name, []

    def run(cmd: list[str], background: bool = False):
        rec = {"command": " ".join(cmd), "load_before": os.getloadavg()[0]}
        print(rec["command"], flush=True)
        exe = [os.path.join(bin_dir, "rackserve"), *cmd[1:]] if cmd[0] == "rackserve" else [sys.executable, *cmd[1:]]
        steps.append(rec)
        if background:
            return subprocess.Popen(exe, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rec["rc"] = subprocess.run(exe, stdout=subprocess.DEVNULL).returncode
        rec["load_after"] = os.getloadavg()[0]
        if rec["rc"]:
            sys.exit(f"failed: {rec['command']}")

    fwd = ["rackserve", "bench", "forward", "--device", "cpu", *extra]
    run(fwd + ["--mode", "decode", "--batch-sizes", "1,2,4,8,16", "--context-lens", "256,1024,2048", "--seconds", "2",
               "--output", R + f"forward-decode-{n}.json"])
    chunks = [f"n{t}" for t in (32, 64, 128, 256, 512)]
    for t in (32, 64, 128, 256, 512):
        run(fwd + ["--mode", "prefill", "--batch-sizes", "1", "--context-lens", "0,1024", "--new-tokens", str(t),
                   "--seconds", "2", "--output", R + f"forward-prefill-{n}-n{t}.json"])
    run(fwd + ["--mode", "prefill", "--batch-sizes", "4", "--context-lens", "0,1024", "--new-tokens", "256",
               "--seconds", "3", "--output", R + f"forward-prefill-{n}-b4.json"])
    run(fwd + ["--mode", "prefill", "--batch-sizes", "1", "--context-lens", "0,4096,8000", "--new-tokens", "64",
               "--seconds", "2", "--output", R + f"forward-prefill-{n}-n64-long.json"])
    server = run(["rackserve", "serve", "--port", args.port, "--uvicorn-log-level", "warning", *extra], background=True)
    url = f"http://127.0.0.1:{args.port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2)
            break
        except OSError:
            time.sleep(1)
    common = ["--base-url", url, "--tokenizer", "smollm2-135m-instruct", "--no-progress"]
    try:
        run(["rackserve", "bench", "serve", *common, "--workload", "random", "--concurrency", "1,2,4,8",
             "--duration", "25", "--output", R + f"random-rackserve-{n}-fit.json"])
        run(["python", "-m", "rackserve.bench.front_path", "--base-url", url, "--tokenizer", "smollm2-135m-instruct",
             "--output", R + f"front-path-{n}.json"])
        run(["rackserve", "bench", "serve", *common, "--workload", "agentx", "--concurrency", "1,2,4,8",
             "--duration", "30", "--label", "rackserve", "--output", R + f"agentx-rackserve-{n}.json"])
        run(["rackserve", "bench", "serve", *common, "--workload", "random", "--concurrency", "1,2,4,8",
             "--duration", "25", "--output", R + f"random-rackserve-{n}.json"])
    finally:
        server.terminate()
        server.wait()
    steps.append({"command": "end of holds", "load_before": os.getloadavg()[0]})
    run(fwd + ["--mode", "decode", "--batch-sizes", "1,4", "--context-lens", "4096,7000", "--seconds", "2",
               "--output", R + f"forward-decode-{n}-long.json"])
    cpu = cpu_identity()
    with open(R + f"measure-load-{n}.json", "w") as f:
        json.dump({"cpu": cpu, "note": args.note, "steps": steps}, f, indent=1)
    prefill = " ".join(R + f"forward-prefill-{n}-{c}.json" for c in [*chunks, "b4", "n64-long"])
    print(f"\nfit:\n  python -m rackserve.sim.calibrate {R}forward-decode-{n}.json {prefill} "
          f"--serve {R}random-rackserve-{n}-fit.json --front-path {R}front-path-{n}.json "
          f"--check {R}forward-decode-{n}-long.json --key --output rackserve/sim/calibration/<name>.json\n"
          f"validate: rackserve sim --calibration-dir <empty dir> {' '.join(extra)} --workload agentx|random "
          f"--concurrency 1,2,4,8 --duration 30|25 --max-model-len 8192 --summary-only --output SIM.json; "
          f"python -m rackserve.sim.validate {R}agentx-rackserve-{n}.json SIM.json")


if __name__ == "__main__":
    main()
