// The CPU emulation of CUDA behind cuda_emu.hpp: the fiber scheduler that runs a CTA's threads
// and the PTX stand-ins (the runtime API: runtime_emu.cpp; cuBLASLt: cublaslt_emu.cpp).
#include <sys/mman.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <new>
#include <random>
#include <string>
#include <vector>

// Switches stacks: saves the callee-saved registers on the current stack, stores its pointer in
// *from, loads `to` and pops the registers saved there (x86-64 System V). glibc's swapcontext
// also saves the signal mask, two system calls a switch: ten times slower for the millions of
// switches a kernel test makes.
extern "C" void troupe_emu_switch(void** from, void* to);
asm(R"(
  .text
  .globl troupe_emu_switch
  .type troupe_emu_switch, @function
troupe_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size troupe_emu_switch, .-troupe_emu_switch
)");

namespace troupe_emu {

uint3 block_idx;
dim3 grid_dim, block_dim;
thread_local cudaError_t last_error = cudaSuccess;
cudaError_t sticky_error = cudaSuccess;

namespace {

constexpr size_t stack_bytes = 256 * 1024;
constexpr size_t static_smem_limit = 48 * 1024;  // a device's limit for static shared memory per CTA
#if defined(__SANITIZE_ADDRESS__)
// An AddressSanitizer build keeps a poisoned gap before each static shared variable, and poisons
// the rest of the static area and the dynamic area's padding, so a CTA's access outside its shared
// variables is reported (compute-sanitizer's memcheck checks shared memory too).
constexpr size_t shared_redzone = 64;
constexpr size_t statics_capacity = 2 * static_smem_limit;  // room for the gaps
void poison(const void* p, size_t n) { ASAN_POISON_MEMORY_REGION(p, n); }
void unpoison(const void* p, size_t n) { ASAN_UNPOISON_MEMORY_REGION(p, n); }
#else
constexpr size_t shared_redzone = 0;
constexpr size_t statics_capacity = static_smem_limit;
void poison(const void*, size_t) {}
void unpoison(const void*, size_t) {}
#endif

struct trap_exception {
  const char* why;
};

struct barrier {
  int arrived = 0;
  uint64_t gen = 0;
  unsigned mask = 0;  // a warp barrier's lanes
};

// An asynchronous copy into shared memory (cp.async, cp.async.bulk) that has not landed: the
// source is read when it lands, as a device may read it any time before then.
struct async_copy {
  void* dst;
  const void* src;
  uint32_t bytes;
  uint64_t* bar;  // a bulk copy's mbarrier (complete_tx); null for cp.async
};

struct fiber {
  void* sp = nullptr;  // saved stack pointer while switched out
  void* stack = nullptr;
  uint3 tid{};
  int warp = 0, lane = 0;
  bool done = false;
  barrier* waiting = nullptr;  // blocked until its generation moves on
  uint64_t wait_gen = 0;
  bool spinning = false;  // yielded while polling
  uint32_t exchanges = 0;  // full-warp exchanges done: which slot set the next one uses
  std::vector<async_copy> cp_open;                 // cp.async copies not yet committed
  std::vector<std::vector<async_copy>> cp_groups;  // committed groups not landed, oldest first
};

struct warp_state {
  // One barrier per lane mask waited on at once: lanes split by __match_any_sync reduce in
  // disjoint groups side by side, each group a mask of its own.
  barrier bars[32];
  uint64_t slots[3][32] = {};  // [0], [1]: full-warp exchanges alternately; [2]: the others
  alignas(16) unsigned char scratch[32][32] = {};
  unsigned live = 0;

