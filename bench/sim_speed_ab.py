"""rackserve sim's wall time, and an engine's start-up, with two source trees one after the other.

`--together` runs each config's two sides at once instead (one core each), which pairs them: on
a shared VM the neighbours move a run's speed by 15% within minutes (in the twenty-fourth round
one tree run twice, one side after the other, read 0.86-0.98x; its change's paired runs 1.12-1.15x).

Run it under the bench lock (see docs/simulator.md, "Speed"):
  flock /work/notes/bench.lock setsid sh -c 'echo -15 > /proc/self/autogroup; exec python
      bench/sim_speed_ab.py --old OLD_TREE --new NEW_TREE --output bench/results/sim-speed-r7.json'
OLD_TREE and NEW_TREE are checkouts (e.g. `git archive COMMIT | tar -x -C DIR`). Each simulated
run's JSON, wall-clock fields left out, must be the same from both trees: a speed-up that changes
a figure is a bug, and the script says so. The engine start-up builds LLM() on a tiny random
Llama with a large KV cache (--kv-cache-memory), the case a lazy block pool speeds up.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from rackserve.cpu_dtype import cpu_identity

SIM = ["sim", "--model", "deepseek-v4.1-flash", "--hardware", "GB300", "--enable-expert-parallel",
       "--num-speculative-tokens", "3", "--acceptance-rate", "0.8", "--seed", "0"]
FULL = ["--instances", "3", "--data-parallel-size", "2", "--block-size", "256",
        "--kv-cache-memory", "100", "--max-num-seqs", "256", "--max-num-batched-tokens", "16384", "--scale", "1"]
PD = ["--block-size", "256", "--kv-cache-memory", "100", "--max-num-seqs", "256", "--max-num-batched-tokens", "16384",
      "--scale", "1", "--prefill-data-parallel-size", "2", "--prefill-max-num-batched-tokens", "16384", "--decode", "1",
      "--router-policy", "least_uncached", "--kv-pool-memory", "2000"]
# tests/test_sim_speed.py's two runs (their JSON pinned), then full-size kv-routed runs.
TEST_RUN = ["--block-size", "64", "--kv-cache-memory", "1", "--max-model-len", "32768", "--max-num-batched-tokens",
            "4096", "--scale", "0.05", "--max-num-seqs", "64", "--duration", "5"]
CONFIGS = {
    "test-kv-routed-dep2": TEST_RUN + ["--instances", "2", "--data-parallel-size", "2", "--router-policy", "kv",
                                       "--concurrency", "12"],
    "test-pd-kv-pool": TEST_RUN + ["--prefill", "1", "--prefill-data-parallel-size", "2", "--decode", "1",
                                   "--data-parallel-size", "2", "--router-policy", "least_uncached",
                                   "--kv-pool-memory", "500", "--concurrency", "8"],
    "c16-20s": FULL + ["--router-policy", "kv", "--concurrency", "16", "--duration", "20"],
    "c96-5s": FULL + ["--router-policy", "kv", "--concurrency", "96", "--duration", "5"],
    "c384-3s": FULL + ["--router-policy", "kv", "--concurrency", "384", "--duration", "3"],
    # The sixth round's routing A/B baseline (490 simulated s): long enough for the ids' cache to fill.
    "c384-90s-least-load": FULL + ["--router-policy", "least_load", "--concurrency", "384", "--duration", "90"],
    # Twelfth round: the AgentX rack point's P/D shapes with a KV pool, the eighth round's 10-GPU slice
    # (3 DEP2 prefill + DEP4 decode) and the rack (12 DEP2 prefill + DEP48 decode, 72 GPUs).
    "pd3-pool-c128-10s": PD + ["--prefill", "3", "--data-parallel-size", "4", "--concurrency", "128", "--duration", "10"],
    "rack-pool-c256-5s": PD + ["--prefill", "12", "--data-parallel-size", "48", "--concurrency", "256",
                               "--duration", "5"],
    # Twenty-third round's rack point shape (4 DEP2 prefill + DEP8 decode) at a third of its lanes.
    "pd4dep8-pool-c256-60s": PD + ["--prefill", "4", "--data-parallel-size", "8", "--concurrency", "256",
                                   "--duration", "60"],
    "pd4dep8-pool-c256-150s": PD + ["--prefill", "4", "--data-parallel-size", "8", "--concurrency", "256",
                                    "--duration", "150"],
}
START = """
import sys, time
sys.path.insert(0, {tests!r})
from tiny_models import build_tiny_model
path = build_tiny_model("LlamaForCausalLM", {model!r})
from rackserve.engine.llm import LLM
start = time.perf_counter()
llm = LLM(path, device="cpu", kv_cache_memory={gib}, skip_tokenizer_init=True)
built = time.perf_counter() - start
blocks = sum(s.kv.num_blocks for s in llm.engine.core.schedulers)
print(built, blocks)
"""


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def in_tree(tree: str) -> dict:
    """subprocess keywords that run Python on `tree`'s rackserve: its directory on PYTHONPATH and
    as the working directory too, since `python -m` and `-c` put the working directory first on
    sys.path (until the twenty-fourth round both sides ran the tree the script was started in)."""
    return {"env": {**os.environ, "PYTHONPATH": tree}, "cwd": tree}


def check_tree(tree: str) -> None:
    found = subprocess.run([sys.executable, "-c", "import rackserve; print(rackserve.__file__)"], check=True,
                           capture_output=True, text=True, **in_tree(tree)).stdout.strip()
    if not found.startswith(os.path.join(tree, "")):
        sys.exit(f"a run on {tree} imports {found}")


def timed(cmd: list[str], tree: str) -> tuple[float, float]:
    before = os.times()
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **in_tree(tree))
    after = os.times()
    return time.perf_counter() - start, after.children_user - before.children_user


def timed_together(cmds: dict[str, list[str]], trees: dict[str, str]) -> dict[str, tuple[float, float]]:
    """Each side's (wall, user CPU) seconds, both sides run at once: paired, on a shared VM whose
    neighbours move a run's speed by more than a change does between two runs minutes apart."""
    start, procs = time.perf_counter(), {}
    for side, cmd in cmds.items():
        procs[side] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **in_tree(trees[side]))
    times = {}
    while len(times) < len(procs):
        pid, status, usage = os.wait4(-1, 0)
        side = next(s for s, p in procs.items() if p.pid == pid)
        procs[side].returncode = os.waitstatus_to_exitcode(status)
        if procs[side].returncode:
            raise subprocess.CalledProcessError(procs[side].returncode, cmds[side])
        times[side] = (time.perf_counter() - start, usage.ru_utime)
    return times


