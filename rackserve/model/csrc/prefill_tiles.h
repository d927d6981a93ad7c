// The register tiles of csrc/prefill_attention.cpp, for one work item's query vectors transposed
// into lane vectors (a vector's lanes are query vectors): a tile's scores against keys in the cache's
// own layout, its online-softmax step over whole vectors, and the value accumulation. This header
// must hold only inline code that prefill_attention.cpp includes (native.py hashes it into the builds).
#pragma once
#include <cstdint>
#include <cstring>

#include "vec_exp.h"

namespace {

#ifdef __AVX512F__
typedef rs_f16 vf;
typedef rs_i16 vi;
constexpr int kLanes = 16;
constexpr int kValQ = 4;        // query vectors sharing each loaded value vector: 16 accumulators
constexpr int kKeyBlock = 8;    // keys scored at once against up to kScoreLanes lane vectors: 24
                                // accumulators (4 measured within 0-7% of 8; 6 value queries 1.7x slower)
#else
typedef rs_f8 vf;               // AVX2 has 16 registers: 8 lanes, fewer shared
typedef rs_i8 vi;
constexpr int kLanes = 8;
constexpr int kValQ = 3;        // 12 accumulators
constexpr int kKeyBlock = 4;    // 12
#endif
constexpr int kKeys = 16;       // keys a tile: one online-softmax step
constexpr int kScoreLanes = 3;

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

// add_values over head_dim (vecs vectors), 4 vectors at a time.
template <int NQ>
inline void add_values_all(float* const* acc, const float* corr, const float* const* p, const float* const* vrow,
                           int64_t visible, int64_t vecs) {
  int64_t j = 0;
  for (; j + 4 <= vecs; j += 4) add_values<NQ, 4>(acc, corr, p, vrow, visible, kLanes * j);
  for (; j < vecs; ++j) add_values<NQ, 1>(acc, corr, p, vrow, visible, kLanes * j);
}

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
