"""The simulator's speed-ups change no decision: the prompt ids taken from the workload's blocks
(sim/prompt_ids.py) are exactly the ids the rendered text gives word by word (a session's prompt
extended from its last one's ids too), and a whole
simulated run through the block path (kv routing, DP, MTP, P/D with a KV pool) produces the
same requests, the same scheduler and router decisions and the same figures as the text path;
the routers' hashes of a session's prompts, each extended from the last (sim/routing.py's
PromptHashes), are block_hashes' and a run with them is the run without; prompts held as arrays
of 4-byte ids give the run of prompts held as lists; the collector tuned for a virtual run
(sim/virtual_loop.py) changes nothing in it and is put back after."""
from __future__ import annotations

import gc
import json
from array import array

import pytest

from rackserve.bench.token_text import PromptRenderer, default_vocabulary
from rackserve.bench.workload import WorkloadOptions, make_workload
from rackserve.serve.cli import main
from rackserve.core.hashing import block_hashes
from rackserve.core.request import Request
from rackserve.sampling_params import SamplingParams
from rackserve.sim import prompt_ids, routing, virtual_loop
from rackserve.sim.chat_template import TemplateTokens
from rackserve.sim.prompt_ids import BlockRenderer, Tokens
from rackserve.sim.routing import PromptHashes


def test_block_ids_are_the_text_words_ids():
    template = TemplateTokens(3, 2, 1)
    text, blocks = Tokens(300, template), Tokens(300, template)     # 300 < the words used: ids wrap
    by_text, by_block = PromptRenderer(default_vocabulary(), 7), BlockRenderer(default_vocabulary(), 7)
    workload = make_workload("agentx", WorkloadOptions(seed=1, scale=0.02, max_context=32768))
    prompts = [(turn.hash_ids, turn.input_len, s.session_id, s.shared_prefix_blocks)
               for s in map(workload.session, range(3)) for turn, _ in s.requests()]
    # A prompt cut inside its shared blocks, one of whole blocks only, one with no shared block.
    prompts += [([0, 1, 2, 3], 130, "x", 3), ([0, 1], 128, "y", 1), ([5, 6, 7], 150, "z", 0)]
    for i, prompt in enumerate(prompts):
        marker = f"[play {i} of test]"
        assert blocks.encode(by_block.messages(*prompt, marker)) == text.encode(by_text.messages(*prompt, marker))
    assert text.ids == blocks.ids and max(text.ids.values()) < 300 < len(text.ids)


def _run(tmp_path, name: str, args: list[str]) -> dict:
    out = tmp_path / f"{name}.json"
    assert main(["sim", "--model", "deepseek-v4.1-flash", "--hardware", "GB300", "--enable-expert-parallel",
                 "--block-size", "64", "--kv-cache-memory", "1", "--max-model-len", "32768", "--max-num-batched-tokens", "4096",
                 "--num-speculative-tokens", "3", "--acceptance-rate", "0.8", "--scale", "0.05", "--max-num-seqs", "64",
                 "--duration", "5", "--output", str(out), *args]) == 0
    result = json.loads(out.read_text())
    for run in result["runs"]:
        for key in ("wall_seconds", "speedup"):
            run["sim"].pop(key)
    return {k: result[k] for k in ("runs", "workload_stats")}


def test_prompt_ids_are_the_texts_whatever_the_sessions_last_prompt_was(monkeypatch):
    """Tokens keeps a session's last prompt and extends its ids by the new blocks: prompts that
    extend, shrink, part mid-way (a compaction), interleave with another session or a new play,
    and overflow the kept ids give the ids of the text path all the same."""
    monkeypatch.setattr(prompt_ids, "MAX_PROMPT_IDS", 64 * 14)     # about two prompts: evictions too
    template = TemplateTokens(3, 2, 1)
    text, blocks = Tokens(300, template), Tokens(300, template)
    by_text, by_block = PromptRenderer(default_vocabulary(), 7), BlockRenderer(default_vocabulary(), 7)
    prompts = [  # (hash ids, tokens, session, shared blocks, play)
        (range(8), 8 * 64, "s", 1, 0), (range(10), 10 * 64 - 5, "s", 1, 0), (range(12), 12 * 64, "s", 1, 0),
        (range(4), 4 * 64, "s", 1, 0), ([0, 1, 2, 99, 100, 101], 6 * 64, "s", 1, 0), (range(9), 9 * 64, "t", 1, 0),
        ([0, 1, 2, 99, 100, 101, 102], 7 * 64 - 1, "s", 1, 0), (range(12), 12 * 64, "s", 1, 1),
        (range(20), 20 * 64, "s", 1, 0), (range(21), 21 * 64, "s", 1, 0), (range(3), 100, "s", 0, 0)]
    for hash_ids, tokens, session, shared, play in prompts:
        prompt = (hash_ids, tokens, session, shared, f"[play {play} of test]")
        assert blocks.encode(by_block.messages(*prompt)) == text.encode(by_text.messages(*prompt)), prompt
    kept = sum(len(ids) for _, ids in blocks._prompts.values())
    assert blocks._prompts and blocks._prompt_ids == kept <= prompt_ids.MAX_PROMPT_IDS


