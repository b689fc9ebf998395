// Sizes a KvCache's per-layer K and V vectors (their pages faulted in) on threads of its own,
// in layer order, while the caller goes on: the device forward starts one at a run's start, so
// the host's first touch of a long prompt's KV (tens of GB at 1M tokens) overlaps the device's
// first layers, and each layer's landing waits only for its own two vectors.
#pragma once
#include <condition_variable>
#include <functional>
#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

#include "common/status.h"
#include "worker/model/model.h"

namespace sf::model {

class KvSizer {
 public:
  // Sizes every layer's kv->k[l] and kv->v[l] (kv->k and kv->v already hold n_layers vectors,
  // not resized while this lives; with KvCache::bf16(), kv->k16 and kv->v16) to `floats`
  // elements each, on `threads` threads of its own (not the CPU
  // pool, whose parallel regions run one at a time and would queue the caller's copies behind
  // the sizing). Where no thread can start, the first wait() sizes everything inline.
  // on_vector (tests): called on the sizing thread before vector i (layer i / 2's K, then V).
  KvSizer(KvCache* kv, size_t floats, int threads,
          std::function<void(size_t)> on_vector = {});
  // Stops (vectors not yet begun are skipped) and joins.
  ~KvSizer();
  // Vectors not yet begun are skipped from now on (a failed run's caller that goes on enqueuing
  // to keep its group in step stops faulting in memory nobody will read); wait() for a layer
  // left unsized then fails. Does not join.
  void stop();
  KvSizer(const KvSizer&) = delete;
  KvSizer& operator=(const KvSizer&) = delete;

  // Once layer l's K and V are sized: ok, or the sizing's error (kResourceExhausted).
  [[nodiscard]] Status wait(int layer);
  // Every vector sized and the threads joined: the sizing's status and, in *seconds, its time.
  [[nodiscard]] Status finish(double* seconds);

 private:
  void run() noexcept;
  Status size_one(size_t i);

  KvCache* kv_;
  size_t floats_;
  std::function<void(size_t)> on_vector_;
  int threads_;
  bool bf16_;
  int n_layers_;
  std::thread thread_;
  bool started_ = false;  // a thread, or the inline sizing, has begun
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> vectors_sized_;  // per layer: 0, 1 or 2
  int sized_layers_ = 0;            // layers [0, sized_layers_) are sized
  bool done_ = false, stop_ = false;
  Status status_;
  double seconds_ = 0;
};

}  // namespace sf::model
