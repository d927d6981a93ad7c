"""`rackserve cluster`: one command for a cluster on this machine: N `rackserve serve` instances
(the CPU threads split among them, each publishing KV events on its own free ports) and the
router in front, behind one URL. Ctrl-C stops everything; so does an instance that dies (the
command then exits 1). Beyond one machine, start `rackserve serve` on each and point
`rackserve router --worker URL ...` at them.

This file owns the children's lives and their flags; it never routes (router/ does).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import httpx

from rackserve.config import EngineArgs
from rackserve.router.cli import add_health_args, add_pd_args, add_router_policy_args, serve_router
from rackserve.serve.cli import register_subcommand

STARTUP_TIMEOUT_S = 600.0


def _add_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--instances", type=int, default=2, help="instances to start on this machine")
    add_router_policy_args(parser, "--router-policy")
    add_pd_args(parser)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="CPU threads to split evenly among the instances")
    add_health_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="the router's address")
    parser.add_argument("--port", type=int, default=8000, help="the router's port (instances take free ones)")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given to `cluster` (those that differ from the defaults), for `serve`."""
    flags = []
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        if value == f.default or f.name == "kv_events_config":
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def start_instances(args: argparse.Namespace) -> tuple[list[subprocess.Popen], list[str]]:
    from rackserve.distributed.parallel_state import free_port
    threads = max(1, args.threads // args.instances)
    procs, urls = [], []
    for i in range(args.instances):
        port = free_port()
        events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{free_port()}",
                  "replay_endpoint": f"tcp://*:{free_port()}", "topic": "kv"}
        cmd = [sys.executable, "-m", "rackserve.serve.cli", "serve", *engine_flags(args), "--port", str(port),
               "--kv-events-config", json.dumps(events), "--uvicorn-log-level", "warning"]
        procs.append(subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads)}))
        urls.append(f"http://127.0.0.1:{port}")
        print(f"rackserve cluster: instance {i} at {urls[-1]} (pid {procs[-1].pid}, {threads} threads)", flush=True)
    return procs, urls


def wait_healthy(procs: list[subprocess.Popen], urls: list[str]) -> str | None:
    """None once every instance answers /health; else why not."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    pending = set(range(len(urls)))
    while pending:
        for i in list(pending):
            if procs[i].poll() is not None:
                return f"instance {i} exited with code {procs[i].returncode} while starting"
            try:
                if httpx.get(f"{urls[i]}/health", timeout=1).status_code == 200:
                    pending.discard(i)
            except httpx.TransportError:
                pass
        if time.monotonic() > deadline:
            return f"instances {sorted(pending)} did not come up within {STARTUP_TIMEOUT_S:.0f} s"
        time.sleep(0.2)
    return None


async def run_cluster(args: argparse.Namespace, procs: list[subprocess.Popen], urls: list[str]) -> str | None:
    """Serves the router until it stops (None) or an instance dies (returns why)."""
    router = asyncio.create_task(serve_router(args, urls, args.router_policy))
    while not router.done():
        await asyncio.wait({router}, timeout=0.5)
        dead = [i for i, p in enumerate(procs) if p.poll() is not None]
        if dead and not router.done():
            router.cancel()
            try:
                await router
            except asyncio.CancelledError:
                pass
            return f"instance {dead[0]} exited with code {procs[dead[0]].returncode}"
    router.result()
    return None


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """SIGTERM stops the cluster as Ctrl-C does (children stopped), not by dying and orphaning
    them; the router's uvicorn takes both signals over while it serves."""
    signal.signal(signal.SIGTERM, _interrupt)


def stop_instances(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@register_subcommand("cluster", "start N instances and a KV-aware router in front, behind one URL", _add_args)
def _cluster(args: argparse.Namespace) -> int:
    if args.instances < 1:
        print("rackserve cluster: --instances must be >= 1", file=sys.stderr)
        return 2
    stop_on_sigterm()
    procs, urls = start_instances(args)
    failure = None
    try:
        failure = wait_healthy(procs, urls) or asyncio.run(run_cluster(args, procs, urls))
    except KeyboardInterrupt:
        pass
    finally:
        stop_instances(procs)
    if failure:
        print(f"rackserve cluster: {failure}; stopped everything", file=sys.stderr, flush=True)
        return 1
    return 0
