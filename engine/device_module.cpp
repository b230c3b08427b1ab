#include "engine/device_module.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <stdexcept>

namespace troupe::engine {

namespace {

struct loaded_module {
  cuda_module_device_count_fn device_count = nullptr;
  cuda_module_open_fn open = nullptr;
  cuda_module_copy_bandwidth_fn copy_bandwidth = nullptr;
  std::string error;  // why it could not be loaded (then the functions are null)
};

std::string exe_dir() {
  std::error_code ec;
  const auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : p.parent_path().string();
}

// Loaded once per process and never unloaded (its objects may live until exit).
const loaded_module& module() {
  static loaded_module m;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string path = cuda_module_path();
    if (path.empty()) {
      m.error = "this build has no CUDA backend (libtroupe_cuda.so was not built: nvcc was not found when it was configured): use the CPU";
      return;
    }
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      m.error = "the CUDA backend " + path + " cannot be loaded (" + (e ? e : "unknown error") + "): use the CPU";
      return;
    }
    const auto abi = (cuda_module_abi_fn)dlsym(h, "troupe_cuda_module_abi");
    m.device_count = (cuda_module_device_count_fn)dlsym(h, "troupe_cuda_module_device_count");
    m.open = (cuda_module_open_fn)dlsym(h, "troupe_cuda_module_open");
    m.copy_bandwidth = (cuda_module_copy_bandwidth_fn)dlsym(h, "troupe_cuda_module_copy_bandwidth");
    if (!abi || !m.device_count || !m.open || !m.copy_bandwidth || abi() != cuda_module_abi) {
      m.device_count = nullptr;
      m.open = nullptr;
      m.copy_bandwidth = nullptr;
      m.error = "the CUDA backend " + path + " is from another build (entry points or version differ): rebuild";
    }
  });
  return m;
}

const loaded_module& loaded() {
  const loaded_module& m = module();
  if (!m.open) throw std::runtime_error(m.error);
  return m;
}

}  // namespace

std::string cuda_module_path() {
  if (const char* env = std::getenv("TROUPE_CUDA_MODULE"); env && *env) return env;
  const std::string beside = exe_dir() + "/libtroupe_cuda.so";
  if (access(beside.c_str(), R_OK) == 0) return beside;
#ifdef TROUPE_CUDA_MODULE_BUILT
  if (access(TROUPE_CUDA_MODULE_BUILT, R_OK) == 0) return TROUPE_CUDA_MODULE_BUILT;
#endif
  return {};
}

int cuda_device_count() { return loaded().device_count(); }

std::unique_ptr<device_forward> open_cuda_forward(const model& m, const device_forward_options& o) {
  return std::unique_ptr<device_forward>(loaded().open(&m, &o));
}

double cuda_copy_bandwidth(int device, size_t bytes, int reps) { return loaded().copy_bandwidth(device, bytes, reps); }

}  // namespace troupe::engine
