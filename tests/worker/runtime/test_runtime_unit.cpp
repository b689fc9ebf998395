// The runtime's pure pieces without MPI: zigzag chunks, grid checks, index slicing, batch lines,
// and the TP x CP forward on one-rank communicators (equal to model::prefill).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "worker/model/model.h"
#include "worker/runtime/batch.h"
#include "worker/runtime/batch_metrics.h"
#include "tests/common/test_seed.h"
#include "worker/runtime/cp_need.h"
#include "worker/runtime/grid.h"
#include "worker/runtime/parallel_prefill.h"

namespace sf {
namespace {

TEST(Zigzag, ChunksCoverThePromptOnBlockBoundaries) {
  for (int cp : {1, 2, 3, 4, 8})
    for (int64_t n : {1, 63, 64, 65, 427, 640, 1000, 8192}) {
      const auto ch = runtime::zigzag_chunks(n, cp);
      ASSERT_EQ(ch.size(), size_t(2 * cp));
      int64_t at = 0, min_blocks = INT64_MAX, max_blocks = 0;
      for (const auto& c : ch) {
        EXPECT_EQ(c.begin, at) << "n " << n << " cp " << cp;
        EXPECT_GE(c.end, c.begin);
        EXPECT_TRUE(c.begin % 64 == 0);
        at = c.end;
        const int64_t b = (c.size() + 63) / 64;
        min_blocks = std::min(min_blocks, b);
        max_blocks = std::max(max_blocks, b);
      }
      EXPECT_EQ(at, n);
      EXPECT_LE(max_blocks - min_blocks, 1) << "unbalanced chunks, n " << n << " cp " << cp;
      // Rank i holds chunks i and 2cp-1-i: every chunk exactly once over the ranks.
      std::vector<int> held(size_t(2 * cp), 0);
      for (int r = 0; r < cp; ++r) {
        const auto rr = runtime::cp_rank_ranges(n, cp, r);
        EXPECT_EQ(rr[0].begin, ch[size_t(r)].begin);
        EXPECT_EQ(rr[1].begin, ch[size_t(2 * cp - 1 - r)].begin);
        held[size_t(r)]++;
        held[size_t(2 * cp - 1 - r)]++;
      }
      for (int h : held) EXPECT_EQ(h, 1);
    }
}

TEST(Grid, WorldAndModelChecksNameTheNumbers) {
  const Status w = runtime::check_world({2, 2}, 6);
  EXPECT_EQ(w.code(), Code::kInvalidArgument);
  EXPECT_NE(w.message().find("world size 6 is not a multiple of tp x cp = 2 x 2 = 4"),
            std::string::npos)
      << w.message();
  EXPECT_TRUE(runtime::check_world({2, 2}, 8).is_ok());
  EXPECT_FALSE(runtime::check_world({0, 1}, 1).is_ok());
  model::ModelConfig c;
  c.name = "m";
  c.n_heads = 9;
  c.n_kv_heads = 3;
  c.intermediate = 1536;
  EXPECT_TRUE(runtime::check_model_divides(c, 3).is_ok());
  const Status t = runtime::check_model_divides(c, 2);
  EXPECT_NE(t.message().find("has 3 KV heads (9 query heads), which do not divide by --tp 2"),
            std::string::npos);
  c.n_kv_heads = 9;
  c.intermediate = 100;
  EXPECT_NE(runtime::check_model_divides(c, 3).message().find("intermediate size 100"),
            std::string::npos);
}

TEST(SliceIndex, CopiesHeadsAndRowsAndRefusesUnalignedChunks) {
  const int64_t S = 300;
  const auto gi = kernels::sparse_index_dense(4, S, S, 0);
  auto s = runtime::slice_index(gi, 2, 2, {128, 256});
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  const auto want = kernels::sparse_index_dense(2, 128, 256, 128);
  EXPECT_EQ(s->block_count, want.block_count);
  EXPECT_EQ(s->n_k, 256);
  EXPECT_EQ(s->q_offset, 128);
  EXPECT_TRUE(kernels::sparse_index_validate(s.value(), 0).is_ok());
  EXPECT_FALSE(runtime::slice_index(gi, 0, 1, {100, 200}).is_ok());
  EXPECT_FALSE(runtime::slice_index(gi, 3, 2, {0, 64}).is_ok());
  EXPECT_TRUE(runtime::slice_index(gi, 0, 4, {256, 300}).is_ok());  // the partial last block
}

// A UTF-8 byte order mark before line 1 (as Windows editors save a file) is skipped, not taken
// for line 1's JSON; one anywhere else is the line's and makes it bad.
TEST(Batch, ByteOrderMarkBeforeLineOneIsSkipped) {
  const std::string bom = "\xEF\xBB\xBF";
  const auto f = runtime::parse_batch(bom + "{\"id\": \"a\", \"prompt\": \"x\"}\n" + bom +
                                      "{\"id\": \"b\", \"tokens\": [1]}\n");
  ASSERT_EQ(f.requests.size(), 1u);
  EXPECT_EQ(f.requests[0].id, "a");
  EXPECT_EQ(f.requests[0].line, 1);
  ASSERT_EQ(f.bad.size(), 1u);
  EXPECT_EQ(f.bad[0].line, 2);
}

TEST(Batch, GoodAndBadLinesWithNumbers) {
  const std::string text =
      "{\"id\": \"a\", \"prompt\": \"hello\"}\n"
      "\n"
      "{\"id\": \"b\", \"tokens\": [1, 2, 3]}\r\n"
      "{oops\n"
      "[1, 2]\n"
      "{\"prompt\": \"no id\"}\n"
      "{\"id\": \"a/x\", \"prompt\": \"p\"}\n"
      "{\"id\": \"c\", \"prompt\": \"p\", \"tokens\": [1]}\n"
      "{\"id\": \"d\", \"tokens\": [1, -2]}\n"
      "{\"id\": \"e\", \"prompt\": \"\"}\n"
      "{\"id\": \"a\", \"prompt\": \"again\"}\n"
      "{\"id\": \"f\", \"prompt\": \"x\", \"extra\": 1}\n"
      "{\"id\": \"g\", \"tokens\": []}\n"
      "{\"id\": \"B\", \"tokens\": [4]}\n"
      "{\"id\": \"h\", \"prompt\": \"last line, no newline\"}";
  auto f = runtime::parse_batch(text);
  // The parser leaves repeated ids (lines 11 and 14) to first_of_each_id.
  ASSERT_EQ(f.requests.size(), 5u);
  std::vector<int64_t> bad_lines;
  for (const auto& b : f.bad) bad_lines.push_back(b.line);
  EXPECT_EQ(bad_lines, (std::vector<int64_t>{4, 5, 6, 7, 8, 9, 10, 12, 13}));
  f.requests = runtime::first_of_each_id(std::move(f.requests), f.bad);
  ASSERT_EQ(f.requests.size(), 3u);
  EXPECT_EQ(f.requests[0].id, "a");
  EXPECT_EQ(f.requests[0].line, 1);
  EXPECT_EQ(f.requests[1].id, "b");
  EXPECT_EQ(f.requests[1].line, 3);
  EXPECT_EQ(f.requests[1].tokens, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(f.requests[2].id, "h");
  EXPECT_EQ(f.requests[2].line, 15);
  bad_lines.clear();
  for (const auto& b : f.bad) bad_lines.push_back(b.line);
  EXPECT_EQ(bad_lines, (std::vector<int64_t>{4, 5, 6, 7, 8, 9, 10, 12, 13, 11, 14}));
  auto reason = [&](int64_t line) {
    for (const auto& b : f.bad)
      if (b.line == line) return b.reason;
    return std::string();
  };
  EXPECT_NE(reason(4).find("invalid JSON"), std::string::npos);
  EXPECT_NE(reason(6).find("'id' is missing"), std::string::npos);
  EXPECT_NE(reason(7).find("[A-Za-z0-9._-]"), std::string::npos);
  EXPECT_NE(reason(8).find("exactly one of"), std::string::npos);
  EXPECT_NE(reason(9).find("item 1"), std::string::npos);
  EXPECT_NE(reason(11).find("repeats"), std::string::npos);
  EXPECT_NE(reason(12).find("unknown field 'extra'"), std::string::npos);
  // Control characters in a key or a value are shown escaped: each report stays one line.
  const auto esc = runtime::parse_batch(
      "{\"id\": \"a\", \"x\\n\\u001b[2J\": 1}\n"
      "{\"id\": \"b\", \"tokens\": [1], \"kv_dtype\": \"y\\n\\u001b[2J\"}\n");
  ASSERT_EQ(esc.bad.size(), 2u);
  EXPECT_NE(esc.bad[0].reason.find("unknown field 'x\\u000a\\u001b[2J'"), std::string::npos)
      << esc.bad[0].reason;
  EXPECT_NE(esc.bad[1].reason.find("y\\u000a\\u001b[2J"), std::string::npos) << esc.bad[1].reason;
  for (const auto& b : esc.bad) {
    EXPECT_EQ(b.reason.find('\n'), std::string::npos) << b.reason;
    EXPECT_EQ(b.reason.find('\x1b'), std::string::npos) << b.reason;
  }
  // 'B' after 'b': one export and one summary on a case-insensitive filesystem.
  EXPECT_NE(reason(14).find("only in case"), std::string::npos) << reason(14);
  EXPECT_FALSE(runtime::validate_request_id(".hidden").is_ok());
  EXPECT_FALSE(runtime::validate_request_id(std::string(129, 'a')).is_ok());
  // Ids that would be another id's summary or a temporary beside the outputs.
  for (const char* id : {"a.json", "a.tmp", "a.json.tmp", "a.partial-12", "x.partial-"})
    EXPECT_FALSE(runtime::validate_request_id(id).is_ok()) << id;
  // (an export is a directory, a summary temporary a file: "doc.tmp.v1" or even
  // "a.json.tmp.Xy12Ab" cannot be mistaken for one: stale_partial below)
  for (const char* id : {"a", "a.jsonl", "doc.v2", "json", "a-partial", "tmp.a", "doc.tmp.v1",
                         "a.json.tmp.Xy12Ab"})
    EXPECT_TRUE(runtime::validate_request_id(id).is_ok()) << id;
}

// JSON parsers keep the last of an object's repeated keys; a batch line naming a field twice is
// refused instead of running whichever value came last (an escaped spelling is the same key).
TEST(Batch, RepeatedFieldsAreBadLines) {
  const std::string text =
      "{\"id\": \"a\", \"tokens\": [1], \"tokens\": [2, 3]}\n"
      "{\"id\": \"b\", \"prompt\": \"p\", \"id\": \"c\"}\n"
      "{\"id\": \"d\", \"to\\u006bens\": [1], \"tokens\": [2]}\n"
      "{\"id\": \"e\", \"prompt\": \"tokens\", \"retention\": \"full\"}\n"
      "{\"id\": \"f\", \"kv_dtype\": \"int8\", \"tokens\": [7], \"kv_dtype\": \"int8\"}\n";
  const auto f = runtime::parse_batch(text);
  ASSERT_EQ(f.requests.size(), 1u);
  EXPECT_EQ(f.requests[0].id, "e");  // a value spelled like a field is not a field
  ASSERT_EQ(f.bad.size(), 4u);
  const char* want[] = {"'tokens' appears twice", "'id' appears twice", "'tokens' appears twice",
                        "'kv_dtype' appears twice"};
  const int64_t lines[] = {1, 2, 3, 5};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(f.bad[i].line, lines[i]);
    EXPECT_NE(f.bad[i].reason.find(want[i]), std::string::npos) << f.bad[i].reason;
  }
}

// A line's own retention: parsed with the kvstore syntax, errors name the field.
TEST(Batch, RetentionField) {
  const std::string text =
      "{\"id\": \"a\", \"prompt\": \"p\", \"retention\": \"snapkv:budget=256,span=4\"}\n"
      "{\"id\": \"b\", \"prompt\": \"p\"}\n"
      "{\"id\": \"c\", \"prompt\": \"p\", \"retention\": 3}\n"
      "{\"id\": \"d\", \"prompt\": \"p\", \"retention\": \"snapkv\"}\n"
      "{\"id\": \"e\", \"prompt\": \"p\", \"retention\": \"nearest\"}\n";
  const auto f = runtime::parse_batch(text);
  ASSERT_EQ(f.requests.size(), 2u);
  ASSERT_TRUE(f.requests[0].retention.has_value());
  EXPECT_EQ(f.requests[0].retention->kind, kvstore::RetentionKind::kSnapKV);
  EXPECT_EQ(f.requests[0].retention->budget, 256);
  EXPECT_EQ(f.requests[0].retention->span, 4);
  EXPECT_FALSE(f.requests[1].retention.has_value());
  ASSERT_EQ(f.bad.size(), 3u);
  EXPECT_NE(f.bad[0].reason.find("field 'retention' must be a string"), std::string::npos);
  EXPECT_NE(f.bad[1].reason.find("field 'retention': retention snapkv needs budget"),
            std::string::npos)
      << f.bad[1].reason;
  EXPECT_NE(f.bad[2].reason.find("field 'retention': "), std::string::npos);
  EXPECT_NE(f.bad[2].reason.find("nearest"), std::string::npos) << f.bad[2].reason;
}

// A line's own K/V encoding: one of the encodings' names, errors name the field.
TEST(Batch, KvDtypeField) {
  const std::string text =
      "{\"id\": \"a\", \"prompt\": \"p\", \"kv_dtype\": \"int8\"}\n"
      "{\"id\": \"b\", \"prompt\": \"p\"}\n"
      "{\"id\": \"c\", \"prompt\": \"p\", \"kv_dtype\": 8}\n"
      "{\"id\": \"d\", \"prompt\": \"p\", \"kv_dtype\": \"fp8\"}\n";
  const auto f = runtime::parse_batch(text);
  ASSERT_EQ(f.requests.size(), 2u);
  ASSERT_TRUE(f.requests[0].kv_dtype.has_value());
  EXPECT_EQ(f.requests[0].kv_dtype->high, kvstore::KvEncoding::kInt8);
  EXPECT_FALSE(f.requests[0].kv_dtype->low.has_value());
  EXPECT_FALSE(f.requests[1].kv_dtype.has_value());
  ASSERT_EQ(f.bad.size(), 2u);
  EXPECT_NE(f.bad[0].reason.find("field 'kv_dtype' must be a string"), std::string::npos);
  EXPECT_NE(f.bad[1].reason.find("field 'kv_dtype': KV encoding 'fp8' is not f32, bf16, int8"),
            std::string::npos)
      << f.bad[1].reason;
}

// "auto" in a line is the job's forward dtype: bf16 for the GPU worker, f32 for the CPU one.
TEST(Batch, KvDtypeAutoIsTheForwardsDtype) {
  const std::string text = "{\"id\": \"a\", \"prompt\": \"p\", \"kv_dtype\": \"auto\"}\n";
  const auto gpu = runtime::parse_batch(text, DType::kBF16);
  ASSERT_EQ(gpu.requests.size(), 1u);
  EXPECT_EQ(gpu.requests[0].kv_dtype->high, kvstore::KvEncoding::kBF16);
  const auto cpu = runtime::parse_batch(text);
  ASSERT_EQ(cpu.requests.size(), 1u);
  EXPECT_EQ(cpu.requests[0].kv_dtype->high, kvstore::KvEncoding::kF32);
}

// CpNeedCount on a hand-built index: 512 tokens (CP 2: rank 0 holds [0,128) and [384,512),
// rank 1 [128,384)), 2 heads each its own KV head. Every slot reads the sink block and its own
// diagonal block; head 1's slots past key 300 also read column 300.
TEST(CpNeedCount, CountsWhatEachRankReadsAndDoesNotHold) {
  const int64_t S = 512;
  kernels::SparseIndex idx = kernels::sparse_index_make(2, S, S, 0, 2, 1);
  for (int h = 0; h < 2; ++h)
    for (int64_t qb = 0; qb < idx.n_qblocks; ++qb) {
      const size_t sl = idx.slot(h, qb);
      int32_t* bo = idx.block_offset.data() + sl * size_t(idx.max_blocks);
      bo[0] = 0;
      bo[1] = int32_t(qb * 64);
      idx.block_count[sl] = qb > 0 ? 2 : 1;
      if (h == 1 && qb * 64 > 300) {
        idx.column_index[sl * size_t(idx.max_cols)] = 300;
        idx.column_count[sl] = 1;
      }
    }
  runtime::CpNeedCount cnt(S, 2, 2);
  ASSERT_TRUE(cnt.add(idx, 1, 0).is_ok());
  // Rank 0: column 300 (head 1) from rank 1. Rank 1: the sink block of both heads from rank 0.
  EXPECT_EQ(cnt.moved_rows(), (std::vector<int64_t>{1, 128}));
  EXPECT_EQ(cnt.allgather_rows(), (std::vector<int64_t>{512, 512}));
  // An index over part of the prompt, or heads past the counter's KV heads, is refused.
  runtime::CpNeedCount small(S - 64, 2, 2);
  EXPECT_EQ(small.add(idx, 1, 0).code(), Code::kInvalidArgument);
  EXPECT_EQ(cnt.add(idx, 1, 1).code(), Code::kInvalidArgument);
}

TEST(Batch, CompleteMeansManifestAndASummaryWithTheSameFingerprint) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("sf-batch-test-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir / "x");
  const std::string fp = "0123456789abcdef";
  EXPECT_FALSE(runtime::request_complete(dir.string(), "x", fp));
  EXPECT_EQ(runtime::request_stale_reason(dir.string(), "x", fp), "");  // nothing exported yet
  std::ofstream(dir / "x" / "manifest.json") << "{}";
  // An export without its summary (a job stopped between the two) is not complete.
  EXPECT_FALSE(runtime::request_complete(dir.string(), "x", fp));
  EXPECT_NE(runtime::request_stale_reason(dir.string(), "x", fp).find("no summary"),
            std::string::npos);
  std::ofstream(dir / "x.json") << R"({"id": "x", "fingerprint": "0123456789abcdef"})" << "\n";
  EXPECT_TRUE(runtime::request_complete(dir.string(), "x", fp));
  EXPECT_EQ(runtime::request_stale_reason(dir.string(), "x", fp), "");
  // Another request's inputs under the same id.
  EXPECT_FALSE(runtime::request_complete(dir.string(), "x", "fedcba9876543210"));
  EXPECT_NE(runtime::request_stale_reason(dir.string(), "x", "fedcba9876543210")
                .find("made for other inputs (fingerprint 0123456789abcdef"),
            std::string::npos);
  EXPECT_FALSE(runtime::request_complete(dir.string(), "y", fp));
  std::filesystem::remove_all(dir);
}

// The host memory check: the host's ranks' KV plus each rank's growth of its plan's pinned
// staging over what the last plan holds, with a quarter to spare.
TEST(Batch, HostMemoryCountsThePinnedStagingAPlanMustAdd) {
  using runtime::host_memory_fits;
  const int64_t kv = 8000, avail = 10000 * 5 / 4;  // 10000 bytes fit exactly
  EXPECT_TRUE(host_memory_fits(kv, 1000, 0, 2, avail));      // 8000 + 2 x 1000 new pinned bytes
  EXPECT_FALSE(host_memory_fits(kv, 1001, 0, 2, avail));     // two bytes more
  EXPECT_FALSE(host_memory_fits(kv + 1, 1000, 0, 2, avail));
  EXPECT_FALSE(host_memory_fits(kv, 3000, 1999, 2, avail));  // grows by 1001 a rank
  EXPECT_TRUE(host_memory_fits(kv, 3000, 2000, 2, avail));   // grows by 1000 a rank
  EXPECT_TRUE(host_memory_fits(kv, 1000, 8000, 2, avail));   // the held staging is larger
  EXPECT_FALSE(host_memory_fits(kv, 1000, 0, 3, avail));     // a third rank's staging
  EXPECT_TRUE(host_memory_fits(int64_t(1) << 50, 0, 0, 8, -1));  // memory unknown: no check
}

// A plan's sparse capacity carried to another length: scaled, in 64-entry steps, within what a
// slot of the new length can hold.
TEST(Batch, SparseCapacityScalesWithThePrompt) {
  using runtime::scaled_sparse_capacity;
  using A = std::array<int, 2>;
  EXPECT_EQ(scaled_sparse_capacity({640, 4160}, 131072, 131072), (A{640, 4160}));
  EXPECT_EQ(scaled_sparse_capacity({640, 4160}, 131072, 262144), (A{1280, 8320}));
  EXPECT_EQ(scaled_sparse_capacity({640, 4160}, 131072, 65536), (A{320, 2112}));  // 2080 -> 2112
  EXPECT_EQ(scaled_sparse_capacity({100, 0}, 100000, 101000), (A{128, 0}));  // 101 up to 128
  // A slot of 5000 keys holds at most 79 blocks (128 in 64-entry steps) and 5000 columns (5056).
  EXPECT_EQ(scaled_sparse_capacity({4096, 65536}, 8192, 5000), (A{128, 5056}));
  EXPECT_EQ(scaled_sparse_capacity({0, 0}, 8192, 16384), (A{0, 0}));
  EXPECT_EQ(scaled_sparse_capacity({64, 64}, 0, 16384), (A{0, 0}));
}

TEST(Batch, StalePartialsByNameKindHostAndAge) {
  using runtime::stale_partial;
  const auto dead = [](long) { return false; };
  const auto alive = [](long) { return true; };
  const double fresh = 5, old_tmp = runtime::kStaleTmpSeconds + 1,
               old_dir = runtime::kStalePartialSeconds + 1;
  // An export's temporary of this host: stale once its process is gone, whatever its age.
  EXPECT_TRUE(stale_partial("doc.partial-h1-123", true, "h1", fresh, dead));
  // An earlier export renamed aside while a new one replaced it (kvstore::finish_export).
  EXPECT_TRUE(stale_partial("doc+replaced.partial-h1-123", true, "h1", fresh, dead));
  EXPECT_FALSE(stale_partial("doc+replaced.partial-h1-123", true, "h1", fresh, alive));
  EXPECT_FALSE(stale_partial("doc.partial-h1-123", true, "h1", fresh, alive));
  // Another host's (or an earlier version's, with no host): only once idle for an hour.
  EXPECT_FALSE(stale_partial("doc.partial-h2-123", true, "h1", fresh, dead));
  EXPECT_TRUE(stale_partial("doc.partial-h2-123", true, "h1", old_dir, alive));
  EXPECT_FALSE(stale_partial("doc.partial-123", true, "h1", fresh, dead));
  EXPECT_TRUE(stale_partial("doc.partial-123", true, "h1", old_dir, alive));
  EXPECT_TRUE(stale_partial("a.b-c.partial-host-1.x-9", true, "host-1.x", fresh, dead));
  // A summary's temporary (a file), once idle for ten minutes.
  EXPECT_TRUE(stale_partial("doc.json.tmp.Ab12Cd", false, "h1", old_tmp, alive));
  EXPECT_TRUE(stale_partial("doc.json.tmp", false, "h1", old_tmp, alive));
  EXPECT_FALSE(stale_partial("doc.json.tmp.Ab12Cd", false, "h1", fresh, alive));
  // Never: exports and user files, however named or old.
  for (const char* name : {"doc.tmp.v1", "a.json.tmp.Xy12Ab", "doc", "doc.partial-h1-x"})
    EXPECT_FALSE(stale_partial(name, true, "h1", 1e9, dead)) << name;
  for (const char* name : {"notes.tmp", "doc.json", "a.json.tmp.toolong", "doc.partial-h1-123",
                           ".json.tmp"})
    EXPECT_FALSE(stale_partial(name, false, "h1", 1e9, dead)) << name;
}

TEST(BatchMetrics, GroupFilesSeriesAndTotals) {
  using runtime::BatchMetrics;
  EXPECT_EQ(BatchMetrics::group_path("/m/sf.prom", 0, 1), "/m/sf.prom");
  EXPECT_EQ(BatchMetrics::group_path("/m/sf.prom", 1, 3), "/m/sf.g1.prom");
  EXPECT_EQ(BatchMetrics::group_path("sf", 2, 3), "sf.g2");
  const auto dir =
      std::filesystem::temp_directory_path() / ("sf-batch-metrics-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto read = [](const std::filesystem::path& p) {
    std::ifstream f(p);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  };
  auto has = [](const std::string& text, const std::string& line) {
    return text.find("\n" + line + "\n") != std::string::npos;
  };
  // Disabled: nothing written, every call succeeds.
  BatchMetrics off("", {});
  EXPECT_TRUE(off.start(3, 1).is_ok());
  EXPECT_TRUE(off.publish(1, 1, 1, false, true).is_ok());

  const std::string p1 = (dir / "w.g1.prom").string();
  BatchMetrics m(p1, {"SmolLM2", "cpu", "dense", "", 1, 2, 1, 2});
  ASSERT_TRUE(m.start(3, 5).is_ok());
  std::string t = read(p1);
  EXPECT_TRUE(has(t, "sparsefill_worker_requests_assigned{group=\"1\"} 3")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_requests_total{group=\"1\",outcome=\"written\"} 0")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_prefill_seconds_count{group=\"1\"} 0")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_export_seconds_count{group=\"1\"} 0")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_export_bytes_total{group=\"1\"} 0")) << t;
  // A series per rank of the group (TP 1 x CP 2), zero before any request.
  EXPECT_TRUE(has(t, "sparsefill_worker_rank_attention_seconds_total{group=\"1\",rank=\"1\"} 0")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_rank_comm_seconds_total{group=\"1\",rank=\"0\"} 0")) << t;
  EXPECT_EQ(t.find("rank=\"2\""), std::string::npos) << t;
  // Only group 0 carries the batch's bad lines.
  EXPECT_EQ(t.find("sparsefill_worker_batch_bad_lines"), std::string::npos) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_info{group=\"1\",model=\"SmolLM2\",device=\"cpu\","
                     "attention=\"dense\",tp=\"1\",cp=\"2\",groups=\"2\"} 1"))
      << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_memory_wait_seconds_total{group=\"1\"} 0")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_device_workspace_bytes{group=\"1\"} 0")) << t;
  m.add_written({100, 0, 2.5, 0.25, 4000, 1000, 200, 0, 0.25, 7000, 0, 1.5, 0, {1.0, 1.5},
                 {0.25, 0.125}, 0.0, int64_t(5) << 32});
  m.add_written({50, 10, 0.75, 0.5, 2000, 500, 100, 0, 2.0, 3000, 0, 0.0, 0, {0.5, 2.0},
                 {0.5, 0.0}, 3.25, int64_t(3) << 32});
  ASSERT_TRUE(m.publish(2, 1, 1, false, true).is_ok());
  t = read(p1);
  EXPECT_TRUE(has(t, "sparsefill_worker_requests_total{group=\"1\",outcome=\"written\"} 2")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_requests_total{group=\"1\",outcome=\"skipped\"} 1")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_requests_total{group=\"1\",outcome=\"failed\"} 1")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_prompt_tokens_total{group=\"1\"} 150")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_prefix_reused_tokens_total{group=\"1\"} 10")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_comm_seconds_total{group=\"1\"} 0.75")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_kv_allgather_bytes_total{group=\"1\"} 6000")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_kv_moved_bytes_total{group=\"1\"} 1500")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_estimate_bytes_total{group=\"1\"} 300")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_prefill_seconds_bucket{group=\"1\",le=\"0.5\"} 0")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_prefill_seconds_bucket{group=\"1\",le=\"1\"} 1")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_prefill_seconds_bucket{group=\"1\",le=\"5\"} 2")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_prefill_seconds_sum{group=\"1\"} 3.25")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_export_seconds_bucket{group=\"1\",le=\"0.5\"} 1")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_export_seconds_bucket{group=\"1\",le=\"1\"} 1")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_export_seconds_sum{group=\"1\"} 2.25")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_export_bytes_total{group=\"1\"} 10000")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_plan_seconds_total{group=\"1\"} 1.5")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_memory_wait_seconds_total{group=\"1\"} 3.25")) << t;
  // A gauge: the last written request's plan (3 x 2^32 bytes), not a sum.
  EXPECT_TRUE(has(t, "sparsefill_worker_device_workspace_bytes{group=\"1\"} 12884901888")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_rank_attention_seconds_total{group=\"1\",rank=\"0\"} 1.5")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_rank_attention_seconds_total{group=\"1\",rank=\"1\"} 3.5")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_rank_comm_seconds_total{group=\"1\",rank=\"0\"} 0.75")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_rank_comm_seconds_total{group=\"1\",rank=\"1\"} 0.125")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_finished{group=\"1\"} 1")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_request_in_flight{group=\"1\"} 0")) << t;

