#include "engine/gguf.hpp"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

using namespace troupe::engine;
using Catch::Matchers::Contains;

namespace {

// ---- a minimal GGUF writer: every field explicit, so tests can corrupt any of them ----------

enum : uint32_t { u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7, str = 8, arr = 9,
                  u64 = 10, i64 = 11, f64 = 12 };

struct bytes {
  std::vector<uint8_t> b;
  template <class T>
  bytes& put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
    return *this;
  }
  bytes& put_str(const std::string& s, uint64_t len_override = 0) {
    put<uint64_t>(len_override ? len_override : s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  bytes& append(const bytes& o) {
    b.insert(b.end(), o.b.begin(), o.b.end());
    return *this;
  }
};

struct test_tensor {
  std::string name;
  std::vector<uint64_t> ne;
  uint32_t type = 0;
  uint64_t offset = 0;
  std::vector<uint8_t> data;  // placed at `offset` in the data section
};

struct gguf_builder {
  char magic[4] = {'G', 'G', 'U', 'F'};
  uint32_t version = 3;
  std::optional<uint64_t> n_kv_override, n_tensors_override;
  uint64_t alignment = 32;  // only for laying out data; write general.alignment to change the reader's
  uint64_t n_kv = 0;
  bytes kv;
  std::vector<test_tensor> tensors;

  /// A key with a raw value (its type id first).
  gguf_builder& add(const std::string& key, uint32_t type, const bytes& value) {
    kv.put_str(key).put(type).append(value);
    ++n_kv;
    return *this;
  }
  template <class T>
  gguf_builder& add_scalar(const std::string& key, uint32_t type, T v) { return add(key, type, bytes{}.put(v)); }
  gguf_builder& add_string(const std::string& key, const std::string& s) { return add(key, str, bytes{}.put_str(s)); }

  /// Appends a tensor at the next aligned offset after the previous one.
  gguf_builder& tensor(const std::string& name, std::vector<uint64_t> ne, uint32_t type, size_t n_bytes) {
    uint64_t off = 0;
    if (!tensors.empty()) off = (tensors.back().offset + tensors.back().data.size() + alignment - 1) / alignment * alignment;
    std::vector<uint8_t> data(n_bytes);
    for (size_t i = 0; i < n_bytes; ++i) data[i] = static_cast<uint8_t>(i * 7 + tensors.size());
    tensors.push_back({name, std::move(ne), type, off, std::move(data)});
    return *this;
  }

  std::vector<uint8_t> build() const {
    bytes out;
    out.b.insert(out.b.end(), magic, magic + 4);
    out.put(version).put<uint64_t>(n_tensors_override.value_or(tensors.size())).put<uint64_t>(n_kv_override.value_or(n_kv));
    out.append(kv);
    for (const test_tensor& t : tensors) {
      out.put_str(t.name).put<uint32_t>(t.ne.size());
      for (uint64_t d : t.ne) out.put(d);
      out.put(t.type).put(t.offset);
    }
    out.b.resize((out.b.size() + alignment - 1) / alignment * alignment);
    const size_t data_start = out.b.size();
    for (const test_tensor& t : tensors) {  // no padding after the last tensor: it ends the file
      if (t.data.empty()) continue;
      if (out.b.size() < data_start + t.offset + t.data.size()) out.b.resize(data_start + t.offset + t.data.size());
      std::memcpy(out.b.data() + data_start + t.offset, t.data.data(), t.data.size());
    }
    return out.b;
  }
};

/// A scratch file removed at the end of the test.
struct temp_file {
  std::string path;
  temp_file() {
    static int counter = 0;
    path = (std::filesystem::temp_directory_path() /
            ("troupe_gguf_test_" + std::to_string(getpid()) + "_" + std::to_string(counter++) + ".gguf"))
               .string();
  }
  ~temp_file() { std::filesystem::remove(path); }
  void write(const std::vector<uint8_t>& b, size_t n) const {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(n));
  }
  void write(const std::vector<uint8_t>& b) const { write(b, b.size()); }
  /// Rewrites the bytes in place (no truncation, much faster): b must be as long as the file.
  void overwrite(const std::vector<uint8_t>& b) const {
    std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
    f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  }
};

/// The message of the gguf_error that opening `b` throws ("" and a test failure when none is).
std::string open_error(const temp_file& f, const std::vector<uint8_t>& b) {
  f.write(b);
  try {
    gguf_file::open(f.path);
  } catch (const gguf_error& e) {
    return e.what();
  }
  FAIL("the file loaded");
  return "";
}

/// A valid file with two tensors and a key, the base of the corruption cases.
gguf_builder small_model() {
  gguf_builder g;
  g.add_string("general.architecture", "llama");
  g.tensor("tok", {64, 2}, 8, 2 * 2 * 34);  // Q8_0: 2 blocks a row, 2 rows
  g.tensor("w", {32, 3}, 0, 32 * 3 * 4);    // F32
  return g;
}

}  // namespace

