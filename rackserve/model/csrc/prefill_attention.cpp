// Causal attention of one request's prefill chunk (n queries at positions ctx .. ctx + n - 1)
// against its paged KV cache, the chunk's own K and V already written there: flash attention's
// online softmax over keys 16 at a time, so that no [heads, n, ctx + n] score tensor is written,
// read, masked and soft-maxed in memory (the torch path's passes, 63% of a 512-token chunk's step
// over 1024 cached tokens on SmolLM2), and keys past a query's position are never scored.
//
// Work item: one KV head and 16 query positions, i.e. its group's query heads at those positions
// (48 query vectors on SmolLM2). The item transposes its query vectors once, so that a vector's
// lanes are query vectors (16 on AVX-512, 8 on AVX2), and reads keys and values in the cache's own
// layout (prefill_tiles.h): a key's score against a lane vector is head_dim multiply-adds of the
// query lanes by the key's broadcast elements, with no horizontal sums and no per-key transposition
// (the earlier form of this kernel transposed every 16 keys for every item, a scalar gather that
// took as long as a third of its multiply-adds, which waited on two loads each); the online softmax
// runs lane-wise over whole vectors. A chunk of fewer items than twice the threads (a short chunk
// after a long context: 16 queries x 3 KV heads is 3 items) splits each item's keys into segments
// that threads run apart, then merges their softmax states. Written with GCC's vector extensions
// (vec_exp.h), so that both builds compile it to their own ISA. model/native_ops.py calls
// rs_prefill_attention; the torch backend keeps its two-matmul form for other dtypes and devices.
// A float16 cache (rs_prefill_attention_f16) or an 8-bit float one (kv_fp8.h: _fp8e4m3, _fp8e5m2)
// has each tile's keys and values widened once into float32 rows (F16C) that the same tiles read:
// an item's 16 query rows x its group share each conversion. This file must never allocate
// tensors: the caller passes every buffer.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kv_fp8.h"
#include "prefill_tiles.h"

