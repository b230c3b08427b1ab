// Data-parallel replicas: the router that spreads generations over the local executor and the
// remote replicas, the keeper actor that connects the remote ones (CAF middleman) and keeps them
// connected, and the wire registration both ends share.
// CAF 0.17's deserializer of std::vector<enum> (registered with each enum) trips g++ 12's
// -Wmaybe-uninitialized inside its own header.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <caf/io/all.hpp>
#include <caf/openssl/manager.hpp>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>

#include "actors/runtime.hpp"
#include "engine/block_manager.hpp"

namespace troupe::actors {

void add_wire_types(caf::actor_system_config& cfg) {
  cfg.add_message_type<engine::sampling_params>("troupe.sampling_params");
  cfg.add_message_type<engine::token_logprob>("troupe.token_logprob");
  cfg.add_message_type<engine::sample_result>("troupe.sample_result");
  cfg.add_message_type<std::vector<engine::token_logprob>>("troupe.token_logprobs");
  cfg.add_message_type<request_spec>("troupe.request_spec");
  cfg.add_message_type<request_msg>("troupe.request_msg");
  cfg.add_message_type<admission>("troupe.admission");
  cfg.add_message_type<token_event>("troupe.token_event");
  cfg.add_message_type<finish_reason>("troupe.finish_reason");
  cfg.add_message_type<gen_error>("troupe.gen_error");
  cfg.add_message_type<priority_class>("troupe.priority_class");
  cfg.add_message_type<admit_error>("troupe.admit_error");
}

namespace {

struct fnv1a {
  uint64_t h = 1469598103934665603ULL;
  void add(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ULL;
  }
  void add(const std::string& s) { add(s.data(), s.size() + 1); }
  void add(int64_t v) { add(&v, sizeof v); }
  // The first bytes of a matrix's first row: different weights of the same shapes differ there.
  void add(const kernels::weight_view& w) {
    if (w.data) add(w.data, std::min<size_t>(w.row_stride, 256));
  }
};

}  // namespace

std::string model_fingerprint(const engine::model& m) {
  const auto& hp = m.hparams();
  fnv1a f;
  f.add(hp.arch);
  f.add(hp.name);
  for (int64_t v : {hp.n_layers, hp.d_model, hp.n_heads, hp.n_kv_heads, hp.head_dim, hp.d_ff, hp.n_vocab}) f.add(v);
  if (m.dummy()) f.add((int64_t)m.dummy_seed());  // random weights a device made: their seed names them
  const engine::tokenizer& tok = m.vocab();
  for (engine::token_id t = 0; t < tok.n_vocab(); ++t) f.add(tok.token_text(t));
  f.add(m.token_embd());
  f.add(m.output());
  for (int il = 0; il < hp.n_layers; ++il) {
    const auto& l = m.layer(il);
    for (const kernels::weight_view* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) f.add(*w);
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", (unsigned long long)f.h);
  std::ostringstream out;
  out << hp.arch << " '" << hp.name << "' " << hp.n_layers << " layers, d=" << hp.d_model << ", vocab " << hp.n_vocab
      << ", #" << hex;
  return out.str();
}

replica_endpoint parse_endpoint(const std::string& text) {
  const size_t colon = text.rfind(':');
  const auto bad = [&] { return std::invalid_argument("replica '" + text + "' is not HOST:PORT (a port in 1..65535)"); };
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) throw bad();
  const std::string port = text.substr(colon + 1);
  if (port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos) throw bad();
  const long p = std::stol(port);
  if (p < 1 || p > 65535) throw bad();
  return {0, text.substr(0, colon), (uint16_t)p};
}

// --- replica_router ------------------------------------------------------------------------------

replica_router::replica_router(caf::actor local, bool local_serves, routing_options opts) : opts_(opts), affinity_(opts.affinity_blocks) {
  if (local_serves) entries_.push_back({"local", std::move(local), "serving"});
  else entries_.push_back({"local", nullptr, "no local executor: a router only"});
}

bool replica_router::any_up() const {
  std::lock_guard lk(mu_);
  for (const entry& e : entries_)
    if (e.scheduler) return true;
  return false;
}

bool replica_router::wants_prefix() const {
  std::lock_guard lk(mu_);
  return opts_.prefix && entries_.size() > 1;
}

std::vector<uint64_t> replica_router::prefix_hashes(std::span<const engine::token_id> prompt) const {
  std::vector<uint64_t> out;
  const auto bs = (size_t)opts_.block_size;
  for (size_t b = 0; (b + 1) * bs <= prompt.size(); ++b)
    out.push_back(engine::kv_block_hash(out.empty() ? 0 : out.back(), prompt.subspan(b * bs, bs)));
  return out;
}

size_t replica_router::add_remote(std::string name) {
  std::lock_guard lk(mu_);
  entries_.push_back({std::move(name), nullptr, "connecting"});
  return entries_.size() - 1;
}

std::optional<replica_router::choice> replica_router::pick(const std::vector<size_t>& tried, std::span<const uint64_t> prefix) {
  std::lock_guard lk(mu_);
  const size_t n = entries_.size();
  auto usable = [&](size_t i) { return entries_[i].scheduler && std::find(tried.begin(), tried.end(), i) == tried.end(); };
  std::optional<size_t> least;
  // In turn from the one after the last pick, so equally loaded replicas share the work.
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (turn_ + k) % n;
    if (usable(i) && (!least || entries_[i].in_flight < entries_[*least].in_flight)) least = i;
  }
  if (!least) return std::nullopt;
  size_t chosen = *least;
  bool by_prefix = false;
  if (opts_.prefix && n > 1 && !prefix.empty()) {
    auto hit = affinity_.find(prefix, usable);
    if (hit && entries_[hit->first].in_flight <= entries_[*least].in_flight + opts_.max_imbalance) {
      chosen = hit->first;
      by_prefix = true;
    }
    affinity_.record(prefix, chosen);
  }
  entry& e = entries_[chosen];
  ++e.in_flight;
  ++e.routed;
  e.prefix_routed += by_prefix;
  if (!by_prefix) turn_ = chosen + 1;
  return choice{chosen, e.scheduler};
}

