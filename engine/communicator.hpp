// Collective operations between the ranks of a tensor-parallel group, the interface NCCL gives
// GPUs. Every rank calls the same operations in the same order, each from its own thread.
//
//   local_group g(4);                 // four ranks of one process
//   // on rank r's thread:
//   g.rank(r).all_reduce_sum(x, n);   // x: the element-wise sum over the ranks, the same bits on each
//
// The in-process group is how the sharding logic runs and is tested on a CPU: ranks are threads
// sharing memory. Every wait has a limit; a rank that fails calls abort(), which makes the others'
// waits throw rather than hang.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace troupe::engine {

/// A collective that could not complete: a rank did not arrive in time or the group was aborted.
class collective_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class communicator {
 public:
  virtual ~communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// data[i] <- sum over ranks of their data[i], summed in rank order: every rank gets the same
  /// bits. Throws collective_error.
  virtual void all_reduce_sum(float* data, size_t n) = 0;
};

/// N ranks in one process (threads), reducing through shared memory: each rank sums its slice of
/// the vector over all ranks (reduce-scatter), then every rank copies the whole sum (all-gather).
class local_group {
 public:
  explicit local_group(int n_ranks, std::chrono::milliseconds timeout = std::chrono::seconds(60));
  ~local_group();
  local_group(const local_group&) = delete;
  local_group& operator=(const local_group&) = delete;

  int size() const { return n_; }
  communicator& rank(int r);
  /// Wakes every rank waiting in a collective with collective_error(why), and fails those after.
  void abort(const std::string& why);

 private:
  class member;
  friend class member;
  /// Waits until all ranks have arrived at this barrier (or throws).
  void barrier();

  int n_;
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::string aborted_;
  std::vector<float*> bufs_;   // each rank's vector in the collective under way
  std::vector<float> sum_;     // the reduced vector
  std::vector<std::unique_ptr<member>> members_;
};

}  // namespace troupe::engine
