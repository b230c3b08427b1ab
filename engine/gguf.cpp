#include "engine/gguf.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>

namespace troupe::engine {

namespace {

// Limits on what a header may ask for: real models stay far below them, and a corrupt or
// hostile file is refused before it can make us allocate or loop for long.
constexpr uint64_t max_tensors = 1u << 16;
constexpr uint64_t max_kv = 1u << 16;
constexpr uint64_t max_array_items = 1u << 22;  // largest vocabularies are ~256k tokens
constexpr uint64_t max_total_items = 1u << 24;  // all array elements of all keys together
constexpr int max_array_depth = 8;
constexpr uint64_t max_name_len = 1024;  // keys and tensor names
constexpr uint64_t max_alignment = 1u << 20;
constexpr uint32_t max_dims = 4;  // GGML_MAX_DIMS
constexpr uint64_t default_alignment = 32;

// GGUF metadata value types.
enum gguf_type : uint32_t {
  t_u8 = 0, t_i8 = 1, t_u16 = 2, t_i16 = 3, t_u32 = 4, t_i32 = 5, t_f32 = 6, t_bool = 7,
  t_string = 8, t_array = 9, t_u64 = 10, t_i64 = 11, t_f64 = 12,
};

const char* type_name(uint32_t t) {
  static constexpr const char* names[] = {"uint8", "int8",   "uint16", "int16", "uint32",
                                          "int32", "float32", "bool",  "string", "array",
                                          "uint64", "int64", "float64"};
  return t < std::size(names) ? names[t] : "unknown";
}

/// " (<ggml's name>)" of a tensor type id, for error messages ("" for an unknown id).
std::string ggml_type_name(uint32_t t) {
  static constexpr const char* names[] = {
      "F32",   "F16",    "Q4_0",    "Q4_1",   "",      "",      "Q5_0",   "Q5_1",  "Q8_0",  "Q8_1", "Q2_K",
      "Q3_K",  "Q4_K",   "Q5_K",    "Q6_K",   "Q8_K",  "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL",
      "IQ3_S", "IQ2_S",  "IQ4_XS",  "I8",     "I16",   "I32",   "I64",    "F64",   "IQ1_M", "BF16", "",
      "",      "",       "TQ1_0",   "TQ2_0",  "",      "",      "",       "MXFP4", "NVFP4", "Q1_0"};
  return t < std::size(names) && names[t][0] != '\0' ? std::string(" (") + names[t] + ")" : std::string();
}

bool is_int_type(uint32_t t) {
  return t == t_u8 || t == t_i8 || t == t_u16 || t == t_i16 || t == t_u32 || t == t_i32 ||
         t == t_u64 || t == t_i64;
}

/// Fewest bytes one value of type t takes in the file (for bounding counts before allocating).
uint64_t min_encoded_size(uint32_t t) {
  switch (t) {
    case t_u8: case t_i8: case t_bool: return 1;
    case t_u16: case t_i16: return 2;
    case t_u32: case t_i32: case t_f32: return 4;
    case t_u64: case t_i64: case t_f64: case t_string: return 8;  // string: its length
    case t_array: return 12;                                      // element type + count
    default: return 1;
  }
}

std::string describe_value(const gguf_value& v) {
  switch (v.index()) {
    case 0: return "an unsigned integer";
    case 1: return "a signed integer";
    case 2: return "a float";
    case 3: return "a bool";
    case 4: return "a string";
    default: return "an array of " + std::string(type_name(std::get<5>(v)->elem_type));
  }
}

std::string shape_str(std::span<const int64_t> ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

[[noreturn]] void throw_error(const gguf_file& f, const std::string& what) {
  throw gguf_error(f.path() + ": " + what);
}

/// Bounds-checked little-endian reader over the mapping. `where` names what is being parsed so
/// that a truncation error can say where it happened.
class cursor {
 public:
  cursor(const gguf_file& f, const uint8_t* base, size_t size) : file_(f), base_(base), size_(size) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }
  std::string where;  // e.g. "key 'general.name'"
  uint64_t n_items = 0;  // array elements read so far, against max_total_items

  [[noreturn]] void fail(const std::string& what) const {
    throw_error(file_, where.empty() ? what : what + " (" + where + ")");
  }

  const uint8_t* take(uint64_t n, const char* what) {
    if (n > remaining())
      fail("truncated file: " + std::string(what) + " needs " + std::to_string(n) + " bytes at offset " +
           std::to_string(pos_) + ", only " + std::to_string(remaining()) + " left");
    const uint8_t* p = base_ + pos_;
    pos_ += n;
    return p;
  }

  template <class T>
  T read(const char* what) {
    T v;
    std::memcpy(&v, take(sizeof(T), what), sizeof(T));
    return v;
  }

  std::string read_string(const char* what, uint64_t max_len) {
    const uint64_t len = read<uint64_t>(what);
    if (len > max_len)
      fail(std::string(what) + " length " + std::to_string(len) + " exceeds the limit of " + std::to_string(max_len));
    const uint8_t* p = take(len, what);
    return std::string(reinterpret_cast<const char*>(p), len);
  }

 private:
  const gguf_file& file_;
  const uint8_t* base_;
  size_t size_;
  size_t pos_ = 0;
};

gguf_value read_value(cursor& c, uint32_t type, int depth);

std::shared_ptr<gguf_array> read_array(cursor& c, int depth) {
  if (depth >= max_array_depth) c.fail("arrays nested deeper than " + std::to_string(max_array_depth));
  auto arr = std::make_shared<gguf_array>();
  arr->elem_type = c.read<uint32_t>("array element type");
  if (arr->elem_type > t_f64) c.fail("unknown array element type " + std::to_string(arr->elem_type));
  const uint64_t n = c.read<uint64_t>("array length");
  if (n > max_array_items)
    c.fail("array of " + std::to_string(n) + " elements exceeds the limit of " + std::to_string(max_array_items));
  c.n_items += n;
  if (c.n_items > max_total_items)
    c.fail("metadata arrays hold more than " + std::to_string(max_total_items) + " elements in all");
  if (n > c.remaining() / min_encoded_size(arr->elem_type))
    c.fail("truncated file: array of " + std::to_string(n) + " " + type_name(arr->elem_type) +
           " elements cannot fit in the " + std::to_string(c.remaining()) + " bytes left");
  arr->items.reserve(n);
  for (uint64_t i = 0; i < n; ++i) arr->items.push_back(read_value(c, arr->elem_type, depth + 1));
  return arr;
}

gguf_value read_value(cursor& c, uint32_t type, int depth) {
  switch (type) {
    case t_u8: return uint64_t{c.read<uint8_t>("uint8 value")};
    case t_i8: return int64_t{c.read<int8_t>("int8 value")};
    case t_u16: return uint64_t{c.read<uint16_t>("uint16 value")};
    case t_i16: return int64_t{c.read<int16_t>("int16 value")};
    case t_u32: return uint64_t{c.read<uint32_t>("uint32 value")};
    case t_i32: return int64_t{c.read<int32_t>("int32 value")};
    case t_u64: return c.read<uint64_t>("uint64 value");
    case t_i64: return c.read<int64_t>("int64 value");
    case t_f32: return double{c.read<float>("float32 value")};
    case t_f64: return c.read<double>("float64 value");
    case t_bool: {
      const uint8_t b = c.read<uint8_t>("bool value");
      if (b > 1) c.fail("bool value " + std::to_string(b) + " is neither 0 nor 1");
      return b == 1;
    }
    case t_string: return c.read_string("string value", std::numeric_limits<uint64_t>::max());
    case t_array: return read_array(c, depth);
    default: c.fail("unknown value type " + std::to_string(type));
  }
}

}  // namespace

int64_t gguf_tensor::n_elements() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;
  return n;
}

