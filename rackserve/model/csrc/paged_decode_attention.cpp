// Decode attention over a paged KV cache, read in place through the block table: one
// query token per request, its K/V spread over blocks of `block_size` tokens ([num_blocks,
// block_size, kv_heads, head_dim] caches). This is what the torch backend does with a gather of
// the blocks and one SDPA call, without the gather and the dozen small ops around it. A KV
// head's query heads (GQA) share each loaded key and value. A long context is split over the
// threads (flash-decoding: each part of whole blocks keeps its own max, sum and accumulator, then
// the parts are merged), so a lone decode at thousands of tokens uses every core. Scores are
// taken 16 (AVX-512) or 8 (AVX2) keys at a time and reduced across keys in registers, not one
// horizontal sum per key; other head sizes and the last keys of a block take the plain loop.
// The cache holds float32, IEEE half (float16, uint16_t in memory: rs_paged_decode_attention_f16),
// bfloat16 (rs_paged_decode_attention_bf16) or an 8-bit float (e4m3 or e5m2, kv_fp8.h:
// rs_paged_decode_attention_fp8e4m3 / _fp8e5m2), one template over all five: a narrower cache's values
// are widened (F16C, a shift for bfloat16, an 8-bit code moved into a float16's bits first) as the
// AVX-512 loops load them, or (AVX2) a block at a time into a float32 block the same loops read, so a
// step reads a half or a quarter of the bytes from memory, and the
// query, the output and the arithmetic stay float32; on AVX2 a float32 cache's block is copied into
// that block the same way (widen_block). A KV head's 2-4 query heads are scored and
// accumulated against each loaded K/V row at once (score_group, add_values_group), and the next
// block's bytes are asked for while this one is read (NextBlock): the cores compute while the
// memory streams, where each block's reads used to wait for the memory and then for the loops.
// torch_attention.py calls it through model/native_ops.py, and decode_loop.cpp per layer; this
// file must never write the cache.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kv_fp8.h"
#include "vec_exp.h"