  const std::string p0 = (dir / "w.g0.prom").string();
  BatchMetrics m0(p0, {"SmolLM2", "cpu", "dense", "/jobs/a", 1, 2, 0, 2});
  ASSERT_TRUE(m0.start(2, 5).is_ok());
  t = read(p0);
  // The job's --out on every series: two jobs' files never export the same series.
  EXPECT_TRUE(has(t, "sparsefill_worker_batch_bad_lines{group=\"0\",out=\"/jobs/a\"} 5")) << t;
  EXPECT_TRUE(has(t, "sparsefill_worker_requests_total{group=\"0\",out=\"/jobs/a\",outcome=\"failed\"} 0")) << t;
  // An earlier job's files, for any group count, go; other files stay.
  std::ofstream(dir / "w.prom") << "x";
  std::ofstream(dir / "w.g17.prom") << "x";
  std::ofstream(dir / "w.gx.prom") << "x";
  std::ofstream(dir / "other.prom") << "x";
  // A lock another job holds (the text names that job) stops the removal of every file; one
  // this job holds, or one nobody holds (left by a finished job), does not.
  const std::string w = (dir / "w.prom").string(), ours = "job A", theirs = "job B";
  auto held = runtime::lock_file((dir / "w.g17.prom.lock").string(), theirs);
  ASSERT_TRUE(held.is_ok() && held.value() >= 0);
  int removed = -1;
  Status rm = BatchMetrics::remove_group_files(w, ours, &removed);
  EXPECT_EQ(rm.code(), Code::kAlreadyExists) << rm.message();
  EXPECT_NE(rm.message().find("w.g17.prom' is in use by another sparsefill-worker job (job B)"),
            std::string::npos)
      << rm.message();
  EXPECT_EQ(removed, -1);
  EXPECT_TRUE(std::filesystem::exists(dir / "w.prom"));
  EXPECT_TRUE(std::filesystem::exists(dir / "w.g0.prom"));
  ::close(held.value());  // that job ends; its lock file stays behind
  auto mine = runtime::lock_file((dir / "w.g0.prom.lock").string(), ours);
  ASSERT_TRUE(mine.is_ok() && mine.value() >= 0);
  ASSERT_TRUE(BatchMetrics::remove_group_files(w, ours, &removed).is_ok());
  EXPECT_EQ(removed, 4);  // w, g0, g1, g17
  ::close(mine.value());
  EXPECT_TRUE(std::filesystem::exists(dir / "w.gx.prom"));
  EXPECT_TRUE(std::filesystem::exists(dir / "other.prom"));
  EXPECT_FALSE(std::filesystem::exists(dir / "w.g1.prom"));
  // A directory that does not exist: the error names the file.
  BatchMetrics bad((dir / "nope" / "w.prom").string(), {});
  const Status st = bad.start(1, 0);
  EXPECT_EQ(st.code(), Code::kIo) << st.message();
  std::filesystem::remove_all(dir);
}

