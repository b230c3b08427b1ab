#include "engine/communicator.hpp"

#include <algorithm>
#include <cstring>

namespace troupe::engine {

class local_group::member final : public communicator {
 public:
  member(local_group& g, int r) : g_(g), r_(r) {}
  int rank() const override { return r_; }
  int size() const override { return g_.n_; }

  void all_reduce_sum(float* data, size_t n) override {
    if (g_.n_ == 1) return;
    g_.bufs_[(size_t)r_] = data;
    if (r_ == 0 && g_.sum_.size() < n) g_.sum_.resize(n);  // before the barrier: nobody reads it yet
    g_.barrier();
    // Reduce-scatter: this rank's slice, summed over the ranks in rank order.
    const size_t lo = n * (size_t)r_ / (size_t)g_.n_, hi = n * (size_t)(r_ + 1) / (size_t)g_.n_;
    float* sum = g_.sum_.data();
    std::memcpy(sum + lo, g_.bufs_[0] + lo, (hi - lo) * sizeof(float));
    for (int k = 1; k < g_.n_; ++k) {
      const float* src = g_.bufs_[(size_t)k];
      for (size_t i = lo; i < hi; ++i) sum[i] += src[i];
    }
    g_.barrier();
    // All-gather: every rank takes the whole sum; the last barrier keeps the sum and the buffers
    // in place until all have copied.
    std::memcpy(data, sum, n * sizeof(float));
    g_.barrier();
  }

 private:
  local_group& g_;
  int r_;
};

local_group::local_group(int n_ranks, std::chrono::milliseconds timeout) : n_(n_ranks), timeout_(timeout) {
  if (n_ranks < 1) throw std::invalid_argument("a communicator group needs at least one rank");
  bufs_.resize((size_t)n_ranks);
  for (int r = 0; r < n_ranks; ++r) members_.push_back(std::make_unique<member>(*this, r));
}

local_group::~local_group() = default;

communicator& local_group::rank(int r) {
  if (r < 0 || r >= n_) throw std::out_of_range("no rank " + std::to_string(r) + " in a group of " + std::to_string(n_));
  return *members_[(size_t)r];
}

void local_group::abort(const std::string& why) {
  {
    std::lock_guard lk(mu_);
    if (aborted_.empty()) aborted_ = why.empty() ? "aborted" : why;
  }
  cv_.notify_all();
}

void local_group::barrier() {
  std::unique_lock lk(mu_);
  if (!aborted_.empty()) throw collective_error("tensor-parallel group aborted: " + aborted_);
  const uint64_t gen = generation_;
  if (++arrived_ == n_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  if (!cv_.wait_for(lk, timeout_, [&] { return generation_ != gen || !aborted_.empty(); })) {
    aborted_ = "a rank did not reach a collective within " + std::to_string(timeout_.count()) + " ms";
    cv_.notify_all();
  }
  if (generation_ == gen) throw collective_error("tensor-parallel group aborted: " + aborted_);
}

}  // namespace troupe::engine