namespace {

// A float16 cache element, as its bits (F16C converts it; the float32 one is used as it is), and a
// bfloat16 one (float32's top half: widened exactly by a shift).
using half = uint16_t;
struct bf16 {
  uint16_t bits;
};
inline float to_float(float x) { return x; }
inline float to_float(half x) { return _cvtsh_ss(x); }
inline float to_float(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
// An 8-bit float is read as its raw value (kv_fp8.h: e4m3's times 2^-8), here and in vload:
// attend_part scales the scores and the accumulated values back (kRawUnit), one multiply a score or
// output element instead of one a loaded vector.
inline float to_float(fp8e4m3 x) { return fp8_raw(x); }
inline float to_float(fp8e5m2 x) { return fp8_raw(x); }
template <typename T>
constexpr float kRawUnit = kFp8RawUnit<T>;     // 1 but for e4m3

// exp(x - mx) over a row of scores in place, 16 at a time (vec_exp.h: arithmetic the build
// vectorises for its ISA; std::exp is a scalar libm call of ~20 ns, which was most of this kernel's
// time at 257 tokens of context on SmolLM2); returns their sum.
float exp_shifted_sum(float* s, int64_t n, float mx) {
  rs_f16 sum = {};
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    rs_f16 v;
    __builtin_memcpy(&v, s + t, sizeof v);
    v = rs_expv<rs_f16, rs_i16>(v - mx);
    __builtin_memcpy(s + t, &v, sizeof v);
    sum += v;
  }
  float total = 0.f;
  for (int i = 0; i < 16; ++i) total += sum[i];
  for (; t < n; ++t) {
    s[t] = rs_expv<rs_f16, rs_i16>(rs_f16{} + (s[t] - mx))[0];
    total += s[t];
  }
  return total;
}

#if defined(__AVX512F__)
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
#endif

#if defined(__AVX512F__)
#define RS_VECTOR_KEYS 1
constexpr int64_t kKeys = 16;       // keys scored at once: one vector of scores
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vec vload(const bf16* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
inline Vec vload(const fp8e4m3* p) { return widen16_raw(p); }
inline Vec vload(const fp8e5m2* p) { return widen16_raw(p); }
inline void vstore(float* p, Vec a) { _mm512_storeu_ps(p, a); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
// x[j] holds key j's products lane by lane; returns lane j = the sum of x[j]'s lanes. A transpose
// and add in 4 levels (15 adds for 16 keys) where a horizontal sum per key would take 4 each.
inline void store_sums(const Vec* x, float* out) {
  Vec y[8], z[4], w[2];
  for (int j = 0; j < 8; ++j)
    y[j] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * j], x[2 * j + 1]), _mm512_unpackhi_ps(x[2 * j], x[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(y[2 * j]), b = _mm512_castps_pd(y[2 * j + 1]);
    z[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int j = 0; j < 2; ++j)
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * j], z[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[2 * j], z[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1))));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define RS_VECTOR_KEYS 1
constexpr int64_t kKeys = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Vec vload(const bf16* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}
inline Vec vload(const fp8e4m3* p) { return widen8_raw(p); }
inline Vec vload(const fp8e5m2* p) { return widen8_raw(p); }
inline void vstore(float* p, Vec a) { _mm256_storeu_ps(p, a); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void store_sums(const Vec* x, float* out) {     // as above, in 3 levels for 8 keys
  Vec y[4], z[2];
  for (int j = 0; j < 4; ++j)
    y[j] = _mm256_add_ps(_mm256_unpacklo_ps(x[2 * j], x[2 * j + 1]), _mm256_unpackhi_ps(x[2 * j], x[2 * j + 1]));
  for (int j = 0; j < 2; ++j) {
    const __m256d a = _mm256_castps_pd(y[2 * j]), b = _mm256_castps_pd(y[2 * j + 1]);
    z[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(z[0], z[1], 0x20), _mm256_permute2f128_ps(z[0], z[1], 0x31)));
}
#endif                              // else no vector path: every key takes the plain loop

#ifdef RS_VECTOR_KEYS
// q . k for kKeys keys at a time, token_stride apart, of M vectors each, into s[0..n) (the keys of
// a last part-group are left to the caller): each key's products are added in the order of its
// vectors, as a plain loop over the head would, but the kKeys keys' sums advance together, vector
// by vector. Key by key, each sum was one chain of M dependent FMAs (8 on AVX2 at head_dim 64,
// ~4 cycles each) that the next key's chain could only partly overlap.
template <int M>
int64_t score_keys_vec(const float* q, const float* k, int64_t n, int64_t token_stride, float* s) {
  constexpr int64_t lanes = sizeof(Vec) / sizeof(float);
  int64_t j = 0;
  for (; j + kKeys <= n; j += kKeys) {
    Vec acc[kKeys];
    for (int64_t t = 0; t < kKeys; ++t) acc[t] = vzero();
    for (int c = 0; c < M; ++c) {
      const Vec qc = vload(q + c * lanes);
      for (int64_t t = 0; t < kKeys; ++t) acc[t] = vfma(qc, vload(k + (j + t) * token_stride + c * lanes), acc[t]);
    }
    store_sums(acc, s + j);
  }
  return j;
}
#endif

// q . k for n keys token_stride apart, into s[0..n).
void score_keys(const float* q, const float* k, int64_t n, int64_t head_dim, int64_t token_stride, float* s) {
  int64_t j = 0;
#ifdef RS_VECTOR_KEYS
  constexpr int64_t lanes = sizeof(Vec) / sizeof(float);
  if (head_dim % lanes == 0) {
    // The AVX2 build only (measured on a Zen 3, bench/decode_attention_ab.py); the AVX-512 build's
    // chains are half as long, and it keeps the key-by-key loop it was measured with.
    switch (kAvx512 ? 0 : head_dim / lanes) {
      case 2: j = score_keys_vec<2>(q, k, n, token_stride, s); break;
      case 4: j = score_keys_vec<4>(q, k, n, token_stride, s); break;
      case 8: j = score_keys_vec<8>(q, k, n, token_stride, s); break;
      case 16: j = score_keys_vec<16>(q, k, n, token_stride, s); break;
      default:
        for (; j + kKeys <= n; j += kKeys) {
          Vec acc[kKeys];
          for (int64_t t = 0; t < kKeys; ++t) {
            const float* kt = k + (j + t) * token_stride;
            Vec a = vzero();
            for (int64_t i = 0; i < head_dim; i += lanes) a = vfma(vload(q + i), vload(kt + i), a);
            acc[t] = a;
          }
          store_sums(acc, s + j);
        }
    }
  }
#endif
  for (; j < n; ++j) {
    const float* kt = k + j * token_stride;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < head_dim; ++i) sum += q[i] * kt[i];
    s[j] = sum;
  }
}

#ifdef RS_VECTOR_KEYS
// acc[0..M vectors) += sum over j < n of p[j] v_j, values token_stride apart, kept in registers
// (M is a constant so that they are): not a load and a store of acc per value.
template <int M>
void add_values_vec(const float* p, const float* v, int64_t n, int64_t token_stride, float* acc) {
  constexpr int64_t lanes = sizeof(Vec) / sizeof(float);
  Vec a[M];
  for (int c = 0; c < M; ++c) a[c] = vload(acc + c * lanes);
  for (int64_t j = 0; j < n; ++j) {
    const Vec w = vset1(p[j]);
    for (int c = 0; c < M; ++c) a[c] = vfma(w, vload(v + j * token_stride + c * lanes), a[c]);
  }
  for (int c = 0; c < M; ++c) vstore(acc + c * lanes, a[c]);
}
#endif

// acc[0..head_dim) += sum over j < n of p[j] v_j, values token_stride apart.
void add_values(const float* p, const float* v, int64_t n, int64_t head_dim, int64_t token_stride, float* acc) {
#ifdef RS_VECTOR_KEYS
  constexpr int64_t lanes = sizeof(Vec) / sizeof(float);
  if (head_dim % lanes == 0) {
    switch (head_dim / lanes) {
      case 2: return add_values_vec<2>(p, v, n, token_stride, acc);
      case 4: return add_values_vec<4>(p, v, n, token_stride, acc);
      case 8: return add_values_vec<8>(p, v, n, token_stride, acc);
      case 16: return add_values_vec<16>(p, v, n, token_stride, acc);
      default: break;
    }
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
    for (int64_t i = 0; i < head_dim; ++i) acc[i] += p[j] * v[j * token_stride + i];
  }
}

#ifdef RS_VECTOR_KEYS
#define RS_GROUP_VEC 1
// A KV head's G query heads (GQA) against each K or V row loaded once: scored or accumulated one
// query head at a time, every row was loaded from L1 G times, and on a Zen 1 (256-bit ops split
// in two halves, two loads a cycle) the loads per useful FMA bounded the kernel as much as the
// memory did; on a Zen 5 the AVX-512 build's key-by-key loop took 1.1-1.2x the grouped loops'
// time. The accumulators are register-blocked to fit AVX2's 16 ymm (AVX-512 uses the same tiles).

// q . k of G query heads (q + g * head_dim) for KB keys from key j (token_stride apart) into
// s[g * s_stride + j ...]: G x KB accumulators, each loaded key chunk used by the G heads. Each
// sum is added in the order of its vectors and then across lanes as score_keys_vec's.
template <typename T, int G, int M, int KB>
__attribute__((always_inline)) inline void score_group_tile(const float* q, const T* k, int64_t j,
                                                            int64_t token_stride, float* s, int64_t s_stride) {
  constexpr int64_t lanes = sizeof(Vec) / sizeof(float), head_dim = M * lanes;
  constexpr int kSums = (G * KB + kKeys - 1) / kKeys * kKeys;     // whole store_sums calls
  Vec acc[kSums];
  for (int i = 0; i < kSums; ++i) acc[i] = vzero();
  for (int c = 0; c < M; ++c) {
    Vec kc[KB];
    for (int t = 0; t < KB; ++t) kc[t] = vload(k + (j + t) * token_stride + c * lanes);
    for (int g = 0; g < G; ++g) {
      const Vec qc = vload(q + g * head_dim + c * lanes);
      for (int t = 0; t < KB; ++t) acc[g * KB + t] = vfma(qc, kc[t], acc[g * KB + t]);
    }
  }
  alignas(64) float sums[kSums];
  for (int i = 0; i < kSums; i += kKeys) store_sums(acc + i, sums + i);
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < KB; ++t) s[g * s_stride + j + t] = sums[g * KB + t];
}

