// A small GGUF writer for tests: builds files key by key and tensor by tensor, and records where
// each field sits so a test can corrupt exactly one of them. Thread-compatible.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace simpler::llm::testing {

class GgufBuilder {
 public:
  // Where the fields of the built file sit (byte offsets from the start of the file).
  struct Layout {
    uint64_t tensor_count_at = 8;
    uint64_t kv_count_at = 16;
    std::map<std::string, uint64_t> key_at;         // a key-value's key length
    std::map<std::string, uint64_t> value_type_at;  // its value type
    std::map<std::string, uint64_t> info_at;        // a tensor info's name length
    std::map<std::string, uint64_t> n_dims_at;
    std::map<std::string, uint64_t> type_at;
    std::map<std::string, uint64_t> offset_at;
    uint64_t data_at = 0;
  };

  void u32(std::string_view key, uint32_t v) { scalar(key, 4, &v, 4); }
  void i32(std::string_view key, int32_t v) { scalar(key, 5, &v, 4); }
  void f32(std::string_view key, float v) { scalar(key, 6, &v, 4); }
  void boolean(std::string_view key, bool v) {
    const uint8_t b = v;
    scalar(key, 7, &b, 1);
  }
  void u64(std::string_view key, uint64_t v) { scalar(key, 10, &v, 8); }
  void string(std::string_view key, std::string_view v) {
    begin(key, 8);
    put_string(kv_, v);
  }
  void strings(std::string_view key, const std::vector<std::string>& v) {
    begin(key, 9);
    put(kv_, uint32_t{8});
    put(kv_, uint64_t{v.size()});
    for (const std::string& s : v) put_string(kv_, s);
  }
  // An array of integers of gguf_type `type`, T its C++ type (uint8_t for 0, int8_t for 1, ...).
  template <class T>
  void ints(std::string_view key, uint32_t type, const std::vector<T>& v) {
    begin(key, 9);
    put(kv_, type);
    put(kv_, uint64_t{v.size()});
    kv_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  }
  void i32s(std::string_view key, const std::vector<int32_t>& v) { ints(key, 5, v); }

  // A tensor: `shape` row-major (written reversed, innermost first), `data` its bytes. Offsets
  // follow one another, each aligned to the file's alignment.
  void tensor(std::string_view name, std::vector<uint64_t> shape, uint32_t type, std::string data) {
    tensors_.push_back({std::string(name), std::move(shape), type, std::move(data)});
  }

  // The file's bytes (alignment: the one `general.alignment` says, default 32).
  std::string build(uint64_t alignment = 32) {
    std::string out = "GGUF";
    put(out, uint32_t{3});
    put(out, uint64_t{tensors_.size()});
    put(out, uint64_t{keys_.size()});
    for (const auto& [k, at] : kv_key_at_) layout.key_at[k] = at + out.size();
    for (const auto& [k, at] : kv_type_at_) layout.value_type_at[k] = at + out.size();
    out += kv_;
    uint64_t offset = 0;
    std::vector<uint64_t> offsets;
    for (const Tensor& t : tensors_) {
      layout.info_at[t.name] = out.size();
      put_string(out, t.name);
      layout.n_dims_at[t.name] = out.size();
      put(out, static_cast<uint32_t>(t.shape.size()));
      for (auto d = t.shape.rbegin(); d != t.shape.rend(); ++d) put(out, *d);
      layout.type_at[t.name] = out.size();
      put(out, t.type);
      layout.offset_at[t.name] = out.size();
      put(out, offset);
      offsets.push_back(offset);
      offset = (offset + t.data.size() + alignment - 1) / alignment * alignment;
    }
    out.resize((out.size() + alignment - 1) / alignment * alignment, '\0');
    layout.data_at = out.size();
    for (size_t i = 0; i < tensors_.size(); ++i) {
      out.resize(layout.data_at + offsets[i], '\0');
      out += tensors_[i].data;
    }
    return out;
  }

  Layout layout;

 private:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> shape;
    uint32_t type;
    std::string data;
  };
  template <class T>
  static void put(std::string& out, T v) {
    out.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  static void put_string(std::string& out, std::string_view s) {
    put(out, uint64_t{s.size()});
    out.append(s);
  }
  void begin(std::string_view key, uint32_t type) {
    kv_key_at_[std::string(key)] = kv_.size();
    put_string(kv_, key);
    kv_type_at_[std::string(key)] = kv_.size();
    put(kv_, type);
    keys_.emplace_back(key);
  }
  void scalar(std::string_view key, uint32_t type, const void* v, size_t n) {
    begin(key, type);
    kv_.append(static_cast<const char*>(v), n);
  }
  std::string kv_;
  std::vector<std::string> keys_;
  std::map<std::string, uint64_t> kv_key_at_, kv_type_at_;
  std::vector<Tensor> tensors_;
};

// Overwrites sizeof(T) bytes of `bytes` at `at` with `v`.
template <class T>
void poke(std::string& bytes, uint64_t at, T v) {
  std::memcpy(bytes.data() + at, &v, sizeof(T));
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace simpler::llm::testing
