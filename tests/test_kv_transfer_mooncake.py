"""MooncakeConnector in one process: a prefiller LLM and a decoder LLM, each with its own Mooncake
transfer engine and side channel, give the same greedy tokens as one LLM doing both, for the
standard K/V layout, MLA's latent cache and a 16-bit KV cache; leases, load failures and
mismatched layouts end in a completed request or a clear error, with no block leaked; a hold two readers pinned
is freed when both are done. DeepSeek-V4's cache comes in
several groups (a bounded window, compressed entries): every group's blocks move."""
from __future__ import annotations

import time

import pytest

from rackserve import LLM, SamplingParams


def _llm(path: str, role: str | None, **extra) -> LLM:
    config = None if role is None else {"kv_connector": "MooncakeConnector", "kv_role": role,
                                        "kv_connector_extra_config": extra.pop("connector", {}),
                                        **extra.pop("transfer", {})}
    return LLM(path, dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=64,
               block_size=4, kv_transfer_config=config, **extra)


def _drain(llm: LLM, timeout: float = 10.0) -> None:
    """Step until no KV is held for or arriving from a peer."""
    deadline = time.monotonic() + timeout
    while llm.engine.core.has_kv_transfers():
        assert time.monotonic() < deadline, "KV transfers never ended"
        llm.engine.step()


def _drain_to_empty(*llms: LLM) -> None:
    """Step each until its transfers ended; then every block is free and accounted for."""
    for llm in llms:
        _drain(llm)
    for llm in llms:
        llm.engine.core.check_integrity()
        assert llm.engine.core.scheduler.kv.usage() == 0.0


def _prefill_then_decode(prefiller: LLM, decoder: LLM, prompt: list[int], max_tokens: int, n: int = 1):
    [pre] = prefiller.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    params = pre.kv_transfer_params
    assert params and params["do_remote_prefill"] and params["remote_num_tokens"] == len(prompt)
    [out] = decoder.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0.0, max_tokens=max_tokens, n=n, kv_transfer_params=params))
    return out


PROMPTS = [[1], [5, 6, 7, 8, 9, 10, 11, 12], [3 + (i * 7) % 500 for i in range(23)]]


def test_deepseek_v4_moves_every_cache_group_and_decodes_like_one_instance(tiny_deepseek_v4_kv_dir):
    """DeepSeek-V4's cache has three groups (a 16-token window, CSA entries of 4 tokens, HCA
    entries of 16). The prefiller prefills in chunks of 8, so its window group gives back the
    blocks behind the window before the request ends: the params name only the ones it holds,
    and the decoder pulls those (the window its next token reads) plus every compressed block.
    The second prompt shares 40 tokens with the first: the decoder hits its own compressed blocks
    and pulls the rest."""
    first = [3 + (i * 7) % 500 for i in range(45)]            # 11 blocks and a partial one, past the window
    prompts = [first, first[:40] + [9, 8, 7, 6, 5, 4, 3], [5, 6, 7]]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with _llm(tiny_deepseek_v4_kv_dir, None) as single, \
            _llm(tiny_deepseek_v4_kv_dir, "kv_producer", max_num_batched_tokens=8) as prefiller, \
            _llm(tiny_deepseek_v4_kv_dir, "kv_consumer") as decoder:
        for k, prompt in enumerate(prompts):
            [want] = single.generate({"prompt_token_ids": prompt}, greedy)
            [pre] = prefiller.generate({"prompt_token_ids": prompt}, SamplingParams(
                temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
            params = pre.kv_transfer_params
            window, csa, hca = params["remote_block_ids"]
            assert len(window) == 12 if len(prompt) > 40 else len(window) == 1
            if k == 0:
                assert window[:6] == [None] * 6 and None not in window[-5:]   # given back behind the window
                assert None not in csa + hca and (len(csa), len(hca)) == (12, 3)
            [got] = decoder.generate({"prompt_token_ids": prompt}, SamplingParams(
                temperature=0.0, max_tokens=6, ignore_eos=True, kv_transfer_params=params))
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, k
            assert got.num_cached_tokens == len(prompt) - 1
        _drain_to_empty(prefiller, decoder)


@pytest.mark.parametrize("model_fixture,kv_cache_dtype", [("tiny_llama_dir", "auto"), ("tiny_deepseek_v3_dir", "auto"),
                                                          ("tiny_llama_dir", "bfloat16"), ("tiny_llama_dir", "fp8")])
def test_disaggregated_greedy_tokens_match_one_instance(request, model_fixture, kv_cache_dtype):
    path = request.getfixturevalue(model_fixture)
    opts = {"kv_cache_dtype": kv_cache_dtype}
    with _llm(path, None, **opts) as single, _llm(path, "kv_producer", **opts) as prefiller, \
            _llm(path, "kv_consumer", **opts) as decoder:
        for prompt in PROMPTS:
            want = single.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=6, n=2))
            got = _prefill_then_decode(prefiller, decoder, prompt, 6, n=2)
            assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want[0].outputs]
            # Every prompt token but the last arrived from the prefiller (minus what was cached here).
            assert got.num_cached_tokens == len(prompt) - 1 or len(prompt) == 1
        stats = decoder.engine.core.make_stats()
        # The prompts' pulls went over side channel connections kept open: at most one per transfer
        # thread (2), since two loads may run at once (with the native decode step they overlapped).
        connector = decoder.engine.core.executor.runner.kv_connector
        assert 1 <= connector._channels.opened <= connector._pool._max_workers == 2
        _drain(prefiller)
        _drain(decoder)
        prefiller.engine.core.check_integrity()
        decoder.engine.core.check_integrity()
        assert prefiller.engine.core.scheduler.kv.usage() == 0.0
        assert stats is not None