// KB: the keys of a tile, G x KB <= 12 accumulators.
template <typename T, int G, int M>
void score_group_vec(const float* q, const T* k, int64_t n, int64_t token_stride, float* s, int64_t s_stride) {
  constexpr int KB = G == 2 ? 4 : 12 / G;
  int64_t j = 0;
  for (; j + KB <= n; j += KB) score_group_tile<T, G, M, KB>(q, k, j, token_stride, s, s_stride);
  for (; j < n; ++j) score_group_tile<T, G, M, 1>(q, k, j, token_stride, s, s_stride);
}

// acc[g * acc_stride ...] += sum over j < n of p[g * p_stride + j] v_j for the G query heads:
// head_dim in chunks of C vectors, G x C accumulators + G broadcast weights + the loaded chunk
// in registers, each value chunk loaded once for the G heads.
template <typename T, int G, int M>
void add_values_group_vec(const float* p, int64_t p_stride, const T* v, int64_t n, int64_t token_stride,
                          float* acc, int64_t acc_stride) {
  constexpr int64_t lanes = sizeof(Vec) / sizeof(float);
  constexpr int C = G <= 3 && M >= 4 ? 4 : 2;
  for (int c0 = 0; c0 < M; c0 += C) {
    Vec a[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) a[g][c] = vload(acc + g * acc_stride + (c0 + c) * lanes);
    for (int64_t j = 0; j < n; ++j) {
      Vec w[G];
      for (int g = 0; g < G; ++g) w[g] = vset1(p[g * p_stride + j]);
      for (int c = 0; c < C; ++c) {
        const Vec vc = vload(v + j * token_stride + (c0 + c) * lanes);
        for (int g = 0; g < G; ++g) a[g][c] = vfma(w[g], vc, a[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) vstore(acc + g * acc_stride + (c0 + c) * lanes, a[g][c]);
  }
}

// The grouped loops' instance for (group, head_dim) or null: groups of 2-4, head_dim of 2-16 vectors.
template <typename F, template <int, int> class Pick>
F pick_group(int64_t group, int64_t head_dim) {
  constexpr int64_t lanes = sizeof(Vec) / sizeof(float);
  if (head_dim % lanes) return nullptr;
  const int64_t m = head_dim / lanes;
  auto by_m = [m](auto g) -> F {
    constexpr int G = decltype(g)::value;
    switch (m) {
      case 2: return Pick<G, 2>::fn;
      case 4: return Pick<G, 4>::fn;
      case 8: return Pick<G, 8>::fn;
      case 16: return Pick<G, 16>::fn;
      default: return nullptr;
    }
  };
  switch (group) {
    case 2: return by_m(std::integral_constant<int, 2>{});
    case 3: return by_m(std::integral_constant<int, 3>{});
    case 4: return by_m(std::integral_constant<int, 4>{});
    default: return nullptr;
  }
}
template <typename T>
using ScoreGroupFn = void (*)(const float*, const T*, int64_t, int64_t, float*, int64_t);
template <typename T>
using AddGroupFn = void (*)(const float*, int64_t, const T*, int64_t, int64_t, float*, int64_t);
template <typename T>
struct PickScore {
  template <int G, int M>
  struct At {
    static constexpr ScoreGroupFn<T> fn = score_group_vec<T, G, M>;
  };
};
template <typename T>
struct PickAdd {
  template <int G, int M>
  struct At {
    static constexpr AddGroupFn<T> fn = add_values_group_vec<T, G, M>;
  };
};
#endif

// Whether the grouped loops take (group, head_dim) for a cache of T: then a 16-bit block can be
// read where it lies, each K or V vector converted as it is loaded, once for the group's heads.
template <typename T>
bool grouped(int64_t group, int64_t head_dim) {
#ifdef RS_GROUP_VEC
  return pick_group<ScoreGroupFn<T>, PickScore<T>::template At>(group, head_dim) != nullptr;
#else
  (void)group, (void)head_dim;
  return false;
#endif
}

// A KV head's `group` query heads (q, head_dim apart) against n keys token_stride apart, into
// s[g * s_stride ...]: all at once where the grouped loop takes the shape, else head by head (a
// float32 block only: a 16-bit one is read in place only where grouped() says so).
template <typename T>
void score_group(const float* q, const T* k, int64_t n, int64_t group, int64_t head_dim, int64_t token_stride,
                 float* s, int64_t s_stride) {
#ifdef RS_GROUP_VEC
  if (const ScoreGroupFn<T> fn = pick_group<ScoreGroupFn<T>, PickScore<T>::template At>(group, head_dim))
    return fn(q, k, n, token_stride, s, s_stride);
#endif
  if constexpr (std::is_same_v<T, float>)
    for (int64_t g = 0; g < group; ++g) score_keys(q + g * head_dim, k, n, head_dim, token_stride, s + g * s_stride);
}

// acc[g * acc_stride ...] += sum over j < n of p[g * p_stride + j] v_j, for a KV head's `group`
// query heads, as score_group.
template <typename T>
void add_values_group(const float* p, int64_t p_stride, const T* v, int64_t n, int64_t group, int64_t head_dim,
                      int64_t token_stride, float* acc, int64_t acc_stride) {
#ifdef RS_GROUP_VEC
  if (const AddGroupFn<T> fn = pick_group<AddGroupFn<T>, PickAdd<T>::template At>(group, head_dim))
    return fn(p, p_stride, v, n, token_stride, acc, acc_stride);
#endif
  if constexpr (std::is_same_v<T, float>)
    for (int64_t g = 0; g < group; ++g)
      add_values(p + g * p_stride, v, n, head_dim, token_stride, acc + g * acc_stride);
}

// A block's first `count` cache elements as float32 in `wide` (a block's floats, L1-resident),
// which the float32 loops above read: a float16 block widened once, so that a KV head's query
// heads (GQA) share each conversion (converting at every load took a lone decode at 384 tokens
// 1.85x the float32 cache's time on a Zen 1: F16C's conversion is slower there than the FMA it
// feeds); in the AVX2 build a float32 block copied, one sequential read of its bytes from memory
// that the grouped loops' strided reads then find in L1. Without the copy the grouped loops ran a
// Zen 1 float32 step at 0.88-0.96x main's speed; with it 1.03-1.14x faster at 256-4096 tokens
// (bench/results/decode-attention-ab-gqa-s15-zen1.json), though 0.89x with a layer's K/V
// already in the caches (the bench streams them from memory, as a step does). The AVX-512 build
// reads a float32 block in place: with NextBlock's requests ahead of its loops the copy cost it
// 1.35-1.4x on a Zen 5 (ad hoc, bench/results/measure-load-zen5-s18.json).
#if defined(RS_GROUP_VEC) && !defined(__AVX512F__)
constexpr bool kCopyF32 = true;
#else
constexpr bool kCopyF32 = false;
#endif
inline const float* widen_block(const float* b, int64_t count, float* wide) {
  if (!kCopyF32) return b;
  std::memcpy(wide, b, count * sizeof(float));
  return wide;
}
template <typename TN>      // half, bf16, fp8e4m3 or fp8e5m2
inline const float* widen_block(const TN* b, int64_t count, float* wide) {
  int64_t i = 0;
#ifdef RS_VECTOR_KEYS
  constexpr int64_t lanes = sizeof(Vec) / sizeof(float);
  for (; i + lanes <= count; i += lanes) vstore(wide + i, vload(b + i));
#endif
  for (; i < count; ++i) wide[i] = to_float(b[i]);
  return wide;
}

// The next block of a part (when it has one), asked for a line at a time while this block is
// read: the table scatters a context's blocks, so the hardware prefetcher loses the stream at each
// block's end, and a block's reads waited for the memory, then for the loops. The AVX2 build asks
// for the whole block before this one's copy (on a Zen 3 it took a lone decode's attention at 256
// tokens from 56 to 43 us a layer, bench/results/decode-attention-ab-prefetch-s9z.json); the
// AVX-512 build asks for kRunRows of its rows before each kRunRows of this block's rows are scored
// or summed, so that the requests stay few and spread over the loops' time (on a Zen 5 the whole
// block at once gained nothing; the runs of 4 took a 16-row step at 384 tokens from 400 to 220 us a
// layer with both threads, 2 or 8 rows and 2-3 blocks ahead were slower: ad hoc variants in
// bench/results/measure-load-zen5-s18.json; against the kernel before, decode-attention-ab-prefetch-s18-zen5.json).
constexpr int64_t kRunRows = kAvx512 ? 4 : 0;      // 0: the whole next block before this one's rows
template <typename T>
struct NextBlock {
  const char* bytes = nullptr;
  int64_t rows = 0, row_bytes = 0;
  NextBlock(const T* cache, const int64_t* table, int64_t t0, int64_t t_end, int64_t block_size,
            int64_t token_stride) {
    const int64_t next = t0 + block_size;
    if (next >= t_end) return;
    bytes = reinterpret_cast<const char*>(cache + table[next / block_size] * block_size * token_stride);
    rows = std::min(block_size, t_end - next);
    row_bytes = token_stride * static_cast<int64_t>(sizeof(T));
  }
  void prefetch(int64_t from, int64_t to) const {      // its rows [from, to)
    const int64_t end = std::min(to, rows) * row_bytes;
    for (int64_t off = from * row_bytes; off < end; off += 64) _mm_prefetch(bytes + off, _MM_HINT_T0);
  }
};

// One part of one request: its query heads (q, head_dim apart; KV head g's are g * group ...)
// against tokens [t_begin, t_end) (whole blocks but for the context's last), every KV head of a
// token by the same thread: the cache interleaves the KV heads of a token, and a thread reading
// one head's 256 bytes of each 768 would have the prefetcher bring in the rest for nothing.
// Writes, per query head, the scores' max m, the sum l of exp(score - m) and acc = sum
// exp(score - m) v, unnormalised: part[h * (head_dim + 2) ...] = acc[head_dim], m, l.
// scores: scratch of heads * (t_end - t_begin); wide: of block_size * kv_heads * head_dim (a float16
// cache's block widened, a float32 one copied: widen_block).
template <typename T>
void attend_part(const float* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t t_begin,
                 int64_t t_end, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                 float* scores, float* wide, float* part) {
  // Denormals flushed to zero while this thread runs it (and the caller's mode restored): a
  // peaked softmax leaves many weights below 1e-38, and each exp, product and sum on a denormal
  // takes a microcode assist (2x the kernel's time on a peaked softmax over 750 tokens). They add
  // nothing a float32 sum of ~1 could show.
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);         // FTZ | DAZ
  const int64_t len = t_end - t_begin, group = heads / kv_heads, token_stride = kv_heads * head_dim;
  // A 16-bit block read in place by the grouped loops (AVX-512): widened into `wide` first, a float16
  // cache ran a Zen 5 step at 0.84-1.21x the float32 cache's time though it reads half the bytes.
  const bool in_place = kAvx512 && !std::is_same_v<T, float> && grouped<T>(group, head_dim);
  // Block by block (the slot of token t found once per block, not by a division per token), in runs of
  // rows: fn(rows, t, m) for the m rows from token t, rows in place or widened into `wide`, the next
  // block asked for as NextBlock says.
  auto each_run = [&](const T* cache, auto&& fn) {
    for (int64_t t0 = t_begin; t0 < t_end; t0 += block_size) {
      const int64_t n = std::min(block_size, t_end - t0);
      const NextBlock<T> next(cache, table, t0, t_end, block_size, token_stride);
      if (!kRunRows) next.prefetch(0, block_size);
      const T* block = cache + table[t0 / block_size] * block_size * token_stride;
      auto runs = [&](const auto* rows) {
        const int64_t run = kRunRows ? kRunRows : n;
        for (int64_t c = 0; c < n; c += run) {
          if (kRunRows) next.prefetch(c, c + run);
          fn(rows + c * token_stride, t0 + c, std::min(run, n - c));
        }
      };
      if (in_place) runs(block);
      else runs(widen_block(block, n * token_stride, wide));
    }
  };
  each_run(k_cache, [&](const auto* kb, int64_t t, int64_t m) {
    for (int64_t kv = 0; kv < kv_heads; ++kv)
      score_group(q + kv * group * head_dim, kb + kv * head_dim, m, group, head_dim, token_stride,
                  scores + kv * group * len + t - t_begin, len);
  });
  const float score_scale = scale / kRawUnit<T>;      // exact: the unit is a power of 2
  for (int64_t h = 0; h < heads; ++h) {
    float* sh = scores + h * len;
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sh[t] *= score_scale);
    const float sum = exp_shifted_sum(sh, len, mx);
    float* ph = part + h * (head_dim + 2);
    std::fill(ph, ph + head_dim, 0.f);
    ph[head_dim] = mx;
    ph[head_dim + 1] = sum;
  }
  each_run(v_cache, [&](const auto* vb, int64_t t, int64_t m) {
    for (int64_t kv = 0; kv < kv_heads; ++kv)
      add_values_group(scores + kv * group * len + t - t_begin, len, vb + kv * head_dim, m, group, head_dim,
                       token_stride, part + kv * group * (head_dim + 2), head_dim + 2);
  });
  if constexpr (kRawUnit<T> != 1.f)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < head_dim; ++i) part[h * (head_dim + 2) + i] /= kRawUnit<T>;
  _mm_setcsr(csr);
}

