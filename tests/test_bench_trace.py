"""The weka trace reader on tests/data/weka_tiny.jsonl (three traces: shared prefixes, think
times, one subagent group of two agents), its other layouts, and its refusals."""
from __future__ import annotations

import json
import os

import pytest

from rackserve.bench.trace import read_traces
from rackserve.bench.workload import SubagentGroup, Turn

TRACE = os.path.join(os.path.dirname(__file__), "data", "weka_tiny.jsonl")


def traces() -> list[dict]:
    with open(TRACE) as f:
        return [json.loads(line) for line in f]


def test_reads_sessions_turns_and_the_subagent_group():
    sessions = read_traces(TRACE).sessions
    assert [s.session_id for s in sessions] == ["tiny-a", "tiny-b", "tiny-c"]
    a = sessions[0]
    assert [type(step) for step in a.steps] == [Turn, Turn, Turn, SubagentGroup, Turn]
    assert [(t.input_len, t.output_len, t.think_time) for t in a.turns] == [
        (200, 6, 0.0), (290, 8, 0.3), (380, 7, 0.2), (450, 5, 0.4)]
    assert a.turns[1].hash_ids == (1, 2, 3, 5, 6)
    group = a.steps[3]
    # Two consecutive subagent entries: one group, run at once.
    assert [agent.session_id for agent in group.agents] == ["tiny-a/agent_001", "tiny-a/agent_002"]
    assert [t.input_len for t in group.agents[0].turns] == [150, 220]
    assert group.agents[1].turns[0].hash_ids == (1, 201, 202)
    assert all(s.shared_prefix_blocks == 0 for s in sessions)   # local scope: nothing shared across traces
    assert sessions[2].turns[1].think_time == 0.0               # null think time


def test_reads_a_json_array_and_a_single_object(tmp_path):
    array, single = tmp_path / "array.json", tmp_path / "single.json"
    array.write_text(json.dumps(traces(), indent=2))
    single.write_text(json.dumps(traces()[1], indent=2))
    assert [s.session_id for s in read_traces(str(array)).sessions] == ["tiny-a", "tiny-b", "tiny-c"]
    assert read_traces(str(single)).sessions == read_traces(TRACE).sessions[1:2]


def test_drops_traces_beyond_the_context():
    # tiny-a peaks at 450 + 5 tokens; 128 tokens stay free for the chat template and the marker.
    kept = read_traces(TRACE, max_context=450 + 5 + 127)
    assert kept.dropped == ["tiny-a"] and len(kept.sessions) == 2
    assert read_traces(TRACE, max_context=450 + 5 + 128).dropped == []
    with pytest.raises(ValueError, match="no trace fits"):
        read_traces(TRACE, max_context=64)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update(block_size=16), "block_size 16"),
    (lambda t: t.update(hash_id_scope="global"), "hash_id_scope"),
    (lambda t: t["requests"][0].update(hash_ids=[1, 2]), "2 hash ids for 200 tokens"),
    (lambda t: t["requests"][0].pop("out"), "no 'out'"),
    (lambda t: t["requests"][0].update(type="x"), "type 'x'"),
])
def test_refuses_malformed_traces(tmp_path, change, message):
    trace = traces()[0]
    change(trace)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(trace))
    with pytest.raises(ValueError, match=message):
        read_traces(str(path))
