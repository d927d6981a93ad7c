"""UniProcExecutor: the model runner in this very process, registered as "uniproc".

It owns nothing but the runner. It must never schedule, and never add parallelism (that is the
multiprocess executors' job).
"""
from __future__ import annotations

from torch import nn

from rackserve.config import EngineConfig
from rackserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from rackserve.executor.base import Executor, register_executor
from rackserve.executor.model_runner import ModelRunner


@register_executor("uniproc")
class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.runner: ModelRunner | None = ModelRunner(config)
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.kv_cache_config = self.runner.kv_cache_config
        self.model_max_len = self.runner.model_info.max_position_embeddings
        self.vocab_size = self.runner.model_info.vocab_size

    @property
    def model(self) -> nn.Module:
        assert self.runner is not None, "executor was shut down"
        return self.runner.model

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "executor was shut down"
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        # Dropping the runner frees the model and the KV cache.
        if self.runner is not None:
            self.runner.shutdown()
        self.runner = None
