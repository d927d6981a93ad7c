// Ad hoc (issue 12, eighth round part I): the multi-row tile call alone, one thread: tile_rows<Q4_1, ROWS12>
// over T tiles (T * 5.76 KB of weights) and ROWS12 rows of K = 576, repeated; best of 3, ns per row-block
// (one row times one block of 32 inputs times a tile's 16 outputs: 1024 flops). Build per tree:
//   g++ -O3 -std=c++17 -fopenmp -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mf16c -mfma \
//       -DSRC='"TREE/rackserve/model/csrc/vnni_gemv.cpp"' -DROWS12=12 -o tile_rows_TREE bench/vnni_tile_rows.cpp
//   ./tile_rows_TREE 45      (main's widest call is 8 rows: -DROWS12=8)
#include SRC
#include <chrono>
#include <cstdio>
#include <cstdlib>
template <int R> double run(const uint8_t* rec, int64_t tiles, int64_t nb, const QuantizedRows& x, int64_t k, float* y, long iters) {
  auto t0 = std::chrono::steady_clock::now();
  for (long it = 0; it < iters; ++it)
    for (int64_t t = 0; t < tiles; ++t) { tile_rows<1, R>(rec + t * nb * 320, nb, x, 0, k, y + t * 16, tiles * 16); }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s / (iters * tiles * R * nb) * 1e9;
}
int main(int argc, char** argv) {
  const int64_t k = 576, nb = k / 32, rows = 12, tiles = atoi(argv[1]);
  std::vector<float> x(rows * k);
  for (auto& v : x) v = (rand() % 2000 - 1000) / 100.f;
  const QuantizedRows& q = quantize_rows(x.data(), rows, k, 1);
  std::vector<uint8_t> rec(tiles * nb * 320 + 8192);
  for (auto& v : rec) v = rand() & 0x3F;
  std::vector<float> y(rows * 16 * tiles);
  const long iters = 200000 / tiles;
  double a = 1e9;
  for (int rep = 0; rep < 3; ++rep) a = std::min(a, run<ROWS12>(rec.data(), tiles, nb, q, k, y.data(), iters));
  printf("tiles %ld R=%d: %.3f ns/row-block (%.0f GFLOP/s)\n", (long)tiles, ROWS12, a, 1024 / a);
}
