"""Workloads for `rackserve bench serve`: what a session tree is (Session, Turn, SubagentGroup),
the Workload base class, its statistics (with the theoretical prefix hit rate of an infinite
cache), and the registry by name (`agentx`, `random`, `trace:FILE`).

A Turn is one request, described as the weka traces describe it: `input_len` prompt tokens made
of 64-token blocks named by `hash_ids` (equal ids, equal blocks; the last block may be partial),
`output_len` tokens to generate, and the think time before it. A Session plays its steps in
order; a SubagentGroup's sessions run at once and the parent's next turn waits for all of them.

This file owns those types and the registry. It must never talk to a server nor render text
(token_text.py does).
"""
from __future__ import annotations

import importlib
import statistics
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from rackserve.bench.token_text import BLOCK_SIZE

# Room for what a chat request adds to a workload's prompt: the chat template and the per-play
# marker. Workloads keep prompt + output within the server's context minus this.
CONTEXT_HEADROOM = 128


@dataclass(frozen=True)
class Turn:
    input_len: int              # prompt tokens ("in")
    output_len: int             # tokens to generate, with ignore_eos ("out")
    hash_ids: Sequence[int]     # one id per 64-token block of the prompt
    think_time: float = 0.0     # seconds the client waits before sending it

    def __post_init__(self) -> None:
        assert self.input_len > 0 and self.output_len > 0, "a turn sends and receives tokens"
        assert len(self.hash_ids) == -(-self.input_len // BLOCK_SIZE), "one hash id per block"


@dataclass(frozen=True)
class SubagentGroup:
    agents: tuple["Session", ...]


@dataclass(frozen=True)
class Session:
    session_id: str
    steps: tuple[Turn | SubagentGroup, ...]
    # Leading blocks that every session of the workload shares (a common system prompt): their
    # content depends on the position only. Hash ids of the other blocks are local to the tree.
    shared_prefix_blocks: int = 0

    @property
    def turns(self) -> list[Turn]:
        return [s for s in self.steps if isinstance(s, Turn)]

    def requests(self) -> Iterator[tuple[Turn, bool]]:
        """Every request of the tree in play order, with whether a subagent sends it."""
        for step in self.steps:
            if isinstance(step, Turn):
                yield step, False
            else:
                for agent in step.agents:
                    yield from ((turn, True) for turn, _ in agent.requests())


class Workload(ABC):
    """Session trees, by index; a lane plays session 0, 1, 2... as the run hands them out."""

    name: str
    scale: float | None = None          # the factor on token counts, for generated workloads
    output_scale: float | None = None   # the factor on output lengths, where it differs

    @abstractmethod
    def session(self, index: int) -> Session:
        """The index-th session tree; the same for a given index on every call and every run."""

    @abstractmethod
    def __len__(self) -> int:
        """How many distinct sessions there are (indices wrap around)."""

    def describe(self, max_sessions: int = 500) -> "WorkloadStats":
        return workload_stats([self.session(i) for i in range(min(len(self), max_sessions))])


@dataclass(frozen=True)
class WorkloadStats:
    sessions: int
    requests: int
    main_turns_median: float
    main_turns_mean: float
    sessions_with_subagents: float      # share of sessions
    subagent_groups_per_session: float
    subagent_request_share: float       # share of requests sent by subagents
    input_median: float
    input_mean: float
    output_median: float
    output_mean: float
    growth_median: float                # input_len(k+1) - input_len(k) over consecutive main turns
    tool_tokens_median: float           # the part of that growth that is not the recorded output
    think_time_median: float
    shared_prefix_tokens: int
    theoretical_hit_rate: float         # an infinite prefix cache, sessions played from the start

    def lines(self) -> list[str]:
        return [
            f"{self.sessions} sessions, {self.requests} requests; main turns per session: median "
            f"{self.main_turns_median:.0f}, mean {self.main_turns_mean:.1f}",
            f"subagents: {self.sessions_with_subagents:.0%} of sessions, {self.subagent_groups_per_session:.2f} "
            f"groups per session, {self.subagent_request_share:.1%} of requests",
            f"input tokens per request: median {self.input_median:.0f}, mean {self.input_mean:.0f}; growth per "
            f"main turn: median {self.growth_median:.0f} (tool output median {self.tool_tokens_median:.0f})",
            f"output tokens per request: median {self.output_median:.0f}, mean {self.output_mean:.1f}; think "
            f"time median {self.think_time_median:.2f} s; shared system prompt {self.shared_prefix_tokens} tokens",
            f"theoretical prefix hit rate (infinite cache): {self.theoretical_hit_rate:.1%}",
        ]


def workload_stats(sessions: Sequence[Session]) -> WorkloadStats:
    assert sessions, "statistics of no sessions"
    inputs, outputs, thinks, growth, tool = [], [], [], [], []
    main_turns, groups, subagent_requests = [], [], 0
    cache = InfiniteCache()
    hits = queries = 0
    for session in sessions:
        turns = session.turns
        main_turns.append(len(turns))
        groups.append(len(session.steps) - len(turns))
        for a, b in zip(turns, turns[1:]):
            if b.input_len > a.input_len:   # not across a compaction
                growth.append(b.input_len - a.input_len)
                tool.append(b.input_len - a.input_len - a.output_len)
        cache.new_tree()
        for turn, by_subagent in session.requests():
            subagent_requests += by_subagent
            inputs.append(turn.input_len)
            outputs.append(turn.output_len)
            thinks.append(turn.think_time)
            hits += cache.send(turn, session.shared_prefix_blocks)
            queries += turn.input_len
    with_subagents = sum(1 for g in groups if g)
    return WorkloadStats(
        sessions=len(sessions), requests=len(inputs), main_turns_median=statistics.median(main_turns),
        main_turns_mean=statistics.fmean(main_turns), sessions_with_subagents=with_subagents / len(sessions),
        subagent_groups_per_session=statistics.fmean(groups), subagent_request_share=subagent_requests / len(inputs),
        input_median=statistics.median(inputs), input_mean=statistics.fmean(inputs),
        output_median=statistics.median(outputs), output_mean=statistics.fmean(outputs),
        growth_median=statistics.median(growth) if growth else 0.0,
        tool_tokens_median=statistics.median(tool) if tool else 0.0,
        think_time_median=statistics.median(thinks),
        shared_prefix_tokens=min(sessions[0].shared_prefix_blocks * BLOCK_SIZE, sessions[0].turns[0].input_len),
        theoretical_hit_rate=hits / queries)


class InfiniteCache:
    """A prefix cache that never evicts, at token granularity: a prompt hits the longest leading
    run of tokens sent before (hash ids are local to a session tree; shared blocks are global)."""

    def __init__(self) -> None:
        self.shared_tokens = 0              # shared-prefix tokens sent so far (they lead every prompt)
        self.full: set[int] = set()         # ids of this tree's blocks sent whole
        self.partial: dict[int, int] = {}   # id -> most tokens sent of a block never sent whole

    def new_tree(self) -> None:
        self.full, self.partial = set(), {}

    def send(self, turn: Turn, shared_blocks: int) -> int:
        """Tokens of `turn`'s prompt found in the cache; then caches the prompt."""
        shared = min(turn.input_len, shared_blocks * BLOCK_SIZE)
        hits = min(shared, self.shared_tokens)
        self.shared_tokens = max(self.shared_tokens, shared)
        own = turn.hash_ids[shared_blocks:]
        whole, rest = divmod(turn.input_len - shared, BLOCK_SIZE)
        if hits == shared and own:
            cached = self.full.__contains__
            # Prompts mostly extend cached ones: step back over the few uncached blocks at the end,
            # then check the run before them (in C); if a block inside it is uncached, binary
            # search the longest cached run (own[:m] all cached is monotone in m).
            lo = whole
            while lo and not cached(own[lo - 1]):
                lo -= 1
            if not all(map(cached, own[:lo])):
                lo, hi = 0, lo - 1
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if all(map(cached, own[:mid])) else (lo, mid - 1)
            hits += lo * BLOCK_SIZE
            if lo < len(own):   # the first block not cached whole may be cached in part
                tokens = BLOCK_SIZE if lo < whole else rest
                have = BLOCK_SIZE if own[lo] in self.full else self.partial.get(own[lo], 0)
                hits += min(have, tokens)
        self.full.update(own[:whole])
        if rest and own[whole] not in self.full:
            self.partial[own[whole]] = max(self.partial.get(own[whole], 0), rest)
        return hits


# ---- registry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadOptions:
    seed: int = 0
    scale: float | None = None          # None: the workload's default
    output_scale: float | None = None   # None: the workload's default
    max_context: int | None = None      # longest prompt + output the server takes
    random_input_len: int = 1024
    random_output_len: int = 128


WorkloadFactory = Callable[[str, WorkloadOptions], Workload]
WORKLOADS: dict[str, WorkloadFactory] = {}
# Modules that register workloads when imported.
_WORKLOAD_MODULES = ("rackserve.bench.agentx", "rackserve.bench.trace")


def register_workload(name: str) -> Callable[[WorkloadFactory], WorkloadFactory]:
    """Decorator for `factory(argument, options) -> Workload`; `--workload NAME:ARGUMENT`."""
    def wrap(factory: WorkloadFactory) -> WorkloadFactory:
        assert name not in WORKLOADS, f"workload {name!r} registered twice"
        WORKLOADS[name] = factory
        return factory
    return wrap


def make_workload(spec: str, options: WorkloadOptions) -> Workload:
    """`spec` is a registered name, optionally with an argument: `agentx`, `trace:FILE`."""
    for module in _WORKLOAD_MODULES:
        importlib.import_module(module)
    name, _, argument = spec.partition(":")
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {spec!r}; known: {sorted(WORKLOADS)} (trace takes trace:FILE)")
    return WORKLOADS[name](argument, options)


class RandomWorkload(Workload):
    """Independent single-turn sessions of fixed lengths and unshared content, like vLLM's random
    dataset: the no-reuse baseline."""

    name = "random"

    def __init__(self, input_len: int, output_len: int, sessions: int = 1 << 20):
        self.input_len, self.output_len, self._sessions = input_len, output_len, sessions

    def session(self, index: int) -> Session:
        ids = range(-(-self.input_len // BLOCK_SIZE))
        return Session(f"random-{index % self._sessions}", (Turn(self.input_len, self.output_len, ids),))

    def __len__(self) -> int:
        return self._sessions


@register_workload("random")
def _random(argument: str, options: WorkloadOptions) -> Workload:
    if argument:
        raise ValueError("the random workload takes no argument; set --random-input-len/--random-output-len")
    if (options.max_context is not None
            and options.random_input_len + options.random_output_len > options.max_context - CONTEXT_HEADROOM):
        raise ValueError(f"random requests of {options.random_input_len}+{options.random_output_len} tokens "
                         f"exceed the server's context of {options.max_context}")
    return RandomWorkload(options.random_input_len, options.random_output_len)
