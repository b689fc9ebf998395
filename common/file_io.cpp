#include "common/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace sf {
namespace fs = std::filesystem;

Status write_file_atomic(const std::string& path, std::string_view bytes) {
  if (path.empty()) return SF_ERR(kInvalidArgument, "cannot write a file with an empty name");
  const std::string tmp = path + ".tmp";
  auto failed = [&](int err, const char* step) {
    ::unlink(tmp.c_str());
    return Status(err == ENOSPC ? Code::kResourceExhausted : Code::kIo,
                  "cannot write '" + path + "' (" + step + " '" + tmp + "'): " +
                      std::strerror(err));
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    return Status(Code::kIo, "cannot write '" + path + "' (creating '" + tmp + "'): " +
                                 std::strerror(err));
  }
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      return failed(err, "writing");
    }
    done += size_t(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return failed(err, "syncing");
  }
  if (::close(fd) != 0) return failed(errno, "closing");
  if (::rename(tmp.c_str(), path.c_str()) != 0) return failed(errno, "renaming");
  return Status::ok();
}

Status check_output_file(const std::string& path, const std::string& what) {
  if (path.empty() || path.back() == '/')
    return SF_ERR(kInvalidArgument, what + " '" + path + "' does not name a file");
  std::error_code ec;
  if (fs::is_directory(path, ec))
    return SF_ERR(kInvalidArgument, what + " '" + path + "' is a directory, not a file");
  const fs::path parent = fs::path(path).parent_path();
  const std::string dir = parent.empty() ? "." : parent.string();
  if (!fs::is_directory(dir, ec))
    return SF_ERR(kInvalidArgument,
                  what + " '" + path + "': its directory '" + dir + "' does not exist");
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    return SF_ERR(kInvalidArgument, what + " '" + path + "': its directory '" + dir +
                                        "' is not writable: " + std::strerror(errno));
  return Status::ok();
}

Status check_output_dir(const std::string& dir, const std::string& what) {
  if (dir.empty()) return SF_ERR(kInvalidArgument, what + " is empty");
  std::error_code ec;
  fs::path p = fs::absolute(dir, ec);
  if (ec) return SF_ERR(kInvalidArgument, what + " '" + dir + "': " + ec.message());
  // The directory itself, or the nearest ancestor that exists, must be a writable directory.
  for (;;) {
    const auto st = fs::status(p, ec);
    if (fs::exists(st)) {
      if (!fs::is_directory(st))
        return SF_ERR(kInvalidArgument, what + " '" + dir + "': '" + p.string() +
                                            "' exists and is not a directory");
      if (::access(p.c_str(), W_OK | X_OK) != 0)
        return SF_ERR(kInvalidArgument, what + " '" + dir + "': '" + p.string() +
                                            "' is not writable: " + std::strerror(errno));
      return Status::ok();
    }
    if (!p.has_parent_path() || p.parent_path() == p)
      return SF_ERR(kInvalidArgument, what + " '" + dir + "': no existing parent directory");
    p = p.parent_path();
  }
}

}  // namespace sf
