// The supervisor: spawns the executor, monitors it, and restarts it when it dies, handing each
// new one to the scheduler (which requeues the lost sequences for recompute). More than
// max_restarts deaths within window_s open the circuit: the scheduler fails what it holds and
// refuses new work, and readiness turns false.
#include <chrono>
#include <deque>

#include "actors/runtime.hpp"

namespace troupe::actors {

caf::behavior supervisor_actor(caf::event_based_actor* self, caf::actor scheduler, executor_config cfg, int max_restarts,
                               double window_s) {
  struct state {
    caf::actor executor;
    std::deque<std::chrono::steady_clock::time_point> deaths;
  };
  auto st = std::make_shared<state>();
  auto spawn_executor = [=] {
    st->executor = self->spawn<caf::detached + caf::monitored>(executor_actor, cfg);
    self->send(scheduler, executor_atom::value, st->executor);
  };
  self->set_down_handler([=](caf::down_msg& dm) {
    if (!st->executor || dm.source != st->executor.address()) return;
    st->executor = nullptr;
    const auto now = std::chrono::steady_clock::now();
    st->deaths.push_back(now);
    while (!st->deaths.empty() && std::chrono::duration<double>(now - st->deaths.front()).count() > window_s) st->deaths.pop_front();
    if ((int)st->deaths.size() > max_restarts) {
      self->send<caf::message_priority::high>(scheduler, circuit_atom::value);
      return;
    }
    spawn_executor();
  });
  self->set_exit_handler([=](caf::exit_msg& em) {
    if (st->executor) self->send_exit(st->executor, em.reason);
    self->quit(em.reason);
  });
  spawn_executor();
  return {
      [](tick_atom) {},  // no client mail: everything arrives as down and exit messages
  };
}

}  // namespace troupe::actors
