// The work items of the CUDA RoPE kernels (kernels/cuda/qkv_items.hpp: rope_qkv_store and the
// qkv GEMV that applies RoPE) against the CPU's rope_row: every value of a fused QKV row belongs
// to exactly one item, and the items pair the columns RoPE rotates together. Runs without a GPU.
#include <catch2/catch.hpp>

#include <vector>

#include "kernels/cuda/qkv_items.hpp"
#include "kernels/ops.hpp"

namespace kc = troupe::kernels::cuda;
using troupe::kernels::rope_row;
using troupe::kernels::rope_style;

TEST_CASE("qkv_item covers the fused QKV row once and pairs columns as rope_row rotates them", "[rope]") {
  struct shape {
    int n_heads, n_kv, head_dim, n_rot;
  };
  for (const shape sh : {shape{6, 2, 64, 64}, shape{6, 2, 128, 64}, shape{9, 3, 64, 64}, shape{32, 8, 128, 128},
                         shape{4, 4, 8, 4}, shape{2, 1, 6, 2}, shape{3, 1, 16, 0}})
    for (const bool neox : {false, true}) {
      INFO("n_heads " << sh.n_heads << " n_kv " << sh.n_kv << " head_dim " << sh.head_dim << " n_rot " << sh.n_rot
                      << " neox " << neox);
      const int hd = sh.head_dim, q_dim = sh.n_heads * hd, kv_dim = sh.n_kv * hd, row = q_dim + 2 * kv_dim;
      const int n_items = kc::qkv_item_count(sh.n_heads, sh.n_kv, hd);
      REQUIRE(2 * n_items == row);

      // A quarter turn (cos 0, sin 1) through the CPU reference: y[a] = -x[b], y[b] = x[a].
      std::vector<float> x(static_cast<size_t>(row)), cos_sin(static_cast<size_t>(sh.n_rot));
      for (int i = 0; i < row; ++i) x[static_cast<size_t>(i)] = float(i + 1);
      for (int i = 0; i < sh.n_rot / 2; ++i) cos_sin[static_cast<size_t>(2 * i)] = 0.0f, cos_sin[static_cast<size_t>(2 * i + 1)] = 1.0f;
      std::vector<float> y = x;
      const rope_style style = neox ? rope_style::neox : rope_style::normal;
      rope_row(y.data(), sh.n_heads, hd, sh.n_rot, cos_sin.data(), style);
      rope_row(y.data() + q_dim, sh.n_kv, hd, sh.n_rot, cos_sin.data(), style);

      std::vector<int> uses(static_cast<size_t>(row), 0);
      for (int p = 0; p < n_items; ++p) {
        const kc::qkv_item it(sh.n_heads, sh.n_kv, hd, sh.n_rot, neox, p);
        const auto ra = static_cast<size_t>(it.row(sh.n_heads, sh.n_kv, hd, false));
        const auto rb = static_cast<size_t>(it.row(sh.n_heads, sh.n_kv, hd, true));
        REQUIRE(rb < uses.size());
        ++uses[ra], ++uses[rb];
        INFO("item " << p << " head " << it.h << " j " << it.j << " rows " << ra << ", " << rb);
        CHECK(it.a < it.b);
        CHECK(it.b < (it.h >= 0 ? hd : kv_dim));  // within the head, or within V
        if (it.h >= 0 && it.j < sh.n_rot / 2) {  // a rotated pair
          CHECK(y[ra] == -x[rb]);
          CHECK(y[rb] == x[ra]);
        } else {  // V, or past n_rot: untouched
          CHECK(y[ra] == x[ra]);
          CHECK(y[rb] == x[rb]);
        }
      }
      for (int i = 0; i < row; ++i) {
        INFO("row " << i);
        CHECK(uses[static_cast<size_t>(i)] == 1);
      }
    }
}
