// A small driver of engine::gguf_file and kernels::dequantize_row for tests/python/test_dequant.py:
//   troupe_gguf_tool dequant FILE OUTDIR [NAME...]   every tensor (or the named ones) dequantized to
//                                          OUTDIR/<name>.f32 (raw little-endian float32, ggml order)
//   troupe_gguf_tool info FILE             one JSON object per line: the header, each metadata key
//                                          (arrays as their length and first elements), each tensor
// A load failure prints "error: <message>" on one line to stderr and exits 1; bad usage exits 2.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "engine/gguf.hpp"
#include "kernels/dequant.hpp"

namespace {

using troupe::engine::gguf_array;
using troupe::engine::gguf_file;
using troupe::engine::gguf_tensor;
using troupe::engine::gguf_value;
namespace kernels = troupe::kernels;

constexpr size_t array_head = 8;  // array elements `info` prints

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += static_cast<char>(ch);
    } else if (ch < 0x20 || ch == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", ch);
      out += buf;
    } else {
      out += static_cast<char>(ch);  // bytes >= 0x80 pass through (GGUF strings are UTF-8)
    }
  }
  return out + "\"";
}

std::string json_value(const gguf_value& v) {
  switch (v.index()) {
    case 0: return std::to_string(std::get<uint64_t>(v));
    case 1: return std::to_string(std::get<int64_t>(v));
    case 2: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.17g", std::get<double>(v));
      return buf;
    }
    case 3: return std::get<bool>(v) ? "true" : "false";
    case 4: return json_string(std::get<std::string>(v));
    default: {
      const gguf_array& arr = *std::get<5>(v);
      std::string out = "{\"elem_type\": " + std::to_string(arr.elem_type) + ", \"n\": " +
                        std::to_string(arr.items.size()) + ", \"head\": [";
      for (size_t i = 0; i < arr.items.size() && i < array_head; ++i) out += (i ? ", " : "") + json_value(arr.items[i]);
      return out + "]}";
    }
  }
}

int info(const gguf_file& f) {
  std::printf("{\"version\": %u, \"alignment\": %llu, \"n_kv\": %zu, \"n_tensors\": %zu}\n", f.version(),
              static_cast<unsigned long long>(f.alignment()), f.keys().size(), f.tensors().size());
  for (const std::string& key : f.keys())
    std::printf("{\"key\": %s, \"value\": %s}\n", json_string(key).c_str(), json_value(*f.find(key)).c_str());
  for (const gguf_tensor& t : f.tensors()) {
    std::string ne;
    for (size_t i = 0; i < t.ne.size(); ++i) ne += (i ? ", " : "") + std::to_string(t.ne[i]);
    std::printf("{\"tensor\": %s, \"type\": \"%s\", \"ne\": [%s], \"offset\": %llu, \"n_bytes\": %zu}\n",
                json_string(t.name).c_str(), kernels::traits(t.type).name, ne.c_str(),
                static_cast<unsigned long long>(t.offset), t.n_bytes);
  }
  return 0;
}

int dequant(const gguf_file& f, const std::string& outdir, const std::vector<std::string>& names) {
  std::vector<const gguf_tensor*> todo;
  for (const std::string& name : names) todo.push_back(&f.tensor(name));
  if (names.empty())
    for (const gguf_tensor& t : f.tensors()) todo.push_back(&t);
  std::vector<float> buf;
  for (const gguf_tensor* tp : todo) {
    const gguf_tensor& t = *tp;
    std::string file_name = t.name;  // keep the output inside outdir whatever the name holds
    for (char& ch : file_name)
      if (ch == '/') ch = '_';
    if (file_name == "." || file_name == "..") file_name = "_" + file_name;
    buf.resize(static_cast<size_t>(t.n_elements()));
    kernels::dequantize_row(t.type, t.data, buf.data(), t.n_elements());
    const std::string out_path = outdir + "/" + file_name + ".f32";
    std::ofstream out(out_path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(buf.data()), static_cast<std::streamsize>(buf.size() * sizeof(float)));
    if (!out) {
      std::fprintf(stderr, "error: cannot write %s\n", out_path.c_str());
      return 1;
    }
  }
  return 0;
}

int usage() {
  std::fprintf(stderr, "usage: troupe_gguf_tool dequant FILE OUTDIR [NAME...] | info FILE\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return usage();
  const std::string cmd = argv[1];
  if (!((cmd == "dequant" && argc >= 4) || (cmd == "info" && argc == 3))) return usage();
  try {
    const auto f = gguf_file::open(argv[2]);
    return cmd == "info" ? info(*f) : dequant(*f, argv[3], std::vector<std::string>(argv + 4, argv + argc));
  } catch (const std::exception& e) {
    std::string msg = e.what();  // one line, whatever bytes a key or tensor name holds
    for (char& ch : msg)
      if (static_cast<unsigned char>(ch) < 0x20) ch = '?';
    std::fprintf(stderr, "error: %s\n", msg.c_str());
    return 1;
  }
}
