// Shared by the decode tests: a tiny synthetic model, its prefill and an export of it.
#pragma once
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <random>
#include <optional>
#include <string>

#include "decode/decode_session.h"
#include "kvstore/kv_export.h"
#include "kvstore/retention.h"
#include "tests/common/test_seed.h"
#include "tests/worker/model/model_test_util.h"
#include "worker/model/model.h"

namespace sf::testing {

inline std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(rng() % uint64_t(vocab));
  return t;
}

// A fresh directory under the system temp dir, removed by the destructor.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static int n = 0;
    path = std::filesystem::temp_directory_path() /
           ("sf-decode-test-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string sub(const std::string& s) const { return (path / s).string(); }
};

inline kvstore::ImportanceScores scores_of(const model::PrefillResult& r, int window, int pool) {
  kvstore::ImportanceScores s;
  s.n_layers = int(r.importance.size());
  s.n_kv_heads = r.kv.n_kv_heads;
  s.n_tokens = r.kv.n_tokens;
  s.window = window;
  s.pool = pool;
  s.layers = r.importance;
  return s;
}

inline Status export_prefill(const model::Model& m, const std::vector<int32_t>& toks,
                             const model::PrefillResult& r, const std::string& dir,
                             const kvstore::Retention* ret, const kvstore::ImportanceScores* imp,
                             kvstore::KvEncoding enc = kvstore::KvEncoding::kF32,
                             std::optional<kvstore::KvEncoding> low = std::nullopt) {
  kvstore::KvExportSpec spec = kvstore::model_export_spec(m);
  spec.encoding = enc;
  spec.encoding_low = low;
  spec.n_tokens = int64_t(toks.size());
  spec.token_ids = toks;
  spec.first_token = r.first_token;
  spec.retention = ret;
  spec.importance = imp;
  return kvstore::export_kv(
      dir, spec, [&](int l, bool v) { return (v ? r.kv.v : r.kv.k)[size_t(l)].data(); }, false);
}

}  // namespace sf::testing
