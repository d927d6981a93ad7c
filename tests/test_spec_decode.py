"""Speculative decoding with n-gram prompt lookup (`--speculative-config`): the proposer's matches,
the scheduler's budget and rollback (a stand-in model that repeats its history part of the time),
and engines on tiny models whose tokens must be those of decoding without drafts: transformers'
greedy tokens, seeded sampling token for token, logprobs, stop rules, preemption, prefix hits,
tensor parallelism. Every engine test also checks that drafts were computed and some kept, so
none passes with the feature switched off.
"""
from __future__ import annotations

import zlib

import pytest
import torch
import transformers

from rackserve import LLM, SamplingParams
from rackserve.config import (CacheConfig, EngineArgs, EngineConfig, ModelConfig, SchedulerConfig,
                              SpeculativeConfig)
from rackserve.core.outputs import ModelRunnerOutput
from rackserve.core.request import Request, RequestStatus
from rackserve.core.scheduler import Scheduler
from rackserve.core.spec_decode import NgramProposer, RunnerDrafts
from rackserve.engine.stats import SpecDecodeCounts
from tests.test_engine_parity import NUM_TOKENS, SETTINGS, hf_greedy
from tests.tiny_models import TINY_KV_CACHE_GIB

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def proposer(k=3, hi=3, lo=1) -> NgramProposer:
    return NgramProposer(SpeculativeConfig.from_json({"num_speculative_tokens": k, "prompt_lookup_max": hi,
                                                      "prompt_lookup_min": lo}))


# -- the proposer -------------------------------------------------------------------------------
def test_proposer_takes_the_longest_match_then_the_latest():
    p = proposer(k=2, hi=3)
    # "7 8 9" last; "8 9" occurs at 1-2 (followed by 4 5) and "7 8 9" at 5-7 (followed by 1 2).
    assert p.propose("a", [0, 8, 9, 4, 5, 7, 8, 9, 1, 2, 3, 7, 8, 9], 5) == [1, 2]
    # Only single-token matches: the latest occurrence of 9 wins.
    assert proposer(k=2).propose("b", [9, 1, 2, 9, 3, 4, 9], 5) == [3, 4]


def test_proposer_respects_min_k_room_and_the_end_of_the_context():
    assert proposer(lo=2).propose("a", [1, 2, 3, 9, 3], 5) == []        # only "3" matches, min is 2
    assert proposer(k=4).propose("b", [5, 6, 7, 5, 6, 7], 9) == [5, 6, 7]  # "5 6 7" then the end
    assert proposer(k=4).propose("c", [1, 2, 3, 4, 5, 1, 2], 2) == [3, 4]  # room for 2
    assert proposer().propose("d", [1, 2, 3], 5) == []                      # nothing repeats


def test_proposer_index_follows_a_growing_context():
    p, tokens = proposer(k=1, hi=2), [4, 5, 6]
    assert p.propose("a", tokens, 1) == []
    tokens += [4, 5]
    assert p.propose("a", tokens, 1) == [6]
    tokens += [7, 4, 5]
    assert p.propose("a", tokens, 1) == [7]        # the latest "4 5" now
    p.forget("a")
    assert p.propose("a", tokens, 1) == [7]        # rebuilt from the tokens


def test_runner_drafts_are_proposed_once_and_only_after_the_tokens_they_follow():
    """method "mtp": the executor's drafts for a request, cut to k and the room, proposed at its next
    decode only while its tokens are the ones they were drafted after (never twice, never stale)."""
    p = RunnerDrafts(SpeculativeConfig(method="mtp", num_speculative_tokens=2))
    p.take("a", 3, [7, 8, 9])
    assert p.propose("a", [1, 2, 3], 5) == [7, 8]
    assert p.propose("a", [1, 2, 3], 5) == []           # used
    p.take("a", 3, [7, 8, 9])
    assert p.propose("a", [1, 2, 3, 4], 5) == []        # drafted after other tokens
    p.take("a", 3, [7, 8, 9])
    assert p.propose("a", [1, 2, 3], 1) == [7]
    p.take("a", 3, [7, 8])
    p.forget("a")
    assert p.propose("a", [1, 2, 3], 5) == []


