#include <CLI/CLI.hpp>

#include <stdexcept>

#include "net/cli.hpp"

namespace troupe::cli {

void add_engine_options(CLI::App& cmd, config::engine_config& c) {
  cmd.add_option("-m,--model", c.model_path,
                 "GGUF model file (default: the installed default model); with --load-format dummy also a built-in architecture: "
                 "llama-3-8b, qwen2.5-7b, smollm2-135m, gemma3-270m");
  cmd.add_option("--load-format", c.load_format,
                 "auto: the file's weights; dummy: random weights of the model's shapes (no weights read), for throughput measurements")
      ->capture_default_str();
  cmd.add_option("--dummy-seed", c.dummy_seed, "seed of the random weights of --load-format dummy")->capture_default_str();
  cmd.add_option("-t,--threads", c.n_threads, "compute threads (0: one per available core)");
  cmd.add_option("-c,--ctx-size", c.n_ctx, "max positions per sequence (0: the model's trained context)");
  cmd.add_option("--kv-block-size", c.kv_block_size, "positions per paged KV block");
  cmd.add_option("-b,--batch-size", c.n_batch, "max tokens per forward step (prefill chunk)");
  cmd.add_option("--tensor-parallel,--tp", c.tensor_parallel,
                 "tensor-parallel ranks: the model's heads and feed-forward columns split over them (CPU: the threads are shared)");
  cmd.add_option("--expert-parallel,--ep", c.expert_parallel,
                 "expert-parallel ranks: a mixture of experts' experts split over them (CPU: the threads are shared)");
  cmd.add_flag("--swa-full", c.swa_full,
               "sliding-window layers keep the KV of every position (default: only their window's blocks stay)");
  cmd.add_option("--pipeline-parallel,--pp", c.pipeline_parallel,
                 "pipeline stages: the model's layers split over them, micro-batches flowing through (CPU: the threads are shared)");
}

void add_sampling_options(CLI::App& cmd, engine::sampling_params& p) {
  cmd.add_option("--temperature,--temp", p.temperature, "0: greedy")->capture_default_str();
  cmd.add_option("--top-k", p.top_k, "keep the k most likely tokens (0: off)")->capture_default_str();
  cmd.add_option("--top-p", p.top_p, "nucleus sampling mass (1: off)")->capture_default_str();
  cmd.add_option("--min-p", p.min_p, "drop tokens below min_p * p(max) (0: off)")->capture_default_str();
  cmd.add_option("--repeat-penalty", p.repetition_penalty, "repetition penalty (1: off)");
  cmd.add_option("--repeat-last-n", p.penalty_last_n, "tokens the penalties look back over (-1: all)");
  cmd.add_option("--presence-penalty", p.presence_penalty, "OpenAI presence penalty in [-2, 2]");
  cmd.add_option("--frequency-penalty", p.frequency_penalty, "OpenAI frequency penalty in [-2, 2]");
  cmd.add_option_function<uint64_t>("-s,--seed", [&p](const uint64_t& s) { p.seed = s; p.has_seed = true; }, "RNG seed");
  cmd.add_option("--stop", p.stop, "stop string (repeatable)");
  cmd.add_option("--stop-token", p.stop_tokens, "stop token id (repeatable)");
  cmd.add_flag("--ignore-eos", p.ignore_eos, "keep generating past end-of-generation tokens");
  cmd.add_option("--top-logprobs", p.top_logprobs, "report the n most likely alternatives per token");
}

std::unique_ptr<engine::model> load_model(config::engine_config& c, bool shapes_only) {
  if (auto err = config::validate(c); !err.empty()) throw std::runtime_error(err);
  if (c.model_path.empty()) c.model_path = config::default_model_path();
  if (c.model_path.empty())
    throw std::runtime_error("no model given and the default model is not installed: run scripts/setup.sh or pass --model FILE");
  if (c.n_threads == 0) c.n_threads = config::default_threads();
  // A dummy model's random weights are made on the host for the CPU only: a CUDA device makes its own.
  return engine::model::load(c.model_path,
                             {c.load_format == "dummy", (uint64_t)c.dummy_seed, !shapes_only && config::parse_device(c.device) < 0});
}

std::vector<int32_t> parse_token_list(const std::string& s) {
  std::vector<int32_t> out;
  size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && (s[i] == ',' || s[i] == ' ' || s[i] == '\n' || s[i] == '\t')) ++i;
    if (i >= s.size()) break;
    size_t j = i;
    while (j < s.size() && s[j] != ',' && s[j] != ' ' && s[j] != '\n' && s[j] != '\t') ++j;
    const std::string item = s.substr(i, j - i);
    try {
      size_t used = 0;
      const long long v = std::stoll(item, &used);
      if (used != item.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument(item);
      out.push_back((int32_t)v);
    } catch (const std::exception&) {
      throw std::invalid_argument("'" + item + "' is not a token id");
    }
    i = j;
  }
  return out;
}

}  // namespace troupe::cli