struct Part {
  int64_t row, t_begin, t_end;
};

// out [rows, heads * head_dim]: row r's query (q + r * q_stride, heads of head_dim) against its
// first lens[r] tokens, found through tables[r * width ...]. Work is split into parts (a row's
// context cut into runs of whole blocks) over `threads` threads; a short context stays in one
// part and a small step on the calling thread: a parallel region costs more than the few
// microseconds of work it would share.
template <typename T>
int paged_decode_attention(const float* q, int64_t q_stride, const T* k_cache, const T* v_cache, const int64_t* tables,
                           int64_t width, const int64_t* lens, int64_t rows, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, int64_t block_size, float scale, float* out, int threads) {
  // Below kMinPartTokens a part's fixed costs (merge, scratch) dominate; a step needs
  // kMinParallelKeys keys x KV heads before it uses the threads. The AVX2 build splits sooner: on a
  // Zen 3 one thread reads a lone decode's 257-token K/V at a third of what a core reads, and two
  // parts of 128+ tokens on two threads took 1.9x less time (decode-attention-ab-sweep-s9z.json).
  constexpr int64_t kMinPartTokens = kAvx512 ? 256 : 128;
  constexpr int64_t kMinParallelKeys = kAvx512 ? 1024 : 768;
  const int64_t stride = head_dim + 2;
  int64_t keys = 0;
  for (int64_t r = 0; r < rows; ++r) keys += lens[r] * kv_heads;
  threads = keys >= kMinParallelKeys ? std::max(threads, 1) : 1;
  // Cut each row's context so that there are about two parts per thread, in whole blocks.
  std::vector<Part> parts;
  std::vector<int64_t> first(rows + 1);       // parts of row r: [first[r], first[r + 1])
  const int64_t want = (2 * threads + rows - 1) / rows;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t blocks = (lens[r] + block_size - 1) / block_size;
    const int64_t n = std::max<int64_t>(1, std::min({want, lens[r] / kMinPartTokens, blocks}));
    first[r] = static_cast<int64_t>(parts.size());
    for (int64_t p = 0; p < n; ++p)
      parts.push_back({r, std::min(lens[r], blocks * p / n * block_size),
                       std::min(lens[r], blocks * (p + 1) / n * block_size)});
  }
  first[rows] = static_cast<int64_t>(parts.size());
  std::vector<float> results(parts.size() * heads * stride);
  const int64_t count = static_cast<int64_t>(parts.size());
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t i = 0; i < count; ++i) {
    const Part& p = parts[i];
    thread_local std::vector<float> scores, wide;
    const int64_t need = heads * (p.t_end - p.t_begin);
    const int64_t block = sizeof(T) < sizeof(float) || kCopyF32 ? block_size * kv_heads * head_dim : 0;
    if (static_cast<int64_t>(scores.size()) < need) scores.resize(need);
    if (static_cast<int64_t>(wide.size()) < block) wide.resize(block);
    attend_part(q + p.row * q_stride, k_cache, v_cache, tables + p.row * width, p.t_begin, p.t_end, heads, kv_heads,
                head_dim, block_size, scale, scores.data(), wide.data(), results.data() + i * heads * stride);
  }
  // Merge each row's parts per query head: rescale every part's sum and accumulator to the
  // largest max, then divide once.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = first[r + 1] - first[r];
    const float* base = results.data() + first[r] * heads * stride;
    for (int64_t h = 0; h < heads; ++h) {
      float* o = out + (r * heads + h) * head_dim;
      float mx = -INFINITY, sum = 0.f;
      for (int64_t p = 0; p < n; ++p) mx = std::max(mx, base[(p * heads + h) * stride + head_dim]);
      std::fill(o, o + head_dim, 0.f);
      for (int64_t p = 0; p < n; ++p) {
        const float* part = base + (p * heads + h) * stride;
        const float w = n == 1 ? 1.f : std::exp(part[head_dim] - mx);
        sum += w * part[head_dim + 1];
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) o[i] += w * part[i];
      }
      const float inv = 1.f / sum;
