// Tiering copy bandwidth on a GPU host (issue 4 target: pool demotions reach >= 80% of the pinned
// device-to-host bandwidth measured in the same run). Demotes the blocks of a full device tier to
// the pinned host tier (one by one, as an ordered batch, as a shuffled batch on the copy stream)
// and compares with one cudaMemcpy of all the bytes from a cudaMalloc'd to a cudaHostAlloc'd
// buffer.
//   sf_bench_kv_tiering [n_blocks=2048] [n_kv_heads=8] [head_dim=128]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "bench/bench_util.h"
#include "kvstore/block_pool.h"

using namespace sf::kvstore;
using sf::bench::fail;
using sf::bench::now_s;

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 2048;
  const int heads = argc > 2 ? std::atoi(argv[2]) : 8;
  const int dim = argc > 3 ? std::atoi(argv[3]) : 128;
  BlockPoolConfig c;
  c.n_kv_heads = heads;
  c.head_dim = dim;
  const int64_t bb = int64_t(2) * kPoolBlockTokens * heads * dim * 4;
  c.device_bytes = n * bb;
  c.host_bytes = n * bb;
  auto pr = BlockPool::create(c);
  if (!pr.is_ok()) return fail("create", pr.status());
  BlockPool& pool = *pr.value();
  std::vector<float> k(size_t(pool.half_floats())), v(k.size());
  std::mt19937 rng(1);
  for (auto& x : k) x = float(rng() % 1000);
  for (auto& x : v) x = -float(rng() % 1000);
  std::vector<BlockId> ids;
  for (int64_t i = 0; i < n; ++i) {
    auto id = pool.alloc(Tier::kDevice);
    if (!id.is_ok()) return fail("alloc", id.status());
    if (pool.tier_of(*id).value() != Tier::kDevice)
      return fail("alloc", SF_ERR(kInternal, "spill"));
    sf::Status st = pool.write(*id, k.data(), v.data());
    if (!st.is_ok()) return fail("write", st);
    ids.push_back(*id);
  }
  // Ceiling: one large pinned D2H copy of the same bytes, best of 3.
  void *dsrc = nullptr, *hdst = nullptr;
  if (cudaMalloc(&dsrc, size_t(n * bb)) != cudaSuccess ||
      cudaHostAlloc(&hdst, size_t(n * bb), cudaHostAllocDefault) != cudaSuccess) {
    std::fprintf(stderr, "raw buffers: allocation failed\n");
    return 1;
  }
  cudaMemset(dsrc, 1, size_t(n * bb));
  double raw = 1e30;
  for (int r = 0; r < 3; ++r) {
    const double t0 = now_s();
    cudaMemcpy(hdst, dsrc, size_t(n * bb), cudaMemcpyDeviceToHost);
    raw = std::min(raw, now_s() - t0);
  }
  cudaFree(dsrc);
  cudaFreeHost(hdst);
  // A third of the blocks one by one (BlockPool::move), a third as one batch in slot order
  // (coalesced into few copies), a third as one batch in shuffled order (one copy per block, the
  // fragmented case). Each part copies distinct device slots to distinct host slots.
  const size_t third = ids.size() / 3;
  double t0 = now_s();
  for (size_t i = 0; i < third; ++i) {
    sf::Status st = pool.move(ids[i], Tier::kHost);
    if (!st.is_ok()) return fail("move", st);
  }
  const double single = now_s() - t0;
  t0 = now_s();
  sf::Status bst =
      pool.move_batch(std::span<const BlockId>(ids).subspan(third, third), Tier::kHost);
  if (!bst.is_ok()) return fail("move_batch", bst);
  const double ordered = now_s() - t0;
  std::vector<BlockId> rest(ids.begin() + 2 * std::ptrdiff_t(third), ids.end());
  std::shuffle(rest.begin(), rest.end(), rng);
  t0 = now_s();
  bst = pool.move_batch(rest, Tier::kHost);
  if (!bst.is_ok()) return fail("move_batch", bst);
  const double shuffled = now_s() - t0;
  std::vector<float> k2(k.size()), v2(v.size());
  bool exact = true;
  for (BlockId id : {ids.front(), ids[third], ids.back()}) {  // one of each path
    sf::Status st = pool.read(id, k2.data(), v2.data());
    if (!st.is_ok()) return fail("read", st);
    exact = exact && std::memcmp(k.data(), k2.data(), k.size() * 4) == 0 &&
            std::memcmp(v.data(), v2.data(), v.size() * 4) == 0;
  }
  const double gbs_raw = double(n * bb) / raw / 1e9;
  const double g1 = double(third) * double(bb) / single / 1e9;
  const double g2 = double(third) * double(bb) / ordered / 1e9;
  const double g3 = double(rest.size()) * double(bb) / shuffled / 1e9;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) std::snprintf(prop.name, 8, "unknown");
  std::printf(
      "{\"device\": \"%s\", \"blocks\": %lld, \"block_bytes\": %lld, \"pinned_d2h_GBps\": %.2f, "
      "\"move_GBps\": %.2f, \"batch_ordered_GBps\": %.2f, \"batch_shuffled_GBps\": %.2f, "
      "\"ratio_move\": %.3f, \"ratio_batch_ordered\": %.3f, \"ratio_batch_shuffled\": %.3f, "
      "\"byte_exact\": %s, \"date\": \"%s\", \"commit\": \"%s\", \"command\": \"%s\"}\n",
      prop.name, (long long)n, (long long)bb, gbs_raw, g1, g2, g3, g1 / gbs_raw, g2 / gbs_raw,
      g3 / gbs_raw, exact ? "true" : "false", sf::now_iso8601().c_str(),
      sf::bench::source_commit().c_str(), sf::bench::command_line(argc, argv).c_str());
  return exact ? 0 : 1;
}
