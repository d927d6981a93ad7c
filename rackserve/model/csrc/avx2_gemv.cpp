// y = x W^T for GGUF Q4_0 / Q4_1 / Q8_0 weights, for a few rows of x (decode), with AVX2 + FMA +
// F16C: vnni_gemv.cpp's method and numerics for CPUs without AVX-512 (AMD Zen 2/3, Intel before
// Ice Lake), built only into the "avx2" library (model/native.py).
//
// Each block of 32 of a row of x is written as dx * q + dr * r (two int8 parts, with their integer
// sums and the block's float sum) exactly as there. AVX2 has no vpdpbusd; its sum of four u8 x s8
// products into an int32 lane is vpmaddubsw (pairs into int16) then vpmaddwd by ones (pairs of
// int16 into int32), llama.cpp's AVX2 path. Output rows are interleaved 8 at a time (the 8 int32
// lanes of a ymm), so a block's 8 scales are one vector. Per tile and block the record holds
//   codes: Q4_*: 128 bytes, byte (j, r, i) = code[r][4j + i] | code[r][16 + 4j + i] << 4
//          Q8_0: 256 bytes, byte (j, r, i) = q[r][4j + i] as int8 (signed: vpmaddubsw's unsigned
//          side takes |q| and the activation takes q's sign, so no int16 pair saturates:
//          2 * 128 * 127 < 2^15; an offset code q + 128 would)
//   d[8] fp16, then (Q4_1) m[8] fp16,
// and a block's product is d * (dx * (sum(code q) - 8 sum(q)) + dr * (sum(code r) - 8 sum(r)))
// for Q4_0, d * (dx sum(code q) + dr sum(code r)) (+ m * sum(x) for Q4_1) otherwise: GGUF's
// numerics. quant/avx2_linear.py packs the records and calls rs_avx2_gemv through ctypes.
// This file must never allocate or own weights.
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <algorithm>
#include "quantized_rows.h"

namespace {

constexpr int kGroup = 32;
constexpr int kTile = 8;

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t hsum(__m256i v) {
  __m128i m = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(m, _mm_shuffle_epi32(m, 0xB1)));
}

// Rounds the 32 values v / d to int8 (nearest even, as vnni_gemv.cpp's; |v / d| <= 127 by the
// choice of d) into out; returns them as int32 in q.
inline void to_int8(const __m256 v[4], float d, int8_t* out, __m256i q[4]) {
  const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // packs work within 128-bit lanes: the permute puts the 32 bytes back in order.
  __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), b);
}

inline float abs_max(const __m256 v[4]) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1]));
  m = _mm256_max_ps(m, _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  return hmax(m);
}

// x = dx * q + dr * r per block, as vnni_gemv.cpp's quantize_rows: into the calling thread's own
// buffers (quantized_rows.h), kept from call to call. With kFixedResidual (the rows of tile_rows)
// dr = dx / 2^kResidualBits, as vnni_gemv.cpp's: the two integer sums of a block then join exactly
// into one (2^kResidualBits sum(code q) + sum(code r)), converted and scaled once; the residual
// (|x - dx q| <= dx / 2) is clamped to +-127 dr (a tie would round to 128, which int8 cannot hold).
// Otherwise (tile_dot's few rows) dr = max|residual| / 127.
constexpr int kResidualBits = 8;

