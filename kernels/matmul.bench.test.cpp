// matmul throughput at the shapes of SmolLM2-135M (d_model 576, ffn 1536, 3 kv heads x 64,
// vocabulary 49152), with the machine's memory bandwidth for context. Hidden from CI ([!benchmark]);
// run with:  troupe_tests "[!benchmark][matmul]"
// Each figure is the best of several runs (the least disturbed by other processes). Weights are
// taken from a pool larger than the last-level cache, rotating, so m = 1 reads them from memory as
// a decode step does; m = 512 reuses each weight matrix across the 512 activation rows.
#include "kernels/matmul.hpp"

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/fp16.hpp"
#include "kernels/thread_pool.hpp"

namespace tk = troupe::kernels;
using tk::dtype;

namespace {

/// Bytes of weights cycled through so that m = 1 runs stream from memory (L3 here is 32 MiB).
constexpr size_t cold_bytes = size_t{256} << 20;

/// n_copies matrices of random blocks with sane fp16 scales.
struct weight_set {
  std::vector<uint8_t> bytes;
  std::vector<tk::weight_view> views;

  weight_set(dtype t, int64_t n_out, int64_t n_in, size_t n_copies) {
    const auto& tr = tk::traits(t);
    const size_t row = static_cast<size_t>(tk::row_bytes(tr, n_in)), matrix = row * static_cast<size_t>(n_out);
    bytes.resize(matrix * n_copies);
    std::mt19937 rng(1);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    if (tr.block_size > 1) {  // overwrite the leading fp16 scale(s) of every block
      const uint16_t scale = tk::f32_to_fp16(0.01f);
      for (size_t off = 0; off + static_cast<size_t>(tr.type_size) <= bytes.size();
           off += static_cast<size_t>(tr.type_size))
        for (size_t k = 0; k < (t == dtype::q4_1 ? 2u : 1u); ++k) std::memcpy(bytes.data() + off + 2 * k, &scale, 2);
    } else {  // float weights: finite values (random bits would include NaN and subnormals)
      std::normal_distribution<float> normal(0.0f, 0.1f);
      for (size_t off = 0; off < bytes.size(); off += static_cast<size_t>(tr.type_size)) {
        const float v = normal(rng);
        const uint16_t h = t == dtype::f16 ? tk::f32_to_fp16(v) : tk::f32_to_bf16(v);
        if (t == dtype::f32)
          std::memcpy(bytes.data() + off, &v, 4);
        else
          std::memcpy(bytes.data() + off, &h, 2);
      }
    }
    for (size_t c = 0; c < n_copies; ++c) views.push_back({t, bytes.data() + c * matrix, n_out, n_in, row});
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Best time of fn() over at least min_runs runs and min_seconds in total.
template <class Fn>
double best_time(Fn&& fn, int min_runs = 5, double min_seconds = 0.3) {
  double best = 1e30, total = 0.0;
  for (int run = 0; run < min_runs || total < min_seconds; ++run) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const double t = seconds_since(t0);
    best = std::min(best, t);
    total += t;
  }
  return best;
}

struct shape {
  const char* name;
  dtype type;
  int64_t n_out, n_in;
};

constexpr shape smollm2_shapes[] = {
    {"attn_q/o 576x576", dtype::q4_1, 576, 576},      {"attn_k/v 192x576", dtype::q4_1, 192, 576},
    {"ffn_gate/up 1536x576", dtype::q4_1, 1536, 576}, {"ffn_down 576x1536", dtype::q4_1, 576, 1536},
    {"output 49152x576", dtype::q8_0, 49152, 576},
};

}  // namespace

TEST_CASE("memory bandwidth for context", "[!benchmark][matmul]") {
  std::vector<uint8_t> src(cold_bytes, 1), dst(cold_bytes, 0);
  const double copy = best_time([&] { std::memcpy(dst.data(), src.data(), src.size()); }, 3, 0.0);
  std::printf("memcpy %zu MiB: %.1f GB/s (bytes copied per second)\n", cold_bytes >> 20, cold_bytes / copy / 1e9);
  for (int n_threads : {1, 2}) {
    tk::thread_pool pool(n_threads);
    std::vector<uint64_t> sums(static_cast<size_t>(n_threads));
    const double read = best_time(
        [&] {
          pool.run([&](int ith, int nth) {
            const size_t n = src.size() / sizeof(uint64_t), b = n * ith / nth, e = n * (ith + 1) / nth;
            const auto* p = reinterpret_cast<const uint64_t*>(src.data());
            uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            size_t i = b;
            for (; i + 4 <= e; i += 4) s0 += p[i], s1 += p[i + 1], s2 += p[i + 2], s3 += p[i + 3];
            sums[static_cast<size_t>(ith)] = s0 + s1 + s2 + s3;
          });
        },
        3, 0.0);
    std::printf("streaming read, %d thread(s): %.1f GB/s\n", n_threads, cold_bytes / read / 1e9);
  }
  CHECK(dst[0] == 1);
}

TEST_CASE("matmul throughput at SmolLM2-135M shapes", "[!benchmark][matmul]") {
  std::printf("matmul SIMD level: %s\n", tk::matmul_isa());
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  for (const shape& s : smollm2_shapes) {
    const auto& tr = tk::traits(s.type);
    const size_t matrix = static_cast<size_t>(tk::row_bytes(tr, s.n_in) * s.n_out);
    const weight_set cold(s.type, s.n_out, s.n_in, std::max<size_t>(1, cold_bytes / matrix));
    for (int n_threads : {1, 2}) {
      tk::thread_pool pool(n_threads);
      // m = 1 from memory: a different copy each run.
      {
        std::vector<float> x(static_cast<size_t>(s.n_in)), y(static_cast<size_t>(s.n_out));
        for (float& v : x) v = normal(rng);
        size_t next = 0;
        const int runs = static_cast<int>(cold.views.size());
        const double t = best_time(
            [&] {
              tk::matmul(cold.views[next], x.data(), s.n_in, 1, y.data(), s.n_out, pool);
              next = (next + 1) % cold.views.size();
            },
            runs, 0.0);
        std::printf("%-22s %s m=1   %d thread(s): %8.1f us  %6.1f GB/s of weights\n", s.name, tr.name, n_threads,
                    t * 1e6, matrix / t / 1e9);
      }
      // m = 512 (prefill): compute bound.
      if (s.type != dtype::q8_0) {
        const int64_t m = 512;
        std::vector<float> x(static_cast<size_t>(m * s.n_in)), y(static_cast<size_t>(m * s.n_out));
        for (float& v : x) v = normal(rng);
        const double t = best_time([&] { tk::matmul(cold.views[0], x.data(), s.n_in, m, y.data(), s.n_out, pool); }, 3);
        std::printf("%-22s %s m=512 %d thread(s): %8.1f us  %6.1f GFLOP/s\n", s.name, tr.name, n_threads, t * 1e6,
                    2.0 * m * s.n_out * s.n_in / t / 1e9);
      }
    }
  }
  SUCCEED();
}

TEST_CASE("matmul throughput by weight type", "[!benchmark][matmul]") {
  tk::thread_pool pool(2);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  const int64_t n_out = 1536, n_in = 1536;
  for (dtype t : {dtype::f32, dtype::f16, dtype::bf16, dtype::q4_0, dtype::q4_1, dtype::q8_0, dtype::q4_k, dtype::q5_k,
                  dtype::q6_k}) {
    const weight_set w(t, n_out, n_in, 1);
    for (int64_t m : {1, 64}) {
      std::vector<float> x(static_cast<size_t>(m * n_in)), y(static_cast<size_t>(m * n_out));
      for (float& v : x) v = normal(rng);
      const double s = best_time([&] { tk::matmul(w.views[0], x.data(), n_in, m, y.data(), n_out, pool); });
      std::printf("%-5s %lldx%lld m=%-3lld 2 threads, weights in cache: %8.1f us  %6.1f GFLOP/s\n", tk::traits(t).name,
                  static_cast<long long>(n_out), static_cast<long long>(n_in), static_cast<long long>(m), s * 1e6,
                  2.0 * m * n_out * n_in / s / 1e9);
    }
  }
  SUCCEED();
}
