"""The "torch_dsv4" backend: DeepSeek-V4 attention over the paged per-token cache that
model/dsv4_attention.py lays out, in plain PyTorch, on CPU and CUDA.

Per layer and step: write each new token's window key and its compressors' raw kv and gate at its
slot; close every compression group whose last token is in this step (gathering its tokens' raw
values from the cache, so a group may span steps, chunks and prefix hits) and write the pooled,
normed, roped entry at that last token's slot; then attend, one request at a time, each query to
its window and to the entries it may see (entry g is visible to position t iff g < (t + 1) //
ratio): all of them on HCA layers, the indexer's top index_topk on CSA layers, with a per-head sink
in the softmax. Single-token queries (decodes) attend together, their contexts padded and masked.
Indexer ties are broken toward the earlier entry (a stable sort), so a prefill and a decode choose
alike when ReLU zeroes several scores. This file must never allocate the cache or
decide what runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rackserve.model.attention import CommonAttentionMetadata, register_attn_backend
from rackserve.model.dsv4_attention import (CSA, Compressor, DeepseekV4Attention, InterleavedRope,
                                            apply_interleaved_rope)


@dataclass
class Span:
    start: int                  # the request's tokens are batch rows [start, end)
    end: int
    context: int                # its tokens already in the cache (positions [0, context))
    table: torch.Tensor         # its block ids


@dataclass
class Decodes:
    """The step's single-token queries, attended together."""
    rows: torch.Tensor          # [D] their batch rows
    positions: torch.Tensor     # [D]
    tables: torch.Tensor        # [D, max_blocks] their block tables, padded with block 0

    def slots(self, positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """positions [D, L] (negative ones map to a valid slot, to be masked) -> slots [D, L]."""
        p = positions.clamp(min=0)
        return self.tables.gather(1, p // block_size) * block_size + p % block_size


@dataclass
class DSV4Metadata:
    spans: list[Span]           # every request (groups close in decodes too)
    slot_mapping: torch.Tensor
    block_size: int
    decodes: Decodes | None

    def slots(self, span: Span, positions: torch.Tensor) -> torch.Tensor:
        return span.table[positions // self.block_size] * self.block_size + positions % self.block_size


def topk_earliest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[n, k] indices of each row's k highest scores; among equal scores the earlier index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


@register_attn_backend("torch_dsv4")
class TorchDSV4Backend:

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata, device: torch.device) -> DSV4Metadata:
        spans, start = [], 0
        rows, positions, tables = [], [], []
        for n, ctx, table in zip(common.query_lens, common.context_lens, common.block_tables):
            spans.append(Span(start, start + n, ctx, torch.tensor(table, dtype=torch.long, device=device)))
            if n == 1:
                rows.append(start)
                positions.append(ctx)
                tables.append(table)
            start += n
        decodes = None
        if rows:
            width = max(len(t) for t in tables)
            padded = [t + [0] * (width - len(t)) for t in tables]
            decodes = Decodes(*(torch.tensor(v, dtype=torch.long, device=device) for v in (rows, positions, padded)))
        return DSV4Metadata(spans, common.slot_mapping, common.block_size, decodes)

    def forward(self, layer: DeepseekV4Attention, q: torch.Tensor, kv: torch.Tensor, x: torch.Tensor,
                q_residual: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
                m: DSV4Metadata) -> torch.Tensor:
        """q: [T, H, hd] and kv: [T, hd], roped; x: the layer's input [T, hidden]. Returns [T, H, hd]."""
        lay, flat = layer.layout, cache.view(-1, cache.shape[-1])
        self._write(flat, m.slot_mapping, lay.range("window"), kv)
        index = None
        if layer.compressor is not None:
            c = layer.compressor
            self._write(flat, m.slot_mapping, lay.range("raw_kv"), c.wkv(x))
            self._write(flat, m.slot_mapping, lay.range("raw_gate"), c.wgate(x))
            self._close_groups(flat, m, c, lay.range("raw_kv"), lay.range("raw_gate"), lay.range("entry"),
                               layer.compress_rope)
        if layer.kind == CSA:
            ix = layer.indexer
            self._write(flat, m.slot_mapping, lay.range("index_raw_kv"), ix.compressor.wkv(x))
            self._write(flat, m.slot_mapping, lay.range("index_raw_gate"), ix.compressor.wgate(x))
            self._close_groups(flat, m, ix.compressor, lay.range("index_raw_kv"), lay.range("index_raw_gate"),
                               lay.range("index_entry"), layer.compress_rope)
            cos, sin = layer.compress_rope(positions)
            iq = apply_interleaved_rope(ix.wq_b(q_residual).view(x.shape[0], ix.num_heads, ix.head_dim), cos, sin)
            iw = ix.weights_proj(x).float() * ix.num_heads ** -0.5
            index = (iq, iw)
        out = torch.empty_like(q)
        for span in m.spans:
            if span.end - span.start > 1:
                out[span.start:span.end] = self._attend(layer, q[span.start:span.end], flat, m, span, index)
        if m.decodes is not None:
            out[m.decodes.rows] = self._attend_decodes(layer, q, flat, m, index)
        return out

    @staticmethod
    def _write(flat: torch.Tensor, slots: torch.Tensor, rng: tuple[int, int], values: torch.Tensor) -> None:
        """values [T, w] into the first w channels of range `rng` (HCA layers fill half of a range
        sized for CSA's two series)."""
        flat[:, rng[0]:rng[0] + values.shape[-1]].index_copy_(0, slots, values.to(flat.dtype))

    @staticmethod
    def _close_groups(flat: torch.Tensor, m: DSV4Metadata, c: Compressor, kv_rng: tuple[int, int],
                      gate_rng: tuple[int, int], entry_rng: tuple[int, int], rope: InterleavedRope) -> None:
        """Pool every group whose last token is in this step into the entry slot of that token."""
        r, d = c.ratio, c.dim
        offsets = torch.arange(-r if c.overlap else 0, r, device=flat.device)
        sources, entry_slots, firsts = [], [], []
        for span in m.spans:
            first, last = span.context // r, (span.context + span.end - span.start) // r
            if first == last:
                continue
            g = torch.arange(first, last, device=flat.device)
            pos = g[:, None] * r + offsets
            sources.append(torch.where(pos >= 0, m.slots(span, pos.clamp(min=0)), -1))
            entry_slots.append(m.slots(span, g * r + r - 1))
            firsts.append(g * r)
        if not sources:
            return
        src = torch.cat(sources)                                     # [G, S]
        valid = (src >= 0).unsqueeze(-1)
        rows = flat[src.clamp(min=0)]                                # [G, S, width]
        width = c.ape.shape[1]
        kv, gate = rows[..., kv_rng[0]:kv_rng[0] + width], rows[..., gate_rng[0]:gate_rng[0] + width]
        if c.overlap:
            # Slots [0, r): the Ca half of the previous group; [r, 2r): the Cb half of this one.
            ape = c.ape.to(gate.dtype)
            kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
            gate = torch.cat([gate[:, :r, :d] + ape[:, :d], gate[:, r:, d:] + ape[:, d:]], dim=1)
        else:
            gate = gate + c.ape.to(gate.dtype)
        kv = kv.masked_fill(~valid, 0.0)
        gate = gate.masked_fill(~valid, float("-inf"))
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        cos, sin = rope(torch.cat(firsts))
        entry = apply_interleaved_rope(c.norm(pooled), cos, sin)
        flat[:, entry_rng[0]:entry_rng[1]].index_copy_(0, torch.cat(entry_slots), entry.to(flat.dtype))

    @staticmethod
    def _attend(layer: DeepseekV4Attention, q: torch.Tensor, flat: torch.Tensor, m: DSV4Metadata, span: Span,
                index: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        lay, n, dev = layer.layout, span.end - span.start, q.device
        end = span.context + n
        qpos = torch.arange(span.context, end, device=dev)
        lo = max(0, span.context - layer.window + 1)
        kpos = torch.arange(lo, end, device=dev)
        w0, w1 = lay.range("window")
        keys = flat[m.slots(span, kpos), w0:w1]
        visible = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - layer.window)
        if layer.compressor is not None and end // layer.ratio > 0:
            r = layer.ratio
            groups = torch.arange(end // r, device=dev)
            entry_slots = m.slots(span, groups * r + r - 1)
            e0, e1 = lay.range("entry")
            keys = torch.cat([keys, flat[entry_slots, e0:e1]])
            closed = groups[None, :] < (qpos[:, None] + 1) // r                       # [n, G]
            if index is not None:
                closed = closed & TorchDSV4Backend._chosen(layer, flat, entry_slots, closed, span, index)
            visible = torch.cat([visible, closed], dim=1)
        keys = keys.to(q.dtype)
        scores = torch.einsum("nhd,kd->hnk", q, keys) * layer.head_dim ** -0.5
        scores = scores.masked_fill(~visible, float("-inf"))
        sinks = layer.attn_sink.to(scores.dtype).view(-1, 1, 1).expand(-1, n, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("hnk,kd->nhd", probs.to(keys.dtype), keys)

    @staticmethod
    def _chosen(layer: DeepseekV4Attention, flat: torch.Tensor, entry_slots: torch.Tensor, closed: torch.Tensor,
                span: Span, index: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """[n, G] bool: the closed entries among each query's top index_topk by indexer score."""
        ix, (iq, iw) = layer.indexer, index
        i0, i1 = layer.layout.range("index_entry")
        ikeys = flat[entry_slots, i0:i1].float()                                  # [G, dI]
        dots = torch.einsum("nhd,gd->nhg", iq[span.start:span.end].float(), ikeys).relu() * ix.head_dim ** -0.5
        scores = (dots * iw[span.start:span.end].unsqueeze(-1)).sum(dim=1)        # [n, G]
        scores = scores.masked_fill(~closed, float("-inf"))
        top = topk_earliest(scores, min(ix.topk, scores.shape[1]))
        return torch.zeros_like(closed).scatter_(1, top, True)

    @staticmethod
    def _attend_decodes(layer: DeepseekV4Attention, q: torch.Tensor, flat: torch.Tensor, m: DSV4Metadata,
                        index: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """_attend for every single-token query at once, the context padded to the longest."""
        lay, d, bs, dev = layer.layout, m.decodes, m.block_size, q.device
        q, pos = q[d.rows], d.positions
        kpos = pos[:, None] - layer.window + 1 + torch.arange(layer.window, device=dev)           # [D, W]
        visible = kpos >= 0
        w0, w1 = lay.range("window")
        keys = flat[d.slots(kpos, bs), w0:w1]                                                    # [D, W, hd]
        r = layer.ratio
        num_groups = int(((pos + 1) // r).max()) if layer.compressor is not None else 0
        if num_groups > 0:
            groups = torch.arange(num_groups, device=dev)
            entry_slots = d.slots((groups * r + r - 1).expand(pos.shape[0], -1), bs)             # [D, G]
            closed = groups[None, :] < ((pos + 1) // r)[:, None]
            if index is not None:
                ix, (iq, iw) = layer.indexer, index
                i0, i1 = lay.range("index_entry")
                dots = torch.einsum("dhi,dgi->dhg", iq[d.rows].float(), flat[entry_slots, i0:i1].float())
                scores = (dots.relu() * ix.head_dim ** -0.5 * iw[d.rows].unsqueeze(-1)).sum(dim=1)
                top = topk_earliest(scores.masked_fill(~closed, float("-inf")), min(ix.topk, num_groups))
                closed = closed & torch.zeros_like(closed).scatter_(1, top, True)
            e0, e1 = lay.range("entry")
            keys = torch.cat([keys, flat[entry_slots, e0:e1]], dim=1)
            visible = torch.cat([visible, closed], dim=1)
        keys = keys.to(q.dtype)
        scores = torch.einsum("dhk,dlk->dhl", q, keys) * layer.head_dim ** -0.5
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        sinks = layer.attn_sink.to(scores.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("dhl,dlk->dhk", probs.to(keys.dtype), keys)
