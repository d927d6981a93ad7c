// y [rows, n] = x [rows, k] W^T for a dense weight W [n, k] (row-major, as torch keeps a Linear's
// weight): the GEMV of the native decode step (decode_loop.cpp) for a model whose weights are not
// kept packed (an HF safetensors checkpoint), with rs_vnni_gemv's signature
// so the loop calls it through the same pointer. A decode step's GEMV is bound by the weight's
// bytes: each thread streams its own run of output rows, four at a time (four sequential reads the
// prefetcher follows), and the rows of x meet them while they are in L1; the sums are float32 in
// lanes, then across them (another order than torch's GEMM: the same values up to float32
// rounding). The weight is float32 or bfloat16 (a bf16 model's, widened exactly: the activations
// and the arithmetic stay float32). Built into both ISAs' libraries: 16 lanes with AVX-512, 8
// with AVX2.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
// bfloat16 is float32's top half: widened exactly by a shift into the top of each lane.
inline Vec load(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float sum(Vec v) { return _mm512_reduce_add_ps(v); }
#else
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

inline float widen(float w) { return w; }
inline float widen(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

constexpr int64_t kOut = 4;     // output rows a pass: 4 accumulators and 4 weight loads a vector of x

// y[(r0 + x) * n + j + i] for i < R, x < X: rows r0 .. r0 + X - 1 of x against weight rows
// j .. j + R - 1, each weight vector loaded (and widened) once for the X rows.
template <typename T, int R, int X>
void dot_block(const T* w, int64_t k, const float* x, int64_t r0, float* y, int64_t n, int64_t j) {
  Vec acc[R][X];
  for (int i = 0; i < R; ++i)
    for (int r = 0; r < X; ++r) acc[i][r] = zero();
  int64_t c = 0;
  for (; c + kLanes <= k; c += kLanes) {
    Vec wv[R];
    for (int i = 0; i < R; ++i) wv[i] = load(w + (j + i) * k + c);
    for (int r = 0; r < X; ++r) {
      const Vec xv = load(x + (r0 + r) * k + c);
      for (int i = 0; i < R; ++i) acc[i][r] = fma(wv[i], xv, acc[i][r]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int r = 0; r < X; ++r) {
      const float* xr = x + (r0 + r) * k;
      float s = sum(acc[i][r]);
      for (int64_t t = c; t < k; ++t) s += widen(w[(j + i) * k + t]) * xr[t];
      y[(r0 + r) * n + j + i] = s;
    }
}

// Every row of x against weight rows j .. j + R - 1. A bfloat16 weight's vectors are widened once
// for kRowsAtOnce rows (their accumulators fill the registers: 16 of AVX-512's 32, 8 of AVX2's 16;
// 1.05-1.37x one row at a time at 4-16 rows of SmolLM2's weights, a Zen 5); a float32 one meets
// the rows one by one (four at once ran 0.90-0.97x at 8-16 rows there).
template <typename T, int R>
void dot_rows(const T* w, int64_t k, const float* x, int64_t rows, float* y, int64_t n, int64_t j) {
  constexpr int kRowsAtOnce = std::is_same<T, float>::value ? 1 : (kLanes == 16 ? 4 : 2);
  int64_t r = 0;
  for (; r + kRowsAtOnce <= rows; r += kRowsAtOnce) dot_block<T, R, kRowsAtOnce>(w, k, x, r, y, n, j);
  for (; r < rows; ++r) dot_block<T, R, 1>(w, k, x, r, y, n, j);
}

template <typename T>
void gemv(const float* x, int64_t rows, int64_t k, const T* w, int64_t n, float* y, int threads) {
  // At least 64 output rows a thread: below that a parallel region costs more than it shares.
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n / 64)));
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int64_t id = omp_get_thread_num(), count = omp_get_num_threads();
    // Whole groups of kOut rows a thread, in one run of memory each.
    const int64_t groups = n / kOut, ga = groups * id / count, gb = groups * (id + 1) / count;
    for (int64_t g = ga; g < gb; ++g) dot_rows<T, kOut>(w, k, x, rows, y, n, g * kOut);
    if (id == count - 1)
      for (int64_t j = groups * kOut; j < n; ++j) dot_rows<T, 1>(w, k, x, rows, y, n, j);
  }
}

}  // namespace

// kind: 0 a float32 weight, 1 a bfloat16 one (multiplied in float32). Returns 0, or -1 for
// arguments it cannot take.
extern "C" int rs_dense_gemv(const float* x, int64_t rows, int64_t k, const uint8_t* weight, int64_t n, int kind,
                             float* y, int threads) {
  if (rows < 0 || k < 1 || n < 0 || kind < 0 || kind > 1 || threads < 1) return -1;
  if (kind == 0) gemv(x, rows, k, reinterpret_cast<const float*>(weight), n, y, threads);
  else gemv(x, rows, k, reinterpret_cast<const uint16_t*>(weight), n, y, threads);
  return 0;
}
