"""N KV consumers opening a fresh side channel connection and making one call at the same moment
(a producer restarted and every decoder's pool reconnects, or one peer opening many): each one's
latency to its reply, with this tree's SideChannelServer and, alternating in one process, an older
side_channel.py given by --ref (e.g. `git show REV:rackserve/kv_transfer/side_channel.py > old.py`).

    python bench/side_channel_burst.py --consumers 64 --rounds 3 [--ref old.py]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from rackserve.kv_transfer import side_channel


def _load(path: str):
    spec = importlib.util.spec_from_file_location("side_channel_ref", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def burst(module, n: int, timeout: float) -> list[float]:
    server = module.SideChannelServer("127.0.0.1", 0, lambda msg: {"status": "unknown"})
    start = threading.Barrier(n)

    def one(_: int) -> tuple[float, object]:
        start.wait()
        t = time.perf_counter()
        client = module.SideChannelClient("127.0.0.1", server.port, timeout)
        try:
            client.call({"op": "pin", "req_id": "x"})
        except TimeoutError:
            return float("inf"), client
        return time.perf_counter() - t, client

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    for _, client in results:
        client.close()
    server.shutdown()
    return sorted(s for s, _ in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--consumers", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=10.0, help="the consumer's socket timeout (transfer_timeout)")
    parser.add_argument("--ref", help="an older side_channel.py to alternate with")
    args = parser.parse_args()
    sides = [("this tree", side_channel)] + ([("ref", _load(args.ref))] if args.ref else [])
    for r in range(args.rounds):
        for name, module in sides:
            s = burst(module, args.consumers, args.timeout)
            print(f"round {r} {name}: {args.consumers} at once: median {statistics.median(s) * 1e3:.0f} ms, "
                  f"p90 {s[int(0.9 * len(s))] * 1e3:.0f} ms, max {s[-1] * 1e3:.0f} ms, over 1 s: "
                  f"{sum(x > 1 for x in s)}, timed out: {sum(x == float('inf') for x in s)}", flush=True)


if __name__ == "__main__":
    main()
