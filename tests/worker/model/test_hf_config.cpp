// Hugging Face config.json -> ModelConfig, shard discovery, and ModelConfig::validate().
// The configs below are the published config.json files of the named checkpoints.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "worker/model/hf_config.h"

namespace sf::model {
namespace {

namespace fs = std::filesystem;

const char* kLlama31_8B = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
  "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
  "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256})";

const char* kLlama2_7B = R"({
  "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null,
  "tie_word_embeddings": false, "torch_dtype": "float16", "transformers_version": "4.31.0.dev0",
  "use_cache": true, "vocab_size": 32000})";

const char* kQwen2_05B = R"({
  "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
  "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
  "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
  "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
  "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "sliding_window": 32768, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.40.1", "use_cache": true, "use_sliding_window": false,
  "vocab_size": 151936})";

const char* kMistral7B_v02 = R"({
  "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
  "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": null,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.36.0",
  "use_cache": true, "vocab_size": 32000})";

// Replaces the first occurrence of `from` (which must exist) in `s`.
std::string edit(std::string s, const std::string& from, const std::string& to) {
  const size_t p = s.find(from);
  EXPECT_NE(p, std::string::npos) << from;
  if (p != std::string::npos) s.replace(p, from.size(), to);
  return s;
}

void expect_error(const std::string& json, Code code, const std::string& needle) {
  Result<ModelConfig> r = config_from_hf_json(json, "m");
  ASSERT_FALSE(r.is_ok()) << "accepted: " << json;
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  EXPECT_NE(r.status().message().find(needle), std::string::npos)
      << "'" << r.status().message() << "' does not mention '" << needle << "'";
}

TEST(HfConfig, Llama3WithRopeScaling) {
  Result<ModelConfig> r = config_from_hf_json(kLlama31_8B, "Llama-3.1-8B");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  const ModelConfig& c = *r;
  EXPECT_EQ(c.arch, Arch::kLlama);
  EXPECT_EQ(c.name, "Llama-3.1-8B");
  EXPECT_EQ(c.n_layers, 32);
  EXPECT_EQ(c.hidden, 4096);
  EXPECT_EQ(c.n_heads, 32);
  EXPECT_EQ(c.n_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.intermediate, 14336);
  EXPECT_EQ(c.vocab, 128256);
  EXPECT_EQ(c.max_context, 131072);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_TRUE(c.rope.neox);
  EXPECT_FLOAT_EQ(c.rope.theta, 500000.f);
  EXPECT_FLOAT_EQ(c.rope.scaling_factor, 8.f);
  EXPECT_FLOAT_EQ(c.rope.low_freq_factor, 1.f);
  EXPECT_FLOAT_EQ(c.rope.high_freq_factor, 4.f);
  EXPECT_EQ(c.rope.original_max_pos, 8192);
  EXPECT_EQ(c.rope.rot_dim, 0);
  EXPECT_TRUE(c.validate().is_ok());
}

TEST(HfConfig, Llama2Defaults) {
  Result<ModelConfig> r = config_from_hf_json(kLlama2_7B, "Llama-2-7b");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->n_kv_heads, 32);
  EXPECT_EQ(r->head_dim, 128);
  EXPECT_FLOAT_EQ(r->rope.theta, 10000.f);  // absent: transformers' default
  EXPECT_EQ(r->rope.scaling_factor, 0.f);   // rope_scaling: null
  // num_key_value_heads absent defaults to num_attention_heads.
  Result<ModelConfig> r2 =
      config_from_hf_json(edit(kLlama2_7B, "\"num_key_value_heads\": 32,", ""), "m");
  ASSERT_TRUE(r2.is_ok()) << r2.status().to_string();
  EXPECT_EQ(r2->n_kv_heads, 32);
  // An explicit head_dim wins over hidden / heads (e.g. Mistral-Nemo: 5120 hidden, 32 x 128).
  Result<ModelConfig> r3 = config_from_hf_json(
      edit(kLlama2_7B, "\"hidden_size\": 4096", "\"hidden_size\": 5120, \"head_dim\": 128"), "m");
  ASSERT_TRUE(r3.is_ok()) << r3.status().to_string();
  EXPECT_EQ(r3->head_dim, 128);
  EXPECT_EQ(r3->hidden, 5120);
}

