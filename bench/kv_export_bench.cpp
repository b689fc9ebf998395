// KV export and load throughput (CPU): a synthetic cache of Llama-3-8B-like geometry (random
// keys and values, never zeros) exported with kvstore::export_kv, full retention, then loaded
// back with decode::load_kv_export (checksums, compat hash, decode to F32), each timed; best of
// reps. Both run layers_in_flight layers at once. One JSON line: the CPU, bytes of K/V, seconds
// and GB/s of each, the thread count.
//   sf_bench_kv_export [tokens=32768] [layers=8] [kv_heads=8] [head_dim=128] [dtype=f32] [reps=3]
//                      [layers_in_flight=kvstore::default_layers_in_flight()]
//                      [dir=$TMPDIR/sf-kv-export-bench]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "common/file_io.h"
#include "common/thread_pool.h"
#include "decode/kv_client.h"
#include "kvstore/kv_export.h"

using namespace sf;

int main(int argc, char** argv) {
  const int64_t S = argc > 1 ? std::atoll(argv[1]) : 32768;
  const int L = argc > 2 ? std::atoi(argv[2]) : 8;
  const int hkv = argc > 3 ? std::atoi(argv[3]) : 8;
  const int d = argc > 4 ? std::atoi(argv[4]) : 128;
  const std::string dtype = argc > 5 ? argv[5] : "f32";
  const int reps = argc > 6 ? std::atoi(argv[6]) : 3;
  kvstore::ExportOptions eo;
  eo.layers_in_flight = argc > 7 ? std::atoi(argv[7]) : kvstore::default_layers_in_flight();
  const std::filesystem::path dir =
      argc > 8 ? std::filesystem::path(argv[8])
               : std::filesystem::temp_directory_path() / "sf-kv-export-bench";
  auto enc = kvstore::kv_encoding_parse(dtype);
  if (S < 64 || L < 1 || hkv < 1 || d < 8 || d % 8 || reps < 1 || !enc.is_ok() ||
      eo.layers_in_flight < 1) {
    std::fprintf(stderr,
                 "usage: %s [tokens>=64] [layers] [kv_heads] [head_dim: a multiple of 8] "
                 "[f32|bf16|int8|int4] [reps] [layers_in_flight>=1] [dir]\n",
                 argv[0]);
    return 2;
  }
  kvstore::KvExportSpec spec;
  spec.model_name = "bench";
  spec.arch = "llama";
  spec.n_layers = L;
  spec.n_kv_heads = hkv;
  spec.head_dim = d;
  spec.rope_theta = 500000.f;
  spec.n_tokens = S;
  spec.token_ids.resize(size_t(S));
  spec.first_token = 1;
  spec.encoding = enc.value();
  std::mt19937_64 rng(12345);
  for (auto& t : spec.token_ids) t = int32_t(rng() % 128000);
  // Every layer's K and V, [S, hkv, d]: uniform values in (-2, 2) from an xorshift stream a
  // vector, drawn on the pool.
  std::vector<std::vector<float>> kv(size_t(2 * L));
  std::vector<std::vector<float>*> vs;
  for (auto& v : kv) vs.push_back(&v);
  if (!size_vectors(vs, size_t(S * hkv * d))) return 1;
  parallel_for(kv.size(), [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      uint64_t x = 0x9E3779B97F4A7C15ull * (i + 1);
      for (float& f : kv[i]) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        f = float(int64_t(x >> 40) - (int64_t(1) << 23)) * (2.f / float(1 << 23));
      }
    }
  });
  const kvstore::LayerSource src = [&](int l, bool value) {
    return kv[size_t(2 * l + (value ? 1 : 0))].data();
  };
  const std::string hash = kvstore::compat_hash(spec);
  double t_exp = 1e30, t_load = 1e30;
  int64_t disk = 0;
  for (int r = 0; r < reps; ++r) {
    double t0 = bench::now_s();
    const Status st = kvstore::export_kv(dir.string(), spec, src, /*force=*/true, eo);
    if (!st.is_ok()) return bench::fail("export", st);
    t_exp = std::min(t_exp, bench::now_s() - t0);
    t0 = bench::now_s();
    auto loaded = decode::load_kv_export(dir.string(), hash, eo.layers_in_flight);
    if (!loaded.is_ok()) return bench::fail("load", loaded.status());
    t_load = std::min(t_load, bench::now_s() - t0);
    if (r == 0) {  // the round trip must be the cache written (F32: exact)
      disk = 0;
      for (const auto& e : std::filesystem::directory_iterator(dir)) disk += int64_t(e.file_size());
      if (spec.encoding == kvstore::KvEncoding::kF32) {
        const auto& h = loaded->head(L - 1, hkv - 1);
        for (int64_t t = 0; t < S; t += 997)
          for (int j = 0; j < d; ++j)
            if (h.v[size_t(t * d + j)] != kv[size_t(2 * L - 1)][size_t((t * hkv + hkv - 1) * d + j)]) {
              std::fprintf(stderr, "load: value mismatch at token %lld\n", (long long)t);
              return 1;
            }
      }
    }
  }
  std::filesystem::remove_all(dir);
  std::string json_cpu;  // the CPU's name, as a JSON string's contents
  for (char ch : cpu_name())
    if (ch != '"' && ch != '\\') json_cpu += ch;
  const double f32_bytes = double(2) * L * S * hkv * d * 4;
  std::printf(
      "{\"bench\": \"kv_export\", \"device\": \"CPU: %s\", \"tokens\": %lld, \"layers\": %d, \"kv_heads\": %d, "
      "\"head_dim\": %d, \"kv_dtype\": \"%s\", \"threads\": %d, \"layers_in_flight\": %d, "
      "\"f32_kv_bytes\": %.0f, "
      "\"export_bytes\": %lld, \"export_s\": %.3f, \"export_f32_GBps\": %.2f, \"load_s\": %.3f, "
      "\"load_f32_GBps\": %.2f, \"date\": \"%s\", \"commit\": \"%s\", \"command\": \"%s\"}\n",
      json_cpu.c_str(), (long long)S, L, hkv, d, dtype.c_str(), num_threads(), eo.layers_in_flight, f32_bytes, (long long)disk, t_exp,
      f32_bytes / t_exp / 1e9, t_load, f32_bytes / t_load / 1e9, now_iso8601().c_str(),
      bench::source_commit().c_str(), bench::command_line(argc, argv).c_str());
  return 0;
}