#pragma omp simd
      for (int64_t i = 0; i < head_dim; ++i) o[i] *= inv;
    }
  }
  return 0;
}

}  // namespace

// The float32 cache's entry point, the float16 one's (k_cache, v_cache: IEEE half bits), the
// bfloat16 one's (their bits) and the 8-bit floats' (their codes); the arguments are
// paged_decode_attention's above.
extern "C" int rs_paged_decode_attention(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                                         const int64_t* tables, int64_t width, const int64_t* lens, int64_t rows,
                                         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                         float scale, float* out, int threads) {
  return paged_decode_attention(q, q_stride, k_cache, v_cache, tables, width, lens, rows, heads, kv_heads, head_dim,
                                block_size, scale, out, threads);
}

extern "C" int rs_paged_decode_attention_f16(const float* q, int64_t q_stride, const uint16_t* k_cache,
                                             const uint16_t* v_cache, const int64_t* tables, int64_t width,
                                             const int64_t* lens, int64_t rows, int64_t heads, int64_t kv_heads,
                                             int64_t head_dim, int64_t block_size, float scale, float* out,
                                             int threads) {
  return paged_decode_attention(q, q_stride, k_cache, v_cache, tables, width, lens, rows, heads, kv_heads, head_dim,
                                block_size, scale, out, threads);
}

