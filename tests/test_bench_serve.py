"""`rackserve bench serve` end to end: a tiny generated AgentX-like workload and the tiny weka
trace replayed against a live `rackserve serve` (tiny random Llama, test tokenizer) in a
subprocess. Every request completes with its full output; prompts grow exactly as the workload
says; the server's cache holds each conversation's prefix from its second request on, across a
subagent and its parent, and never across two plays (beyond the shared system prompt)."""
from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest

import rackserve.bench.serve_bench  # noqa: F401  (registers `bench serve`)
from rackserve.bench.agentx import AgentXConfig, AgentXWorkload
from rackserve.bench.trace import read_traces
from rackserve.bench.workload import SubagentGroup
from rackserve.serve.cli import main
from tests.server_utils import start_server
from tests.tiny_models import build_tiny_model
from tests.tokenizer_utils import save_test_tokenizer

TRACE = os.path.join(os.path.dirname(__file__), "data", "weka_tiny.jsonl")
MAX_MODEL_LEN = 4096
SERVER_BLOCK = 16                       # rackserve's default KV block size: the cache's granularity
# 64 MiB: room for ~87k tokens of the tiny model, far more than a run's conversations hold, so
# nothing the checks look for is evicted; the default 2 GiB (175k blocks) cost seconds to set up.
KV_CACHE_GIB = 1 / 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    model = build_tiny_model("LlamaForCausalLM", root / "model", vocab_size=512,
                             max_position_embeddings=MAX_MODEL_LEN)
    save_test_tokenizer(str(root / "tokenizer"), 512)
    proc, url = start_server(
        ["--model", model, "--tokenizer", str(root / "tokenizer"), "--served-model-name", "tiny",
         "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(KV_CACHE_GIB)],
        root / "server.log")
    yield url, str(root / "tokenizer"), root
    proc.terminate()
    proc.wait(timeout=30)


def bench(server, workload: str, *flags: str, duration: float = 8) -> dict:
    url, tokenizer, root = server
    out = root / f"{workload.split(':')[0]}.json"
    code = main(["bench", "serve", "--base-url", url, "--workload", workload, "--concurrency", "2",
                 "--duration", str(duration), "--tokenizer", tokenizer, "--output", str(out), "--no-progress", *flags])
    assert code == 0, "a valid run exits 0"
    with open(out) as f:
        result = json.load(f)
    assert len(result["runs"]) == 1
    assert result["machine"]["cpu"] and result["machine"]["cpu_count"] >= 1   # what it ran on
    return result["runs"][0]


def shared_prefix(a, b) -> int:
    """Tokens two turns of one conversation share: their common whole blocks."""
    n = 0
    while n < min(len(a.hash_ids), len(b.hash_ids)) and a.hash_ids[n] == b.hash_ids[n]:
        n += 1
    return min(n * 64, (a.input_len // 64) * 64, (b.input_len // 64) * 64)


def turns_by_session(sessions) -> dict:
    """Every (sub)session's turns by its id."""
    out = {}
    for session in sessions:
        out[session.session_id] = session.turns
        out.update((a.session_id, a.turns) for s in session.steps if isinstance(s, SubagentGroup) for a in s.agents)
    return out


def check_replay(run: dict, turns_of: dict, shared_tokens: int, min_hit_rate: float, think_cap: float) -> list[dict]:
    """The checks both workloads must pass; `turns_of[session_id]` lists a (sub)session's turns."""
    records = run["requests"]
    summary = run["summary"]
    assert summary["valid"] and summary["failures"] == {}
    assert summary["hit_rate_source"] == "usage.cached_tokens" and summary["hit_rate"] > min_hit_rate
    assert summary["server_hit_rate"] is not None
    assert all(r["error"] is None and r["output_tokens"] == r["max_tokens"] for r in records)
    by_play = defaultdict(list)
    for r in sorted(records, key=lambda r: r["start"]):
        by_play[r["play"]].append(r)
    assert len(by_play) >= 2
    for play in by_play.values():
        # Prompt tokens = the workload's input + one fixed overhead (chat template and marker).
        assert len({r["prompt_tokens"] - r["input_len"] for r in play}) == 1
        # Nothing is shared with another play beyond the shared system prompt.
        assert play[0]["cached_tokens"] < shared_tokens + 2 * SERVER_BLOCK
        conversations = defaultdict(list)
        for r in play:
            conversations[r["session_id"]].append(r)
        for session_id, requests in conversations.items():
            turns = turns_of[session_id]
            assert [r["turn"] for r in requests] == list(range(requests[0]["turn"], requests[-1]["turn"] + 1))
            for before, after in zip(requests, requests[1:]):
                turn, previous = turns[after["turn"]], turns[before["turn"]]
                assert after["cached_tokens"] > 0
                assert after["cached_tokens"] >= shared_prefix(previous, turn) - SERVER_BLOCK
                # The recorded think time (capped) passes before each turn.
                assert after["start"] - before["end"] >= min(turn.think_time, think_cap) - 0.01
    return records


def test_agentx_replay(server):
    # A fixed amount of work, not a time window: lane 0 plays play 0 from its main turn 9 (13
    # requests left), lane 1 play 1 from turn 20 (12 left), so 14 requests a lane take each lane
    # through its first play and into a later one whatever the machine's speed (300 s only bounds a
    # server that hangs). Outputs at 0.02 of the recorded (~500 tokens in all; the default 0.05 ~1,300);
    # think times capped at 0.05 s.
    run = bench(server, "agentx", "--think-time-cap", "0.05", "--output-scale", "0.02", "--requests-per-lane", "14",
                duration=300)
    config = AgentXConfig(seed=0, max_context=MAX_MODEL_LEN, output_scale=0.02)
    workload = AgentXWorkload(config)
    turns_of = turns_by_session(workload.session(play) for play in {r["play"] for r in run["requests"]})
    records = check_replay(run, turns_of, config.shared_prefix_blocks * 64, min_hit_rate=0.8, think_cap=0.05)
    measured = defaultdict(int)
    for r in records:
        measured[r["lane"]] += r["kind"] != "warmup"
    assert measured == {0: 14, 1: 14}, "each lane starts exactly --requests-per-lane measured requests"
    first_plays = {r["lane"]: r["play"] for r in sorted(records, key=lambda r: r["start"]) if r["play"] < 2}
    assert first_plays == {0: 0, 1: 1}
    # The system prompt is shared by all sessions: the first request of every conversation of a
    # later play (each lane begins one after its first) finds it in the cache.
    firsts = {}
    for r in sorted(records, key=lambda r: r["start"]):
        firsts.setdefault((r["play"], r["session_id"]), r)
    later = [r for (play, _), r in firsts.items() if play >= 2]
    assert {r["lane"] for r in later} == {0, 1}, "both lanes began a later play"
    assert all(r["cached_tokens"] >= config.shared_prefix_blocks * 64 - SERVER_BLOCK for r in later)


def test_trace_replay(server):
    # Lane 0 plays tiny-a from main turn 1: 6 requests, its subagent group's 3 among them; lane 1
    # plays the shorter sessions after it, several plays. 6 a lane, whatever the machine's speed.
    run = bench(server, f"trace:{TRACE}", "--think-time-cap", "0.3", "--requests-per-lane", "6", duration=300)
    turns_of = turns_by_session(read_traces(TRACE).sessions)
    # Its prompts are short next to their 64-token blocks: 48% hit an infinite cache.
    records = check_replay(run, turns_of, 0, min_hit_rate=0.3, think_cap=0.3)
    # The subagent group always runs (random starts fall on main turn 1 or 2, before it), and the
    # second agent finds block 1 of its parent's prompts in the cache.
    agent2 = [r for r in records if r["session_id"] == "tiny-a/agent_002"]
    assert agent2 and all(r["kind"] == "subagent" and r["cached_tokens"] >= 64 - SERVER_BLOCK for r in agent2)
