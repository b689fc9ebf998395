// KV tiering during a GPU prefill (issue 4, sparsity-aware tiering): what the device sink costs
// the forward. A Llama-3-8B-shaped model (synthetic BF16 weights drawn on the device, fewer
// layers) prefills one prompt three ways on one plan each, timed in alternating rounds:
//   plain:  no host KV (keep_kv off), importance on: the forward alone;
//   tiered: plain + TieredKv's device sink: each layer's blocks copied on the copy stream (its
//           device share device to device, the rest to pinned host), placed by importance on
//           the host thread, cold device blocks swapped for hot host ones on the pool's stream;
//   hostkv: plain + keep_kv (the forward's own D2H copy of every layer): the copy-out this
//           path replaces, for scale.
// With host_frac < 1 the host tier holds that share of the KV's blocks (at least two layers'
// landings plus one) and a disk tier in disk_dir takes the rest: the tiered run then includes
// the background drain to disk, waited for before its time is taken.
// One JSON line: times (best of reps), the tiered run's overhead over plain, the bytes it wrote
// off the device, the pool's tier counts, the host time place() took, and whether the pool read
// back equals the hostkv run's KV bit for bit (layer 0 and the last layer).
//   sf_bench_kv_tiering_prefill [tokens=32768] [layers=8] [device_frac=0.25] [reps=3]
//                               [host_frac=1] [disk_dir]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "worker/model/config.h"
#include "kvstore/block_pool.h"
#include "kvstore/tiered_kv.h"
#include "worker/model/device_model.h"

using namespace sf;
using sf::bench::fail;
using sf::bench::now_s;

