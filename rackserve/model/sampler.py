"""Sampler: turns one step's logits into one token per request, with vLLM v1's semantics.

Order: logit_bias, penalties (repetition over prompt + output, presence and frequency over output,
read from the runner's PenaltyRows: model/penalties.py), then greedy rows take the argmax; random
rows apply temperature, min_p, top_k, top_p and draw by the exponential race (argmax of probs /
Exponential(1) noise). A seeded request draws its noise from its own generator, so its tokens do
not depend on what else is in the batch. Logprobs come from the raw logits (before penalties and
temperature), as vLLM's default "raw_logprobs".

This file owns the sampling math, vectorised over rows. It must never touch the KV cache, the
scheduler or request state beyond what a SamplingRow carries (and the penalty rows it names, which
it only reads), and never mutate the caller's logits. A failure while sampling one row fails that
row alone (`sample_isolating_failures`): the engine ends that request with an error and every
other request in the batch gets its token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rackserve.core.outputs import LogprobsLists
from rackserve.model.penalties import PenaltyRows, has_penalties
from rackserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None   # the request's own (on the logits' device) when params.seed is set
    penalty_row: int | None = None      # the request's row in the PenaltyRows, when it has penalties


@dataclass
class SamplerOutput:
    token_ids: list[int]                        # one per row
    logprobs: list[LogprobsLists | None]        # None where params.logprobs is None


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device)   # for rows without a seed of their own
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 penalties: PenaltyRows | None = None) -> SamplerOutput:
        """`penalties`: the pool that rows with penalties name their rows in."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one row of logits per request"
        assert logits.dtype == torch.float32, "the sampler works on fp32 logits"
        params = [row.params for row in rows]
        want_logprobs = any(p.logprobs is not None for p in params)
        penalized = [i for i, p in enumerate(params) if has_penalties(p)]
        biased = any(p.logit_bias for p in params)
        if not penalized and not biased and not want_logprobs and all(p.greedy for p in params):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(rows))

        raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
        if biased:
            logits = apply_logit_bias(logits, params)
        if penalized:
            pool_rows = [rows[i].penalty_row for i in penalized]
            if penalties is None or None in pool_rows:
                raise ValueError("a request with penalties has no penalty row")
            logits = penalties.apply(logits, penalized, pool_rows, [params[i] for i in penalized])
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(random_rows) == len(rows):
            token_ids = self._sample(logits, rows)
        else:
            token_ids = logits.argmax(dim=-1)
            if random_rows:
                index = torch.tensor(random_rows, device=logits.device)
                token_ids[index] = self._sample(logits[index], [rows[i] for i in random_rows])
        logprobs = (compute_logprobs(raw_logprobs, token_ids, params) if raw_logprobs is not None
                    else [None] * len(rows))
        return SamplerOutput(token_ids.tolist(), logprobs)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Random rows only: temperature, min_p, top_k, top_p, then the exponential race."""
        params = [row.params for row in rows]
        device = logits.device
        logits = logits / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        if any(p.min_p > 0 for p in params):
            logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
        vocab = logits.shape[1]
        # A top_k of the whole vocabulary or more filters nothing (vLLM clamps it alike); rows
        # without filters pass through. `logits` is this method's own (divided above): masked in place.
        if any(0 < p.top_k < vocab or p.top_p < 1 for p in params):
            logits = apply_top_k_top_p(logits, [p.top_k for p in params], [p.top_p for p in params],
                                       inplace=True)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        if any(row.generator is None for row in rows):
            noise.uniform_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].uniform_(generator=row.generator)
        # -log(U) is Exponential(1), drawn ~3x faster than exponential_ on CPU; U < 1, so
        # the noise is never 0 and a masked token never becomes 0 / 0.
        noise.log_().neg_()
        return probs.div_(noise).argmax(dim=-1)


def nonfinite_rows(logits: torch.Tensor) -> list[int]:
    """The rows of `logits` that hold a NaN or an infinity. On CPU, one single-threaded numpy sum
    per row (finite unless a logit is not, or finite logits overflow float32, which the exact check
    of that row then clears): torch's isfinite and all open two parallel regions a step, which
    took 0.4-0.8 ms at batch 1 while serving (3% of the engine thread at c=1, measured by py-spy)
    whenever a peer thread was preempted on shared cores."""
    if logits.device.type != "cpu":
        return (~torch.isfinite(logits).all(dim=-1)).nonzero().flatten().tolist()
    rows = logits.detach().numpy()
    with np.errstate(over="ignore", invalid="ignore"):     # what a bad row's sum does: no warning
        suspects = np.flatnonzero(~np.isfinite(rows.sum(axis=-1))).tolist()
    return [i for i in suspects if not np.isfinite(rows[i]).all()]


def sample_isolating_failures(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow],
                              penalties: PenaltyRows | None = None,
                              failed: dict[int, str] | None = None) -> tuple[SamplerOutput, dict[int, str]]:
    """Sample every row; a row that cannot be sampled (non-finite logits, or an error while
    sampling it) gets token -1 and a reason in the returned {row index: reason}, the others their
    tokens as if sampled together. Deterministic, so every TP rank fails the same rows. `failed`:
    rows the caller already knows cannot be sampled, with their reasons."""
    failed = {**{i: "the model produced non-finite logits for this request" for i in nonfinite_rows(logits)},
              **(failed or {})}
    good = [i for i in range(len(rows)) if i not in failed]
    token_ids: list[int] = [-1] * len(rows)
    logprobs: list[LogprobsLists | None] = [None] * len(rows)
    try:   # the whole batch at once (no copy of the logits when every row is good)
        batch_logits = logits if len(good) == len(rows) else logits[good]
        attempt = [(good, sampler(batch_logits, [rows[i] for i in good], penalties))] if good else []
    except Exception:   # noqa: BLE001 - find the rows at fault: sample them one by one
        attempt = []
        for i in good:
            try:
                attempt.append(([i], sampler(logits[i:i + 1], [rows[i]], penalties)))
            except Exception as e:  # noqa: BLE001 - that row's request fails, not the step
                failed[i] = f"sampling failed: {type(e).__name__}: {e}"
    for group, out in attempt:
        for j, i in enumerate(group):
            token_ids[i], logprobs[i] = out.token_ids[j], out.logprobs[j]
    vocab = logits.shape[1]
    for i, t in enumerate(token_ids):
        if i not in failed and not 0 <= t < vocab:
            failed[i] = f"sampling produced token id {t}, outside the vocabulary"
    return SamplerOutput(token_ids, logprobs), failed


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """A new tensor with each row's logit_bias added (OpenAI's logit_bias; ids checked upstream)."""
    logits = logits.clone()
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            logits[i].index_add_(0, ids, bias)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


# Each row's kept set is looked for among its 1,024 largest logits (sorted); the rows whose set
# may reach past them (a flat distribution under top_p, a larger top_k), and only those, look
# among their 8,192 largest, then sort their whole row. (128 rows of 49,152 with top_p sets of
# ~2,000 tokens: 125 ms, against 555 ms for the batch sorted whole; bench/sampler_step.py.)
_WINDOWS = (1024, 8192)
# On CPU, numpy's partition then a sort of the window only beat torch.topk 2.5-3x (128 rows:
# 15 against 47 ms at 49,152, 37 against 92 ms at 129,280, on a loaded Zen 1); other devices
# use torch.topk.
_NUMPY_ON_CPU = True


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                      inplace: bool = False) -> torch.Tensor:
    """Keep each row's top_k logits (ties with the k-th kept), then the fewest of those, most
    likely first, whose probability reaches top_p (renormalised after top_k, as vLLM does), and
    ties with the last kept. A row with top_k 0/-1/>= vocab and top_p 1 keeps everything.
    `inplace`: mask `logits` itself (a caller that owns it); otherwise a new tensor."""
    rows, vocab = logits.shape
    device = logits.device
    k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)
    p = torch.tensor([p if p < 1 else float("inf") for p in top_p], dtype=torch.float64, device=device)
    cutoff = torch.full((rows,), float("-inf"), dtype=logits.dtype, device=device)
    todo = ((k < vocab) | (p < 1)).nonzero().flatten()
    whole = todo[:0]                        # rows the next window cannot decide either
    widths = sorted({min(vocab, w) for w in (*_WINDOWS, vocab)})
    for width, wider in zip(widths, widths[1:] + [vocab]):
        if width == vocab:
            todo = torch.cat([todo, whole]).sort().values   # ascending: all rows are 0..rows-1
        if len(todo):
            found, decided, mass, last = _cutoffs(logits, todo, _largest(logits, todo, width), k[todo], p[todo])
            cutoff[todo[decided]] = found[decided].to(logits.dtype)
            if wider < vocab:               # its tokens are no likelier than the last here
                kk = k[todo]
                hopeless = torch.where(kk < vocab, kk > wider, mass + (wider - width) * last < p[todo])
                whole = torch.cat([whole, todo[~decided & hopeless]])
                decided |= hopeless
            todo = todo[~decided]
    assert not len(todo), "the whole vocabulary always holds the kept set"
    out = logits if inplace else logits.clone()
    return out.masked_fill_(out < cutoff.unsqueeze(1), float("-inf"))


def _largest(logits: torch.Tensor, rows: torch.Tensor, width: int) -> torch.Tensor:
    """[len(rows), width] float64: those rows' `width` largest logits, descending. `rows` ascend."""
    vocab = logits.shape[1]
    if logits.device.type == "cpu" and _NUMPY_ON_CPU:
        x = logits.detach().numpy()
        x = x if len(rows) == len(x) else x[rows.numpy()]
        top = np.partition(x, vocab - width, axis=1)[:, vocab - width:] if width < vocab else x.copy()
        top.sort(axis=1)
        return torch.from_numpy(np.ascontiguousarray(top[:, ::-1], dtype=np.float64))
    x = logits[rows]
    top = x.topk(width, dim=-1).values if width < vocab else x.sort(dim=-1, descending=True).values
    return top.double()