DEAD_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "gone", "remote_request_id": "r0",
               "remote_block_ids": list(range(8)), "remote_host": "127.0.0.1", "remote_num_tokens": 23}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_recomputes_or_fails_as_told(tiny_llama_dir, policy):
    from rackserve.distributed.parallel_state import free_port
    prompt = PROMPTS[2]
    params = {**DEAD_PARAMS, "remote_port": free_port()}   # nobody listens there
    with _llm(tiny_llama_dir, None) as single, _llm(tiny_llama_dir, "kv_consumer", connector={"transfer_timeout": 1.0},
                                                  transfer={"kv_load_failure_policy": policy}) as decoder:
        [want] = single.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=5))
        [got] = decoder.generate({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0.0, max_tokens=5, kv_transfer_params=params))
        if policy == "recompute":
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert got.num_cached_tokens == 0
        else:
            assert got.outputs[0].token_ids == [] and got.outputs[0].finish_reason == "error"
            assert got.outputs[0].stop_reason == "kv_load_failed"
        _drain(decoder)
        decoder.engine.core.check_integrity()
        assert decoder.engine.core.scheduler.kv.usage() == 0.0


def test_a_producer_with_another_kv_layout_is_refused_and_its_lease_frees_the_blocks(tiny_llama_dir):
    """A bfloat16 KV cache cannot feed a float32 one (a restarted instance with another model or
    dtype, say): the decoder recomputes, and the producer's blocks go when the lease runs out."""
    prompt = PROMPTS[2]
    with _llm(tiny_llama_dir, None) as single, \
            _llm(tiny_llama_dir, "kv_producer", kv_cache_dtype="bfloat16", connector={"lease_seconds": 0.5}) as pre, \
            _llm(tiny_llama_dir, "kv_consumer") as decoder:
        [want] = single.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=5))
        got = _prefill_then_decode(pre, decoder, prompt, 5)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.num_cached_tokens == 0
        assert pre.engine.core.scheduler.kv.usage() > 0   # held for a decoder that will never pull
        _drain(pre)
        _drain(decoder)
        for llm in (pre, decoder):
            llm.engine.core.check_integrity()
            assert llm.engine.core.scheduler.kv.usage() == 0.0


def test_smollm2_chats_disaggregated_match_one_instance(smollm2_gguf):
    """Real weights: SmolLM2-135M chats, prefilled on one instance and decoded on another, give the
    tokens the prefiller gives alone (run after, so the pull saw none of its own cache)."""
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]]
    kw = dict(dtype="float32", device="cpu", max_model_len=512, num_gpu_blocks_override=64, block_size=16)
    with LLM(smollm2_gguf, kv_transfer_config={"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"},
             **kw) as prefiller, \
            LLM(smollm2_gguf, kv_transfer_config={"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer"},
                **kw) as decoder:
        firsts = prefiller.chat(chats, SamplingParams(temperature=0.0, max_tokens=1,
                                                      kv_transfer_params={"do_remote_decode": True}))
        got = decoder.chat(chats, [SamplingParams(temperature=0.0, max_tokens=12, kv_transfer_params=f.kv_transfer_params)
                                   for f in firsts])
        want = prefiller.chat(chats, SamplingParams(temperature=0.0, max_tokens=12))
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert g.num_cached_tokens == len(g.prompt_token_ids) - 1
        _drain(prefiller)
        prefiller.engine.core.check_integrity()
        decoder.engine.core.check_integrity()


def test_a_producer_of_another_model_with_the_same_geometry_is_refused(tiny_llama_dir, tiny_llama3_rope_dir):
    """Same layers, heads and dtype, other weights (the KV fingerprint differs): never reused."""
    prompt = PROMPTS[2]
    with _llm(tiny_llama3_rope_dir, "kv_producer", connector={"lease_seconds": 0.5}) as pre, \
            _llm(tiny_llama_dir, "kv_consumer") as decoder:
        got = _prefill_then_decode(pre, decoder, prompt, 5)
        [want] = decoder.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=5))
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.num_cached_tokens == 0
        _drain(pre)
        pre.engine.core.check_integrity()
        decoder.engine.core.check_integrity()


