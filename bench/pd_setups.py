"""Issue 8's AgentX setups: start one, run `rackserve bench serve` against it, stop it.

usage: PYTHONPATH=. python bench/pd_setups.py SETUP OUTPUT [--bind] [bench serve flags...]

SETUP: pd (1P+1D, one thread each, behind rackserve proxy) | colo2 (one instance, two threads) |
       colo1x2 (two one-thread instances behind rackserve router, round_robin) |
       pool-store, pool-none (two one-thread instances behind the router, round_robin, with or
       without a Mooncake pool from `rackserve kv-pool`)

Each instance is `rackserve serve --max-model-len 8192` (SmolLM2 by default) with OMP_NUM_THREADS
set; for the pool setups the instances' prefix-cache counters are printed after the run.
--bind gives each one-thread instance a core of its own (--cpu-omp-threads-bind: the first
instance CPU 0, the second CPU 1) and the two-thread instance both; the fronts stay unbound.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

from rackserve.bench.pd_itl_bench import _start, _wait_healthy, bind_flags
from rackserve.router.cluster import stop_instances
from rackserve.distributed.parallel_state import free_port

SERVE = ["serve", "--max-model-len", "8192"]


def main(setup: str, output: str, flags: list[str]) -> int:
    logs = tempfile.mkdtemp(prefix="pd-setups-")
    bind = "--bind" in flags
    flags = [f for f in flags if f != "--bind"]
    cpus = ["0", "1"] if bind else [None, None]
    procs: list[subprocess.Popen] = []
    workers: list[str] = []
    try:
        extra: list[str] = []
        if setup == "pool-store":
            pool = subprocess.Popen([sys.executable, "-m", "rackserve.serve.cli", "kv-pool", "--port", str(free_port()),
                                     "--metrics-port", str(free_port())], stdout=subprocess.PIPE, text=True)
            procs.append(pool)
            extra = ["--kv-transfer-config", json.dumps(json.loads(pool.stdout.readline()))]
            time.sleep(1.0)   # the master binds its port
        if setup == "pd":
            roles = [("prefill", "kv_producer"), ("decode", "kv_consumer")]
            for (name, role), cpu in zip(roles, cpus):
                config = json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role})
                proc, url = _start(SERVE + ["--kv-transfer-config", config, *bind_flags(cpu)], 1, logs, name)
                procs.append(proc)
                workers.append(url)
            _wait_healthy(procs, workers)
            front, url = _start(["proxy", "--prefill", workers[0], "--decode", workers[1]], 1, logs, "proxy")
        elif setup == "colo2":
            front, url = _start(SERVE + bind_flags("0-1" if bind else None), 2, logs, "colocated")
        else:
            for name, cpu in zip(("a", "b"), cpus):
                proc, url = _start(SERVE + extra + bind_flags(cpu), 1, logs, name)
                procs.append(proc)
                workers.append(url)
            _wait_healthy(procs[-2:], workers)
            front, url = _start(["router", "--worker", workers[0], "--worker", workers[1], "--policy", "round_robin"],
                                1, logs, "router")
        procs.append(front)
        _wait_healthy([front], [url])
        cmd = [sys.executable, "-m", "rackserve.serve.cli", "bench", "serve", "--base-url", url, "--no-progress",
               "--output", output, *flags]
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd)
        if setup.startswith("pool"):
            import httpx
            for worker in workers:
                lines = [line for line in httpx.get(worker + "/metrics").text.splitlines()
                         if "prefix_cache_" in line and not line.startswith("#")]
                print(worker, lines, flush=True)
        return rc
    finally:
        stop_instances(procs[::-1])
        print("logs in", logs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
