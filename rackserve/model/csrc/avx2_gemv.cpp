// y = x W^T for GGUF Q4_0 / Q4_1 / Q8_0 weights, a decode batch's rows or a prefill chunk's, with
// AVX2 + FMA + F16C: vnni_gemv.cpp's method and numerics for CPUs without AVX-512 (AMD Zen 2/3,
// Intel before Ice Lake), built only into the "avx2" library (model/native.py).
//
// Output rows are interleaved 8 at a time (the 8 int32 lanes of a ymm), so a block's 8 scales are
// one vector. Per tile and block the record holds
//   codes: Q4_*: 128 bytes, byte (g, r, i) = code[r][4g + i] | code[r][16 + 4g + i] << 4
//          Q8_0: 256 bytes, byte (g, r, i) = q[r][4g + i] as int8
//   d[8] fp16, then (Q4_1) m[8] fp16.
// A decode batch's few rows (tile_dot) take each block of 32 of x as dx * j with j int16 (one part):
// on Zen 1, which splits a ymm op in two 128-bit halves, the one-row GEMV is bound by the integer
// multiplies, and each code then meets x in one vpmaddwd (below). From 5 rows on (g_many_rows),
// Q4_* take tile_rows instead: x as dx * q + dr * r (two int8 parts, with their integer sums and
// the block's float sum) as vnni_gemv.cpp's, multiplied by vpmaddubsw (u8 x s8 pairs into int16) with 4 tiles a
// call and the codes unpacked once for all the rows, llama.cpp's AVX2 method. A block's product is
// d * dx * (sum(code j) - 8 sum(j)) for Q4_0, d * dx * sum(code j) (+ m * sum(x) for Q4_1) otherwise
// (in tile_rows with q and r for j): GGUF's numerics.
// quant/avx2_linear.py packs the records and calls rs_avx2_gemv through ctypes.
// This file must never allocate or own weights.
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <vector>
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

// x = dx * q + dr * r per block, as vnni_gemv.cpp's quantize_rows, for tile_rows (a prefill chunk's
// rows): into the calling thread's own buffers (quantized_rows.h), kept from call to call.
// - dr = dx / 2^kResidualBits, as vnni_gemv.cpp's: the two integer sums of a block then join exactly
//   into one (2^kResidualBits sum(code q) + sum(code r)), converted and scaled once; the residual
//   (|x - dx q| <= dx / 2) is clamped to +-127 dr (a tie would round to 128, which int8 cannot hold);
// - q and r are stored as unsigned bytes q + 128, r + 128: tile_rows' vpmaddubsw side (qsum and
//   rsum stay those of q and r).
constexpr int kResidualBits = 8;

const QuantizedRows& quantize_rows(const float* x, int64_t rows, int64_t k, int threads) {
  const int64_t n = rows * (k / kGroup);
  thread_local QuantizedRows out;
  out.fit(rows, k, kGroup);
  QuantizedRows& o = out;   // the calling thread's buffers, filled by the team below
#pragma omp parallel for num_threads(threads) if (n >= 2048) schedule(static)
  for (int64_t b = 0; b < n; ++b) {
    const float* xb = x + b * kGroup;
    __m256 v[4], res[4];
    __m256i q[4], s[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    const float d = abs_max(v) / 127.f;
    to_int8(v, d, o.q.data() + b * kGroup, q);
    for (int i = 0; i < 4; ++i) res[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q[i]), _mm256_set1_ps(d), v[i]);
    const float dr = d * (1.f / (1 << kResidualBits));
    const __m256 hi = _mm256_set1_ps(127.f * dr), lo = _mm256_set1_ps(-127.f * dr);
    for (int i = 0; i < 4; ++i) res[i] = _mm256_max_ps(_mm256_min_ps(res[i], hi), lo);
    to_int8(res, dr, o.r.data() + b * kGroup, s);
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int8_t* p : {o.q.data() + b * kGroup, o.r.data() + b * kGroup})
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                          _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), flip));
    o.dx[b] = d;
    o.dr[b] = dr;
    o.fsum[b] = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    o.qsum[b] = hsum(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    o.rsum[b] = hsum(_mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3])));
  }
  return out;
}

