// Decode attention over a paged KV cache, float32, read in place through the block table: one
// query token per request, its K/V spread over blocks of `block_size` tokens ([num_blocks,
// block_size, kv_heads, head_dim] caches). This is what the torch backend does with a gather of
// the blocks and one SDPA call, without the gather and the dozen small ops around it. A KV
// head's query heads (GQA) share each loaded key and value. Plain C++ that the compiler
// vectorises for whichever ISA the library is built for. torch_attention.py calls it through
// model/native_ops.py, and decode_loop.cpp per layer; this file must never write the cache.
#include <xmmintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// exp(x) for the x <= 0 of a softmax after its max is subtracted (Cephes' expf: x = n ln2 + r,
// a degree-7 polynomial in r, times 2^n; relative error ~2e-7). Arithmetic only, so that the
// loop around it vectorises: std::exp is a scalar libm call of ~20 ns, which was most of this
// kernel's time (0.1 ms a layer at 257 tokens of context on SmolLM2).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);          // 2^n stays a normal float
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// One request's KV head g: its `group` query heads (qg, head_dim apart) against its first len
// tokens; scores is scratch of group * len floats; out gets group * head_dim floats.
void attend_one(const float* qg, const float* k_cache, const float* v_cache, const int64_t* table, int64_t len,
                int64_t group, int64_t head_dim, int64_t block_size, int64_t token_stride, float scale,
                float* scores, float* out) {
  // Denormals flushed to zero while this thread runs it (and the caller's mode restored): a
  // peaked softmax leaves many weights below 1e-38, and each exp, product and sum on a denormal
  // takes a microcode assist (2x the kernel's time on a peaked softmax over 750 tokens). They add
  // nothing a float32 sum of ~1 could show.
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);         // FTZ | DAZ
  // Block by block: the slot of token t is found once per block, not by a division per token.
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const int64_t n = std::min(block_size, len - t0);
    const float* kb = k_cache + table[t0 / block_size] * block_size * token_stride;
    for (int64_t j = 0; j < n; ++j) {
      const float* k = kb + j * token_stride;
      for (int64_t h = 0; h < group; ++h) {
        const float* qh = qg + h * head_dim;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < head_dim; ++i) s += qh[i] * k[i];
        scores[h * len + t0 + j] = s * scale;
      }
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* sh = scores + h * len;
    const float mx = *std::max_element(sh, sh + len);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      sh[t] = exp_nonpositive(sh[t] - mx);
      sum += sh[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) sh[t] *= inv;
  }
  std::fill(out, out + group * head_dim, 0.f);
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const int64_t n = std::min(block_size, len - t0);
    const float* vb = v_cache + table[t0 / block_size] * block_size * token_stride;
    for (int64_t j = 0; j < n; ++j) {
      const float* v = vb + j * token_stride;
      for (int64_t h = 0; h < group; ++h) {
        const float p = scores[h * len + t0 + j];
        float* a = out + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) a[i] += p * v[i];
      }
    }
  }
  _mm_setcsr(csr);
}

}  // namespace

// out [rows, heads * head_dim]: row r's query (q + r * q_stride, heads of head_dim) against its
// first lens[r] tokens, found through tables[r * width ...]. Rows and KV heads are split over the
// threads from 4 rows on; a lone decode's few KV heads are not worth a parallel region.
extern "C" int rs_paged_decode_attention(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                                         const int64_t* tables, int64_t width, const int64_t* lens, int64_t rows,
                                         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                         float scale, float* out) {
  const int64_t group = heads / kv_heads, token_stride = kv_heads * head_dim;
#pragma omp parallel for collapse(2) if (rows >= 4) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < kv_heads; ++g) {
      thread_local std::vector<float> scores;
      if (static_cast<int64_t>(scores.size()) < group * lens[r]) scores.resize(group * lens[r]);
      attend_one(q + r * q_stride + g * group * head_dim, k_cache + g * head_dim, v_cache + g * head_dim,
                 tables + r * width, lens[r], group, head_dim, block_size, token_stride, scale, scores.data(),
                 out + r * heads * head_dim + g * group * head_dim);
    }
  }
  return 0;
}
