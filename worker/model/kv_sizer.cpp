#include "worker/model/kv_sizer.h"

#include <chrono>
#include <utility>
#include <exception>
#include <string>
#include <system_error>

#include "common/thread_pool.h"
#include "common/timing.h"

namespace sf::model {

KvSizer::KvSizer(KvCache* kv, size_t floats, int threads, std::function<void(size_t)> on_vector)
    : kv_(kv), floats_(floats), on_vector_(std::move(on_vector)),
      threads_(threads < 1 ? 1 : threads), bf16_(kv->bf16()),
      n_layers_(int(bf16_ ? kv->k16.size() : kv->k.size())), vectors_sized_(size_t(n_layers_), 0) {
  try {
    thread_ = std::thread([this] { run(); });
    started_ = true;
  } catch (const std::exception&) {  // std::system_error, or no memory for the thread
    // No thread to spare: the first wait() sizes everything inline.
  }
}

KvSizer::~KvSizer() {
  if (!thread_.joinable()) return;
  stop();
  thread_.join();
}

void KvSizer::stop() {
  std::lock_guard<std::mutex> lk(mu_);
  stop_ = true;
}

// Vector i: layer i / 2's K (even) or V (odd); then publishes the layers now whole.
Status KvSizer::size_one(size_t i) {
  const size_t l = i / 2;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return Status::ok();  // the owner is going: nobody waits for the rest
  }
  if (on_vector_) on_vector_(i);
  const bool sized = bf16_ ? size_vector(i % 2 ? kv_->v16[l] : kv_->k16[l], floats_)
                          : size_vector(i % 2 ? kv_->v[l] : kv_->k[l], floats_);
  if (!sized)
    return SF_ERR(kResourceExhausted, "no host memory for the kept KV (" +
                                          std::to_string(2 * n_layers_) + " vectors of " +
                                          std::to_string(floats_) +
                                          (bf16_ ? " bf16 values)" : " floats)"));
  std::lock_guard<std::mutex> lk(mu_);
  ++vectors_sized_[l];
  const int before = sized_layers_;
  while (sized_layers_ < n_layers_ && vectors_sized_[size_t(sized_layers_)] == 2) ++sized_layers_;
  if (sized_layers_ != before) cv_.notify_all();
  return Status::ok();
}

void KvSizer::run() noexcept {
  const auto t0 = std::chrono::steady_clock::now();
  Status st = Status::ok();
  try {
    // Items are taken in index order, so the first layers are sized first.
    st = run_items(size_t(2 * n_layers_), threads_, [this](size_t i) { return size_one(i); });
  } catch (const std::exception& e) {  // run_items' own bookkeeping (no memory for it)
    st = Status(Code::kResourceExhausted, std::string("sizing the kept KV: ") + e.what(),
                __FILE__, __LINE__);
  }
  std::lock_guard<std::mutex> lk(mu_);
  seconds_ = sf::seconds_since(t0);
  status_ = st;
  done_ = true;
  cv_.notify_all();
}

Status KvSizer::wait(int layer) {
  if (!started_) {
    started_ = true;
    run();  // inline, once
  }
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return sized_layers_ > layer || done_; });
  if (sized_layers_ > layer) return Status::ok();
  return status_.is_ok() ? SF_ERR(kInternal, "the KV sizing stopped before layer " +
                                                 std::to_string(layer))
                         : status_;
}

Status KvSizer::finish(double* seconds) {
  if (!started_) {
    started_ = true;
    run();
  }
  if (thread_.joinable()) thread_.join();
  if (seconds) *seconds = seconds_;
  return status_;
}

}  // namespace sf::model
