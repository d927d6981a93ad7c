"""MoE routing: the plain gate against transformers' own routers (Qwen3-MoE softmax top-k,
DeepSeek-V3 sigmoid + correction bias + groups), and the pruned gate (MegaGate) against the plain
gate on many-expert configs: its bound always holds, it chooses the same experts with the same
weights (up to the rounding of the router's dot products), ties go to the lower id in both, and it
scores far fewer experts than there are; both route an empty batch.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from rackserve.model.pruned_gate import PrunedGate
from rackserve.model.gate import PlainGate, MoEGate, Routing, RoutingConfig, choice_scores

QWEN = RoutingConfig(128, 8, "softmax", norm_topk_prob=True)
DEEPSEEK = RoutingConfig(256, 8, "sigmoid", True, num_groups=8, topk_groups=4, routed_scaling_factor=2.5,
                         use_correction_bias=True)
CONFIGS = {
    "qwen3_128x8": QWEN,
    "deepseek_256x8_groups": DEEPSEEK,
    "sigmoid_384x6": RoutingConfig(384, 6, "sigmoid", True, use_correction_bias=True),
    "sigmoid_64x4_unnormalised": RoutingConfig(64, 4, "sigmoid", False, num_groups=4, topk_groups=2),
}


def random_router(cfg: RoutingConfig, hidden: int, gate: str, seed: int = 0) -> MoEGate:
    g = torch.Generator().manual_seed(seed)
    router = MoEGate(hidden, cfg, gate)
    router.weight.data.copy_(torch.randn(cfg.num_experts, hidden, generator=g) * 0.05)
    if router.e_score_correction_bias is not None:
        router.e_score_correction_bias.data.copy_(torch.randn(cfg.num_experts, generator=g) * 0.05)
    router.process_weights_after_loading()
    return router


def pruned_like(plain: MoEGate) -> MoEGate:
    pruned = MoEGate(plain.weight.shape[1], plain.cfg, "pruned")
    pruned.load_state_dict(plain.state_dict())
    pruned.process_weights_after_loading()
    return pruned


def assert_same_routing(plain: MoEGate, x: torch.Tensor, got: Routing) -> int:
    """The same experts (as sets) with bitwise equal weights, except for tokens where the plain
    gate's k-th and (k+1)-th choice scores agree to float32 rounding (relative to sum |w_i x_i|):
    there either choice is a correct top-k. Returns how many tokens differed."""
    want = plain(x)
    ids_w, order_w = want.topk_ids.sort(-1)
    ids_g, order_g = got.topk_ids.sort(-1)
    differ = (ids_w != ids_g).any(-1)
    if differ.any():
        scores = choice_scores(plain.cfg, F.linear(x, plain.weight), plain.e_score_correction_bias)
        top = scores.topk(plain.cfg.top_k + 1, dim=-1).values
        rounding = 1e-6 * (1 + F.linear(x.abs(), plain.weight.abs()).max(-1).values)
        assert ((top[:, -2] - top[:, -1]) <= rounding)[differ].all(), "different experts without a near-tie"
    same = ~differ
    assert torch.equal(got.topk_weights.gather(1, order_g)[same], want.topk_weights.gather(1, order_w)[same])
    return int(differ.sum())


def test_plain_gate_matches_qwen3_moe_router():
    config = transformers.Qwen3MoeConfig(hidden_size=64, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
    g = torch.Generator().manual_seed(0)
    ref = Qwen3MoeTopKRouter(config)
    ref.weight.data.normal_(0, 0.1, generator=g)
    ours = MoEGate(64, QWEN)
    ours.weight.data.copy_(ref.weight.data)
    x = torch.randn(200, 64, generator=g)
    _, weights, ids = ref(x)
    got = ours(x)
    assert torch.equal(got.topk_ids.sort(-1).values, ids.sort(-1).values)
    torch.testing.assert_close(got.topk_weights.gather(1, got.topk_ids.argsort(-1)), weights.gather(1, ids.argsort(-1)))


def test_plain_gate_matches_deepseek_v3_router():
    config = transformers.DeepseekV3Config(hidden_size=64, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
                                           topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True)
    g = torch.Generator().manual_seed(0)
    ref = DeepseekV3TopkRouter(config)
    ref.weight.data.normal_(0, 0.1, generator=g)
    ref.e_score_correction_bias.normal_(0, 0.05, generator=g)
    ours = MoEGate(64, DEEPSEEK)
    ours.weight.data.copy_(ref.weight.data)
    ours.e_score_correction_bias.data.copy_(ref.e_score_correction_bias)
    x = torch.randn(200, 64, generator=g)
    _, weights, ids = ref(x)
    got = ours(x)
    assert torch.equal(got.topk_ids.sort(-1).values, ids.sort(-1).values)
    torch.testing.assert_close(got.topk_weights.gather(1, got.topk_ids.argsort(-1)),
                               weights.gather(1, ids.argsort(-1)))
    # The bias steers the choice but is not in the weights.
    no_bias = MoEGate(64, DEEPSEEK)
    no_bias.load_state_dict(ours.state_dict())
    no_bias.e_score_correction_bias.data.zero_()
    assert not torch.equal(no_bias(x).topk_ids.sort(-1).values, got.topk_ids.sort(-1).values)


@pytest.mark.parametrize("hidden", [64, 1024])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_pruned_gate_chooses_what_the_plain_gate_chooses(name, hidden):
    plain = random_router(CONFIGS[name], hidden, "plain")
    pruned = pruned_like(plain)
    x = torch.randn(300, hidden, generator=torch.Generator().manual_seed(1))
    assert assert_same_routing(plain, x, pruned(x)) <= 1


@pytest.mark.parametrize("gate", ["plain", "pruned"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_an_empty_batch_routes_to_nothing(name, gate):
    # An idle DP rank runs its MoE layers on zero tokens, so that the expert-parallel all-to-alls match.
    routing = random_router(CONFIGS[name], 64, gate)(torch.empty(0, 64))
    assert routing.topk_ids.shape == routing.topk_weights.shape == (0, CONFIGS[name].top_k)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bounds_hold_for_hard_inputs(name):
    # Large dynamic range (entries from 1e-30 to 1e4, so bf16 halves and their rest all matter),
    # saturated sigmoids, and exact zeros.
    cfg, hidden = CONFIGS[name], 256
    plain = random_router(cfg, hidden, "plain", seed=1)
    pruned = pruned_like(plain)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, hidden, generator=g) * torch.logspace(-30, 4, hidden)[torch.randperm(hidden, generator=g)]
    x[:8] *= 100.0
    x[8:12] = 0.0
    scores = choice_scores(cfg, torch.nn.functional.linear(x, plain.weight), plain.e_score_correction_bias).double()
    lo, hi = pruned.gate.score_bounds(x, plain.e_score_correction_bias)
    assert ((lo <= scores) & (scores <= hi)).all()
    assert_same_routing(plain, x, pruned(x))


@pytest.mark.parametrize("name", ["qwen3_128x8", "deepseek_256x8_groups"])
def test_ties_go_to_the_lower_expert_in_both_gates(name):
    # Experts 0..num_experts/2 have zero gate rows: their logits are exactly 0 and tie; the inputs
    # are positive and the other rows negative, so all other experts score lower and the top-k is
    # decided among the tied zeros by id alone. With groups every group has tied members.
    cfg, hidden = CONFIGS[name], 32
    plain = random_router(cfg, hidden, "plain")
    w = -plain.weight.data.abs()
    per_group = cfg.num_experts // cfg.num_groups
    tied = torch.arange(cfg.num_experts) % per_group < per_group // 2
    w[tied] = 0.0
    plain.weight.data.copy_(w)
    if plain.e_score_correction_bias is not None:
        plain.e_score_correction_bias.data.zero_()
    pruned = pruned_like(plain)
    x = torch.rand(50, hidden, generator=torch.Generator().manual_seed(1)) + 0.1
    want, got = plain(x), pruned(x)
    assert torch.equal(want.topk_ids, got.topk_ids) and torch.equal(want.topk_weights, got.topk_weights)
    lowest_tied = tied.nonzero()[:, 0][:cfg.top_k] if cfg.num_groups == 1 else \
        tied.view(cfg.num_groups, -1)[:cfg.topk_groups].flatten().nonzero()[:, 0][:cfg.top_k]
    assert torch.equal(want.topk_ids[0].sort().values, lowest_tied)


def test_pruned_gate_scores_few_experts():
    cfg, hidden = CONFIGS["sigmoid_384x6"], 1024
    plain = random_router(cfg, hidden, "plain")
    gate = pruned_like(plain).gate
    assert isinstance(gate, PrunedGate)
    x = torch.randn(100, hidden, generator=torch.Generator().manual_seed(1))
    routing, num_scored = gate.route(x, plain.weight, plain.e_score_correction_bias)
    assert_same_routing(plain, x, routing)
    assert (num_scored >= cfg.top_k).all()
    assert num_scored.float().mean() < 20        # of 384


def test_pruned_gate_refuses_softmax_weights_over_all_experts():
    with pytest.raises(AssertionError, match="norm_topk_prob"):
        MoEGate(16, RoutingConfig(8, 2, "softmax", norm_topk_prob=False), "pruned")


def test_plain_gate_is_a_registered_name():
    assert isinstance(MoEGate(16, QWEN).gate, PlainGate)
    with pytest.raises(ValueError, match="unknown gate"):
        MoEGate(16, QWEN, "no-such-gate")


def test_bench_gate_reports_scored_experts_and_agreement(tmp_path):
    import json

    from rackserve.serve import cli
    out = tmp_path / "gate.json"
    assert cli.main(["bench", "gate", "--presets", "tiny-64x4", "--batch-sizes", "1,16", "--repeats", "1",
                     "--output", str(out)]) == 0
    points = json.loads(out.read_text())["presets"][0]["points"]
    assert [p["batch_size"] for p in points] == [1, 16]
    assert all(p["tokens_with_other_experts"] == 0 and 4 <= p["scored_per_token_mean"] < 64 for p in points)