template <bool kFixedResidual>
const QuantizedRows& quantize_rows(const float* x, int64_t rows, int64_t k, int threads) {
  const int64_t n = rows * (k / kGroup);
  thread_local QuantizedRows out;
  out.fit(rows, k, kGroup);
  QuantizedRows& o = out;   // the calling thread's buffers, filled by the team below
  // A prefill chunk's rows split over the threads (as vnni_gemv.cpp); a decode batch's few blocks
  // stay on the calling thread, where waking the team would cost more.
#pragma omp parallel for num_threads(threads) if (n >= 2048) schedule(static)
  for (int64_t b = 0; b < n; ++b) {
    const float* xb = x + b * kGroup;
    __m256 v[4], res[4];
    __m256i q[4], s[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    const float d = abs_max(v) / 127.f;
    to_int8(v, d, o.q.data() + b * kGroup, q);
    for (int i = 0; i < 4; ++i) res[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q[i]), _mm256_set1_ps(d), v[i]);
    float dr;
    if constexpr (kFixedResidual) {
      dr = d * (1.f / (1 << kResidualBits));
      const __m256 hi = _mm256_set1_ps(127.f * dr), lo = _mm256_set1_ps(-127.f * dr);
      for (int i = 0; i < 4; ++i) res[i] = _mm256_max_ps(_mm256_min_ps(res[i], hi), lo);
    } else {
      dr = abs_max(res) / 127.f;
    }
    to_int8(res, dr, o.r.data() + b * kGroup, s);
    o.dx[b] = d;
    o.dr[b] = dr;
    o.fsum[b] = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    o.qsum[b] = hsum(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    o.rsum[b] = hsum(_mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3])));
  }
  return out;
}

// How far ahead of its block tile_dot asks for the weight's bytes: as vnni_gemv.cpp's kPrefetch
// (bench/avx2_decode_gemv_ab.py builds other distances with -DRS_AVX2_PREFETCH=...).
#ifndef RS_AVX2_PREFETCH
#define RS_AVX2_PREFETCH 4096
#endif
constexpr int kPrefetch = RS_AVX2_PREFETCH;

// One tile (8 output rows) times row `row` of x: 8 outputs.
template <int kKind>   // 0: Q4_0, 1: Q4_1, 2: Q8_0
inline __m256 tile_dot(const uint8_t* rec, int64_t nb, const QuantizedRows& x, int64_t row, int64_t k) {
  constexpr int kCodeBytes = kKind == 2 ? 256 : 128;
  constexpr int kRecBytes = kCodeBytes + (kKind == 1 ? 32 : 16);
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int32_t* xq = reinterpret_cast<const int32_t*>(x.q.data() + row * k);
  const int32_t* xr = reinterpret_cast<const int32_t*>(x.r.data() + row * k);
  const float *dx = x.dx.data() + row * nb, *dr = x.dr.data() + row * nb, *fsum = x.fsum.data() + row * nb;
  const int32_t *qsum = x.qsum.data() + row * nb, *rsum = x.rsum.data() + row * nb;
  __m256 acc = _mm256_setzero_ps(), acc_r = _mm256_setzero_ps(), acc_min = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, rec += kRecBytes, xq += 8, xr += 8) {
    for (int c = 0; c < kRecBytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetch + c), _MM_HINT_T0);
    __m256i s, t;   // sum(code * q), sum(code * r) per output row
    if constexpr (kKind == 2) {
      s = t = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * j)), a = _mm256_abs_epi8(v);
        const __m256i sq = _mm256_sign_epi8(_mm256_set1_epi32(xq[j]), v), sr = _mm256_sign_epi8(_mm256_set1_epi32(xr[j]), v);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(a, sq), ones));
        t = _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(a, sr), ones));
      }
    } else {
      // 4-bit codes: the 8 int16 pair sums of a block stay under 8 * 2 * 15 * 127 < 2^15, so they
      // are added as int16 and widened once.
      __m256i s16 = _mm256_setzero_si256(), t16 = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * j));
        const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        s16 = _mm256_add_epi16(s16, _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[j])),
                                                     _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[j + 4]))));
        t16 = _mm256_add_epi16(t16, _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xr[j])),
                                                     _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xr[j + 4]))));
      }
      s = _mm256_madd_epi16(s16, ones);
      t = _mm256_madd_epi16(t16, ones);
      if constexpr (kKind == 0) {
        s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * qsum[b]));
        t = _mm256_sub_epi32(t, _mm256_set1_epi32(8 * rsum[b]));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kCodeBytes)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(dx[b])), acc);
    acc_r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d, _mm256_set1_ps(dr[b])), acc_r);
    if constexpr (kKind == 1) {
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kCodeBytes + 16)));
      acc_min = _mm256_fmadd_ps(m, _mm256_set1_ps(fsum[b]), acc_min);
    }
  }
  return _mm256_add_ps(_mm256_add_ps(acc, acc_r), acc_min);
}

