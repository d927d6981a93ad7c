// Causal attention of one request's prefill chunk (n queries at positions ctx .. ctx + n - 1)
// against its paged KV cache, the chunk's own K and V already written there: flash attention's
// online softmax over keys 16 at a time, so that no [heads, n, ctx + n] score tensor is written,
// read, masked and soft-maxed in memory (the torch path's passes, 63% of a 512-token chunk's step
// over 1024 cached tokens on SmolLM2), and keys past a query's position are never scored.
//
// Work item: one KV head and 16 query positions, i.e. its group's query heads at those positions
// (48 query vectors on SmolLM2). The item transposes its query vectors once, so that a vector's
// lanes are query vectors (16 on AVX-512, 8 on AVX2), and reads keys and values in the cache's own
// layout: a key's score against a lane vector is head_dim multiply-adds of the query lanes by the
// key's broadcast elements (no horizontal sums, no per-key transposition: the earlier form of this
// kernel transposed every 16 keys for every item, a scalar gather as long as the scoring), 4 keys
// times up to 3 lane vectors at once so that each loaded vector feeds several multiply-adds. The
// online softmax then runs lane-wise over whole vectors (max, exp, sums), and the values are added
// to the accumulators of kValQ query vectors at a time, each loaded value vector shared by them.
// Written with GCC's vector extensions (vec_exp.h), so that both builds compile it to their own ISA.
// model/native_ops.py calls rs_prefill_attention; the torch backend keeps its two-matmul form for
// other dtypes and devices. This file must never allocate tensors: the caller passes every buffer.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec_exp.h"

namespace {

#ifdef __AVX512F__
typedef rs_f16 vf;
typedef rs_i16 vi;
constexpr int kLanes = 16;
constexpr int kValQ = 4;        // query vectors sharing each loaded value vector: 16 accumulators
constexpr int kKeyBlock = 8;    // keys scored at once against up to kScoreLanes lane vectors: 24
#else
typedef rs_f8 vf;               // AVX2 has 16 registers: 8 lanes, fewer shared
typedef rs_i8 vi;
constexpr int kLanes = 8;
constexpr int kValQ = 3;
constexpr int kKeyBlock = 4;
#endif
constexpr int kKeys = 16;       // keys a tile: one online-softmax step
constexpr int kScoreLanes = 3;
constexpr int kQueryRows = 16;  // query positions of a work item

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// s[l][t] (lanes) = qt[l] . krow[t] for NL lane vectors of transposed, scaled queries (qt: NL
// blocks of [head_dim][kLanes], qt_stride floats apart) and the tile's kKeys keys.
template <int NL>
inline void score(const float* qt, int64_t qt_stride, const float* const* krow, int64_t head_dim, float* s) {
  for (int t0 = 0; t0 < kKeys; t0 += kKeyBlock) {
    vf acc[NL][kKeyBlock] = {};
    const float* k[kKeyBlock];
#pragma GCC unroll 8
    for (int u = 0; u < kKeyBlock; ++u) k[u] = krow[t0 + u];
    for (int64_t d = 0; d < head_dim; ++d) {
      vf qv[NL];
#pragma GCC unroll 4
      for (int l = 0; l < NL; ++l) qv[l] = loadv(qt + l * qt_stride + d * kLanes);
#pragma GCC unroll 8
      for (int u = 0; u < kKeyBlock; ++u) {
        const float kd = k[u][d];
#pragma GCC unroll 4
        for (int l = 0; l < NL; ++l) acc[l][u] += qv[l] * kd;
      }
    }
#pragma GCC unroll 4
    for (int l = 0; l < NL; ++l)
#pragma GCC unroll 8
      for (int u = 0; u < kKeyBlock; ++u) storev(s + (l * kKeys + t0 + u) * kLanes, acc[l][u]);
  }
}

// acc[q][off .. off + kVecs vectors) = acc[q] * corr[q] + sum over t < visible of p[q][t] * vrow[t][off ..],
// p[q][t] at p[q] + t * kLanes: each value vector is loaded once for the NQ query vectors.
template <int NQ, int kVecs>
inline void add_values(float* const* acc, const float* corr, const float* const* p, const float* const* vrow,
                       int64_t visible, int64_t off) {
  vf o[NQ][kVecs];
#pragma GCC unroll 4
  for (int q = 0; q < NQ; ++q)
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) {
      o[q][j] = loadv(acc[q] + off + kLanes * j);
      if (corr[q] != 1.f) o[q][j] *= corr[q];
    }
  for (int64_t t = 0; t < visible; ++t) {
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) {
      const vf vv = loadv(vrow[t] + off + kLanes * j);
#pragma GCC unroll 4
      for (int q = 0; q < NQ; ++q) o[q][j] += p[q][t * kLanes] * vv;
    }
  }
