// `troupe logits`, `troupe tokenize`, `troupe detokenize`: the engine's raw outputs, for tests
// against independent references and for debugging.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>
#include <iterator>
#include <stdexcept>

#include "engine/generator.hpp"
#include "net/cli.hpp"

namespace troupe::cli {

namespace {
std::string read_stdin() {
  std::ios::sync_with_stdio(false);
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}
}  // namespace

action add_logits(CLI::App& app) {
  struct opts {
    config::engine_config engine;
    std::string tokens, out;
  };
  auto o = std::make_shared<opts>();
  CLI::App* cmd = app.add_subcommand("logits", "write the logits of every position of a token list (float32, row-major)");
  add_engine_options(*cmd, o->engine);
  cmd->add_option("--tokens", o->tokens, "token ids (\"1,2,3\")")->required();
  cmd->add_option("-o,--out", o->out, "output file: n_tokens x n_vocab little-endian float32")->required();
  return [o] {
    const auto ids = parse_token_list(o->tokens);
    if (ids.empty()) throw std::runtime_error("--tokens is empty");
    auto m = load_model(o->engine);
    engine::generator gen(*m, {o->engine.n_threads, o->engine.n_ctx, o->engine.kv_block_size, o->engine.n_batch, o->engine.tensor_parallel, o->engine.pipeline_parallel, o->engine.expert_parallel, !o->engine.swa_full});
    const auto logits = gen.logits_all(ids);
    FILE* f = std::fopen(o->out.c_str(), "wb");
    if (!f) throw std::runtime_error("cannot write " + o->out);
    const size_t n = std::fwrite(logits.data(), sizeof(float), logits.size(), f);
    if (std::fclose(f) != 0 || n != logits.size()) throw std::runtime_error("short write to " + o->out);
    std::printf("%zu %d\n", ids.size(), m->hparams().n_vocab);
    return 0;
  };
}

action add_tokenize(CLI::App& app) {
  struct opts {
    config::engine_config engine;
    bool special = false, add_special = false;
  };
  auto o = std::make_shared<opts>();
  CLI::App* cmd = app.add_subcommand("tokenize", "read UTF-8 text on stdin, print its token ids");
  cmd->add_option("-m,--model", o->engine.model_path, "GGUF model file");
  cmd->add_flag("--special", o->special, "parse special-token text as special tokens");
  cmd->add_flag("--add-special", o->add_special, "add BOS/EOS as the model asks");
  return [o] {
    auto m = load_model(o->engine);
    const auto ids = m->vocab().encode(read_stdin(), o->add_special, o->special);
    for (size_t i = 0; i < ids.size(); ++i) std::printf(i ? " %d" : "%d", ids[i]);
    std::printf("\n");
    return 0;
  };
}

action add_detokenize(CLI::App& app) {
  struct opts {
    config::engine_config engine;
    bool render_special = true;
  };
  auto o = std::make_shared<opts>();
  CLI::App* cmd = app.add_subcommand("detokenize", "read token ids on stdin, write their text");
  cmd->add_option("-m,--model", o->engine.model_path, "GGUF model file");
  cmd->add_flag("!--no-special", o->render_special, "do not render control tokens");
  return [o] {
    auto m = load_model(o->engine);
    const auto ids = parse_token_list(read_stdin());
    for (auto id : ids)
      if (id >= m->vocab().n_vocab()) throw std::runtime_error("token id " + std::to_string(id) + " outside the vocabulary");
    const std::string text = m->vocab().decode(ids, o->render_special);
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
  };
}

}  // namespace troupe::cli