  barrier& bar_for(unsigned mask) {
    barrier* free = nullptr;
    for (barrier& b : bars) {
      if (b.arrived > 0 && b.mask == mask) return b;
      if (!free && b.arrived == 0) free = &b;
    }
    if (!free) trap("more than 32 lane masks waited on at once in one warp");
    free->mask = mask;
    return *free;
  }
};

// A resident CTA: its threads' fibers, barriers, and shared memory.
struct cta_slot {
  std::vector<fiber> fibers;  // a pool: stacks kept across the CTAs that use this slot
  std::vector<warp_state> warps;
  barrier bar;
  int live = 0;  // threads that have not returned
  size_t n_threads = 0;
  uint3 idx{};
  std::vector<int> order;  // its fibers' visiting order (shuffled once a CTA)
  bool forward = true;
  std::vector<unsigned char> dyn_store;
  unsigned char* dyn = nullptr;
  size_t dyn_bytes = 0;
  std::unique_ptr<unsigned char[]> statics;  // static shared variables (TROUPE_SHARED), statics_capacity bytes
  size_t statics_used = 0;   // the end of the last variable in `statics`
  size_t statics_bytes = 0;  // the bytes a device would count (without the sanitizer's gaps)
  std::vector<std::pair<const void*, size_t>> static_at;  // each variable's key and offset, in first-use order
  bool active = false;
  bool parked = false;  // every thread not returned waits in pdl_wait() or at a barrier behind it
  std::vector<async_copy> bulk;  // bulk copies in flight, in issue order
};

// One grid's execution: up to `limit` CTAs resident at once, one running. A kernel launched with
// programmatic dependent launch may run up to its pdl_wait() before the kernel ahead of it runs
// (park_grid): it stays parked in a grid_run of its own while the first runs that kernel.
struct grid_run {
  std::vector<cta_slot> slots;
  cta_slot* cta = nullptr;   // the running CTA
  bool switch_requested = false;
  void* sched_sp = nullptr;
  const void* sched_stack = nullptr;  // the scheduling thread's stack (AddressSanitizer builds)
  size_t sched_stack_bytes = 0;
  fiber* cur = nullptr;
  std::function<void()> body;
  bool aborted = false;
  std::string error;
  dim3 grid{}, block{};
  size_t smem = 0, n_threads = 0, n_blocks = 0, limit = 0;
  std::vector<uint32_t> order;     // the CTAs in the order they start
  size_t next = 0;                 // the next to start
  std::vector<cta_slot*> running;  // the resident ones
  bool gate_closed = false;        // pdl_wait() blocks: the kernel ahead has not run
  barrier gate;
};

constexpr int max_parked = 2;  // programmatic launches parked at once: a chain of two behind a kernel

struct state {
  grid_run runs[1 + max_parked];  // [0]: launches run through; the others: parked ones
  std::vector<int> parked;        // the runs holding a parked grid, oldest first
  grid_run* run = &runs[0];
  uint64_t progress = 0;  // barrier releases, satisfied polls, fibers that ended
  uint64_t switches = 0;  // CTA switches at global atomics and fences
  std::mt19937_64 rng;
  bool seeded = false;
};

state g;

// An mbarrier: expected arrivals, pending arrivals, pending transaction bytes, phase.
struct mbar {
  uint16_t count, pending;
  int32_t tx : 31;
  uint32_t phase : 1;
};
static_assert(sizeof(mbar) == 8);
mbar& as_mbar(uint64_t* bar) { return *reinterpret_cast<mbar*>(bar); }
void mbar_maybe_complete(mbar& m) {
  if (m.pending == 0 && m.tx == 0) {
    m.phase ^= 1u;
    m.pending = m.count;
  }
}

// Lands bulk copy i of CTA c: its bytes arrive and its mbarrier counts them.
void land_bulk(cta_slot& c, size_t i) {
  const async_copy a = c.bulk[i];
  c.bulk.erase(c.bulk.begin() + std::ptrdiff_t(i));
  std::memcpy(a.dst, a.src, a.bytes);
  mbar& m = as_mbar(a.bar);
  m.tx -= int32_t(a.bytes);
  mbar_maybe_complete(m);
  ++g.progress;
}

void land(const std::vector<async_copy>& copies) {
  for (const async_copy& a : copies) std::memcpy(a.dst, a.src, a.bytes);
}

void release(barrier& b) {
  b.arrived = 0;
  ++b.gen;
  ++g.progress;
}

// Stack switches. An AddressSanitizer build (a separate build dir, kernels/cuda/README.md) is told
// of each: before it, which stack comes next; after it, that it arrived (and from which stack).
#if defined(__SANITIZE_ADDRESS__)
void to_fiber(fiber& f) {
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, stack_bytes);
  troupe_emu_switch(&g.run->sched_sp, f.sp);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
}
void arrived_in_fiber(void* fake) { __sanitizer_finish_switch_fiber(fake, &g.run->sched_stack, &g.run->sched_stack_bytes); }
void to_scheduler(void** fake_save) {
  __sanitizer_start_switch_fiber(fake_save, g.run->sched_stack, g.run->sched_stack_bytes);
  troupe_emu_switch(&g.run->cur->sp, g.run->sched_sp);
}
#else
void to_fiber(fiber& f) { troupe_emu_switch(&g.run->sched_sp, f.sp); }
void arrived_in_fiber(void*) {}
void to_scheduler(void**) { troupe_emu_switch(&g.run->cur->sp, g.run->sched_sp); }
#endif

void yield() {
  void* fake = nullptr;
  to_scheduler(&fake);
  arrived_in_fiber(fake);
}

// The running fiber waits until b's generation moves on.
void block_on(barrier& b) {
  fiber& f = *g.run->cur;
  f.waiting = &b;
  f.wait_gen = b.gen;
  yield();
  f.waiting = nullptr;
}

void wait_at(barrier& b, int expected) {
  if (++b.arrived >= expected) return release(b);
  block_on(b);
}

int popcount(unsigned m) { return __builtin_popcount(m); }

// A fiber that returned: the barriers its CTA and warp wait at no longer count it.
void retire(fiber& f) {
  cta_slot& c = *g.run->cta;
  if ((!f.cp_open.empty() || !f.cp_groups.empty()) && !g.run->aborted) {
    g.run->aborted = true;
    g.run->error = "a thread returned with cp.async copies it did not wait for (cp.async.wait_group)";
  }
  f.done = true;
  ++g.progress;
  --c.live;
  warp_state& w = c.warps[f.warp];
  w.live &= ~(1u << f.lane);
  if (c.bar.arrived > 0 && c.bar.arrived >= c.live) release(c.bar);
  for (barrier& b : w.bars)
    if (b.arrived > 0 && b.arrived >= popcount(b.mask & w.live)) release(b);
}

// A fiber's first code: runs the kernel body for g.run->cur, then switches back for good.
void fiber_main() {
  arrived_in_fiber(nullptr);
  fiber& f = *g.run->cur;
  try {
    g.run->body();
  } catch (const trap_exception& t) {
    g.run->aborted = true;
    g.run->error = t.why;
  } catch (const std::exception& e) {
    g.run->aborted = true;
    g.run->error = std::string("exception in device code: ") + e.what();
  } catch (...) {
    g.run->aborted = true;
    g.run->error = "exception in device code";
  }
  retire(f);
  to_scheduler(nullptr);  // for good: no fake stack to keep
  __builtin_unreachable();
}

// A fresh stack whose first switch "returns" into fiber_main: six zeroed registers to pop, then
// the return address, placed so that rsp + 8 is 16-byte aligned at fiber_main's entry.
void* fresh_stack(void* stack) {
  unpoison(stack, stack_bytes);  // frames a fiber abandoned here (a failed launch) leave no poison behind
  auto top = (reinterpret_cast<uintptr_t>(stack) + stack_bytes) & ~uintptr_t(15);
  auto* p = reinterpret_cast<void**>(top);
  *--p = nullptr;                                       // alignment pad (fiber_main's "return address" slot)
  *--p = reinterpret_cast<void*>(&fiber_main);          // popped by ret
  for (int i = 0; i < 6; ++i) *--p = nullptr;           // r15 r14 r13 r12 rbx rbp
  return p;
}

void ensure_fibers(cta_slot& c, size_t n) {
  while (c.fibers.size() < n) {
    fiber f;
    f.stack = mmap(nullptr, stack_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (f.stack == MAP_FAILED) throw std::bad_alloc();
    c.fibers.push_back(f);
  }
}

void seed_once() {
  if (g.seeded) return;
  g.seeded = true;
  uint64_t seed = std::random_device{}();
  if (const char* s = std::getenv("TROUPE_EMU_SEED")) seed = std::strtoull(s, nullptr, 10);
  std::fprintf(stderr, "cuda_emu: scheduling seed %llu (TROUPE_EMU_SEED replays it)\n", (unsigned long long)seed);
  g.rng.seed(seed);
}

// Starts CTA `idx` of n_threads threads (and smem bytes of dynamic shared memory) in slot c.
void start_cta(cta_slot& c, uint3 idx, size_t n_threads, size_t smem) {
  ensure_fibers(c, n_threads);
  const size_t n_warps = (n_threads + 31) / 32;
  c.warps.assign(n_warps, warp_state{});
  for (size_t w = 0; w < n_warps; ++w) {
    const size_t lanes = std::min<size_t>(32, n_threads - w * 32);
    c.warps[w].live = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
  }
  c.bar = barrier{};
  c.bulk.clear();
  c.live = int(n_threads);
  c.n_threads = n_threads;
  c.idx = idx;
  if (smem) {
    unpoison(c.dyn_store.data(), c.dyn_store.size());  // before the vector may move its bytes
    c.dyn_store.resize(smem + 128);
    c.dyn = c.dyn_store.data() + (128 - reinterpret_cast<uintptr_t>(c.dyn_store.data()) % 128) % 128;
    std::memset(c.dyn, 0xFF, smem);  // uninitialized shared memory reads as NaN
    poison(c.dyn_store.data(), size_t(c.dyn - c.dyn_store.data()));
    poison(c.dyn + smem, size_t(c.dyn_store.data() + c.dyn_store.size() - (c.dyn + smem)));
  } else {
    c.dyn = nullptr;
  }
  c.dyn_bytes = smem;
  if (!c.statics) c.statics = std::make_unique<unsigned char[]>(statics_capacity);
  c.statics_used = c.statics_bytes = 0;
  poison(c.statics.get(), statics_capacity);
  c.static_at.clear();
  for (size_t i = 0; i < n_threads; ++i) {
    fiber& f = c.fibers[i];
    f.tid = uint3{unsigned(i % block_dim.x), unsigned(i / block_dim.x % block_dim.y), unsigned(i / (block_dim.x * block_dim.y))};
    f.warp = int(i / 32), f.lane = int(i % 32);
    f.done = false, f.waiting = nullptr, f.spinning = false, f.exchanges = 0;
    f.cp_open.clear(), f.cp_groups.clear();
    f.sp = fresh_stack(f.stack);
  }
  // Rounds visit the fibers in one shuffled order, each from a random start, alternately forward
  // and backward (a fresh shuffle a round cost more than the fibers' work in warp-heavy kernels).
  c.order.resize(n_threads);
  for (size_t i = 0; i < n_threads; ++i) c.order[i] = int(i);
  std::shuffle(c.order.begin(), c.order.end(), g.rng);
  c.forward = true;
  c.active = true;
}

// Makes c the running CTA.
void switch_to(cta_slot& c) {
  g.run->cta = &c;
  block_idx = c.idx;
}

// Runs rounds of the running CTA's fibers until they have all returned, the launch aborts (a trap
// or a deadlock), or a fiber asks to let another CTA run (switch_point).
void run_rounds(cta_slot& c) {
  const size_t n = c.n_threads;
  for (; c.live > 0 && !g.run->aborted; c.forward = !c.forward) {
    const uint64_t before = g.progress;
    bool ran = false;
    const size_t start = size_t(g.rng() % n);
    for (size_t k = 0; k < n; ++k) {
      const size_t at = c.forward ? (start + k) % n : (start + n - k) % n;
      fiber& f = c.fibers[size_t(c.order[at])];
      if (f.done || (f.waiting && f.waiting->gen == f.wait_gen)) continue;
      f.spinning = false;
      g.run->cur = &f;
      to_fiber(f);
      g.run->cur = nullptr;
      ran = ran || !f.spinning;
      if (g.run->aborted) break;
      if (g.run->switch_requested) {  // an interrupted round proves nothing about a deadlock
        g.run->switch_requested = false;
        return;
      }
    }
    if (!g.run->aborted && !ran && g.progress == before) {
      if (!c.bulk.empty()) {  // every thread polls: the oldest bulk copy lands (it would, on a device)
        land_bulk(c, 0);
        continue;
      }
      if (g.run->gate_closed) {  // parked, if some thread waits in pdl_wait() for the kernel ahead
        for (size_t i = 0; i < n; ++i)
          if (!c.fibers[i].done && c.fibers[i].waiting == &g.run->gate) {
            c.parked = true;
            return;
          }
      }
      g.run->aborted = true;
      g.run->error = "deadlock: every thread of the CTA waits at a barrier or polls for something no thread will do";
    }
  }
}

size_t resident_limit() {
  static const size_t n = [] {
    const char* s = std::getenv("TROUPE_EMU_RESIDENT_CTAS");
    const long v = s ? std::strtol(s, nullptr, 10) : 4;
    return size_t(std::clamp(v, 1L, 64L));
  }();
  return n;
}

}  // namespace

const uint3& thread_idx() { return g.run->cur->tid; }
unsigned char* dynamic_smem() { return g.run->cta->dyn; }
int lane() { return g.run->cur->lane; }
uint64_t* exchange_slots(unsigned mask) {
  warp_state& w = g.run->cta->warps[size_t(g.run->cur->warp)];
  return mask == 0xffffffffu ? w.slots[g.run->cur->exchanges & 1] : w.slots[2];
}
void exchange_end(unsigned mask) {
  if (mask == 0xffffffffu)
    ++g.run->cur->exchanges;
  else
    syncwarp(mask);
}
unsigned live_lanes() { return g.run->cta->warps[size_t(g.run->cur->warp)].live; }

void syncthreads() { wait_at(g.run->cta->bar, g.run->cta->live); }

void syncwarp(unsigned mask) {
  warp_state& w = g.run->cta->warps[size_t(g.run->cur->warp)];
  wait_at(w.bar_for(mask), popcount(mask & w.live));
}

void spin_yield() {
  g.run->cur->spinning = true;
  yield();
}

void trap(const char* why) { throw trap_exception{why}; }

void* cta_static(const void* key, size_t bytes, size_t align) {
  cta_slot& c = *g.run->cta;
  for (const auto& [k, at] : c.static_at)
    if (k == key) return c.statics.get() + at;
  const size_t at = (c.statics_used + shared_redzone + align - 1) / align * align;
  c.statics_bytes = (c.statics_bytes + align - 1) / align * align + bytes;
  if (c.statics_bytes > static_smem_limit || at + bytes > statics_capacity) trap("static shared memory beyond 48 KiB in one CTA");
  unpoison(c.statics.get() + at, bytes);
  std::memset(c.statics.get() + at, 0xFF, bytes);  // uninitialized shared memory reads as NaN
  c.static_at.emplace_back(key, at);
  c.statics_used = at + bytes;
  return c.statics.get() + at;
}

bool is_shared(const void* p) {
  const auto* b = static_cast<const unsigned char*>(p);
  const cta_slot& c = *g.run->cta;
  return (b >= c.statics.get() && b < c.statics.get() + statics_capacity) || (c.dyn && b >= c.dyn && b < c.dyn + c.dyn_bytes);
}

void switch_point() {
  if (g.run->running.size() < 2 || (g.rng() & 1)) return;
  ++g.switches;
  g.run->switch_requested = true;
  yield();
}

uint64_t cta_switches() { return g.switches; }

uint64_t random_u64() {
  seed_once();
  return g.rng();
}

bool launch_config_ok(dim3 grid, dim3 block, size_t smem) {
  const size_t n_threads = size_t(block.x) * block.y * block.z;
  const size_t n_blocks = size_t(grid.x) * grid.y * grid.z;
  if (n_threads == 0 || n_threads > 1024 || n_blocks == 0 || grid.y > 65535 || grid.z > 65535 || smem > 227 * 1024) {
    last_error = cudaErrorInvalidConfiguration;
    return false;
  }
  return true;
}

namespace {

// Fault injection for the serving tests: with TROUPE_EMU_FAULT_FILE set, the first launch that
// finds that file removes it and faults as an illegal memory access would (the context is lost:
// every later call fails), so a test decides when a device fault happens by creating the file.
bool injected_fault() {
  static const char* const path = std::getenv("TROUPE_EMU_FAULT_FILE");
  if (!path || ::unlink(path) != 0) return false;
  std::fprintf(stderr, "cuda_emu: injected fault (%s): an illegal memory access in this launch\n", path);
  last_error = sticky_error = cudaErrorIllegalAddress;
  return true;
}

// Sets grid r up for a launch (false: the launch cannot start); nothing runs yet.
bool start_grid(grid_run& r, dim3 grid, dim3 block, size_t smem, std::function<void()> body) {
  seed_once();
  if (sticky_error != cudaSuccess) {
    last_error = sticky_error;
    return false;
  }
  if (!launch_config_ok(grid, block, smem) || injected_fault()) return false;
  r.grid = grid, r.block = block, r.smem = smem;
  r.n_threads = size_t(block.x) * block.y * block.z;
  r.n_blocks = size_t(grid.x) * grid.y * grid.z;
  r.body = std::move(body);
  r.order.resize(r.n_blocks);
  for (size_t i = 0; i < r.n_blocks; ++i) r.order[i] = uint32_t(i);
  std::shuffle(r.order.begin(), r.order.end(), g.rng);
  r.next = 0;
  r.aborted = false;
  r.error.clear();
  r.switch_requested = false;
  r.slots.resize(std::max(r.slots.size(), resident_limit()));
  r.limit = std::min(resident_limit(), r.n_blocks);
  for (cta_slot& c : r.slots) c.active = false, c.parked = false;
  r.running.clear();
  r.gate_closed = false;
  return true;
}

// Runs grid r: CTAs start in the shuffled order, up to r.limit at once; each turn runs a random
// resident one until it finishes or stops at a switch point (a global atomic or fence). Returns
// when every CTA has finished, the launch failed, or, with the gate closed, every resident CTA is
// parked at pdl_wait() (no CTA starts then past the first r.limit: the rest wait on the device
// too, for SMs that the kernel ahead holds).
void drive(grid_run& r) {
  g.run = &r;
  grid_dim = r.grid, block_dim = r.block;
  std::vector<size_t> ready;
  while (!r.aborted) {
    while (r.running.size() < r.limit && r.next < r.n_blocks && !(r.gate_closed && r.next >= r.limit)) {
      cta_slot* c = nullptr;
      for (cta_slot& s : r.slots)
        if (!s.active) c = &s;
      const uint32_t b = r.order[r.next++];
      const dim3 gd = r.grid;
      start_cta(*c, uint3{unsigned(b % gd.x), unsigned(b / gd.x % gd.y), unsigned(b / (size_t(gd.x) * gd.y))}, r.n_threads,
                r.smem);
      r.running.push_back(c);
    }
    ready.clear();
    for (size_t i = 0; i < r.running.size(); ++i)
      if (!r.running[i]->parked) ready.push_back(i);
    if (ready.empty()) break;
    const size_t pick = ready.size() == 1 ? ready[0] : ready[size_t(g.rng() % ready.size())];
    cta_slot& c = *r.running[pick];
    switch_to(c);
    run_rounds(c);
    if (!r.aborted && c.live == 0 && !c.bulk.empty()) {
      r.aborted = true;
      r.error = "the CTA ended with a bulk copy (cp.async.bulk) still writing its shared memory";
    }
    if (r.aborted) {
      std::fprintf(stderr, "cuda_emu: launch failed in CTA (%u,%u,%u): %s\n", c.idx.x, c.idx.y, c.idx.z, r.error.c_str());
      last_error = sticky_error = cudaErrorLaunchFailure;
    } else if (c.live == 0) {
      c.active = false;
      r.running.erase(r.running.begin() + std::ptrdiff_t(pick));
    }
  }
  r.cta = nullptr;
}

// Ends grid r (a launch that failed leaves CTAs suspended mid-way: their fibers are abandoned, the
// stacks reset when their slot starts its next CTA, as a device abandons a faulted grid) and makes
// the first grid_run the running one again.
void finish(grid_run& r) {
  for (cta_slot& c : r.slots) c.active = false, c.parked = false;
  r.running.clear();
  r.gate_closed = false;
  r.body = nullptr;
  g.run = &g.runs[0];
}

}  // namespace

void run_grid(dim3 grid, dim3 block, size_t smem, std::function<void()> body) {
  grid_run& r = g.runs[0];
  if (start_grid(r, grid, block, smem, std::move(body))) drive(r);
  finish(r);
}

bool park_grid(dim3 grid, dim3 block, size_t smem, std::function<void()> body) {
  int free = 0;
  for (int i = 1; i <= max_parked && !free; ++i)
    if (std::find(g.parked.begin(), g.parked.end(), i) == g.parked.end()) free = i;
  if (!free) return false;
  grid_run& r = g.runs[free];
  if (!start_grid(r, grid, block, smem, std::move(body))) {
    finish(r);
    return false;
  }
  g.parked.push_back(free);
  r.gate_closed = true;
  drive(r);
  g.run = &g.runs[0];
  return true;
}

void finish_parked_grid() {
  if (g.parked.empty()) return;
  grid_run& r = g.runs[g.parked.front()];
  g.parked.erase(g.parked.begin());
  if (!r.aborted && sticky_error == cudaSuccess) {
    r.gate_closed = false;
    release(r.gate);
    for (cta_slot* c : r.running) c->parked = false;
    drive(r);
  }
  finish(r);
}

void pdl_wait() {
  if (g.run->gate_closed) block_on(g.run->gate);
}

// ---- PTX stand-ins ------------------------------------------------------------------------------

// ldmatrix .m8n8.x4 .b16: lanes 8j..8j+7 give the row addresses of matrix j; lane l receives in
// r[j] the elements (l/4, 2(l%4)) and (l/4, 2(l%4)+1) of matrix j, or with .trans those at
// (2(l%4), l/4) and (2(l%4)+1, l/4).
void ldmatrix_x4(uint32_t (&r)[4], const void* smem, bool trans) {
  uint64_t* s = g.run->cta->warps[size_t(g.run->cur->warp)].slots[2];
  const int me = lane();
  s[me] = reinterpret_cast<uintptr_t>(smem);
  syncwarp(0xffffffffu);
  for (int j = 0; j < 4; ++j) {
    uint16_t e[2];
    for (int k = 0; k < 2; ++k) {
      const int row = trans ? 2 * (me % 4) + k : me / 4;
      const int col = trans ? me / 4 : 2 * (me % 4) + k;
      std::memcpy(&e[k], reinterpret_cast<const unsigned char*>(s[8 * j + row]) + 2 * col, 2);
    }
    r[j] = uint32_t(e[0]) | uint32_t(e[1]) << 16;
  }
  syncwarp(0xffffffffu);
}

// mma.sync.m16n8k16.row.col.f32.f16.f16.f32 with the fragment layouts of the PTX ISA: group
// g = lane/4, t = lane%4; A regs {a0a1 (g, 2t..), a2a3 (g+8, 2t..), a4a5 (g, 2t+8..), a6a7 (g+8,
// 2t+8..)}; B regs {b0b1 (k 2t.., n g), b2b3 (k 2t+8.., n g)}; D {(g, 2t), (g, 2t+1), (g+8, 2t),
// (g+8, 2t+1)}. Products summed in float in k order.
void mma_16816_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  struct frag {
    uint32_t a[4], b[2];
  };
  static_assert(sizeof(frag) <= sizeof(warp_state::scratch[0]));
  frag* all = reinterpret_cast<frag*>(g.run->cta->warps[size_t(g.run->cur->warp)].scratch);  // this warp's, between the barriers
  const int me = lane();
  all[me] = frag{{a[0], a[1], a[2], a[3]}, {b0, b1}};
  syncwarp(0xffffffffu);
  // Every fp16 value as a float, built once (the host's __half2float is a software conversion).
  static const std::vector<float> half_value = [] {
    std::vector<float> v(65536);
    for (uint32_t i = 0; i < 65536; ++i) {
      __half_raw h;
      h.x = uint16_t(i);
      v[i] = __half2float(__half(h));
    }
    return v;
  }();
  const auto half_at = [&](uint32_t reg, int k) { return half_value[(reg >> (16 * k)) & 0xFFFFu]; };
  const auto A = [&](int row, int col) {  // 16 x 16
    const int gg = row % 8, t = (col % 8) / 2, k = col % 2;
    const int reg = (row >= 8 ? 1 : 0) + (col >= 8 ? 2 : 0);
    return half_at(all[gg * 4 + t].a[reg], k);
  };
  const auto B = [&](int kk, int n) {  // 16 x 8
    const int t = (kk % 8) / 2, k = kk % 2;
    return half_at(all[n * 4 + t].b[kk >= 8 ? 1 : 0], k);
  };
  const int gg = me / 4, t = me % 4;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = gg + (i >= 2 ? 8 : 0), col = 2 * t + (i % 2);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    out[i] = acc;
  }
  syncwarp(0xffffffffu);
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}

