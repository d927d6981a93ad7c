"""Worker processes: one per rank. A worker joins the instance's process group, builds its
ModelRunner (its slice of the model, the KV cache of its DP rank's requests and its heads), reports
WorkerReady, then steps in lockstep with the others: rank 0 takes each step (one SchedulerOutput
per DP rank) from the engine over its pipe and broadcasts it to every rank over the control group
(one path for local and remote ranks alike), every rank executes its DP rank's SchedulerOutput,
the first rank of each DP rank times its forward (collectives excluded: the DP rank's busy time),
the DP ranks' first ranks gather their ModelRunnerOutputs on rank 0, and rank 0 sends them back.
None ends the loop.

This file owns the worker's life (start, step loop, failure report, exit), the helpers that
start, watch and stop a node's workers, and the life of a node other than 0 (run_worker_node,
behind `rackserve worker`). A worker that fails reports a WorkerFailure on its pipe
and exits at once: its peers' collectives then fail promptly (gloo reports a closed connection),
so one failure ends every rank instead of hanging them. It must never schedule, and never return
a partial output.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing

from rackserve.config import EngineConfig, KVEventsConfig, KVTransferConfig

# How long stopping workers waits for them to leave by themselves before SIGTERM, then SIGKILL.
STOP_GRACE_S = 5.0
# How long a failure waits for the other workers' reports and exits before describing it.
FAILURE_GRACE_S = 2.0


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    num_kv_blocks: int                  # equal on every rank of a DP rank
    model_max_len: int
    vocab_size: int
    dp_num_kv_blocks: tuple[int, ...] = ()   # rank 0 only: num_kv_blocks of every DP rank
    kv_cache_config: Any = None         # the runner's KVCacheConfig (a model with several cache groups)


@dataclass(frozen=True)
class WorkerFailure:
    rank: int
    traceback: str

    @property
    def summary(self) -> str:
        """The exception's own line (the traceback's last)."""
        return self.traceback.strip().splitlines()[-1]


@dataclass
class WorkerHandle:
    """The parent's side of one worker: its process and its end of the pipe."""
    rank: int
    process: BaseProcess
    conn: Connection


class WorkerError(RuntimeError):
    """A worker process failed or died; the instance cannot step again."""


