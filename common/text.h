// Small text helpers shared by writers of JSON by hand (safetensors headers, worker summaries,
// results files).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace sf {

// s with each byte that does not start a well-formed UTF-8 sequence (RFC 3629: no overlong
// forms, surrogates or values past U+10FFFF; common/utf8.h) replaced by U+FFFD: text from files
// (a GGUF's name, a path) made fit for JSON and Prometheus readers, which refuse invalid UTF-8.
std::string utf8_repaired(std::string_view s);

// Appends s as a JSON string literal, quotes included: '"' and '\' escaped, control characters
// as \u00XX, everything else as is: bytes that are not UTF-8 make invalid JSON, which a writer
// that must not rename its keys (safetensors) detects and refuses; text from outside that may
// simply be shown goes through utf8_repaired first.
void json_escape(std::string_view s, std::string* out);
// The same, returned.
std::string json_quoted(std::string_view s);
// s with its control characters (below 0x20, and DEL) as \u00XX, everything else as is: text
// from outside (a line of an input file) shown in a one-line message, where a newline or a
// terminal escape would break the line.
std::string controls_escaped(std::string_view s);

// printf into a string of whatever length it needs.
__attribute__((format(printf, 1, 2))) std::string sformat(const char* fmt, ...);

// The current time in UTC, ISO 8601 to the second (2026-11-27T03:40:00Z): results' dates.
std::string now_iso8601();

// A byte count for people, in decimal units with three significant digits: "512 B", "1.50 MB",
// "23.4 GB", "1.20 TB"; negative counts as "unknown".
std::string human_bytes(int64_t n);

}  // namespace sf
