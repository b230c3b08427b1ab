// The matmul driver: checks the arguments, picks the kernels of the active SIMD level, quantizes
// the activations once per format into a per-thread scratch buffer, and splits the output rows of
// all products of a batch over the pool's threads.
#include "kernels/matmul.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>

#include "kernels/matmul_impl.hpp"
#include "kernels/thread_pool.hpp"

namespace troupe::kernels {

namespace detail {

namespace {

isa detect() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
#if defined(__AVX2__)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni") &&
      __builtin_cpu_supports("avx512vbmi"))
    return isa::avx512;
  // The whole library is compiled for AVX2 + FMA + F16C (see kernels/CMakeLists.txt), so a CPU
  // without them could not run it at all: there is no scalar-only fallback at run time.
  return isa::avx2;
#endif
#endif
  return isa::scalar;
}

std::atomic<isa>& active_level() {
  static std::atomic<isa> level{detected_isa()};
  return level;
}

kernel find_kernel(isa level, dtype t) {
  kernel k;
  if (level >= isa::avx512) k = find_kernel_avx512(t);
  if (k.fn == nullptr && level >= isa::avx2) k = find_kernel_avx2(t);
  if (k.fn == nullptr) k = find_kernel_scalar(t);
  return k;
}

/// Grow-only, 64-byte aligned scratch of the calling thread for quantized activations.
uint8_t* scratch(size_t bytes) {
  struct free_deleter {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<uint8_t, free_deleter> buffer;
  thread_local size_t capacity = 0;
  if (bytes > capacity) {
    const size_t rounded = std::max<size_t>((bytes + 4095) & ~size_t{4095}, 1 << 16);
    buffer.reset(static_cast<uint8_t*>(std::aligned_alloc(64, rounded)));
    if (!buffer) {
      capacity = 0;
      throw std::bad_alloc();
    }
    capacity = rounded;
  }
  return buffer.get();
}

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("matmul: " + what); }

/// Throws std::invalid_argument unless `out` is a valid product of n_in-wide rows (strings are
/// built only on failure: this runs on every call).
void check(const matmul_out& out, int64_t n_in, int64_t ldx, int64_t m) {
  const weight_view& w = out.w;
  const dtype_traits* tr = find_dtype(static_cast<uint32_t>(w.type));
  if (tr == nullptr) fail("unsupported weight type " + std::to_string(static_cast<uint32_t>(w.type)));
  auto typed = [&](const std::string& what) { fail(std::string(tr->name) + " weights: " + what); };
  if (w.n_in <= 0 || w.n_out < 0) typed("bad shape " + std::to_string(w.n_out) + " x " + std::to_string(w.n_in));
  if (w.n_in != n_in)
    fail("batch products disagree on n_in: " + std::to_string(w.n_in) + " vs " + std::to_string(n_in));
  if (w.n_in % tr->block_size != 0)
    typed("n_in must be a multiple of " + std::to_string(tr->block_size) + ", got " + std::to_string(w.n_in));
  if (w.row_stride < static_cast<size_t>(row_bytes(*tr, w.n_in)))
    typed("row_stride " + std::to_string(w.row_stride) + " is shorter than a row (" +
          std::to_string(row_bytes(*tr, w.n_in)) + " bytes)");
  if (w.n_out > 0 && w.data == nullptr) typed("null data");
  // Every block type holds fp16 fields: rows must be 2-byte aligned (GGUF aligns tensors to 32).
  if (reinterpret_cast<uintptr_t>(w.data) % 2 != 0 || w.row_stride % 2 != 0)
    typed("rows must be 2-byte aligned (data and row_stride)");
  if (ldx < n_in) fail("ldx " + std::to_string(ldx) + " < n_in " + std::to_string(n_in));
  if (out.y == nullptr && w.n_out > 0 && m > 0) fail("null output");
  if (m > 1 && out.ldy < w.n_out) fail("ldy " + std::to_string(out.ldy) + " < n_out " + std::to_string(w.n_out));
}

/// Products below this many multiply-adds run on the calling thread alone: a parallel region
/// costs a few microseconds of wake-up and cache-line traffic.
constexpr int64_t min_parallel_macs = 1 << 16;

/// Activations below this many values are quantized by the calling thread alone.
constexpr int64_t min_parallel_quantize = 8192;

/// Output rows per work unit handed to a thread (kernels block rows by 4 and 16).
constexpr int64_t rows_per_unit_m1 = 8;
constexpr int64_t rows_per_unit = 16;

/// Chunks of work per thread in a parallel region: more balance the load when a thread runs
/// late, fewer cost fewer atomic operations on a shared counter.
constexpr int64_t chunks_per_thread = 4;

/// Products of one matmul_batch call handled together (more are split into several calls).
constexpr size_t max_batch = 8;

}  // namespace

const char* isa_name(isa level) {
  switch (level) {
    case isa::scalar:
      return "scalar";
    case isa::avx2:
      return "avx2";
    case isa::avx512:
      return "avx512-vnni";
  }
  return "?";
}

isa detected_isa() {
  static const isa level = detect();
  return level;
}

isa active_isa() { return active_level().load(std::memory_order_relaxed); }

bool force_isa(isa level) {
  if (level > detected_isa()) return false;
  active_level().store(level);
  return true;
}

}  // namespace detail

const char* matmul_isa() { return detail::isa_name(detail::active_isa()); }

void matmul(const weight_view& w, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, thread_pool& pool) {
  const matmul_out out{w, y, ldy};
  matmul_batch(std::span<const matmul_out>(&out, 1), x, ldx, m, pool);
}

