#include "engine/chat_template.hpp"

#include <catch2/catch.hpp>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

using namespace troupe::engine;

namespace {

std::string fixture(const std::string& name) {
  const std::string path = std::string(TROUPE_SOURCE_DIR) + "/tests/fixtures/chat_templates/" + name + ".jinja";
  std::ifstream f(path, std::ios::binary);
  REQUIRE(f.good());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

chat_template detect_fixture(const std::string& name, std::string bos, std::string eos) {
  auto t = chat_template::detect(fixture(name), std::move(bos), std::move(eos));
  REQUIRE(t.has_value());
  return *t;
}

// The conversation of llama.cpp's tests/test-chat-template.cpp, whose expected outputs (made
// with transformers' apply_chat_template) serve as independent references below.
const std::vector<chat_message> conversation = {
    {"system", "You are a helpful assistant"}, {"user", "Hello"},
    {"assistant", "Hi there"},                 {"user", "Who are you"},
    {"assistant", "   I am an assistant   "},  {"user", "Another question"},
};

}  // namespace

TEST_CASE("detect recognizes every fixture and its family", "[chat_template]") {
  const std::vector<std::pair<std::string, chat_family>> cases = {
      {"chatml_openhermes", chat_family::chatml}, {"chatml_qwen2", chat_family::chatml},
      {"chatml_smollm2", chat_family::chatml},    {"llama3", chat_family::llama3},
      {"llama3_original", chat_family::llama3},   {"gemma3", chat_family::gemma},
      {"gemma2", chat_family::gemma},             {"mistral_v01", chat_family::mistral},
      {"mistral_v02", chat_family::mistral},      {"mistral_v02_system", chat_family::mistral},
  };
  for (const auto& [name, family] : cases) {
    INFO(name);
    const auto t = chat_template::detect(fixture(name), "<s>", "</s>");
    REQUIRE(t.has_value());
    CHECK(t->family() == family);
  }
  CHECK_FALSE(chat_template::detect("", "", ""));
  CHECK_FALSE(chat_template::detect("INVALID TEMPLATE", "", ""));
  CHECK_FALSE(chat_template::detect("{% for message in messages %}{{ message['content'] }}{% endfor %}", "", ""));
  CHECK_FALSE(chat_template::detect("{% for m in messages %}{{ m['content'] ", "", ""));  // unterminated
}

TEST_CASE("detect sees through formatting that Jinja renders identically", "[chat_template]") {
  // Multi-line, indented, attribute syntax, double quotes: HF's trim_blocks / lstrip_blocks and
  // the `-` markers remove all the text between the tags.
  const auto t = chat_template::detect(
      "{%- for message in messages %}\n"
      "    {{- '<|im_start|>' + message.role + \"\\n\" + message.content + '<|im_end|>' + '\\n' }}\n"
      "{%- endfor %}\n"
      "{% if add_generation_prompt %}\n"
      "    {{- '<|im_start|>assistant\\n' }}\n"
      "{%- endif %}\n",
      "", "");
  REQUIRE(t.has_value());
  CHECK(t->family() == chat_family::chatml);
  CHECK(t->render(std::vector<chat_message>{{"user", "x"}}, true) ==
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n");
  // A newline after an expression tag is output by Jinja: a different template.
  CHECK_FALSE(chat_template::detect(
      "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
      "'<|im_end|>' + '\\n'}}\n{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
      "{% endif %}",
      "", ""));
}

TEST_CASE("renders the llama.cpp reference conversation", "[chat_template]") {
  CHECK(detect_fixture("chatml_openhermes", "<s>", "</s>").render(conversation, true) ==
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
        "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n"
        "<|im_start|>assistant\n   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother question<|im_end|>\n"
        "<|im_start|>assistant\n");
  // llama.cpp's reference has no BOS text: an empty one reproduces it.
  CHECK(detect_fixture("llama3", "", "<|eot_id|>").render(conversation, true) ==
        "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
        "\n\nHi there<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nI am an assistant<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnother question<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n");
  CHECK(detect_fixture("gemma3", "", "<eos>").render(conversation, true) ==
        "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>model\nHi there"
        "<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\nI am an assistant"
        "<end_of_turn>\n<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n");
}

TEST_CASE("BOS and the generation prompt", "[chat_template]") {
  const std::vector<chat_message> hi = {{"user", "Hi"}};
  CHECK(detect_fixture("llama3", "<|begin_of_text|>", "").render(hi, false) ==
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
  // The first Llama 3 release appends the assistant header whatever add_generation_prompt says.
  CHECK(detect_fixture("llama3_original", "<|begin_of_text|>", "").render(hi, false) ==
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n");
  CHECK(detect_fixture("gemma2", "<bos>", "<eos>").render(hi, false) == "<bos><start_of_turn>user\nHi<end_of_turn>\n");
  CHECK(detect_fixture("llama3", "<|begin_of_text|>", "").renders_bos());
  CHECK(detect_fixture("gemma3", "<bos>", "").renders_bos());
  CHECK_FALSE(detect_fixture("chatml_smollm2", "<|im_start|>", "<|im_end|>").renders_bos());
}

TEST_CASE("ChatML default system prompts (SmolLM2, Qwen2)", "[chat_template]") {
  const auto smollm2 = detect_fixture("chatml_smollm2", "<|im_start|>", "<|im_end|>");
  CHECK(smollm2.render(std::vector<chat_message>{{"user", "Hi"}}, true) ==
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  CHECK(smollm2.render(std::vector<chat_message>{{"system", "Be brief."}, {"user", "Hi"}}, false) ==
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
  CHECK(detect_fixture("chatml_qwen2", "", "").render(std::vector<chat_message>{{"assistant", "x"}}, false) ==
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>assistant\nx<|im_end|>\n");
}

TEST_CASE("Mistral variants", "[chat_template]") {
  // Expected output from swift-transformers' test of TheBloke/Mistral-7B-Instruct-v0.1.
  const std::vector<chat_message> chat = {
      {"user", "Hello, how are you?"},
      {"assistant", "I'm doing great. How can I help you today?"},
      {"user", "I'd like to show off how chat templating works!"},
  };
  CHECK(detect_fixture("mistral_v01", "<s>", "</s>").render(chat, true) ==
        "<s>[INST] Hello, how are you? [/INST]I'm doing great. How can I help you today?</s> [INST] I'd like to "
        "show off how chat templating works! [/INST]");
  CHECK(detect_fixture("mistral_v02", "<s>", "</s>").render(chat, true) ==
        "<s>[INST] Hello, how are you? [/INST]I'm doing great. How can I help you today?</s>[INST] I'd like to "
        "show off how chat templating works! [/INST]");
  std::vector<chat_message> with_system = chat;
  with_system.insert(with_system.begin(), {"system", "Be kind."});
  const auto v2s = detect_fixture("mistral_v02_system", "<s>", "</s>");
  CHECK(v2s.render(with_system, false) ==
        "<s> [INST] Be kind.\n\nHello, how are you? [/INST] I'm doing great. How can I help you today?</s> [INST] "
        "I'd like to show off how chat templating works! [/INST]");
  CHECK(chat_template::from_name("mistral", "<s>", "</s>")->render(with_system, false) == v2s.render(with_system, false));
  // The v0.1 / v0.2 templates have no system role.
  CHECK_THROWS_AS(detect_fixture("mistral_v01", "<s>", "</s>").render(with_system, false), std::invalid_argument);
}

TEST_CASE("orders and roles the templates reject", "[chat_template]") {
  const auto gemma3 = detect_fixture("gemma3", "<bos>", "<eos>");
  const auto gemma2 = detect_fixture("gemma2", "<bos>", "<eos>");
  const auto mistral = detect_fixture("mistral_v02", "<s>", "</s>");
  const auto chatml = detect_fixture("chatml_openhermes", "", "");
  using msgs = std::vector<chat_message>;
  for (const auto* t : {&gemma3, &gemma2, &mistral}) {
    INFO(t->name());
    CHECK_THROWS_AS(t->render(msgs{{"assistant", "a"}}, true), std::invalid_argument);
    CHECK_THROWS_AS(t->render(msgs{{"user", "a"}, {"user", "b"}}, true), std::invalid_argument);
    CHECK_THROWS_AS(t->render(msgs{{"user", "a"}, {"assistant", "b"}, {"assistant", "c"}}, true),
                    std::invalid_argument);
  }
  CHECK_THROWS_AS(gemma2.render(msgs{{"system", "s"}, {"user", "a"}}, true), std::invalid_argument);
  CHECK_NOTHROW(gemma3.render(msgs{{"system", "s"}, {"user", "a"}}, true));
  CHECK_THROWS_AS(gemma3.render(msgs{{"system", "s"}, {"assistant", "a"}}, true), std::invalid_argument);
  // Every template: no messages, or a role outside system/user/assistant.
  for (const auto* t : {&gemma3, &gemma2, &mistral, &chatml}) {
    CHECK_THROWS_AS(t->render(msgs{}, true), std::invalid_argument);
    CHECK_THROWS_AS(t->render(msgs{{"user", "a"}, {"tool", "b"}}, true), std::invalid_argument);
  }
  try {
    chatml.render(msgs{{"developer", "x"}}, true);
    FAIL("no exception");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("developer") != std::string::npos);
  }
  // ChatML and Llama 3 impose no order.
  CHECK_NOTHROW(chatml.render(msgs{{"assistant", "a"}, {"assistant", "b"}}, true));
}

TEST_CASE("from_name picks a family by name", "[chat_template]") {
  for (const char* name : {"chatml", "llama3", "gemma", "mistral"}) {
    const auto t = chat_template::from_name(name, "<s>", "</s>");
    REQUIRE(t.has_value());
    CHECK(t->name() == name);
  }
  CHECK_FALSE(chat_template::from_name("vicuna", "", ""));
  CHECK(chat_template::from_name("gemma", "<bos>", "")->render(std::vector<chat_message>{{"user", " x "}}, true) ==
        "<bos><start_of_turn>user\nx<end_of_turn>\n<start_of_turn>model\n");
}

TEST_CASE("python_strip removes exactly Python's whitespace", "[chat_template]") {
  CHECK(python_strip("  a b \n") == "a b");
  CHECK(python_strip("\xe3\x80\x80x\xc2\xa0") == "x");                   // U+3000, U+00A0
  CHECK(python_strip("\xc2\x85x\xe2\x80\xa8\xe2\x80\xa9\x1c") == "x");    // U+0085, U+2028/9, U+001C
  CHECK(python_strip("\xe2\x80\x8bx\xe2\x80\x8b") == "\xe2\x80\x8bx\xe2\x80\x8b");  // U+200B is not space
  CHECK(python_strip("\xef\xbb\xbfx") == "\xef\xbb\xbfx");                // BOM is not space
  CHECK(python_strip(" \xff ") == "\xff");                               // invalid UTF-8: kept
  CHECK(python_strip(" \xe3\x80 ") == "\xe3\x80");                       // truncated sequence: kept
  CHECK(python_strip("   ").empty());
  CHECK(python_strip("").empty());
}
