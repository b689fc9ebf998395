// safetensors reader and writer (https://huggingface.co/docs/safetensors): an 8-byte little-endian
// header length, a JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}},
// then the data section. KV shards are written in this format so Python users can load them with
// the `safetensors` package (DESIGN.md "KV files").
//
// The reader validates everything against the buffer size and never crashes on malformed input
// (fuzzed: tests/fuzz/fuzz_safetensors.cpp). Tensor data is not aligned in general (the format
// packs tensors back to back), so consumers must memcpy or check alignment before casting.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/mapped_file.h"
#include "common/status.h"

namespace sf {

// Bytes per element of a safetensors dtype string ("F32", "BF16", "I64", "BOOL", ...); 0 if the
// dtype is unknown or not byte-sized (sub-byte float formats are not supported).
size_t safetensors_dtype_size(std::string_view dtype);
// "F32", "F16", "BF16", "I32", "I64", "U8" for our DType.
const char* safetensors_dtype_name(DType t);
// The DType for a safetensors dtype string; kUnsupported for dtypes the engine has no DType for.
Result<DType> safetensors_to_dtype(std::string_view dtype);

struct SafetensorsTensor {
  std::string name;
  std::string dtype;              // safetensors spelling: "F32", "F16", "BF16", "I32", "I64", ...
  std::vector<int64_t> shape;     // row-major; empty for a scalar
  uint64_t begin = 0, end = 0;    // byte offsets within the data section
  const uint8_t* data = nullptr;  // start of the tensor's bytes (not necessarily aligned)

  uint64_t n_bytes() const { return end - begin; }
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Maps the file; the tensors' data pointers stay valid as long as this object lives.
  static Result<SafetensorsFile> open(const std::string& path);
  // The same over a mapping already made (e.g. one whose bytes were checksummed first); takes it.
  static Result<SafetensorsFile> open(MappedFile m);
  // Parses an in-memory file; bytes must outlive the returned object (no ownership taken).
  static Result<SafetensorsFile> parse(ByteSpan bytes);

  // Sorted by data offset (then name), so the order is deterministic and follows the file layout.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  uint64_t header_bytes() const { return header_bytes_; }  // JSON length, without the 8-byte prefix

 private:
  MappedFile file_;
  uint64_t header_bytes_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

// Collects tensors and metadata, then writes one file atomically: the bytes go to `path.tmp`,
// which is fsynced and renamed over `path`; on any error the temporary is removed, so a reader
// never sees a half-written file. Tensors are laid out back to back in the order they were added
// (no gaps, as the reference implementation requires); the header is padded with spaces so the
// data section starts at an 8-byte aligned offset.
class SafetensorsWriter {
 public:
  // `data` is not copied: it must stay valid until write() returns. Argument errors (bytes that
  // do not match shape x dtype, duplicate or reserved names, negative dims) are reported by
  // write().
  void add(std::string name, DType dtype, std::vector<int64_t> shape, const void* data,
           size_t bytes);
  void set_metadata(std::string key, std::string value);
  // Returns the XXH64 (seed 0) of the whole file as written.
  Result<uint64_t> write(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    const void* data;
    size_t bytes;
  };
  Result<std::string> header_json() const;

  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
  Status first_error_;  // the first argument error seen by add()
};

}  // namespace sf
