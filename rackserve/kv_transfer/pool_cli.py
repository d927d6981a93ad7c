"""`rackserve kv-pool`: runs Mooncake's master (the `mooncake_master` binary the Mooncake wheel
ships) for MooncakeStoreConnector, prints the address instances take, and stops it on Ctrl-C.
Clients join with P2P handshakes (metadata "P2PHANDSHAKE"), so the master is all the pool needs.

This file owns the command only; it never imports torch or the engine.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

from rackserve.config import free_port_run
from rackserve.serve.cli import register_subcommand


def master_binary() -> str:
    try:
        import mooncake
    except ImportError as e:
        raise SystemExit(f"rackserve kv-pool: Mooncake is not installed (pip install "
                         f"mooncake-transfer-engine-non-cuda; see README): {e}") from None
    path = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    if not os.access(path, os.X_OK):
        raise SystemExit(f"rackserve kv-pool: no mooncake_master binary at {path}")
    return path


def master_command(port: int, metrics_port: int, eviction_high_watermark: float) -> list[str]:
    return [master_binary(), f"--rpc_port={port}", f"--metrics_port={metrics_port}",
            f"--eviction_high_watermark_ratio={eviction_high_watermark}"]


def die_with_parent() -> None:
    """In the master's process before exec: SIGTERM it when this command dies, even by SIGKILL,
    so a pool master never outlives the command that started it (Linux; elsewhere a no-op)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address instances reach the master at")
    parser.add_argument("--port", type=int, default=50051, help="the master's RPC port")
    parser.add_argument("--metrics-port", type=int, default=None, help="the master's metrics port (default: a free one)")
    parser.add_argument("--eviction-high-watermark", type=float, default=0.95,
                        help="pool usage at which the master evicts old blocks")


@register_subcommand("kv-pool", "run the Mooncake master of a KV pool shared by instances (MooncakeStoreConnector)",
                     _add_args)
def _kv_pool(args: argparse.Namespace) -> int:
    metrics_port = args.metrics_port or free_port_run("127.0.0.1", 1)
    command = master_command(args.port, metrics_port, args.eviction_high_watermark)
    proc = subprocess.Popen(command, preexec_fn=die_with_parent)
    address = f"{args.host}:{args.port}"
    print(json.dumps({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"master_server_address": address}}), flush=True)
    print(f"KV pool master on {address}; pass the line above as --kv-transfer-config. Ctrl-C stops it.",
          file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        return 0