int main(int argc, char** argv) {
  const int64_t S = argc > 1 ? std::atoll(argv[1]) : 32768;
  const int layers = argc > 2 ? std::atoi(argv[2]) : 8;
  const double frac = argc > 3 ? std::atof(argv[3]) : 0.25;
  const int reps = argc > 4 ? std::atoi(argv[4]) : 3;
  const double host_frac = argc > 5 ? std::atof(argv[5]) : 1.0;
  const std::string disk_dir = argc > 6 ? argv[6] : "";
  if (S < 128 || layers < 1 || !(frac > 0 && frac < 1) || reps < 1 ||
      !(host_frac > 0 && host_frac <= 1) || (host_frac < 1) != !disk_dir.empty()) {
    std::fprintf(stderr,
                 "usage: %s [tokens>=128] [layers>=1] [device_frac in (0,1)] [reps>=1] "
                 "[host_frac in (0,1] [disk_dir, with host_frac < 1 only]]\n",
                 argv[0]);
    return 2;
  }
  const model::ModelConfig c = model::llama3_8b_config(layers);
  auto dm = model::DeviceModel::synthetic(c, 1);
  if (!dm.is_ok()) return fail("synthetic model", dm.status());
  std::vector<int32_t> tokens(static_cast<size_t>(S));
  uint64_t x = 88172645463325252ull;
  for (auto& t : tokens) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    t = int32_t(x % uint64_t(c.vocab));
  }

  const int64_t nb = (S + kvstore::kPoolBlockTokens - 1) / kvstore::kPoolBlockTokens;
  const int64_t bb = int64_t(2) * kvstore::kPoolBlockTokens * c.n_kv_heads * c.head_dim * 4;
  kvstore::BlockPoolConfig pc;
  pc.n_kv_heads = c.n_kv_heads;
  pc.head_dim = c.head_dim;
  const int64_t dev_blocks = std::max<int64_t>(int64_t(double(layers * nb) * frac), layers);
  pc.device_bytes = dev_blocks * bb;
  pc.host_bytes = int64_t(layers) * nb * bb;
  if (host_frac < 1) {
    // Never below what the drain needs in flight: two layers' landings and a swap block.
    const int64_t landing = nb - dev_blocks / layers;
    pc.host_bytes = std::max<int64_t>(int64_t(host_frac * double(layers * nb)), 2 * landing + 1) * bb;
    pc.disk_bytes = int64_t(layers) * nb * bb;
    pc.disk_dir = disk_dir;
  }
  auto pool = kvstore::BlockPool::create(pc);
  if (!pool.is_ok()) return fail("pool", pool.status());
  kvstore::TieredKvConfig tc{layers, c.n_kv_heads, c.head_dim};
  tc.fast = kvstore::Tier::kDevice;
  auto tk = kvstore::TieredKv::create(pool->get(), tc);
  if (!tk.is_ok()) return fail("tiered kv", tk.status());
  if (Status st = (*tk)->check_room(S); !st.is_ok()) return fail("room", st);
  // The sink, with place() timed (the host thread's part).
  double place_s = 0;
  model::DeviceLayerKvSink inner = (*tk)->device_sink();
  model::DeviceLayerKvSink sink;
  sink.enqueue = inner.enqueue;
  sink.max_inflight = inner.max_inflight;
  sink.abandon = inner.abandon;  // (a failed run drops its unplaced layers while its stream lives)
  sink.place = [&](int l, std::span<const float> imp) {
    const double t0 = now_s();
    Status st = inner.place(l, imp);
    place_s += now_s() - t0;
    return st;
  };

  model::PrefillOptions base;
  base.chunk = 8192;
  base.keep_kv = false;
  base.importance_window = 32;
  model::PrefillOptions tiered = base, hostkv = base;
  tiered.on_layer_kv_device = sink;
  hostkv.keep_kv = true;
  auto p_plain = model::DevicePrefill::plan(dm.value(), S, base);
  if (!p_plain.is_ok()) return fail("plan plain", p_plain.status());
  auto p_tiered = model::DevicePrefill::plan(dm.value(), S, tiered);
  if (!p_tiered.is_ok()) return fail("plan tiered", p_tiered.status());
  auto p_hostkv = model::DevicePrefill::plan(dm.value(), S, hostkv);
  if (!p_hostkv.is_ok()) return fail("plan hostkv", p_hostkv.status());

  double t_plain = 1e30, t_tiered = 1e30, t_hostkv = 1e30, place_best = 1e30;
  model::PrefillResult kept;
  std::vector<float> logits_plain, logits_tiered;
  // Round 0 warms every plan up (not timed); then alternating rounds, best of reps each.
  for (int r = 0; r <= reps; ++r) {
    double t0 = now_s();
    auto a = p_plain->run(tokens);
    if (!a.is_ok()) return fail("plain run", a.status());
    const double ta = now_s() - t0;
    place_s = 0;
    t0 = now_s();
    auto b = p_tiered->run(tokens);
    if (!b.is_ok()) return fail("tiered run", b.status());
    if (Status st = (*tk)->wait_drained(); !st.is_ok()) return fail("drain", st);
    const double tb = now_s() - t0;
    t0 = now_s();
    auto h = p_hostkv->run(tokens);
    if (!h.is_ok()) return fail("hostkv run", h.status());
    const double th = now_s() - t0;
    if (r == 0) {
      logits_plain = a->logits;
      logits_tiered = b->logits;
      kept = std::move(h).value();
      continue;
    }
    t_plain = std::min(t_plain, ta);
    t_tiered = std::min(t_tiered, tb);
    t_hostkv = std::min(t_hostkv, th);
    place_best = std::min(place_best, place_s);
  }
  bool exact = logits_plain.size() == logits_tiered.size() &&
               std::memcmp(logits_plain.data(), logits_tiered.data(), logits_plain.size() * 4) == 0;
  for (int l : {0, layers - 1}) {
    std::vector<float> k, v;
    Status st = (*tk)->read_layer(l, &k, &v);
    if (!st.is_ok()) return fail("read_layer", st);
    exact = exact && k.size() == kept.kv.k[size_t(l)].size() &&
            std::memcmp(k.data(), kept.kv.k[size_t(l)].data(), k.size() * 4) == 0 &&
            std::memcmp(v.data(), kept.kv.v[size_t(l)].data(), v.size() * 4) == 0;
  }
  const kvstore::TierStats d = (*pool)->stats(kvstore::Tier::kDevice);
  const kvstore::TierStats h = (*pool)->stats(kvstore::Tier::kHost);
  const kvstore::TierStats k = (*pool)->stats(kvstore::Tier::kDisk);
  const int64_t runs = reps + 1;  // every run placed its layers again
  const double kv_bytes = double(layers) * double(nb) * double(bb);
  std::printf(
      "{\"bench\": \"kv_tiering_prefill\", \"device\": \"%s\", \"date\": \"%s\", "
      "\"commit\": \"%s\", "
      "\"command\": \"%s\", \"model\": \"%s\", \"layers\": %d, \"seq_len\": %lld, "
      "\"kv_bytes_f32\": %.0f, \"device_budget_blocks\": %lld, \"blocks\": %lld, "
      "\"plain_prefill_s\": %.4f, \"tiered_prefill_s\": %.4f, \"hostkv_prefill_s\": %.4f, "
      "\"tiered_over_plain\": %.4f, \"hostkv_over_plain\": %.4f, \"place_host_s\": %.4f, "
      "\"device_blocks\": %lld, \"host_blocks\": %lld, \"swapped_per_run\": %.1f, "
      "\"host_budget_blocks\": %lld, \"host_keep_per_layer\": %lld, \"disk_blocks\": %lld, "
      "\"to_disk_per_run\": %.1f, \"to_disk_GBps\": %.2f, \"host_wait_s_per_run\": %.4f, "
      "\"written_off_device_GBps\": %.2f, \"byte_exact\": %s}\n",
      dm->device_name().c_str(), sf::now_iso8601().c_str(), sf::bench::source_commit().c_str(),
      sf::bench::command_line(argc, argv).c_str(), c.name.c_str(), layers,
      static_cast<long long>(S), kv_bytes, static_cast<long long>(dev_blocks),
      static_cast<long long>(int64_t(layers) * nb), t_plain, t_tiered, t_hostkv,
      t_tiered / t_plain, t_hostkv / t_plain, place_best, static_cast<long long>(d.blocks),
      static_cast<long long>(h.blocks), double(d.demoted_out) / double(runs),
      static_cast<long long>(h.capacity_bytes / bb),
      static_cast<long long>(host_frac < 1 ? (*tk)->host_keep(S) : nb - dev_blocks / layers),
      static_cast<long long>(k.blocks), double(h.demoted_out) / double(runs),
      // The last run's blocks to disk over its wall time (the drain overlaps the compute).
      double(k.blocks) * double(bb) / t_tiered / 1e9, (*tk)->host_wait_seconds() / double(runs),
      // Bytes that left the device per tiered run (spilled blocks' copies plus demotions) over
      // the tiered run's wall time: the copy stream's average rate beside the compute.
      (double(h.blocks + k.blocks) * double(bb)) / t_tiered / 1e9, exact ? "true" : "false");
  return exact ? 0 : 1;
}
