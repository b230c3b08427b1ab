// The supervisor: spawns the executor, monitors it, and restarts it when it dies, handing each
// new one to the scheduler (which requeues the lost sequences for recompute). More than
// max_restarts deaths within window_s open the circuit: the scheduler fails what it holds and
// refuses new work, and readiness turns false.
//
// Start: the first executor that cannot build its backend (weights, KV pools: out of memory, no
// such device) is not restarted — the same configuration would fail the same way. Its error
// answers `ready` (engine_handle::start waits on it) and opens the circuit. Once an executor
// has been up, a death is restarted as above, and the circuit's reason names the first error of
// the window (the cause: a device fault, say) and the last (what restarting then met). Each death
// is logged to stderr.
//
// A lost device: an executor that dies of a failure that lost its device's context (a sticky CUDA
// error: an illegal address, a kernel exception) says so first (lost). No restart can help — every
// later CUDA call in the process fails the same way — so none is tried: the circuit opens at once
// for good, and on_device_lost tells the process (the server exits, or reports itself unhealthy).
#include <chrono>
#include <cstdio>
#include <deque>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "actors/runtime.hpp"

namespace troupe::actors {

caf::behavior supervisor_actor(caf::event_based_actor* self, caf::actor scheduler, executor_config cfg, int max_restarts,
                               double window_s, std::function<void(const std::string&)> on_device_lost) {
  struct state {
    caf::actor executor;
    std::deque<std::pair<std::chrono::steady_clock::time_point, std::string>> deaths;  // within the window
    bool ever_up = false;
    std::string start_error;  // the first executor's, when it never came up
    std::string device_lost;  // the sticky error its last executor reported before dying
    std::vector<caf::response_promise> ready_waiters;
  };
  auto st = std::make_shared<state>();
  auto spawn_executor = [=] {
    st->executor = self->spawn<caf::detached + caf::monitored>(executor_actor, cfg, caf::actor{self});
    self->send(scheduler, executor_atom::value, st->executor);
  };
  auto answer_waiters = [=] {
    for (auto& rp : st->ready_waiters) {
      if (st->ever_up)
        rp.deliver(true);
      else
        rp.deliver(caf::make_error(caf::sec::runtime_error, st->start_error));
    }
    st->ready_waiters.clear();
  };
  self->set_down_handler([=](caf::down_msg& dm) {
    if (!st->executor || dm.source != st->executor.address()) return;
    st->executor = nullptr;
    const std::string why = exit_text(self->system(), dm.reason);
    if (!st->ever_up) {
      st->start_error = "the executor could not start: " + why;
      answer_waiters();
      self->send<caf::message_priority::high>(scheduler, circuit_atom::value, st->start_error, false);
      return;
    }
    if (!st->device_lost.empty()) {
      const std::string reason = "its device is lost: " + why + " (" + st->device_lost + "; only a new process can use the device)";
      std::fprintf(stderr, "troupe: executor failed: %s; its device is lost (%s): not restarted, the process must be restarted\n",
                   why.c_str(), st->device_lost.c_str());
      self->send<caf::message_priority::high>(scheduler, circuit_atom::value, reason, true);
      if (on_device_lost) on_device_lost(reason);
      return;
    }
    const auto now = std::chrono::steady_clock::now();
    st->deaths.emplace_back(now, why);
    while (!st->deaths.empty() && std::chrono::duration<double>(now - st->deaths.front().first).count() > window_s)
      st->deaths.pop_front();
    const int n = int(st->deaths.size());
    if (n > max_restarts) {
      std::string reason = "its executor failed " + std::to_string(n) + " times in " + std::to_string((int)window_s) + " s (";
      if (n > 1 && st->deaths.front().second != why) reason += "first: " + st->deaths.front().second + "; ";
      reason += "last: " + why + ")";
      std::fprintf(stderr, "troupe: executor failed: %s; not restarted: the model is unavailable\n", why.c_str());
      self->send<caf::message_priority::high>(scheduler, circuit_atom::value, reason, false);
      return;
    }
    std::fprintf(stderr, "troupe: executor failed: %s; restarting it (%d of %d restarts in %d s)\n", why.c_str(), n, max_restarts,
                 (int)window_s);
    spawn_executor();
  });
  self->set_exit_handler([=](caf::exit_msg& em) {
    if (st->executor) self->send_exit(st->executor, em.reason);
    self->quit(em.reason);
  });
  spawn_executor();
  return {
      [=](lost_atom, const std::string& why) { st->device_lost = why; },
      [=](up_atom) {
        st->ever_up = true;
        answer_waiters();
      },
      [=](ready_atom) -> caf::result<bool> {
        if (st->ever_up) return true;
        if (!st->start_error.empty()) return caf::make_error(caf::sec::runtime_error, st->start_error);
        st->ready_waiters.push_back(self->make_response_promise());
        return st->ready_waiters.back();
      },
  };
}

}  // namespace troupe::actors
