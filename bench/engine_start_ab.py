"""How long a GGUF engine takes to start, in two trees, alternating in one run: `load_tokenizer` of
the model and the construction of `LLM(model)` (the file's header read twice, the weights packed,
the KV cache allocated), each in a fresh process.

    python bench/engine_start_ab.py --before /tmp/wt-before --rounds 2 [--model PATH]
    (/tmp/wt-before: `git worktree add --detach /tmp/wt-before <ref>`)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CHILD = """
import json, sys, time
from rackserve.config import smollm2_gguf_path
from rackserve.engine.tokenizer import load_tokenizer
path = sys.argv[1] or smollm2_gguf_path()
t = time.perf_counter(); load_tokenizer(path); tokenizer = time.perf_counter() - t
from rackserve import LLM
t = time.perf_counter()
with LLM(path, dtype="float32", device="cpu", max_model_len=512, num_gpu_blocks_override=64):
    init = time.perf_counter() - t
print(json.dumps({"load_tokenizer_s": tokenizer, "llm_init_s": init}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the other tree (a git worktree of the ref to compare)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="", help="a .gguf file (default: SmolLM2-135M-Instruct's)")
    args = parser.parse_args()
    for r in range(args.rounds):
        for name, tree in (("before", args.before), ("after", _ROOT)):
            env = {**os.environ, "PYTHONPATH": tree}
            out = subprocess.run([sys.executable, "-c", _CHILD, args.model], cwd=tree, env=env, check=True,
                                 capture_output=True, text=True).stdout.strip().splitlines()[-1]
            times = json.loads(out)
            print(f"round {r + 1} {name}: load_tokenizer {times['load_tokenizer_s']:.2f} s, "
                  f"LLM init {times['llm_init_s']:.2f} s, load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
