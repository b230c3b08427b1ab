// The supervisor: spawns the executor, monitors it, and restarts it when it dies, handing each
// new one to the scheduler (which requeues the lost sequences for recompute). More than
// max_restarts deaths within window_s open the circuit: the scheduler fails what it holds and
// refuses new work, and readiness turns false. circuit_reset_s later the circuit is half open: a
// new executor is started (the scheduler still refuses work), and the circuit closes once it is
// up. The deaths stay counted for their window, so one more failure soon after opens it again at
// once. Each half-open try that fails doubles the wait before the next (up to 16 x circuit_reset_s;
// a start may upload gigabytes of weights), and a close sets it back: a fault that persists costs
// a start every few minutes, a passing one (memory another process held, a device reset) heals.
//
// Start: the first executor that cannot build its backend (weights, KV pools: out of memory, no
// such device) is not restarted — the same configuration would fail the same way. Its error
// answers `ready` (engine_handle::start waits on it) and opens the circuit. Once an executor
// has been up, a death is restarted as above, and the circuit's reason names the first error of
// the window (the cause: a device fault, say) and the last (what restarting then met). Each death
// is logged to stderr.
//
// A lost device: an executor that dies of a failure that lost its device's context (a sticky CUDA
// error: an illegal address, a kernel exception; or a wait for the device that timed out) says so
// as it fails (lost), and is given up then, without waiting for its end: tearing down its device
// state may itself wait forever (freeing memory a hung kernel uses). No restart can help — every
// later CUDA call in the process fails the same way — so none is tried: the circuit opens at once
// for good, and on_device_lost tells the process (the server exits, or reports itself unhealthy).
//
// A wedged executor: the scheduler tells the executor to stop when a step fails or outlasts
// step_timeout_s, and tells the supervisor (stuck). A hung kernel or a deadlock keeps the
// executor's thread inside the step, where no message reaches it; one that has not stopped
// within stop_timeout_s is given up like a lost device (its thread and device cannot be had back).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "actors/runtime.hpp"

