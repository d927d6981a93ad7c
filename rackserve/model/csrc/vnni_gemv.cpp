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
// rs_vnni_gemv through ctypes (a plain C ABI and no torch headers: it compiles in a second), or
// rs_vnni_gemv_parts (--packed-activations), which keeps the residual part only in the blocks that
// hold a large activation and skips its dot products where a tile of rows kept none.
// Threads are OpenMP's, from the runtime torch itself loaded (one libgomp.so.1 in the process).
// This file must never allocate or own weights.
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include "quantized_rows.h"

namespace {

constexpr int kGroup = 32;
constexpr int kTile = 16;

// Rounds v / d to int8 (nearest even), clamped to +-127, with its integer sum. |v / d| <= 127 for a
// block's q by the choice of d; a residual's r reaches 128 only where its value sits on a tie.
inline __m512i to_int8(__m512 v, float inv_d, int8_t* out) {
  __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inv_d)));
  q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(q));
  return q;
}

// x = dx * q + dr * r per block, dr = dx / 2^kResidualBits: the residual (|x - dx q| <= dx / 2) in
// steps of dx / 256 leaves an error of about 1 / 254^2 of the block's largest value, so that the
// products are those of the fp32 activations to ~1e-5 (one int8 part alone, llama.cpp's Q8
// activations, leaves ~0.5% of an output's scale, which adds up over a model's layers). The fixed
// power-of-two ratio lets the multi-row path (tile_rows) join a block's two integer sums into one,
// 2^kResidualBits sum(code q) + sum(code r), exactly, and scale that once.
// Into the calling thread's own buffers (quantized_rows.h), kept from call to call.
//
// kAdaptive (rs_vnni_gemv_parts, --packed-activations): a block keeps its residual only where its
// largest value exceeds tau times its row's RMS (a large activation, whose int8 step would leave the
// block's other values a few steps wide); elsewhere the residual's codes and sum are zero, which is
// one part exactly, and `two` [T, blocks] says which, so that a tile of rows with none skips those
// dot products. fsum is then the sum of the values the dot products see (dx q + dr r), not of x:
// with Q4_1's w = d c + m, an exact m sum(x) beside d sum(c (dx q)) leaves the rounding of x weighted
// by d c (all of one sign) where the dequantized weight would weigh it by w (KL 2.5e-2 against 4e-3
// over SmolLM2's 400-token check with one part everywhere; bench/activation_parts_numerics.py).
constexpr int kResidualBits = 8;

template <bool kAdaptive = false>
const QuantizedRows& quantize_rows(const float* x, int64_t rows, int64_t k, int threads, float tau = 0.f,
                                   uint8_t* two = nullptr) {
  const int64_t nb = k / kGroup, n = rows * nb;
  thread_local QuantizedRows out;
  out.fit(rows, k, kGroup);
  QuantizedRows& o = out;   // the calling thread's buffers, filled by the team below
  std::vector<float> rms;
  if constexpr (kAdaptive) {
    rms.resize(rows);
#pragma omp parallel for num_threads(threads) if (n >= 2048) schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      __m512 ss = _mm512_setzero_ps();
      for (int64_t c = 0; c < k; c += 16) {
        const __m512 v = _mm512_loadu_ps(x + i * k + c);
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      rms[i] = std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(k));
    }
  }
  // A prefill chunk's rows split over the threads (512 rows of 1536: ~0.3 ms on one); a decode
  // batch's few blocks stay on the calling thread, where waking the team would cost more.