TEST_CASE("gguf: a valid file round-trips metadata of every type and its tensors", "[gguf]") {
  gguf_builder g;
  g.add_scalar<uint8_t>("k.u8", u8, 200)
      .add_scalar<int8_t>("k.i8", i8, -100)
      .add_scalar<uint16_t>("k.u16", u16, 60000)
      .add_scalar<int16_t>("k.i16", i16, -30000)
      .add_scalar<uint32_t>("k.u32", u32, 4000000000u)
      .add_scalar<int32_t>("k.i32", i32, -2000000000)
      .add_scalar<float>("k.f32", f32, 1e-5f)
      .add_scalar<uint8_t>("k.bool", boolean, 1)
      .add_string("k.str", std::string("h\xc3\xa9llo\0x", 8))
      .add_scalar<uint64_t>("k.u64", u64, 1ull << 40)
      .add_scalar<uint64_t>("k.u64big", u64, std::numeric_limits<uint64_t>::max())
      .add_scalar<int64_t>("k.i64", i64, -(1ll << 50))
      .add_scalar<double>("k.f64", f64, 0.1)
      .add("k.ints", arr, bytes{}.put(i32).put<uint64_t>(3).put<int32_t>(-1).put<int32_t>(0).put<int32_t>(7))
      .add("k.bytes", arr, bytes{}.put(u8).put<uint64_t>(2).put<uint8_t>(255).put<uint8_t>(1))
      .add("k.floats", arr, bytes{}.put(f32).put<uint64_t>(2).put<float>(0.5f).put<float>(-2.f))
      .add("k.strs", arr, bytes{}.put(str).put<uint64_t>(3).put_str("a").put_str("").put_str("ccc"))
      .add("k.empty", arr, bytes{}.put(u64).put<uint64_t>(0))
      .add("k.nested", arr,
           bytes{}.put(arr).put<uint64_t>(2)
               .put(u8).put<uint64_t>(1).put<uint8_t>(9)
               .put(str).put<uint64_t>(1).put_str("x"))
      .add_scalar<uint32_t>("general.alignment", u32, 64);
  g.alignment = 64;
  g.tensor("a", {4, 3}, 0, 48).tensor("b", {64, 2}, 8, 136).tensor("c", {256}, 12, 144).tensor("d", {2, 3, 4}, 1, 48);
  g.tensor("e", {2, 1, 1, 3}, 30, 12);
  temp_file tf;
  const std::vector<uint8_t> file = g.build();
  tf.write(file);
  const auto f = gguf_file::open(tf.path);

  CHECK(f->version() == 3);
  CHECK(f->alignment() == 64);
  CHECK(f->file_size() == file.size());
  CHECK(f->keys().size() == g.n_kv);
  CHECK(f->keys().front() == "k.u8");
  CHECK(f->keys().back() == "general.alignment");

  CHECK(f->get_int("k.u8") == 200);
  CHECK(f->get_int("k.i8") == -100);
  CHECK(f->get_int("k.u16") == 60000);
  CHECK(f->get_int("k.i16") == -30000);
  CHECK(f->get_int("k.u32") == 4000000000ll);
  CHECK(f->get_int("k.i32") == -2000000000);
  CHECK(f->get_int("k.u64") == (1ll << 40));
  CHECK(f->get_int("k.i64") == -(1ll << 50));
  CHECK(std::get<uint64_t>(*f->find("k.u64big")) == std::numeric_limits<uint64_t>::max());
  CHECK(f->get_float("k.f32") == static_cast<double>(1e-5f));
  CHECK(f->get_float("k.f64") == 0.1);
  CHECK(f->get_float("k.i32") == -2e9);  // integers widen to float
  CHECK(f->get_bool("k.bool") == true);
  CHECK(f->get_string("k.str") == std::string("h\xc3\xa9llo\0x", 8));
  CHECK(f->get_int_array("k.ints") == std::vector<int64_t>{-1, 0, 7});
  CHECK(f->get_int_array("k.bytes") == std::vector<int64_t>{255, 1});
  CHECK(f->get_int_array("k.empty") == std::vector<int64_t>{});
  CHECK(f->get_float_array("k.floats") == std::vector<float>{0.5f, -2.f});
  CHECK(f->get_float_array("k.ints") == std::vector<float>{-1.f, 0.f, 7.f});
  CHECK(f->get_string_array("k.strs") == std::vector<std::string>{"a", "", "ccc"});
  const auto& nested = *std::get<std::shared_ptr<gguf_array>>(*f->find("k.nested"));
  REQUIRE(nested.items.size() == 2);
  CHECK(nested.elem_type == arr);
  CHECK(std::get<uint64_t>(std::get<std::shared_ptr<gguf_array>>(nested.items[0])->items.at(0)) == 9);
  CHECK(std::get<std::string>(std::get<std::shared_ptr<gguf_array>>(nested.items[1])->items.at(0)) == "x");

  CHECK_FALSE(f->get_int("absent"));
  CHECK_FALSE(f->get_string_array("absent"));
  CHECK_FALSE(f->has("absent"));
  CHECK(f->has("k.u8"));

  REQUIRE(f->tensors().size() == 5);
  const troupe::kernels::dtype types[] = {troupe::kernels::dtype::f32, troupe::kernels::dtype::q8_0,
                                          troupe::kernels::dtype::q4_k, troupe::kernels::dtype::f16,
                                          troupe::kernels::dtype::bf16};
  const size_t data_start = file.size() - (g.tensors.back().offset + g.tensors.back().data.size());
  CHECK(data_start % 64 == 0);
  for (size_t i = 0; i < g.tensors.size(); ++i) {
    const test_tensor& want = g.tensors[i];
    const gguf_tensor& got = f->tensors()[i];
    INFO(want.name);
    CHECK(got.name == want.name);
    CHECK(got.type == types[i]);
    CHECK(std::vector<uint64_t>(got.ne.begin(), got.ne.end()) == want.ne);
    CHECK(got.offset == want.offset);
    CHECK(got.offset % 64 == 0);
    CHECK(got.n_bytes == want.data.size());
    CHECK(got.data == f->tensors()[0].data + got.offset);
    CHECK(std::memcmp(got.data, file.data() + data_start + want.offset, want.data.size()) == 0);
    CHECK(std::memcmp(got.data, want.data.data(), want.data.size()) == 0);
    CHECK(f->find_tensor(want.name) == &got);
  }
  CHECK(f->tensors()[3].n_elements() == 24);
  CHECK(f->find_tensor("nope") == nullptr);
  const int64_t shape_b[] = {64, 2};
  CHECK(&f->tensor("b", shape_b) == &f->tensors()[1]);
  CHECK(&f->tensor("b") == &f->tensors()[1]);
}

