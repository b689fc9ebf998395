// libFuzzer target: SafetensorsFile::parse on arbitrary bytes. Any accepted file must describe
// tensors that lie inside the buffer and whose byte size matches shape x dtype; every byte of
// every tensor is read so ASan flags a pointer that escapes the input.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/safetensors.h"

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();  // an invariant of an accepted file broke: report as a crash
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  sf::Result<sf::SafetensorsFile> r = sf::SafetensorsFile::parse(sf::ByteSpan{data, size});
  if (!r.is_ok()) {
    check(!r.status().message().empty());
    return 0;
  }
  const sf::SafetensorsFile& f = *r;
  volatile uint64_t sink = 0;
  for (const auto& [k, v] : f.metadata()) sink = sink + k.size() + v.size();
  uint64_t prev_begin = 0;
  for (const sf::SafetensorsTensor& t : f.tensors()) {
    check(t.begin <= t.end && t.begin >= prev_begin);
    prev_begin = t.begin;
    check(t.data >= data && t.n_bytes() <= size && t.data - data <= ptrdiff_t(size - t.n_bytes()));
    const size_t es = sf::safetensors_dtype_size(t.dtype);
    check(es != 0);
    check(uint64_t(t.numel()) * es == t.n_bytes());
    const sf::SafetensorsTensor* found = f.find(t.name);
    check(found && found->name == t.name);
    uint64_t acc = 0;
    for (uint64_t i = 0; i < t.n_bytes(); ++i) acc += t.data[i];
    sink = sink + acc;
    (void)sf::safetensors_to_dtype(t.dtype);
  }
  return 0;
}