#pragma omp parallel for num_threads(threads) if (n >= 2048) schedule(static)
  for (int64_t b = 0; b < n; ++b) {
    const float* xb = x + b * kGroup;
    __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = top / 127.f;
    const float inv = d > 0.f ? 1.f / d : 0.f;
    __m512i qlo = to_int8(lo, inv, o.q.data() + b * kGroup), qhi = to_int8(hi, inv, o.q.data() + b * kGroup + 16);
    __m512 rlo = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qlo), _mm512_set1_ps(d), lo);
    __m512 rhi = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qhi), _mm512_set1_ps(d), hi);
    float inv_r = inv * (1 << kResidualBits);
    if constexpr (kAdaptive) {
      const bool keep = top > tau * rms[b / nb];
      two[b] = keep;
      if (!keep) inv_r = 0.f;
    }
    __m512i slo = to_int8(rlo, inv_r, o.r.data() + b * kGroup), shi = to_int8(rhi, inv_r, o.r.data() + b * kGroup + 16);
    o.dx[b] = d;
    o.dr[b] = d * (1.f / (1 << kResidualBits));
    o.qsum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    o.rsum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(slo, shi));
    if constexpr (kAdaptive) o.fsum[b] = d * static_cast<float>(o.qsum[b]) + o.dr[b] * static_cast<float>(o.rsum[b]);
    else o.fsum[b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
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

// s += the unsigned bytes of w times the 4 signed bytes at p, broadcast to the 16 lanes: vpdpbusd
// with its embedded broadcast, one instruction (GCC 12 makes _mm512_set1_epi32(*p) a vpbroadcastd
// of its own, so the multi-row loop issued twice the instructions it needs).
inline __m512i dpbusd_bcst(__m512i s, __m512i w, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return s;
}

// The block's codes for input bytes 4j..4j+3 of each of a tile's 16 rows (Q4_*: the low nibbles for
// j < 4, the high ones after).
template <int kKind>
__attribute__((always_inline)) inline __m512i block_codes(const uint8_t* rec, int j) {
  if constexpr (kKind == 2) return _mm512_loadu_si512(rec + 64 * j);
  const __m512i v = _mm512_loadu_si512(rec + 64 * (j & 3)), nibble = _mm512_set1_epi8(0x0F);
  return j < 4 ? _mm512_and_si512(v, nibble) : _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
}

// One tile (16 output rows) times kRows consecutive rows of x from `row`. Per block, each row's two
// integer sums are joined into one, 2^kResidualBits sum(code q) + sum(code r) (< 2^31), converted
// and scaled once by d * dr. The dot products (5 cycles' latency, two ports) need ~10 independent
// chains: up to 8 rows, each row's q and r sums are chains of their own (the codes unpacked once
// for both); at 12, one chain a row (q, the shift, then r) keeps the registers for the rows.
// kAdaptive: `two` (quantize_rows) says which blocks of which rows kept a residual; a block where
// none of the kRows rows did skips the residual's dot products (their codes are all zero).
template <int kKind, int kRows, bool kAdaptive = false>
__attribute__((always_inline)) inline void tile_rows(const uint8_t* rec, int64_t nb, const QuantizedRows& x,
                                                     int64_t row, int64_t k, float* y, int64_t y_stride,
                                                     const uint8_t* two = nullptr) {
  constexpr int kCodeBytes = kKind == 2 ? 512 : 256;
  constexpr int kRecBytes = kCodeBytes + (kKind == 1 ? 64 : 32);
  constexpr int kOffset = kKind == 0 ? 8 : (kKind == 2 ? 128 : 0);
  constexpr bool kOneChain = kRows > 8;
  const int8_t *xq = x.q.data() + row * k, *xr = x.r.data() + row * k;
  const float* dr = x.dr.data() + row * nb;
  const int32_t *qsum = x.qsum.data() + row * nb, *rsum = x.rsum.data() + row * nb;
  const float* fsum = x.fsum.data() + row * nb;
  __m512 acc[kRows];
#pragma GCC unroll 16
  for (int i = 0; i < kRows; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, rec += kRecBytes) {
    // As in tile_dot: ask for the weight 4 KB ahead, so its DRAM latency overlaps this block's dots.
    for (int c = 0; c < kRecBytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetch + c), _MM_HINT_T0);
    // Row i's q (or r) part at block input bytes 4j..4j+3.
    auto bq = [&](int i, int j) { return xq + i * k + b * kGroup + 4 * j; };
    auto br = [&](int i, int j) { return xr + i * k + b * kGroup + 4 * j; };
    __m512i s[kRows];
#pragma GCC unroll 16
    for (int i = 0; i < kRows; ++i) s[i] = _mm512_setzero_si512();
    bool residual = true;
    if constexpr (kAdaptive) {
      uint8_t any = 0;
#pragma GCC unroll 16
      for (int i = 0; i < kRows; ++i) any |= two[(row + i) * nb + b];
      residual = any != 0;
    }
    // One chain a row, or (kAdaptive) any rows when none kept this block's residual: then the q
    // part alone, shifted as if the r part (all zero) followed.
    if (kOneChain || !residual) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i w = block_codes<kKind>(rec, j);
#pragma GCC unroll 16
        for (int i = 0; i < kRows; ++i) s[i] = dpbusd_bcst(s[i], w, bq(i, j));
      }
#pragma GCC unroll 16
      for (int i = 0; i < kRows; ++i) s[i] = _mm512_slli_epi32(s[i], kResidualBits);
      if (residual) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m512i w = block_codes<kKind>(rec, j);
#pragma GCC unroll 16
          for (int i = 0; i < kRows; ++i) s[i] = dpbusd_bcst(s[i], w, br(i, j));
        }
      }
    } else {
      __m512i t[kRows];
#pragma GCC unroll 16
      for (int i = 0; i < kRows; ++i) t[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i w = block_codes<kKind>(rec, j);
#pragma GCC unroll 16
        for (int i = 0; i < kRows; ++i) {
          s[i] = dpbusd_bcst(s[i], w, bq(i, j));
          t[i] = dpbusd_bcst(t[i], w, br(i, j));
        }
      }
#pragma GCC unroll 16
      for (int i = 0; i < kRows; ++i) s[i] = _mm512_add_epi32(_mm512_slli_epi32(s[i], kResidualBits), t[i]);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + kCodeBytes)));
#pragma GCC unroll 16
    for (int i = 0; i < kRows; ++i) {
      if constexpr (kOffset != 0)
        s[i] = _mm512_sub_epi32(s[i], _mm512_set1_epi32(kOffset * ((qsum[i * nb + b] << kResidualBits) + rsum[i * nb + b])));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(d, _mm512_set1_ps(dr[i * nb + b])), acc[i]);
    }
    if constexpr (kKind == 1) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + kCodeBytes + 32)));