void matmul_batch(std::span<const matmul_out> outs, const float* x, int64_t ldx, int64_t m, thread_pool& pool) {
  using namespace detail;
  if (outs.empty()) return;
  if (m < 0) fail("negative m " + std::to_string(m));
  const int64_t n_in = outs[0].w.n_in;
  for (const matmul_out& out : outs) check(out, n_in, ldx, m);
  if (m == 0) return;
  if (x == nullptr) fail("null activations");

  if (outs.size() > max_batch) {  // rare: split, quantizing once per part
    for (size_t j = 0; j < outs.size(); j += max_batch)
      matmul_batch(outs.subspan(j, std::min(max_batch, outs.size() - j)), x, ldx, m, pool);
    return;
  }

  // Kernels and the activation layouts they need.
  const isa level = active_isa();
  constexpr int n_kinds = n_act_kinds;
  bool kind_used[n_kinds] = {};
  kernel kernels[max_batch];
  int64_t total_rows = 0;
  for (size_t j = 0; j < outs.size(); ++j) {
    kernels[j] = find_kernel(level, outs[j].w.type);
    kind_used[static_cast<int>(kernels[j].act)] = true;
    total_rows += outs[j].w.n_out;
  }
  if (total_rows == 0) return;
  static_assert(static_cast<int>(act_kind::f32) == 0, "kind 0 is the unquantized one");
  size_t scratch_bytes = 0;
  for (int k = 1; k < n_kinds; ++k)
    if (kind_used[k]) scratch_bytes += act_row_bytes(static_cast<act_kind>(k), n_in) * static_cast<size_t>(m);
  uint8_t* buffer = scratch(scratch_bytes);
  uint8_t* quantized[n_kinds] = {};
  act_view acts[n_kinds];
  for (int k = 0; k < n_kinds; ++k) {
    const auto kind = static_cast<act_kind>(k);
    acts[k].kind = kind;
    acts[k].m = m;
    acts[k].n_in = n_in;
    if (kind == act_kind::f32) {
      acts[k].data = reinterpret_cast<const uint8_t*>(x);
      acts[k].stride = static_cast<size_t>(ldx) * sizeof(float);
    } else if (kind_used[k]) {
      quantized[k] = buffer;
      acts[k].data = buffer;
      acts[k].stride = act_row_bytes(kind, n_in);
      buffer += acts[k].stride * static_cast<size_t>(m);
    }
  }

  const bool parallel = pool.size() > 1 && m * total_rows * n_in >= min_parallel_macs;

  // Quantize: on the caller when small, else rows split over the threads.
  auto quantize = [&](int64_t i0, int64_t i1) {
    for (int k = 1; k < n_kinds; ++k)
      if (kind_used[k])
        quantize_rows(static_cast<act_kind>(k), level, x, ldx, n_in, i0, i1, quantized[k], acts[k].stride);
  };
  if (parallel && m * n_in >= min_parallel_quantize)
    pool.parallel_for(m, 1, [&](int64_t i0, int64_t i1, int) { quantize(i0, i1); });
  else
    quantize(0, m);

  // Work units: runs of output rows of each product, or, when there are too few rows to share,
  // runs of activation rows. Threads take chunks of units from a shared counter, so a thread that
  // starts late (or is preempted) leaves its chunks to the others.
  const int64_t unit = m == 1 ? rows_per_unit_m1 : rows_per_unit;
  int64_t n_units = 0;
  for (const matmul_out& out : outs) n_units += (out.w.n_out + unit - 1) / unit;
  auto run_rows = [&](int64_t u0, int64_t u1) {  // units [u0, u1) of the concatenated products
    int64_t base = 0;
    for (size_t j = 0; j < outs.size() && base < u1; ++j) {
      const int64_t n_out = outs[j].w.n_out, units = (n_out + unit - 1) / unit;
      const int64_t b = std::max(u0, base), e = std::min(u1, base + units);
      if (b < e) {
        const act_view& a = acts[static_cast<int>(kernels[j].act)];
        kernels[j].fn(outs[j].w, (b - base) * unit, std::min(n_out, (e - base) * unit), a, outs[j].y, outs[j].ldy);
      }
      base += units;
    }
  };
  auto run_acts = [&](int64_t i0, int64_t i1) {  // activation rows [i0, i1) of every product
    for (size_t j = 0; j < outs.size(); ++j) {
      act_view a = acts[static_cast<int>(kernels[j].act)];
      a.data += static_cast<size_t>(i0) * a.stride;
      a.m = i1 - i0;
      kernels[j].fn(outs[j].w, 0, outs[j].w.n_out, a, outs[j].y + i0 * outs[j].ldy, outs[j].ldy);
    }
  };
  if (!parallel) {
    run_rows(0, n_units);
    return;
  }
  const bool by_rows = n_units >= chunks_per_thread * pool.size() || m < pool.size();
  const int64_t total = by_rows ? n_units : m;
  const int64_t chunk = std::max<int64_t>(1, total / (chunks_per_thread * pool.size()));
  std::atomic<int64_t> next{0};
  pool.run([&](int, int) {
    for (;;) {
      const int64_t b = next.fetch_add(chunk, std::memory_order_relaxed);
      if (b >= total) return;
      const int64_t e = std::min(total, b + chunk);
      if (by_rows)
        run_rows(b, e);
      else
        run_acts(b, e);
    }
  });
}

}  // namespace troupe::kernels
