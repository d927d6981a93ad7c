// The decode step of a dense Llama-style decoder in one call: every layer (RMSNorm with the
// residual, fused qkv, RoPE, the KV cache write, paged attention, o_proj, RMSNorm, gate_up,
// SiLU-and-mul, down) and the final norm, for a batch of single-token queries, with the ops of
// this library and the weights' own GEMV (a packed kernel's, or dense_gemv.cpp's). In Python
// each layer is ~30 dispatches and ctypes calls around ~10 small native calls, which a batch-1
// decode step of SmolLM2 paid more for than for its attention. model/native_decode.py lays out the structs below once per model
// (the pointers of every layer's weights and KV cache) and calls rs_decode_layers once per step;
// the torch path computes the same (tests/test_native_decode.py). This file must never allocate
// tensors nor decide when it runs: the caller passes every buffer. Activations are float32 (a
// bfloat16 model's norm weights, cos and sin come widened; its dense weights are multiplied in
// float32 by rs_dense_gemv). The KV cache is float32, float16, bfloat16 or an 8-bit float
// (RsDecoder.kv_dtype): a narrower one is written rounded to nearest even, as torch's .to() rounds
// (an 8-bit one saturating, as torch's cast after a clamp), and read by its own
// rs_paged_decode_attention_* entry.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstring>

#include "kv_fp8.h"

extern "C" {
int rs_add_rms_norm(const float* h, float* residual, const float* weight, float eps, int64_t rows, int64_t n,
                    float* out);
int rs_silu_and_mul(const float* gate_up, int64_t rows, int64_t n, float* out);
int rs_rope_neox(float* x, int64_t rows, int64_t stride, int64_t heads, int64_t head_dim, const float* cos,
                 const float* sin);
int rs_paged_decode_attention(const float* q, int64_t q_stride, const float* k_cache, const float* v_cache,
                              const int64_t* tables, int64_t width, const int64_t* lens, int64_t rows, int64_t heads,
                              int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, float* out,
                              int threads);
int rs_paged_decode_attention_f16(const float* q, int64_t q_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                                  const int64_t* tables, int64_t width, const int64_t* lens, int64_t rows,
                                  int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                  float* out, int threads);
int rs_paged_decode_attention_bf16(const float* q, int64_t q_stride, const uint16_t* k_cache,
                                   const uint16_t* v_cache, const int64_t* tables, int64_t width, const int64_t* lens,
                                   int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                   float scale, float* out, int threads);
int rs_paged_decode_attention_fp8e4m3(const float* q, int64_t q_stride, const uint8_t* k_cache, const uint8_t* v_cache,
                                      const int64_t* tables, int64_t width, const int64_t* lens, int64_t rows,
                                      int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                      float scale, float* out, int threads);
int rs_paged_decode_attention_fp8e5m2(const float* q, int64_t q_stride, const uint8_t* k_cache, const uint8_t* v_cache,
                                      const int64_t* tables, int64_t width, const int64_t* lens, int64_t rows,
                                      int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                      float scale, float* out, int threads);

// A GEMV of the library (rs_vnni_gemv's signature), passed as a pointer: the loop runs whichever
// kernel packed the weights, or rs_dense_gemv for a dense float32 weight (a row a "tile").
typedef int (*RsGemv)(const float* x, int64_t rows, int64_t k, const uint8_t* packed, int64_t tiles, int kind,
                      float* y, int threads);

struct RsLinear {
  RsGemv gemv;
  const uint8_t* packed;
  int64_t tiles;
  int64_t width;            // output columns the GEMV writes per row (tiles * rows a tile): qkv's row
                            // stride (o, gate_up and down have no padding: native_decode.supports)
  int64_t kind;
};

struct RsDecoderLayer {
  const float* input_norm;
  const float* post_norm;
  RsLinear qkv, o, gate_up, down;
  void* k_cache;            // [blocks, block_size, kv_heads, head_dim], of RsDecoder.kv_dtype
  void* v_cache;
};

struct RsDecoder {
  int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
  int64_t wide;             // the wider of a qkv and a gate_up output row
  int64_t kv_dtype;         // every layer's KV cache: 0 float32, 1 float16 (IEEE half bits), 2 bfloat16,
                            // 3 fp8 e4m3, 4 fp8 e5m2 (their codes, kv_fp8.h)
  float eps, scale;
  const RsDecoderLayer* layers;
  const float* final_norm;
};

// What `seconds` (when not null) adds each op's time to, in this order.
enum RsOp { kNorm, kQkv, kRopeKv, kAttention, kOProj, kGateUp, kAct, kDown, kNumOps };

}  // extern "C"

