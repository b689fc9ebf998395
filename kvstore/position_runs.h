// Kept positions in an export's manifest (format 6, docs/kv-format.md): a head's ascending,
// disjoint [begin, end) runs as one string instead of a JSON array per run. Each run is two
// unsigned LEB128 varints, begin minus the previous run's end (the first run's begin itself) and
// end minus begin, and the byte stream is base64 (RFC 4648, padded). A scattered 1M-token
// retention is about 6x smaller than the JSON runs of formats 2-5, and a reader parses one string
// a head instead of two JSON numbers and an array a run (measured in test_kv_export).
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace sf::kvstore {

using PositionRun = std::pair<int64_t, int64_t>;  // [begin, end)

// The runs of ascending, distinct positions (consecutive positions make one run).
std::vector<PositionRun> position_runs(std::span<const int32_t> ascending);

// Encodes runs that are ascending, disjoint and non-empty (not checked here: the writer builds
// them with position_runs).
std::string encode_position_runs(std::span<const PositionRun> runs);

// Decodes and validates: base64 alphabet and padding, varints that end and fit, every run
// non-empty, ascending, disjoint and inside [0, n_tokens). kCorrupt names what is wrong.
Result<std::vector<PositionRun>> decode_position_runs(std::string_view text, int64_t n_tokens);

}  // namespace sf::kvstore
