// The CPU emulation of CUDA behind cuda_emu.hpp: the fiber scheduler that runs a CTA's threads
// and the PTX stand-ins (the runtime API: runtime_emu.cpp; cuBLASLt: cublaslt_emu.cpp).
#include <sys/mman.h>

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

struct trap_exception {
  const char* why;
};

struct barrier {
  int arrived = 0;
  uint64_t gen = 0;
  unsigned mask = 0;  // a warp barrier's lanes
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

// The running CTA (one at a time) and the launch state.
struct state {
  std::vector<fiber> fibers;  // a pool: stacks kept across CTAs and launches
  std::vector<warp_state> warps;
  barrier bar;
  int live = 0;
  void* sched_sp = nullptr;
  fiber* cur = nullptr;
  const std::function<void()>* body = nullptr;
  unsigned char* dyn = nullptr;
  size_t dyn_bytes = 0;
  bool aborted = false;
  std::string error;
  uint64_t progress = 0;  // barrier releases, satisfied polls, fibers that ended
  std::mt19937_64 rng;
  bool seeded = false;
};

state g;

void release(barrier& b) {
  b.arrived = 0;
  ++b.gen;
  ++g.progress;
}

void yield() { troupe_emu_switch(&g.cur->sp, g.sched_sp); }

void wait_at(barrier& b, int expected) {
  if (++b.arrived >= expected) return release(b);
  fiber& f = *g.cur;
  f.waiting = &b;
  f.wait_gen = b.gen;
  yield();
  f.waiting = nullptr;
}

int popcount(unsigned m) { return __builtin_popcount(m); }

// A fiber that returned: the barriers its CTA and warp wait at no longer count it.
void retire(fiber& f) {
  f.done = true;
  ++g.progress;
  --g.live;
  warp_state& w = g.warps[f.warp];
  w.live &= ~(1u << f.lane);
  if (g.bar.arrived > 0 && g.bar.arrived >= g.live) release(g.bar);
  for (barrier& b : w.bars)
    if (b.arrived > 0 && b.arrived >= popcount(b.mask & w.live)) release(b);
}

// A fiber's first code: runs the kernel body for g.cur, then switches back for good.
void fiber_main() {
  fiber& f = *g.cur;
  try {
    (*g.body)();
  } catch (const trap_exception& t) {
    g.aborted = true;
    g.error = t.why;
  } catch (const std::exception& e) {
    g.aborted = true;
    g.error = std::string("exception in device code: ") + e.what();
  } catch (...) {
    g.aborted = true;
    g.error = "exception in device code";
  }
  retire(f);
  troupe_emu_switch(&f.sp, g.sched_sp);
  __builtin_unreachable();
}

// A fresh stack whose first switch "returns" into fiber_main: six zeroed registers to pop, then
// the return address, placed so that rsp + 8 is 16-byte aligned at fiber_main's entry.
void* fresh_stack(void* stack) {
  auto top = (reinterpret_cast<uintptr_t>(stack) + stack_bytes) & ~uintptr_t(15);
  auto* p = reinterpret_cast<void**>(top);
  *--p = nullptr;                                       // alignment pad (fiber_main's "return address" slot)
  *--p = reinterpret_cast<void*>(&fiber_main);          // popped by ret
  for (int i = 0; i < 6; ++i) *--p = nullptr;           // r15 r14 r13 r12 rbx rbp
  return p;
}

void ensure_fibers(size_t n) {
  while (g.fibers.size() < n) {
    fiber f;
    f.stack = mmap(nullptr, stack_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (f.stack == MAP_FAILED) throw std::bad_alloc();
    g.fibers.push_back(f);
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

// Runs one CTA's fibers to completion (or to a trap or deadlock: g.aborted).
void run_cta(size_t n_threads) {
  ensure_fibers(n_threads);
  const size_t n_warps = (n_threads + 31) / 32;
  g.warps.assign(n_warps, warp_state{});
  for (size_t w = 0; w < n_warps; ++w) {
    const size_t lanes = std::min<size_t>(32, n_threads - w * 32);
    g.warps[w].live = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
  }
  g.bar = barrier{};
  g.live = int(n_threads);
  if (g.dyn) std::memset(g.dyn, 0xFF, g.dyn_bytes);  // uninitialized shared memory reads as NaN
  for (size_t i = 0; i < n_threads; ++i) {
    fiber& f = g.fibers[i];
    f.tid = uint3{unsigned(i % block_dim.x), unsigned(i / block_dim.x % block_dim.y), unsigned(i / (block_dim.x * block_dim.y))};
    f.warp = int(i / 32), f.lane = int(i % 32);
    f.done = false, f.waiting = nullptr, f.spinning = false, f.exchanges = 0;
    f.sp = fresh_stack(f.stack);
  }
  // Rounds visit the fibers in one shuffled order, each from a random start, alternately forward
  // and backward (a fresh shuffle a round cost more than the fibers' work in warp-heavy kernels).
  std::vector<int> order(n_threads);
  for (size_t i = 0; i < n_threads; ++i) order[i] = int(i);
  std::shuffle(order.begin(), order.end(), g.rng);
  for (bool forward = true; g.live > 0 && !g.aborted; forward = !forward) {
    const uint64_t before = g.progress;
    bool ran = false;
    const size_t start = size_t(g.rng() % n_threads);
    for (size_t k = 0; k < n_threads; ++k) {
      const size_t at = forward ? (start + k) % n_threads : (start + n_threads - k) % n_threads;
      fiber& f = g.fibers[size_t(order[at])];
      if (f.done || (f.waiting && f.waiting->gen == f.wait_gen)) continue;
      f.spinning = false;
      g.cur = &f;
      troupe_emu_switch(&g.sched_sp, f.sp);
      g.cur = nullptr;
      ran = ran || !f.spinning;
      if (g.aborted) break;
    }
    if (!g.aborted && !ran && g.progress == before) {
      g.aborted = true;
      g.error = "deadlock: every thread of the CTA waits at a barrier or polls for something no thread will do";
    }
  }
}

}  // namespace

const uint3& thread_idx() { return g.cur->tid; }
unsigned char* dynamic_smem() { return g.dyn; }
int lane() { return g.cur->lane; }
uint64_t* exchange_slots(unsigned mask) {
  warp_state& w = g.warps[size_t(g.cur->warp)];
  return mask == 0xffffffffu ? w.slots[g.cur->exchanges & 1] : w.slots[2];
}
void exchange_end(unsigned mask) {
  if (mask == 0xffffffffu)
    ++g.cur->exchanges;
  else
    syncwarp(mask);
}
unsigned live_lanes() { return g.warps[size_t(g.cur->warp)].live; }

void syncthreads() { wait_at(g.bar, g.live); }

void syncwarp(unsigned mask) {
  warp_state& w = g.warps[size_t(g.cur->warp)];
  wait_at(w.bar_for(mask), popcount(mask & w.live));
}

void spin_yield() {
  g.cur->spinning = true;
  yield();
}

void trap(const char* why) { throw trap_exception{why}; }

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

void run_grid(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
  seed_once();
  if (sticky_error != cudaSuccess) {
    last_error = sticky_error;
    return;
  }
  if (!launch_config_ok(grid, block, smem)) return;
  const size_t n_threads = size_t(block.x) * block.y * block.z;
  const size_t n_blocks = size_t(grid.x) * grid.y * grid.z;
  grid_dim = grid, block_dim = block;
  g.body = &body;
  std::vector<unsigned char> dyn;
  if (smem) {
    dyn.resize(smem + 128);
    g.dyn = dyn.data() + (128 - reinterpret_cast<uintptr_t>(dyn.data()) % 128) % 128;
    g.dyn_bytes = smem;
  } else {
    g.dyn = nullptr, g.dyn_bytes = 0;
  }
  std::vector<uint32_t> order(n_blocks);
  for (size_t i = 0; i < n_blocks; ++i) order[i] = uint32_t(i);
  std::shuffle(order.begin(), order.end(), g.rng);
  g.aborted = false;
  for (uint32_t b : order) {
    block_idx = uint3{unsigned(b % grid.x), unsigned(b / grid.x % grid.y), unsigned(b / (size_t(grid.x) * grid.y))};
    run_cta(n_threads);
    if (g.aborted) {
      std::fprintf(stderr, "cuda_emu: launch failed in CTA (%u,%u,%u): %s\n", block_idx.x, block_idx.y, block_idx.z,
                   g.error.c_str());
      last_error = sticky_error = cudaErrorLaunchFailure;
      break;
    }
  }
  g.dyn = nullptr;
  g.body = nullptr;
}

// ---- PTX stand-ins ------------------------------------------------------------------------------

// ldmatrix .m8n8.x4 .b16: lanes 8j..8j+7 give the row addresses of matrix j; lane l receives in
// r[j] the elements (l/4, 2(l%4)) and (l/4, 2(l%4)+1) of matrix j, or with .trans those at
// (2(l%4), l/4) and (2(l%4)+1, l/4).
void ldmatrix_x4(uint32_t (&r)[4], const void* smem, bool trans) {
  uint64_t* s = g.warps[size_t(g.cur->warp)].slots[2];
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
  frag* all = reinterpret_cast<frag*>(g.warps[size_t(g.cur->warp)].scratch);  // this warp's, between the barriers
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

// An mbarrier: expected arrivals, pending arrivals, pending transaction bytes, phase.
namespace {
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
}  // namespace

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
  std::memcpy(dst, src, bytes);
  mbar& m = as_mbar(bar);
  m.tx -= int32_t(bytes);
  mbar_maybe_complete(m);
}
bool mbar_test_parity(uint64_t* bar, uint32_t parity) {
  const bool done = as_mbar(bar).phase != parity;
  if (done) ++g.progress;
  return done;
}

}  // namespace troupe_emu