#pragma GCC unroll 4
  for (int q = 0; q < NQ; ++q)
#pragma GCC unroll 4
    for (int j = 0; j < kVecs; ++j) storev(acc[q] + off + kLanes * j, o[q][j]);
}

template <int NQ>
inline void add_values_all(float* const* acc, const float* corr, const float* const* p, const float* const* vrow,
                           int64_t visible, int64_t vecs) {
  int64_t j = 0;
  for (; j + 4 <= vecs; j += 4) add_values<NQ, 4>(acc, corr, p, vrow, visible, kLanes * j);
  for (; j < vecs; ++j) add_values<NQ, 1>(acc, corr, p, vrow, visible, kLanes * j);
}

}  // namespace

namespace {

// One lane vector's online-softmax step over a tile: s ([kKeys][kLanes] scores) to p (the
// probabilities, same layout), its running max m and sum l updated, corr = exp(m_old - m_new), which
// is exactly 1 where the max held. `masked`: some lane does not see every key (key c0 + t is seen by
// a lane at position pos when c0 + t <= pos).
inline void softmax_step(const float* s, float* p, float* m, float* l, float* corr, vf pos, float c0, bool masked) {
  const vf m_old = loadv(m), none = vf{} - 3.0e38f;
  vf m_new = m_old;
#pragma GCC unroll 16
  for (int t = 0; t < kKeys; ++t) {
    vf x = loadv(s + t * kLanes);
    if (masked) x = (c0 + t <= pos) ? x : none;
    m_new = m_new > x ? m_new : x;
  }
  vf sum = {};
#pragma GCC unroll 16
  for (int t = 0; t < kKeys; ++t) {
    vf e = rs_expv<vf, vi>(loadv(s + t * kLanes) - m_new);
    if (masked) e = (c0 + t <= pos) ? e : vf{};
    storev(p + t * kLanes, e);
    sum += e;
  }
  const vf c = rs_expv<vf, vi>(m_old - m_new);
  storev(l, loadv(l) * c + sum);
  storev(m, m_new);
  storev(corr, c);
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
  const int64_t group = heads / kv_heads, vecs = head_dim / kLanes;
  const int64_t row_blocks = (n + kQueryRows - 1) / kQueryRows, items = kv_heads * row_blocks;
  const int64_t token_stride = kv_heads * head_dim, lane_block = head_dim * kLanes;
#pragma omp parallel num_threads(threads)
  {
    // kQueryRows * group query vectors: a whole number of lane vectors, as kLanes divides kQueryRows.
    const int64_t qv_max = kQueryRows * group;
    std::vector<float> qt(qv_max * head_dim), acc(qv_max * head_dim), s(qv_max * kKeys), p(qv_max * kKeys);
    std::vector<float> m(qv_max), l(qv_max), corr(qv_max), pos(qv_max);
    const float* krow[kKeys];
    const float* vrow[kKeys];
    // Later row blocks see more keys: the last ones first, dynamically, so that threads end together.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t g = item % kv_heads, rb = row_blocks - 1 - item / kv_heads;
      const int64_t r0 = rb * kQueryRows, rows = std::min<int64_t>(kQueryRows, n - r0);
      const int64_t qvs = rows * group, lvs = (qvs + kLanes - 1) / kLanes;
      // Query vector v = (row v / group, head g * group + v % group), scaled, at lane v % kLanes of
      // lane vector v / kLanes. Lanes past the last row: zero queries at its position (never read out).
      for (int64_t v = 0; v < lvs * kLanes; ++v) {
        float* dst = qt.data() + (v / kLanes) * lane_block + v % kLanes;
        const float* src = q + (r0 + v / group) * q_stride + (g * group + v % group) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d * kLanes] = v < qvs ? src[d] * scale : 0.f;
        pos[v] = static_cast<float>(ctx + r0 + std::min(v / group, rows - 1));
      }
      std::fill(acc.begin(), acc.begin() + qvs * head_dim, 0.f);
      std::fill(m.begin(), m.begin() + lvs * kLanes, -3.0e38f);
      std::fill(l.begin(), l.begin() + lvs * kLanes, 0.f);
      const int64_t seen = ctx + r0 + rows;    // keys the block's last query sees
      for (int64_t c0 = 0; c0 < seen; c0 += kKeys) {
        const int64_t nk = std::min<int64_t>(kKeys, seen - c0);
        // The key's block and offset stepped along, not divided out per key (a 64-bit division a key).
        int64_t blk = c0 / block_size, in_blk = c0 % block_size;
        for (int64_t t = 0; t < kKeys; ++t) {
          // past the end: a repeat of the last key, masked below
          const int64_t off = (table[blk] * block_size + in_blk) * token_stride + g * head_dim;
          krow[t] = k_cache + off;
          vrow[t] = v_cache + off;
          if (t + 1 < nk && ++in_blk == block_size) in_blk = 0, ++blk;
        }
        // Positions grow with v: lane vectors before `first` have every key here in their future.
        int64_t first = 0;
        while (pos[first * kLanes + kLanes - 1] < c0) ++first;
        for (int64_t lv = first; lv < lvs; lv += kScoreLanes) {
          const float* qb = qt.data() + lv * lane_block;
          float* sb = s.data() + lv * kKeys * kLanes;
          switch (std::min<int64_t>(kScoreLanes, lvs - lv)) {
            case 1: score<1>(qb, lane_block, krow, head_dim, sb); break;
            case 2: score<2>(qb, lane_block, krow, head_dim, sb); break;
            default: score<3>(qb, lane_block, krow, head_dim, sb); break;
          }
        }
        for (int64_t lv = first; lv < lvs; ++lv) {
          const int64_t o = lv * kLanes;
          softmax_step(s.data() + o * kKeys, p.data() + o * kKeys, m.data() + o, l.data() + o, corr.data() + o,
                       loadv(pos.data() + o), static_cast<float>(c0), c0 + kKeys - 1 > pos[o]);
        }
        for (int64_t v = first * kLanes; v < qvs; v += kValQ) {
          const int nq = static_cast<int>(std::min<int64_t>(kValQ, qvs - v));
          const int64_t visible = std::min<int64_t>(kKeys, static_cast<int64_t>(pos[v + nq - 1]) - c0 + 1);
          if (visible <= 0) continue;
          float* a[kValQ];
          const float* pq[kValQ];
          for (int i = 0; i < nq; ++i) {
            a[i] = acc.data() + (v + i) * head_dim;
            pq[i] = p.data() + ((v + i) / kLanes) * kKeys * kLanes + (v + i) % kLanes;
          }
          const float* cq = corr.data() + v;
          switch (nq) {
            case 1: add_values_all<1>(a, cq, pq, vrow, visible, vecs); break;
            case 2: add_values_all<2>(a, cq, pq, vrow, visible, vecs); break;
            case 3: add_values_all<3>(a, cq, pq, vrow, visible, vecs); break;
#ifdef __AVX512F__
            default: add_values_all<4>(a, cq, pq, vrow, visible, vecs); break;
#endif
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
