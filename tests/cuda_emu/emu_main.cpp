// Entry point of troupe_cuda_emu_tests: the kernels/cuda tests, run on the CPU through the
// emulation in cuda_emu.cpp (no device needed, so no skip). See cuda_emu.hpp for what it checks.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

int main(int argc, char* argv[]) { return Catch::Session().run(argc, argv); }