#pragma GCC unroll 16
      for (int i = 0; i < kRows; ++i) acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(fsum[i * nb + b]), acc[i]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < kRows; ++i) _mm512_storeu_ps(y + (row + i) * y_stride, acc[i]);
}

template <int kKind, bool kAdaptive = false>
void gemv(const QuantizedRows& xq, int64_t rows, int64_t k, const uint8_t* packed, int64_t tiles, float* y,
          int threads, const uint8_t* two = nullptr) {
  constexpr int64_t kRecBytes = kKind == 2 ? 544 : (kKind == 1 ? 320 : 288);
  const int64_t nb = k / kGroup, width = tiles * kTile;
  // Few tiles (a small layer): fewer threads, so that no thread wakes for a sliver of work.
  const int n = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tiles / 8)));
  // Each thread takes one run of tiles (one run of memory: tile_dot's prefetch reads ahead in it), in
  // groups whose weights (~256 KB) stay in L2 while all the rows pass over them. Within a group the
  // rows go 12 at a time, and each 12 rows' quantized activations (24 k bytes) stay in L1 while
  // every tile of the group meets them: the weight streams through L1, one run at a time, where
  // chunks of rows streaming from L2 for every tile (24 concurrent runs of broadcast loads) had
  // left the dot products waiting.
  const int64_t group = std::max<int64_t>(1, (256 << 10) / (nb * kRecBytes));
#pragma omp parallel num_threads(n)
  {
    const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t ta = tiles * id / nt, tb = tiles * (id + 1) / nt;
    for (int64_t g0 = ta; g0 < tb; g0 += group) {
      const int64_t g1 = std::min(tb, g0 + group);
      auto pass = [&](auto rows_at_once, int64_t r) {
        for (int64_t t = g0; t < g1; ++t)
          tile_rows<kKind, decltype(rows_at_once)::value, kAdaptive>(packed + t * nb * kRecBytes, nb, xq, r, k,
                                                                     y + t * kTile, width, two);
      };
      int64_t r = 0;
      for (; r + 12 <= rows; r += 12) pass(std::integral_constant<int, 12>{}, r);
      if (r + 8 <= rows) {
        pass(std::integral_constant<int, 8>{}, r);
        r += 8;
      }
      if (r + 4 <= rows) {
        pass(std::integral_constant<int, 4>{}, r);
        r += 4;
      }
      for (int64_t t = g0; t < g1 && r < rows; ++t)
        for (int64_t i = r; i < rows; ++i)
          _mm512_storeu_ps(y + i * width + t * kTile, tile_dot<kKind>(packed + t * nb * kRecBytes, nb, xq, i, k));
    }
  }
}

template <bool kAdaptive>
int vnni_gemv(const float* x, int64_t rows, int64_t k, const uint8_t* packed, int64_t tiles, int kind, float* y,
              int threads, float tau) {
  if (k % kGroup || rows < 0 || tiles < 0 || kind < 0 || kind > 2 || threads < 1) return -1;
  std::vector<uint8_t> two(kAdaptive ? rows * (k / kGroup) : 0);
  const QuantizedRows& xq = quantize_rows<kAdaptive>(x, rows, k, threads, tau, two.data());
  if (kind == 0) gemv<0, kAdaptive>(xq, rows, k, packed, tiles, y, threads, two.data());
  else if (kind == 1) gemv<1, kAdaptive>(xq, rows, k, packed, tiles, y, threads, two.data());
  else gemv<2, kAdaptive>(xq, rows, k, packed, tiles, y, threads, two.data());
  return 0;
}

}  // namespace

// y [rows, tiles * 16] = x [rows, k] times the packed weight of `tiles` tiles. kind: 0 Q4_0, 1 Q4_1,
// 2 Q8_0. Returns 0, or -1 for arguments it cannot take (the caller checks shapes first).
extern "C" int rs_vnni_gemv(const float* x, int64_t rows, int64_t k, const uint8_t* packed, int64_t tiles,
                            int kind, float* y, int threads) {
  return vnni_gemv<false>(x, rows, k, packed, tiles, kind, y, threads, 0.f);
}

// rs_vnni_gemv with a block's residual part kept only where its largest |x| exceeds tau times its
// row's RMS (quantize_rows<true>): tau = INFINITY is one int8 part everywhere (llama.cpp's Q8
// activations); tau <= 0 is rs_vnni_gemv itself. The residual's dot products are skipped in tiles
// of rows that kept none for a block.
extern "C" int rs_vnni_gemv_parts(const float* x, int64_t rows, int64_t k, const uint8_t* packed, int64_t tiles,
                                  int kind, float* y, int threads, float tau) {
  return tau > 0.f ? vnni_gemv<true>(x, rows, k, packed, tiles, kind, y, threads, tau)
                   : vnni_gemv<false>(x, rows, k, packed, tiles, kind, y, threads, 0.f);
}
