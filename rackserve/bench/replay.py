"""Closed-loop replay, as AgentX runs it: `concurrency` lanes, each playing one session tree at a
time (the root session and its subagents, which run inside the lane, so more requests than lanes
can be in flight) and taking the next tree only when the whole tree has finished.

A play starts at a random main turn between 25% and 75% of the session, after a warm-up request
carrying the prompt before it (the prefix a full replay would have cached; the lanes' first
warm-ups run before the run's clock starts, later ones within it); every prompt opens,
after the shared system prompt, with a marker naming the run and the play, so two plays of one
session never share cache. The prompt of each turn is the recorded one (recorded outputs, not
what the server generated); max_tokens is the recorded output, with ignore_eos. Recorded think
times are honoured up to a cap. After `duration` seconds no new request starts, nor in a lane
that has started `requests_per_lane` measured requests (when set: a run of a fixed amount of
work, whatever the machine's speed); requests in flight finish and are measured.

This file owns the lanes and the play order. It must never compute statistics nor speak HTTP
itself (client.py does).
"""
from __future__ import annotations

import asyncio
import collections
import math
import random
from dataclasses import dataclass, field
from typing import NamedTuple

from rackserve.bench.client import ChatClient
from rackserve.bench.metrics import RequestRecord
from rackserve.bench.token_text import PromptRenderer
from rackserve.bench.workload import Session, SubagentGroup, Turn, Workload


def play_marker(number: int, run_id: str) -> str:
    """The text that opens a play's every prompt after the shared prefix (the simulator tokenizes
    it as the server does: sim/chat_template.marker_ids)."""
    return f"[play {number} of {run_id}]"


@dataclass(frozen=True)
class ReplayConfig:
    concurrency: int
    duration: float                     # seconds during which requests may start
    think_time_cap: float               # seconds; recorded think times above it are cut to it
    seed: int                           # random starts
    run_id: str                         # in every marker: distinct runs never share cache
    requests_per_lane: int | None = None    # measured requests (main and subagent) a lane may start


@dataclass
class LiveStats:
    """What the progress display shows; lanes update it as they go."""
    lanes: list[str]                    # per lane: idle, warm-up, busy, think, subagents, done
    in_flight: int = 0
    done: int = 0
    failed: int = 0
    # (end, prompt + output tokens, ITL) of the latest completed measured requests
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))


class _Play(NamedTuple):
    number: int
    tree: Session
    first: int                          # the main turn the play starts at
    marker: str                         # opens every prompt of the play, after the shared prefix


class Replay:
    def __init__(self, workload: Workload, renderer: PromptRenderer, client: ChatClient, config: ReplayConfig):
        assert config.concurrency > 0 and config.duration > 0, "a run needs lanes and time"
        assert config.requests_per_lane is None or config.requests_per_lane > 0, "a lane needs requests"
        self.workload, self.renderer, self.client, self.config = workload, renderer, client, config
        self.stats = LiveStats(["idle"] * config.concurrency)
        self.records: list[RequestRecord] = []
        self._plays = 0
        self._deadline = 0.0
        self._started = [0] * config.concurrency    # measured requests each lane has started

    async def run(self) -> list[RequestRecord]:
        # The lanes' first warm-ups run before the clock starts: N long prefills at once would
        # otherwise weigh on the measured window, the more so the higher the concurrency.
        self._deadline = math.inf
        plays = await asyncio.gather(*(self._begin(lane) for lane in range(self.config.concurrency)))
        self._deadline = self.client.clock() + self.config.duration
        await asyncio.gather(*(self._lane(lane, play) for lane, play in enumerate(plays)))
        return self.records

    def _open(self, lane: int) -> bool:
        bound = self.config.requests_per_lane
        return self.client.clock() < self._deadline and (bound is None or self._started[lane] < bound)

    def elapsed(self) -> float | None:
        """Seconds since the measured window opened; None during the first warm-ups."""
        if math.isinf(self._deadline):
            return None
        return self.client.clock() - (self._deadline - self.config.duration)

    async def _lane(self, lane: int, play: _Play) -> None:
        while True:
            await self._play(lane, play)
            if not self._open(lane):
                break
            play = await self._begin(lane)
        self.stats.lanes[lane] = "done"

    async def _begin(self, lane: int) -> _Play:
        """Takes the next session tree, picks its start, and sends its warm-up."""
        number = self._plays
        self._plays += 1
        tree = self.workload.session(number)
        turns = tree.turns
        first = int(random.Random(f"{self.config.seed}/{number}").uniform(0.25, 0.75) * len(turns))
        # The play number first: markers of two plays part within a few tokens.
        play = _Play(number, tree, first, play_marker(number, self.config.run_id))
        if first > 0:
            self.stats.lanes[lane] = "warm-up"
            # One output token: the point is the prefix, not the answer.
            await self._send(lane, play, tree, turns[first - 1], first - 1, "warmup", max_tokens=1)
        return play

    async def _play(self, lane: int, play: _Play) -> None:
        index = -1
        for step in play.tree.steps:
            if isinstance(step, Turn):
                index += 1
                if index >= play.first and not await self._turn(lane, play, play.tree, step, index, "main"):
                    return
            elif index >= play.first:
                await self._group(lane, play, step)

    async def _group(self, lane: int, play: _Play, group: SubagentGroup) -> None:
        self.stats.lanes[lane] = "subagents"

        async def agent(session: Session) -> None:
            for index, turn in enumerate(session.turns):
                if not await self._turn(lane, play, session, turn, index, "subagent"):
                    return

        await asyncio.gather(*(agent(a) for a in group.agents))

    async def _turn(self, lane: int, play: _Play, session: Session, turn: Turn, index: int, kind: str) -> bool:
        """Think, then send; False once the run (or this lane's share of it) has closed."""
        if not self._open(lane):
            return False
        think = min(turn.think_time, self.config.think_time_cap, self._deadline - self.client.clock())
        if think > 0:
            if kind == "main":
                self.stats.lanes[lane] = "think"
            await asyncio.sleep(think)
        if not self._open(lane):
            return False
        self._started[lane] += 1
        if kind == "main":
            self.stats.lanes[lane] = "busy"
        await self._send(lane, play, session, turn, index, kind, turn.output_len)
        return True

    async def _send(self, lane: int, play: _Play, session: Session, turn: Turn, index: int, kind: str,
                    max_tokens: int) -> None:
        # Hash ids are local to the tree: subagents name blocks in their root session's space.
        messages = self.renderer.messages(turn.hash_ids, turn.input_len, play.tree.session_id,
                                          session.shared_prefix_blocks, play.marker)
        record = RequestRecord(lane=lane, play=play.number, session_id=session.session_id, turn=index, kind=kind,
                               input_len=turn.input_len, max_tokens=max_tokens, start=self.client.clock())
        self.stats.in_flight += 1
        try:
            await self.client.send(messages, record)
        finally:
            self.stats.in_flight -= 1
        self.records.append(record)
        if not record.ok:
            self.stats.failed += 1
            if record.error == "connection":    # a server that is down: do not spin
                await asyncio.sleep(1.0)
        elif record.measured:
            self.stats.done += 1
            self.stats.recent.append((record.end, (record.prompt_tokens or record.input_len)
                                      + (record.output_tokens or 0), record.itl))
