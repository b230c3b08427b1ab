#include "config/engine_config.hpp"

#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <thread>

namespace troupe::config {

std::string validate(const engine_config& c) {
  if (c.n_threads < 0 || c.n_threads > 1024) return "--threads must be in [0, 1024] (0: automatic), got " + std::to_string(c.n_threads);
  if (c.n_ctx < 0 || c.n_ctx > (1 << 20)) return "--ctx-size must be in [0, 1048576] (0: the model's), got " + std::to_string(c.n_ctx);
  if (c.kv_block_size < 1 || c.kv_block_size > 1024 || (c.kv_block_size & (c.kv_block_size - 1)))
    return "--kv-block-size must be a power of two in [1, 1024], got " + std::to_string(c.kv_block_size);
  if (c.n_batch < 1 || c.n_batch > 65536) return "--batch-size must be in [1, 65536], got " + std::to_string(c.n_batch);
  if (c.tensor_parallel < 1 || c.tensor_parallel > 64)
    return "--tensor-parallel must be in [1, 64], got " + std::to_string(c.tensor_parallel);
  if (c.pipeline_parallel < 1 || c.pipeline_parallel > 64)
    return "--pipeline-parallel must be in [1, 64], got " + std::to_string(c.pipeline_parallel);
  if (c.expert_parallel < 1 || c.expert_parallel > 64)
    return "--expert-parallel must be in [1, 64], got " + std::to_string(c.expert_parallel);
  if (c.expert_parallel > 1 && (c.tensor_parallel > 1 || c.pipeline_parallel > 1))
    return "--expert-parallel cannot be combined with --tensor-parallel or --pipeline-parallel yet";
  if (c.tensor_parallel * c.pipeline_parallel > 64)
    return "--tensor-parallel x --pipeline-parallel must be at most 64 workers, got " + std::to_string(c.tensor_parallel * c.pipeline_parallel);
  if (c.max_kv_bytes < (1 << 20)) return "--max-kv-bytes must be at least 1 MiB";
  if (c.load_format != "auto" && c.load_format != "dummy")
    return "--load-format must be \"auto\" or \"dummy\", got \"" + c.load_format + "\"";
  if (c.dummy_seed < 0) return "--dummy-seed must be >= 0, got " + std::to_string(c.dummy_seed);
  try {
    parse_device(c.device);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return {};
}

int parse_device(const std::string& device) {
  if (device == "cpu") return -1;
  if (device == "cuda") return 0;
  if (device.rfind("cuda:", 0) == 0 && device.size() > 5 && device.size() <= 8 &&
      device.find_first_not_of("0123456789", 5) == std::string::npos)
    return std::stoi(device.substr(5));
  throw std::invalid_argument("--device must be \"cpu\", \"cuda\" or \"cuda:N\", got \"" + device + "\"");
}

int default_threads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n ? (int)n : 1;
}

std::string default_model_path() {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (const char* env = std::getenv("TROUPE_MODEL"); env && *env) return env;
  const fs::path candidate = fs::path(TROUPE_SOURCE_DIR) / "models" / "default.gguf";
  if (fs::exists(candidate, ec)) return candidate.string();
  return {};
}

}  // namespace troupe::config
