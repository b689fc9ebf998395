#include "worker/runtime/batch.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <boost/json.hpp>
#include <boost/json/basic_parser_impl.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "common/file_io.h"
#include "common/text.h"
#include "kvstore/kv_export.h"

namespace sf::runtime {
namespace json = boost::json;

Status validate_request_id(const std::string& id) {
  if (id.empty() || id.size() > 128)
    return SF_ERR(kInvalidArgument,
                  "field 'id' must have 1 to 128 characters, got " + std::to_string(id.size()));
  if (id[0] == '.') return SF_ERR(kInvalidArgument, "field 'id' must not start with '.'");
  for (char ch : id) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                    (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-';
    if (!ok)
      return SF_ERR(kInvalidArgument,
                    "field 'id' may hold only [A-Za-z0-9._-] (it names the output directory)");
  }
  // The worker writes DIR/<id>/, DIR/<id>.json and temporaries (files <id>.json.tmp.<6 random>,
  // directories <id>.partial-HOST-PID) beside them: an id must not be another id's file.
  const auto ends_with = [&](const char* s) {
    const size_t n = std::strlen(s);
    return id.size() >= n && id.compare(id.size() - n, n, s) == 0;
  };
  if (ends_with(".json") || ends_with(".tmp") || id.find(kvstore::kExportPartialTag) != std::string::npos)
    return SF_ERR(kInvalidArgument,
                  "field 'id' must not end in .json or .tmp or hold .partial- (the worker's own "
                  "files beside each output directory are named so)");
  return Status::ok();
}

namespace {

std::string lower_ascii(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = char(c - 'A' + 'a');
  return s;
}

// Boost.JSON keeps the last of an object's duplicate keys without a word, so a line naming
// "tokens" twice would run whichever came last. This pass over the line (no values built) finds
// the first key a line's top-level object repeats.
struct TopLevelKeys {
  static constexpr std::size_t max_array_size = std::size_t(-1);
  static constexpr std::size_t max_object_size = std::size_t(-1);
  static constexpr std::size_t max_string_size = std::size_t(-1);
  static constexpr std::size_t max_key_size = std::size_t(-1);
  using ec_t = boost::system::error_code;
  int depth = 0;
  std::string key;
  std::set<std::string> seen;
  std::string repeated;  // the first key seen twice at depth 1

