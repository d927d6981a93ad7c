"""Penalty state: what repetition, presence and frequency penalties need to know of each request's
tokens, kept across steps, so that a step's penalties cost a few [rows, vocab] tensor operations
whatever the prompts' lengths (vLLM keeps a prompt mask and output counts per request alike).

`PenaltyRows` is a pool of rows, one per running request that has penalties (requests without
them take none and pay nothing): `seen` (bool: the token is in the prompt or the output, what the
repetition penalty reads) and `counts` (int32: times in the output, what frequency and presence
read). A row is filled once, from the prompt and any outputs a request resumes with after
preemption, and then updated with each sampled token. The pool grows to the most penalised
requests running at once (rounded up to a power of two) and is released when the last one leaves:
5 bytes a vocabulary entry a request, 245 KB at a 49k vocabulary, 645 KB at 129k (165 MB for 256
penalised requests at once).

The model runner owns the pool and its rows (add, free, append); the sampler only reads it
(`apply`). Nothing here decides when penalties apply against the other logits processors.
"""
from __future__ import annotations

import torch

from rackserve.sampling_params import SamplingParams

_MIN_ROWS = 8


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class PenaltyRows:
    def __init__(self, device: torch.device):
        self.device = device
        self.vocab = 0
        self.seen: torch.Tensor | None = None     # [capacity, vocab] bool: in prompt or output
        self.counts: torch.Tensor | None = None   # [capacity, vocab] int32: times in the output
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return 0 if self.seen is None else self.seen.shape[0]

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    def reserve(self, rows: int, vocab: int) -> None:
        """Room for `rows` more rows (one growth for a batch of arrivals, such as n samples)."""
        if self.seen is not None:
            assert vocab == self.vocab, f"penalty rows of {self.vocab} tokens, logits of {vocab}"
        need = self.in_use + rows
        if need <= self.capacity:
            return
        capacity = max(_MIN_ROWS, self.capacity)
        while capacity < need:
            capacity *= 2
        seen = torch.zeros(capacity, vocab, dtype=torch.bool, device=self.device)
        counts = torch.zeros(capacity, vocab, dtype=torch.int32, device=self.device)
        if self.seen is not None:
            seen[:self.capacity] = self.seen
            counts[:self.capacity] = self.counts
        # Lowest rows first (pop from the end), so that rows in use stay packed at the front.
        self._free = sorted(self._free + list(range(self.capacity, capacity)), reverse=True)
        self.seen, self.counts, self.vocab = seen, counts, vocab

    def add(self, prompt: list[int], output: list[int], vocab: int) -> int:
        """A row for a request that arrives (or resumes after preemption): its prompt and outputs
        counted once. Raises ValueError for a token outside [0, vocab)."""
        ids = torch.tensor(prompt + output, dtype=torch.long)   # checked on the CPU, before any device write
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
            raise ValueError(f"token ids must be in [0, {vocab}) for penalties")
        self.reserve(1, vocab)
        row = self._free.pop()
        ids = ids.to(self.device)
        self.seen[row].zero_()
        self.seen[row, ids] = True
        self.counts[row].zero_()
        if output:
            out = ids[len(prompt):]
            self.counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        return row

    def free(self, row: int) -> None:
        assert 0 <= row < self.capacity and row not in self._free, f"penalty row {row} is not in use"
        self._free.append(row)
        if not self.in_use:   # nothing penalised runs: give the memory back
            self.seen = self.counts = None
            self._free = []

    def append(self, rows: list[int], tokens: list[int]) -> None:
        """Each row's request sampled its token (rows distinct)."""
        if not rows:
            return
        index = (torch.tensor(rows, device=self.device), torch.tensor(tokens, device=self.device))
        self.seen.index_put_(index, torch.tensor(True, device=self.device))
        self.counts.index_put_(index, torch.tensor(1, dtype=torch.int32, device=self.device), accumulate=True)

    def apply(self, logits: torch.Tensor, batch_rows: list[int], rows: list[int],
              params: list[SamplingParams]) -> torch.Tensor:
        """A new tensor: `logits` with penalties applied to batch row batch_rows[i] from pool row
        rows[i] and params[i]. Repetition (HF/vLLM: a positive logit divided, a negative one
        multiplied) on every token seen in prompt or output; then logit -= frequency * count +
        presence * (count > 0) over output tokens."""
        assert logits.shape[1] == self.vocab, f"logits of {logits.shape[1]} tokens, penalty rows of {self.vocab}"
        device, dtype = logits.device, logits.dtype
        whole = batch_rows == list(range(logits.shape[0]))
        pool = torch.tensor(rows, device=device)
        index = None if whole else torch.tensor(batch_rows, device=device)
        out = None if whole else logits[index]   # a copy: ours to change in place

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)

        repetition = [p.repetition_penalty for p in params]
        if any(r != 1.0 for r in repetition):
            src, r = (logits if out is None else out), column(repetition)
            penalised = torch.where(src > 0, src / r, src * r)
            out = torch.where(self.seen[pool], penalised, src, out=penalised)
        frequency = [p.frequency_penalty for p in params]
        presence = [p.presence_penalty for p in params]
        if any(f != 0.0 for f in frequency) or any(p != 0.0 for p in presence):
            out = logits.clone() if out is None else out
            counts = self.counts[pool]
            if any(f != 0.0 for f in frequency):
                out -= column(frequency) * counts
            if any(p != 0.0 for p in presence):
                out -= column(presence) * (counts > 0)
        assert out is not None, "apply() is for rows with penalties"
        if whole:
            return out
        result = logits.clone()
        result[index] = out
        return result
