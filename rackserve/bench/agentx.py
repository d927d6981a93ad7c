"""The AgentX-like generator: agentic-coding session trees whose statistics follow the published
ones of the AgentX corpus (reference/agentx.md), with every token count multiplied by `scale` so
that a small machine can serve them.

A session opens with a system prompt that all sessions share and a task; each later main turn's
prompt is the previous prompt + the recorded output + new tool output; past the context limit
the conversation compacts (restarts from the system prompt and a summary, as agentic coding tools
do). Some sessions spawn subagent groups after a main turn: one or more subagents with their own
conversations (sharing only the system prompt), run at once while the parent waits. Think times
(tool execution, in seconds) are not scaled. Session i is drawn from (seed, i) alone.

Hash ids name stream positions: a conversation segment (a session's start, each compaction,
each subagent) gets a base id, and the block at position p of its prompts is base + p, so a
prompt's partial last block is the prefix of the block the next prompt completes.

This file owns the generator and its parameters. It must never talk to a server.
"""
from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

from rackserve.bench.token_text import BLOCK_SIZE
from rackserve.bench.workload import (CONTEXT_HEADROOM, Session, SubagentGroup, Turn, Workload, WorkloadOptions,
                                      WorkloadStats, register_workload, workload_stats)

# 1/200 fits the 2-core CPU this project is built on: SmolLM2-135M (~200 prefill and ~30 decode
# tokens/s) serves its median prompt of ~800 tokens, growing ~9 tokens a turn (plus the output),
# several turns a lane a minute at concurrency 2; compaction at 5K tokens keeps the warm-up of a
# play under ~25 s and the workload the same on any server with 5K of context.
DEFAULT_SCALE = 0.005
# Outputs are scaled 10x less hard than inputs by default: AgentX's median 444 output tokens at
# scale 0.005 would be 2 tokens, too few for an inter-token latency worth reporting.
OUTPUT_SCALE_FACTOR = 10.0
_SEGMENT = 1 << 24                      # hash ids per conversation segment (1B tokens)


@dataclass(frozen=True)
class AgentXConfig:
    """Token counts at scale 1 are the published corpus's; `scale` multiplies them all."""
    scale: float = DEFAULT_SCALE
    output_scale: float | None = None   # multiplies output lengths; None: min(1, 10 x scale)
    seed: int = 0
    max_context: int | None = None      # the server's longest prompt + output
    # Main turns per session: lognormal, median 43 (seed documents), mean 145 (56,798 / 393).
    main_turns_median: float = 43.0
    main_turns_sigma: float = 1.56
    max_main_turns: int = 2000
    # Output tokens per request: lognormal, median 444 (seed documents), mean 1,077.
    output_median: float = 444.0
    output_sigma: float = 1.33
    # The prompt: a shared system prompt and tools, a first task, then per turn the recorded output
    # and new tool output. With compaction at 1M tokens these give a median prompt near 142K, a
    # mean near 220K and a theoretical hit rate near 0.98 (published: 142K, 219K, 0.95 to 0.98).
    system_tokens: int = 16384
    task_median: float = 2000.0
    task_sigma: float = 1.0
    tool_median: float = 800.0
    tool_sigma: float = 1.5
    context_limit: int = 1_000_000
    # Subagents: 44% of sessions have them; such a session spawns a group after one main turn
    # drawn at random and after each other main turn with probability (4.3 / 0.44 - 1) / 144,
    # for 4.3 groups per trace; a group has 1 + Poisson(0.5) subagents of lognormal turns (median
    # 10, mean 16.5): 24.8 requests per group, 42.5% of all requests.
    subagent_session_share: float = 0.44
    groups_per_main_turn: float = (4.3 / 0.44 - 1) / 144
    extra_agents_per_group: float = 0.5
    subagent_turns_median: float = 10.0
    subagent_turns_sigma: float = 1.0
    # Think time before a turn (tool execution): not published; a lognormal of median 1 s.
    think_median: float = 1.0
    think_sigma: float = 1.0

    def __post_init__(self) -> None:
        assert self.scale > 0, "scale must be > 0"
        if self.output_scale is None:
            object.__setattr__(self, "output_scale", min(1.0, OUTPUT_SCALE_FACTOR * self.scale))
        assert self.output_scale > 0, "output_scale must be > 0"

    @property
    def shared_prefix_blocks(self) -> int:
        return max(1, round(self.system_tokens * self.scale / BLOCK_SIZE))

    @property
    def context_budget(self) -> int:
        """Most prompt + output tokens of one request."""
        budget = round(self.context_limit * self.scale)
        if self.max_context is not None:
            budget = min(budget, self.max_context - CONTEXT_HEADROOM)
        return budget


