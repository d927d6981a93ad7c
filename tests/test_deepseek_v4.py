"""DeepSeek-V4 against transformers' deepseek_v4 on tiny random checkpoints: greedy tokens identical
for prompts of 1 to 230 tokens (crossing sliding windows, CSA and HCA groups) under mixed batches,
chunked prefill at chunk sizes that do not align with the compression ratios, prefix-cache hits,
preemption and prefix caching off.

The lightning indexer keeps the top index_topk entries; scores tie (at ReLU zero) often with few
indexer heads, and torch.topk breaks ties one way in a prefill and another in a decode, so
transformers disagrees with itself there. rackserve's rule is "ties go to the earlier entry"; the
reference runs with the same rule (torch.topk replaced by a stable sort while it runs), and a test
pins the rule itself.
"""
from __future__ import annotations

import collections
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
import transformers

from rackserve import LLM, SamplingParams
from rackserve.model.torch_dsv4_attention import topk_earliest
from tests.tiny_models import TINY_KV_CACHE_GIB, build_tiny_deepseek_v4
from tests.tokenizer_utils import save_test_tokenizer

NUM_TOKENS = 16
KV_GIB = TINY_KV_CACHE_GIB     # the default 2 GiB is millions of blocks of the tiny V4: most of a test's time
_TopK = collections.namedtuple("_TopK", "values indices")

# A second config unlike the first: CSA first with a single indexer head (ties are common) keeping
# 2 entries, HCA at ratio 8, window 8, 2 mHC streams, 4 output groups, top-3 routing, one hash layer.
SECOND = dict(layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
              mlp_layer_types=["hash_moe", "moe", "moe"], num_hidden_layers=3, index_n_heads=1, index_topk=2,
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
              sliding_window=8, hc_mult=2, o_groups=4, num_experts_per_tok=3)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    # Tiny tensors: intra-op threads only add synchronisation, which on a loaded 2-core machine
    # made these tests 17x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextmanager
def stable_topk() -> Iterator[None]:
    """torch.Tensor.topk with ties to the lower index (the indexer calls the method; the MoE
    router calls torch.topk, whose float scores do not tie)."""
    original = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
        return _TopK(values.narrow(dim, 0, k), indices.narrow(dim, 0, k))
    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = [1, 3, 9, 17, 30, 41, 77, 150, 230]
    shared = torch.randint(3, vocab, (60,), generator=g).tolist()
    out = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    out[5] = shared + out[5][:13]          # two prompts share 60 tokens: a prefix hit inside one batch
    out[7] = shared + out[7][:90]
    return out


def hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode(), stable_topk():
        for prompt in prompts:
            out = model(torch.tensor([prompt]), use_cache=True)
            cache, tokens = out.cache, []
            for _ in range(NUM_TOKENS):
                tokens.append(int(out.logits[0, -1].argmax()))
                out = model(torch.tensor([tokens[-1:]]), cache=cache, use_cache=True)
                cache = out.cache
            results.append(tokens)
    return results


@pytest.fixture(scope="module", params=["first", "second"])
def v4_case(request, tmp_path_factory):
    overrides = {} if request.param == "first" else SECOND
    path = build_tiny_deepseek_v4(tmp_path_factory.mktemp(f"tiny_dsv4_{request.param}"), seed=11, **overrides)
    save_test_tokenizer(path, 512)
    prompts = prompts_for(512)
    return path, prompts, hf_greedy(path, prompts)


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for scheduler in llm.engine.core.schedulers:
        scheduler.check_integrity()
    return [o.outputs[0].token_ids for o in outs]


