// Where each value of a fused QKV row goes in RoPE: the work items of rope_qkv_store and of the
// qkv GEMV that applies RoPE itself (gemv_bf16_rope_qkv). Plain C++ (no CUDA header), so the host
// tests check the pairing against the CPU's kernels::rope_row (tests/qkv_items.test.cpp).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TROUPE_HOST_DEVICE __host__ __device__
#else
#define TROUPE_HOST_DEVICE
#endif

namespace troupe::kernels::cuda {

/// Head columns a, b of work item j (< head_dim / 2): RoPE's pair for j < n_rot / 2 (adjacent
/// dims, or n_rot / 2 apart for neox), else two unrotated dims of [n_rot, head_dim).
TROUPE_HOST_DEVICE inline void rope_pair_cols(int n_rot, bool neox, int j, int& a, int& b) {
  const int half_rot = n_rot / 2;
  a = j < half_rot ? (neox ? j : 2 * j) : n_rot + 2 * (j - half_rot);
  b = j < half_rot ? (neox ? j + half_rot : 2 * j + 1) : a + 1;
}

/// Work items of one token row: (n_heads + 2 n_kv_heads) * head_dim / 2.
TROUPE_HOST_DEVICE inline int qkv_item_count(int n_heads, int n_kv_heads, int head_dim) {
  return (n_heads + 2 * n_kv_heads) * head_dim / 2;
}

/// Work item p of a token row: item j of each Q and K head h (Q heads first; columns a, b of
/// rope_pair_cols), then V's columns two by two (h = -1, columns 2j and 2j + 1 of V).
struct qkv_item {
  int h, j, a, b;
  TROUPE_HOST_DEVICE qkv_item(int n_heads, int n_kv_heads, int head_dim, int n_rot, bool neox, int p) {
    const int half_hd = head_dim / 2, qk_items = (n_heads + n_kv_heads) * half_hd;
    if (p < qk_items) {
      h = p / half_hd, j = p % half_hd;
      rope_pair_cols(n_rot, neox, j, a, b);
    } else {
      h = -1, j = p - qk_items, a = 2 * j, b = a + 1;
    }
  }
  /// Index in the fused QKV row of column a (second: b).
  TROUPE_HOST_DEVICE int64_t row(int n_heads, int n_kv_heads, int head_dim, bool second) const {
    const int q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim;
    return (h < 0 ? q_dim + kv_dim : h * head_dim) + (second ? b : a);
  }
};

}  // namespace troupe::kernels::cuda
