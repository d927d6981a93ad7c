// The GEMVs of a batch-1 decode step, timed without the rest of the step: bench/avx2_decode_gemv_ab.py
// builds this beside each side's csrc/avx2_gemv.cpp and calls it through ctypes. A step is the
// weights' GEMVs back to back on their own buffers (one row of x, as rs_decode_layers calls them);
// the plain read is an AVX2 read of the same buffers, one OpenMP region a weight as the GEMVs
// open: the bytes' own time on this machine, in the same process and minute.
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>

typedef int (*RsGemv)(const float* x, int64_t rows, int64_t k, const uint8_t* packed, int64_t tiles, int kind,
                      float* y, int threads);

namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
}  // namespace

// Seconds of one step: weight i (packed[i], tiles[i], k[i], kind[i]) times x, into y.
extern "C" double rs_bench_gemv_step(RsGemv gemv, const uint8_t* const* packed, const int64_t* tiles,
                                     const int64_t* k, const int* kind, int count, const float* x, float* y,
                                     int threads) {
  const double t0 = now();
  for (int i = 0; i < count; ++i)
    if (gemv(x, 1, k[i], packed[i], tiles[i], kind[i], y, threads)) return -1.0;
  return now() - t0;
}

// Seconds of one plain read of the same buffers (bytes[i] each, a multiple of 32).
extern "C" double rs_bench_plain_read(const uint8_t* const* packed, const int64_t* bytes, int count, int threads,
                                      int64_t* sink) {
  const double t0 = now();
  int64_t acc = 0;
  for (int i = 0; i < count; ++i) {
    const uint8_t* p = packed[i];
    const int64_t m = bytes[i] / 32;
#pragma omp parallel num_threads(threads) reduction(| : acc)
    {
      __m256i a = _mm256_setzero_si256();
#pragma omp for schedule(static)
      for (int64_t j = 0; j < m; ++j) a = _mm256_or_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j)));
      acc |= _mm256_extract_epi64(a, 0) | _mm256_extract_epi64(a, 1) | _mm256_extract_epi64(a, 2) |
             _mm256_extract_epi64(a, 3);
    }
  }
  *sink = acc;
  return now() - t0;
}
