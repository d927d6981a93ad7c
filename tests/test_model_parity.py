"""Model parity with HF transformers in float32 for every supported architecture: prefill logits
close at every position and greedy argmax equal; plus the safetensors loader's formats (sharded,
tied) and the config spellings real checkpoints use.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from rackserve.config import ModelConfig
from rackserve.model.attention import CommonAttentionMetadata, bind_kv_cache, get_attn_backend
from rackserve.model.loader import ModelInfo, load_model
from rackserve.model.rotary import inverse_frequencies, rope_parameters
from tests.tiny_models import LLAMA3_ROPE, build_tiny_model, load_hf

BS = 8


def load(path: str) -> tuple[nn.Module, ModelInfo]:
    return load_model(ModelConfig(path, "tiny", path, "float32", "cpu", None, 0))


def prefill_logits(model: nn.Module, info: ModelInfo, ids: list[int],
                   cache_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits at every position of one prefill, through a paged cache (of `cache_dtype`) with a
    reversed block table."""
    n = len(ids)
    num_blocks = -(-n // BS) + 2
    bind_kv_cache(model, [(torch.zeros(num_blocks, BS, info.num_kv_heads, info.head_dim, dtype=cache_dtype),
                           torch.zeros(num_blocks, BS, info.num_kv_heads, info.head_dim, dtype=cache_dtype))
                          for _ in range(info.num_layers)])
    table = list(range(num_blocks))[::-1]
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
    backend = get_attn_backend("torch")
    meta = backend.build_metadata(CommonAttentionMetadata([n], [0], [table], slots, BS), torch.device("cpu"))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta))


def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return load_hf(path)(torch.tensor([ids])).logits[0]


def assert_parity(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama3_rope_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_prefill_logits_match_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    # 150 tokens: well past the llama3 fixture's original context of 64, where its scaling acts.
    ids = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    model, info = load(path)
    assert_parity(prefill_logits(model, info, ids), hf_logits(path, ids))


def test_model_info_from_config(tiny_qwen3_dir):
    _, info = load(tiny_qwen3_dir)
    assert (info.architecture, info.num_layers, info.num_attention_heads, info.num_kv_heads, info.head_dim,
            info.hidden_size, info.vocab_size, info.max_position_embeddings, info.eos_token_ids) == \
        ("Qwen3ForCausalLM", 3, 4, 2, 32, 64, 512, 1024, (2,))
    assert info.kv_cache_bytes_per_token == 2 * 3 * 2 * 32 * 4


def test_tied_embeddings_share_one_tensor(tiny_qwen3_dir, tiny_llama_dir):
    tied, _ = load(tiny_qwen3_dir)
    untied, _ = load(tiny_llama_dir)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_sharded_checkpoint_loads_like_one_file(tiny_llama_dir, tmp_path):
    load_hf(tiny_llama_dir).save_pretrained(tmp_path, max_shard_size="50KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    ids = list(range(3, 40))
    sharded, one_file = load(str(tmp_path)), load(tiny_llama_dir)
    assert torch.equal(prefill_logits(*sharded, ids), prefill_logits(*one_file, ids))


def test_legacy_rope_scaling_spelling_is_understood():
    # Checkpoints saved before transformers 5 (all real Llama 3.x ones) say rope_theta + rope_scaling.
    legacy = {"rope_theta": LLAMA3_ROPE["rope_theta"],
              "rope_scaling": {"type" if k == "rope_type" else k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}}
    new = {"rope_parameters": LLAMA3_ROPE}
    assert torch.equal(inverse_frequencies(16, rope_parameters(legacy)), inverse_frequencies(16, rope_parameters(new)))
    assert not torch.equal(inverse_frequencies(16, rope_parameters(new)),
                           inverse_frequencies(16, rope_parameters({"rope_theta": 10000.0})))


def test_unknown_architecture_and_missing_weights_are_refused(tiny_llama_dir, tmp_path):
    with open(os.path.join(tiny_llama_dir, "config.json")) as f:
        config = json.load(f)
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes(open(os.path.join(tiny_llama_dir, name), "rb").read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="not supported"):
        load(str(tmp_path))
    # One more layer than the checkpoint has: its parameters stay unloaded.
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    with pytest.raises(ValueError, match="not .*loaded"):
        load(str(tmp_path))


def test_build_tiny_model_is_deterministic(tmp_path):
    a = build_tiny_model("Qwen2ForCausalLM", tmp_path / "a", seed=5)
    b = build_tiny_model("Qwen2ForCausalLM", tmp_path / "b", seed=5)
    assert (open(os.path.join(a, "model.safetensors"), "rb").read()
            == open(os.path.join(b, "model.safetensors"), "rb").read())
