// exp over 8 or 16 floats at a time, and SiLU, written with GCC's vector extensions so that each build
// compiles them to its own ISA (AVX2's ymm, AVX-512's): std::exp is a scalar libm call of ~20 ns,
// which a prefill's SiLU over 512 x 1536 values paid ~4 ms a layer for, and GCC 12 does not
// vectorise a scalar polynomial exp whose argument is clamped (it splits the loop at the clamp).
// Cephes' expf: x = n ln2 + r, a degree-7 polynomial in r, times 2^n; relative error ~2e-7.
// This header must hold only inline math (native.py hashes it into the builds).
#pragma once
#include <cstdint>

typedef float rs_f8 __attribute__((vector_size(32)));
typedef int32_t rs_i8 __attribute__((vector_size(32)));
typedef float rs_f16 __attribute__((vector_size(64)));      // AVX2 runs it as two ymm
typedef int32_t rs_i16 __attribute__((vector_size(64)));

// exp(x) for x clamped to [-87, 88], where 2^n stays a normal float; F a float vector type, I the
// int32 vector of as many lanes.
template <typename F, typename I>
inline F rs_expv(F x) {
  const F lo = F{} - 87.0f, hi = F{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // floor(x log2 e + 0.5) by truncation of a positive value: x log2 e + 128.5 > 0 after the clamp.
  const I n = __builtin_convertvector(x * 1.44269504088896341f + 128.5f, I) - 128;
  const F nf = __builtin_convertvector(n, F);
  const F r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * reinterpret_cast<F>((n + 127) << 23);
}

inline rs_f8 rs_exp8(rs_f8 x) { return rs_expv<rs_f8, rs_i8>(x); }

// out[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u for i < n; below g = -88 the clamp leaves
// |silu| < 1e-36 where it is ~0.
inline void rs_silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    rs_f8 gv, uv;
    __builtin_memcpy(&gv, g + i, sizeof gv);
    __builtin_memcpy(&uv, u + i, sizeof uv);
    const rs_f8 o = gv / (1.0f + rs_exp8(-gv)) * uv;
    __builtin_memcpy(out + i, &o, sizeof o);
  }
  for (; i < n; ++i) {
    rs_f8 gv = rs_f8{} + g[i];
    out[i] = (gv / (1.0f + rs_exp8(-gv)))[0] * u[i];
  }
}
