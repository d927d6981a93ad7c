"""EngineCore: one instance's step loop body. It pairs one Scheduler per DP rank (one in all but
data-parallel instances) with an Executor: schedule every DP rank -> execute them in lockstep ->
update each scheduler from its own rank's output, once per `step()`.

A new request goes to one DP rank, chosen by a placement policy (engine/data_parallel.py), and
stays there: its n samples go with it, and an abort or stop finds it there. It owns token ids
only: no text, no tokenizer, no HTTP, no threads. The same class runs a real model (executors
"uniproc", "mp") or a cost model (the simulator's executor "sim", rackserve/sim/executor.py).
"""
from __future__ import annotations

import time
from typing import Callable

from rackserve.config import EngineConfig
from rackserve.core.outputs import EngineCoreOutput, ModelRunnerOutput
from rackserve.core.request import Request, RequestStatus
from rackserve.core.scheduler import Scheduler
from rackserve.engine.data_parallel import DPPlacement, least_load, merge_dp_stats
from rackserve.core.stats import SchedulerStats
from rackserve.executor.base import Executor, create_executor


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None, placement: DPPlacement = least_load,
                 sleep: Callable[[float], None] = time.sleep):
        """`sleep`: how an empty step waiting on KV transfers polls (a simulator's executor
        advances its virtual clock instead and passes one that returns at once)."""
        self.executor = executor or create_executor(config)
        try:
            self.config = config.with_model_len(self.executor.model_max_len)
            spec = config.speculative
            # An executor whose outputs carry draft tokens (ModelRunnerOutput.draft_token_ids) says
            # so with `drafts_tokens`: the simulator's does; no model runner drafts yet.
            if spec is not None and spec.method == "mtp" and not getattr(self.executor, "drafts_tokens", False):
                raise ValueError(f"speculative method 'mtp' needs an executor that drafts; "
                                 f"{type(self.executor).__name__} does not")
            # DP rank i's scheduler plans for DP rank i's KV cache, whose size may differ from others'.
            self.schedulers = [Scheduler(self.config, n, self.executor.kv_cache_config, dp_rank)
                               for dp_rank, n in enumerate(self.executor.dp_num_kv_blocks)]
        except ValueError:
            if executor is None:   # started here: its workers must not outlive the refusal
                self.executor.shutdown()
            raise
        self.placement = placement
        self.sleep = sleep

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler of an instance with one DP rank."""
        assert len(self.schedulers) == 1, "a data-parallel instance has one scheduler per DP rank"
        return self.schedulers[0]

    def add_requests(self, requests: list[Request], dp_rank: int | None = None) -> int:
        """Queue requests of one prompt (its n samples) on one DP rank (`dp_rank` when the caller
        pins one, as a router does, else the placement policy's), which shares their prompt's KV,
        and return that rank; raises ValueError if they can never fit (nothing is queued then)."""
        rank = self.placement(self.schedulers, requests[0]) if dp_rank is None else dp_rank
        assert 0 <= rank < len(self.schedulers), f"no DP rank {rank}"
        for request in requests:
            self.schedulers[rank].add_request(request)
        return rank

    def abort_requests(self, request_ids: list[str]) -> None:
        # Each scheduler ends the requests it holds and ignores the others.
        for scheduler in self.schedulers:
            scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, stops: dict[str, str],
                      status: RequestStatus = RequestStatus.FINISHED_STOPPED) -> None:
        """End requests found finished above the core: by a stop string (request id -> the stop
        string), or, with FINISHED_ERROR, by a failure of theirs alone (request id -> why)."""
        for req_id, reason in stops.items():
            for scheduler in self.schedulers:
                scheduler.finish_requests([req_id], status, reason)

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.schedulers)

    def has_kv_transfers(self) -> bool:
        """KV held for or arriving from peers: steps must go on to hear when transfers end."""
        return any(s.has_kv_transfers() for s in self.schedulers)

    def step(self) -> tuple[list[EngineCoreOutput], SchedulerStats]:
        scheduler_outputs = [s.schedule() for s in self.schedulers]
        runner_outputs = self.executor.execute_dp(scheduler_outputs)
        if all(so.is_empty for so in scheduler_outputs) and self.has_kv_transfers():
            self.sleep(0.002)   # only waiting on KV transfers: poll, do not spin a core
        outputs = [out for s, so, ro in zip(self.schedulers, scheduler_outputs, runner_outputs)
                   for out in s.update_from_output(so, ro)]
        return outputs, self.make_stats(runner_outputs)

    def make_stats(self, runner_outputs: list[ModelRunnerOutput] | None = None) -> SchedulerStats:
        """The schedulers' stats merged, with each DP rank's idle time in the step that produced
        `runner_outputs` (none when no step ran)."""
        busy = [o.busy_seconds for o in runner_outputs] if runner_outputs else [None] * len(self.schedulers)
        return merge_dp_stats([s.make_stats() for s in self.schedulers], self.executor.dp_num_kv_blocks, busy)

    def check_integrity(self) -> None:
        for scheduler in self.schedulers:
            scheduler.check_integrity()

    def shutdown(self) -> None:
        self.executor.shutdown()