void mbar_init(uint64_t* bar, uint32_t count) { as_mbar(bar) = mbar{uint16_t(count), uint16_t(count), 0, 0}; }
void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  mbar& m = as_mbar(bar);
  if (m.pending == 0) trap("mbarrier: arrival beyond the expected count");
  m.tx += int32_t(bytes);
  --m.pending;
  mbar_maybe_complete(m);
}
void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  if (bytes % 16 || reinterpret_cast<uintptr_t>(dst) % 16 || reinterpret_cast<uintptr_t>(src) % 16)
    trap("cp.async.bulk: size and addresses must be multiples of 16");
  if (!is_shared(dst) || !is_shared(static_cast<const unsigned char*>(dst) + bytes - 1) || !is_shared(bar))
    trap("cp.async.bulk: the destination and the mbarrier must be in the CTA's shared memory");
  cta_slot& c = *g.run->cta;
  c.bulk.push_back(async_copy{dst, src, bytes, bar});
  if (g.rng() & 1)  // half the time every copy in flight lands now, this one included
    while (!c.bulk.empty()) land_bulk(c, 0);
}
bool mbar_test_parity(uint64_t* bar, uint32_t parity) {
  cta_slot& c = *g.run->cta;
  if (as_mbar(bar).phase == parity && (g.rng() & 1)) {  // not complete: half the time its oldest copy lands
    for (size_t i = 0; i < c.bulk.size(); ++i)
      if (c.bulk[i].bar == bar) {
        land_bulk(c, i);
        break;
      }
  }
  const bool done = as_mbar(bar).phase != parity;
  if (done) ++g.progress;
  return done;
}

void cp_async(void* dst, const void* src, uint32_t bytes) {
  if ((bytes != 4 && bytes != 8 && bytes != 16) || reinterpret_cast<uintptr_t>(dst) % bytes ||
      reinterpret_cast<uintptr_t>(src) % bytes)
    trap("cp.async: 4, 8 or 16 bytes, both addresses aligned to the size");
  if (!is_shared(dst)) trap("cp.async: the destination must be in the CTA's shared memory");
  g.run->cur->cp_open.push_back(async_copy{dst, src, bytes, nullptr});
}
void cp_async_commit() {
  fiber& f = *g.run->cur;
  f.cp_groups.push_back(std::move(f.cp_open));
  f.cp_open.clear();
}
void cp_async_wait(int n) {
  fiber& f = *g.run->cur;
  size_t keep = size_t(std::max(n, 0));
  if (g.rng() & 1) {  // half the time every copy of the thread lands, the n newest groups included
    keep = 0;
    land(f.cp_open);
    f.cp_open.clear();
  }
  while (f.cp_groups.size() > keep) {
    land(f.cp_groups.front());
    f.cp_groups.erase(f.cp_groups.begin());
  }
}

}  // namespace troupe_emu
