// write_file_atomic (whole file or the old one, never a part) and the output-path checks that
// commands run before their slow work.
#include <gtest/gtest.h>
#include <sys/utsname.h>
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

TEST(FileIo, ReadFileTakesWholeFilesAndRefusesDirectories) {
  TmpDir d;
  const std::string f = (d.p / "t.jsonl").string();
  const std::string bytes("{\"a\": 1}\r\n\0tail", 15);
  ASSERT_TRUE(write_file_atomic(f, bytes).is_ok());
  Result<std::string> r = read_file(f, "batch file");
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r.value(), bytes);  // binary-safe: CR and NUL kept
  ASSERT_TRUE(write_file_atomic(f, "").is_ok());
  r = read_file(f, "batch file");
  ASSERT_TRUE(r.is_ok());  // an empty file is a file
  EXPECT_EQ(r.value(), "");
  // An ifstream opens a directory and reads nothing: that must not pass for an empty file.
  r = read_file(d.p.string(), "batch file");
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find("batch file '" + d.p.string() + "' is a directory"),
            std::string::npos)
      << r.status().message();
  r = read_file((d.p / "none.jsonl").string(), "batch file");
  EXPECT_EQ(r.status().code(), Code::kIo);
  EXPECT_NE(r.status().message().find("cannot read batch file"), std::string::npos);
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

// The machine's own figure is positive and no larger than its memory. The rest runs on a
// stand-in root: MemAvailable alone; a cgroup v2 limit below it wins ("max": no limit); a v1
// memory controller's limit less usage wins, its "no limit" (a huge number) does not; nothing
// readable is -1.
// The CPU's name from /proc/cpuinfo; a "model name" line with nothing after its colon (seen in
// some VMs) gives the machine type instead of an exception.
TEST(FileIo, CpuNameReadsCpuinfoAndFallsBackToTheMachine) {
  EXPECT_FALSE(cpu_name().empty());
  TmpDir d;
  const std::string root = d.p.string();
  fs::create_directories(root + "/proc");
  std::ofstream(root + "/proc/cpuinfo") << "processor\t: 0\nmodel name\t: AMD EPYC 9654\n";
  EXPECT_EQ(cpu_name(root), "AMD EPYC 9654");
  std::ofstream(root + "/proc/cpuinfo") << "processor\t: 0\nmodel name\t:\n";
  std::string name;
  EXPECT_NO_THROW(name = cpu_name(root));
  utsname u{};
  ASSERT_EQ(uname(&u), 0);
  EXPECT_EQ(name, u.machine);
}

TEST(FileIo, HostMemoryAvailableReadsMeminfoAndTheMemoryCgroup) {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  const int64_t here = host_memory_available();
  EXPECT_GT(here, 0);
  EXPECT_LE(here, int64_t(pages) * page);

  TmpDir d;
  const std::string root = d.p.string();
  auto put = [&](const std::string& rel, const std::string& text) {
    fs::create_directories(fs::path(root + rel).parent_path());
    std::ofstream(root + rel) << text;
  };
  EXPECT_EQ(host_memory_available(root), -1);
  put("/proc/meminfo",
      "MemTotal:       32000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n"
      "HugePages_Total:       0\n");
  EXPECT_EQ(host_memory_available(root), int64_t(20000000) * 1024);
  put("/proc/self/cgroup", "0::/job.slice/step\n");
  put("/sys/fs/cgroup/job.slice/step/memory.max", "max\n");
  put("/sys/fs/cgroup/job.slice/step/memory.current", "123\n");
  EXPECT_EQ(host_memory_available(root), int64_t(20000000) * 1024);
  put("/sys/fs/cgroup/job.slice/step/memory.max", "8000000000\n");
  put("/sys/fs/cgroup/job.slice/step/memory.current", "3000000000\n");
  EXPECT_EQ(host_memory_available(root), 5000000000);
  put("/proc/self/cgroup", "4:memory:/docker/abc\n3:cpu,cpuacct:/\n");
  put("/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n");
  put("/sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes", "1000\n");
  EXPECT_EQ(host_memory_available(root), int64_t(20000000) * 1024);
  put("/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", "2000000000\n");
  EXPECT_EQ(host_memory_available(root), 2000000000 - 1000);
  // Inside a container without a cgroup namespace: the host's path is not mounted there, the
  // container's own cgroup is the hierarchy's root.
  fs::remove_all(root + "/sys/fs/cgroup/memory/docker");
  put("/sys/fs/cgroup/memory/memory.limit_in_bytes", "3000000000\n");
  put("/sys/fs/cgroup/memory/memory.usage_in_bytes", "500\n");
  EXPECT_EQ(host_memory_available(root), 3000000000 - 500);
  // v2 with the limit on a parent slice, none on the job's own cgroup: the least on the path.
  fs::remove_all(root + "/sys/fs/cgroup");
  put("/proc/self/cgroup", "0::/job.slice/step\n");
  put("/sys/fs/cgroup/job.slice/step/memory.max", "max\n");
  put("/sys/fs/cgroup/job.slice/step/memory.current", "100\n");
  put("/sys/fs/cgroup/job.slice/memory.max", "4000000000\n");
  put("/sys/fs/cgroup/job.slice/memory.current", "1000000000\n");
  EXPECT_EQ(host_memory_available(root), 3000000000);
  // ... and a tighter one below it wins.
  put("/sys/fs/cgroup/job.slice/step/memory.max", "1000000100\n");
  EXPECT_EQ(host_memory_available(root), 1000000000);
}

}  // namespace
}  // namespace sf