TEST(ParallelSelf, OneRankEqualsModelPrefill) {
  model::ModelConfig c;
  c.name = "tiny";
  c.n_layers = 2;
  c.hidden = 64;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 16;
  c.intermediate = 96;
  c.vocab = 101;
  c.max_context = 4096;
  const uint64_t seed = testing::fresh_seed();  // printed; SF_TEST_SEED replays it
  auto m = model::Model::synthetic(c, seed);
  ASSERT_TRUE(m.is_ok());
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t;
  for (int i = 0; i < 200; ++i) t.push_back(int32_t(rng() % 101));
  auto world = comm::make_self_communicator();
  auto g = runtime::make_grid(*world, {1, 1});
  ASSERT_TRUE(g.is_ok());
  runtime::ParallelOptions po;
  po.all_logits = true;
  auto par = runtime::parallel_prefill(m.value(), g.value(), t, po);
  ASSERT_TRUE(par.is_ok()) << par.status().to_string();
  model::PrefillOptions ro;
  ro.all_logits = true;
  auto ref = model::prefill(m.value(), t, ro);
  ASSERT_TRUE(ref.is_ok());
  EXPECT_EQ(par->first_token, ref->first_token);
  EXPECT_EQ(par->logits, ref->logits);  // same kernels, same rows: bit-identical
  EXPECT_EQ(par->kv.k, ref->kv.k);
  EXPECT_EQ(par->kv.v, ref->kv.v);
  // A one-rank grid cannot run tp 2.
  EXPECT_FALSE(runtime::make_grid(*world, {2, 1}).is_ok());
}

}  // namespace
}  // namespace sf