// tile_dot's rows (a decode batch's few): each block of 32 of x as dx * j, j int16 (|j| <= 32767, dx
// = max |x| / 32767; one part, finer than the two int8 parts' 2^-15 of the block's max), with sum(j)
// and the block's float sum. Within each group of 4 the values are stored in the order 0, 2, 1, 3:
// tile_dot broadcasts pairs (x[4g], x[4g + 2]) and (x[4g + 1], x[4g + 3]), which meet a record's
// int16 lanes' low and high bytes (below). Q8_0's prefill rows split over the threads as
// quantize_rows'; a decode batch's few blocks stay on the calling thread.
const QuantizedRows& quantize_rows16(const float* x, int64_t rows, int64_t k, int threads) {
  const int64_t n = rows * (k / kGroup);
  thread_local QuantizedRows out;
  out.fit16(rows, k, kGroup);
  QuantizedRows& o = out;
  const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                         0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
#pragma omp parallel for num_threads(threads) if (n >= 2048) schedule(static)
  for (int64_t b = 0; b < n; ++b) {
    const float* xb = x + b * kGroup;
    __m256 v[4];
    __m256i q[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    const float d = abs_max(v) / 32767.f;
    const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    // packs work within 128-bit lanes: the qword permute puts each 16 back in order, the byte
    // shuffle then orders each group of 4 as 0, 2, 1, 3.
    for (int h = 0; h < 2; ++h) {
      __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * h], q[2 * h + 1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.x16.data() + b * kGroup + 16 * h),
                          _mm256_shuffle_epi8(w, order));
    }
    o.dx[b] = d;
    o.fsum[b] = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    o.qsum[b] = hsum(sum);
    o.rsum[b] = hsum(_mm256_blend_epi32(sum, _mm256_setzero_si256(), 0xAA));   // x[4g] and x[4g + 2]
  }
  return out;
}

// How far ahead of its block tile_dot asks for the weight's bytes: as vnni_gemv.cpp's kPrefetch
// (bench/avx2_decode_gemv_ab.py builds other distances with -DRS_AVX2_PREFETCH=...).
#ifndef RS_AVX2_PREFETCH
#define RS_AVX2_PREFETCH 4096
#endif
constexpr int kPrefetch = RS_AVX2_PREFETCH;

