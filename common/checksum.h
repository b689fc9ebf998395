// XXH64 checksums (seed 0) of buffers and files: the checksum recorded in KV manifests.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/status.h"

namespace sf {

uint64_t xxh64_bytes(const void* data, size_t n);
// 16 lowercase hex digits: how manifests, summaries and fingerprints write a checksum.
std::string hex64(uint64_t v);
// Streams the file (no mapping), so it also works on files larger than the address space budget.
Result<uint64_t> xxh64_file(const std::string& path);

}  // namespace sf
