#include "common/safetensors.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <boost/json.hpp>
#include <cerrno>
#include <cstring>
#include <limits>
#include <memory>

#include "common/text.h"

namespace sf {
namespace {

// A header larger than this is rejected before parsing (the reference implementation uses the
// same bound); it keeps a corrupt length field from driving a huge allocation.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

struct DTypeInfo {
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
    {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
    {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8},
};

std::string quoted(std::string_view s) {
  // Names come from untrusted files: keep messages printable and bounded.
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < 200; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    out += (c >= 0x20 && c < 0x7f) ? char(c) : '?';
  }
  if (s.size() > 200) out += "...";
  return out + "'";
}

// Non-negative JSON integer (int64 or uint64 kind); doubles are rejected.
bool json_u64(const boost::json::value& v, uint64_t* out) {
  if (v.is_int64()) {
    if (v.get_int64() < 0) return false;
    *out = uint64_t(v.get_int64());
    return true;
  }
  if (v.is_uint64()) {
    *out = v.get_uint64();
    return true;
  }
  return false;
}

Status parse_tensor(const std::string& where, std::string_view name, const boost::json::value& v,
                    uint64_t data_size, SafetensorsTensor* t) {
  const std::string tn = where + ": tensor " + quoted(name);
  const boost::json::object* o = v.if_object();
  SF_ENSURE(o, kCorrupt, tn + ": entry is not a JSON object");
  t->name = std::string(name);

  const boost::json::value* dt = o->if_contains("dtype");
  SF_ENSURE(dt, kCorrupt, tn + ": missing field 'dtype'");
  SF_ENSURE(dt->is_string(), kCorrupt, tn + ": field 'dtype' is not a string");
  t->dtype = std::string(dt->get_string());
  const size_t esize = safetensors_dtype_size(t->dtype);
  SF_ENSURE(esize != 0, kUnsupported, tn + ": unknown dtype " + quoted(t->dtype));

  const boost::json::value* sh = o->if_contains("shape");
  SF_ENSURE(sh, kCorrupt, tn + ": missing field 'shape'");
  SF_ENSURE(sh->is_array(), kCorrupt, tn + ": field 'shape' is not an array");
  // The product of the non-zero dims must fit int64 even when a zero dim makes numel 0, so
  // consumers can multiply any subset of dims without overflow.
  uint64_t nonzero_product = 1;
  bool overflow = false, has_zero = false;
  t->shape.clear();
  t->shape.reserve(sh->get_array().size());
  for (const boost::json::value& d : sh->get_array()) {
    uint64_t n = 0;
    SF_ENSURE(json_u64(d, &n), kCorrupt, tn + ": shape entries must be non-negative integers");
    SF_ENSURE(n <= uint64_t(std::numeric_limits<int64_t>::max()), kCorrupt,
              tn + ": shape entry " + std::to_string(n) + " too large");
    t->shape.push_back(int64_t(n));
    if (n == 0)
      has_zero = true;
    else if (__builtin_mul_overflow(nonzero_product, n, &nonzero_product))
      overflow = true;
  }
  uint64_t want_bytes = 0;
  if (__builtin_mul_overflow(nonzero_product, uint64_t(esize), &want_bytes)) overflow = true;
  SF_ENSURE(!overflow && want_bytes <= uint64_t(std::numeric_limits<int64_t>::max()), kCorrupt,
            tn + ": shape overflows the element count");
  if (has_zero) want_bytes = 0;

  const boost::json::value* off = o->if_contains("data_offsets");
  SF_ENSURE(off, kCorrupt, tn + ": missing field 'data_offsets'");
  SF_ENSURE(off->is_array() && off->get_array().size() == 2, kCorrupt,
            tn + ": field 'data_offsets' is not an array of two integers");
  SF_ENSURE(json_u64(off->get_array()[0], &t->begin) && json_u64(off->get_array()[1], &t->end),
            kCorrupt, tn + ": data_offsets must be non-negative integers");
  SF_ENSURE(
      t->begin <= t->end, kCorrupt,
      tn + ": data_offsets begin " + std::to_string(t->begin) + " > end " + std::to_string(t->end));
  SF_ENSURE(t->end <= data_size, kCorrupt,
            tn + ": data_offsets end " + std::to_string(t->end) + " beyond the data section (" +
                std::to_string(data_size) + " bytes)");
  SF_ENSURE(t->end - t->begin == want_bytes, kCorrupt,
            tn + ": data_offsets span " + std::to_string(t->end - t->begin) +
                " bytes but shape x dtype needs " + std::to_string(want_bytes));
  return Status::ok();
}

Status write_all(int fd, const void* p, size_t n, const std::string& path) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  while (n > 0) {
    const size_t chunk = std::min<size_t>(n, size_t(1) << 30);
    const ssize_t w = ::write(fd, b, chunk);
    if (w < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      return SF_ERR(kIo, "write '" + path + "': " + std::strerror(e));
    }
    b += w;
    n -= size_t(w);
  }
  return Status::ok();
}

struct XxhStateDeleter {
  void operator()(XXH64_state_t* s) const { XXH64_freeState(s); }
};

}  // namespace