// One tile (8 output rows) times row `row` of x (quantize_rows16): 8 outputs. A record's 32 bytes of
// a group g of 4 inputs, read as int16 lanes, hold per output row r (its lanes 2r, 2r + 1) the codes
// of inputs 4g, 4g + 1 (lane 2r) and 4g + 2, 4g + 3 (lane 2r + 1) in the low and high bytes; so the
// low bytes, widened in place, times the broadcast pair (x[4g], x[4g + 2]) by vpmaddwd give row r's
// two products summed in its int32 lane r, and the high bytes likewise with (x[4g + 1], x[4g + 3]):
// the rows' sums come out in lane order, no horizontal step, and each code meets x in one multiply
// (the int8 path needed vpmaddubsw then vpmaddwd, twice: two parts of x). Q8_0: the low byte widened
// by shifting left then arithmetic right, the high by an arithmetic shift; Q4_*: the four nibbles
// of a lane (Q4_*'s byte holds inputs 4g + i and 16 + 4g + i) by shifts and masks.
// Bounds: |q| <= 128 (Q8_0; codes <= 15 for Q4_*) times |j| <= 32767, 32 of them: < 2^27.
template <int kKind>   // 0: Q4_0, 1: Q4_1, 2: Q8_0
inline __m256 tile_dot(const uint8_t* rec, int64_t nb, const QuantizedRows& x, int64_t row, int64_t k) {
  constexpr int kCodeBytes = kKind == 2 ? 256 : 128;
  constexpr int kRecBytes = kCodeBytes + (kKind == 1 ? 32 : 16);
  const int16_t* xj = x.x16.data() + row * k;
  const float *dx = x.dx.data() + row * nb, *fsum = x.fsum.data() + row * nb;
  const int32_t *jsum = x.qsum.data() + row * nb, *lsum = x.rsum.data() + row * nb;
  // The broadcast pair i of the block's reordered inputs (quantize_rows16).
  auto pair = [&](int i) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xj + 2 * i)); };
  __m256 acc = _mm256_setzero_ps(), acc_min = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, rec += kRecBytes, xj += kGroup) {
    for (int c = 0; c < kRecBytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetch + c), _MM_HINT_T0);
    __m256i s;   // sum(code * j) per output row
    if constexpr (kKind == 2) {
      // The low bytes as q + 128 (mask, flip the sign bit): no shift; the 128 sum(x[4g], x[4g + 2])
      // they add is taken out once a block.
      const __m256i low = _mm256_set1_epi16(0xFF), sign = _mm256_set1_epi16(0x80);
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * g));
        const __m256i lo = _mm256_xor_si256(_mm256_and_si256(v, low), sign), hi = _mm256_srai_epi16(v, 8);
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(lo, pair(2 * g)));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(hi, pair(2 * g + 1)));
      }
      s = _mm256_sub_epi32(_mm256_add_epi32(s0, s1), _mm256_set1_epi32(128 * lsum[b]));
    } else {
      // Three nibbles of a lane masked in place (16 and 256 times their codes: sums kept apart and
      // shifted back exactly, 256 * 15 * 32767 * 8 < 2^31), the top one shifted down.
      const __m256i n0 = _mm256_set1_epi16(0x000F), n1 = _mm256_set1_epi16(0x00F0), n2 = _mm256_set1_epi16(0x0F00);
      __m256i s0 = _mm256_setzero_si256(), s4 = _mm256_setzero_si256(), s8 = _mm256_setzero_si256();
      for (int g = 0; g < 4; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * g));
        s0 = _mm256_add_epi32(s0, _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(v, n0), pair(2 * g)),
                                                   _mm256_madd_epi16(_mm256_srli_epi16(v, 12), pair(9 + 2 * g))));
        s4 = _mm256_add_epi32(s4, _mm256_madd_epi16(_mm256_and_si256(v, n1), pair(8 + 2 * g)));
        s8 = _mm256_add_epi32(s8, _mm256_madd_epi16(_mm256_and_si256(v, n2), pair(2 * g + 1)));
      }
      s = _mm256_add_epi32(s0, _mm256_srai_epi32(_mm256_add_epi32(s4, _mm256_srai_epi32(s8, 4)), 4));
      if constexpr (kKind == 0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * jsum[b]));
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kCodeBytes)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(dx[b])), acc);
    if constexpr (kKind == 1) {
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kCodeBytes + 16)));
      acc_min = _mm256_fmadd_ps(m, _mm256_set1_ps(fsum[b]), acc_min);
    }
  }
  return _mm256_add_ps(acc, acc_min);
}

// The many-rows path (a prefill chunk; Q4_0 and Q4_1): tile_rows multiplies kTiles tiles (32
// output rows) by up to kMaxRows rows of x at once, fewer where a row's quantized activations are
// long, so that the chunk's rows (kChunkBytes in all) stay in L1 or close while each tile of a group
// meets them (2 tiles a call measured 0.79-1.00x 4 on Zen 3, bench/results/avx2-gemm-ab-*-s9z.json).
// gemv() takes it from g_many_rows rows up (Q8_0 widen_q8's path); fewer rows go row by row through tile_dot.
// 5 rows: on a Zen 1 tile_rows won from 3 rows on a weight in cache (1.06-1.28x at 3-4) but lost
// 4-9% at 3-4 rows in whole decode steps, whose weights stream from DRAM (docs/benchmarks.md,
// thirteenth round). Tests and A/B runs move it (rs_avx2_set_many_rows) to reach both paths.
constexpr int kTiles = 4;
constexpr int kMaxRows = 16;
constexpr int64_t kChunkBytes = 48 << 10;   // 24 KB: 576x1536 at 64-512 rows 0.92x (7 rows a call, not 14)
constexpr int64_t kManyRows = 5;
std::atomic<int64_t> g_many_rows{kManyRows};

// One block of `n` tiles' codes, unpacked once for all the rows of a tile_rows call: the codes as
// signed bytes c - 8 (Q4_0's w = d (c - 8); Q4_1's d c + m = d (c - 8) + (m + 8 d)), laid out as
// tile_dot's registers ([tile][j][8 rows x 4 bytes]); per output row -128 * (2^kResidualBits + 1) *
// sum(c - 8), which takes the activations' +128 offset back out of both parts' joined sums; d; and
// (Q4_1) m + 8 d, which meets the block's float sum of x.
struct UnpackedBlock {
  alignas(32) int8_t codes[kTiles][8][32];
  alignas(32) int32_t offset[kTiles][kTile];
  alignas(32) float d[kTiles][kTile], m[kTiles][kTile];
};

