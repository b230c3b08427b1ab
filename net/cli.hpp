// The `troupe` subcommands. Each add_* registers its options on the app and returns the action
// to run when that subcommand was chosen; actions return the process exit code.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config/engine_config.hpp"
#include "engine/model.hpp"
#include "engine/sampling.hpp"

namespace CLI {
class App;
}

namespace troupe::cli {

using action = std::function<int()>;

action add_generate(CLI::App& app);
action add_bench(CLI::App& app);
action add_logits(CLI::App& app);
action add_tokenize(CLI::App& app);
action add_detokenize(CLI::App& app);
action add_serve(CLI::App& app);  // only with the actor runtime (TROUPE_HAVE_ACTORS)

// Shared option groups.
void add_engine_options(CLI::App& cmd, config::engine_config& c);
void add_sampling_options(CLI::App& cmd, engine::sampling_params& p);

/// Validates the engine config and loads the model (the default one when none is named);
/// shapes_only: a dummy load draws no weights (its shapes and vocabulary are all the caller reads).
/// Throws std::runtime_error with a one-line message.
std::unique_ptr<engine::model> load_model(config::engine_config& c, bool shapes_only = false);

/// "1,2,3" or "1 2 3" -> ids; throws std::invalid_argument naming the bad entry.
std::vector<int32_t> parse_token_list(const std::string& s);

}  // namespace troupe::cli