size_t safetensors_dtype_size(std::string_view dtype) {
  for (const DTypeInfo& d : kDTypes)
    if (dtype == d.name) return d.size;
  return 0;
}

const char* safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kU8:
      return "U8";
  }
  return "?";
}

Result<DType> safetensors_to_dtype(std::string_view dtype) {
  if (dtype == "F32") return DType::kF32;
  if (dtype == "F16") return DType::kF16;
  if (dtype == "BF16") return DType::kBF16;
  if (dtype == "I32") return DType::kI32;
  if (dtype == "I64") return DType::kI64;
  if (dtype == "U8") return DType::kU8;
  return SF_ERR(kUnsupported, "safetensors dtype " + quoted(dtype) + " has no engine dtype");
}

int64_t SafetensorsTensor::numel() const {
  // Validated at parse time: the product of the non-zero dims fits int64.
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d == 0) return 0;
    n *= d;
  }
  return n;
}

namespace {

Status parse_impl(ByteSpan bytes, const std::string& where, std::vector<SafetensorsTensor>* tensors,
                  std::map<std::string, std::string>* metadata, uint64_t* header_bytes) {
  SF_ENSURE(bytes.data || bytes.size == 0, kInvalidArgument, where + ": null buffer");
  SF_ENSURE(bytes.size >= 8, kCorrupt,
            where + ": file is " + std::to_string(bytes.size) +
                " bytes, shorter than the 8-byte header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes.data[i];  // little-endian
  SF_ENSURE(n <= kMaxHeaderBytes, kCorrupt,
            where + ": header length " + std::to_string(n) + " exceeds the 100 MB limit");
  SF_ENSURE(n <= bytes.size - 8, kCorrupt,
            where + ": header length " + std::to_string(n) + " exceeds the file size " +
                std::to_string(bytes.size));
  SF_ENSURE(n >= 2, kCorrupt, where + ": header of " + std::to_string(n) + " bytes is too short");
  SF_ENSURE(bytes.data[8] == '{', kCorrupt, where + ": header does not start with '{'");
  *header_bytes = n;
  const uint64_t data_size = bytes.size - 8 - n;
  const uint8_t* data = bytes.data + 8 + n;

  boost::json::value root;
  try {
    boost::system::error_code ec;
    boost::json::parse_options opt;
    opt.max_depth = 8;  // the format needs 3 levels; bounds recursion on hostile input
    root = boost::json::parse(
        boost::json::string_view(reinterpret_cast<const char*>(bytes.data + 8), size_t(n)), ec, {},
        opt);
    if (ec) return SF_ERR(kCorrupt, where + ": header is not valid JSON: " + ec.message());
  } catch (const std::exception& e) {
    return SF_ERR(kResourceExhausted, where + ": parsing the header failed: " + e.what());
  }
  const boost::json::object* top = root.if_object();
  SF_ENSURE(top, kCorrupt, where + ": header is not a JSON object");

  tensors->reserve(top->size());
  for (const auto& kv : *top) {
    const std::string_view key(kv.key().data(), kv.key().size());
    if (key == "__metadata__") {
      const boost::json::object* m = kv.value().if_object();
      SF_ENSURE(m, kCorrupt, where + ": __metadata__ is not a JSON object");
      for (const auto& mkv : *m) {
        const std::string_view mk(mkv.key().data(), mkv.key().size());
        SF_ENSURE(mkv.value().is_string(), kCorrupt,
                  where + ": __metadata__ value for " + quoted(mk) + " is not a string");
        const boost::json::string& s = mkv.value().get_string();
        (*metadata)[std::string(mk)] = std::string(s.data(), s.size());
      }
      continue;
    }
    SafetensorsTensor t;
    SF_TRY(parse_tensor(where, key, kv.value(), data_size, &t));
    t.data = data + t.begin;
    tensors->push_back(std::move(t));
  }

  std::sort(tensors->begin(), tensors->end(),
            [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
              if (a.begin != b.begin) return a.begin < b.begin;
              if (a.end != b.end) return a.end < b.end;
              return a.name < b.name;
            });
  // Gaps are tolerated (harmless); overlaps are not. Empty tensors occupy no bytes.
  const SafetensorsTensor* prev = nullptr;
  for (const SafetensorsTensor& t : *tensors) {
    if (t.begin == t.end) continue;
    if (prev) {
      SF_ENSURE(t.begin >= prev->end, kCorrupt,
                where + ": tensors " + quoted(prev->name) + " [" + std::to_string(prev->begin) +
                    ", " + std::to_string(prev->end) + ") and " + quoted(t.name) + " [" +
                    std::to_string(t.begin) + ", " + std::to_string(t.end) + ") overlap");
    }
    prev = &t;
  }
  return Status::ok();
}

}  // namespace

Result<SafetensorsFile> SafetensorsFile::parse(ByteSpan bytes) {
  SafetensorsFile f;
  SF_TRY(parse_impl(bytes, "safetensors", &f.tensors_, &f.metadata_, &f.header_bytes_));
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);
  return f;
}

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  SF_ASSIGN(MappedFile m, MappedFile::open(path));
  return open(std::move(m));
}

