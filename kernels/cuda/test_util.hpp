// Helpers for the CUDA kernel tests (host code, compiled by the C++ compiler): device buffers that
// free themselves, copies both ways, NaN poisoning, random inputs, bf16/fp16 conversions on the
// host, and the normalized error the tests bound. Copies use the legacy default stream, so a
// download waits for kernels launched on stream 0.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/fp16.hpp"

namespace troupe::kernels::cuda::test {

/// n values of T in device memory; move-only, freed on destruction.
template <class T>
struct dev_buf {
  T* p = nullptr;
  size_t n = 0;

  dev_buf() = default;
  explicit dev_buf(size_t count) : n(count) {
    check(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(1, n) * sizeof(T)), "cudaMalloc");
  }
  explicit dev_buf(const std::vector<T>& host) : dev_buf(host.size()) { upload(host); }
  dev_buf(dev_buf&& o) noexcept : p(o.p), n(o.n) { o.p = nullptr, o.n = 0; }
  dev_buf& operator=(dev_buf&& o) noexcept {
    std::swap(p, o.p);
    std::swap(n, o.n);
    return *this;
  }
  dev_buf(const dev_buf&) = delete;
  dev_buf& operator=(const dev_buf&) = delete;
  ~dev_buf() {
    if (p) cudaFree(p);
  }

  size_t bytes() const { return n * sizeof(T); }
  /// Copies host[0, n) to the device (host.size() must be n).
  void upload(const std::vector<T>& host) {
    check(cudaMemcpy(p, host.data(), std::min(host.size(), n) * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  std::vector<T> download() const {
    std::vector<T> host(n);
    check(cudaMemcpy(host.data(), p, bytes(), cudaMemcpyDeviceToHost), "download");
    return host;
  }
  /// Fills every byte with 0xFF: NaN in fp32, fp16 and bf16, -1 in integers, so values a kernel
  /// fails to write show up as errors.
  void poison() { check(cudaMemset(p, 0xFF, bytes()), "poison"); }
};

/// A seed that differs per run; tests print it (INFO), and TROUPE_TEST_SEED=that value replays it.
inline uint64_t fresh_seed() {
  if (const char* s = std::getenv("TROUPE_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

inline std::vector<float> random_floats(size_t n, std::mt19937_64& g, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

inline std::vector<bf16> to_bf16(const std::vector<float>& x) {
  std::vector<bf16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    __nv_bfloat16_raw r;
    r.x = kernels::f32_to_bf16(x[i]);
    out[i] = bf16(r);
  }
  return out;
}
inline std::vector<float> from_bf16(const std::vector<bf16>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = kernels::bf16_to_f32(__nv_bfloat16_raw(x[i]).x);
  return out;
}
inline std::vector<fp16> to_fp16(const std::vector<float>& x) {
  std::vector<fp16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    __half_raw r;
    r.x = kernels::f32_to_fp16(x[i]);
    out[i] = fp16(r);
  }
  return out;
}
inline std::vector<float> from_fp16(const std::vector<fp16>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = kernels::fp16_to_f32(__half_raw(x[i]).x);
  return out;
}
/// Values rounded through bf16, so a CPU reference sees exactly what the device reads.
inline std::vector<float> round_bf16(const std::vector<float>& x) { return from_bf16(to_bf16(x)); }

/// max|got - want| / max(1e-6, max|want|); infinity when got holds a NaN or sizes differ.
inline double normalized_error(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double err = 0.0, scale = 1e-6;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(double(got[i]) - double(want[i]));
    if (!(d <= err)) err = std::isnan(d) ? std::numeric_limits<double>::infinity() : d;
    scale = std::max(scale, std::fabs(double(want[i])));
  }
  return err / scale;
}

}  // namespace troupe::kernels::cuda::test