def sim_cmd(name: str, out: str) -> list[str]:
    return [sys.executable, "-m", "rackserve.serve.cli", *SIM, *CONFIGS[name], "--output", out]


def sim_result(out: str, wall: float, cpu: float, load_before: list[float]) -> dict:
    result = json.loads(open(out).read())
    sims = [r["sim"] for r in result["runs"]]
    figures = {"runs": result["runs"], "workload_stats": result.get("workload_stats")}
    for s in sims:
        s.pop("wall_seconds"), s.pop("speedup")
    return {"process_wall_s": round(wall, 2), "user_s": round(cpu, 2),
            "virtual_s": round(sum(s["virtual_seconds"] for s in sims), 1),
            "load_before": load_before, "load_after": load(), "figures": figures}


def sim_run(name: str, tree: str, out: str) -> dict:
    load_before = load()
    wall, cpu = timed(sim_cmd(name, out), tree)
    return sim_result(out, wall, cpu, load_before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True)
    parser.add_argument("--new", required=True)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--start-kv-gib", type=float, default=2.0)
    parser.add_argument("--together", action="store_true",
                        help="run each config's two sides at once (paired; one core each) instead of one after the other")
    parser.add_argument("--no-start", action="store_true", help="leave out the engine start-up pair")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    trees = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    for tree in trees.values():
        check_tree(tree)
    report = {"what": __doc__.splitlines()[0], "cpu": cpu_identity(),
              "command": " ".join(sys.argv), "trees": trees, "runs": [], "start": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs.split(","):
            row = {"config": name, "together": args.together}
            outs = {side: os.path.join(tmp, f"{name}-{side}.json") for side in trees}
            if args.together:
                load_before = load()
                times = timed_together({side: sim_cmd(name, out) for side, out in outs.items()}, trees)
                for side, out in outs.items():
                    row[side] = sim_result(out, *times[side], load_before)
            else:
                for side, tree in trees.items():
                    row[side] = sim_run(name, tree, outs[side])
            row["identical_figures"] = row["old"].pop("figures") == row["new"].pop("figures")
            row["speedup_process"] = round(row["old"]["process_wall_s"] / row["new"]["process_wall_s"], 2)
            row["speedup_user"] = round(row["old"]["user_s"] / row["new"]["user_s"], 2)
            report["runs"].append(row)
            print(json.dumps(row), flush=True)
        if not args.no_start:
            code = START.format(tests=os.path.join(trees["new"], "tests"), model=os.path.join(tmp, "tiny"),
                                gib=args.start_kv_gib)
            for side, tree in trees.items():
                out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                     **in_tree(tree)).stdout.split()
                report["start"][side] = {"llm_build_s": round(float(out[0]), 3), "kv_blocks": int(out[1]),
                                         "kv_cache_memory_gib": args.start_kv_gib, "load": load()}
        print(json.dumps(report["start"]), flush=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    if not all(r["identical_figures"] for r in report["runs"]):
        sys.exit("the two trees' simulated figures differ")


if __name__ == "__main__":
    main()
