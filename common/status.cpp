#include "common/status.h"

#include <cstring>

namespace sf {

const char* code_name(Code c) {
  switch (c) {
    case Code::kOk: return "ok";
    case Code::kInvalidArgument: return "invalid argument";
    case Code::kNotFound: return "not found";
    case Code::kIo: return "io error";
    case Code::kCorrupt: return "corrupt";
    case Code::kUnsupported: return "unsupported";
    case Code::kOutOfRange: return "out of range";
    case Code::kResourceExhausted: return "resource exhausted";
    case Code::kInternal: return "internal";
    case Code::kDeadlineExceeded: return "deadline exceeded";
    case Code::kAlreadyExists: return "already exists";
  }
  return "unknown";
}

Status::Status(Code code, std::string msg, const char* file, int line)
    : code_(code), msg_(std::move(msg)), file_(file), line_(line) {}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  std::string s = std::string(code_name(code_)) + ": " + msg_;
  if (file_) {
    const char* base = std::strrchr(file_, '/');
    s += " (" + std::string(base ? base + 1 : file_) + ":" + std::to_string(line_) + ")";
  }
  return s;
}

}  // namespace sf
