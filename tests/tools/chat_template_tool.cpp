// Renders chat conversations with troupe's chat templates, for the Python reference tests.
//
// stdin: one JSON object
//   {"template": "<jinja source>" | "family": "chatml|llama3|gemma|mistral",
//    "bos": "...", "eos": "...", "messages": [{"role": "...", "content": "..."}],
//    "add_generation_prompt": true}
// stdout: the rendered text, exactly. Exit 1 when the conversation is rejected (message on
// stderr), 2 when the template is not recognized, 3 on bad input.
//
// Or a JSON array of such objects (batch): stdout is a JSON array with, per item,
// {"family": name or null} plus "text" (rendered) or "error" (rejected); items without
// "messages" only report the detected family.
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/chat_template.hpp"

using nlohmann::json;
using troupe::engine::chat_message;
using troupe::engine::chat_template;

namespace {

std::optional<chat_template> make_template(const json& item) {
  const std::string bos = item.value("bos", ""), eos = item.value("eos", "");
  if (item.contains("template")) return chat_template::detect(item.at("template").get<std::string>(), bos, eos);
  return chat_template::from_name(item.at("family").get<std::string>(), bos, eos);
}

std::vector<chat_message> read_messages(const json& item) {
  std::vector<chat_message> messages;
  for (const auto& m : item.at("messages"))
    messages.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
  return messages;
}

json run_one(const json& item) {
  json out;
  const auto t = make_template(item);
  out["family"] = t ? json(std::string(t->name())) : json(nullptr);
  if (!t || !item.contains("messages")) return out;
  try {
    out["text"] = t->render(read_messages(item), item.value("add_generation_prompt", false));
  } catch (const std::invalid_argument& e) {
    out["error"] = e.what();
  }
  return out;
}

}  // namespace

int main() {
  json input;
  try {
    std::string text{std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>()};
    input = json::parse(text);
    if (input.is_array()) {
      json results = json::array();
      for (const auto& item : input) results.push_back(run_one(item));
      std::cout << results.dump();
      return 0;
    }
    const auto t = make_template(input);
    if (!t) {
      std::cerr << "unrecognized chat template\n";
      return 2;
    }
    try {
      std::cout << t->render(read_messages(input), input.value("add_generation_prompt", false));
    } catch (const std::invalid_argument& e) {
      std::cerr << e.what() << "\n";
      return 1;
    }
  } catch (const json::exception& e) {
    std::cerr << "bad input: " << e.what() << "\n";
    return 3;
  }
  return 0;
}
