#include "common/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace sf {

namespace fs = std::filesystem;

Result<std::string> read_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (fs::is_directory(path, ec))
    return SF_ERR(kInvalidArgument, what + " '" + path + "' is a directory, not a file");
  std::ifstream f(path, std::ios::binary);
  if (!f) return SF_ERR(kIo, "cannot read " + what + " '" + path + "': " + std::strerror(errno));
  std::ostringstream ss;
  ss << f.rdbuf();
  std::string text = ss.str();
  // A filebuf takes a read error for the end of the file: a regular file that gave fewer bytes
  // than its size is one (or was cut while read). /proc files say size 0, so are not checked.
  const std::uintmax_t size = fs::is_regular_file(path, ec) ? fs::file_size(path, ec) : 0;
  if (f.bad() || (!ec && text.size() < size))
    return SF_ERR(kIo, "cannot read " + what + " '" + path + "': read " +
                           std::to_string(text.size()) + " of " + std::to_string(size) + " bytes");
  return text;
}

namespace {
// The umask, read once without changing it (umask(2) would race other threads' creations).
mode_t process_umask() {
  static const mode_t m = [] {
    std::ifstream f("/proc/self/status");
    std::string line;
    while (std::getline(f, line))
      if (line.rfind("Umask:", 0) == 0) return mode_t(std::strtoul(line.c_str() + 6, nullptr, 8));
    return mode_t(022);
  }();
  return m;
}
}  // namespace

