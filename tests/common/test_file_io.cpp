// write_file_atomic (whole file or the old one, never a part) and the output-path checks that
// commands run before their slow work.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "common/file_io.h"

namespace sf {
namespace {

namespace fs = std::filesystem;

struct TmpDir {
  fs::path p = fs::temp_directory_path() / ("sf-file-io-" + std::to_string(::getpid()));
  TmpDir() {
    fs::remove_all(p);
    fs::create_directories(p);
  }
  ~TmpDir() { fs::remove_all(p); }
};

// The directory's entries, sorted: what a write left behind.
std::vector<std::string> listing(const fs::path& d) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(d)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(FileIo, AtomicWriteReplacesWholeAndLeavesNoTemporary) {
  TmpDir d;
  const std::string f = (d.p / "r.json").string();
  ASSERT_TRUE(write_file_atomic(f, "a longer first version\n").is_ok());
  ASSERT_TRUE(write_file_atomic(f, "v2\n").is_ok());
  EXPECT_EQ(slurp(f), "v2\n");
  EXPECT_EQ(listing(d.p), std::vector<std::string>{"r.json"});
  ASSERT_TRUE(write_file_atomic(f, "").is_ok());  // an empty file is a file
  EXPECT_EQ(slurp(f), "");
}

TEST(FileIo, AtomicWriteFailuresNameThePathAndLeaveNothingBehind) {
  TmpDir d;
  // The target is a (non-empty) directory: the data is written, the rename fails; the target is
  // as it was and the temporary is gone.
  fs::create_directories(d.p / "adir");
  std::ofstream(d.p / "adir" / "x") << "kept";
  Status st = write_file_atomic((d.p / "adir").string(), "new\n");
  EXPECT_EQ(st.code(), Code::kIo) << st.message();
  EXPECT_NE(st.message().find("adir' (renaming"), std::string::npos) << st.message();
  EXPECT_EQ(listing(d.p), std::vector<std::string>{"adir"});
  EXPECT_EQ(slurp(d.p / "adir" / "x"), "kept");
  // A missing directory.
  st = write_file_atomic((d.p / "missing" / "r.json").string(), "x");
  EXPECT_EQ(st.code(), Code::kIo);
  EXPECT_NE(st.message().find("missing/r.json"), std::string::npos) << st.message();
  EXPECT_EQ(write_file_atomic("", "x").code(), Code::kInvalidArgument);
}

TEST(FileIo, ConcurrentWritersOfOnePathEachRenameAWholeFile) {
  TmpDir d;
  const std::string f = (d.p / "m.prom").string();
  // Two writers with different lengths, many rounds: the file is always one writer's whole text.
  const std::string a(100000, 'a'), b(7, 'b');
  std::atomic<bool> bad{false};
  auto writer = [&](const std::string& text) {
    for (int i = 0; i < 200; ++i)
      if (!write_file_atomic(f, text).is_ok()) bad = true;
  };
  auto reader = [&] {
    for (int i = 0; i < 400; ++i) {
      const std::string t = slurp(f);
      if (!t.empty() && t != a && t != b) bad = true;
    }
  };
  std::thread t1(writer, a), t2(writer, b), t3(reader);
  t1.join();
  t2.join();
  t3.join();
  EXPECT_FALSE(bad.load());
  EXPECT_EQ(listing(d.p), std::vector<std::string>{"m.prom"});
}

TEST(FileIo, OutputChecksBeforeTheWork) {
  TmpDir d;
  EXPECT_TRUE(check_output_file((d.p / "out.json").string(), "--out").is_ok());
  Status st = check_output_file((d.p / "no" / "out.json").string(), "--out");
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("does not exist"), std::string::npos) << st.message();
  st = check_output_file(d.p.string(), "--out");
  EXPECT_NE(st.message().find("is a directory"), std::string::npos) << st.message();
  EXPECT_FALSE(check_output_file((d.p / "x").string() + "/", "--out").is_ok());
  EXPECT_FALSE(check_output_file("", "--out").is_ok());

  EXPECT_TRUE(check_output_dir((d.p / "a" / "b" / "c").string(), "--export-kv").is_ok());
  EXPECT_TRUE(check_output_dir(d.p.string() + "/", "--export-kv").is_ok());
  EXPECT_FALSE(fs::exists(d.p / "a"));  // a check creates nothing
  std::ofstream(d.p / "afile") << "x";
  st = check_output_dir((d.p / "afile" / "sub").string(), "--export-kv");
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("exists and is not a directory"), std::string::npos) << st.message();
  st = check_output_dir((d.p / "afile").string(), "--export-kv");
  EXPECT_NE(st.message().find("exists and is not a directory"), std::string::npos) << st.message();
  EXPECT_FALSE(check_output_dir("", "--export-kv").is_ok());
}

// The available memory is a positive amount no larger than the machine's, and it follows an
// allocation: 512 MiB touched lowers it by at least half of that. The figure is the whole
// machine's, so another process freeing memory in between can hide the drop: the best of five
// tries counts.
TEST(FileIo, HostMemoryAvailableFollowsAnAllocation) {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  const int64_t first = host_memory_available();
  ASSERT_GT(first, 0);
  EXPECT_LE(first, int64_t(pages) * page);
  if (first < (int64_t(2) << 30)) GTEST_SKIP() << "under 2 GiB available";
  int64_t best = 0;
  for (int t = 0; t < 5 && best < (int64_t(256) << 20); ++t) {
    const int64_t before = host_memory_available();
    std::vector<char> big(size_t(512) << 20);
    for (size_t i = 0; i < big.size(); i += 4096) big[i] = char(i | 1);
    asm volatile("" : : "r"(big.data()) : "memory");  // the pages are touched before the read
    best = std::max(best, before - host_memory_available());
  }
  EXPECT_GE(best, int64_t(256) << 20) << "the largest drop of five tries";
}

}  // namespace
}  // namespace sf
