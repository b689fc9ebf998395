#include "worker/model/gguf.h"

#include "common/dtype.h"

#include <algorithm>
#include <cstring>
#include <limits>

namespace sf::model {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
// Caps that keep a hostile header from making us allocate unbounded memory before we notice.
constexpr uint64_t kMaxStringLen = 64ull << 20;
constexpr uint64_t kMaxArrayLen = 1ull << 28;
constexpr uint64_t kMaxDims = 4;

// Bounds-checked cursor over the file bytes.
class Reader {
 public:
  explicit Reader(ByteSpan b) : b_(b) {}
  size_t pos() const { return pos_; }
  size_t remaining() const { return b_.size - pos_; }

  template <typename T>
  Status read(T* out, const char* what) {
    if (remaining() < sizeof(T)) return trunc(what);
    std::memcpy(out, b_.data + pos_, sizeof(T));
    pos_ += sizeof(T);
    return Status::ok();
  }
  Status read_string(std::string* out, const char* what) {
    uint64_t n = 0;
    SF_TRY(read(&n, what));
    if (n > kMaxStringLen) return SF_ERR(kCorrupt, std::string("gguf: ") + what + " length " + std::to_string(n) + " too large");
    if (remaining() < n) return trunc(what);
    out->assign(reinterpret_cast<const char*>(b_.data + pos_), size_t(n));
    pos_ += size_t(n);
    return Status::ok();
  }
  Status trunc(const char* what) const {
    return SF_ERR(kCorrupt, std::string("gguf: truncated while reading ") + what + " at byte " + std::to_string(pos_) +
                                " of " + std::to_string(b_.size));
  }

