"""MoE models against HF transformers in float32 (Qwen3-MoE; DeepSeek-V3 with MLA, in two config
variants): logits at every position of one prefill, and of the same sequence fed as chunks over
cached context and single-token decodes through the paged cache; plus which layers are sparse,
the latent cache's size, checkpoint tensors that are skipped, and the MoE layer's expert-parallel
seam (experts split over placements add up to the whole layer), and the pruned gate in a model.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from rackserve.config import ModelConfig
from rackserve.distributed.parallel_state import ParallelGroups
from rackserve.model.attention import CommonAttentionMetadata, bind_kv_cache, get_attn_backend, model_kv_cache_spec
from rackserve.model.layers import silu_and_mul
from rackserve.model.loader import ModelInfo, load_model, read_hf_config, safetensors_weights
from rackserve.model.models import get_model_class
from rackserve.model.moe import DispatchedTokens, ExpertPlacement, FusedMoE
from rackserve.model.rotary import inverse_frequencies, rope_attention_factor, rope_parameters
from rackserve.model.gate import MoEGate, Routing, get_gate
from tests.tiny_models import load_hf

BS = 4
MOE_FIXTURES = ["tiny_qwen3_moe_dir", "tiny_deepseek_v3_dir", "tiny_deepseek_v3_nolora_dir"]


def load(path: str) -> tuple[nn.Module, ModelInfo]:
    return load_model(ModelConfig(path, "tiny", path, "float32", "cpu", None, 0))


def incremental_logits(model: nn.Module, info: ModelInfo, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits at every position, the sequence fed as `chunks` (sizes) one step each, each step
    attending to the cache the earlier ones wrote; blocks in shuffled order."""
    spec = model_kv_cache_spec(model)
    num_blocks = -(-len(ids) // BS) + 3
    bind_kv_cache(model, [tuple(torch.zeros(spec.num_tensors, *spec.cache_shape(num_blocks, BS)))
                          for _ in range(info.num_layers)])
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    backend = get_attn_backend("torch", use_mla=spec.use_mla)
    out, start = [], 0
    for n in chunks:
        pos = list(range(start, start + n))
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in pos])
        meta = backend.build_metadata(CommonAttentionMetadata([n], [start], [table], slots, BS), torch.device("cpu"))
        with torch.inference_mode():
            out.append(model.compute_logits(model(torch.tensor(ids[start:start + n]), torch.tensor(pos), meta)))
        start += n
    assert start == len(ids)
    return torch.cat(out)


def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return load_hf(path)(torch.tensor([ids])).logits[0]


def random_ids(n: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def assert_parity(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("fixture", MOE_FIXTURES)
def test_prefill_logits_match_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    ids = random_ids(150)
    model, info = load(path)
    assert_parity(incremental_logits(model, info, ids, [len(ids)]), hf_logits(path, ids))


@pytest.mark.parametrize("fixture", MOE_FIXTURES)
def test_chunks_and_decodes_match_transformers(fixture, request):
    # Fresh prefill, chunks over cached context (MLA: latent expanded) and decodes (MLA: kv_b_proj
    # absorbed into query and output), all against one full-sequence reference.
    path = request.getfixturevalue(fixture)
    ids = random_ids(60)
    model, info = load(path)
    chunks = [13, 1, 1, 9, 1, 22, 1, 1, 1, 10]
    assert_parity(incremental_logits(model, info, ids, chunks), hf_logits(path, ids))


def test_mla_caches_only_the_latent(tiny_deepseek_v3_dir, tiny_qwen3_moe_dir):
    model, info = load(tiny_deepseek_v3_dir)
    spec = model_kv_cache_spec(model)
    assert (spec.num_tensors, spec.num_kv_heads, spec.head_size, spec.use_mla) == (1, 1, 32 + 16, True)
    assert info.kv_cache_spec == spec
    assert info.kv_cache_bytes_per_token == 3 * (32 + 16) * 4      # layers * (kv_lora_rank + rope) * fp32
    model, info = load(tiny_qwen3_moe_dir)
    assert model_kv_cache_spec(model) == info.kv_cache_spec
    assert info.kv_cache_bytes_per_token == 3 * 2 * 2 * 32 * 4      # layers * (K, V) * kv heads * head_dim


def sparse_layers(config: dict) -> list[int]:
    with torch.device("meta"):
        model = get_model_class(config["architectures"][0])(config, "torch", 16, ParallelGroups.single())
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def test_sparse_layers_follow_the_config(tiny_qwen3_moe_dir, tiny_deepseek_v3_dir):
    qwen = read_hf_config(tiny_qwen3_moe_dir)
    assert sparse_layers(qwen) == [0, 2]                               # mlp_only_layers=[1]
    assert sparse_layers({**qwen, "mlp_only_layers": [], "decoder_sparse_step": 2}) == [1]
    deepseek = read_hf_config(tiny_deepseek_v3_dir)
    assert sparse_layers(deepseek) == [1, 2]                           # first_k_dense_replace=1
    assert sparse_layers({**deepseek, "num_hidden_layers": 5, "moe_layer_freq": 2}) == [2, 4]


def test_prediction_layer_tensors_are_skipped(tiny_deepseek_v3_dir):
    # Real DeepSeek-V3 checkpoints carry their multi-token-prediction layer as layer 61 of 61.
    model, _ = load(tiny_deepseek_v3_dir)
    weights = list(safetensors_weights(tiny_deepseek_v3_dir))
    model.load_weights(weights + [("model.layers.3.eh_proj.weight", torch.zeros(64, 128))])
    with pytest.raises(KeyError, match="has no parameter"):
        model.load_weights(weights + [("model.layers.2.eh_proj.weight", torch.zeros(64, 128))])


def test_missing_expert_tensor_is_refused(tiny_qwen3_moe_dir):
    model, _ = load(tiny_qwen3_moe_dir)
    dropped = "model.layers.2.mlp.experts.5.up_proj.weight"
    weights = [(n, t) for n, t in safetensors_weights(tiny_qwen3_moe_dir) if n != dropped]
    with pytest.raises(ValueError, match=r"layers.2.mlp.experts.w13_weight.*\(5, 'w3'\)"):
        model.load_weights(weights)


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_moe_dir"])
def test_missing_stacked_shard_is_refused(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    model, _ = load(model_dir)
    dropped = "model.layers.1.self_attn.k_proj.weight"
    weights = [(n, t) for n, t in safetensors_weights(model_dir) if n != dropped]
    assert len(weights) == len(list(safetensors_weights(model_dir))) - 1
    with pytest.raises(ValueError, match=r"layers.1.self_attn.qkv_proj.weight.*\['k'\] missing of 3"):
        model.load_weights(weights)


def naive_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              experts: range) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t]):
            if e in experts:
                out[t] += w * (w2[e] @ silu_and_mul(w13[e] @ x[t]))
    return out


