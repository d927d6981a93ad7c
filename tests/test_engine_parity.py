"""Engine parity with HF transformers on tiny random models: greedy tokens identical across batch
mixing, chunked prefill, prefix-cache hits and preemption.

The reference is a plain greedy loop over transformers' forward (no generate() logic, so EOS and
generation configs cannot interfere); rackserve runs with ignore_eos.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from rackserve import LLM, SamplingParams
from tests.tiny_models import TINY_KV_CACHE_GIB, identical_or_within_top

NUM_TOKENS = 32


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = [3, 9, 17, 30, 41, 58, 77, 100]
    shared = torch.randint(0, vocab, (40,), generator=g).tolist()
    out = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    # Two prompts share a 40-token prefix with each other (prefix hits inside one batch).
    out[5] = shared + out[5][:18]
    out[7] = shared + out[7][:60]
    return out


def hf_greedy(model_dir: str, prompts: list[list[int]], n: int = NUM_TOKENS) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model(ids, use_cache=True)
            past, tokens = out.past_key_values, []
            for _ in range(n):
                tok = int(out.logits[0, -1].argmax())
                tokens.append(tok)
                out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
            results.append(tokens)
    return results


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.core.scheduler.check_integrity()
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0].token_ids for o in outs]


# Each setting forces one path: mixed batches of chunks and decodes; small chunks; a cache so
# small that requests are preempted and recomputed; prefix caching off.
SETTINGS = {
    "mixed": dict(max_num_batched_tokens=64, max_num_seqs=8),
    "chunked": dict(max_num_batched_tokens=8, max_num_seqs=4),
    "preempt": dict(max_num_batched_tokens=64, num_gpu_blocks_override=24, block_size=8, max_model_len=160),
    "no_prefix_cache": dict(max_num_batched_tokens=128, enable_prefix_caching=False),
}


@pytest.fixture(scope="module",
                params=["tiny_llama_dir", "tiny_qwen3_dir", "tiny_qwen3_moe_dir", "tiny_deepseek_v3_dir"])
def model_case(request):
    model_dir = request.getfixturevalue(request.param)
    prompts = prompts_for(transformers.AutoConfig.from_pretrained(model_dir).vocab_size)
    return model_dir, prompts, hf_greedy(model_dir, prompts)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_tokens_match_transformers(model_case, setting):
    model_dir, prompts, expected = model_case
    with LLM(model_dir, dtype="float32", device="cpu", kv_cache_memory=TINY_KV_CACHE_GIB, **SETTINGS[setting]) as llm:
        assert run(llm, prompts) == expected
        # A second pass hits the prefix cache for every prompt and must not change a token.
        assert run(llm, prompts) == expected


def test_preemption_actually_happens(tiny_llama_dir):
    counted = []

    class Count:
        def record(self, sched_stats, iter_stats):
            counted.append(sched_stats.num_preemptions)

    with LLM(tiny_llama_dir, dtype="float32", device="cpu", **SETTINGS["preempt"]) as llm:
        llm.engine.stat_loggers.append(Count())
        run(llm, prompts_for(llm.engine.core.executor.vocab_size))
    assert sum(counted) > 0


def test_prefix_hits_are_reported(tiny_llama_dir):
    with LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory=TINY_KV_CACHE_GIB) as llm:
        prompt = {"prompt_token_ids": list(range(1, 70))}
        params = SamplingParams(temperature=0.0, max_tokens=4)
        first = llm.generate(prompt, params)[0]
        second = llm.generate(prompt, params)[0]
        assert first.num_cached_tokens == 0
        assert second.num_cached_tokens == 64   # whole 16-token blocks, last token recomputed
        assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_seeded_sampling_is_unchanged_by_preemption_and_batching(tiny_llama_dir):
    prompts = [{"prompt_token_ids": p} for p in prompts_for(256)]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=NUM_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    with LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory=TINY_KV_CACHE_GIB) as llm:
        alone = [llm.generate(p, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    with LLM(tiny_llama_dir, dtype="float32", device="cpu", **SETTINGS["preempt"]) as llm:
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.engine.core.scheduler.check_integrity()
    assert together == alone


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_deepseek_v3_dir"])   # K and V; MLA's latent
def test_bfloat16_kv_cache_holds_twice_the_blocks_and_keeps_greedy_tokens_in_top5(request, fixture):
    # --kv-cache-dtype bfloat16 under float32 weights: vLLM's rule for a lower-precision run,
    # each side's token inside the other's top-5 at the first divergence.
    model_dir = request.getfixturevalue(fixture)
    prompts = prompts_for(transformers.AutoConfig.from_pretrained(model_dir).vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    runs = {}
    for kv_dtype in ("auto", "bfloat16"):
        with LLM(model=model_dir, dtype="float32", device="cpu", kv_cache_memory=0.01,
                 max_num_batched_tokens=64, kv_cache_dtype=kv_dtype) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            llm.engine.core.scheduler.check_integrity()
            runs[kv_dtype] = (llm.engine.core.scheduler.kv.num_blocks, outs)
    (fp32_blocks, fp32), (bf16_blocks, bf16) = runs["auto"], runs["bfloat16"]
    assert bf16_blocks // 2 == fp32_blocks         # the same GiB, at half the bytes a block
    assert identical_or_within_top(fp32, bf16) >= len(prompts) // 2


# K and V; MLA's latent; DeepSeek-V4's window, compressed entries and their pooling's state.
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_deepseek_v3_dir", "tiny_deepseek_v4_kv_dir"])
@pytest.mark.parametrize("kv_dtype,fp8", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)],
                         ids=["fp8", "fp8_e5m2"])
def test_an_8_bit_float_kv_cache_computes_what_a_float32_cache_of_its_values_does(request, monkeypatch, fixture,
                                                                                   kv_dtype, fp8):
    # --kv-cache-dtype fp8 / fp8_e5m2 under float32 weights, against a float32 cache whose every
    # write is rounded through the same format (the native decode step, which writes its own, off in
    # both runs: tests/test_native_decode.py pins its writes): both runs attend over the same values,
    # so the same greedy tokens and logprobs, and four times the blocks in the same GiB (the
    # sliding-window groups of V4 are a fixed share, so more). Accuracy on a real model is a
    # benchmark's (docs/benchmarks.md): a tiny random model's near-tied logits tell nothing of it.
    from rackserve.executor import model_runner
    from rackserve.model import attention, torch_attention, torch_dsv4_attention, torch_mla_attention

    def rounded(cache, slots, values):
        limit = torch.finfo(fp8).max
        attention.write_cache(cache, slots, values.clamp(-limit, limit).to(fp8).to(values.dtype))
    model_dir = request.getfixturevalue(fixture)
    prompts = prompts_for(transformers.AutoConfig.from_pretrained(model_dir).vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    runs = {}
    monkeypatch.setattr(model_runner, "native_decoder", lambda model: None)
    for dtype in ("auto", kv_dtype):
        with monkeypatch.context() as m:
            if dtype == "auto":
                for module in (torch_attention, torch_mla_attention, torch_dsv4_attention):
                    m.setattr(module, "write_cache", rounded)
            with LLM(model=model_dir, dtype="float32", device="cpu", kv_cache_memory=0.01,
                     max_num_batched_tokens=64, kv_cache_dtype=dtype) as llm:
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
                llm.engine.core.scheduler.check_integrity()
                runs[dtype] = (llm.engine.core.scheduler.kv.num_blocks, outs)
    (fp32_blocks, ref), (fp8_blocks, ours) = runs["auto"], runs[kv_dtype]
    assert (fp8_blocks >= 4 * fp32_blocks) if fixture == "tiny_deepseek_v4_kv_dir" else (fp8_blocks // 4 == fp32_blocks)
    for a, b in zip(ours, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def test_float16_kv_cache_decodes_natively_with_the_greedy_tokens_of_the_sdpa_path(tiny_llama_dir, monkeypatch):
    # --kv-cache-dtype float16 under float32 weights: decode attention reads the half cache in place
    # (native_ops.paged_decode_attention, widening each block once); without it the torch path gathers
    # the blocks and runs SDPA over them. Both attend over the same rounded K and V.
    from rackserve.model import native_ops
    from rackserve.model.native import choose_isa
    if choose_isa().isa == "none":
        pytest.skip("no native library runs here")
    prompts = prompts_for(transformers.AutoConfig.from_pretrained(tiny_llama_dir).vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1)
    native_calls, real = [], native_ops.paged_decode_attention

    def counted(*args):
        out = real(*args)
        native_calls.append(out is not None)
        return out
    runs = {}
    for native in (True, False):
        with monkeypatch.context() as m:
            m.setattr(native_ops, "paged_decode_attention", counted if native else lambda *args: None)
            with LLM(model=tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory=0.01,
                     max_num_batched_tokens=64, kv_cache_dtype="float16") as llm:
                runs[native] = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert native_calls and all(native_calls), "every decode step's attention ran natively"
    for ours, sdpa in zip(runs[True], runs[False]):
        assert ours.outputs[0].token_ids == sdpa.outputs[0].token_ids
        for a, b in zip(ours.outputs[0].logprobs, sdpa.outputs[0].logprobs):
            # SDPA narrows the query to float16 and computes in it (torch_attention._decode; up to
            # 3.6e-3 apart here); ours keeps it float32 (test_native_decode_attention.py pins the
            # kernel to a float64 reference).
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-2 for t in a)