template <int kKind>
inline void unpack_block(const uint8_t* rec, int64_t tile_bytes, int n, UnpackedBlock& u) {
  constexpr int kCodeBytes = 128;
  const __m256i nibble = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int t = 0; t < n; ++t, rec += tile_bytes) {
    __m256i sum = _mm256_setzero_si256();   // |8 codes - 8| <= 64: int8
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * j));
      const __m256i lo = _mm256_sub_epi8(_mm256_and_si256(v, nibble), eight);
      const __m256i hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), eight);
      _mm256_store_si256(reinterpret_cast<__m256i*>(u.codes[t][j]), lo);
      _mm256_store_si256(reinterpret_cast<__m256i*>(u.codes[t][j + 4]), hi);
      sum = _mm256_add_epi8(sum, _mm256_add_epi8(lo, hi));
    }
    const __m256i csum = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, sum), ones16);
    _mm256_store_si256(reinterpret_cast<__m256i*>(u.offset[t]),
                       _mm256_mullo_epi32(csum, _mm256_set1_epi32(-128 * ((1 << kResidualBits) + 1))));
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kCodeBytes)));
    _mm256_store_ps(u.d[t], d);
    if constexpr (kKind == 1) {
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + kCodeBytes + 16)));
      _mm256_store_ps(u.m[t], _mm256_fmadd_ps(_mm256_set1_ps(8.f), d, m));
    }
  }
}

// kN tiles (kN * 8 output rows, the tiles tile_bytes apart) times `rows` consecutive rows of x from
// `row` (quantize_rows), into y's rows y_stride apart. Where tile_dot broadcasts each of a
// row's 4-byte groups for one tile and unpacks the codes for every row, here the codes come unpacked
// from L1 (unpack_block, once a block for all the rows) as vpmaddubsw's signed side, so each
// broadcast group (the unsigned side: x + 128) meets kN tiles; the two parts' sums join into one
// (2^kResidualBits sum q + sum r, the offsets taken out by one add), so one conversion, scale and
// FMA a tile, row and block instead of two. The rows' accumulators live in L1.
// Bounds: a pair of u8 x s8 products |2 * 255 * 8| and 8 of them < 2^15 (no int16 saturation);
// 2^kResidualBits * 32 * 255 * 8 < 2^31.
template <int kKind, int kN>
inline void tile_rows(const uint8_t* rec, int64_t tile_bytes, int64_t nb, const QuantizedRows& x, int64_t row,
                      int rows, int64_t k, float* y, int64_t y_stride) {
  constexpr int kRecBytes = kKind == 1 ? 160 : 144;
  const __m256i ones = _mm256_set1_epi16(1), shift = _mm256_set1_epi16(1 << kResidualBits);
  alignas(32) float acc[kMaxRows][kN * kTile];
  for (int i = 0; i < rows; ++i)
    for (int t = 0; t < kN; ++t) _mm256_store_ps(acc[i] + t * kTile, _mm256_setzero_ps());
  UnpackedBlock u;
  for (int64_t b = 0; b < nb; ++b, rec += kRecBytes) {
    // As in tile_dot: on the first rows' pass the weight comes from DRAM (a decode batch).
    for (int t = 0; t < kN; ++t)
      for (int c = 0; c < kRecBytes; c += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec + t * tile_bytes + kPrefetch + c), _MM_HINT_T0);
    unpack_block<kKind>(rec, tile_bytes, kN, u);
    for (int i = 0; i < rows; ++i) {
      const int64_t o = (row + i) * nb + b;
      const int32_t* xq = reinterpret_cast<const int32_t*>(x.q.data() + (row + i) * k + b * kGroup);
      const int32_t* xr = reinterpret_cast<const int32_t*>(x.r.data() + (row + i) * k + b * kGroup);
      // The codes are read from L1 by each row's vpmaddubsw (a memory operand): the empty asm keeps
      // GCC from hoisting 32 code vectors out of the row loop into spilled copies of themselves.
      const int8_t* codes = u.codes[0][0];
      asm("" : "+r"(codes));
      __m256i s[kN], t16[kN];
#pragma GCC unroll 4
      for (int t = 0; t < kN; ++t) s[t] = t16[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i bq = _mm256_set1_epi32(xq[j]), br = _mm256_set1_epi32(xr[j]);
#pragma GCC unroll 4
        for (int t = 0; t < kN; ++t) {
          __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes + (t * 8 + j) * 32));
          asm("" : "+x"(w));   // one load for both parts (GCC would fold it into each vpmaddubsw)
          s[t] = _mm256_add_epi16(s[t], _mm256_maddubs_epi16(bq, w));
          t16[t] = _mm256_add_epi16(t16[t], _mm256_maddubs_epi16(br, w));
          // Each sum a chain in a register: unfenced, GCC reassociates the 8 adds into a tree whose
          // 64 products, all live at once, spill.
          asm("" : "+x"(s[t]), "+x"(t16[t]));
        }
      }
      const __m256 dr = _mm256_set1_ps(x.dr[o]);
      __m256 fsum;
      if constexpr (kKind == 1) fsum = _mm256_set1_ps(x.fsum[o]);