def test_prompt_hashes_are_block_hashes_whatever_the_last_prompt_was():
    memo = PromptHashes()
    base = [i % 7 for i in range(40)]
    prompts = [  # (tokens, key): extends, shrinks, parts mid-way (a compaction), other session, new play
        (base[:10], (0, 0, "s")), (base, (0, 0, "s")), (base + [9] * 9, (0, 0, "s")), (base[:17], (0, 0, "s")),
        (base[:9] + [8] * 30, (0, 0, "s")), ([8] + base, (0, 0, "t")), (base + [1] * 4, (0, 0, "s")),
        (base[:3], (0, 0, "s")), (base, (0, 1, "s")), (base + [2] * 8, (1, 0, "s")), (base, None)]
    for tokens, key in prompts:
        for block_size, seed in ((4, 0), (8, 3)):
            assert memo.of(tokens, block_size, seed, key) == block_hashes(tokens, block_size, seed), (tokens, key)
    assert list(memo._plays) == [0, 1] and list(memo._plays[0][1]) == [("s", 4, 0), ("s", 8, 3)]   # play 1 only


# A kv-routed DEP2 pair and a P/D pair over a KV pool: the runs whose prompts the routers hash.
ROUTED_RUNS = pytest.mark.parametrize("args", [
    ["--instances", "2", "--data-parallel-size", "2", "--router-policy", "kv", "--concurrency", "12"],
    ["--prefill", "1", "--prefill-data-parallel-size", "2", "--decode", "1", "--data-parallel-size", "2",
     "--router-policy", "least_uncached", "--kv-pool-memory", "500", "--concurrency", "8"],
], ids=["kv-routed-dep2", "pd-kv-pool"])


@ROUTED_RUNS
def test_a_run_is_the_same_through_blocks_or_text(tmp_path, monkeypatch, args):
    fast = _run(tmp_path, "blocks", args)
    monkeypatch.setattr(prompt_ids, "BlockRenderer", PromptRenderer)    # the text path, as bench serve renders
    assert _run(tmp_path, "text", args) == fast
    assert all(r["summary"]["completed"] > 0 for r in fast["runs"])


@ROUTED_RUNS
def test_a_run_is_the_same_with_or_without_the_prompt_hash_memo(tmp_path, monkeypatch, args):
    memo = _run(tmp_path, "memo", args)
    monkeypatch.setattr(routing.PromptHashes, "of", lambda self, tokens, size, seed=0, key=None:
                        block_hashes(tokens, size, seed))
    assert _run(tmp_path, "whole", args) == memo


def test_a_simulated_prompt_is_an_array_that_the_engine_keeps():
    """A simulated prompt is an array of 4-byte ids (a rack holds thousands of 100K-token prompts
    at once: a list took 8 bytes a token, twice over), and the engine's Request keeps that kind for
    its prompt and its own copy of every token, which hash as the list's."""
    ids = Tokens(300, TemplateTokens(3, 2, 1)).encode([{"role": "user", "content": "one two three " * 50}])
    # The template's 3 + 2 tokens before the words and 1 after.
    assert isinstance(ids, array) and ids.itemsize == 4 and len(ids) == 3 + 2 + 150 + 1
    request = Request("r", ids, SamplingParams(max_tokens=4))
    assert isinstance(request.all_token_ids, array) and request.all_token_ids is not ids
    request.append_output_token(7)
    assert list(request.all_token_ids) == list(ids) + [7] and list(ids) == list(request.prompt_token_ids)
    assert block_hashes(request.all_token_ids, 16) == block_hashes(list(request.all_token_ids), 16)
    assert isinstance(Request("s", [1, 2], SamplingParams()).all_token_ids, list)


@ROUTED_RUNS
def test_a_run_is_the_same_with_prompts_as_lists(tmp_path, monkeypatch, args):
    arrays = _run(tmp_path, "arrays", args)
    encode = Tokens.encode
    monkeypatch.setattr(Tokens, "encode", lambda self, messages: list(encode(self, messages)))
    assert _run(tmp_path, "lists", args) == arrays


def test_the_virtual_loop_tunes_the_collector_for_its_run_only():
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()

    async def inside():
        return gc.get_threshold(), gc.get_freeze_count()
    during, frozen_during = virtual_loop.run_virtual(inside())
    assert during == (virtual_loop.YOUNG_GC_THRESHOLD, *thresholds[1:]) and frozen_during > frozen
    assert gc.get_threshold() == thresholds
    # The heap frozen for the run is thawed after, unless something (an engine) had frozen it before.
    assert gc.get_freeze_count() == 0 if not frozen else gc.get_freeze_count() >= frozen


@ROUTED_RUNS
def test_a_run_is_the_same_with_the_collectors_defaults(tmp_path, monkeypatch, args):
    tuned = _run(tmp_path, "tuned", args)
    monkeypatch.setattr(virtual_loop, "YOUNG_GC_THRESHOLD", gc.get_threshold()[0])
    monkeypatch.setattr(virtual_loop.gc, "freeze", lambda: None)
    assert _run(tmp_path, "defaults", args) == tuned
