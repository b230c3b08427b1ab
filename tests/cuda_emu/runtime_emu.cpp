// The CUDA runtime API of the emulation (cuda_emu.hpp), as far as kernels/cuda, engine/cuda and
// their tests call it. One device, an H200's shape.
//
// Memory: device memory is host memory, each allocation tracked, so a copy or memset outside an
// allocation fails as on a device (cudaErrorInvalidValue) and the capacity (TROUPE_EMU_DEVICE_MIB,
// 16 GiB by default) runs out. Fresh allocations read as 0xFF bytes (NaN as bf16 and float).
// Pinned host memory (cudaHostAlloc, cudaHostRegister) is tracked too: asynchronous copies to or
// from it run when the device reaches them, while pageable copies complete before the call
// returns, after the stream's earlier work (the runtime's documented behaviour).
//
// Streams: each a queue of work, event records and event waits. The device runs the head of a
// stream that can run, the one of highest priority: at each enqueue with even odds, a few items at
// each query, all that a synchronization needs; so the host's view lags the device by a random
// amount. A stream's priority is set when its queue fills from empty: with odds of 3 in 4 above
// every other (the newest burst overtakes older ones, the order that exposes a missing wait
// between streams), else at random below; streams run in any order their events allow. The legacy
// default stream (0) waits for the blocking streams and runs its work at once. A programmatic
// launch queued right behind a kernel starts, half the time, before that kernel runs, as far as
// its pdl_wait(), and so may the one behind it (run_front).
//
// Graphs: a capturing stream appends its work (kernels with their parameters, copies, memsets) to
// the capture; cudaGraphLaunch enqueues that work again. Calls that synchronize or allocate during
// a capture in global or thread-local mode, work on the legacy stream while a blocking stream
// captures, and event records or waits inside a capture (not emulated) invalidate it: the capture
// ends in cudaErrorStreamCaptureInvalidated and the call reports an error.
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

namespace troupe_emu {
namespace {

using clock_type = std::chrono::steady_clock;

struct event_state {
  uint64_t recorded = 0;  // records enqueued
  uint64_t reached = 0;   // the latest record the device has run
  clock_type::time_point at{};
  bool timing = true;
};

struct item {
  enum kind_t { work, record, wait } kind = work;
  std::function<void()> fn;        // work
  std::shared_ptr<event_state> ev;  // record, wait
  uint64_t seq = 0;                 // record: its number; wait: the record it waits for
  bool kernel = false;              // work that is a kernel (ours or cuBLASLt's)
  bool hangs = false;               // work that never ends (TROUPE_EMU_HANG_FILE): nothing behind it runs
  std::shared_ptr<const kernel_launch> launch{};  // work that is one of our kernels
};

struct capture_state {
  std::vector<item> items;
  std::string invalid;  // why the capture was invalidated; empty while valid
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id thread;
};

}  // namespace
}  // namespace troupe_emu

struct CUstream_st {
  std::deque<troupe_emu::item> q;
  uint64_t priority = 0;  // set when work arrives at an empty queue: the device favours the highest
  bool blocking = true;   // synchronizes with the legacy default stream
  std::unique_ptr<troupe_emu::capture_state> capture;
};
struct CUevent_st {
  std::shared_ptr<troupe_emu::event_state> s = std::make_shared<troupe_emu::event_state>();
};
struct CUgraph_st {
  std::vector<troupe_emu::item> items;
};
struct CUgraphExec_st {
  std::vector<troupe_emu::item> items;
};

