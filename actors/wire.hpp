// Internal to actors/: the messages that cross between processes, made serializable for CAF's
// middleman (data-parallel replicas, docs/architecture.md "Beyond one machine"). A front server's
// request actor talks to a replica's scheduler with exactly the mail it uses in-process:
//
//   request  --submit(request_msg)-->             scheduler   replies admission
//   request  --[h] cancel(seq)-->                 scheduler
//   request  --[h] priority(seq, cls, p)-->       scheduler
//   scheduler --token(seq, token_event)-->        request
//   scheduler --finished(seq, finish_reason, n)--> request
//   scheduler --failed(seq, gen_error, text)-->   request
//   router   --info-->                            scheduler   replies the model's fingerprint
//
// Every type named here is registered under the same name in every process (add_wire_types),
// or remote_actor fails with unexpected_actor_messaging_interface.
#pragma once

#include <caf/all.hpp>

#include <memory>
#include <string>

#include "actors/engine_handle.hpp"
#include "actors/scheduler_policy.hpp"
#include "engine/json_grammar.hpp"
#include "engine/sampling.hpp"

namespace troupe::engine {

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, json_node::property& x) {
  return f(caf::meta::type_name("json_property"), x.key, x.value, x.required);
}

// A grammar node without its tries and pattern automaton (finalize() rebuilds them on arrival).
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, json_node& x) {
  return f(caf::meta::type_name("json_node"), x.k, x.properties, x.additional, x.items, x.min_items, x.max_items, x.min_length,
           x.max_length, x.pattern, x.integer, x.literals, x.branches);
}

// sampling_params::grammar travels as its nodes, root and bare flag (root -1: no grammar).
struct grammar_wire {
  std::shared_ptr<const json_grammar>* g;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, grammar_wire& x) {
  std::vector<json_node> nodes;
  int32_t root = -1;
  bool bare = false;
  if constexpr (Inspector::reads_state) {
    if (*x.g) {
      nodes = (*x.g)->nodes();
      root = (*x.g)->root();
      bare = (*x.g)->bare();
    }
    return f(caf::meta::type_name("json_grammar"), nodes, root, bare);
  } else {
    auto&& r = f(caf::meta::type_name("json_grammar"), nodes, root, bare);
    x.g->reset();
    if (root >= 0) {
      auto g = std::make_shared<json_grammar>(std::move(nodes), root, bare);
      // The sender finalized the same nodes; should they not check out here (a corrupt message),
      // the constraint falls back to json_object's grammar rather than run unchecked.
      if (g->finalize().empty()) *x.g = std::move(g);
      else *x.g = json_grammar::any_object();
    }
    return r;
  }
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sampling_params& x) {
  grammar_wire g{&x.grammar};
  return f(caf::meta::type_name("sampling_params"), x.temperature, x.top_k, x.top_p, x.min_p, x.repetition_penalty,
           x.presence_penalty, x.frequency_penalty, x.penalty_last_n, x.seed, x.has_seed, x.top_logprobs, x.logprobs,
           x.stop_tokens, x.stop, x.ignore_eos, g);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, token_logprob& x) {
  return f(caf::meta::type_name("token_logprob"), x.token, x.logprob);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, sample_result& x) {
  return f(caf::meta::type_name("sample_result"), x.token, x.logprob, x.top);
}

}  // namespace troupe::engine

namespace troupe::actors {

using info_atom = caf::atom_constant<caf::atom("info")>;

/// What a request actor submits: the scheduler's spec plus what the executor needs to sample.
/// `sampling` is shared with the steps that sample this sequence (never null once submitted).
struct request_msg {
  request_spec spec;
  std::shared_ptr<const engine::sampling_params> sampling;
  std::vector<engine::token_id> stop_tokens;  // end-of-generation ids (empty with ignore_eos) + the request's
};

struct token_event {
  engine::sample_result r;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, request_spec& x) {
  return f(caf::meta::type_name("request_spec"), x.id, x.prompt, x.max_tokens, x.cls, x.priority, x.queue_timeout_s);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, admission& x) {
  return f(caf::meta::type_name("admission"), x.error, x.message);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, token_event& x) {
  return f(caf::meta::type_name("token_event"), x.r);
}

// The sampling parameters travel by value; the receiving side shares them again.
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, request_msg& x) {
  if constexpr (Inspector::reads_state) {
    engine::sampling_params p = x.sampling ? *x.sampling : engine::sampling_params{};
    return f(caf::meta::type_name("request_msg"), x.spec, p, x.stop_tokens);
  } else {
    engine::sampling_params p;
    auto&& r = f(caf::meta::type_name("request_msg"), x.spec, p, x.stop_tokens);
    x.sampling = std::make_shared<const engine::sampling_params>(std::move(p));
    return r;
  }
}

/// Registers every type above (and the enums the mail carries) under its wire name.
void add_wire_types(caf::actor_system_config& cfg);

/// Identifies what a scheduler serves: architecture, shapes, the vocabulary and a sample of the
/// weights. A front routes to a replica only when the fingerprints are equal, so a replica
/// serving another model (or another fine-tune of it) is never mixed in.
std::string model_fingerprint(const engine::model& m);

}  // namespace troupe::actors