extern "C" int rs_paged_decode_attention_bf16(const float* q, int64_t q_stride, const uint16_t* k_cache,
                                              const uint16_t* v_cache, const int64_t* tables, int64_t width,
                                              const int64_t* lens, int64_t rows, int64_t heads, int64_t kv_heads,
                                              int64_t head_dim, int64_t block_size, float scale, float* out,
                                              int threads) {
  return paged_decode_attention(q, q_stride, reinterpret_cast<const bf16*>(k_cache),
                                reinterpret_cast<const bf16*>(v_cache), tables, width, lens, rows, heads, kv_heads,
                                head_dim, block_size, scale, out, threads);
}

extern "C" int rs_paged_decode_attention_fp8e4m3(const float* q, int64_t q_stride, const uint8_t* k_cache,
                                                 const uint8_t* v_cache, const int64_t* tables, int64_t width,
                                                 const int64_t* lens, int64_t rows, int64_t heads, int64_t kv_heads,
                                                 int64_t head_dim, int64_t block_size, float scale, float* out,
                                                 int threads) {
  return paged_decode_attention(q, q_stride, reinterpret_cast<const fp8e4m3*>(k_cache),
                                reinterpret_cast<const fp8e4m3*>(v_cache), tables, width, lens, rows, heads, kv_heads,
                                head_dim, block_size, scale, out, threads);
}

extern "C" int rs_paged_decode_attention_fp8e5m2(const float* q, int64_t q_stride, const uint8_t* k_cache,
                                                 const uint8_t* v_cache, const int64_t* tables, int64_t width,
                                                 const int64_t* lens, int64_t rows, int64_t heads, int64_t kv_heads,
                                                 int64_t head_dim, int64_t block_size, float scale, float* out,
                                                 int threads) {
  return paged_decode_attention(q, q_stride, reinterpret_cast<const fp8e5m2*>(k_cache),
                                reinterpret_cast<const fp8e5m2*>(v_cache), tables, width, lens, rows, heads, kv_heads,
                                head_dim, block_size, scale, out, threads);
}
