// Token sampling on the device, one CTA of 1024 threads per row, no sort of the vocabulary.
//
// The chain matches engine::sampler: penalties -> greedy (temperature <= 0 or top_k == 1) ->
// top-k -> top-p (over the top-k survivors, temperature 1) -> min-p (logit >= max + log(min_p))
// -> weights exp((l - max) / T) -> one draw. Candidates are ranked by logit descending, ties to
// the lower id, as the CPU sampler ranks them.
//
// Top-k and top-p each reduce to one boundary token (value, id) in that ranking, found by an
// MSB-first radix select over the logits' order-preserving 32-bit keys: four passes of a 256-bin
// shared-memory histogram (counts for top-k, masses for top-p), each pass keeping the bin where
// the running amount from the top reaches the target. The survivors are then "every token ranked
// at or above the boundary", so the draw needs no candidate list: it walks the vocabulary in id
// order with the weights of the survivors (zero elsewhere). Ties at a boundary value are cut at
// the n-th tied id by one extra ordered count (only when the cut falls inside the ties).
//
// Exactness and limits: no cap on the number of survivors (top-k of the whole vocabulary and
// top-p = 0.999 cost the same). Top-p masses are fixed point, round(exp(l - max) * 2^40) summed
// in 64-bit integers, so selection is deterministic; tokens lighter than 2^-41 of the best one
// count as zero mass, which moves the top-p boundary only when the target mass lies within
// n_vocab * 2^-41 of a boundary. NaN logits are never chosen and rank below everything. Cost:
// about 11 passes over the row for top-k plus top-p (4 + 4 radix, max, 2 for the draw), fewer
// otherwise; rows run on separate SMs.
//
// Draws: u = (h >> 11) * 2^-53 where h is a splitmix64-style hash of (seed, draw); the token is
// the first survivor in id order whose running weight exceeds u * W (the last positive one if
// rounding leaves none). Every sum has a fixed order, so the same inputs give the same token.
//
// Against engine::sampler: greedy rows (and the penalties) give the CPU's token exactly; seeded
// stochastic rows draw from the same survivor set and distribution but NOT the same token for the
// same seed: the CPU takes u from a per-sequence mt19937_64 stream, walks top-k survivors in rank
// order and uses its own exp, while this kernel hashes (seed, draw), walks in id order and uses
// expf. Penalty histories are used whole: the caller applies penalty_last_n.
#include <climits>
#include <cstdint>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/device_util.cuh"
#include "kernels/cuda/launch.cuh"

