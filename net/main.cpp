// troupe: an LLM inference engine and server. `troupe --help` lists the commands.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "net/cli.hpp"

int main(int argc, char** argv) {
  CLI::App app{"troupe: LLM inference on actors"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "troupe 0.1.0");
  troupe::cli::action chosen;
  auto bind = [&](troupe::cli::action a, const char* name) {
    app.get_subcommand(name)->callback([&chosen, a] { chosen = a; });
  };
  bind(troupe::cli::add_generate(app), "generate");
  bind(troupe::cli::add_bench(app), "bench");
  bind(troupe::cli::add_logits(app), "logits");
  bind(troupe::cli::add_tokenize(app), "tokenize");
  bind(troupe::cli::add_detokenize(app), "detokenize");
#ifdef TROUPE_HAVE_ACTORS
  bind(troupe::cli::add_serve(app), "serve");
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return chosen ? chosen() : 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "troupe: error: %s\n", e.what());
    return 1;
  }
}
