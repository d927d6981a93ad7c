"""`rackserve worker`: host this machine's ranks of a multi-machine instance whose engine runs on
node 0 (`rackserve serve` or `LLM(...)` there, with --node-rank 0). Started with the same engine
flags as node 0 plus its own --node-rank; it exits when node 0 shuts the instance down (0), or
when a rank fails (1).

This file owns the command's flags and exit codes only; the workers' life is executor/worker.py's.
It must never import torch at module level.
"""
from __future__ import annotations

import argparse
import signal
import sys

from rackserve.config import EngineArgs
from rackserve.serve.cli import register_subcommand


def _add_worker_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)


@register_subcommand("worker", "host this machine's ranks of an instance whose engine runs on node 0 "
                     "(--nnodes, --node-rank, --master-addr, --master-port)", _add_worker_args)
def _worker(args: argparse.Namespace) -> int:
    try:
        config = EngineArgs.from_cli_args(args).create_engine_config()
    except (ValueError, FileNotFoundError) as e:
        print(f"rackserve worker: {e}", file=sys.stderr)
        return 2
    if config.parallel.node_rank == 0:
        print("rackserve worker: node 0 runs the engine (rackserve serve, or LLM(...)), which starts its "
              "own workers; give this machine --node-rank 1 or more", file=sys.stderr)
        return 2
    from rackserve.executor.worker import run_worker_node

    def stop(*_: object) -> None:
        raise KeyboardInterrupt
    # SIGTERM (a supervisor stopping us) stops the workers as Ctrl-C does, instead of orphaning them.
    signal.signal(signal.SIGTERM, stop)
    try:
        return run_worker_node(config)
    except KeyboardInterrupt:
        return 130
