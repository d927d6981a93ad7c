"""The "torch_dsv4" backend: DeepSeek-V4 attention over the KV cache groups that
model/dsv4_cache.py lays out, in plain PyTorch, on CPU and CUDA.

Per layer and step: write each new token's window key and its compressors' raw kv and gate at its
slot of the window group; close every compression group whose last token is in this step (gathering
its tokens' raw values from the window group, so a group may span steps, chunks and prefix hits) and
write the pooled, normed, roped entry at its slot of the layer's compressed group (entry g: slot
g % per_block of block table[g // per_block]), except entries in blocks that came from the prefix
cache (a bounded replay recomputes the tokens before a hit, never those blocks); then attend, one
request at a time, each query to its window and to the entries it may see (entry g is visible to
position t iff g < (t + 1) // ratio): all of them on HCA layers, the indexer's top index_topk on CSA
layers, with a per-head sink in the softmax. Single-token queries (decodes) attend together, their
contexts padded and masked. Indexer ties are broken toward the earlier entry (a stable sort), so a
prefill and a decode choose alike when ReLU zeroes several scores. This file must never allocate
the cache or decide what runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rackserve.model.attention import FP8_DTYPES, CommonAttentionMetadata, register_attn_backend, write_cache
from rackserve.model.dsv4_attention import (CSA, Compressor, DeepseekV4Attention, InterleavedRope,
                                            apply_interleaved_rope)


@dataclass
class Span:
    start: int                  # the request's tokens are batch rows [start, end)
    end: int
    context: int                # its tokens already in the cache (positions [0, context))
    tables: list[torch.Tensor]  # its block ids, per cache group
    hit_blocks: tuple[int, ...]  # per group, leading blocks from the prefix cache: never written

    def slots(self, group: int, index: torch.Tensor, per_block: int) -> torch.Tensor:
        """Slots of group `group` holding positions (window group) or entries `index`."""
        return self.tables[group][index // per_block] * per_block + index % per_block


@dataclass
class Decodes:
    """The step's single-token queries, attended together."""
    rows: torch.Tensor          # [D] their batch rows
    positions: torch.Tensor     # [D]
    tables: list[torch.Tensor]  # per group [D, max_blocks]: their block tables, padded with block 0

    def slots(self, group: int, index: torch.Tensor, per_block: int) -> torch.Tensor:
        """index [D, L] (negative ones map to a valid slot, to be masked) -> slots [D, L]."""
        i = index.clamp(min=0)
        return self.tables[group].gather(1, i // per_block) * per_block + i % per_block


@dataclass
class DSV4Metadata:
    spans: list[Span]           # every request (groups close in decodes too)
    slot_mapping: torch.Tensor  # the window group's
    block_size: int
    decodes: Decodes | None


@dataclass
class Caches:
    """One layer's view of the groups: [slots, channels] of the window group and of its kind's."""
    window: torch.Tensor
    entries: torch.Tensor | None
    per_block: int              # entries per block of its kind's group
    group: int


def topk_earliest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[n, k] indices of each row's k highest scores; among equal scores the earlier index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


@register_attn_backend("torch_dsv4")
class TorchDSV4Backend:

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata, device: torch.device) -> DSV4Metadata:
        tables_of = common.group_block_tables or [(t,) for t in common.block_tables]
        hits_of = common.num_hit_blocks or [()] * len(tables_of)
        spans, start = [], 0
        rows, positions, decode_tables = [], [], []
        for n, ctx, tables, hits in zip(common.query_lens, common.context_lens, tables_of, hits_of):
            spans.append(Span(start, start + n, ctx, [torch.tensor(t, dtype=torch.long, device=device) for t in tables],
                              hits))
            if n == 1:
                rows.append(start)
                positions.append(ctx)
                decode_tables.append(tables)
            start += n
        decodes = None
        if rows:
            padded = []
            for g in range(len(decode_tables[0])):
                width = max(len(t[g]) for t in decode_tables)
                padded.append(torch.tensor([t[g] + [0] * (width - len(t[g])) for t in decode_tables],
                                           dtype=torch.long, device=device))
            decodes = Decodes(torch.tensor(rows, dtype=torch.long, device=device),
                              torch.tensor(positions, dtype=torch.long, device=device), padded)
        return DSV4Metadata(spans, common.slot_mapping, common.block_size, decodes)

    def forward(self, layer: DeepseekV4Attention, q: torch.Tensor, kv: torch.Tensor, x: torch.Tensor,
                q_residual: torch.Tensor, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor | None], m: DSV4Metadata) -> torch.Tensor:
        """q: [T, H, hd] and kv: [T, hd], roped; x: the layer's input [T, hidden]. Returns [T, H, hd]."""
        window, entries = kv_cache
        at = layer.cache.ranges
        c = Caches(window.view(-1, window.shape[-1]), None if entries is None else entries.view(-1, entries.shape[-1]),
                   0 if entries is None else entries.shape[1], layer.cache.group)
        self._write(c.window, m.slot_mapping, at["window"], kv)
        index = None
        if layer.compressor is not None:
            comp = layer.compressor
            self._write(c.window, m.slot_mapping, at["raw_kv"], comp.wkv(x))
            self._write(c.window, m.slot_mapping, at["raw_gate"], comp.wgate(x))
            self._close_groups(c, m, comp, at["raw_kv"], at["raw_gate"], at["entry"], layer.compress_rope)
        if layer.kind == CSA:
            ix = layer.indexer
            self._write(c.window, m.slot_mapping, at["index_raw_kv"], ix.compressor.wkv(x))
            self._write(c.window, m.slot_mapping, at["index_raw_gate"], ix.compressor.wgate(x))
            self._close_groups(c, m, ix.compressor, at["index_raw_kv"], at["index_raw_gate"], at["index_entry"],
                               layer.compress_rope)
            cos, sin = layer.compress_rope(positions)
            iq = apply_interleaved_rope(ix.wq_b(q_residual).view(x.shape[0], ix.num_heads, ix.head_dim), cos, sin)
            iw = ix.weights_proj(x).float() * ix.num_heads ** -0.5
            index = (iq, iw)
        out = torch.empty_like(q)
        for span in m.spans:
            if span.end - span.start > 1:
                out[span.start:span.end] = self._attend(layer, q[span.start:span.end], c, m, span, index)
        if m.decodes is not None:
            out[m.decodes.rows] = self._attend_decodes(layer, q, c, m, index)
        return out

    @staticmethod
    def _write(flat: torch.Tensor, slots: torch.Tensor, rng: tuple[int, int], values: torch.Tensor) -> None:
        write_cache(flat[:, rng[0]:rng[1]], slots, values)

    @staticmethod
    def _close_groups(c: Caches, m: DSV4Metadata, comp: Compressor, kv_rng: tuple[int, int],
                      gate_rng: tuple[int, int], entry_rng: tuple[int, int], rope: InterleavedRope) -> None:
        """Pool every group whose last token is in this step into its entry slot, except those in
        blocks from the prefix cache."""
        r, d, bs, dev = comp.ratio, comp.dim, m.block_size, c.window.device
        offsets = torch.arange(-r if comp.overlap else 0, r, device=dev)
        sources, entry_slots, firsts = [], [], []
        for span in m.spans:
            hit = span.hit_blocks[c.group] if span.hit_blocks else 0
            first, last = max(span.context // r, hit * c.per_block), (span.context + span.end - span.start) // r
            if first >= last:
                continue
            g = torch.arange(first, last, device=dev)
            pos = g[:, None] * r + offsets
            sources.append(torch.where(pos >= 0, span.slots(0, pos.clamp(min=0), bs), -1))
            entry_slots.append(span.slots(c.group, g, c.per_block))
            firsts.append(g * r)
        if not sources:
            return
        src = torch.cat(sources)                                     # [G, S]
        valid = (src >= 0).unsqueeze(-1)
        rows = c.window[src.clamp(min=0)]                            # [G, S, width]
        if rows.dtype in FP8_DTYPES:                                 # an 8-bit cache: pooled in the model's dtype
            rows = rows.to(comp.ape.dtype)
        kv, gate = rows[..., kv_rng[0]:kv_rng[1]], rows[..., gate_rng[0]:gate_rng[1]]
        if comp.overlap:
            # Slots [0, r): the Ca half of the previous group; [r, 2r): the Cb half of this one.
            ape = comp.ape.to(gate.dtype)
            kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
            gate = torch.cat([gate[:, :r, :d] + ape[:, :d], gate[:, r:, d:] + ape[:, d:]], dim=1)
        else:
            gate = gate + comp.ape.to(gate.dtype)
        kv = kv.masked_fill(~valid, 0.0)
        gate = gate.masked_fill(~valid, float("-inf"))
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        cos, sin = rope(torch.cat(firsts))
        entry = apply_interleaved_rope(comp.norm(pooled), cos, sin)
        write_cache(c.entries[:, entry_rng[0]:entry_rng[1]], torch.cat(entry_slots), entry)

    @staticmethod
    def _attend(layer: DeepseekV4Attention, q: torch.Tensor, c: Caches, m: DSV4Metadata, span: Span,
                index: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        at, n, dev = layer.cache.ranges, span.end - span.start, q.device
        end = span.context + n
        qpos = torch.arange(span.context, end, device=dev)
        lo = max(0, span.context - layer.window + 1)
        kpos = torch.arange(lo, end, device=dev)
        w0, w1 = at["window"]
        keys = c.window[span.slots(0, kpos, m.block_size), w0:w1]
        visible = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - layer.window)
        if layer.compressor is not None and end // layer.ratio > 0:
            groups = torch.arange(end // layer.ratio, device=dev)
            entry_slots = span.slots(c.group, groups, c.per_block)
            e0, e1 = at["entry"]
            keys = torch.cat([keys, c.entries[entry_slots, e0:e1]])
            closed = groups[None, :] < (qpos[:, None] + 1) // layer.ratio              # [n, G]
            if index is not None:
                closed = closed & TorchDSV4Backend._chosen(layer, c, entry_slots, closed, span, index)
            visible = torch.cat([visible, closed], dim=1)
        keys = keys.to(q.dtype)
        scores = torch.einsum("nhd,kd->hnk", q, keys) * layer.head_dim ** -0.5
        scores = scores.masked_fill(~visible, float("-inf"))
        sinks = layer.attn_sink.to(scores.dtype).view(-1, 1, 1).expand(-1, n, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("hnk,kd->nhd", probs.to(keys.dtype), keys)

    @staticmethod
    def _chosen(layer: DeepseekV4Attention, c: Caches, entry_slots: torch.Tensor, closed: torch.Tensor,
                span: Span, index: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """[n, G] bool: the closed entries among each query's top index_topk by indexer score."""
        ix, (iq, iw) = layer.indexer, index
        i0, i1 = layer.cache.ranges["index_entry"]
        ikeys = c.entries[entry_slots, i0:i1].float()                             # [G, dI]
        dots = torch.einsum("nhd,gd->nhg", iq[span.start:span.end].float(), ikeys).relu() * ix.head_dim ** -0.5
        scores = (dots * iw[span.start:span.end].unsqueeze(-1)).sum(dim=1)        # [n, G]
        scores = scores.masked_fill(~closed, float("-inf"))
        top = topk_earliest(scores, min(ix.topk, scores.shape[1]))
        return torch.zeros_like(closed).scatter_(1, top, True)

    @staticmethod
    def _attend_decodes(layer: DeepseekV4Attention, q: torch.Tensor, c: Caches, m: DSV4Metadata,
                        index: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """_attend for every single-token query at once, the context padded to the longest."""
        at, d, dev = layer.cache.ranges, m.decodes, q.device
        q, pos = q[d.rows], d.positions
        kpos = pos[:, None] - layer.window + 1 + torch.arange(layer.window, device=dev)           # [D, W]
        visible = kpos >= 0
        w0, w1 = at["window"]
        keys = c.window[d.slots(0, kpos, m.block_size), w0:w1]                                  # [D, W, hd]
        r = layer.ratio
        num_groups = int(((pos + 1) // r).max()) if layer.compressor is not None else 0
        if num_groups > 0:
            groups = torch.arange(num_groups, device=dev)
            entry_slots = d.slots(c.group, groups.expand(pos.shape[0], -1), c.per_block)          # [D, G]
            closed = groups[None, :] < ((pos + 1) // r)[:, None]
            if index is not None:
                ix, (iq, iw) = layer.indexer, index
                i0, i1 = at["index_entry"]
                dots = torch.einsum("dhi,dgi->dhg", iq[d.rows].float(), c.entries[entry_slots, i0:i1].float())
                scores = (dots.relu() * ix.head_dim ** -0.5 * iw[d.rows].unsqueeze(-1)).sum(dim=1)
                top = topk_earliest(scores.masked_fill(~closed, float("-inf")), min(ix.topk, num_groups))
                closed = closed & torch.zeros_like(closed).scatter_(1, top, True)
            e0, e1 = at["entry"]
            keys = torch.cat([keys, c.entries[entry_slots, e0:e1]], dim=1)
            visible = torch.cat([visible, closed], dim=1)
        keys = keys.to(q.dtype)
        scores = torch.einsum("dhk,dlk->dhl", q, keys) * layer.head_dim ** -0.5
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        sinks = layer.attn_sink.to(scores.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("dhl,dlk->dhk", probs.to(keys.dtype), keys)
