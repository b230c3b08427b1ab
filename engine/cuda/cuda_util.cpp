#include "engine/cuda/cuda_util.hpp"

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>
#include <utility>

namespace troupe::engine::cuda {

namespace {

// A size for an error message: KiB under 1 MiB (a small buffer is not "0 MiB"), else MiB to 0.1.
std::string mib(size_t bytes) {
  char s[48];
  if (bytes < (size_t{1} << 20)) std::snprintf(s, sizeof s, "%zu KiB", (bytes + 1023) >> 10);
  else std::snprintf(s, sizeof s, "%.1f MiB", (double)bytes / (1 << 20));
  return s;
}

}  // namespace

void select_device(int device) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // as kc::check: a refused call must not be reported by the next check_launch
    throw kc::cuda_error(std::string("no usable CUDA device: ") + cudaGetErrorString(e));
  }
  if (device < 0 || device >= n)
    throw kc::cuda_error("CUDA device " + std::to_string(device) + " requested, " + std::to_string(n) + " present");
  kc::check(cudaSetDevice(device), "cudaSetDevice");
}

device_buffer::device_buffer(size_t bytes, const char* what) : n_(bytes) {
  if (bytes == 0) return;
  const cudaError_t e = cudaMalloc(&p_, bytes);
  if (e == cudaSuccess) return;
  p_ = nullptr;
  size_t free_b = 0, total_b = 0;
  cudaMemGetInfo(&free_b, &total_b);
  cudaGetLastError();  // not sticky: clear it (and any cudaMemGetInfo failure) so a later check_launch does not report it
  throw kc::cuda_error(std::string("out of device memory allocating ") + what + ": " + mib(bytes) + " asked, " + mib(free_b) +
                       " free of " + mib(total_b) + " (" + cudaGetErrorString(e) + ")");
}

device_buffer::~device_buffer() {
  if (p_) cudaFree(p_);
}

device_buffer::device_buffer(device_buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}

device_buffer& device_buffer::operator=(device_buffer&& o) noexcept {
  if (this != &o) {
    if (p_) cudaFree(p_);
    p_ = std::exchange(o.p_, nullptr);
    n_ = std::exchange(o.n_, 0);
  }
  return *this;
}

pinned_buffer::pinned_buffer(size_t bytes, const char* what) : n_(bytes) {
  if (bytes == 0) return;
  const cudaError_t e = cudaHostAlloc(&p_, bytes, cudaHostAllocDefault);
  if (e == cudaSuccess) return;
  cudaGetLastError();
  p_ = nullptr;
  throw kc::cuda_error(std::string("cannot allocate pinned host memory for ") + what + ": " + mib(bytes) + " asked (" +
                       cudaGetErrorString(e) + ")");
}

pinned_buffer::~pinned_buffer() {
  if (p_) cudaFreeHost(p_);
}

pinned_buffer::pinned_buffer(pinned_buffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}

pinned_buffer& pinned_buffer::operator=(pinned_buffer&& o) noexcept {
  if (this != &o) {
    if (p_) cudaFreeHost(p_);
    p_ = std::exchange(o.p_, nullptr);
    n_ = std::exchange(o.n_, 0);
  }
  return *this;
}

stream_handle::stream_handle() { kc::check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreate"); }

stream_handle::~stream_handle() {
  if (s_) cudaStreamDestroy(s_);
}

event_handle::event_handle(bool timing) {
  kc::check(cudaEventCreateWithFlags(&e_, timing ? cudaEventDefault : cudaEventDisableTiming), "cudaEventCreate");
}

event_handle::~event_handle() {
  if (e_) cudaEventDestroy(e_);
}

void wait_event(cudaEvent_t ev, std::chrono::milliseconds timeout, const char* what, std::chrono::milliseconds spin) {
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  for (;;) {
    const cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) kc::check(e, what);
    // cudaErrorNotReady is recorded as the thread's last error: clear it, or the next
    // check_launch (cudaGetLastError) reports "device not ready" for a good launch.
    if (cudaPeekAtLastError() == cudaErrorNotReady) cudaGetLastError();
    const auto waited = clock::now() - t0;
    if (waited > timeout)
      throw device_timeout(std::string(what) + ": the device did not finish within " + std::to_string(timeout.count()) +
                           " ms (a hung kernel?)");
    if (waited > spin)
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    else
      std::this_thread::yield();
  }
}

double copy_bandwidth(size_t bytes, int reps, cudaStream_t s, std::chrono::milliseconds timeout) {
  device_buffer a(bytes, "the copy benchmark's source"), b(bytes, "the copy benchmark's destination");
  kc::check(cudaMemsetAsync(a.as<void>(), 1, bytes, s), "cudaMemsetAsync");
  const event_handle start(true), stop(true);
  double best = 0;
  for (int i = 0; i <= reps; ++i) {  // the first a warm-up
    kc::check(cudaEventRecord(start.get(), s), "cudaEventRecord");
    kc::check(cudaMemcpyAsync(b.as<void>(), a.as<void>(), bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
    kc::check(cudaEventRecord(stop.get(), s), "cudaEventRecord");
    wait_event(stop.get(), timeout, "the copy benchmark");
    float ms = 0;
    kc::check(cudaEventElapsedTime(&ms, start.get(), stop.get()), "cudaEventElapsedTime");
    if (i > 0 && ms > 0) best = std::max(best, 2.0 * (double)bytes / (ms / 1e3));
  }
  return best;
}

void sync_stream(cudaStream_t s, cudaEvent_t scratch_event, std::chrono::milliseconds timeout, const char* what) {
  kc::check(cudaEventRecord(scratch_event, s), what);
  wait_event(scratch_event, timeout, what);
}

}  // namespace troupe::engine::cuda
