// Pattern-config validation: every malformed or mismatched config gets an error naming the
// layer, head and field; a saved config round-trips.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "worker/model/sparse_config.h"

namespace sf::model {
namespace {

std::string two_by_two(const std::string& h01) {
  return R"({"n_layers":2,"n_heads":2,"layers":[[{"pattern":"dense"},{"pattern":"a-shape"}],[{"pattern":"vertical-slash","n_vertical":100,"n_slash":200},)" +
         h01 + "]]}";
}

void expect_error(const std::string& json, const std::string& needle) {
  auto r = sparse_config_parse(json, 2, 2, "t.json");
  ASSERT_FALSE(r.is_ok()) << "accepted: " << json;
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
}

TEST(SparseConfig, ParsesValid) {
  auto r = sparse_config_parse(two_by_two(R"({"pattern":"moa","alpha":512,"beta":0.1})"), 2, 2, "t.json");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->layers[1][0].pattern, kernels::Pattern::kVerticalSlash);
  EXPECT_EQ(r->layers[1][0].n_slash, 200);
  EXPECT_DOUBLE_EQ(r->layers[1][1].beta, 0.1);
}

TEST(SparseConfig, RejectsWithLayerHeadField) {
  expect_error(two_by_two(R"({"pattern":"zigzag"})"), "layer 1 head 1: field 'pattern' has unknown value 'zigzag'");
  expect_error(two_by_two(R"({"pattern":"vertical-slash","n_vertical":-5})"), "layer 1 head 1: field 'n_vertical' must be >= 0");
  expect_error(two_by_two(R"({"pattern":"adaptive-vs","gamma":1.5})"), "layer 1 head 1: field 'gamma'");
  expect_error(two_by_two(R"({"pattern":"block-sparse","n_blocks":"many"})"), "layer 1 head 1: field 'n_blocks' must be an integer");
  expect_error(two_by_two(R"({"n_blocks":3})"), "layer 1 head 1: field 'pattern' is missing");
  expect_error(two_by_two(R"({"pattern":"vertical-slash","segment_rows":100})"),
               "layer 1 head 1: field 'segment_rows' must be a multiple of 64 (got 100)");
  expect_error(two_by_two(R"({"pattern":"block-sparse","last_block_rows":1})"),
               "layer 1 head 1: field 'last_block_rows' applies to adaptive-block only");
  expect_error(two_by_two(R"({"pattern":"adaptive-block","last_block_rows":2})"),
               "layer 1 head 1: field 'last_block_rows' must be 0 or 1");
  expect_error(two_by_two(R"({"pattern":"vertical-slash","share_group":2})"),
               "layer 1 head 1: field 'share_group' must be 0 or 1");
  expect_error(two_by_two(R"({"pattern":"vertical-slash","vs_cover":1})"),
               "layer 1 head 1: field 'vs_cover' applies to adaptive-vs only");
  expect_error(two_by_two(R"({"pattern":"adaptive-vs","vs_cover":2})"),
               "layer 1 head 1: field 'vs_cover' must be 0 or 1");
  expect_error(two_by_two(R"({"pattern":"vertical-slash","tail_block_min":64})"),
               "layer 1 head 1: field 'tail_block_min' must be in [0, 63]");
  expect_error(R"({"n_layers":3,"n_heads":2,"layers":[]})", "it is for 3 layers x 2 heads, the model has 2 x 2");
  expect_error(R"({"n_layers":2,"n_heads":2,"layers":[[{"pattern":"dense"}],[]]})", "layer 0 must list 2 heads");
  expect_error("{not json", "invalid JSON");
  // What the estimator would refuse at a prefill's first layer is refused at load, with the layer.
  expect_error(two_by_two(R"({"pattern":"vertical-slash","spread_rows":5000})"),
               "layer 1: sparse_estimate: patterns[1].spread_rows must be in [0, 4096]");
  expect_error(two_by_two(R"({"pattern":"adaptive-vs","vs_cover":1,"segment_rows":128})"),
               "layer 1: sparse_estimate: patterns[1].vs_cover needs segment_rows 0 and share_group 0");
  // An integer past int64 as a JSON double is an error, not an undefined conversion.
  expect_error(two_by_two(R"({"pattern":"vertical-slash","n_vertical":1e19})"),
               "layer 1 head 1: field 'n_vertical' must be an integer");
}

TEST(SparseConfig, ModesAndRoundTrip) {
  auto bad = sparse_config_for_mode("bogus", 2, 2);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("unknown attention mode 'bogus'"), std::string::npos);
  auto a = sparse_config_for_mode("adaptive", 2, 2);
  ASSERT_TRUE(a.is_ok());
  EXPECT_EQ(a->layers[1][1].pattern, kernels::Pattern::kAdaptiveVS);
  auto c = sparse_config_parse(two_by_two(R"({"pattern":"block-sparse","n_blocks":7,"score":0.97})"), 2, 2, "t");
  ASSERT_TRUE(c.is_ok());
  const std::string path = ::testing::TempDir() + "cfg.json";
  ASSERT_TRUE(sparse_config_save(c.value(), path).is_ok());
  auto back = sparse_config_load(path, 2, 2);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->layers[1][1].n_blocks, 7);
  EXPECT_DOUBLE_EQ(back->layers[1][1].score, 0.97);
  // Parse one 2x2 config (head [1][1] from `head`), save it, load it back.
  auto round_trip = [&](const char* head) {
    auto p = sparse_config_parse(two_by_two(head), 2, 2, "t");
    EXPECT_TRUE(p.is_ok()) << p.status().to_string();
    EXPECT_TRUE(p.is_ok() && sparse_config_save(p.value(), path).is_ok());
    auto r = sparse_config_load(path, 2, 2);
    EXPECT_TRUE(r.is_ok()) << r.status().to_string();
    return r.is_ok() ? std::move(r).value() : SparseConfig{};
  };
  auto vb = round_trip(R"({"pattern":"vertical-slash","spread_rows":32,"segment_rows":1024})");
  ASSERT_EQ(vb.layers.size(), 2u);
  EXPECT_EQ(vb.layers[1][1].spread_rows, 32);
  EXPECT_EQ(vb.layers[1][1].segment_rows, 1024);
  // A field set on head [1][1] comes back; heads [0][0] and [1][0], which omit it, read 0.
  auto field_round_trips = [&](const char* head, int64_t kernels::HeadPattern::*field,
                               int64_t want) {
    const SparseConfig c = round_trip(head);
    ASSERT_EQ(c.layers.size(), 2u) << head;
    EXPECT_EQ(c.layers[1][1].*field, want) << head;
    EXPECT_EQ(c.layers[0][0].*field, 0) << head;
    EXPECT_EQ(c.layers[1][0].*field, 0) << head;
  };
  field_round_trips(R"({"pattern":"adaptive-block","last_block_rows":1})",
                    &kernels::HeadPattern::last_block_rows, 1);
  field_round_trips(R"({"pattern":"block-sparse","share_group":1})",
                    &kernels::HeadPattern::share_group, 1);
  field_round_trips(R"({"pattern":"adaptive-vs","vs_cover":1})", &kernels::HeadPattern::vs_cover,
                    1);
  // tail_block_min: a file without the field means 0 (files from before the default became 32
  // keep their index); what the CLI modes build carries the default, and saving writes it out.
  field_round_trips(R"({"pattern":"vertical-slash","tail_block_min":32})",
                    &kernels::HeadPattern::tail_block_min, 32);
  auto vs = sparse_config_for_mode("vertical-slash", 2, 2);
  ASSERT_TRUE(vs.is_ok());
  EXPECT_EQ(vs->layers[1][1].tail_block_min, kernels::HeadPattern{}.tail_block_min);
  EXPECT_EQ(kernels::HeadPattern{}.tail_block_min, 32);
  ASSERT_TRUE(sparse_config_save(vs.value(), path).is_ok());
  auto vs_back = sparse_config_load(path, 2, 2);
  ASSERT_TRUE(vs_back.is_ok()) << vs_back.status().to_string();
  EXPECT_EQ(vs_back->layers[1][1].tail_block_min, 32);
  EXPECT_FALSE(sparse_config_is_dense(back.value()));
  EXPECT_FALSE(sparse_config_load("/nonexistent.json", 2, 2).is_ok());
}

}  // namespace
}  // namespace sf::model