  bool on_document_begin(ec_t&) { return true; }
  bool on_document_end(ec_t&) { return true; }
  bool on_array_begin(ec_t&) { return ++depth, true; }
  bool on_array_end(std::size_t, ec_t&) { return --depth, true; }
  bool on_object_begin(ec_t&) { return ++depth, true; }
  bool on_object_end(std::size_t, ec_t&) { return --depth, true; }
  bool on_string_part(json::string_view, std::size_t, ec_t&) { return true; }
  bool on_string(json::string_view, std::size_t, ec_t&) { return true; }
  bool on_key_part(json::string_view s, std::size_t, ec_t&) { return key.append(s), true; }
  bool on_key(json::string_view s, std::size_t, ec_t&) {
    key.append(s);
    if (depth == 1 && !seen.insert(key).second && repeated.empty()) repeated = key;
    key.clear();
    return true;
  }
  bool on_number_part(json::string_view, ec_t&) { return true; }
  bool on_int64(int64_t, json::string_view, ec_t&) { return true; }
  bool on_uint64(uint64_t, json::string_view, ec_t&) { return true; }
  bool on_double(double, json::string_view, ec_t&) { return true; }
  bool on_bool(bool, ec_t&) { return true; }
  bool on_null(ec_t&) { return true; }
  bool on_comment_part(json::string_view, ec_t&) { return true; }
  bool on_comment(json::string_view, ec_t&) { return true; }
};

Result<BatchRequest> parse_line(std::string_view line, DType compute) {
  boost::system::error_code ec;
  json::parse_options po;
  po.max_depth = 4;  // {"tokens": [..]} needs 2
  json::value v = json::parse(line, ec, {}, po);
  if (ec) return SF_ERR(kInvalidArgument, "invalid JSON: " + ec.message());
  if (!v.is_object()) return SF_ERR(kInvalidArgument, "a line must be a JSON object");
  {
    // (After the full parse, so this pass only ever sees valid JSON within the depth limit.)
    json::basic_parser<TopLevelKeys> keys(po);
    keys.write_some(false, line.data(), line.size(), ec);
    if (ec) return SF_ERR(kInternal, "batch line: key scan failed: " + ec.message());
    if (!keys.handler().repeated.empty())
      return SF_ERR(kInvalidArgument,
                    "field '" + keys.handler().repeated + "' appears twice");
  }
  const json::object& o = v.as_object();
  for (const auto& kv : o)
    if (kv.key() != "id" && kv.key() != "prompt" && kv.key() != "tokens" &&
        kv.key() != "retention" && kv.key() != "kv_dtype")
      return SF_ERR(kInvalidArgument, "unknown field '" + std::string(kv.key()) +
                                          "' (id, prompt, tokens, retention, kv_dtype)");
  BatchRequest r;
  const json::value* id = o.if_contains("id");
  if (!id) return SF_ERR(kInvalidArgument, "field 'id' is missing");
  if (!id->is_string()) return SF_ERR(kInvalidArgument, "field 'id' must be a string");
  r.id = std::string(id->as_string());
  SF_TRY(validate_request_id(r.id));
  const json::value* p = o.if_contains("prompt");
  const json::value* t = o.if_contains("tokens");
  if ((p != nullptr) == (t != nullptr))
    return SF_ERR(kInvalidArgument, "give exactly one of the fields 'prompt' and 'tokens'");
  if (p) {
    if (!p->is_string()) return SF_ERR(kInvalidArgument, "field 'prompt' must be a string");
    r.prompt = std::string(p->as_string());
    if (r.prompt.empty()) return SF_ERR(kInvalidArgument, "field 'prompt' is empty");
  } else {
    if (!t->is_array())
      return SF_ERR(kInvalidArgument, "field 'tokens' must be an array of token ids");
    const json::array& a = t->as_array();
    if (a.empty()) return SF_ERR(kInvalidArgument, "field 'tokens' is empty");
    for (size_t i = 0; i < a.size(); ++i) {
      int64_t x = -1;
      if (a[i].is_int64())
        x = a[i].as_int64();
      else if (a[i].is_uint64() && a[i].as_uint64() <= uint64_t(INT32_MAX))
        x = int64_t(a[i].as_uint64());
      if (x < 0 || x > INT32_MAX)
        return SF_ERR(kInvalidArgument,
                      "field 'tokens' item " + std::to_string(i) + " is not a token id");
      r.tokens.push_back(int32_t(x));
    }
    r.has_tokens = true;
  }
  if (const json::value* ret = o.if_contains("retention")) {
    if (!ret->is_string()) return SF_ERR(kInvalidArgument, "field 'retention' must be a string");
    auto pol = kvstore::retention_parse(std::string(ret->as_string()));
    if (!pol.is_ok())
      return SF_ERR(kInvalidArgument, "field 'retention': " + pol.status().message());
    r.retention = std::move(pol).value();
  }
  if (const json::value* e = o.if_contains("kv_dtype")) {
    if (!e->is_string()) return SF_ERR(kInvalidArgument, "field 'kv_dtype' must be a string");
    auto enc = kvstore::kv_encodings_parse(std::string(e->as_string()), compute);
    if (!enc.is_ok())
      return SF_ERR(kInvalidArgument, "field 'kv_dtype': " + enc.status().message());
    r.kv_dtype = enc.value();
  }
  return r;
}

}  // namespace

BatchFile parse_batch(const std::string& text, DType compute) {
  BatchFile f;
  int64_t line_no = 0;
  // A UTF-8 byte order mark (editors on Windows write one) is not part of line 1's JSON.
  size_t pos = text.starts_with("\xEF\xBB\xBF") ? 3 : 0;
  while (pos <= text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    std::string_view line(text.data() + pos, nl - pos);
    ++line_no;
    pos = nl + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) {
      if (nl == text.size()) break;
      continue;
    }
    auto r = parse_line(line, compute);
    if (!r.is_ok()) {
      // One line: a reason can quote the line's own keys and values.
      f.bad.push_back({line_no, controls_escaped(r.status().message())});
    } else {
      r->line = line_no;
      f.requests.push_back(std::move(r).value());
    }
    if (nl == text.size()) break;
  }
  return f;
}

