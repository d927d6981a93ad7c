// y = x W^T for GGUF Q4_0 / Q4_1 / Q8_0 weights, for a few rows of x (decode), with AVX-512 VNNI.
//
// llama.cpp's fast path with one more int8 part: each block of 32 of a row of x is written as
// dx * q + dr * r (q the int8 quantization, r that of its residual, with their integer sums and the
// block's float sum), and each block of the weight meets both in integer dot products (vpdpbusd:
// unsigned 8-bit codes times signed 8-bit activations, 64 products an instruction; the codes are
// loaded and unpacked once for both). Output rows are interleaved 16 at a time (one tile), so that
// the 16 int32 lanes of a dot product are 16 output rows: no horizontal sums, and a block's 16
// scales are one vector. Per tile and block the packed record holds
//   codes: Q4_*: 256 bytes, byte (j, r, i) = code[r][4j + i] | code[r][16 + 4j + i] << 4
//          Q8_0: 512 bytes, byte (j, r, i) = q[r][4j + i] + 128
//   d[16] fp16, then (Q4_1) m[16] fp16,
// and a block's product is d * (dx * (sum(code q) - offset sum(q)) + dr * (sum(code r) - offset
// sum(r))) (+ m * sum(x) for Q4_1), offset 8 for Q4_0, 128 for Q8_0, 0 for Q4_1: GGUF's own
// numerics (w = d (q - 8), d q + m, d q). quant/vnni_linear.py packs the records and calls
// rs_vnni_gemv through ctypes (a plain C ABI and no torch headers: it compiles in a second).
// Threads are OpenMP's, from the runtime torch itself loaded (one libgomp.so.1 in the process).
// This file must never allocate or own weights.
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <algorithm>
#include "quantized_rows.h"

namespace {

constexpr int kGroup = 32;
constexpr int kTile = 16;

// Rounds v / d to int8 (nearest even; |v / d| <= 127 by the choice of d), with its integer sum.
inline __m512i to_int8(__m512 v, float d, int8_t* out) {
  __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(q));
  return q;
}

// x = dx * q + dr * r per block: the residual's own int8 part leaves an error of about 1 / 254^2
// of the block's largest value, so that the products are those of the fp32 activations to ~1e-5
// (one int8 part alone, llama.cpp's Q8 activations, leaves ~0.5% of an output's scale, which adds
// up over a model's layers).
// Into the calling thread's own buffers (quantized_rows.h), kept from call to call.
const QuantizedRows& quantize_rows(const float* x, int64_t rows, int64_t k, int threads) {
  const int64_t n = rows * (k / kGroup);
  thread_local QuantizedRows out;
  out.fit(rows, k, kGroup);
  QuantizedRows& o = out;   // the calling thread's buffers, filled by the team below
  // A prefill chunk's rows split over the threads (512 rows of 1536: ~0.3 ms on one); a decode
  // batch's few blocks stay on the calling thread, where waking the team would cost more.
#pragma omp parallel for num_threads(threads) if (n >= 2048) schedule(static)
  for (int64_t b = 0; b < n; ++b) {
    const float* xb = x + b * kGroup;
    __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi))) / 127.f;
    __m512i qlo = to_int8(lo, d, o.q.data() + b * kGroup), qhi = to_int8(hi, d, o.q.data() + b * kGroup + 16);
    __m512 rlo = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qlo), _mm512_set1_ps(d), lo);
    __m512 rhi = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qhi), _mm512_set1_ps(d), hi);
    float dr = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(rlo), _mm512_abs_ps(rhi))) / 127.f;
    __m512i slo = to_int8(rlo, dr, o.r.data() + b * kGroup), shi = to_int8(rhi, dr, o.r.data() + b * kGroup + 16);
    o.dx[b] = d;
    o.dr[b] = dr;
    o.fsum[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    o.qsum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    o.rsum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(slo, shi));
  }
  return out;
}

// How far ahead of its block tile_dot asks for the weight's bytes (a thread's tiles are one run of
// memory). A decode step reads ~100 MB of weights once, so the bytes come from DRAM (or a shared L3),
// and without the hint the hardware prefetcher kept too few lines in flight to overlap the dot
// products: the GEMVs of a SmolLM2 step ran at 0.65x a plain read of the same bytes (1 and 2
// threads), 0.84x with it (bench/results/gemv-step-harness-s6e.json); 2-8 KB ahead measured alike,
// 1 KB less.
constexpr int kPrefetch = 4096;