def _cutoffs(logits: torch.Tensor, rows: torch.Tensor, desc: torch.Tensor, k: torch.Tensor,
             p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each of `rows`' smallest kept logit, found among its `width` largest `desc` (float64,
    descending), whether it was decided there (not when the row may keep tokens past them), and
    (for rows without top_k) the probability of those `width` tokens and of the last of them."""
    width, vocab = desc.shape[1], logits.shape[1]
    has_k = k < vocab
    past = has_k & (k > width)              # its k-th largest is not among them
    kth = desc.gather(1, (k.clamp(max=width) - 1).unsqueeze(1))
    if bool(has_k.any()):                   # `desc` is _largest's own
        desc.masked_fill_((desc < kth) & has_k.unsqueeze(1), float("-inf"))
    top = desc[:, :1]                       # each row's max, exactly
    cum = desc.sub(top).exp_().cumsum_(dim=-1)   # mass relative to the max's, down the window
    # top_p's total: what top_k kept (in the window, but for ties past it), or the whole row.
    total = cum[:, -1].clone()
    if width < vocab:
        no_k = ~has_k
        if bool(no_k.any()):
            x = logits if bool(no_k.all()) and len(rows) == logits.shape[0] else logits[rows[no_k]]
            total[no_k] = (x - top[no_k].to(x.dtype)).exp_().sum(dim=-1).double()   # float32 sums
        # Ties with the k-th past the window: top_k keeps them, so they count in the total.
        edge = has_k & ~past & (desc[:, -1] == kth[:, 0])
        if bool(edge.any()):
            value = kth[edge]
            extra = ((logits[rows[edge]] == value.to(logits.dtype)).sum(dim=-1)
                     - (desc[edge] == value).sum(dim=-1))
            total[edge] += extra.double() * (value[:, 0] - top[edge, 0]).exp()
    # Token j's mass above it is cum[j - 1]: kept are the first 1 + #(cum[:-1] < p * total),
    # finite ones at most. At least the most likely token stays: a top_p too small to cover even
    # it keeps that one token, as vLLM does.
    kept = torch.searchsorted(cum, (p * total).unsqueeze(1)).squeeze(1).clamp(max=width - 1) + 1
    if bool(torch.isinf(p).any()) or bool((desc[:, -1] == float("-inf")).any()):
        kept = torch.minimum(kept, (desc > float("-inf")).sum(dim=-1))
    kept = kept.clamp(min=1)
    decided = ~past & (has_k | (kept < width) | (width == vocab))
    last = cum[:, -1] - cum[:, -2] if width > 1 else cum[:, -1]
    return desc.gather(1, (kept - 1).unsqueeze(1))[:, 0], decided, cum[:, -1] / total, last / total


def compute_logprobs(raw_logprobs: torch.Tensor, token_ids: torch.Tensor,
                     params: list[SamplingParams]) -> list[LogprobsLists | None]:
    """The sampled token's logprob and rank (1 = most likely; ties count ahead, as vLLM) and the
    top k = params.logprobs, for the rows that asked, tied values by token id (the one greedy's
    argmax takes first: bf16 logits tie often, and topk orders ties as it likes)."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    index = torch.tensor(rows, device=raw_logprobs.device)
    logprobs = raw_logprobs[index]
    sampled = logprobs.gather(1, token_ids[index].unsqueeze(1))
    ranks = (logprobs >= sampled).sum(dim=-1).tolist()
    sampled_list = sampled.squeeze(1).tolist()
    k_max = max(params[i].logprobs for i in rows)
    top_values, top_ids = logprobs.topk(k_max, dim=-1)
    ks = torch.tensor([params[i].logprobs for i in rows], device=logprobs.device)
    crossing = [False] * len(rows)
    if k_max:
        last = top_values.gather(1, (ks - 1).clamp(min=0).unsqueeze(1))     # each row's k-th value
        crossing = ((logprobs >= last).sum(dim=-1) > ks).tolist()           # ties past its k-th: topk chose among them
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out: list[LogprobsLists | None] = [None] * len(params)
    for j, i in enumerate(rows):
        k = params[i].logprobs
        top = list(zip(top_values[j][:k], top_ids[j][:k]))
        if k and crossing[j]:
            above = [(v, t) for v, t in top if v > top[-1][0]]
            tied = (logprobs[j] == top[-1][0]).nonzero()[:k - len(above), 0].tolist()   # the lowest ids
            top = above + [(top[-1][0], t) for t in tied]
        top.sort(key=lambda pair: (-pair[0], pair[1]))
        out[i] = LogprobsLists(sampled_list[j], ranks[j], [t for _, t in top], [v for v, _ in top])
    return out
