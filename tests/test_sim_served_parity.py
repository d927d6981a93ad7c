"""A simulated request's prompt is as long as the served one: for the same workload, seed and play,
`rackserve sim` counts exactly the tokens a `rackserve serve` would count for the text `bench serve`
sends (the server's own chat-template path, rackserve's Tokenizer.apply_chat_template), play
marker included. The marker ("[play 3 of 1f0c9a2bc4]") once counted a token a word in the
simulator, 12-13 tokens short of SmolLM2's tokenization of it."""
from __future__ import annotations

import json

import pytest

from rackserve.bench.replay import play_marker
from rackserve.bench.token_text import PromptRenderer, load_server_tokenizer, vocabulary_from_tokenizer
from rackserve.bench.workload import SubagentGroup, WorkloadOptions, make_workload
from rackserve.serve.cli import main
from rackserve.sim.instance import run_id

SEED, MAX_MODEL_LEN = 3, 8192


def sessions_of(tree) -> dict:
    """Every (sub)session of a session tree by its id."""
    out = {tree.session_id: tree}
    out.update((a.session_id, a) for s in tree.steps if isinstance(s, SubagentGroup) for a in s.agents)
    return out


# Virtual seconds: agentx's plays are long (15 s holds 2 plays, 24 requests on the H100); random's
# are one request each (~8 ms on the H100: 0.2 s holds ~25; 15 s held 1,814, tokenized in ~18 s).
@pytest.mark.parametrize("workload,concurrency,duration", [("agentx", 2, "15"), ("random", 1, "0.2")])
def test_simulated_prompts_count_the_served_tokens(tmp_path, workload, concurrency, duration):
    out = tmp_path / "sim.json"
    # H100: the CPU's calibration is beside the point here (and may not exist for this machine).
    assert main(["sim", "--hardware", "H100", "--workload", workload, "--concurrency", str(concurrency),
                 "--duration", duration, "--seed", str(SEED), "--max-model-len", str(MAX_MODEL_LEN),
                 "--random-input-len", "300", "--random-output-len", "8", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["sim"]["marker_tokenizer"] == "smollm2-135m-instruct"
    records = result["runs"][0]["requests"]
    assert len({r["play"] for r in records}) >= 2

    # What bench serve sends for those requests, and what the server counts of it.
    tokenizer = load_server_tokenizer("smollm2-135m-instruct")
    renderer = PromptRenderer(vocabulary_from_tokenizer(tokenizer, "smollm2-135m-instruct"), SEED)
    work = make_workload(workload, WorkloadOptions(seed=SEED, max_context=MAX_MODEL_LEN, random_input_len=300,
                                                   random_output_len=8))
    for r in records:
        tree = work.session(r["play"])
        session = sessions_of(tree)[r["session_id"]]
        turn = session.turns[r["turn"]]
        assert turn.input_len == r["input_len"]
        messages = renderer.messages(turn.hash_ids, turn.input_len, tree.session_id, session.shared_prefix_blocks,
                                     play_marker(r["play"], run_id(SEED, concurrency)))
        assert r["prompt_tokens"] == len(tokenizer.apply_chat_template(messages)), r
