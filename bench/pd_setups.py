"""Issue 8's AgentX setups: start one, run `rackserve bench serve` against it, stop it.
usage: PYTHONPATH=. python bench/pd_setups.py SETUP OUTPUT [bench serve flags...]
SETUP: pd (1P+1D, 1 thread each, rackserve proxy) | colo2 (one instance, 2 threads) |
       colo1x2 (two 1-thread instances, rackserve router round_robin) |
       pool-store / pool-none (two 1-thread instances, router round_robin, with / without the Mooncake store)"""
import json, os, subprocess, sys, tempfile, time
from rackserve.bench.pd_itl_bench import _start, _wait_healthy, _stop
from rackserve.distributed.parallel_state import free_port

setup, output, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
logs = tempfile.mkdtemp(prefix="wt8-agentx-")
procs = []
serve = ["serve", "--max-model-len", "8192"]
try:
    extra = []
    if setup == "pool-store":
        port = free_port()
        pool = subprocess.Popen([sys.executable, "-m", "rackserve.serve.cli", "kv-pool", "--port", str(port),
                                 "--metrics-port", str(free_port())], stdout=subprocess.PIPE, text=True)
        procs.append(pool)
        config = json.loads(pool.stdout.readline())
        time.sleep(1.0)
        extra = ["--kv-transfer-config", json.dumps(config)]
    if setup == "pd":
        a, ua = _start(serve + ["--kv-transfer-config", json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"})], 1, logs, "p")
        b, ub = _start(serve + ["--kv-transfer-config", json.dumps({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"})], 1, logs, "d")
        procs += [a, b]; _wait_healthy([a, b], [ua, ub])
        front, url = _start(["proxy", "--prefill", ua, "--decode", ub], 1, logs, "proxy")
    elif setup == "colo2":
        front, url = _start(serve, 2, logs, "c")
    else:
        a, ua = _start(serve + extra, 1, logs, "a")
        b, ub = _start(serve + extra, 1, logs, "b")
        procs += [a, b]; _wait_healthy([a, b], [ua, ub])
        front, url = _start(["router", "--worker", ua, "--worker", ub, "--policy", "round_robin"], 1, logs, "router")
    procs.append(front)
    _wait_healthy([front], [url])
    cmd = [sys.executable, "-m", "rackserve.serve.cli", "bench", "serve", "--base-url", url, "--no-progress",
           "--output", output, *flags]
    print("+", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    if setup.startswith("pool"):
        import httpx
        for u in (ua, ub):
            text = httpx.get(u + "/metrics").text
            print(u, [l for l in text.splitlines() if "prefix_cache_" in l and not l.startswith("#")], flush=True)
    sys.exit(rc)
finally:
    _stop(procs[::-1])
    print("logs in", logs)
