// 8-bit float KV cache elements (`--kv-cache-dtype fp8` / `fp8_e4m3`: OCP e4m3fn; `fp8_e5m2`), read by
// paged_decode_attention.cpp and prefill_attention.cpp and written by decode_loop.cpp. Both widen
// through F16C, which every native build has: an e5m2 code is a float16's top byte, and an e4m3 code's
// exponent and mantissa moved into float16's places (the sign kept) are a float16 equal to the value
// times 2^-8, normal and subnormal alike (float16's exponent bias is 8 more than e4m3's), so one
// multiply by 256 gives the value exactly, or a reader scales its results instead. The cache holds
// the values themselves (vLLM's k_scale and v_scale of 1.0, what it uses where a checkpoint gives
// none).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

struct fp8e4m3 {
  uint8_t bits;
};
struct fp8e5m2 {
  uint8_t bits;
};

inline uint16_t half_bits(fp8e5m2 x) { return static_cast<uint16_t>(x.bits << 8); }
inline uint16_t half_bits(fp8e4m3 x) { return static_cast<uint16_t>((x.bits & 0x80) << 8 | (x.bits & 0x7F) << 7); }

// "Raw" values: the float16 that half_bits makes, i.e. the value times kFp8RawUnit (2^-8 for e4m3,
// float16's bias less e4m3's; 1 for e5m2), exact and never a float32 denormal (F16C widens float16
// subnormals exactly, whatever MXCSR's DAZ says). A reader that scales its results by 1 / unit
// skips a multiply a vector (paged_decode_attention.cpp); widen8 gives the values.
template <typename T>
constexpr float kFp8RawUnit = 1.f;
template <>
inline constexpr float kFp8RawUnit<fp8e4m3> = 1.f / 256.f;
template <typename T>
inline float fp8_raw(T x) { return _cvtsh_ss(half_bits(x)); }

// 8 raw elements from p widened to float32: an e5m2 code zero-extended and moved to the top byte;
// an e4m3 one sign-extended, so that shifted left by 7 its sign lands in bit 15 (and a copy in bit
// 14, cleared), its exponent and mantissa in bits 13-7.
inline __m128i half_bits8(const fp8e5m2* p) {
  return _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8);
}
inline __m128i half_bits8(const fp8e4m3* p) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
}
template <typename T>
inline __m256 widen8_raw(const T* p) { return _mm256_cvtph_ps(half_bits8(p)); }
// ... and their values.
inline __m256 widen8(const fp8e5m2* p) { return widen8_raw(p); }
inline __m256 widen8(const fp8e4m3* p) { return _mm256_mul_ps(widen8_raw(p), _mm256_set1_ps(256.f)); }
#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 raw elements, as half_bits8.
inline __m256i half_bits16(const fp8e5m2* p) {
  return _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8);
}
inline __m256i half_bits16(const fp8e4m3* p) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
}
template <typename T>
inline __m512 widen16_raw(const T* p) { return _mm512_cvtph_ps(half_bits16(p)); }
#endif

// x rounded to nearest even on the grid of a format of M mantissa bits and exponent bias B whose
// largest finite value is `max`, saturating there (vLLM's fp8 cache does; torch's float -> e5m2 cast
// would give inf), NaN kept a NaN (0x7F): bit for bit torch's x.clamp(-max, max).to(float8_*).
template <int M, int B>
inline uint8_t fp8_code(float x, float max) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>(bits >> 24 & 0x80);
  float a = std::fabs(x);
  if (a != a) return sign | 0x7F;
  a = std::min(a, max);
  std::memcpy(&bits, &a, sizeof bits);
  const int e = static_cast<int>(bits >> 23) - 127;
  if (e < 1 - B)      // a subnormal code (or zero): whole units of 2^(1 - B - M), to nearest even
    return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(a, B - 1 + M)));
  constexpr int shift = 23 - M;
  constexpr uint32_t half = 1u << (shift - 1);
  const uint32_t mant = bits & 0x7FFFFF, rest = mant & ((1u << shift) - 1);
  uint32_t code = static_cast<uint32_t>(e + B) << M | mant >> shift;
  if (rest > half || (rest == half && (code & 1))) ++code;     // a carry moves into the exponent
  return sign | static_cast<uint8_t>(code);
}
inline uint8_t fp8_code(float x, fp8e4m3) { return fp8_code<3, 7>(x, 448.f); }
inline uint8_t fp8_code(float x, fp8e5m2) { return fp8_code<2, 15>(x, 57344.f); }
