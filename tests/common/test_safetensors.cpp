// safetensors reader/writer: round trips with fresh random data, and every malformed-input class
// the reader must reject with an error (never a crash) and a message naming the tensor or field.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/checksum.h"
#include "common/safetensors.h"
#include "tests/common/test_seed.h"

namespace sf {
namespace {

namespace fs = std::filesystem;

// One seed a process (printed; SF_TEST_SEED replays it).
uint64_t test_seed() {
  static const uint64_t seed = testing::fresh_seed();
  return seed;
}

class TempDir {
 public:
  TempDir() {
    path_ = fs::path(::testing::TempDir()) /
            ("sf_st_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

// An in-memory file from a raw header string and a data section of `data_bytes` bytes.
std::vector<uint8_t> make_file(const std::string& header, size_t data_bytes, uint8_t fill = 0x5a) {
  std::vector<uint8_t> f(8 + header.size() + data_bytes, fill);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f[i] = uint8_t(n >> (8 * i));
  std::memcpy(f.data() + 8, header.data(), header.size());
  return f;
}

Status parse_bytes(const std::vector<uint8_t>& f) {
  return SafetensorsFile::parse(ByteSpan{f.data(), f.size()}).status();
}

// Expects an error of `code` whose message contains `needle`.
void expect_error(const std::string& header, size_t data_bytes, Code code,
                  const std::string& needle) {
  const Status st = parse_bytes(make_file(header, data_bytes));
  ASSERT_FALSE(st.is_ok()) << "accepted header: " << header;
  EXPECT_EQ(st.code(), code) << st.to_string();
  EXPECT_NE(st.message().find(needle), std::string::npos)
      << "message '" << st.message() << "' does not mention '" << needle << "'";
}

struct RandomTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

std::vector<RandomTensor> random_tensors(std::mt19937_64& rng, int count) {
  const DType types[] = {DType::kF32, DType::kF16, DType::kBF16,
                         DType::kI32, DType::kI64, DType::kU8};
  std::vector<RandomTensor> out;
  for (int i = 0; i < count; ++i) {
    RandomTensor t;
    t.name = "layers." + std::to_string(i) + (i % 2 ? ".k" : ".v");
    t.dtype = types[rng() % 6];
    const int ndim = int(rng() % 4);  // includes scalars
    int64_t numel = 1;
    for (int d = 0; d < ndim; ++d) {
      t.shape.push_back(int64_t(1 + rng() % 7));
      numel *= t.shape.back();
    }
    t.bytes.resize(size_t(numel) * dtype_size(t.dtype));
    for (auto& b : t.bytes) b = uint8_t(rng());
    out.push_back(std::move(t));
  }
  return out;
}

TEST(Safetensors, RoundTripRandom) {
  std::mt19937_64 rng(test_seed());
  TempDir dir;
  for (int iter = 0; iter < 20; ++iter) {
    std::vector<RandomTensor> ts = random_tensors(rng, 1 + int(rng() % 9));
    SafetensorsWriter w;
    for (const auto& t : ts) w.add(t.name, t.dtype, t.shape, t.bytes.data(), t.bytes.size());
    w.add("empty", DType::kF16, {3, 0, 2}, nullptr, 0);
    w.set_metadata("format", "pt");
    w.set_metadata("quote\"back\\slash\nnewline\x01", "caf\xc3\xa9 \xe2\x9c\x93");
    const std::string path = dir.file("rt" + std::to_string(iter) + ".safetensors");
    Result<uint64_t> h = w.write(path);
    ASSERT_TRUE(h.is_ok()) << h.status().to_string();
    EXPECT_FALSE(fs::exists(path + ".tmp"));
    Result<uint64_t> hf = xxh64_file(path);
    ASSERT_TRUE(hf.is_ok()) << hf.status().to_string();
    EXPECT_EQ(*h, *hf);

    Result<SafetensorsFile> r = SafetensorsFile::open(path);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    const SafetensorsFile& f = *r;
    EXPECT_EQ((8 + f.header_bytes()) % 8, 0u) << "data section not 8-byte aligned";
    EXPECT_EQ(f.metadata().at("format"), "pt");
    EXPECT_EQ(f.metadata().at("quote\"back\\slash\nnewline\x01"), "caf\xc3\xa9 \xe2\x9c\x93");
    ASSERT_EQ(f.tensors().size(), ts.size() + 1);
    uint64_t prev_begin = 0;
    for (const auto& st : f.tensors()) {
      EXPECT_GE(st.begin, prev_begin) << "tensors not sorted by offset";
      prev_begin = st.begin;
    }
    for (const auto& t : ts) {
      const SafetensorsTensor* st = f.find(t.name);
      ASSERT_NE(st, nullptr) << t.name;
      EXPECT_EQ(st->dtype, safetensors_dtype_name(t.dtype));
      EXPECT_EQ(st->shape, t.shape);
      ASSERT_EQ(st->n_bytes(), t.bytes.size());
      EXPECT_EQ(std::memcmp(st->data, t.bytes.data(), t.bytes.size()), 0) << t.name;
      Result<DType> dt = safetensors_to_dtype(st->dtype);
      ASSERT_TRUE(dt.is_ok());
      EXPECT_EQ(*dt, t.dtype);
    }
    const SafetensorsTensor* e = f.find("empty");
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->numel(), 0);
    EXPECT_EQ(e->n_bytes(), 0u);
    EXPECT_EQ(f.find("missing"), nullptr);
  }
}

TEST(Safetensors, OverwriteIsAtomicReplace) {
  TempDir dir;
  const std::string path = dir.file("x.safetensors");
  const float a[2] = {1.f, 2.f};
  SafetensorsWriter w1;
  w1.add("a", DType::kF32, {2}, a, sizeof(a));
  ASSERT_TRUE(w1.write(path).is_ok());
  const int32_t b[3] = {7, 8, 9};
  SafetensorsWriter w2;
  w2.add("b", DType::kI32, {3}, b, sizeof(b));
  ASSERT_TRUE(w2.write(path).is_ok());
  Result<SafetensorsFile> r = SafetensorsFile::open(path);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->find("a"), nullptr);
  ASSERT_NE(r->find("b"), nullptr);
  EXPECT_EQ(std::memcmp(r->find("b")->data, b, sizeof(b)), 0);
}

TEST(Safetensors, WriterRejectsBadArgumentsAndLeavesNothing) {
  TempDir dir;
  const float x[4] = {1, 2, 3, 4};
  struct Case {
    const char* what;
    std::function<void(SafetensorsWriter&)> fill;
    const char* needle;
  };
  const std::vector<Case> cases = {
      {"size mismatch", [&](SafetensorsWriter& w) { w.add("t", DType::kF32, {3}, x, 16); },
       "needs 12"},
      {"duplicate",
       [&](SafetensorsWriter& w) {
         w.add("t", DType::kF32, {4}, x, 16);
         w.add("t", DType::kF32, {4}, x, 16);
       },
       "added twice"},
      {"reserved", [&](SafetensorsWriter& w) { w.add("__metadata__", DType::kF32, {4}, x, 16); },
       "reserved"},
      {"negative", [&](SafetensorsWriter& w) { w.add("t", DType::kF32, {-4}, x, 16); }, "negative"},
      {"overflow",
       [&](SafetensorsWriter& w) {
         w.add("t", DType::kF32, {int64_t(1) << 40, int64_t(1) << 40}, x, 16);
       },
       "overflows"},
      {"bad utf8", [&](SafetensorsWriter& w) { w.add("bad\xff", DType::kF32, {4}, x, 16); },
       "UTF-8"},
  };
  for (const Case& c : cases) {
    SafetensorsWriter w;
    c.fill(w);
    const std::string path = dir.file("bad.safetensors");
    Result<uint64_t> r = w.write(path);
    ASSERT_FALSE(r.is_ok()) << c.what;
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos)
        << c.what << ": " << r.status().to_string();
    EXPECT_FALSE(fs::exists(path)) << c.what;
    EXPECT_FALSE(fs::exists(path + ".tmp")) << c.what;
  }
  SafetensorsWriter w;
  w.add("t", DType::kF32, {4}, x, 16);
  Result<uint64_t> r = w.write(dir.file("no/such/dir/x.safetensors"));
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), Code::kIo);
}

