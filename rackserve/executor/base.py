"""Executor: decides WHERE a step runs. The engine core hands it one SchedulerOutput per step and
gets one ModelRunnerOutput back; nothing above can tell a real executor from a simulated one.
Under data parallelism a step is one SchedulerOutput per DP rank, run in lockstep (`execute_dp`).

This file owns the interface and the registry by name. It must never schedule (that is core/)
or know how a model computes (that is model/).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

from rackserve.config import EngineConfig
from rackserve.core.kv_cache_groups import KVCacheConfig
from rackserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from rackserve.registry import Registry


class Executor(ABC):
    """Built from the config; loads the model and allocates the KV cache before returning.

    After construction `num_kv_blocks` (blocks of `block_size` tokens each), `model_max_len`
    (the checkpoint's own context length) and `vocab_size` (rows of the embedding: valid token
    ids are below it) are set.
    """
    num_kv_blocks: int
    model_max_len: int
    vocab_size: int
    # A model with several kinds of cache (DeepSeek-V4): its groups, whose block counts replace
    # num_kv_blocks (equal on every DP rank). None: one group.
    kv_cache_config: KVCacheConfig | None = None

    @abstractmethod
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Raises if a worker failed; never returns a partial output."""

    @property
    def dp_num_kv_blocks(self) -> list[int]:
        """The KV blocks of each DP rank (each has its own cache and scheduler); one DP rank here."""
        return [self.num_kv_blocks]

    def execute_dp(self, scheduler_outputs: list[SchedulerOutput]) -> list[ModelRunnerOutput]:
        """Run one step of every DP rank together: DP rank i runs scheduler_outputs[i] (an empty
        one when it has nothing to do) and returns outputs[i]. Raises as `execute` does."""
        assert len(scheduler_outputs) == len(self.dp_num_kv_blocks), "one SchedulerOutput per DP rank"
        return [self.execute(scheduler_outputs[0])]

    def shutdown(self) -> None:
        """Stop workers and free memory; safe to call twice."""


# Executor "x" lives in rackserve/executor/x.py or, for a package of its own, rackserve/x/executor.py
# ("sim"); importing it registers it, which keeps torch out of processes that never execute.
EXECUTORS: Registry[Callable[[EngineConfig], Executor]] = Registry(
    "executor", "rackserve.executor.{}", "rackserve.{}.executor")
register_executor = EXECUTORS.register


def create_executor(config: EngineConfig, name: str | None = None) -> Executor:
    """The executor registered as `name`; by default "uniproc" for one rank, "mp" for more."""
    if config.parallel.cpu_omp_threads_bind:   # before the model loads and any rank or torch thread starts
        from rackserve.executor.cpu_bind import bind_process_threads
        bind_process_threads(config.parallel.cpu_omp_threads_bind)
    return EXECUTORS.get(name or ("uniproc" if config.parallel.world_size == 1 else "mp"))(config)
