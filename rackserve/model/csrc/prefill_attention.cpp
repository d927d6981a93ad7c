// Causal attention of one request's prefill chunk (n queries at positions ctx .. ctx + n - 1)
// against its paged KV cache, the chunk's own K and V already written there: flash attention's
// online softmax over keys 16 at a time, so that no [heads, n, ctx + n] score tensor is written,
// read, masked and soft-maxed in memory (the torch path's passes, 63% of a 512-token chunk's step
// over 1024 cached tokens on SmolLM2), and keys past a query's position are never scored.
//
// Work item: one KV head and 16 query positions, i.e. its group's query heads at those positions
// (48 query vectors on SmolLM2), kept with their accumulators in L1. Per 16 keys the item
// transposes the keys once ([head_dim][16]), so that a query's 16 scores are head_dim
// multiply-adds of whole vectors (no horizontal sums), then each query vector rescales its
// running sums and adds the 16 values weighted by their probabilities. Written with GCC's vector
// extensions (vec_exp.h), so that both builds compile it to their own ISA.
// model/native_ops.py calls rs_prefill_attention; the torch backend keeps its two-matmul form for
// other dtypes and devices. This file must never allocate tensors: the caller passes every buffer.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_exp.h"

namespace {

constexpr int kKeys = 16;       // keys scored at once: one rs_f16
constexpr int kQueryRows = 16;  // query positions of a work item

inline rs_f16 load16(const float* p) {
  rs_f16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, rs_f16 v) { std::memcpy(p, &v, sizeof v); }

inline float hmax(rs_f16 v) {
  float m = v[0];
  for (int i = 1; i < kKeys; ++i) m = std::max(m, v[i]);
  return m;
}

}  // namespace

extern "C" {

// q: row i (position ctx + i) of the chunk at q + i * q_stride, heads of head_dim contiguous.
// k_cache, v_cache: [blocks, block_size, kv_heads, head_dim]; table: the request's blocks, covering
// ctx + n tokens. out: [n, heads * head_dim]. head_dim a multiple of 16, at most 256.
int rs_prefill_attention(const float* q, int64_t q_stride, int64_t n, int64_t ctx, const float* k_cache,
                         const float* v_cache, const int64_t* table, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, float* out, int threads) {
  if (head_dim % 16 || head_dim > 256 || n < 1 || ctx < 0 || heads % kv_heads || threads < 1) return -1;
  const int64_t group = heads / kv_heads, vecs = head_dim / 16;
  const int64_t row_blocks = (n + kQueryRows - 1) / kQueryRows, items = kv_heads * row_blocks;
  const int64_t token_stride = kv_heads * head_dim;
#pragma omp parallel num_threads(threads)
  {
    const int64_t qv_max = kQueryRows * group;
    std::vector<float> qs(qv_max * head_dim), acc(qv_max * head_dim), kt(head_dim * kKeys), m(qv_max), l(qv_max);
    std::vector<const float*> vrow(kKeys);
    // Later row blocks see more keys: the last ones first, dynamically, so that threads end together.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t g = item % kv_heads, rb = row_blocks - 1 - item / kv_heads;
      const int64_t r0 = rb * kQueryRows, rows = std::min<int64_t>(kQueryRows, n - r0);
      const int64_t qvs = rows * group;
      // Query vector v = (row v / group, head g * group + v % group), scaled.
      for (int64_t v = 0; v < qvs; ++v) {
        const float* src = q + (r0 + v / group) * q_stride + (g * group + v % group) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qs[v * head_dim + d] = src[d] * scale;
      }
      std::fill(acc.begin(), acc.begin() + qvs * head_dim, 0.f);
      std::fill(m.begin(), m.begin() + qvs, -3.0e38f);
      std::fill(l.begin(), l.begin() + qvs, 0.f);
      const int64_t seen = ctx + r0 + rows;    // keys the block's last query sees
      for (int64_t c0 = 0; c0 < seen; c0 += kKeys) {
        const int64_t nk = std::min<int64_t>(kKeys, seen - c0);
        for (int64_t t = 0; t < kKeys; ++t) {
          const int64_t tok = c0 + std::min(t, nk - 1);       // past the end: a repeat, masked below
          const int64_t off = (table[tok / block_size] * block_size + tok % block_size) * token_stride + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) kt[d * kKeys + t] = k_cache[off + d];
          vrow[t] = v_cache + off;
        }
        for (int64_t v = 0; v < qvs; ++v) {
          const int64_t pos = ctx + r0 + v / group;           // this query's position
          if (c0 > pos) continue;                             // every key here is in its future
          const float* qv = qs.data() + v * head_dim;
          rs_f16 s = rs_f16{};
          for (int64_t d = 0; d < head_dim; ++d) s += qv[d] * load16(kt.data() + d * kKeys);
          const int64_t visible = std::min<int64_t>(nk, pos - c0 + 1);
          for (int64_t t = visible; t < kKeys; ++t) s[t] = -3.0e38f;
          const float m_new = std::max(m[v], hmax(s));
          const rs_f16 p = rs_expv<rs_f16, rs_i16>(s - m_new);
          const float corr = rs_expv<rs_f16, rs_i16>(rs_f16{} + (m[v] - m_new))[0];
          float sum = 0.f;
          for (int64_t t = 0; t < visible; ++t) sum += p[t];
          l[v] = l[v] * corr + sum;
          m[v] = m_new;
          float* a = acc.data() + v * head_dim;
          for (int64_t j = 0; j < vecs; ++j) {
            rs_f16 o = load16(a + 16 * j) * corr;
            for (int64_t t = 0; t < visible; ++t) o += p[t] * load16(vrow[t] + 16 * j);
            store16(a + 16 * j, o);
          }
        }
      }
      for (int64_t v = 0; v < qvs; ++v) {
        float* dst = out + (r0 + v / group) * heads * head_dim + (g * group + v % group) * head_dim;
        const float inv = 1.f / l[v];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[v * head_dim + d] * inv;
      }
    }
  }
  return 0;
}

}  // extern "C"
