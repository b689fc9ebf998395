// Shared pieces of the `sparsefill` CLI. Process edge: errors become one line and an exit code.
#pragma once
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <boost/json/object.hpp>

#include "common/args.h"
#include "common/file_io.h"  // cpu_name
#include "common/status.h"
#include "common/text.h"  // now_iso8601

namespace sf::cli {

using ::sf::Args;  // common/args.h
// --help or -h where an option can stand prints print_usage(stdout) and exits 0 (the CLI's
// edge: one usage text serves every command).
Result<Args> parse_args(int argc, char** argv, int first, const std::vector<std::string>& valued,
                        const std::vector<std::string>& flags);
// Every command's usage.
void print_usage(FILE* to);

// A comma-separated list ("what" names the option in errors): an empty item (",a", "a,,b",
// "a,") and an empty list are errors, never skipped or run as nothing.
Result<std::vector<std::string>> parse_list(const std::string& s, const std::string& what);
// Comma-separated whole integers, each at least lo ("what" names the option in errors); empty
// items are errors, and so is an empty list unless allow_empty.
Result<std::vector<int64_t>> parse_int_list(const std::string& s, const std::string& what,
                                            int64_t lo, bool allow_empty = false);
// --lengths: comma-separated integers, each at least 256.
Result<std::vector<int64_t>> parse_length_list(const std::string& s);

// The CLI's one error convention: "error: MESSAGE" on stderr, exit status 1.
int fail(const Status& st);

// "default" -> $SF_MODEL, else <repo>/models/SmolLM2-135M-Instruct.Q4_1.gguf.
std::string resolve_model(const std::string& m);
// Comma-separated paths, read and joined by a blank line (one long document from several texts).
Result<std::string> read_text_files(const std::string& list, const char* what);
std::string git_commit();
std::string shell_quote_args(int argc, char** argv);
// A CPU result's "device": kind, CPU name, hardware threads and the pool's threads.
boost::json::object cpu_device_json();

int cmd_prefill(int argc, char** argv);
int cmd_bench(int argc, char** argv);
int cmd_bench_attention(int argc, char** argv);  // bench attention (GPU)
int cmd_inspect(int argc, char** argv);
int cmd_eval(int argc, char** argv);
int cmd_search(int argc, char** argv);
int cmd_retention_eval(int argc, char** argv);  // eval --retention ...
int cmd_moa_profile(int argc, char** argv);     // moa-profile: MoA retention spans

}  // namespace sf::cli