TEST(HfConfig, Qwen2HasQkvBiasAndTiedEmbeddings) {
  Result<ModelConfig> r = config_from_hf_json(kQwen2_05B, "Qwen2-0.5B-Instruct");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->arch, Arch::kQwen2);
  EXPECT_TRUE(r->qkv_bias);
  EXPECT_TRUE(r->tied_embeddings);
  EXPECT_EQ(r->head_dim, 64);
  EXPECT_EQ(r->n_kv_heads, 2);
  EXPECT_FLOAT_EQ(r->rope.theta, 1e6f);
  EXPECT_TRUE(r->rope.neox);
  expect_error(edit(kQwen2_05B, "\"use_sliding_window\": false", "\"use_sliding_window\": true"),
               Code::kUnsupported, "use_sliding_window");
}

TEST(HfConfig, Mistral) {
  Result<ModelConfig> r = config_from_hf_json(kMistral7B_v02, "Mistral-7B-Instruct-v0.2");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->arch, Arch::kMistral);
  EXPECT_FALSE(r->qkv_bias);
  // Mistral-7B-v0.1 states a 4096-token sliding window, which the forward does not implement.
  expect_error(edit(kMistral7B_v02, "\"sliding_window\": null", "\"sliding_window\": 4096"),
               Code::kUnsupported, "sliding_window=4096");
}

TEST(HfConfig, RejectsUnknownArchitecturesAndFeatures) {
  expect_error(edit(kLlama2_7B, "LlamaForCausalLM", "GPTNeoXForCausalLM"), Code::kUnsupported,
               "GPTNeoXForCausalLM");
  // Without "architectures", model_type decides.
  Result<ModelConfig> r =
      config_from_hf_json(edit(kLlama2_7B, "\"architectures\": [\"LlamaForCausalLM\"],", ""), "m");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  expect_error(edit(edit(kLlama2_7B, "\"architectures\": [\"LlamaForCausalLM\"],", ""),
                    "\"model_type\": \"llama\"", "\"model_type\": \"gemma\""),
               Code::kUnsupported, "'gemma'");
  expect_error(edit(edit(kLlama2_7B, "\"architectures\": [\"LlamaForCausalLM\"],", ""),
                    "\"model_type\": \"llama\",", ""),
               Code::kCorrupt, "missing field 'architectures'");
  expect_error(edit(kLlama2_7B, "[\"LlamaForCausalLM\"]", "[]"), Code::kCorrupt, "'architectures'");
  expect_error(edit(kLlama31_8B, "\"rope_type\": \"llama3\"", "\"rope_type\": \"yarn\""),
               Code::kUnsupported, "rope_type 'yarn'");
  expect_error(edit(kLlama31_8B, "\"rope_type\": \"llama3\"", "\"type\": \"linear\""),
               Code::kUnsupported, "rope_type 'linear'");
  expect_error(edit(kLlama31_8B, ", \"rope_type\": \"llama3\"", ""), Code::kCorrupt,
               "rope_scaling: missing field 'rope_type'");
  expect_error(edit(kLlama31_8B, "\"low_freq_factor\": 1.0, ", ""), Code::kCorrupt,
               "missing field 'low_freq_factor'");
  expect_error(edit(kLlama31_8B, "\"high_freq_factor\": 4.0", "\"high_freq_factor\": 1.0"),
               Code::kCorrupt, "high_freq_factor must exceed");
  expect_error(edit(kLlama31_8B, "\"attention_bias\": false", "\"attention_bias\": true"),
               Code::kUnsupported, "attention_bias");
  expect_error(edit(kLlama31_8B, "\"mlp_bias\": false", "\"mlp_bias\": true"), Code::kUnsupported,
               "mlp_bias");
  expect_error(edit(kLlama31_8B, "\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\""),
               Code::kUnsupported, "hidden_act 'gelu'");
  expect_error(edit(kLlama31_8B, "\"use_cache\": true", "\"quantization_config\": {\"bits\": 4}"),
               Code::kUnsupported, "quantization_config");
}

