// Fused decode ops for float32 rows, each one call where torch takes several ops (and several
// Python dispatches, which is what a batch-1 decode step pays for them): residual add + RMSNorm,
// SiLU-and-mul, and neox RoPE in place. model/native_ops.py calls them through ctypes and keeps
// the torch form of each for everything else; the math is that form's, in float32. This file must
// never allocate tensors: the caller passes every buffer.
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec_exp.h"

extern "C" {

// residual += h (h may be null: residual alone), then out = residual * rsqrt(mean(residual^2) + eps)
// * weight, per row of n.
int rs_add_rms_norm(const float* h, float* residual, const float* weight, float eps, int64_t rows, int64_t n,
                    float* out) {
#pragma omp parallel for if (rows >= 64) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float* x = residual + r * n;
    if (h != nullptr) {
      const float* hr = h + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) x[i] += hr[i];
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    float* o = out + r * n;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) o[i] = x[i] * inv * weight[i];
  }
  return 0;
}

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, n + i].
int rs_silu_and_mul(const float* gate_up, int64_t rows, int64_t n, float* out) {
#pragma omp parallel for if (rows >= 64) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * n;
    const float* u = g + n;
    float* o = out + r * n;
    rs_silu_mul_row(g, u, o, n);
  }
  return 0;
}

// The first `heads` heads of each row of x (row stride `stride`, heads of head_dim contiguous)
// become x * cos + roll(x, head_dim / 2) * sin, cos and sin [rows, head_dim] (sin's first half
// negated), as rotary.apply_rope computes.
int rs_rope_neox(float* x, int64_t rows, int64_t stride, int64_t heads, int64_t head_dim, const float* cos,
                 const float* sin) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for if (rows >= 64) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * head_dim;
    const float* s = sin + r * head_dim;
    for (int64_t hd = 0; hd < heads; ++hd) {
      float* v = x + r * stride + hd * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] + b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
  return 0;
}

}  // extern "C"
