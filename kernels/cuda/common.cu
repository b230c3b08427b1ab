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

std::string sticky_error() {
  // A plain error is reset by the read; a sticky one is the result of every call after it, this
  // read included. The query makes sure an error the device raised since the last call is seen.
  cudaGetLastError();
  cudaError_t e = cudaStreamQuery(nullptr);
  if (e == cudaErrorNotReady) e = cudaSuccess;  // work in flight on the device: not a fault
  if (e == cudaSuccess) e = cudaGetLastError();
  if (e == cudaSuccess || cudaGetLastError() != e) return {};  // not there again: not sticky
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

}  // namespace troupe::kernels::cuda
