// Read-only memory map of a whole file. Parsers take a byte span so they can be fuzzed on
// in-memory buffers as well as files.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace sf {

struct ByteSpan {
  const uint8_t* data = nullptr;
  size_t size = 0;
};

class MappedFile {
 public:
  MappedFile() = default;
  ~MappedFile();
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // populate: every page read in by the map call itself (MAP_POPULATE), for a caller about to
  // read the whole file (a checksum): one read-ahead instead of a fault per page.
  static Result<MappedFile> open(const std::string& path, bool populate = false);
  ByteSpan bytes() const { return {static_cast<const uint8_t*>(addr_), size_}; }
  const std::string& path() const { return path_; }

 private:
  void* addr_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

}  // namespace sf