TEST_CASE("gguf: getters and tensor() name the key or tensor on a mismatch", "[gguf]") {
  gguf_builder g = small_model();
  g.add_scalar<uint64_t>("big", u64, std::numeric_limits<uint64_t>::max())
      .add("big_arr", arr, bytes{}.put(u64).put<uint64_t>(1).put<uint64_t>(std::numeric_limits<uint64_t>::max()))
      .add("strs", arr, bytes{}.put(str).put<uint64_t>(1).put_str("s"))
      .add("ints", arr, bytes{}.put(i16).put<uint64_t>(1).put<int16_t>(5))
      .add_scalar<float>("flt", f32, 2.5f)
      .add_scalar<uint8_t>("flag", boolean, 0);
  temp_file tf;
  tf.write(g.build());
  const auto f = gguf_file::open(tf.path);
  auto msg = [&](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const gguf_error& e) {
      return e.what();
    }
    FAIL("no gguf_error");
    return "";
  };
  CHECK_THAT(msg([&] { f->get_int("general.architecture"); }), Contains(tf.path) && Contains("general.architecture"));
  CHECK_THAT(msg([&] { f->get_int("big"); }), Contains("'big'"));
  CHECK_THAT(msg([&] { f->get_int("flt"); }), Contains("'flt'") && Contains("float"));
  CHECK_THAT(msg([&] { f->get_int("flag"); }), Contains("'flag'"));
  CHECK_THAT(msg([&] { f->get_float("general.architecture"); }), Contains("general.architecture"));
  CHECK_THAT(msg([&] { f->get_bool("flt"); }), Contains("'flt'"));
  CHECK_THAT(msg([&] { f->get_string("flag"); }), Contains("'flag'"));
  CHECK_THAT(msg([&] { f->get_string_array("ints"); }), Contains("'ints'") && Contains("int16"));
  CHECK_THAT(msg([&] { f->get_int_array("strs"); }), Contains("'strs'"));
  CHECK_THAT(msg([&] { f->get_int_array("big_arr"); }), Contains("'big_arr'"));
  CHECK_THAT(msg([&] { f->get_float_array("strs"); }), Contains("'strs'"));
  CHECK_THAT(msg([&] { f->get_string_array("flt"); }), Contains("'flt'"));
  CHECK(f->get_int_array("ints") == std::vector<int64_t>{5});
  CHECK(f->get_float("flt") == 2.5);
  CHECK(f->get_bool("flag") == false);

  const int64_t wrong[] = {32, 4};
  CHECK_THAT(msg([&] { f->tensor("w", wrong); }), Contains(tf.path) && Contains("'w'") && Contains("[32, 3]") &&
                                                      Contains("[32, 4]"));
  const int64_t fewer[] = {32};
  CHECK_THAT(msg([&] { f->tensor("w", fewer); }), Contains("[32, 3]") && Contains("[32]"));
  CHECK_THAT(msg([&] { f->tensor("missing"); }), Contains(tf.path) && Contains("'missing'"));
}