 private:
  ByteSpan b_;
  size_t pos_ = 0;
};

size_t scalar_size(GgufValueType t) {
  switch (t) {
    case GgufValueType::kU8: case GgufValueType::kI8: case GgufValueType::kBool: return 1;
    case GgufValueType::kU16: case GgufValueType::kI16: return 2;
    case GgufValueType::kU32: case GgufValueType::kI32: case GgufValueType::kF32: return 4;
    case GgufValueType::kU64: case GgufValueType::kI64: case GgufValueType::kF64: return 8;
    default: return 0;
  }
}

bool is_int_type(GgufValueType t) {
  switch (t) {
    case GgufValueType::kU8: case GgufValueType::kI8: case GgufValueType::kU16: case GgufValueType::kI16:
    case GgufValueType::kU32: case GgufValueType::kI32: case GgufValueType::kU64: case GgufValueType::kI64:
      return true;
    default: return false;
  }
}

// Reads one scalar of type t as (uint, int, double, bool) depending on its kind.
Status read_scalar(Reader& r, GgufValueType t, GgufValue* v, const std::string& key) {
  const char* what = "metadata value";
  switch (t) {
    case GgufValueType::kU8: { uint8_t x = 0; SF_TRY(r.read(&x, what)); v->scalar = uint64_t(x); break; }
    case GgufValueType::kI8: { int8_t x = 0; SF_TRY(r.read(&x, what)); v->scalar = int64_t(x); break; }
    case GgufValueType::kU16: { uint16_t x = 0; SF_TRY(r.read(&x, what)); v->scalar = uint64_t(x); break; }
    case GgufValueType::kI16: { int16_t x = 0; SF_TRY(r.read(&x, what)); v->scalar = int64_t(x); break; }
    case GgufValueType::kU32: { uint32_t x = 0; SF_TRY(r.read(&x, what)); v->scalar = uint64_t(x); break; }
    case GgufValueType::kI32: { int32_t x = 0; SF_TRY(r.read(&x, what)); v->scalar = int64_t(x); break; }
    case GgufValueType::kU64: { uint64_t x = 0; SF_TRY(r.read(&x, what)); v->scalar = x; break; }
    case GgufValueType::kI64: { int64_t x = 0; SF_TRY(r.read(&x, what)); v->scalar = x; break; }
    case GgufValueType::kF32: { float x = 0; SF_TRY(r.read(&x, what)); v->scalar = double(x); break; }
    case GgufValueType::kF64: { double x = 0; SF_TRY(r.read(&x, what)); v->scalar = x; break; }
    case GgufValueType::kBool: {
      uint8_t x = 0; SF_TRY(r.read(&x, what));
      if (x > 1) return SF_ERR(kCorrupt, "gguf: metadata '" + key + "' has bool value " + std::to_string(x));
      v->scalar = bool(x);
      break;
    }
    case GgufValueType::kString: { std::string s; SF_TRY(r.read_string(&s, "metadata string")); v->scalar = std::move(s); break; }
    default:
      return SF_ERR(kCorrupt, "gguf: metadata '" + key + "' has unknown value type " + std::to_string(uint32_t(t)));
  }
  return Status::ok();
}

Status read_value(Reader& r, GgufValue* v, const std::string& key) {
  uint32_t t = 0;
  SF_TRY(r.read(&t, "metadata value type"));
  v->type = GgufValueType(t);
  if (v->type != GgufValueType::kArray) return read_scalar(r, v->type, v, key);

  uint32_t et = 0;
  uint64_t n = 0;
  SF_TRY(r.read(&et, "array element type"));
  SF_TRY(r.read(&n, "array length"));
  v->elem_type = GgufValueType(et);
  if (n > kMaxArrayLen) return SF_ERR(kCorrupt, "gguf: metadata '" + key + "' array length " + std::to_string(n) + " too large");
  if (v->elem_type == GgufValueType::kArray)
    return SF_ERR(kUnsupported, "gguf: metadata '" + key + "' is a nested array");
  if (v->elem_type == GgufValueType::kString) {
    // Each string needs at least its 8-byte length: reject impossible counts before reserving.
    if (n > r.remaining() / 8) return r.trunc("string array");
    v->strings.reserve(size_t(std::min<uint64_t>(n, 1 << 20)));  // grows past a vocabulary's size
    for (uint64_t i = 0; i < n; ++i) {
      std::string s;
      SF_TRY(r.read_string(&s, "array string"));
      v->strings.push_back(std::move(s));
    }
    return Status::ok();
  }
  const size_t es = scalar_size(v->elem_type);
  if (es == 0) return SF_ERR(kCorrupt, "gguf: metadata '" + key + "' has unknown array element type " + std::to_string(et));
  if (n > r.remaining() / es) return r.trunc("array data");
  GgufValue tmp;
  for (uint64_t i = 0; i < n; ++i) {
    SF_TRY(read_scalar(r, v->elem_type, &tmp, key));
    if (auto* u = std::get_if<uint64_t>(&tmp.scalar)) v->ints.push_back(int64_t(*u));
    else if (auto* s = std::get_if<int64_t>(&tmp.scalar)) v->ints.push_back(*s);
    else if (auto* d = std::get_if<double>(&tmp.scalar)) v->floats.push_back(*d);
    else if (auto* b = std::get_if<bool>(&tmp.scalar)) v->ints.push_back(*b ? 1 : 0);
  }
  return Status::ok();
}

struct TypeTraits {
  uint64_t block;  // elements per block
  uint64_t bytes;  // bytes per block
};

bool type_traits(uint32_t t, TypeTraits* tt) {
  switch (GgmlType(t)) {
    case GgmlType::kF32: *tt = {1, 4}; return true;
    case GgmlType::kF16: *tt = {1, 2}; return true;
    case GgmlType::kBF16: *tt = {1, 2}; return true;
    case GgmlType::kQ8_0: *tt = {32, 34}; return true;   // f16 d + 32 x int8
    case GgmlType::kQ4_0: *tt = {32, 18}; return true;   // f16 d + 16 bytes of nibbles
    case GgmlType::kQ4_1: *tt = {32, 20}; return true;   // f16 d, f16 m + 16 bytes
    default: return false;
  }
}

}  // namespace

const char* ggml_type_name(uint32_t t) {
  switch (t) {
    case 0: return "F32"; case 1: return "F16"; case 2: return "Q4_0"; case 3: return "Q4_1";
    case 6: return "Q5_0"; case 7: return "Q5_1"; case 8: return "Q8_0"; case 9: return "Q8_1";
    case 10: return "Q2_K"; case 11: return "Q3_K"; case 12: return "Q4_K"; case 13: return "Q5_K";
    case 14: return "Q6_K"; case 15: return "Q8_K"; case 30: return "BF16";
    default: return "unknown";
  }
}

uint64_t ggml_row_bytes(uint32_t t, uint64_t n) {
  TypeTraits tt{};
  if (!type_traits(t, &tt) || n % tt.block != 0) return 0;
  return n / tt.block * tt.bytes;
}

uint64_t GgufTensorInfo::numel() const {
  uint64_t n = 1;
  for (uint64_t d : dims) n *= d;
  return n;
}

Result<GgufFile> GgufFile::open(const std::string& path) {
  SF_ASSIGN(MappedFile mf, MappedFile::open(path));
  SF_ASSIGN(GgufFile g, parse(mf.bytes()));
  g.file_ = std::move(mf);  // mapping address is stable across the move
  return g;
}