Status write_file_atomic(const std::string& path, std::string_view bytes) {
  if (path.empty()) return SF_ERR(kInvalidArgument, "cannot write a file with an empty name");
  // A name of its own (mkstemp: O_EXCL, never through a planted link), so two writers of one path
  // never write into each other's file; the last rename wins whole.
  std::string tmp = path + ".tmp.XXXXXX";  // mkstemp's template: it replaces the six X
  const int fd = ::mkostemp(tmp.data(), O_CLOEXEC);
  auto failed = [&](int err, const char* step) {
    ::unlink(tmp.c_str());
    return Status(err == ENOSPC || err == EDQUOT ? Code::kResourceExhausted : Code::kIo,
                  "cannot write '" + path + "' (" + step + " '" + tmp + "'): " +
                      std::strerror(err));
  };
  if (fd < 0) {
    const int err = errno;
    return Status(err == ENOSPC || err == EDQUOT ? Code::kResourceExhausted : Code::kIo,
                  "cannot write '" + path + "' (creating '" + path +
                                 ".tmp.<6 random characters>'): " + std::strerror(err));
  }
  // mkstemp creates 0600; results are read by other processes (a node_exporter): the mode an
  // open(..., 0666) would give under the process's umask.
  if (::fchmod(fd, 0666 & ~process_umask()) != 0) {
    const int err = errno;
    ::close(fd);
    return failed(err, "fchmod");
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
  // The rename is durable once its directory is synced (a summary or manifest said written must
  // not vanish at a power loss). Best effort: some filesystems refuse fsync on a directory, and
  // the file's own bytes are already synced.
  sync_dir(fs::path(path).parent_path().string());
  return Status::ok();
}

void sync_dir(const std::string& dir) {
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
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
  fs::path p = fs::absolute(dir, ec).lexically_normal();
  if (ec) return SF_ERR(kInvalidArgument, what + " '" + dir + "': " + ec.message());
  if (!p.has_filename()) p = p.parent_path();  // a trailing separator names the same directory
  if (fs::exists(p, ec) && !fs::is_directory(p, ec))
    return SF_ERR(kInvalidArgument, what + " '" + dir + "' exists and is not a directory");
  // DIR is built beside itself (DIR.partial-PID) and renamed into place: the nearest existing
  // ancestor of its parent must be a writable directory.
  p = p.parent_path();
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

bool path_within(const std::string& inner, const std::string& outer) {
  auto norm = [](const std::string& s, bool* ok) {
    std::error_code ec;
    fs::path p = fs::absolute(s, ec);
    if (!ec) p = fs::weakly_canonical(p, ec).lexically_normal();
    if (ec || p.empty()) *ok = false;
    if (!p.has_filename() && p.has_parent_path() && p != p.root_path()) p = p.parent_path();
    return p;
  };
  bool ok = true;
  const fs::path i = norm(inner, &ok), o = norm(outer, &ok);
  if (!ok) return false;  // unresolvable (EACCES, ELOOP): not known to overlap
  auto it = i.begin();
  for (const auto& part : o) {
    if (part.empty()) continue;  // a trailing separator's empty element
    if (it == i.end() || *it != part) return false;
    ++it;
  }
  return true;
}

std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return {};
  return host;
}

namespace {

// A number read from a one-line file ("max" and unreadable files: -1).
int64_t read_count(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  if (!(f >> s) || s.empty() || s == "max") return -1;
  char* end = nullptr;
  const long long x = std::strtoll(s.c_str(), &end, 10);
  return *end || x < 0 ? -1 : int64_t(x);
}

// Limit less usage of the memory cgroup at `dir`, or -1 where it sets no limit (or is absent).
int64_t cgroup_left_at(const std::string& dir, bool v1) {
  int64_t limit = read_count(dir + (v1 ? "/memory.limit_in_bytes" : "/memory.max"));
  const int64_t usage = read_count(dir + (v1 ? "/memory.usage_in_bytes" : "/memory.current"));
  if (v1 && limit >= (int64_t(1) << 60)) limit = -1;  // v1's "no limit" is a huge number
  return limit >= 0 && usage >= 0 ? std::max<int64_t>(0, limit - usage) : -1;
}

// What this process's memory cgroups still allow, or -1 without a limit: a job under Slurm,
// Docker or Kubernetes is killed at its cgroup's limit whatever the host has. A limit may sit on
// any ancestor (a systemd or Slurm slice above the job's step), so the least over the path to the
// root counts. Inside a container without a cgroup namespace, /proc/self/cgroup names the host's
// path ("/docker/<id>") while the container's own cgroup is mounted at the hierarchy's root: when
// that path is not there, the root is read instead.
int64_t cgroup_memory_left(const std::string& root) {
  std::ifstream f(root + "/proc/self/cgroup");
  std::string line;
  int64_t least = -1;
  while (std::getline(f, line)) {
    // v2: "0::/path"; v1: "N:memory:/path" (or "N:...,memory,...:/path").
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string ctrl = line.substr(a + 1, b - a - 1);
    const bool v1 = !ctrl.empty();
    if (v1 && ("," + ctrl + ",").find(",memory,") == std::string::npos) continue;
    const std::string mount = root + (v1 ? "/sys/fs/cgroup/memory" : "/sys/fs/cgroup");
    std::string path = line.substr(b + 1);
    std::error_code ec;
    if (!fs::is_directory(mount + path, ec)) path.assign(1, '/');  // the container's view (above)
    for (;;) {
      const int64_t left = cgroup_left_at(mount + path, v1);
      if (left >= 0) least = least < 0 ? left : std::min(least, left);
      const size_t cut = path.find_last_of('/');
      if (path.size() <= 1 || cut == std::string::npos) break;
      path = cut == 0 ? "/" : path.substr(0, cut);
    }
  }
  return least;
}

}  // namespace

int64_t host_memory_available(const std::string& root) {
  int64_t avail = -1;
  std::ifstream f(root + "/proc/meminfo");
  std::string line;
  while (std::getline(f, line))  // "MemAvailable:   12345678 kB"
    if (line.rfind("MemAvailable:", 0) == 0) {
      const long long kib = std::strtoll(line.c_str() + 13, nullptr, 10);
      if (kib > 0) avail = int64_t(kib) * 1024;
      break;
    }
  if (avail < 0 && root.empty()) {
    const long pages = ::sysconf(_SC_AVPHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) avail = int64_t(pages) * page;
  }
  const int64_t cg = cgroup_memory_left(root);
  return cg >= 0 && (avail < 0 || cg < avail) ? cg : avail;
}

std::string cpu_name(const std::string& root) {
  std::ifstream f(root + "/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const size_t p = line.find(':');
      const size_t b = p == std::string::npos ? p : line.find_first_not_of(" \t", p + 1);
      if (b != std::string::npos) return line.substr(b);  // (an empty name: the machine's)
    }
  utsname u{};
  uname(&u);
  return u.machine;
}

int exit_status_after_stdout(int rc) {
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  if (flushed && !std::ferror(stdout)) return rc;
  // errno names the flush's failure; an earlier buffered write's was not kept by stdio.
  if (!flushed && errno != 0)
    std::fprintf(stderr, "error: writing the standard output failed: %s\n", std::strerror(errno));
  else
    std::fprintf(stderr, "error: writing the standard output failed\n");
  return rc == 0 ? 1 : rc;
}

}  // namespace sf