def test_experts_split_over_placements_add_up_to_the_layer():
    g = torch.Generator().manual_seed(0)
    num_experts, hidden, inter, tokens = 8, 16, 12, 40
    w13 = 0.3 * torch.randn(num_experts, 2 * inter, hidden, generator=g)
    w2 = 0.3 * torch.randn(num_experts, hidden, inter, generator=g)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:3] for _ in range(tokens)])
    ids[:, 0] = 6                                                    # one busy expert; some stay idle
    routing = Routing(ids, torch.rand(tokens, 3, generator=g))
    outputs = []
    for placement in (ExpertPlacement.all_local(8), ExpertPlacement(8, 0, 5), ExpertPlacement(8, 5, 3)):
        held = range(placement.first, placement.first + placement.num_local)
        layer = FusedMoE(num_experts, hidden, inter, placement=placement)
        layer.w13_weight.data.copy_(w13[held.start:held.stop])
        layer.w2_weight.data.copy_(w2[held.start:held.stop])
        outputs.append(layer(x, routing))
        want = naive_moe(x, ids, routing.topk_weights, w13, w2, held)
        torch.testing.assert_close(outputs[-1], want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(outputs[1] + outputs[2], outputs[0], atol=1e-5, rtol=1e-4)


def test_tokens_of_no_local_expert_get_zero():
    layer = FusedMoE(4, 8, 6, placement=ExpertPlacement(4, 2, 2))
    layer.w13_weight.data.normal_()
    layer.w2_weight.data.normal_()
    tokens = DispatchedTokens(torch.randn(3, 8), torch.tensor([[-1, -1], [0, -1], [1, 0]]), torch.ones(3, 2), None)
    out = layer.backend.apply(tokens, layer.w13_weight, layer.w2_weight)
    assert torch.equal(out[0], torch.zeros(8)) and out[1].abs().sum() > 0


def test_both_spellings_of_the_expert_count_are_read(tiny_qwen3_moe_dir):
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts; real checkpoints say
    # num_experts. Both spellings must build the same model.
    with open(os.path.join(tiny_qwen3_moe_dir, "config.json")) as f:
        config = json.load(f)
    renamed = {k: v for k, v in config.items() if k != "num_local_experts"}
    renamed["num_experts"] = config["num_local_experts"]
    assert sparse_layers(renamed) == sparse_layers(config) == [0, 2]


@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe_dir", "tiny_deepseek_v3_dir"])
def test_pruned_gate_leaves_the_logits_unchanged(fixture, request):
    path = request.getfixturevalue(fixture)
    model, info = load(path)
    ids = random_ids(80)
    plain = incremental_logits(model, info, ids, [50, 1, 1, 28])
    routers = [m for m in model.modules() if isinstance(m, MoEGate)]
    assert routers
    for router in routers:
        router.gate = get_gate("pruned")(router.cfg)
        router.process_weights_after_loading()
    assert torch.equal(incremental_logits(model, info, ids, [50, 1, 1, 28]), plain)


def test_unknown_moe_backend_is_refused():
    with pytest.raises(ValueError, match="unknown MoE backend"):
        FusedMoE(4, 8, 6, backend="no-such-backend")


def test_yarn_matches_transformers_on_deepseek_v3s_own_rope():
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from rackserve.model.models.deepseek_v3 import DeepseekV3Attention
    # DeepSeek-V3's config.json (old spelling): 4K tokens stretched 40x to 160K.
    scaling = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    config = transformers.DeepseekV3Config(rope_parameters={**scaling, "rope_type": "yarn", "rope_theta": 10000.0},
                                           max_position_embeddings=163840)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    params = rope_parameters({"rope_scaling": scaling, "rope_theta": 10000.0})
    torch.testing.assert_close(inverse_frequencies(64, params), inv_freq)
    assert rope_attention_factor(params) == pytest.approx(attention_factor)
    with torch.device("meta"):
        attn = DeepseekV3Attention({**config.to_dict(), "rope_scaling": scaling}, "torch")
    assert attn.mla_attn.impl.scale == pytest.approx(yarn_apply_mscale(config.rope_parameters, 192 ** -0.5))