std::vector<BatchRequest> first_of_each_id(std::vector<BatchRequest> requests,
                                           std::vector<BadLine>& bad) {
  std::set<std::string> seen;
  std::vector<BatchRequest> kept;
  kept.reserve(requests.size());
  for (auto& r : requests) {
    // Case-folded: on a case-insensitive filesystem (APFS, SMB) 'Doc' and 'doc' would share
    // one export and one summary.
    if (seen.insert(lower_ascii(r.id)).second)
      kept.push_back(std::move(r));
    else
      bad.push_back({r.line, "id '" + r.id + "' repeats an earlier line's (ids differing "
                                             "only in case count as one)"});
  }
  return kept;
}

std::string request_dir(const std::string& out_dir, const std::string& id) {
  return (std::filesystem::path(out_dir) / id).string();
}

namespace {
bool has_export(const std::string& out_dir, const std::string& id) {
  std::error_code ec;
  return std::filesystem::is_regular_file(
      std::filesystem::path(request_dir(out_dir, id)) / "manifest.json", ec);
}
// The summary's fingerprint, "" when there is no summary or it names none.
std::string summary_fingerprint(const std::string& out_dir, const std::string& id) {
  std::ifstream f(request_dir(out_dir, id) + ".json");
  std::string line;
  if (!f || !std::getline(f, line)) return "";
  boost::system::error_code ec;
  const boost::json::value v = boost::json::parse(line, ec);
  if (ec || !v.is_object()) return "";
  const boost::json::value* fp = v.as_object().if_contains("fingerprint");
  return fp && fp->is_string() ? std::string(fp->as_string()) : "";
}
}  // namespace

bool request_complete(const std::string& out_dir, const std::string& id,
                      const std::string& fingerprint) {
  return has_export(out_dir, id) && summary_fingerprint(out_dir, id) == fingerprint;
}

Result<int> lock_file(const std::string& path, const std::string& holder) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return SF_ERR(kIo, "cannot open the lock '" + path + "': " + std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string held;
    char buf[512] = {};
    const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
    if (n > 0) held = std::string(buf, size_t(n));
    while (!held.empty() && (held.back() == '\n' || held.back() == ' ')) held.pop_back();
    ::close(fd);
    if (err == EWOULDBLOCK) return SF_ERR(kAlreadyExists, held);
    // A filesystem without flock (Lustre's noflock, some FUSE mounts): no lock, not an error.
    if (err == ENOSYS || err == EOPNOTSUPP || err == ENOLCK) return -1;
    return SF_ERR(kIo, "cannot lock '" + path + "': " + std::strerror(err));
  }
  const std::string text = holder + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) != ssize_t(text.size()) ||
      ::fsync(fd) != 0) {
    // The lock holds either way; only the holder's name in another job's message is lost.
  }
  return fd;
}

Result<int> lock_output_dir(const std::string& out_dir) {
  const std::string path = (std::filesystem::path(out_dir) / ".sparsefill-worker.lock").string();
  auto l = lock_file(path, "pid " + std::to_string(::getpid()) + " on " + host_name());
  if (!l.is_ok() && l.status().code() == Code::kAlreadyExists) {
    const std::string& held = l.status().message();
    return SF_ERR(kAlreadyExists, "--out '" + out_dir + "' is in use by another sparsefill-worker job" +
                                      (held.empty() ? std::string() : " (" + held + ")") +
                                      "; give each job its own --out");
  }
  return l;
}

namespace {
namespace fs = std::filesystem;
bool all_alnum(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
  });
}
bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}
// Seconds since the entry, or anything directly in it, last changed (a live export writes a
// shard a layer, so its directory keeps changing).
double idle_seconds(const fs::path& p) {
  std::error_code ec;
  auto newest = fs::last_write_time(p, ec);
  if (ec) return 0;
  if (fs::is_directory(p, ec))
    for (fs::directory_iterator it(p, ec), end; !ec && it != end; it.increment(ec)) {
      const auto t = fs::last_write_time(it->path(), ec);
      if (!ec && t > newest) newest = t;
    }
  return std::chrono::duration<double>(fs::file_time_type::clock::now() - newest).count();
}
}  // namespace