def worker_main(config: EngineConfig, rank: int, conn: Connection) -> None:
    """The body of one worker process (the target of start_workers)."""
    # Ctrl-C in a terminal reaches every process of its group; the engine (or the worker node)
    # stops its workers in order instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from rackserve.distributed.parallel_state import CollectiveTimer, init_distributed
        from rackserve.executor.model_runner import ModelRunner
        if config.model.device == "cuda":
            torch.cuda.set_device(rank - config.parallel.local_ranks.start)
        else:
            # The node's ranks share its cores. More threads than cores would leave OpenMP
            # spin-waiting on the cores a peer needs to reach the next collective.
            torch.set_num_threads(max(1, torch.get_num_threads() // config.parallel.local_world_size))
        timer = CollectiveTimer()
        groups = init_distributed(config.parallel, rank, timer)
        rank0 = groups.world.broadcast_object(config)
        mismatch = config_mismatch(config, rank0)
        # Every rank learns of a mismatch anywhere, so that node 0's error says what went wrong.
        if groups.world.min(0 if mismatch else 1) == 0:
            raise ValueError(mismatch or "a node was started with other engine flags than node 0 (its log says which)")
        # The KV connector's settings are node 0's: its engine named the instance and chose the
        # side channel ports once (KVTransferConfig.resolved), and every rank must serve those.
        config = dataclasses.replace(config, kv_transfer=rank0.kv_transfer)
        runner = ModelRunner(config, groups=groups)
        info = runner.model_info
        leader = groups.tp.is_first_rank     # reports for its DP rank
        dp_blocks = groups.dp.gather_object(runner.num_kv_blocks) if leader else None
        conn.send(WorkerReady(rank, runner.num_kv_blocks, info.max_position_embeddings, info.vocab_size,
                              tuple(dp_blocks) if rank == 0 else (), runner.kv_cache_config))
        while True:
            step = groups.world.broadcast_object(conn.recv() if rank == 0 else None)
            if step is None:
                break
            start, waited = time.perf_counter(), timer.seconds
            output = runner.execute_model(step[groups.dp.rank_in_group])
            if leader:
                busy = time.perf_counter() - start - (timer.seconds - waited)
                outputs = groups.dp.gather_object(dataclasses.replace(output, busy_seconds=busy))
                if rank == 0:
                    conn.send(outputs)
    except BaseException:   # noqa: BLE001 - the parent must hear of every failure
        report = WorkerFailure(rank, traceback.format_exc())
        print(f"rackserve worker rank {rank} failed:\n{report.traceback}", file=sys.stderr, flush=True)
        try:
            conn.send(report)
        except OSError:
            pass   # the parent is gone too
        os._exit(1)
    # Both ways out skip tearing down the process group: the peers leave at the same moment, and
    # gloo aborts a process whose peer closes a connection while it tears down its own.
    sys.stdout.flush()
    os._exit(0)


def config_mismatch(mine: EngineConfig, rank0: EngineConfig) -> str | None:
    """What differs between this node's engine flags and node 0's, or None. Only where things
    live may differ: the node rank, the model's path on that machine."""
    def comparable(c: EngineConfig) -> dict[str, Any]:
        model = dataclasses.replace(c.model, model="", tokenizer="", served_model_name="")
        parallel = dataclasses.replace(c.parallel, node_rank=0)
        # KV events are published by node 0's engine alone: other nodes need not agree on them.
        # A node names the same KV connector; its other settings (a port, the engine id each node
        # resolved on its own) are node 0's, adopted by every rank.
        kv_transfer = c.kv_transfer and KVTransferConfig(c.kv_transfer.kv_connector, c.kv_transfer.kv_role)
        return dataclasses.asdict(dataclasses.replace(c, model=model, parallel=parallel, kv_events=KVEventsConfig(),
                                                      kv_transfer=kv_transfer))
    a, b = comparable(mine), comparable(rank0)
    # An optional section (kv_transfer) may be None on both nodes: compare it whole.
    diff = [f"{section}.{key}: {b[section][key]!r} on node 0, {a[section][key]!r} here"
            for section in a if isinstance(a[section], dict) and isinstance(b[section], dict)
            for key in a[section] if a[section][key] != b[section][key]]
    diff += [f"{section}: {b[section]!r} on node 0, {a[section]!r} here" for section in a
             if not (isinstance(a[section], dict) and isinstance(b[section], dict)) and a[section] != b[section]]
    return "this node was started with other engine flags than node 0: " + "; ".join(diff) if diff else None


def start_workers(config: EngineConfig) -> list[WorkerHandle]:
    """Spawn this node's ranks (config.parallel.local_ranks); the master port must be fixed."""
    ctx = torch.multiprocessing.get_context("spawn")
    handles = []
    for rank in config.parallel.local_ranks:
        parent_conn, child_conn = ctx.Pipe()
        process = ctx.Process(target=worker_main, args=(config, rank, child_conn),
                              name=f"rackserve-worker-{rank}", daemon=True)
        process.start()
        child_conn.close()   # the child holds it now: the parent reads EOF when the child dies
        handles.append(WorkerHandle(rank, process, parent_conn))
    return handles


def wait_ready(handles: list[WorkerHandle]) -> list[WorkerReady]:
    """Every worker's WorkerReady, in rank order; raises WorkerError (after stopping all of them)
    as soon as one fails or dies instead."""
    ready: dict[int, WorkerReady] = {}
    while len(ready) < len(handles):
        waiting = [h for h in handles if h.rank not in ready]
        fired = wait([h.conn for h in waiting] + [h.process.sentinel for h in waiting])
        for h in waiting:
            if h.conn in fired or h.process.sentinel in fired:
                message = _receive(h)
                if not isinstance(message, WorkerReady):
                    first = message if isinstance(message, WorkerFailure) else None
                    raise fail(handles, "starting the workers", first)
                ready[h.rank] = message
    return [ready[h.rank] for h in handles]


def _receive(h: WorkerHandle) -> Any:
    """The worker's next message, or None when it has died without one."""
    try:
        return h.conn.recv() if h.conn.poll() else None
    except (EOFError, OSError):
        return None


def fail(handles: list[WorkerHandle], doing: str, first: WorkerFailure | None = None) -> WorkerError:
    """Describe what went wrong in every worker (waiting up to FAILURE_GRACE_S for their reports
    and exits), stop them all, and return the error to raise."""
    failures = {first.rank: first} if first else {}
    deadline = time.monotonic() + FAILURE_GRACE_S
    while time.monotonic() < deadline and any(h.process.is_alive() for h in handles):
        wait([h.process.sentinel for h in handles if h.process.is_alive()], timeout=0.05)
    for h in handles:
        while True:
            message = _receive(h)
            if message is None:
                break
            if isinstance(message, WorkerFailure):
                failures.setdefault(h.rank, message)
    # A rank that died without a word is the cause; the others' reports (a collective that lost
    # its peer) are consequences, so they come after.
    died = [f"rank {h.rank} (pid {h.process.pid}) died: {_exit_reason(h.process.exitcode)}" for h in handles
            if h.rank not in failures and h.process.exitcode not in (None, 0)]
    by_summary: dict[str, list[str]] = {}
    for rank in sorted(failures):
        by_summary.setdefault(failures[rank].summary, []).append(str(rank))
    reported = [f"rank{'s' * (len(ranks) > 1)} {', '.join(ranks)}: {summary}" for summary, ranks in by_summary.items()]
    stop_workers(handles, grace_s=0.0)
    detail = "; ".join(died + reported) or "a worker stopped answering"
    return WorkerError(f"a worker failed while {doing}: {detail}")


def _exit_reason(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def stop_workers(handles: list[WorkerHandle], grace_s: float = STOP_GRACE_S) -> None:
    """Wait up to grace_s for the workers to exit by themselves, then terminate, then kill; safe
    to repeat."""
    deadline = time.monotonic() + grace_s
    for h in handles:
        h.process.join(max(0.0, deadline - time.monotonic()))
    for h in handles:
        if h.process.is_alive():
            h.process.terminate()
            h.process.join(1.0)
        if h.process.is_alive():
            h.process.kill()
            h.process.join()
        h.conn.close()


def run_worker_node(config: EngineConfig) -> int:
    """Host this node's ranks (a node other than 0, which runs the engine) until the instance
    shuts down. Returns 0 when every rank left cleanly, 1 when one failed."""
    parallel = config.parallel
    assert parallel.node_rank > 0, "node 0 runs the engine, which starts its own workers"
    handles = start_workers(config)
    try:
        wait_ready(handles)
        print(f"rackserve worker: node {parallel.node_rank} of {parallel.nnodes} hosts ranks "
              f"{list(parallel.local_ranks)}, ready", flush=True)
        running = list(handles)
        while running:
            fired = wait([h.process.sentinel for h in running])
            for h in [h for h in running if h.process.sentinel in fired]:
                # The sentinel fires as the process exits, a moment before its exit code exists.
                h.process.join()
                running.remove(h)
                if h.process.exitcode != 0:
                    raise fail(handles, "serving")
    except WorkerError as e:
        print(f"rackserve worker: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_workers(handles, grace_s=0.0)
    return 0
