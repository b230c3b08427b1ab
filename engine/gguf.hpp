// GGUF v3 reader: the file is memory-mapped, the header, metadata and tensor table validated
// before anything is handed out. Every failure throws gguf_error naming the file (and the key or
// tensor at fault); no read ever leaves the mapping.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

#include "kernels/ggml_types.hpp"

namespace troupe::engine {

/// A load failure: what() reads "<file>: <what is wrong>[ (tensor '<name>')]".
class gguf_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// One metadata value. Arrays keep their element type; numbers widen to int64/uint64/double.
struct gguf_array;
using gguf_value = std::variant<uint64_t, int64_t, double, bool, std::string, std::shared_ptr<gguf_array>>;
struct gguf_array {
  uint32_t elem_type = 0;  // the GGUF value type id of the elements
  std::vector<gguf_value> items;
};

struct gguf_tensor {
  std::string name;
  kernels::dtype type;
  std::vector<int64_t> ne;  // ggml order: ne[0] is the contiguous (row) dimension
  uint64_t offset = 0;      // from the start of the data section
  const uint8_t* data = nullptr;
  size_t n_bytes = 0;
  int64_t n_elements() const;
};

class gguf_file {
 public:
  /// Maps and validates `path`. Throws gguf_error.
  static std::unique_ptr<gguf_file> open(const std::string& path);
  ~gguf_file();
  gguf_file(const gguf_file&) = delete;
  gguf_file& operator=(const gguf_file&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  size_t file_size() const { return size_; }
  uint64_t alignment() const { return alignment_; }

  const std::vector<gguf_tensor>& tensors() const { return tensors_; }
  /// nullptr when absent.
  const gguf_tensor* find_tensor(std::string_view name) const;
  /// Throws gguf_error when absent or when its shape differs from `ne` (empty ne: any shape).
  const gguf_tensor& tensor(std::string_view name, std::span<const int64_t> ne = {}) const;

  const gguf_value* find(std::string_view key) const;
  bool has(std::string_view key) const { return find(key) != nullptr; }
  // Typed getters: nullopt when absent; throw gguf_error when present with an incompatible type.
  std::optional<int64_t> get_int(std::string_view key) const;
  std::optional<double> get_float(std::string_view key) const;
  std::optional<bool> get_bool(std::string_view key) const;
  std::optional<std::string> get_string(std::string_view key) const;
  std::optional<std::vector<std::string>> get_string_array(std::string_view key) const;
  std::optional<std::vector<int64_t>> get_int_array(std::string_view key) const;
  std::optional<std::vector<float>> get_float_array(std::string_view key) const;
  /// Keys in file order.
  const std::vector<std::string>& keys() const { return key_order_; }

 private:
  gguf_file() = default;
  [[noreturn]] void fail(const std::string& what) const;
  void parse();  // header, metadata, tensor table and data bounds of the mapped file

  std::string path_;
  int fd_ = -1;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::vector<gguf_tensor> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
  std::unordered_map<std::string, gguf_value> kv_;
  std::vector<std::string> key_order_;
};

}  // namespace troupe::engine
