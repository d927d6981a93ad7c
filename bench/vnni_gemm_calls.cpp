// Ad hoc (issue 12, eighth round part I): rs_vnni_gemv's whole calls, quantize_rows alone and the
// GEMM alone (gemv<Q4_1>) on random Q4_1 records of an N x K weight at `rows` rows and `th` threads;
// best of 5 means of 10 calls. Build one binary per tree and run them alternately under the bench lock:
//   g++ -O3 -std=c++17 -fopenmp -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mf16c -mfma \
//       -DSRC='"TREE/rackserve/model/csrc/vnni_gemv.cpp"' -o calls_TREE bench/vnni_gemm_calls.cpp
//   ./calls_main 3072 576 96 1; ./calls_branch 3072 576 96 1
// (bench/results/vnni-gemm-harness-s8i.json).
#include SRC
#include <chrono>
#include <cstdio>
#include <cstdlib>
int main(int argc, char** argv) {
  const int64_t n = atoi(argv[1]), k = atoi(argv[2]), rows = atoi(argv[3]); const int th = atoi(argv[4]);
  const int64_t nb = k / 32, tiles = n / 16;
  std::vector<float> x(rows * k);
  for (auto& v : x) v = (rand() % 2000 - 1000) / 100.f;
  std::vector<uint8_t> rec(tiles * nb * 320 + 8192);
  for (auto& v : rec) v = rand() & 0x3F;
  std::vector<float> y(rows * n);
  auto time = [&](auto f) { double best = 1e9; for (int r = 0; r < 5; ++r) { auto t0 = std::chrono::steady_clock::now(); for (int i = 0; i < 10; ++i) f(); best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 10); } return best; };
  double whole = time([&] { rs_vnni_gemv(x.data(), rows, k, rec.data(), tiles, 1, y.data(), th); });
  double quant = time([&] { quantize_rows(x.data(), rows, k, th); });
  const QuantizedRows& q = quantize_rows(x.data(), rows, k, th);
  double g = time([&] { gemv<1>(q, rows, k, rec.data(), tiles, y.data(), th); });
  printf("%ldx%ld@%ld th%d: whole %.1f us (%.0f GFLOP/s), quantize %.1f us, gemv %.1f us (%.0f GFLOP/s)\n", (long)n, (long)k, (long)rows, th,
         whole * 1e6, 2.0 * rows * n * k / whole / 1e9, quant * 1e6, g * 1e6, 2.0 * rows * n * k / g / 1e9);
}
