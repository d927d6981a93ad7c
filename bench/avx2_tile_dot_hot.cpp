// The avx2 build's one-row block dot (csrc/avx2_gemv.cpp's tile_dot) in a hot loop: each side is an
// avx2_gemv.cpp built on its own as a shared library; this program loads them all and times one row
// of x against a weight of 32 tiles x 1024 inputs (1024 tile-blocks; 278 KB of Q8_0 records, 164 KB
// of Q4_1: in a Zen's 512 KB L2, so the multiplies are timed, not DRAM) on one thread, the sides
// alternating round by round. Prints each side's median ns per tile-block (8 output rows x 32
// inputs) per kind, its speed against the first side, and the largest output difference to it.
//
//   d=$(mktemp -d); F="-O3 -std=c++17 -fopenmp -shared -fPIC -mavx2 -mfma -mf16c"
//   mkdir $d/main; for f in avx2_gemv.cpp quantized_rows.h; do
//     git show main:rackserve/model/csrc/$f > $d/main/$f; done
//   g++ $F $d/main/avx2_gemv.cpp -o $d/main.so
//   g++ $F rackserve/model/csrc/avx2_gemv.cpp -o $d/tree.so
//   g++ -O2 -std=c++17 bench/avx2_tile_dot_hot.cpp -ldl -o $d/hot && $d/hot main=$d/main.so tree=$d/tree.so
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

typedef int (*RsGemv)(const float* x, int64_t rows, int64_t k, const uint8_t* packed, int64_t tiles, int kind,
                      float* y, int threads);

namespace {

constexpr int64_t kTiles = 32, kK = 1024, kBlocks = kK / 32;
constexpr int kCalls = 200, kRounds = 7;
const char* kNames[] = {"Q4_0", "Q4_1", "Q8_0"};
const int kRec[] = {144, 160, 272}, kCodes[] = {128, 128, 256};

uint16_t fp16(float f) {   // f in [2^-14, 2): a normal half, truncated
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(((u >> 31) << 15) | ((((u >> 23) & 0xFF) - 112) << 10) | ((u >> 13) & 0x3FF));
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> labels;
  std::vector<RsGemv> fns;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    const size_t eq = arg.find('=');
    void* h = dlopen(arg.substr(eq + 1).c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) { std::fprintf(stderr, "%s\n", dlerror()); return 1; }
    labels.push_back(arg.substr(0, eq));
    fns.push_back(reinterpret_cast<RsGemv>(dlsym(h, "rs_avx2_gemv")));
  }
  if (fns.empty()) { std::fprintf(stderr, "usage: %s LABEL=lib.so ...\n", argv[0]); return 1; }
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  std::vector<float> x(kK), y(kTiles * 8), ref(kTiles * 8);
  for (float& v : x) v = normal(rng);
  x[7] *= 20;   // an outlier, as real activations have
  for (int kind = 0; kind < 3; ++kind) {
    std::vector<uint8_t> w(kTiles * kBlocks * kRec[kind]);
    for (int64_t r = 0; r < kTiles * kBlocks; ++r) {
      uint8_t* rec = w.data() + r * kRec[kind];
      for (int i = 0; i < kCodes[kind]; ++i) rec[i] = static_cast<uint8_t>(rng());
      for (int i = kCodes[kind]; i < kRec[kind]; i += 2) {
        const uint16_t h = fp16(0.01f + 0.01f * std::abs(normal(rng)));
        std::memcpy(rec + i, &h, 2);
      }
    }
    std::vector<std::vector<double>> times(fns.size());
    std::vector<float> diff(fns.size());
    for (size_t s = 0; s < fns.size(); ++s) {
      fns[s](x.data(), 1, kK, w.data(), kTiles, kind, s ? y.data() : ref.data(), 1);
      if (s) for (size_t i = 0; i < y.size(); ++i) diff[s] = std::max(diff[s], std::abs(y[i] - ref[i]));
    }
    float scale = 0;
    for (float v : ref) scale = std::max(scale, std::abs(v));
    for (int round = 0; round < kRounds; ++round)
      for (size_t s = 0; s < fns.size(); ++s) {
        for (int i = 0; i < 20; ++i) fns[s](x.data(), 1, kK, w.data(), kTiles, kind, y.data(), 1);
        for (int i = 0; i < kCalls; ++i) {
          const double t0 = now();
          fns[s](x.data(), 1, kK, w.data(), kTiles, kind, y.data(), 1);
          times[s].push_back((now() - t0) * 1e9 / (kTiles * kBlocks));
        }
      }
    double base = 0;
    for (size_t s = 0; s < fns.size(); ++s) {
      std::vector<double>& t = times[s];
      std::sort(t.begin(), t.end());
      const double med = t[t.size() / 2];
      if (!s) base = med;
      std::printf("%s %10s: %6.2f ns a tile-block (p10 %6.2f), %.3fx %s's speed, max |y - %s's| %.2e of max |y|\n",
                  kNames[kind], labels[s].c_str(), med, t[t.size() / 10], base / med, labels[0].c_str(),
                  labels[0].c_str(), diff[s] / scale);
    }
  }
  return 0;
}
