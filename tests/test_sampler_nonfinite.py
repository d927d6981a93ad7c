"""sampler.nonfinite_rows: the rows of a step's logits that hold a NaN or an infinity, found on CPU
by a row sum and confirmed row by row, against torch.isfinite on every row."""
from __future__ import annotations

import torch

from rackserve.model.sampler import nonfinite_rows


def test_nan_and_infinities_are_found_and_huge_finite_logits_are_not():
    logits = torch.randn(6, 1000)
    logits[1, 3] = float("nan")
    logits[2, 999] = float("inf")
    logits[3, 0] = float("-inf")
    logits[4] = 3e38                              # finite, but its row sum overflows to inf
    logits[5, :2] = torch.tensor([float("inf"), float("-inf")])   # a sum of NaN
    expected = (~torch.isfinite(logits).all(dim=-1)).nonzero().flatten().tolist()
    assert nonfinite_rows(logits) == expected == [1, 2, 3, 5]
    assert nonfinite_rows(logits[4:5]) == [] and nonfinite_rows(torch.randn(1, 49152)) == []