namespace {

constexpr int kQueryRows = 16;    // query positions of a work item
constexpr int64_t kMinSegment = 256;  // keys: a shorter segment is not worth a merge

enum CacheElem { kFloat32, kFloat16, kFp8E4m3, kFp8E5m2 };

// The call's arguments, which every work item reads.
struct Chunk {
  const float* q;
  int64_t q_stride, n, ctx;
  const void* k_cache;      // of `elem`
  const void* v_cache;
  CacheElem elem;
  const int64_t* table;
  int64_t heads, kv_heads, head_dim, block_size;
  float scale;
};

// One thread's buffers: kQueryRows * group query vectors, a whole number of lane vectors (kLanes
// divides kQueryRows).
struct Scratch {
  std::vector<float> qt, acc, s, p, m, l, corr, pos, kw, vw;   // kw, vw: a float16 tile's keys and values widened
  Scratch(int64_t qv_max, int64_t head_dim)
      : qt(qv_max * head_dim), acc(qv_max * head_dim), s(qv_max * kKeys), p(qv_max * kKeys), m(qv_max),
        l(qv_max), corr(qv_max), pos(qv_max), kw(kKeys * head_dim), vw(kKeys * head_dim) {}
};

// A key's or value's n elements from element `off` (n a multiple of 8) widened into dst, 8 at a time; dst.
template <typename T>
inline const float* widen_as(const void* cache, int64_t off, int64_t n, float* dst) {
  const T* src = static_cast<const T*>(cache) + off;
  for (int64_t i = 0; i < n; i += 8) {
    if constexpr (std::is_same_v<T, uint16_t>)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    else
      _mm256_storeu_ps(dst + i, widen8(src + i));
  }
  return dst;
}
inline const float* widen(CacheElem elem, const void* cache, int64_t off, int64_t n, float* dst) {
  switch (elem) {
    case kFloat16: return widen_as<uint16_t>(cache, off, n, dst);
    case kFp8E4m3: return widen_as<fp8e4m3>(cache, off, n, dst);
    default: return widen_as<fp8e5m2>(cache, off, n, dst);
  }
}

// Rows r0 .. r0 + rows of KV head g against keys [k0, k1): the item's query vectors' unnormalised
// sums (w.acc), running maxima (w.m) and sums of probabilities (w.l).
void run_item(const Chunk& c, Scratch& w, int64_t g, int64_t r0, int64_t rows, int64_t k0, int64_t k1) {
  const int64_t group = c.heads / c.kv_heads, head_dim = c.head_dim, vecs = head_dim / kLanes;
  const int64_t token_stride = c.kv_heads * head_dim, lane_block = head_dim * kLanes;
  const int64_t qvs = rows * group, lvs = (qvs + kLanes - 1) / kLanes;
  // Query vector v = (row v / group, head g * group + v % group), scaled, at lane v % kLanes of
  // lane vector v / kLanes. Lanes past the last row: zero queries at its position (never read out).
  for (int64_t v = 0; v < lvs * kLanes; ++v) {
    float* dst = w.qt.data() + (v / kLanes) * lane_block + v % kLanes;
    const int64_t row = std::min(v / group, rows - 1);
    const float* src = c.q + (r0 + row) * c.q_stride + (g * group + v % group) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d * kLanes] = v < qvs ? src[d] * c.scale : 0.f;
    w.pos[v] = static_cast<float>(c.ctx + r0 + row);
  }
  std::fill(w.acc.begin(), w.acc.begin() + qvs * head_dim, 0.f);
  std::fill(w.m.begin(), w.m.begin() + lvs * kLanes, -3.0e38f);
  std::fill(w.l.begin(), w.l.begin() + lvs * kLanes, 0.f);
  const float* krow[kKeys];
  const float* vrow[kKeys];
  for (int64_t c0 = k0; c0 < k1; c0 += kKeys) {
    const int64_t nk = std::min<int64_t>(kKeys, k1 - c0);
    // The key's block and offset stepped along, not divided out per key (a 64-bit division a key).
    int64_t blk = c0 / c.block_size, in_blk = c0 % c.block_size;
    for (int64_t t = 0; t < kKeys; ++t) {
      // past the end: a repeat of the last key, masked (k1 < c0 + kKeys only where k1 is `seen`)
      const int64_t off = (c.table[blk] * c.block_size + in_blk) * token_stride + g * head_dim;
      if (c.elem != kFloat32) {
        krow[t] = widen(c.elem, c.k_cache, off, head_dim, w.kw.data() + t * head_dim);
        vrow[t] = widen(c.elem, c.v_cache, off, head_dim, w.vw.data() + t * head_dim);
      } else {
        krow[t] = static_cast<const float*>(c.k_cache) + off;
        vrow[t] = static_cast<const float*>(c.v_cache) + off;
      }
      if (t + 1 < nk && ++in_blk == c.block_size) in_blk = 0, ++blk;
    }
    // Positions grow with v: lane vectors before `first` have every key here in their future.
    int64_t first = 0;
    while (w.pos[first * kLanes + kLanes - 1] < c0) ++first;
    for (int64_t lv = first; lv < lvs; lv += kScoreLanes) {
      const float* qb = w.qt.data() + lv * lane_block;
      float* sb = w.s.data() + lv * kKeys * kLanes;
      switch (std::min<int64_t>(kScoreLanes, lvs - lv)) {
        case 1: score<1>(qb, lane_block, krow, head_dim, sb); break;
        case 2: score<2>(qb, lane_block, krow, head_dim, sb); break;
        default: score<3>(qb, lane_block, krow, head_dim, sb); break;
      }
    }
    for (int64_t lv = first; lv < lvs; ++lv) {
      const int64_t o = lv * kLanes;
      softmax_step(w.s.data() + o * kKeys, w.p.data() + o * kKeys, w.m.data() + o, w.l.data() + o,
                   w.corr.data() + o, loadv(w.pos.data() + o), static_cast<float>(c0), c0 + kKeys - 1 > w.pos[o]);
    }
    for (int64_t v = first * kLanes; v < qvs; v += kValQ) {
      const int nq = static_cast<int>(std::min<int64_t>(kValQ, qvs - v));
      const int64_t visible = std::min<int64_t>(kKeys, static_cast<int64_t>(w.pos[v + nq - 1]) - c0 + 1);
      if (visible <= 0) continue;
      float* a[kValQ];
      const float* pq[kValQ];
      for (int i = 0; i < nq; ++i) {
        a[i] = w.acc.data() + (v + i) * head_dim;
        pq[i] = w.p.data() + ((v + i) / kLanes) * kKeys * kLanes + (v + i) % kLanes;
      }
      const float* cq = w.corr.data() + v;
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
}

// q: row i (position ctx + i) of the chunk at q + i * q_stride, heads of head_dim contiguous.
// k_cache, v_cache: [blocks, block_size, kv_heads, head_dim], of `elem`; table: the
// request's blocks, covering ctx + n tokens. out: [n, heads * head_dim]. head_dim a multiple of 16,
// at most 256.
int prefill_attention(const float* q, int64_t q_stride, int64_t n, int64_t ctx, const void* k_cache,
                      const void* v_cache, CacheElem elem, const int64_t* table, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int64_t block_size, float scale, float* out, int threads) {
  if (head_dim % 16 || head_dim > 256 || n < 1 || ctx < 0 || heads % kv_heads || threads < 1) return -1;
  const Chunk c{q, q_stride, n, ctx, k_cache, v_cache, elem, table, heads, kv_heads, head_dim, block_size, scale};
  const int64_t group = heads / kv_heads, qv_max = kQueryRows * group;
  const int64_t row_blocks = (n + kQueryRows - 1) / kQueryRows, items = kv_heads * row_blocks;
  const int64_t splits = std::max<int64_t>(1, std::min((2 * threads + items - 1) / items, (ctx + 1) / kMinSegment));
  // Each segment's state (qv_max sums of head_dim, maxima, probability sums), merged below.
  const int64_t state = qv_max * (head_dim + 2);
  std::vector<float> parts(splits > 1 ? items * splits * state : 0);
#pragma omp parallel num_threads(threads)
  {
    Scratch w(qv_max, head_dim);
    // Later row blocks see more keys: the last ones first, dynamically, so that threads end together.
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < items * splits; ++unit) {
      const int64_t item = unit / splits, g = item % kv_heads, rb = row_blocks - 1 - item / kv_heads;
      const int64_t r0 = rb * kQueryRows, rows = std::min<int64_t>(kQueryRows, n - r0), qvs = rows * group;
      const int64_t seen = ctx + r0 + rows;    // keys the block's last query sees
      const int64_t per = ((seen + kKeys - 1) / kKeys + splits - 1) / splits * kKeys;
      const int64_t k0 = std::min(seen, unit % splits * per);
      run_item(c, w, g, r0, rows, k0, std::min(seen, k0 + per));
      if (splits > 1) {
        float* part = parts.data() + unit * state;
        std::copy(w.acc.begin(), w.acc.begin() + qvs * head_dim, part);
        std::copy(w.m.begin(), w.m.begin() + qvs, part + qv_max * head_dim);
        std::copy(w.l.begin(), w.l.begin() + qvs, part + qv_max * (head_dim + 1));
        continue;
      }
      for (int64_t v = 0; v < qvs; ++v) {
        float* dst = out + (r0 + v / group) * heads * head_dim + (g * group + v % group) * head_dim;
        const float inv = 1.f / w.l[v];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = w.acc[v * head_dim + d] * inv;
      }
    }
    if (splits > 1) {
      // Each query vector: its segments' sums, each scaled by exp(its max - the overall max).
#pragma omp for schedule(static)
      for (int64_t item = 0; item < items; ++item) {
        const int64_t g = item % kv_heads, rb = row_blocks - 1 - item / kv_heads;
        const int64_t r0 = rb * kQueryRows, rows = std::min<int64_t>(kQueryRows, n - r0);
        const float* first = parts.data() + item * splits * state;
        for (int64_t v = 0; v < rows * group; ++v) {
          float* dst = out + (r0 + v / group) * heads * head_dim + (g * group + v % group) * head_dim;
          float mx = -3.0e38f, l = 0.f;
          for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, first[sp * state + qv_max * head_dim + v]);
          std::fill(dst, dst + head_dim, 0.f);
          for (int64_t sp = 0; sp < splits; ++sp) {
            const float* part = first + sp * state;
            const float f = std::exp(part[qv_max * head_dim + v] - mx);
            l += f * part[qv_max * (head_dim + 1) + v];
            for (int64_t d = 0; d < head_dim; ++d) dst[d] += f * part[v * head_dim + d];
          }
          const float inv = 1.f / l;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] *= inv;
        }
      }
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// prefill_attention's arguments over a float32 cache, a float16 one (IEEE half bits) and the 8-bit
// floats' (their codes).
int rs_prefill_attention(const float* q, int64_t q_stride, int64_t n, int64_t ctx, const float* k_cache,
                         const float* v_cache, const int64_t* table, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, int64_t block_size, float scale, float* out, int threads) {
  return prefill_attention(q, q_stride, n, ctx, k_cache, v_cache, kFloat32, table, heads, kv_heads, head_dim,
                           block_size, scale, out, threads);
}

int rs_prefill_attention_f16(const float* q, int64_t q_stride, int64_t n, int64_t ctx, const uint16_t* k_cache,
                             const uint16_t* v_cache, const int64_t* table, int64_t heads, int64_t kv_heads,
                             int64_t head_dim, int64_t block_size, float scale, float* out, int threads) {
  return prefill_attention(q, q_stride, n, ctx, k_cache, v_cache, kFloat16, table, heads, kv_heads, head_dim,
                           block_size, scale, out, threads);
}

int rs_prefill_attention_fp8e4m3(const float* q, int64_t q_stride, int64_t n, int64_t ctx, const uint8_t* k_cache,
                                 const uint8_t* v_cache, const int64_t* table, int64_t heads, int64_t kv_heads,
                                 int64_t head_dim, int64_t block_size, float scale, float* out, int threads) {
  return prefill_attention(q, q_stride, n, ctx, k_cache, v_cache, kFp8E4m3, table, heads, kv_heads, head_dim,
                           block_size, scale, out, threads);
}

int rs_prefill_attention_fp8e5m2(const float* q, int64_t q_stride, int64_t n, int64_t ctx, const uint8_t* k_cache,
                                 const uint8_t* v_cache, const int64_t* table, int64_t heads, int64_t kv_heads,
                                 int64_t head_dim, int64_t block_size, float scale, float* out, int threads) {
  return prefill_attention(q, q_stride, n, ctx, k_cache, v_cache, kFp8E5m2, table, heads, kv_heads, head_dim,
                           block_size, scale, out, threads);
}

}  // extern "C"