Result<GgufFile> GgufFile::parse(ByteSpan bytes) {
  Reader r(bytes);
  uint32_t magic = 0;
  SF_TRY(r.read(&magic, "magic"));
  if (magic != kMagic) return SF_ERR(kCorrupt, "gguf: bad magic (not a GGUF file)");
  GgufFile g;
  SF_TRY(r.read(&g.version_, "version"));
  if (g.version_ != 2 && g.version_ != 3)
    return SF_ERR(kUnsupported, "gguf: version " + std::to_string(g.version_) + " (supported: 2, 3)");
  uint64_t n_tensors = 0, n_kv = 0;
  SF_TRY(r.read(&n_tensors, "tensor count"));
  SF_TRY(r.read(&n_kv, "metadata count"));
  // Every kv needs >= 12 bytes and every tensor info >= 24: reject counts the file can't hold.
  if (n_kv > r.remaining() / 12) return SF_ERR(kCorrupt, "gguf: metadata count " + std::to_string(n_kv) + " exceeds file size");
  if (n_tensors > r.remaining() / 24) return SF_ERR(kCorrupt, "gguf: tensor count " + std::to_string(n_tensors) + " exceeds file size");

  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key;
    SF_TRY(r.read_string(&key, "metadata key"));
    GgufValue v;
    SF_TRY(read_value(r, &v, key));
    if (g.kv_.count(key)) return SF_ERR(kCorrupt, "gguf: duplicate metadata key '" + key + "'");
    g.kv_.emplace(std::move(key), std::move(v));
  }
  if (auto it = g.kv_.find("general.alignment"); it != g.kv_.end()) {
    const GgufValue& a = it->second;
    const uint64_t* u = std::get_if<uint64_t>(&a.scalar);
    if (a.type != GgufValueType::kU32 || !u || *u == 0 || (*u & (*u - 1)) != 0 || *u > 65536)
      return SF_ERR(kCorrupt, "gguf: general.alignment must be a power-of-two u32");
    g.alignment_ = *u;
  }

  // (Reserved only up to a count real models stay under: the file-size bound above still lets a
  // damaged count reserve several times the file's size before the first entry is read.)
  g.tensors_.reserve(size_t(std::min<uint64_t>(n_tensors, 1 << 16)));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    SF_TRY(r.read_string(&t.name, "tensor name"));
    uint32_t nd = 0;
    SF_TRY(r.read(&nd, "tensor n_dims"));
    if (nd == 0 || nd > kMaxDims) return SF_ERR(kCorrupt, "gguf: tensor '" + t.name + "' has " + std::to_string(nd) + " dims");
    uint64_t numel = 1;
    for (uint32_t d = 0; d < nd; ++d) {
      uint64_t x = 0;
      SF_TRY(r.read(&x, "tensor dim"));
      if (x == 0 || x > (1ull << 40) || numel > (1ull << 48) / x)
        return SF_ERR(kCorrupt, "gguf: tensor '" + t.name + "' has invalid dim " + std::to_string(x));
      numel *= x;
      t.dims.push_back(x);
    }
    SF_TRY(r.read(&t.type, "tensor type"));
    SF_TRY(r.read(&t.offset, "tensor offset"));
    TypeTraits tt{};
    if (type_traits(t.type, &tt)) {
      if (t.dims[0] % tt.block != 0)
        return SF_ERR(kCorrupt, "gguf: tensor '" + t.name + "' row length " + std::to_string(t.dims[0]) +
                                    " is not a multiple of the " + ggml_type_name(t.type) + " block");
      t.n_bytes = numel / tt.block * tt.bytes;
    }  // unsupported types keep n_bytes = 0: listed, but loading them fails with kUnsupported
    if (g.tensor_index_.count(t.name)) return SF_ERR(kCorrupt, "gguf: duplicate tensor '" + t.name + "'");
    g.tensor_index_.emplace(t.name, g.tensors_.size());
    g.tensors_.push_back(std::move(t));
  }

  const uint64_t data_start = (uint64_t(r.pos()) + g.alignment_ - 1) / g.alignment_ * g.alignment_;
  if (!g.tensors_.empty() && data_start > bytes.size)
    return SF_ERR(kCorrupt, "gguf: data section starts at " + std::to_string(data_start) + " beyond file size " +
                                std::to_string(bytes.size));
  const uint64_t data_size = data_start <= bytes.size ? bytes.size - data_start : 0;
  for (auto& t : g.tensors_) {
    if (t.offset % g.alignment_ != 0)
      return SF_ERR(kCorrupt, "gguf: tensor '" + t.name + "' offset " + std::to_string(t.offset) + " is not aligned");
    if (t.offset > data_size || t.n_bytes > data_size - t.offset)
      return SF_ERR(kCorrupt, "gguf: tensor '" + t.name + "' [" + std::to_string(t.offset) + ", +" +
                                  std::to_string(t.n_bytes) + ") lies beyond the data section (" +
                                  std::to_string(data_size) + " bytes); file truncated?");
    t.data = bytes.data + data_start + t.offset;
  }
  return g;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = kv_.find(std::string(key));
  return it == kv_.end() ? nullptr : &it->second;
}

