// write_file_atomic (whole file or the old one, never a part) and the output-path checks that
// commands run before their slow work.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

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
  EXPECT_FALSE(fs::exists(f + ".tmp"));
  ASSERT_TRUE(write_file_atomic(f, "").is_ok());  // an empty file is a file
  EXPECT_EQ(slurp(f), "");
}

TEST(FileIo, AtomicWriteFailuresNameThePathAndKeepTheOldFile) {
  TmpDir d;
  const std::string f = (d.p / "r.json").string();
  ASSERT_TRUE(write_file_atomic(f, "old\n").is_ok());
  // The target is a directory: the rename fails, the temporary is removed.
  fs::create_directories(d.p / "adir" / "x");
  Status st = write_file_atomic((d.p / "adir").string(), "new\n");
  EXPECT_EQ(st.code(), Code::kIo) << st.message();
  EXPECT_NE(st.message().find("adir'"), std::string::npos) << st.message();
  EXPECT_FALSE(fs::exists(d.p / "adir.tmp"));
  // A missing directory.
  st = write_file_atomic((d.p / "missing" / "r.json").string(), "x");
  EXPECT_EQ(st.code(), Code::kIo);
  EXPECT_NE(st.message().find("missing/r.json"), std::string::npos) << st.message();
  EXPECT_EQ(write_file_atomic("", "x").code(), Code::kInvalidArgument);
  EXPECT_EQ(slurp(f), "old\n");
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
  EXPECT_FALSE(fs::exists(d.p / "a"));  // a check creates nothing
  std::ofstream(d.p / "afile") << "x";
  st = check_output_dir((d.p / "afile" / "sub").string(), "--export-kv");
  EXPECT_EQ(st.code(), Code::kInvalidArgument);
  EXPECT_NE(st.message().find("exists and is not a directory"), std::string::npos) << st.message();
  EXPECT_FALSE(check_output_dir("", "--export-kv").is_ok());
}

}  // namespace
}  // namespace sf
