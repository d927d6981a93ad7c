"""GGUF loading: the real SmolLM2-135M-Instruct file (Q4_1 + Q8_0 + F32) against transformers
loading the very same file, and tiny GGUF files written here the way llama.cpp's converter writes
them (q/k rows permuted for llama, rope scaling as rope_freqs) against the HF originals.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from rackserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from rackserve.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from rackserve.executor.model_runner import ModelRunner
from rackserve.sampling_params import SamplingParams
from tests.test_model_parity import assert_parity, load, prefill_logits
from tests.tiny_models import load_hf

# The chat template applied to "What is the capital of France? Answer in one word." (SmolLM2's
# default system prompt included), as transformers' GGUF tokenizer encodes it.
SMOLLM2_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                  19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 19842, 281, 582, 2229,
                  30, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def smollm2_ours(smollm2_gguf):
    return load(smollm2_gguf)


def test_smollm2_model_info(smollm2_ours):
    model, info = smollm2_ours
    assert (info.architecture, info.num_layers, info.hidden_size, info.num_attention_heads, info.num_kv_heads,
            info.head_dim, info.vocab_size, info.max_position_embeddings, info.eos_token_ids) == \
        ("LlamaForCausalLM", 30, 576, 9, 3, 64, 49152, 8192, (2,))
    assert model.lm_head.weight is model.model.embed_tokens.weight     # the file has no output.weight


def test_smollm2_logits_match_transformers(smollm2_ours, smollm2_hf):
    model, info = smollm2_ours
    ours = prefill_logits(model, info, SMOLLM2_PROMPT)
    with torch.inference_mode():
        ref = smollm2_hf(torch.tensor([SMOLLM2_PROMPT])).logits[0]
    torch.testing.assert_close(ours[-1], ref[-1], atol=1e-3, rtol=1e-3)
    assert set(ours[-1].topk(5).indices.tolist()) == set(ref[-1].topk(5).indices.tolist())
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_smollm2_runner_greedy_matches_generate(smollm2_gguf, smollm2_hf):
    config = EngineConfig(ModelConfig(smollm2_gguf, "smollm2", smollm2_gguf, "float32", "cpu", None, 0),
                          CacheConfig(16, 0.01, True, 8), SchedulerConfig(4, 64))
    runner = ModelRunner(config)
    n_out = 8
    params = SamplingParams(temperature=0.0, max_tokens=None)
    prompt = SMOLLM2_PROMPT
    # A chunked prefill (20 + 22 tokens) over blocks out of order, then decodes.
    runner.execute_model(SchedulerOutput([NewRequestData("r", prompt, [], params, [6, 1, 4, 0], 0)], [], {"r": 20}, 20))
    rest = len(prompt) - 20
    out = runner.execute_model(SchedulerOutput([], [CachedRequestData("r", [], 20)], {"r": rest}, rest))
    tokens = out.sampled_token_ids[0]
    for i in range(n_out - 1):
        done = len(prompt) + i
        out = runner.execute_model(SchedulerOutput([], [CachedRequestData("r", [], done)], {"r": 1}, 1))
        tokens += out.sampled_token_ids[0]
    ids = torch.tensor([prompt])   # the mask is explicit: the pad id (<|im_end|>) is in the prompt
    ref = smollm2_hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n_out,
                              eos_token_id=None)
    assert tokens == ref[0, len(prompt):].tolist()


# --- tiny GGUF files written as llama.cpp's convert_hf_to_gguf.py writes them ---------------------

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf, path: str, arch: str, qtypes: list) -> str:
    """Write `hf` as llama.cpp would; 2-D weights cycle through `qtypes`. `hf` is changed in place
    to the dequantized weights, so that it stays the exact reference of the file."""
    import gguf
    from gguf.quants import dequantize, quantize
    c = hf.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_eos_token_id(c.eos_token_id)
    if c.rope_parameters["rope_type"] == "llama3":
        inv_freq = hf.model.rotary_emb.inv_freq
        default = 1.0 / c.rope_parameters["rope_theta"] ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
        w.add_tensor("rope_freqs.weight", (default / inv_freq).numpy().astype(np.float32))
    matrices = 0
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, kind = name.rsplit(".", 1)
        if base in _GLOBAL:
            gname = f"{_GLOBAL[base]}.{kind}"
        else:
            _, _, layer, part = base.split(".", 3)
            gname = f"blk.{layer}.{_LAYER[part]}.{kind}"
        data, qtype = t.numpy().astype(np.float32), None
        if data.ndim == 2:
            qtype = qtypes[matrices % len(qtypes)]
            matrices += 1
            data = quantize(data, qtype)
            with torch.no_grad():
                t.copy_(torch.from_numpy(dequantize(data, qtype)))
        # Quantization blocks run along rows, so permuting rows commutes with it.
        if arch == "llama" and part_is(name, "q_proj"):
            data = llama_cpp_permute(data, c.num_attention_heads)
        elif arch == "llama" and part_is(name, "k_proj"):
            data = llama_cpp_permute(data, c.num_key_value_heads)
        w.add_tensor(gname, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def part_is(name: str, part: str) -> bool:
    return f".{part}." in name


@pytest.mark.parametrize("fixture,arch", [("tiny_llama3_rope_dir", "llama"), ("tiny_qwen3_dir", "qwen3")])
def test_tiny_gguf_matches_its_hf_original(fixture, arch, request, tmp_path):
    from gguf import GGMLQuantizationType as Q
    hf_dir = request.getfixturevalue(fixture)
    hf = load_hf(hf_dir)
    path = write_gguf(hf, str(tmp_path / "tiny.gguf"), arch, [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
    ids = torch.randint(0, 512, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    model, info = load(path)
    assert info.head_dim == hf.config.head_dim
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_parity(prefill_logits(model, info, ids), ref)
