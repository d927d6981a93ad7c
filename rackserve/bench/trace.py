"""The weka trace reader (`--workload trace:FILE`): the public format of the AgentX corpus, one
trace object per line (JSON Lines), or a JSON array of them, or one object.

A trace has `id`, `block_size` (64), `hash_id_scope` ("local": ids name blocks within the trace
only) and `requests`: normal (`type` "n") and streaming ("s") requests with `in`, `out`,
`hash_ids` and `think_time` (seconds before the request), and subagent entries (`type`
"subagent") with nested `requests`. Consecutive subagent entries form one group that runs at once;
the parent's next request waits for the group, as the format says. Start times (`t`), `api_time`
and `ttft` are recorded facts of the original run, not replay instructions: a closed-loop replay
paces itself by think times.

This file owns parsing and checking the format. It must never talk to a server.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from rackserve.bench.token_text import BLOCK_SIZE
from rackserve.bench.workload import (CONTEXT_HEADROOM, Session, SubagentGroup, Turn, Workload, WorkloadOptions,
                                      register_workload)


@dataclass(frozen=True)
class TraceFile:
    sessions: list[Session]
    dropped: list[str]                  # ids of traces with a request beyond the server's context


def read_traces(path: str, max_context: int | None = None) -> TraceFile:
    """Every trace of `path` as a session tree; with `max_context`, traces with a request whose
    prompt + output (+ room for the chat template) exceeds it are dropped, as aiperf does."""
    with open(path) as f:
        text = f.read()
    try:
        whole = json.loads(text)
        objects = whole if isinstance(whole, list) else [whole]
    except json.JSONDecodeError:   # JSON Lines: one trace a line
        objects = [json.loads(line) for line in text.splitlines() if line.strip()]
    sessions, dropped = [], []
    for number, obj in enumerate(objects):
        session = _trace(obj, f"{path}: trace {number}")
        peak = max(turn.input_len + turn.output_len for turn, _ in session.requests())
        if max_context is not None and peak > max_context - CONTEXT_HEADROOM:
            dropped.append(session.session_id)
        else:
            sessions.append(session)
    if not sessions:
        raise ValueError(f"{path}: no trace fits a context of {max_context} tokens" if dropped
                         else f"{path} holds no traces")
    return TraceFile(sessions, dropped)


def _trace(obj: dict, where: str) -> Session:
    for key in ("id", "block_size", "requests"):
        if key not in obj:
            raise ValueError(f"{where}: no {key!r}")
    if obj["block_size"] != BLOCK_SIZE:
        raise ValueError(f"{where}: block_size {obj['block_size']}; only {BLOCK_SIZE}-token blocks are supported")
    if obj.get("hash_id_scope", "local") != "local":
        raise ValueError(f"{where}: hash_id_scope {obj['hash_id_scope']!r}; only 'local' is supported")
    trace_id = str(obj["id"])
    steps: list[Turn | SubagentGroup] = []
    agents: list[Session] = []
    for number, request in enumerate(obj["requests"]):
        at = f"{where} ({trace_id}), request {number}"
        if request.get("type") == "subagent":
            turns = tuple(_turn(r, f"{at}, subagent request {i}") for i, r in enumerate(request.get("requests", ())))
            if turns:
                agents.append(Session(f"{trace_id}/{request.get('agent_id', number)}", turns))
            continue
        if agents:
            steps.append(SubagentGroup(tuple(agents)))
            agents = []
        steps.append(_turn(request, at))
    if agents:
        steps.append(SubagentGroup(tuple(agents)))
    if not any(isinstance(s, Turn) for s in steps):
        raise ValueError(f"{where} ({trace_id}): no requests")
    return Session(trace_id, tuple(steps))


def _turn(request: dict, where: str) -> Turn:
    if request.get("type") not in ("n", "s"):
        raise ValueError(f"{where}: type {request.get('type')!r}; expected 'n', 's' or 'subagent'")
    try:
        input_len, output_len, hash_ids = int(request["in"]), int(request["out"]), request["hash_ids"]
    except KeyError as e:
        raise ValueError(f"{where}: no {e.args[0]!r}") from None
    if input_len <= 0:
        raise ValueError(f"{where}: 'in' is {input_len}")
    if len(hash_ids) != -(-input_len // BLOCK_SIZE):
        raise ValueError(f"{where}: {len(hash_ids)} hash ids for {input_len} tokens in {BLOCK_SIZE}-token blocks")
    # A recorded output of 0 tokens (a cut-off call) is sent as 1: an API asks for at least one.
    return Turn(input_len, max(1, output_len), tuple(int(h) for h in hash_ids),
                float(request.get("think_time") or 0.0))


class TraceWorkload(Workload):
    def __init__(self, path: str, trace_file: TraceFile):
        self.name = f"trace:{path}"
        self.trace_file = trace_file

    def session(self, index: int) -> Session:
        return self.trace_file.sessions[index % len(self.trace_file.sessions)]

    def __len__(self) -> int:
        return len(self.trace_file.sessions)


@register_workload("trace")
def _trace_workload(argument: str, options: WorkloadOptions) -> Workload:
    if not argument:
        raise ValueError("the trace workload needs a file: --workload trace:FILE")
    if options.scale is not None:
        raise ValueError("--scale applies to the agentx generator, not to a recorded trace")
    return TraceWorkload(argument, read_traces(argument, options.max_context))