namespace troupe_emu {
namespace {

struct device_state {
  std::vector<CUstream_st*> streams;
  std::map<uintptr_t, size_t> allocations;  // device: start -> bytes
  std::map<uintptr_t, size_t> pinned;       // host: start -> bytes
  size_t allocated = 0;
};

device_state& dev() {
  static device_state d;
  return d;
}

// The runtime is called from several host threads at once (a hot reload builds one forward while
// another serves): every entry point holds this, and the device's work runs under it.
std::recursive_mutex& api_mutex() {
  static std::recursive_mutex m;
  return m;
}
#define TROUPE_EMU_LOCKED const std::lock_guard<std::recursive_mutex> emu_lock_(api_mutex())

size_t capacity() {
  static const size_t bytes = [] {
    const char* s = std::getenv("TROUPE_EMU_DEVICE_MIB");
    return (s ? std::strtoull(s, nullptr, 10) : 16384ull) << 20;
  }();
  return bytes;
}

cudaError_t fail(cudaError_t e) {
  if (e != cudaSuccess) last_error = e;
  return e;
}

}  // namespace

bool refusing() {
  static const char* const path = std::getenv("TROUPE_EMU_REFUSE_FILE");
  return path && ::access(path, F_OK) == 0;
}

namespace {

// The sticky error, if any, as the result of a call that succeeded otherwise.
cudaError_t ok() { return sticky_error != cudaSuccess ? fail(sticky_error) : cudaSuccess; }

bool is_legacy(cudaStream_t s) { return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread; }

bool within(const std::map<uintptr_t, size_t>& m, const void* p, size_t n) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = m.upper_bound(a);
  if (it == m.begin()) return false;
  --it;
  return a + n <= it->first + it->second;
}
bool on_device(const void* p, size_t n) { return within(dev().allocations, p, n); }
bool is_pinned(const void* p, size_t n) { return within(dev().pinned, p, n); }

void invalidate(capture_state& c, const std::string& why) {
  if (!c.invalid.empty()) return;
  c.invalid = why;
  std::fprintf(stderr, "cuda_emu: stream capture invalidated: %s\n", why.c_str());
}

// A call that synchronizes or allocates is refused while this thread captures in thread-local or
// global mode (or any thread in global mode), and the capture is invalidated.
cudaError_t refuse_while_capturing(const char* call) {
  cudaError_t e = cudaSuccess;
  for (CUstream_st* s : dev().streams) {
    capture_state* c = s->capture.get();
    if (!c || c->mode == cudaStreamCaptureModeRelaxed) continue;
    if (c->mode == cudaStreamCaptureModeThreadLocal && c->thread != std::this_thread::get_id()) continue;
    invalidate(*c, std::string(call) + " during a stream capture");
    e = cudaErrorStreamCaptureUnsupported;
  }
  return fail(e);
}

bool runnable(const CUstream_st& s) {
  if (s.q.empty()) return false;
  const item& it = s.q.front();
  return !it.hangs && (it.kind != item::wait || it.ev->reached >= it.seq);
}

// Hang injection for the serving tests: with TROUPE_EMU_HANG_FILE set, the first work enqueued on
// a stream after that file appears removes it and never ends, as a kernel that spins forever: the
// stream runs nothing more, queries say not ready, and a call that waits for it never returns.
bool injected_hang() {
  static const char* const path = std::getenv("TROUPE_EMU_HANG_FILE");
  if (!path || ::unlink(path) != 0) return false;
  std::fprintf(stderr, "cuda_emu: injected hang (%s): this work never ends\n", path);
  return true;
}

bool device_hangs() {
  for (CUstream_st* s : dev().streams)
    if (!s->q.empty() && s->q.front().hangs) return true;
  return false;
}

// Whether the stream's head is a programmatic launch (one that may start before the kernel ahead).
bool pdl_next(const CUstream_st& s) {
  return !s.q.empty() && s.q.front().kind == item::work && s.q.front().launch && s.q.front().launch->pdl;
}

void run_front(CUstream_st& s) {
  item it = std::move(s.q.front());
  s.q.pop_front();
  if (it.kind == item::work && it.kernel && pdl_next(s) && sticky_error == cudaSuccess && random_u64() % 2) {
    // The programmatic launch behind this kernel starts first, as far as its pdl_wait(), and half
    // the time the next one behind it too (a programmatic launch may start once the one ahead has
    // started: so while this kernel still runs). What they read before the wait, this kernel has
    // not written yet; what they write, it then reads. Half the time, so every pair of kernels in a
    // chain of programmatic launches is sometimes the pair.
    std::vector<std::pair<item, bool>> early;  // each with whether it parked
    do {
      item next = std::move(s.q.front());
      s.q.pop_front();
      const kernel_launch& k = *next.launch;
      const bool parked = park_grid(k.grid, k.block, k.smem, k.body);
      early.emplace_back(std::move(next), parked);
    } while (early.size() < 2 && pdl_next(s) && random_u64() % 2);
    if (sticky_error == cudaSuccess) it.fn();
    for (auto& [next, parked] : early) {
      if (parked)
        finish_parked_grid();
      else if (sticky_error == cudaSuccess)
        next.fn();
    }
    return;
  }
  switch (it.kind) {
    case item::work:
      if (sticky_error == cudaSuccess) it.fn();  // after a fault, nothing more runs
      break;
    case item::record:
      it.ev->reached = std::max(it.ev->reached, it.seq);
      it.ev->at = clock_type::now();
      break;
    case item::wait: break;
  }
}

// Runs the head of the stream of highest priority among those that can run; false if none can.
// A stream's priority is set whenever its queue fills from empty (put), so one stream's burst of
// work runs all before or all after another's rather than interleaved item by item.
bool step() {
  CUstream_st* best = nullptr;
  for (CUstream_st* s : dev().streams)
    if (runnable(*s) && (!best || s->priority > best->priority)) best = s;
  if (!best) return false;
  run_front(*best);
  return true;
}

template <class Done>
void run_until(Done done) {
  while (!done()) {
    if (!step()) {
      if (device_hangs()) {  // what the device can never finish, the caller waits for forever
        std::fprintf(stderr, "cuda_emu: a call waits for work that never ends: it never returns\n");
        for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
      }
      // Cannot happen with the calls emulated here (a wait names a record already enqueued).
      std::fprintf(stderr, "cuda_emu: every stream waits for an event no stream will record\n");
      std::abort();
    }
  }
}

void advance(uint64_t n) {
  for (uint64_t i = 0; i < n && step(); ++i) {
  }
}

void drain(CUstream_st* s) {
  run_until([s] { return s->q.empty(); });
}

// Runs every stream's work (only the blocking streams' with blocking_only) to the end.
void drain_all(bool blocking_only = false) {
  run_until([blocking_only] {
    for (CUstream_st* s : dev().streams)
      if ((s->blocking || !blocking_only) && !s->q.empty()) return false;
    return true;
  });
}

void drain_blocking() { drain_all(true); }

cudaError_t put(cudaStream_t s, item it) {
  if (is_legacy(s)) {
    cudaError_t e = cudaSuccess;
    for (CUstream_st* o : dev().streams)
      if (o->capture && o->blocking) {
        invalidate(*o->capture, "work on the legacy default stream while a blocking stream captures");
        e = cudaErrorStreamCaptureImplicit;
      }
    if (e != cudaSuccess) return fail(e);
    drain_blocking();
    if (it.kind == item::wait) run_until([&] { return it.ev->reached >= it.seq; });
    CUstream_st now;
    now.q.push_back(std::move(it));
    run_front(now);
    return ok();
  }
  if (s->capture) {
    if (it.kind != item::work) {
      invalidate(*s->capture, "an event record or wait inside a capture (not emulated)");
      return fail(cudaErrorStreamCaptureUnsupported);
    }
    if (!s->capture->invalid.empty()) return fail(cudaErrorStreamCaptureInvalidated);
    s->capture->items.push_back(std::move(it));
    return ok();
  }
  if (it.kind == item::work) it.hangs = injected_hang();
  if (s->q.empty()) {
    // Mostly the newest burst runs first: work enqueued later on another stream overtaking what
    // is still queued is the order that exposes a missing wait, whether the later work reads what
    // the earlier writes or overwrites what it reads. Sometimes it waits behind older bursts.
    static uint64_t bursts = 0;
    ++bursts;
    s->priority = random_u64() % 4 != 0 ? bursts : random_u64() % bursts;
  }
  s->q.push_back(std::move(it));
  advance(random_u64() % 2);
  return ok();
}

cudaMemcpyKind infer(const void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  if (kind != cudaMemcpyDefault) return kind;
  const bool d = on_device(dst, n), s = on_device(src, n);
  return d && s ? cudaMemcpyDeviceToDevice : d ? cudaMemcpyHostToDevice : s ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost;
}

bool copy_ranges_ok(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  if (n == 0) return true;
  switch (kind) {
    case cudaMemcpyHostToDevice: return on_device(dst, n);
    case cudaMemcpyDeviceToHost: return on_device(src, n);
    case cudaMemcpyDeviceToDevice: return on_device(dst, n) && on_device(src, n);
    case cudaMemcpyHostToHost: return true;
    default: return false;
  }
}

}  // namespace

