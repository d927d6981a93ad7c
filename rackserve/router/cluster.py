"""`rackserve cluster`: one command for a cluster on this machine: N `rackserve serve` instances
(the CPU threads split among them, each publishing KV events on its own free ports) and the
router in front, behind one URL. `--prefill P --decode D` adds P prefill and D decode instances
(MooncakeConnector as kv_producer / kv_consumer) behind the router's P/D pools; `--kv-pool`
starts `rackserve kv-pool`'s Mooncake master and gives every instance MooncakeStoreConnector
(inside a MultiConnector, after the P2P one, on P/D instances). Ctrl-C or SIGTERM stops everything
(exit 0); an instance that dies is started again on its port (Restarts) while the router routes
around it; the pool master dying stops everything (exit 1). Beyond one machine, start `rackserve serve` on
each and point `rackserve router --worker URL ...` at them.

This file owns the children's lives and their flags; it never routes (router/ does).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from rackserve.config import EngineArgs
from rackserve.router import BOTH, DECODE, PREFILL
from rackserve.router.cli import add_body_args, add_health_args, add_pd_args, add_router_policy_args, serve_router
from rackserve.router.restarts import Restarts
from rackserve.serve.cli import register_subcommand

STARTUP_TIMEOUT_S = 600.0


def _add_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--instances", type=int, default=None,
                        help="plain instances (whole requests) to start on this machine (default 2, or 0 with "
                             "--prefill/--decode)")
    parser.add_argument("--prefill", type=int, default=0, help="prefill instances (MooncakeConnector kv_producer)")
    parser.add_argument("--decode", type=int, default=0, help="decode instances (MooncakeConnector kv_consumer)")
    parser.add_argument("--kv-pool", action="store_true",
                        help="start a Mooncake KV pool master; every instance stores to and loads from it")
    parser.add_argument("--kv-pool-segment-bytes", type=int, default=256 << 20,
                        help="bytes each instance lends the KV pool (MooncakeStoreConnector's global_segment_size)")
    add_router_policy_args(parser, "--router-policy")
    add_pd_args(parser)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="CPU threads to split evenly among the instances")
    add_health_args(parser)
    add_body_args(parser, answers=True)
    parser.add_argument("--host", default="127.0.0.1", help="the router's address")
    parser.add_argument("--port", type=int, default=8000, help="the router's port (instances take free ones)")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given to `cluster` (those that differ from the defaults), for `serve`."""
    flags = []
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        if value == f.default or f.name in ("kv_events_config", "kv_transfer_config"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def instance_roles(args: argparse.Namespace) -> list[str]:
    """Each instance's role (router.BOTH, PREFILL or DECODE), in start order."""
    plain = args.instances if args.instances is not None else (0 if args.prefill or args.decode else 2)
    return [BOTH] * plain + [PREFILL] * args.prefill + [DECODE] * args.decode


def kv_transfer_config(args: argparse.Namespace, role: str, pool_address: str | None) -> dict | None:
    """The --kv-transfer-config an instance of `role` gets: P2P for P/D, the pool's store with
    --kv-pool, both in a MultiConnector when both apply; the user's own one otherwise."""
    store = pool_address and {"kv_connector": "MooncakeStoreConnector", "kv_connector_extra_config": {
        "master_server_address": pool_address, "global_segment_size": args.kv_pool_segment_bytes}}
    if role == BOTH:
        return {**store, "kv_role": "kv_both"} if store else args.kv_transfer_config
    kv_role = "kv_producer" if role == PREFILL else "kv_consumer"
    if not store:
        return {"kv_connector": "MooncakeConnector", "kv_role": kv_role}
    return {"kv_connector": "MultiConnector", "kv_role": kv_role,
            "kv_connector_extra_config": {"connectors": [{"kv_connector": "MooncakeConnector"}, store]}}


def start_instance(args: argparse.Namespace, i: int, role: str, url: str, threads: int,
                   pool_address: str | None = None) -> subprocess.Popen:
    """Instance i, serving at `url`; its KV events on ports its publisher binds (port 0: the OS
    picks them as it binds, so no other process can take them first; the router reads them from
    /kv_events each time the instance joins, so a restarted instance may have new ones)."""
    from rackserve.kv_transfer.pool_cli import die_with_parent
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", "topic": "kv"}
    kv = kv_transfer_config(args, role, pool_address)
    cmd = [sys.executable, "-m", "rackserve.serve.cli", "serve", *engine_flags(args), "--port", url.rsplit(":", 1)[1],
           "--kv-events-config", json.dumps(events), "--uvicorn-log-level", "warning"]
    if getattr(args, "header_timeout", None) is not None:   # `bench router`'s flags have none
        cmd += ["--header-timeout", str(args.header_timeout)]
    if kv is not None:
        cmd += ["--kv-transfer-config", kv if isinstance(kv, str) else json.dumps(kv)]
    # SIGTERMed if this command dies, even by SIGKILL: an instance never outlives its cluster.
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, preexec_fn=die_with_parent)
    print(f"rackserve cluster: {role} instance {i} at {url} (pid {proc.pid}, {threads} threads)", flush=True)
    return proc