// A multi-row call (tile_rows) takes at most kMaxRows rows of x, fewer where a row's quantized
// activations are long: the chunk's rows (kChunkBytes in all) stay in L1 while each tile of a group
// meets them. gemv() takes that path from kManyRows rows up; fewer go row by row through tile_dot.
constexpr int kMaxRows = 16;
constexpr int64_t kChunkBytes = 24 << 10;
constexpr int64_t kManyRows = 5;

// One tile (8 output rows) times `rows` consecutive rows of x from `row` (a prefill chunk), into
// y's rows y_stride apart. Against tile_dot, per row and block: the codes are loaded and unpacked
// once into 8 registers for all the rows (tile_dot decodes them again for every row: 12 of its ~55
// vector ops), and the two parts' sums join into one (quantize_rows<true>), so one conversion, scale
// and FMA instead of two. The rows' accumulators live in L1 (16 ymm registers hold the codes and one
// row's sums, not 16 rows'); each row is independent of the next, so the out-of-order core overlaps
// a few rows' chains.
template <int kKind>   // 0: Q4_0, 1: Q4_1, 2: Q8_0
inline void tile_rows(const uint8_t* rec, int64_t nb, const QuantizedRows& x, int64_t row, int rows, int64_t k,
                      float* y, int64_t y_stride) {
  constexpr int kCodeBytes = kKind == 2 ? 256 : 128;
  constexpr int kRecBytes = kCodeBytes + (kKind == 1 ? 32 : 16);
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), shift = _mm256_set1_epi16(1 << kResidualBits);
  alignas(32) float acc[kMaxRows * kTile];
  for (int i = 0; i < rows; ++i) _mm256_store_ps(acc + i * kTile, _mm256_setzero_ps());
  for (int64_t b = 0; b < nb; ++b, rec += kRecBytes) {
    // As in tile_dot: on the first rows' pass the weight comes from DRAM (a decode batch).
    for (int c = 0; c < kRecBytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetch + c), _MM_HINT_T0);
    __m256i w[8];   // the codes meeting input bytes 4j..4j+3 of each row's block (Q8_0: |q|)
    if constexpr (kKind == 2) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) w[j] = _mm256_abs_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * j)));
    } else {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * j));
        w[j] = _mm256_and_si256(v, nibble);
        w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kCodeBytes)));
    __m256 m = _mm256_setzero_ps();
    if constexpr (kKind == 1) m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kCodeBytes + 16)));
    for (int i = 0; i < rows; ++i) {
      const int64_t o = (row + i) * nb + b;
      const int32_t* xq = reinterpret_cast<const int32_t*>(x.q.data() + (row + i) * k + b * kGroup);
      const int32_t* xr = reinterpret_cast<const int32_t*>(x.r.data() + (row + i) * k + b * kGroup);
      __m256i s;   // 2^kResidualBits sum(code * q) + sum(code * r) per output row
      if constexpr (kKind == 2) {
        s = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * j));
          s = _mm256_add_epi32(s, _mm256_add_epi32(
              _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], _mm256_sign_epi8(_mm256_set1_epi32(xq[j]), v)), shift),
              _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], _mm256_sign_epi8(_mm256_set1_epi32(xr[j]), v)), ones)));
        }
      } else {
        // int16 sums as in tile_dot (8 * 2 * 15 * 127 < 2^15), added as a tree: short chains.
        auto part = [&](const int32_t* p) {
          __m256i h[4];
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j)
            h[j] = _mm256_add_epi16(_mm256_maddubs_epi16(w[2 * j], _mm256_set1_epi32(p[2 * j])),
                                    _mm256_maddubs_epi16(w[2 * j + 1], _mm256_set1_epi32(p[2 * j + 1])));
          return _mm256_add_epi16(_mm256_add_epi16(h[0], h[1]), _mm256_add_epi16(h[2], h[3]));
        };
        // vpmaddwd by 2^kResidualBits widens and shifts the q part in one (< 2^24: exact).
        s = _mm256_add_epi32(_mm256_madd_epi16(part(xq), shift), _mm256_madd_epi16(part(xr), ones));
        if constexpr (kKind == 0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * ((x.qsum[o] << kResidualBits) + x.rsum[o])));
      }
      __m256 a = _mm256_load_ps(acc + i * kTile);
      a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(x.dr[o])), a);
      if constexpr (kKind == 1) a = _mm256_fmadd_ps(m, _mm256_set1_ps(x.fsum[o]), a);
      _mm256_store_ps(acc + i * kTile, a);
    }
  }
  for (int i = 0; i < rows; ++i) _mm256_storeu_ps(y + i * y_stride, _mm256_load_ps(acc + i * kTile));
}