namespace troupe::kernels::cuda {

namespace {

constexpr int sample_threads = 1024;
constexpr int n_warps = sample_threads / 32;
constexpr int n_bins = 256;
constexpr int bins_per_lane = n_bins / 32;
constexpr float mass_scale = 1099511627776.0f;  // 2^40: fixed point of top-p masses
constexpr uint32_t no_bin = 0xffffffffu;
constexpr unsigned full_mask = 0xffffffffu;

struct row_smem {
  unsigned int count[n_bins];
  unsigned long long mass[n_bins];
  double warp_total[n_warps];
  float red_val[n_warps];
  int red_idx[n_warps];
  // radix select results
  uint32_t prefix;
  unsigned long long target, above, at_mass;
  unsigned int at_count;
  // first_crossing results
  int cross_warp, result;
  double cross_before, cross_target;
};

/// Order-preserving key: a < b (floats, not NaN) iff key(a) < key(b); -0 and +0 share a key.
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t b = f == 0.0f ? 0u : __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ unsigned long long mass_of(float l, float l_max) {
  return __float2ull_rn(expf(l - l_max) * mass_scale);
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// A uniform double in [0, 1) that depends only on (seed, draw).
__device__ double unit_draw(uint64_t seed, uint64_t draw) {
  const uint64_t z = mix64(mix64(seed ^ 0x243f6a8885a308d3ull) + (draw + 1) * 0x9e3779b97f4a7c15ull);
  return double(z >> 11) * 0x1p-53;
}

__device__ __forceinline__ void better_of(float& v, int& i, float v2, int i2) {
  if (v2 > v || (v2 == v && i2 < i)) v = v2, i = i2;  // NaN never wins
}

/// Largest logit and its lowest index (INT_MAX when every logit is NaN). Each thread has
/// argmax_batch loads in flight per round: one at a time, a 128k vocabulary is a chain of 125
/// dependent-issue L2 round trips a thread, the likely reason the sampling kernel took 48 us of a
/// batch-1 decode step for a 0.5 MB row (docs/perf.md §4b; not yet re-measured). The order of the
/// comparisons does not change the result (ties go to the lower index).
constexpr int argmax_batch = 8;
__device__ void block_argmax(const float* l, int n, row_smem& sm, float& best, int& best_i) {
  float v = -INFINITY;
  int idx = INT_MAX;
  const int stride = blockDim.x;
  int i = threadIdx.x;
  for (; i + (argmax_batch - 1) * stride < n; i += argmax_batch * stride) {
    float x[argmax_batch];
#pragma unroll
    for (int k = 0; k < argmax_batch; ++k) x[k] = l[i + k * stride];
#pragma unroll
    for (int k = 0; k < argmax_batch; ++k) better_of(v, idx, x[k], i + k * stride);
  }
  for (; i < n; i += stride) better_of(v, idx, l[i], i);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) better_of(v, idx, __shfl_xor_sync(full_mask, v, o), __shfl_xor_sync(full_mask, idx, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sm.red_val[threadIdx.x >> 5] = v, sm.red_idx[threadIdx.x >> 5] = idx;
  __syncthreads();
  best = -INFINITY, best_i = INT_MAX;
  for (int w = 0; w < n_warps; ++w) better_of(best, best_i, sm.red_val[w], sm.red_idx[w]);
}

/// Penalties over the row's history: each distinct token in range, with its count c, gets
/// l = l > 0 ? l / rp : l * rp, then l -= c * frequency + presence. counts (n_vocab ints, any
/// contents) is scratch: only the history's entries are touched and they are left at 0.
__device__ void apply_penalties(float* l, int n, const sample_row_params& p, const int32_t* hist, int n_hist,
                                int32_t* counts) {
  for (int i = threadIdx.x; i < n_hist; i += blockDim.x)
    if (hist[i] >= 0 && hist[i] < n) counts[hist[i]] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < n_hist; i += blockDim.x)
    if (hist[i] >= 0 && hist[i] < n) atomicAdd(&counts[hist[i]], 1);
  __syncthreads();
  for (int i = threadIdx.x; i < n_hist; i += blockDim.x) {
    const int32_t t = hist[i];
    if (t < 0 || t >= n) continue;
    const int c = atomicExch(&counts[t], 0);  // the first occurrence to get here owns the token
    if (c == 0) continue;
    float x = l[t];
    x = x <= 0.0f ? x * p.repetition_penalty : x / p.repetition_penalty;
    l[t] = x - __fadd_rn(__fmul_rn(float(c), p.frequency_penalty), p.presence_penalty);
  }
  __syncthreads();
}

/// Warp 0 picks this pass's bin: the one where the running amount from the top bin down reaches
/// the target. On the first pass the target is target_of(total amount).
template <bool Mass, class TargetOf>
__device__ void choose_bin(row_smem& sm, int shift, bool first, const TargetOf& target_of) {
  const int lane = threadIdx.x;
  unsigned long long a[bins_per_lane], s = 0;
#pragma unroll
  for (int k = 0; k < bins_per_lane; ++k) {
    const int b = bins_per_lane * lane + k;
    a[k] = Mass ? sm.mass[b] : sm.count[b];
    s += a[k];
  }
  unsigned long long suffix = s;  // amount in this lane's bins and all higher ones
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long t = __shfl_down_sync(full_mask, suffix, o);
    if (lane + o < 32) suffix += t;
  }
  if (first) {
    const unsigned long long total = __shfl_sync(full_mask, suffix, 0);
    if (lane == 0) sm.target = target_of(total), sm.above = 0, sm.prefix = 0;
    __syncwarp();
  }
  const unsigned long long need = sm.target - sm.above, above = suffix - s;
  __syncwarp();
  if (above < need && need <= suffix) {  // exactly one lane
    unsigned long long cum = above;
    int bin = bins_per_lane * lane;
    for (int k = bins_per_lane - 1; k >= 0; --k) {
      if (cum + a[k] >= need) {
        bin = bins_per_lane * lane + k;
        break;
      }
      cum += a[k];
    }
    sm.prefix |= uint32_t(bin) << shift;
    sm.above += cum;
    sm.at_count = sm.count[bin];
    sm.at_mass = sm.mass[bin];
  }
}

/// Radix select over the keys of the valid (non-NaN) tokens with in_set(i, key): the largest
/// key v whose amount (count, or fixed-point mass) at keys >= v reaches target_of(total).
/// Leaves in sm: prefix = v, target, above = amount at keys > v, at_count / at_mass = at v.
template <bool Mass, class InSet, class TargetOf>
__device__ void radix_select(const float* l, int n, float l_max, const InSet& in_set, const TargetOf& target_of,
                             row_smem& sm) {
  const int lane = threadIdx.x & 31;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    __syncthreads();  // earlier readers of sm are done
    for (int b = threadIdx.x; b < n_bins; b += blockDim.x) sm.count[b] = 0, sm.mass[b] = 0;
    const uint32_t hi_mask = pass == 0 ? 0u : ~0u << (shift + 8);
    const uint32_t prefix = pass == 0 ? 0u : sm.prefix;
    __syncthreads();
    // Every thread runs the same number of iterations: the warp intrinsics need whole warps.
    for (int i0 = 0; i0 < n; i0 += blockDim.x) {
      const int i = i0 + threadIdx.x;
      uint32_t bin = no_bin;
      unsigned long long amount = 0;
      if (i < n) {
        const float v = l[i];
        const uint32_t key = order_key(v);
        if (!isnan(v) && (key & hi_mask) == prefix && in_set(i, key)) {
          bin = (key >> shift) & 0xff;
          if (Mass) amount = mass_of(v, l_max);
        }
      }
      // Lanes that share a bin add once (the first passes put most tokens in a few bins).
      const unsigned peers = __match_any_sync(full_mask, bin);
      const bool leader = lane == __ffs(peers) - 1;
      if (Mass) {
        // amount <= 2^40: 32 halves of 20 bits fit the 32-bit reduction.
        const unsigned hi = __reduce_add_sync(peers, unsigned(amount >> 20));
        const unsigned lo = __reduce_add_sync(peers, unsigned(amount & 0xfffff));
        if (bin != no_bin && leader) atomicAdd(&sm.mass[bin], (static_cast<unsigned long long>(hi) << 20) + lo);
      }
      if (bin != no_bin && leader) atomicAdd(&sm.count[bin], unsigned(__popc(peers)));
    }
    __syncthreads();
    if (threadIdx.x < 32) choose_bin<Mass>(sm, shift, pass == 0, target_of);
  }
  __syncthreads();
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(full_mask, v, o);
  return v;
}

__device__ __forceinline__ double warp_inclusive_scan(double v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double t = __shfl_up_sync(full_mask, v, o);
    if (lane >= o) v += t;
  }
  return v;
}

