"""MultiprocExecutor, registered as "mp": one worker process per rank of this node (see worker.py),
chosen whenever an instance has more than one rank. It runs on node 0 beside the engine; the
other nodes' ranks are hosted by `rackserve worker` and reached by rank 0's broadcast.

Each step (one SchedulerOutput per DP rank) goes to rank 0 over its pipe, and every DP rank's
ModelRunnerOutput comes back from rank 0, in DP rank order. While it waits the executor watches
every local worker's pipe and process sentinel, so a worker that dies or reports an error makes
`execute_dp` raise WorkerError at once (after stopping the other workers); a worker on another
node that dies fails rank 0's next collective, which rank 0 reports. This file must never
schedule and never compute.
"""
from __future__ import annotations

import dataclasses
from multiprocessing.connection import wait

from rackserve.config import EngineConfig
from rackserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from rackserve.distributed.parallel_state import free_port
from rackserve.executor.base import Executor, register_executor
from rackserve.executor.worker import (WorkerError, WorkerFailure, fail, start_workers, stop_workers,
                                       wait_ready)


@register_executor("mp")
class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        parallel = config.parallel
        if parallel.node_rank != 0:
            raise ValueError(f"node_rank={parallel.node_rank} hosts workers only: run `rackserve worker` "
                             "with the same flags on that machine; the engine runs on node 0")
        if parallel.master_port is None:
            parallel = dataclasses.replace(parallel, master_port=free_port(parallel.master_addr))
            config = dataclasses.replace(config, parallel=parallel)
        self.workers = start_workers(config)
        self._error: WorkerError | None = None
        ready = wait_ready(self.workers)
        rank0 = ready[0]
        assert len(rank0.dp_num_kv_blocks) == parallel.data_parallel_size
        self._dp_num_kv_blocks = list(rank0.dp_num_kv_blocks)
        # A DP rank's ranks index the same blocks; ranks of other DP ranks may hold other counts.
        assert all(r.num_kv_blocks == self._dp_num_kv_blocks[parallel.dp_rank_of(r.rank)] for r in ready)
        self.num_kv_blocks, self.model_max_len, self.vocab_size = \
            min(self._dp_num_kv_blocks), rank0.model_max_len, rank0.vocab_size
        self.kv_cache_config = rank0.kv_cache_config

    @property
    def dp_num_kv_blocks(self) -> list[int]:
        return self._dp_num_kv_blocks

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """DP rank 0 runs `scheduler_output`; any other DP ranks run an empty step beside it."""
        idle = [SchedulerOutput([], [], {}, 0) for _ in self._dp_num_kv_blocks[1:]]
        return self.execute_dp([scheduler_output, *idle])[0]

    def execute_dp(self, scheduler_outputs: list[SchedulerOutput]) -> list[ModelRunnerOutput]:
        if self._error is not None:
            raise self._error
        assert len(scheduler_outputs) == len(self._dp_num_kv_blocks), "one SchedulerOutput per DP rank"
        rank0 = self.workers[0]
        try:
            rank0.conn.send(scheduler_outputs)
        except OSError:   # rank 0 is gone; its sentinel says how
            self._fail(None)
        while True:
            fired = wait([h.conn for h in self.workers] + [h.process.sentinel for h in self.workers])
            if rank0.conn in fired:
                try:
                    message = rank0.conn.recv()
                except (EOFError, OSError):
                    message = None
                if isinstance(message, list):
                    return message
                self._fail(message if isinstance(message, WorkerFailure) else None)
            if fired:
                # Another worker reported (only failures come unasked) or died.
                self._fail(None)

    def _fail(self, first: WorkerFailure | None) -> None:
        self._error = fail(self.workers, "running a step", first)
        raise self._error

    def shutdown(self) -> None:
        if self._error is None and all(h.process.is_alive() for h in self.workers):
            try:
                self.workers[0].conn.send(None)   # rank 0 passes it on: every rank leaves its loop
            except OSError:
                pass
        stop_workers(self.workers)
        if self._error is None:
            self._error = WorkerError("the executor was shut down")
