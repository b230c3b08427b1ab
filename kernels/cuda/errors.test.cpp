// How the CUDA errors the executor meets are told apart (kernels::cuda::check, sticky_error): a
// plain failure leaves the device usable, a kernel fault loses the context for good, and the
// executor decides on that whether a restart can help (actors/supervisor_actor.cpp).
//
// The fault case is hidden ([.sticky]): it ruins its process's CUDA context, so it runs alone,
// named (scripts/gpu-check's "sticky" stage on a device, ctest's cuda_emu.sticky_error here).
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/test_util.hpp"

using namespace troupe::kernels::cuda;
using namespace troupe::kernels::cuda::test;

namespace {

// embed_rows of a 4 x 8 table: each of 3 rows gets its token's row, as floats.
bool embed_works() {
  std::vector<float> table(32);
  for (size_t i = 0; i < table.size(); ++i) table[i] = float(i);  // exact in bf16
  const std::vector<int32_t> tokens{3, 0, 2};
  const dev_buf<bf16> d_table(to_bf16(table));
  const dev_buf<int32_t> d_tokens(tokens);
  dev_buf<float> d_out(3 * 8);
  d_out.poison();
  embed_rows(d_table.p, d_tokens.p, d_out.p, 3, 8, nullptr);
  check_launch("embed_rows");
  const std::vector<float> out = d_out.download();
  for (size_t r = 0; r < 3; ++r)
    for (size_t c = 0; c < 8; ++c)
      if (out[r * 8 + c] != table[size_t(tokens[r]) * 8 + c]) return false;
  return true;
}

}  // namespace

TEST_CASE("a plain CUDA failure is not sticky: the device keeps working", "[cuda]") {
  REQUIRE(embed_works());
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, size_t{1} << 50);  // 1 PiB: refused, and nothing else changes
  REQUIRE(e != cudaSuccess);
  CHECK_THROWS_AS(check(e, "cudaMalloc of 1 PiB"), cuda_error);
  CHECK(sticky_error().empty());
  CHECK(embed_works());
  CHECK(sticky_error().empty());
}

TEST_CASE("a kernel fault is sticky: sticky_error names it and every later call fails", "[.sticky]") {
  REQUIRE(sticky_error().empty());
  std::vector<float> table(32, 1.0f);
  const dev_buf<bf16> d_table(to_bf16(table));
  const dev_buf<int32_t> d_tokens(std::vector<int32_t>{1});
#ifdef TROUPE_CUDA_EMU
  // The emulation runs kernels on the host, where a wild store would crash the test: it injects
  // the fault an illegal address raises instead (TROUPE_EMU_FAULT_FILE, read at the first launch).
  const std::string fault = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/troupe_sticky_fault";
  std::FILE* f = std::fopen(fault.c_str(), "w");
  REQUIRE(f);
  std::fclose(f);
  REQUIRE(::setenv("TROUPE_EMU_FAULT_FILE", fault.c_str(), 1) == 0);
  dev_buf<float> d_out(8);
  float* out = d_out.p;
#else
  float* out = reinterpret_cast<float*>(uintptr_t{16});  // no allocation there: an illegal address
#endif
  // The device reports the fault when the kernel runs (at the synchronize); the emulation's
  // injected one fails the launch itself, which embed_rows' check_launch throws.
  std::string launch_error = "none";
  try {
    embed_rows(d_table.p, d_tokens.p, out, 1, 8, nullptr);
  } catch (const cuda_error& e) {
    launch_error = e.what();
  }
  const cudaError_t synced = cudaDeviceSynchronize();
  INFO("launch error: " << launch_error << "; synchronize: " << cudaGetErrorName(synced));
  CHECK(synced == cudaErrorIllegalAddress);
  CHECK((launch_error == "none" || launch_error == "embed_rows: an illegal memory access was encountered"));
  const std::string lost = sticky_error();
  CHECK(lost.rfind("cudaErrorIllegalAddress: ", 0) == 0);
  CHECK(sticky_error() == lost);  // asking again changes nothing
  void* p = nullptr;
  CHECK(cudaMalloc(&p, 256) == cudaErrorIllegalAddress);  // nor does any later call succeed
  CHECK_THROWS_AS(embed_works(), cuda_error);
}