bool stale_partial(const std::string& name, bool is_dir, const std::string& host,
                   const std::function<double()>& idle_s,
                   const std::function<bool(long)>& pid_alive) {
  // Summaries' temporaries: files <id>.json.tmp (earlier versions) or <id>.json.tmp.<6 random>
  // (write_file_atomic), renamed within milliseconds of their creation by a live writer.
  if (!is_dir) {
    const size_t t = name.rfind(".json.tmp");
    if (t == std::string::npos || t == 0) return false;
    const std::string rest = name.substr(t + 9);
    const bool tmp = rest.empty() || (rest.size() == 7 && rest[0] == '.' && all_alnum(rest.substr(1)));
    return tmp && idle_s() > kStaleTmpSeconds;
  }
  // Exports' temporaries: directories <id>.partial-HOST-PID (or <id>.partial-PID, earlier
  // versions). One of this host whose process is gone is stale now; any other once it has been
  // idle for kStalePartialSeconds (another host's job, or a flock that locks per host only).
  const size_t p = name.rfind(kvstore::kExportPartialTag);
  if (p == std::string::npos || p == 0) return false;
  const std::string tag = name.substr(p + kvstore::kExportPartialTag.size());
  const size_t dash = tag.rfind('-');
  const std::string pid = dash == std::string::npos ? tag : tag.substr(dash + 1);
  if (!all_digits(pid) || pid.size() > 9) return false;
  const std::string h = dash == std::string::npos ? std::string() : tag.substr(0, dash);
  if (!h.empty() && h == host && !pid_alive(std::stol(pid))) return true;
  return idle_s() > kStalePartialSeconds;
}

Result<int64_t> remove_stale_partials(const std::string& out_dir,
                                      std::vector<std::string>* not_removed) {
  const std::string host = host_name();
  const auto alive = [](long pid) { return ::kill(pid_t(pid), 0) == 0 || errno != ESRCH; };
  std::error_code ec;
  int64_t n = 0;
  std::vector<fs::path> stale;
  for (fs::directory_iterator it(out_dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::error_code e2;
    const bool dir = it->is_directory(e2) && !it->is_symlink(e2);
    const bool file = it->is_regular_file(e2) && !it->is_symlink(e2);
    if (!dir && !file) continue;
    const fs::path path = it->path();
    if (stale_partial(path.filename().string(), dir, host, [&] { return idle_seconds(path); },
                      alive))
      stale.push_back(path);
  }
  if (ec) return SF_ERR(kIo, "cannot list '" + out_dir + "': " + ec.message());
  // One entry that cannot go (another user's, a busy NFS file) must not stop the others, nor
  // every later job: it is reported and left.
  for (const auto& p : stale) {
    fs::remove_all(p, ec);
    if (!ec) {
      ++n;
    } else if (not_removed) {
      not_removed->push_back(p.string() + ": " + ec.message());
    }
  }
  return n;
}

std::string request_stale_reason(const std::string& out_dir, const std::string& id,
                                 const std::string& fingerprint) {
  if (!has_export(out_dir, id)) return "";
  const std::string had = summary_fingerprint(out_dir, id);
  if (had == fingerprint) return "";
  if (had.empty()) return "its export has no summary with a fingerprint";
  return "its export was made for other inputs (fingerprint " + had + ", now " + fingerprint + ")";
}

std::array<int, 2> scaled_sparse_capacity(std::array<int, 2> cap, int64_t from, int64_t to) {
  if (from <= 0 || to <= 0) return {0, 0};
  const auto up64 = [](int64_t x) { return (x + 63) / 64 * 64; };
  const int64_t most[2] = {up64((to + 63) / 64), up64(to)};
  std::array<int, 2> out{0, 0};
  for (int i = 0; i < 2; ++i) {
    if (cap[size_t(i)] <= 0) continue;
    const int64_t scaled = (int64_t(cap[size_t(i)]) * to + from - 1) / from;
    out[size_t(i)] = int(std::min(up64(scaled), most[i]));
  }
  return out;
}

bool host_memory_fits(int64_t host_kv_bytes, int64_t staging_bytes, int64_t staging_held,
                      int local_ranks, int64_t avail) {
  if (avail < 0) return true;
  const int64_t need =
      host_kv_bytes + int64_t(local_ranks) * std::max<int64_t>(0, staging_bytes - staging_held);
  return double(need) * 1.25 <= double(avail);
}

}  // namespace sf::runtime
