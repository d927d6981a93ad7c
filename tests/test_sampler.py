"""The sampler against hand-computed values and against softmax itself: greedy is argmax, the
filters keep what vLLM keeps, penalties move logits by the HF/vLLM formulas, logprobs are the raw
log_softmax with correct ranks, seeded requests are reproducible whatever shares their batch, and
samples follow softmax(logits / T)."""
from __future__ import annotations

import pytest
import torch

from rackserve.model.penalties import PenaltyRows, has_penalties
from rackserve.model.sampler import Sampler, SamplingRow, apply_top_k_top_p, sample_isolating_failures
from rackserve.sampling_params import SamplingParams

CPU = torch.device("cpu")


def row(prompt=(0,), output=(), pool: PenaltyRows | None = None, vocab: int = 64, **kw) -> SamplingRow:
    """A row; one with penalties gets a row of `pool` holding its tokens."""
    params = SamplingParams(**kw)
    gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    penalty_row = pool.add(list(prompt), list(output), vocab) if has_penalties(params) else None
    return SamplingRow(params, gen, penalty_row)


def random_logits(rows: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = random_logits(5)
    out = Sampler(0, CPU)(logits, [row(temperature=0.0) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_sampler_leaves_callers_logits_alone():
    logits = random_logits(3)
    before = logits.clone()
    pool = PenaltyRows(CPU)
    Sampler(0, CPU)(logits, [row(temperature=0.8, top_k=5, min_p=0.1, repetition_penalty=1.3, logprobs=2,
                                 output=[1, 2], pool=pool)] * 3, pool)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_keep_one_token_equal_greedy(kw):
    logits = random_logits(8)
    out = Sampler(0, CPU)(logits, [row(temperature=1.5, **kw) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()


def _sample_counts(logits_row: torch.Tensor, n: int, **kw) -> torch.Tensor:
    """How often each token is drawn in n independent draws (one batch of n identical rows)."""
    out = Sampler(1234, CPU)(logits_row.expand(n, -1).contiguous(), [row(**kw) for _ in range(n)])
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.numel()).float()


def test_samples_follow_softmax_of_logits_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    n = 40_000
    freq = _sample_counts(logits, n, temperature=0.7) / n
    want = torch.softmax(logits / 0.7, dim=-1)
    # Binomial standard error is at most 0.0025 here; 5 sigma.
    assert (freq - want).abs().max() < 0.0125, (freq, want)


def test_top_k_and_top_p_keep_the_expected_tokens():
    logits = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    drawn = _sample_counts(logits, 4000, top_k=3) > 0
    assert drawn.tolist() == [True, True, True, False, False, False]
    # top_p=0.7: 0.4 + 0.25 = 0.65 < 0.7, so the third token is needed too.
    drawn = _sample_counts(logits, 4000, top_p=0.7) > 0
    assert drawn.tolist() == [True, True, True, False, False, False]
    # Both: top_k=2 renormalises to 0.615 / 0.385, and top_p=0.5 then needs only the first.
    drawn = _sample_counts(logits, 4000, top_k=2, top_p=0.5) > 0
    assert drawn.tolist() == [True, False, False, False, False, False]


def _kept_by_definition(logits_row: torch.Tensor, k: int, p: float) -> set[int]:
    """Sort, keep the k most likely, renormalise, keep the fewest reaching mass p."""
    order = logits_row.argsort(descending=True).tolist()
    if k:
        order = order[:k]
    probs = torch.softmax(logits_row[order].double(), dim=0).tolist()
    kept, mass = [], 0.0
    for token, prob in zip(order, probs):
        if mass >= p:
            break
        kept.append(token)
        mass += prob
    return set(kept)


@pytest.mark.parametrize("scale", [4.0, 0.3])     # peaked, and flat enough to need the full sort
def test_top_k_top_p_keep_exactly_the_defined_sets(scale):
    vocab = 2000
    logits = random_logits(6, vocab=vocab, seed=11) / 3 * scale
    top_k = [0, 5, 300, 0, 40, 7]
    top_p = [0.9, 1.0, 0.8, 0.5, 0.95, 0.99]
    out = apply_top_k_top_p(logits, top_k, top_p)
    for i in range(6):
        kept = set(torch.nonzero(out[i] > float("-inf")).flatten().tolist())
        assert kept == _kept_by_definition(logits[i], top_k[i], top_p[i]), i
        assert torch.equal(out[i][list(kept)], logits[i][list(kept)])


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.11, 0.09, 0.06, 0.04]))
    # min_p=0.2: threshold 0.1 -> 0.5, 0.2, 0.11 survive and keep their relative odds.
    counts = _sample_counts(logits, 20_000, min_p=0.2)
    assert (counts > 0).tolist() == [True, True, True, False, False, False]
    freq = counts[:3] / counts.sum()
    assert (freq - torch.tensor([0.5, 0.2, 0.11]) / 0.81).abs().max() < 0.02


def test_seeded_rows_are_reproducible_in_any_batch():
    logits = random_logits(1, vocab=1000, seed=5)

    def draw(batch_before: int, batch_after: int, steps: int = 6) -> list[int]:
        target = row(temperature=1.0, seed=42)
        tokens = []
        for _ in range(steps):
            others_before = [row(temperature=1.0) for _ in range(batch_before)]
            others_after = [row(temperature=0.9, seed=7), row(temperature=0.0)][:batch_after]
            rows = others_before + [target] + others_after
            batch = random_logits(len(rows), vocab=1000, seed=len(tokens))
            batch[len(others_before)] = logits[0]
            tokens.append(Sampler(99 + len(tokens), CPU)(batch, rows).token_ids[len(others_before)])
        return tokens

    alone = draw(0, 0)
    assert draw(3, 2) == alone
    assert draw(1, 1) == alone
    assert len(set(alone)) > 1, "six draws from a spread-out distribution should not all agree"


def test_unseeded_rows_follow_the_sampler_seed():
    logits = random_logits(4, vocab=1000)
    rows = [row(temperature=1.0) for _ in range(4)]
    assert Sampler(3, CPU)(logits, rows).token_ids == Sampler(3, CPU)(logits, rows).token_ids
    draws = {tuple(Sampler(seed, CPU)(logits, rows).token_ids) for seed in range(5)}
    assert len(draws) > 1


def test_penalties_apply_per_row_and_change_the_greedy_pick():
    logits = torch.tensor([[2.0, 1.5, 0.0], [2.0, 1.5, 0.0], [2.0, 1.5, 0.0]])
    pool = PenaltyRows(CPU)
    rows = [row(temperature=0.0, output=[0], repetition_penalty=1.5, pool=pool, vocab=3),  # 2 / 1.5 = 1.33 < 1.5
            row(temperature=0.0, output=[0], frequency_penalty=0.6, pool=pool, vocab=3),   # 2 - 0.6 = 1.4 < 1.5
            row(temperature=0.0, output=[0])]                                              # no penalty
    assert Sampler(0, CPU)(logits, rows, pool).token_ids == [1, 1, 0]
    # Penalties on the middle row alone: the others' logits are the caller's.
    assert Sampler(0, CPU)(logits, [rows[2], rows[1], rows[2]], pool).token_ids == [0, 1, 0]


def test_a_row_with_penalties_and_no_penalty_row_fails_alone():
    logits = random_logits(2)
    rows = [row(temperature=0.0), SamplingRow(SamplingParams(temperature=0.0, presence_penalty=1.0), None)]
    out, failed = sample_isolating_failures(Sampler(0, CPU), logits, rows, PenaltyRows(CPU))
    assert list(failed) == [1] and "no penalty row" in failed[1]
    assert out.token_ids[0] == logits[0].argmax().item()


def test_logprobs_are_raw_log_softmax_with_ranks_and_top_k():
    logits = random_logits(3, vocab=50, seed=3)
    pool = PenaltyRows(CPU)
    rows = [row(temperature=0.0, logprobs=5), row(temperature=1.0, seed=1, logprobs=0),
            row(temperature=2.0, output=[int(logits[2].argmax())], repetition_penalty=2.0, logprobs=3,
                pool=pool, vocab=50)]
    out = Sampler(0, CPU)(logits, rows, pool)
    want = torch.log_softmax(logits, dim=-1)
    for i, lp in enumerate(out.logprobs):
        token = out.token_ids[i]
        assert lp.sampled_logprob == pytest.approx(want[i, token].item(), abs=1e-6)
        assert lp.sampled_rank == 1 + int((want[i] > want[i, token]).sum())
        k = rows[i].params.logprobs
        values, ids = want[i].topk(k)
        assert lp.top_token_ids == ids.tolist()
        assert lp.top_logprobs == pytest.approx(values.tolist(), abs=1e-6)
    assert out.logprobs[0].sampled_rank == 1


def test_tied_logprobs_are_listed_by_token_id_so_greedys_token_comes_first():
    """bf16 logits tie often: the top list orders ties by token id, the one argmax takes, and a tie
    at its k-th place keeps the lowest ids (topk alone orders and picks ties as it likes)."""
    logits = torch.full((2, 64), -5.0)
    logits[0, [40, 9, 33, 21]] = 2.0               # a four-way tie for the top, two of them listed
    logits[1, 50] = 3.0
    logits[1, [60, 12, 30]] = 1.0                  # one place left for three tied tokens
    out = Sampler(0, CPU)(logits, [row(temperature=0.0, logprobs=2), row(temperature=0.0, logprobs=2)])
    assert out.token_ids == [9, 50]
    assert out.logprobs[0].top_token_ids == [9, 21] and out.logprobs[0].sampled_rank == 4   # ties count ahead
    assert out.logprobs[1].top_token_ids == [50, 12]
    assert out.logprobs[1].top_logprobs[1] == pytest.approx(torch.log_softmax(logits[1], -1)[12].item())


def test_logprobs_only_for_rows_that_ask():
    logits = random_logits(2)
    out = Sampler(0, CPU)(logits, [row(temperature=0.0), row(temperature=0.0, logprobs=1)])
    assert out.logprobs[0] is None and out.logprobs[1].top_token_ids == [out.token_ids[1]]


@pytest.mark.parametrize("name, value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("top_p", float("nan")),
    ("min_p", float("nan")), ("presence_penalty", float("-inf")), ("frequency_penalty", float("nan")),
    ("repetition_penalty", float("nan")), ("repetition_penalty", 1e-40), ("repetition_penalty", 1e30),
    ("seed", 2**64), ("logit_bias", {3: float("nan")}), ("logit_bias", {3: 1e300}), ("logit_bias", {-1: 1.0}),
])
def test_non_finite_and_degenerate_values_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


