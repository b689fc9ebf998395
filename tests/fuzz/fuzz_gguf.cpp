// libFuzzer target: GgufFile::parse on arbitrary bytes. For an accepted file, every metadata value
// goes through the typed getters, every tensor's bytes are read (ASan flags a pointer that escapes
// the input), and the first row of each supported tensor is dequantized.
#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "worker/model/gguf.h"

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();  // an invariant of an accepted file broke: report as a crash
}

// Bounds the scratch row so one input cannot ask for gigabytes (rows are <= 2^40 elements).
constexpr uint64_t kMaxRow = uint64_t(1) << 20;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sf::model;
  sf::Result<GgufFile> r = GgufFile::parse(sf::ByteSpan{data, size});
  if (!r.is_ok()) {
    check(!r.status().message().empty());
    return 0;
  }
  const GgufFile& g = *r;
  volatile uint64_t sink = 0;
  for (const auto& [key, v] : g.metadata()) {
    check(g.find(key) == &v);
    sink = sink + key.size() + v.strings.size() + v.ints.size() + v.floats.size();
    if (const auto* s = std::get_if<std::string>(&v.scalar)) sink = sink + s->size();
    for (const std::string& s : v.strings) sink = sink + s.size();
    // Each getter either succeeds or reports a type mismatch; none may crash.
    (void)g.get_string(key);
    (void)g.get_int(key);
    (void)g.get_float(key);
    (void)g.get_bool(key);
    (void)g.get_string_array(key);
    (void)g.get_int_array(key);
  }
  check(g.alignment() > 0 && (g.alignment() & (g.alignment() - 1)) == 0);
  std::vector<float> row;
  for (const GgufTensorInfo& t : g.tensors()) {
    check(g.find_tensor(t.name) == &t);
    check(!t.dims.empty());
    (void)ggml_type_name(t.type);
    if (t.n_bytes == 0) continue;  // unsupported type: listed, never loaded
    check(t.data >= data && t.n_bytes <= size && uint64_t(t.data - data) <= size - t.n_bytes);
    check(ggml_row_bytes(t.type, t.dims[0]) * (t.numel() / t.dims[0]) == t.n_bytes);
    uint64_t acc = 0;
    for (uint64_t i = 0; i < t.n_bytes; ++i) acc += t.data[i];
    sink = sink + acc;
    const uint64_t n = t.dims[0];
    const uint64_t rb = ggml_row_bytes(t.type, n);
    if (rb == 0 || rb > t.n_bytes || n > kMaxRow) continue;
    row.assign(size_t(n), 0.f);
    check(dequantize_row(t.type, t.data, n, row.data()).is_ok());
    for (float x : row) sink = sink + (x == x ? 1 : 0);  // touch without casting NaN/inf to int
  }
  return 0;
}
