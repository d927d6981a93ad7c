// The activations of a quantized GEMV (vnni_gemv.cpp, avx2_gemv.cpp): each block of 32 of a row of x
// written as dx * q + dr * r (two int8 parts, with their integer sums and the block's float sum),
// in buffers a thread keeps from call to call: seven fresh vectors a call were about half of a small
// layer's time (a 576x576 weight at batch 1). Each build fills them with its own ISA's code.
// This header must hold only the buffers' layout (native.py hashes it into the builds).
#pragma once
#include <cstdint>
#include <vector>

namespace {   // each build's own copy: the two libraries may be loaded into one process

struct QuantizedRows {
  std::vector<int8_t> q, r;                 // [T, K]
  std::vector<float> dx, dr, fsum;          // [T, blocks]
  std::vector<int32_t> qsum, rsum;          // [T, blocks]
  std::vector<int16_t> x16;                 // [T, K]: avx2_gemv.cpp's few rows, x in one int16 part

  // Grows (never shrinks) the buffers to hold `rows` rows of k inputs in blocks of `group`.
  void fit(int64_t rows, int64_t k, int64_t group) {
    const int64_t n = rows * (k / group);
    if (static_cast<int64_t>(q.size()) < rows * k) {
      q.resize(rows * k);
      r.resize(rows * k);
    }
    if (static_cast<int64_t>(dx.size()) < n) {
      for (auto* v : {&dx, &dr, &fsum}) v->resize(n);
      for (auto* v : {&qsum, &rsum}) v->resize(n);
    }
  }

  // As fit, for x16 instead of q and r (with dx, fsum and qsum: its scales and sums).
  void fit16(int64_t rows, int64_t k, int64_t group) {
    const int64_t n = rows * (k / group);
    if (static_cast<int64_t>(x16.size()) < rows * k) x16.resize(rows * k);
    if (static_cast<int64_t>(dx.size()) < n) {
      for (auto* v : {&dx, &dr, &fsum}) v->resize(n);
      for (auto* v : {&qsum, &rsum}) v->resize(n);
    }
  }
};

}  // namespace
