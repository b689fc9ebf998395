// Status / Result<T>: the error convention of library code (see DESIGN.md "Errors").
// Library functions return [[nodiscard]] Status or Result<T>; SF_TRY propagates and keeps the
// first error with its file:line context. Exceptions only at process edges.
#pragma once
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace sf {

enum class Code { kOk = 0, kInvalidArgument, kNotFound, kIo, kCorrupt, kUnsupported, kOutOfRange,
                  kResourceExhausted, kInternal, kDeadlineExceeded, kAlreadyExists };

const char* code_name(Code c);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string msg, const char* file = nullptr, int line = 0);
  static Status ok() { return Status(); }
  bool is_ok() const { return code_ == Code::kOk; }
  explicit operator bool() const { return is_ok(); }
  Code code() const { return code_; }
  const std::string& message() const { return msg_; }
  // "corrupt: gguf: tensor 'x' offset 123 beyond file size 100 (gguf.cpp:88)"
  std::string to_string() const;

 private:
  Code code_ = Code::kOk;
  std::string msg_;
  const char* file_ = nullptr;
  int line_ = 0;
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status st) : v_(std::move(st)) {}   // NOLINT
  bool is_ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const {
    static const Status kOk;
    return is_ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }

 private:
  std::variant<Status, T> v_;
};

}  // namespace sf

#define SF_ERR(code, msg) ::sf::Status(::sf::Code::code, (msg), __FILE__, __LINE__)

#define SF_CONCAT_INNER(a, b) a##b
#define SF_CONCAT(a, b) SF_CONCAT_INNER(a, b)

// Propagate a non-ok Status.
#define SF_TRY(expr)                          \
  do {                                        \
    ::sf::Status sf_st_ = (expr);             \
    if (!sf_st_.is_ok()) return sf_st_;       \
  } while (0)

// SF_ASSIGN(auto x, result_expr): unwraps a Result<T> or returns its Status.
#define SF_ASSIGN_IMPL(tmp, decl, expr)     \
  auto tmp = (expr);                        \
  if (!tmp.is_ok()) return tmp.status();    \
  decl = std::move(tmp).value()
#define SF_ASSIGN(decl, expr) SF_ASSIGN_IMPL(SF_CONCAT(sf_r_, __LINE__), decl, expr)

// Validation helper: returns kInvalidArgument/kCorrupt with message when cond fails.
#define SF_ENSURE(cond, code, msg)                 \
  do {                                             \
    if (!(cond)) return SF_ERR(code, (msg));       \
  } while (0)