def start_instances(args: argparse.Namespace, roles: list[str] | None = None,
                    pool_address: str | None = None) -> tuple[list[subprocess.Popen], list[str]]:
    from rackserve.distributed.parallel_state import free_port
    roles = roles or instance_roles(args)
    urls = [f"http://127.0.0.1:{free_port()}" for _ in roles]
    threads = instance_threads(args, roles)
    return [start_instance(args, i, role, url, threads, pool_address)
            for i, (role, url) in enumerate(zip(roles, urls))], urls


def instance_threads(args: argparse.Namespace, roles: list[str]) -> int:
    return max(1, args.threads // len(roles))


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


async def run_cluster(args: argparse.Namespace, procs: list[subprocess.Popen], urls: list[str],
                      roles: list[str] | None = None, master: subprocess.Popen | None = None,
                      pool_address: str | None = None) -> str | None:
    """Serves the router until it stops (None) or the pool master dies (returns why). An instance
    that dies is started again in its place in `procs` (see Restarts); meanwhile the router
    routes around it, as around any instance that stops answering. One that exits 0 (stopped on
    purpose) stays down."""
    roles = roles or [BOTH] * len(urls)
    pool = {role: [u for u, r in zip(urls, roles) if r == role] for role in (BOTH, PREFILL, DECODE)}
    router = asyncio.create_task(serve_router(args, pool[BOTH], args.router_policy, None, pool[PREFILL],
                                              pool[DECODE]))
    restarts = Restarts(len(procs), time.monotonic())
    while not router.done():
        await asyncio.wait({router}, timeout=0.5)
        for i, proc in enumerate(procs):
            # Exit code 0 is a requested stop (a signal meant for it, or Ctrl-C reaching the whole
            # process group as the cluster stops): only a failure is restarted.
            if proc.poll() not in (None, 0) and restarts.due(i, proc.returncode, time.monotonic()):
                procs[i] = start_instance(args, i, roles[i], urls[i], instance_threads(args, roles), pool_address)
        why = f"the KV pool master exited with code {master.returncode}" if master and master.poll() is not None else None
        if why and not router.done():
            router.cancel()
            try:
                await router
            except asyncio.CancelledError:
                pass
            return why
    router.result()
    return None


def start_pool_master() -> tuple[subprocess.Popen, str]:
    """`rackserve kv-pool`'s Mooncake master on free ports (it dies with this process)."""
    from rackserve.distributed.parallel_state import free_port
    from rackserve.kv_transfer.pool_cli import die_with_parent, master_command
    port = free_port()
    proc = subprocess.Popen(master_command(port, free_port(), 0.95), preexec_fn=die_with_parent)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:   # instances that start before it listens would run without the pool
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the KV pool master did not come up (exit code {proc.poll()})")
            time.sleep(0.1)
    print(f"rackserve cluster: KV pool master at {address} (pid {proc.pid})", flush=True)
    return proc, address


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


def _refusal(args: argparse.Namespace) -> str | None:
    if min(args.instances or 0, args.prefill, args.decode) < 0:
        return "--instances, --prefill and --decode must not be negative"
    if bool(args.prefill) != bool(args.decode):
        return "--prefill and --decode come together"
    if not instance_roles(args):
        return "no instance to start"
    if args.kv_transfer_config and (args.prefill or args.kv_pool):
        return "--kv-transfer-config cannot be combined with --prefill/--decode/--kv-pool (the cluster sets it)"
    return None


@register_subcommand("cluster", "start N instances (or P prefill + D decode) and a KV-aware router in front, "
                                "behind one URL", _add_args)
def _cluster(args: argparse.Namespace) -> int:
    refusal = _refusal(args)
    if refusal:
        print(f"rackserve cluster: {refusal}", file=sys.stderr)
        return 2
    roles = instance_roles(args)
    stop_on_sigterm()
    master, address, procs, failure = None, None, [], None
    try:
        if args.kv_pool:
            master, address = start_pool_master()
        procs, urls = start_instances(args, roles, address)
        failure = wait_healthy(procs, urls) or asyncio.run(run_cluster(args, procs, urls, roles, master, address))
    except KeyboardInterrupt:
        pass
    except RuntimeError as e:
        failure = str(e)
    finally:
        stop_instances(procs + ([master] if master else []))
    if failure:
        print(f"rackserve cluster: {failure}; stopped everything", file=sys.stderr, flush=True)
        return 1
    return 0
