"""The native decode step (model/native_decode.py): a step of decodes through one native call gives
the tokens and logprobs of the module path, and transformers' greedy tokens, on a tiny Llama GGUF
kept packed (batched decodes of different lengths over scattered blocks, a padded qkv tile) and
on its dense HF copy in float32 (and in bfloat16, within the module path's top 3); and it stays off, with its reason, where an op has no native form. Skipped where the native library
cannot run.
"""
from __future__ import annotations

import pytest
import torch

from rackserve.config import ModelConfig
from rackserve.engine.llm import LLM
from rackserve.executor import model_runner
from rackserve.model import native_decode
from rackserve.model.loader import load_model
from rackserve.model.native import ISAS, unavailable_reason
from rackserve.sampling_params import SamplingParams
from tests.test_model_gguf import write_gguf
from tests.tiny_models import build_tiny_model, identical_or_within_top, load_hf

# Skipped only where no build runs (a Zen has the avx2 one alone; the tests below pick each build).
WHY_NOT = None if any(unavailable_reason(isa=isa) is None for isa in ISAS) else unavailable_reason()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 8, 9, 11, 300], [300, 12, 64], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
# Different lengths, so that steps of 3, then 2, then 1 decode run; each request's blocks come
# after the others' in the pool, so a batch's tables are never one run of blocks.
PARAMS = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (14, 6, 10)]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[str, object]:
    """A tiny Llama whose qkv output (8 heads of 4 and one KV head: 40 rows) pads the last of vnni's
    16-row tiles; o, gate_up and down fill theirs. HF's copy holds the dequantized weights."""
    from gguf import GGMLQuantizationType as Q
    root = tmp_path_factory.mktemp("native_decode")
    hf_dir = build_tiny_model("LlamaForCausalLM", root / "hf", hidden_size=32, num_attention_heads=8,
                              num_key_value_heads=1, head_dim=4, intermediate_size=96)
    hf = load_hf(hf_dir)
    return write_gguf(hf, str(root / "tiny.gguf"), "llama", [Q.Q4_1]), hf


def _generate(path: str, native: bool, monkeypatch, isa: str, kv_cache_dtype: str = "auto",
              quantization: str = "gguf", dtype: str = "float32") -> tuple[list, int]:
    """The RequestOutputs of PROMPTS, and how many steps ran natively."""
    steps = []
    forward = native_decode.NativeDecoder.forward

    def counted(self, *args):
        out = forward(self, *args)
        steps.append(out is not None)
        return out
    with monkeypatch.context() as m:
        m.setattr(native_decode.NativeDecoder, "forward", counted)
        if not native:
            m.setattr(model_runner, "native_decoder", lambda model: None)
        with LLM(path, device="cpu", dtype=dtype, num_gpu_blocks_override=32, block_size=4, max_model_len=64,
                 skip_tokenizer_init=True, quantization=quantization, native_isa=isa,
                 kv_cache_dtype=kv_cache_dtype) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
            llm.engine.core.scheduler.check_integrity()
    return outs, sum(steps)


def _same_tokens_and_logprobs(native: tuple[list, int], ref: tuple[list, int]) -> None:
    """Every decode step of the first run native, none of the second; the same tokens, and
    logprobs within float32 rounding."""
    (ours, native_steps), (theirs, none) = native, ref
    assert none == 0 and native_steps == max(p.max_tokens for p in PARAMS) - 1, "every decode step ran natively"
    for a, b in zip(ours, theirs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step, ref_step in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert step.keys() == ref_step.keys()
            assert all(abs(lp.logprob - ref_step[token].logprob) < 1e-4 for token, lp in step.items())


ISA_PARAMS = [pytest.param(isa, marks=pytest.mark.skipif((why := unavailable_reason(isa=isa)) is not None,
                                                         reason=str(why))) for isa in ISAS]


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_native_decode_steps_match_the_module_path_and_transformers(tiny_gguf, monkeypatch, isa):
    # Each build: its GEMV (vnni's 16-row tiles, which the 40-row qkv pads; avx2's 8-row ones) and
    # its own compile of the loop and the attention.
    path, hf = tiny_gguf
    ours = _generate(path, True, monkeypatch, isa)
    _same_tokens_and_logprobs(ours, _generate(path, False, monkeypatch, isa))
    with torch.inference_mode():
        for out, prompt, params in zip(ours[0], PROMPTS, PARAMS):
            ids = torch.tensor([prompt])
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=params.max_tokens, eos_token_id=None)
            assert out.outputs[0].token_ids == want[0, len(prompt):].tolist()


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("kv_cache_dtype", ["float16", "fp8", "fp8_e5m2"])
def test_a_narrower_kv_cache_decodes_natively_as_the_module_path(tiny_gguf, monkeypatch, isa, kv_cache_dtype):
    # The loop writes K/V rounded to nearest even (F16C, or kv_fp8.h's codes) where the modules
    # write k.to(float16) or the clamped cast to an 8-bit float (attention.write_cache), and both
    # read them with the same kernel: the same cache bits, so the same tokens and logprobs up to
    # the float32 rounding of the float32-cache test above.
    path, _ = tiny_gguf
    _same_tokens_and_logprobs(_generate(path, True, monkeypatch, isa, kv_cache_dtype),
                              _generate(path, False, monkeypatch, isa, kv_cache_dtype))


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_a_dense_float32_checkpoint_decodes_natively_as_the_module_path(tiny_gguf, monkeypatch, isa):
    # HF's safetensors copy of the same tiny Llama: its linears are dense float32 weights, which
    # the loop multiplies with rs_dense_gemv (the module path's few rows take it too, through
    # native_ops.linear; with the library off they are F.linear: the reference below).
    path = tiny_gguf[1].name_or_path
    _same_tokens_and_logprobs(_generate(path, True, monkeypatch, isa, quantization="auto"),
                              _generate(path, False, monkeypatch, "none", quantization="auto"))


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_a_bfloat16_checkpoint_decodes_natively_within_the_module_paths_top3(tiny_gguf, monkeypatch, isa):
    # The HF copy in bfloat16 (bf16 weights, KV cache and prefill): the loop multiplies the bf16
    # weights in float32 (rs_dense_gemv kind 1), writes K/V rounded to bf16 and reads them with the
    # bf16 attention entry, where the modules round every activation to bf16: vLLM's rule for runs
    # of different precision (PARAMS ask for 3 logprobs), and most requests do not differ at all.
    path = tiny_gguf[1].name_or_path
    ours, native_steps = _generate(path, True, monkeypatch, isa, quantization="auto", dtype="bfloat16")
    theirs, none = _generate(path, False, monkeypatch, isa, quantization="auto", dtype="bfloat16")
    assert none == 0 and native_steps == max(p.max_tokens for p in PARAMS) - 1, "every decode step ran natively"
    assert identical_or_within_top(ours, theirs) >= 2