void replica_router::release(size_t index) {
  std::lock_guard lk(mu_);
  if (index < entries_.size() && entries_[index].in_flight > 0) --entries_[index].in_flight;
}

void replica_router::lost(size_t index) {
  std::lock_guard lk(mu_);
  if (index < entries_.size()) ++entries_[index].lost;
}

void replica_router::set_up(size_t index, caf::actor scheduler) {
  std::lock_guard lk(mu_);
  entries_.at(index).scheduler = std::move(scheduler);
  entries_.at(index).status = "serving";
}

void replica_router::set_down(size_t index, std::string status) {
  std::lock_guard lk(mu_);
  if (entries_.at(index).scheduler) affinity_.forget(index);
  entries_.at(index).scheduler = nullptr;
  entries_.at(index).status = std::move(status);
}

std::string replica_router::name(size_t index) const {
  std::lock_guard lk(mu_);
  return index < entries_.size() ? entries_[index].name : "?";
}

std::vector<replica_stats> replica_router::stats() const {
  std::lock_guard lk(mu_);
  std::vector<replica_stats> out;
  for (const entry& e : entries_) out.push_back({e.name, (bool)e.scheduler, e.status, e.in_flight, e.routed, e.lost, e.prefix_routed});
  return out;
}

// --- replica_keeper ------------------------------------------------------------------------------

namespace {

using retry_atom = caf::atom_constant<caf::atom("retry")>;

struct keeper_state {
  std::unordered_map<caf::actor_addr, size_t> connected;  // a monitored replica scheduler -> index
  std::vector<std::string> last_status;                    // logged once per change
};

}  // namespace