TEST(HfConfig, MissingAndMistypedFieldsAreNamed) {
  for (const char* field : {"hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads", "vocab_size", "max_position_embeddings"}) {
    std::string j = kLlama31_8B;
    const size_t p = j.find(std::string("\"") + field + "\"");
    ASSERT_NE(p, std::string::npos);
    j.replace(p, 1, "\"x_");  // rename the key so the field is absent
    expect_error(j, Code::kCorrupt, std::string("missing field '") + field + "'");
  }
  expect_error(edit(kLlama31_8B, "\"hidden_size\": 4096", "\"hidden_size\": \"4096\""),
               Code::kCorrupt, "'hidden_size' must be a positive integer, got a string");
  expect_error(edit(kLlama31_8B, "\"hidden_size\": 4096", "\"hidden_size\": -4096"), Code::kCorrupt,
               "'hidden_size' must be a positive integer");
  expect_error(edit(kLlama31_8B, "\"hidden_size\": 4096", "\"hidden_size\": 4096.5"),
               Code::kCorrupt, "'hidden_size' must be a positive integer, got a float");
  expect_error(edit(kLlama31_8B, "\"num_hidden_layers\": 32", "\"num_hidden_layers\": 4294967328"),
               Code::kCorrupt, "'num_hidden_layers' must be a positive integer below 2^31");
  expect_error(edit(kLlama31_8B, "\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5"),
               Code::kCorrupt, "num_key_value_heads (5) must divide num_attention_heads (32)");
  expect_error(edit(kLlama31_8B, "\"hidden_size\": 4096", "\"hidden_size\": 4001"), Code::kCorrupt,
               "not divisible by num_attention_heads");
  expect_error(edit(kLlama31_8B, "\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": \"small\""),
               Code::kCorrupt, "'rms_norm_eps' must be a number");
  expect_error(edit(kLlama31_8B, "\"tie_word_embeddings\": false", "\"tie_word_embeddings\": 0"),
               Code::kCorrupt, "'tie_word_embeddings' must be a boolean");
  expect_error(edit(kLlama31_8B, "\"rope_scaling\": {", "\"rope_scaling\": [{"), Code::kCorrupt,
               "not valid JSON");
  expect_error("[]", Code::kCorrupt, "not a JSON object");
  expect_error("", Code::kCorrupt, "not valid JSON");
}

TEST(HfConfig, EveryTruncationFailsCleanly) {
  const std::string full = kLlama31_8B;
  for (size_t n = 0; n < full.size(); ++n) {
    const std::string prefix = full.substr(0, n);
    EXPECT_FALSE(config_from_hf_json(prefix, "m").is_ok()) << n;
  }
}

TEST(ModelConfigValidate, NamesTheField) {
  ModelConfig good = config_from_hf_json(kLlama31_8B, "v").value();
  ASSERT_TRUE(good.validate().is_ok());
  auto expect_bad = [&](auto mutate, const std::string& needle) {
    ModelConfig c = good;
    mutate(c);
    const Status st = c.validate();
    ASSERT_FALSE(st.is_ok()) << needle;
    EXPECT_EQ(st.code(), Code::kInvalidArgument);
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.to_string();
  };
  expect_bad([](ModelConfig& c) { c.n_layers = 0; }, "n_layers must be positive");
  expect_bad([](ModelConfig& c) { c.hidden = -1; }, "hidden must be positive");
  expect_bad([](ModelConfig& c) { c.n_kv_heads = 0; }, "n_kv_heads must be positive");
  expect_bad([](ModelConfig& c) { c.vocab = 0; }, "vocab must be positive");
  expect_bad([](ModelConfig& c) { c.intermediate = 0; }, "intermediate must be positive");
  expect_bad([](ModelConfig& c) { c.n_kv_heads = 3; }, "n_kv_heads (3) must divide n_heads (32)");
  expect_bad([](ModelConfig& c) { c.head_dim = 127; }, "head_dim must be even");
  expect_bad([](ModelConfig& c) { c.rms_eps = 0.f; }, "rms_eps");
  expect_bad([](ModelConfig& c) { c.rope.theta = -1.f; }, "rope.theta");
  expect_bad([](ModelConfig& c) { c.rope.rot_dim = 130; }, "rope.rot_dim");
  expect_bad([](ModelConfig& c) { c.rope.high_freq_factor = 0.5f; }, "rope.high_freq_factor");
  expect_bad([](ModelConfig& c) { c.rope.original_max_pos = 0; }, "rope.original_max_pos");
  expect_bad([](ModelConfig& c) { c.max_context = -5; }, "max_context");
}