def test_speculative_config_follows_vllms_defaults_and_refuses_what_it_cannot_do():
    assert SpeculativeConfig.from_json('{"num_speculative_tokens": 2}').prompt_lookup_max == 5
    c = SpeculativeConfig.from_json({"num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (3, 3)
    for bad in ('{"method": "eagle", "num_speculative_tokens": 2}', '{"num_speculative_tokens": 0}',
                '{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
                '{"num_speculative_tokens": 2, "draft_model": "x"}', "ngram"):
        with pytest.raises(ValueError):
            SpeculativeConfig.from_json(bad)


def test_the_startup_banner_says_how_it_drafts():
    from rackserve.serve.launch import speculative_line

    def line(spec):
        config = EngineArgs(model="smollm2-135m-instruct", speculative_config=spec).create_engine_config()
        return speculative_line(config)
    assert line(None) == ""
    assert line({**NGRAM, "disable_by_batch_size": 4}) == \
        "  speculative decoding: ngram, up to 3 drafts a step from the last 3..1 tokens; none while 4+ requests run\n"


# -- the scheduler, with a stand-in model ---------------------------------------------------------
def next_token(history: list[int]) -> int:
    """Repeats the token 5 back two times in three, else a hash of the history: drafts are right
    for a while, then wrong."""
    h = zlib.crc32(str(history).encode())
    return history[-5] if h % 3 else h % 50


def run_engine_loop(sched: Scheduler, max_steps=2000) -> dict[str, list[int]]:
    """A runner that computes drafts as the model runner does: samples at the last token and at
    each draft, keeps the drafts up to the first that differs, plus the token sampled there."""
    results: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return results
        so = sched.schedule()
        req_ids, tokens = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            req = sched.requests[req_id]
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            assert req.num_computed_tokens == req.num_tokens + len(drafts) or not drafts
            if req.num_computed_tokens - len(drafts) < req.num_tokens:
                continue
            history, new = list(req.all_token_ids), []
            for d in [*drafts, None]:
                new.append(next_token(history))
                if new[-1] != d:
                    break
                history.append(d)
            req_ids.append(req_id)
            tokens.append(new)
        for out in sched.update_from_output(so, ModelRunnerOutput(req_ids, tokens, [None] * len(req_ids))):
            results.setdefault(out.req_id, []).extend(out.new_token_ids)
        sched.check_integrity()
    raise AssertionError("did not finish")


def make_scheduler(speculative, num_blocks=64, budget=32, block_size=4):
    config = EngineConfig(ModelConfig("m", "m", "m", "float32", "cpu", 56, 0),
                          CacheConfig(block_size, 1.0, True, None), SchedulerConfig(8, budget),
                          speculative=None if speculative is None else SpeculativeConfig.from_json(speculative))
    return Scheduler(config, num_blocks)


@pytest.mark.parametrize("num_blocks,budget", [(64, 32), (14, 32), (64, 6)])   # roomy; preempting; tight budget
def test_scheduler_drafts_give_the_tokens_of_one_at_a_time(num_blocks, budget):
    def workload(sched):
        for i in range(5):
            sched.add_request(Request(f"r{i}", [(7 * i + j) % 50 for j in range(3 + 4 * i)],
                                      SamplingParams(max_tokens=12 + 5 * i)))
        drafted = []
        original = sched.update_from_output

        def counting(so, out):
            drafted.append(sum(map(len, so.scheduled_spec_decode_tokens.values())))
            assert so.total_num_scheduled_tokens <= budget
            return original(so, out)
        sched.update_from_output = counting
        return run_engine_loop(sched), sum(drafted), sched

    plain, none_drafted, _ = workload(make_scheduler(None, num_blocks, budget))
    spec, drafted, sched = workload(make_scheduler(NGRAM, num_blocks, budget))
    assert none_drafted == 0 and drafted > 0
    assert spec == plain
    assert all(len(spec[f"r{i}"]) == 12 + 5 * i for i in range(5))     # max_tokens, never past it
    assert sched.kv.usage() == 0.0
    assert (sched.make_stats().num_preemptions > 0) == (num_blocks == 14)


def test_scheduler_counts_drafts_and_never_caches_a_block_of_drafts():
    sched = make_scheduler(NGRAM, block_size=2)
    prompt = [1, 2, 3, 1, 2]        # "1 2" repeats: drafts 3, 1, 2
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=8)))
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(["a"], [[3]], [None]))   # the prompt's step
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3]} and so.num_scheduled_tokens == {"a": 4}
    # The runner kept one draft (1) and sampled 9 where 2 was drafted.
    sched.update_from_output(so, ModelRunnerOutput(["a"], [[1, 9]], [None]))
    req = sched.requests["a"]
    assert req.all_token_ids == prompt + [3, 1, 9] and req.num_computed_tokens == len(prompt) + 2
    stats = sched.make_stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    # Blocks were cached only as far as the request's own tokens: every cached block's hash is one
    # of its full blocks of real tokens.
    assert sched.kv.num_cached_blocks["a"] <= req.num_tokens // 2
    assert sched.kv.num_cached_blocks["a"] == len(req.block_hashes)
    # Kept drafts past a stop token are dropped, and so is their KV from the computed count (what a
    # KV connector reads as the request's tokens when it ends).
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    b = Request("b", prompt, SamplingParams(max_tokens=8, stop_token_ids=[1]))
    sched.add_request(b)
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(["b"], [[3]], [None]))
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens["b"] == [1, 2, 3]
    [out] = sched.update_from_output(so, ModelRunnerOutput(["b"], [[1, 2, 3, 7]], [None]))
    assert out.new_token_ids == [1] and out.finish_reason == "stop"
    assert b.num_computed_tokens == b.num_tokens - 1 == len(prompt) + 1


