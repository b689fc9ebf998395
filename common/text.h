// Small text helpers shared by writers of JSON by hand (safetensors headers, worker summaries,
// results files).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace sf {

// Appends s as a JSON string literal, quotes included: '"' and '\' escaped, control characters
// as \u00XX, everything else (UTF-8 included) as is.
void json_escape(std::string_view s, std::string* out);
// The same, returned.
std::string json_quoted(std::string_view s);

// printf into a string of whatever length it needs.
__attribute__((format(printf, 1, 2))) std::string sformat(const char* fmt, ...);

// The current time in UTC, ISO 8601 to the second (2026-11-27T03:40:00Z): results' dates.
std::string now_iso8601();

// A byte count for people, in decimal units with three significant digits: "512 B", "1.50 MB",
// "23.4 GB", "1.20 TB"; negative counts as "unknown".
std::string human_bytes(int64_t n);

}  // namespace sf