TEST_CASE("gguf: version 2 loads like version 3", "[gguf]") {
  gguf_builder g = small_model();
  g.version = 2;
  temp_file tf;
  tf.write(g.build());
  const auto f = gguf_file::open(tf.path);
  CHECK(f->version() == 2);
  CHECK(f->tensors().size() == 2);
  CHECK(f->get_string("general.architecture") == "llama");
}

TEST_CASE("gguf: each corruption is one gguf_error naming the file and the culprit", "[gguf]") {
  temp_file tf;
  auto check = [&](gguf_builder g, std::vector<std::string> needles) {
    const std::string m = open_error(tf, g.build());
    INFO(m);
    CHECK_THAT(m, Contains(tf.path + ": "));
    for (const auto& n : needles) CHECK_THAT(m, Contains(n));
  };

  SECTION("missing file") {
    const std::string m = open_error(tf, {});  // empty file first
    CHECK_THAT(m, Contains(tf.path) && Contains("truncated"));
    std::filesystem::remove(tf.path);
    CHECK_THROWS_WITH(gguf_file::open(tf.path), Contains(tf.path) && Contains("cannot open"));
    CHECK_THROWS_WITH(gguf_file::open(std::filesystem::temp_directory_path().string()), Contains("not a regular file"));
  }
  SECTION("header") {
    gguf_builder g = small_model();
    g.magic[3] = 'G';
    check(g, {"magic"});
    g = small_model();
    g.version = 1;
    check(g, {"version 1"});
    g.version = 4;
    check(g, {"version 4"});
    g.version = 0x03000000;
    check(g, {"big-endian"});
    g = small_model();
    g.n_tensors_override = 1ull << 40;
    check(g, {"tensor count 1099511627776", "limit"});
    g = small_model();
    g.n_kv_override = 1ull << 62;
    check(g, {"metadata count", "limit"});
    g = small_model();
    g.n_kv_override = 2;  // one more key than the file holds: reads into the tensor table
    const std::string m = open_error(tf, g.build());
    CHECK_THAT(m, Contains(tf.path));
  }
  SECTION("metadata") {
    gguf_builder g = small_model();
    g.add("general.name", str, bytes{}.put<uint64_t>(1ull << 50));
    check(g, {"key 'general.name'", "truncated"});
    g = small_model();
    g.kv.put<uint64_t>(1ull << 20).put<uint32_t>(0);  // a key name longer than the limit
    ++g.n_kv;
    check(g, {"key #1", "limit"});
    g = small_model();
    g.add("tokens", arr, bytes{}.put(str).put<uint64_t>(1000).put_str("a"));
    check(g, {"key 'tokens'", "truncated", "1000"});
    g = small_model();
    g.add("tokens", arr, bytes{}.put(u8).put<uint64_t>(1ull << 40));
    check(g, {"key 'tokens'", "limit"});
    g = small_model();
    for (int k = 0; k < 5; ++k)  // each array within its limit, together too many elements
      g.add("a" + std::to_string(k), arr, bytes{}.put(u8).put<uint64_t>(1u << 22).append(bytes{std::vector<uint8_t>(1u << 22)}));
    check(g, {"key 'a4'", "in all"});
    g = small_model();
    g.add("t", 13, bytes{}.put<uint32_t>(0));
    check(g, {"key 't'", "unknown value type 13"});
    g = small_model();
    g.add("t", arr, bytes{}.put<uint32_t>(77).put<uint64_t>(0));
    check(g, {"key 't'", "unknown array element type 77"});
    g = small_model();
    g.add_string("general.architecture", "again");
    check(g, {"key 'general.architecture'", "duplicate"});
    g = small_model();
    g.add_scalar<uint8_t>("flag", boolean, 2);
    check(g, {"key 'flag'", "bool"});
    g = small_model();
    bytes deep;
    for (int i = 0; i < 20; ++i) deep.put(arr).put<uint64_t>(1);
    deep.put(u8).put<uint64_t>(0);
    g.add("deep", arr, deep);
    check(g, {"key 'deep'", "nested"});
  }
  SECTION("alignment") {
    for (uint32_t a : {0u, 3u, 48u, 1u << 31}) {
      gguf_builder g = small_model();
      g.add_scalar<uint32_t>("general.alignment", u32, a);
      check(g, {"key 'general.alignment'", std::to_string(a)});
    }
    gguf_builder g = small_model();
    g.add_string("general.alignment", "32");
    check(g, {"key 'general.alignment'", "string"});
  }
  SECTION("tensor table") {
    gguf_builder g = small_model();
    g.tensors[1].type = 99;
    check(g, {"tensor 'w'", "unsupported tensor type 99"});
    g = small_model();
    g.tensors[1].type = 7;  // Q5_1: a real ggml type troupe does not support
    check(g, {"tensor 'w'", "unsupported tensor type 7 (Q5_1)"});
    g = small_model();
    g.tensors[1].ne = {32, 1, 1, 1, 3};
    check(g, {"tensor 'w'", "5 dimensions"});
    g = small_model();
    g.tensors[1].ne = {};
    check(g, {"tensor 'w'", "0 dimensions"});
    g = small_model();
    g.tensors[1].ne = {32, 0};
    check(g, {"tensor 'w'", "dimension 1 is 0"});
    g = small_model();
    g.tensors[1].ne = {32, static_cast<uint64_t>(-3)};
    check(g, {"tensor 'w'", "dimension 1 is -3"});
    g = small_model();
    g.tensors[1].ne = {1ull << 40, 1ull << 40};
    check(g, {"tensor 'w'", "overflow"});
    g = small_model();
    g.tensors[0].ne = {48, 2};  // Q8_0 rows of 48 weights: not whole blocks
    check(g, {"tensor 'tok'", "48", "block size 32"});
    g = small_model();
    g.tensors[1].offset += 16;
    check(g, {"tensor 'w'", "alignment 32"});
    g = small_model();
    g.tensors[1].name = "tok";
    check(g, {"tensor 'tok'", "duplicate"});
    g = small_model();
    g.tensors[0].name = std::string(5000, 'x');
    check(g, {"tensor #0", "limit"});
  }
  SECTION("tensor data") {
    gguf_builder g = small_model();
    g.tensors[1].data.resize(g.tensors[1].data.size() - 1);  // file ends one byte short
    check(g, {"tensor 'w'", "truncated"});
    g = small_model();
    g.tensors[1].offset = 1ull << 60;
    g.tensors[1].data.clear();
    check(g, {"tensor 'w'", "past the end"});
    g = small_model();
    g.tensors[1].offset = static_cast<uint64_t>(-32);  // offset + size wraps around
    g.tensors[1].data.clear();
    check(g, {"tensor 'w'", "past the end"});
    g = small_model();
    g.tensors.push_back(g.tensors[0]);  // same bytes as 'tok', under another name
    g.tensors.back().name = "alias";
    g.tensors[1].data.resize(g.tensors[1].data.size() + 64);  // keep the file long enough
    check(g, {"'tok'", "'alias'", "overlap"});
    g = small_model();
    g.tensors[1].offset = 128;  // 'tok' takes [0, 136)
    check(g, {"'tok'", "'w'", "overlap"});
  }
}

