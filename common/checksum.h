// XXH64 checksums (seed 0) of buffers and files: the checksum recorded in KV manifests.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace sf {

uint64_t xxh64_bytes(const void* data, size_t n);
// Streams the file (no mapping), so it also works on files larger than the address space budget.
Result<uint64_t> xxh64_file(const std::string& path);

}  // namespace sf
