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
// running sums and adds the 16 values weighted by their probabilities. A row's query vectors (its
// group's heads) go through a block together, so each loaded key and value vector feeds all of
// them (one alone left the kernel waiting on loads). Written with GCC's vector
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

// Tree reductions by whole-vector shuffles: indexing a vector's lanes one by one makes GCC store
// it and reload each lane, which stalled the first form of this kernel to ~20 GFLOP/s.
// Lane i takes lane i ^ K.
template <int K>
inline rs_f16 lanes_xor(rs_f16 v) {
  return __builtin_shufflevector(v, v, 0 ^ K, 1 ^ K, 2 ^ K, 3 ^ K, 4 ^ K, 5 ^ K, 6 ^ K, 7 ^ K, 8 ^ K, 9 ^ K,
                                 10 ^ K, 11 ^ K, 12 ^ K, 13 ^ K, 14 ^ K, 15 ^ K);
}

inline float hmax(rs_f16 v) {
  rs_f16 w = lanes_xor<8>(v);
  v = v > w ? v : w;
  w = lanes_xor<4>(v);
  v = v > w ? v : w;
  w = lanes_xor<2>(v);
  v = v > w ? v : w;
  w = lanes_xor<1>(v);
  v = v > w ? v : w;
  return v[0];
}

inline float hsum(rs_f16 v) {
  v += lanes_xor<8>(v);
  v += lanes_xor<4>(v);
  v += lanes_xor<2>(v);
  v += lanes_xor<1>(v);
  return v[0];
}

// The query vectors of one row that share each loaded key and value: a loaded 16-key vector
// feeding one multiply-add alone made the first form of this kernel wait on loads (two a
// multiply-add); shared by kQueries it feeds kQueries. AVX2 runs an rs_f16 as two of its 16
// registers, so it shares by two.
#ifdef __AVX512F__
constexpr int kQueries = 4;
#else
constexpr int kQueries = 2;
#endif

// acc[q][off .. off + 16 kVecs) = acc[q] * corr[q] + sum over t < visible of p[q][t] * vrow[t][off ..],
// for the NQ query vectors at once: each value vector is loaded once for all of them.
template <int NQ, int kVecs>
inline void add_values(float* const* acc, const float* corr, const float (*p)[kKeys], const float* const* vrow,
                       int64_t visible, int64_t off) {
  rs_f16 o[NQ][kVecs];
#pragma GCC unroll 4
  for (int q = 0; q < NQ; ++q)
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) {
      o[q][j] = load16(acc[q] + off + 16 * j);
      if (corr[q] != 1.f) o[q][j] *= corr[q];
    }
  for (int64_t t = 0; t < visible; ++t) {
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) {
      const rs_f16 vv = load16(vrow[t] + off + 16 * j);
#pragma GCC unroll 4
      for (int q = 0; q < NQ; ++q) o[q][j] += p[q][t] * vv;
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < NQ; ++q)
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) store16(acc[q] + off + 16 * j, o[q][j]);
}

// NQ query vectors of one position (qv[q], scaled) against 16 transposed keys kt ([head_dim][16]),
// of which the first `visible` are in their past: each one's online softmax (m, l) and accumulator
// updated. Per query the same operations in the same order as one at a time (the compiler may
// fuse a multiply and an add differently: within an ulp or two of it).
template <int NQ>
inline void attend(const float* const* qv, float* m, float* l, float* const* acc, const float* kt,
                   const float* const* vrow, int64_t visible, int64_t head_dim) {
  // Four independent sums a query: one chain of head_dim multiply-adds waits on each one's latency.
  rs_f16 s4[NQ][4] = {};
  for (int64_t d = 0; d < head_dim; d += 4) {
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const rs_f16 k = load16(kt + (d + u) * kKeys);
#pragma GCC unroll 4
      for (int q = 0; q < NQ; ++q) s4[q][u] += qv[q][d + u] * k;
    }
  }
  const rs_f16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const rs_i16 seen_mask = lane < static_cast<float>(visible);
  alignas(64) float pw[NQ][kKeys];
  float corr[NQ];
#pragma GCC unroll 4
  for (int q = 0; q < NQ; ++q) {
    rs_f16 s = (s4[q][0] + s4[q][1]) + (s4[q][2] + s4[q][3]);
    s = seen_mask ? s : rs_f16{} - 3.0e38f;
    const float m_new = std::max(m[q], hmax(s));
    rs_f16 p = rs_expv<rs_f16, rs_i16>(s - m_new);
    p = seen_mask ? p : rs_f16{};
    // exp(0) is exactly 1: skip it where the running max held, as it mostly does past the first keys.
    corr[q] = m_new == m[q] ? 1.f : rs_expv<rs_f16, rs_i16>(rs_f16{} + (m[q] - m_new))[0];
    l[q] = l[q] * corr[q] + hsum(p);
    m[q] = m_new;
    std::memcpy(pw[q], &p, sizeof pw[q]);
  }
  const int64_t vecs = head_dim / 16;
  int64_t j = 0;
  for (; j + 4 <= vecs; j += 4) add_values<NQ, 4>(acc, corr, pw, vrow, visible, 16 * j);
  for (; j < vecs; ++j) add_values<NQ, 1>(acc, corr, pw, vrow, visible, 16 * j);
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
        // The key's block and offset stepped along, not divided out per key (a 64-bit division a key).
        int64_t blk = c0 / block_size, in_blk = c0 % block_size;
        for (int64_t t = 0; t < kKeys; ++t) {
          // past the end: a repeat of the last key, masked below
          const int64_t off = (table[blk] * block_size + in_blk) * token_stride + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) kt[d * kKeys + t] = k_cache[off + d];
          vrow[t] = v_cache + off;
          if (t + 1 < nk && ++in_blk == block_size) in_blk = 0, ++blk;
        }
        // Row by row, the row's query vectors (its group's heads: consecutive v) kQueries at a time.
        for (int64_t v0 = 0; v0 < qvs; v0 += group) {
          const int64_t pos = ctx + r0 + v0 / group;          // this row's position
          if (c0 > pos) continue;                             // every key here is in its future
          const int64_t visible = std::min<int64_t>(nk, pos - c0 + 1);
          for (int64_t v = v0; v < v0 + group; v += kQueries) {
            const int nq = static_cast<int>(std::min<int64_t>(kQueries, v0 + group - v));
            const float* qv[kQueries];
            float* a[kQueries];
            for (int q = 0; q < nq; ++q) {
              qv[q] = qs.data() + (v + q) * head_dim;
              a[q] = acc.data() + (v + q) * head_dim;
            }
            float* mv = m.data() + v;
            float* lv = l.data() + v;
            switch (nq) {
              case 1: attend<1>(qv, mv, lv, a, kt.data(), vrow.data(), visible, head_dim); break;
              case 2: attend<2>(qv, mv, lv, a, kt.data(), vrow.data(), visible, head_dim); break;
#ifdef __AVX512F__
              case 3: attend<3>(qv, mv, lv, a, kt.data(), vrow.data(), visible, head_dim); break;
              default: attend<4>(qv, mv, lv, a, kt.data(), vrow.data(), visible, head_dim); break;
#endif
            }
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