TEST(Arch, NamesRoundTrip) {
  for (Arch a : {Arch::kLlama, Arch::kMistral, Arch::kQwen2}) {
    Result<Arch> r = arch_from_string(arch_name(a));
    ASSERT_TRUE(r.is_ok());
    EXPECT_EQ(*r, a);
  }
  EXPECT_EQ(arch_from_string("Qwen2ForCausalLM").value(), Arch::kQwen2);
  EXPECT_EQ(arch_from_string("MistralForCausalLM").value(), Arch::kMistral);
  EXPECT_EQ(arch_from_string("falcon").status().code(), Code::kUnsupported);
  EXPECT_NE(arch_from_string("falcon").status().message().find("'falcon'"), std::string::npos);
}

class HfDir : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(testing::TempDir()) /
           ("sf_hf_" + std::to_string(::getpid()) + "_" +
            testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  void put(const std::string& name, const std::string& text) { std::ofstream(dir_ / name) << text; }
  std::string d() const { return dir_.string(); }
  fs::path dir_;
};

TEST_F(HfDir, ConfigFromDirUsesDirName) {
  put("config.json", kQwen2_05B);
  Result<ModelConfig> r = config_from_hf_dir(d() + "/");
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(r->name, dir_.filename().string());
  fs::remove(dir_ / "config.json");
  EXPECT_EQ(config_from_hf_dir(d()).status().code(), Code::kNotFound);
}

TEST_F(HfDir, ShardsFromIndex) {
  put("model-00002-of-00002.safetensors", "x");
  put("model-00001-of-00002.safetensors", "x");
  put("model.safetensors.index.json", R"({"metadata": {"total_size": 16},
    "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors",
                   "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                   "model.norm.weight": "model-00002-of-00002.safetensors"}})");
  Result<std::vector<std::string>> r = hf_shard_files(d());
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[0], d() + "/model-00001-of-00002.safetensors");
  EXPECT_EQ((*r)[1], d() + "/model-00002-of-00002.safetensors");
}

TEST_F(HfDir, ShardIndexErrors) {
  put("model.safetensors.index.json", R"({"weight_map": {"a": "missing.safetensors"}})");
  Result<std::vector<std::string>> r = hf_shard_files(d());
  EXPECT_EQ(r.status().code(), Code::kNotFound);
  EXPECT_NE(r.status().message().find("'missing.safetensors'"), std::string::npos);
  put("model.safetensors.index.json", R"({"weight_map": {"a": "../etc/passwd"}})");
  r = hf_shard_files(d());
  EXPECT_EQ(r.status().code(), Code::kCorrupt);
  EXPECT_NE(r.status().message().find("not a plain file name"), std::string::npos);
  put("model.safetensors.index.json", R"({"weight_map": {"a": 3}})");
  EXPECT_NE(hf_shard_files(d()).status().message().find("entry for 'a' is not a string"),
            std::string::npos);
  put("model.safetensors.index.json", R"({"metadata": {}})");
  EXPECT_NE(hf_shard_files(d()).status().message().find("missing field 'weight_map'"),
            std::string::npos);
  put("model.safetensors.index.json", R"({"weight_map": {}})");
  EXPECT_NE(hf_shard_files(d()).status().message().find("empty"), std::string::npos);
  put("model.safetensors.index.json", "{");
  EXPECT_EQ(hf_shard_files(d()).status().code(), Code::kCorrupt);
}

TEST_F(HfDir, SingleFileFallback) {
  EXPECT_EQ(hf_shard_files(d()).status().code(), Code::kNotFound);
  put("model.safetensors", "x");
  Result<std::vector<std::string>> r = hf_shard_files(d());
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  EXPECT_EQ(*r, std::vector<std::string>{d() + "/model.safetensors"});
}

}  // namespace
}  // namespace sf::model