template <int kKind>
void gemv(const QuantizedRows& xq, int64_t rows, int64_t k, const uint8_t* packed, int64_t tiles, float* y,
          int threads) {
  constexpr int64_t kRecBytes = kKind == 2 ? 272 : (kKind == 1 ? 160 : 144);
  const int64_t nb = k / kGroup, width = tiles * kTile;
  // Few tiles (a small layer): fewer threads, so that no thread wakes for a sliver of work (as
  // vnni_gemv.cpp: 128 output rows a thread at least).
  const int n = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tiles / 16)));
  if (rows < kManyRows) {
#pragma omp parallel for num_threads(n) schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const uint8_t* tile = packed + t * nb * kRecBytes;
      for (int64_t r = 0; r < rows; ++r) _mm256_storeu_ps(y + r * width + t * kTile, tile_dot<kKind>(tile, nb, xq, r, k));
    }
    return;
  }
  // Many rows (prefill): each thread one run of tiles, in groups whose weights (~256 KB, half a
  // Zen 3 core's L2) stay in L2 while every chunk of rows passes over them (vnni_gemv.cpp's order).
  const int64_t group = std::max<int64_t>(1, (256 << 10) / (nb * kRecBytes));
  const int64_t chunk = std::clamp<int64_t>(kChunkBytes / (2 * k + 20 * nb), 4, kMaxRows);
#pragma omp parallel num_threads(n)
  {
    const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t ta = tiles * id / nt, tb = tiles * (id + 1) / nt;
    for (int64_t g0 = ta; g0 < tb; g0 += group) {
      const int64_t g1 = std::min(tb, g0 + group);
      for (int64_t r = 0; r < rows; r += chunk)
        for (int64_t t = g0; t < g1; ++t)
          tile_rows<kKind>(packed + t * nb * kRecBytes, nb, xq, r, static_cast<int>(std::min(chunk, rows - r)), k,
                           y + r * width + t * kTile, width);
    }
  }
}

}  // namespace

// y [rows, tiles * 8] = x [rows, k] times the packed weight of `tiles` tiles. kind: 0 Q4_0, 1 Q4_1,
// 2 Q8_0. Returns 0, or -1 for arguments it cannot take (the caller checks shapes first).
extern "C" int rs_avx2_gemv(const float* x, int64_t rows, int64_t k, const uint8_t* packed, int64_t tiles,
                            int kind, float* y, int threads) {
  if (k % kGroup || rows < 0 || tiles < 0 || kind < 0 || kind > 2 || threads < 1) return -1;
  const QuantizedRows& xq = rows >= kManyRows ? quantize_rows<true>(x, rows, k, threads)
                                               : quantize_rows<false>(x, rows, k, threads);
  if (kind == 0) gemv<0>(xq, rows, k, packed, tiles, y, threads);
  else if (kind == 1) gemv<1>(xq, rows, k, packed, tiles, y, threads);
  else gemv<2>(xq, rows, k, packed, tiles, y, threads);
  return 0;
}
