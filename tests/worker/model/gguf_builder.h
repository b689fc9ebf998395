// Builds small GGUF v3 files in memory for loader tests (independent of the reader's code).
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace sf::testing {

class GgufBuilder {
 public:
  void kv_string(const std::string& k, const std::string& v) { key(k, 8); str(meta_, v); ++n_kv_; }
  void kv_u32(const std::string& k, uint32_t v) { key(k, 4); pod(meta_, v); ++n_kv_; }
  void kv_f32(const std::string& k, float v) { key(k, 6); pod(meta_, v); ++n_kv_; }
  void kv_bool(const std::string& k, bool v) { key(k, 7); pod(meta_, uint8_t(v)); ++n_kv_; }
  // F32 tensor; dims in ggml order (dims[0] contiguous).
  void tensor_f32(const std::string& name, std::vector<uint64_t> dims, const std::vector<float>& data) {
    tensor_raw(name, dims, 0, data.data(), data.size() * 4);
  }
  void tensor_raw(const std::string& name, std::vector<uint64_t> dims, uint32_t type, const void* p, size_t n) {
    str(infos_, name);
    pod(infos_, uint32_t(dims.size()));
    for (auto d : dims) pod(infos_, d);
    pod(infos_, type);
    pod(infos_, uint64_t(data_.size()));
    data_.insert(data_.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
    while (data_.size() % 32) data_.push_back(0);
    ++n_tensors_;
  }
  std::vector<uint8_t> build() const {
    std::vector<uint8_t> out;
    pod(out, uint32_t(0x46554747));
    pod(out, uint32_t(3));
    pod(out, n_tensors_);
    pod(out, n_kv_);
    out.insert(out.end(), meta_.begin(), meta_.end());
    out.insert(out.end(), infos_.begin(), infos_.end());
    while (out.size() % 32) out.push_back(0);
    out.insert(out.end(), data_.begin(), data_.end());
    return out;
  }

 private:
  template <typename T>
  static void pod(std::vector<uint8_t>& b, T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  static void str(std::vector<uint8_t>& b, const std::string& s) {
    pod(b, uint64_t(s.size()));
    b.insert(b.end(), s.begin(), s.end());
  }
  void key(const std::string& k, uint32_t type) {
    str(meta_, k);
    pod(meta_, type);
  }
  std::vector<uint8_t> meta_, infos_, data_;
  uint64_t n_kv_ = 0, n_tensors_ = 0;
};

}  // namespace sf::testing