def test_no_drafts_for_penalised_requests_nor_beyond_disable_by_batch_size():
    def drafted_by_running(spec, **params):
        sched = make_scheduler(spec)
        for i in range(3):
            sched.add_request(Request(f"r{i}", [1, 2, 3, 1, 2], SamplingParams(max_tokens=6 + 6 * i, **params)))
        seen = []
        original = sched.update_from_output

        def record(so, out):
            seen.append((len(sched.running), bool(so.scheduled_spec_decode_tokens)))
            return original(so, out)
        sched.update_from_output = record
        run_engine_loop(sched)
        return seen

    assert not any(d for _, d in drafted_by_running(NGRAM, repetition_penalty=1.2))
    seen = drafted_by_running({**NGRAM, "disable_by_batch_size": 2})
    assert any(d for _, d in seen) and not any(d for running, d in seen if running >= 2)
    assert any(d for running, d in drafted_by_running(NGRAM) if running >= 2)


# -- engines on tiny models ----------------------------------------------------------------------
def repetitive_prompts(vocab: int) -> list[list[int]]:
    """Prompts whose second half repeats their first (drafts found from the start) and a few plain ones."""
    g = torch.Generator().manual_seed(1)
    halves = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (4, 11, 23, 37)]
    return [h + h for h in halves] + [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 19)]


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_deepseek_v3_dir"])
def spec_case(request):
    model_dir = request.getfixturevalue(request.param)
    prompts = repetitive_prompts(transformers.AutoConfig.from_pretrained(model_dir).vocab_size)
    return model_dir, prompts, hf_greedy(model_dir, prompts)


def generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.core.scheduler.check_integrity()
    return outs


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_tokens_with_drafts_match_transformers(spec_case, setting):
    model_dir, prompts, expected = spec_case
    stats = SpecDecodeCounts()
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    with LLM(model_dir, dtype="float32", device="cpu", kv_cache_memory=TINY_KV_CACHE_GIB,
             speculative_config=NGRAM, **SETTINGS[setting]) as llm:
        llm.engine.stat_loggers.append(stats)
        assert [o.outputs[0].token_ids for o in generate(llm, prompts, params)] == expected
        # Again, over prefix hits: a draft's KV in a cached block would change tokens here.
        assert [o.outputs[0].token_ids for o in generate(llm, prompts, params)] == expected
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens


def test_seeded_sampling_logprobs_and_stops_are_those_of_decoding_without_drafts(tiny_llama_dir):
    prompts = repetitive_prompts(256)
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=NUM_TOKENS, ignore_eos=True,
                             logprobs=3) for i in range(len(prompts))]
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    runs, stats = {}, SpecDecodeCounts()
    for spec in (None, NGRAM):
        with LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory=TINY_KV_CACHE_GIB,
                 speculative_config=spec) as llm:
            if spec:
                llm.engine.stat_loggers.append(stats)
            sampled = generate(llm, prompts, seeded)
            plain = generate(llm, prompts, greedy)
            # Stop at a token each greedy output has at its 10th place, and at 7 tokens.
            stops = [SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                                    stop_token_ids=[o.outputs[0].token_ids[9]]) for o in plain]
            stopped = generate(llm, prompts, stops)
            short = generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
            runs[spec is None] = (sampled, stopped, short)
    (s_spec, stop_spec, short_spec), (s_plain, stop_plain, short_plain) = runs[False], runs[True]
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    for a, b in zip(s_spec, s_plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert len(la) == len(lb) == NUM_TOKENS
        for pa, pb in zip(la, lb):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)
    for a, b in zip(stop_spec, stop_plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].finish_reason == "stop"
        assert len(a.outputs[0].token_ids) <= 10
    assert [o.outputs[0].token_ids for o in short_spec] == [o.outputs[0].token_ids for o in short_plain]
    assert all(len(o.outputs[0].token_ids) == 7 for o in short_spec)


