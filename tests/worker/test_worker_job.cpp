// The worker job's pieces that need neither MPI nor a model's weights: the batch lines' checks,
// the host K/V sizing behind the memory check and --dry-run, and the request summary's JSON.
#include <gtest/gtest.h>

#include <boost/json.hpp>
#include <string>
#include <vector>

#include "tests/worker/model/model_test_util.h"
#include "tests/worker/worker_args.h"
#include "worker/host_kv.h"
#include "worker/options.h"
#include "worker/request_checks.h"
#include "worker/request_summary.h"

namespace sf::worker {
namespace {

// The tiny synthetic Llama (2 KV heads of 16, vocabulary 101) with 4 layers and a 50-token
// context.
model::ModelConfig small_config() {
  model::ModelConfig c = testing::tiny_config(4);
  c.max_context = 50;
  return c;
}

Options options(const std::vector<std::string>& extra = {}) {
  auto o = parse_worker_args(extra);
  EXPECT_TRUE(o.is_ok()) << o.status().to_string();
  return o.is_ok() ? o.value() : Options{};
}

std::string tokens_line(const std::string& id, int n, int first = 1, const std::string& more = "") {
  std::string s = "{\"id\": \"" + id + "\", \"tokens\": [";
  for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(i == 0 ? first : 1 + i % 90);
  return s + "]" + more + "}\n";
}

// The reason given for `line`, or "" when it is not a bad line.
std::string reason(const runtime::BatchFile& bf, int64_t line) {
  for (const auto& b : bf.bad)
    if (b.line == line) return b.reason;
  return "";
}

TEST(WorkerRequestChecks, EachRuleNamesItsLine) {
  const std::string text = tokens_line("ok1", 5) +                     // 1
                           tokens_line("vocab", 5, 101) +               // 2: id 101 of vocab 101
                           tokens_line("long", 51) +                    // 3: over max_context 50
                           "{\"id\": \"text\", \"prompt\": \"hello\"}\n" +  // 4: no tokenizer
                           tokens_line("tier", 45, 1, ", \"retention\": \"adakv:budget=40,high=36\"") +
                           tokens_line("budget", 5, 1, ", \"retention\": \"adakv:budget=64\"") +
                           tokens_line("ok2", 50);                      // 7: exactly the context
  const model::ModelConfig cfg = small_config();
  runtime::BatchFile bf = runtime::parse_batch(text);
  ASSERT_TRUE(bf.bad.empty()) << bf.bad[0].reason;
  const auto good = check_requests(bf, cfg, nullptr, options());
  ASSERT_EQ(good.size(), 2u);
  EXPECT_EQ(good[0].id, "ok1");
  EXPECT_EQ(good[1].id, "ok2");
  EXPECT_EQ(good[1].line, 7);
  EXPECT_TRUE(bf.requests.empty());
  EXPECT_EQ(bf.bad.size(), 5u);
  EXPECT_NE(reason(bf, 2).find("item 0 (101) is outside the vocabulary of 101"), std::string::npos)
      << reason(bf, 2);
  EXPECT_NE(reason(bf, 3).find("51 tokens, more than the model context of 50"), std::string::npos)
      << reason(bf, 3);
  EXPECT_NE(reason(bf, 4).find("no tokenizer support"), std::string::npos) << reason(bf, 4);
  EXPECT_NE(reason(bf, 5).find("high= needs a two-tier kv_dtype"), std::string::npos)
      << reason(bf, 5);
  EXPECT_NE(reason(bf, 6).find("field 'retention'"), std::string::npos) << reason(bf, 6);
}

// An id belongs to the first line that passes every check: a line refused for its tokens does
// not take the id from the corrected line after it; a repeat of a passing line is refused. (The
// worker runs first_of_each_id on the lines every rank agreed on, after check_requests.)
TEST(WorkerRequestChecks, ARefusedLineLeavesItsIdToALaterLine) {
  const std::string text = tokens_line("fix", 5, 101) +  // 1: outside the vocabulary
                           tokens_line("fix", 5) +       // 2: the corrected line runs
                           tokens_line("Fix", 5) +       // 3: repeats line 2 (case folded)
                           tokens_line("once", 5) +      // 4
                           tokens_line("once", 51);      // 5: over the context, and a repeat
  const model::ModelConfig cfg = small_config();
  runtime::BatchFile bf = runtime::parse_batch(text);
  ASSERT_TRUE(bf.bad.empty()) << bf.bad[0].reason;
  const auto good = runtime::first_of_each_id(check_requests(bf, cfg, nullptr, options()), bf.bad);
  ASSERT_EQ(good.size(), 2u);
  EXPECT_EQ(good[0].id, "fix");
  EXPECT_EQ(good[0].line, 2);
  EXPECT_EQ(good[1].id, "once");
  EXPECT_EQ(good[1].line, 4);
  ASSERT_EQ(bf.bad.size(), 3u);
  EXPECT_NE(reason(bf, 1).find("outside the vocabulary"), std::string::npos) << reason(bf, 1);
  EXPECT_NE(reason(bf, 3).find("repeats an earlier line's"), std::string::npos) << reason(bf, 3);
  // Its own fault is the reason a user can act on; the repeat is not checked past it.
  EXPECT_NE(reason(bf, 5).find("more than the model context"), std::string::npos)
      << reason(bf, 5);
}

TEST(WorkerRequestChecks, FlagsChangeTheVerdict) {
  const model::ModelConfig cfg = small_config();
  {  // --allow-long runs a prompt over the context
    runtime::BatchFile bf = runtime::parse_batch(tokens_line("long", 51));
    EXPECT_EQ(check_requests(bf, cfg, nullptr, options({"--allow-long"})).size(), 1u);
    EXPECT_TRUE(bf.bad.empty());
  }
  {  // bf16 host K/V cannot give a line its own f32 export; the job's own encoding is not a line's
    const std::string text = tokens_line("f32", 5, 1, ", \"kv_dtype\": \"f32\"") +
                             tokens_line("bf16", 5, 1, ", \"kv_dtype\": \"bf16\"");
    runtime::BatchFile bf = runtime::parse_batch(text, DType::kBF16);
    const auto good = check_requests(
        bf, cfg, nullptr, options({"--device", "cuda", "--kv-host-dtype", "bf16"}));
    ASSERT_EQ(good.size(), 1u);
    EXPECT_EQ(good[0].id, "bf16");
    EXPECT_NE(reason(bf, 1).find("needs --kv-host-dtype f32"), std::string::npos) << reason(bf, 1);
  }
  {  // a two-tier encoding without high= is bad; the pair together passes
    const std::string text =
        tokens_line("two", 45, 1, ", \"kv_dtype\": \"int8+int4\"") +
        tokens_line("both", 45, 1, ", \"kv_dtype\": \"int8+int4\", \"retention\": \"adakv:budget=40,high=36\"");
    runtime::BatchFile bf = runtime::parse_batch(text);
    const auto good = check_requests(bf, cfg, nullptr, options());
    ASSERT_EQ(good.size(), 1u);
    EXPECT_EQ(good[0].id, "both");
    EXPECT_NE(reason(bf, 1).find("needs a retention with high="), std::string::npos)
        << reason(bf, 1);
  }
}

// A layer's K and V for `tokens` tokens of `heads` KV heads, F32 or bf16.
int64_t kv_bytes(const model::ModelConfig& c, int64_t tokens, int heads, bool bf16) {
  return tokens * heads * c.head_dim * 2 * (bf16 ? 2 : 4);
}

TEST(WorkerHostKv, ShardedRanksHoldTheirRowsAndHeads) {
  const model::ModelConfig c = small_config();
  const int64_t T = 1000;
  for (const bool bf16 : {false, true}) {
    const Options o = options({"--tp", "2", "--cp", "2"});
    const HostKvSizing one(o, c, bf16, {0});
    EXPECT_EQ(one.rank_rows(T), 500);
    // The group's four ranks hold each layer's K/V exactly once between them.
    EXPECT_EQ(4 * one.rank_layer_bytes(T), kv_bytes(c, T, c.n_kv_heads, bf16));
    // On the CPU each rank also holds one layer's whole-prompt K/V of its heads twice.
    EXPECT_EQ(one.rank_bytes(T), c.n_layers * one.rank_layer_bytes(T) +
                                     2 * kv_bytes(c, T, c.n_kv_heads / 2, bf16));
    EXPECT_EQ(one.staging_bytes(T), 0);  // no pinned staging on the CPU
    const HostKvSizing four(o, c, bf16, {0, 1, 2, 3});
    EXPECT_EQ(four.host_bytes(T), 4 * one.rank_bytes(T));
    EXPECT_EQ(one.host_bytes(T), one.rank_bytes(T));
  }
  // An uneven prompt rounds a rank's rows up.
  EXPECT_EQ(HostKvSizing(options({"--cp", "3"}), c, false, {0}).rank_rows(1000), 334);
}

TEST(WorkerHostKv, GatheredLeaderHoldsTheWholeCache) {
  const model::ModelConfig c = small_config();
  const int64_t T = 1000;
  const Options o = options({"--tp", "2", "--cp", "2", "--export", "gathered"});
  const HostKvSizing s(o, c, false, {0, 1, 2, 3});
  EXPECT_EQ(s.rank_rows(T), T);
  EXPECT_EQ(s.rank_layer_bytes(T), kv_bytes(c, T, c.n_kv_heads, false));
  // A rank's CPU layer buffers: one layer's whole-prompt K/V of its TP slice's heads, twice.
  const int64_t layer_buffers = 2 * kv_bytes(c, T, c.n_kv_heads / 2, false);
  // Rank 0 the whole cache; rank 1 (TP rank 1, CP rank 0) its slice of every token; ranks 2 and
  // 3 (CP rank 1) nothing but the forward's layer buffers.
  const int64_t want = s.rank_bytes(T) +
                       (c.n_layers * kv_bytes(c, T, c.n_kv_heads / 2, false) + layer_buffers) +
                       2 * layer_buffers;
  EXPECT_EQ(s.host_bytes(T), want);
  EXPECT_EQ(s.rank_bytes(T), c.n_layers * kv_bytes(c, T, c.n_kv_heads, false) + layer_buffers);
  // --selective-kv: CP rank 1 keeps its own rows of its slice too.
  const HostKvSizing sel(options({"--tp", "2", "--cp", "2", "--export", "gathered",
                                  "--attention", "vertical-slash", "--cp-estimate", "--selective-kv"}),
                         c, false, {2});
  EXPECT_EQ(sel.host_bytes(T), c.n_layers * kv_bytes(c, T / 2, c.n_kv_heads / 2, false) +
                                   layer_buffers);
}

TEST(WorkerHostKv, DeviceStagingAndShortPrompts) {
  const model::ModelConfig c = small_config();
  const Options o = options({"--device", "cuda", "--cp", "2", "--kv-staging-layers", "2"});
  const HostKvSizing s(o, c, true, {0});
  // A prompt too short for a 64-token block on every CP rank is computed whole on each.
  EXPECT_EQ(s.rank_rows(255), 255);
  EXPECT_EQ(s.rank_rows(256), 128);
  EXPECT_EQ(s.rank_bytes(256), c.n_layers * s.rank_layer_bytes(256));  // no CPU layer buffers
  EXPECT_EQ(s.staging_bytes(256), 2 * s.rank_layer_bytes(256));        // two pinned slots
  // --kv-staging-layers 0: a slot per layer.
  const HostKvSizing every(options({"--device", "cuda", "--kv-staging-layers", "0"}), c, true, {0});
  EXPECT_EQ(every.staging_bytes(1000), c.n_layers * every.rank_layer_bytes(1000));
}

TEST(WorkerRequestSummary, ParsesWithEveryField) {
  runtime::BatchFile bf = runtime::parse_batch(tokens_line("doc-1", 3));
  ASSERT_EQ(bf.requests.size(), 1u);
  runtime::ParallelStats st;
  st.seconds = 1.5;
  st.kv_allgather_bytes = int64_t(1) << 40;  // past 32 bits
  st.density = 0.25;
  st.kv_moved_bytes_by_rank = {10, 20};
  st.seconds_by_rank = {1.25, 1.5};
  st.group_density = 0.5;
  RequestSummary s;
  s.request = &bf.requests[0];
  s.first_token = 42;
  s.tp = 2;
  s.cp = 1;
  s.stats = &st;
  s.attention = "config:/a \"b\".json";  // quoted as JSON
  s.kv_host_dtype = "f32";
  s.export_mode = "sharded";
  s.device = "cpu";
  s.retention = "full";
  s.kv_dtype = "bf16";
  s.export_streamed = true;
  s.export_layers_at_prefill_end = 3;
  s.fingerprint = "0123456789abcdef";
  s.chunk = 8192;
  s.device_workspace_bytes = int64_t(3) << 33;  // past 32 bits
  const std::string text = request_summary_json(s);
  EXPECT_EQ(text.find('\n'), std::string::npos);
  boost::system::error_code ec;
  const boost::json::value v = boost::json::parse(text, ec);
  ASSERT_FALSE(ec) << ec.message() << "\n" << text;
  const auto& o = v.as_object();
  EXPECT_EQ(o.at("id").as_string(), "doc-1");
  EXPECT_EQ(o.at("line").as_int64(), 1);
  EXPECT_EQ(o.at("n_tokens").as_int64(), 3);
  EXPECT_EQ(o.at("first_token").as_int64(), 42);
  EXPECT_EQ(o.at("tp").as_int64(), 2);
  EXPECT_EQ(o.at("kv_allgather_bytes").as_int64(), int64_t(1) << 40);
  EXPECT_DOUBLE_EQ(o.at("prefill_s").as_double(), 1.5);
  EXPECT_DOUBLE_EQ(o.at("density").as_double(), 0.25);
  EXPECT_DOUBLE_EQ(o.at("group_density").as_double(), 0.5);
  EXPECT_EQ(o.at("attention").as_string(), "config:/a \"b\".json");
  EXPECT_TRUE(o.at("export_streamed").as_bool());
  EXPECT_EQ(o.at("export_layers_at_prefill_end").as_int64(), 3);
  EXPECT_TRUE(o.at("plan_parts").is_null());
  ASSERT_EQ(o.at("kv_moved_bytes_by_rank").as_array().size(), 2u);
  EXPECT_EQ(o.at("kv_moved_bytes_by_rank").as_array()[1].as_int64(), 20);
  EXPECT_DOUBLE_EQ(o.at("prefill_s_by_rank").as_array()[0].as_double(), 1.25);
  EXPECT_TRUE(o.at("density_by_rank").as_array().empty());
  EXPECT_EQ(o.at("estimate_bytes_parts").as_object().size(), 4u);
  EXPECT_EQ(o.at("fingerprint").as_string(), "0123456789abcdef");
  EXPECT_EQ(o.at("chunk").as_int64(), 8192);
  EXPECT_EQ(o.at("device_workspace_bytes").as_int64(), int64_t(3) << 33);
  // A planned device request names where its plan's time went.
  model::PlanTimes pt;
  pt.total_s = 2.0;
  pt.reused_bytes = 7;
  s.plan = pt;
  const boost::json::value w = boost::json::parse(request_summary_json(s));
  EXPECT_DOUBLE_EQ(w.at("plan_parts").at("total_s").as_double(), 2.0);
  EXPECT_EQ(w.at("plan_parts").at("reused_bytes").as_int64(), 7);
  EXPECT_EQ(w.as_object().size(), o.size());
}

}  // namespace
}  // namespace sf::worker