void gguf_file::fail(const std::string& what) const { throw_error(*this, what); }

gguf_file::~gguf_file() {
  if (base_ != nullptr) munmap(const_cast<uint8_t*>(base_), size_);
  if (fd_ >= 0) close(fd_);
}

std::unique_ptr<gguf_file> gguf_file::open(const std::string& path) {
  std::unique_ptr<gguf_file> f(new gguf_file());
  f->path_ = path;
  f->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f->fd_ < 0) f->fail(std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (fstat(f->fd_, &st) != 0) f->fail(std::string("cannot stat: ") + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) f->fail("not a regular file");
  f->size_ = static_cast<size_t>(st.st_size);
  if (f->size_ < 4) f->fail("truncated file: " + std::to_string(f->size_) + " bytes, no GGUF header");
  void* p = mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, f->fd_, 0);
  if (p == MAP_FAILED) f->fail(std::string("cannot map: ") + std::strerror(errno));
  f->base_ = static_cast<const uint8_t*>(p);
  close(f->fd_);  // the mapping keeps the file alive
  f->fd_ = -1;
  f->parse();
  return f;
}

void gguf_file::parse() {
  cursor c(*this, base_, size_);

  // Header.
  if (std::memcmp(c.take(4, "magic"), "GGUF", 4) != 0) fail("bad magic: not a GGUF file");
  version_ = c.read<uint32_t>("version");
  if (version_ != 2 && version_ != 3) {
    const bool swapped = version_ == 0x02000000u || version_ == 0x03000000u;
    fail("unsupported GGUF version " + std::to_string(version_) +
         (swapped ? " (a big-endian file?)" : "") + "; versions 2 and 3 are supported");
  }
  const uint64_t n_tensors = c.read<uint64_t>("tensor count");
  const uint64_t n_kv = c.read<uint64_t>("metadata count");
  if (n_tensors > max_tensors)
    fail("tensor count " + std::to_string(n_tensors) + " exceeds the limit of " + std::to_string(max_tensors));
  if (n_kv > max_kv) fail("metadata count " + std::to_string(n_kv) + " exceeds the limit of " + std::to_string(max_kv));

  // Metadata.
  key_order_.reserve(n_kv);
  for (uint64_t i = 0; i < n_kv; ++i) {
    c.where = "key #" + std::to_string(i);
    std::string key = c.read_string("key", max_name_len);
    c.where = "key '" + key + "'";
    if (kv_.count(key) != 0) c.fail("duplicate key");
    const uint32_t type = c.read<uint32_t>("value type");
    if (type > t_f64) c.fail("unknown value type " + std::to_string(type));
    gguf_value v = read_value(c, type, 0);
    kv_.emplace(key, std::move(v));
    key_order_.push_back(std::move(key));
  }

  if (const gguf_value* a = find("general.alignment")) {
    c.where = "key 'general.alignment'";
    const uint64_t* al = std::get_if<uint64_t>(a);
    if (al == nullptr) c.fail("alignment must be an unsigned integer, not " + describe_value(*a));
    if (*al == 0 || !std::has_single_bit(*al) || *al > max_alignment)
      c.fail("alignment " + std::to_string(*al) + " is not a power of two up to " + std::to_string(max_alignment));
    alignment_ = *al;
  } else {
    alignment_ = default_alignment;
  }

  // Tensor infos.
  tensors_.reserve(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    c.where = "tensor #" + std::to_string(i);
    gguf_tensor t;
    t.name = c.read_string("tensor name", max_name_len);
    c.where = "tensor '" + t.name + "'";
    if (tensor_index_.count(t.name) != 0) c.fail("duplicate tensor name");
    const uint32_t n_dims = c.read<uint32_t>("dimension count");
    if (n_dims == 0 || n_dims > max_dims)
      c.fail(std::to_string(n_dims) + " dimensions; 1 to " + std::to_string(max_dims) + " are supported");
    int64_t n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t raw = c.read<uint64_t>("dimension");
      if (raw == 0 || raw > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        c.fail("dimension " + std::to_string(d) + " is " + std::to_string(static_cast<int64_t>(raw)) +
               " (must be positive)");
      const auto ne = static_cast<int64_t>(raw);
      if (n_elements > std::numeric_limits<int64_t>::max() / ne) c.fail("element count overflows");
      n_elements *= ne;
      t.ne.push_back(ne);
    }
    const uint32_t raw_type = c.read<uint32_t>("tensor type");
    const kernels::dtype_traits* tr = kernels::find_dtype(raw_type);
    if (tr == nullptr) c.fail("unsupported tensor type " + std::to_string(raw_type) + ggml_type_name(raw_type));
    t.type = tr->type;
    if (t.ne[0] % tr->block_size != 0)
      c.fail("row length " + std::to_string(t.ne[0]) + " is not a multiple of the " + tr->name + " block size " +
             std::to_string(tr->block_size));
    // n_elements fits int64 and type_size <= block_size * 8, so this cannot overflow size_t.
    t.n_bytes = static_cast<size_t>(n_elements / tr->block_size) * static_cast<size_t>(tr->type_size);
    t.offset = c.read<uint64_t>("tensor offset");
    if (t.offset % alignment_ != 0)
      c.fail("data offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
             std::to_string(alignment_));
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  // Data section: starts at the next multiple of the alignment; every tensor must lie inside the
  // file and no two may overlap.
  c.where.clear();
  const uint64_t data_start = (c.pos() + alignment_ - 1) / alignment_ * alignment_;
  for (gguf_tensor& t : tensors_) {
    const uint64_t avail = size_ > data_start ? size_ - data_start : 0;
    if (t.offset > avail || t.n_bytes > avail - t.offset)
      fail("truncated file: data of " + std::to_string(t.n_bytes) + " bytes at offset " +
           std::to_string(data_start) + " + " + std::to_string(t.offset) + " runs past the end (" +
           std::to_string(size_) + " bytes) (tensor '" + t.name + "')");
    t.data = base_ + data_start + t.offset;
  }
  std::vector<const gguf_tensor*> by_offset;
  by_offset.reserve(tensors_.size());
  for (const gguf_tensor& t : tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const gguf_tensor* a, const gguf_tensor* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const gguf_tensor& a = *by_offset[i - 1];
    const gguf_tensor& b = *by_offset[i];
    if (a.offset + a.n_bytes > b.offset)
      fail("data of tensors '" + a.name + "' [" + std::to_string(a.offset) + ", " +
           std::to_string(a.offset + a.n_bytes) + ") and '" + b.name + "' [" + std::to_string(b.offset) + ", " +
           std::to_string(b.offset + b.n_bytes) + ") overlap (tensor '" + b.name + "')");
  }
}

// ---- lookups -----------------------------------------------------------------------------------

const gguf_tensor* gguf_file::find_tensor(std::string_view name) const {
  const auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const gguf_tensor& gguf_file::tensor(std::string_view name, std::span<const int64_t> ne) const {
  const gguf_tensor* t = find_tensor(name);
  if (t == nullptr) fail("missing tensor (tensor '" + std::string(name) + "')");
  if (!ne.empty() && !std::equal(ne.begin(), ne.end(), t->ne.begin(), t->ne.end()))
    fail("shape " + shape_str(t->ne) + " where " + shape_str(ne) + " was expected (tensor '" + std::string(name) +
         "')");
  return *t;
}

const gguf_value* gguf_file::find(std::string_view key) const {
  const auto it = kv_.find(std::string(key));
  return it == kv_.end() ? nullptr : &it->second;
}

namespace {

[[noreturn]] void type_mismatch(const gguf_file& f, std::string_view key, const gguf_value& v, const char* want) {
  throw_error(f, "expected " + std::string(want) + ", found " + describe_value(v) + " (key '" + std::string(key) +
                     "')");
}

std::optional<int64_t> as_int(const gguf_value& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return *i;
  if (const auto* u = std::get_if<uint64_t>(&v))
    if (*u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return static_cast<int64_t>(*u);
  return std::nullopt;
}

std::optional<double> as_float(const gguf_value& v) {
  if (const auto* d = std::get_if<double>(&v)) return *d;
  if (const auto* i = std::get_if<int64_t>(&v)) return static_cast<double>(*i);
  if (const auto* u = std::get_if<uint64_t>(&v)) return static_cast<double>(*u);
  return std::nullopt;
}

/// The array at `key`, checked to hold elements accepted by `ok`.
const gguf_array* get_array(const gguf_file& f, std::string_view key, bool (*ok)(uint32_t), const char* want) {
  const gguf_value* v = f.find(key);
  if (v == nullptr) return nullptr;
  const auto* arr = std::get_if<std::shared_ptr<gguf_array>>(v);
  if (arr == nullptr || !ok((*arr)->elem_type)) type_mismatch(f, key, *v, want);
  return arr->get();
}

}  // namespace

std::optional<int64_t> gguf_file::get_int(std::string_view key) const {
  const gguf_value* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (auto i = as_int(*v)) return i;
  type_mismatch(*this, key, *v, "an integer (up to int64)");
}

std::optional<double> gguf_file::get_float(std::string_view key) const {
  const gguf_value* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (auto d = as_float(*v)) return d;
  type_mismatch(*this, key, *v, "a number");
}

std::optional<bool> gguf_file::get_bool(std::string_view key) const {
  const gguf_value* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (const auto* b = std::get_if<bool>(v)) return *b;
  type_mismatch(*this, key, *v, "a bool");
}

std::optional<std::string> gguf_file::get_string(std::string_view key) const {
  const gguf_value* v = find(key);
  if (v == nullptr) return std::nullopt;
  if (const auto* s = std::get_if<std::string>(v)) return *s;
  type_mismatch(*this, key, *v, "a string");
}

std::optional<std::vector<std::string>> gguf_file::get_string_array(std::string_view key) const {
  const gguf_array* arr = get_array(*this, key, [](uint32_t t) { return t == t_string; }, "an array of strings");
  if (arr == nullptr) return std::nullopt;
  std::vector<std::string> out;
  out.reserve(arr->items.size());
  for (const gguf_value& item : arr->items) out.push_back(std::get<std::string>(item));
  return out;
}

std::optional<std::vector<int64_t>> gguf_file::get_int_array(std::string_view key) const {
  const gguf_array* arr = get_array(*this, key, is_int_type, "an array of integers");
  if (arr == nullptr) return std::nullopt;
  std::vector<int64_t> out;
  out.reserve(arr->items.size());
  for (const gguf_value& item : arr->items) {
    const auto i = as_int(item);
    if (!i) fail("array element " + std::to_string(out.size()) + " exceeds int64 (key '" + std::string(key) + "')");
    out.push_back(*i);
  }
  return out;
}

std::optional<std::vector<float>> gguf_file::get_float_array(std::string_view key) const {
  const gguf_array* arr = get_array(
      *this, key, [](uint32_t t) { return t == t_f32 || t == t_f64 || is_int_type(t); }, "an array of numbers");
  if (arr == nullptr) return std::nullopt;
  std::vector<float> out;
  out.reserve(arr->items.size());
  for (const gguf_value& item : arr->items) out.push_back(static_cast<float>(*as_float(item)));
  return out;
}

}  // namespace troupe::engine