namespace {

class Clock {
 public:
  explicit Clock(double* seconds) : seconds_(seconds), last_(now()) {}
  void lap(RsOp op) {          // time since the last lap goes to op
    if (seconds_ == nullptr) return;
    const double t = now();
    seconds_[op] += t - last_;
    last_ = t;
  }

 private:
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  double* seconds_;
  double last_;
};

enum RsKvDtype { kKvFloat32, kKvFloat16, kKvBFloat16, kKvFp8E4m3, kKvFp8E5m2 };

int64_t kv_elem_bytes(int64_t dtype) {
  return dtype == kKvFloat32 ? sizeof(float) : dtype >= kKvFp8E4m3 ? 1 : sizeof(uint16_t);
}

}  // namespace

// n floats of a token's K or V into its cache slot at dst: float32 as they are, float16 rounded
// to nearest even (F16C, 8 at a time), bfloat16 rounded to nearest even with NaN kept a quiet
// NaN (torch's float -> bfloat16 rounding, bit for bit), or an 8-bit float code (kv_fp8.h: torch's
// saturating cast, bit for bit). Returns 0, or -1 for an unknown dtype. Exported for the tests.
extern "C" int rs_store_kv(void* dst, const float* src, int64_t n, int64_t dtype) {
  if (dtype == kKvFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
    return 0;
  }
  if (dtype == kKvFp8E4m3 || dtype == kKvFp8E5m2) {
    uint8_t* d = static_cast<uint8_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = dtype == kKvFp8E4m3 ? fp8_code(src[i], fp8e4m3{}) : fp8_code(src[i], fp8e5m2{});
    return 0;
  }
  if (dtype != kKvFloat16 && dtype != kKvBFloat16) return -1;
  uint16_t* d = static_cast<uint16_t*>(dst);
  if (dtype == kKvBFloat16) {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, src + i, sizeof bits);
      d[i] = src[i] != src[i] ? 0x7FC0 : static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
    }
    return 0;
  }
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) d[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return 0;
}