Result<SafetensorsFile> SafetensorsFile::open(MappedFile m) {
  SafetensorsFile f;
  SF_TRY(parse_impl(m.bytes(), "safetensors '" + m.path() + "'", &f.tensors_, &f.metadata_,
                    &f.header_bytes_));
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);
  // Moving the mapping keeps its address, so the data pointers stay valid.
  f.file_ = std::move(m);
  return f;
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

// ---- writer ----------------------------------------------------------------------------------

void SafetensorsWriter::add(std::string name, DType dtype, std::vector<int64_t> shape,
                            const void* data, size_t bytes) {
  auto fail = [&](const std::string& msg) {
    if (first_error_.is_ok())
      first_error_ =
          SF_ERR(kInvalidArgument, "safetensors writer: tensor " + quoted(name) + ": " + msg);
  };
  if (name == "__metadata__") return fail("name is reserved");
  for (const Entry& e : entries_)
    if (e.name == name) return fail("added twice");
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) return fail("negative dim " + std::to_string(d));
    if (__builtin_mul_overflow(numel, uint64_t(d), &numel)) return fail("shape overflows");
  }
  uint64_t want = 0;
  if (__builtin_mul_overflow(numel, uint64_t(dtype_size(dtype)), &want))
    return fail("shape overflows");
  if (want != bytes)
    return fail(std::to_string(bytes) + " bytes given but shape x " + dtype_name(dtype) +
                " needs " + std::to_string(want));
  if (bytes > 0 && !data) return fail("null data");
  entries_.push_back({std::move(name), dtype, std::move(shape), data, bytes});
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

