"""How the CPU's native decode attention spreads a step's decodes over its threads, as a factor on
their attention time: the rule of csrc/paged_decode_attention.cpp (rs_paged_decode_attention),
which the cost model otherwise prices as if every thread had an equal share.

The kernel runs a step on one thread when its keys (tokens x KV heads, all rows) are under 1,024
(768 in the avx2 build); otherwise it cuts each row's context into parts of whole blocks (about two
parts per thread over the step, none under 256 tokens, 128 in the avx2 build) and hands the parts to the threads with OpenMP's static schedule:
contiguous runs of parts, the first `count % threads` threads one part more. The step lasts as
long as the busiest thread's tokens; with T threads sharing the work evenly it would last total/T.
The factor is the ratio of the two (1: balanced; T: one thread does everything). A lone decode at
a few hundred tokens, or one long row beside short ones (a part per short row, two halves of the
long row on one thread), is where it departs from 1.

This file owns that rule; it must never price a step itself (cost.py multiplies by the factor).
"""
from __future__ import annotations

from collections.abc import Sequence

# The native library's build -> (kMinPartTokens, kMinParallelKeys): the AVX2 build splits sooner (a
# Zen 3 measured a lone decode at 256 tokens faster on both threads).
RULES = {"avx512": (256, 1024), "avx2": (128, 768)}


def _parts(lens: Sequence[int], threads: int, block_size: int, min_part_tokens: int) -> list[int]:
    """Tokens of each part, in the kernel's order (row by row)."""
    rows = len(lens)
    want = (2 * threads + rows - 1) // rows
    parts = []
    for length in lens:
        blocks = (length + block_size - 1) // block_size
        n = max(1, min(want, length // min_part_tokens, blocks))
        parts += [min(length, blocks * (p + 1) // n * block_size) - min(length, blocks * p // n * block_size)
                  for p in range(n)]
    return parts


def decode_attention_imbalance(lens: Sequence[int], kv_heads: int, threads: int, block_size: int = 16,
                               isa: str = "avx512") -> float:
    """The busiest thread's tokens x threads / all tokens, for decode rows attending over `lens`
    tokens each (their contexts and the new token) on `threads` threads, in `isa`'s build."""
    min_part_tokens, min_parallel_keys = RULES[isa]
    total = sum(lens)
    if threads <= 1 or total == 0:
        return 1.0
    if total * kv_heads < min_parallel_keys:
        return float(threads)
    parts = _parts(lens, threads, block_size, min_part_tokens)
    share, extra = divmod(len(parts), threads)
    busiest, start = 0, 0
    for t in range(threads):
        count = share + (1 if t < extra else 0)
        busiest = max(busiest, sum(parts[start:start + count]))
        start += count
    return busiest * threads / total