// One tile (16 output rows) times row `row` of x: 16 outputs.
template <int kKind>   // 0: Q4_0, 1: Q4_1, 2: Q8_0
inline __m512 tile_dot(const uint8_t* rec, int64_t nb, const QuantizedRows& x, int64_t row, int64_t k) {
  constexpr int kCodeBytes = kKind == 2 ? 512 : 256;
  constexpr int kRecBytes = kCodeBytes + (kKind == 1 ? 64 : 32);
  constexpr int kOffset = kKind == 0 ? 8 : (kKind == 2 ? 128 : 0);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const int32_t* xq = reinterpret_cast<const int32_t*>(x.q.data() + row * k);
  const int32_t* xr = reinterpret_cast<const int32_t*>(x.r.data() + row * k);
  const float *dx = x.dx.data() + row * nb, *dr = x.dr.data() + row * nb, *fsum = x.fsum.data() + row * nb;
  const int32_t *qsum = x.qsum.data() + row * nb, *rsum = x.rsum.data() + row * nb;
  __m512 acc = _mm512_setzero_ps(), acc_r = _mm512_setzero_ps(), acc_min = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, rec += kRecBytes, xq += 8, xr += 8) {
    for (int c = 0; c < kRecBytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetch + c), _MM_HINT_T0);
    __m512i s = _mm512_setzero_si512(), t = _mm512_setzero_si512();   // sum(code * q), sum(code * r)
    if constexpr (kKind == 2) {
      for (int j = 0; j < 8; ++j) {
        __m512i v = _mm512_loadu_si512(rec + 64 * j);
        s = _mm512_dpbusd_epi32(s, v, _mm512_set1_epi32(xq[j]));
        t = _mm512_dpbusd_epi32(t, v, _mm512_set1_epi32(xr[j]));
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        __m512i v = _mm512_loadu_si512(rec + 64 * j);
        __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s, lo, _mm512_set1_epi32(xq[j])), hi, _mm512_set1_epi32(xq[j + 4]));
        t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(t, lo, _mm512_set1_epi32(xr[j])), hi, _mm512_set1_epi32(xr[j + 4]));
      }
    }
    if constexpr (kOffset != 0) {
      s = _mm512_sub_epi32(s, _mm512_set1_epi32(kOffset * qsum[b]));
      t = _mm512_sub_epi32(t, _mm512_set1_epi32(kOffset * rsum[b]));
    }
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + kCodeBytes)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(dx[b])), acc);
    acc_r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d, _mm512_set1_ps(dr[b])), acc_r);
    if constexpr (kKind == 1) {
      __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + kCodeBytes + 32)));
      acc_min = _mm512_fmadd_ps(m, _mm512_set1_ps(fsum[b]), acc_min);
    }
  }
  return _mm512_add_ps(_mm512_add_ps(acc, acc_r), acc_min);
}

// One tile (16 output rows) times kRows consecutive rows of x from `row`: each block's codes are
// loaded and unpacked once for all kRows rows (tile_dot pays that again for every row), then
// meet the rows' q parts, then their r parts, so that the unpacked codes (8 zmm), one part's
// integer sums (kRows) and the float sums (kRows) stay in the 32 zmm registers at 8 rows.
template <int kKind, int kRows>
__attribute__((always_inline)) inline void tile_rows(const uint8_t* rec, int64_t nb, const QuantizedRows& x,
                                                     int64_t row, int64_t k, float* y, int64_t y_stride) {
  constexpr int kCodeBytes = kKind == 2 ? 512 : 256;
  constexpr int kRecBytes = kCodeBytes + (kKind == 1 ? 64 : 32);
  constexpr int kOffset = kKind == 0 ? 8 : (kKind == 2 ? 128 : 0);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const int8_t* parts[2] = {x.q.data() + row * k, x.r.data() + row * k};
  const float* scales[2] = {x.dx.data() + row * nb, x.dr.data() + row * nb};
  const int32_t* sums[2] = {x.qsum.data() + row * nb, x.rsum.data() + row * nb};
  const float* fsum = x.fsum.data() + row * nb;
  __m512 acc[kRows];
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, rec += kRecBytes) {
    // As in tile_dot: ask for the weight 4 KB ahead, so its DRAM latency overlaps this block's dots.
    for (int c = 0; c < kRecBytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetch + c), _MM_HINT_T0);
    __m512i w[8];     // the block's codes for 4 input bytes each (Q4_*: low nibbles, then high)
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      if constexpr (kKind == 2) {
        w[j] = _mm512_loadu_si512(rec + 64 * j);
      } else {
        const __m512i v = _mm512_loadu_si512(rec + 64 * (j & 3));
        w[j] = j < 4 ? _mm512_and_si512(v, nibble) : _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + kCodeBytes)));
