"""EngineCore: one instance's step loop body. It pairs the Scheduler with an Executor:
schedule -> execute -> update_from_output, once per `step()`.

It owns token ids only: no text, no tokenizer, no HTTP, no threads. The same class runs a real
model (executor "uniproc") or a cost model (the simulator's executor).
"""
from __future__ import annotations

from rackserve.config import EngineConfig
from rackserve.core.outputs import EngineCoreOutput
from rackserve.core.request import Request, RequestStatus
from rackserve.core.scheduler import Scheduler
from rackserve.engine.stats import SchedulerStats
from rackserve.executor.base import Executor, create_executor


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None):
        self.executor = executor or create_executor(config)
        self.config = config.with_model_len(self.executor.model_max_len)
        self.scheduler = Scheduler(self.config, self.executor.num_kv_blocks)

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError if it can never fit (nothing is queued then)."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, stops: dict[str, str]) -> None:
        """End requests whose text hit a stop string (request id -> the stop string)."""
        for req_id, stop in stops.items():
            self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_STOPPED, stop)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> tuple[list[EngineCoreOutput], SchedulerStats]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return outputs, self.scheduler.make_stats()

    def shutdown(self) -> None:
        self.executor.shutdown()
