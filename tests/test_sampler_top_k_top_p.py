"""apply_top_k_top_p against a float64 full-sort reference of vLLM's semantics: which tokens keep a
finite logit, and the kept set's probabilities after renormalisation. top_k keeps the k largest
logits and every tie with the k-th; top_p then keeps, most likely first, the fewest tokens whose
probability (renormalised over what top_k kept) reaches p, at least one, and every tie with the last
kept. Both ways of finding the largest logits run on every case: numpy on CPU (the default there)
and torch (what other devices use), forced on CPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rackserve.model import sampler
from rackserve.model.sampler import apply_top_k_top_p

NEG_INF = float("-inf")


# How far from top_p a row's cumulative mass must be for the kept set to be exact: within it the
# set may end at either side (float32 logits' normaliser is good to ~2e-7, not 1e-12).
TOLERANCE = 1e-6


def reference_keep(row: torch.Tensor, k: int, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Two [vocab] bool masks, the fewest and the most tokens vLLM's filters may keep (the same
    unless top_p lies within TOLERANCE of a boundary), by sorting the whole row in float64."""
    x = row.double().numpy()
    values = np.sort(x)[::-1]
    values = values[np.isfinite(values)]
    if 0 < k < len(x):
        values = values[values >= values[min(k, len(values)) - 1]]
    keep = np.isfinite(x) & (x >= values[-1])
    if p >= 1:
        return keep, keep
    probs = np.exp(values - values[0])
    probs /= probs.sum()
    mass_above = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
    fewest, most = (keep & (x >= values[max(1, int((mass_above < q).sum())) - 1])
                    for q in (p - TOLERANCE, p + TOLERANCE))
    return fewest, most


@pytest.fixture(params=["numpy", "torch"])
def path(request, monkeypatch):
    monkeypatch.setattr(sampler, "_NUMPY_ON_CPU", request.param == "numpy", raising=False)
    return request.param


