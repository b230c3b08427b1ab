// Resource ownership and small helpers of the CUDA backend: checked allocations (an out-of-memory
// error says what was asked and what is free), owned streams and events, bounded waits (the host
// never blocks without a deadline), and the few kernels the forward needs beyond kernels/cuda
// (random weights for the synthetic mode, a row gather, a constant fill).
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_kernels.hpp"

namespace troupe::engine::cuda {

namespace kc = troupe::kernels::cuda;
using kc::bf16;

/// n rounded up to a multiple of 256 bytes (where one buffer's sub-allocations start).
inline size_t align_up(size_t n) { return (n + 255) & ~size_t{255}; }

/// Selects `device` on the calling thread; cuda_error names the index and the count present.
void select_device(int device);

/// An owned device allocation; moves, never copies.
class device_buffer {
 public:
  device_buffer() = default;
  /// cudaMalloc of `bytes` (0: empty). On failure throws cuda_error naming `what`, the bytes asked
  /// and the device's free and total memory.
  device_buffer(size_t bytes, const char* what);
  ~device_buffer();
  device_buffer(device_buffer&& o) noexcept;
  device_buffer& operator=(device_buffer&& o) noexcept;
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;

  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

/// An owned page-locked host allocation (cudaHostAlloc), for asynchronous copies.
class pinned_buffer {
 public:
  pinned_buffer() = default;
  pinned_buffer(size_t bytes, const char* what);
  ~pinned_buffer();
  pinned_buffer(pinned_buffer&& o) noexcept;
  pinned_buffer& operator=(pinned_buffer&& o) noexcept;
  pinned_buffer(const pinned_buffer&) = delete;
  pinned_buffer& operator=(const pinned_buffer&) = delete;

  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

/// An owned non-blocking stream.
class stream_handle {
 public:
  stream_handle();
  ~stream_handle();
  stream_handle(const stream_handle&) = delete;
  stream_handle& operator=(const stream_handle&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

/// An owned event, without timing unless asked (cheaper to record and wait on).
class event_handle {
 public:
  explicit event_handle(bool timing = false);
  ~event_handle();
  event_handle(const event_handle&) = delete;
  event_handle& operator=(const event_handle&) = delete;
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

/// A wait for the device that timed out: its work still runs (a hung kernel?), and CUDA cannot
/// cancel it, so nothing more can use the device in this process.
class device_timeout : public kc::cuda_error {
 public:
  using kc::cuda_error::cuda_error;
};

/// Returns when `ev` has completed. Throws cuda_error naming `what` when the work behind it
/// failed, or device_timeout when it has not completed within `timeout` (a hung kernel never
/// hangs the host).
/// Polls without sleeping (yielding the core) for the first `spin`, then sleeps 20 us between
/// polls: a sleep overshoots by tens of microseconds, which a decode step that waits would add
/// to its time.
void wait_event(cudaEvent_t ev, std::chrono::milliseconds timeout, const char* what,
                std::chrono::milliseconds spin = std::chrono::milliseconds(1));

/// Records an event on `s` and waits for it as wait_event does.
void sync_stream(cudaStream_t s, cudaEvent_t scratch_event, std::chrono::milliseconds timeout, const char* what);

/// Bytes per second a device-to-device copy of `bytes` moves on the current device (read plus
/// write counted), the best of `reps` after one warm-up, timed by events on `s`: the rate a
/// memory-bound step is held to, a roofline's denominator. Each wait ends within `timeout`.
double copy_bandwidth(size_t bytes, int reps, cudaStream_t s, std::chrono::milliseconds timeout);

// ---- kernels (cuda_util.cu) ---------------------------------------------------------------------

/// p[i] = bf16(amplitude * u_i), u_i uniform in [-1, 1) from a hash of (seed, i): the same seed
/// gives the same values on any device.
void fill_uniform_bf16(bf16* p, int64_t n, float amplitude, uint64_t seed, cudaStream_t stream);
/// As fill_uniform_bf16, in fp32.
void fill_uniform_f32(float* p, int64_t n, float amplitude, uint64_t seed, cudaStream_t stream);
/// p[i] = value.
void fill_f32(float* p, int64_t n, float value, cudaStream_t stream);
/// *out ^= the XOR of the 32-bit words of p[0, bytes) (bytes a multiple of 16, p 16-byte
/// aligned): every byte read once by streaming 16-byte loads, a grid of `ctas` CTAs of 256
/// threads striding over it. For measuring how fast the device reads (troupe_gpu_bench).
void read_checksum(const void* p, size_t bytes, uint32_t* out, int ctas, cudaStream_t stream);
/// out[r, :] = in[rows[r], :] for r in [0, n_rows); rows of d bf16 values.
void gather_rows_bf16(const bf16* in, const int32_t* rows, bf16* out, int n_rows, int d, cudaStream_t stream);

}  // namespace troupe::engine::cuda
