// `troupe bench --concurrency N`: closed-loop load through the actor runtime.
#pragma once

#include "config/engine_config.hpp"

namespace troupe::cli {

struct load_opts {
  config::engine_config engine;
  int concurrency = 0, requests = 0, prompt_len = 128, gen_len = 128;
  bool json = false;
  bool plan_ahead = true;  // pipelining: the scheduler plans decode step n+1 while n runs
  double target_itl_ms = 0;  // scheduler_config::target_itl_ms (0: off)
};

/// Runs the load and prints the figures; returns 0 when every request completed.
int run_load_bench(const load_opts& o);

}  // namespace troupe::cli