#pragma GCC unroll 2
    for (int part = 0; part < 2; ++part) {
      __m512i s[kRows];
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) s[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
#pragma GCC unroll 8
        for (int i = 0; i < kRows; ++i) {
          const int32_t* xi = reinterpret_cast<const int32_t*>(parts[part] + i * k + b * kGroup);
          s[i] = _mm512_dpbusd_epi32(s[i], w[j], _mm512_set1_epi32(xi[j]));
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) {
        if constexpr (kOffset != 0) s[i] = _mm512_sub_epi32(s[i], _mm512_set1_epi32(kOffset * sums[part][i * nb + b]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(d, _mm512_set1_ps(scales[part][i * nb + b])),
                                 acc[i]);
      }
    }
    if constexpr (kKind == 1) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + kCodeBytes + 32)));
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(fsum[i * nb + b]), acc[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i) _mm512_storeu_ps(y + (row + i) * y_stride, acc[i]);
}

template <int kKind>
void gemv(const QuantizedRows& xq, int64_t rows, int64_t k, const uint8_t* packed, int64_t tiles, float* y,
          int threads) {
  constexpr int64_t kRecBytes = kKind == 2 ? 544 : (kKind == 1 ? 320 : 288);
  const int64_t nb = k / kGroup, width = tiles * kTile;
  // Few tiles (a small layer): fewer threads, so that no thread wakes for a sliver of work.
  const int n = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tiles / 8)));
  // Rows in chunks whose quantized activations (~3 KB a row at k = 1536) stay in L2 beside the
  // weight while every tile of the thread passes over them: 512 rows at once spilled to L3.
  constexpr int64_t kChunk = 64;
#pragma omp parallel num_threads(n)
  for (int64_t r0 = 0; r0 < rows; r0 += kChunk) {
    const int64_t r1 = std::min(rows, r0 + kChunk);
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tiles; ++t) {
      const uint8_t* tile = packed + t * nb * kRecBytes;
      int64_t r = r0;
      for (; r + 8 <= r1; r += 8) tile_rows<kKind, 8>(tile, nb, xq, r, k, y + t * kTile, width);
      if (r + 4 <= r1) {
        tile_rows<kKind, 4>(tile, nb, xq, r, k, y + t * kTile, width);
        r += 4;
      }
      for (; r < r1; ++r) _mm512_storeu_ps(y + r * width + t * kTile, tile_dot<kKind>(tile, nb, xq, r, k));
    }
  }
}

}  // namespace

// y [rows, tiles * 16] = x [rows, k] times the packed weight of `tiles` tiles. kind: 0 Q4_0, 1 Q4_1,
// 2 Q8_0. Returns 0, or -1 for arguments it cannot take (the caller checks shapes first).
extern "C" int rs_vnni_gemv(const float* x, int64_t rows, int64_t k, const uint8_t* packed, int64_t tiles,
                            int kind, float* y, int threads) {
  if (k % kGroup || rows < 0 || tiles < 0 || kind < 0 || kind > 2 || threads < 1) return -1;
  const QuantizedRows& xq = quantize_rows(x, rows, k, threads);
  if (kind == 0) gemv<0>(xq, rows, k, packed, tiles, y, threads);
  else if (kind == 1) gemv<1>(xq, rows, k, packed, tiles, y, threads);
  else gemv<2>(xq, rows, k, packed, tiles, y, threads);
  return 0;
}