def check(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    before = logits.clone()
    out = apply_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(logits, before), "the caller's logits are left alone"
    for i in range(logits.shape[0]):
        fewest, most = reference_keep(logits[i], top_k[i], top_p[i])
        got = torch.isfinite(out[i]).numpy()
        x = logits[i].numpy()
        assert (got >= fewest).all() and (got <= most).all(), (
            i, top_k[i], top_p[i], int(got.sum()), int(fewest.sum()), int(most.sum()))
        assert (got == (x >= x[got].min()) & np.isfinite(x)).all(), "all tokens above the last kept"
        assert torch.equal(out[i][got], logits[i][got]), "kept logits are unchanged"
        kept = x[got].astype(np.float64)
        want_probs = np.exp(kept - kept.max()) / np.exp(kept - kept.max()).sum()
        np.testing.assert_allclose(out[i].double().softmax(dim=-1).numpy()[got], want_probs, rtol=1e-9)


def normal(rows: int, vocab: int, scale: float, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# (rows' logits scale, top_k, top_p) at vocab 49,152: scale 4 is peaked (top_p sets of a few to
# a few hundred tokens), 0.5 flat (top_p sets of thousands: past any window).
CASES = {
    "top_k 1": (4.0, 1, 1.0),
    "top_k 5": (4.0, 5, 1.0),
    "top_k 50": (0.5, 50, 1.0),
    "top_k 300 (past 256)": (0.5, 300, 1.0),
    "top_k 5000 (past 1024)": (0.5, 5000, 1.0),
    "top_p 0.9 peaked": (4.0, 0, 0.9),
    "top_p 0.5 peaked": (4.0, 0, 0.5),
    "top_p 0.9 flat": (0.5, 0, 0.9),
    "top_p 0.999 peaked": (4.0, 0, 0.999),
    "top_p 0.99999 peaked": (3.0, 0, 0.99999),
    "top_p tiny": (4.0, 0, 1e-9),
    "top_p 0.999 flat": (0.5, 0, 0.999),
    "both 40 0.9": (4.0, 40, 0.9),
    "both 300 0.8 flat": (0.5, 300, 0.8),
    "both 2000 0.95 flat": (0.5, 2000, 0.95),
    "both 5000 0.5 flat": (0.3, 5000, 0.5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_one_filter_setting(path, name):
    scale, k, p = CASES[name]
    check(normal(4, 49_152, scale, seed=len(name)), [k] * 4, [p] * 4)


@pytest.mark.parametrize("vocab", [49_152, 129_280])
def test_mixed_rows_in_one_batch_with_disabled_ones(path, vocab):
    settings = [(k, p) for k in (0, -1, 1, 20, 300, 3000) for p in (1.0, 0.3, 0.92, 0.999)]
    rows = len(settings) * 2
    logits = torch.cat([normal(len(settings), vocab, 4.0, seed=1), normal(len(settings), vocab, 0.4, seed=2)])
    check(logits, [k for k, _ in settings] * 2, [p for _, p in settings] * 2)
    assert logits.shape[0] == rows


@pytest.mark.parametrize("vocab", [49_152, 129_280])
def test_many_rows_and_one_row(path, vocab):
    logits = normal(128, vocab, 3.0, seed=3)
    ks = [(0, 40, 1000)[i % 3] for i in range(128)]
    ps = [(0.9, 0.95, 1.0, 0.6)[i % 4] for i in range(128)]
    check(logits, ks, ps)
    check(logits[5:6].clone(), [0], [0.9])


def tied(vocab: int, distinct: int, ties: int, seed: int = 0) -> torch.Tensor:
    """One row: `distinct` decreasing logits from 6, then `ties` logits of exactly 0, the rest below."""
    row = torch.rand(vocab, generator=torch.Generator().manual_seed(seed)) * 3 - 8
    row[:distinct] = torch.linspace(6, 1, distinct)
    row[distinct:distinct + ties] = 0.0
    return row[torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 1))]


def test_top_k_ties_past_the_window_are_renormalised_over(path):
    # 10 distinct logits then 1,500 ties at the 15th: top_k=15 keeps all 1,510 tokens, and top_p
    # must be measured against all of them, not only those within the first few hundred.
    row = tied(49_152, 10, 1_500)
    probs = torch.softmax(row.double()[row >= 0], dim=0).sort(descending=True).values
    # p between the mass of the first 4 distinct tokens and the first 5: keeps 5 tokens.
    p = float(probs[:4].sum() + probs[4] / 2)
    check(row.unsqueeze(0), [15], [p])
    check(torch.stack([row, row]), [15, 1300], [p, 1.0])


def test_ties_at_the_cutoff(path):
    logits = (normal(3, 49_152, 4.0, seed=7) * 2).round() / 2   # steps of 0.5: every value is tied
    check(logits, [10, 0, 30], [1.0, 0.8, 0.9])
    # A tie run across the top_p cutoff, one inside the window and one past it.
    row_in = tied(49_152, 3, 100)
    row_past = tied(49_152, 3, 3_000, seed=5)
    check(torch.stack([row_in, row_past]), [0, 0], [0.99, 0.999])
    check(torch.full((2, 1000), 0.25), [3, 0], [1.0, 0.5])      # all tied: all kept


def test_top_p_close_to_1(path):
    # 200 likely tokens, then 10 of probability ~5e-6 each, the rest below 1e-20: p = 1 - 2.75e-5
    # keeps the 200 and 5 of the 10, 2.5e-6 away from either boundary.
    logits = normal(2, 49_152, 1.0, seed=6) - 60
    logits[:, :200] = normal(2, 200, 1.0, seed=8)
    tail = logits[:, :200].logsumexp(dim=-1, keepdim=True) + np.log(5e-6)
    logits[:, 200:210] = tail - torch.linspace(0, 0.01, 10)
    p = 1 - 2.75e-5
    check(logits, [0, 208], [p, p])
    fewest, most = reference_keep(logits[0], 0, p)
    assert (fewest == most).all() and fewest.sum() == 205


def test_negative_infinity_entries(path):
    logits = normal(4, 49_152, 2.0, seed=9)
    logits[0, 5:] = NEG_INF                     # 5 finite: top_k past them, top_p near 1
    logits[1, ::2] = NEG_INF
    logits[2, 3000:] = NEG_INF
    logits[3, 1:] = NEG_INF
    check(logits, [50, 0, 0, 7], [0.999, 0.9, 0.95, 0.5])
    check(logits, [3, 100, 2000, 0], [1.0, 1.0, 0.5, 0.9])


def test_small_vocabularies(path):
    logits = normal(6, 64, 2.0, seed=4)
    check(logits, [63, 64, 100, 0, 5, 1], [0.9, 0.9, 0.5, 0.7, 1.0, 0.3])