/// The first index i in [0, n), in id order, at which the running sum of weight(i) exceeds
/// target_of(total of all weights); the last index with a positive weight when rounding leaves
/// none; -1 when no weight is positive. Warp w owns one contiguous chunk of the row; the chunk
/// sums and the scan inside the crossing chunk have fixed orders, so the result is reproducible.
template <class Weight, class TargetOf>
__device__ int first_crossing(int n, const Weight& weight, const TargetOf& target_of, row_smem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunk = ((n + n_warps - 1) / n_warps + 31) & ~31;
  const auto range_of = [&](int w, int& b, int& e) {
    b = min(n, w * chunk);
    e = min(n, b + chunk);
  };
  int begin, end;
  range_of(warp, begin, end);
  double s = 0.0;
  for (int i = begin + lane; i < end; i += 32) s += weight(i);
  s = warp_sum(s);
  __syncthreads();  // earlier readers of sm are done
  if (lane == 0) sm.warp_total[warp] = s;
  __syncthreads();
  if (warp == 0) {
    const double wt = sm.warp_total[lane];
    const double incl = warp_inclusive_scan(wt, lane);
    const double excl = __shfl_up_sync(full_mask, incl, 1);
    const double target = target_of(__shfl_sync(full_mask, incl, 31));
    const unsigned cross = __ballot_sync(full_mask, incl > target);
    const unsigned positive = __ballot_sync(full_mask, wt > 0.0);
    const int w = cross ? __ffs(cross) - 1 : positive ? 31 - __clz(positive) : -1;
    const double before = __shfl_sync(full_mask, lane == 0 ? 0.0 : excl, w < 0 ? 0 : w);
    if (lane == 0) sm.cross_warp = w, sm.cross_before = before, sm.cross_target = target;
  }
  __syncthreads();
  const int w = sm.cross_warp;
  if (w >= 0 && warp == w) {
    double cum = sm.cross_before;
    const double target = sm.cross_target;
    int found = -1, last_positive = -1;
    for (int i0 = begin; i0 < end && found < 0; i0 += 32) {
      const int i = i0 + lane;
      const double x = i < end ? weight(i) : 0.0;
      const double incl = warp_inclusive_scan(x, lane);
      const unsigned hit = __ballot_sync(full_mask, cum + incl > target);
      const unsigned positive = __ballot_sync(full_mask, x > 0.0);
      if (positive) last_positive = i0 + 31 - __clz(positive);
      if (hit) found = i0 + __ffs(hit) - 1;
      cum += __shfl_sync(full_mask, incl, 31);
    }
    if (lane == 0) sm.result = found >= 0 ? found : last_positive;
  }
  __syncthreads();
  return w < 0 ? -1 : sm.result;
}