SETTINGS = {
    "mixed": dict(max_num_batched_tokens=96, max_num_seqs=9),
    "chunked_unaligned": dict(max_num_batched_tokens=7, max_num_seqs=3),
    "preempt": dict(max_num_batched_tokens=64, num_gpu_blocks_override=40, block_size=8, max_model_len=256),
    "no_prefix_cache": dict(max_num_batched_tokens=256, enable_prefix_caching=False),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_tokens_match_transformers(v4_case, setting):
    model_dir, prompts, expected = v4_case
    preemptions = []

    class Count:
        def record(self, sched_stats, iter_stats):
            preemptions.append(sched_stats.num_preemptions)

    with LLM(model_dir, dtype="float32", device="cpu", kv_cache_memory=KV_GIB, **SETTINGS[setting]) as llm:
        llm.engine.stat_loggers.append(Count())
        assert run(llm, prompts) == expected
        # Again: the longer prompts now hit their compressed entries in the prefix cache and replay
        # a bounded span before the hit to rebuild the window (docs/deepseek_v4.md).
        assert run(llm, prompts) == expected
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        again = llm.generate({"prompt_token_ids": prompts[8]}, params)[0]
        assert again.outputs[0].token_ids == expected[8]
        kv_config, block_size = llm.engine.core.executor.kv_cache_config, llm.engine.config.cache.block_size
        if SETTINGS[setting].get("enable_prefix_caching", True):
            # The hit: whole blocks of every compressed group, short of the last prompt token.
            hit = min((len(prompts[8]) - 1) // g.block_size * g.block_size for g in kv_config.groups[1:])
            start = kv_config.replay_start(hit, [hit // g.block_size for g in kv_config.groups[1:]], block_size)
            assert again.num_cached_tokens == start and 0 < hit - start <= \
                kv_config.num_layers * (kv_config.window - 1) + block_size
        else:
            assert again.num_cached_tokens == 0
    assert (sum(preemptions) > 0) == (setting == "preempt")


def test_indexer_ties_go_to_the_earlier_entry():
    scores = torch.tensor([[0.0, 2.0, 0.0, -1.0, 0.0, 2.0], [float("-inf"), 0.0, 0.0, 0.0, 1.0, 0.0]])
    assert topk_earliest(scores, 3).tolist() == [[1, 5, 0], [4, 1, 2]]


def test_quantized_checkpoints_are_refused(v4_case):
    from rackserve.model.loader import read_hf_config
    from rackserve.model.models.deepseek_v4 import DeepseekV4ForCausalLM
    from rackserve.distributed.parallel_state import ParallelGroups
    config = read_hf_config(v4_case[0])
    with pytest.raises(ValueError, match="FP8/FP4"):
        DeepseekV4ForCausalLM({**config, "quantization_config": {"quant_method": "fp8"}}, "torch", 64,
                              ParallelGroups.single())
    model = DeepseekV4ForCausalLM(config, "torch", 64, ParallelGroups.single())
    with pytest.raises(ValueError, match="quantized"):
        model.load_weights([("layers.0.attn.wq_a.weight", torch.zeros(48, 64, dtype=torch.float8_e4m3fn))])
    with pytest.raises(ValueError, match="quantized"):
        model.load_weights([("layers.0.attn.wq_a.scale", torch.ones(1, 1))])


@pytest.mark.parametrize("v4_case", ["first"], indirect=True)
@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                      dict(data_parallel_size=2, enable_expert_parallel=True)],
                         ids=["tp2", "tp2_ep2", "dep2"])
def test_parallel_runs_give_the_one_process_tokens(v4_case, parallel):
    # One process gives transformers' tokens (above), so the reference stands in for it.
    model_dir, prompts, expected = v4_case
    picked = [0, 2, 5, 7]
    with LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=64, kv_cache_memory=KV_GIB,
             **parallel) as llm:
        assert run(llm, [prompts[i] for i in picked]) == [expected[i] for i in picked]


@pytest.mark.parametrize("v4_case", ["first"], indirect=True)
def test_served_through_the_openai_api_and_bench_serve(v4_case, tmp_path):
    import json
    import os

    import openai

    import rackserve.bench.serve_bench  # noqa: F401  (registers `bench serve`)
    from rackserve.serve.cli import main
    from tests.server_utils import start_server
    model_dir, prompts, expected = v4_case
    proc, url = start_server(["--model", model_dir, "--served-model-name", "tiny-v4", "--device", "cpu",
                              "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", str(KV_GIB)],
                             tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        for i in (1, 7):
            out = client.completions.create(model="tiny-v4", prompt=prompts[i], max_tokens=NUM_TOKENS,
                                            temperature=0.0, extra_body={"ignore_eos": True})
            assert out.choices[0].text == tokenizer.decode(expected[i])
        # The startup banner (printed once the server is up) gives each cache group's bytes per token.
        assert "KV cache groups: window: " in (tmp_path / "server.log").read_text()
        trace = os.path.join(os.path.dirname(__file__), "data", "weka_tiny.jsonl")
        code = main(["bench", "serve", "--base-url", url, "--workload", f"trace:{trace}", "--concurrency", "2",
                     "--duration", "3", "--think-time-cap", "0.2", "--tokenizer", model_dir,
                     "--output", str(tmp_path / "bench.json"), "--no-progress"])
        assert code == 0
        with open(tmp_path / "bench.json") as f:
            run_ = json.load(f)["runs"][0]
        assert run_["summary"]["valid"] and run_["requests"]
        assert all(r["error"] is None and r["output_tokens"] == r["max_tokens"] for r in run_["requests"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_legacy_config_keys_of_deepseeks_checkpoints_are_read():
    # DeepSeek's own config.json spells the layer plan and RoPE the older way (transformers folds
    # them in at load time; rackserve reads config.json itself).
    from rackserve.model.dsv4_attention import CSA, HCA, SLIDING, layer_kinds, rope_dim, rope_params
    legacy = dict(num_hidden_layers=4, compress_ratios=[0, 4, 128, 4], qk_rope_head_dim=64, head_dim=512,
                  rope_theta=10000.0, compress_rope_theta=160000.0,
                  rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536})
    assert layer_kinds(legacy) == [SLIDING, CSA, HCA, CSA]
    assert rope_dim(legacy) == 64
    assert rope_params(legacy, "main") == {"rope_type": "default", "rope_theta": 10000.0}
    compress = rope_params(legacy, "compress")
    assert compress["rope_type"] == "yarn" and compress["rope_theta"] == 160000.0
    assert compress["attention_factor"] == 1.0       # V4 leaves cos/sin unscaled under YaRN