caf::behavior replica_keeper(caf::event_based_actor* self, std::shared_ptr<replica_router> router,
                             std::vector<replica_endpoint> endpoints, std::string fingerprint, double retry_s, double timeout_s,
                             bool tls) {
  auto st = std::make_shared<keeper_state>();
  st->last_status.resize(endpoints.size() + 1);
  const auto timeout = std::chrono::milliseconds((int64_t)(timeout_s * 1000));
  const auto retry = std::chrono::milliseconds((int64_t)(retry_s * 1000));
  // A replica that is not serving: say why (once per change of reason) and try again later.
  auto down = [=](size_t index, const std::string& status) {
    router->set_down(index, status);
    if (st->last_status[index] != status) {
      std::fprintf(stderr, "troupe: replica %s: %s; retrying every %.3g s\n", router->name(index).c_str(), status.c_str(), retry_s);
      st->last_status[index] = status;
    }
    self->delayed_send(self, retry, retry_atom::value, index);
  };
  self->set_down_handler([=](caf::down_msg& dm) {
    auto it = st->connected.find(dm.source);
    if (it == st->connected.end()) return;
    const size_t index = it->second;
    st->connected.erase(it);
    down(index, "lost: " + self->system().render(dm.reason));
  });
  for (const replica_endpoint& e : endpoints) self->send(self, retry_atom::value, e.index);
  return {
      [=](retry_atom, size_t index) {
        const replica_endpoint* ep = nullptr;
        for (const auto& e : endpoints) ep = e.index == index ? &e : ep;
        if (!ep) return;
        auto mm = tls ? self->system().openssl_manager().actor_handle() : self->system().middleman().actor_handle();
        self->request(mm, timeout, caf::connect_atom::value, ep->host, ep->port)
            .then(
                [=](const caf::node_id&, caf::strong_actor_ptr& ptr, const std::set<std::string>&) {
                  if (!ptr) return down(index, "unreachable: nothing is published there");
                  auto sched = caf::actor_cast<caf::actor>(ptr);
                  self->request(sched, timeout, info_atom::value)
                      .then(
                          [=](const std::string& theirs) {
                            if (theirs != fingerprint) return down(index, "serves another model (" + theirs + "; this one: " + fingerprint + ")");
                            st->connected[sched.address()] = index;
                            self->monitor(sched);
                            router->set_up(index, sched);
                            st->last_status[index] = "serving";
                            std::fprintf(stderr, "troupe: replica %s: serving (%s)\n", router->name(index).c_str(), theirs.c_str());
                          },
                          [=](caf::error& e) { down(index, "no answer: " + self->system().render(e)); });
                },
                [=](caf::error& e) {
                  std::string why = "unreachable: " + self->system().render(e);
                  if (e == caf::sec::disconnect_during_handshake || (tls && e == caf::sec::cannot_connect_to_node))
                    why += " (if it is listening, the handshake failed: TLS needs both ends with certificates of the CA the "
                           "other trusts (--replica-tls-cert/-key/-ca), plain TCP neither)";
                  down(index, why);
                });
      },
  };
}

std::string replica_tls_error(const std::string& cert, const std::string& key, const std::string& ca) {
  const int named = !cert.empty() + !key.empty() + !ca.empty();
  if (named == 0) return {};
  if (named < 3)
    return "replica TLS needs all three files: the certificate, its key and the CA that signs the peers' certificates "
           "(--replica-tls-cert, --replica-tls-key, --replica-tls-ca)";
  // The checks CAF's OpenSSL module makes on each connection (a failure there would only drop
  // the connection, unexplained), made once here with OpenSSL's reason.
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_method()), SSL_CTX_free);
  if (!ctx) return "replica TLS: cannot create an OpenSSL context";
  auto why = [](const std::string& what) {
    std::string msg = what;
    for (unsigned long e; (e = ERR_get_error()) != 0;) {
      char buf[256];
      ERR_error_string_n(e, buf, sizeof buf);
      msg += std::string(msg == what ? ": " : "; ") + buf;
    }
    return msg;
  };
  ERR_clear_error();
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), cert.c_str()) != 1) return why("replica TLS certificate " + cert + " does not load");
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), key.c_str(), SSL_FILETYPE_PEM) != 1)
    return why("replica TLS key " + key + " does not load (PEM, unencrypted) or is not the key of " + cert);
  if (SSL_CTX_check_private_key(ctx.get()) != 1) return why("replica TLS key " + key + " is not the key of " + cert);
  if (SSL_CTX_load_verify_locations(ctx.get(), ca.c_str(), nullptr) != 1) return why("replica TLS CA file " + ca + " does not load");
  return {};
}

}  // namespace troupe::actors