namespace {
Status missing(std::string_view key) { return SF_ERR(kNotFound, "gguf: metadata key '" + std::string(key) + "' missing"); }
Status wrong(std::string_view key, const char* want) {
  return SF_ERR(kCorrupt, "gguf: metadata key '" + std::string(key) + "' is not " + want);
}
}  // namespace

Result<std::string> GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(key);
  if (auto* s = std::get_if<std::string>(&v->scalar); s && v->type == GgufValueType::kString) return *s;
  return wrong(key, "a string");
}

Result<int64_t> GgufFile::get_int(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(key);
  if (!is_int_type(v->type)) return wrong(key, "an integer");
  if (auto* u = std::get_if<uint64_t>(&v->scalar)) {
    if (*u > uint64_t(std::numeric_limits<int64_t>::max())) return wrong(key, "an int64-representable integer");
    return int64_t(*u);
  }
  return std::get<int64_t>(v->scalar);
}

Result<double> GgufFile::get_float(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(key);
  if (v->type == GgufValueType::kF32 || v->type == GgufValueType::kF64) return std::get<double>(v->scalar);
  if (is_int_type(v->type)) {
    if (auto* u = std::get_if<uint64_t>(&v->scalar)) return double(*u);
    return double(std::get<int64_t>(v->scalar));
  }
  return wrong(key, "a number");
}

Result<bool> GgufFile::get_bool(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(key);
  if (v->type != GgufValueType::kBool) return wrong(key, "a bool");
  return std::get<bool>(v->scalar);
}

Result<std::vector<std::string>> GgufFile::get_string_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(key);
  if (v->type != GgufValueType::kArray || v->elem_type != GgufValueType::kString) return wrong(key, "a string array");
  return v->strings;
}

Result<std::vector<int64_t>> GgufFile::get_int_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return missing(key);
  if (v->type != GgufValueType::kArray || !(is_int_type(v->elem_type) || v->elem_type == GgufValueType::kBool))
    return wrong(key, "an integer array");
  return v->ints;
}

Status dequantize_row(uint32_t t, const uint8_t* src, uint64_t n, float* out) {
  TypeTraits tt{};
  if (!type_traits(t, &tt))
    return SF_ERR(kUnsupported, std::string("gguf: tensor type ") + ggml_type_name(t) + " (" + std::to_string(t) +
                                    ") is not supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1 are)");
  if (n % tt.block != 0) return SF_ERR(kInvalidArgument, "dequantize_row: n not a multiple of the block size");
  auto f16 = [](const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return f16_to_f32(h); };
  switch (GgmlType(t)) {
    case GgmlType::kF32: std::memcpy(out, src, n * 4); break;
    case GgmlType::kF16: for (uint64_t i = 0; i < n; ++i) out[i] = f16(src + 2 * i); break;
    case GgmlType::kBF16:
      for (uint64_t i = 0; i < n; ++i) { uint16_t h; std::memcpy(&h, src + 2 * i, 2); out[i] = bf16_to_f32(h); }
      break;
    case GgmlType::kQ8_0:
      for (uint64_t b = 0; b < n / 32; ++b) {
        const uint8_t* blk = src + b * 34;
        const float d = f16(blk);
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
        for (int j = 0; j < 32; ++j) out[b * 32 + j] = d * float(q[j]);
      }
      break;
    case GgmlType::kQ4_0:
      // Low nibbles are elements 0..15, high nibbles 16..31; values are offset by 8.
      for (uint64_t b = 0; b < n / 32; ++b) {
        const uint8_t* blk = src + b * 18;
        const float d = f16(blk);
        const uint8_t* q = blk + 2;
        for (int j = 0; j < 16; ++j) {
          out[b * 32 + j] = d * float(int(q[j] & 0x0f) - 8);
          out[b * 32 + j + 16] = d * float(int(q[j] >> 4) - 8);
        }
      }
      break;
    case GgmlType::kQ4_1:
      for (uint64_t b = 0; b < n / 32; ++b) {
        const uint8_t* blk = src + b * 20;
        const float d = f16(blk);
        const float m = f16(blk + 2);
        const uint8_t* q = blk + 4;
        for (int j = 0; j < 16; ++j) {
          out[b * 32 + j] = d * float(q[j] & 0x0f) + m;
          out[b * 32 + j + 16] = d * float(q[j] >> 4) + m;
        }
      }
      break;
  }
  return Status::ok();
}

}  // namespace sf::model