#pragma GCC unroll 4
      for (int t = 0; t < kN; ++t) {
        const __m256i joined = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(s[t], shift), _mm256_madd_epi16(t16[t], ones)),
            _mm256_load_si256(reinterpret_cast<const __m256i*>(u.offset[t])));
        __m256 a = _mm256_load_ps(acc[i] + t * kTile);
        a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(joined), _mm256_mul_ps(_mm256_load_ps(u.d[t]), dr), a);
        if constexpr (kKind == 1) a = _mm256_fmadd_ps(_mm256_load_ps(u.m[t]), fsum, a);
        _mm256_store_ps(acc[i] + t * kTile, a);
      }
    }
  }
  for (int i = 0; i < rows; ++i)
    for (int t = 0; t < kN; ++t) _mm256_storeu_ps(y + i * y_stride + t * kTile, _mm256_load_ps(acc[i] + t * kTile));
}

// Q8_0's many rows (from g_many_rows, as Q4_*'s tile_rows; an lm_head over a decode batch): a
// tile's codes widened once, both bytes of each int16 lane sign-extended (the low by shifting left
// then arithmetic right, the high by an arithmetic shift), with the blocks' scales as floats, into
// the calling thread's buffers; then each row meets them as tile_dot's Q8_0 does, by vpmaddwd alone,
// not re-widening them row by row. The integer sums are tile_dot's exactly (its 128 sum(x) offset
// is the low bytes' + 128, absent here), so the outputs are the few-rows path's to the bit.
inline void widen_q8(const uint8_t* rec, int64_t nb, int16_t* codes, float* d) {
  for (int64_t b = 0; b < nb; ++b, rec += 272, codes += 256, d += kTile) {
    for (int c = 0; c < 272; c += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetch + c), _MM_HINT_T0);
    for (int g = 0; g < 8; ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 * g));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 32 * g), _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 32 * g + 16), _mm256_srai_epi16(v, 8));
    }
    _mm256_storeu_ps(d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 256))));
  }
}

inline __m256 wide_dot(const int16_t* codes, const float* d, int64_t nb, const QuantizedRows& x, int64_t row, int64_t k) {
  const int16_t* xj = x.x16.data() + row * k;
  const float* dx = x.dx.data() + row * nb;
  auto pair = [&](int i) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xj + 2 * i)); };
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, xj += kGroup, codes += 256, d += kTile) {
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {
      const __m256i* w = reinterpret_cast<const __m256i*>(codes + 32 * g);
      s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_loadu_si256(w), pair(2 * g)));
      s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_loadu_si256(w + 1), pair(2 * g + 1)));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)),
                          _mm256_mul_ps(_mm256_loadu_ps(d), _mm256_set1_ps(dx[b])), acc);
  }
  return acc;
}

