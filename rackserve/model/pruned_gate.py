"""The pruned gate ("pruned"; the seeds' MegaGate): exact router logits only for the experts that can
still make a token's top-k, found with a cheap bound; the plain gate's experts and weights.

Bound. A bfloat16 copy Ŵ of the gate weight is kept (half the bytes of the float32 weight, and
bf16 matmuls run on AMX / tensor cores). The input is split exactly into two bfloat16 halves and a
rest, x = x1 + x2 + r, and one bf16 GEMM over [x1; x2] (the weight read once) gives h1 = Ŵx1 and
h2 = Ŵx2, each accumulated in float32 and rounded to bf16. The plain gate's float32 logit of
expert e then provably lies in [h1 + h2 - eps, h1 + h2 + eps], with (|.| the 2-norm)

    eps = |W_e - Ŵ_e| |x|                        the weight's rounding to bf16
        + |Ŵ_e| |r|,  |r| <= 2^-16 |x|           the input's, after two halves of 8 bits each
        + g |Ŵ_e| (|x1| + |x2|)  +  2^-7 (|h1| + |h2|)     float32 accumulation, bf16 output
        + g |W_e| |x|                            the plain gate's own float32 rounding
        + flush-to-zero and underflow terms of 2^-126 each

where g = H u / (1 - H u), u = 2^-24, covers any summation order. Only |x| is computed per token
(one float32 norm, rounded up); the rest is per expert, precomputed. This assumes what torch's
defaults give: bf16 matmuls accumulate in float32 and float32 matmuls run at full precision;
`_check_matmul_precision` refuses settings that break it.

Pruning. Scores are monotone in logits, so the bounds carry over (widened by 2^-20 for the float32
rounding of sigmoid and the bias add). An expert is dropped only when k others' lower bounds
exceed its upper bound, so it cannot be in the top-k whatever its logit; with groups, a group is
dropped when topk_groups others' lower-bound scores exceed its upper-bound score, and the
survivors' two best experts are scored exactly first to choose the groups as the plain gate does.

Exactness. The final choice uses float32 logits of the survivors (gate.sampled_logits), ranked
with the plain gate's rules and tie order. Those logits can differ from the plain gate's GEMM in
the last bits (another summation order), so the two gates can choose differently only where two
experts' scores agree to that rounding, where either choice is a correct top-k; tests check
exactly this. Both gates compute the weights of their choice with gate.chosen_logits, so equal
choices have bitwise equal weights. Softmax routing without norm_topk_prob needs every logit for
its weights and is refused. This file must never change what is selected: every shortcut must
keep the plain gate's choice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rackserve.model.gate import (Gate, Routing, RoutingConfig, choice_scores, chosen_logits, expert_mask_of_groups,
                                    group_scores, register_gate, sampled_logits, topk_lowest_first,
                                    weights_from_logits)

_WIDEN = 2.0 ** -20


@register_gate("pruned")
class PrunedGate(Gate):

    def __init__(self, cfg: RoutingConfig):
        assert cfg.scoring == "sigmoid" or cfg.norm_topk_prob, \
            "the pruned gate needs weights that depend on the chosen experts only (softmax needs norm_topk_prob)"
        super().__init__(cfg)

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w = weight.detach().float()
        self.bound_weight = w.to(torch.bfloat16)
        w64, b64 = w.double(), self.bound_weight.double()
        h = w.shape[1]
        gamma = h * 2.0 ** -24 / (1 - h * 2.0 ** -24)
        self.gamma = gamma
        # eps = |x| * per_norm + 2^-7 (|h1| + |h2|) + tiny: the terms that scale with |x| are
        # per expert (|x1| + |x2| <= (1 + 2^-6) |x| and |r| <= 2^-16 |x|: bf16 keeps 8 bits).
        self.per_norm = ((w64 - b64).norm(dim=1) + b64.norm(dim=1) * (2.0 ** -16 + gamma * (1 + 2.0 ** -6))
                         + gamma * w64.norm(dim=1))
        # Flushed to zero or underflowed (AMX flushes denormals): 2^-126 at most per input element,
        # product and output.
        self.tiny = (b64.norm(dim=1) * h ** 0.5 + h + 2) * 2.0 ** -126

    def select(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Routing:
        return self.route(x, weight, bias)[0]

    def route(self, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> tuple[Routing, torch.Tensor]:
        """The routing, and [T] how many experts each token's logits were computed exactly for."""
        cfg, t = self.cfg, x.shape[0]
        lo, hi = self.score_bounds(x, bias)
        logits = torch.full((t, cfg.num_experts), float("nan"), device=x.device)
        scored = torch.zeros(t, cfg.num_experts, dtype=torch.bool, device=x.device)
        in_groups = torch.ones_like(scored)
        if cfg.num_groups > 1:
            g, per = cfg.num_groups, cfg.num_experts // cfg.num_groups
            lo_g, hi_g = lo.view(t, g, per), hi.view(t, g, per)
            group_lo, group_hi = lo_g.topk(2, dim=-1).values.sum(-1), hi_g.topk(2, dim=-1).values.sum(-1)
            # Out for sure: topk_groups others are better. In for sure: better than all but at most
            # topk_groups - 1 others can be. Only the groups in between need their exact score.
            out = group_hi < group_lo.topk(cfg.topk_groups, dim=-1).values[:, -1:]
            sure = group_lo > group_hi.topk(cfg.topk_groups + 1, dim=-1).values[:, -1:]
            undecided = ~out & ~sure
            # Within such a group, only experts that can be among its best two set its score.
            second_lo = lo_g.topk(2, dim=-1).values[..., 1:]
            self._score(x, weight, (undecided.unsqueeze(-1) & (hi_g >= second_lo)).view(t, cfg.num_experts), logits, scored)
            exact = choice_scores(cfg, logits, bias).masked_fill(~scored, float("-inf"))
            groups = group_scores(cfg, exact).masked_fill(out, float("-inf")).masked_fill(sure, float("inf"))
            in_groups = expert_mask_of_groups(cfg, topk_lowest_first(groups, cfg.topk_groups))
        kth_lo = lo.masked_fill(~in_groups, float("-inf")).topk(cfg.top_k, dim=-1).values[:, -1:]
        self._score(x, weight, in_groups & (hi >= kth_lo) & ~scored, logits, scored)
        exact = choice_scores(cfg, logits, bias).masked_fill(~(scored & in_groups), float("-inf"))
        ids = topk_lowest_first(exact, cfg.top_k)
        return Routing(ids, weights_from_logits(cfg, chosen_logits(x, weight, ids))), scored.sum(1)

    def score_bounds(self, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, E] float64 lower and upper bounds of the plain gate's choice scores."""
        _check_matmul_precision(x.device)
        t = x.shape[0]
        # x = x1 + x2 + r, the two bf16 halves stacked so that one GEMM reads the weight once.
        halves_in = torch.empty(2 * t, x.shape[1], dtype=torch.bfloat16, device=x.device)
        halves_in[:t] = x
        halves_in[t:] = x - halves_in[:t]                   # exact in float32
        halves = F.linear(halves_in, self.bound_weight).double()
        # |x| in float32, rounded up past its own summation error.
        x_norm = x.norm(dim=1, keepdim=True).double() * (1 + 2 * self.gamma)
        eps = x_norm * self.per_norm + 2.0 ** -7 * (halves[:t].abs() + halves[t:].abs())
        eps = eps * (1 + _WIDEN) + self.tiny                # float64 rounding of the sums here
        b = halves[:t] + halves[t:]
        lo, hi = b - eps, b + eps
        if self.cfg.scoring == "softmax":
            return lo, hi
        lo, hi = lo.sigmoid(), hi.sigmoid()
        if bias is not None:
            lo, hi = lo + bias.double(), hi + bias.double()
        return lo - _WIDEN * (lo.abs() + 1), hi + _WIDEN * (hi.abs() + 1)

    @staticmethod
    def _score(x: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor, logits: torch.Tensor,
               scored: torch.Tensor) -> None:
        """Compute the float32 logits of the masked (token, expert) pairs into `logits`."""
        logits[mask] = sampled_logits(x, weight, mask)
        scored |= mask


def _check_matmul_precision(device: torch.device) -> None:
    if device.type == "cuda":
        assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction, \
            "the pruned gate's bound needs float32 accumulation of bf16 matmuls: set " \
            "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False"
    assert torch.get_float32_matmul_precision() == "highest", \
        "the pruned gate's bound needs full-precision float32 matmuls in the plain gate"