namespace troupe::actors {

caf::behavior supervisor_actor(caf::event_based_actor* self, caf::actor scheduler, executor_config cfg, supervision sv) {
  struct state {
    caf::actor executor;
    std::deque<std::pair<std::chrono::steady_clock::time_point, std::string>> deaths;  // within the window
    bool ever_up = false;
    bool half_open = false;  // an executor started after the circuit opened: it closes the circuit once up
    double reset_s = 0;      // the wait before the next half-open try
    bool given_up = false;   // the device lost or the executor wedged: nothing is ever tried again
    std::string start_error;  // the first executor's, when it never came up
    caf::actor_addr stopping;  // the executor the scheduler stopped for a failed or timed-out step
    std::vector<caf::response_promise> ready_waiters;
  };
  auto st = std::make_shared<state>();
  st->reset_s = sv.circuit_reset_s;
  auto spawn_executor = [=] {
    st->executor = self->spawn<caf::detached + caf::monitored>(executor_actor, cfg, caf::actor{self});
    self->send(scheduler, executor_atom::value, st->executor);
  };
  // No restart can help: the circuit opens for good and the process is told.
  auto give_up = [=](const std::string& reason) {
    st->given_up = true;
    self->send<caf::message_priority::high>(scheduler, circuit_atom::value, reason, true);
    if (sv.on_device_lost) sv.on_device_lost(reason);
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
    std::string why = exit_text(self->system(), dm.reason);
    if (dm.source == st->stopping && dm.reason == caf::exit_reason::kill) {  // the scheduler stopped it
      char timed_out[96];
      std::snprintf(timed_out, sizeof timed_out, "a step took longer than %g s (stopped)", sv.step_timeout_s);
      why = timed_out;
    }
    if (!st->ever_up) {
      st->start_error = "the executor could not start: " + why;
      answer_waiters();
      self->send<caf::message_priority::high>(scheduler, circuit_atom::value, st->start_error, false);
      return;
    }
    const auto now = std::chrono::steady_clock::now();
    st->deaths.emplace_back(now, why);
    while (!st->deaths.empty() && std::chrono::duration<double>(now - st->deaths.front().first).count() > sv.window_s)
      st->deaths.pop_front();
    const int n = int(st->deaths.size());
    if (n > sv.max_restarts) {
      std::string reason = "its executor failed " + std::to_string(n) + " times in " + std::to_string((int)sv.window_s) + " s (";
      if (n > 1 && st->deaths.front().second != why) reason += "first: " + st->deaths.front().second + "; ";
      reason += "last: " + why + ")";
      self->send<caf::message_priority::high>(scheduler, circuit_atom::value, reason, false);
      if (sv.circuit_reset_s > 0) {
        if (st->half_open) st->reset_s = std::min(st->reset_s * 2, sv.circuit_reset_s * 16);  // a try that failed
        std::fprintf(stderr, "troupe: executor failed: %s; not restarted: the model is unavailable; a new executor in %g s\n",
                     why.c_str(), st->reset_s);
        self->delayed_send(self, std::chrono::milliseconds((int64_t)(st->reset_s * 1000)), probe_atom::value);
      } else {
        std::fprintf(stderr, "troupe: executor failed: %s; not restarted: the model is unavailable\n", why.c_str());
      }
      return;
    }
    std::fprintf(stderr, "troupe: executor failed: %s; restarting it (%d of %d restarts in %d s)\n", why.c_str(), n, sv.max_restarts,
                 (int)sv.window_s);
    spawn_executor();
  });
  self->set_exit_handler([=](caf::exit_msg& em) {
    if (st->executor) self->send_exit(st->executor, em.reason);
    self->quit(em.reason);
  });
  spawn_executor();
  return {
      [=](lost_atom, const std::string& why, const std::string& error) {
        if (!st->executor || caf::actor_cast<caf::actor_addr>(self->current_sender()) != st->executor.address()) return;
        self->demonitor(st->executor);
        st->executor = nullptr;
        // The failure, and the state of the device it left where that says more (a sticky error).
        const std::string lost = error.find(why) != std::string::npos ? error : why + " (" + error + ")";
        std::fprintf(stderr, "troupe: executor failed, its device is lost: %s: not restarted, the process must be restarted\n", lost.c_str());
        give_up("its device is lost: " + lost + "; only a new process can use the device");
      },
      [=](stuck_atom, const caf::actor_addr& executor) {
        if (!st->executor || st->executor.address() != executor) return;
        st->stopping = executor;
        self->delayed_send(self, std::chrono::milliseconds((int64_t)(sv.stop_timeout_s * 1000)), wedged_atom::value, executor);
      },
      [=](wedged_atom, const caf::actor_addr& executor) {
        if (!st->executor || st->executor.address() != executor) return;  // it stopped (and was handled) in time
        self->demonitor(st->executor);
        st->executor = nullptr;
        char limits[96];
        std::snprintf(limits, sizeof limits, "%g s, nor stopped within %g s", sv.step_timeout_s, sv.stop_timeout_s);
        const std::string reason = std::string("its executor is wedged: a step neither finished within ") + limits +
                                   " (a hung kernel or a deadlock); only a new process can use the device";
        std::fprintf(stderr, "troupe: %s: not restarted, the process must be restarted\n", reason.c_str());
        give_up(reason);
      },
      [=](up_atom) {
        st->ever_up = true;
        answer_waiters();
        if (st->half_open && st->executor && caf::actor_cast<caf::actor_addr>(self->current_sender()) == st->executor.address()) {
          st->half_open = false;
          st->reset_s = sv.circuit_reset_s;
          std::fprintf(stderr, "troupe: a new executor is up: the circuit is closed, requests are served again\n");
          self->send(scheduler, closed_atom::value);
        }
      },
      [=](probe_atom) {
        if (st->given_up || st->executor) return;
        std::fprintf(stderr, "troupe: the circuit is half open: starting a new executor\n");
        st->half_open = true;
        spawn_executor();
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
