// Output files written whole or not at all, and output paths checked before slow work.
//
// Every result a run writes (summaries, configs, benchmark JSON, metrics) goes through
// write_file_atomic, so a crash, a kill or a full disk leaves the previous file or none, never a
// truncated one that looks complete. The checks let a command refuse a path it could not write
// before it spends minutes or hours computing what would go there.
#pragma once
#include <string>
#include <string_view>

#include "common/status.h"

namespace sf {

// The whole file at `path`. A directory is kInvalidArgument (an ifstream opens one and reads
// nothing, which would pass for an empty file); a file that cannot be opened, or a regular file
// that gives fewer bytes than its size (a read error, or a file cut while read), kIo. `what`
// names the file in the error ("batch file").
[[nodiscard]] Result<std::string> read_file(const std::string& path, const std::string& what);

// `bytes` to `path`: written to a new `path`.tmp.<6 random characters> (mkstemp), fsynced,
// closed, then renamed over `path`. On any failure the temporary file is removed and kIo names
// `path` and the reason (ENOSPC: kResourceExhausted). Concurrent writers of one path each rename
// a whole file.
[[nodiscard]] Status write_file_atomic(const std::string& path, std::string_view bytes);
// fsync of a directory, so renames into it survive a power loss. Best effort: some filesystems
// refuse fsync on a directory.
void sync_dir(const std::string& dir);

// `path` can be written as a file: it is not a directory, and its directory exists and is
// writable. `what` names the option in the error ("--out").
[[nodiscard]] Status check_output_file(const std::string& path, const std::string& what);

// `dir` can be created (or is) a directory that a sibling can be renamed onto: it is not a file,
// and the nearest existing ancestor of its parent is a writable directory.
[[nodiscard]] Status check_output_dir(const std::string& dir, const std::string& what);

// A command's exit status once its standard output is flushed: rc, or 1 (said on stderr) where
// stdout did not take everything written to it (a full disk, /dev/full), since a command whose
// result is what it prints must not exit 0 with a truncated result.
int exit_status_after_stdout(int rc);

// This machine's host name (empty if it cannot be read): temporary and lock names carry it so a
// later job can tell its own host's leftovers.
std::string host_name();
// The CPU's model name (/proc/cpuinfo), else the machine type (uname): results' device. root: a
// directory standing in for / (tests).
std::string cpu_name(const std::string& root = "");
// Bytes of host memory the kernel says a new allocation can have without swapping (MemAvailable
// of /proc/meminfo, which counts reclaimable page cache; else the free physical pages), or what
// this process's memory cgroup (v2 or v1) still allows when that is less; -1 when nothing can be
// read. root: a directory standing in for / (tests); empty for the machine itself.
int64_t host_memory_available(const std::string& root = "");

// True when `inner` is `outer` or lies under it, symbolic links and trailing separators
// resolved (paths that do not exist yet compare by their existing prefix).
bool path_within(const std::string& inner, const std::string& outer);

}  // namespace sf
