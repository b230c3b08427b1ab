// A small driver of engine::tokenizer for tests/python/test_tokenizer.py, with the same contract as
// the `troupe tokenize|detokenize` subcommands:
//   tokenizer_tool tokenize   --model PATH [--special] [--add-special]   UTF-8 text on stdin -> ids on one line
//   tokenizer_tool detokenize --model PATH [--no-special]                ids on stdin -> bytes on stdout
// (--special: parse special-token text; detokenize renders control tokens unless --no-special)
// and three more for the tests:
//   tokenizer_tool vocab --model PATH    JSON: n_vocab, bos, eos, add_bos, add_eos, eog, control ids
//   tokenizer_tool batch --model PATH    one request per stdin line, one answer line each:
//       "T <special 0|1> <add_special 0|1> <text as hex>"  ->  the ids, space-separated
//       "D <special 0|1> <id> <id> ..."                     ->  the decoded bytes as hex
//   tokenizer_tool bench --model PATH [--special] [--repeat N]   encodes stdin N times, prints MB/s
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "engine/gguf.hpp"
#include "engine/tokenizer.hpp"

namespace {

using troupe::engine::token_id;

std::string read_stdin() {
  std::ostringstream ss;
  ss << std::cin.rdbuf();
  return ss.str();
}

std::string ids_line(const std::vector<token_id>& ids) {
  std::string line;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line += ' ';
    line += std::to_string(ids[i]);
  }
  return line + '\n';
}

std::vector<token_id> parse_ids(std::istream& in) {
  std::vector<token_id> ids;
  std::string word;
  while (in >> word) {
    size_t used = 0;
    const long long v = std::stoll(word, &used);
    if (used != word.size() || v < INT32_MIN || v > INT32_MAX) throw std::invalid_argument("not a token id: '" + word + "'");
    ids.push_back((token_id)v);
  }
  return ids;
}

std::string from_hex(const std::string& h) {
  if (h.size() % 2) throw std::invalid_argument("odd hex length");
  std::string out;
  for (size_t i = 0; i < h.size(); i += 2) out.push_back((char)std::stoi(h.substr(i, 2), nullptr, 16));
  return out;
}

std::string to_hex(std::string_view s) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

int usage() {
  std::fprintf(stderr,
               "usage: tokenizer_tool tokenize|detokenize|vocab|batch|bench --model PATH [--special] [--add-special] [--no-special] [--repeat N]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 2) return usage();
  const std::string cmd = argv[1];
  std::string model;
  bool special = false, add_special = false, no_special = false;
  int repeat = 10;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--model" && i + 1 < argc) {
      model = argv[++i];
    } else if (a == "--special") {
      special = true;
    } else if (a == "--add-special") {
      add_special = true;
    } else if (a == "--no-special") {
      no_special = true;
    } else if (a == "--repeat" && i + 1 < argc) {
      repeat = std::stoi(argv[++i]);
    } else {
      return usage();
    }
  }
  if (model.empty()) return usage();
  std::ios::sync_with_stdio(false);
  const auto file = troupe::engine::gguf_file::open(model);
  const auto tok = troupe::engine::tokenizer::from_gguf(*file);

  if (cmd == "tokenize") {
    const std::string line = ids_line(tok->encode(read_stdin(), add_special, special));
    std::fwrite(line.data(), 1, line.size(), stdout);
  } else if (cmd == "detokenize") {
    std::istringstream in(read_stdin());
    const std::string text = tok->decode(parse_ids(in), !no_special);
    std::fwrite(text.data(), 1, text.size(), stdout);
  } else if (cmd == "batch") {
    std::string line;
    while (std::getline(std::cin, line)) {
      std::istringstream in(line);
      std::string op;
      int sp = 0, add = 0;
      in >> op >> sp;
      std::string answer;
      if (op == "T") {
        std::string hex;
        in >> add >> hex;
        answer = ids_line(tok->encode(from_hex(hex), add != 0, sp != 0));
      } else if (op == "D") {
        answer = to_hex(tok->decode(parse_ids(in), sp != 0)) + '\n';
      } else {
        throw std::invalid_argument("bad batch request: " + line.substr(0, 40));
      }
      std::fwrite(answer.data(), 1, answer.size(), stdout);
    }
  } else if (cmd == "vocab") {
    auto list = [](const std::vector<token_id>& v) {
      std::string s = "[";
      for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
      return s + "]";
    };
    std::vector<token_id> control;
    for (token_id id = 0; id < tok->n_vocab(); ++id)
      if (tok->is_control(id)) control.push_back(id);
    std::printf("{\"n_vocab\": %d, \"bos\": %d, \"eos\": %d, \"add_bos\": %s, \"add_eos\": %s, \"eog\": %s, \"control\": %s}\n",
                tok->n_vocab(), tok->bos(), tok->eos(), tok->add_bos() ? "true" : "false", tok->add_eos() ? "true" : "false",
                list(tok->eog_ids()).c_str(), list(control).c_str());
  } else if (cmd == "bench") {
    const std::string text = read_stdin();
    size_t n_tokens = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < repeat; ++r) n_tokens = tok->encode(text, false, special).size();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("{\"bytes\": %zu, \"tokens\": %zu, \"seconds\": %.6f, \"mb_per_s\": %.3f}\n", text.size(), n_tokens, s / repeat,
                s > 0 ? (double)text.size() * repeat / s / 1e6 : 0.0);
  } else {
    return usage();
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "tokenizer_tool: %s\n", e.what());
  return 1;
}
