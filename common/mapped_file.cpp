#include "common/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace sf {

MappedFile::~MappedFile() {
  if (addr_ && size_) munmap(addr_, size_);
}
MappedFile::MappedFile(MappedFile&& o) noexcept : addr_(o.addr_), size_(o.size_), path_(std::move(o.path_)) {
  o.addr_ = nullptr;
  o.size_ = 0;
}
MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    if (addr_ && size_) munmap(addr_, size_);
    addr_ = o.addr_; size_ = o.size_; path_ = std::move(o.path_);
    o.addr_ = nullptr; o.size_ = 0;
  }
  return *this;
}

Result<MappedFile> MappedFile::open(const std::string& path, bool populate) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    return SF_ERR(kIo, "cannot open '" + path + "': " + std::strerror(e));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return SF_ERR(kIo, "'" + path + "' is not a regular file");
  }
  MappedFile f;
  f.path_ = path;
  f.size_ = size_t(st.st_size);
  if (f.size_ > 0) {
    void* p = mmap(nullptr, f.size_, PROT_READ, MAP_PRIVATE | (populate ? MAP_POPULATE : 0), fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      return SF_ERR(kIo, "cannot map '" + path + "': " + std::strerror(e));
    }
    f.addr_ = p;
  }
  ::close(fd);
  return f;
}

}  // namespace sf
