// Batch mode input and output: prompts.jsonl lines -> requests, and where each request's
// result lives under the output directory.
//
// A line is one JSON object:
//   {"id": "doc-17", "prompt": "text ..."}      or      {"id": "doc-17", "tokens": [1, 2, 3]}
// with an optional "retention": "POLICY" (kvstore::retention_parse's syntax, e.g.
// "snapkv:budget=1024,span=4") that overrides the worker's --retention for that request, and an
// optional "kv_dtype": "auto" | "f32" | "bf16" | "int8" | "int4" (or two tiers, "int8+int4", with a
// retention's high=TOKENS) that overrides its --kv-dtype ("auto": the forward's dtype, `compute`).
// id: 1-128 characters of [A-Za-z0-9._-], not starting with '.', unique in the file (it names
// the output directory). Exactly one of prompt (non-empty string) / tokens (non-empty array of
// integers). Blank lines are ignored. Every other line is a bad line: it is reported with its
// number and reason and skipped; the batch goes on.
//
// Output: DIR/<id>/ is the request's KV export (kvstore/kv_export.h: manifest.json + layer
// shards, renamed into place when complete) and DIR/<id>.json a one-line summary, written after
// it, holding the request's fingerprint (what the export depends on; worker/job_identity.h,
// request_fingerprint). On resume a request is complete, and skipped, when its manifest.json
// exists and its summary holds the same fingerprint; otherwise (a changed line, other options or
// grid, another model, or a job stopped between the export and its summary) it is computed again,
// its old summary removed first and its export replaced.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "kvstore/kv_quant.h"
#include "kvstore/retention.h"

namespace sf::runtime {

struct BatchRequest {
  int64_t line = 0;  // 1-based line number in the file
  std::string id;
  std::string prompt;           // when given as text
  std::vector<int32_t> tokens;  // when given as ids
  bool has_tokens = false;
  std::optional<kvstore::RetentionPolicy> retention;  // the line's own, when it names one
  std::optional<kvstore::KvEncodings> kv_dtype;       // likewise
};

struct BadLine {
  int64_t line = 0;
  std::string reason;
};

struct BatchFile {
  std::vector<BatchRequest> requests;  // in file order
  std::vector<BadLine> bad;
};

// Parses the whole file's text. Never fails: a line that is not a valid request becomes a
// BadLine. Ids may repeat here: first_of_each_id settles that once the job's own checks have
// run, so a line those checks refuse does not take its id from a corrected line after it.
// `compute`: the dtype the job's forward computes K/V in, which a line's "kv_dtype": "auto" takes
// (kvstore::kv_encodings_parse).
BatchFile parse_batch(const std::string& text, DType compute = DType::kF32);

// `requests` (in file order) keeping the first line of each id, ids equal up to ASCII case
// counting as one; every later line becomes a BadLine in `bad`.
std::vector<BatchRequest> first_of_each_id(std::vector<BatchRequest> requests,
                                           std::vector<BadLine>& bad);

// The id check alone (also used for the output paths).
Status validate_request_id(const std::string& id);

std::string request_dir(const std::string& out_dir, const std::string& id);
// True when the request's export is complete (its manifest.json exists) and was made for
// `fingerprint` (its summary DIR/<id>.json holds "fingerprint": "<fingerprint>").
bool request_complete(const std::string& out_dir, const std::string& id,
                      const std::string& fingerprint);
// Why a request with an export is not complete: "" when it is (or has no export at all).
std::string request_stale_reason(const std::string& out_dir, const std::string& id,
                                 const std::string& fingerprint);

// Whether a host has memory for the next request (beside a pending export, where one is): its
// ranks' KV (host_kv_bytes, summed over the host's ranks) plus what each rank's device plan's
// pinned K/V staging must grow by (staging_bytes for this request against staging_held, what the
// last plan pinned and passes on: a longer prompt pins more), within 0.8 of avail (-1: unknown,
// which passes).
bool host_memory_fits(int64_t host_kv_bytes, int64_t staging_bytes, int64_t staging_held,
                      int local_ranks, int64_t avail);

// A device plan's sparse index capacity {64-key blocks, columns} a slot, seen on a prompt of
// `from` tokens, for a plan of `to` tokens (model::PrefillOptions::sparse_capacity): scaled by
// to / from (a slot's keys grow with the prompt), in whole 64-entry steps, at most what a slot of
// `to` keys can hold. {0, 0} stays {0, 0}.
std::array<int, 2> scaled_sparse_capacity(std::array<int, 2> cap, int64_t from, int64_t to);

// The output directory's lock (DIR/.sparsefill-worker.lock, flock): one job writes a directory
// at a time. Returns the descriptor to keep open for the job's life, -1 when the filesystem has
// no flock (no lock: the caller says so), kAlreadyExists naming the holder's pid and host when
// another job holds it.
Result<int> lock_output_dir(const std::string& out_dir);

// An exclusive flock on `path` (created if missing), holder's text written into it: the
// descriptor to keep open while the lock is held, -1 when the filesystem has no flock,
// kAlreadyExists with the holder's text (the file's contents) as its message when another open
// file holds it, kIo otherwise.
Result<int> lock_file(const std::string& path, const std::string& holder);

// What an earlier job left half written, by name: a summary's temporary (file <id>.json.tmp or
// <id>.json.tmp.<6 random characters>) idle for kStaleTmpSeconds; an export's temporary (directory
// <id>.partial-HOST-PID, or <id>.partial-PID from earlier versions) of this host whose process is
// gone, or of any host once idle for kStalePartialSeconds. Nothing else (a finished export, a
// user's file) ever matches.
inline constexpr double kStaleTmpSeconds = 600, kStalePartialSeconds = 3600;
// idle_s is asked only of a name that matches, so a directory of finished exports is not walked.
bool stale_partial(const std::string& name, bool is_dir, const std::string& host,
                   const std::function<double()>& idle_s,
                   const std::function<bool(long)>& pid_alive);
inline bool stale_partial(const std::string& name, bool is_dir, const std::string& host,
                          double idle_s, const std::function<bool(long)>& pid_alive) {
  return stale_partial(name, is_dir, host, [idle_s] { return idle_s; }, pid_alive);
}
// Under the lock: removes the stale entries of DIR and returns how many went.
// Entries that cannot be removed are left and named in *not_removed (when given); only a
// directory that cannot be listed is an error.
Result<int64_t> remove_stale_partials(const std::string& out_dir,
                                      std::vector<std::string>* not_removed = nullptr);

}  // namespace sf::runtime