Result<std::string> SafetensorsWriter::header_json() const {
  std::string h = "{";
  if (!metadata_.empty()) {
    h += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata_) {
      if (!first) h += ',';
      first = false;
      json_escape(k, &h);
      h += ':';
      json_escape(v, &h);
    }
    h += '}';
  }
  uint64_t off = 0;
  for (const Entry& e : entries_) {
    if (h.size() > 1) h += ',';
    json_escape(e.name, &h);
    h += ":{\"dtype\":\"";
    h += safetensors_dtype_name(e.dtype);
    h += "\",\"shape\":[";
    for (size_t i = 0; i < e.shape.size(); ++i) {
      if (i) h += ',';
      h += std::to_string(e.shape[i]);
    }
    h += "],\"data_offsets\":[" + std::to_string(off) + "," + std::to_string(off + e.bytes) + "]}";
    off += e.bytes;
  }
  h += '}';
  // Pad so that 8 + header length is a multiple of 8: the data section starts aligned.
  h.append((8 - h.size() % 8) % 8, ' ');
  SF_ENSURE(h.size() <= kMaxHeaderBytes, kInvalidArgument,
            "safetensors writer: header of " + std::to_string(h.size()) +
                " bytes exceeds the 100 MB limit");
  // Names and metadata must be valid UTF-8 for any reader to accept the file; checking the header
  // here is cheap and catches it before anything touches the disk.
  boost::system::error_code ec;
  try {
    boost::json::parse(boost::json::string_view(h), ec);
  } catch (const std::exception& e) {
    return SF_ERR(kResourceExhausted, std::string("safetensors writer: ") + e.what());
  }
  SF_ENSURE(!ec, kInvalidArgument,
            "safetensors writer: a tensor name or metadata entry is not valid UTF-8 (" +
                ec.message() + ")");
  return h;
}

Result<uint64_t> SafetensorsWriter::write(const std::string& path) const {
  SF_TRY(first_error_);
  SF_ASSIGN(const std::string header, header_json());

  std::unique_ptr<XXH64_state_t, XxhStateDeleter> xs(XXH64_createState());
  SF_ENSURE(xs, kResourceExhausted, "safetensors writer: cannot allocate hash state");
  XXH64_reset(xs.get(), 0);

  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int e = errno;
    return SF_ERR(kIo, "safetensors writer: cannot create '" + tmp + "': " + std::strerror(e));
  }
  auto body = [&]() -> Status {
    uint8_t len[8];
    const uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) len[i] = uint8_t(n >> (8 * i));
    SF_TRY(write_all(fd, len, 8, tmp));
    XXH64_update(xs.get(), len, 8);
    SF_TRY(write_all(fd, header.data(), header.size(), tmp));
    XXH64_update(xs.get(), header.data(), header.size());
    for (const Entry& e : entries_) {
      if (e.bytes == 0) continue;
      SF_TRY(write_all(fd, e.data, e.bytes, tmp));
      XXH64_update(xs.get(), e.data, e.bytes);
    }
    if (::fsync(fd) != 0) {
      const int e = errno;
      return SF_ERR(kIo, "safetensors writer: fsync '" + tmp + "': " + std::strerror(e));
    }
    return Status::ok();
  };
  Status st = body();
  if (::close(fd) != 0 && st.is_ok()) {
    const int e = errno;
    st = SF_ERR(kIo, "safetensors writer: close '" + tmp + "': " + std::strerror(e));
  }
  if (st.is_ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    st = SF_ERR(kIo,
                "safetensors writer: rename '" + tmp + "' to '" + path + "': " + std::strerror(e));
  }
  if (!st.is_ok()) {
    ::unlink(tmp.c_str());
    return st;
  }
  return uint64_t(XXH64_digest(xs.get()));
}

}  // namespace sf