cudaError_t enqueue(cudaStream_t stream, std::function<void()> work, bool kernel) {
  TROUPE_EMU_LOCKED;
  item it;
  it.fn = std::move(work);
  it.kernel = kernel;
  return put(stream, std::move(it));
}

cudaError_t enqueue_kernel(cudaStream_t stream, std::shared_ptr<const kernel_launch> k) {
  TROUPE_EMU_LOCKED;
  item it;
  it.fn = [k] { run_grid(k->grid, k->block, k->smem, k->body); };
  it.kernel = true;
  it.launch = std::move(k);
  return put(stream, std::move(it));
}

}  // namespace troupe_emu

using namespace troupe_emu;

extern "C" {

// ---- errors -------------------------------------------------------------------------------------

cudaError_t cudaGetLastError(void) {
  TROUPE_EMU_LOCKED;
  const cudaError_t e = last_error;
  last_error = sticky_error;
  return e;
}
cudaError_t cudaPeekAtLastError(void) { return last_error; }

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
    default: return "cudaError (emulated)";
  }
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorLaunchFailure: return "unspecified launch failure (emulated: a trap or a deadlock, see stderr)";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalState: return "the operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureImplicit: return "operation would make the legacy stream depend on a capturing blocking stream";
    default: return "emulated CUDA error";
  }
}