class AgentXWorkload(Workload):
    name = "agentx"

    def __init__(self, config: AgentXConfig, sessions: int = 1 << 20):
        self.config = config
        self.scale, self.output_scale = config.scale, config.output_scale
        self._sessions = sessions
        system = config.shared_prefix_blocks * BLOCK_SIZE
        if config.context_budget < system + 2 * BLOCK_SIZE:
            raise ValueError(f"a context of {config.max_context} tokens is too small for scale {config.scale}: "
                             f"the shared system prompt alone is {system} tokens")

    def __len__(self) -> int:
        return self._sessions

    def session(self, index: int) -> Session:
        index %= self._sessions
        return _SessionBuilder(self.config, random.Random(f"agentx/{self.config.seed}/{index}"),
                               f"agentx-{index}").build()

    def describe(self, max_sessions: int = 500) -> WorkloadStats:
        # The sessions are a function of the config: a process that runs several (a sim's sweep,
        # the tests) builds and counts them once (500 sessions: ~8 s on a Zen 1).
        return _stats(self.config, min(self._sessions, max_sessions))


@functools.lru_cache(maxsize=8)
def _stats(config: AgentXConfig, sessions: int) -> WorkloadStats:
    workload = AgentXWorkload(config, sessions)
    return workload_stats([workload.session(i) for i in range(sessions)])


class _SessionBuilder:
    def __init__(self, config: AgentXConfig, rng: random.Random, session_id: str):
        self.c, self.rng, self.session_id = config, rng, session_id
        self.segments = 0

    def tokens(self, median: float, sigma: float, floor: int, scale: float | None = None) -> int:
        scale = self.c.scale if scale is None else scale
        return max(floor, round(self.rng.lognormvariate(math.log(median), sigma) * scale))

    def count(self, median: float, sigma: float, cap: int) -> int:
        return min(cap, max(1, round(self.rng.lognormvariate(math.log(median), sigma))))

    def new_segment(self) -> tuple[int, int]:
        """(base hash id, prompt length) of a fresh conversation: system prompt + a task."""
        self.segments += 1
        system = self.c.shared_prefix_blocks * BLOCK_SIZE
        return self.segments * _SEGMENT, system + self.tokens(self.c.task_median, self.c.task_sigma, 1)

    def conversation(self, turns: int, spawn: bool) -> list[Turn | SubagentGroup]:
        """One agent's steps: `turns` turns, with subagent groups after some when `spawn`."""
        c = self.c
        first_group = self.rng.randrange(turns) if spawn else -1
        steps: list[Turn | SubagentGroup] = []
        base, context = self.new_segment()
        previous_output = 0
        for k in range(turns):
            # Output at least 2 tokens, so that every request has an inter-token latency.
            # Outputs take at most half the context, leaving room for the prompt that asked.
            output = min(self.tokens(c.output_median, c.output_sigma, 2, c.output_scale), c.context_budget // 2)
            think = 0.0
            if k > 0:
                context += previous_output + self.tokens(c.tool_median, c.tool_sigma, 1)
                think = self.rng.lognormvariate(math.log(c.think_median), c.think_sigma)
            if context + output > c.context_budget:
                if k > 0:   # compact: the old conversation's blocks are never sent again
                    base, context = self.new_segment()
                context = min(context, c.context_budget - output)
            steps.append(Turn(context, output, range(base, base - (-context // BLOCK_SIZE)), think))
            previous_output = output
            if k == first_group or (spawn and self.rng.random() < c.groups_per_main_turn):
                steps.append(self.group(len(steps)))
        return steps

    def group(self, position: int) -> SubagentGroup:
        c = self.c
        agents = 1 + _poisson(self.rng, c.extra_agents_per_group)
        return SubagentGroup(tuple(
            Session(f"{self.session_id}/step{position}-agent{j}",
                    tuple(self.conversation(self.count(c.subagent_turns_median, c.subagent_turns_sigma,
                                                       c.max_main_turns), spawn=False)),
                    c.shared_prefix_blocks)
            for j in range(agents)))

    def build(self) -> Session:
        c = self.c
        turns = self.count(c.main_turns_median, c.main_turns_sigma, c.max_main_turns)
        spawn = self.rng.random() < c.subagent_session_share
        return Session(self.session_id, tuple(self.conversation(turns, spawn)), c.shared_prefix_blocks)


def _poisson(rng: random.Random, mean: float) -> int:
    threshold, k, p = math.exp(-mean), 0, rng.random()
    while p > threshold:
        k += 1
        p *= rng.random()
    return k


@register_workload("agentx")
def _agentx(argument: str, options: WorkloadOptions) -> Workload:
    if argument:
        raise ValueError("the agentx workload takes no argument; set --scale and --seed")
    scale = options.scale if options.scale is not None else DEFAULT_SCALE
    return AgentXWorkload(AgentXConfig(scale=scale, output_scale=options.output_scale, seed=options.seed,
                                       max_context=options.max_context))