// A small valid file whose last tensor (by offset) is non-empty, so every strict prefix is invalid.
std::vector<uint8_t> small_valid_file(std::mt19937_64& rng) {
  TempDir dir;
  std::vector<float> a(6);
  std::vector<uint16_t> b(5);
  for (auto& v : a) v = float(rng() % 1000) / 7.f;
  for (auto& v : b) v = uint16_t(rng());
  SafetensorsWriter w;
  w.add("a", DType::kF32, {2, 3}, a.data(), a.size() * 4);
  w.add("b", DType::kBF16, {5}, b.data(), b.size() * 2);
  w.set_metadata("k", "v");
  const std::string path = dir.file("small.safetensors");
  EXPECT_TRUE(w.write(path).is_ok());
  Result<MappedFile> m = MappedFile::open(path);
  EXPECT_TRUE(m.is_ok());
  return std::vector<uint8_t>(m->bytes().data, m->bytes().data + m->bytes().size);
}

TEST(Safetensors, EveryTruncationIsAnError) {
  std::mt19937_64 rng(test_seed() + 1);
  const std::vector<uint8_t> full = small_valid_file(rng);
  ASSERT_TRUE(parse_bytes(full).is_ok());
  for (size_t n = 0; n < full.size(); ++n) {
    // Copy to an exact-size heap buffer so a read past the end is caught under ASan.
    std::vector<uint8_t> prefix(full.begin(), full.begin() + ptrdiff_t(n));
    const Status st = parse_bytes(prefix);
    EXPECT_FALSE(st.is_ok()) << "prefix of " << n << " bytes accepted";
  }
}

