// Error reporting and device discovery shared by every launcher.
#include <string>

#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/launch.cuh"

namespace troupe::kernels::cuda {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  // The runtime also records a failed call's error as the thread's last error. A sticky one (a
  // faulted context) stays whatever we do; a plain one (a bad device index, an invalid value)
  // would otherwise be reported again by the next check_launch, for a good launch: clear it.
  cudaGetLastError();
  throw cuda_error(std::string(what) + ": " + cudaGetErrorString(e));
}

void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

namespace {
thread_local bool pdl_on = false;
}

bool pdl_enabled() { return pdl_on; }

pdl_scope::pdl_scope(bool on) : previous_(pdl_on) { pdl_on = on; }
pdl_scope::~pdl_scope() { pdl_on = previous_; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it so a later check_launch does not report it
    return 0;
  }
  return n;
}

}  // namespace troupe::kernels::cuda