def test_child_seeds_stay_within_64_bits():
    top = SamplingParams(n=3, seed=2**63 - 1)
    assert [top.child(i).seed for i in range(3)] == [2**63 - 1, -2**63, -2**63 + 1]


def test_top_k_of_the_whole_vocabulary_or_more_filters_nothing():
    logits = random_logits(2)
    for top_k in (64, 1000):
        out = Sampler(0, CPU)(logits, [row(top_k=top_k, top_p=1.0, seed=5), row(top_k=top_k, top_p=0.9, seed=6)])
        assert all(0 <= t < 64 for t in out.token_ids)


def test_top_p_below_float32_resolution_keeps_the_top_token():
    logits = random_logits(3)
    out = Sampler(0, CPU)(logits, [row(top_p=1e-300, seed=i) for i in range(3)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_logit_bias_is_added_before_sampling_and_logprobs_stay_raw():
    logits = random_logits(2)
    top = logits[1].argmax().item()
    out = Sampler(0, CPU)(logits, [row(temperature=0.0, logit_bias={7: 100.0}, logprobs=1),
                                   row(temperature=0.0, logit_bias={top: -100.0})])
    assert out.token_ids[0] == 7
    assert out.token_ids[1] == logits[1].topk(2).indices[1].item()   # the runner-up, once the top is pushed down
    assert out.logprobs[0].sampled_logprob == pytest.approx(logits[0].log_softmax(-1)[7].item())


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = random_logits(4)
    logits[1, 5] = float("nan")                 # a row the model computed badly
    rows = [row(temperature=0.0), row(temperature=0.0), row(temperature=0.7, seed=3),
            row(temperature=0.0, logit_bias={7: 1.0})]
    rows[3].params.logit_bias = {10**6: 1.0}    # out of the vocabulary: its sampling raises
    out, failed = sample_isolating_failures(Sampler(0, CPU), logits, rows)
    assert set(failed) == {1, 3} and "non-finite" in failed[1] and "sampling failed" in failed[3]
    alone = Sampler(0, CPU)(logits[2:3], [row(temperature=0.7, seed=3)])
    assert out.token_ids[0] == logits[0].argmax().item() and out.token_ids[2] == alone.token_ids[0]
    assert out.token_ids[1] == out.token_ids[3] == -1