template <int kKind>
void gemv(const QuantizedRows& xq, int64_t rows, bool many, int64_t k, const uint8_t* packed, int64_t tiles, float* y,
          int threads) {
  constexpr int64_t kRecBytes = kKind == 2 ? 272 : (kKind == 1 ? 160 : 144);
  const int64_t nb = k / kGroup, width = tiles * kTile, tile_bytes = nb * kRecBytes;
  // Few tiles (a small layer): fewer threads, so that no thread wakes for a sliver of work (as
  // vnni_gemv.cpp: 128 output rows a thread at least).
  const int n = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tiles / 16)));
  if (kKind == 2 && many) {
#pragma omp parallel num_threads(n)
    {
      thread_local std::vector<int16_t> codes;
      thread_local std::vector<float> d;
      if (static_cast<int64_t>(codes.size()) < 256 * nb) {
        codes.resize(256 * nb);
        d.resize(kTile * nb);
      }
#pragma omp for schedule(static)
      for (int64_t t = 0; t < tiles; ++t) {
        widen_q8(packed + t * tile_bytes, nb, codes.data(), d.data());
        for (int64_t r = 0; r < rows; ++r)
          _mm256_storeu_ps(y + r * width + t * kTile, wide_dot(codes.data(), d.data(), nb, xq, r, k));
      }
    }
    return;
  }
  if (kKind == 2 || !many) {
#pragma omp parallel for num_threads(n) schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const uint8_t* tile = packed + t * tile_bytes;
      for (int64_t r = 0; r < rows; ++r) _mm256_storeu_ps(y + r * width + t * kTile, tile_dot<kKind>(tile, nb, xq, r, k));
    }
    return;
  }
  if constexpr (kKind != 2) {
    // Many rows: each thread one run of tiles, in groups whose weights (~256 KB, half a Zen 3 core's
    // L2) stay in L2 while every chunk of rows passes over them (vnni_gemv.cpp's order).
    const int64_t group = std::max<int64_t>(kTiles, (256 << 10) / tile_bytes / kTiles * kTiles);
    const int64_t chunk = std::clamp<int64_t>(kChunkBytes / (2 * k + 8 * nb), 4, kMaxRows);
#pragma omp parallel num_threads(n)
    {
      const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t ta = tiles * id / nt, tb = tiles * (id + 1) / nt;
      for (int64_t g0 = ta; g0 < tb; g0 += group) {
        const int64_t g1 = std::min(tb, g0 + group);
        for (int64_t r = 0; r < rows; r += chunk) {
          const int cr = static_cast<int>(std::min(chunk, rows - r));
          for (int64_t t = g0; t < g1; t += kTiles) {
            const uint8_t* rec = packed + t * tile_bytes;
            float* out = y + r * width + t * kTile;
            switch (std::min<int64_t>(kTiles, g1 - t)) {
              case 1: tile_rows<kKind, 1>(rec, tile_bytes, nb, xq, r, cr, k, out, width); break;
              case 2: tile_rows<kKind, 2>(rec, tile_bytes, nb, xq, r, cr, k, out, width); break;
              case 3: tile_rows<kKind, 3>(rec, tile_bytes, nb, xq, r, cr, k, out, width); break;
              default: tile_rows<kKind, kTiles>(rec, tile_bytes, nb, xq, r, cr, k, out, width); break;
            }
          }
        }
      }
    }
  }
}

}  // namespace

// y [rows, tiles * 8] = x [rows, k] times the packed weight of `tiles` tiles. kind: 0 Q4_0, 1 Q4_1,
// 2 Q8_0. Returns 0, or -1 for arguments it cannot take (the caller checks shapes first).
extern "C" int rs_avx2_gemv(const float* x, int64_t rows, int64_t k, const uint8_t* packed, int64_t tiles,
                            int kind, float* y, int threads) {
  if (k % kGroup || rows < 0 || tiles < 0 || kind < 0 || kind > 2 || threads < 1) return -1;
  const bool many = rows >= g_many_rows.load(std::memory_order_relaxed);
  const QuantizedRows& xq = many && kind != 2 ? quantize_rows(x, rows, k, threads) : quantize_rows16(x, rows, k, threads);
  if (kind == 0) gemv<0>(xq, rows, many, k, packed, tiles, y, threads);
  else if (kind == 1) gemv<1>(xq, rows, many, k, packed, tiles, y, threads);
  else gemv<2>(xq, rows, many, k, packed, tiles, y, threads);
  return 0;
}

// From `rows` rows up, calls take the many-rows paths (tile_rows; Q8_0's widen_q8) instead of
// tile_dot row by row; returns the rows it replaced, or -1 for rows < 1. For tests and A/B runs;
// not while a call runs.
extern "C" int rs_avx2_set_many_rows(int64_t rows) {
  if (rows < 1) return -1;
  return static_cast<int>(g_many_rows.exchange(rows));
}
