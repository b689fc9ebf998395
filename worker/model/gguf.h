// GGUF v3 reader: metadata, tensor infos, alignment. Every length and offset is checked against
// the buffer size; malformed input yields kCorrupt/kUnsupported, never a crash (fuzzed).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/mapped_file.h"
#include "common/status.h"

namespace sf::model {

enum class GgufValueType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

// ggml tensor types the loader understands (values are ggml's).
enum class GgmlType : uint32_t { kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kBF16 = 30 };
const char* ggml_type_name(uint32_t t);
// Bytes for n elements of type t (n must be a multiple of the block size); 0 if unsupported.
uint64_t ggml_row_bytes(uint32_t t, uint64_t n);

struct GgufValue {
  GgufValueType type = GgufValueType::kU8;
  std::variant<uint64_t, int64_t, double, bool, std::string> scalar;  // for non-arrays
  GgufValueType elem_type = GgufValueType::kU8;                        // for arrays
  std::vector<std::string> strings;                                    // string arrays
  std::vector<int64_t> ints;                                           // integer/bool arrays
  std::vector<double> floats;                                          // float arrays
};

struct GgufTensorInfo {
  std::string name;
  std::vector<uint64_t> dims;  // ggml order: dims[0] is the contiguous (row) length
  uint32_t type = 0;
  uint64_t offset = 0;         // relative to the data section
  uint64_t n_bytes = 0;
  const uint8_t* data = nullptr;
  uint64_t numel() const;
};

class GgufFile {
 public:
  static Result<GgufFile> open(const std::string& path);  // maps the file
  static Result<GgufFile> parse(ByteSpan bytes);          // no ownership of bytes

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(std::string_view name) const;
  const GgufValue* find(std::string_view key) const;

  // Typed getters: kNotFound if absent, kCorrupt if the type does not fit.
  Result<std::string> get_string(std::string_view key) const;
  Result<int64_t> get_int(std::string_view key) const;     // any integer type
  Result<double> get_float(std::string_view key) const;    // F32/F64 (ints accepted)
  Result<bool> get_bool(std::string_view key) const;
  Result<std::vector<std::string>> get_string_array(std::string_view key) const;
  Result<std::vector<int64_t>> get_int_array(std::string_view key) const;

 private:
  MappedFile file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, GgufValue> kv_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

// Dequantizes n elements (a multiple of the type's block size) of ggml type t into out (fp32).
Status dequantize_row(uint32_t t, const uint8_t* src, uint64_t n, float* out);

}  // namespace sf::model