def test_drafts_under_tensor_parallelism_give_the_one_process_tokens(tiny_llama_dir):
    prompts = repetitive_prompts(256)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    expected = hf_greedy(tiny_llama_dir, prompts)
    with LLM(tiny_llama_dir, dtype="float32", device="cpu", tensor_parallel_size=2, num_gpu_blocks_override=64,
             speculative_config=NGRAM) as llm:
        stats = SpecDecodeCounts()
        llm.engine.stat_loggers.append(stats)
        assert [o.outputs[0].token_ids for o in generate(llm, prompts, params)] == expected
    assert stats.num_accepted_tokens > 0


def test_a_disaggregated_decoder_with_drafts_gives_one_instances_tokens(tiny_llama_dir):
    """P/D over Mooncake (in one process): a prefiller without drafts, a decoder with them, a third
    instance that does both; the decoder's greedy tokens are the single instance's, it kept drafts,
    and every block is free once the transfers end."""
    from tests.test_kv_transfer_mooncake import _drain_to_empty, _llm, _prefill_then_decode
    prompts = [p for p in repetitive_prompts(512) if len(p) < 64]
    with _llm(tiny_llama_dir, None) as single, _llm(tiny_llama_dir, "kv_producer") as prefiller, \
            _llm(tiny_llama_dir, "kv_consumer", speculative_config=NGRAM) as decoder:
        stats = SpecDecodeCounts()
        decoder.engine.stat_loggers.append(stats)
        for prompt in prompts:
            want = single.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=24))
            got = _prefill_then_decode(prefiller, decoder, prompt, 24)
            assert got.outputs[0].token_ids == want[0].outputs[0].token_ids
            assert got.num_cached_tokens == len(prompt) - 1
        _drain_to_empty(prefiller, decoder)
    assert stats.num_accepted_tokens > 0


def test_a_model_with_several_kinds_of_kv_cache_refuses_drafts(tiny_deepseek_v4_kv_dir):
    with pytest.raises(ValueError, match="several kinds of KV cache"):
        LLM(tiny_deepseek_v4_kv_dir, dtype="float32", device="cpu", speculative_config=NGRAM)


def test_server_streams_the_tokens_of_decoding_without_drafts_and_counts_them(tmp_path, tiny_llama_dir):
    """`rackserve serve --speculative-config` driven by the openai client: streamed and whole
    completions carry the greedy tokens of an engine without drafts, several tokens a chunk where
    drafts were kept, and /metrics counts the drafts (vLLM's spec_decode names)."""
    import json

    import openai

    from tests.server_utils import metric_totals, start_server
    prompt = repetitive_prompts(512)[4]     # this tiny model's greedy output repeats a token: drafts are kept
    with LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory=TINY_KV_CACHE_GIB,
             skip_tokenizer_init=True) as llm:
        expected = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS,
                                                                          ignore_eos=True))[0].outputs[0].token_ids
    proc, url = start_server(["--model", tiny_llama_dir, "--served-model-name", "tiny", "--device", "cpu",
                              "--skip-tokenizer-init", "--num-gpu-blocks-override", "64",
                              "--speculative-config", json.dumps(NGRAM)], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        body = dict(model="tiny", prompt=prompt, max_tokens=NUM_TOKENS, temperature=0.0,
                    extra_body={"ignore_eos": True, "return_token_ids": True})
        whole = client.completions.create(**body)
        assert whole.choices[0].token_ids == expected
        chunks = [c.choices[0].token_ids for c in client.completions.create(stream=True, **body)
                  if c.choices and c.choices[0].token_ids]
        assert [t for c in chunks for t in c] == expected and max(map(len, chunks)) > 1
        totals = metric_totals(url)
        assert 0 < totals["rackserve:spec_decode_num_accepted_tokens_total"] \
            <= totals["rackserve:spec_decode_num_draft_tokens_total"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