// residual [rows, hidden]: the embedded tokens in, clobbered; out [rows, hidden]: the final norm's
// output. cos, sin [rows, head_dim] (sin's first half negated); slots [rows] the cache slot of each
// row's token; tables [rows * width] block ids and lens [rows] the context each row attends to
// (its own token included). scratch: rows * (2 * hidden + wide + heads * head_dim + intermediate)
// floats. Returns 0, or -1 where a GEMV refused its arguments.
extern "C" int rs_decode_layers(const RsDecoder* m, int64_t rows, float* residual, const float* cos, const float* sin,
                                const int64_t* slots, const int64_t* tables, int64_t width, const int64_t* lens,
                                float* scratch, float* out, int threads, double* seconds) {
  const int64_t hidden = m->hidden, hd = m->head_dim, q_size = m->heads * hd, kv_size = m->kv_heads * hd;
  float* normed = scratch;                  // [rows, hidden]
  float* big = normed + rows * hidden;      // qkv, then gate_up: [rows, wide]
  float* attn = big + rows * m->wide;       // [rows, heads * head_dim]
  float* h = attn + rows * q_size;          // o_proj's, then down's output: [rows, hidden]
  float* act = h + rows * hidden;           // [rows, intermediate]
  Clock clock(seconds);
  for (int64_t l = 0; l < m->num_layers; ++l) {
    const RsDecoderLayer& L = m->layers[l];
    rs_add_rms_norm(l == 0 ? nullptr : h, residual, L.input_norm, m->eps, rows, hidden, normed);
    clock.lap(kNorm);
    if (L.qkv.gemv(normed, rows, hidden, L.qkv.packed, L.qkv.tiles, L.qkv.kind, big, threads)) return -1;
    clock.lap(kQkv);
    rs_rope_neox(big, rows, L.qkv.width, m->heads + m->kv_heads, hd, cos, sin);
    const int64_t elem = kv_elem_bytes(m->kv_dtype);
    for (int64_t r = 0; r < rows; ++r) {
      const float* k = big + r * L.qkv.width + q_size;
      rs_store_kv(static_cast<char*>(L.k_cache) + slots[r] * kv_size * elem, k, kv_size, m->kv_dtype);
      rs_store_kv(static_cast<char*>(L.v_cache) + slots[r] * kv_size * elem, k + kv_size, kv_size, m->kv_dtype);
    }
    clock.lap(kRopeKv);
    const auto k16 = static_cast<const uint16_t*>(L.k_cache), v16 = static_cast<const uint16_t*>(L.v_cache);
    const auto k8 = static_cast<const uint8_t*>(L.k_cache), v8 = static_cast<const uint8_t*>(L.v_cache);
    switch (m->kv_dtype) {
      case kKvFloat16:
        rs_paged_decode_attention_f16(big, L.qkv.width, k16, v16, tables, width, lens, rows, m->heads, m->kv_heads, hd,
                                      m->block_size, m->scale, attn, threads);
        break;
      case kKvBFloat16:
        rs_paged_decode_attention_bf16(big, L.qkv.width, k16, v16, tables, width, lens, rows, m->heads, m->kv_heads, hd,
                                       m->block_size, m->scale, attn, threads);
        break;
      case kKvFp8E4m3:
        rs_paged_decode_attention_fp8e4m3(big, L.qkv.width, k8, v8, tables, width, lens, rows, m->heads, m->kv_heads,
                                          hd, m->block_size, m->scale, attn, threads);
        break;
      case kKvFp8E5m2:
        rs_paged_decode_attention_fp8e5m2(big, L.qkv.width, k8, v8, tables, width, lens, rows, m->heads, m->kv_heads,
                                          hd, m->block_size, m->scale, attn, threads);
        break;
      default:
        rs_paged_decode_attention(big, L.qkv.width, static_cast<const float*>(L.k_cache),
                                  static_cast<const float*>(L.v_cache), tables, width, lens, rows, m->heads,
                                  m->kv_heads, hd, m->block_size, m->scale, attn, threads);
    }
    clock.lap(kAttention);
    if (L.o.gemv(attn, rows, q_size, L.o.packed, L.o.tiles, L.o.kind, h, threads)) return -1;
    clock.lap(kOProj);
    rs_add_rms_norm(h, residual, L.post_norm, m->eps, rows, hidden, normed);
    clock.lap(kNorm);
    if (L.gate_up.gemv(normed, rows, hidden, L.gate_up.packed, L.gate_up.tiles, L.gate_up.kind, big, threads)) return -1;
    clock.lap(kGateUp);
    rs_silu_and_mul(big, rows, m->intermediate, act);
    clock.lap(kAct);
    if (L.down.gemv(act, rows, m->intermediate, L.down.packed, L.down.tiles, L.down.kind, h, threads)) return -1;
    clock.lap(kDown);
  }
  rs_add_rms_norm(h, residual, m->final_norm, m->eps, rows, hidden, out);
  clock.lap(kNorm);
  return 0;
}
