#include "common/checksum.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

namespace sf {

uint64_t xxh64_bytes(const void* data, size_t n) { return uint64_t(XXH64(data, n, 0)); }

std::string hex64(uint64_t v) {
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

Result<uint64_t> xxh64_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    return SF_ERR(kIo, "cannot open '" + path + "': " + std::strerror(e));
  }
  struct StateDeleter {
    void operator()(XXH64_state_t* s) const { XXH64_freeState(s); }
  };
  std::unique_ptr<XXH64_state_t, StateDeleter> st(XXH64_createState());
  if (!st) {
    ::close(fd);
    return SF_ERR(kResourceExhausted, "cannot allocate hash state");
  }
  XXH64_reset(st.get(), 0);
  std::vector<uint8_t> buf(size_t(1) << 20);
  for (;;) {
    const ssize_t r = ::read(fd, buf.data(), buf.size());
    if (r < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      ::close(fd);
      return SF_ERR(kIo, "read '" + path + "': " + std::strerror(e));
    }
    if (r == 0) break;
    XXH64_update(st.get(), buf.data(), size_t(r));
  }
  ::close(fd);
  return uint64_t(XXH64_digest(st.get()));
}

}  // namespace sf