TEST(Safetensors, RandomCorruptionNeverCrashes) {
  std::mt19937_64 rng(test_seed() + 2);
  const std::vector<uint8_t> full = small_valid_file(rng);
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint8_t> f = full;
    const int flips = 1 + int(rng() % 4);
    for (int k = 0; k < flips; ++k) f[rng() % f.size()] = uint8_t(rng());
    Result<SafetensorsFile> r = SafetensorsFile::parse(ByteSpan{f.data(), f.size()});
    if (!r.is_ok()) continue;
    ++accepted;
    // An accepted file must describe tensors inside the buffer.
    for (const auto& t : r->tensors()) {
      ASSERT_GE(t.data, f.data());
      ASSERT_LE(t.data + t.n_bytes(), f.data() + f.size());
      volatile uint8_t sink = 0;
      for (uint64_t j = 0; j < t.n_bytes(); ++j) sink = sink ^ t.data[j];
    }
  }
  std::printf("random corruption: %d of 20000 mutants still parse\n", accepted);
}

TEST(Safetensors, RejectsBadHeaders) {
  // Length field larger than the file, and larger than the 100 MB limit.
  {
    std::vector<uint8_t> f = make_file("{}", 0);
    f[0] = 200;
    const Status st = parse_bytes(f);
    EXPECT_EQ(st.code(), Code::kCorrupt);
    EXPECT_NE(st.message().find("exceeds the file size"), std::string::npos) << st.to_string();
    f[0] = 0;
    f[4] = 1;  // 4 GiB
    EXPECT_NE(parse_bytes(f).message().find("100 MB"), std::string::npos);
  }
  expect_error("{not json}", 0, Code::kCorrupt, "not valid JSON");
  expect_error("{\"a\":1", 0, Code::kCorrupt, "not valid JSON");
  expect_error("{} trailing", 0, Code::kCorrupt, "not valid JSON");
  expect_error("[1,2,3]", 0, Code::kCorrupt, "start with '{'");
  expect_error("{\"a\":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}", 0,
               Code::kCorrupt, "not valid JSON");
  expect_error("{\"a\":\"F32\"}", 0, Code::kCorrupt, "'a': entry is not a JSON object");
  expect_error("{\"__metadata__\":[]}", 0, Code::kCorrupt, "__metadata__ is not a JSON object");
  expect_error("{\"__metadata__\":{\"k\":1}}", 0, Code::kCorrupt, "__metadata__ value for 'k'");
  // A valid header padded with trailing spaces is fine (the format allows it).
  EXPECT_TRUE(parse_bytes(make_file("{}      ", 0)).is_ok());
}