// ---- device -------------------------------------------------------------------------------------

cudaError_t cudaGetDevice(int* d) {
  TROUPE_EMU_LOCKED;
  *d = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  TROUPE_EMU_LOCKED;
  return d == 0 ? ok() : fail(cudaErrorInvalidDevice);
}
cudaError_t cudaGetDeviceCount(int* n) {
  TROUPE_EMU_LOCKED;
  *n = 1;
  return cudaSuccess;
}

namespace {
int env_int(const char* name, int fallback) {
  const char* s = std::getenv(name);
  return s ? std::atoi(s) : fallback;
}
}  // namespace

// An H200's shape by default (132 SMs, compute capability 9.0); TROUPE_EMU_SMS changes the count.
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr attr, int device) {
  TROUPE_EMU_LOCKED;
  if (device != 0) return fail(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *v = env_int("TROUPE_EMU_SMS", 132); break;
    case cudaDevAttrComputeCapabilityMajor: *v = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *v = 0; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *v = 2048; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = 227 * 1024; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *v = 228 * 1024; break;
    case cudaDevAttrL2CacheSize: *v = 60 * 1024 * 1024; break;
    case cudaDevAttrWarpSize: *v = 32; break;
    default: return fail(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
  TROUPE_EMU_LOCKED;
  if (device != 0) return fail(cudaErrorInvalidDevice);
  *p = cudaDeviceProp{};
  std::snprintf(p->name, sizeof p->name, "emulated (troupe cuda_emu, H200 shape)");
  p->totalGlobalMem = capacity();
  p->multiProcessorCount = env_int("TROUPE_EMU_SMS", 132);
  p->major = 9;
  p->minor = 0;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsPerMultiProcessor = 2048;
  p->sharedMemPerBlock = 48 * 1024;
  p->sharedMemPerBlockOptin = 227 * 1024;
  p->sharedMemPerMultiprocessor = 228 * 1024;
  p->l2CacheSize = 60 * 1024 * 1024;
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) { return cudaSuccess; }
// Resident CTAs of blockSize threads and dyn bytes of shared memory per SM, by threads and shared
// memory only (registers unknown here).
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, const void*, int block, size_t dyn) {
  TROUPE_EMU_LOCKED;
  int by_threads = block > 0 ? 2048 / block : 0;
  if (by_threads > 32) by_threads = 32;
  const int by_smem = dyn ? int(228 * 1024 / (dyn + 1024)) : 32;
  *n = std::min(by_threads, by_smem);
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
  TROUPE_EMU_LOCKED;
  if (const cudaError_t e = refuse_while_capturing("cudaDeviceSynchronize")) return e;
  drain_all();
  return ok();
}

// ---- memory -------------------------------------------------------------------------------------

cudaError_t cudaMalloc(void** p, size_t n) {
  TROUPE_EMU_LOCKED;
  *p = nullptr;
  if (sticky_error != cudaSuccess) return fail(sticky_error);  // the context is lost
  if (const cudaError_t e = refuse_while_capturing("cudaMalloc")) return e;
  if (refusing()) return fail(cudaErrorMemoryAllocation);
  const size_t bytes = (std::max<size_t>(n, 1) + 255) / 256 * 256;
  if (bytes > capacity() - dev().allocated) return fail(cudaErrorMemoryAllocation);
  *p = std::aligned_alloc(256, bytes);
  if (!*p) return fail(cudaErrorMemoryAllocation);
  std::memset(*p, 0xFF, bytes);
#if defined(__SANITIZE_ADDRESS__)
  // An AddressSanitizer build reports any access past the bytes asked for, as compute-sanitizer's
  // memcheck would, though the allocation is rounded up to 256 bytes as a device's is.
  ASAN_POISON_MEMORY_REGION(static_cast<unsigned char*>(*p) + n, bytes - n);
#endif
  dev().allocations.emplace(reinterpret_cast<uintptr_t>(*p), bytes);
  dev().allocated += bytes;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  TROUPE_EMU_LOCKED;
  if (!p) return cudaSuccess;
  if (const cudaError_t e = refuse_while_capturing("cudaFree")) return e;
  auto it = dev().allocations.find(reinterpret_cast<uintptr_t>(p));
  if (it == dev().allocations.end()) return fail(cudaErrorInvalidValue);
  drain_all();  // cudaFree waits for the device
  dev().allocated -= it->second;
#if defined(__SANITIZE_ADDRESS__)
  ASAN_UNPOISON_MEMORY_REGION(p, it->second);
#endif
  dev().allocations.erase(it);
  std::free(p);
  return ok();
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  TROUPE_EMU_LOCKED;
  *total = capacity();
  *free_bytes = capacity() - dev().allocated;
  return ok();
}
cudaError_t cudaHostAlloc(void** p, size_t n, unsigned int) {
  TROUPE_EMU_LOCKED;
  *p = nullptr;
  if (sticky_error != cudaSuccess) return fail(sticky_error);
  *p = std::aligned_alloc(4096, (std::max<size_t>(n, 1) + 4095) / 4096 * 4096);
  if (!*p) return fail(cudaErrorMemoryAllocation);
  dev().pinned.emplace(reinterpret_cast<uintptr_t>(*p), n);
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t n) { return cudaHostAlloc(p, n, 0); }
cudaError_t cudaFreeHost(void* p) {
  TROUPE_EMU_LOCKED;
  if (!p) return cudaSuccess;
  auto it = dev().pinned.find(reinterpret_cast<uintptr_t>(p));
  if (it == dev().pinned.end()) return fail(cudaErrorInvalidValue);
  drain_all();
  dev().pinned.erase(it);
  std::free(p);
  return ok();
}
cudaError_t cudaHostRegister(void* p, size_t n, unsigned int) {
  TROUPE_EMU_LOCKED;
  if (!p || n == 0 || is_pinned(p, 1)) return fail(cudaErrorInvalidValue);
  dev().pinned.emplace(reinterpret_cast<uintptr_t>(p), n);
  return ok();
}
cudaError_t cudaHostUnregister(void* p) {
  TROUPE_EMU_LOCKED;
  auto it = dev().pinned.find(reinterpret_cast<uintptr_t>(p));
  if (it == dev().pinned.end()) return fail(cudaErrorInvalidValue);
  drain_all();
  dev().pinned.erase(it);
  return ok();
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  TROUPE_EMU_LOCKED;
  if (const cudaError_t e = refuse_while_capturing("cudaMemcpy")) return e;
  kind = infer(dst, src, n, kind);
  if (!copy_ranges_ok(dst, src, n, kind)) return fail(cudaErrorInvalidValue);
  drain_blocking();
  if (sticky_error != cudaSuccess) return fail(sticky_error);
  if (n) std::memmove(dst, src, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s) {
  TROUPE_EMU_LOCKED;
  kind = infer(dst, src, n, kind);
  if (!copy_ranges_ok(dst, src, n, kind)) return fail(cudaErrorInvalidValue);
  if (n == 0) return ok();
  const bool pageable = (kind == cudaMemcpyHostToDevice && !is_pinned(src, n)) || (kind == cudaMemcpyDeviceToHost && !is_pinned(dst, n));
  if (pageable && !is_legacy(s) && !s->capture) {
    // Staged through a pinned buffer: the host returns once the copy has left (or reached) its
    // pageable memory, after the stream's earlier work.
    drain(s);
    if (sticky_error != cudaSuccess) return fail(sticky_error);
    std::memmove(dst, src, n);
    return cudaSuccess;
  }
  return put(s, item{item::work, [dst, src, n] { std::memmove(dst, src, n); }, nullptr, 0});
}
cudaError_t cudaMemset(void* p, int v, size_t n) {
  TROUPE_EMU_LOCKED;
  if (const cudaError_t e = refuse_while_capturing("cudaMemset")) return e;
  if (n && !on_device(p, n)) return fail(cudaErrorInvalidValue);
  drain_blocking();
  if (sticky_error != cudaSuccess) return fail(sticky_error);
  if (n) std::memset(p, v, n);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s) {
  TROUPE_EMU_LOCKED;
  if (n && !on_device(p, n)) return fail(cudaErrorInvalidValue);
  if (n == 0) return ok();
  return put(s, item{item::work, [p, v, n] { std::memset(p, v, n); }, nullptr, 0});
}

// ---- streams and events -------------------------------------------------------------------------

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  TROUPE_EMU_LOCKED;
  auto* st = new CUstream_st;
  st->blocking = (flags & cudaStreamNonBlocking) == 0;
  dev().streams.push_back(st);
  *s = st;
  return ok();
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  TROUPE_EMU_LOCKED;
  if (is_legacy(s)) return fail(cudaErrorInvalidResourceHandle);
  auto& v = dev().streams;
  auto it = std::find(v.begin(), v.end(), s);
  if (it == v.end()) return fail(cudaErrorInvalidResourceHandle);
  drain(s);  // its work completes, as on a device
  v.erase(it);
  delete s;
  return ok();
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  TROUPE_EMU_LOCKED;
  if (!is_legacy(s) && s->capture) {
    invalidate(*s->capture, "cudaStreamSynchronize on the capturing stream");
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  if (is_legacy(s))
    drain_blocking();
  else
    drain(s);
  return ok();
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
  TROUPE_EMU_LOCKED;
  if (is_legacy(s)) return ok();
  if (!s->q.empty()) advance(1 + random_u64() % 4);
  if (sticky_error != cudaSuccess) return fail(sticky_error);
  return s->q.empty() ? cudaSuccess : fail(cudaErrorNotReady);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
  TROUPE_EMU_LOCKED;
  *e = new CUevent_st;
  (*e)->s->timing = (flags & cudaEventDisableTiming) == 0;
  return ok();
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  TROUPE_EMU_LOCKED;
  delete e;  // records and waits still queued keep its state
  return ok();
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  TROUPE_EMU_LOCKED;
  item it{item::record, {}, e->s, 0};
  if (!is_legacy(s) && s->capture) return put(s, std::move(it));  // refused there
  it.seq = ++e->s->recorded;
  return put(s, std::move(it));
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  TROUPE_EMU_LOCKED;
  if (e->s->recorded == 0) return ok();  // never recorded: nothing to wait for
  return put(s, item{item::wait, {}, e->s, e->s->recorded});
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  TROUPE_EMU_LOCKED;
  event_state& st = *e->s;
  if (st.reached < st.recorded) advance(1 + random_u64() % 4);
  if (sticky_error != cudaSuccess) return fail(sticky_error);
  return st.reached >= st.recorded ? cudaSuccess : fail(cudaErrorNotReady);
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  TROUPE_EMU_LOCKED;
  event_state& st = *e->s;
  run_until([&] { return st.reached >= st.recorded; });
  return ok();
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
  TROUPE_EMU_LOCKED;
  if (!a->s->timing || !b->s->timing) return fail(cudaErrorInvalidResourceHandle);
  for (const event_state* st : {a->s.get(), b->s.get()})
    if (st->recorded == 0 || st->reached < st->recorded) return fail(cudaErrorNotReady);
  *ms = std::chrono::duration<float, std::milli>(b->s->at - a->s->at).count();
  return ok();
}

// ---- graphs -------------------------------------------------------------------------------------

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
  TROUPE_EMU_LOCKED;
  if (is_legacy(s)) return fail(cudaErrorStreamCaptureUnsupported);
  if (s->capture) return fail(cudaErrorIllegalState);
  s->capture = std::make_unique<capture_state>();
  s->capture->mode = mode;
  s->capture->thread = std::this_thread::get_id();
  return ok();
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* g) {
  TROUPE_EMU_LOCKED;
  *g = nullptr;
  if (is_legacy(s) || !s->capture) return fail(cudaErrorIllegalState);
  std::unique_ptr<capture_state> c = std::move(s->capture);
  if (!c->invalid.empty()) return fail(cudaErrorStreamCaptureInvalidated);
  *g = new CUgraph_st{std::move(c->items)};
  return ok();
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  TROUPE_EMU_LOCKED;
  *status = is_legacy(s) || !s->capture ? cudaStreamCaptureStatusNone
            : s->capture->invalid.empty() ? cudaStreamCaptureStatusActive
                                          : cudaStreamCaptureStatusInvalidated;
  return ok();
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t g, unsigned long long) {
  TROUPE_EMU_LOCKED;
  *exec = new CUgraphExec_st{g->items};
  return ok();
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
  TROUPE_EMU_LOCKED;
  if (!is_legacy(s) && s->capture) {
    invalidate(*s->capture, "a graph launched into a capture (not emulated)");
    return fail(cudaErrorStreamCaptureUnsupported);
  }
  for (const item& it : exec->items)
    if (const cudaError_t e = put(s, it)) return e;
  return ok();
}
cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  TROUPE_EMU_LOCKED;
  delete g;
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  TROUPE_EMU_LOCKED;
  delete exec;
  return cudaSuccess;
}

}  // extern "C"
