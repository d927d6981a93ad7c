"""Penalty state: what repetition, presence and frequency penalties need to know of each request's
tokens, kept across steps, so that a step's penalties cost tensor work in the distinct tokens its
rows have seen, never Python work in their prompts' lengths (vLLM keeps a prompt mask and output
counts per request alike).

`PenaltyRows` is a pool of rows, one per running request that has penalties (requests without
them take none and pay nothing). A row holds `seen` (bool over the vocabulary: the token is in
the prompt or the output) and `counts` (int32: times in the output), and the distinct ids of each
(what a step reads: on CPU, a where() over a whole [rows, vocab] tensor costs several times the
same work over the few thousand ids a long prompt has). A row is filled once, from the prompt and
any outputs a request resumes with after preemption, then updated with each sampled token. The
pool grows to the most penalised requests running at once (rounded up to a power of two) and is
released when the last one leaves. Memory: 5 bytes a vocabulary entry a request (245 KB at a 49k
vocabulary, 645 KB at 129k: 165 MB for 256 penalised requests at once) plus 8 bytes a distinct
token seen.

The model runner owns the pool and its rows (add, free, append); the sampler only reads it
(`apply`). Nothing here decides when penalties apply against the other logits processors.
"""
from __future__ import annotations

import numpy as np
import torch

from rackserve.sampling_params import SamplingParams

_MIN_ROWS = 8
_MERGE = 64   # tokens newly seen by a row, held as a list until this many join its id tensor


class _Ids:
    """One row's distinct token ids: a tensor, and those found since it was last grown."""
    __slots__ = ("tensor", "recent")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.recent = tensor, []

    def add(self, token: int) -> None:
        self.recent.append(token)
        if len(self.recent) >= _MERGE:
            recent = torch.tensor(self.recent, dtype=torch.long, device=self.tensor.device)
            self.tensor, self.recent = torch.cat([self.tensor, recent]), []

    def parts(self) -> list[torch.Tensor]:
        if not self.recent:
            return [self.tensor]
        return [self.tensor, torch.tensor(self.recent, dtype=torch.long, device=self.tensor.device)]


def _ids(tokens: list[int], vocab: int) -> torch.Tensor:
    """A CPU tensor of token ids (numpy turns a list into one ~5x faster than torch.tensor)."""
    ids = torch.from_numpy(np.array(tokens, dtype=np.int64))
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
        raise ValueError(f"token ids must be in [0, {vocab}) for penalties")
    return ids


def has_penalties(p: SamplingParams) -> bool:
    return p.has_penalties


class PenaltyRows:
    def __init__(self, device: torch.device):
        self.device = device
        self.vocab = 0
        self.seen: torch.Tensor | None = None     # [capacity, vocab] bool: in prompt or output
        self.counts: torch.Tensor | None = None   # [capacity, vocab] int32: times in the output
        self._seen_ids: dict[int, _Ids] = {}      # row: its seen tokens, by id
        self._output_ids: dict[int, _Ids] = {}    # row: its output tokens, by id
        self._free: list[int] = []
        # The last prompt added and its distinct ids: a request's n samples arrive together with one prompt.
        self._last_prompt: tuple[list[int], torch.Tensor] | None = None

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
        last = self._last_prompt
        prompt_ids = last[1] if last is not None and last[0] == prompt and self.vocab == vocab else None
        prompt_tokens = _ids(prompt, vocab) if prompt_ids is None else None   # checked before any row is taken
        output_tokens = _ids(output, vocab)
        self.reserve(1, vocab)
        row = self._free.pop()
        seen, counts = self.seen[row], self.counts[row]
        seen.zero_()
        counts.zero_()
        if prompt_ids is None:
            seen[prompt_tokens.to(self.device)] = True
            prompt_ids = seen.nonzero().flatten()
            self._last_prompt = (prompt, prompt_ids)
        else:
            seen[prompt_ids] = True
        if output:
            out = output_tokens.to(self.device)
            seen[out] = True
            counts.index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        self._seen_ids[row] = _Ids(seen.nonzero().flatten() if output else prompt_ids)
        self._output_ids[row] = _Ids(counts.nonzero().flatten() if output else prompt_ids[:0])
        return row

    def free(self, row: int) -> None:
        assert 0 <= row < self.capacity and row not in self._free, f"penalty row {row} is not in use"
        self._free.append(row)
        del self._seen_ids[row], self._output_ids[row]
        if not self.in_use:   # nothing penalised runs: give the memory back
            self.seen = self.counts = self._last_prompt = None
            self._free = []

    def append(self, rows: list[int], tokens: list[int]) -> None:
        """Each row's request sampled its token (rows distinct)."""
        if not rows:
            return
        index = (torch.tensor(rows, device=self.device), torch.tensor(tokens, device=self.device))
        new_seen = (~self.seen[index]).tolist()
        new_output = (self.counts[index] == 0).tolist()
        self.seen.index_put_(index, torch.tensor(True, device=self.device))
        self.counts.index_put_(index, torch.tensor(1, dtype=torch.int32, device=self.device), accumulate=True)
        for row, token, seen, output in zip(rows, tokens, new_seen, new_output):
            if seen:
                self._seen_ids[row].add(token)
            if output:
                self._output_ids[row].add(token)

    def apply(self, logits: torch.Tensor, batch_rows: list[int], rows: list[int],
              params: list[SamplingParams]) -> torch.Tensor:
        """A new tensor: `logits` with penalties applied to batch row batch_rows[i] from pool row
        rows[i] and params[i]. Repetition (HF/vLLM: a positive logit divided, a negative one
        multiplied) on every token seen in prompt or output; then logit -= frequency * count, then
        -= presence, on output tokens."""
        assert logits.shape[1] == self.vocab, f"logits of {logits.shape[1]} tokens, penalty rows of {self.vocab}"
        out = logits.clone()
        flat = out.view(-1)
        repeated = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if repeated:
            index, _, (r,) = self._spread(self._seen_ids, repeated, batch_rows, rows,
                                          [[params[i].repetition_penalty for i in repeated]])
            values = flat.index_select(0, index)
            flat.index_copy_(0, index, torch.where(values > 0, values / r, values * r))
        counted = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
        if counted:
            index, pool_index, (f, p) = self._spread(
                self._output_ids, counted, batch_rows, rows,
                [[params[i].frequency_penalty for i in counted], [params[i].presence_penalty for i in counted]],
                in_pool=True)
            counts = self.counts.view(-1).index_select(0, pool_index)
            flat.index_copy_(0, index, flat.index_select(0, index) - f * counts - p)
        return out

    def _spread(self, ids: dict[int, _Ids], which: list[int], batch_rows: list[int], rows: list[int],
                values: list[list[float]], in_pool: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """For the params indices `which`: each one's token ids (from `ids`) as flat indices into
        the batch's logits (and, `in_pool`, into the pool's rows), and each of `values` (one
        number a row) repeated along them."""
        parts: list[torch.Tensor] = []
        lengths = []
        for i in which:
            own = ids[rows[i]].parts()
            parts += own
            lengths.append(sum(len(t) for t in own))
        tokens = torch.cat(parts)
        length = torch.tensor(lengths, device=self.device)

        def spread(per_row: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.repeat_interleave(torch.tensor(per_row, dtype=dtype, device=self.device), length,
                                           output_size=len(tokens))

        vocab = self.vocab
        index = spread([batch_rows[i] * vocab for i in which], torch.long) + tokens
        pool_index = spread([rows[i] * vocab for i in which], torch.long) + tokens if in_pool else None
        return index, pool_index, [spread(v, torch.float32) for v in values]
