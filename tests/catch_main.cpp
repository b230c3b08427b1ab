#define CATCH_CONFIG_MAIN
#ifndef CATCH_CONFIG_ENABLE_BENCHMARKING  // the test targets define it too
#define CATCH_CONFIG_ENABLE_BENCHMARKING
#endif
#include <catch2/catch.hpp>