def test_a_bf16_checkpoint_run_in_float32_keeps_its_linears_in_bf16(tiny_gguf, tmp_path, monkeypatch):
    # float32 (what --dtype auto picks on a CPU without native bf16) over a bf16 checkpoint: its
    # linear weights stay bf16, every value being one, and are widened exactly (rs_dense_gemv kind
    # 1 in the loop, F.linear of the widened weight in prefill), so the tokens and logprobs are
    # those of the same values held in float32, for half the bytes a decode step reads.
    import copy

    from rackserve.model import loader
    path = str(tmp_path / "bf16")
    copy.deepcopy(tiny_gguf[1]).to(torch.bfloat16).save_pretrained(path)
    kept, real = [], loader.keep_bf16_linears
    monkeypatch.setattr(loader, "keep_bf16_linears", lambda model: kept.append(real(model)) or kept[-1])
    ours = _generate(path, True, monkeypatch, "auto", quantization="auto")
    monkeypatch.setattr(loader, "keep_bf16_linears", lambda model: 0)
    theirs = _generate(path, True, monkeypatch, "auto", quantization="auto")
    assert kept == [3 * 4], "qkv, o, gate_up and down of each of the 3 layers"
    assert ours[1] == theirs[1] == max(p.max_tokens for p in PARAMS) - 1, "every decode step ran natively"
    for a, b in zip(ours[0], theirs[0], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step, ref_step in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert all(abs(lp.logprob - ref_step[token].logprob) < 1e-5 for token, lp in step.items())


def test_native_decode_stays_off_where_an_op_has_no_native_form(tiny_llama_dir, tiny_qwen2_dir):
    dense, _ = load_model(ModelConfig(tiny_llama_dir, "tiny", tiny_llama_dir, "float32", "cpu", None, 0))
    assert "KV cache" in native_decode.supports(dense)       # its linears qualify: dense float32
    half, _ = load_model(ModelConfig(tiny_llama_dir, "tiny", tiny_llama_dir, "float16", "cpu", None, 0))
    assert "dense float32 or bfloat16" in native_decode.supports(half)
    biased, _ = load_model(ModelConfig(tiny_qwen2_dir, "tiny", tiny_qwen2_dir, "float32", "cpu", None, 0))
    assert "dense Llama" in native_decode.supports(biased)


def test_bench_forward_profile_splits_the_native_step_by_op(tiny_gguf):
    from rackserve.bench.forward_steps import KINDS, ForwardPoint, Side, time_point
    from rackserve.config import EngineArgs
    from rackserve.executor.base import create_executor
    config = EngineArgs(model=tiny_gguf[0], device="cpu", num_gpu_blocks_override=16, block_size=4,
                        quantization="gguf").create_engine_config()
    executor = create_executor(config)
    try:
        (timing,) = time_point([Side(executor, config)], ForwardPoint("decode", 2, 9, 1), 0.0, 1, seed=0, profile=True)
    finally:
        executor.shutdown()
    assert list(timing.native_profile) == list(native_decode.OPS)
    assert all(v > 0 for v in timing.native_profile.values()), timing.native_profile
    # Inside the native call is attention, MLP and norms; embedding, lm_head and the rest are around it.
    assert list(timing.profile) == list(KINDS) and all(v > 0 for v in timing.profile.values()), timing.profile
    assert sum(timing.native_profile.values()) < 1