TEST(Safetensors, RejectsBadEntries) {
  const auto e = [](const std::string& dtype, const std::string& shape, const std::string& offs) {
    return "{\"w\":{\"dtype\":" + dtype + ",\"shape\":" + shape + ",\"data_offsets\":" + offs +
           "}}";
  };
  ASSERT_TRUE(parse_bytes(make_file(e("\"F32\"", "[2,3]", "[0,24]"), 24)).is_ok());
  expect_error("{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, Code::kCorrupt,
               "'w': missing field 'dtype'");
  expect_error("{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, Code::kCorrupt,
               "'w': missing field 'shape'");
  expect_error("{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, Code::kCorrupt,
               "'w': missing field 'data_offsets'");
  expect_error(e("5", "[1]", "[0,4]"), 4, Code::kCorrupt, "'dtype' is not a string");
  expect_error(e("\"F31\"", "[1]", "[0,4]"), 4, Code::kUnsupported, "unknown dtype 'F31'");
  expect_error(e("\"F32\"", "1", "[0,4]"), 4, Code::kCorrupt, "'shape' is not an array");
  expect_error(e("\"F32\"", "[-1]", "[0,4]"), 4, Code::kCorrupt, "non-negative integers");
  expect_error(e("\"F32\"", "[1.0]", "[0,4]"), 4, Code::kCorrupt, "non-negative integers");
  expect_error(e("\"F32\"", "[1]", "[0]"), 4, Code::kCorrupt, "array of two integers");
  expect_error(e("\"F32\"", "[1]", "[0,4,8]"), 4, Code::kCorrupt, "array of two integers");
  expect_error(e("\"F32\"", "[1]", "[4,0]"), 4, Code::kCorrupt, "begin 4 > end 0");
  expect_error(e("\"F32\"", "[1]", "[-4,0]"), 4, Code::kCorrupt, "non-negative");
  // Wrong sizes: span does not match shape x dtype, and span beyond the data section.
  expect_error(e("\"F32\"", "[2,3]", "[0,20]"), 24, Code::kCorrupt, "needs 24");
  expect_error(e("\"F16\"", "[2,3]", "[0,24]"), 24, Code::kCorrupt, "needs 12");
  expect_error(e("\"F32\"", "[2,3]", "[0,24]"), 23, Code::kCorrupt, "beyond the data section");
  expect_error(e("\"F32\"", "[1]", "[18446744073709551612,18446744073709551615]"), 4,
               Code::kCorrupt, "beyond the data section");
  // Huge shapes: element count or byte count overflow 64 bits, and dims beyond int64.
  expect_error(e("\"F32\"", "[4294967296,4294967296,16]", "[0,0]"), 0, Code::kCorrupt, "overflows");
  expect_error(e("\"F32\"", "[4611686018427387904]", "[0,0]"), 0, Code::kCorrupt, "overflows");
  expect_error(e("\"F32\"", "[9223372036854775808]", "[0,0]"), 0, Code::kCorrupt, "too large");
  expect_error(e("\"U8\"", "[4294967296,4294967296,0]", "[0,0]"), 0, Code::kCorrupt, "overflows");
  // A zero dim with small other dims is a valid empty tensor.
  EXPECT_TRUE(parse_bytes(make_file(e("\"U8\"", "[4096,0,7]", "[0,0]"), 0)).is_ok());
}

TEST(Safetensors, RejectsOverlaps) {
  const std::string two =
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}";
  expect_error(two, 12, Code::kCorrupt, "'a' [0, 8) and 'b' [4, 12) overlap");
  const std::string same =
      "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
      "\"b\":{\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
  expect_error(same, 4, Code::kCorrupt, "overlap");
  // Contained inside a larger tensor that starts earlier.
  const std::string inside =
      "{\"a\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[0,16]},"
      "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[12,14]},"
      "\"c\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,6]}}";
  expect_error(inside, 16, Code::kCorrupt, "overlap");
  // Adjacent tensors, a gap, and an empty tensor inside another are all fine.
  const std::string ok =
      "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
      "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]},"
      "\"c\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[10,12]},"
      "\"z\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[2,2]}}";
  Result<SafetensorsFile> r = [&] {
    static std::vector<uint8_t> f;
    f = make_file(ok, 12);
    return SafetensorsFile::parse(ByteSpan{f.data(), f.size()});
  }();
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  std::vector<std::string> order;
  for (const auto& t : r->tensors()) order.push_back(t.name);
  EXPECT_EQ(order, (std::vector<std::string>{"a", "z", "b", "c"}));
}

TEST(Safetensors, OpenNamesThePath) {
  TempDir dir;
  const std::string path = dir.file("broken.safetensors");
  FILE* fp = std::fopen(path.c_str(), "wb");
  ASSERT_NE(fp, nullptr);
  std::fputs("abc", fp);
  std::fclose(fp);
  Result<SafetensorsFile> r = SafetensorsFile::open(path);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().to_string();
  EXPECT_EQ(SafetensorsFile::open(dir.file("missing")).status().code(), Code::kIo);
}

TEST(Checksum, FileMatchesBytes) {
  std::mt19937_64 rng(test_seed() + 3);
  TempDir dir;
  std::vector<uint8_t> buf(3 * (1 << 20) + 17);  // spans several read chunks
  for (auto& b : buf) b = uint8_t(rng());
  const std::string path = dir.file("blob");
  FILE* fp = std::fopen(path.c_str(), "wb");
  ASSERT_NE(fp, nullptr);
  ASSERT_EQ(std::fwrite(buf.data(), 1, buf.size(), fp), buf.size());
  std::fclose(fp);
  Result<uint64_t> h = xxh64_file(path);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  EXPECT_EQ(*h, xxh64_bytes(buf.data(), buf.size()));
  EXPECT_EQ(xxh64_bytes("", 0), 0xEF46DB3751D8E999ull);  // XXH64 test vector: empty input
  EXPECT_FALSE(xxh64_file(dir.file("missing")).is_ok());
}

}  // namespace
}  // namespace sf
