// sparsefill-worker's options without MPI or a model: the defaults, what each flag sets, and every
// rejection naming its flag (the mpi cases in worker_cases.sh check the job's start-up paths).
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "worker/job_identity.h"
#include "tests/worker/worker_args.h"
#include "worker/options.h"

namespace sf::worker {
namespace {

TEST(WorkerOptions, Defaults) {
  auto o = parse_worker_args({});
  ASSERT_TRUE(o.is_ok()) << o.status().to_string();
  EXPECT_EQ(o->model, "m.gguf");
  EXPECT_EQ(o->tp, 1);
  EXPECT_EQ(o->cp, 1);
  EXPECT_EQ(o->device, "cpu");
  EXPECT_EQ(o->export_mode, "sharded");
  EXPECT_TRUE(o->export_overlap);
  EXPECT_EQ(o->export_stream, -1);  // auto
  EXPECT_TRUE(o->kv_host_auto);
  EXPECT_FALSE(o->kv_host_bf16);
  EXPECT_EQ(o->compute_dtype(), DType::kF32);
  EXPECT_EQ(o->kv_dtype.high, kvstore::KvEncoding::kF32);  // --kv-dtype auto on the CPU
  EXPECT_EQ(o->kv_staging_max_bytes(), int64_t(8) << 30);
  EXPECT_FALSE(o->synthetic.has_value());
  EXPECT_EQ(o->chunk, 512);  // the CPU's default chunk
}

// The linear chunk's default follows the device (model::kDefaultChunk*); --chunk overrides it
// on either (docs/api.md and docs/operations.md name these figures).
TEST(WorkerOptions, ChunkDefaultFollowsTheDevice) {
  auto gpu = parse_worker_args({"--device", "cuda"});
  ASSERT_TRUE(gpu.is_ok()) << gpu.status().to_string();
  EXPECT_EQ(gpu->chunk, 8192);
  auto gpu_set = parse_worker_args({"--device", "cuda", "--chunk", "512"});
  ASSERT_TRUE(gpu_set.is_ok()) << gpu_set.status().to_string();
  EXPECT_EQ(gpu_set->chunk, 512);
  auto cpu_set = parse_worker_args({"--chunk", "8192"});
  ASSERT_TRUE(cpu_set.is_ok()) << cpu_set.status().to_string();
  EXPECT_EQ(cpu_set->chunk, 8192);
}

TEST(WorkerOptions, FlagsSetTheirFields) {
  auto o = parse_worker_args({"--device", "cuda", "--tp", "2", "--cp=4", "--export-stream", "off",
                  "--kv-host-dtype", "bf16", "--kv-staging-max-gib", "0", "--export-threads", "3",
                  "--retention", "snapkv:budget=1024", "--host-memory-check", "off"});
  ASSERT_TRUE(o.is_ok()) << o.status().to_string();
  EXPECT_EQ(o->tp, 2);
  EXPECT_EQ(o->cp, 4);
  EXPECT_EQ(o->export_stream, 0);
  EXPECT_TRUE(o->kv_host_bf16);
  EXPECT_FALSE(o->kv_host_auto);
  EXPECT_EQ(o->compute_dtype(), DType::kBF16);
  EXPECT_EQ(o->kv_dtype.high, kvstore::KvEncoding::kBF16);  // auto on the GPU
  EXPECT_EQ(o->kv_staging_max_bytes(), 0);                  // no cap
  EXPECT_EQ(o->export_threads, 3);
  EXPECT_EQ(o->retention.kind, kvstore::RetentionKind::kSnapKV);
  EXPECT_FALSE(o->host_memory_check);
  auto s = parse_worker_args({"--model", "synthetic:llama3-8b:2:7", "--batch", "b", "--out", "o", "--device",
                  "cuda"},
                 false);
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  ASSERT_TRUE(s->synthetic.has_value());
  EXPECT_EQ(s->synthetic->config.n_layers, 2);
  EXPECT_EQ(s->synthetic->seed, 7u);
}

TEST(WorkerOptions, HelpNeedsNothingElse) {
  auto o = parse_worker_args({"--help"}, false);
  ASSERT_TRUE(o.is_ok()) << o.status().to_string();
  EXPECT_TRUE(o->help);
  EXPECT_NE(std::string(kUsage).find("--export-stream auto|on|off"), std::string::npos);
}

TEST(WorkerOptions, RejectionsNameTheFlag) {
  struct Bad {
    std::vector<std::string> args;
    const char* want;  // a part of the message
    bool required = true;
  };
  const std::vector<Bad> bad = {
      {{"--batch", "b", "--out", "o"}, "--model is required", false},
      {{"--tp", "0"}, "--tp must be a positive integer, got '0'"},
      {{"--cp", "two"}, "--cp must be a positive integer"},
      {{"--tp", "4294967298"}, "--tp must be at most 2147483647, got '4294967298'"},
      {{"--cp", "99999999999999999999"}, "--cp must be at most 2147483647"},
      {{"--chunk", "-5"}, "--chunk must be a positive integer"},
      {{"--export", "bogus"}, "--export must be sharded or gathered, got 'bogus'"},
      {{"--export-overlap", "maybe"}, "--export-overlap must be on or off"},
      {{"--export-stream", "yes"}, "--export-stream must be auto, on or off, got 'yes'"},
      {{"--host-memory-check", "maybe"}, "--host-memory-check must be on or off"},
      {{"--export-threads", "65"}, "--export-threads must be in [1, 64], got 65"},
      {{"--kv-staging-layers", "-1"}, "--kv-staging-layers must be in [0, 4096]"},
      {{"--kv-staging-layers", "4097"}, "--kv-staging-layers must be in [0, 4096]"},
      {{"--kv-host-dtype", "f16"}, "--kv-host-dtype must be auto, f32 or bf16"},
      {{"--kv-host-dtype", "bf16"}, "--kv-host-dtype bf16 is the device prefill's"},
      {{"--device", "cuda", "--kv-host-dtype", "bf16", "--kv-dtype", "f32"},
       "an f32 export (--kv-dtype) needs --kv-host-dtype f32"},
      {{"--comm-timeout", "0"}, "--comm-timeout must be a number of seconds in [0.001, 1e6]"},
      {{"--comm-timeout", "1e-4"}, "--comm-timeout must be a number of seconds in [0.001, 1e6]"},
      {{"--stall-timeout", "2e6"}, "--stall-timeout must be a number of seconds in [0.001, 1e6]"},
      {{"--stall-timeout", "0x10"}, "--stall-timeout must be a number of seconds in [0.001, 1e6]"},
      {{"--cp-estimate"}, "--cp-estimate needs a sparse --attention"},
      {{"--attention", "block-sparse", "--selective-kv"}, "--selective-kv needs --cp-estimate"},
      {{"--retention", "snapkv"}, "--retention: retention snapkv needs budget=TOKENS"},
      {{"--metrics-file", "dir/"}, "--metrics-file must name a file"},
      {{"--device", "tpu"}, "--device must be cpu or cuda, got 'tpu'"},
      {{"--kv-dtype", "int3"}, "--kv-dtype: "},
      {{"--device", "cuda", "--export", "gathered"}, "--device cuda runs per-piece estimation"},
      {{"--prefix-cache", "1G", "--cp", "2"}, "--prefix-cache needs a positive size, --tp 1 --cp 1"},
      {{"--model", "synthetic:llama3-8b:2", "--batch", "b", "--out", "o"},
       "draws its weights on the GPU: it needs --device cuda",
       false},
      {{"--tp", "2", "--tp", "3"}, "option --tp is given twice"},
      {{"--no-such-flag", "1"}, "no-such-flag"},
  };
  for (const Bad& b : bad) {
    auto o = parse_worker_args(b.args, b.required);
    std::string joined;
    for (const auto& s : b.args) joined += s + " ";
    ASSERT_FALSE(o.is_ok()) << joined << "was accepted";
    EXPECT_EQ(o.status().code(), Code::kInvalidArgument) << joined;
    EXPECT_NE(o.status().message().find(b.want), std::string::npos)
        << joined << ": got '" << o.status().message() << "', want '" << b.want << "'";
  }
}

// The export fingerprint resume compares: every input it names changes it, nothing else does.
TEST(WorkerOptions, RequestFingerprintNamesItsInputs) {
  const std::vector<int32_t> t{1, 2, 3};
  kvstore::RetentionPolicy full;
  auto snap = kvstore::retention_parse("snapkv:budget=64");
  ASSERT_TRUE(snap.is_ok());
  kvstore::KvEncodings f32{kvstore::KvEncoding::kF32, std::nullopt};
  kvstore::KvEncodings bf16{kvstore::KvEncoding::kBF16, std::nullopt};
  const std::string base = request_fingerprint(t, full, f32, "job", false);
  EXPECT_EQ(base.size(), 16u);
  EXPECT_EQ(base, request_fingerprint(t, full, f32, "job", false));
  EXPECT_NE(base, request_fingerprint({1, 2, 4}, full, f32, "job", false));
  EXPECT_NE(base, request_fingerprint(t, snap.value(), f32, "job", false));
  EXPECT_NE(base, request_fingerprint(t, full, bf16, "job", false));
  EXPECT_NE(base, request_fingerprint(t, full, f32, "job2", false));
  // bf16 host K/V change an f32 export's bytes, not a plain bf16 export's.
  EXPECT_NE(base, request_fingerprint(t, full, f32, "job", true));
  EXPECT_EQ(request_fingerprint(t, full, bf16, "job", false),
            request_fingerprint(t, full, bf16, "job", true));
  EXPECT_NE(policy_fingerprint(full), policy_fingerprint(snap.value()));
  EXPECT_GE(policy_fingerprint(snap.value()), 0);
}


// The job's part of the fingerprint: each option that changes what a prefill computes changes
// it, as do the weights' bytes and an --attention config file's contents under the same paths;
// the options that change no byte of an export do not.
TEST(WorkerOptions, JobIdentityNamesWhatChangesTheBytes) {
  const std::string dir = ::testing::TempDir();
  const std::string model = dir + "/sf_job_identity_model.gguf";
  const std::string attn = dir + "/sf_job_identity_attn.json";
  const auto write = [](const std::string& path, const std::string& text) {
    std::ofstream f(path, std::ios::binary);
    f << text;
  };
  write(model, std::string(4096, 'w'));
  write(attn, "{\"a\": 1}");
  const auto id = [&](const std::vector<std::string>& extra, const std::string& compat = "c") {
    std::vector<std::string> all{"--batch", "b.jsonl", "--out", "o", "--model", model};
    all.insert(all.end(), extra.begin(), extra.end());
    auto o = parse_worker_args(all, false);
    EXPECT_TRUE(o.is_ok()) << o.status().to_string();
    return o.is_ok() ? job_identity(o.value(), compat) : std::string();
  };
  const std::string base = id({});
  EXPECT_EQ(base, id({}));
  EXPECT_NE(base, id({}, "other"));  // another model spec
  for (const std::vector<std::string>& flags : std::vector<std::vector<std::string>>{
           {"--tp", "2"},
           {"--cp", "2"},
           {"--attention", "vertical-slash"},
           {"--export", "gathered"},
           {"--attention", "vertical-slash", "--cp", "2", "--cp-estimate"},
           {"--device", "cuda"}})
    EXPECT_NE(base, id(flags)) << flags[0];
  EXPECT_NE(id({"--attention", "vertical-slash", "--cp", "2"}),
            id({"--attention", "vertical-slash", "--cp", "2", "--cp-estimate"}));
  EXPECT_EQ(base, id({"--export-overlap", "off"}));
  EXPECT_EQ(base, id({"--chunk", "256"}));
  // On GPUs the chunk changes the bytes (GEMM shapes): 512 and the default 8192 differ.
  EXPECT_NE(id({"--device", "cuda"}), id({"--device", "cuda", "--chunk", "512"}));
  EXPECT_EQ(id({"--device", "cuda"}), id({"--device", "cuda", "--chunk", "8192"}));
  // The same paths with other contents.
  const std::string with_config = id({"--attention", "config:" + attn});
  write(attn, "{\"a\": 2}");
  EXPECT_NE(with_config, id({"--attention", "config:" + attn}));
  write(model, std::string(4095, 'w') + "x");
  EXPECT_NE(base, id({}));
  std::remove(model.c_str());
  std::remove(attn.c_str());
}

}  // namespace
}  // namespace sf::worker
