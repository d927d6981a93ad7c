"""The "torch_mla" backend: multi-head latent attention over the paged latent cache in plain PyTorch
(SDPA), on CPU and CUDA; the MLA sibling of the "torch" backend, whose per-step metadata it shares.

Two forms, as vLLM's MLA backends choose them. Prefill chunks expand the latent of the whole
context through kv_b_proj into per-head keys and values and run ordinary attention: with n
queries over N keys the work is N * rank * H * (nope + v) for the expansion plus n * N * H *
(nope + rope + v) for attention. Decodes absorb kv_b_proj instead: the query's nope part is
mapped into the latent space (q_nope W_UK) and the output back from it (o W_UV), so attention runs
straight over the cached latent as one shared KV head of width rank + rope (MQA, values = its first
rank dims): n * N * H * (2 * rank + rope), with no per-key expansion. For one query per request
(decode) absorption saves the N * rank * H * (nope + v) term, which dominates at DeepSeek-V3's
sizes by a factor of about 100; for long chunks the expansion is amortised over many queries and
the narrower heads win. Both forms work per head, so under tensor parallelism each rank runs them
for its own heads over the same latent. This file must never allocate the cache or decide what
runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rackserve.model.attention import register_attn_backend, write_cache
from rackserve.model.mla import MLABackend
from rackserve.model.torch_attention import PrefillChunk, TorchAttentionBackend, TorchAttentionMetadata


@register_attn_backend("torch_mla")
class TorchMLABackend(MLABackend):
    build_metadata = staticmethod(TorchAttentionBackend.build_metadata)

    def forward(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                kv_cache: tuple[torch.Tensor, ...], metadata: TorchAttentionMetadata) -> torch.Tensor:
        m, (cache,) = metadata, kv_cache
        entries = torch.cat([kv_c_normed, k_pe], dim=-1)
        write_cache(cache.view(-1, entries.shape[1]), m.slot_mapping, entries)
        num_tokens = q.shape[0]
        if not m.prefills and isinstance(m.decode_rows, slice) and m.decode_rows == slice(0, num_tokens):
            return self._decode(q, cache, m)        # pure decode step: no scatter needed
        out = q.new_empty(num_tokens, self.num_heads * self.v_head_dim)
        for p in m.prefills:
            latent = entries[p.start:p.end] if p.block_ids is None else \
                m.workspace.gather_blocks("latent", cache, p.block_ids).view(-1, entries.shape[1])[:p.kv_len].to(q.dtype)
            out[p.start:p.end] = self._prefill(q[p.start:p.end], latent, p)
        if m.decode_rows is not None:
            out[m.decode_rows] = self._decode(q[m.decode_rows], cache, m)
        return out

    def _prefill(self, q: torch.Tensor, latent: torch.Tensor, p: PrefillChunk) -> torch.Tensor:
        """q: [n, H, nope + rope]; latent: [kv_len, rank + rope], the chunk's context and itself."""
        h, nope, rank = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
        kv = self.kv_b_proj(latent[:, :rank]).view(-1, h, nope + self.v_head_dim)
        k = torch.cat([kv[..., :nope], latent[:, None, rank:].expand(-1, h, -1)], dim=-1)
        v = kv[..., nope:]
        qi, ki, vi = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if p.block_ids is None:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=p.mask, scale=self.scale)
        return o.transpose(0, 1).reshape(q.shape[0], -1)

    def _decode(self, q: torch.Tensor, cache: torch.Tensor, m: TorchAttentionMetadata) -> torch.Tensor:
        """q: [d, H, nope + rope], one query per request."""
        d, h, nope, rank = q.shape[0], self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
        w = self.kv_b_proj.weight.view(h, nope + self.v_head_dim, rank)
        q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w[:, :nope]).transpose(0, 1)     # [d, H, rank]
        q_abs = torch.cat([q_latent, q[..., nope:]], dim=-1)                                 # [d, H, rank + rope]
        latent = m.workspace.gather_blocks("latent", cache, m.decode_block_tables).view(d, -1, cache.shape[-1])[:, :m.decode_kv_len]
        latent = latent.to(q.dtype)     # a 16-bit cache under wider weights: widened once per layer
        # Two matmuls rather than SDPA: with values narrower than keys SDPA takes its slow math
        # path on CPU (3x slower here).
        scores = torch.bmm(q_abs, latent.transpose(1, 2)) * self.scale                      # [d, H, N]
        if m.decode_mask is not None:
            scores.masked_fill_(~m.decode_mask.view(d, 1, -1), float("-inf"))
        o = torch.bmm(scores.softmax(-1, dtype=torch.float32).to(q.dtype), latent[..., :rank])   # [d, H, rank]
        out = torch.bmm(o.transpose(0, 1), w[:, nope:].transpose(1, 2))                    # [H, d, v]
        return out.transpose(0, 1).reshape(d, -1)
