"""What slow and greedy clients do to the fronts (`rackserve router`, `rackserve proxy`), this
checkout's code against a baseline checkout's in one run (each front started from either code by
PYTHONPATH, interleaved).

"streams": 150 concurrent streaming requests through the front to one instance that holds every
stream open after its first event (tests/test_slow_clients.py's StubInstance, in this process):
how many reached the instance after 15 s, the front's /health then (and how long it took), and
how many streams ended clean once the instance let them go. "slowloris": a raw socket trickles a
request head (a header line every 0.2 s) for up to 15 s: when the front closed it, and what it
answered; meanwhile /health on another connection. The baseline has no --header-timeout: this
checkout runs with `--header-timeout 1` there.

  git archive a27d31a rackserve | tar -x -C /tmp/base
  python bench/slow_clients.py --baseline /tmp/base --output bench/results/slow-clients-hunt10.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rackserve.cpu_dtype import cpu_identity  # noqa: E402
from tests.server_utils import start_command, stop_all  # noqa: E402
from tests.test_slow_clients import CHAT, StubInstance, _trickled_head_answer  # noqa: E402
from tests.tokenizer_utils import save_test_tokenizer  # noqa: E402

STREAMS = 150


def _front(kind: str, code: str, stub: StubInstance, tokenizer: str, log: Path, *flags: str):
    os.environ["PYTHONPATH"] = code   # start_command's child inherits both; `python -m` puts its
    os.chdir(code)                    # working directory first on its path
    if kind == "router":
        args = ["router", "--worker", stub.url, "--tokenizer", tokenizer, "--health-interval", "0.3",
                "--health-timeout", "2"]
    else:
        args = ["proxy", "--prefill", stub.url, "--decode", stub.url, "--uvicorn-log-level", "warning"]
    return start_command([*args, *flags], log, timeout=120)


def streams(kind: str, code: str, tokenizer: str, log: Path) -> dict:
    stub = StubInstance(tokenizer)
    proc, url = _front(kind, code, stub, tokenizer, log)

    async def run() -> dict:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as client:
            async def one() -> bytes:
                try:
                    async with client.stream("POST", f"{url}/v1/chat/completions",
                                             json={**CHAT, "stream": True}) as r:
                        return b"".join([chunk async for chunk in r.aiter_bytes()])
                except httpx.HTTPError as e:
                    return repr(e).encode()
            tasks = [asyncio.ensure_future(one()) for _ in range(STREAMS)]
            await asyncio.sleep(15)
            reached = sum(1 for b in stub.arrived if b.get("stream"))
            start = time.monotonic()
            health = (await client.get(f"{url}/health", timeout=10)).status_code
            health_s = time.monotonic() - start
            stub.let_go()
            bodies = await asyncio.gather(*tasks)
            clean = sum(1 for b in bodies if b.endswith(b"data: [DONE]\n\n") and b"error" not in b)
            return {"streams": STREAMS, "reached_after_15s": reached, "health": health,
                    "health_s": round(health_s, 3), "ended_clean": clean}
    try:
        return asyncio.run(run())
    finally:
        stop_all([proc])
        stub.stop()


def slowloris(kind: str, code: str, tokenizer: str, log: Path, *flags: str) -> dict:
    stub = StubInstance(tokenizer)
    proc, url = _front(kind, code, stub, tokenizer, log, *flags)
    try:
        box: dict = {}
        slow = threading.Thread(target=lambda: box.update(answer=_trickled_head_answer(url, 15.0)))
        slow.start()
        start = time.monotonic()
        health = httpx.get(f"{url}/health", timeout=10).status_code
        health_s = time.monotonic() - start
        slow.join()
        answer, closed_after = box["answer"]
        return {"flags": list(flags), "closed_after_s": None if closed_after == float("inf") else round(closed_after, 3),
                "still_open_after_s": 15.0 if closed_after == float("inf") else None,
                "answer": answer.split(b"\r\n", 1)[0].decode(errors="replace"),
                "other_connection_health": health, "other_connection_health_s": round(health_s, 3)}
    finally:
        stop_all([proc])
        stub.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="a directory holding the baseline's rackserve package")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    cpu = cpu_identity()
    result = {"command": "bench/slow_clients.py " + " ".join(sys.argv[1:]), "cpu": cpu,
              "loadavg_before": os.getloadavg(), "baseline": {}, "this": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = f"{tmp}/tokenizer"
        save_test_tokenizer(tokenizer, 512)
        for kind in ("router", "proxy"):
            for name, code in (("baseline", args.baseline), ("this", str(ROOT))):
                result[name][f"{kind}_streams"] = streams(kind, code, tokenizer, Path(tmp) / f"{kind}-{name}.log")
                print(name, kind, result[name][f"{kind}_streams"], flush=True)
        for name, code, flags in (("baseline", args.baseline, ()), ("this", str(ROOT), ("--header-timeout", "1"))):
            result[name]["proxy_slowloris"] = slowloris("proxy", code, tokenizer, Path(tmp) / f"sl-{name}.log", *flags)
            print(name, "slowloris", result[name]["proxy_slowloris"], flush=True)
    result["loadavg_after"] = os.getloadavg()
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