/// The index of the m-th (1-based) token in id order with key == v among in_set.
template <class InSet>
__device__ int nth_tie(const float* l, int n, uint32_t v, const InSet& in_set, unsigned m, row_smem& sm) {
  const auto tie = [=](int i) {
    const float x = l[i];
    const uint32_t key = order_key(x);
    return !isnan(x) && key == v && in_set(i, key) ? 1.0 : 0.0;
  };
  return first_crossing(n, tie, [m](double) { return double(m) - 0.5; }, sm);
}

__global__ void __launch_bounds__(sample_threads)
    sample_kernel(float* logits, int n, const sample_row_params* params, const int32_t* history,
                  const int32_t* hist_start, int32_t* counts, int32_t* out_tokens) {
  TROUPE_SHARED(row_smem, sm);
  const int r = blockIdx.x;
  float* l = logits + int64_t(r) * n;
  const sample_row_params p = params[r];

  if (history && hist_start &&
      (p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f))
    apply_penalties(l, n, p, history + hist_start[r], hist_start[r + 1] - hist_start[r], counts + int64_t(r) * n);

  float l_max;
  int argmax;
  block_argmax(l, n, sm, l_max, argmax);
  const int k = p.top_k > 0 && p.top_k < n ? p.top_k : 0;
  int token;
  if (argmax == INT_MAX) {
    token = 0;  // every logit is NaN
  } else if (p.temperature <= 0.0f || k == 1) {
    token = argmax;
  } else if (l_max == -INFINITY) {
    token = 0;  // nothing finite to draw from (as the CPU sampler)
  } else {
    // Top-k boundary (v_k, id_k): the k-th token in the ranking.
    uint32_t v_k = 0;
    int id_k = INT_MAX;
    if (k > 0) {
      const auto any = [](int, uint32_t) { return true; };
      radix_select<false>(l, n, l_max, any, [k](unsigned long long total) { return min(total, (unsigned long long)k); }, sm);
      v_k = sm.prefix;
      const auto need = unsigned(sm.target - sm.above), ties = sm.at_count;
      if (need < ties) id_k = nth_tie(l, n, v_k, any, need, sm);
    }
    const auto in_k = [=](int i, uint32_t key) { return key > v_k || (key == v_k && i <= id_k); };

    // Top-p boundary within the top-k set: the first token at which the mass reaches p * total.
    uint32_t v_p = 0;
    int id_p = INT_MAX;
    if (p.top_p < 1.0f) {
      const float top_p = p.top_p;
      radix_select<true>(l, n, l_max, in_k, [top_p](unsigned long long total) {
        const double t = ceil(double(top_p) * double(total));
        return t < 1.0 ? 1ull : (unsigned long long)t;
      }, sm);
      v_p = sm.prefix;
      const unsigned long long need = sm.target - sm.above, w_tie = sm.at_mass / sm.at_count;
      const unsigned long long m = (need + w_tie - 1) / w_tie;  // ties needed to reach the target
      if (m < sm.at_count) id_p = nth_tie(l, n, v_p, in_k, unsigned(m), sm);
    }

    const float min_logit = p.min_p > 0.0f ? l_max + logf(p.min_p) : -INFINITY;
    const float inv_t = 1.0f / p.temperature;
    const auto weight = [=](int i) {
      const float x = l[i];
      const uint32_t key = order_key(x);
      const bool kept = !isnan(x) && x >= min_logit && in_k(i, key) && (key > v_p || (key == v_p && i <= id_p));
      return kept ? double(expf((x - l_max) * inv_t)) : 0.0;
    };
    const double u = unit_draw(p.seed, p.draw);
    token = first_crossing(n, weight, [u](double total) { return u * total; }, sm);
    if (token < 0) token = argmax;  // unreachable: the maximum always survives with weight 1
  }
  if (threadIdx.x == 0) out_tokens[r] = token;
}

}  // namespace

size_t sample_scratch_bytes(int n_rows, int n_vocab) {
  return size_t(n_rows > 0 ? n_rows : 0) * size_t(n_vocab > 0 ? n_vocab : 0) * sizeof(int32_t);
}

void sample_tokens(float* logits, int n_rows, int n_vocab, const sample_row_params* params, const int32_t* history,
                   const int32_t* hist_start, void* scratch, int32_t* out_tokens, cudaStream_t stream) {
  if (n_rows <= 0) return;
  if (n_vocab <= 0) throw cuda_error("sample_tokens: n_vocab must be positive");
  if (history && hist_start && !scratch) throw cuda_error("sample_tokens: penalty histories need scratch");
  launch_ordinary(sample_kernel, n_rows, sample_threads, 0, stream, logits, n_vocab, params, history, hist_start,
                  static_cast<int32_t*>(scratch), out_tokens);
  check_launch("sample_tokens");
}

}  // namespace troupe::kernels::cuda
