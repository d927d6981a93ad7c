"""How long the event loop spends shaping a non-streaming chat answer's logprobs, in process:
`OpenAIServingChat._logprobs` over synthetic steps (390 tokens x 20 top logprobs a choice, the
shape of n=128, max_tokens=390, top_logprobs=20, which --max-logprob-entries' default 2^20
admits), with Python's cyclic GC on (as the server runs it) and off. It serves nothing and
changes nothing it measures; a served request would also pay generating the tokens first.

  python bench/logprob_shaping.py --choices 8,32 --output bench/results/logprob-shaping-h5.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.unread_streams import _cpu_model  # noqa: E402
from rackserve.outputs import Logprob  # noqa: E402
from rackserve.serve.serving_chat import OpenAIServingChat  # noqa: E402

TOKENS, TOP = 390, 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--choices", default="8,32", help="comma-separated numbers of choices")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    chat = OpenAIServingChat.__new__(OpenAIServingChat)
    chat.tokenizer = None   # token texts come from each Logprob's decoded_token
    rng = random.Random(0)
    steps = [{t: Logprob(-rng.random(), rank + 1, f"tok{t}") for rank, t in enumerate(rng.sample(range(49152), TOP))}
             for _ in range(TOKENS)]
    ids = [next(iter(step)) for step in steps]
    gc.collect()
    gc.freeze()   # as the server does after start-up: only what serving allocates is scanned
    result = {"command": " ".join(sys.argv), "cpu": _cpu_model(), "loadavg_before": os.getloadavg(), "runs": []}
    for n in map(int, args.choices.split(",")):
        for collector in ("on", "off"):
            if collector == "off":
                gc.disable()
            t0 = time.perf_counter()
            shaped = [chat._logprobs(ids, steps, TOP) for _ in range(n)]
            seconds = time.perf_counter() - t0
            gc.enable()
            del shaped
            gc.collect()
            run = {"choices": n, "entries": n * TOKENS * (TOP + 1), "gc": collector, "seconds": round(seconds, 2)}
            result["runs"].append(run)
            print(run, flush=True)
    result["loadavg_after"] = os.getloadavg()
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