def test_tensor_parallel_instances_move_each_ranks_shard(tiny_llama_dir):
    """TP=2 prefiller and TP=2 decoder (rank r pulls rank r's KV heads) give one TP=1 instance's tokens."""
    prompt = PROMPTS[2]
    with _llm(tiny_llama_dir, None) as single:
        [want] = single.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=6))
    with _llm(tiny_llama_dir, "kv_producer", tensor_parallel_size=2) as pre, \
            _llm(tiny_llama_dir, "kv_consumer", tensor_parallel_size=2) as decoder:
        got = _prefill_then_decode(pre, decoder, prompt, 6)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.num_cached_tokens == len(prompt) - 1
        _drain(pre)
        pre.engine.core.check_integrity()
        decoder.engine.core.check_integrity()
        assert pre.engine.core.scheduler.kv.usage() == 0.0


def test_a_hold_pinned_by_two_readers_is_freed_only_when_both_are_done(tiny_llama_dir):
    """Two decoders given the same kv_transfer_params (a client or proxy that sent them twice) pin
    one hold: the first one's done must not free blocks the second is still reading (freed, they
    are reused by the next request, and the second would load another prompt's KV silently)."""
    from rackserve.kv_transfer.side_channel import SideChannelClient

    with _llm(tiny_llama_dir, "kv_producer") as pre:
        [out] = pre.generate({"prompt_token_ids": PROMPTS[2]}, SamplingParams(
            temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        params = out.kv_transfer_params
        readers = [SideChannelClient(params["remote_host"], params["remote_port"], 5.0) for _ in range(2)]
        pin = {"op": "pin", "req_id": params["remote_request_id"]}
        try:
            while readers[0].call(pin)["status"] != "pinned":   # the workers learn of the hold at a step
                pre.engine.step()
            assert readers[1].call(pin)["status"] == "pinned"
            readers[0].call({"op": "done", "req_id": params["remote_request_id"], "pinned": True})
            for _ in range(3):
                pre.engine.step()
            assert pre.engine.core.scheduler.kv.usage() > 0   # the second reader's blocks are still held
            readers[1].call({"op": "done", "req_id": params["remote_request_id"], "pinned": True})
            _drain(pre)
            assert pre.engine.core.scheduler.kv.usage() == 0.0
            pre.engine.core.check_integrity()
        finally:
            for reader in readers:
                reader.close()


def test_a_decoder_starts_remote_kv_loads_while_prompts_wait(tiny_llama_dir):
    """With --max-waiting-tokens, prompt work waits while requests decode; a P/D request does not:
    its load computes nothing and, once landed, it computes one token as a decode does. So it
    decodes beside the running stream while a local prompt still waits, with one instance's tokens."""
    pd_prompt = PROMPTS[2]
    with _llm(tiny_llama_dir, None) as single, _llm(tiny_llama_dir, "kv_producer") as prefiller, \
            _llm(tiny_llama_dir, "kv_consumer", max_waiting_tokens=1000) as decoder:
        [want] = single.generate({"prompt_token_ids": pd_prompt}, SamplingParams(temperature=0.0, max_tokens=4))
        [pre] = prefiller.generate({"prompt_token_ids": pd_prompt}, SamplingParams(
            temperature=0.0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        engine = decoder.engine
        engine.add_request("stream", {"prompt_token_ids": [7, 8, 9]},
                           SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
        engine.step()   # its prompt goes: from now on it decodes, and prompts wait
        engine.add_request("local", {"prompt_token_ids": list(range(20, 32))},
                           SamplingParams(temperature=0.0, max_tokens=2))
        engine.add_request("pd", {"prompt_token_ids": pd_prompt}, SamplingParams(
            temperature=0.0, max_tokens=4, kv_transfer_params=pre.kv_transfer_params))
        got: dict[str, list[int]] = {}
        # Paced by the clock, not a count of steps: the load lands after some wall time, and a
        # native decode step of this tiny model takes well under a millisecond. The stream's 120
        # tokens at >= 5 ms a step give the load >= 0.6 s while prompts wait.
        for _ in range(120):
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if len(got.get("pd", [])) == 4:
                break
            time.sleep(0.005)
        assert got.get("pd") == want.outputs[0].token_ids, "the P/D request waited for the prompts"
        assert "local" not in got, "the local prompt went although the stream still decodes"
        while engine.has_unfinished_requests():
            engine.step()
        _drain(prefiller)
        _drain(decoder)
        decoder.engine.core.check_integrity()
