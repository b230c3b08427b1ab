#include "actors/prefix_affinity.hpp"

#include <stdexcept>

namespace troupe::actors {

prefix_affinity::prefix_affinity(size_t capacity) : capacity_(capacity) {
  if (capacity < 1) throw std::invalid_argument("prefix affinity needs room for at least one prefix");
}

std::optional<std::pair<size_t, size_t>> prefix_affinity::find(std::span<const uint64_t> hashes,
                                                               const std::function<bool(size_t)>& usable) const {
  for (size_t k = hashes.size(); k-- > 0;) {
    auto it = map_.find(hashes[k]);
    if (it != map_.end() && usable(it->second.replica)) return std::pair{it->second.replica, k + 1};
  }
  return std::nullopt;
}

void prefix_affinity::record(std::span<const uint64_t> hashes, size_t replica) {
  for (uint64_t h : hashes) {
    auto it = map_.find(h);
    if (it != map_.end()) {
      it->second.replica = replica;
      order_.splice(order_.begin(), order_, it->second.pos);
      continue;
    }
    order_.push_front(h);
    map_.emplace(h, entry{replica, order_.begin()});
    if (map_.size() > capacity_) {
      map_.erase(order_.back());
      order_.pop_back();
    }
  }
}

void prefix_affinity::forget(size_t replica) {
  for (auto it = map_.begin(); it != map_.end();) {
    if (it->second.replica == replica) {
      order_.erase(it->second.pos);
      it = map_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace troupe::actors
