// Decode attention over a paged KV cache, float32, read in place through the block table: one
// query token per request, its K/V spread over blocks of `block_size` tokens ([num_blocks,
// block_size, kv_heads, head_dim] caches). This is what the torch backend does with a gather of
// the blocks and one SDPA call, without the gather and the dozen small ops around it. A KV
// head's query heads (GQA) share each loaded key and value. torch_attention.py calls it through
// model/native_ops.py; this file must never write the cache.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

extern "C" int rs_paged_decode_attention(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                                         const int64_t* tables, int64_t width, const int64_t* lens, int64_t rows,
                                         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                         float scale, float* out) {
  const int64_t group = heads / kv_heads, token_stride = kv_heads * head_dim;
#pragma omp parallel for collapse(2) if (rows >= 4) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < kv_heads; ++g) {
      const int64_t len = lens[r];
      const int64_t* table = tables + r * width;
      std::vector<float> scores(group * len), acc(group * head_dim, 0.f);
      const float* qg = q + r * q_stride + g * group * head_dim;
      for (int64_t t = 0; t < len; ++t) {
        const float* k = k_cache + (table[t / block_size] * block_size + t % block_size) * token_stride + g * head_dim;
        for (int64_t h = 0; h < group; ++h) {
          const float* qh = qg + h * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t i = 0; i < head_dim; ++i) s += qh[i] * k[i];
          scores[h * len + t] = s * scale;
        }
      }
      for (int64_t h = 0; h < group; ++h) {
        float* sh = scores.data() + h * len;
        const float mx = *std::max_element(sh, sh + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) sum += (sh[t] = std::exp(sh[t] - mx));
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sh[t] *= inv;
      }
      for (int64_t t = 0; t < len; ++t) {
        const float* v = v_cache + (table[t / block_size] * block_size + t % block_size) * token_stride + g * head_dim;
        for (int64_t h = 0; h < group; ++h) {
          const float p = scores[h * len + t];
          float* a = acc.data() + h * head_dim;
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) a[i] += p * v[i];
        }
      }
      float* o = out + r * heads * head_dim + g * group * head_dim;
      std::copy(acc.begin(), acc.end(), o);
    }
  }
  return 0;
}