TEST_CASE("gguf: every truncated prefix of a valid file is a gguf_error, never a crash", "[gguf]") {
  gguf_builder g = small_model();
  g.add("k.strs", arr, bytes{}.put(str).put<uint64_t>(2).put_str("one").put_str("two"))
      .add_scalar<float>("k.eps", f32, 1e-6f)
      .add("k.nested", arr, bytes{}.put(arr).put<uint64_t>(1).put(i32).put<uint64_t>(2).put<int32_t>(1).put<int32_t>(2));
  const std::vector<uint8_t> file = g.build();
  temp_file tf;
  tf.write(file);
  CHECK(gguf_file::open(tf.path)->tensors().size() == 2);
  for (size_t n = file.size(); n-- > 0;) {  // shrinking in place is much faster than rewriting
    INFO("prefix of " << n << " bytes");
    std::filesystem::resize_file(tf.path, n);
    try {
      gguf_file::open(tf.path);
      FAIL("a truncated file loaded");
    } catch (const gguf_error& e) {
      CHECK_THAT(e.what(), Contains(tf.path));
    }
  }
}

TEST_CASE("gguf: random byte corruption is rejected or loads within bounds", "[gguf]") {
  gguf_builder g = small_model();
  g.add("k.strs", arr, bytes{}.put(str).put<uint64_t>(2).put_str("one").put_str("two"));
  const std::vector<uint8_t> file = g.build();
  // Corrupt the header and tables, not the data.
  const size_t header_end = file.size() - (g.tensors.back().offset + g.tensors.back().data.size());
  temp_file tf;
  tf.write(file);
  std::mt19937 rng(42);
  int n_loaded = 0;
  for (int iter = 0; iter < 2000; ++iter) {
    std::vector<uint8_t> bad = file;
    const int n_flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < n_flips; ++k) bad[rng() % header_end] ^= static_cast<uint8_t>(1u << (rng() % 8));
    tf.overwrite(bad);
    try {
      const auto f = gguf_file::open(tf.path);
      ++n_loaded;
      for (const gguf_tensor& t : f->tensors()) {  // whatever loaded lies inside the file
        CHECK(t.offset + t.n_bytes <= f->file_size());
        unsigned sum = 0;  // touch every byte: outside the mapping this faults (or ASan reports)
        for (size_t i = 0; i < t.n_bytes; ++i) sum += t.data[i];
        CHECK(sum < 256u * t.n_bytes + 1);
      }
    } catch (const gguf_error& e) {
      CHECK_THAT(e.what(), Contains(tf.path));
    }
  }
  CHECK(n_loaded < 2000);  // the flips did reach fields that matter
}
